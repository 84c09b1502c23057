//! Never a hang, never silent garbage: mismatched calls, timeouts, lost peers, bad arguments, and
//! bitwise determinism of all_reduce.

use std::time::Duration;

use distgrad::{CommOptions, Communicator, Error, ReduceOp, SmallAllReduce, Tensor, run_local};

fn opts(timeout_ms: u64) -> CommOptions {
    CommOptions {
        timeout: Duration::from_millis(timeout_ms),
        ..CommOptions::default()
    }
}

/// Every rank failed; at least one with a Mismatch naming both calls; the rest aborted by it.
/// None timed out (the timeout is long, so a hang would show up as Timeout).
fn assert_mismatch<T: std::fmt::Debug>(
    results: &[distgrad::Result<T>],
    call_a: &str,
    call_b: &str,
) {
    let all: Vec<usize> = (0..results.len()).collect();
    assert_mismatch_among(results, &all, call_a, call_b);
}

/// [`assert_mismatch`] over the ranks `among` only (index = global rank; the others made no call).
fn assert_mismatch_among<T: std::fmt::Debug>(
    results: &[distgrad::Result<T>],
    among: &[usize],
    call_a: &str,
    call_b: &str,
) {
    let mut mismatches = 0;
    for (r, res) in results.iter().enumerate() {
        if !among.contains(&r) {
            continue;
        }
        match res {
            Ok(v) => panic!("rank {r} succeeded with {v:?} despite mismatched calls"),
            Err(Error::Mismatch {
                rank,
                call,
                peer,
                peer_call,
                ..
            }) => {
                mismatches += 1;
                assert_eq!(*rank, r, "mismatch error names the detecting rank");
                assert_ne!(rank, peer);
                let both = format!("{call} | {peer_call}");
                assert!(
                    both.contains(call_a) && both.contains(call_b),
                    "rank {r}: error should name both calls ({call_a}, {call_b}), got {both}"
                );
            }
            Err(Error::Aborted { by, reason, .. }) => {
                assert!(
                    reason.contains("mismatch"),
                    "rank {r}: aborted by {by} for {reason}"
                );
            }
            Err(e) => panic!("rank {r}: expected a mismatch or abort, got {e}"),
        }
    }
    assert!(
        mismatches >= 1,
        "some rank must detect the mismatch: {results:?}"
    );
}

#[test]
fn different_collectives_fail_everywhere() {
    for world in [2, 3, 5] {
        let res = run_local(world, opts(30_000), |comm| async move {
            let x = Tensor::vector(&[1.0, 2.0]);
            let g = comm.world();
            if comm.rank() == world - 1 {
                comm.broadcast(&x, 0, &g).await
            } else {
                comm.all_reduce(&x, ReduceOp::Sum, &g).await
            }
        });
        assert_mismatch(&res, "broadcast(root=0", "all_reduce(op=sum");
    }
}

#[test]
fn different_shapes_fail_everywhere() {
    let res = run_local(4, opts(30_000), |comm| async move {
        let n = if comm.rank() == 2 { 3 } else { 4 };
        comm.all_reduce(&Tensor::zeros(&[n]), ReduceOp::Sum, &comm.world())
            .await
    });
    assert_mismatch(&res, "shape=[3]", "shape=[4]");
}

#[test]
fn large_payload_shape_mismatch_between_ring_and_direct() {
    // One rank's tensor is small (direct exchange), the others' large (ring): different algorithms.
    let res = run_local(3, opts(30_000), |comm| async move {
        let n = if comm.rank() == 1 { 10 } else { 100_000 };
        comm.all_reduce(&Tensor::zeros(&[n]), ReduceOp::Sum, &comm.world())
            .await
    });
    assert_mismatch(&res, "shape=[10]", "shape=[100000]");
}

#[test]
fn different_roots_fail_instead_of_deadlocking() {
    // Ranks 0 and 1 each believe they are the root of a gather: both would wait forever.
    let res = run_local(3, opts(30_000), |comm| async move {
        let root = if comm.rank() == 1 { 1 } else { 0 };
        comm.gather(&Tensor::zeros(&[2]), root, &comm.world()).await
    });
    assert_mismatch(&res, "root=0", "root=1");
    let res = run_local(4, opts(30_000), |comm| async move {
        let root = if comm.rank() == 3 { 2 } else { 1 };
        comm.broadcast(&Tensor::zeros(&[2]), root, &comm.world())
            .await
    });
    assert_mismatch(&res, "root=1", "root=2");
}

#[test]
fn different_ops_fail() {
    let res = run_local(2, opts(30_000), |comm| async move {
        let op = if comm.rank() == 0 {
            ReduceOp::Sum
        } else {
            ReduceOp::Max
        };
        comm.all_reduce(&Tensor::zeros(&[2]), op, &comm.world())
            .await
    });
    assert_mismatch(&res, "op=sum", "op=max");
}

#[test]
fn different_order_fails() {
    let res = run_local(3, opts(30_000), |comm| async move {
        let g = comm.world();
        let x = Tensor::zeros(&[2]);
        if comm.rank() == 0 {
            comm.all_gather(&x, &g).await?;
            comm.all_reduce(&x, ReduceOp::Sum, &g).await?;
        } else {
            comm.all_reduce(&x, ReduceOp::Sum, &g).await?;
            comm.all_gather(&x, &g).await?;
        }
        Ok(())
    });
    assert_mismatch(&res, "all_gather", "all_reduce");
}

#[test]
fn p2p_shape_mismatch_fails_both_sides() {
    let res = run_local(2, opts(30_000), |comm| async move {
        let g = comm.world();
        if comm.rank() == 0 {
            comm.send(&Tensor::zeros(&[3]), 1, &g).await?;
            // Wait for the peer's verdict instead of exiting (which would read as a lost peer).
            comm.barrier(&g).await
        } else {
            comm.recv(&[4], 0, &g).await.map(|_| ())
        }
    });
    match &res[1] {
        Err(Error::Mismatch {
            call, peer_call, ..
        }) => {
            assert!(
                call.contains("[4]") && peer_call.contains("[3]"),
                "{call} / {peer_call}"
            );
        }
        other => panic!("receiver: expected mismatch, got {other:?}"),
    }
    assert!(
        matches!(&res[0], Err(Error::Aborted { by: 1, .. })),
        "sender: {:?}",
        res[0]
    );
}

#[test]
fn all_to_all_single_split_disagreement_names_both_ranks() {
    let res = run_local(2, opts(30_000), |comm| async move {
        let g = comm.world();
        // rank 0 sends 1 row to rank 1, but rank 1 expects 2 rows from rank 0.
        let (x, ins, outs) = if comm.rank() == 0 {
            (Tensor::zeros(&[2, 1]), vec![1, 1], vec![1, 1])
        } else {
            (Tensor::zeros(&[2, 1]), vec![1, 1], vec![2, 1])
        };
        comm.all_to_all_single(&x, &ins, &outs, &g).await
    });
    let texts: Vec<String> = res
        .iter()
        .map(|r| format!("{:?}", r.as_ref().err()))
        .collect();
    assert!(res.iter().all(|r| r.is_err()), "{texts:?}");
    assert!(
        texts
            .iter()
            .any(|t| t.contains("expects 2 rows from group rank 0") && t.contains("got 1")),
        "{texts:?}"
    );
}

#[test]
fn silent_peer_times_out_with_context() {
    let res = run_local(2, opts(200), |comm| async move {
        if comm.rank() == 1 {
            // Alive but never joins the collective.
            std::thread::sleep(Duration::from_millis(1500));
            return Ok(());
        }
        comm.all_reduce(&Tensor::zeros(&[2]), ReduceOp::Sum, &comm.world())
            .await
            .map(|_| ())
    });
    match &res[0] {
        Err(Error::Timeout {
            rank,
            peer,
            call,
            timeout,
        }) => {
            assert_eq!((*rank, *peer), (0, 1));
            assert_eq!(*timeout, Duration::from_millis(200));
            assert!(call.contains("all_reduce"), "{call}");
        }
        other => panic!("expected timeout, got {other:?}"),
    }
}

#[test]
fn lost_peer_fails_pending_ops_on_every_rank() {
    let res = run_local(4, opts(30_000), |comm| async move {
        if comm.rank() == 2 {
            return Ok(()); // leaves: its transport is dropped
        }
        comm.all_reduce(&Tensor::zeros(&[100_000]), ReduceOp::Sum, &comm.world())
            .await
            .map(|_| ())
    });
    for (r, res) in res.iter().enumerate() {
        if r == 2 {
            continue;
        }
        match res {
            Err(Error::PeerLost { peer: 2, .. }) => {}
            Err(Error::Aborted { reason, .. }) => {
                assert!(reason.contains("rank 2 is gone"), "rank {r}: {reason}")
            }
            other => panic!("rank {r}: expected PeerLost/Aborted, got {other:?}"),
        }
    }
}

#[test]
fn after_an_abort_later_calls_fail_fast() {
    let res = run_local(2, opts(30_000), |comm| async move {
        let g = comm.world();
        let op = if comm.rank() == 0 {
            ReduceOp::Sum
        } else {
            ReduceOp::Min
        };
        let first = comm.all_reduce(&Tensor::zeros(&[1]), op, &g).await;
        assert!(first.is_err());
        comm.all_reduce(&Tensor::zeros(&[1]), ReduceOp::Sum, &g)
            .await
    });
    for r in &res {
        assert!(matches!(r, Err(Error::Aborted { .. })), "{r:?}");
    }
}

/// One rank makes a bad call: it gets a clear error, and the others are aborted instead of waiting.
fn bad_call_on_rank_0(
    what: &str,
    bad: impl AsyncFn(&distgrad::LocalComm) -> distgrad::Result<()> + Sync,
) {
    let res = run_local(3, opts(30_000), |comm| {
        let bad = &bad;
        async move {
            let g = comm.world();
            if comm.rank() == 0 {
                return bad(&comm).await;
            }
            comm.all_reduce(&Tensor::zeros(&[2]), ReduceOp::Sum, &g)
                .await
                .map(|_| ())
        }
    });
    let e = res[0].as_ref().unwrap_err().to_string();
    assert!(e.contains(what), "rank 0: expected {what:?} in {e}");
    for (r, res) in res.iter().enumerate().skip(1) {
        match res {
            Err(Error::Aborted { by: 0, reason, .. }) => {
                assert!(reason.contains(what), "rank {r}: {reason}")
            }
            other => panic!("rank {r}: expected abort by rank 0, got {other:?}"),
        }
    }
}

#[test]
fn bad_arguments_are_errors_that_abort_the_others() {
    let x = Tensor::zeros(&[2]);
    bad_call_on_rank_0("not a member of group 1", async |c| {
        let g = c.new_group(&[1, 2])?;
        c.all_reduce(&x, ReduceOp::Sum, &g).await.map(|_| ())
    });
    bad_call_on_rank_0("root 3 is not a rank of group 0 (size 3)", async |c| {
        c.broadcast(&x, 3, &c.world()).await.map(|_| ())
    });
    bad_call_on_rank_0("root must pass the list", async |c| {
        c.scatter(None, 0, &c.world()).await.map(|_| ())
    });
    bad_call_on_rank_0("destination twice", async |c| {
        c.permute(&x, &[(0, 1), (1, 1)], &c.world())
            .await
            .map(|_| ())
    });
    bad_call_on_rank_0("do not sum to dim 0", async |c| {
        c.all_to_all_single(&x, &[1, 0, 0], &[1, 1, 1], &c.world())
            .await
            .map(|_| ())
    });
}

#[test]
fn bad_groups_are_errors() {
    let res = run_local(2, opts(1_000), |comm| async move {
        let dup = comm.new_group(&[1, 1]).unwrap_err();
        let out = comm.new_group(&[0, 7]).unwrap_err();
        Ok((dup.to_string(), out.to_string()))
    });
    let (dup, out) = res[0].clone().unwrap();
    assert!(dup.contains("listed twice"), "{dup}");
    assert!(out.contains("outside world of 2"), "{out}");
}

/// Values whose float sum depends on the order of additions.
fn order_sensitive(rank: usize, n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| {
            let k = (i * 7 + rank * 13) % 11;
            match k {
                0 => 1.0e8,
                1 => -1.0e8,
                2 => 3.0e-3,
                _ => (k as f32).powi(3) * 0.1 + rank as f32 * 1.0e-4,
            }
        })
        .collect()
}

#[test]
fn all_reduce_is_bitwise_identical_on_every_rank() {
    // Sanity: the chosen values really are order sensitive.
    let a: f32 = 1.0e8 + 3.0e-3 - 1.0e8;
    let b: f32 = 1.0e8 - 1.0e8 + 3.0e-3;
    assert_ne!(a.to_bits(), b.to_bits());
    for world in 1..=8 {
        for n in [5, 40_000] {
            // 40_000 floats = 160 KB: above the ring threshold
            for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Prod] {
                let res = run_local(world, opts(30_000), |comm| async move {
                    let x = Tensor::vector(&order_sensitive(comm.rank(), n));
                    Ok(comm.all_reduce(&x, op, &comm.world()).await?.to_vec())
                });
                let outs: Vec<Vec<f32>> = res.into_iter().map(|r| r.unwrap()).collect();
                for (r, o) in outs.iter().enumerate() {
                    assert!(
                        o.iter()
                            .zip(&outs[0])
                            .all(|(a, b)| a.to_bits() == b.to_bits()),
                        "world {world}, n {n}, {op:?}: rank {r} differs from rank 0"
                    );
                }
            }
        }
    }
}

/// One all_reduce of 64 zeros on 3 ranks, each built by hand with its own options (options are
/// per communicator).
fn all_reduce_with_options(
    opts_of: impl Fn(usize) -> CommOptions + Sync,
) -> Vec<distgrad::Result<Tensor>> {
    all_reduce_with_options_in(3, opts_of)
}

/// [`all_reduce_with_options`] on `world` ranks.
fn all_reduce_with_options_in(
    world: usize,
    opts_of: impl Fn(usize) -> CommOptions + Sync,
) -> Vec<distgrad::Result<Tensor>> {
    let transports = distgrad::transport::local::LocalTransport::world(world);
    std::thread::scope(|s| {
        let hs: Vec<_> = transports
            .into_iter()
            .enumerate()
            .map(|(rank, t)| {
                let o = opts_of(rank);
                s.spawn(move || {
                    let comm = distgrad::P2p::new(t, o);
                    futures::executor::block_on(comm.all_reduce(
                        &Tensor::zeros(&[64]),
                        ReduceOp::Sum,
                        &comm.world(),
                    ))
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

#[test]
fn ranks_configured_for_different_algorithms_fail_with_a_mismatch() {
    // Rank 1 would use the ring for this size, the others direct exchange.
    let results = all_reduce_with_options(|rank| {
        let mut o = opts(30_000);
        o.ring_threshold = if rank == 1 { 0 } else { 1 << 30 };
        o.all_reduce = distgrad::AllReduceAlgo::Ring;
        o
    });
    assert_mismatch(&results, "args=[1, ", "args=[0]");
}

#[test]
fn ranks_configured_for_different_large_all_reduce_algorithms_fail_with_a_mismatch() {
    // Same threshold, but rank 2 would use the pairwise algorithm and the others the shared one.
    let results = all_reduce_with_options(|rank| {
        let mut o = opts(30_000);
        o.ring_threshold = 0;
        o.all_reduce = if rank == 2 {
            distgrad::AllReduceAlgo::Pairwise
        } else {
            distgrad::AllReduceAlgo::Shared
        };
        o
    });
    assert_mismatch(&results, "args=[2]", "args=[3]");
}

/// A transport that counts what it sends, per channel.
struct Counting {
    inner: distgrad::transport::local::LocalTransport,
    sent: std::cell::RefCell<std::collections::HashMap<&'static str, usize>>,
}

impl distgrad::transport::Transport for Counting {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn world(&self) -> usize {
        self.inner.world()
    }
    async fn send(
        &self,
        dst: usize,
        tag: distgrad::transport::Tag,
        payload: bytes::Bytes,
    ) -> distgrad::Result<()> {
        let ch = match tag.channel {
            distgrad::transport::Channel::Sig => "sig",
            _ => "data",
        };
        *self.sent.borrow_mut().entry(ch).or_insert(0) += 1;
        self.inner.send(dst, tag, payload).await
    }
    async fn recv(
        &self,
        src: usize,
        tag: distgrad::transport::Tag,
    ) -> distgrad::Result<bytes::Bytes> {
        self.inner.recv(src, tag).await
    }
    async fn abort(&self, reason: &str) {
        self.inner.abort(reason).await
    }
}

/// One SUM all_reduce of `numel` copies of `rank + 1` on `world` in-process ranks with `opts`,
/// counting what each rank sends: per rank, its result and its (signature, data) messages.
fn counted_all_reduce(
    world: usize,
    numel: usize,
    opts: &CommOptions,
) -> Vec<(Vec<f32>, (usize, usize))> {
    let ts = distgrad::transport::local::LocalTransport::world(world);
    std::thread::scope(|s| {
        let hs: Vec<_> = ts
            .into_iter()
            .map(|t| {
                let opts = opts.clone();
                s.spawn(move || {
                    let comm = distgrad::P2p::new(
                        Counting {
                            inner: t,
                            sent: Default::default(),
                        },
                        opts,
                    );
                    let r = comm.rank();
                    let x = Tensor::full(&[numel], r as f32 + 1.0);
                    let y = futures::executor::block_on(comm.all_reduce(
                        &x,
                        ReduceOp::Sum,
                        &comm.world(),
                    ))
                    .unwrap();
                    let sent = comm.transport().sent.borrow().clone();
                    let count = |ch| sent.get(ch).copied().unwrap_or(0);
                    (y.to_vec(), (count("sig"), count("data")))
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// A small all_reduce is one message from every rank to every other: the signature rides with the
/// data to the ring successor (world - 1 messages per rank and call, the first of them on the
/// signature channel); a large one (the ring) sends its signature on its own, before the data.
/// Results as computed by hand.
#[test]
fn a_small_all_reduce_sends_one_message_per_peer() {
    for world in [2, 3, 4, 7] {
        for (numel, sigs, data) in [(1, 1, world - 2), (40_000, 1, 2 * (world - 1))] {
            let res = counted_all_reduce(world, numel, &CommOptions::for_network());
            let want = (world * (world + 1) / 2) as f32;
            for (r, (y, sent)) in res.iter().enumerate() {
                assert!(
                    y.iter().all(|&v| v == want),
                    "world {world} rank {r}: {y:?}"
                );
                assert_eq!(
                    *sent,
                    (sigs, data),
                    "world {world} numel {numel} rank {r}: (signature, data) messages sent"
                );
            }
        }
    }
}

fn star_opts(timeout_ms: u64) -> CommOptions {
    CommOptions {
        small_all_reduce: SmallAllReduce::Star,
        ..opts(timeout_ms)
    }
}

/// The star all_reduce checks calls at its ends (the root sees every rank's, every rank the
/// root's), not around the ring; a rank in any other call must still fail every rank with a
/// mismatch, wherever it sits (the root, the root's successor or predecessor, a rank between),
/// and never leave one waiting (a wait would end in a Timeout, which `assert_mismatch` rejects).
#[test]
fn star_all_reduce_mismatches_fail_everywhere_wherever_the_odd_rank_sits() {
    for world in [3, 4, 5] {
        for odd in 0..world {
            // Other rooted collectives at the odd rank: a broadcast (its tree reaches the star's
            // root only for some positions), a reduce, a gather (the root receives from all).
            for kind in ["broadcast", "reduce", "gather"] {
                let res = run_local(world, star_opts(30_000), |comm| async move {
                    let x = Tensor::vector(&[1.0, 2.0]);
                    let g = comm.world();
                    if comm.rank() != odd {
                        return comm.all_reduce(&x, ReduceOp::Sum, &g).await.map(drop);
                    }
                    match kind {
                        "broadcast" => comm.broadcast(&x, odd, &g).await.map(drop),
                        "reduce" => comm.reduce(&x, odd, ReduceOp::Sum, &g).await.map(drop),
                        _ => comm.gather(&x, odd, &g).await.map(drop),
                    }
                });
                assert_mismatch(&res, &format!("{kind}("), "all_reduce(op=sum");
            }
            // Another shape, small on both sides (star against star); also in sizes from
            // `SPLIT_BYTES` (16 KiB) up, below the ring's 64 KiB, where the signature goes on its
            // own before the data.
            for (a, b) in [(3, 4), (5000, 5001)] {
                let res = run_local(world, star_opts(30_000), |comm| async move {
                    let n = if comm.rank() == odd { a } else { b };
                    comm.all_reduce(&Tensor::zeros(&[n]), ReduceOp::Sum, &comm.world())
                        .await
                });
                assert_mismatch(&res, &format!("shape=[{a}]"), &format!("shape=[{b}]"));
            }
            // Another shape, large on one side: the ring (messages only to its successor) against
            // the star, both ways round.
            for (mine, others) in [(100_000, 10), (10, 100_000)] {
                let res = run_local(world, star_opts(30_000), |comm| async move {
                    let n = if comm.rank() == odd { mine } else { others };
                    comm.all_reduce(&Tensor::zeros(&[n]), ReduceOp::Sum, &comm.world())
                        .await
                });
                assert_mismatch(&res, "shape=[10]", "shape=[100000]");
            }
            // Another op; another kind that talks to everyone (all_gather's exchange).
            let res = run_local(world, star_opts(30_000), |comm| async move {
                let op = if comm.rank() == odd {
                    ReduceOp::Max
                } else {
                    ReduceOp::Sum
                };
                comm.all_reduce(&Tensor::zeros(&[2]), op, &comm.world())
                    .await
            });
            assert_mismatch(&res, "op=sum", "op=max");
            let res = run_local(world, star_opts(30_000), |comm| async move {
                let x = Tensor::zeros(&[2]);
                let g = comm.world();
                if comm.rank() == odd {
                    comm.all_gather(&x, &g).await.map(|_| ())
                } else {
                    comm.all_reduce(&x, ReduceOp::Sum, &g).await.map(|_| ())
                }
            });
            assert_mismatch(&res, "all_gather", "all_reduce");
            // One rank configured for the exchange, the others for the star (and the reverse).
            for odd_star in [false, true] {
                let res = all_reduce_with_options_in(world, |rank| {
                    let star = (rank == odd) == odd_star;
                    let mut o = opts(30_000);
                    if star {
                        o.small_all_reduce = SmallAllReduce::Star;
                    }
                    o
                });
                assert_mismatch(&res, "args=[4]", "args=[0]");
            }
        }
    }
}

/// The star all_reduce sends `2(n-1)` messages: every rank but the root one to the root (the
/// root's predecessor's on the signature channel, the others' with the signature as a prefix),
/// the root one to every rank (the first, to its successor, on the signature channel). Two
/// ranks exchange (the star would save nothing): one message each. Results as computed by hand,
/// and bitwise those of the exchange for values whose sum depends on the order of additions.
#[test]
fn a_small_star_all_reduce_sends_two_messages_per_rank_and_matches_the_exchange() {
    let star = CommOptions {
        small_all_reduce: SmallAllReduce::Star,
        ..CommOptions::for_network()
    };
    for world in [2, 3, 4, 7] {
        let res = counted_all_reduce(world, 3, &star);
        let want = (world * (world + 1) / 2) as f32;
        for (r, (y, sent)) in res.iter().enumerate() {
            assert!(
                y.iter().all(|&v| v == want),
                "world {world} rank {r}: {y:?}"
            );
            let expected = match (world, r) {
                (2, _) => (1, 0),
                (_, 0) => (1, world - 2),
                (_, r) if r == world - 1 => (1, 0),
                _ => (0, 1),
            };
            assert_eq!(
                *sent, expected,
                "world {world} rank {r}: (signature, data) messages sent"
            );
        }
    }
    for world in 1..=8 {
        for op in ReduceOp::ALL {
            let run = |o: CommOptions| {
                run_local(world, o, |comm| async move {
                    let x = Tensor::vector(&order_sensitive(comm.rank(), 5));
                    Ok(comm.all_reduce(&x, op, &comm.world()).await?.to_vec())
                })
                .into_iter()
                .map(|r| r.unwrap())
                .collect::<Vec<_>>()
            };
            let exchange = run(opts(30_000));
            let star = run(star_opts(30_000));
            for (r, (a, b)) in exchange.iter().zip(&star).enumerate() {
                assert!(
                    a.iter().zip(b).all(|(a, b)| a.to_bits() == b.to_bits()),
                    "world {world} {op:?} rank {r}: star {b:?} != exchange {a:?}"
                );
            }
        }
    }
}

/// `SmallAllReduce` names round-trip, and a bad one is an input error naming the choices.
#[test]
fn small_all_reduce_names_parse() {
    for a in SmallAllReduce::ALL {
        assert_eq!(SmallAllReduce::parse(a.name()).unwrap(), a);
    }
    let e = SmallAllReduce::parse("tree").unwrap_err().to_string();
    assert!(
        e.contains("\"tree\"") && e.contains("exchange, star"),
        "{e}"
    );
}

/// On a subgroup the star's root is group rank 0, here global rank 4 of 5; global rank 1 is no
/// member and makes no call. One member (each in turn) calls with another op: every member fails
/// with the mismatch.
#[test]
fn star_all_reduce_mismatch_on_a_subgroup() {
    const MEMBERS: [usize; 4] = [4, 2, 0, 3];
    for odd in MEMBERS {
        let res = run_local(5, star_opts(30_000), |comm| async move {
            let g = comm.new_group(&MEMBERS)?;
            if !MEMBERS.contains(&comm.rank()) {
                return Ok(None);
            }
            let op = if comm.rank() == odd {
                ReduceOp::Max
            } else {
                ReduceOp::Sum
            };
            comm.all_reduce(&Tensor::zeros(&[2]), op, &g)
                .await
                .map(Some)
        });
        assert!(
            matches!(res[1], Ok(None)),
            "rank 1 is no member: {:?}",
            res[1]
        );
        assert_mismatch_among(&res, &MEMBERS, "op=sum", "op=max");
    }
}

/// A star all_reduce of 5000 floats (20 KB: at least `SPLIT_BYTES`, below the ring threshold):
/// the root's result goes to its successor after a signature message of its own, as does rank
/// n-1's tensor to the root; every other message (the other ranks' tensors to the root, the
/// root's result to the ranks after its successor) goes as a signature prefix message followed by
/// the payload untouched. Results as computed by hand.
#[test]
fn a_star_all_reduce_of_split_size_sends_its_signatures_apart() {
    let star = CommOptions {
        small_all_reduce: SmallAllReduce::Star,
        ..CommOptions::for_network()
    };
    for world in [3, 4, 6] {
        let res = counted_all_reduce(world, 5000, &star);
        let want = (world * (world + 1) / 2) as f32;
        for (r, (y, sent)) in res.iter().enumerate() {
            assert!(
                y.len() == 5000 && y.iter().all(|&v| v == want),
                "world {world} rank {r}: {:?}",
                &y[..4]
            );
            let expected = match r {
                0 => (1, 1 + 2 * (world - 2)),
                r if r == world - 1 => (1, 1),
                _ => (0, 2),
            };
            assert_eq!(
                *sent, expected,
                "world {world} rank {r}: (signature, data) messages sent"
            );
        }
    }
}
