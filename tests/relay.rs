//! The relay and the native WebSocket transport: end to end across processes, bitwise against the
//! in-process transport; join refusals; room isolation; peer loss; a hostile third-party client;
//! source stamping; a bounded load test; idle timeout; backpressure; data streams (hello checks,
//! stream <-> WebSocket routing, splice and buffered forwarding, fallback).
//!
//! Every test talks only to 127.0.0.1 (port 0), and every wait is bounded (raw-client waits by
//! `common_relay::WAIT`, collectives by `CommOptions::timeout`), so a broken relay fails a test
//! instead of hanging it.

mod common_relay;

use std::io::Read as _;
use std::process::{Command, Output, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use common_relay::{
    Child, Event, Raw, TestRelay, WAIT, all_ok, frame, join_opts, names_lost_rank, rank_runtime,
    run_ranks, tok,
};
use distgrad::collective::Kind;
use distgrad::relay::RelayConfig;
use distgrad::transport::ws::{JoinOptions, StreamRoute, WsTransport};
use distgrad::transport::{Channel, Tag, Transport};
use distgrad::vjp::{self, CaseOutput};
use distgrad::wire::{Control, HEADER_LEN, Header};
use distgrad::{
    AllReduceAlgo, CommOptions, Communicator, Error, ReduceOp, Tape, Tensor, dist, run_local,
};
use futures::SinkExt as _;
use tokio_tungstenite::tungstenite::Message;

const BIN: &str = env!("CARGO_BIN_EXE_distgrad");

// ---------------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------------

/// Run the binary with a wall-clock bound (killed past it).
fn run_bin(args: &[&str], bound: Duration) -> Output {
    let mut cmd = Command::new(BIN);
    cmd.args(args);
    run_bounded(cmd, &format!("distgrad {args:?}"), bound)
}

/// Run `cmd` (named `what` in failures) with a wall-clock bound (killed past it); stdout and
/// stderr are drained by threads so a chatty child cannot block on a full pipe.
fn run_bounded(mut cmd: Command, what: &str, bound: Duration) -> Output {
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
fn assert_bitwise_eq(got: &CaseOutput, want: &CaseOutput, ctx: &str) {
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

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// A quick all_reduce in a fresh room: each rank contributes `[rank + 1, 10 * rank]`; checks the
/// exact sums. Used to show that the relay still serves after a fault.
fn quick_all_reduce(url: &str, room: &str, world: u32) {
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

fn p2p_tag(seq: u64) -> Tag {
    Tag {
        group: 0,
        seq,
        channel: Channel::P2p,
    }
}

// ---------------------------------------------------------------------------------------------
// 1. Multi-process end to end
// ---------------------------------------------------------------------------------------------

/// `distgrad demo --transport relay` (a relay + 4 worker processes over loopback) prints exactly what
/// `distgrad vjp` (4 threads, in-process transport) prints, for every collective, every reduce op and
/// roots 1 and 2. JSON floats round-trip f32 exactly, so equal JSON means bitwise-equal results;
/// the f32 bit patterns are compared as well.
#[test]
fn demo_over_relay_processes_equals_in_process_vjp_for_every_collective() {
    const WITH_OP: [&str; 3] = ["reduce", "all_reduce", "reduce_scatter"];
    let mut cases = Vec::new();
    for (i, which) in vjp::COLLECTIVES.iter().enumerate() {
        let name = which.name();
        let ops: Vec<ReduceOp> = if WITH_OP.contains(&name) {
            ReduceOp::ALL.to_vec()
        } else {
            vec![ReduceOp::Sum]
        };
        for (j, op) in ops.into_iter().enumerate() {
            cases.push((name, op.name(), 1 + (i + j) % 2));
        }
    }
    assert_eq!(cases.len(), 22, "10 collectives, 3 of them with 5 ops");
    let t0 = Instant::now();
    for (coll, op, root) in cases {
        let root = root.to_string();
        let common = ["--world", "4", "--op", op, "--root", &root, "--json"];
        let ctx = format!("{coll} op={op} root={root}");

        let demo_args: Vec<&str> = ["demo", "--transport", "relay", "--collective", coll]
            .into_iter()
            .chain(common)
            .collect();
        let demo = run_bin(&demo_args, Duration::from_secs(60));
        let demo_err = String::from_utf8_lossy(&demo.stderr);
        assert!(
            demo.status.success(),
            "{ctx}: distgrad {demo_args:?} failed ({}): {demo_err}",
            demo.status
        );
        assert!(
            demo_err.contains("relay at ws://127.0.0.1:"),
            "{ctx}: the demo did not report a loopback relay (did it run over the relay?): {demo_err}"
        );

        let vjp_args: Vec<&str> = ["vjp", coll].into_iter().chain(common).collect();
        let local = run_bin(&vjp_args, Duration::from_secs(60));
        assert!(
            local.status.success(),
            "{ctx}: distgrad {vjp_args:?} failed: {}",
            String::from_utf8_lossy(&local.stderr)
        );

        let dj: serde_json::Value = serde_json::from_slice(&demo.stdout)
            .unwrap_or_else(|e| panic!("{ctx}: demo printed no JSON ({e}): {:?}", demo.stdout));
        let lj: serde_json::Value = serde_json::from_slice(&local.stdout)
            .unwrap_or_else(|e| panic!("{ctx}: vjp printed no JSON ({e})"));
        assert_eq!(
            dj, lj,
            "{ctx}: demo over the relay and in-process vjp print different JSON"
        );
        let d: CaseOutput = serde_json::from_value(dj).expect("demo output schema");
        let l: CaseOutput = serde_json::from_value(lj).expect("vjp output schema");
        assert_eq!(d.outputs.len(), 4, "{ctx}: outputs for 4 ranks");
        assert_ne!(
            d.dual, "nothing",
            "{ctx}: the backward pass ran no collective"
        );
        assert_bitwise_eq(&d, &l, &ctx);
    }
    eprintln!(
        "22 demo-vs-vjp comparisons (multi-process) took {:.1} s",
        t0.elapsed().as_secs_f64()
    );
}

/// `distgrad demo --transport direct`: worker processes introduced by the relay, data over direct
/// links, print the same JSON as the in-process `vjp` (a few collectives; every collective runs
/// over direct links in-process in `direct_links_carry_every_collective_bitwise_like_local`).
#[test]
fn demo_with_direct_links_equals_in_process_vjp() {
    for (coll, op, root) in [
        ("all_reduce", "max", "0"),
        ("scatter", "sum", "2"),
        ("all_to_all", "sum", "0"),
    ] {
        let common = ["--world", "4", "--op", op, "--root", root, "--json"];
        let demo_args: Vec<&str> = ["demo", "--transport", "direct", "--collective", coll]
            .into_iter()
            .chain(common)
            .collect();
        let demo = run_bin(&demo_args, Duration::from_secs(60));
        assert!(
            demo.status.success(),
            "{coll}: distgrad {demo_args:?} failed: {}",
            String::from_utf8_lossy(&demo.stderr)
        );
        let err = String::from_utf8_lossy(&demo.stderr);
        for r in 0..4 {
            let others: Vec<usize> = (0..4).filter(|&x| x != r).collect();
            let want = format!("rank {r}: direct links to ranks {others:?}");
            assert!(err.contains(&want), "{coll}: no {want:?} in {err}");
        }
        let vjp_args: Vec<&str> = ["vjp", coll].into_iter().chain(common).collect();
        let local = run_bin(&vjp_args, Duration::from_secs(60));
        let dj: serde_json::Value = serde_json::from_slice(&demo.stdout).expect("demo JSON");
        let lj: serde_json::Value = serde_json::from_slice(&local.stdout).expect("vjp JSON");
        assert_eq!(dj, lj, "{coll}: demo over direct links and vjp differ");
    }
}

// ---------------------------------------------------------------------------------------------
// 2a. In-process relay, ranks as threads: bitwise equal to the in-process transport
// ---------------------------------------------------------------------------------------------

/// The built-in example cases run over the relay and over direct links: (collective, op, root,
/// subgroup) for 4 ranks — every kind of collective, roots != 0, subgroups.
fn example_cases() -> Vec<(Kind, ReduceOp, usize, Option<Vec<usize>>)> {
    vec![
        (Kind::Broadcast, ReduceOp::Sum, 3, None),
        (Kind::Reduce, ReduceOp::Prod, 2, None),
        (Kind::Gather, ReduceOp::Sum, 1, None),
        (Kind::Scatter, ReduceOp::Sum, 2, None),
        (Kind::AllGather, ReduceOp::Sum, 0, None),
        (Kind::ReduceScatter, ReduceOp::Max, 0, None),
        (Kind::AllToAll, ReduceOp::Sum, 0, None),
        (Kind::AllReduce, ReduceOp::Avg, 0, None),
        (Kind::Permute, ReduceOp::Sum, 0, None),
        (Kind::AllToAllSingle, ReduceOp::Sum, 0, None),
        // a subgroup: global rank 1 takes no part, group rank 1 (global 0) is the root
        (Kind::Reduce, ReduceOp::Min, 1, Some(vec![3, 0, 2])),
        (Kind::AllReduce, ReduceOp::Prod, 0, Some(vec![2, 1])),
    ]
}

/// Forward + backward of the built-in examples through an in-process relay (4 ranks, each its own
/// thread and runtime) equal `run_local` bitwise: roots != 0, every kind of collective, a subgroup.
#[test]
fn collectives_through_in_process_relay_equal_local_bitwise() {
    let relay = TestRelay::default_config();
    let url = relay.url();
    for (k, (which, op, root, group)) in example_cases().into_iter().enumerate() {
        let ctx = format!(
            "{} op={} root={root} group={group:?}",
            which.name(),
            op.name()
        );
        let case = vjp::example_case(which, 4, op, root, group).expect("example case");
        let local = vjp::run_case(&case).unwrap_or_else(|e| panic!("{ctx}: local run: {e}"));
        let prepared = vjp::Prepared::new(&case).expect("prepare");
        let room = format!("coll-{k}");
        // Rank 0 sends on a data stream on the relay's Unix-domain socket, rank 1 on its
        // WebSocket (as browsers do), ranks 2 and 3 on TCP data streams: every pairing of
        // different routes, and TCP to TCP (Unix to Unix: the fallback test below).
        let route_of = |r: u32| match r {
            0 => Some(StreamRoute::Unix),
            1 => None,
            _ => Some(StreamRoute::Tcp),
        };
        let joins = (0..4)
            .map(|r| {
                let mut j = join_opts(&room, "tok", 4, r);
                j.stream = route_of(r).is_some();
                j.local_stream = route_of(r) == Some(StreamRoute::Unix);
                j
            })
            .collect();
        let results = run_ranks(&url, joins, vjp::case_options(), |r, comm| {
            let p = &prepared;
            async move {
                let want = route_of(r as u32);
                assert_eq!(comm.transport().data_stream_route(), want, "rank {r}");
                vjp::run_rank(&comm, p).await
            }
        });
        let over_relay = vjp::assemble(&prepared, results)
            .unwrap_or_else(|e| panic!("{ctx}: over the relay: {e}"));
        assert_bitwise_eq(&over_relay, &local, &ctx);
    }
    relay.shutdown(Duration::from_secs(5));
}

// ---------------------------------------------------------------------------------------------
// 2b. Direct links: the relay introduces native ranks, data goes over TCP between them
// ---------------------------------------------------------------------------------------------

/// Join options with direct links on 127.0.0.1.
fn direct_join(room: &str, world: u32, rank: u32) -> JoinOptions {
    let mut j = join_opts(room, "tok", world, rank);
    j.direct = Some(([127, 0, 0, 1], 0).into());
    j
}

/// The built-in examples (every kind of collective, roots != 0, a subgroup) plus a 1 MiB
/// all_reduce, forward and backward, with 4 native ranks linked directly (each reports links to
/// the 3 others): bitwise equal to `run_local`.
#[test]
fn direct_links_carry_every_collective_bitwise_like_local() {
    let relay = TestRelay::default_config();
    let url = relay.url();
    for (k, (which, op, root, group)) in example_cases().into_iter().enumerate() {
        let ctx = format!(
            "direct {} op={} root={root} group={group:?}",
            which.name(),
            op.name()
        );
        let case = vjp::example_case(which, 4, op, root, group).expect("example case");
        let local = vjp::run_case(&case).unwrap_or_else(|e| panic!("{ctx}: local run: {e}"));
        let prepared = vjp::Prepared::new(&case).expect("prepare");
        let room = format!("direct-{k}");
        let joins = (0..4).map(|r| direct_join(&room, 4, r)).collect();
        let results = run_ranks(&url, joins, vjp::case_options(), |r, comm| {
            let p = &prepared;
            async move {
                let peers = comm.transport().direct_peers();
                let want: Vec<usize> = (0..4).filter(|&x| x != r).collect();
                assert_eq!(peers, want, "rank {r}: direct links");
                vjp::run_rank(&comm, p).await
            }
        });
        let direct = vjp::assemble(&prepared, results)
            .unwrap_or_else(|e| panic!("{ctx}: over direct links: {e}"));
        assert_bitwise_eq(&direct, &local, &ctx);
    }
    // A large message on a link (one frame of 1 MiB, no fragments): ring all_reduce.
    const N: usize = 1 << 18;
    let x_of = |r: usize| -> Vec<f32> {
        (0..N)
            .map(|i| ((i * 7 + r * 13) % 101) as f32 * 0.25 - 12.0)
            .collect()
    };
    let opts = CommOptions {
        all_reduce: AllReduceAlgo::Ring,
        ..CommOptions::default()
    };
    let local = all_ok(
        "local",
        run_local(4, opts.clone(), |comm| async move {
            let x = Tensor::vector(&x_of(comm.rank()));
            Ok(comm
                .all_reduce(&x, ReduceOp::Sum, &comm.world())
                .await?
                .to_vec())
        }),
    );
    let joins = (0..4).map(|r| direct_join("direct-big", 4, r)).collect();
    let remote = all_ok(
        "direct",
        run_ranks(&url, joins, opts, |_, comm| async move {
            let x = Tensor::vector(&x_of(comm.rank()));
            Ok(comm
                .all_reduce(&x, ReduceOp::Sum, &comm.world())
                .await?
                .to_vec())
        }),
    );
    for r in 0..4 {
        assert!(
            bits(&remote[r]) == bits(&local[r]),
            "rank {r}: 1 MiB all_reduce"
        );
    }
    relay.shutdown(Duration::from_secs(5));
}

/// Ranks 0 and 2 make direct links, 1 and 3 do not: only the pair (0, 2) links, every other
/// pair goes through the relay, and the results are still bitwise the in-process ones.
#[test]
fn direct_and_relay_only_ranks_mix() {
    let relay = TestRelay::default_config();
    let url = relay.url();
    let case = vjp::example_case(Kind::AllToAll, 4, ReduceOp::Sum, 0, None).unwrap();
    let local = vjp::run_case(&case).unwrap();
    let prepared = vjp::Prepared::new(&case).unwrap();
    let joins = (0..4)
        .map(|r| {
            if r % 2 == 0 {
                direct_join("mix", 4, r)
            } else {
                join_opts("mix", "tok", 4, r)
            }
        })
        .collect();
    let t0 = Instant::now();
    let results = run_ranks(&url, joins, vjp::case_options(), |r, comm| {
        let p = &prepared;
        async move {
            let want: Vec<usize> = match r {
                0 => vec![2],
                2 => vec![0],
                _ => vec![],
            };
            assert_eq!(comm.transport().direct_peers(), want, "rank {r}");
            vjp::run_rank(&comm, p).await
        }
    });
    if let Some(Err(e)) = results.iter().find(|r| r.is_err()) {
        panic!("mixed run failed: {e}");
    }
    // Relay-only ranks say so at once: nobody waits for the link timeout.
    assert!(
        t0.elapsed() < Duration::from_secs(4),
        "joining took {:?}",
        t0.elapsed()
    );
    let out = vjp::assemble(&prepared, results).expect("mixed run");
    assert_bitwise_eq(&out, &local, "mixed direct / relay-only");
    relay.shutdown(Duration::from_secs(5));
}

/// A large all_reduce (3 MiB per rank, ring and pairwise algorithms) forward and backward, sent in 64 KiB
/// fragments through a relay whose frame limit is 64 KiB: bitwise equal to `run_local`, and close
/// to an f64 reference (so both are right, not just equal).
#[test]
fn large_all_reduce_is_fragmented_and_bitwise_equal_to_local() {
    const WORLD: usize = 4;
    const N: usize = 3 << 18; // 786432 f32 = 3 MiB per rank
    const FRAME: usize = 64 << 10;
    let relay = TestRelay::start(RelayConfig {
        max_frame: FRAME,
        ..RelayConfig::default()
    });
    let url = relay.url();
    // Values with fractional parts, so the summation order shows in the bits.
    let x_of = |r: usize| -> Vec<f32> {
        (0..N)
            .map(|i| {
                let h = (i as u64 * 2_654_435_761 + r as u64 * 40_503) % 10_007;
                (h as f32 / 10_007.0 - 0.5) * (1.0 + r as f32 * 0.37)
            })
            .collect()
    };
    let c_of = |r: usize| -> Vec<f32> {
        (0..N)
            .map(|i| ((i * 7 + r * 3) % 11) as f32 * 0.1 - 0.45)
            .collect()
    };
    // y = all_reduce(SUM, x * x); seed y with cotangent c_r; grad_r = 2 x_r * all_reduce(SUM, c).
    async fn run<C: Communicator>(
        comm: &C,
        x: Vec<f32>,
        c: Vec<f32>,
    ) -> distgrad::Result<(Vec<f32>, Vec<f32>)> {
        let tape = Tape::new();
        let xv = tape.var(Tensor::vector(&x));
        let y = dist::all_reduce(comm, &xv.mul(&xv)?, ReduceOp::Sum, &comm.world()).await?;
        let grads = tape
            .backward_from(&[(y.clone(), Tensor::vector(&c))], comm)
            .await?;
        Ok((y.value().to_vec(), grads.wrt(&xv)?.to_vec()))
    }
    // The ring (what the relay uses by default) and the pairwise algorithm, each with the same
    // algorithm in-process (where the default would be the shared one).
    for algo in [AllReduceAlgo::Ring, AllReduceAlgo::Pairwise] {
        let opts = CommOptions {
            timeout: Duration::from_secs(60),
            all_reduce: algo,
            ..CommOptions::default()
        };
        assert!(
            N * 4 >= opts.ring_threshold,
            "the payload must be large enough for the ring algorithm"
        );
        let local = run_local(WORLD, opts.clone(), |comm| async move {
            let r = comm.rank();
            run(&comm, x_of(r), c_of(r)).await
        });
        let local = all_ok("local large all_reduce", local);

        let t0 = Instant::now();
        // Ranks 0 and 1 send on data streams (whole messages; the relay cuts them into 64 KiB
        // frames for the WebSocket ranks), 2 and 3 on their WebSockets in 64 KiB fragments.
        let joins = (0..WORLD as u32)
            .map(|r| {
                let mut j = join_opts(&format!("big-{}", algo.name()), "tok", WORLD as u32, r);
                j.max_payload = FRAME - HEADER_LEN;
                j.stream = r < 2;
                j
            })
            .collect();
        let remote = run_ranks(&url, joins, opts, |_, comm| async move {
            let r = comm.rank();
            run(&*comm, x_of(r), c_of(r)).await
        });
        let remote = all_ok("large all_reduce over the relay", remote);
        eprintln!(
            "3 MiB/rank all_reduce ({}) forward+backward over the relay, 64 KiB frames: {:.2} s",
            algo.name(),
            t0.elapsed().as_secs_f64()
        );
        // f64 reference
        let xs: Vec<Vec<f32>> = (0..WORLD).map(x_of).collect();
        let cs: Vec<Vec<f32>> = (0..WORLD).map(c_of).collect();
        for r in 0..WORLD {
            let (ry, rg) = &remote[r];
            let (ly, lg) = &local[r];
            assert_eq!(ry.len(), N, "rank {r}: output length");
            assert!(
                bits(ry) == bits(ly),
                "rank {r}: forward output over the relay differs bitwise from run_local"
            );
            assert!(
                bits(rg) == bits(lg),
                "rank {r}: gradient over the relay differs bitwise from run_local"
            );
            for i in (0..N).step_by(997) {
                let y: f64 = xs.iter().map(|x| (x[i] as f64).powi(2)).sum();
                let csum: f64 = cs.iter().map(|c| c[i] as f64).sum();
                let g = 2.0 * xs[r][i] as f64 * csum;
                assert!(
                    (ry[i] as f64 - y).abs() <= 1e-5 * (1.0 + y.abs()),
                    "rank {r} y[{i}] = {} but the f64 reference is {y}",
                    ry[i]
                );
                assert!(
                    (rg[i] as f64 - g).abs() <= 1e-5 * (1.0 + g.abs()),
                    "rank {r} grad[{i}] = {} but the f64 reference is {g}",
                    rg[i]
                );
            }
        }
        // every rank's all_reduce output is the same bits
        for r in 1..WORLD {
            assert!(
                bits(&remote[r].0) == bits(&remote[0].0),
                "all_reduce output of rank {r} differs bitwise from rank 0's"
            );
        }
    }
}

/// Messages at the fragment boundaries (empty, 1 byte, max_payload - 1, max_payload,
/// max_payload + 1, several fragments) arrive whole and in order, including interleaved tags.
#[test]
fn fragment_boundaries_round_trip() {
    const P: usize = 1000; // tiny fragments: many frames per message
    let relay = TestRelay::start(RelayConfig {
        max_frame: P + HEADER_LEN,
        ..RelayConfig::default()
    });
    let url = relay.url();
    let sizes = [0, 1, P - 1, P, P + 1, 2 * P, 2 * P + 1, 37 * P + 13];
    let payload = |k: usize, n: usize| -> Bytes {
        (0..n)
            .map(|i| (i * 31 + k * 7 + i / 256) as u8)
            .collect::<Vec<u8>>()
            .into()
    };
    let joins: Vec<JoinOptions> = (0..2)
        .map(|r| {
            let mut j = join_opts("frag", "tok", 2, r);
            j.max_payload = P;
            j
        })
        .collect();
    let res = run_ranks(&url, joins, CommOptions::default(), |_, comm| async move {
        let t = comm.transport();
        let me = t.rank();
        let peer = 1 - me;
        // Send every size under its own tag, and the same sizes again under one shared tag (order).
        for (k, &n) in sizes.iter().enumerate() {
            t.send(peer, p2p_tag(100 + k as u64), payload(k, n)).await?;
            t.send(peer, p2p_tag(1), payload(k + 50, n)).await?;
        }
        // Receive the per-tag ones in reverse order (tag matching), then the shared tag in order.
        for (k, &n) in sizes.iter().enumerate().rev() {
            let got = t.recv(peer, p2p_tag(100 + k as u64)).await?;
            if got != payload(k, n) {
                return Err(Error::Input(format!(
                    "rank {me}: message of {n} bytes (tag {}) arrived as {} bytes or corrupted",
                    100 + k,
                    got.len()
                )));
            }
        }
        for (k, &n) in sizes.iter().enumerate() {
            let got = t.recv(peer, p2p_tag(1)).await?;
            if got != payload(k + 50, n) {
                return Err(Error::Input(format!(
                    "rank {me}: message #{k} of {n} bytes on the shared tag arrived out of order or corrupted ({} bytes)",
                    got.len()
                )));
            }
        }
        Ok(())
    });
    all_ok("fragment boundaries", res);
}

/// `WsTransport::close` promises to flush what is queued before closing. Ranks that finish a ring
/// all_reduce close at once, while the tail of their last message to the ring successor may still
/// be in flight (and messages for them may still arrive): the successor must still get all of it.
/// Repeated in 12 fresh rooms, as the loss depends on timing.
#[test]
fn close_right_after_a_large_collective_loses_nothing() {
    const N: usize = 1 << 18; // 1 MiB per rank: ring, 256 KiB per step
    let relay = TestRelay::start(RelayConfig {
        max_frame: 64 << 10,
        ..RelayConfig::default()
    });
    let url = relay.url();
    let opts = CommOptions {
        timeout: Duration::from_secs(20),
        ..CommOptions::default()
    };
    let mut failures = Vec::new();
    for round in 0..12 {
        let room = format!("close-{round}");
        // Even rounds: data streams (the relay forwards what came on a stream before it announces
        // the leave); odd rounds: WebSockets.
        let joins = (0..4)
            .map(|r| {
                let mut j = join_opts(&room, "t", 4, r);
                j.max_payload = (64 << 10) - HEADER_LEN;
                j.stream = round % 2 == 0;
                j
            })
            .collect();
        let res = run_ranks(&url, joins, opts.clone(), |_, comm| async move {
            let x = Tensor::full(&[N], comm.rank() as f32 + 1.0);
            let y = comm.all_reduce(&x, ReduceOp::Sum, &comm.world()).await?;
            Ok(y.to_vec().iter().all(|&v| v == 10.0))
        });
        for (r, x) in res.into_iter().enumerate() {
            match x {
                Ok(true) => {}
                Ok(false) => failures.push(format!("round {round} rank {r}: wrong sums")),
                Err(e) => failures.push(format!("round {round} rank {r}: {e}")),
            }
        }
    }
    assert!(
        failures.is_empty(),
        "data sent before close() was lost (the peer saw the closing rank leave first) in {} \
         rank-runs:\n  {}",
        failures.len(),
        failures.join("\n  ")
    );
}

/// A clean leave is ordered with the data on direct links too: 50 rooms of 4 ranks linked directly
/// each run a 16 MiB all_reduce and close at once; no rank may fail (the relay's notice that a
/// peer left must not overtake that peer's last data on the link).
#[test]
fn close_right_after_large_collectives_over_direct_links_loses_nothing() {
    const N: usize = 4 << 20; // 16 MiB per rank
    const ROOMS: usize = 50;
    let relay = TestRelay::default_config();
    let url = relay.url();
    let opts = CommOptions {
        timeout: Duration::from_secs(30),
        ..CommOptions::default()
    };
    let t0 = Instant::now();
    let mut failures = Vec::new();
    for round in 0..ROOMS {
        let room = format!("direct-close-{round}");
        let joins = (0..4)
            .map(|r| {
                let mut j = join_opts(&room, "t", 4, r);
                j.direct = Some(([127, 0, 0, 1], 0).into());
                j
            })
            .collect();
        let res = run_ranks(&url, joins, opts.clone(), |_, comm| async move {
            let x = Tensor::full(&[N], comm.rank() as f32 + 1.0);
            let y = comm.all_reduce(&x, ReduceOp::Sum, &comm.world()).await?;
            Ok(y.to_vec().iter().all(|&v| v == 10.0))
        });
        for (r, x) in res.into_iter().enumerate() {
            match x {
                Ok(true) => {}
                Ok(false) => failures.push(format!("room {round} rank {r}: wrong sums")),
                Err(e) => failures.push(format!("room {round} rank {r}: {e}")),
            }
        }
    }
    eprintln!(
        "{ROOMS} rooms x 16 MiB all_reduce over direct links + close: {} failures in {:?}",
        failures.len(),
        t0.elapsed()
    );
    assert!(
        failures.is_empty(),
        "a clean leave failed a peer over direct links in {} rank-runs:\n  {}",
        failures.len(),
        failures.join("\n  ")
    );
}

/// `WsTransport::close` promises to flush what is queued before closing. Rank 0 sends 24 MiB to a
/// slow reader (rank 1), so when `close()` returns much of it is still in the socket buffers
/// between rank 0 and the relay (backpressure). Then a peer (rank 2) sends rank 0 a small frame,
/// as peers do in any collective, and rank 0's runtime ends. Rank 1 must still receive every byte
/// rank 0 sent before it hears that rank 0 left.
///
/// Sequencing: rank 1 reads one 64 KiB frame per 5 ms (far slower than rank 0 and the relay can
/// send), so the pipeline is full while rank 0 sends. Once rank 0's close() has returned, rank 1
/// stops reading for a moment, rank 2 sends its frame, and rank 0's thread keeps its runtime (and
/// socket) until that frame has had 200 ms to land; then rank 0's runtime ends. A close() that
/// returns only once the relay has taken everything passes; one that returns with data still in
/// the socket loses it (the socket is reset because of the unread frame).
#[test]
fn close_after_sending_to_a_slow_reader_delivers_everything() {
    close_after_sending_to_a_slow_reader(false);
}

/// The same with rank 0 sending on a data stream. The relay forwards what came on the stream
/// before it answers the close, so here close() returns only once (nearly) everything is through;
/// rank 1 must still see every byte before the leave.
#[test]
fn close_after_sending_on_a_stream_to_a_slow_reader_delivers_everything() {
    close_after_sending_to_a_slow_reader(true);
}

fn close_after_sending_to_a_slow_reader(stream: bool) {
    const FRAME: usize = 64 << 10;
    const MSG: usize = 1 << 20;
    const COUNT: usize = 24;
    let relay = TestRelay::start(RelayConfig {
        max_frame: FRAME,
        max_pending_bytes: 256 << 10,
        ..RelayConfig::default()
    });
    let url = relay.url();
    let content =
        |k: usize| -> Vec<u8> { (0..MSG).map(|i| ((i * 7 + k * 13) % 253) as u8).collect() };
    let (closed_tx, closed_rx) = mpsc::channel::<()>();
    let (ack_tx, ack_rx) = mpsc::channel::<()>();
    let url_s = url.clone();
    let sender = std::thread::spawn(move || {
        rank_runtime().block_on(async move {
            let mut j = join_opts("close-slow", "t", 3, 0);
            j.max_payload = FRAME - HEADER_LEN;
            j.stream = stream;
            let t = WsTransport::connect(&url_s, j).await.expect("sender joins");
            for k in 0..COUNT {
                t.send(1, p2p_tag(k as u64), content(k).into())
                    .await
                    .unwrap_or_else(|e| panic!("sender: message {k}: {e}"));
            }
            t.close().await;
            closed_tx.send(()).unwrap();
            // Blocking here keeps this runtime from running: the socket stays open, unread.
            let _ = ack_rx.recv_timeout(WAIT);
        })
        // the runtime is dropped here, and with it the socket
    });
    rank_runtime().block_on(async {
        let (mut rx, _) = Raw::join(&url, "close-slow", Some("t"), 3, 1).await;
        let (mut peer, _) = Raw::join(&url, "close-slow", Some("t"), 3, 2).await;
        rx.wait_ready().await;
        peer.wait_ready().await;
        let mut sender = Some(sender);
        let mut got = 0usize;
        let mut buf = Vec::new();
        let mut k = 0usize;
        let mut closed_at = None;
        while k < COUNT || sender.is_some() {
            if sender.is_some() && closed_rx.try_recv().is_ok() {
                closed_at = Some(k);
                peer.send_binary(frame(2, 0, 0, b"for rank 0"))
                    .await
                    .unwrap();
                tokio::time::sleep(Duration::from_millis(200)).await;
                ack_tx.send(()).unwrap();
                sender.take().unwrap().join().expect("sender thread");
            }
            if k == COUNT {
                // Everything arrived; rank 0's close() has yet to return.
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
            match rx.next().await {
                Event::Binary(f) => {
                    let h = Header::decode(&f).expect("frame");
                    assert_eq!((h.src, h.tag.seq), (0, k as u64), "fragment out of order");
                    buf.extend_from_slice(&f[HEADER_LEN..]);
                    got += f.len() - HEADER_LEN;
                    if !h.more {
                        assert!(buf == content(k), "message {k} corrupted");
                        buf.clear();
                        k += 1;
                    }
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                Event::Text(t) => match serde_json::from_str::<Control>(&t).unwrap() {
                    Control::PeerLeft { rank, reason } => panic!(
                        "rank {rank} left ({reason}) before its data arrived: rank 1 got {got} of \
                         {} bytes that rank 0 sent before close() returned",
                        MSG * COUNT
                    ),
                    other => panic!("unexpected {other:?}"),
                },
                other => panic!("receiver: unexpected {other:?} after {got} bytes"),
            }
        }
        if !stream {
            assert!(
                closed_at.is_some_and(|k| k < COUNT),
                "rank 1 received everything before rank 0's close() returned: the test did not \
                 exercise a close with data in flight (raise COUNT)"
            );
        }
    });
}

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
        ..RelayConfig::default()
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

/// `allowed_origins`: a browser with another Origin is refused at the handshake; an allowed one and
/// a native client (no Origin) get in.
#[test]
fn allowed_origins_refuse_other_browsers() {
    use tokio_tungstenite::tungstenite::client::IntoClientRequest;
    let relay = TestRelay::start(RelayConfig {
        allowed_origins: Some(vec!["http://good.example".into()]),
        ..RelayConfig::default()
    });
    let url = relay.url();
    rank_runtime().block_on(async {
        let with_origin = |o: &str| {
            let mut req = url.as_str().into_client_request().unwrap();
            req.headers_mut().insert("origin", o.parse().unwrap());
            req
        };
        let bad = tokio_tungstenite::connect_async(with_origin("http://evil.example")).await;
        match bad {
            Err(tokio_tungstenite::tungstenite::Error::Http(resp)) => {
                assert_eq!(resp.status().as_u16(), 403, "status for a foreign origin")
            }
            Err(e) => panic!("foreign origin: expected HTTP 403, got {e}"),
            Ok(_) => panic!("foreign origin was let in"),
        }
        let good = tokio_tungstenite::connect_async(with_origin("http://good.example")).await;
        assert!(good.is_ok(), "allowed origin refused: {:?}", good.err());
        let (_native, w) = Raw::join(&url, "o", None, 1, 0).await;
        assert_eq!(w.members, vec![0], "native client (no Origin) joins");
    });
}

// ---------------------------------------------------------------------------------------------
// 2c. Room isolation
// ---------------------------------------------------------------------------------------------

/// Two rooms of world 3 on one relay run all_reduces concurrently (small: direct exchange, large:
/// ring) with different data; every result is its own room's sum.
#[test]
fn concurrent_rooms_only_see_their_own_data() {
    const ITERS: usize = 60;
    const BIG: usize = 32 << 10; // 128 KiB: ring
    let relay = TestRelay::default_config();
    let url = relay.url();
    let rooms = ["room-a", "room-b"];
    let joins: Vec<JoinOptions> = rooms
        .iter()
        .flat_map(|room| (0..3).map(move |r| join_opts(room, room, 3, r)))
        .collect();
    let opts = CommOptions {
        timeout: Duration::from_secs(20),
        ..CommOptions::default()
    };
    // room a contributes small positive numbers, room b large negative ones
    let value = |room: usize, r: usize, it: usize, i: usize| -> f32 {
        let base = ((r + 1) * 3 + it * 5 + i % 7) as f32;
        if room == 0 { base } else { -1000.0 * base }
    };
    let res = run_ranks(&url, joins, opts, |idx, comm| async move {
        let room = idx / 3;
        let r = comm.rank();
        for it in 0..ITERS {
            let n = if it % 10 == 9 { BIG } else { 3 };
            let x: Vec<f32> = (0..n).map(|i| value(room, r, it, i)).collect();
            let y = comm
                .all_reduce(&Tensor::vector(&x), ReduceOp::Sum, &comm.world())
                .await?
                .to_vec();
            for (i, &got) in y.iter().enumerate() {
                let want: f32 = (0..3).map(|q| value(room, q, it, i)).sum();
                if got != want {
                    return Err(Error::Input(format!(
                        "{}: rank {r} iteration {it} element {i}: got {got}, want {want}",
                        rooms[room]
                    )));
                }
            }
        }
        Ok(())
    });
    all_ok("two concurrent rooms", res);
}

/// The relay routes by room: a frame (and a signal) from room A addressed to rank 3, which exists
/// only in room B, reaches nobody in room B.
#[test]
fn frames_cannot_cross_rooms() {
    let relay = TestRelay::default_config();
    let url = relay.url();
    rank_runtime().block_on(async {
        // room A: world 4 but only ranks 0 and 1 present; room B: full, ranks 0..4
        let (mut a0, _) = Raw::join(&url, "A", Some("ta"), 4, 0).await;
        let (mut a1, _) = Raw::join(&url, "A", Some("ta"), 4, 1).await;
        let mut b = Vec::new();
        for r in 0..4 {
            b.push(Raw::join(&url, "B", Some("tb"), 4, r).await.0);
        }
        for (r, c) in b.iter_mut().enumerate() {
            assert_eq!(c.wait_ready().await, vec![0, 1, 2, 3], "room B rank {r}");
        }
        a0.send_binary(frame(0, 3, 7, b"secret of room A"))
            .await
            .unwrap();
        a0.send_control(&Control::Signal {
            to: Some(3),
            from: None,
            data: serde_json::json!({"sdp": "secret of room A"}),
        })
        .await;
        // a0's messages are routed in order: once a1 has the marker, the relay is done with them.
        a0.send_binary(frame(0, 1, 8, b"marker A")).await.unwrap();
        let (h, p) = a1.next_frame().await;
        assert_eq!(
            (h.src, &p[..]),
            (0, &b"marker A"[..]),
            "a1 gets a0's marker"
        );
        // b3's queue: if the secret had been routed there it would come before this marker.
        b[0].send_binary(frame(0, 3, 9, b"marker B")).await.unwrap();
        match b[3].next().await {
            Event::Binary(f) => {
                let h = Header::decode(&f).unwrap();
                assert_eq!(
                    (h.src, &f[HEADER_LEN..]),
                    (0, &b"marker B"[..]),
                    "room B rank 3 received a frame that is not room B's marker (leak from room A?)"
                );
            }
            other => panic!("room B rank 3: expected room B's marker, got {other:?}"),
        }
        // nor did any other member of room B get anything
        for (r, c) in b.iter_mut().enumerate().take(3) {
            let e = c.next_within(Duration::from_millis(100)).await;
            assert!(e.is_none(), "room B rank {r} received {e:?}");
        }
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
                        let comm = distgrad::P2p::new(t, vjp::case_options());
                        let res = vjp::run_rank(&comm, prepared).await;
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
        ..RelayConfig::default()
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
        ..RelayConfig::default()
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
// 2f. Source stamping
// ---------------------------------------------------------------------------------------------

/// A client that joined as rank 1 claims src = 0 (and src = 99): receivers see src = 1, both a raw
/// receiver (header) and our transport (tag matching files it under rank 1). Signals are stamped too.
#[test]
fn relay_stamps_the_source_rank() {
    let relay = TestRelay::default_config();
    let url = relay.url();
    rank_runtime().block_on(async {
        let (mut r0, _) = Raw::join(&url, "spoof", Some("t"), 3, 0).await;
        let (mut r1, _) = Raw::join(&url, "spoof", Some("t"), 3, 1).await;
        let t2 = WsTransport::connect(&url, join_opts("spoof", "t", 3, 2))
            .await
            .expect("rank 2 joins");
        r0.wait_ready().await;
        r1.wait_ready().await;

        // to the raw receiver (rank 0): claims to be rank 0 itself
        r1.send_binary(frame(0, 0, 5, b"I am rank 0, honest"))
            .await
            .unwrap();
        let (h, p) = r0.next_frame().await;
        assert_eq!(h.src, 1, "the relay must stamp the sender's real rank");
        assert_eq!(
            (h.dst, h.tag, &p[..]),
            (0, p2p_tag(5), &b"I am rank 0, honest"[..])
        );

        // to our transport: claims rank 0, then a rank outside the world
        r1.send_binary(frame(0, 2, 6, b"spoofed as 0"))
            .await
            .unwrap();
        r1.send_binary(frame(99, 2, 7, b"spoofed as 99"))
            .await
            .unwrap();
        let got = tokio::time::timeout(WAIT, t2.recv(1, p2p_tag(6)))
            .await
            .expect("rank 2 did not get the frame under src 1")
            .expect("recv");
        assert_eq!(&got[..], b"spoofed as 0");
        let got = tokio::time::timeout(WAIT, t2.recv(1, p2p_tag(7)))
            .await
            .expect("rank 2 did not get the src-99 frame under src 1")
            .expect("recv");
        assert_eq!(&got[..], b"spoofed as 99");
        // nothing was filed under rank 0
        let r = tokio::time::timeout(Duration::from_millis(200), t2.recv(0, p2p_tag(6))).await;
        assert!(
            r.is_err(),
            "a frame was delivered as coming from rank 0: {r:?}"
        );

        // signals: `from` is stamped, `to` is stripped
        r1.send_control(&Control::Signal {
            to: Some(0),
            from: Some(2),
            data: serde_json::json!({"candidate": "x"}),
        })
        .await;
        match r0.next_control().await {
            Control::Signal { to, from, data } => {
                assert_eq!(from, Some(1), "signal source must be stamped");
                assert_eq!(to, None);
                assert_eq!(data, serde_json::json!({"candidate": "x"}));
            }
            other => panic!("expected the signal, got {other:?}"),
        }
    });
}

// ---------------------------------------------------------------------------------------------
// 2g. Bounded load test
// ---------------------------------------------------------------------------------------------

/// 16 ranks × N all_reduces through one relay (plus a few large ones on the ring), every result
/// checked exactly against the sum of values derived from (rank, iteration, element), and a
/// running checksum compared across ranks. Bounded: every wait by `CommOptions::timeout` (20 s),
/// the whole run by a 120 s deadline after which ranks abort and the test fails.
#[test]
fn load_16_ranks_many_all_reduces_nothing_lost_or_corrupted() {
    load_test(false);
}

/// The same load with direct links between all 16 ranks (120 TCP links, each rank reporting 15).
#[test]
fn load_16_ranks_over_direct_links_nothing_lost_or_corrupted() {
    load_test(true);
}

fn load_test(direct: bool) {
    // N = 2000 as in the issue: in a debug build on the 2-core test machine this takes about 8 s
    // (16 threads + the relay; ~270 collectives/s).
    const WORLD: usize = 16;
    const N: usize = 2000;
    const DEADLINE: Duration = Duration::from_secs(120);
    let relay = TestRelay::default_config();
    let url = relay.url();
    // small integers: sums of 16 are exact in f32, so equality is exact
    let value = |r: usize, it: usize, i: usize| -> f32 {
        ((r * 131 + it * 17 + i * 7 + (r * it) % 13) % 1024) as f32
    };
    let opts = CommOptions {
        timeout: Duration::from_secs(20),
        ..CommOptions::default()
    };
    let joins = (0..WORLD as u32)
        .map(|r| {
            let mut j = join_opts("load", "tl", 16, r);
            if direct {
                j.direct = Some(([127, 0, 0, 1], 0).into());
            }
            j
        })
        .collect();
    let t0 = Instant::now();
    let res = run_ranks(&url, joins, opts, |_, comm| async move {
        let r = comm.rank();
        let g = comm.world();
        if direct {
            assert_eq!(
                comm.transport().direct_peers().len(),
                WORLD - 1,
                "rank {r}: links"
            );
        }
        let mut checksum: u64 = 0;
        for it in 0..N {
            if t0.elapsed() > DEADLINE {
                let why = format!("load test deadline of {DEADLINE:?} passed at iteration {it}");
                comm.abort(&why).await;
                return Err(Error::Input(why));
            }
            // every 250th call is large (64 KiB/rank): ring algorithm
            let n = if it % 250 == 125 { 16 << 10 } else { 4 };
            let x: Vec<f32> = (0..n).map(|i| value(r, it, i)).collect();
            let y = comm
                .all_reduce(&Tensor::vector(&x), ReduceOp::Sum, &g)
                .await?
                .to_vec();
            for (i, &got) in y.iter().enumerate() {
                let want: f32 = (0..WORLD).map(|q| value(q, it, i)).sum();
                if got != want {
                    let why = format!(
                        "rank {r}: iteration {it} element {i}: got {got}, want {want} (corrupted or mismatched)"
                    );
                    comm.abort(&why).await;
                    return Err(Error::Input(why));
                }
                checksum = checksum
                    .wrapping_mul(1_000_003)
                    .wrapping_add(got.to_bits() as u64);
            }
        }
        Ok(checksum)
    });
    let took = t0.elapsed();
    let sums = all_ok("load test", res);
    eprintln!(
        "load test (direct links: {direct}): {WORLD} ranks x {N} all_reduces in {:.1} s ({:.0} collectives/s)",
        took.as_secs_f64(),
        N as f64 / took.as_secs_f64()
    );
    assert!(
        sums.iter().all(|&s| s == sums[0]),
        "ranks disagree on the checksum of all results: {sums:?}"
    );
    assert!(took < DEADLINE, "load test took {took:?}");
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
        ..RelayConfig::default()
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
        ..RelayConfig::default()
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
        ..RelayConfig::default()
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
        ..RelayConfig::default()
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

/// Join `room` (token "t") over a raw WebSocket, asking for a data stream or not; returns the
/// client and the relay's first answer.
async fn raw_join(url: &str, room: &str, world: u32, rank: u32, stream: bool) -> (Raw, Control) {
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
                ..RelayConfig::default()
            },
            None,
        ),
        (
            RelayConfig {
                splice: false,
                ..RelayConfig::default()
            },
            Some(StreamRoute::Unix),
        ),
        (
            RelayConfig {
                local_streams: false,
                ..RelayConfig::default()
            },
            Some(StreamRoute::Tcp),
        ),
        (RelayConfig::default(), Some(StreamRoute::Unix)),
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

    let relay = TestRelay::start_on("0.0.0.0:0", RelayConfig::default());
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
        ..RelayConfig::default()
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
        ..RelayConfig::default()
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
            ..RelayConfig::default()
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

/// The README's two-worker flow: the first worker creates the room and says its token at once
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
