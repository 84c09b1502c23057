//! Helpers for the relay tests (`tests/relay.rs`).
//!
//! - [`TestRelay`]: `relay::serve` on `127.0.0.1:0` (or another address) in its own thread and
//!   multi-thread tokio runtime, stopped through a oneshot (on [`TestRelay::shutdown`] or on drop).
//! - [`run_ranks`]: one std thread per rank, each with its own current-thread tokio runtime, that
//!   connects a [`WsTransport`], wraps it in a [`P2p`] communicator and runs a closure on it.
//! - [`Raw`]: a third-party client (plain tokio-tungstenite, not our transport) that speaks the wire
//!   format by hand, or sends garbage. Every wait is bounded, so a test fails instead of hanging.
//! - [`Child`]: a child process that is killed when dropped (no stray workers if a test panics).
#![allow(dead_code)]

mod helpers;
#[allow(unused_imports)]
pub use helpers::*;

use std::future::Future;
use std::net::SocketAddr;
use std::rc::Rc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use distgrad::relay::{self, RelayConfig};
use distgrad::transport::ws::{JoinOptions, WsTransport};
use distgrad::transport::{Channel, Tag};
use distgrad::wire::{Control, Header};
use distgrad::{CommOptions, Error, P2p, Result};
use futures::{SinkExt, StreamExt};
use tokio::net::TcpStream;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::{MaybeTlsStream, WebSocketStream};

/// How long any single wait of a raw client may take before the test fails.
pub const WAIT: Duration = Duration::from_secs(10);

// ---------------------------------------------------------------------------------------------
// The relay
// ---------------------------------------------------------------------------------------------

/// A relay serving on an ephemeral loopback port.
pub struct TestRelay {
    pub addr: SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<std::io::Result<()>>>,
}

impl TestRelay {
    /// Start a relay with `cfg`.
    pub fn start(cfg: RelayConfig) -> TestRelay {
        TestRelay::start_on("127.0.0.1:0", cfg)
    }

    /// Start a relay with `cfg` listening on `bind` (only loopback, or addresses of a network
    /// namespace the test made itself).
    pub fn start_on(bind: &str, cfg: RelayConfig) -> TestRelay {
        let std_listener =
            std::net::TcpListener::bind(bind).unwrap_or_else(|e| panic!("bind {bind}: {e}"));
        std_listener.set_nonblocking(true).expect("nonblocking");
        let addr = std_listener.local_addr().expect("local_addr");
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let thread = std::thread::Builder::new()
            .name("relay".into())
            .spawn(move || {
                let rt = tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(2)
                    .enable_all()
                    .build()
                    .expect("relay runtime");
                let r = rt.block_on(async move {
                    let listener = tokio::net::TcpListener::from_std(std_listener)?;
                    relay::serve(listener, cfg, async {
                        let _ = stop_rx.await;
                    })
                    .await
                });
                rt.shutdown_timeout(Duration::from_secs(1));
                r
            })
            .expect("spawn relay thread");
        TestRelay {
            addr,
            stop: Some(stop_tx),
            thread: Some(thread),
        }
    }

    /// A relay with the default config, except that clients may choose room tokens
    /// ([`scripted`]): the tests' ranks all start with theirs.
    pub fn default_config() -> TestRelay {
        TestRelay::start(scripted())
    }

    /// The WebSocket URL.
    pub fn url(&self) -> String {
        format!("ws://{}/ws", self.addr)
    }

    /// Stop the relay and return how long `serve` took to return; fails the test if it does not
    /// return within `bound` or returns an error.
    pub fn shutdown(mut self, bound: Duration) -> Duration {
        let t0 = Instant::now();
        let _ = self.stop.take().expect("stop sender").send(());
        let h = self.thread.take().expect("relay thread");
        while !h.is_finished() {
            assert!(
                t0.elapsed() < bound,
                "relay::serve did not return within {bound:?} after its shutdown future resolved"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        let r = h.join().expect("relay thread panicked");
        assert!(r.is_ok(), "relay::serve returned an error: {r:?}");
        t0.elapsed()
    }
}

impl Drop for TestRelay {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(h) = self.thread.take() {
            // Bounded: never hang a test in its destructor.
            let t0 = Instant::now();
            while !h.is_finished() && t0.elapsed() < Duration::from_secs(5) {
                std::thread::sleep(Duration::from_millis(10));
            }
            if h.is_finished() {
                let _ = h.join();
            } else {
                eprintln!("warning: relay thread still running 5 s after shutdown; detaching it");
            }
        }
    }
}

/// The default config with [`RelayConfig::client_tokens`] on, as a scripted setup runs it (every
/// rank starts with the token); `RelayConfig::default()` is the relay a class meets.
pub fn scripted() -> RelayConfig {
    RelayConfig {
        client_tokens: true,
        ..RelayConfig::default()
    }
}

// ---------------------------------------------------------------------------------------------
// Ranks over our transport
// ---------------------------------------------------------------------------------------------

/// A room token named `name`, in the one form a relay takes from a client
/// ([`relay::is_token_form`]: 32 hex digits): the helpers here take short names ("t", "tok") and
/// turn each into 32 hex digits (a 128-bit FNV-1a hash of the name: distinct names stay distinct
/// tokens).
pub fn tok(name: &str) -> String {
    let mut h: u128 = 0x6c62272e07bb014262b821756295c58d;
    for b in name.bytes() {
        h ^= u128::from(b);
        h = h.wrapping_mul(0x0000000001000000000000000000013b);
    }
    format!("{h:032x}")
}

/// Join options for `rank` of a room (explicit rank, the token named `token` ([`tok`]), bounded
/// wait for the room).
pub fn join_opts(room: &str, token: &str, world: u32, rank: u32) -> JoinOptions {
    let mut j = JoinOptions::new(room, world);
    j.token = Some(tok(token));
    j.rank = Some(rank);
    j.ready_timeout = Duration::from_secs(30);
    j
}

/// A current-thread tokio runtime (what one rank uses).
pub fn rank_runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("rank runtime")
}

/// Run `f(i, comm)` on one rank per entry `i` of `joins` (results in the same order; use explicit
/// ranks to make `i` the global rank). Each rank: its own thread and current-thread runtime, connects, wraps
/// the transport in `P2p::new(_, opts)`, runs `f`, then closes the connection cleanly.
pub fn run_ranks<R, F, Fut>(
    url: &str,
    joins: Vec<JoinOptions>,
    opts: CommOptions,
    f: F,
) -> Vec<Result<R>>
where
    R: Send,
    F: Fn(usize, Rc<P2p<WsTransport>>) -> Fut + Sync,
    Fut: Future<Output = Result<R>>,
{
    std::thread::scope(|s| {
        let handles: Vec<_> = joins
            .into_iter()
            .enumerate()
            .map(|(i, join)| {
                let f = &f;
                let opts = opts.clone();
                s.spawn(move || {
                    rank_runtime().block_on(async move {
                        let t = WsTransport::connect(url, join).await?;
                        let comm = Rc::new(P2p::new(t, opts));
                        let r = f(i, comm.clone()).await;
                        if let Ok(c) = Rc::try_unwrap(comm) {
                            c.into_transport().close().await;
                        }
                        r
                    })
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("rank thread panicked"))
            .collect()
    })
}

/// Unwrap every rank's result, naming the rank and the error otherwise.
pub fn all_ok<R>(what: &str, results: Vec<Result<R>>) -> Vec<R> {
    results
        .into_iter()
        .enumerate()
        .map(|(r, x)| x.unwrap_or_else(|e| panic!("{what}: rank {r} failed: {e}")))
        .collect()
}

// ---------------------------------------------------------------------------------------------
// A third-party client
// ---------------------------------------------------------------------------------------------

/// What a raw client saw next.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    Text(String),
    Binary(Bytes),
    /// A close frame: code and reason.
    Close(Option<(u16, String)>),
    /// The stream ended (or failed) without a close frame.
    Ended(String),
}

/// A plain tokio-tungstenite client.
pub struct Raw {
    pub ws: WebSocketStream<MaybeTlsStream<TcpStream>>,
}

/// The welcome fields a raw client got.
#[derive(Debug, Clone)]
pub struct Welcome {
    pub rank: u32,
    pub world: u32,
    pub token: String,
    pub members: Vec<u32>,
}

impl Raw {
    /// Connect (WebSocket handshake only).
    pub async fn connect(url: &str) -> Raw {
        let (ws, _) = tokio::time::timeout(WAIT, tokio_tungstenite::connect_async(url))
            .await
            .expect("WebSocket handshake timed out")
            .unwrap_or_else(|e| panic!("cannot connect to {url}: {e}"));
        Raw { ws }
    }

    /// Connect from the loopback address `from` (any of 127.0.0.0/8) to the relay at `addr`: the
    /// relay counts connections and waiting rooms per source address, so one host plays several
    /// machines. `Err`: the handshake failed (an HTTP refusal: its status and body).
    pub async fn connect_from(
        url: &str,
        addr: SocketAddr,
        from: std::net::IpAddr,
    ) -> std::result::Result<Raw, String> {
        Raw::connect_from_with(url, addr, from, &[]).await
    }

    /// [`Raw::connect_from`] with extra request headers (e.g. what a reverse proxy adds).
    pub async fn connect_from_with(
        url: &str,
        addr: SocketAddr,
        from: std::net::IpAddr,
        headers: &[(&str, &str)],
    ) -> std::result::Result<Raw, String> {
        use tokio_tungstenite::tungstenite::client::IntoClientRequest;
        let mut req = url.into_client_request().map_err(|e| e.to_string())?;
        for (k, v) in headers {
            req.headers_mut().append(
                tokio_tungstenite::tungstenite::http::HeaderName::from_bytes(k.as_bytes())
                    .map_err(|e| e.to_string())?,
                v.parse().map_err(|e| format!("{e}"))?,
            );
        }
        let sock = tokio::net::TcpSocket::new_v4().map_err(|e| e.to_string())?;
        sock.bind((from, 0).into())
            .map_err(|e| format!("bind {from}: {e}"))?;
        let tcp = tokio::time::timeout(WAIT, sock.connect(addr))
            .await
            .map_err(|_| "TCP connect timed out".to_string())?
            .map_err(|e| format!("TCP connect: {e}"))?;
        let hs = tokio_tungstenite::client_async(req, MaybeTlsStream::Plain(tcp));
        match tokio::time::timeout(WAIT, hs).await {
            Err(_) => Err("WebSocket handshake timed out".into()),
            Ok(Ok((ws, _))) => Ok(Raw { ws }),
            Ok(Err(tokio_tungstenite::tungstenite::Error::Http(r))) => Err(format!(
                "HTTP {}: {}",
                r.status().as_u16(),
                String::from_utf8_lossy(r.body().as_deref().unwrap_or_default())
            )),
            Ok(Err(e)) => Err(e.to_string()),
        }
    }

    /// Send a join (explicit rank) and return the relay's answer: the welcome, or the refusal.
    pub async fn send_join(
        &mut self,
        room: &str,
        token: Option<String>,
        world: u32,
        rank: u32,
        stream: bool,
    ) -> std::result::Result<Welcome, Refusal> {
        self.send_control(&Control::Join {
            room: room.into(),
            token,
            world,
            rank: Some(rank),
            stream,
        })
        .await;
        match self.next().await {
            Event::Text(t) => match serde_json::from_str::<Control>(&t) {
                Ok(Control::Welcome {
                    rank,
                    world,
                    token,
                    members,
                    ..
                }) => Ok(Welcome {
                    rank,
                    world,
                    token,
                    members,
                }),
                Ok(Control::Error { message }) => {
                    let mut r = self.expect_refusal().await;
                    r.error = Some(message);
                    Err(r)
                }
                other => panic!("joining {room:?}: expected welcome or error, got {other:?}"),
            },
            other => panic!("joining {room:?}: expected welcome or error, got {other:?}"),
        }
    }

    /// Connect and join (with the token named `token`, [`tok`]; `None`: the relay makes one);
    /// panics unless the relay answers with a welcome.
    pub async fn join(
        url: &str,
        room: &str,
        token: Option<&str>,
        world: u32,
        rank: u32,
    ) -> (Raw, Welcome) {
        let mut c = Raw::connect(url).await;
        c.send_control(&Control::Join {
            room: room.into(),
            token: token.map(tok),
            world,
            rank: Some(rank),
            stream: false,
        })
        .await;
        match c.next_control().await {
            Control::Welcome {
                rank,
                world,
                token,
                members,
                ..
            } => (
                c,
                Welcome {
                    rank,
                    world,
                    token,
                    members,
                },
            ),
            other => {
                panic!("joining room {room:?} as rank {rank}: expected welcome, got {other:?}")
            }
        }
    }

    pub async fn send_text(&mut self, s: &str) {
        tokio::time::timeout(WAIT, self.ws.send(Message::text(s.to_string())))
            .await
            .expect("sending text timed out")
            .expect("sending text");
    }

    pub async fn send_control(&mut self, c: &Control) {
        self.send_text(&serde_json::to_string(c).unwrap()).await;
    }

    /// Send a binary message; errors are returned (the relay may already have closed on us).
    pub async fn send_binary(&mut self, b: impl Into<Bytes>) -> std::result::Result<(), String> {
        match tokio::time::timeout(WAIT, self.ws.send(Message::Binary(b.into()))).await {
            Ok(r) => r.map_err(|e| e.to_string()),
            Err(_) => Err("sending binary timed out".into()),
        }
    }

    /// The next text / binary / close event within `within` (pings and pongs are skipped).
    pub async fn next_within(&mut self, within: Duration) -> Option<Event> {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            let m = tokio::time::timeout_at(deadline, self.ws.next())
                .await
                .ok()?;
            return Some(match m {
                None => Event::Ended("stream ended".into()),
                Some(Err(e)) => Event::Ended(format!("error: {e}")),
                Some(Ok(Message::Text(t))) => Event::Text(t.to_string()),
                Some(Ok(Message::Binary(b))) => Event::Binary(b),
                Some(Ok(Message::Close(f))) => {
                    Event::Close(f.map(|f| (u16::from(f.code), f.reason.to_string())))
                }
                Some(Ok(_)) => continue,
            });
        }
    }

    /// The next event; fails the test if none comes within [`WAIT`].
    pub async fn next(&mut self) -> Event {
        self.next_within(WAIT)
            .await
            .expect("no message from the relay within the wait bound")
    }

    /// The next control message (binary frames are an error here).
    pub async fn next_control(&mut self) -> Control {
        match self.next().await {
            Event::Text(t) => serde_json::from_str(&t)
                .unwrap_or_else(|e| panic!("relay sent malformed control JSON {t:?}: {e}")),
            other => panic!("expected a control message, got {other:?}"),
        }
    }

    /// Skip control messages until a `ready`.
    pub async fn wait_ready(&mut self) -> Vec<u32> {
        loop {
            match self.next_control().await {
                Control::Ready { members, .. } => return members,
                Control::Members { .. } => continue,
                other => panic!("waiting for ready, got {other:?}"),
            }
        }
    }

    /// The next binary frame, skipping `members` / `ready` notes; any other event fails the test.
    pub async fn next_frame(&mut self) -> (Header, Bytes) {
        loop {
            match self.next().await {
                Event::Binary(b) => {
                    let h = Header::decode(&b).unwrap_or_else(|e| {
                        panic!("relay forwarded a frame we cannot decode: {e}")
                    });
                    return (h, b.slice(distgrad::wire::HEADER_LEN..));
                }
                Event::Text(t) => match serde_json::from_str::<Control>(&t) {
                    Ok(Control::Members { .. } | Control::Ready { .. }) => continue,
                    other => panic!("expected a data frame, got control message {other:?}"),
                },
                other => panic!("expected a data frame, got {other:?}"),
            }
        }
    }

    /// The relay refused or dropped this connection: collect the `error` message (if any) and the
    /// close frame (if any) until the stream ends. Fails the test if the relay neither sends an
    /// error nor closes within [`WAIT`], or sends a data frame.
    pub async fn expect_refusal(&mut self) -> Refusal {
        let mut r = Refusal::default();
        loop {
            match self.next_within(WAIT).await {
                None => panic!(
                    "the relay did not close the connection within {WAIT:?} (saw so far: {r:?})"
                ),
                Some(Event::Text(t)) => match serde_json::from_str::<Control>(&t) {
                    Ok(Control::Error { message }) => r.error = Some(message),
                    Ok(
                        Control::PeerLeft { .. } | Control::Members { .. } | Control::Ready { .. },
                    ) => {}
                    other => panic!("expected an error and a close, got {other:?}"),
                },
                Some(Event::Binary(b)) => {
                    panic!(
                        "expected an error and a close, got a {}-byte data frame",
                        b.len()
                    )
                }
                Some(Event::Close(f)) => r.close = Some(f),
                Some(Event::Ended(why)) => {
                    r.ended = Some(why);
                    return r;
                }
            }
        }
    }
}

/// How a connection was refused.
#[derive(Debug, Default, Clone)]
pub struct Refusal {
    /// The text of the relay's `{"type":"error"}` message.
    pub error: Option<String>,
    /// The close frame: `Some(None)` = a close without code.
    pub close: Option<Option<(u16, String)>>,
    /// How the stream ended.
    pub ended: Option<String>,
}

impl Refusal {
    /// The close code and reason, if a close frame with a code came.
    pub fn close_reason(&self) -> Option<(u16, String)> {
        self.close.clone().flatten()
    }
}

/// A data frame: header (src as claimed by the sender) + payload.
pub fn frame(src: u32, dst: u32, seq: u64, payload: &[u8]) -> Bytes {
    Header {
        src,
        dst,
        tag: Tag {
            group: 0,
            seq,
            channel: Channel::P2p,
        },
        more: false,
    }
    .frame(payload)
}

// ---------------------------------------------------------------------------------------------
// Child processes
// ---------------------------------------------------------------------------------------------

/// A child process that is killed (and reaped) when dropped.
pub struct Child(pub Option<std::process::Child>);

impl Child {
    pub fn get(&mut self) -> &mut std::process::Child {
        self.0.as_mut().expect("child")
    }
}

impl Drop for Child {
    fn drop(&mut self) {
        if let Some(mut c) = self.0.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// True if `e` says that global rank `lost` is gone: `PeerLost { peer: lost }`, or an abort (by
/// anyone) whose reason names that rank as gone / lost / left (a peer that saw the loss first
/// aborts the others).
pub fn names_lost_rank(e: &Error, lost: usize) -> bool {
    match e {
        Error::PeerLost { peer, .. } => *peer == lost,
        Error::Aborted { reason, .. } => [
            format!("peer rank {lost} "),
            format!("rank {lost} is gone"),
            format!("rank {lost} was lost"),
            format!("rank {lost} left"),
            format!("lost rank {lost}"),
        ]
        .iter()
        .any(|p| reason.contains(p.as_str())),
        _ => false,
    }
}
