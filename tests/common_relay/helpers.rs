//! Helpers shared by the relay test files: running the binary with a bound, bitwise comparison
//! of outputs, a quick all_reduce in a fresh room, a point-to-point tag.

use std::io::Read as _;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use distgrad::transport::{Channel, Tag};
use distgrad::vjp::CaseOutput;
use distgrad::{CommOptions, Communicator, ReduceOp, Tensor};

use distgrad::wire::Control;

use super::{Raw, all_ok, join_opts, run_ranks, tok};

/// The `distgrad` binary of this build.
pub const BIN: &str = env!("CARGO_BIN_EXE_distgrad");

/// Run the binary with a wall-clock bound (killed past it).
pub fn run_bin(args: &[&str], bound: Duration) -> Output {
    let mut cmd = Command::new(BIN);
    cmd.args(args);
    run_bounded(cmd, &format!("distgrad {args:?}"), bound)
}

/// Run `cmd` (named `what` in failures) with a wall-clock bound (killed past it); stdout and
/// stderr are drained by threads so a chatty child cannot block on a full pipe.
pub fn run_bounded(mut cmd: Command, what: &str, bound: Duration) -> Output {
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("spawning {what}: {e}"));
    let mut so = child.stdout.take().unwrap();
    let mut se = child.stderr.take().unwrap();
    let out_t = std::thread::spawn(move || {
        let mut v = Vec::new();
        let _ = so.read_to_end(&mut v);
        v
    });
    let err_t = std::thread::spawn(move || {
        let mut v = Vec::new();
        let _ = se.read_to_end(&mut v);
        v
    });
    let t0 = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().expect("try_wait") {
            break s;
        }
        if t0.elapsed() > bound {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{what} ran longer than {bound:?}; killed");
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    Output {
        status,
        stdout: out_t.join().unwrap(),
        stderr: err_t.join().unwrap(),
    }
}

/// Compare two case outputs exactly: same JSON and the same f32 bit patterns.
pub fn assert_bitwise_eq(got: &CaseOutput, want: &CaseOutput, ctx: &str) {
    assert_eq!(got.dual, want.dual, "{ctx}: dual differs");
    for (what, g, w) in [
        ("outputs", &got.outputs, &want.outputs),
        ("grads", &got.grads, &want.grads),
    ] {
        assert_eq!(g.len(), w.len(), "{ctx}: number of ranks in {what}");
        for (r, (gl, wl)) in g.iter().zip(w).enumerate() {
            assert_eq!(gl.len(), wl.len(), "{ctx}: rank {r}: number of {what}");
            for (i, (gt, wt)) in gl.iter().zip(wl).enumerate() {
                assert_eq!(gt.shape, wt.shape, "{ctx}: rank {r} {what}[{i}] shape");
                let bits = |d: &[Option<f32>]| -> Vec<Option<u32>> {
                    d.iter().map(|x| x.map(f32::to_bits)).collect()
                };
                assert_eq!(
                    bits(&gt.data),
                    bits(&wt.data),
                    "{ctx}: rank {r} {what}[{i}] differs bitwise: {:?} vs {:?}",
                    gt.data,
                    wt.data
                );
            }
        }
    }
}

pub fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// A quick all_reduce in a fresh room: each rank contributes `[rank + 1, 10 * rank]`; checks the
/// exact sums. Used to show that the relay still serves after a fault.
pub fn quick_all_reduce(url: &str, room: &str, world: u32) {
    let opts = CommOptions {
        timeout: Duration::from_secs(10),
        ..CommOptions::default()
    };
    let joins = (0..world)
        .map(|r| join_opts(room, "quick", world, r))
        .collect();
    let res = run_ranks(url, joins, opts, |_, comm| async move {
        let r = comm.rank() as f32;
        comm.all_reduce(
            &Tensor::vector(&[r + 1.0, 10.0 * r]),
            ReduceOp::Sum,
            &comm.world(),
        )
        .await
        .map(|t| t.to_vec())
    });
    let n = world as f32;
    let want = vec![n * (n + 1.0) / 2.0, 10.0 * n * (n - 1.0) / 2.0];
    for (r, y) in all_ok(&format!("quick all_reduce in room {room:?}"), res)
        .into_iter()
        .enumerate()
    {
        assert_eq!(y, want, "quick all_reduce in room {room:?}: rank {r}");
    }
}

pub fn p2p_tag(seq: u64) -> Tag {
    Tag {
        group: 0,
        seq,
        channel: Channel::P2p,
    }
}

/// Join `room` (token "t") over a raw WebSocket, asking for a data stream or not; returns the
/// client and the relay's first answer.
pub async fn raw_join(
    url: &str,
    room: &str,
    world: u32,
    rank: u32,
    stream: bool,
) -> (Raw, Control) {
    let mut c = Raw::connect(url).await;
    c.send_control(&Control::Join {
        room: room.into(),
        token: Some(tok("t")),
        world,
        rank: Some(rank),
        stream,
    })
    .await;
    let answer = c.next_control().await;
    (c, answer)
}

/// One HTTP/1.1 request on a fresh connection to `addr` (with `token` as the admin's bearer
/// token): the status and the body. Bounded by [`super::WAIT`].
pub async fn http(
    addr: std::net::SocketAddr,
    method: &str,
    path: &str,
    token: Option<&str>,
) -> (u16, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let auth = token.map_or(String::new(), |t| format!("Authorization: Bearer {t}\r\n"));
    let req = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Length: 0\r\n{auth}\r\n"
    );
    let exchange = async {
        let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect");
        s.write_all(req.as_bytes()).await.expect("send request");
        let mut raw = Vec::new();
        s.read_to_end(&mut raw).await.expect("read answer");
        raw
    };
    let raw = tokio::time::timeout(super::WAIT, exchange)
        .await
        .unwrap_or_else(|_| panic!("{method} {path}: no answer within {:?}", super::WAIT));
    let text = String::from_utf8_lossy(&raw).into_owned();
    let status = text
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("{method} {path}: not an HTTP answer: {text:?}"));
    let body = text
        .split_once("\r\n\r\n")
        .map_or("", |(_, b)| b)
        .to_string();
    (status, body)
}
