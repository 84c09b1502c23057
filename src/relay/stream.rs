//! Data streams: native members' plain TCP connections to the relay ([`crate::wire::StreamHello`]),
//! or Unix-domain connections for members on the relay's own host.
//!
//! The relay's listener sorts accepted connections by their first byte: a data stream's hello
//! starts with a non-ASCII byte, anything else goes to the HTTP server (page, WebSocket). On Unix
//! the relay also listens on a Unix-domain socket whose path it tells members in their `welcome`
//! ([`LocalListener`]); every connection there is a data stream. Members that reached the relay on
//! a loopback address attach there first: the same frames, without the TCP/IP stack's work. A stream
//! is attached to the member whose `welcome` carried its key, before the room is announced ready,
//! so each member's data route (stream or WebSocket) is fixed for the whole session.
//!
//! One task per stream reads its frames. A frame for a member with a stream is forwarded while
//! holding that member's write lock: header first (source stamped), then the payload moved socket
//! to socket, piece by piece (`splice(2)` through a pipe on Linux, else a 256 KiB buffer), so the
//! relay never holds a whole frame and a slow receiver slows its senders through TCP itself. A
//! frame for a member without a stream (a browser) is cut into WebSocket frames of at most
//! `max_frame` bytes and queued under that member's byte budget, like WebSocket traffic.
//! A receiver that accepts nothing for `idle_timeout` is disconnected; so is a sender that stops
//! halfway through a frame.

use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::BytesMut;
#[cfg(target_os = "linux")]
use tokio::io::Interest;
#[cfg(unix)]
use tokio::net::UnixStream;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;

use super::budget::charge;
use super::watch::Watched;
use super::{AddrSlot, Link, Out, Seat, Shared};
use crate::wire::{FLAG_MORE, HEADER_LEN, Header, STREAM_CONTROL, STREAM_MAGIC, StreamHello};

/// Payloads up to this size are read whole before the destination is locked (one write).
const SMALL: usize = 64 << 10;
/// Buffer of the portable (non-splice) forwarding loop.
const CHUNK: usize = 256 << 10;

/// A data stream's socket: TCP, or Unix-domain for members on the relay's host.
pub(super) enum Sock {
    /// A TCP connection to the relay's port.
    Tcp(TcpStream),
    /// A connection to the relay's Unix-domain socket.
    #[cfg(unix)]
    Unix(UnixStream),
}

impl Sock {
    fn try_read(&self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Sock::Tcp(s) => s.try_read(buf),
            #[cfg(unix)]
            Sock::Unix(s) => s.try_read(buf),
        }
    }

    fn try_write_vectored(&self, bufs: &[io::IoSlice<'_>]) -> io::Result<usize> {
        match self {
            Sock::Tcp(s) => s.try_write_vectored(bufs),
            #[cfg(unix)]
            Sock::Unix(s) => s.try_write_vectored(bufs),
        }
    }

    async fn readable(&self) -> io::Result<()> {
        match self {
            Sock::Tcp(s) => s.readable().await,
            #[cfg(unix)]
            Sock::Unix(s) => s.readable().await,
        }
    }

    async fn writable(&self) -> io::Result<()> {
        match self {
            Sock::Tcp(s) => s.writable().await,
            #[cfg(unix)]
            Sock::Unix(s) => s.writable().await,
        }
    }

    /// Run a non-blocking operation on the raw socket, clearing tokio's readiness on "would block".
    #[cfg(target_os = "linux")]
    fn try_io<R>(&self, interest: Interest, f: impl FnOnce() -> io::Result<R>) -> io::Result<R> {
        match self {
            Sock::Tcp(s) => s.try_io(interest, f),
            Sock::Unix(s) => s.try_io(interest, f),
        }
    }

    #[cfg(target_os = "linux")]
    fn raw_fd(&self) -> std::os::fd::RawFd {
        use std::os::fd::AsRawFd;
        match self {
            Sock::Tcp(s) => s.as_raw_fd(),
            Sock::Unix(s) => s.as_raw_fd(),
        }
    }

    fn shutdown(&self) {
        let _ = match self {
            Sock::Tcp(s) => socket2::SockRef::from(s).shutdown(std::net::Shutdown::Both),
            #[cfg(unix)]
            Sock::Unix(s) => socket2::SockRef::from(s).shutdown(std::net::Shutdown::Both),
        };
    }
}

/// A member's data stream, as its senders see it.
pub(super) struct StreamOut {
    sock: Sock,
    /// Held while one frame is written, so frames from different senders never interleave.
    lock: tokio::sync::Mutex<()>,
    /// Becomes true when this member's own frames are all forwarded (its stream ended).
    done: tokio::sync::watch::Sender<bool>,
}

impl StreamOut {
    /// Write one encoded frame (header + payload) with its length prefix.
    pub(super) async fn send_frame(&self, frame: &[u8], timeout: Duration) -> io::Result<()> {
        let _g = self.lock.lock().await;
        let len = (frame.len() as u32).to_le_bytes();
        write_all_parts(&self.sock, &[&len, frame], timeout).await
    }

    /// Write a control message (JSON) as a control frame.
    pub(super) async fn send_control(&self, text: &str, timeout: Duration) -> io::Result<()> {
        let _g = self.lock.lock().await;
        let mut frame = Vec::with_capacity(4 + text.len());
        frame.extend_from_slice(&(text.len() as u32 | STREAM_CONTROL).to_le_bytes());
        frame.extend_from_slice(text.as_bytes());
        write_all(&self.sock, &frame, timeout).await
    }

    /// Wait (at most `limit`) until every frame this member sent on its stream was forwarded.
    pub(super) async fn drained(&self, limit: Duration) {
        let mut rx = self.done.subscribe();
        let _ = tokio::time::timeout(limit, rx.wait_for(|d| *d)).await;
    }

    /// Close both directions now (the member left): its reader and its client see the end.
    pub(super) fn shutdown(&self) {
        self.sock.shutdown();
    }
}

/// The relay's listener as axum sees it: only the connections that are not data streams.
pub(super) struct Incoming {
    rx: mpsc::Receiver<(Watched<Conn>, SocketAddr)>,
    local: SocketAddr,
}

impl Incoming {
    /// Accept on `listener`, handle data streams here and pass everything else on.
    pub(super) fn new(listener: TcpListener, shared: Arc<Shared>) -> io::Result<Incoming> {
        let local = listener.local_addr()?;
        let (tx, rx) = mpsc::channel(64);
        tokio::spawn(async move {
            loop {
                let (sock, addr) = tokio::select! {
                    r = listener.accept() => match r {
                        Ok(c) => c,
                        // Out of descriptors and the like: wait a little rather than spin.
                        Err(_) => {
                            tokio::time::sleep(Duration::from_millis(50)).await;
                            continue;
                        }
                    },
                    // The server stopped accepting (shutdown).
                    () = tx.closed() => break,
                };
                // Small control frames and latency-bound collectives must not wait for Nagle.
                let _ = sock.set_nodelay(true);
                let (tx, shared) = (tx.clone(), shared.clone());
                // Counted in the order of arrival, before anything else runs for it.
                let slot = AddrSlot::take(&shared, addr.ip());
                // Sorted in its own task: a silent connection holds up nobody.
                tokio::spawn(async move {
                    let slot = match slot {
                        Ok(slot) => slot,
                        Err(why) => {
                            let why = why.to_string();
                            return refuse(sock, TOO_MANY, &why, shared.cfg.join_timeout).await;
                        }
                    };
                    let mut first = [0u8; 1];
                    let peek = tokio::time::timeout(shared.cfg.join_timeout, sock.peek(&mut first));
                    match peek.await {
                        // Where TLS is required, plain HTTP is told so and plain streams are
                        // dropped (their clients fall back to the WebSocket, over TLS).
                        Ok(Ok(1)) if shared.cfg.require_tls && first[0] == STREAM_MAGIC[0] => {}
                        Ok(Ok(1)) if shared.cfg.require_tls && first[0] != 0x16 => {
                            let why = "this relay takes only TLS: use https:// and wss://";
                            refuse(sock, FORBIDDEN, why, shared.cfg.join_timeout).await;
                        }
                        Ok(Ok(1)) if first[0] == STREAM_MAGIC[0] && shared.cfg.streams => {
                            attach(shared, Sock::Tcp(sock)).await;
                        }
                        // A stream when streams are off: dropped (its client falls back).
                        Ok(Ok(1)) if first[0] == STREAM_MAGIC[0] => {}
                        // A TLS handshake (ClientHello), where the relay has a certificate.
                        Ok(Ok(1)) if first[0] == 0x16 && shared.cfg.tls.is_some() => {
                            let Some(cfg) = shared.cfg.tls.clone() else {
                                return;
                            };
                            let plain = Counted { sock, _slot: slot };
                            let tls = tokio_rustls::TlsAcceptor::from(cfg).accept(plain);
                            if let Ok(Ok(s)) =
                                tokio::time::timeout(shared.cfg.join_timeout, tls).await
                            {
                                let conn = watched(&shared, Conn::Tls(Box::new(s)));
                                let _ = tx.send((conn, addr)).await;
                            }
                        }
                        Ok(Ok(1)) => {
                            let conn = watched(&shared, Conn::Plain(Counted { sock, _slot: slot }));
                            let _ = tx.send((conn, addr)).await;
                        }
                        // Nothing within the join timeout (or closed): let it go.
                        _ => {}
                    }
                });
            }
        });
        Ok(Incoming { rx, local })
    }
}

/// `conn` under the relay's HTTP time limits: each request's headers within the join timeout,
/// the idle timeout between requests (`src/relay/watch.rs`).
fn watched(shared: &Shared, conn: Conn) -> Watched<Conn> {
    Watched::new(conn, shared.cfg.join_timeout, shared.cfg.idle_timeout)
}

/// The status line of a refusal for a connection over a cap.
const TOO_MANY: &str = "429 Too Many Requests";
/// The status line of a refusal for a plain connection where TLS is required.
const FORBIDDEN: &str = "403 Forbidden";

/// Answer a connection refused before HTTP (over a cap, or plain where TLS is required) with
/// `status` saying why (a WebSocket client shows the status; a browser's console shows the
/// handshake failure), then close it.
async fn refuse(mut sock: TcpStream, status: &str, why: &str, limit: Duration) {
    use tokio::io::AsyncWriteExt;
    let body = format!("{why}\n");
    let answer = format!(
        "HTTP/1.1 {status}\r\ncontent-type: text/plain; charset=utf-8\r\n\
         content-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    let _ = tokio::time::timeout(limit, sock.write_all(answer.as_bytes())).await;
    let _ = sock.shutdown().await;
}

/// A TCP connection counted against its source address while it is open.
pub(super) struct Counted {
    sock: TcpStream,
    _slot: AddrSlot,
}

impl tokio::io::AsyncRead for Counted {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<io::Result<()>> {
        std::pin::Pin::new(&mut self.sock).poll_read(cx, buf)
    }
}

impl tokio::io::AsyncWrite for Counted {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<io::Result<usize>> {
        std::pin::Pin::new(&mut self.sock).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> std::task::Poll<io::Result<usize>> {
        std::pin::Pin::new(&mut self.sock).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.sock.is_write_vectored()
    }

    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<io::Result<()>> {
        std::pin::Pin::new(&mut self.sock).poll_flush(cx)
    }

    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<io::Result<()>> {
        std::pin::Pin::new(&mut self.sock).poll_shutdown(cx)
    }
}

/// An HTTP connection to the relay: plain, or TLS where the relay has a certificate.
pub(super) enum Conn {
    Plain(Counted),
    Tls(Box<tokio_rustls::server::TlsStream<Counted>>),
}

impl tokio::io::AsyncRead for Conn {
    fn poll_read(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<io::Result<()>> {
        match self.get_mut() {
            Conn::Plain(s) => std::pin::Pin::new(s).poll_read(cx, buf),
            Conn::Tls(s) => std::pin::Pin::new(s.as_mut()).poll_read(cx, buf),
        }
    }
}

impl tokio::io::AsyncWrite for Conn {
    fn poll_write(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<io::Result<usize>> {
        match self.get_mut() {
            Conn::Plain(s) => std::pin::Pin::new(s).poll_write(cx, buf),
            Conn::Tls(s) => std::pin::Pin::new(s.as_mut()).poll_write(cx, buf),
        }
    }

    fn poll_write_vectored(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> std::task::Poll<io::Result<usize>> {
        match self.get_mut() {
            Conn::Plain(s) => std::pin::Pin::new(s).poll_write_vectored(cx, bufs),
            Conn::Tls(s) => std::pin::Pin::new(s.as_mut()).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            Conn::Plain(s) => s.is_write_vectored(),
            Conn::Tls(s) => s.is_write_vectored(),
        }
    }

    fn poll_flush(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<io::Result<()>> {
        match self.get_mut() {
            Conn::Plain(s) => std::pin::Pin::new(s).poll_flush(cx),
            Conn::Tls(s) => std::pin::Pin::new(s.as_mut()).poll_flush(cx),
        }
    }

    fn poll_shutdown(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<io::Result<()>> {
        match self.get_mut() {
            Conn::Plain(s) => std::pin::Pin::new(s).poll_shutdown(cx),
            Conn::Tls(s) => std::pin::Pin::new(s.as_mut()).poll_shutdown(cx),
        }
    }
}

impl axum::serve::Listener for Incoming {
    type Io = Watched<Conn>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Watched<Conn>, SocketAddr) {
        match self.rx.recv().await {
            Some(c) => c,
            // The accepting task ended: nothing more will come.
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> io::Result<SocketAddr> {
        Ok(self.local)
    }
}

/// The address a WebSocket member connected from (what `serve` tells the handler).
#[derive(Clone, Copy, Debug)]
pub(super) struct PeerAddr(pub(super) SocketAddr);

impl axum::extract::connect_info::Connected<axum::serve::IncomingStream<'_, Incoming>>
    for PeerAddr
{
    fn connect_info(s: axum::serve::IncomingStream<'_, Incoming>) -> PeerAddr {
        PeerAddr(*s.remote_addr())
    }
}

/// The relay's Unix-domain socket for data streams of members on its host: `relay.sock` in a
/// directory of its own under the temporary directory, both reachable by the relay's user only
/// (the directory is private before the socket exists, so there is no moment when others could
/// connect), both removed when dropped.
#[cfg(unix)]
pub(super) struct LocalListener {
    dir: std::path::PathBuf,
    path: std::path::PathBuf,
    /// The accepting task: it ends with the relay, or when this is dropped (on any path out of
    /// `serve`, including its errors).
    accepting: Option<tokio::task::JoinHandle<()>>,
}

#[cfg(unix)]
impl LocalListener {
    /// Listen on a new socket file and attach the data streams that arrive until the relay stops.
    pub(super) fn start(shared: Arc<Shared>) -> io::Result<LocalListener> {
        use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
        let dir = std::env::temp_dir().join(format!(
            "distgrad-relay-{}-{}",
            std::process::id(),
            &super::random_token()?[..12]
        ));
        // Fails if the name exists: never a directory someone else prepared.
        std::fs::DirBuilder::new().mode(0o700).create(&dir)?;
        let mut me = LocalListener {
            path: dir.join("relay.sock"),
            dir,
            accepting: None,
        };
        let listener = tokio::net::UnixListener::bind(&me.path)?;
        std::fs::set_permissions(&me.path, std::fs::Permissions::from_mode(0o600))?;
        let mut stopping = shared.stopping.clone();
        me.accepting = Some(tokio::spawn(async move {
            loop {
                let sock = tokio::select! {
                    r = listener.accept() => match r {
                        Ok((s, _)) => s,
                        Err(_) => {
                            tokio::time::sleep(Duration::from_millis(50)).await;
                            continue;
                        }
                    },
                    () = super::stopped(&mut stopping) => break,
                };
                crate::wire::enlarge_unix_buffer(&sock);
                tokio::spawn(attach(shared.clone(), Sock::Unix(sock)));
            }
        }));
        Ok(me)
    }

    /// The socket's path, as members are told it.
    pub(super) fn path(&self) -> &std::path::Path {
        &self.path
    }
}

#[cfg(unix)]
impl Drop for LocalListener {
    fn drop(&mut self) {
        if let Some(t) = self.accepting.take() {
            t.abort();
        }
        let _ = std::fs::remove_file(&self.path);
        let _ = std::fs::remove_dir(&self.dir);
    }
}

/// Read a stream's hello, attach it to its member and forward its frames until it ends.
async fn attach(shared: Arc<Shared>, sock: Sock) {
    let limit = shared.cfg.join_timeout;
    let hello = async {
        let mut head = [0u8; 8];
        read_exact(&sock, &mut head, limit)
            .await
            .map_err(|e| e.to_string())?;
        let mut body = vec![0u8; StreamHello::body_len(&head)?];
        read_exact(&sock, &mut body, limit)
            .await
            .map_err(|e| e.to_string())?;
        StreamHello::decode(&body)
    };
    let Ok(Ok(hello)) = tokio::time::timeout(limit, hello).await else {
        let _ = write_all(&sock, &[0], limit).await;
        return;
    };
    let out = Arc::new(StreamOut {
        sock,
        lock: tokio::sync::Mutex::new(()),
        done: tokio::sync::watch::Sender::new(false),
    });
    // The answer must precede any frame for this member: hold its write lock until it is sent
    // (once attached, the room may turn ready and peers may send at once).
    let guard = out.lock.lock().await;
    let seated = seat(&shared, &hello, &out);
    let answer = if seated.is_ok() { 1 } else { 0 };
    let answered = write_all(&out.sock, &[answer], limit).await;
    drop(guard);
    let Ok((seat, kill)) = seated else { return };
    if answered.is_err() {
        let _ = kill.send(Some("its data stream failed while attaching".into()));
        return;
    }
    let r = pump(&shared, &seat, &out).await;
    out.done.send_replace(true);
    if let Err(reason) = r {
        let _ = kill.send(Some(reason));
    }
}

/// Attach `out` to the member `hello` names, if the key is that member's and it has no stream yet.
#[allow(clippy::type_complexity)]
fn seat(
    shared: &Shared,
    hello: &StreamHello,
    out: &Arc<StreamOut>,
) -> Result<(Seat, Arc<tokio::sync::watch::Sender<Option<String>>>), String> {
    let mut rooms = shared.rooms();
    let r = rooms.get_mut(&hello.room).ok_or("no such room")?;
    let m = r.members.get_mut(&hello.rank).ok_or("no such member")?;
    if m.settled
        || !m
            .key
            .as_deref()
            .is_some_and(|k| crate::wire::secret_eq(k, &hello.key))
        || m.link.stream.set(out.clone()).is_err()
    {
        return Err("wrong key, or the member's route is already settled".into());
    }
    m.settled = true;
    let kill = m.link.kill.clone();
    super::ready_check(r, &shared.cfg);
    Ok((
        Seat {
            room: hello.room.clone(),
            room_id: r.id,
            rank: hello.rank,
        },
        kill,
    ))
}

/// Which end of a forward failed.
enum Fault {
    /// The sending member (its stream broke or stalled): it is disconnected.
    Src(String),
    /// The receiving member: it is disconnected; `left` payload bytes of the frame remain unread
    /// on the sender's stream.
    Dst(String, usize),
}

/// Forward the frames of `seat`'s stream until it ends: `Ok` on a clean end between frames.
async fn pump(shared: &Shared, seat: &Seat, src: &StreamOut) -> Result<(), String> {
    let cfg = &shared.cfg;
    let limit = cfg.idle_timeout.max(Duration::from_millis(10));
    let mut mover = Mover::new(cfg.splice);
    let mut head = [0u8; 4 + HEADER_LEN];
    let fail = |e: io::Error| format!("data stream failed: {e}");
    loop {
        // Between frames the stream may rest indefinitely (the WebSocket keeps the member alive).
        match read_exact(&src.sock, &mut head[..4], Duration::MAX).await {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(fail(e)),
        }
        let len = u32::from_le_bytes([head[0], head[1], head[2], head[3]]);
        if len & STREAM_CONTROL != 0 {
            return Err("control messages go on the WebSocket, not the data stream".into());
        }
        let len = len as usize;
        read_exact(&src.sock, &mut head[4..], limit)
            .await
            .map_err(fail)?;
        let n = len
            .checked_sub(HEADER_LEN)
            .ok_or_else(|| format!("data stream frame of {len} bytes is shorter than a header"))?;
        let h = Header::decode(&head[4..]).map_err(|e| format!("bad data frame: {e}"))?;
        Header::stamp_src(&mut head[4..], seat.rank);
        // The destination left (its peers were told): drop the frame.
        let Some(d) = shared.dest(seat, h.dst)? else {
            mover.discard(&src.sock, n, limit).await.map_err(fail)?;
            continue;
        };
        let Some(dst) = d.stream.get() else {
            to_websocket(shared, &mut mover, &src.sock, &d, &head[4..], n, limit).await?;
            continue;
        };
        match forward(&mut mover, &src.sock, dst, &head, n, limit).await {
            Ok(()) => {}
            Err(Fault::Src(e)) => return Err(e),
            Err(Fault::Dst(e, left)) => {
                let _ = d.kill.send(Some(format!("its data stream failed: {e}")));
                dst.shutdown();
                mover.discard(&src.sock, left, limit).await.map_err(fail)?;
            }
        }
    }
}

/// Forward one frame to a member's stream: the head, then `n` payload bytes from `src`.
async fn forward(
    mover: &mut Mover,
    src: &Sock,
    dst: &StreamOut,
    head: &[u8],
    n: usize,
    limit: Duration,
) -> Result<(), Fault> {
    if n <= SMALL {
        // Read it whole first (it is usually there already), then write it with one call.
        let frame = &mut mover.small;
        frame.clear();
        frame.extend_from_slice(head);
        frame.resize(head.len() + n, 0);
        read_exact(src, &mut frame[head.len()..], limit)
            .await
            .map_err(|e| Fault::Src(format!("data stream failed: {e}")))?;
        let _g = dst.lock.lock().await;
        return write_all(&dst.sock, frame, limit)
            .await
            .map_err(|e| Fault::Dst(e.to_string(), 0));
    }
    let _g = dst.lock.lock().await;
    write_all(&dst.sock, head, limit)
        .await
        .map_err(|e| Fault::Dst(e.to_string(), n))?;
    mover.forward(src, &dst.sock, n, limit).await
}

/// Forward one frame to a member without a stream: WebSocket frames of at most `max_frame` payload
/// bytes (`more` set on all but the message's last), each charged to its queue budget.
async fn to_websocket(
    shared: &Shared,
    mover: &mut Mover,
    src: &Sock,
    d: &Link,
    header: &[u8],
    n: usize,
    limit: Duration,
) -> Result<(), String> {
    let max = shared.cfg.max_frame.max(1);
    let last_of_message = header[2] & FLAG_MORE == 0;
    let mut left = n;
    loop {
        let k = left.min(max);
        let mut f = BytesMut::with_capacity(HEADER_LEN + k);
        f.extend_from_slice(header);
        if left > k || !last_of_message {
            f[2] |= FLAG_MORE;
        } else {
            f[2] &= !FLAG_MORE;
        }
        f.resize(HEADER_LEN + k, 0);
        read_exact(src, &mut f[HEADER_LEN..], limit)
            .await
            .map_err(|e| format!("data stream failed: {e}"))?;
        left -= k;
        // The destination left while we waited for room: drop the rest of the frame.
        let Some(charged) = charge(shared, &d.budget, f.len()).await? else {
            return mover
                .discard(src, left, limit)
                .await
                .map_err(|e| format!("data stream failed: {e}"));
        };
        let _ = d.tx.send(Out::Frame(f.freeze(), Some(charged)));
        if left == 0 {
            return Ok(());
        }
    }
}

/// Moves payload bytes from one socket to another.
struct Mover {
    /// The portable loop's buffer (also used to drop bytes).
    buf: Vec<u8>,
    /// A small frame, read whole before it is written.
    small: Vec<u8>,
    #[cfg(target_os = "linux")]
    pipe: Option<splice::Pipe>,
    #[cfg(target_os = "linux")]
    use_splice: bool,
}

impl Mover {
    fn new(use_splice: bool) -> Mover {
        #[cfg(not(target_os = "linux"))]
        let _ = use_splice;
        Mover {
            buf: Vec::new(),
            small: Vec::new(),
            #[cfg(target_os = "linux")]
            pipe: None,
            #[cfg(target_os = "linux")]
            use_splice,
        }
    }

    /// Move `n` bytes from `src` to `dst`.
    async fn forward(
        &mut self,
        src: &Sock,
        dst: &Sock,
        n: usize,
        limit: Duration,
    ) -> Result<(), Fault> {
        #[cfg(target_os = "linux")]
        if self.use_splice {
            if self.pipe.is_none() {
                // No pipe (out of descriptors?): the buffer works too.
                self.pipe = splice::Pipe::new().ok();
            }
            if let Some(p) = &self.pipe {
                let r = p.forward(src, dst, n, limit).await;
                if r.is_err() {
                    // Bytes may be left in it: the next frame gets a fresh pipe.
                    self.pipe = None;
                }
                return r;
            }
        }
        self.buf.resize(CHUNK, 0);
        let mut left = n;
        while left > 0 {
            let k = read_some(src, &mut self.buf[..left.min(CHUNK)], limit)
                .await
                .map_err(|e| Fault::Src(format!("data stream failed: {e}")))?;
            left -= k;
            write_all(dst, &self.buf[..k], limit)
                .await
                .map_err(|e| Fault::Dst(e.to_string(), left))?;
        }
        Ok(())
    }

    /// Read and drop `n` bytes from `src`.
    async fn discard(&mut self, src: &Sock, n: usize, limit: Duration) -> io::Result<()> {
        self.buf.resize(CHUNK, 0);
        let mut left = n;
        while left > 0 {
            left -= read_some(src, &mut self.buf[..left.min(CHUNK)], limit).await?;
        }
        Ok(())
    }
}

/// Read at least one byte (end of stream is an error), waiting at most `limit` for each.
async fn read_some(s: &Sock, buf: &mut [u8], limit: Duration) -> io::Result<usize> {
    loop {
        match s.try_read(buf) {
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(k) => return Ok(k),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => ready(s.readable(), limit).await?,
            Err(e) => return Err(e),
        }
    }
}

/// Fill `buf` from `s`.
async fn read_exact(s: &Sock, buf: &mut [u8], limit: Duration) -> io::Result<()> {
    let mut at = 0;
    while at < buf.len() {
        at += read_some(s, &mut buf[at..], limit).await?;
    }
    Ok(())
}

/// Write all of `buf` to `s`, waiting at most `limit` for the socket to take each piece.
async fn write_all(s: &Sock, buf: &[u8], limit: Duration) -> io::Result<()> {
    write_all_parts(s, &[buf], limit).await
}

/// Write `parts` one after the other to `s` (gathered into as few calls as the socket allows).
async fn write_all_parts(s: &Sock, parts: &[&[u8]], limit: Duration) -> io::Result<()> {
    let total: usize = parts.iter().map(|p| p.len()).sum();
    let mut done = 0;
    while done < total {
        let mut skip = done;
        let mut left = Vec::with_capacity(parts.len());
        for p in parts {
            if skip >= p.len() {
                skip -= p.len();
            } else {
                left.push(io::IoSlice::new(&p[skip..]));
                skip = 0;
            }
        }
        match s.try_write_vectored(&left) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(k) => done += k,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => ready(s.writable(), limit).await?,
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Wait for a readiness future, at most `limit` (`Duration::MAX`: forever).
async fn ready(f: impl Future<Output = io::Result<()>>, limit: Duration) -> io::Result<()> {
    if limit == Duration::MAX {
        return f.await;
    }
    match tokio::time::timeout(limit, f).await {
        Ok(r) => r,
        Err(_) => Err(io::Error::new(
            io::ErrorKind::TimedOut,
            format!("no progress for {limit:?}"),
        )),
    }
}

#[cfg(target_os = "linux")]
mod splice {
    //! `splice(2)` from a socket into a pipe and from the pipe into another socket: the payload
    //! pages move inside the kernel, never copied into the relay.

    use std::io;
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
    use std::time::Duration;

    use super::{Fault, Interest, Sock, ready};

    /// A non-blocking pipe, enlarged to 1 MiB where the system allows.
    pub(super) struct Pipe {
        r: OwnedFd,
        w: OwnedFd,
        cap: usize,
    }

    impl Pipe {
        pub(super) fn new() -> io::Result<Pipe> {
            let mut fds = [0 as libc::c_int; 2];
            // SAFETY: `fds` has room for the two descriptors pipe2 writes.
            if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_NONBLOCK | libc::O_CLOEXEC) } < 0 {
                return Err(io::Error::last_os_error());
            }
            // SAFETY: pipe2 succeeded, so both descriptors are open and owned by nobody else.
            let (r, w) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
            // SAFETY: F_SETPIPE_SZ / F_GETPIPE_SZ on a pipe we own; failure leaves it as it was.
            let cap = unsafe {
                let set = libc::fcntl(w.as_raw_fd(), libc::F_SETPIPE_SZ, 1 << 20);
                if set > 0 {
                    set
                } else {
                    libc::fcntl(w.as_raw_fd(), libc::F_GETPIPE_SZ)
                }
            };
            Ok(Pipe {
                r,
                w,
                cap: if cap > 0 { cap as usize } else { 1 << 16 },
            })
        }

        /// Move `n` bytes from `src` to `dst`: fill the pipe from `src` (as much as has arrived),
        /// drain it into `dst`, repeat. The pipe is empty between calls.
        pub(super) async fn forward(
            &self,
            src: &Sock,
            dst: &Sock,
            n: usize,
            limit: Duration,
        ) -> Result<(), Fault> {
            let mut left = n;
            while left > 0 {
                // The pipe is empty here, so "would block" means the socket has nothing yet
                // (which is what tokio's readiness must hear).
                let got = loop {
                    let want = left.min(self.cap);
                    match src.try_io(Interest::READABLE, || {
                        move_bytes(src.raw_fd(), self.w.as_raw_fd(), want)
                    }) {
                        Ok(0) => return Err(src_fault(io::ErrorKind::UnexpectedEof.into())),
                        Ok(k) => break k,
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                            ready(src.readable(), limit).await.map_err(src_fault)?;
                        }
                        Err(e) => return Err(src_fault(e)),
                    }
                };
                left -= got;
                let mut held = got;
                while held > 0 {
                    // The pipe holds data here, so "would block" means the socket is full.
                    match dst.try_io(Interest::WRITABLE, || {
                        move_bytes(self.r.as_raw_fd(), dst.raw_fd(), held)
                    }) {
                        Ok(0) => {
                            return Err(Fault::Dst("the stream took no bytes".into(), left));
                        }
                        Ok(k) => held -= k,
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                            ready(dst.writable(), limit)
                                .await
                                .map_err(|e| Fault::Dst(e.to_string(), left))?;
                        }
                        Err(e) => return Err(Fault::Dst(e.to_string(), left)),
                    }
                }
            }
            Ok(())
        }
    }

    fn src_fault(e: io::Error) -> Fault {
        Fault::Src(format!("data stream failed: {e}"))
    }

    /// One non-blocking `splice` of up to `n` bytes.
    fn move_bytes(from: RawFd, to: RawFd, n: usize) -> io::Result<usize> {
        // SAFETY: both descriptors are open for the duration of the call; null offsets are
        // required for sockets and pipes.
        let r = unsafe {
            libc::splice(
                from,
                std::ptr::null_mut(),
                to,
                std::ptr::null_mut(),
                n,
                libc::SPLICE_F_MOVE | libc::SPLICE_F_NONBLOCK,
            )
        };
        if r < 0 {
            Err(io::Error::last_os_error())
        } else {
            Ok(r as usize)
        }
    }
}
