//! Transports: move bytes between ranks. Nothing here knows about tensors or collectives.
//!
//! A [`Transport`] sends a message to a rank under a [`Tag`] and receives the next message from a rank
//! under a tag; messages between one pair of ranks with one tag arrive in the order they were sent.
//! Incoming messages of every transport land in a [`Mailbox`], the one place that does tag matching,
//! peer loss and abort. Implementations: [`local`] (ranks as threads of one process) and, natively, `ws`
//! (WebSocket through the relay, with `direct` TCP links between native ranks where they can make
//! them).

#[cfg(not(target_arch = "wasm32"))]
pub mod direct;
pub mod local;
pub mod mailbox;
#[cfg(not(target_arch = "wasm32"))]
pub mod ws;

use bytes::Bytes;

use crate::error::Result;
pub use mailbox::Mailbox;

/// Which stream of a call a message belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(u8)]
pub enum Channel {
    /// Payload of a collective (chunks, tensors).
    Data = 0,
    /// A collective's call signature, sent to the successor in the group ring.
    Sig = 1,
    /// Point-to-point send/recv; `seq` counts the messages of one ordered pair of ranks.
    P2p = 2,
    /// The sender aborts: every pending and later receive fails. `group`/`seq` are ignored.
    Abort = 3,
}

impl Channel {
    /// Decode from the wire.
    pub fn from_u8(x: u8) -> Option<Self> {
        match x {
            0 => Some(Channel::Data),
            1 => Some(Channel::Sig),
            2 => Some(Channel::P2p),
            3 => Some(Channel::Abort),
            _ => None,
        }
    }
}

/// What a message is matched on (besides its source rank).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Tag {
    /// Group id (see [`crate::collective::Group`]).
    pub group: u32,
    /// Sequence number of the call within the group (or of the p2p message within the pair).
    pub seq: u64,
    /// The stream.
    pub channel: Channel,
}

impl Tag {
    /// The tag of abort messages.
    pub const ABORT: Tag = Tag {
        group: 0,
        seq: 0,
        channel: Channel::Abort,
    };
}

/// Async, tag-matched, ordered delivery of byte messages between the ranks of one world.
///
/// Futures are not required to be `Send`: in a browser nothing is. Native code runs one rank per
/// thread (or task on a local executor).
#[allow(async_fn_in_trait)] // deliberately no `Send` bound on the futures (browser futures are not Send)
pub trait Transport {
    /// This rank, `0..world`.
    fn rank(&self) -> usize;
    /// Number of ranks.
    fn world(&self) -> usize;
    /// Send `payload` to `dst` under `tag`. May return before the peer has received it.
    async fn send(&self, dst: usize, tag: Tag, payload: Bytes) -> Result<()>;
    /// The next message from `src` under `tag`. Waits without bound: callers add timeouts.
    async fn recv(&self, src: usize, tag: Tag) -> Result<Bytes>;
    /// Fail every pending and later receive here, and tell every peer (best effort) with `reason`.
    async fn abort(&self, reason: &str);
    /// Whether a sent payload reaches its receiver without a copy (ranks share memory), so that
    /// algorithms may send one buffer to many ranks for free. Default: no.
    fn shares_memory(&self) -> bool {
        false
    }
}
