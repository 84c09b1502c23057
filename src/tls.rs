//! TLS for the relay's HTTPS / `wss://` and for members reaching such a relay: the one crypto
//! provider both use.

use std::sync::Arc;

/// rustls with *ring*: it builds with a plain C compiler in seconds on every platform we build
/// for. rustls 0.23.48 marks it deprecated because it offers no post-quantum key exchange (its
/// `aws-lc-rs` provider does, at the cost of a much heavier build); classical TLS 1.2/1.3 is
/// what browsers and proxies negotiate with it.
#[allow(deprecated)]
pub fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}
