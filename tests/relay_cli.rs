//! The command line's relay and worker, as a user meets them.
//!
//! Every test talks only to 127.0.0.1 (port 0), and every wait is bounded (raw-client waits by
//! `common_relay::WAIT`, collectives by `CommOptions::timeout`), so a broken relay fails a test
//! instead of hanging it.

mod common_relay;

use std::io::Read as _;
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use common_relay::*;
use distgrad::relay::RelayConfig;
use distgrad::transport::ws::JoinOptions;
use distgrad::wire::Control;
use distgrad::{CommOptions, Communicator, ReduceOp, Tensor};

// ---------------------------------------------------------------------------------------------
// The command line's relay and worker, as a user meets them

// ---------------------------------------------------------------------------------------------

/// A relay whose frame limit is below the members' default fragment size (1 MiB) names it in the
/// welcome, and members fragment to it: a 40 KB all_reduce over the WebSockets (no data streams)
/// through a relay taking 4 KiB frames.
#[test]
fn members_fragment_to_the_relays_frame_limit() {
    let relay = TestRelay::start(RelayConfig {
        max_frame: 4096,
        ..scripted()
    });
    let url = relay.url();
    let joins = (0..2)
        .map(|r| JoinOptions {
            stream: false,
            ..join_opts("small-frames", "t", 2, r)
        })
        .collect();
    let n = 10_000;
    let res = run_ranks(&url, joins, CommOptions::default(), |_, comm| async move {
        let r = comm.rank() as f32;
        let x: Vec<f32> = (0..n).map(|i| r + i as f32).collect();
        comm.all_reduce(&Tensor::vector(&x), ReduceOp::Sum, &comm.world())
            .await
            .map(|t| t.to_vec())
    });
    let want: Vec<f32> = (0..n).map(|i| 2.0 * i as f32 + 1.0).collect();
    for (r, y) in all_ok("all_reduce through 4 KiB frames", res)
        .into_iter()
        .enumerate()
    {
        assert_eq!(y, want, "rank {r}");
    }
    relay.shutdown(Duration::from_secs(5));
}

/// The welcome names the relay's frame limit only where it is not the default (so members of an
/// earlier build, which refuse unknown fields, still join a default relay).
#[test]
fn the_welcome_names_only_a_non_default_frame_limit() {
    for (max_frame, want) in [
        (distgrad::wire::DEFAULT_FRAME_PAYLOAD, None),
        (4096, Some(4096)),
    ] {
        let relay = TestRelay::start(RelayConfig {
            max_frame,
            ..scripted()
        });
        let url = relay.url();
        let got = rank_runtime().block_on(async {
            match raw_join(&url, "limit", 2, 0, false).await {
                (_, Control::Welcome { max_frame, .. }) => max_frame,
                (_, other) => panic!("expected a welcome, got {other:?}"),
            }
        });
        assert_eq!(got, want, "relay max_frame {max_frame}");
        relay.shutdown(Duration::from_secs(5));
    }
}

/// `distgrad relay` refuses limits under which no member could work, with exit code 2.
#[test]
fn the_relay_refuses_unusable_limits() {
    for (args, want) in [
        (&["--max-frame", "0"][..], "outside 1024..="),
        (
            &["--max-frame", "18446744073709551615"][..],
            "outside 1024..=",
        ),
        (&["--max-members", "0"][..], "at least 1"),
        (&["--idle-timeout-secs", "0"][..], "above zero"),
        (&["--max-pending-bytes", "100"][..], "cannot hold one frame"),
        (
            &["--static", "/nonexistent/distgrad-web"][..],
            "not a folder",
        ),
    ] {
        let all: Vec<&str> = ["relay", "--addr", "127.0.0.1:0"]
            .into_iter()
            .chain(args.iter().copied())
            .collect();
        let out = run_bin(&all, Duration::from_secs(20));
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(want), "{args:?}: expected {want:?} in {err}");
    }
}

/// Lines of a child's pipe, read by a thread as they come (waits on them are bounded).
fn lines_of(pipe: impl std::io::Read + Send + 'static) -> mpsc::Receiver<String> {
    use std::io::BufRead as _;
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(pipe).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    rx
}

/// The next line of `rx` that contains `needle` (panics after `WAIT`, naming what was seen).
fn wait_line(rx: &mpsc::Receiver<String>, needle: &str, seen: &mut Vec<String>) -> String {
    let t0 = Instant::now();
    while t0.elapsed() < WAIT {
        match rx.recv_timeout(Duration::from_millis(100)) {
            Ok(l) if l.contains(needle) => return l,
            Ok(l) => seen.push(l),
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
        }
    }
    panic!("no line with {needle:?} within {WAIT:?}; saw {seen:?}");
}

/// The two-worker flow of docs/cli.md: the first worker creates the room and says its token at once
/// (while it waits for the room to fill), the second joins with that token through
/// DISTGRAD_TOKEN, and both finish with the same all_gather result.
#[test]
fn the_first_worker_says_its_token_while_the_room_fills() {
    let relay = TestRelay::default_config();
    let url = relay.url();
    let worker = |token: Option<&str>| {
        let mut c = Command::new(BIN);
        c.args([
            "worker",
            "--relay",
            &url,
            "--room",
            "readme",
            "--world",
            "2",
            "--collective",
            "all_gather",
            "--json",
            "--fill-timeout-secs",
            "30",
        ])
        .env_remove("DISTGRAD_TOKEN")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
        if let Some(t) = token {
            c.env("DISTGRAD_TOKEN", t);
        }
        c.spawn().expect("spawn worker")
    };
    let mut first = worker(None);
    let errs = lines_of(first.stderr.take().unwrap());
    let mut seen = Vec::new();
    let line = wait_line(&errs, "token: ", &mut seen);
    let token = line
        .split("token: ")
        .nth(1)
        .and_then(|t| t.split_whitespace().next())
        .expect("a token after 'token: '")
        .to_string();
    let waiting = wait_line(&errs, "waiting", &mut seen);
    assert!(waiting.contains("1 of 2 ranks present"), "{waiting}");
    let second = worker(Some(&token));
    let out2 = second.wait_with_output().expect("second worker");
    let mut out1 = String::new();
    first
        .stdout
        .take()
        .unwrap()
        .read_to_string(&mut out1)
        .unwrap();
    let status1 = first.wait().expect("first worker");
    assert!(
        status1.success() && out2.status.success(),
        "first: {status1}, second: {} {}",
        out2.status,
        String::from_utf8_lossy(&out2.stderr)
    );
    let outputs = |s: &str| -> serde_json::Value {
        serde_json::from_str::<serde_json::Value>(s.trim().lines().last().unwrap_or(""))
            .unwrap_or_else(|e| panic!("JSON result line in {s:?}: {e}"))["outputs"]
            .clone()
    };
    assert_eq!(
        outputs(&out1),
        outputs(&String::from_utf8_lossy(&out2.stdout)),
        "both ranks gather the same tensors"
    );
    relay.shutdown(Duration::from_secs(5));
}

/// A relay stopped with SIGTERM (kill, a service manager) shuts down cleanly: it says so, and the
/// private directory of its Unix-domain socket is gone.
#[cfg(unix)]
#[test]
fn a_relay_stopped_with_sigterm_removes_its_socket_directory() {
    let mut relay = Command::new(BIN)
        .args(["relay", "--addr", "127.0.0.1:0"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn relay");
    let out = lines_of(relay.stdout.take().unwrap());
    let mut seen = Vec::new();
    wait_line(&out, "members on this host", &mut seen);
    let prefix = format!("distgrad-relay-{}-", relay.id());
    let dirs = || -> Vec<std::path::PathBuf> {
        std::fs::read_dir(std::env::temp_dir())
            .map(|d| {
                d.filter_map(|e| e.ok())
                    .filter(|e| e.file_name().to_string_lossy().starts_with(&prefix))
                    .map(|e| e.path())
                    .collect()
            })
            .unwrap_or_default()
    };
    // The directory is made as the relay starts serving.
    let t0 = Instant::now();
    while dirs().is_empty() && t0.elapsed() < WAIT {
        std::thread::sleep(Duration::from_millis(20));
    }
    let made = dirs();
    assert_eq!(made.len(), 1, "the relay's socket directory: {made:?}");
    // SAFETY: signals our own child.
    let rc = unsafe { libc::kill(relay.id() as libc::pid_t, libc::SIGTERM) };
    assert_eq!(rc, 0, "kill -TERM");
    wait_line(&out, "shutting down", &mut seen);
    let t0 = Instant::now();
    let status = loop {
        if let Some(s) = relay.try_wait().expect("wait relay") {
            break s;
        }
        assert!(t0.elapsed() < WAIT, "the relay did not exit after SIGTERM");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(status.success(), "relay exit after SIGTERM: {status}");
    assert!(!made[0].exists(), "{} left behind", made[0].display());
}
