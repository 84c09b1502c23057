//! Property tests of the collective algorithms' forward results against a plain oracle, with the
//! ring forced on for tiny tensors (threshold 0, segments of a few elements) so uneven chunks,
//! empty chunks and multi-segment pipelines are all exercised. Inputs are small integers, so every
//! sum and product is exact in f32 and results compare bit for bit whatever the reduction order.

use std::time::Duration;

use distgrad::{
    AllReduceAlgo, CommOptions, Communicator, ReduceOp, SmallAllReduce, Tensor, run_local,
};
use proptest::prelude::*;

fn opts(segment_bytes: usize) -> CommOptions {
    CommOptions {
        timeout: Duration::from_secs(20),
        ring_threshold: 0,
        segment_bytes,
        ..CommOptions::default()
    }
}

fn algo_strategy() -> impl Strategy<Value = AllReduceAlgo> {
    prop::sample::select(vec![
        AllReduceAlgo::Auto,
        AllReduceAlgo::Ring,
        AllReduceAlgo::Pairwise,
        AllReduceAlgo::Shared,
    ])
}

/// Rank r's input: small integers from a seed.
fn input(seed: u64, rank: usize, n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| (((seed as usize).wrapping_mul(31) + rank * 7 + i * 3) % 5) as f32 - 2.0)
        .collect()
}

fn oracle_reduce(op: ReduceOp, xs: &[Vec<f32>]) -> Vec<f32> {
    let n = xs[0].len();
    (0..n)
        .map(|i| {
            let col = xs.iter().map(|x| x[i]);
            match op {
                ReduceOp::Sum => col.sum(),
                ReduceOp::Avg => col.sum::<f32>() * (1.0 / xs.len() as f32),
                ReduceOp::Prod => col.product(),
                ReduceOp::Min => col.fold(f32::INFINITY, f32::min),
                ReduceOp::Max => col.fold(f32::NEG_INFINITY, f32::max),
            }
        })
        .collect()
}

fn op_strategy() -> impl Strategy<Value = ReduceOp> {
    prop::sample::select(ReduceOp::ALL.to_vec())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn all_reduce_matches_oracle(world in 1usize..8, numel in 0usize..40, seg in 1usize..5, op in op_strategy(), algo in algo_strategy(), seed in 0u64..1000) {
        let o = CommOptions { all_reduce: algo, ..opts(seg * 4) };
        let res = run_local(world, o, |comm| async move {
            let x = Tensor::vector(&input(seed, comm.rank(), numel));
            Ok(comm.all_reduce(&x, op, &comm.world()).await?.to_vec())
        });
        let xs: Vec<Vec<f32>> = (0..world).map(|r| input(seed, r, numel)).collect();
        let want = oracle_reduce(op, &xs);
        for (r, got) in res.into_iter().enumerate() {
            prop_assert_eq!(got.unwrap(), want.clone(), "rank {} {:?}", r, algo);
        }
    }

    /// Small payloads (the default threshold) with either small algorithm, on the world or on a
    /// subgroup whose group rank 0 (the star's root) is not global rank 0.
    #[test]
    fn small_all_reduce_matches_oracle(world in 1usize..9, numel in 0usize..40, op in op_strategy(), star in any::<bool>(), sub in any::<bool>(), seed in 0u64..1000) {
        let o = CommOptions {
            timeout: Duration::from_secs(20),
            small_all_reduce: if star { SmallAllReduce::Star } else { SmallAllReduce::Exchange },
            ..CommOptions::default()
        };
        // The subgroup: the world's ranks in reverse order, without rank 0 where there are 3 or more.
        let members: Vec<usize> = (0..world).rev().filter(|&r| !(sub && world >= 3 && r == 0)).collect();
        let m = members.clone();
        let res = run_local(world, o, |comm| {
            let m = m.clone();
            async move {
                let g = if sub { comm.new_group(&m)? } else { comm.world() };
                let me = if sub { m.iter().position(|&r| r == comm.rank()) } else { Some(comm.rank()) };
                let Some(me) = me else { return Ok(None) };
                let x = Tensor::vector(&input(seed, me, numel));
                Ok(Some(comm.all_reduce(&x, op, &g).await?.to_vec()))
            }
        });
        let n = if sub { members.len() } else { world };
        let xs: Vec<Vec<f32>> = (0..n).map(|r| input(seed, r, numel)).collect();
        let want = oracle_reduce(op, &xs);
        for (r, got) in res.into_iter().enumerate() {
            let got = got.unwrap();
            if sub && !members.contains(&r) {
                prop_assert_eq!(got, None, "rank {} is not in the group", r);
            } else {
                prop_assert_eq!(got, Some(want.clone()), "rank {} star {} sub {}", r, star, sub);
            }
        }
    }

    #[test]
    fn reduce_scatter_and_all_gather_match_oracle(world in 1usize..7, numel in 0usize..9, op in op_strategy(), seed in 0u64..1000) {
        let res = run_local(world, opts(4), |comm| async move {
            let g = comm.world();
            let me = comm.rank();
            let list: Vec<Tensor> = (0..world).map(|j| Tensor::vector(&input(seed + j as u64, me, numel))).collect();
            let rs = comm.reduce_scatter(&list, op, &g).await?.to_vec();
            let ag = comm.all_gather(&Tensor::vector(&input(seed, me, numel)), &g).await?;
            Ok((rs, ag.iter().map(Tensor::to_vec).collect::<Vec<_>>()))
        });
        for (r, got) in res.into_iter().enumerate() {
            let (rs, ag) = got.unwrap();
            let col: Vec<Vec<f32>> = (0..world).map(|k| input(seed + r as u64, k, numel)).collect();
            prop_assert_eq!(rs, oracle_reduce(op, &col), "reduce_scatter rank {}", r);
            let all: Vec<Vec<f32>> = (0..world).map(|k| input(seed, k, numel)).collect();
            prop_assert_eq!(ag, all, "all_gather rank {}", r);
        }
    }

    #[test]
    fn broadcast_and_reduce_trees_match_oracle(world in 1usize..9, root_pick in 0usize..8, numel in 0usize..6, op in op_strategy(), seed in 0u64..1000) {
        let root = root_pick % world;
        let res = run_local(world, opts(4), |comm| async move {
            let g = comm.world();
            let x = Tensor::vector(&input(seed, comm.rank(), numel));
            let b = comm.broadcast(&x, root, &g).await?.to_vec();
            let red = comm.reduce(&x, root, op, &g).await?.map(|t| t.to_vec());
            Ok((b, red))
        });
        let xs: Vec<Vec<f32>> = (0..world).map(|r| input(seed, r, numel)).collect();
        for (r, got) in res.into_iter().enumerate() {
            let (b, red) = got.unwrap();
            prop_assert_eq!(&b, &xs[root], "broadcast rank {}", r);
            if r == root {
                prop_assert_eq!(red, Some(oracle_reduce(op, &xs)), "reduce root {}", r);
            } else {
                prop_assert_eq!(red, None);
            }
        }
    }

    #[test]
    fn all_to_all_single_matches_oracle(world in 1usize..6, seed in 0u64..1000) {
        // splits[i][j] = rows rank i sends to rank j (0..3, zeros included); rows are [value, -value].
        let splits: Vec<Vec<usize>> = (0..world).map(|i| (0..world).map(|j| ((seed as usize) + i * 5 + j * 3) % 3).collect()).collect();
        let row_val = |i: usize, j: usize, k: usize| (100 * i + 10 * j + k) as f32;
        let res = run_local(world, opts(4), |comm| {
            let splits = splits.clone();
            async move {
                let me = comm.rank();
                let mut data = Vec::new();
                for (j, &count) in splits[me].iter().enumerate() {
                    for k in 0..count {
                        data.extend([row_val(me, j, k), -row_val(me, j, k)]);
                    }
                }
                let rows = data.len() / 2;
                let x = Tensor::from_vec(data, &[rows, 2])?;
                let outs: Vec<usize> = (0..world).map(|i| splits[i][me]).collect();
                Ok(comm.all_to_all_single(&x, &splits[me], &outs, &comm.world()).await?.to_vec())
            }
        });
        for (me, got) in res.into_iter().enumerate() {
            let mut want = Vec::new();
            for (i, row) in splits.iter().enumerate() {
                for k in 0..row[me] {
                    want.extend([row_val(i, me, k), -row_val(i, me, k)]);
                }
            }
            prop_assert_eq!(got.unwrap(), want, "rank {}", me);
        }
    }
}

/// Payloads large enough that messages to non-neighbours travel split (signature message, then the
/// payload untouched: `distgrad::collective::call::SPLIT_BYTES`): every all_reduce algorithm, every
/// op, odd worlds, against the oracle; and all_to_all / gather, whose messages go to every rank.
#[test]
fn large_payloads_every_algorithm_match_oracle() {
    let numel = 30_011; // 117 KiB per rank: chunks >= 16 KiB up to 7 ranks, uneven
    for world in [2, 3, 5, 7] {
        for algo in [
            AllReduceAlgo::Ring,
            AllReduceAlgo::Pairwise,
            AllReduceAlgo::Shared,
        ] {
            for op in ReduceOp::ALL {
                let o = CommOptions {
                    all_reduce: algo,
                    ..CommOptions::default()
                };
                let res = run_local(world, o, |comm| async move {
                    let x = Tensor::vector(&input(9, comm.rank(), numel));
                    Ok(comm.all_reduce(&x, op, &comm.world()).await?.to_vec())
                });
                let xs: Vec<Vec<f32>> = (0..world).map(|r| input(9, r, numel)).collect();
                let want = oracle_reduce(op, &xs);
                for (r, got) in res.into_iter().enumerate() {
                    assert!(
                        got.unwrap() == want,
                        "world {world} {algo:?} {op:?} rank {r}"
                    );
                }
            }
        }
        let res = run_local(world, CommOptions::default(), |comm| async move {
            let me = comm.rank();
            let list: Vec<Tensor> = (0..world)
                .map(|j| Tensor::vector(&input(100 * me as u64 + j as u64, 0, 5000)))
                .collect();
            let a2a = comm.all_to_all(&list, &comm.world()).await?;
            let g = comm.gather(&list[0], world - 1, &comm.world()).await?;
            Ok((
                a2a.iter().map(Tensor::to_vec).collect::<Vec<_>>(),
                g.map(|l| l.iter().map(Tensor::to_vec).collect::<Vec<_>>()),
            ))
        });
        for (r, got) in res.into_iter().enumerate() {
            let (a2a, g) = got.unwrap();
            for (j, part) in a2a.iter().enumerate() {
                assert!(
                    *part == input(100 * j as u64 + r as u64, 0, 5000),
                    "all_to_all world {world} rank {r} part {j}"
                );
            }
            if r == world - 1 {
                let g = g.expect("the root gets the list");
                for (j, part) in g.iter().enumerate() {
                    assert!(*part == input(100 * j as u64, 0, 5000), "gather part {j}");
                }
            } else {
                assert!(g.is_none());
            }
        }
    }
}
