//! TURN credentials that expire (the "TURN REST" scheme coturn and others implement with
//! `use-auth-secret`): the relay shares a secret with the TURN server and hands each member, in
//! its `ready`, a username `<expiry>:<room>-<rank>` (expiry in Unix seconds) and the password
//! base64(HMAC-SHA1(secret, username)). The TURN server checks the HMAC and the expiry itself, so a
//! credential copied out of a tab stops working when it expires, and none is handed to a
//! connection before its room is full (not in the `welcome`, which anyone who joins gets).

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use hmac::{Hmac, Mac};
use serde_json::json;

use super::RelayConfig;

/// A TURN server that takes credentials made with a shared secret.
#[derive(Clone)]
pub struct TurnRest {
    /// Its URLs (`turn:host:3478`, `turns:host:5349?transport=tcp`, ...).
    pub urls: Vec<String>,
    /// The secret shared with it (coturn's `static-auth-secret`).
    pub secret: String,
    /// How long a credential lasts from when it is handed out.
    pub ttl: Duration,
}

impl std::fmt::Debug for TurnRest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TurnRest")
            .field("urls", &self.urls)
            .field("secret", &"…")
            .field("ttl", &self.ttl)
            .finish()
    }
}

/// The username and password for `user`, valid until `now_unix + ttl` seconds.
pub fn turn_credential(t: &TurnRest, user: &str, now_unix: u64) -> (String, String) {
    let username = format!("{}:{user}", now_unix.saturating_add(t.ttl.as_secs()));
    let mut mac = <Hmac<sha1::Sha1> as Mac>::new_from_slice(t.secret.as_bytes())
        .expect("HMAC takes a key of any length");
    mac.update(username.as_bytes());
    let password = base64(&mac.finalize().into_bytes());
    (username, password)
}

/// What a member of room `room_id` as `rank` is told in its `ready`: the operator's ICE servers
/// and, with a TURN secret, a TURN server with a fresh credential. `None` when there are none.
pub(super) fn ice_servers_for(
    cfg: &RelayConfig,
    room_id: u64,
    rank: u32,
) -> Option<serde_json::Value> {
    let mut list: Vec<serde_json::Value> = cfg
        .ice_servers
        .as_ref()
        .and_then(|v| v.as_array())
        .cloned()
        .unwrap_or_default();
    if let Some(t) = &cfg.turn {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let (username, credential) = turn_credential(t, &format!("r{room_id}-{rank}"), now);
        list.push(json!({ "urls": t.urls, "username": username, "credential": credential }));
    }
    (!list.is_empty()).then_some(serde_json::Value::Array(list))
}

/// Standard base64 with padding.
fn base64(bytes: &[u8]) -> String {
    const ABC: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let b = [
            chunk[0],
            *chunk.get(1).unwrap_or(&0),
            *chunk.get(2).unwrap_or(&0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for (i, shift) in [18, 12, 6, 0].into_iter().enumerate() {
            if i <= chunk.len() {
                out.push(ABC[((n >> shift) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Expected values from Python's `hmac` and `base64` modules (not from this code):
    /// `base64.b64encode(hmac.new(b'north-wind-secret', b'1700003600:r7-2', hashlib.sha1).digest())`.
    #[test]
    fn credentials_follow_the_turn_rest_scheme() {
        let t = TurnRest {
            urls: vec!["turn:turn.example.org:3478".into()],
            secret: "north-wind-secret".into(),
            ttl: Duration::from_secs(3600),
        };
        let (user, pass) = turn_credential(&t, "r7-2", 1_700_000_000);
        assert_eq!(user, "1700003600:r7-2");
        assert_eq!(pass, "LJLZDJiE6SLLzh0ezmgW6Ch3dwM=");
        for (raw, enc) in [
            ("f", "Zg=="),
            ("fo", "Zm8="),
            ("foo", "Zm9v"),
            ("foob", "Zm9vYg=="),
        ] {
            assert_eq!(base64(raw.as_bytes()), enc);
        }
        assert!(
            !format!("{t:?}").contains("north-wind"),
            "the secret is not printed"
        );
    }
}
