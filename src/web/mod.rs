//! The browser side: each tab is a rank.
//!
//! - [`markup`] and the views' markup ([`lesson_view`], [`algorithm_view`]): plain Rust on every
//!   target, so the views are tested natively; a view is a function from data to
//!   [`markup::Markup`].
//! - `page` (wasm32): the rank page of `www/index.html` (room from the URL, compute backend, share link,
//!   lessons, running any collective forward and backward on every tab) and its `window.distgrad`
//!   API, one file per concern.
//!
//! The tab's transport (the relay's WebSocket plus WebRTC data channels, and MessageChannels or
//! BroadcastChannels between tabs of one browser) lives beside the native ones:
//! `crate::transport::browser` (wasm32).

pub mod algorithm_view;
pub mod lesson_view;
pub mod markup;
#[cfg(target_arch = "wasm32")]
pub mod page;

#[cfg(target_arch = "wasm32")]
pub use page::start;
