//! Who may use the relay, and how much of it: connections counted per source address
//! ([`addr_bucket`]) and in all ([`AddrSlot`]), the default connection cap below the file limit,
//! room tokens chosen by clients, and browser origins.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Arc;

use super::{Refusal, RelayConfig, Shared};

/// Connections open: per source address ([`addr_bucket`]) and in all.
#[derive(Default)]
pub(super) struct ConnCount {
    per_addr: HashMap<IpAddr, usize>,
    total: usize,
}

impl ConnCount {
    /// Connections open in all.
    pub(super) fn total(&self) -> usize {
        self.total
    }

    /// Addresses with connections open.
    pub(super) fn addresses(&self) -> usize {
        self.per_addr.len()
    }
}

/// One open connection counted against its source address and the relay's total (uncounted when
/// dropped). A connection from a trusted proxy counts in the total only; the client it forwards is
/// counted against its own address once its request names it ([`AddrSlot::take_forwarded`]).
pub(super) struct AddrSlot {
    shared: Arc<Shared>,
    /// The address counted against, if any.
    ip: Option<IpAddr>,
    /// Counted in the relay's total.
    total: bool,
}

impl AddrSlot {
    /// Count a new connection from `ip`, or say why it is refused (the relay or the address is
    /// at its cap).
    pub(super) fn take(shared: &Arc<Shared>, ip: IpAddr) -> Result<AddrSlot, Refusal> {
        let proxy = shared.cfg.trusted_proxies.contains(&ip.to_canonical());
        let ip = (!proxy).then(|| addr_bucket(ip));
        AddrSlot::count(shared, ip, true)
    }

    /// Count a connection forwarded by a trusted proxy against the client's address `ip` (its
    /// place in the total is the proxy connection's).
    pub(super) fn take_forwarded(shared: &Arc<Shared>, ip: IpAddr) -> Result<AddrSlot, Refusal> {
        AddrSlot::count(shared, Some(addr_bucket(ip)), false)
    }

    fn count(shared: &Arc<Shared>, ip: Option<IpAddr>, total: bool) -> Result<AddrSlot, Refusal> {
        let mut conns = shared.addr_conns.lock().unwrap_or_else(|e| e.into_inner());
        if total && conns.total >= shared.cfg.max_conns {
            return Err(Refusal::RelayBusy { open: conns.total });
        }
        if let Some(ip) = ip {
            let n = conns.per_addr.entry(ip).or_insert(0);
            if *n >= shared.cfg.max_conns_per_addr {
                return Err(Refusal::TooManyConnections { ip, open: *n });
            }
            *n += 1;
        }
        if total {
            conns.total += 1;
        }
        Ok(AddrSlot {
            shared: shared.clone(),
            ip,
            total,
        })
    }
}

impl Drop for AddrSlot {
    fn drop(&mut self) {
        let mut conns = self
            .shared
            .addr_conns
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if self.total {
            conns.total = conns.total.saturating_sub(1);
        }
        if let Some(ip) = self.ip
            && let Some(n) = conns.per_addr.get_mut(&ip)
        {
            *n -= 1;
            if *n == 0 {
                conns.per_addr.remove(&ip);
            }
        }
    }
}

/// The client a trusted proxy forwards, from the request's headers: the last address of the last
/// `X-Forwarded-For` header (the one the proxy added; those before it are the client's to
/// invent), else the last `for=` of `Forwarded` (RFC 7239; quotes, brackets and a port removed).
/// `None` if neither names an address.
pub(super) fn forwarded_client(headers: &axum::http::HeaderMap) -> Option<IpAddr> {
    if let Some(xff) = headers.get_all("x-forwarded-for").iter().next_back() {
        return xff
            .to_str()
            .ok()?
            .rsplit(',')
            .next()
            .and_then(|a| a.trim().parse().ok());
    }
    let fwd = headers
        .get_all("forwarded")
        .iter()
        .next_back()?
        .to_str()
        .ok()?;
    let last = fwd.rsplit(',').next()?;
    let node = last.split(';').find_map(|kv| {
        let (k, v) = kv.trim().split_once('=')?;
        k.eq_ignore_ascii_case("for")
            .then_some(v.trim().trim_matches('"'))
    })?;
    match node.strip_prefix('[') {
        Some(v6) => v6.split(']').next()?.parse().ok(),
        None => node
            .parse()
            .ok()
            .or_else(|| node.rsplit_once(':').and_then(|(h, _)| h.parse().ok())),
    }
}

/// Whether `token` has the form the relay's own tokens have
/// ([`random_token`](super::random_token)): exactly 32 hex digits. The only form a client-chosen
/// token may take ([`RelayConfig::client_tokens`]): a form with no room for words, names or
/// patterns shorter than 128 bits written out.
pub fn is_token_form(token: &str) -> bool {
    token.len() == 32 && token.bytes().all(|b| b.is_ascii_hexdigit())
}

/// Why `token`, chosen by a client to create `room`, is refused under `cfg`, if it is.
pub(super) fn client_token_refusal(cfg: &RelayConfig, room: &str, token: &str) -> Option<Refusal> {
    if !cfg.client_tokens {
        return Some(Refusal::ClientToken {
            room: room.to_string(),
        });
    }
    (!is_token_form(token)).then(|| Refusal::TokenForm {
        len: token.chars().count(),
        why: if token.chars().all(|c| c.is_ascii_hexdigit()) {
            ""
        } else {
            ", not all hex digits"
        },
    })
}

/// The default of [`RelayConfig::max_conns`]: half the process's soft limit on open files, less
/// 64 for the relay's own (a relayed data stream may hold a pipe pair besides its socket), at
/// least 16 and at most 65,536; 4,096 where the limit cannot be read.
pub fn default_max_conns() -> usize {
    #[cfg(unix)]
    {
        let mut lim = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: getrlimit writes one rlimit through a valid pointer to a local.
        if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } == 0 {
            let soft = usize::try_from(lim.rlim_cur).unwrap_or(usize::MAX);
            return (soft.saturating_sub(64) / 2).clamp(16, 65_536);
        }
    }
    4096
}

/// Raise this process's soft limit on open files to its hard limit (Unix), so that the default
/// connection cap ([`default_max_conns`]) is not held below what the host allows by a low
/// default soft limit (1,024 on many systems). Returns the soft limit before and after, where it
/// could be read.
pub fn raise_file_limit() -> Option<(u64, u64)> {
    #[cfg(unix)]
    {
        let mut lim = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: getrlimit and setrlimit read and write one rlimit through a valid pointer.
        unsafe {
            if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) != 0 {
                return None;
            }
            let before = lim.rlim_cur;
            if lim.rlim_cur < lim.rlim_max {
                let raised = libc::rlimit {
                    rlim_cur: lim.rlim_max,
                    rlim_max: lim.rlim_max,
                };
                if libc::setrlimit(libc::RLIMIT_NOFILE, &raised) == 0 {
                    lim.rlim_cur = lim.rlim_max;
                }
            }
            // rlim_t is u64 here, another width elsewhere.
            #[allow(clippy::unnecessary_cast)]
            Some((before as u64, lim.rlim_cur as u64))
        }
    }
    #[cfg(not(unix))]
    None
}

/// The address `ip` is counted under: itself (IPv4-mapped IPv6 as IPv4), or for IPv6 its /64
/// (the rest zero): one host or site is handed a whole /64, so per-address caps on single IPv6
/// addresses would not hold.
pub fn addr_bucket(ip: IpAddr) -> IpAddr {
    match ip.to_canonical() {
        IpAddr::V6(v6) => {
            let bits = u128::from(v6) & !((1u128 << 64) - 1);
            IpAddr::V6(std::net::Ipv6Addr::from(bits))
        }
        v4 => v4,
    }
}

/// Whether a browser page of `origin` may open a WebSocket sent to `host` (the request's `Host`
/// header): it is the relay's own page (the origin's `host[:port]` is `host`), or `allowed` names
/// it (or holds `"*"`).
pub(super) fn origin_allowed(allowed: &[String], origin: &str, host: Option<&str>) -> bool {
    if allowed.iter().any(|a| a == "*" || a == origin) {
        return true;
    }
    let authority = origin
        .strip_prefix("https://")
        .or_else(|| origin.strip_prefix("http://"));
    authority.is_some_and(|a| host.is_some_and(|h| a.eq_ignore_ascii_case(h)))
}

#[cfg(test)]
mod tests {
    use super::{addr_bucket, default_max_conns, forwarded_client, origin_allowed};
    use std::net::IpAddr;

    /// The client behind a trusted proxy: the last `X-Forwarded-For` address (the proxy's own
    /// addition), else the last `Forwarded` element's `for=`, in each of its forms.
    #[test]
    fn the_forwarded_client_is_the_last_hop_the_proxy_added() {
        let get = |pairs: &[(&str, &str)]| {
            let mut h = axum::http::HeaderMap::new();
            for (k, v) in pairs {
                h.append(
                    axum::http::HeaderName::from_bytes(k.as_bytes()).unwrap(),
                    v.parse().unwrap(),
                );
            }
            forwarded_client(&h).map(|ip| ip.to_string())
        };
        let some = |s: &str| Some(s.to_string());
        assert_eq!(
            get(&[("x-forwarded-for", "203.0.113.7")]),
            some("203.0.113.7")
        );
        assert_eq!(
            get(&[("x-forwarded-for", "1.2.3.4, 203.0.113.7")]),
            some("203.0.113.7")
        );
        assert_eq!(
            get(&[
                ("x-forwarded-for", "1.2.3.4"),
                ("x-forwarded-for", "203.0.113.8")
            ]),
            some("203.0.113.8")
        );
        assert_eq!(
            get(&[("x-forwarded-for", "2001:db8::5")]),
            some("2001:db8::5")
        );
        assert_eq!(
            get(&[("forwarded", "for=192.0.2.60;proto=http")]),
            some("192.0.2.60")
        );
        assert_eq!(
            get(&[("forwarded", "for=1.1.1.1, for=\"[2001:db8:cafe::17]:4711\"")]),
            some("2001:db8:cafe::17")
        );
        assert_eq!(
            get(&[("forwarded", "For=\"192.0.2.43:47011\"")]),
            some("192.0.2.43")
        );
        assert_eq!(get(&[("forwarded", "for=unknown")]), None);
        assert_eq!(get(&[("x-forwarded-for", "not an address")]), None);
        assert_eq!(get(&[]), None);
    }

    /// An IPv6 address counts as its /64 (one host or site holds a whole /64); IPv4, and IPv4
    /// mapped into IPv6, as itself.
    #[test]
    fn addresses_are_counted_per_ipv4_address_and_ipv6_slash_64() {
        let b = |s: &str| addr_bucket(s.parse::<IpAddr>().unwrap()).to_string();
        assert_eq!(b("2001:db8:1:2:aaaa:bbbb:cccc:dddd"), "2001:db8:1:2::");
        assert_eq!(b("2001:db8:1:2::1"), b("2001:db8:1:2:ffff:ffff:ffff:ffff"));
        assert_ne!(b("2001:db8:1:2::1"), b("2001:db8:1:3::1"));
        assert_eq!(b("::ffff:10.1.2.3"), "10.1.2.3");
        assert_eq!(b("10.1.2.3"), "10.1.2.3");
        assert_ne!(b("10.1.2.3"), b("10.1.2.4"));
        assert_eq!(b("::1"), "::");
    }

    /// A browser page may use the relay when it is the relay's own (its origin names the host the
    /// request went to), or is named; anything else, `null` included, is refused.
    #[test]
    fn only_the_relays_own_page_and_named_origins_may_connect() {
        let none: &[String] = &[];
        let own = Some("class.example.org:8443");
        assert!(origin_allowed(none, "https://class.example.org:8443", own));
        assert!(origin_allowed(none, "http://Class.Example.org:8443", own));
        assert!(!origin_allowed(none, "https://class.example.org", own));
        assert!(!origin_allowed(none, "https://evil.example", own));
        assert!(!origin_allowed(none, "null", own));
        assert!(!origin_allowed(
            none,
            "https://class.example.org:8443",
            None
        ));
        let named = ["https://notes.example.org".to_string()];
        assert!(origin_allowed(&named, "https://notes.example.org", own));
        assert!(!origin_allowed(
            &named,
            "https://notes.example.org.evil",
            own
        ));
        assert!(origin_allowed(
            &["*".to_string()],
            "https://anything.example",
            own
        ));
    }

    /// The default connection cap sits below the open-file limit, with room for the relay's own.
    #[cfg(unix)]
    #[test]
    fn the_default_connection_cap_is_below_the_file_limit() {
        let mut lim = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: getrlimit writes one rlimit through a valid pointer to a local.
        assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) }, 0);
        let cap = default_max_conns();
        let soft = usize::try_from(lim.rlim_cur).unwrap_or(usize::MAX);
        assert!((16..=65_536).contains(&cap), "{cap}");
        if soft > 96 {
            assert!(
                2 * cap + 64 <= soft,
                "cap {cap} against a file limit of {soft}"
            );
        }
    }
}
