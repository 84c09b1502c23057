//! The relay: a small WebSocket server that groups clients into rooms, assigns ranks, routes binary
//! data frames by destination rank (stamping the source itself) and relays WebRTC signaling; with
//! `static_dir` it also serves the built web app from the same port.
//!
//! Native members may also attach a **data stream** ([`crate::wire::StreamHello`]): a plain TCP
//! connection to the same port, told apart from HTTP by its first byte, that carries their data
//! frames without WebSocket framing or masking. Between two members with streams the relay moves
//! payloads socket to socket (with `splice(2)` on Linux: the bytes never enter the relay's memory);
//! members on the relay's host attach theirs to a Unix-domain socket instead
//! ([`RelayConfig::local_streams`]); see `src/relay/stream.rs`.
//!
//! **Admission** (with [`serve`], which sees each connection's source address): at most
//! [`RelayConfig::max_conns`] connections in all (below the process's file limit),
//! [`RelayConfig::max_conns_per_addr`] open connections and [`RelayConfig::max_rooms_per_addr`]
//! open rooms (started or not) per source address ([`addr_bucket`]: an IPv6 address counts as
//! its /64), so one address flooding connections or rooms cannot lock others out; a room must
//! fill within [`RelayConfig::room_fill_timeout`] (its members are told why it closed), an
//! announced data stream must attach within [`RelayConfig::join_timeout`], and a connection that
//! sends nothing within that time is dropped. The relay makes every room's token (128 bits from
//! the OS generator, [`random_token`]); a token chosen by a client creates a room only where
//! [`RelayConfig::client_tokens`] allows it, and only in that same form ([`is_token_form`]).
//! Tokens and stream keys are compared in constant time.
//!
//! One connection = one task reading the socket plus one writer task draining a queue. The queue of
//! each member is bounded in BYTES (`max_pending_bytes`): a sender whose destination is slow waits
//! for room in that queue before reading its own socket further, so a slow receiver slows its
//! senders (TCP backpressure) instead of growing the relay's memory.

use std::collections::HashMap;
use std::net::IpAddr;
use std::path::PathBuf;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use axum::Router;
use axum::extract::connect_info::ConnectInfo;
use axum::extract::ws::{CloseFrame, Message, Utf8Bytes, WebSocket, WebSocketUpgrade};
use axum::extract::{Extension, State};
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use bytes::Bytes;
use futures::{SinkExt, StreamExt};
use tokio::sync::{Semaphore, mpsc};
use tower_http::set_header::SetResponseHeader;

use crate::wire::{
    Control, DEFAULT_FRAME_PAYLOAD, HEADER_LEN, Header, LEFT_CLEANLY, MAX_FRAME_PAYLOAD,
    MIN_FRAME_PAYLOAD, secret_eq,
};

mod admin;
mod admission;
mod budget;
mod errors;
mod join;
mod stream;
mod turn;
mod watch;

use admission::{AddrSlot, ConnCount, forwarded_client, origin_allowed};
pub use admission::{addr_bucket, default_max_conns, is_token_form, raise_file_limit};
use budget::{Charge, charge, memory_permits, queue_budget};
pub use budget::{default_memory_budget, parse_bytes};
pub use errors::{ConfigError, Refusal};
use stream::StreamOut;
pub use turn::{TurnRest, turn_credential};

/// Limits and options of a relay.
#[derive(Debug, Clone)]
pub struct RelayConfig {
    /// Largest data-frame payload (bytes after the 24-byte header) a client may send; clients
    /// split larger messages into fragments of at most this size.
    pub max_frame: usize,
    /// Largest world size of a room.
    pub max_members: u32,
    /// Most rooms at once.
    pub max_rooms: usize,
    /// Bytes that may wait in one member's outgoing queue before its senders are slowed down.
    pub max_pending_bytes: usize,
    /// Bytes that may wait in all members' queues together (default:
    /// [`default_memory_budget`], a quarter of the host's memory, at most 4 GiB): beyond it
    /// senders wait, and one that waits twice the idle timeout is dropped, so rooms whose members
    /// never read cannot pin more than this.
    pub memory_budget: usize,
    /// A connection silent this long (no frame, no pong to the relay's pings) is closed.
    pub idle_timeout: Duration,
    /// Time a new connection has to send its first byte and its `join`, and a member that
    /// announced a data stream has to attach it.
    pub join_timeout: Duration,
    /// Most connections open at once from one source address (WebSockets, data streams, page
    /// loads). A class behind one NAT address shares it. Only with [`serve`].
    pub max_conns_per_addr: usize,
    /// Most connections open at once in all (default: [`default_max_conns`], below the process's
    /// file limit, so that accepting never fails for want of descriptors). Only with [`serve`].
    pub max_conns: usize,
    /// Most rooms created from one source address open at once, started or not (a class behind
    /// one NAT address shares it). Only with [`serve`].
    pub max_rooms_per_addr: usize,
    /// A room that has not filled this long after it was created is closed; its members are told.
    pub room_fill_timeout: Duration,
    /// Let a client create a room with a token of its own choosing (for scripted setups such as
    /// `distgrad launch`, whose ranks all start with the token), in the form the relay makes
    /// ([`is_token_form`]). Off by default: the relay makes every room's token and tells it in
    /// the creator's `welcome`.
    pub client_tokens: bool,
    /// Serve HTTPS and `wss://` with this certificate ([`tls_config`]) on the same port (plain
    /// HTTP and data streams still work there; a connection opening with a TLS handshake gets
    /// TLS). Only with [`serve`].
    pub tls: Option<Arc<rustls::ServerConfig>>,
    /// With `tls`: refuse plain HTTP and WebSocket connections (told so, HTTP 403) and plain data
    /// streams (their clients fall back to the WebSocket, over TLS). Not behind a proxy that
    /// terminates TLS. Only with [`serve`].
    pub require_tls: bool,
    /// STUN/TURN servers handed to the tabs for WebRTC, as an `iceServers` array
    /// ([`check_ice_servers`]), in each member's `ready` (never in the `welcome`); `None`: tabs
    /// use host candidates only (plus `turn`).
    pub ice_servers: Option<serde_json::Value>,
    /// A TURN server taking credentials made with a shared secret ([`TurnRest`]): each member's
    /// `ready` carries one that expires after its `ttl`.
    pub turn: Option<TurnRest>,
    /// Browser origins that may open WebSockets besides the relay's own (a page whose `Origin`
    /// names the host the request was sent to: the page the relay serves); `"*"` lets any page
    /// in. Native clients send no `Origin` and are not subject to it. By default none: any other
    /// web page a student visits cannot use the relay (and the class's per-address quota).
    pub allowed_origins: Vec<String>,
    /// The token of the teacher's controls (`/admin`, `src/relay/admin.rs`): list rooms and
    /// members, close a room, remove a member, see the relay's use against its budgets. `None`:
    /// no admin routes.
    pub admin_token: Option<String>,
    /// Reverse proxies in front of the relay: a connection from one of these addresses is
    /// counted against the client its request names (`X-Forwarded-For`, else `Forwarded`), not
    /// against the proxy, and must name one. Only with [`serve`].
    pub trusted_proxies: Vec<IpAddr>,
    /// Serve this folder (the built web app) at `/`, with a Content-Security-Policy that lets
    /// the page connect only to its own origin and to `connect_src`.
    pub static_dir: Option<PathBuf>,
    /// Other relays the page this relay serves may connect to (origins such as
    /// `wss://other.example.org`; a link's `?relay=` names one, and the student confirms it).
    pub connect_src: Vec<String>,
    /// Serve `static_dir`'s files with the headers that make the page cross-origin isolated
    /// (`Cross-Origin-Opener-Policy: same-origin`, `Cross-Origin-Embedder-Policy:
    /// require-corp`): in a secure context the page's clock then steps by 5 µs instead of 100 µs
    /// (Chromium), which the room benchmark's sub-millisecond figures need. On by default.
    pub cross_origin_isolated: bool,
    /// Accept data streams from native members (on by default; only with [`serve`], which owns
    /// the listener). Members without one use the WebSocket.
    pub streams: bool,
    /// Move data-stream payloads with `splice(2)` (Linux; elsewhere, or when off, through a
    /// 256 KiB buffer).
    pub splice: bool,
    /// Also take data streams on a Unix-domain socket (Unix only; with `streams`): members that
    /// reached the relay on a loopback address attach there, skipping the TCP/IP stack. Its path
    /// is `relay.sock` in a new private (0700) directory under the temporary directory, told to
    /// members in their `welcome`.
    pub local_streams: bool,
}

impl RelayConfig {
    /// Whether these limits can work; otherwise what is wrong (every join or frame would fail).
    pub fn check(&self) -> std::result::Result<(), ConfigError> {
        if !(MIN_FRAME_PAYLOAD..=MAX_FRAME_PAYLOAD).contains(&self.max_frame) {
            return Err(ConfigError::MaxFrame {
                max_frame: self.max_frame,
                min: MIN_FRAME_PAYLOAD,
                max: MAX_FRAME_PAYLOAD,
            });
        }
        if self.max_members == 0 || self.max_rooms == 0 {
            return Err(ConfigError::Capacity {
                members: self.max_members,
                rooms: self.max_rooms,
            });
        }
        if self.max_pending_bytes < self.max_frame + HEADER_LEN {
            return Err(ConfigError::Pending {
                pending: self.max_pending_bytes,
                max_frame: self.max_frame,
                header: HEADER_LEN,
            });
        }
        if self.memory_budget < self.max_frame + HEADER_LEN {
            return Err(ConfigError::MemoryBudget {
                budget: self.memory_budget,
                max_frame: self.max_frame,
                header: HEADER_LEN,
            });
        }
        if self.idle_timeout.is_zero()
            || self.join_timeout.is_zero()
            || self.room_fill_timeout.is_zero()
        {
            return Err(ConfigError::ZeroTimeout);
        }
        if self.max_conns == 0 || self.max_conns_per_addr == 0 || self.max_rooms_per_addr == 0 {
            return Err(ConfigError::PerAddress {
                total: self.max_conns,
                conns: self.max_conns_per_addr,
                rooms: self.max_rooms_per_addr,
            });
        }
        if self.require_tls && self.tls.is_none() {
            return Err(ConfigError::RequireTls);
        }
        if let Some(ice) = &self.ice_servers {
            check_ice_servers(ice).map_err(ConfigError::IceServers)?;
        }
        if let Some(t) = &self.turn {
            let entry = serde_json::json!([{ "urls": t.urls, "username": "u", "credential": "c" }]);
            check_ice_servers(&entry).map_err(ConfigError::IceServers)?;
            if !t
                .urls
                .iter()
                .all(|u| u.starts_with("turn:") || u.starts_with("turns:"))
            {
                return Err(ConfigError::IceServers(format!(
                    "TURN URLs must start with turn: or turns: ({})",
                    t.urls.join(", ")
                )));
            }
        }
        for o in &self.connect_src {
            let ok = ["ws://", "wss://", "http://", "https://"]
                .iter()
                .any(|p| o.starts_with(p))
                && o.bytes()
                    .all(|b| b.is_ascii_graphic() && b != b';' && b != b',')
                && HeaderValue::from_str(o).is_ok();
            if !ok {
                return Err(ConfigError::ConnectSrc(o.clone()));
            }
        }
        if let Some(d) = &self.static_dir
            && !d.is_dir()
        {
            return Err(ConfigError::StaticDir(d.clone()));
        }
        Ok(())
    }
}

impl Default for RelayConfig {
    fn default() -> Self {
        RelayConfig {
            max_frame: DEFAULT_FRAME_PAYLOAD,
            max_members: 64,
            max_rooms: 256,
            max_pending_bytes: 16 << 20,
            memory_budget: default_memory_budget(),
            idle_timeout: Duration::from_secs(30),
            join_timeout: Duration::from_secs(10),
            // A class of 60 behind one NAT address, a few tabs each, plus page loads.
            max_conns_per_addr: 512,
            max_conns: default_max_conns(),
            max_rooms_per_addr: 64,
            room_fill_timeout: Duration::from_secs(300),
            client_tokens: false,
            tls: None,
            require_tls: false,
            ice_servers: None,
            turn: None,
            allowed_origins: Vec::new(),
            trusted_proxies: Vec::new(),
            admin_token: None,
            static_dir: None,
            connect_src: Vec::new(),
            cross_origin_isolated: true,
            streams: true,
            splice: true,
            local_streams: true,
        }
    }
}

/// What the writer task of a connection sends.
enum Out {
    Frame(Bytes, Option<Charge>),
    Text(String),
    /// Text routed from another member, charged to this member's queue budget like frames.
    Routed(String, Charge),
    Ping,
    Close(String),
    /// A control message that must stay in order with data frames (a peer left): on the data
    /// stream where the member has one, else on the WebSocket.
    Notice(String),
}

/// The relay's handles on one member's connection: what its room entry holds and what a sender
/// to it looks up.
#[derive(Clone)]
struct Link {
    /// Its outgoing queue (drained by its writer task).
    tx: mpsc::UnboundedSender<Out>,
    /// Bytes that may wait in that queue.
    budget: Arc<Semaphore>,
    /// Its data stream, once attached (set once, before the room is ready).
    stream: Arc<OnceLock<Arc<StreamOut>>>,
    /// Ends its connection with a reason (a fault seen on its data stream).
    kill: Arc<tokio::sync::watch::Sender<Option<String>>>,
}

struct Member {
    link: Link,
    /// The key that attaches its stream, if its join announced one.
    key: Option<String>,
    /// Its data route is decided (stream attached, or none coming): the room waits for this.
    settled: bool,
    /// The address it connected from (the forwarded client's behind a trusted proxy), if known.
    addr: Option<IpAddr>,
    /// When it joined.
    since: std::time::Instant,
}

struct Room {
    /// Tells this room from a later one of the same name.
    id: u64,
    token: String,
    /// The address it was created from, bucketed ([`addr_bucket`]): the room counts against it
    /// until it closes.
    creator: Option<IpAddr>,
    world: u32,
    members: HashMap<u32, Member>,
    /// True once `ready` was announced: late joiners then are replacements, which we refuse.
    started: bool,
    /// When it was created.
    created: std::time::Instant,
}

struct Shared {
    cfg: RelayConfig,
    rooms: Mutex<HashMap<String, Room>>,
    /// Becomes true when the relay shuts down: every member is then told and disconnected.
    stopping: tokio::sync::watch::Receiver<bool>,
    /// One permit held by each open connection, so shutdown can wait for their goodbyes.
    conns: Arc<Semaphore>,
    /// The relay's memory budget: a permit per byte queued for any member ([`budget`]).
    memory: Arc<Semaphore>,
    /// The path of the Unix-domain socket for local data streams, once it listens.
    local_path: OnceLock<String>,
    /// Open connections per source address ([`addr_bucket`]) and in all.
    addr_conns: Mutex<ConnCount>,
    /// The next room's id.
    next_room: AtomicU64,
}

/// Permits of `Shared::conns` (far above any real number of connections).
const CONN_PERMITS: u32 = 1 << 24;

impl Shared {
    fn rooms(&self) -> std::sync::MutexGuard<'_, HashMap<String, Room>> {
        self.rooms.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Where frames from `seat` to rank `dst` go: `Err` if `dst` is outside the room's world,
    /// `Ok(None)` if it left.
    fn dest(&self, seat: &Seat, dst: u32) -> Result<Option<Link>, String> {
        let mut rooms = self.rooms();
        let room = seat.room_in(&mut rooms).ok_or("room vanished")?;
        if dst >= room.world {
            return Err(format!(
                "destination rank {dst} outside world {}",
                room.world
            ));
        }
        Ok(room.members.get(&dst).map(|m| m.link.clone()))
    }
}

/// Announce `ready` if the room is full and every member's data route is decided. Each member's
/// `ready` carries a key per peer, the same for both members of a pair and known to no one else
/// (direct links prove ranks with it); if the OS generator fails, no keys (and no direct links).
fn ready_check(r: &mut Room, cfg: &RelayConfig) -> bool {
    if r.started || r.members.len() as u32 != r.world || !r.members.values().all(|m| m.settled) {
        return false;
    }
    r.started = true;
    let mut members: Vec<u32> = r.members.keys().copied().collect();
    members.sort_unstable();
    let keys = pair_keys(r.world);
    for (&rank, m) in &r.members {
        let link_keys = keys.as_ref().map(|k| {
            (0..r.world)
                .map(|p| if p == rank { String::new() } else { k(rank, p) })
                .collect()
        });
        let text = control(&Control::Ready {
            members: members.clone(),
            link_keys,
            // Only where WebRTC links can form (a room of one has no peer): TURN credentials
            // are not handed to whoever opens a room of one.
            ice_servers: (r.world >= 2)
                .then(|| turn::ice_servers_for(cfg, r.id, rank))
                .flatten(),
        });
        let _ = m.link.tx.send(Out::Text(text));
    }
    true
}

/// Fresh random keys for every pair of ranks of a room of `world` (128 bits each from the OS
/// generator): `key(a, b) == key(b, a)`. `None` if the generator fails.
fn pair_keys(world: u32) -> Option<impl Fn(u32, u32) -> String> {
    let w = world as usize;
    let mut bytes = vec![0u8; 16 * w * w.saturating_sub(1) / 2];
    getrandom::fill(&mut bytes).ok()?;
    Some(move |a: u32, b: u32| {
        let (lo, hi) = (a.min(b) as usize, a.max(b) as usize);
        // Pairs (lo, hi) with lo < hi, numbered row by row.
        let i = hi * (hi - 1) / 2 + lo;
        bytes[16 * i..16 * i + 16]
            .iter()
            .map(|x| format!("{x:02x}"))
            .collect()
    })
}

/// A random token: 128 bits from the operating system's generator, as 32 hex digits. Fails if the
/// generator does (there is no weaker fallback).
pub fn random_token() -> std::io::Result<String> {
    let mut b = [0u8; 16];
    getrandom::fill(&mut b).map_err(|e| {
        std::io::Error::other(format!(
            "the operating system's random number generator failed ({e}): cannot make a token"
        ))
    })?;
    Ok(b.iter().map(|x| format!("{x:02x}")).collect())
}

/// Whether `ice` is a WebRTC `iceServers` array: objects with `urls` (a `stun:`, `turn:` or
/// `turns:` URL, or a non-empty array of them) and optional string `username` and `credential`,
/// nothing else; otherwise what is wrong.
pub fn check_ice_servers(ice: &serde_json::Value) -> std::result::Result<(), String> {
    let list = ice
        .as_array()
        .ok_or("ICE servers must be a JSON array of {urls, username?, credential?}")?;
    for (i, s) in list.iter().enumerate() {
        let obj = s
            .as_object()
            .ok_or_else(|| format!("ICE server {i} is not an object"))?;
        let url_ok = |u: &serde_json::Value| {
            u.as_str().is_some_and(|u| {
                ["stun:", "turn:", "turns:"]
                    .iter()
                    .any(|p| u.starts_with(p))
            })
        };
        match obj.get("urls") {
            Some(u) if url_ok(u) => {}
            Some(serde_json::Value::Array(us)) if !us.is_empty() && us.iter().all(url_ok) => {}
            _ => {
                return Err(format!(
                    "ICE server {i}: `urls` must be a stun:, turn: or turns: URL or a list of them"
                ));
            }
        }
        for (k, v) in obj {
            match k.as_str() {
                "urls" => {}
                "username" | "credential" if v.is_string() => {}
                _ => return Err(format!("ICE server {i}: unexpected field {k:?}")),
            }
        }
    }
    Ok(())
}

/// A TLS configuration for [`RelayConfig::tls`] from PEM files: the certificate chain (leaf first)
/// and its private key (PKCS#8, PKCS#1 or SEC1). Errors name the file and what is wrong.
pub fn tls_config(
    cert: &std::path::Path,
    key: &std::path::Path,
) -> std::io::Result<Arc<rustls::ServerConfig>> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let bad = |what: &std::path::Path, e: &dyn std::fmt::Display| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("{}: {e}", what.display()),
        )
    };
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(cert)
        .map_err(|e| bad(cert, &e))?
        .collect::<Result<_, _>>()
        .map_err(|e| bad(cert, &e))?;
    if chain.is_empty() {
        return Err(bad(cert, &"no certificate in the file"));
    }
    let key_der = PrivateKeyDer::from_pem_file(key).map_err(|e| bad(key, &e))?;
    let mut cfg = rustls::ServerConfig::builder_with_provider(crate::tls::provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| bad(cert, &e))?
        .with_no_client_auth()
        .with_single_cert(chain, key_der)
        .map_err(|e| {
            bad(
                cert,
                &format!("the certificate and key do not go together: {e}"),
            )
        })?;
    // WebSockets upgrade HTTP/1.1.
    cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(cfg))
}

/// The relay's routes: `/ws` (WebSocket) and, with `static_dir`, the files of the web app.
/// Data streams need the listener ([`serve`]): members of a relay served through this router alone
/// send their data through the WebSocket.
pub fn router(cfg: RelayConfig) -> Router {
    // No shutdown signal: the sender is dropped, which `stopped` treats as "never".
    let conns = Arc::new(Semaphore::new(CONN_PERMITS as usize));
    let memory = Arc::new(Semaphore::new(memory_permits(&cfg)));
    router_with(Arc::new(Shared {
        cfg: RelayConfig {
            streams: false,
            ..cfg
        },
        rooms: Mutex::new(HashMap::new()),
        stopping: tokio::sync::watch::channel(false).1,
        conns,
        memory,
        local_path: OnceLock::new(),
        addr_conns: Mutex::default(),
        next_room: AtomicU64::new(0),
    }))
}

fn router_with(shared: Arc<Shared>) -> Router {
    let static_dir = shared.cfg.static_dir.clone();
    let isolate = shared.cfg.cross_origin_isolated;
    // Checked with the config: a value that cannot be a header never gets here.
    let csp = content_security_policy(&shared.cfg)
        .unwrap_or_else(|_| HeaderValue::from_static("connect-src 'self'"));
    let mut r = Router::new().route("/ws", get(ws_handler));
    if let Some(admin) = admin::routes(&shared) {
        r = r.merge(admin);
    }
    let r = r.with_state(shared);
    let files = |dir| {
        SetResponseHeader::overriding(
            tower_http::services::ServeDir::new(dir),
            HeaderName::from_static("content-security-policy"),
            csp.clone(),
        )
    };
    match static_dir {
        Some(dir) if isolate => r.fallback_service(isolated(files(dir))),
        Some(dir) => r.fallback_service(files(dir)),
        None => r,
    }
}

/// The Content-Security-Policy the relay serves its page with: the page may connect (fetch,
/// WebSocket) only to its own origin and the relays named in `connect_src`, so a link's
/// `?relay=` cannot send a tab's data elsewhere even if confirmed.
fn content_security_policy(cfg: &RelayConfig) -> Result<HeaderValue, ConfigError> {
    let mut v = String::from("connect-src 'self'");
    for o in &cfg.connect_src {
        v.push(' ');
        v.push_str(o);
    }
    HeaderValue::from_str(&v).map_err(|_| ConfigError::ConnectSrc(cfg.connect_src.join(" ")))
}

/// `files` with the two headers that make the page cross-origin isolated
/// (`window.crossOriginIsolated`, in a secure context: `localhost`, 127.0.0.1 or HTTPS). The page
/// loads nothing from other origins, and an isolated page's `performance.now()` steps by 5 µs
/// instead of 100 µs (Chromium), which the room benchmark's sub-millisecond round trips need.
fn isolated<S>(files: S) -> SetResponseHeader<SetResponseHeader<S, HeaderValue>, HeaderValue> {
    let files = SetResponseHeader::overriding(
        files,
        HeaderName::from_static("cross-origin-opener-policy"),
        HeaderValue::from_static("same-origin"),
    );
    SetResponseHeader::overriding(
        files,
        HeaderName::from_static("cross-origin-embedder-policy"),
        HeaderValue::from_static("require-corp"),
    )
}

/// Serve until `shutdown` resolves.
pub async fn serve(
    listener: tokio::net::TcpListener,
    cfg: RelayConfig,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    cfg.check().map_err(|e| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("relay config: {e}"),
        )
    })?;
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let shutdown = async move {
        shutdown.await;
        // Upgraded WebSockets outlive the HTTP server: tell their tasks to say goodbye.
        let _ = stop_tx.send(true);
    };
    let conns = Arc::new(Semaphore::new(CONN_PERMITS as usize));
    let memory = Arc::new(Semaphore::new(memory_permits(&cfg)));
    let shared = Arc::new(Shared {
        cfg,
        rooms: Mutex::new(HashMap::new()),
        stopping: stop_rx,
        conns: conns.clone(),
        memory,
        local_path: OnceLock::new(),
        addr_conns: Mutex::default(),
        next_room: AtomicU64::new(0),
    });
    // Same-host members' data streams: a Unix-domain socket (removed when `_local` drops).
    #[cfg(unix)]
    let _local = if shared.cfg.streams && shared.cfg.local_streams {
        match stream::LocalListener::start(shared.clone()) {
            Ok(l) => {
                let _ = shared
                    .local_path
                    .set(l.path().to_string_lossy().into_owned());
                Some(l)
            }
            Err(e) => {
                eprintln!(
                    "distgrad relay: no Unix-domain data streams ({e}); members on this host use TCP"
                );
                None
            }
        }
    } else {
        None
    };
    // Accepted connections are sorted: data streams here, HTTP (page, WebSocket) to axum.
    let incoming = stream::Incoming::new(listener, shared.clone())?;
    axum::serve(
        incoming,
        router_with(shared).into_make_service_with_connect_info::<stream::PeerAddr>(),
    )
    .with_graceful_shutdown(shutdown)
    .await?;
    // Give the open connections a moment to tell their members (error + close) before returning.
    let _ = tokio::time::timeout(Duration::from_secs(2), conns.acquire_many(CONN_PERMITS)).await;
    Ok(())
}

async fn ws_handler(
    ws: WebSocketUpgrade,
    headers: HeaderMap,
    peer: Option<Extension<ConnectInfo<stream::PeerAddr>>>,
    State(shared): State<Arc<Shared>>,
) -> Response {
    let peer = peer.map(|Extension(ConnectInfo(a))| a.0);
    // Behind a trusted proxy the member is the client it names, counted against its address.
    let (peer, forwarded) = match peer {
        Some(p) if shared.cfg.trusted_proxies.contains(&p.ip().to_canonical()) => {
            let Some(ip) = forwarded_client(&headers) else {
                return (
                    StatusCode::BAD_REQUEST,
                    format!(
                        "a request through the trusted proxy {} must name its client \
                         (X-Forwarded-For or Forwarded)",
                        p.ip()
                    ),
                )
                    .into_response();
            };
            match AddrSlot::take_forwarded(&shared, ip) {
                Ok(slot) => (Some(std::net::SocketAddr::new(ip, 0)), Some(slot)),
                Err(why) => {
                    return (StatusCode::TOO_MANY_REQUESTS, why.to_string()).into_response();
                }
            }
        }
        other => (other, None),
    };
    let on_host = on_host(peer);
    // Native clients send no Origin; only browsers are subject to the check.
    if let Some(o) = headers.get("origin") {
        let o = o.to_str().unwrap_or("(not text)");
        let host = headers.get("host").and_then(|h| h.to_str().ok());
        if !origin_allowed(&shared.cfg.allowed_origins, o, host) {
            let o = truncate(o, 200);
            return (
                StatusCode::FORBIDDEN,
                format!(
                    "origin {o} may not use this relay: it takes pages it serves itself, and \
                     origins named with --allowed-origin"
                ),
            )
                .into_response();
        }
    }
    // The socket layer refuses frames far above the limit; we check the exact limit ourselves so
    // that the client gets a reason.
    let hard = shared.cfg.max_frame.saturating_mul(2).max(64 << 10);
    ws.max_message_size(hard)
        .max_frame_size(hard)
        .on_upgrade(move |socket| async move {
            // A forwarded client's place, held as long as its connection.
            let _forwarded = forwarded;
            connection(socket, shared, on_host, peer.map(|a| a.ip())).await;
        })
}

/// Whether a member connected from `peer` is on the relay's host (a loopback address, IPv4-mapped
/// ones included). Only [`serve`] knows the peer (and only it has a Unix-domain socket to name):
/// `None` is not on the host.
fn on_host(peer: Option<std::net::SocketAddr>) -> bool {
    peer.is_some_and(|a| a.ip().to_canonical().is_loopback())
}

/// A member's identity inside the relay.
#[derive(Clone)]
struct Seat {
    room: String,
    /// The room's id (a later room of the same name is another room).
    room_id: u64,
    rank: u32,
}

impl Seat {
    /// This member's room, if it still exists.
    fn room_in<'a>(&self, rooms: &'a mut HashMap<String, Room>) -> Option<&'a mut Room> {
        rooms.get_mut(&self.room).filter(|r| r.id == self.room_id)
    }
}

/// `on_host`: the member reached us on a loopback address (so it may use our Unix-domain socket);
/// `peer`: its address, where known (rooms it creates count against it).
async fn connection(socket: WebSocket, shared: Arc<Shared>, on_host: bool, peer: Option<IpAddr>) {
    let _open = shared.conns.clone().try_acquire_owned().ok();
    let (mut sink, mut stream) = socket.split();
    let (tx, mut rx) = mpsc::unbounded_channel::<Out>();
    // A receiver that stops reading must not hold its senders forever: a write that does not
    // finish within the idle timeout ends the connection (its queue budget is then closed).
    let write_timeout = shared.cfg.idle_timeout.max(Duration::from_millis(10));
    let slot: Arc<OnceLock<Arc<StreamOut>>> = Arc::default();
    let data_stream = slot.clone();
    let (kill, mut killed) = tokio::sync::watch::channel(None);
    let kill = Arc::new(kill);
    let stream_failed = kill.clone();
    let writer = tokio::spawn(async move {
        // A failed data stream ends the member (with the reason) and is shut down; what follows
        // for it fails at once and is dropped, while the WebSocket still says goodbye.
        let failed = |s: &StreamOut, e: std::io::Error| {
            let _ = stream_failed.send(Some(format!("its data stream failed: {e}")));
            s.shutdown();
        };
        while let Some(out) = rx.recv().await {
            let (msg, permit, last) = match out {
                // A member with a data stream gets its frames there.
                Out::Frame(b, permit) if data_stream.get().is_some() => {
                    if let Some(s) = data_stream.get()
                        && let Err(e) = s.send_frame(&b, write_timeout).await
                    {
                        failed(s, e);
                    }
                    drop(permit);
                    continue;
                }
                Out::Frame(b, permit) => (Message::Binary(b), permit, false),
                Out::Notice(t) if data_stream.get().is_some() => {
                    if let Some(s) = data_stream.get()
                        && let Err(e) = s.send_control(&t, write_timeout).await
                    {
                        failed(s, e);
                    }
                    continue;
                }
                Out::Notice(t) => (Message::Text(t.into()), None, false),
                Out::Text(t) => (Message::Text(t.into()), None, false),
                Out::Routed(t, permit) => (Message::Text(t.into()), Some(permit), false),
                Out::Ping => (Message::Ping(Bytes::new()), None, false),
                Out::Close(reason) => {
                    let frame = CloseFrame {
                        code: 1008,
                        reason: Utf8Bytes::from(reason),
                    };
                    (Message::Close(Some(frame)), None, true)
                }
            };
            let r = tokio::time::timeout(write_timeout, sink.send(msg)).await;
            drop(permit);
            let failed = match &r {
                Ok(Ok(())) => None,
                Err(_) => Some(format!("it took no data for {write_timeout:?}")),
                Ok(Err(e)) => Some(format!("writing to it failed: {e}")),
            };
            if let Some(why) = &failed
                && !last
            {
                // The member is dropped (its room told), not left holding its queue.
                let _ = stream_failed.send(Some(why.clone()));
            }
            if last || failed.is_some() {
                break;
            }
        }
        // Bounded: a peer that reads nothing cannot hold the close (and this task) open.
        let _ = tokio::time::timeout(Duration::from_secs(1), sink.close()).await;
    });
    let budget = Arc::new(Semaphore::new(queue_budget(&shared.cfg)));
    let link = Link {
        tx: tx.clone(),
        budget,
        stream: slot,
        kill,
    };

    let seat = match join::join(&shared, &mut stream, &link, on_host, peer).await {
        Ok(seat) => seat,
        Err(refusal) => {
            send_error(&tx, &refusal.to_string());
            let _ = writer.await;
            return;
        }
    };

    let reason = serve_member(&shared, &seat, &mut stream, &tx, &mut killed).await;
    if reason == LEFT_CLEANLY
        && let Some(s) = link.stream.get()
    {
        // A clean leave: the client ended its data stream first; let what it sent there reach
        // its peers before they hear that it left.
        s.drained(shared.cfg.idle_timeout).await;
    }
    leave(&shared, &seat, &reason);
    if reason != LEFT_CLEANLY {
        send_error(&tx, &reason);
    }
    // The writer ends (closing the WebSocket) once every sender of its queue is gone.
    drop((tx, link));
    let _ = writer.await;
}

fn send_error(tx: &mpsc::UnboundedSender<Out>, reason: &str) {
    let msg = serde_json::to_string(&Control::Error {
        message: reason.to_string(),
    })
    .unwrap_or_default();
    let _ = tx.send(Out::Text(msg));
    let _ = tx.send(Out::Close(truncate(reason, 123)));
}

/// At most `n` bytes of `s`, cut at a char boundary (a close frame's reason is limited to 123 bytes).
fn truncate(s: &str, n: usize) -> String {
    let mut end = n.min(s.len());
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    s[..end].to_string()
}

fn control(msg: &Control) -> String {
    serde_json::to_string(msg).unwrap_or_default()
}

/// Route a member's messages until it leaves; returns why it left.
async fn serve_member(
    shared: &Shared,
    seat: &Seat,
    stream: &mut futures::stream::SplitStream<WebSocket>,
    tx: &mpsc::UnboundedSender<Out>,
    killed: &mut tokio::sync::watch::Receiver<Option<String>>,
) -> String {
    let cfg = &shared.cfg;
    let mut ping = tokio::time::interval((cfg.idle_timeout / 3).max(Duration::from_millis(10)));
    ping.tick().await;
    let mut last_heard = tokio::time::Instant::now();
    let mut stopping = shared.stopping.clone();
    // One abort per member is forwarded (a member cannot flood the others' queues with them).
    let mut aborted = false;
    loop {
        let msg = tokio::select! {
            m = stream.next() => m,
            () = stopped(&mut stopping) => return "the relay is shutting down".into(),
            Ok(reason) = killed.wait_for(Option::is_some) => {
                return reason.clone().unwrap_or_default();
            }
            _ = ping.tick() => {
                if last_heard.elapsed() >= cfg.idle_timeout {
                    return format!("idle for {:?}", cfg.idle_timeout);
                }
                let _ = tx.send(Out::Ping);
                continue;
            }
        };
        last_heard = tokio::time::Instant::now();
        let msg = match msg {
            None => return LEFT_CLEANLY.into(),
            Some(Err(e)) => return format!("socket error: {e}"),
            Some(Ok(m)) => m,
        };
        // While it waits for room at a destination it still sees shutdown and kill.
        let handled = match msg {
            Message::Binary(b) => unless_ended(route(shared, seat, b), &mut stopping, killed).await,
            Message::Text(t) => match serde_json::from_str::<Control>(&t) {
                Ok(Control::Signal {
                    to: Some(to), data, ..
                }) => {
                    let signal = forward_signal(shared, seat, to, data);
                    unless_ended(signal, &mut stopping, killed).await
                }
                Ok(Control::Abort { reason, .. }) if !aborted => {
                    aborted = true;
                    forward_abort(shared, seat, &reason);
                    Ok(Ok(()))
                }
                Ok(Control::Abort { .. }) => Ok(Ok(())),
                Ok(Control::NoStream) => {
                    let mut rooms = shared.rooms();
                    if let Some(r) = seat.room_in(&mut rooms) {
                        if let Some(m) = r.members.get_mut(&seat.rank) {
                            m.settled = true;
                        }
                        ready_check(r, &shared.cfg);
                    }
                    Ok(Ok(()))
                }
                Ok(other) => {
                    let quoted = crate::wire::clip(&format!("{other:?}"), crate::wire::MAX_QUOTED);
                    return format!("unexpected control message {quoted}");
                }
                Err(e) => {
                    let e = crate::wire::clip(&e.to_string(), crate::wire::MAX_QUOTED);
                    return format!("malformed control message: {e}");
                }
            },
            Message::Ping(_) | Message::Pong(_) => Ok(Ok(())),
            Message::Close(_) => return LEFT_CLEANLY.into(),
        };
        match handled {
            Ok(Ok(())) => {}
            Ok(Err(reason)) | Err(reason) => return reason,
        }
    }
}

/// `fut`, unless the relay shuts down or the member is ended first: then why it goes.
async fn unless_ended<T>(
    fut: impl std::future::Future<Output = T>,
    stopping: &mut tokio::sync::watch::Receiver<bool>,
    killed: &mut tokio::sync::watch::Receiver<Option<String>>,
) -> Result<T, String> {
    tokio::select! {
        v = fut => Ok(v),
        () = stopped(stopping) => Err("the relay is shutting down".into()),
        Ok(reason) = killed.wait_for(Option::is_some) => Err(reason.clone().unwrap_or_default()),
    }
}

/// Forward a WebRTC signal from `seat` to rank `to` of its room, charged to the receiver's queue
/// and the memory budget like data (a member cannot grow the relay's memory by flooding one that
/// does not read); `Err`: why the sender must go.
async fn forward_signal(
    shared: &Shared,
    seat: &Seat,
    to: u32,
    data: serde_json::Value,
) -> Result<(), String> {
    let fwd = control(&Control::Signal {
        to: None,
        from: Some(seat.rank),
        data,
    });
    let dst = {
        let mut rooms = shared.rooms();
        seat.room_in(&mut rooms)
            .and_then(|r| r.members.get(&to))
            .map(|m| (m.link.tx.clone(), m.link.budget.clone()))
    };
    if let Some((tx, budget)) = dst
        && let Some(c) = charge(shared, &budget, fwd.len()).await?
    {
        let _ = tx.send(Out::Routed(fwd, c));
    }
    Ok(())
}

/// Tell the other members of `seat`'s room that it aborted, with its `reason` (cut to the wire's
/// bound). Not charged to the receivers' budgets and never waited for: a member whose queue is
/// full (it stopped reading) must not hold up the others' notes.
fn forward_abort(shared: &Shared, seat: &Seat, reason: &str) {
    let fwd = control(&Control::Abort {
        from: Some(seat.rank),
        reason: truncate(reason, crate::wire::MAX_ABORT_REASON),
    });
    let mut rooms = shared.rooms();
    if let Some(r) = seat.room_in(&mut rooms) {
        for (_, m) in r.members.iter().filter(|&(&k, _)| k != seat.rank) {
            let _ = m.link.tx.send(Out::Text(fwd.clone()));
        }
    }
}

/// Resolves when the relay shuts down; never if there is no shutdown signal.
async fn stopped(rx: &mut tokio::sync::watch::Receiver<bool>) {
    if rx.wait_for(|stop| *stop).await.is_err() {
        std::future::pending::<()>().await;
    }
}

/// Forward one data frame to its destination in the same room.
async fn route(shared: &Shared, seat: &Seat, frame: Bytes) -> Result<(), String> {
    if frame.len() > shared.cfg.max_frame + HEADER_LEN {
        return Err(format!(
            "frame of {} bytes exceeds the limit of {} (split messages into fragments)",
            frame.len(),
            shared.cfg.max_frame + HEADER_LEN
        ));
    }
    let h = Header::decode(&frame).map_err(|e| format!("bad data frame: {e}"))?;
    // A destination that left was announced to its peers: its frames are dropped.
    let Some(Link {
        tx: dst_tx, budget, ..
    }) = shared.dest(seat, h.dst)?
    else {
        return Ok(());
    };
    // Stamp the source in place when we hold the only reference (the usual case), else copy.
    let mut frame = frame
        .try_into_mut()
        .unwrap_or_else(|b| bytes::BytesMut::from(&b[..]));
    Header::stamp_src(&mut frame, seat.rank);
    // Backpressure: wait until the destination's queue (and the relay's memory budget) has room.
    // If the destination leaves meanwhile its queue is closed and the frame is dropped (its peers
    // were told it left).
    let Some(charged) = charge(shared, &budget, frame.len()).await? else {
        return Ok(());
    };
    let _ = dst_tx.send(Out::Frame(frame.freeze(), Some(charged)));
    Ok(())
}

fn leave(shared: &Shared, seat: &Seat, reason: &str) {
    let mut rooms = shared.rooms();
    let Some(room) = seat.room_in(&mut rooms) else {
        return;
    };
    if let Some(m) = room.members.remove(&seat.rank) {
        // Senders waiting for room in this member's queue give up (their frames are dropped).
        m.link.budget.close();
        if let Some(s) = m.link.stream.get() {
            s.shutdown();
        }
    }
    let note = control(&Control::PeerLeft {
        rank: seat.rank,
        reason: reason.to_string(),
    });
    for m in room.members.values() {
        let _ = m.link.tx.send(Out::Notice(note.clone()));
    }
    if room.members.is_empty() {
        rooms.remove(&seat.room);
    }
}

#[cfg(test)]
mod tests {
    use super::on_host;

    #[test]
    fn only_loopback_peers_are_on_the_host() {
        for a in [
            "127.0.0.1:9",
            "127.3.4.5:9",
            "[::1]:9",
            "[::ffff:127.0.0.1]:9",
        ] {
            assert!(on_host(Some(a.parse().unwrap())), "{a}");
        }
        for a in [
            "10.0.0.1:9",
            "[::ffff:10.0.0.1]:9",
            "[fe80::1]:9",
            "0.0.0.0:9",
        ] {
            assert!(!on_host(Some(a.parse().unwrap())), "{a}");
        }
        assert!(!on_host(None), "an unknown peer");
    }
}
