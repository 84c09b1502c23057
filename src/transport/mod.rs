//! Transports: move bytes between ranks. Nothing here knows about tensors or collectives.
//!
//! A [`Transport`] sends a message to a rank under a [`Tag`] and receives the next message from a rank
//! under a tag; messages between one pair of ranks with one tag arrive in the order they were sent.
//! Incoming messages of every transport land in a [`Mailbox`], the one place that does tag matching,
//! peer loss and abort. Implementations: [`local`] (ranks as threads of one process); natively
//! `ws` (WebSocket through the relay, with `tcp_links`: direct TCP links between native ranks where they can
//! make them); in a browser `browser` (the relay's WebSocket, WebRTC data channels and
//! BroadcastChannels between tabs; its waits sleep on `clock`, which a hidden tab does not
//! stretch). The two relay clients drive one [`session`]: the relay client
//! protocol without sockets (joining, the control messages, how a peer's leave and abort are
//! taken, how ours reaches every peer).

#[cfg(target_arch = "wasm32")]
pub mod browser;
#[cfg(target_arch = "wasm32")]
pub mod clock;
pub mod local;
pub mod mailbox;
pub mod session;
#[cfg(not(target_arch = "wasm32"))]
pub mod tcp_links;
#[cfg(not(target_arch = "wasm32"))]
pub mod ws;

use bytes::Bytes;

use crate::error::Result;
pub use crate::wire::{Channel, Tag};
pub use mailbox::Mailbox;

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
