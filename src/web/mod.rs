//! The browser side (wasm32 only): each tab is a rank.
//!
//! - [`net`]: the browser [`crate::transport::Transport`]: the relay's WebSocket plus a mesh of
//!   WebRTC data channels signaled through it, falling back to the relay per pair.
//! - [`page`]: the rank page of `www/index.html` (room from the URL, compute backend, share link,
//!   running any collective forward and backward on every tab) and its `window.distgrad` API.

pub mod net;
pub mod page;

pub use page::start;
