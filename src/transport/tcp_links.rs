//! Direct TCP links between native members of a relay room: the relay introduces them (each
//! announces a listening address through the room's signaling), then data between two native
//! ranks goes straight from one to the other instead of through the relay — the native
//! counterpart of the browser's WebRTC mesh. Pairs that cannot link (a browser tab, a rank without
//! direct links, a refused or timed-out connection) keep using the relay.
//!
//! Each direction of a pair uses one route for its whole life (decided before the transport sends
//! anything), so messages of one (source, tag) never overtake each other.
//!
//! Link setup proves both ranks with the key the relay gave only `i` and `j` (in `ready`; a third
//! member of the room cannot pose as either, and nothing secret crosses the link): rank `i < j`
//! connects to `j`'s announced address and sends magic, `i` and a random nonce; `j` answers its
//! own nonce and an HMAC-SHA-256 of both nonces and both ranks under the pair's key ("I am `j`");
//! `i` checks it and sends its own ("I am `i`"); `j` checks that, then that `i` is not linked yet,
//! and only then accepts with one byte. A peer without a key (a relay that issues none) is not
//! linked. Frames on a link: `[u32 length][24-byte wire header][payload]`, with no fragmenting
//! and no masking; the receiver trusts the connection, not the header, for the source rank.

use std::collections::HashMap;
use std::mem::MaybeUninit;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::{Buf, Bytes, BytesMut};
use tokio::io::{AsyncReadExt, AsyncWriteExt, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;

use super::{Mailbox, Tag};
use crate::wire::{HEADER_LEN, Header};

/// First bytes of a link's hello (version 2: per-pair keys).
const HELLO_MAGIC: u32 = 0xD6D6_0002;

/// A pair's link key (from the relay's `ready`).
pub(crate) type LinkKey = [u8; 16];

/// The keys this member shares with each peer rank.
pub(crate) type LinkKeys = HashMap<usize, LinkKey>;

/// Parse the relay's `link_keys` (32 hex digits per rank); malformed entries (and our own, empty)
/// are left out (no link with that rank).
pub(crate) fn parse_keys(keys: &[String]) -> LinkKeys {
    keys.iter()
        .enumerate()
        .filter_map(|(r, hex)| {
            let mut k = [0u8; 16];
            if hex.len() != 32 {
                return None;
            }
            for (i, b) in k.iter_mut().enumerate() {
                *b = u8::from_str_radix(hex.get(2 * i..2 * i + 2)?, 16).ok()?;
            }
            Some((r, k))
        })
        .collect()
}

/// The proof a side of the link (`role`) gives: HMAC-SHA-256 under the pair's key of the role,
/// both ranks and both nonces.
fn proof(key: &LinkKey, role: &[u8], lo: usize, hi: usize, n_lo: &[u8], n_hi: &[u8]) -> [u8; 32] {
    use hmac::Mac;
    // HMAC takes keys of any length: the error arm cannot happen; an all-zero proof never verifies
    // against a real one.
    let Ok(mut m) = hmac::Hmac::<sha2::Sha256>::new_from_slice(key) else {
        return [0; 32];
    };
    m.update(b"distgrad direct link v2 ");
    m.update(role);
    m.update(&(lo as u64).to_le_bytes());
    m.update(&(hi as u64).to_le_bytes());
    m.update(n_lo);
    m.update(n_hi);
    m.finalize().into_bytes().into()
}

fn nonce() -> std::io::Result<[u8; 16]> {
    let mut n = [0u8; 16];
    getrandom::fill(&mut n).map_err(|e| std::io::Error::other(format!("no nonce: {e}")))?;
    Ok(n)
}

/// The signaling payload announcing a rank's link address (`None`: this rank makes no links).
pub(crate) fn announcement(addr: Option<SocketAddr>) -> serde_json::Value {
    match addr {
        Some(a) => serde_json::json!({ "kind": "tcp", "addr": a.to_string() }),
        None => serde_json::json!({ "kind": "tcp" }),
    }
}

/// What a peer's signal says about direct links.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum PeerKind {
    /// A native rank listening at this address.
    Listening(SocketAddr),
    /// A rank that makes no direct links (a native rank without them, or a browser tab, whose
    /// WebRTC signals say what it is).
    NoLinks,
}

/// Interpret a signal from a peer.
pub(crate) fn peer_kind(data: &serde_json::Value) -> PeerKind {
    if data["kind"] == "tcp"
        && let Some(a) = data["addr"].as_str().and_then(|s| s.parse().ok())
    {
        return PeerKind::Listening(a);
    }
    PeerKind::NoLinks
}

/// One established link's sending side: frames queue here for the writer task.
pub(crate) type LinkTx = mpsc::Sender<(Bytes, Bytes)>;

/// A link: its sending side and its reader and writer tasks.
pub(crate) type Link = (
    LinkTx,
    tokio::task::JoinHandle<()>,
    tokio::task::JoinHandle<()>,
);

/// Establish links with every peer that can make them, within `timeout`. `peers` receives each
/// peer's signal (rank, what it is) as the relay delivers them. Returns the established links by
/// rank; their reading sides deliver into `mailbox`.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn establish(
    me: usize,
    world: usize,
    keys: &LinkKeys,
    listener: TcpListener,
    mut peers: mpsc::UnboundedReceiver<(usize, PeerKind)>,
    mailbox: Arc<Mailbox>,
    max_message: usize,
    timeout: Duration,
) -> HashMap<usize, Link> {
    use futures::StreamExt as _;
    let deadline = tokio::time::Instant::now() + timeout;
    // A peer is settled when it makes no links, when our link with it is up, or (higher ranks,
    // which we connect to) when our attempt ended. Lower ranks connect to us.
    // Peers we share no key with are never linked.
    let mut settled: Vec<bool> = (0..world).map(|r| !keys.contains_key(&r)).collect();
    settled[me] = true;
    let mut links = HashMap::new();
    let mut connecting = futures::stream::FuturesUnordered::new();
    let mut hellos = futures::stream::FuturesUnordered::new();
    while !settled.iter().all(|&s| s) {
        tokio::select! {
            _ = tokio::time::sleep_until(deadline) => break,
            got = peers.recv() => {
                let Some((r, kind)) = got else { break };
                if r >= world || settled[r] {
                    continue;
                }
                match kind {
                    PeerKind::NoLinks => settled[r] = true,
                    PeerKind::Listening(addr) if r > me => {
                        let key = keys.get(&r).copied().unwrap_or_default();
                        connecting.push(async move { (r, connect(addr, me, r, &key).await) });
                    }
                    PeerKind::Listening(_) => {}
                }
            }
            conn = listener.accept() => {
                // Hellos are read concurrently: a silent connection does not hold up the others.
                if let Ok((stream, _)) = conn {
                    hellos.push(tokio::time::timeout(
                        Duration::from_secs(2),
                        accept(stream, me, keys),
                    ));
                }
            }
            Some(hello) = hellos.next(), if !hellos.is_empty() => {
                // Proven, and the first link of that rank: only now accepted (a second
                // connection for a linked rank is dropped unanswered).
                if let Ok(Ok((mut stream, r))) = hello
                    && !settled[r]
                {
                    let ack = tokio::time::timeout(Duration::from_secs(2), stream.write_all(&[1]));
                    if matches!(ack.await, Ok(Ok(()))) {
                        settled[r] = true;
                        links.insert(r, start(stream, me, r, mailbox.clone(), max_message));
                    }
                }
            }
            Some((r, res)) = connecting.next(), if !connecting.is_empty() => {
                settled[r] = true;
                if let Ok(stream) = res {
                    links.insert(r, start(stream, me, r, mailbox.clone(), max_message));
                }
            }
        }
    }
    links
}

/// Connect to the higher rank `peer` at `addr`, prove who we are and check who answers (see the
/// module docs); the link is up once it accepts.
async fn connect(
    addr: SocketAddr,
    me: usize,
    peer: usize,
    key: &LinkKey,
) -> std::io::Result<TcpStream> {
    let limit = Duration::from_secs(2);
    let timed_out = |what: &str| std::io::Error::other(format!("{what} timed out"));
    let mut s = tokio::time::timeout(limit, TcpStream::connect(addr))
        .await
        .map_err(|_| timed_out("connect"))??;
    s.set_nodelay(true)?;
    let mine = nonce()?;
    let mut hello = BytesMut::with_capacity(24);
    hello.extend_from_slice(&HELLO_MAGIC.to_le_bytes());
    hello.extend_from_slice(&(me as u32).to_le_bytes());
    hello.extend_from_slice(&mine);
    s.write_all(&hello).await?;
    let mut answer = [0u8; 48];
    tokio::time::timeout(limit, s.read_exact(&mut answer))
        .await
        .map_err(|_| timed_out("the answer to the hello"))??;
    let (theirs, their_proof) = answer.split_at(16);
    let want = proof(key, b"listener", me, peer, &mine, theirs);
    if !crate::wire::secret_eq_bytes(their_proof, &want) {
        return Err(std::io::Error::other(format!(
            "the listener at {addr} did not prove it is rank {peer}"
        )));
    }
    s.write_all(&proof(key, b"dialer", me, peer, &mine, theirs))
        .await?;
    let mut ok = [0u8; 1];
    tokio::time::timeout(limit, s.read_exact(&mut ok))
        .await
        .map_err(|_| timed_out("the acceptance"))??;
    if ok[0] != 1 {
        return Err(std::io::Error::other("hello refused"));
    }
    Ok(s)
}

/// Read a lower rank's hello on an accepted connection and check its proof of rank (see the
/// module docs): the stream and the proven rank, not yet accepted (the caller answers once it
/// knows the rank is not linked yet).
async fn accept(
    mut s: TcpStream,
    me: usize,
    keys: &LinkKeys,
) -> std::io::Result<(TcpStream, usize)> {
    let mut head = [0u8; 24];
    s.read_exact(&mut head).await?;
    let word = |i: usize| u32::from_le_bytes([head[i], head[i + 1], head[i + 2], head[i + 3]]);
    let (magic, rank) = (word(0), word(4) as usize);
    let their_nonce = &head[8..24];
    let key = match keys.get(&rank) {
        Some(k) if magic == HELLO_MAGIC && rank < me => k,
        _ => return Err(std::io::Error::other("bad hello")),
    };
    let mine = nonce()?;
    let mut answer = Vec::with_capacity(48);
    answer.extend_from_slice(&mine);
    answer.extend_from_slice(&proof(key, b"listener", rank, me, their_nonce, &mine));
    s.write_all(&answer).await?;
    let mut their_proof = [0u8; 32];
    s.read_exact(&mut their_proof).await?;
    let want = proof(key, b"dialer", rank, me, their_nonce, &mine);
    if !crate::wire::secret_eq_bytes(&their_proof, &want) {
        return Err(std::io::Error::other(format!(
            "the dialer did not prove it is rank {rank}"
        )));
    }
    s.set_nodelay(true)?;
    Ok((s, rank))
}

/// Start the reader and writer tasks of our (`me`) link with `peer`.
fn start(
    stream: TcpStream,
    me: usize,
    peer: usize,
    mailbox: Arc<Mailbox>,
    max_message: usize,
) -> Link {
    let (mut rd, wr) = stream.into_split();
    let (tx, writer) = spawn_writer(wr);
    let reader = tokio::spawn(async move {
        let reason = loop {
            let mut len = [0u8; 4];
            match rd.read_exact(&mut len).await {
                Ok(_) => {}
                // End of stream between frames: the peer closed its transport.
                Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
                    mailbox.peer_gone(peer);
                    return;
                }
                Err(e) => break format!("direct link to rank {peer} failed: {e}"),
            }
            let len = u32::from_le_bytes(len) as usize;
            if !(HEADER_LEN..=HEADER_LEN + max_message).contains(&len) {
                break format!("rank {peer} sent a frame of {len} bytes on the direct link");
            }
            let mut head = [0u8; HEADER_LEN];
            if let Err(e) = rd.read_exact(&mut head).await {
                break format!("direct link to rank {peer} failed: {e}");
            }
            let h = match Header::decode(&head) {
                Ok(h) if h.more => break format!("rank {peer} sent a fragment on the direct link"),
                Ok(h) if h.dst as usize != me => {
                    break format!("rank {peer} sent a frame for rank {} on our link", h.dst);
                }
                Ok(h) => h,
                Err(e) => break format!("rank {peer} sent a bad frame: {e}"),
            };
            let n = len - HEADER_LEN;
            let payload = match read_payload(&mut rd, n).await {
                Ok(p) => p,
                Err(e) => break format!("direct link to rank {peer} failed: {e}"),
            };
            mailbox.deliver(peer, h.tag, payload);
        };
        mailbox.peer_lost(peer, &reason);
    });
    (tx, reader, writer)
}

/// The writer task of a TCP link: writes each queued (head, payload) as one frame; when the
/// sending side is dropped, ends its side of the connection (after what was queued).
pub(crate) fn spawn_writer(
    mut wr: impl tokio::io::AsyncWrite + Unpin + Send + 'static,
) -> (LinkTx, tokio::task::JoinHandle<()>) {
    let (tx, mut rx) = mpsc::channel::<(Bytes, Bytes)>(64);
    let writer = tokio::spawn(async move {
        while let Some((head, payload)) = rx.recv().await {
            let mut frame = head.chain(payload);
            if wr.write_all_buf(&mut frame).await.is_err() {
                break;
            }
        }
        let _ = wr.shutdown().await;
    });
    (tx, writer)
}

/// Read `n` payload bytes: into a recycled f32 buffer when they are whole f32s (aligned, one copy,
/// straight into the buffer's spare room: no zeroing pass first).
pub(crate) async fn read_payload(
    rd: &mut (impl tokio::io::AsyncRead + Unpin),
    n: usize,
) -> std::io::Result<Bytes> {
    if n.is_multiple_of(4) {
        let mut v = crate::pool::take(n / 4);
        // set_len below counts from 0: the spare room must start at the vector's beginning.
        debug_assert!(v.is_empty());
        let spare = &mut v.spare_capacity_mut()[..n / 4];
        // SAFETY: the same memory seen as n possibly-uninitialized bytes (f32 has no invalid
        // bit patterns, MaybeUninit<u8> has alignment 1, and `spare` is exactly n bytes long).
        let raw = unsafe {
            std::slice::from_raw_parts_mut(spare.as_mut_ptr().cast::<MaybeUninit<u8>>(), n)
        };
        let mut buf = ReadBuf::uninit(raw);
        let start = buf.filled().as_ptr() as usize;
        while buf.remaining() > 0 {
            let before = buf.filled().len();
            std::future::poll_fn(|cx| std::pin::Pin::new(&mut *rd).poll_read(cx, &mut buf)).await?;
            // A reader may swap in a buffer of its own; then "filled" says nothing about ours.
            if buf.filled().as_ptr() as usize != start {
                return Err(std::io::Error::other("the reader replaced the read buffer"));
            }
            if buf.filled().len() == before {
                return Err(std::io::ErrorKind::UnexpectedEof.into());
            }
        }
        // SAFETY: ReadBuf reports all n bytes of our memory (checked above) filled, so the
        // first n/4 elements are initialized.
        unsafe { v.set_len(n / 4) };
        return Ok(crate::pool::f32_bytes(v));
    }
    let mut b = vec![0u8; n];
    rd.read_exact(&mut b).await?;
    Ok(Bytes::from(b))
}

/// The frame head (`[u32 length][wire header]`) of a message to send on a link.
pub(crate) fn frame_head(src: usize, dst: usize, tag: Tag, payload_len: usize) -> Bytes {
    frame_head_more(src, dst, tag, payload_len, false)
}

/// [`frame_head`] of a fragment (`more`: further fragments of the message follow).
pub(crate) fn frame_head_more(
    src: usize,
    dst: usize,
    tag: Tag,
    payload_len: usize,
    more: bool,
) -> Bytes {
    let mut b = BytesMut::with_capacity(4 + HEADER_LEN);
    b.extend_from_slice(&((HEADER_LEN + payload_len) as u32).to_le_bytes());
    Header {
        src: src as u32,
        dst: dst as u32,
        tag,
        more,
    }
    .put(&mut b);
    b.freeze()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rt() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
    }

    #[test]
    fn payloads_arrive_whole_from_trickled_reads_and_a_short_stream_is_an_error() {
        rt().block_on(async {
            // 4 MiB + 3 f32 (pool-sized and not), 12 bytes and 7 bytes (not whole f32s).
            for n in [(1usize << 22) + 12, 12, 7] {
                let data: Vec<u8> = (0..n).map(|i| (i * 31 % 251) as u8).collect();
                // The reader sees the stream in pieces of 1000 bytes at most.
                let (mut w, mut r) = tokio::io::duplex(1000);
                let sent = data.clone();
                let writer = tokio::spawn(async move { w.write_all(&sent).await });
                let got = read_payload(&mut r, n).await.unwrap();
                writer.await.unwrap().unwrap();
                assert_eq!(&got[..], &data[..], "{n} bytes");
                // The stream ends 3 bytes early: an error, not a short or padded payload.
                let (mut w, mut r) = tokio::io::duplex(1000);
                let short = data[..n - 3].to_vec();
                tokio::spawn(async move {
                    let _ = w.write_all(&short).await;
                });
                let err = read_payload(&mut r, n).await.unwrap_err();
                assert_eq!(err.kind(), std::io::ErrorKind::UnexpectedEof, "{n} bytes");
            }
        });
    }

    /// The key of the pair (a, b) in these tests.
    fn k(a: usize, b: usize) -> LinkKey {
        let (lo, hi) = (a.min(b) as u8, a.max(b) as u8);
        let mut key = [lo; 16];
        key[0] = hi;
        key
    }

    /// The keys rank `me` of a world of 4 holds.
    fn keys_of(me: usize) -> LinkKeys {
        (0..4).filter(|&p| p != me).map(|p| (p, k(me, p))).collect()
    }

    #[test]
    fn links_prove_both_ranks_with_the_pair_key() {
        rt().block_on(async {
            let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
            let addr = l.local_addr().unwrap();
            // (listener's rank, dialer's claimed rank, the key the dialer uses, the rank it
            // expects to reach, accepted?)
            for (me, them, key, expects, ok) in [
                (2, 0, k(0, 2), 2, true),
                (2, 1, k(1, 2), 2, true),
                // Rank 3 poses as rank 1 with the key it shares with rank 1: refused both ways.
                (2, 1, k(1, 3), 2, false),
                // Rank 0 means to reach rank 2, but rank 3 listens there.
                (3, 0, k(0, 2), 2, false),
                // Not a lower rank.
                (2, 2, k(2, 2), 2, false),
                (1, 3, k(1, 3), 1, false),
            ] {
                let client = tokio::spawn(async move { connect(addr, them, expects, &key).await });
                let (s, _) = l.accept().await.unwrap();
                let got = accept(s, me, &keys_of(me)).await;
                assert_eq!(got.is_ok(), ok, "rank {them} -> {me} (expecting {expects})");
                if let Ok((mut s, r)) = got {
                    assert_eq!(r, them);
                    s.write_all(&[1]).await.unwrap();
                }
                let dialed = client.await.unwrap();
                assert_eq!(dialed.is_ok(), ok, "the dialing side agrees: {dialed:?}");
                if let (Err(e), true) = (&dialed, me != expects) {
                    assert!(e.to_string().contains("did not prove it is rank 2"), "{e}");
                }
            }
            // Not a hello at all: refused.
            let client = tokio::spawn(async move {
                let mut s = TcpStream::connect(addr).await.unwrap();
                let _ = s
                    .write_all(b"GET / HTTP/1.1\r\n\r\nxxxxxxxxxxxxxxxxxxxxxxxxxx")
                    .await;
            });
            let (s, _) = l.accept().await.unwrap();
            assert!(accept(s, 1, &keys_of(1)).await.is_err());
            client.await.unwrap();
        });
    }

    #[test]
    fn relay_keys_parse_and_bad_ones_are_left_out() {
        let m = [
            "",
            "000102030405060708090a0b0c0d0e0f",
            "short",
            "zz0102030405060708090a0b0c0d0e0f",
        ]
        .map(String::from);
        let keys = parse_keys(&m);
        assert_eq!(keys.len(), 1);
        assert_eq!(keys[&1], core::array::from_fn(|i| i as u8));
    }

    #[test]
    fn a_silent_stranger_and_a_second_link_do_not_hold_up_the_links() {
        rt().block_on(async {
            let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
            let addr = l.local_addr().unwrap();
            // A connection that never says hello, made first.
            let _silent = TcpStream::connect(addr).await.unwrap();
            let (tx, rx) = mpsc::unbounded_channel();
            // Rank 0 announces a listener of its own (it is lower: it connects to us).
            let l0 = TcpListener::bind("127.0.0.1:0").await.unwrap();
            tx.send((0, PeerKind::Listening(l0.local_addr().unwrap())))
                .unwrap();
            let key = k(0, 1);
            let dial = tokio::spawn(async move { connect(addr, 0, 1, &key).await });
            let mb = Arc::new(Mailbox::new(1, 2));
            let t0 = std::time::Instant::now();
            let keys: LinkKeys = [(0, k(0, 1))].into_iter().collect();
            let links = establish(1, 2, &keys, l, rx, mb, 1 << 20, Duration::from_secs(5)).await;
            assert!(links.contains_key(&0), "rank 0 linked");
            assert!(
                t0.elapsed() < Duration::from_secs(1),
                "took {:?}",
                t0.elapsed()
            );
            assert!(dial.await.unwrap().is_ok());
        });
    }

    /// With no key for a peer (a relay that issues none), nobody waits for a link with it.
    #[test]
    fn peers_without_a_key_are_not_waited_for() {
        rt().block_on(async {
            let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
            let (_tx, rx) = mpsc::unbounded_channel();
            let t0 = std::time::Instant::now();
            let links = establish(
                1,
                3,
                &LinkKeys::new(),
                l,
                rx,
                Arc::new(Mailbox::new(1, 3)),
                1 << 20,
                Duration::from_secs(5),
            )
            .await;
            assert!(links.is_empty());
            assert!(t0.elapsed() < Duration::from_secs(1), "{:?}", t0.elapsed());
        });
    }

    #[test]
    fn signals_say_who_listens() {
        let a: SocketAddr = "127.0.0.1:4567".parse().unwrap();
        assert_eq!(peer_kind(&announcement(Some(a))), PeerKind::Listening(a));
        assert_eq!(peer_kind(&announcement(None)), PeerKind::NoLinks);
        // A browser tab's WebRTC offer: it makes no TCP links.
        let offer = serde_json::json!({ "kind": "offer", "sdp": "v=0" });
        assert_eq!(peer_kind(&offer), PeerKind::NoLinks);
    }
}
