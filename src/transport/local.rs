//! In-process transport: N ranks as threads (or tasks) of one process, delivering straight into each
//! other's [`Mailbox`]. Payloads move by reference count, so sending a chunk of a CPU tensor copies
//! nothing.

use std::sync::{Arc, Mutex};

use bytes::Bytes;

use super::{Mailbox, Tag, Transport};
use crate::error::{Error, Result};

/// One rank's end of an in-process world. Dropping it tells every peer this rank is gone.
pub struct LocalTransport {
    rank: usize,
    boxes: Arc<Vec<Mailbox>>,
    /// Held while an abort poisons every mailbox and while a leaving rank marks itself gone in
    /// them, so that no rank can see a peer leave, aborted, before it sees the abort.
    world_lock: Arc<Mutex<()>>,
}

impl LocalTransport {
    /// The transports of a world of `world` ranks, index = rank.
    pub fn world(world: usize) -> Vec<LocalTransport> {
        let boxes = Arc::new(
            (0..world)
                .map(|r| Mailbox::new(r, world))
                .collect::<Vec<_>>(),
        );
        let world_lock = Arc::new(Mutex::new(()));
        (0..world)
            .map(|rank| LocalTransport {
                rank,
                boxes: boxes.clone(),
                world_lock: world_lock.clone(),
            })
            .collect()
    }
}

impl Drop for LocalTransport {
    fn drop(&mut self) {
        let _world = self.world_lock.lock().unwrap_or_else(|e| e.into_inner());
        for (r, b) in self.boxes.iter().enumerate() {
            if r != self.rank {
                b.peer_gone(self.rank);
            }
        }
    }
}

impl Transport for LocalTransport {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.boxes.len()
    }

    async fn send(&self, dst: usize, tag: Tag, payload: Bytes) -> Result<()> {
        let mb = self.boxes.get(dst).ok_or_else(|| Error::Transport {
            rank: self.rank,
            detail: format!("send to rank {dst} outside world of {}", self.boxes.len()),
        })?;
        mb.deliver(self.rank, tag, payload);
        Ok(())
    }

    async fn recv(&self, src: usize, tag: Tag) -> Result<Bytes> {
        if src >= self.boxes.len() {
            return Err(Error::Transport {
                rank: self.rank,
                detail: format!("recv from rank {src} outside world of {}", self.boxes.len()),
            });
        }
        self.boxes[self.rank].recv(src, tag).await
    }

    async fn abort(&self, reason: &str) {
        let reason = &crate::wire::clip(reason, crate::wire::MAX_ABORT_REASON);
        // Every peer's mailbox is poisoned before any peer is woken, and under the world's lock:
        // a rank told first may fail, return and drop its transport at once (a running one need
        // not be woken), and a rank not yet told must not see that leave (a lost peer) instead of
        // the abort.
        let mut wake = Vec::new();
        {
            let _world = self.world_lock.lock().unwrap_or_else(|e| e.into_inner());
            for (r, b) in self.boxes.iter().enumerate() {
                if r != self.rank {
                    wake.extend(b.abort_deferred(self.rank, reason));
                }
            }
            self.boxes[self.rank].abort_local(reason);
        }
        for w in wake {
            w.wake();
        }
    }

    fn shares_memory(&self) -> bool {
        true
    }
}
