//! Native WebSocket transport through the relay ([`crate::relay`]). Needs a tokio runtime (its
//! reader and writer are tokio tasks); the collectives on top stay runtime-free.
//!
//! Messages larger than the relay's frame limit are split into fragments; the reader task
//! reassembles them and delivers whole messages into the [`Mailbox`]. The outgoing queue is bounded,
//! so a sender waits when the relay pushes back.
//!
//! By default ([`JoinOptions::stream`]) data goes through a **data stream** instead: a plain TCP
//! connection to the relay's port ([`crate::wire::StreamHello`]), attached while joining, that
//! carries whole messages without WebSocket framing, masking or fragmenting; the WebSocket keeps
//! the control messages. A relay reached on a loopback address that offers its Unix-domain socket
//! (the path comes in the `welcome`) gets the stream there instead ([`JoinOptions::local_stream`],
//! [`StreamRoute`]): the same frames without the TCP/IP stack. A relay that does not take streams
//! (or a connection that fails) leaves the data on the WebSocket.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures::{SinkExt, StreamExt};
use tokio::sync::mpsc;
use tokio_tungstenite::tungstenite::Message;

use super::session::{self, Event, JoinRequest, Linked, Session, Welcome, peer_left};
use super::{Mailbox, Tag, Transport, tcp_links};
use crate::error::{Error, Result};
use crate::wire::{
    Control, DEFAULT_FRAME_PAYLOAD, HEADER_LEN, Header, MAX_STREAM_PAYLOAD, MIN_FRAME_PAYLOAD,
    Reassembler, STREAM_CONTROL, StreamHello, fragments,
};

/// Called once when the relay admits this member, before the room is full (joining may then wait
/// a while for the others): with this member's rank, the room token and the ranks present. A
/// program that created the room tells its user the token here, so that the others can join.
#[derive(Clone)]
pub struct OnWelcome(pub Arc<WelcomeFn>);

/// What [`OnWelcome`] calls: `(rank, token, members present)`.
pub type WelcomeFn = dyn Fn(u32, &str, &[u32]) + Send + Sync;

impl std::fmt::Debug for OnWelcome {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("OnWelcome(..)")
    }
}

/// How to join a room.
#[derive(Debug, Clone)]
pub struct JoinOptions {
    /// Room name.
    pub room: String,
    /// Room token (required to join an existing room; sets it when creating one).
    pub token: Option<String>,
    /// World size.
    pub world: u32,
    /// Wanted rank, or any free one.
    pub rank: Option<u32>,
    /// How long to wait for the room to fill.
    pub ready_timeout: Duration,
    /// Largest frame payload to send (at most the relay's `max_frame`, which also counts payload).
    pub max_payload: usize,
    /// Largest message to reassemble from fragments; a peer sending more is a protocol fault.
    pub max_message: usize,
    /// Longest wait for room in the outgoing queue (the relay pushing back) before a send fails.
    pub send_timeout: Duration,
    /// Direct links: listen on this address (port 0: any) and exchange data with the room's
    /// other native members over TCP, the relay only introducing them ([`super::tcp_links`]);
    /// `None` (the default): everything through the relay.
    pub direct: Option<std::net::SocketAddr>,
    /// How long joining waits for the direct links to come up; pairs not linked by then use the
    /// relay.
    pub direct_timeout: Duration,
    /// Send data through a data stream to the relay (default; see the module docs) rather than
    /// through the WebSocket.
    pub stream: bool,
    /// With `stream`, attach it to the relay's Unix-domain socket when the relay offers one and
    /// was reached on a loopback address (default). If it cannot be reached the stream goes over
    /// TCP; if the relay refuses the hello there, the data goes on the WebSocket.
    pub local_stream: bool,
    /// Hears the relay's welcome (see [`OnWelcome`]); none by default.
    pub on_welcome: Option<OnWelcome>,
    /// For a `wss://` relay: also trust this PEM certificate (a relay with a self-signed one);
    /// certificates from public authorities are trusted anyway.
    pub ca_cert: Option<std::path::PathBuf>,
}

impl JoinOptions {
    /// Defaults: any rank, 60 s to fill, 1 MiB fragments.
    pub fn new(room: &str, world: u32) -> Self {
        JoinOptions {
            room: room.to_string(),
            token: None,
            world,
            rank: None,
            ready_timeout: Duration::from_secs(60),
            max_payload: DEFAULT_FRAME_PAYLOAD,
            max_message: 1 << 30,
            send_timeout: Duration::from_secs(60),
            direct: None,
            direct_timeout: Duration::from_secs(5),
            stream: true,
            local_stream: true,
            on_welcome: None,
            ca_cert: None,
        }
    }
}

/// One rank connected to a relay room.
pub struct WsTransport {
    rank: usize,
    world: usize,
    token: String,
    mailbox: Arc<Mailbox>,
    out: Option<mpsc::Sender<Message>>,
    max_payload: usize,
    send_timeout: Duration,
    reader: Option<tokio::task::JoinHandle<()>>,
    writer: Option<tokio::task::JoinHandle<()>>,
    links: std::collections::HashMap<usize, tcp_links::Link>,
    /// The data stream to the relay, if attached.
    data: Option<tcp_links::Link>,
    /// Which socket carries the data stream.
    data_route: Option<StreamRoute>,
}

/// The socket a data stream to the relay runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StreamRoute {
    /// A TCP connection to the relay's port.
    Tcp,
    /// The relay's Unix-domain socket (the member is on the relay's host).
    Unix,
}

/// The two halves of an attached data stream.
type StreamHalves = (
    Box<dyn tokio::io::AsyncRead + Send + Unpin>,
    Box<dyn tokio::io::AsyncWrite + Send + Unpin>,
    StreamRoute,
);

fn relay_err(detail: impl Into<String>) -> Error {
    Error::Relay {
        detail: detail.into(),
    }
}

/// A TLS client trusting the public authorities and the certificate(s) in the PEM file `pem`.
fn tls_connector(pem: &std::path::Path) -> Result<tokio_tungstenite::Connector> {
    use rustls::pki_types::CertificateDer;
    use rustls::pki_types::pem::PemObject;
    let bad =
        |e: &dyn std::fmt::Display| relay_err(format!("CA certificate {}: {e}", pem.display()));
    let mut roots = rustls::RootCertStore::empty();
    roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(pem)
        .map_err(|e| bad(&e))?
        .collect::<std::result::Result<_, _>>()
        .map_err(|e| bad(&e))?;
    if certs.is_empty() {
        return Err(bad(&"no certificate in the file"));
    }
    for c in certs {
        roots.add(c).map_err(|e| bad(&e))?;
    }
    let cfg = rustls::ClientConfig::builder_with_provider(crate::tls::provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| bad(&e))?
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok(tokio_tungstenite::Connector::Rustls(Arc::new(cfg)))
}

/// Why connecting to the relay failed; a refusal over HTTP (a relay over its per-address
/// connection limit answers 429) with the reason the relay gave in its body.
fn connect_error(url: &str, e: &tokio_tungstenite::tungstenite::Error) -> Error {
    let detail = match e {
        tokio_tungstenite::tungstenite::Error::Http(resp) => {
            let body = resp
                .body()
                .as_deref()
                .map(String::from_utf8_lossy)
                .unwrap_or_default();
            match body.trim() {
                "" => format!("the relay answered {}", resp.status()),
                why => format!("the relay answered {}: {why}", resp.status()),
            }
        }
        e => e.to_string(),
    };
    relay_err(format!("cannot connect to {url}: {detail}"))
}

/// The WebSocket to the relay, split.
type WsSink = futures::stream::SplitSink<
    tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>,
    Message,
>;
type WsStream = futures::stream::SplitStream<
    tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>,
>;

/// What joining gave: the relay's welcome, the data stream (if attached) and the direct-link keys.
struct Joined {
    welcome: Welcome,
    data_stream: Option<StreamHalves>,
    keys: tcp_links::LinkKeys,
}

/// The WebSocket to `url` (TLS trusting `opts.ca_cert` too), and the relay's address where a data
/// stream can reach it (a plain connection: streams do not go through TLS).
async fn open_socket(
    url: &str,
    opts: &JoinOptions,
) -> Result<(WsSink, WsStream, Option<std::net::SocketAddr>)> {
    let connector = match &opts.ca_cert {
        Some(pem) => Some(tls_connector(pem)?),
        None => None,
    };
    let (ws, _) = tokio_tungstenite::connect_async_tls_with_config(url, None, true, connector)
        .await
        .map_err(|e| connect_error(url, &e))?;
    let relay_addr = match ws.get_ref() {
        tokio_tungstenite::MaybeTlsStream::Plain(s) => s.peer_addr().ok(),
        _ => None,
    };
    let (sink, stream) = ws.split();
    Ok((sink, stream, relay_addr))
}

/// Send a control message on the WebSocket.
async fn send_control(sink: &mut WsSink, msg: &Control, what: &str) -> Result<()> {
    let text = serde_json::to_string(msg).map_err(|e| relay_err(e.to_string()))?;
    sink.send(Message::text(text))
        .await
        .map_err(|e| relay_err(format!("sending {what}: {e}")))
}

/// Join: send the session's join, then follow the relay's answers ([`Session`]) until the room
/// is ready, attaching the data stream when the welcome offers one.
async fn handshake(
    session: &mut Session,
    sink: &mut WsSink,
    stream: &mut WsStream,
    opts: &JoinOptions,
    relay_addr: Option<std::net::SocketAddr>,
) -> Result<Joined> {
    sink.send(Message::text(session.join_text()))
        .await
        .map_err(|e| relay_err(format!("sending join: {e}")))?;
    let mut data_stream = None;
    while let Some(msg) = stream.next().await {
        let msg = msg.map_err(|e| relay_err(format!("while joining: {e}")))?;
        let Message::Text(t) = msg else { continue };
        match session.on_text(&t).map_err(|e| relay_err(e.to_string()))? {
            Event::Welcome(w) => {
                if let Some(OnWelcome(f)) = &opts.on_welcome {
                    f(w.rank, &w.token, &w.members);
                }
                // The relay announces the room ready only once our stream is attached or we
                // said there is none.
                if let (Some(key), Some(addr)) = (&w.stream_key, relay_addr) {
                    data_stream = stream_or_none(sink, opts, &w, key, addr).await?;
                }
            }
            Event::Ready { link_keys, .. } => {
                let welcome = session
                    .welcome()
                    .cloned()
                    .ok_or_else(|| relay_err("ready before welcome"))?;
                let keys = link_keys
                    .as_ref()
                    .map(|k| tcp_links::parse_keys(k))
                    .unwrap_or_default();
                return Ok(Joined {
                    welcome,
                    data_stream,
                    keys,
                });
            }
            Event::Members(_)
            | Event::PeerLeft { .. }
            | Event::PeerAborted { .. }
            | Event::Signal { .. } => {}
        }
    }
    Err(relay_err("relay closed the connection while joining"))
}

/// Attach the data stream the welcome offers (through the relay's Unix-domain socket when the
/// relay is on this host and has one), or tell the relay there is none.
async fn stream_or_none(
    sink: &mut WsSink,
    opts: &JoinOptions,
    w: &Welcome,
    key: &str,
    addr: std::net::SocketAddr,
) -> Result<Option<StreamHalves>> {
    let hello = StreamHello {
        room: opts.room.clone(),
        rank: w.rank,
        key: key.to_string(),
    };
    let local = w
        .stream_path
        .as_deref()
        .filter(|_| opts.local_stream && addr.ip().to_canonical().is_loopback());
    match attach_stream(addr, local, &hello).await {
        Ok(s) => Ok(Some(s)),
        Err(_) => {
            send_control(sink, &Control::NoStream, "no-stream").await?;
            Ok(None)
        }
    }
}

/// The reader of the relay's WebSocket once the room runs: data frames into the mailbox,
/// control messages as the session says (a peer's leave or abort, direct-link signals, answered
/// when this rank makes no links); ends the mailbox with the reason the connection ended.
struct Reader {
    session: Session,
    mb: Arc<Mailbox>,
    linked: Arc<Linked>,
    rank: usize,
    world: usize,
    max_message: usize,
    direct_on: bool,
    /// Weak: the writer must still end when the transport drops its sender.
    replies: mpsc::WeakSender<Message>,
    signals: mpsc::UnboundedSender<(usize, tcp_links::PeerKind)>,
}

impl Reader {
    async fn run(mut self, mut stream: WsStream) {
        let mut parts = Reassembler::new(self.max_message);
        let reason = loop {
            let msg = match stream.next().await {
                None => break "the relay closed the connection".to_string(),
                Some(Err(e)) => break format!("connection to the relay failed: {e}"),
                Some(Ok(m)) => m,
            };
            let r = match msg {
                Message::Binary(b) => self.frame(&mut parts, b),
                Message::Text(t) => self.control(&t),
                Message::Close(_) => Err("the relay closed the connection".to_string()),
                _ => Ok(()),
            };
            if let Err(reason) = r {
                break reason;
            }
        };
        self.mb.abort_local(&reason);
    }

    fn frame(&self, parts: &mut Reassembler, b: Bytes) -> std::result::Result<(), String> {
        let h = Header::decode(&b).map_err(|e| format!("the relay sent a bad frame: {e}"))?;
        if let Some(m) = parts.push(h.src, &h, b.slice(HEADER_LEN..))? {
            self.mb.deliver(h.src as usize, h.tag, m);
        }
        Ok(())
    }

    fn control(&mut self, text: &str) -> std::result::Result<(), String> {
        match self.session.on_text(text).map_err(|e| e.to_string())? {
            Event::PeerLeft { rank, reason } => peer_left(&self.mb, &self.linked, rank, &reason),
            Event::PeerAborted { from, reason } => {
                session::peer_aborted(&self.mb, self.rank, self.world, from, reason)
            }
            Event::Signal { from, data } => self.signal(from, &data),
            Event::Welcome(_) | Event::Members(_) | Event::Ready { .. } => {}
        }
        Ok(())
    }

    /// A peer's direct-link signal: handed to the link setup (later ones are moot); a rank
    /// without direct links answers a peer that offers one, so that it does not wait for us
    /// (only such peers are told).
    fn signal(&self, from: u32, data: &serde_json::Value) {
        let kind = tcp_links::peer_kind(data);
        if !self.direct_on && matches!(kind, tcp_links::PeerKind::Listening(_)) {
            let reply = Control::Signal {
                to: Some(from),
                from: None,
                data: tcp_links::announcement(None),
            };
            if let Ok(text) = serde_json::to_string(&reply)
                && let Some(tx) = self.replies.upgrade()
            {
                tokio::spawn(async move {
                    let _ = tx.send(Message::text(text)).await;
                });
            }
        }
        let _ = self.signals.send((from as usize, kind));
    }
}

impl WsTransport {
    /// Connect to `url` (e.g. `ws://127.0.0.1:8080/ws`), join, and wait until the room is full.
    pub async fn connect(url: &str, opts: JoinOptions) -> Result<WsTransport> {
        let (mut sink, mut stream, relay_addr) = open_socket(url, &opts).await?;
        let mut session = Session::new(JoinRequest {
            room: opts.room.clone(),
            token: opts.token.clone(),
            world: opts.world,
            rank: opts.rank,
            stream: opts.stream && relay_addr.is_some(),
        });
        let joining = handshake(&mut session, &mut sink, &mut stream, &opts, relay_addr);
        let joined = match tokio::time::timeout(opts.ready_timeout, joining).await {
            Ok(r) => r?,
            Err(_) => return Err(session.fill_timeout(opts.ready_timeout)),
        };
        let (rank, world) = (joined.welcome.rank as usize, opts.world as usize);
        let mailbox = Arc::new(Mailbox::new(rank, world));
        // Peers we have a direct link with (set once the links are up): their clean leave is the
        // link's end, which comes after their last data on it; the relay's notice could overtake
        // that data.
        let linked = Arc::new(Linked::new(world));
        let data_route = joined.data_stream.as_ref().map(|(_, _, route)| *route);
        let data = joined.data_stream.map(|(rd, wr, _)| {
            let (tx, writer) = tcp_links::spawn_writer(wr);
            let mb = mailbox.clone();
            let max_message = opts.max_message;
            let linked = linked.clone();
            let reader = tokio::spawn(async move {
                let reason = read_stream(rd, &mb, &linked, rank, max_message).await;
                mb.abort_local(&reason);
            });
            (tx, reader, writer)
        });
        let (tx, mut rx) = mpsc::channel::<Message>(64);
        let writer = tokio::spawn(async move {
            while let Some(msg) = rx.recv().await {
                if sink.send(msg).await.is_err() {
                    break;
                }
            }
            let _ = sink.close().await;
        });
        let (signals, peer_signals) = mpsc::unbounded_channel();
        let reader = Reader {
            session,
            mb: mailbox.clone(),
            linked: linked.clone(),
            rank,
            world,
            max_message: opts.max_message,
            direct_on: opts.direct.is_some(),
            replies: tx.downgrade(),
            signals,
        };
        let reader = tokio::spawn(reader.run(stream));
        let links = link_peers(
            &opts,
            &tx,
            rank,
            world,
            &joined.keys,
            peer_signals,
            &mailbox,
        )
        .await?;
        for &r in links.keys() {
            linked.set(r);
        }
        Ok(WsTransport {
            rank,
            world,
            token: joined.welcome.token,
            mailbox,
            out: Some(tx),
            // Fragments fit the relay's frame limit as well as ours (a relay naming a limit
            // below the protocol's floor is not believed: frames that big are refused loudly;
            // a relay naming none has the default).
            max_payload: opts
                .max_payload
                .min(
                    joined
                        .welcome
                        .max_frame
                        .map_or(DEFAULT_FRAME_PAYLOAD, |m| m.max(MIN_FRAME_PAYLOAD)),
                )
                .max(1),
            send_timeout: opts.send_timeout,
            reader: Some(reader),
            writer: Some(writer),
            links,
            data,
            data_route,
        })
    }

    /// Wait at most `send_timeout` for a writer's queue to take a message: `gone` is the error
    /// when that writer has stopped, `route` names where the message was going.
    async fn queue<T>(
        &self,
        send: impl Future<Output = std::result::Result<(), mpsc::error::SendError<T>>>,
        gone: impl FnOnce() -> Error,
        route: &str,
    ) -> Result<()> {
        match tokio::time::timeout(self.send_timeout, send).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(_)) => Err(gone()),
            Err(_) => Err(Error::Transport {
                rank: self.rank,
                detail: format!(
                    "{route} accepted nothing for {:?} (receiver stalled?)",
                    self.send_timeout
                ),
            }),
        }
    }

    /// The socket of the data stream to the relay, if data goes through one (else through the
    /// WebSocket).
    pub fn data_stream_route(&self) -> Option<StreamRoute> {
        self.data_route
    }

    /// Whether data goes through a data stream to the relay (else through the WebSocket).
    pub fn has_data_stream(&self) -> bool {
        self.data.is_some()
    }

    /// The ranks this one exchanges data with over direct links (ascending); the others go
    /// through the relay.
    pub fn direct_peers(&self) -> Vec<usize> {
        let mut v: Vec<usize> = self.links.keys().copied().collect();
        v.sort_unstable();
        v
    }

    /// The room token (share it with the ranks that join later).
    pub fn token(&self) -> &str {
        &self.token
    }

    /// Flush what is queued, close the connection and wait (up to 10 s) for the relay to answer
    /// the close, so that everything sent before reached the relay (peers then see a clean leave).
    pub async fn close(mut self) {
        self.out.take();
        let limit = Duration::from_secs(10);
        // Direct links and the data stream first: each writer flushes what is queued and ends
        // its side of the connection (the relay forwards what came on the stream before it
        // announces our leave).
        let data = self.data.take();
        for (tx, _, writer) in std::mem::take(&mut self.links).into_values().chain(data) {
            drop(tx);
            let _ = tokio::time::timeout(limit, writer).await;
        }
        if let Some(w) = self.writer.take() {
            let _ = tokio::time::timeout(limit, w).await;
        }
        if let Some(r) = self.reader.as_mut() {
            let _ = tokio::time::timeout(limit, r).await;
        }
    }
}

impl Drop for WsTransport {
    fn drop(&mut self) {
        // Dropping the senders lets the writers flush what is queued and close; the readers stop
        // now.
        self.out.take();
        if let Some(r) = &self.reader {
            r.abort();
        }
        for (_, reader, _) in self.links.drain().map(|(_, l)| l).chain(self.data.take()) {
            reader.abort();
        }
    }
}

impl Transport for WsTransport {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.world
    }

    async fn send(&self, dst: usize, tag: Tag, payload: Bytes) -> Result<()> {
        let out = self.out.as_ref().ok_or_else(|| Error::Transport {
            rank: self.rank,
            detail: "transport closed".into(),
        })?;
        let closed = || Error::Transport {
            rank: self.rank,
            detail: "connection to the relay is closed".into(),
        };
        if let Some((link, _, _)) = self.links.get(&dst) {
            let head = tcp_links::frame_head(self.rank, dst, tag, payload.len());
            // The link's writer stopped: the peer is gone (its end closed or broke).
            let gone = || Error::PeerLost {
                rank: self.rank,
                peer: dst,
                call: String::new(),
                reason: "its direct link closed".into(),
            };
            let route = format!("rank {dst} on the direct link");
            return self.queue(link.send((head, payload)), gone, &route).await;
        }
        if let Some((stream, _, _)) = &self.data {
            // Whole messages (fragments only past MAX_STREAM_PAYLOAD), without copying.
            let n = payload.len().div_ceil(MAX_STREAM_PAYLOAD).max(1);
            for i in 0..n {
                let part = payload.slice(
                    (i * MAX_STREAM_PAYLOAD).min(payload.len())
                        ..((i + 1) * MAX_STREAM_PAYLOAD).min(payload.len()),
                );
                let head = tcp_links::frame_head_more(self.rank, dst, tag, part.len(), i + 1 < n);
                let route = "the relay on the data stream";
                self.queue(stream.send((head, part)), closed, route).await?;
            }
            return Ok(());
        }
        for frame in fragments(
            self.rank as u32,
            dst as u32,
            tag,
            &payload,
            self.max_payload,
        ) {
            self.queue(out.send(Message::binary(frame)), closed, "the relay")
                .await?;
        }
        Ok(())
    }

    async fn recv(&self, src: usize, tag: Tag) -> Result<Bytes> {
        if src >= self.world {
            return Err(Error::Transport {
                rank: self.rank,
                detail: format!("recv from rank {src} outside world of {}", self.world),
            });
        }
        self.mailbox.recv(src, tag).await
    }

    async fn abort(&self, reason: &str) {
        let reason = &crate::wire::clip(reason, crate::wire::MAX_ABORT_REASON);
        self.mailbox.abort_local(reason);
        // The relay's note on the WebSocket, beside the notes on every data route (direct links
        // included; a peer takes the first it gets). With a data stream the WebSocket carries no
        // data, so the relay's note reaches every member at once even while the data path holds
        // frames up (a member that stopped reading); without one it waits in line with the data.
        let control = async {
            if let Some(out) = &self.out
                && let Ok(text) = serde_json::to_string(&Control::Abort {
                    from: None,
                    reason: reason.to_string(),
                })
            {
                let _ =
                    tokio::time::timeout(self.send_timeout, out.send(Message::text(text))).await;
            }
        };
        futures::join!(control, session::abort_all(self, None, reason));
    }
}

/// With direct links (`opts.direct`): announce where we listen to every peer, then make the
/// links (peers without them answer, see [`Reader::signal`]). Nothing is sent before this ends,
/// so each direction keeps one route for its whole life.
async fn link_peers(
    opts: &JoinOptions,
    tx: &mpsc::Sender<Message>,
    rank: usize,
    world: usize,
    keys: &tcp_links::LinkKeys,
    peer_signals: mpsc::UnboundedReceiver<(usize, tcp_links::PeerKind)>,
    mailbox: &Arc<Mailbox>,
) -> Result<std::collections::HashMap<usize, tcp_links::Link>> {
    let Some(addr) = opts.direct else {
        return Ok(std::collections::HashMap::new());
    };
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| relay_err(format!("cannot listen for direct links on {addr}: {e}")))?;
    let here = listener.local_addr().ok();
    let note = tcp_links::announcement(here);
    for r in (0..world).filter(|&r| r != rank && here.is_some()) {
        let msg = Control::Signal {
            to: Some(r as u32),
            from: None,
            data: note.clone(),
        };
        let text = serde_json::to_string(&msg).map_err(|e| relay_err(e.to_string()))?;
        tx.send(Message::text(text))
            .await
            .map_err(|_| relay_err("the connection to the relay closed while joining"))?;
    }
    Ok(tcp_links::establish(
        rank,
        world,
        keys,
        listener,
        peer_signals,
        mailbox.clone(),
        opts.max_message,
        opts.direct_timeout,
    )
    .await)
}

/// Open a data stream to the relay and attach it with `hello`: on the Unix-domain socket at
/// `local` if given and it works, else over TCP to `addr`.
async fn attach_stream(
    addr: std::net::SocketAddr,
    local: Option<&str>,
    hello: &StreamHello,
) -> std::io::Result<StreamHalves> {
    let limit = Duration::from_secs(5);
    #[cfg(unix)]
    if let Some(sock) = local.and_then(|p| private_relay_socket(std::path::Path::new(p))) {
        // Not reachable (another filesystem view, say), or not our user's on the other end: TCP
        // is tried next. A connection the relay answered but refused means the key is spent,
        // and TCP would be refused too.
        let s =
            tokio::time::timeout(limit, tokio::net::UnixStream::connect(sock.connect_path())).await;
        drop(sock);
        if let Ok(Ok(mut s)) = s
            && s.peer_cred().is_ok_and(|c| c.uid() == own_uid())
        {
            crate::wire::enlarge_unix_buffer(&s);
            say_hello(&mut s, hello, limit).await?;
            let (rd, wr) = s.into_split();
            return Ok((Box::new(rd), Box::new(wr), StreamRoute::Unix));
        }
    }
    #[cfg(not(unix))]
    let _ = local;
    let mut s = tokio::time::timeout(limit, tokio::net::TcpStream::connect(addr))
        .await
        .map_err(|_| std::io::Error::other("connect timed out"))??;
    s.set_nodelay(true)?;
    say_hello(&mut s, hello, limit).await?;
    let (rd, wr) = s.into_split();
    Ok((Box::new(rd), Box::new(wr), StreamRoute::Tcp))
}

/// A relay's Unix-domain socket that only our user can reach, ready to connect to.
#[cfg(unix)]
struct PrivateSocket {
    /// The socket's directory, held open (Linux): the connection goes through this very
    /// directory, whatever its path names by then.
    #[cfg(target_os = "linux")]
    dir: std::fs::File,
    #[cfg(not(target_os = "linux"))]
    path: std::path::PathBuf,
}

#[cfg(unix)]
impl PrivateSocket {
    /// The path to connect to.
    fn connect_path(&self) -> std::path::PathBuf {
        #[cfg(target_os = "linux")]
        {
            use std::os::fd::AsRawFd;
            // The directory we checked, through our descriptor of it (not its name again).
            std::path::PathBuf::from(format!("/proc/self/fd/{}/relay.sock", self.dir.as_raw_fd()))
        }
        #[cfg(not(target_os = "linux"))]
        self.path.clone()
    }
}

/// `path` as a relay's Unix-domain socket that only our user can reach, or `None`: it must be
/// `<dir>/relay.sock`, absolute, where `<dir>` is named `distgrad-relay-*`, is a directory (not a
/// link), belongs to our user and is closed to everyone else (as `serve` makes it). A member only
/// connects to such a socket, whatever a relay names, so a relay cannot point it at another local
/// service's socket. On Linux the directory is opened once (no link followed at its last step),
/// checked through that descriptor and connected through it, so no one can swap what the path
/// names between the check and the connection; only our user can put a `relay.sock` in it.
#[cfg(unix)]
fn private_relay_socket(path: &std::path::Path) -> Option<PrivateSocket> {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let dir = path.parent()?;
    let named = path.is_absolute()
        && path.file_name().is_some_and(|f| f == "relay.sock")
        && dir
            .file_name()
            .and_then(|d| d.to_str())
            .is_some_and(|d| d.starts_with("distgrad-relay-"));
    if !named {
        return None;
    }
    let private = |m: &std::fs::Metadata| {
        m.is_dir() && m.uid() == own_uid() && m.permissions().mode() & 0o077 == 0
    };
    #[cfg(target_os = "linux")]
    {
        use std::os::unix::fs::OpenOptionsExt;
        let dir = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_PATH | libc::O_DIRECTORY | libc::O_NOFOLLOW)
            .open(dir)
            .ok()?;
        private(&dir.metadata().ok()?).then_some(PrivateSocket { dir })
    }
    #[cfg(not(target_os = "linux"))]
    {
        let m = std::fs::symlink_metadata(dir).ok()?;
        private(&m).then(|| PrivateSocket {
            path: path.to_path_buf(),
        })
    }
}

/// Our effective user id.
#[cfg(unix)]
fn own_uid() -> u32 {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

/// Send the stream hello on `s` and wait for the relay's yes.
async fn say_hello<S>(s: &mut S, hello: &StreamHello, limit: Duration) -> std::io::Result<()>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    s.write_all(&hello.encode()).await?;
    let mut ok = [0u8; 1];
    tokio::time::timeout(limit, s.read_exact(&mut ok))
        .await
        .map_err(|_| std::io::Error::other("no answer to the stream hello"))??;
    if ok[0] != 1 {
        return Err(std::io::Error::other("the relay refused the data stream"));
    }
    Ok(())
}

/// Read the data stream from the relay into `mb` until it ends; returns why it ended.
async fn read_stream(
    mut rd: impl tokio::io::AsyncRead + Unpin,
    mb: &Mailbox,
    linked: &Linked,
    me: usize,
    max_message: usize,
) -> String {
    use tokio::io::AsyncReadExt;
    let failed = |e: std::io::Error| format!("the data stream from the relay failed: {e}");
    let mut parts = Reassembler::new(max_message);
    loop {
        let mut len = [0u8; 4];
        if let Err(e) = rd.read_exact(&mut len).await {
            return failed(e);
        }
        let len = u32::from_le_bytes(len);
        if len & STREAM_CONTROL != 0 {
            let n = (len & !STREAM_CONTROL) as usize;
            if n > crate::wire::MAX_STREAM_CONTROL {
                return format!("the relay sent a control frame of {n} bytes");
            }
            let mut text = vec![0u8; n];
            if let Err(e) = rd.read_exact(&mut text).await {
                return failed(e);
            }
            match serde_json::from_slice::<Control>(&text) {
                // In order with the data: everything the peer sent before leaving is delivered.
                Ok(Control::PeerLeft { rank, reason }) => peer_left(mb, linked, rank, &reason),
                Ok(_) => {}
                Err(e) => return format!("malformed control frame from the relay: {e}"),
            }
            continue;
        }
        let Some(n) = (len as usize).checked_sub(HEADER_LEN) else {
            return format!("the relay sent a frame of {len} bytes, shorter than a header");
        };
        if n > max_message {
            return format!("the relay sent a frame of {n} bytes (limit {max_message})");
        }
        let mut head = [0u8; HEADER_LEN];
        if let Err(e) = rd.read_exact(&mut head).await {
            return failed(e);
        }
        let h = match Header::decode(&head) {
            Ok(h) if h.dst as usize != me => {
                return format!("the relay sent a frame for rank {}", h.dst);
            }
            Ok(h) => h,
            Err(e) => return format!("the relay sent a bad frame: {e}"),
        };
        let payload = match tcp_links::read_payload(&mut rd, n).await {
            Ok(p) => p,
            Err(e) => return failed(e),
        };
        match parts.push(h.src, &h, payload) {
            Ok(Some(m)) => mb.deliver(h.src as usize, h.tag, m),
            Ok(None) => {}
            Err(e) => return e,
        }
    }
}

#[cfg(all(test, unix))]
mod tests {
    use super::private_relay_socket;
    use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
    use std::path::{Path, PathBuf};

    /// A fresh directory under the temporary directory, named `name-<pid>-<n>`, with `mode`.
    fn dir(name: &str, mode: u32) -> PathBuf {
        use std::sync::atomic::{AtomicUsize, Ordering};
        static N: AtomicUsize = AtomicUsize::new(0);
        let d = std::env::temp_dir().join(format!(
            "{name}-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::DirBuilder::new().mode(mode).create(&d).unwrap();
        // The umask may have narrowed the mode; set it exactly.
        std::fs::set_permissions(&d, std::fs::Permissions::from_mode(mode)).unwrap();
        d
    }

    #[test]
    fn only_our_private_relay_directories_are_trusted() {
        let good = dir("distgrad-relay-test", 0o700);
        assert!(private_relay_socket(&good.join("relay.sock")).is_some());
        // Another name in the right directory, or the right name elsewhere.
        assert!(private_relay_socket(&good.join("other.sock")).is_none());
        let elsewhere = dir("not-a-relay", 0o700);
        assert!(private_relay_socket(&elsewhere.join("relay.sock")).is_none());
        // A directory others may enter or list.
        let open = dir("distgrad-relay-open", 0o755);
        assert!(private_relay_socket(&open.join("relay.sock")).is_none());
        // Relative paths, and a path with no directory.
        assert!(private_relay_socket(Path::new("distgrad-relay-x/relay.sock")).is_none());
        assert!(private_relay_socket(Path::new("/relay.sock")).is_none());
        // A link named like a relay directory, pointing at a private directory: refused (the
        // link itself, not its target, must be the directory).
        let link = std::env::temp_dir().join(format!("distgrad-relay-link-{}", std::process::id()));
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink(&good, &link).unwrap();
        assert!(private_relay_socket(&link.join("relay.sock")).is_none());
        // A directory that does not exist.
        assert!(
            private_relay_socket(
                &std::env::temp_dir().join("distgrad-relay-absent-xyz/relay.sock")
            )
            .is_none()
        );
        let _ = std::fs::remove_file(&link);
        for d in [good, elsewhere, open] {
            let _ = std::fs::remove_dir(d);
        }
    }

    /// The checked directory is the one connected through, even if its path names another
    /// directory by the time of the connection (Linux: through the held descriptor).
    #[cfg(target_os = "linux")]
    #[test]
    fn the_connection_goes_to_the_checked_directory() {
        use std::io::{Read, Write};
        use std::os::unix::net::{UnixListener, UnixStream};
        let checked = dir("distgrad-relay-checked", 0o700);
        let listener = UnixListener::bind(checked.join("relay.sock")).unwrap();
        listener.set_nonblocking(true).unwrap();
        let sock = private_relay_socket(&checked.join("relay.sock")).expect("a private directory");
        // Swap: the checked directory moves away; another one, with its own socket, takes its name.
        let moved = checked.with_extension("moved");
        std::fs::rename(&checked, &moved).unwrap();
        std::fs::DirBuilder::new()
            .mode(0o700)
            .create(&checked)
            .unwrap();
        let impostor = UnixListener::bind(checked.join("relay.sock")).unwrap();
        impostor.set_nonblocking(true).unwrap();
        let mut c =
            UnixStream::connect(sock.connect_path()).expect("connect through the descriptor");
        c.write_all(b"x").unwrap();
        let (mut a, _) = listener
            .accept()
            .expect("the checked directory's socket answers");
        let mut b = [0u8; 1];
        a.read_exact(&mut b).unwrap();
        assert_eq!(&b, b"x");
        assert!(
            impostor.accept().is_err(),
            "the impostor got the connection"
        );
        for d in [&checked, &moved] {
            let _ = std::fs::remove_file(d.join("relay.sock"));
            let _ = std::fs::remove_dir(d);
        }
    }
}
