//! Data streams: native members' plain TCP (or Unix-domain) connections to the relay: hello
//! checks, stream <-> WebSocket routing, splice and buffered forwarding, fallback, ordering of
//! leaves with data.
//!
//! Every test talks only to 127.0.0.1 (port 0), and every wait is bounded (raw-client waits by
//! `common_relay::WAIT`, collectives by `CommOptions::timeout`), so a broken relay fails a test
//! instead of hanging it.

mod common_relay;

use std::process::Command;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use common_relay::*;
use distgrad::relay::RelayConfig;
use distgrad::transport::Transport;
use distgrad::transport::ws::{StreamRoute, WsTransport};
use distgrad::wire::{Control, HEADER_LEN, Header};
use distgrad::{CommOptions, Communicator, ReduceOp, Tensor, run_local};

// ---------------------------------------------------------------------------------------------
// Data streams: native members' plain TCP connections to the relay

// ---------------------------------------------------------------------------------------------

/// Join over a raw WebSocket announcing a data stream; returns the client and its stream key.
async fn raw_join_with_stream(url: &str, room: &str, world: u32, rank: u32) -> (Raw, String) {
    let (c, key, _) = raw_join_with_stream_path(url, room, world, rank).await;
    (c, key)
}

/// [`raw_join_with_stream`], also returning the Unix-domain socket path the welcome named (if any).
async fn raw_join_with_stream_path(
    url: &str,
    room: &str,
    world: u32,
    rank: u32,
) -> (Raw, String, Option<String>) {
    match raw_join(url, room, world, rank, true).await {
        (
            c,
            Control::Welcome {
                stream_key: Some(key),
                stream_path,
                ..
            },
        ) => (c, key, stream_path),
        (_, other) => panic!("expected a welcome with a stream key, got {other:?}"),
    }
}

/// Open a TCP connection to the relay, send `hello` bytes, and return it with the relay's answer
/// byte (`None`: the relay closed without answering).
async fn stream_hello(
    addr: std::net::SocketAddr,
    hello: &[u8],
) -> (tokio::net::TcpStream, Option<u8>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect");
    s.write_all(hello).await.expect("send hello");
    let mut b = [0u8; 1];
    let got = tokio::time::timeout(WAIT, s.read(&mut b))
        .await
        .expect("the relay neither answered nor closed the stream");
    let answer = match got {
        Ok(1) => Some(b[0]),
        _ => None,
    };
    (s, answer)
}

/// A stream frame: `[u32 length][header][payload]`.
fn stream_frame(src: u32, dst: u32, seq: u64, payload: &[u8]) -> Vec<u8> {
    let f = frame(src, dst, seq, payload);
    let mut v = ((f.len()) as u32).to_le_bytes().to_vec();
    v.extend_from_slice(&f);
    v
}

/// Stream hellos are checked (wrong key, unknown room or rank, a second stream, garbage: refused,
/// nothing changes); frames on a stream are stamped with the sender's rank, reach WebSocket
/// members cut to the frame limit, and WebSocket members' frames reach the stream; a client that
/// sends a control frame on its stream is disconnected with a reason, its peer told, and the relay
/// keeps serving.
#[test]
fn stream_hellos_are_checked_and_streams_carry_stamped_frames() {
    use distgrad::wire::{STREAM_CONTROL, StreamHello};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let relay = TestRelay::default_config();
    let (url, addr) = (relay.url(), relay.addr);
    rank_runtime().block_on(async {
        let (mut a, key) = raw_join_with_stream(&url, "st", 2, 0).await;
        let hello = |room: &str, rank: u32, key: &str| {
            StreamHello {
                room: room.into(),
                rank,
                key: key.into(),
            }
            .encode()
        };
        for (what, bytes) in [
            ("a wrong key", hello("st", 0, "nope")),
            ("an unknown room", hello("other", 0, &key)),
            ("an absent rank", hello("st", 1, &key)),
            ("garbage after the magic", {
                let mut g = distgrad::wire::STREAM_MAGIC.to_vec();
                g.extend_from_slice(&5u32.to_le_bytes());
                g.extend_from_slice(b"{{{{{");
                g
            }),
            ("an oversized hello", {
                let mut g = distgrad::wire::STREAM_MAGIC.to_vec();
                g.extend_from_slice(&u32::MAX.to_le_bytes());
                g
            }),
        ] {
            let (_, answer) = stream_hello(addr, &bytes).await;
            assert_ne!(answer, Some(1), "a stream hello with {what} was accepted");
        }
        let (mut sa, answer) = stream_hello(addr, &hello("st", 0, &key)).await;
        assert_eq!(answer, Some(1), "the right key attaches the stream");
        let (_, again) = stream_hello(addr, &hello("st", 0, &key)).await;
        assert_ne!(
            again,
            Some(1),
            "a second stream for the same member was accepted"
        );

        // Rank 1 announces a stream too, then says it has none: its data stays on the WebSocket.
        let (mut b, _) = raw_join_with_stream(&url, "st", 2, 1).await;
        b.send_control(&Control::NoStream).await;
        b.wait_ready().await;
        a.wait_ready().await;

        // Stream -> WebSocket: stamped, and cut into frames of at most 1 MiB (the default limit).
        sa.write_all(&stream_frame(7, 1, 1, b"hi")).await.unwrap();
        let (h, p) = b.next_frame().await;
        assert_eq!(
            (h.src, h.dst, h.tag.seq, h.more, &p[..]),
            (0, 1, 1, false, &b"hi"[..])
        );
        let big: Vec<u8> = (0..(3 << 20) + 5).map(|i| (i % 251) as u8).collect();
        sa.write_all(&stream_frame(0, 1, 2, &big)).await.unwrap();
        let mut got = Vec::new();
        loop {
            let (h, p) = b.next_frame().await;
            assert!(p.len() <= 1 << 20, "a {}-byte WebSocket frame", p.len());
            assert_eq!((h.src, h.tag.seq), (0, 2));
            got.extend_from_slice(&p);
            if !h.more {
                break;
            }
        }
        assert!(got == big, "the 3 MiB message arrived changed");

        // WebSocket -> stream: `[len][header][payload]`, source stamped.
        b.send_binary(frame(9, 0, 3, b"back")).await.unwrap();
        let mut len = [0u8; 4];
        sa.read_exact(&mut len).await.unwrap();
        let mut f = vec![0u8; u32::from_le_bytes(len) as usize];
        sa.read_exact(&mut f).await.unwrap();
        let h = Header::decode(&f).unwrap();
        assert_eq!(
            (h.src, h.dst, h.tag.seq, &f[HEADER_LEN..]),
            (1, 0, 3, &b"back"[..])
        );

        // A control frame from a client: that member is disconnected with a reason.
        sa.write_all(&(STREAM_CONTROL | 2).to_le_bytes())
            .await
            .unwrap();
        sa.write_all(b"{}").await.unwrap();
        let refusal = a.expect_refusal().await;
        let why = refusal.error.unwrap_or_default();
        assert!(why.contains("WebSocket"), "reason given: {why:?}");
        match b.next_control().await {
            Control::PeerLeft { rank: 0, reason } => {
                assert!(reason.contains("WebSocket"), "{reason}")
            }
            other => panic!("rank 1 expected rank 0's leave, got {other:?}"),
        }
    });
    quick_all_reduce(&url, "after-stream-fault", 3);
    relay.shutdown(Duration::from_secs(5));
}

/// A relay that takes no streams leaves native members' data on their WebSockets; a relay that
/// forwards without splice(2) (its portable buffer loop) gives the same bits as one with it.
#[test]
fn streams_fall_back_and_both_forwarding_loops_are_exact() {
    const N: usize = 300_001; // not a multiple of anything: ring chunks of uneven sizes
    let opts = CommOptions {
        timeout: Duration::from_secs(30),
        ..CommOptions::for_network()
    };
    let x_of = |r: usize| -> Vec<f32> {
        (0..N)
            .map(|i| ((i * 31 + r * 17) % 1009) as f32 / 7.0 - 50.0)
            .collect()
    };
    let local = all_ok(
        "local",
        run_local(4, opts.clone(), |comm| async move {
            let x = Tensor::vector(&x_of(comm.rank()));
            comm.all_reduce(&x, ReduceOp::Sum, &comm.world())
                .await
                .map(|t| t.to_vec())
        }),
    );
    for (cfg, route) in [
        (
            RelayConfig {
                streams: false,
                ..scripted()
            },
            None,
        ),
        (
            RelayConfig {
                splice: false,
                ..scripted()
            },
            Some(StreamRoute::Unix),
        ),
        (
            RelayConfig {
                local_streams: false,
                ..scripted()
            },
            Some(StreamRoute::Tcp),
        ),
        (scripted(), Some(StreamRoute::Unix)),
    ] {
        let ctx = format!(
            "streams={} splice={} local_streams={}",
            cfg.streams, cfg.splice, cfg.local_streams
        );
        let relay = TestRelay::start(cfg);
        let joins = (0..4).map(|r| join_opts("fb", "t", 4, r)).collect();
        let res = run_ranks(&relay.url(), joins, opts.clone(), |r, comm| async move {
            assert_eq!(comm.transport().data_stream_route(), route, "{r}");
            let x = Tensor::vector(&x_of(comm.rank()));
            comm.all_reduce(&x, ReduceOp::Sum, &comm.world())
                .await
                .map(|t| t.to_vec())
        });
        for (r, y) in all_ok(&ctx, res).into_iter().enumerate() {
            assert!(
                bits(&y) == bits(&local[r]),
                "{ctx}: rank {r} differs from run_local"
            );
        }
        relay.shutdown(Duration::from_secs(5));
    }
}

/// The relay's Unix-domain socket for local data streams: its path comes only with a welcome that
/// carries a stream key, the file and its directory are private to the relay's user, a hello there is checked like
/// one over TCP, a member whose Unix socket is unreachable attaches over TCP instead, and both
/// are gone after shutdown.
#[cfg(unix)]
#[test]
fn local_stream_socket_is_private_checked_falls_back_and_is_removed() {
    use distgrad::wire::StreamHello;
    use std::os::unix::fs::PermissionsExt;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let relay = TestRelay::default_config();
    let url = relay.url();
    let path = rank_runtime().block_on(async {
        // No stream asked for: no path told.
        let mut c = Raw::connect(&url).await;
        c.send_control(&Control::Join {
            room: "nopath".into(),
            token: Some(tok("t")),
            world: 2,
            rank: Some(0),
            stream: false,
        })
        .await;
        match c.next_control().await {
            Control::Welcome {
                stream_path: None,
                stream_key: None,
                ..
            } => {}
            other => panic!("a join without a stream got {other:?}"),
        }
        let mut c = Raw::connect(&url).await;
        c.send_control(&Control::Join {
            room: "uds".into(),
            token: Some(tok("t")),
            world: 2,
            rank: Some(0),
            stream: true,
        })
        .await;
        let (key, path) = match c.next_control().await {
            Control::Welcome {
                stream_key: Some(k),
                stream_path: Some(p),
                ..
            } => (k, p),
            other => panic!("expected a welcome with a key and a socket path, got {other:?}"),
        };
        let mode = std::fs::metadata(&path)
            .unwrap_or_else(|e| panic!("the socket {path}: {e}"))
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600, "socket file mode {mode:o}");
        let dir = std::path::Path::new(&path)
            .parent()
            .expect("the socket's directory");
        let dir_mode = std::fs::metadata(dir).unwrap().permissions().mode();
        assert_eq!(
            dir_mode & 0o777,
            0o700,
            "the socket's own directory is private: {dir_mode:o}"
        );
        // A wrong key is refused there too; the right one attaches.
        let hello = |key: &str| {
            StreamHello {
                room: "uds".into(),
                rank: 0,
                key: key.into(),
            }
            .encode()
        };
        let answer = |mut s: tokio::net::UnixStream, bytes: Vec<u8>| async move {
            s.write_all(&bytes).await.expect("send hello");
            let mut b = [0u8; 1];
            let got = tokio::time::timeout(WAIT, s.read(&mut b))
                .await
                .expect("the relay neither answered nor closed");
            (s, matches!(got, Ok(1)).then_some(b[0]))
        };
        let s = tokio::net::UnixStream::connect(&path)
            .await
            .expect("connect");
        let (_, a) = answer(s, hello("nope")).await;
        assert_ne!(a, Some(1), "a wrong key was accepted on the Unix socket");
        let s = tokio::net::UnixStream::connect(&path)
            .await
            .expect("connect");
        let (_s, a) = answer(s, hello(&key)).await;
        assert_eq!(a, Some(1), "the right key attaches on the Unix socket");
        path
    });
    // The socket file removed behind the relay's back: members attach over TCP and still work.
    std::fs::remove_file(&path).expect("remove the socket file");
    let joins = (0..3).map(|r| join_opts("fallback", "t", 3, r)).collect();
    let res = run_ranks(
        &url,
        joins,
        CommOptions::for_network(),
        |r, comm| async move {
            assert_eq!(
                comm.transport().data_stream_route(),
                Some(StreamRoute::Tcp),
                "rank {r}"
            );
            let x = Tensor::vector(&[r as f32 + 1.0; 5]);
            comm.all_reduce(&x, ReduceOp::Sum, &comm.world())
                .await
                .map(|t| t.to_vec())
        },
    );
    for y in all_ok("fallback to TCP", res) {
        assert_eq!(y, vec![6.0; 5]);
    }
    relay.shutdown(Duration::from_secs(5));

    // A fresh relay's socket file exists while it runs and is gone once it stopped.
    let relay = TestRelay::default_config();
    let url = relay.url();
    let path = rank_runtime().block_on(async {
        let (_c, _key) = raw_join_with_stream(&url, "gone", 2, 0).await;
        let mut c = Raw::connect(&url).await;
        c.send_control(&Control::Join {
            room: "gone".into(),
            token: Some(tok("t")),
            world: 2,
            rank: Some(1),
            stream: true,
        })
        .await;
        match c.next_control().await {
            Control::Welcome {
                stream_path: Some(p),
                ..
            } => p,
            other => panic!("expected a welcome with a socket path, got {other:?}"),
        }
    });
    assert!(std::path::Path::new(&path).exists(), "{path} while serving");
    relay.shutdown(Duration::from_secs(5));
    assert!(
        !std::path::Path::new(&path).exists(),
        "{path} after shutdown"
    );
    let dir = std::path::Path::new(&path)
        .parent()
        .expect("the socket's directory");
    assert!(!dir.exists(), "{} after shutdown", dir.display());
}

/// Set (by [`only_loopback_members_are_told_the_unix_socket`]) for its run in a network namespace.
const NETNS_INNER: &str = "DISTGRAD_NETNS_INNER";
/// What that run prints once all its checks passed.
const NETNS_OK: &str = "netns check: ok (non-loopback member: tcp, loopback member: unix)";

/// Only members that reached the relay on a loopback address are told its Unix-domain socket: in
/// a network namespace of the test's own, where 192.0.2.1 (TEST-NET-1) is an address of this host
/// that nothing outside sees, a relay on 0.0.0.0 names the socket in the welcome of a member that
/// joined on 127.0.0.1 and not in that of one that joined on 192.0.2.1 (its source address), and
/// our transport's data streams take the Unix socket and TCP respectively. The test runs itself
/// again under `unshare -n` (needs root or user namespaces, and iproute2's `ip`; it says why it
/// skipped otherwise), and passes only if that run printed [`NETNS_OK`].
#[cfg(target_os = "linux")]
#[test]
fn only_loopback_members_are_told_the_unix_socket() {
    const NAME: &str = "only_loopback_members_are_told_the_unix_socket";
    if std::env::var_os(NETNS_INNER).is_some() {
        return netns_only_loopback_members_are_told_the_unix_socket();
    }
    // As root `unshare -n`; otherwise a user namespace as well (`-rn`), where the kernel allows it.
    let mut tried = Vec::new();
    let mut flags = None;
    for f in ["-n", "-rn"] {
        match Command::new("unshare").args([f, "true"]).output() {
            Ok(o) if o.status.success() => {
                flags = Some(f);
                break;
            }
            Ok(o) => tried.push(format!(
                "`unshare {f} true` failed ({}): {}",
                o.status,
                String::from_utf8_lossy(&o.stderr).trim()
            )),
            Err(e) => tried.push(format!("cannot run `unshare` (util-linux): {e}")),
        }
    }
    let Some(flags) = flags else {
        eprintln!("skipped: {}", tried.join("; "));
        return;
    };
    if let Err(e) = Command::new("ip").arg("-V").output() {
        eprintln!("skipped: cannot run `ip` (iproute2): {e}");
        return;
    }
    let mut cmd = Command::new("unshare");
    cmd.args([flags, "--"])
        .arg(std::env::current_exe().expect("current_exe"))
        .args(["--exact", NAME, "--nocapture", "--test-threads=1"])
        .env(NETNS_INNER, "1");
    let out = run_bounded(cmd, "this test under `unshare -n`", Duration::from_secs(60));
    let (so, se) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(
        // (libtest may print "test NAME ... " on the same line before the test's own output.)
        out.status.success() && so.contains(NETNS_OK),
        "the run in a network namespace ({}) did not print {NETNS_OK:?}\n\
         stdout:\n{so}\nstderr:\n{se}",
        out.status
    );
    println!("{NETNS_OK}");
}

/// [`only_loopback_members_are_told_the_unix_socket`] inside its network namespace.
#[cfg(target_os = "linux")]
fn netns_only_loopback_members_are_told_the_unix_socket() {
    let ip = |args: &[&str]| -> std::result::Result<(), String> {
        let o = Command::new("ip")
            .args(args)
            .output()
            .map_err(|e| e.to_string())?;
        if o.status.success() {
            Ok(())
        } else {
            Err(String::from_utf8_lossy(&o.stderr).trim().to_string())
        }
    };
    let must = |args: &[&str]| ip(args).unwrap_or_else(|e| panic!("ip {args:?}: {e}"));
    must(&["link", "set", "lo", "up"]);
    // A second interface where the kernel has dummy ones, else lo: either way 192.0.2.1 is an
    // address of this host that is no loopback address.
    let dev = match ip(&["link", "add", "dg0", "type", "dummy"]) {
        Ok(()) => "dg0",
        Err(e) => {
            println!("no dummy interface ({e}); 192.0.2.1 goes on lo");
            "lo"
        }
    };
    must(&["addr", "add", "192.0.2.1/24", "dev", dev]);
    must(&["link", "set", dev, "up"]);

    let relay = TestRelay::start_on("0.0.0.0:0", scripted());
    let port = relay.addr.port();
    let (far, near) = (
        format!("ws://192.0.2.1:{port}/ws"),
        format!("ws://127.0.0.1:{port}/ws"),
    );
    // What the relay tells each member in its welcome.
    rank_runtime().block_on(async {
        let (c, _, far_path) = raw_join_with_stream_path(&far, "told", 2, 0).await;
        let tokio_tungstenite::MaybeTlsStream::Plain(s) = c.ws.get_ref() else {
            unreachable!("ws:// is plain TCP")
        };
        let from = s.local_addr().expect("local_addr").ip();
        assert_eq!(from.to_string(), "192.0.2.1", "the far member's address");
        let (_near, _, near_path) = raw_join_with_stream_path(&near, "told", 2, 1).await;
        assert_eq!(
            far_path, None,
            "a member that joined from {from} was told the relay's Unix-domain socket"
        );
        assert!(
            near_path.is_some(),
            "a member that joined from 127.0.0.1 was not told the relay's Unix-domain socket"
        );
    });
    // The route each of our transport's members takes.
    let route = |url: &str, rank: u32| {
        rank_runtime().block_on(async {
            let t = WsTransport::connect(url, join_opts("routes", "t", 2, rank))
                .await
                .unwrap_or_else(|e| panic!("rank {rank} joins on {url}: {e}"));
            let r = t.data_stream_route();
            t.close().await;
            r
        })
    };
    let routes = std::thread::scope(|s| {
        let far = s.spawn(|| route(&far, 0));
        let near = s.spawn(|| route(&near, 1));
        (far.join().unwrap(), near.join().unwrap())
    });
    assert_eq!(
        routes,
        (Some(StreamRoute::Tcp), Some(StreamRoute::Unix)),
        "data stream routes (member on 192.0.2.1, member on 127.0.0.1)"
    );
    relay.shutdown(Duration::from_secs(5));
    println!("{NETNS_OK}");
}

/// A member that never reads its data stream: the relay's forward to it makes no progress, so
/// after the idle timeout that member is disconnected with the reason, the rest of the frame is
/// dropped, the sender learns that its peer is lost, and the relay keeps serving.
#[test]
fn a_stream_that_is_never_read_is_cut_off_and_its_sender_told() {
    use distgrad::wire::StreamHello;
    let relay = TestRelay::start(RelayConfig {
        idle_timeout: Duration::from_secs(2),
        ..scripted()
    });
    let (url, addr) = (relay.url(), relay.addr);
    let (stalled_tx, stalled_rx) = mpsc::channel::<String>();
    let url2 = url.clone();
    let stalled = std::thread::spawn(move || {
        rank_runtime().block_on(async move {
            let (mut ws, key) = raw_join_with_stream(&url2, "stall", 2, 1).await;
            let hello = StreamHello {
                room: "stall".into(),
                rank: 1,
                key,
            };
            // Attached, then never read.
            let (_stream, answer) = stream_hello(addr, &hello.encode()).await;
            assert_eq!(answer, Some(1));
            ws.wait_ready().await;
            let r = ws.expect_refusal().await;
            let _ = stalled_tx.send(r.error.unwrap_or_default());
        })
    });
    rank_runtime().block_on(async {
        let t = WsTransport::connect(&url, join_opts("stall", "t", 2, 0))
            .await
            .expect("rank 0 joins");
        assert!(t.has_data_stream());
        let t0 = Instant::now();
        let big = Bytes::from(vec![7u8; 64 << 20]);
        // The send may complete (the relay drops the rest once rank 1 is gone) or fail; either
        // way the receive from rank 1 must fail, naming it, well before any collective timeout.
        let _ = t.send(1, p2p_tag(1), big).await;
        let got = tokio::time::timeout(WAIT, t.recv(1, p2p_tag(2))).await;
        match got {
            Ok(Err(e)) => assert!(names_lost_rank(&e, 1), "{e}"),
            Ok(Ok(_)) => panic!("a message from the stalled rank"),
            Err(_) => panic!("rank 0 was not told within {WAIT:?} that rank 1 is gone"),
        }
        eprintln!("stalled receiver cut off after {:?}", t0.elapsed());
        t.close().await;
    });
    let why = stalled_rx
        .recv_timeout(WAIT)
        .expect("rank 1 was not disconnected");
    assert!(
        why.contains("data stream") || why.contains("idle"),
        "rank 1 was told: {why:?}"
    );
    stalled.join().expect("stalled thread");
    quick_all_reduce(&url, "after-stall", 2);
    relay.shutdown(Duration::from_secs(5));
}
