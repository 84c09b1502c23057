//! Adjointness of every LINEAR collective C:  ⟨C x, y⟩ = ⟨x, C* y⟩, summed over the ranks.
//!
//! C x comes from the forward (checked against the independent oracle in `common`), C* y from the
//! backward pass seeded with y as the cotangent. x and y are random. On top of the scalar identity,
//! every rank's gradient is compared with the transpose of the ORACLE's Jacobian (built by running
//! the oracle on basis vectors), so a wrong gradient is pinned to a rank and an element.
//!
//! World sizes 1..=8, roots n-1 and n/2, direct and ring algorithms, and the subgroup case
//! (world 5, group [4, 1, 3]).
//!
//! Every test runs on each backend (`<test>::cpu`, and `<test>::gpu` when there is a GPU): inputs
//! and cotangents are GPU tensors on the GPU run. The tolerances below already allow for the GPU's
//! rounding (it sums in another order); the exact checks are of copies, which are bit-exact there.

mod common;

use common::*;
use distgrad::ReduceOp;

/// Check ⟨C x, y⟩ = ⟨x, C* y⟩ for one case, plus the per-rank oracle transpose.
fn adjoint(s: &Setup, coll: &Coll, shape: &[usize], seed: u64) {
    let mut rng = Rng::new(seed);
    let xs = random_inputs(&mut rng, coll, s.n(), shape, -1.0, 1.0);
    let want = oracle(coll, &xs);
    let ys = random_like(&mut rng, &want, -1.0, 1.0);
    let rs = run_case(s, coll, &xs, &ys);
    check_forward(s, coll, &xs, &rs);

    // ⟨C x, y⟩ and ⟨x, C* y⟩ over all ranks, with the sum of |terms| as the scale.
    let (mut lhs, mut rhs, mut scale) = (0.0f64, 0.0f64, 0.0f64);
    for (r, rr) in rs.iter().enumerate() {
        for (o, y) in rr.outs.iter().zip(&ys[r]) {
            lhs += dot(&o.data, &y.data);
            scale += o
                .data
                .iter()
                .zip(&y.data)
                .map(|(a, b)| (a * b).abs() as f64)
                .sum::<f64>();
        }
        for (x, g) in xs[r].iter().zip(&rr.grads) {
            rhs += dot(&x.data, &g.data);
            scale += x
                .data
                .iter()
                .zip(&g.data)
                .map(|(a, b)| (a * b).abs() as f64)
                .sum::<f64>();
        }
    }
    assert!(
        (lhs - rhs).abs() <= 1e-4 * scale + 1e-6,
        "{}: <Cx,y> = {lhs} but <x,C*y> = {rhs}",
        s.ctx_all(&format!("{coll:?}"))
    );

    // Per-rank, per-element: d/dx[r][k][e] of Σ⟨y, C x⟩ = ⟨y, C e_{r,k,e}⟩ with C = the oracle.
    let zero: Vec<Vec<Arr>> = xs
        .iter()
        .map(|l| l.iter().map(|x| Arr::zeros(&x.shape)).collect())
        .collect();
    for r in 0..s.n() {
        for k in 0..xs[r].len() {
            let want: Vec<f32> = (0..xs[r][k].numel())
                .map(|e| {
                    let mut basis = zero.clone();
                    basis[r][k].data[e] = 1.0;
                    let ce = oracle(coll, &basis);
                    ce.iter()
                        .zip(&ys)
                        .flat_map(|(c, y)| c.iter().zip(y))
                        .map(|(c, y)| dot(&c.data, &y.data))
                        .sum::<f64>() as f32
                })
                .collect();
            assert_close(
                &s.ctx(coll, r),
                &format!("gradient of input {k} vs oracle transpose"),
                &rs[r].grads[k].data,
                &want,
                1e-4,
                1e-5,
            );
        }
    }
}

fn sub(d: &Device) -> Setup {
    Setup::sub(d, SUB_WORLD, &SUB_GROUP)
}

const LINEAR_OPS: [ReduceOp; 2] = [ReduceOp::Sum, ReduceOp::Avg];

fn broadcast_is_adjoint_of_reduce_sum(d: &Device) {
    for n in 1..=8 {
        for root in roots(n) {
            adjoint(
                &Setup::world(d, n),
                &Coll::Broadcast { root },
                &[2, 3],
                100 + n as u64,
            );
        }
    }
    for root in [2, 1] {
        adjoint(&sub(d), &Coll::Broadcast { root }, &[3], 1);
    }
}

fn reduce_sum_avg(d: &Device) {
    for n in 1..=8 {
        for root in roots(n) {
            for op in LINEAR_OPS {
                adjoint(
                    &Setup::world(d, n),
                    &Coll::Reduce { root, op },
                    &[2, 3],
                    200 + n as u64,
                );
            }
        }
    }
    for root in [2, 1] {
        for op in LINEAR_OPS {
            adjoint(&sub(d), &Coll::Reduce { root, op }, &[3], 2);
        }
    }
}

fn all_reduce_sum_avg_direct(d: &Device) {
    // The exchange and the star through group rank 0.
    for star in [false, true] {
        let on = |s: Setup| if star { s.star() } else { s };
        for n in 1..=8 {
            for op in LINEAR_OPS {
                adjoint(
                    &on(Setup::world(d, n)),
                    &Coll::AllReduce { op },
                    &[2, 3],
                    300 + n as u64,
                );
            }
        }
        for op in LINEAR_OPS {
            adjoint(&on(sub(d)), &Coll::AllReduce { op }, &[3], 3);
        }
    }
}

fn all_reduce_sum_avg_ring(d: &Device) {
    // 11 elements: uneven chunks for every n in 2..=8 (the large-payload algorithms need
    // numel >= n), with each of them.
    for algo in LARGE_ALL_REDUCE {
        for n in 1..=8 {
            for op in LINEAR_OPS {
                adjoint(
                    &Setup::world(d, n).ring().algo(algo),
                    &Coll::AllReduce { op },
                    &[11],
                    350 + n as u64,
                );
            }
        }
        for op in LINEAR_OPS {
            adjoint(&sub(d).ring().algo(algo), &Coll::AllReduce { op }, &[11], 4);
        }
    }
}

fn gather_is_adjoint_of_scatter(d: &Device) {
    for n in 1..=8 {
        for root in roots(n) {
            adjoint(
                &Setup::world(d, n),
                &Coll::Gather { root },
                &[2, 2],
                400 + n as u64,
            );
        }
    }
    for root in [2, 1] {
        adjoint(&sub(d), &Coll::Gather { root }, &[3], 5);
    }
}

fn scatter_is_adjoint_of_gather(d: &Device) {
    for n in 1..=8 {
        for root in roots(n) {
            adjoint(
                &Setup::world(d, n),
                &Coll::Scatter { root },
                &[2, 2],
                500 + n as u64,
            );
        }
    }
    for root in [2, 1] {
        adjoint(&sub(d), &Coll::Scatter { root }, &[3], 6);
    }
}

fn all_gather_direct_and_ring(d: &Device) {
    for n in 1..=8 {
        adjoint(
            &Setup::world(d, n),
            &Coll::AllGather,
            &[2, 3],
            600 + n as u64,
        );
    }
    // n = 1 on the ring: see all_gather_ring_group_of_one_backward.
    for n in 2..=8 {
        adjoint(
            &Setup::world(d, n).ring(),
            &Coll::AllGather,
            &[5],
            650 + n as u64,
        );
    }
    adjoint(&sub(d), &Coll::AllGather, &[3], 7);
    adjoint(&sub(d).ring(), &Coll::AllGather, &[3], 8);
}

fn reduce_scatter_sum_avg_direct(d: &Device) {
    for n in 1..=8 {
        for op in LINEAR_OPS {
            adjoint(
                &Setup::world(d, n),
                &Coll::ReduceScatter { op },
                &[2, 3],
                700 + n as u64,
            );
        }
    }
    for op in LINEAR_OPS {
        adjoint(&sub(d), &Coll::ReduceScatter { op }, &[3], 9);
    }
}

fn reduce_scatter_sum_avg_ring(d: &Device) {
    for n in 2..=8 {
        for op in LINEAR_OPS {
            adjoint(
                &Setup::world(d, n).ring(),
                &Coll::ReduceScatter { op },
                &[5],
                750 + n as u64,
            );
        }
    }
    for op in LINEAR_OPS {
        adjoint(&sub(d).ring(), &Coll::ReduceScatter { op }, &[5], 10);
    }
}

/// Regression: a group of ONE rank with a payload at or above `ring_threshold` (default 64 KiB,
/// i.e. >= 16384 f32) used to take the ring reduce_scatter, whose step loop never runs for n = 1,
/// and failed with "Tensor::from_vec: shape [16384] needs 16384 elements, got 0" (fixed in
/// 6bc2c4b by routing n = 1 to the direct path).
fn reduce_scatter_ring_group_of_one(d: &Device) {
    // DEFAULT options: 16384 elements = 64 KiB = ring_threshold.
    let s = Setup::world(d, 1);
    let coll = Coll::ReduceScatter { op: ReduceOp::Sum };
    let mut rng = Rng::new(782);
    let xs = random_inputs(&mut rng, &coll, 1, &[16384], -1.0, 1.0);
    let ys = random_like(&mut rng, &oracle(&coll, &xs), -1.0, 1.0);
    let rs = run_case(&s, &coll, &xs, &ys);
    check_forward(&s, &coll, &xs, &rs);
    assert_close(
        &s.ctx(&coll, 0),
        "gradient (identity on one rank: a copy, exact on every backend)",
        &rs[0].grads[0].data,
        &ys[0][0].data,
        0.0,
        0.0,
    );
    // Forced ring on small payloads: the whole world, and a one-rank subgroup of a world of 3.
    for op in LINEAR_OPS {
        adjoint(
            &Setup::world(d, 1).ring(),
            &Coll::ReduceScatter { op },
            &[5],
            780,
        );
        adjoint(
            &Setup::sub(d, 3, &[1]).ring(),
            &Coll::ReduceScatter { op },
            &[5],
            781,
        );
    }
}

/// Regression: all_gather's dual is reduce_scatter(SUM); on a group of one rank with a ring-sized
/// payload its BACKWARD hit the same size-1 ring reduce_scatter bug. Default options, 16384
/// elements.
fn all_gather_ring_group_of_one_backward(d: &Device) {
    let s = Setup::world(d, 1);
    let coll = Coll::AllGather;
    let mut rng = Rng::new(791);
    let xs = random_inputs(&mut rng, &coll, 1, &[16384], -1.0, 1.0);
    let ys = random_like(&mut rng, &oracle(&coll, &xs), -1.0, 1.0);
    let rs = run_case(&s, &coll, &xs, &ys);
    check_forward(&s, &coll, &xs, &rs);
    assert_close(
        &s.ctx(&coll, 0),
        "gradient (identity on one rank: a copy, exact on every backend)",
        &rs[0].grads[0].data,
        &ys[0][0].data,
        0.0,
        0.0,
    );
    adjoint(&Setup::world(d, 1).ring(), &Coll::AllGather, &[5], 790);
}

fn all_to_all_list(d: &Device) {
    for n in 1..=8 {
        adjoint(
            &Setup::world(d, n),
            &Coll::AllToAll { ragged: false },
            &[2, 2],
            800 + n as u64,
        );
        adjoint(
            &Setup::world(d, n),
            &Coll::AllToAll { ragged: true },
            &[],
            850 + n as u64,
        );
    }
    adjoint(&sub(d), &Coll::AllToAll { ragged: false }, &[3], 11);
    adjoint(&sub(d), &Coll::AllToAll { ragged: true }, &[], 12);
}

fn all_to_all_single_uneven_splits(d: &Device) {
    for n in 1..=8 {
        for variant in 0..2 {
            let coll = Coll::AllToAllSingle {
                in_splits: a2a_splits(n, variant),
                cols: 2,
            };
            adjoint(
                &Setup::world(d, n),
                &coll,
                &[],
                900 + 10 * n as u64 + variant as u64,
            );
        }
    }
    for variant in 0..2 {
        let coll = Coll::AllToAllSingle {
            in_splits: a2a_splits(3, variant),
            cols: 3,
        };
        adjoint(&sub(d), &coll, &[], 13 + variant as u64);
    }
}

fn permute_full_and_partial(d: &Device) {
    for n in 1..=8 {
        for (i, pairs) in permute_cases(n).into_iter().enumerate() {
            adjoint(
                &Setup::world(d, n),
                &Coll::Permute { pairs },
                &[2, 3],
                1000 + 10 * n as u64 + i as u64,
            );
        }
    }
    for (i, pairs) in permute_cases(3).into_iter().enumerate() {
        adjoint(&sub(d), &Coll::Permute { pairs }, &[3], 15 + i as u64);
    }
}

fn send_recv_pairs_adjoint(d: &Device) {
    for n in 2..=8 {
        let coll = Coll::SendRecv {
            pairs: send_recv_pairs(n),
            shape: vec![2, 2],
        };
        adjoint(&Setup::world(d, n), &coll, &[], 1100 + n as u64);
    }
    let coll = Coll::SendRecv {
        pairs: send_recv_pairs(3),
        shape: vec![3],
    };
    adjoint(&sub(d), &coll, &[], 18);
}

fn zero_dimensional_tensors(d: &Device) {
    // Shape [] (one element, no dims) through every collective that takes a common shape.
    for s in [Setup::world(d, 3), sub(d)] {
        let n = s.n();
        let colls = [
            Coll::Broadcast { root: n - 1 },
            Coll::Reduce {
                root: 1,
                op: ReduceOp::Sum,
            },
            Coll::AllReduce { op: ReduceOp::Avg },
            Coll::Gather { root: 1 },
            Coll::Scatter { root: n - 1 },
            Coll::AllGather,
            Coll::ReduceScatter { op: ReduceOp::Sum },
            Coll::AllToAll { ragged: false },
            Coll::Permute {
                pairs: permute_cases(n)[2].clone(),
            },
            Coll::SendRecv {
                pairs: send_recv_pairs(n),
                shape: vec![],
            },
        ];
        for (i, coll) in colls.iter().enumerate() {
            adjoint(&s, coll, &[], 1200 + i as u64);
        }
    }
}

on_every_device!(
    broadcast_is_adjoint_of_reduce_sum,
    reduce_sum_avg,
    all_reduce_sum_avg_direct,
    all_reduce_sum_avg_ring,
    gather_is_adjoint_of_scatter,
    scatter_is_adjoint_of_gather,
    all_gather_direct_and_ring,
    reduce_scatter_sum_avg_direct,
    reduce_scatter_sum_avg_ring,
    reduce_scatter_ring_group_of_one,
    all_gather_ring_group_of_one_backward,
    all_to_all_list,
    all_to_all_single_uneven_splits,
    permute_full_and_partial,
    send_recv_pairs_adjoint,
    zero_dimensional_tensors,
);
