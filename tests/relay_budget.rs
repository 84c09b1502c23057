//! The relay's memory budget and its teacher's controls (#40 items 4 and 9): rooms whose members
//! never read cannot pin more than the budget, a member whose writes stall is dropped, a sender
//! waiting for room still sees removal, and the admin API lists, closes and removes.

mod common_relay;

use std::time::{Duration, Instant};

use common_relay::*;
use distgrad::relay::RelayConfig;
use futures::SinkExt;
use tokio_tungstenite::tungstenite::Message;

const ADMIN: &str = "admin-token-for-the-tests-0001";

/// The admin status, parsed.
async fn status(relay: &TestRelay) -> serde_json::Value {
    let (code, body) = http(relay.addr, "GET", "/admin/api/status", Some(ADMIN)).await;
    assert_eq!(code, 200, "status: {body}");
    serde_json::from_str(&body).unwrap_or_else(|e| panic!("status JSON {body:?}: {e}"))
}

/// The members' ranks of room `name` in `s` (empty if it is gone).
fn ranks(s: &serde_json::Value, name: &str) -> Vec<u64> {
    s["rooms"]["list"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|r| r["name"] == name)
        .flat_map(|r| r["members"].as_array().cloned().unwrap_or_default())
        .filter_map(|m| m["rank"].as_u64())
        .collect()
}

/// Keep `sink` alive without reading: a ping to the relay every 300 ms, for `d`.
async fn ping_for(sink: &mut Raw, d: Duration) {
    let t0 = Instant::now();
    while t0.elapsed() < d {
        if sink
            .ws
            .send(Message::Ping(Vec::new().into()))
            .await
            .is_err()
        {
            return;
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

/// Send 16 MiB from `sender` (rank 0) to rank 1 in frames of 60 KiB, as far as the relay takes
/// them (it stops reading when its queues are full).
async fn flood(sender: &mut Raw) {
    let payload = vec![7u8; 60 << 10];
    for seq in 0..(16 << 20) / payload.len() as u64 {
        if sender
            .send_binary(frame(0, 1, seq, &payload))
            .await
            .is_err()
        {
            return;
        }
    }
}

/// The attack of the issue, scaled down: four rooms of two, each rank 0 sending 16 MiB to a rank
/// 1 that never reads but pings. Each member's queue takes 8 MiB, so without a relay-wide budget
/// the relay would hold 32 MiB for them; with a budget of 12 MiB it holds at most that (senders
/// wait), and once the sinks' writes have stalled for the idle timeout they are dropped and the
/// memory is free again; then a legitimate room runs.
#[test]
fn rooms_that_never_read_cannot_pin_more_than_the_budget() {
    let budget = 12usize << 20;
    let relay = TestRelay::start(RelayConfig {
        max_frame: 64 << 10,
        max_pending_bytes: 8 << 20,
        memory_budget: budget,
        idle_timeout: Duration::from_secs(3),
        admin_token: Some(ADMIN.into()),
        ..scripted()
    });
    let url = relay.url();
    rank_runtime().block_on(async {
        let mut pairs = Vec::new();
        for i in 0..4 {
            let room = format!("pin-{i}");
            let (sender, _) = Raw::join(&url, &room, Some("t"), 2, 0).await;
            let (sink, _) = Raw::join(&url, &room, Some("t"), 2, 1).await;
            pairs.push((sender, sink));
        }
        let local = tokio::task::LocalSet::new();
        let (peak, after) = local
            .run_until(async {
                for (mut sender, mut sink) in pairs {
                    tokio::task::spawn_local(async move { flood(&mut sender).await });
                    tokio::task::spawn_local(async move {
                        ping_for(&mut sink, Duration::from_secs(20)).await
                    });
                }
                // Before the sinks' writes stall for the idle timeout: the budget fills.
                let mut peak = 0u64;
                let t0 = Instant::now();
                while t0.elapsed() < Duration::from_millis(2500) {
                    let s = status(&relay).await;
                    assert_eq!(s["memory"]["budget_bytes"], budget as u64);
                    peak = peak.max(s["memory"]["queued_bytes"].as_u64().unwrap());
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                // The sinks' writes stall; each is dropped, and what was queued for it is freed.
                let t0 = Instant::now();
                let after = loop {
                    let s = status(&relay).await;
                    let sinks_left = (0..4).all(|i| !ranks(&s, &format!("pin-{i}")).contains(&1));
                    if sinks_left && s["memory"]["queued_bytes"] == 0 {
                        break t0.elapsed();
                    }
                    assert!(
                        t0.elapsed() < Duration::from_secs(15),
                        "sinks that never read are still members (or hold memory): {s}"
                    );
                    tokio::time::sleep(Duration::from_millis(100)).await;
                };
                (peak, after)
            })
            .await;
        eprintln!(
            "budget {budget} bytes: peak queued {peak} bytes; sinks dropped and memory freed \
             {:.1} s after the peak window",
            after.as_secs_f64()
        );
        assert!(
            peak <= budget as u64,
            "queued {peak} bytes, over the budget of {budget}"
        );
        assert!(
            peak >= (budget as u64) * 3 / 4,
            "the attack filled only {peak} of {budget} bytes: the test did not test the budget"
        );
    });
    quick_all_reduce(&url, "after-the-pin", 2);
}

/// A sender waiting for room at a destination that does not read still sees its removal (here by
/// the admin): it goes at once, not when the destination is dropped an idle timeout later.
#[test]
fn a_sender_waiting_for_room_is_still_removed() {
    let relay = TestRelay::start(RelayConfig {
        max_frame: 64 << 10,
        max_pending_bytes: 1 << 20,
        idle_timeout: Duration::from_secs(10),
        admin_token: Some(ADMIN.into()),
        ..scripted()
    });
    let url = relay.url();
    rank_runtime().block_on(async {
        let (mut sender, _) = Raw::join(&url, "wait", Some("t"), 2, 0).await;
        let (mut sink, _) = Raw::join(&url, "wait", Some("t"), 2, 1).await;
        let local = tokio::task::LocalSet::new();
        local
            .run_until(async {
                tokio::task::spawn_local(async move { flood(&mut sender).await });
                tokio::task::spawn_local(async move {
                    ping_for(&mut sink, Duration::from_secs(20)).await
                });
                // The sender's queue at the sink fills; the sender now waits inside the relay.
                let t0 = Instant::now();
                loop {
                    let s = status(&relay).await;
                    // Full: the next frame (60 KiB and its 24-byte header) does not fit.
                    let frame = 24 + (60u64 << 10);
                    if s["memory"]["queued_bytes"].as_u64().unwrap() + frame > 1 << 20 {
                        break;
                    }
                    assert!(t0.elapsed() < WAIT, "the queue never filled: {s}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                let (code, body) = http(
                    relay.addr,
                    "POST",
                    "/admin/api/remove?room=wait&rank=0",
                    Some(ADMIN),
                )
                .await;
                assert_eq!(code, 200, "{body}");
                let t0 = Instant::now();
                loop {
                    let s = status(&relay).await;
                    if !ranks(&s, "wait").contains(&0) {
                        break;
                    }
                    assert!(
                        t0.elapsed() < Duration::from_secs(2),
                        "a sender waiting for room was not removed within 2 s: {s}"
                    );
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            })
            .await;
    });
}

/// The admin API needs its token; lists rooms with their members; removes a member (its peers
/// are told who left and why) and closes a room (every member told); names what it cannot find.
/// A relay without a token has no admin routes.
#[test]
fn the_admin_lists_removes_and_closes() {
    let relay = TestRelay::start(RelayConfig {
        admin_token: Some(ADMIN.into()),
        ..scripted()
    });
    let url = relay.url();
    rank_runtime().block_on(async {
        for (token, want) in [(None, 401), (Some("wrong-token-wrong-token"), 401)] {
            let (code, _) = http(relay.addr, "GET", "/admin/api/status", token).await;
            assert_eq!(code, want, "token {token:?}");
            let (code, _) = http(relay.addr, "POST", "/admin/api/close?room=a", token).await;
            assert_eq!(code, want, "close with token {token:?}");
        }
        let (code, page) = http(relay.addr, "GET", "/admin", None).await;
        assert!(
            code == 200 && page.contains("/admin/admin.js"),
            "{code}: {page}"
        );
        let mut a: Vec<Raw> = Vec::new();
        for r in 0..3 {
            a.push(Raw::join(&url, "a", Some("t"), 3, r).await.0);
        }
        let (mut b0, _) = Raw::join(&url, "b", Some("t"), 2, 0).await;
        let s = status(&relay).await;
        assert_eq!(ranks(&s, "a"), vec![0, 1, 2]);
        assert_eq!(ranks(&s, "b"), vec![0]);
        assert_eq!(s["rooms"]["open"], 2);
        let member = &s["rooms"]["list"][0]["members"][0];
        assert_eq!(member["addr"], "127.0.0.1", "{member}");
        // Remove rank 2 of a: ranks 0 and 1 are told it left, and why.
        let (code, body) = http(
            relay.addr,
            "POST",
            "/admin/api/remove?room=a&rank=2",
            Some(ADMIN),
        )
        .await;
        assert_eq!(code, 200, "{body}");
        for peer in &mut a[..2] {
            loop {
                match peer.next_control().await {
                    distgrad::wire::Control::PeerLeft { rank, reason } => {
                        assert_eq!(rank, 2);
                        assert!(reason.contains("removed by the relay's admin"), "{reason}");
                        break;
                    }
                    _ => continue,
                }
            }
        }
        let e = a[2].expect_refusal().await.error.unwrap_or_default();
        assert!(
            e.contains("removed by the relay's admin"),
            "rank 2 told {e:?}"
        );
        // Close b: its member is told.
        let (code, body) = http(relay.addr, "POST", "/admin/api/close?room=b", Some(ADMIN)).await;
        assert_eq!(code, 200, "{body}");
        let e = b0.expect_refusal().await.error.unwrap_or_default();
        assert!(
            e.contains("room closed by the relay's admin"),
            "b's member told {e:?}"
        );
        for (path, want) in [
            ("/admin/api/close?room=nope", "no room \"nope\""),
            ("/admin/api/remove?room=a&rank=7", "has no member of rank 7"),
        ] {
            let (code, body) = http(relay.addr, "POST", path, Some(ADMIN)).await;
            assert!(code == 404 && body.contains(want), "{path}: {code} {body}");
        }
    });
    let plain = TestRelay::default_config();
    rank_runtime().block_on(async {
        let (code, _) = http(plain.addr, "GET", "/admin/api/status", Some(ADMIN)).await;
        assert_eq!(
            code, 404,
            "a relay without an admin token has no admin routes"
        );
    });
}
