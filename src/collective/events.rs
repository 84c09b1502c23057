//! What each rank did in a collective call, recorded where it happened: every message it sent
//! and received (peer, payload bytes, the bytes the transport carried, which chunk of which
//! tensor, the round), what it reduced and assembled locally, and when (microseconds since the
//! call began on this rank). On only when asked ([`super::CommOptions::record_events`]); off, a
//! call keeps no record and each message costs one branch.
//!
//! A call's events are one [`CallRecord`]; a communicator keeps them until taken
//! ([`super::P2p::take_events`]). The teaching page draws the algorithm from them and `distgrad
//! run --events` prints them; the tests hold them against each algorithm's theory (rounds, bytes
//! per rank, messages) and against the bytes the transport really moved.

use std::cell::{Cell, RefCell};

use serde::{Deserialize, Serialize};

/// The algorithm a call's data took.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Algorithm {
    /// Around the ring: each rank sends to its successor and receives from its predecessor.
    Ring,
    /// A binomial tree rooted at the collective's root: `ceil(log2 n)` rounds.
    Tree,
    /// Every rank sends straight to every rank that needs its data: one round.
    Exchange,
    /// Through group rank 0 and back: two rounds, `2(n-1)` messages.
    Star,
    /// Each rank owns one chunk: reduced by its owner, then sent to every rank.
    Pairwise,
    /// [`Algorithm::Pairwise`], the result assembled once by group rank 0 and shared.
    Shared,
    /// Straight from source to destination (gather, scatter, all_to_all, permute, barrier).
    Direct,
    /// One point-to-point message (`send` / `recv`).
    PointToPoint,
}

impl Algorithm {
    /// Every algorithm, in the order the views list them.
    pub const ALL: [Algorithm; 8] = [
        Algorithm::Ring,
        Algorithm::Pairwise,
        Algorithm::Shared,
        Algorithm::Exchange,
        Algorithm::Star,
        Algorithm::Tree,
        Algorithm::Direct,
        Algorithm::PointToPoint,
    ];

    /// Parse an [`Algorithm::name`].
    pub fn parse(s: &str) -> crate::error::Result<Algorithm> {
        Algorithm::ALL
            .into_iter()
            .find(|a| a.name() == s)
            .ok_or_else(|| {
                let names: Vec<&str> = Algorithm::ALL.iter().map(|a| a.name()).collect();
                crate::error::Error::Input(format!(
                    "unknown algorithm {s:?} (one of {})",
                    names.join(", ")
                ))
            })
    }

    /// Lower-case name, as in JSON.
    pub fn name(self) -> &'static str {
        match self {
            Algorithm::Ring => "ring",
            Algorithm::Tree => "tree",
            Algorithm::Exchange => "exchange",
            Algorithm::Star => "star",
            Algorithm::Pairwise => "pairwise",
            Algorithm::Shared => "shared",
            Algorithm::Direct => "direct",
            Algorithm::PointToPoint => "point_to_point",
        }
    }
}

/// What a rank did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Action {
    /// Sent the call's signature alone to its ring successor (no payload; the signature goes
    /// with the first small message to the successor where there is one).
    Announce,
    /// Sent a payload to `peer`.
    Send,
    /// Received a payload from `peer`.
    Recv,
    /// Folded a received contribution (or several) into a partial result.
    Reduce,
    /// Copied finished data into the result.
    Copy,
}

/// The data a message or local step concerns: `len` elements from `start` of a tensor, which is
/// chunk `index` of `of` where the algorithm splits it (`of` = 1: it does not), and entry
/// `entry` of a list where the collective takes or makes one. A message's chunk is named the same
/// on both sides: the list collectives name the entry as the collective indexes its list: by
/// destination for scatter, reduce_scatter and all_to_all (and all_to_all_single's pieces, as if
/// its splits were a list), by source for gather and all_gather.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Chunk {
    /// Which entry of a list (`None`: a single tensor).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub entry: Option<u32>,
    /// Chunk number within the algorithm's split of the tensor.
    pub index: u32,
    /// How many chunks the algorithm splits the tensor into (1: it does not).
    pub of: u32,
    /// First element.
    pub start: u64,
    /// Number of elements.
    pub len: u64,
}

impl Chunk {
    /// The whole of a single tensor of `numel` elements.
    pub fn whole(numel: usize) -> Chunk {
        Chunk {
            entry: None,
            index: 0,
            of: 1,
            start: 0,
            len: numel as u64,
        }
    }

    /// The whole of entry `entry` (of `numel` elements) of a list.
    pub fn entry(entry: usize, numel: usize) -> Chunk {
        Chunk {
            entry: Some(entry as u32),
            ..Chunk::whole(numel)
        }
    }

    /// Chunk `index` of `of`: `len` elements from `start` of a single tensor.
    pub fn part(index: usize, of: usize, start: usize, len: usize) -> Chunk {
        Chunk {
            entry: None,
            index: index as u32,
            of: of as u32,
            start: start as u64,
            len: len as u64,
        }
    }

    /// As the views print it: `chunk 1/3 [2..4)`, `[2]` (a list entry), empty for a whole
    /// single tensor.
    pub fn label(&self) -> String {
        let mut s = self.entry.map_or(String::new(), |e| format!("[{e}]"));
        if self.of > 1 {
            s.push_str(&format!(
                "chunk {}/{} [{}..{})",
                self.index,
                self.of,
                self.start,
                self.start + self.len
            ));
        }
        s
    }
}

/// One thing a rank did in a call.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CommEvent {
    /// The algorithm's round (0-based; the ring's steps, the tree's levels).
    pub round: u32,
    /// What happened.
    pub action: Action,
    /// The other rank (global) of a message; `None` for a local step.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peer: Option<usize>,
    /// Payload bytes sent, received, reduced or copied: what the algorithm handed to the call (a
    /// tensor's shape header included where one travels: scatter, all_to_all, send), without
    /// the call's signature.
    pub bytes: u64,
    /// Bytes handed to the transport for a sent message, signatures and headers included
    /// (0 on the receiving side and for local steps).
    #[serde(default)]
    pub wire_bytes: u64,
    /// Transport messages a send took (a large payload to a non-successor goes as two: its
    /// signature, then the payload untouched).
    #[serde(default)]
    pub messages: u32,
    /// The data it concerns, where it is part of a tensor.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub chunk: Option<Chunk>,
    /// Part of the confirmation round that ends some collectives (every rank learns of a
    /// mismatch anywhere before it returns), not of the algorithm.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub confirm: bool,
    /// Microseconds since the call began on this rank.
    pub t_us: f64,
}

/// One rank's record of one call.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CallRecord {
    /// The rank that recorded it (global).
    pub rank: usize,
    /// Its rank in the call's group.
    pub group_rank: usize,
    /// The group's id (0: the world).
    pub group: u32,
    /// The group's ranks (global).
    pub members: Vec<usize>,
    /// The call's number in its group (point-to-point messages count per pair of ranks).
    pub call: u64,
    /// The collective with its op and root: `all_reduce(op=sum)`, `broadcast(root=2)`.
    pub collective: String,
    /// The shape its signature names (the input's, or a list entry's), where it names one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shape: Option<Vec<usize>>,
    /// The algorithm its data took.
    pub algorithm: Algorithm,
    /// What this rank did, in order.
    pub events: Vec<CommEvent>,
    /// Microseconds from the call's beginning to its end on this rank.
    pub total_us: f64,
}

impl CallRecord {
    /// An empty record of call `seq` of `group` with signature `sig`, made by group rank `me`,
    /// its data taking `algorithm`.
    pub(crate) fn head(
        group: &super::Group,
        (me, seq): (usize, u64),
        sig: &super::CallSig,
        algorithm: Algorithm,
    ) -> CallRecord {
        CallRecord {
            rank: group.global(me),
            group_rank: me,
            group: group.id(),
            members: group.ranks().to_vec(),
            call: seq,
            collective: sig.short(),
            shape: sig.shape.clone(),
            algorithm,
            events: Vec::new(),
            total_us: 0.0,
        }
    }

    /// The payload bytes this rank sent.
    pub fn sent_bytes(&self) -> u64 {
        self.of(Action::Send).map(|e| e.bytes).sum()
    }

    /// The events of one kind.
    pub fn of(&self, action: Action) -> impl Iterator<Item = &CommEvent> {
        self.events.iter().filter(move |e| e.action == action)
    }

    /// The number of rounds the algorithm's messages took on this rank (the confirmation round
    /// not counted): one more than the last round it sent or received in, 0 without messages.
    pub fn rounds(&self) -> u32 {
        self.events
            .iter()
            .filter(|e| !e.confirm && matches!(e.action, Action::Send | Action::Recv))
            .map(|e| e.round + 1)
            .max()
            .unwrap_or(0)
    }
}

/// Milliseconds on a clock that only goes forward (its origin is arbitrary).
#[cfg(not(target_arch = "wasm32"))]
pub(crate) fn clock_ms() -> f64 {
    static ORIGIN: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
    ORIGIN
        .get_or_init(std::time::Instant::now)
        .elapsed()
        .as_secs_f64()
        * 1e3
}

/// Milliseconds on a clock that only goes forward: the page's `performance.now()` (the wall
/// clock where there is no page).
#[cfg(target_arch = "wasm32")]
pub(crate) fn clock_ms() -> f64 {
    web_sys::window()
        .and_then(|w| w.performance())
        .map_or_else(js_sys::Date::now, |p| p.now())
}

/// A call's record in the making (inside [`super::call::Call`]): where the algorithm is (round,
/// the chunks it sends and receives, whether it is confirming) and what it did.
#[derive(Debug)]
pub(crate) struct Recorder {
    began_ms: f64,
    round: Cell<u32>,
    sent: Cell<Option<Chunk>>,
    received: Cell<Option<Chunk>>,
    confirm: Cell<bool>,
    record: RefCell<CallRecord>,
}

impl Recorder {
    /// Start recording a call (the clock starts now).
    pub(crate) fn new(head: CallRecord) -> Recorder {
        Recorder {
            began_ms: clock_ms(),
            round: Cell::new(0),
            sent: Cell::new(None),
            received: Cell::new(None),
            confirm: Cell::new(false),
            record: RefCell::new(head),
        }
    }

    /// The round, and the chunks sent and received, of the messages that follow.
    pub(crate) fn at(&self, round: u32, sent: Option<Chunk>, received: Option<Chunk>) {
        self.round.set(round);
        self.sent.set(sent);
        self.received.set(received);
    }

    /// The messages that follow belong to the confirmation round(s).
    pub(crate) fn confirming(&self) {
        self.confirm.set(true);
        self.at(0, None, None);
    }

    /// The last message received carried `chunk`.
    pub(crate) fn received_as(&self, chunk: Chunk) {
        let mut r = self.record.borrow_mut();
        if let Some(e) = r.events.iter_mut().rev().find(|e| e.action == Action::Recv) {
            e.chunk = Some(chunk);
        }
    }

    fn push(&self, action: Action, peer: Option<usize>, bytes: usize, wire: usize, messages: u32) {
        let chunk = match action {
            Action::Send => self.sent.get(),
            Action::Recv => self.received.get(),
            Action::Announce | Action::Reduce | Action::Copy => None,
        };
        let e = CommEvent {
            round: self.round.get(),
            action,
            peer,
            bytes: bytes as u64,
            wire_bytes: wire as u64,
            messages,
            chunk,
            confirm: self.confirm.get(),
            t_us: (clock_ms() - self.began_ms) * 1e3,
        };
        self.record.borrow_mut().events.push(e);
    }

    /// Record a message (`Announce`, `Send`, `Recv`) to or from global rank `peer`: `bytes` of
    /// payload, `wire` bytes in `messages` transport messages (sends only).
    pub(crate) fn message(
        &self,
        action: Action,
        peer: usize,
        bytes: usize,
        wire: usize,
        messages: u32,
    ) {
        self.push(action, Some(peer), bytes, wire, messages);
    }

    /// Record a local step on `chunk` at the current round.
    pub(crate) fn local(&self, action: Action, chunk: Chunk) {
        self.push(action, None, chunk.len as usize * 4, 0, 0);
        if let Some(e) = self.record.borrow_mut().events.last_mut() {
            e.chunk = Some(chunk);
        }
    }

    /// The finished record.
    pub(crate) fn finish(self) -> CallRecord {
        let mut r = self.record.into_inner();
        r.total_us = (clock_ms() - self.began_ms) * 1e3;
        r
    }
}
