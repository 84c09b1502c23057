//! Tag matching for every transport: incoming messages are delivered here by whatever reads the wire
//! (a sender thread in-process, a socket reader natively, an `onmessage` callback in a browser), and
//! receivers wait here for the next message of one (source, tag).
//!
//! What one source has delivered and no receive has taken yet is bounded
//! ([`Mailbox::with_limit`], [`DEFAULT_MAX_UNRECEIVED`]): a peer sending to tags nobody receives
//! cannot grow this rank's memory without end; past the bound the mailbox fails as if that peer
//! were lost, naming it.

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::pin::Pin;
use std::sync::Mutex;
use std::task::{Context, Poll, Waker};

use bytes::Bytes;

use super::{Channel, Tag};
use crate::error::{Error, Result};

/// Bytes one source may have waiting unreceived in a native mailbox made by [`Mailbox::new`]
/// (2 GiB).
pub const DEFAULT_MAX_UNRECEIVED: usize = 2 << 30;

/// Bytes all sources together may have waiting unreceived in a browser tab (just under 1 GiB:
/// wasm32 has 4 GiB of address space, and the tab holds its tensors too); each source gets an
/// equal share ([`default_max_unreceived`]).
pub const TAB_MAX_UNRECEIVED: usize = (1 << 30) - (1 << 20);

/// What each queued message costs against its source's bound besides its payload: the queue
/// entry and, for a new tag, the queue itself. An empty message is not free.
pub const ENTRY_COST: usize = 64;

/// Most messages one source may have waiting unreceived, whatever their size.
pub const MAX_ENTRIES_PER_SOURCE: usize = 1 << 16;

/// The default bound of one source's unreceived bytes in a world of `world` ranks: natively
/// [`DEFAULT_MAX_UNRECEIVED`]; in a browser tab (`in_tab`) an equal share of
/// [`TAB_MAX_UNRECEIVED`] among the other ranks, so that all of them together stay under it
/// (16 MiB each at 64 ranks).
pub fn default_max_unreceived(world: usize, in_tab: bool) -> usize {
    if in_tab {
        TAB_MAX_UNRECEIVED / world.saturating_sub(1).max(1)
    } else {
        DEFAULT_MAX_UNRECEIVED
    }
}

#[derive(Default)]
struct Inner {
    queues: HashMap<(usize, Tag), VecDeque<Bytes>>,
    /// Bytes waiting per source (payloads plus [`ENTRY_COST`] each).
    held: Vec<usize>,
    /// Messages waiting per source.
    entries: Vec<usize>,
    waiters: HashMap<(usize, Tag), Waker>,
    gone: Vec<bool>,
    poison: Option<Poison>,
}

/// Why every receive fails from now on.
enum Poison {
    /// A rank aborted (this one or a peer) with a reason.
    Aborted { by: usize, reason: String },
    /// A peer's connection was lost (not a clean leave).
    Lost { peer: usize, reason: String },
}

impl Inner {
    /// The first poison wins; wake every waiter so it sees it.
    fn poison(&mut self, p: Poison) {
        if self.poison.is_none() {
            self.poison = Some(p);
        }
        for (_, w) in self.waiters.drain() {
            w.wake();
        }
    }
}

/// The incoming side of one rank: per-(source, tag) FIFO queues plus the peer-lost and abort state.
pub struct Mailbox {
    rank: usize,
    /// Most bytes one source may have waiting unreceived.
    limit: usize,
    inner: Mutex<Inner>,
}

impl Mailbox {
    /// An empty mailbox for `rank` in a world of `world` ranks, holding at most
    /// [`default_max_unreceived`] unreceived bytes per source (a tab's share on wasm32).
    pub fn new(rank: usize, world: usize) -> Self {
        let limit = default_max_unreceived(world, cfg!(target_arch = "wasm32"));
        Self::with_limit(rank, world, limit)
    }

    /// An empty mailbox holding at most `limit` unreceived bytes per source.
    pub fn with_limit(rank: usize, world: usize, limit: usize) -> Self {
        Mailbox {
            rank,
            limit,
            inner: Mutex::new(Inner {
                gone: vec![false; world],
                held: vec![0; world],
                entries: vec![0; world],
                ..Inner::default()
            }),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        // A panic while holding this lock cannot leave the maps inconsistent (no multi-step edits).
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A message arrived from `src`. Abort messages poison the mailbox (payload = UTF-8 reason);
    /// a message that takes `src` past the unreceived-bytes limit poisons it as a lost peer.
    pub fn deliver(&self, src: usize, tag: Tag, payload: Bytes) {
        let mut inner = self.lock();
        if tag.channel == Channel::Abort {
            // A peer's reason is cut as its sender should have cut it.
            let reason = crate::wire::clip(
                &String::from_utf8_lossy(&payload),
                crate::wire::MAX_ABORT_REASON,
            );
            inner.poison(Poison::Aborted { by: src, reason });
            return;
        }
        if inner.poison.is_some() {
            // Nothing will receive it.
            return;
        }
        let (Some(&held), Some(&entries)) = (inner.held.get(src), inner.entries.get(src)) else {
            return;
        };
        let cost = payload.len().saturating_add(ENTRY_COST);
        let over = if held.saturating_add(cost) > self.limit {
            Some(format!(
                "it sent {} bytes that no receive here has taken ({ENTRY_COST} per message \
                 counted besides its payload), above this rank's limit of {}",
                held.saturating_add(cost),
                self.limit
            ))
        } else if entries >= MAX_ENTRIES_PER_SOURCE {
            Some(format!(
                "it sent {} messages that no receive here has taken, above this rank's limit \
                 of {MAX_ENTRIES_PER_SOURCE}",
                entries + 1
            ))
        } else {
            None
        };
        if let Some(why) = over {
            let reason = format!("{why} (messages to tags nobody receives, or a sender far ahead)");
            inner.poison(Poison::Lost { peer: src, reason });
            return;
        }
        inner.held[src] = held + cost;
        inner.entries[src] = entries + 1;
        inner
            .queues
            .entry((src, tag))
            .or_default()
            .push_back(payload);
        if let Some(w) = inner.waiters.remove(&(src, tag)) {
            w.wake();
        }
    }

    /// `src` has left: receives from it that find no queued message fail with [`Error::PeerLost`].
    pub fn peer_gone(&self, src: usize) {
        let mut inner = self.lock();
        if let Some(g) = inner.gone.get_mut(src) {
            *g = true;
        }
        let keys: Vec<_> = inner
            .waiters
            .keys()
            .filter(|(s, _)| *s == src)
            .copied()
            .collect();
        for k in keys {
            if let Some(w) = inner.waiters.remove(&k) {
                w.wake();
            }
        }
    }

    /// `src`'s connection was lost (it did not leave cleanly): every pending and later receive
    /// fails with [`Error::PeerLost`] naming it, since any collective may be waiting on it indirectly.
    pub fn peer_lost(&self, src: usize, reason: &str) {
        let mut inner = self.lock();
        if let Some(g) = inner.gone.get_mut(src) {
            *g = true;
        }
        inner.poison(Poison::Lost {
            peer: src,
            reason: reason.to_string(),
        });
    }

    /// A peer's abort (as [`Mailbox::deliver`] of an abort message), but the receives it fails
    /// are not woken yet: their wakers are returned. A transport that reaches every mailbox at
    /// once (the in-process one) poisons them all before it wakes any.
    pub fn abort_deferred(&self, src: usize, reason: &str) -> Vec<std::task::Waker> {
        let mut inner = self.lock();
        if inner.poison.is_none() {
            inner.poison = Some(Poison::Aborted {
                by: src,
                reason: reason.to_string(),
            });
        }
        inner.waiters.drain().map(|(_, w)| w).collect()
    }

    /// Poison this mailbox locally (this rank aborts): every pending and later receive fails.
    pub fn abort_local(&self, reason: &str) {
        self.deliver(
            self.rank,
            Tag::ABORT,
            Bytes::copy_from_slice(reason.as_bytes()),
        );
    }

    /// Whether an abort or a lost peer was seen.
    pub fn is_aborted(&self) -> bool {
        self.lock().poison.is_some()
    }

    /// Wait for the next message from `src` under `tag`.
    pub fn recv(&self, src: usize, tag: Tag) -> Recv<'_> {
        Recv {
            mailbox: self,
            key: (src, tag),
        }
    }
}

/// Future of [`Mailbox::recv`]. Dropping it consumes nothing.
pub struct Recv<'a> {
    mailbox: &'a Mailbox,
    key: (usize, Tag),
}

impl Future for Recv<'_> {
    type Output = Result<Bytes>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mb = self.mailbox;
        let mut inner = mb.lock();
        match &inner.poison {
            Some(Poison::Aborted { by, reason }) => {
                return Poll::Ready(Err(Error::Aborted {
                    rank: mb.rank,
                    by: *by,
                    reason: reason.clone(),
                }));
            }
            Some(Poison::Lost { peer, reason }) => {
                return Poll::Ready(Err(Error::PeerLost {
                    rank: mb.rank,
                    peer: *peer,
                    call: String::new(),
                    reason: reason.clone(),
                }));
            }
            None => {}
        }
        if let Some(q) = inner.queues.get_mut(&self.key)
            && let Some(msg) = q.pop_front()
        {
            if q.is_empty() {
                inner.queues.remove(&self.key);
            }
            if let Some(h) = inner.held.get_mut(self.key.0) {
                *h -= msg.len() + ENTRY_COST;
            }
            if let Some(e) = inner.entries.get_mut(self.key.0) {
                *e -= 1;
            }
            return Poll::Ready(Ok(msg));
        }
        let src = self.key.0;
        if inner.gone.get(src).copied().unwrap_or(true) {
            return Poll::Ready(Err(Error::PeerLost {
                rank: mb.rank,
                peer: src,
                call: String::new(),
                reason: String::new(),
            }));
        }
        inner.waiters.insert(self.key, cx.waker().clone());
        Poll::Pending
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tag(seq: u64) -> Tag {
        Tag {
            channel: Channel::P2p,
            group: 0,
            seq,
        }
    }

    /// One source may hold at most the limit unreceived (payloads plus [`ENTRY_COST`] per
    /// message); receiving frees room; past it, every receive fails naming that source (as a
    /// lost peer), and other sources count separately.
    #[test]
    fn unreceived_bytes_are_bounded_per_source() {
        let limit = 100 + 2 * ENTRY_COST;
        let mb = Mailbox::with_limit(0, 3, limit);
        let msg = |n: usize| Bytes::from(vec![1u8; n]);
        mb.deliver(1, tag(0), msg(60));
        mb.deliver(2, tag(0), msg(90));
        let got = futures::executor::block_on(mb.recv(1, tag(0))).unwrap();
        assert_eq!(got.len(), 60);
        // Room again: 90 more from rank 1 fit, and 10 more with their entry.
        mb.deliver(1, tag(1), msg(90));
        mb.deliver(1, tag(2), msg(10));
        assert!(!mb.is_aborted());
        // One byte more does not.
        mb.deliver(1, tag(3), msg(1));
        assert!(mb.is_aborted());
        match futures::executor::block_on(mb.recv(2, tag(0))) {
            Err(Error::PeerLost { peer, reason, .. }) => {
                assert_eq!(peer, 1);
                let want = format!("{} bytes", 101 + 3 * ENTRY_COST);
                assert!(
                    reason.contains(&want) && reason.contains(&format!("limit of {limit}")),
                    "{reason}"
                );
            }
            other => panic!("expected PeerLost naming rank 1, got {other:?}"),
        }
    }

    /// Empty messages are charged (#40 item 3): a peer sending 0-byte messages to sequence
    /// numbers 0, 1, 2, ... is cut off at its byte bound (before: never, until this rank ran out
    /// of memory), and at [`MAX_ENTRIES_PER_SOURCE`] messages whatever the byte bound.
    #[test]
    fn empty_messages_are_charged_and_counted() {
        let limit = 1 << 20;
        let mb = Mailbox::with_limit(0, 2, limit);
        let mut sent = 0;
        while !mb.is_aborted() && sent < 10 * limit {
            mb.deliver(1, tag(sent as u64), Bytes::new());
            sent += 1;
        }
        assert_eq!(sent, limit / ENTRY_COST + 1, "cut off at the byte bound");
        let mb = Mailbox::with_limit(0, 2, usize::MAX / 2);
        let mut sent = 0;
        while !mb.is_aborted() && sent < 4 * MAX_ENTRIES_PER_SOURCE {
            mb.deliver(1, tag(sent as u64), Bytes::new());
            sent += 1;
        }
        assert_eq!(
            sent,
            MAX_ENTRIES_PER_SOURCE + 1,
            "cut off at the message count"
        );
        match futures::executor::block_on(mb.recv(1, tag(0))) {
            Err(Error::PeerLost {
                peer: 1, reason, ..
            }) => {
                assert!(reason.contains("messages that no receive"), "{reason}");
            }
            other => panic!("expected PeerLost naming rank 1, got {other:?}"),
        }
    }

    /// In a tab, the default bounds of all 63 peers of a 64-rank room together stay under
    /// 1 GiB (before: 2 GiB per source); natively the bound stays 2 GiB per source.
    #[test]
    fn a_tabs_default_bounds_stay_under_a_gib_together() {
        // Every world a room may have (`program::MAX_WORLD`, 64; named by value: the transport
        // layer sits below programs).
        for world in 1..=64 {
            let each = default_max_unreceived(world, true);
            let total = each * world.saturating_sub(1);
            assert!(total < 1 << 30, "world {world}: {total} bytes");
            assert!(each >= 16 << 20, "world {world}: {each} bytes per source");
        }
        assert_eq!(default_max_unreceived(64, false), 2 << 30);
    }
}
