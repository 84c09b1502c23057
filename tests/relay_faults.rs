//! The relay when things go wrong: join refusals, peer loss, a hostile third-party client, idle
//! timeouts, backpressure from slow or stalled receivers.
//!
//! Every test talks only to 127.0.0.1 (port 0), and every wait is bounded (raw-client waits by
//! `common_relay::WAIT`, collectives by `CommOptions::timeout`), so a broken relay fails a test
//! instead of hanging it.

mod common_relay;

use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use common_relay::*;
use distgrad::collective::Kind;
use distgrad::relay::RelayConfig;
use distgrad::transport::Transport;
use distgrad::transport::ws::{JoinOptions, WsTransport};
use distgrad::vjp;
use distgrad::wire::{Control, HEADER_LEN, Header};
use distgrad::{CommOptions, Communicator, Error, ReduceOp, Tensor};
use futures::SinkExt as _;
use tokio_tungstenite::tungstenite::Message;

// ---------------------------------------------------------------------------------------------
// 2b. Join refusals

// ---------------------------------------------------------------------------------------------

fn relay_detail(r: distgrad::Result<WsTransport>, what: &str) -> String {
    match r {
        Ok(_) => panic!("{what}: the relay accepted the join"),
        Err(Error::Relay { detail }) => detail,
        Err(e) => panic!("{what}: expected Error::Relay, got {e:?}"),
    }
}

/// A second client joining an existing room with a wrong (or missing) token, another world size, a
/// taken rank or a rank outside the world is refused with a clear message, and the room is left as
/// it was; the right join then fills it; a started room refuses late joiners; limits on world size
/// and room count hold.
#[test]
fn join_refusals_say_why_and_leave_the_room_unchanged() {
    let relay = TestRelay::start(RelayConfig {
        max_members: 8,
        max_rooms: 2,
        ..scripted()
    });
    let url = relay.url();
    rank_runtime().block_on(async {
        let (mut creator, w) = Raw::join(&url, "guarded", Some("s3cret"), 2, 0).await;
        assert_eq!(w.token, tok("s3cret"), "the room takes the creator's token");
        assert_eq!((w.rank, w.world, w.members.clone()), (0, 2, vec![0]));

        let mut j = join_opts("guarded", "wrong", 2, 1);
        j.ready_timeout = Duration::from_secs(5);
        let d = relay_detail(WsTransport::connect(&url, j.clone()).await, "wrong token");
        assert!(d.contains("wrong token"), "wrong token refusal says: {d:?}");
        assert!(
            !d.contains(&tok("s3cret")),
            "the refusal leaks the room token: {d:?}"
        );

        j.token = None;
        let d = relay_detail(WsTransport::connect(&url, j.clone()).await, "no token");
        assert!(d.contains("wrong token"), "join without token says: {d:?}");

        j.token = Some(tok("s3cret"));
        j.world = 3;
        let d = relay_detail(WsTransport::connect(&url, j.clone()).await, "world 3 vs 2");
        assert!(
            d.contains("world 2") && d.contains("not 3"),
            "world mismatch refusal should name both worlds: {d:?}"
        );

        j.world = 2;
        j.rank = Some(0);
        let d = relay_detail(WsTransport::connect(&url, j.clone()).await, "taken rank");
        assert!(
            d.contains("rank 0 is taken"),
            "taken-rank refusal says: {d:?}"
        );

        j.rank = Some(7);
        let d = relay_detail(WsTransport::connect(&url, j.clone()).await, "rank 7 of 2");
        assert!(
            d.contains("rank 7 outside world 2"),
            "out-of-world rank refusal says: {d:?}"
        );

        let mut big = join_opts("too-big", "t", 9, 0);
        big.ready_timeout = Duration::from_secs(5);
        let d = relay_detail(WsTransport::connect(&url, big).await, "world 9 > max 8");
        assert!(
            d.contains("world 9 outside 1..=8"),
            "max_members refusal says: {d:?}"
        );

        // None of the refused joins touched the room: the creator hears only its own members note
        // and then, after the right join, ready with both ranks.
        match creator.next_control().await {
            Control::Members { members } => assert_eq!(members, vec![0]),
            other => panic!("creator: expected its members note, got {other:?}"),
        }
        j.rank = Some(1);
        let t = WsTransport::connect(&url, j.clone())
            .await
            .expect("the right token, world and rank must be accepted");
        assert_eq!(
            (t.rank(), t.world(), t.token()),
            (1, 2, tok("s3cret").as_str())
        );
        match creator.next_control().await {
            Control::Ready { members, .. } => assert_eq!(
                members,
                vec![0, 1],
                "refused joins must not have changed the membership"
            ),
            other => panic!("creator: expected ready, got {other:?}"),
        }

        // The room has started: nobody else gets in (even with the token and a free-looking rank).
        j.rank = None;
        let d = relay_detail(WsTransport::connect(&url, j.clone()).await, "late joiner");
        assert!(
            d.contains("already started"),
            "late-join refusal says: {d:?}"
        );

        // max_rooms = 2: "guarded" + one more; a third is refused until one room empties.
        let (second, _) = Raw::join(&url, "second", None, 2, 0).await;
        let mut third = join_opts("third", "t", 2, 0);
        third.ready_timeout = Duration::from_secs(5);
        let d = relay_detail(WsTransport::connect(&url, third).await, "third room");
        assert!(d.contains("relay is full"), "max_rooms refusal says: {d:?}");
        drop(second);
        // The relay notices the closed socket asynchronously and there is no event to await from
        // outside: retry (bounded) until the freed room slot can be used.
        let t0 = Instant::now();
        loop {
            let mut c = Raw::connect(&url).await;
            c.send_control(&Control::Join {
                room: "third".into(),
                token: None,
                world: 2,
                rank: Some(0),
                stream: false,
            })
            .await;
            match c.next_control().await {
                Control::Welcome { .. } => break,
                Control::Error { message } if message.contains("relay is full") => {
                    assert!(
                        t0.elapsed() < Duration::from_secs(5),
                        "the room of a member that left was not freed within 5 s"
                    );
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                other => panic!("joining a third room after one emptied: {other:?}"),
            }
        }
        drop(t);
    });
}

/// A room created without a token gets a random one, returned in the welcome and by
/// `WsTransport::token`; other members join with it.
#[test]
fn room_without_token_gets_a_random_one() {
    let relay = TestRelay::default_config();
    let url = relay.url();
    rank_runtime().block_on(async {
        let (mut a, w) = Raw::join(&url, "rnd", None, 2, 0).await;
        assert_eq!(
            w.token.len(),
            32,
            "random token should be 16 bytes (128 bits) hex: {:?}",
            w.token
        );
        assert!(
            w.token.bytes().all(|b| b.is_ascii_hexdigit()),
            "token {:?}",
            w.token
        );
        let (_b, w2) = Raw::join(&url, "rnd2", None, 2, 0).await;
        assert_ne!(w.token, w2.token, "two rooms got the same random token");
        let mut j = JoinOptions::new("rnd", 2);
        j.token = Some(w.token.clone());
        j.ready_timeout = Duration::from_secs(10);
        let t = WsTransport::connect(&url, j)
            .await
            .expect("join with the printed token");
        assert_eq!(t.token(), w.token);
        assert_eq!(
            t.rank(),
            1,
            "the free rank is assigned when none is asked for"
        );
        assert_eq!(a.wait_ready().await, vec![0, 1]);
    });
}

/// A WebSocket handshake to `url` from a page of origin `origin`.
fn request_from(
    url: &str,
    origin: &str,
) -> tokio_tungstenite::tungstenite::handshake::client::Request {
    use tokio_tungstenite::tungstenite::client::IntoClientRequest;
    let mut req = url.into_client_request().unwrap();
    req.headers_mut().insert("origin", origin.parse().unwrap());
    req
}

/// Browser origins: by default only the relay's own page (its Origin names the host the request
/// went to) may open a WebSocket: any other web page a student visits is refused at the handshake
/// (before the fix any page could, using up the class's per-address quota); an origin named in
/// `allowed_origins` and a native client (no Origin) get in.
#[test]
fn only_the_relays_own_page_and_named_origins_may_connect() {
    let refused =
        |r: std::result::Result<_, tokio_tungstenite::tungstenite::Error>, who: &str| match r {
            Err(tokio_tungstenite::tungstenite::Error::Http(resp)) => {
                assert_eq!(resp.status().as_u16(), 403, "status for {who}")
            }
            Err(e) => panic!("{who}: expected HTTP 403, got {e}"),
            Ok(_) => panic!("{who} was let in"),
        };
    let default = TestRelay::default_config();
    let own = format!("http://{}", default.addr);
    let url = default.url();
    rank_runtime().block_on(async {
        let with_origin = |o: &str| request_from(&url, o);
        let other = tokio_tungstenite::connect_async(with_origin("http://evil.example")).await;
        refused(other, "a page of another origin");
        let mine = tokio_tungstenite::connect_async(with_origin(&own)).await;
        assert!(
            mine.is_ok(),
            "the relay's own page refused: {:?}",
            mine.err()
        );
    });
    let relay = TestRelay::start(RelayConfig {
        allowed_origins: vec!["http://good.example".into()],
        ..scripted()
    });
    let url = relay.url();
    rank_runtime().block_on(async {
        let with_origin = |o: &str| request_from(&url, o);
        let bad = tokio_tungstenite::connect_async(with_origin("http://evil.example")).await;
        refused(bad, "a foreign origin");
        let good = tokio_tungstenite::connect_async(with_origin("http://good.example")).await;
        assert!(good.is_ok(), "allowed origin refused: {:?}", good.err());
        let (_native, w) = Raw::join(&url, "o", None, 1, 0).await;
        assert_eq!(w.members, vec![0], "native client (no Origin) joins");
    });
}

// ---------------------------------------------------------------------------------------------
// 2d. Peer loss

// ---------------------------------------------------------------------------------------------

/// Three ranks: 0 and 1 in this test, 2 a `distgrad worker` process that joins and blocks in its
/// all_reduce waiting for the others. The worker is killed; then ranks 0 and 1 run the same case
/// (forward + backward) and must fail with PeerLost (or an abort naming the lost rank) well within
/// 5 s. Another room on the same relay still works afterwards.
#[test]
fn killed_worker_process_fails_its_room_within_5s_and_the_relay_keeps_serving() {
    killed_worker(false);
}

/// The same with direct links between the three ranks (the worker's data comes over TCP, not the
/// relay): its death still fails the others within 5 s.
#[test]
fn killed_worker_with_direct_links_fails_its_room_within_5s() {
    killed_worker(true);
}

fn killed_worker(direct: bool) {
    let relay = TestRelay::default_config();
    let url = relay.url();
    let case = vjp::example_case(Kind::AllReduce, 3, ReduceOp::Sum, 0, None).unwrap();
    let prepared = vjp::Prepared::new(&case).unwrap();
    let mut worker = Child(Some(
        Command::new(BIN)
            // The token as the CLI's own parents pass it (not on the command line).
            .args(["worker", "--relay", &url, "--room", "loss"])
            .env("DISTGRAD_TOKEN", tok("tk"))
            .args([
                "--world",
                "3",
                "--rank",
                "2",
                "--collective",
                "all_reduce",
                "--json",
            ])
            .args(if direct {
                &["--direct", "127.0.0.1:0"][..]
            } else {
                &[][..]
            })
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn distgrad worker"),
    ));

    let (joined_tx, joined_rx) = mpsc::channel::<usize>();
    let (go_txs, go_rxs): (Vec<_>, Vec<_>) = (0..2).map(|_| mpsc::channel::<Instant>()).unzip();
    let results: Vec<(distgrad::Result<vjp::RankResult>, Duration)> = std::thread::scope(|s| {
        let handles: Vec<_> = go_rxs
            .into_iter()
            .enumerate()
            .map(|(r, go)| {
                let (url, prepared, joined_tx) = (&url, &prepared, joined_tx.clone());
                s.spawn(move || {
                    rank_runtime().block_on(async move {
                        let mut join = join_opts("loss", "tk", 3, r as u32);
                        if direct {
                            join.direct = Some(([127, 0, 0, 1], 0).into());
                        }
                        let t = WsTransport::connect(url, join)
                            .await
                            .unwrap_or_else(|e| panic!("rank {r}: joining: {e}"));
                        if direct {
                            let want: Vec<usize> = (0..3).filter(|&x| x != r).collect();
                            assert_eq!(t.direct_peers(), want, "rank {r}: direct links");
                        }
                        joined_tx.send(r).unwrap();
                        let killed_at = go.recv_timeout(Duration::from_secs(30)).expect("go");
                        // The options of a room's ranks, as the worker's (the same algorithms).
                        let comm = distgrad::P2p::new(t, distgrad::CommOptions::room());
                        let res = vjp::rank_result(&comm, prepared).await;
                        let took = killed_at.elapsed();
                        // as `distgrad worker` does: flush (e.g. this rank's abort) and close
                        comm.into_transport().close().await;
                        (res, took)
                    })
                })
            })
            .collect();
        for _ in 0..2 {
            joined_rx
                .recv_timeout(Duration::from_secs(30))
                .expect("ranks 0 and 1 could not join the room with the worker");
        }
        // The room is full, so the worker is past its join and about to block in its all_reduce
        // (ranks 0 and 1 have not started theirs). This pause only makes it likelier that the
        // kill lands inside the all_reduce; the outcome must be the same either way.
        std::thread::sleep(Duration::from_millis(300));
        let w = worker.get();
        assert!(
            w.try_wait().unwrap().is_none(),
            "the worker exited before it was killed (it should be waiting for ranks 0 and 1)"
        );
        w.kill().expect("kill worker");
        let killed_at = Instant::now();
        let _ = w.wait();
        for tx in &go_txs {
            tx.send(killed_at).unwrap();
        }
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (r, (res, took)) in results.iter().enumerate() {
        eprintln!("peer loss: rank {r} failed {took:?} after the worker was killed");
        match res {
            Ok(v) => panic!("rank {r}: the case succeeded although rank 2 was killed: {v:?}"),
            Err(e) => assert!(
                names_lost_rank(e, 2),
                "rank {r}: expected PeerLost(2) or an abort naming rank 2, got {e:?}"
            ),
        }
        assert!(
            *took < Duration::from_secs(5),
            "rank {r}: the loss of rank 2 was reported after {took:?} (limit 5 s)"
        );
    }
    quick_all_reduce(&url, "after-loss", 3);
}

/// World 4: ranks 1 and 2 enter an all_reduce; rank 3 (a raw client that never sends anything)
/// dies as soon as they have; rank 0 is slow and enters only 7 s later. The all_reduce can never
/// complete, so ranks 1 and 2 must fail with PeerLost (or an abort naming rank 3) within 5 s of
/// the loss — not only once the slow rank 0 shows up or at the communicator timeout.
///
/// (Ranks 1 and 2 are both waiting on rank 0 when rank 3 dies, and rank 3's ring successor is the
/// slow rank 0: no rank is waiting on a message from rank 3 at that moment.)
#[test]
fn pending_collective_fails_within_5s_when_a_peer_dies_while_another_is_slow() {
    let relay = TestRelay::default_config();
    let url = relay.url();
    let slow = Duration::from_secs(7);
    let url2 = url.clone();
    let dier = std::thread::spawn(move || {
        rank_runtime().block_on(async move {
            let (mut c, _) = Raw::join(&url2, "slow", Some("tk"), 4, 3).await;
            c.wait_ready().await;
            // the first data frame shows that a rank has entered its all_reduce
            let (h, _) = c.next_frame().await;
            assert_eq!(h.dst, 3);
            drop(c);
            Instant::now()
        })
    });
    let opts = CommOptions {
        timeout: Duration::from_secs(20),
        ..CommOptions::default()
    };
    let joins = (0..3).map(|r| join_opts("slow", "tk", 4, r)).collect();
    let res = run_ranks(&url, joins, opts, |_, comm| async move {
        if comm.rank() == 0 {
            tokio::time::sleep(slow).await;
        }
        let y = comm
            .all_reduce(&Tensor::vector(&[1.0]), ReduceOp::Sum, &comm.world())
            .await;
        Ok((y, Instant::now()))
    });
    let died_at = dier.join().expect("rank 3's thread");
    for (r, x) in res.into_iter().enumerate().skip(1) {
        let (y, failed_at) = x.unwrap();
        let took = failed_at.saturating_duration_since(died_at);
        eprintln!("rank {r}: all_reduce returned {took:?} after rank 3 died: {y:?}");
        match y {
            Ok(v) => panic!("rank {r}: all_reduce succeeded without rank 3: {v:?}"),
            Err(e) => assert!(
                names_lost_rank(&e, 3),
                "rank {r}: expected PeerLost(3) or an abort naming rank 3, got {e:?}"
            ),
        }
        assert!(
            took < Duration::from_secs(5),
            "rank {r}: its pending all_reduce failed only {took:?} after rank 3 died (limit 5 s); \
             it kept waiting for the slow rank 0 although the call can no longer complete"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// 2e. A hostile third-party client

// ---------------------------------------------------------------------------------------------

/// Garbage from a plain WebSocket client (malformed JSON, unknown message types, binary before
/// join, truncated / bad-magic / bad-channel / bad-flags / oversized frames, a destination outside
/// the world, no join at all): each time the relay answers `{"type":"error"}` naming the problem
/// and closes that connection with code 1008 and a reason; the peer in the room learns that the
/// offender left; a room that was running before keeps working, and new rooms work afterwards.
#[test]
fn hostile_client_gets_error_and_close_and_the_relay_survives() {
    const MAX_FRAME: usize = 4096;
    let relay = TestRelay::start(RelayConfig {
        max_frame: MAX_FRAME,
        join_timeout: Duration::from_millis(500),
        ..scripted()
    });
    let url = relay.url();

    // A healthy room that lives through the whole attack: two ranks in threads that wait for a
    // signal, then run an all_reduce.
    let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
    let (go_tx2, go_rx2) = std::sync::mpsc::channel::<()>();
    let url_b = url.clone();
    let bystanders = std::thread::spawn(move || {
        let gos = std::sync::Mutex::new(vec![Some(go_rx), Some(go_rx2)]);
        let joins = (0..2)
            .map(|r| {
                let mut j = join_opts("bystanders", "tb", 2, r);
                j.max_payload = MAX_FRAME - HEADER_LEN;
                j
            })
            .collect();
        let opts = CommOptions {
            timeout: Duration::from_secs(30),
            ..CommOptions::default()
        };
        run_ranks(&url_b, joins, opts, |i, comm| {
            let go = gos.lock().unwrap()[i].take().unwrap();
            async move {
                go.recv_timeout(Duration::from_secs(60)).expect("go");
                // 16 KiB per rank: fragmented into 4 KiB frames by the transport
                let x = Tensor::vector(&vec![comm.rank() as f32 + 0.5; 4096]);
                let y = comm.all_reduce(&x, ReduceOp::Sum, &comm.world()).await?;
                Ok(y.to_vec())
            }
        })
    });

    rank_runtime().block_on(async {
        // --- before join ---
        let before_join: Vec<(&str, Message, &str)> = vec![
            (
                "malformed JSON",
                Message::text("{\"type\": \"join\", \"room\": "),
                "malformed join",
            ),
            (
                "not JSON at all",
                Message::text("hello relay"),
                "malformed join",
            ),
            (
                "unknown message type",
                Message::text(r#"{"type":"frobnicate","x":1}"#),
                "malformed join",
            ),
            (
                "known type that is not a join",
                Message::text(r#"{"type":"ready","members":[0]}"#),
                "expected join",
            ),
            (
                "join with an unknown field",
                Message::text(r#"{"type":"join","room":"r","world":2,"admin":true}"#),
                "malformed join",
            ),
            (
                "binary frame before join",
                Message::Binary(frame(0, 1, 0, b"data")),
                "first message must be a JSON join",
            ),
            (
                "empty room name",
                Message::text(r#"{"type":"join","room":"","world":2}"#),
                "room name",
            ),
            (
                "world 0",
                Message::text(r#"{"type":"join","room":"z","world":0}"#),
                "world 0 outside",
            ),
        ];
        for (what, msg, want) in before_join {
            let mut c = Raw::connect(&url).await;
            let _ = c.ws.send(msg).await;
            let refusal = c.expect_refusal().await;
            check_refusal(&refusal, what, want);
        }
        // no join at all within join_timeout
        let mut c = Raw::connect(&url).await;
        let t0 = Instant::now();
        let refusal = c.expect_refusal().await;
        check_refusal(&refusal, "no join", "no join within");
        assert!(
            t0.elapsed() < Duration::from_secs(3),
            "a silent client was dropped only after {:?} (join_timeout 500 ms)",
            t0.elapsed()
        );

        // --- after a valid join: a victim (rank 1) and an offender (rank 0) in a fresh room ---
        let good_header = frame(0, 1, 0, &[]);
        let mut bad_magic = frame(0, 1, 0, b"payload").to_vec();
        bad_magic[0] = 0x00;
        let mut bad_channel = frame(0, 1, 0, b"payload").to_vec();
        bad_channel[1] = 9;
        let mut bad_flags = frame(0, 1, 0, b"payload").to_vec();
        bad_flags[2] = 0x80;
        let after_join: Vec<(&str, Message, &str)> = vec![
            (
                "truncated frame (10 bytes)",
                Message::Binary(good_header.slice(..10)),
                "shorter than the 24-byte header",
            ),
            (
                "empty binary frame",
                Message::Binary(Bytes::new()),
                "shorter than",
            ),
            (
                "bad magic byte",
                Message::Binary(bad_magic.into()),
                "bad magic byte 0x00",
            ),
            (
                "unknown channel",
                Message::Binary(bad_channel.into()),
                "unknown channel 9",
            ),
            (
                "unknown flags",
                Message::Binary(bad_flags.into()),
                "unknown flags",
            ),
            (
                "oversized frame",
                Message::Binary(frame(0, 1, 0, &vec![7u8; 2 * MAX_FRAME])),
                "exceeds the limit",
            ),
            (
                "destination outside the world",
                Message::Binary(frame(0, 9, 0, b"x")),
                "destination rank 9 outside world 2",
            ),
            (
                "malformed JSON after join",
                Message::text("{{{{"),
                "malformed control message",
            ),
            (
                "unknown message type after join",
                Message::text(r#"{"type":"frobnicate"}"#),
                "malformed control message",
            ),
            (
                "a second join",
                Message::text(r#"{"type":"join","room":"x","world":2}"#),
                "unexpected control message",
            ),
            // #40 item 7: the reason quotes the message, cut (before: all 60 KB of it went to
            // every member).
            (
                "a second join with a 60 KB room name",
                Message::text(format!(
                    r#"{{"type":"join","room":"{}","world":2}}"#,
                    "r".repeat(60_000)
                )),
                "unexpected control message",
            ),
        ];
        for (k, (what, msg, want)) in after_join.into_iter().enumerate() {
            let room = format!("hostile-{k}");
            let (mut offender, _) = Raw::join(&url, &room, Some("t"), 2, 0).await;
            let (mut victim, _) = Raw::join(&url, &room, Some("t"), 2, 1).await;
            assert_eq!(
                offender.wait_ready().await,
                vec![0, 1],
                "{what}: offender ready"
            );
            assert_eq!(
                victim.wait_ready().await,
                vec![0, 1],
                "{what}: victim ready"
            );
            let _ = offender.ws.send(msg).await;
            let refusal = offender.expect_refusal().await;
            check_refusal(&refusal, what, want);
            // the victim learns that rank 0 left, with the reason, and gets no garbage
            match victim.next_control().await {
                Control::PeerLeft { rank, reason } => {
                    assert_eq!(rank, 0, "{what}: PeerLeft names the offender");
                    assert!(
                        reason.len() <= distgrad::wire::MAX_ABORT_REASON,
                        "{what}: a reason of {} bytes",
                        reason.len()
                    );
                    assert!(
                        reason.contains(want),
                        "{what}: PeerLeft reason {reason:?} should contain {want:?}"
                    );
                }
                other => panic!("{what}: victim expected PeerLeft, got {other:?}"),
            }
        }

        // A frame far above the socket layer's hard limit (here 64 KiB): still an orderly close.
        let (mut offender, _) = Raw::join(&url, "huge", Some("t"), 1, 0).await;
        offender.wait_ready().await;
        let _ = offender
            .ws
            .send(Message::Binary(frame(0, 0, 0, &vec![1u8; 1 << 20])))
            .await;
        let refusal = offender.expect_refusal().await;
        assert!(
            refusal.error.is_some() || refusal.close_reason().is_some(),
            "1 MiB frame: the relay closed without saying why: {refusal:?}"
        );
        eprintln!("1 MiB frame refused with: {refusal:?}");
    });

    // The bystanders' room was live through all of that and still works.
    go_tx.send(()).unwrap();
    go_tx2.send(()).unwrap();
    let ys = all_ok(
        "bystander room after the attack",
        bystanders.join().unwrap(),
    );
    for (r, y) in ys.iter().enumerate() {
        assert!(
            y.iter().all(|&v| v == 0.5 + 1.5),
            "bystander rank {r}: wrong all_reduce result after the attack"
        );
    }
    // And new rooms work.
    quick_all_reduce(&url, "after-attack", 3);
}

fn check_refusal(r: &common_relay::Refusal, what: &str, want: &str) {
    let err = r.error.as_deref().unwrap_or_else(|| {
        panic!("{what}: no {{\"type\":\"error\"}} message from the relay: {r:?}")
    });
    assert!(
        err.contains(want),
        "{what}: error message {err:?} should contain {want:?}"
    );
    let (code, reason) = r.close_reason().unwrap_or_else(|| {
        panic!("{what}: the relay did not send a close frame with a code: {r:?}")
    });
    assert_eq!(
        code, 1008,
        "{what}: close code (policy violation) ; reason {reason:?}"
    );
    let head: String = reason.chars().take(40).collect();
    assert!(
        !reason.is_empty() && err.starts_with(&head),
        "{what}: close reason {reason:?} should be (a prefix of) the error {err:?}"
    );
}

/// The frame-size limit at its edges (max_frame = 4096): a frame of exactly 4096 bytes (header
/// included) is forwarded; one byte more than the limit the relay itself states in its error
/// message (max_frame + header) is refused with that message.
///
/// Note: `RelayConfig::max_frame` is documented as "header + payload", but the relay accepts frames
/// up to max_frame + 24 bytes (its check and error message add the header length); only the bounds
/// that hold under both readings are asserted here.
#[test]
fn frame_size_limit_edges() {
    const MAX_FRAME: usize = 4096;
    let relay = TestRelay::start(RelayConfig {
        max_frame: MAX_FRAME,
        ..scripted()
    });
    let url = relay.url();
    rank_runtime().block_on(async {
        let (mut a, _) = Raw::join(&url, "edge", Some("t"), 2, 0).await;
        let (mut b, _) = Raw::join(&url, "edge", Some("t"), 2, 1).await;
        a.wait_ready().await;
        b.wait_ready().await;
        let exact = frame(0, 1, 1, &vec![3u8; MAX_FRAME - HEADER_LEN]);
        assert_eq!(exact.len(), MAX_FRAME);
        a.send_binary(exact).await.unwrap();
        let (h, p) = b.next_frame().await;
        assert_eq!(
            (h.src, p.len()),
            (0, MAX_FRAME - HEADER_LEN),
            "a max_frame-byte frame"
        );
        let over = frame(0, 1, 2, &vec![3u8; MAX_FRAME + 1]);
        assert_eq!(over.len(), MAX_FRAME + HEADER_LEN + 1);
        a.send_binary(over).await.unwrap();
        let r = a.expect_refusal().await;
        check_refusal(
            &r,
            "frame 1 byte over the stated limit",
            "exceeds the limit of 4120",
        );
    });
}

/// `relay::serve` returns soon after its shutdown future resolves, even with clients connected.
#[test]
fn shutdown_returns_with_clients_connected() {
    let relay = TestRelay::default_config();
    let url = relay.url();
    let rt = rank_runtime();
    let (mut c, _) = rt.block_on(Raw::join(&url, "open", Some("t"), 2, 0));
    let took = relay.shutdown(Duration::from_secs(5));
    eprintln!("relay::serve returned {took:?} after shutdown with a client connected");
    // The member is told why before the connection goes away.
    let refusal = rt.block_on(c.expect_refusal());
    let said = format!("{:?} {:?}", refusal.error, refusal.close_reason());
    assert!(
        said.contains("shutting down"),
        "the client was not told: {said}"
    );
}

// ---------------------------------------------------------------------------------------------
// 2h. Idle timeout

// ---------------------------------------------------------------------------------------------

/// idle_timeout = 600 ms: a raw client that joins and then never reads (so never answers pings) is
/// closed with a reason, and its peers are told: a watcher gets PeerLeft("idle ..."), our transport's
/// recv from it fails with PeerLost. Live members (our transport, a reading watcher) stay connected
/// through silences longer than the idle timeout, because they answer the relay's pings.
async fn next_watch(rx: &mut tokio::sync::mpsc::UnboundedReceiver<Event>) -> Event {
    tokio::time::timeout(WAIT, rx.recv())
        .await
        .expect("watcher: nothing within the wait bound")
        .expect("watcher task ended")
}

#[test]
fn idle_client_is_dropped_and_peers_get_peer_lost() {
    let idle_timeout = Duration::from_millis(600);
    let relay = TestRelay::start(RelayConfig {
        idle_timeout,
        ..scripted()
    });
    let url = relay.url();
    rank_runtime().block_on(async {
        let (mut idle, _) = Raw::join(&url, "idle", Some("t"), 3, 0).await;
        let (watcher, _) = Raw::join(&url, "idle", Some("t"), 3, 2).await;
        // the watcher reads all the time (and so answers pings) in its own task
        let (ev_tx, mut ev_rx) = tokio::sync::mpsc::unbounded_channel::<Event>();
        let watch = tokio::spawn(async move {
            let mut w = watcher;
            while let Some(e) = w.next_within(Duration::from_secs(30)).await {
                let end = matches!(e, Event::Close(_) | Event::Ended(_));
                if ev_tx.send(e).is_err() || end {
                    break;
                }
            }
        });
        let t1 = WsTransport::connect(&url, join_opts("idle", "t", 3, 1))
            .await
            .expect("rank 1 joins");
        let t0 = Instant::now();
        // From here on `idle` is not read: the relay's pings go unanswered.
        let reason = loop {
            match next_watch(&mut ev_rx).await {
                Event::Text(t) => match serde_json::from_str::<Control>(&t).unwrap() {
                    Control::PeerLeft { rank, reason } => {
                        assert_eq!(rank, 0, "the idle client is rank 0, but rank {rank} left: {reason}");
                        break reason;
                    }
                    Control::Members { .. } | Control::Ready { .. } => continue,
                    other => panic!("watcher: unexpected {other:?}"),
                },
                other => panic!("watcher: unexpected {other:?}"),
            }
        };
        let after = t0.elapsed();
        eprintln!("idle client dropped {after:?} after the room filled; reason: {reason}");
        assert!(reason.contains("idle"), "PeerLeft reason should say idle: {reason:?}");
        assert!(
            after < idle_timeout * 4,
            "idle client dropped only after {after:?} (idle timeout {idle_timeout:?})"
        );
        let e = tokio::time::timeout(Duration::from_secs(5), t1.recv(0, p2p_tag(0)))
            .await
            .expect("rank 1's recv from the dropped rank 0 still waits")
            .expect_err("recv from a dropped peer must fail");
        assert!(
            names_lost_rank(&e, 0),
            "rank 1: expected PeerLost(0) or an abort naming rank 0, got {e:?}"
        );
        // The idle client's connection is closed. (What it reads now depends on the client
        // library: tungstenite first tries to answer the buffered pings, which fails on the closed
        // socket, so the error/close the relay sent may not be readable any more.)
        let refusal = idle.expect_refusal().await;
        if let Some(err) = &refusal.error {
            assert!(err.contains("idle for"), "idle client's error: {err:?}");
        }
        eprintln!("idle client saw: {refusal:?}");

        // Silence 3x the idle timeout; the live members must still be there.
        tokio::time::sleep(idle_timeout * 3).await;
        t1.send(2, p2p_tag(1), Bytes::from_static(b"still here")).await.unwrap();
        match next_watch(&mut ev_rx).await {
            Event::Binary(f) => {
                let h = Header::decode(&f).unwrap();
                assert_eq!((h.src, &f[HEADER_LEN..]), (1, &b"still here"[..]));
            }
            other => panic!(
                "a live member was treated as idle: expected rank 1's frame at the watcher, got {other:?}"
            ),
        }
        drop(t1);
        watch.abort();
    });
}

// ---------------------------------------------------------------------------------------------
// 2i. Backpressure

// ---------------------------------------------------------------------------------------------

/// max_pending_bytes = 256 KiB: our transport (rank 0) sends ~32 MiB in 64 KiB fragments (more
/// than the loopback socket buffers and the transport's queue hold together) to a raw receiver
/// (rank 1) that reads slowly; everything arrives intact and in order and the run ends. While rank
/// 1 does not read at all, another pair in the same room (2 -> 3) is not held up.
#[test]
fn slow_receiver_gets_everything_intact_and_in_order() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    const FRAME: usize = 64 << 10;
    let relay = TestRelay::start(RelayConfig {
        max_frame: FRAME,
        max_pending_bytes: 256 << 10,
        ..scripted()
    });
    let url = relay.url();
    let sizes: Vec<usize> = (0..80)
        .map(|k| (200 << 10) + (k * 37_337) % (400 << 10))
        .collect();
    let total: usize = sizes.iter().sum();
    let content = |k: usize, n: usize| -> Vec<u8> {
        (0..n).map(|i| ((i * 131 + k * 17) % 251) as u8).collect()
    };
    let received = Arc::new(AtomicUsize::new(0));
    let (sent_tx, sent_rx) = mpsc::channel::<(Duration, usize)>();
    let url_s = url.clone();
    let sizes_s = sizes.clone();
    let received_s = received.clone();
    let sender = std::thread::spawn(move || {
        rank_runtime().block_on(async move {
            let mut j = join_opts("bp", "t", 4, 0);
            j.max_payload = FRAME - HEADER_LEN;
            let t = WsTransport::connect(&url_s, j).await.expect("sender joins");
            let t0 = Instant::now();
            for (k, &n) in sizes_s.iter().enumerate() {
                t.send(1, p2p_tag(k as u64), content(k, n).into())
                    .await
                    .unwrap_or_else(|e| panic!("sender: message {k}: {e}"));
            }
            sent_tx
                .send((t0.elapsed(), received_s.load(Ordering::SeqCst)))
                .unwrap();
            t.close().await;
        })
    });
    rank_runtime().block_on(async {
        let (mut rx, _) = Raw::join(&url, "bp", Some("t"), 4, 1).await;
        let (mut c2, _) = Raw::join(&url, "bp", Some("t"), 4, 2).await;
        let (mut c3, _) = Raw::join(&url, "bp", Some("t"), 4, 3).await;
        c2.wait_ready().await;
        c3.wait_ready().await;
        // rank 1 is not reading yet; the sender fills its queue. The other pair still talks.
        for i in 0..20u64 {
            c2.send_binary(frame(2, 3, i, &vec![i as u8; 30_000]))
                .await
                .unwrap();
            let (h, p) = c3.next_frame().await;
            assert_eq!(
                (h.src, h.tag.seq, p.len()),
                (2, i, 30_000),
                "pair 2 -> 3 held up or garbled while rank 1 does not read"
            );
        }
        // now read slowly: 1 ms per 64 KiB frame
        let mut buf = Vec::new();
        let t0 = Instant::now();
        for (k, &n) in sizes.iter().enumerate() {
            loop {
                let (h, p) = rx.next_frame().await;
                assert_eq!(h.src, 0, "frame from an unexpected source");
                assert_eq!(
                    h.tag.seq, k as u64,
                    "message {k}: a fragment of message {} arrived (out of order or lost)",
                    h.tag.seq
                );
                buf.extend_from_slice(&p);
                received.fetch_add(p.len(), Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(1)).await;
                if !h.more {
                    break;
                }
            }
            assert_eq!(buf.len(), n, "message {k}: length");
            assert!(buf == content(k, n), "message {k}: content corrupted");
            buf.clear();
        }
        let (sent_after, got_then) = sent_rx
            .recv_timeout(WAIT)
            .expect("the sender did not finish");
        eprintln!(
            "backpressure: {} MiB received in {:.2} s; the sender's sends took {:.2} s and \
             returned when the receiver had read {:.1} MiB",
            total >> 20,
            t0.elapsed().as_secs_f64(),
            sent_after.as_secs_f64(),
            got_then as f64 / (1 << 20) as f64
        );
        assert_eq!(received.load(Ordering::SeqCst), total);
    });
    sender.join().expect("sender thread");
}

/// A refused join must not create the room it named: otherwise one client could use up
/// `max_rooms` and hold room names with a token of its choosing.
#[test]
fn refused_join_creates_no_room() {
    let relay = TestRelay::start(RelayConfig {
        max_rooms: 1,
        ..scripted()
    });
    let url = relay.url();
    rank_runtime().block_on(async {
        for _ in 0..3 {
            let mut j = join_opts("squatted", "attacker", 2, 5);
            j.ready_timeout = Duration::from_secs(5);
            let d = relay_detail(WsTransport::connect(&url, j).await, "rank outside world");
            assert!(d.contains("rank 5 outside world 2"), "refusal says: {d:?}");
        }
        // The only room slot is still free, and the name is not held with the attacker's token.
        let (_owner, w) = Raw::join(&url, "squatted", Some("owner"), 2, 0).await;
        assert_eq!(
            w.token,
            tok("owner"),
            "the room was created by the refused joins"
        );
    });
}

/// A receiver that never reads must stop its sender instead of filling the relay's memory: once the
/// relay's queue for it, the sockets' buffers and the client's own queue are full, a send waits,
/// and with a short send timeout it fails with a clear error. A relay that buffered without bound
/// would accept all 512 MiB below.
#[test]
fn a_receiver_that_never_reads_stops_its_sender() {
    let relay = TestRelay::start(RelayConfig {
        max_frame: 64 << 10,
        max_pending_bytes: 256 << 10,
        ..scripted()
    });
    let url = relay.url();
    rank_runtime().block_on(async {
        let (_stalled, _) = Raw::join(&url, "stall", Some("t"), 2, 1).await;
        let mut j = join_opts("stall", "t", 2, 0);
        j.max_payload = 64 << 10;
        j.send_timeout = Duration::from_secs(1);
        let t = WsTransport::connect(&url, j).await.expect("sender joins");
        let msg = Bytes::from(vec![7u8; 1 << 20]);
        let mut sent = 0usize;
        let err = loop {
            match t.send(1, p2p_tag(sent as u64), msg.clone()).await {
                Ok(()) => sent += 1,
                Err(e) => break e,
            }
            assert!(
                sent < 512,
                "512 MiB went into a relay whose receiver never reads"
            );
        };
        eprintln!("sender blocked after {sent} MiB: {err}");
        assert!(err.to_string().contains("accepted nothing"), "{err}");
    });
}

/// An abort reaches every peer at once over the relay path, even while one member is frozen (it
/// never reads, so the relay's queue for it is full and the aborting rank's data to it is stuck):
/// ranks 1 and 2, waiting on rank 0, fail with rank 0's reason within one send timeout of the
/// abort, not after the frozen member times out (nor world × timeout).
#[test]
fn an_abort_reaches_the_others_while_a_member_is_frozen() {
    let relay = TestRelay::start(RelayConfig {
        max_frame: 64 << 10,
        max_pending_bytes: 256 << 10,
        idle_timeout: Duration::from_secs(20),
        ..scripted()
    });
    let url = relay.url();
    const SEND_TIMEOUT: Duration = Duration::from_secs(3);
    // The frozen member stays until the test is done with it.
    let (release, released) = mpsc::channel::<()>();
    std::thread::scope(|s| {
        // Rank 3: joins and never reads again.
        let frozen = s.spawn(|| {
            rank_runtime().block_on(async {
                let (raw, _) = Raw::join(&url, "frozen", Some("t"), 4, 3).await;
                let _ = tokio::task::spawn_blocking(move || {
                    released.recv_timeout(Duration::from_secs(60))
                })
                .await;
                drop(raw);
            })
        });
        let waiters: Vec<_> = [1u32, 2]
            .into_iter()
            .map(|r| {
                let url = &url;
                s.spawn(move || {
                    rank_runtime().block_on(async move {
                        let mut j = join_opts("frozen", "t", 4, r);
                        j.send_timeout = SEND_TIMEOUT;
                        let t = WsTransport::connect(url, j).await.expect("join");
                        let got =
                            tokio::time::timeout(Duration::from_secs(15), t.recv(0, p2p_tag(999)))
                                .await
                                .expect("the waiting rank heard nothing within 15 s");
                        (r, got.map(|_| ()), Instant::now())
                    })
                })
            })
            .collect();
        let aborter = s.spawn(|| {
            rank_runtime().block_on(async {
                let mut j = join_opts("frozen", "t", 4, 0);
                j.max_payload = 64 << 10;
                j.send_timeout = SEND_TIMEOUT;
                let t = WsTransport::connect(&url, j).await.expect("join");
                // Fill the relay's queue for the frozen rank: sends to it stall.
                let msg = Bytes::from(vec![7u8; 1 << 20]);
                let stuck = async {
                    for k in 0..64u64 {
                        if t.send(3, p2p_tag(k), msg.clone()).await.is_err() {
                            break;
                        }
                    }
                };
                let abort = async {
                    tokio::time::sleep(Duration::from_millis(800)).await;
                    let at = Instant::now();
                    t.abort("rank 0 gave up (test)").await;
                    (at, at.elapsed())
                };
                let (_, (at, took)) = tokio::join!(stuck, abort);
                // Stay in the room: the others must learn of the abort from its notes, not from
                // this rank's connection ending.
                tokio::time::sleep(SEND_TIMEOUT + Duration::from_secs(2)).await;
                (at, took)
            })
        });
        let (at, took) = aborter.join().expect("aborting rank");
        eprintln!("rank 0's abort returned after {took:?}");
        for w in waiters {
            let (r, got, seen) = w.join().expect("waiting rank");
            let e = got.expect_err("the recv must fail");
            assert!(seen >= at, "rank {r} failed before the abort: {e}");
            let after = seen - at;
            eprintln!("rank {r}: failed {after:?} after the abort: {e}");
            assert!(
                e.to_string().contains("rank 0 gave up (test)"),
                "rank {r} names rank 0's reason: {e}"
            );
            assert!(
                after <= SEND_TIMEOUT + Duration::from_secs(1),
                "rank {r} learned of the abort {after:?} after it (one send timeout is {SEND_TIMEOUT:?})"
            );
        }
        let _ = release.send(());
        frozen.join().expect("frozen rank");
    });
}

/// The relay forwards one abort per member, to every other member, stamped with the sender's rank
/// and its reason cut to `MAX_ABORT_REASON` bytes; a second abort from the same member goes
/// nowhere (no flooding the others' queues with notes).
#[test]
fn the_relay_forwards_one_abort_per_member() {
    let relay = TestRelay::default_config();
    let url = relay.url();
    rank_runtime().block_on(async {
        let (mut a, _) = Raw::join(&url, "aborts", Some("t"), 3, 0).await;
        let (mut b, _) = Raw::join(&url, "aborts", Some("t"), 3, 1).await;
        let (mut c, _) = Raw::join(&url, "aborts", Some("t"), 3, 2).await;
        for r in [&mut a, &mut b, &mut c] {
            // Members, then ready.
            while !matches!(r.next_control().await, Control::Ready { .. }) {}
        }
        // One ASCII byte first: byte 1024 falls inside an "é", so the cut must back off to 1023.
        let long = format!("x{}", "é".repeat(3000));
        a.send_control(&Control::Abort {
            from: Some(2),
            reason: long.clone(),
        })
        .await;
        a.send_control(&Control::Abort {
            from: None,
            reason: "again".into(),
        })
        .await;
        for (name, r) in [("rank 1", &mut b), ("rank 2", &mut c)] {
            match r.next_control().await {
                Control::Abort { from, reason } => {
                    // The relay stamps the true sender, whatever the note claims.
                    assert_eq!(from, Some(0), "{name}");
                    assert_eq!(reason.len(), distgrad::wire::MAX_ABORT_REASON - 1, "{name}");
                    assert!(
                        long.starts_with(&reason),
                        "{name}: cut at a character boundary"
                    );
                }
                other => panic!("{name}: expected the abort, got {other:?}"),
            }
            let next = r.next_within(Duration::from_millis(500)).await;
            assert!(
                next.is_none(),
                "{name}: a second abort from the same member was forwarded: {next:?}"
            );
        }
        let back = a.next_within(Duration::from_millis(300)).await;
        assert!(
            back.is_none(),
            "the sender got its own abort back: {back:?}"
        );
    });
}
