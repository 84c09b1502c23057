//! What the relay clients (native `ws`, browser `browser`) share about their peers: a peer's data
//! goes either through the relay or over a link of its own (a direct TCP link, a WebRTC data
//! channel, a BroadcastChannel), decided once per peer; how the relay's note that a peer left is
//! taken depends on that; and an abort reaches every peer at once.

use std::sync::atomic::{AtomicBool, Ordering};

use bytes::Bytes;

use super::{Mailbox, Tag, Transport};
use crate::wire::LEFT_CLEANLY;

/// Per peer rank: whether our data with it goes over a link of its own (set once the links are
/// up). Such a peer's clean leave is the end of its link, which comes after its last data on it;
/// the relay's note could overtake that data.
pub struct Linked(Box<[AtomicBool]>);

impl Linked {
    /// No peer linked, in a world of `world` ranks.
    pub fn new(world: usize) -> Linked {
        Linked((0..world).map(|_| AtomicBool::new(false)).collect())
    }

    /// `rank`'s data goes over a link of its own from now on.
    pub fn set(&self, rank: usize) {
        if let Some(l) = self.0.get(rank) {
            l.store(true, Ordering::Release);
        }
    }

    /// Whether `rank`'s data goes over a link of its own.
    pub fn get(&self, rank: usize) -> bool {
        self.0.get(rank).is_some_and(|l| l.load(Ordering::Acquire))
    }
}

/// The relay says `rank` left with `reason`: a clean leave makes receives from it that find
/// nothing fail, except for a linked peer (its link's end says so, after its last data); a lost
/// connection fails everything at once.
pub fn peer_left(mb: &Mailbox, linked: &Linked, rank: u32, reason: &str) {
    let rank = rank as usize;
    if reason != LEFT_CLEANLY {
        mb.peer_lost(rank, reason);
    } else if !linked.get(rank) {
        mb.peer_gone(rank);
    }
}

/// The relay forwards peer `from`'s abort (its control note, which may overtake that peer's data):
/// taken as the abort note on the data path. A `from` that is not another rank of the world
/// (`me` is ours) is ignored.
pub fn peer_aborted(mb: &Mailbox, me: usize, world: usize, from: u32, reason: String) {
    let from = from as usize;
    if from < world && from != me {
        mb.deliver(from, Tag::ABORT, Bytes::from(reason.into_bytes()));
    }
}

/// Abort `t`: our own receives fail first (`local`, this rank's mailbox), then every peer is told
/// at once, so one frozen peer holds the others up for one send wait at most, not one each.
pub async fn abort_all<T: Transport>(t: &T, local: Option<&Mailbox>, reason: &str) {
    if let Some(mb) = local {
        mb.abort_local(reason);
    }
    let note = Bytes::copy_from_slice(reason.as_bytes());
    futures::future::join_all(
        (0..t.world())
            .filter(|&r| r != t.rank())
            .map(|r| t.send(r, Tag::ABORT, note.clone())),
    )
    .await;
}
