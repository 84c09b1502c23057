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

/// Bytes one source may have waiting unreceived in a mailbox made by [`Mailbox::new`] (2 GiB).
pub const DEFAULT_MAX_UNRECEIVED: usize = 2 << 30;

#[derive(Default)]
struct Inner {
    queues: HashMap<(usize, Tag), VecDeque<Bytes>>,
    /// Bytes waiting per source.
    held: Vec<usize>,
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
    /// [`DEFAULT_MAX_UNRECEIVED`] unreceived bytes per source.
    pub fn new(rank: usize, world: usize) -> Self {
        Self::with_limit(rank, world, DEFAULT_MAX_UNRECEIVED)
    }

    /// An empty mailbox holding at most `limit` unreceived bytes per source.
    pub fn with_limit(rank: usize, world: usize, limit: usize) -> Self {
        Mailbox {
            rank,
            limit,
            inner: Mutex::new(Inner {
                gone: vec![false; world],
                held: vec![0; world],
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
            let reason = String::from_utf8_lossy(&payload).into_owned();
            inner.poison(Poison::Aborted { by: src, reason });
            return;
        }
        if inner.poison.is_some() {
            // Nothing will receive it.
            return;
        }
        let Some(held) = inner.held.get_mut(src) else {
            return;
        };
        if held.saturating_add(payload.len()) > self.limit {
            let reason = format!(
                "it sent {} bytes that no receive here has taken, above this rank's limit of {} \
                 (messages to tags nobody receives, or a sender far ahead)",
                *held + payload.len(),
                self.limit
            );
            inner.poison(Poison::Lost { peer: src, reason });
            return;
        }
        *held += payload.len();
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
                *h -= msg.len();
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

    /// One source may hold at most the limit unreceived; receiving frees room; past it, every
    /// receive fails naming that source (as a lost peer), and other sources count separately.
    #[test]
    fn unreceived_bytes_are_bounded_per_source() {
        let mb = Mailbox::with_limit(0, 3, 100);
        let msg = |n: usize| Bytes::from(vec![1u8; n]);
        mb.deliver(1, tag(0), msg(60));
        mb.deliver(2, tag(0), msg(90));
        let got = futures::executor::block_on(mb.recv(1, tag(0))).unwrap();
        assert_eq!(got.len(), 60);
        // Room again: 90 more from rank 1 fit.
        mb.deliver(1, tag(1), msg(90));
        assert!(!mb.is_aborted());
        // 11 more do not.
        mb.deliver(1, tag(2), msg(11));
        assert!(mb.is_aborted());
        match futures::executor::block_on(mb.recv(2, tag(0))) {
            Err(Error::PeerLost { peer, reason, .. }) => {
                assert_eq!(peer, 1);
                assert!(
                    reason.contains("101 bytes") && reason.contains("limit of 100"),
                    "{reason}"
                );
            }
            other => panic!("expected PeerLost naming rank 1, got {other:?}"),
        }
    }
}
