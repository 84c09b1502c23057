//! The browser side (wasm32 only): each tab is a rank.
//!
//! - [`page`]: the rank page of `www/index.html` (room from the URL, compute backend, share link,
//!   lessons, running any collective forward and backward on every tab) and its `window.distgrad`
//!   API, one file per concern.
//!
//! The tab's transport (the relay's WebSocket plus WebRTC data channels, and MessageChannels or
//! BroadcastChannels between tabs of one browser) lives beside the native ones:
//! [`crate::transport::browser`].

pub mod page;

pub use page::start;
