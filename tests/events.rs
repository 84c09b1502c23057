//! The events a communicator records (`CommOptions::record_events`), held against each
//! algorithm's theory and against the transport: a ring all_reduce of S payload bytes on n ranks
//! (n dividing the elements) has 2(n−1) rounds and moves 2(n−1)/n·S bytes per rank, each round a
//! message to the successor carrying the chunk the ring says; the pairwise the same bytes in 2
//! rounds; the star 2(n−1) messages in 2 rounds; the exchange n(n−1) in one; a tree broadcast or
//! reduce ⌈log2 n⌉ rounds and n−1 messages. Every message recorded as sent is recorded as
//! received by its peer (same round, bytes and chunk), and the bytes and messages the events say
//! were handed to the transport are what a counting transport under the communicator saw.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use distgrad::collective::events::{Action, Algorithm, CallRecord, Chunk};
use distgrad::transport::local::LocalTransport;
use distgrad::transport::{Tag, Transport};
use distgrad::{CommOptions, Communicator, P2p, ReduceOp, Tensor};

/// The in-process transport, counting what each rank hands it.
struct Counting {
    inner: LocalTransport,
    bytes: Arc<AtomicU64>,
    messages: Arc<AtomicU64>,
}

impl Transport for Counting {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn world(&self) -> usize {
        self.inner.world()
    }
    async fn send(&self, dst: usize, tag: Tag, payload: Bytes) -> distgrad::Result<()> {
        self.bytes
            .fetch_add(payload.len() as u64, Ordering::Relaxed);
        self.messages.fetch_add(1, Ordering::Relaxed);
        self.inner.send(dst, tag, payload).await
    }
    async fn recv(&self, src: usize, tag: Tag) -> distgrad::Result<Bytes> {
        self.inner.recv(src, tag).await
    }
    async fn abort(&self, reason: &str) {
        self.inner.abort(reason).await;
    }
    fn shares_memory(&self) -> bool {
        self.inner.shares_memory()
    }
}

/// One rank's records and what its transport counted (bytes, messages).
struct RankRecord {
    calls: Vec<CallRecord>,
    wire: (u64, u64),
}

fn opts(algorithm: Option<Algorithm>) -> CommOptions {
    let o = CommOptions {
        timeout: Duration::from_secs(20),
        record_events: true,
        ..CommOptions::default()
    };
    match algorithm {
        Some(a) => o.with_algorithm(a).unwrap(),
        None => o,
    }
}

/// Run `f` on `n` ranks over counting transports; every rank's records.
fn run<F, Fut>(n: usize, o: CommOptions, f: F) -> Vec<RankRecord>
where
    F: Fn(P2p<Counting>) -> Fut + Sync,
    Fut: std::future::Future<Output = P2p<Counting>>,
{
    std::thread::scope(|s| {
        let handles: Vec<_> = LocalTransport::world(n)
            .into_iter()
            .map(|t| {
                let (f, o) = (&f, o.clone());
                s.spawn(move || {
                    let (bytes, messages) = (Arc::default(), Arc::default());
                    let c = Counting {
                        inner: t,
                        bytes: Arc::clone(&bytes),
                        messages: Arc::clone(&messages),
                    };
                    let comm = futures::executor::block_on(f(P2p::new(c, o)));
                    let calls = comm.take_events();
                    let wire = (
                        bytes.load(Ordering::Relaxed),
                        messages.load(Ordering::Relaxed),
                    );
                    RankRecord { calls, wire }
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// Rank r's input: `len` small integers.
fn input(r: usize, len: usize) -> Tensor {
    let v: Vec<f32> = (0..len).map(|i| ((r * 3 + i) % 7) as f32).collect();
    Tensor::from_vec(v, &[len]).unwrap()
}

/// The one call each rank made.
fn only(ranks: &[RankRecord]) -> Vec<&CallRecord> {
    ranks
        .iter()
        .map(|r| {
            assert_eq!(r.calls.len(), 1, "one call per rank: {:?}", r.calls);
            &r.calls[0]
        })
        .collect()
}

fn all_reduce(n: usize, len: usize, a: Option<Algorithm>) -> Vec<RankRecord> {
    run(n, opts(a), |comm| async move {
        let x = input(comm.rank(), len);
        comm.all_reduce(&x, ReduceOp::Sum, &comm.world())
            .await
            .unwrap();
        comm
    })
}

/// The messages a record sent (not the confirmation round's), as (round, peer, bytes, chunk).
fn sends(c: &CallRecord) -> Vec<(u32, usize, u64, Option<Chunk>)> {
    c.of(Action::Send)
        .filter(|e| !e.confirm)
        .map(|e| (e.round, e.peer.unwrap(), e.bytes, e.chunk))
        .collect()
}

/// Every recorded send is a recorded receive at its peer (same round, bytes, chunk, confirm),
/// and the other way round.
fn sends_match_receives(calls: &[&CallRecord]) {
    let mut sent: Vec<_> = calls
        .iter()
        .flat_map(|c| {
            c.of(Action::Send).map(|e| {
                (
                    c.rank,
                    e.peer.unwrap(),
                    e.round,
                    e.bytes,
                    e.chunk,
                    e.confirm,
                )
            })
        })
        .collect();
    let mut received: Vec<_> = calls
        .iter()
        .flat_map(|c| {
            c.of(Action::Recv).map(|e| {
                (
                    e.peer.unwrap(),
                    c.rank,
                    e.round,
                    e.bytes,
                    e.chunk,
                    e.confirm,
                )
            })
        })
        .collect();
    sent.sort_by_key(|k| format!("{k:?}"));
    received.sort_by_key(|k| format!("{k:?}"));
    assert_eq!(sent, received);
}

/// What the events say went to the transport equals what it counted, on every rank.
fn events_are_the_wire(ranks: &[RankRecord]) {
    for (r, rank) in ranks.iter().enumerate() {
        let (bytes, messages) = rank
            .calls
            .iter()
            .flat_map(|c| &c.events)
            .fold((0, 0), |(b, m), e| {
                (b + e.wire_bytes, m + u64::from(e.messages))
            });
        assert_eq!(
            (bytes, messages),
            rank.wire,
            "rank {r}: events vs transport"
        );
    }
}

#[test]
fn ring_all_reduce_has_2n_minus_2_rounds_and_moves_2_n_minus_1_over_n_of_the_data() {
    for n in 2..=8 {
        let len = n * 5;
        let s = (len * 4) as u64;
        let ranks = all_reduce(n, len, Some(Algorithm::Ring));
        let calls = only(&ranks);
        for c in &calls {
            assert_eq!(c.algorithm, Algorithm::Ring);
            assert_eq!(c.collective, "all_reduce(op=sum)");
            assert_eq!(c.rounds() as usize, 2 * (n - 1), "n={n} rank {}", c.rank);
            assert_eq!(c.sent_bytes(), 2 * (n as u64 - 1) * s / n as u64, "n={n}");
            // Round k: one message to the successor, carrying chunk (me - k) mod n in the
            // reduce-scatter half and (me + 1 - k) mod n in the all-gather half.
            let me = c.rank;
            let expected: Vec<_> = (0..2 * (n - 1))
                .map(|k| {
                    let chunk = if k < n - 1 {
                        (me + n - k % n) % n
                    } else {
                        (me + 1 + n - (k - (n - 1))) % n
                    };
                    (
                        k as u32,
                        (me + 1) % n,
                        20,
                        Some(Chunk::part(chunk, n, chunk * 5, 5)),
                    )
                })
                .collect();
            assert_eq!(sends(c), expected, "n={n} rank {me}");
            // n-1 folds (reduce-scatter), n copies (assembly).
            assert_eq!(c.of(Action::Reduce).count(), n - 1);
            assert_eq!(c.of(Action::Copy).count(), n);
        }
        sends_match_receives(&calls);
        events_are_the_wire(&ranks);
    }
}

#[test]
fn pairwise_moves_the_ring_s_bytes_in_two_rounds() {
    for n in 2..=8 {
        let len = n * 3;
        let s = (len * 4) as u64;
        let ranks = all_reduce(n, len, Some(Algorithm::Pairwise));
        let calls = only(&ranks);
        for c in &calls {
            assert_eq!(c.algorithm, Algorithm::Pairwise);
            assert_eq!(c.rounds(), 2);
            assert_eq!(c.sent_bytes(), 2 * (n as u64 - 1) * s / n as u64, "n={n}");
            assert_eq!(c.of(Action::Reduce).count(), 1);
        }
        sends_match_receives(&calls);
        events_are_the_wire(&ranks);
    }
}

#[test]
fn star_sends_2_n_minus_1_messages_in_two_rounds_and_the_exchange_n_n_minus_1_in_one() {
    for n in 3..=8 {
        let ranks = all_reduce(n, 4, Some(Algorithm::Star));
        let calls = only(&ranks);
        let messages: usize = calls.iter().map(|c| sends(c).len()).sum();
        assert_eq!(messages, 2 * (n - 1), "star, n={n}");
        for c in &calls {
            assert_eq!(c.algorithm, Algorithm::Star);
            assert_eq!(c.rounds(), 2, "star, n={n}, rank {}", c.rank);
            // Only the root (group rank 0) reduces.
            assert_eq!(c.of(Action::Reduce).count(), usize::from(c.rank == 0));
        }
        sends_match_receives(&calls);
        events_are_the_wire(&ranks);

        let ranks = all_reduce(n, 4, Some(Algorithm::Exchange));
        let calls = only(&ranks);
        let messages: usize = calls.iter().map(|c| sends(c).len()).sum();
        assert_eq!(messages, n * (n - 1), "exchange, n={n}");
        assert!(calls.iter().all(|c| c.rounds() == 1));
        sends_match_receives(&calls);
        events_are_the_wire(&ranks);
    }
}

/// ⌈log2 n⌉.
fn log2_ceil(n: usize) -> u32 {
    n.next_power_of_two().trailing_zeros()
}

#[test]
fn tree_broadcast_and_reduce_take_log2_n_rounds_and_n_minus_1_messages() {
    for n in 1..=8 {
        for root in [0, n - 1, n / 2] {
            let ranks = run(n, opts(None), |comm| async move {
                let x = input(comm.rank(), 3);
                let w = comm.world();
                comm.broadcast(&x, root, &w).await.unwrap();
                comm.reduce(&x, root, ReduceOp::Max, &w).await.unwrap();
                comm
            });
            for call in 0..2 {
                let calls: Vec<&CallRecord> = ranks.iter().map(|r| &r.calls[call]).collect();
                let what = format!("{} n={n} root={root}", calls[0].collective);
                assert!(calls.iter().all(|c| c.algorithm == Algorithm::Tree));
                let rounds = calls.iter().map(|c| c.rounds()).max().unwrap();
                assert_eq!(rounds, log2_ceil(n), "{what}");
                let messages: usize = calls.iter().map(|c| sends(c).len()).sum();
                assert_eq!(messages, n - 1, "{what}");
                for c in &calls {
                    // Broadcast: every rank but the root receives once; reduce: every rank but
                    // the root sends once.
                    let (action, want) = if call == 0 {
                        (Action::Recv, usize::from(c.rank != root))
                    } else {
                        (Action::Send, usize::from(c.rank != root))
                    };
                    let got = c.of(action).filter(|e| !e.confirm).count();
                    assert_eq!(got, want, "{what} rank {}", c.rank);
                }
                sends_match_receives(&calls);
            }
            events_are_the_wire(&ranks);
        }
    }
}

#[test]
fn every_collective_s_events_are_what_the_transport_moved() {
    for n in [2, 3, 5] {
        for algorithm in [None, Some(Algorithm::Ring)] {
            let ranks = run(n, opts(algorithm), |comm| async move {
                let me = comm.rank();
                let w = comm.world();
                let x = input(me, 2 * n);
                let list: Vec<Tensor> = (0..n).map(|j| input(me + j, 2)).collect();
                comm.all_gather(&x, &w).await.unwrap();
                comm.reduce_scatter(&list, ReduceOp::Sum, &w).await.unwrap();
                comm.all_to_all(&list, &w).await.unwrap();
                comm.gather(&x, n - 1, &w).await.unwrap();
                let sc = (me == 0).then_some(&list[..]);
                comm.scatter(sc, 0, &w).await.unwrap();
                let pairs: Vec<(usize, usize)> = (0..n).map(|r| (r, (r + 1) % n)).collect();
                comm.permute(&x, &pairs, &w).await.unwrap();
                comm.barrier(&w).await.unwrap();
                if me == 0 {
                    comm.send(&x, 1, &w).await.unwrap();
                } else if me == 1 {
                    comm.recv(&[2 * n], 0, &w).await.unwrap();
                }
                let splits = vec![2; n];
                comm.all_to_all_single(&x, &splits, &splits, &w)
                    .await
                    .unwrap();
                comm
            });
            events_are_the_wire(&ranks);
            let calls: Vec<&CallRecord> = ranks.iter().flat_map(|r| &r.calls).collect();
            sends_match_receives(&calls);
            let names: Vec<String> = ranks[0]
                .calls
                .iter()
                .map(|c| c.collective.clone())
                .collect();
            let gather = format!("gather(root={})", n - 1);
            let want = [
                "all_gather",
                "reduce_scatter(op=sum)",
                "all_to_all",
                &gather,
                "scatter(root=0)",
                "permute",
                "barrier",
                "send/recv",
                "all_to_all_single",
            ];
            assert_eq!(names, want);
            let ring = algorithm == Some(Algorithm::Ring);
            let want = if ring {
                Algorithm::Ring
            } else {
                Algorithm::Exchange
            };
            assert_eq!(ranks[0].calls[0].algorithm, want, "all_gather");
            assert_eq!(ranks[0].calls[1].algorithm, want, "reduce_scatter");
            assert_eq!(ranks[0].calls[7].algorithm, Algorithm::PointToPoint);
            // Rank 0's all_to_all_single sends each rank j its piece (2 rows), named as
            // all_to_all names its list entries.
            let pieces: Vec<_> = sends(&ranks[0].calls[8]).into_iter().map(|s| s.3).collect();
            let want: Vec<_> = (1..n).map(|j| Some(Chunk::entry(j, 2))).collect();
            assert_eq!(pieces, want);
        }
    }
}

#[test]
fn nothing_is_recorded_unless_asked() {
    let o = CommOptions {
        timeout: Duration::from_secs(20),
        ..CommOptions::default()
    };
    let ranks = run(3, o, |comm| async move {
        let x = input(comm.rank(), 4);
        comm.all_reduce(&x, ReduceOp::Sum, &comm.world())
            .await
            .unwrap();
        comm
    });
    assert!(ranks.iter().all(|r| r.calls.is_empty()));
    assert!(ranks.iter().all(|r| r.wire.1 > 0), "the call did run");
}

#[test]
fn only_the_algorithms_a_collective_can_take_are_chosen() {
    for a in [Algorithm::Tree, Algorithm::Direct, Algorithm::PointToPoint] {
        let e = CommOptions::default().with_algorithm(a).unwrap_err();
        assert!(e.to_string().contains("is not chosen"), "{e}");
    }
    assert_eq!(Algorithm::parse("star").unwrap(), Algorithm::Star);
    let e = Algorithm::parse("butterfly").unwrap_err().to_string();
    assert!(
        e.contains("unknown algorithm \"butterfly\"") && e.contains("ring"),
        "{e}"
    );
}
