//! Hand-derived gradients: every expected number below is worked out in the comment above it, never
//! computed by the code under test. Cotangents are chosen so that plausible mistakes (wrong rank,
//! transposed list, missing 1/N, ties not split) give different numbers.
//!
//! Every test runs on each backend (`<test>::cpu`, and `<test>::gpu` when there is a GPU), with the
//! inputs, parameters and cotangents as tensors on that device. Tolerances that already allow for
//! rounding are the same on both. Where the CPU is compared EXACTLY, the GPU is compared exactly
//! too when every op involved is bit-exact there (add/sub/mul/max/min/eq, reductions, copies), and
//! otherwise (a division, a sum of several terms) with [`GPU_RTOL`] against the CPU result of the
//! same case, which is itself checked exactly against the hand values.

mod common;

use common::*;
use distgrad::{
    CommOptions, Communicator, Objective, ReduceOp, Tape, Tensor, Var, dist, run_local,
};

fn v(x: &[f32]) -> Arr {
    Arr::vector(x)
}

/// Relative tolerance of a GPU result against the CPU's where the GPU may round differently.
const GPU_RTOL: f64 = 1e-5;

/// A 1-D tensor on `d`.
fn vec_on(d: &Device, x: &[f32]) -> distgrad::Result<Tensor> {
    Tensor::vector(x).to_device(d)
}

/// A tensor's values read back to the host, and the name of the device it lived on.
fn read(t: &Tensor) -> distgrad::Result<(Vec<f32>, &'static str)> {
    Ok((t.try_to_vec()?, t.device().name()))
}

/// Every rank's value, or a panic that lists each failed rank's error (the rank that failed first
/// is the cause; its peers then report it gone).
fn ranks_ok<T>(ctx: &str, res: Vec<distgrad::Result<T>>) -> Vec<T> {
    let errs: Vec<String> = res
        .iter()
        .enumerate()
        .filter_map(|(r, x)| x.as_ref().err().map(|e| format!("rank {r}: {e}")))
        .collect();
    assert!(errs.is_empty(), "{ctx}: {}", errs.join("; "));
    res.into_iter().flatten().collect()
}

/// `got` = (values, device name) is on `d` and within `rtol` (relative) of `want`.
fn check_on(d: &Device, ctx: &str, what: &str, got: &(Vec<f32>, &str), want: &[f32], rtol: f64) {
    assert_eq!(got.1, d.name(), "{ctx}: {what} must be on the var's device");
    assert_close(ctx, what, &got.0, want, rtol, 0.0);
}

/// Run `coll` with the given inputs and cotangents (index = group rank) and compare outputs and
/// gradients with hand-computed values (tolerance 1e-5 relative, 1e-6 absolute).
fn hand(
    s: &Setup,
    coll: &Coll,
    xs: Vec<Vec<Arr>>,
    cots: Vec<Vec<Arr>>,
    want_outs: Vec<Vec<Arr>>,
    want_grads: Vec<Vec<Arr>>,
) {
    let rs = run_case(s, coll, &xs, &cots);
    for (r, rr) in rs.iter().enumerate() {
        let ctx = s.ctx(coll, r);
        assert_eq!(
            rr.outs.len(),
            want_outs[r].len(),
            "{ctx}: number of outputs"
        );
        for (k, (o, w)) in rr.outs.iter().zip(&want_outs[r]).enumerate() {
            assert_eq!(o.shape, w.shape, "{ctx}: shape of output {k}");
            assert_close(&ctx, &format!("output {k}"), &o.data, &w.data, 1e-5, 1e-6);
        }
        assert_eq!(
            rr.grads.len(),
            want_grads[r].len(),
            "{ctx}: number of gradients"
        );
        for (k, (g, w)) in rr.grads.iter().zip(&want_grads[r]).enumerate() {
            assert_close(
                &ctx,
                &format!("gradient of input {k}"),
                &g.data,
                &w.data,
                1e-5,
                1e-6,
            );
        }
    }
}

// ------------------------------------------------------------------------------------------------
// all_reduce MAX / MIN / PROD
// ------------------------------------------------------------------------------------------------

fn all_reduce_max_ties_split_equally(d: &Device) {
    // y = max over 3 ranks, elementwise.  x0 = [3, 5, 1], x1 = [7, 1, 1], x2 = [7, 2, 1]
    //  →  y = [7, 5, 1].
    // Cotangents g0 = [1, 10, 100], g1 = [2, 20, 200], g2 = [4, 40, 400]; objective
    // Σ_r ⟨g_r, y⟩, so dJ/dy = g_sum = [7, 70, 700].
    // Element 0: ranks 1 and 2 tie at 7 → each gets 7 / 2 = 3.5, rank 0 gets 0.
    // Element 1: rank 0 alone holds 5 → it gets 70, the others 0.
    // Element 2: all three tie at 1 → each gets 700 / 3.
    // Run on the direct path (exchange and star) and on the ring (3 elements ≥ 3 ranks).
    let y = v(&[7.0, 5.0, 1.0]);
    let t = 700.0 / 3.0;
    for s in [
        Setup::world(d, 3),
        Setup::world(d, 3).star(),
        Setup::world(d, 3).ring(),
    ] {
        hand(
            &s,
            &Coll::AllReduce { op: ReduceOp::Max },
            vec![
                vec![v(&[3.0, 5.0, 1.0])],
                vec![v(&[7.0, 1.0, 1.0])],
                vec![v(&[7.0, 2.0, 1.0])],
            ],
            vec![
                vec![v(&[1.0, 10.0, 100.0])],
                vec![v(&[2.0, 20.0, 200.0])],
                vec![v(&[4.0, 40.0, 400.0])],
            ],
            vec![vec![y.clone()]; 3],
            vec![
                vec![v(&[0.0, 70.0, t])],
                vec![v(&[3.5, 0.0, t])],
                vec![v(&[3.5, 0.0, t])],
            ],
        );
    }
}

fn all_reduce_min_ties_split_equally(d: &Device) {
    // y = min over 4 ranks.  x0 = [2, -1], x1 = [2, 0], x2 = [5, -1], x3 = [2, 3]  →  y = [2, -1].
    // Cotangents g_r = [r + 1, 1]  →  g_sum = [1 + 2 + 3 + 4, 4] = [10, 4].
    // Element 0: ranks 0, 1, 3 tie at 2 → each gets 10 / 3; rank 2 gets 0.
    // Element 1: ranks 0 and 2 tie at -1 → each gets 4 / 2 = 2; ranks 1, 3 get 0.
    // The exchange and the star (rank 0 folds, the others get its result).
    let y = v(&[2.0, -1.0]);
    let t = 10.0 / 3.0;
    for s in [Setup::world(d, 4), Setup::world(d, 4).star()] {
        hand(
            &s,
            &Coll::AllReduce { op: ReduceOp::Min },
            vec![
                vec![v(&[2.0, -1.0])],
                vec![v(&[2.0, 0.0])],
                vec![v(&[5.0, -1.0])],
                vec![v(&[2.0, 3.0])],
            ],
            (0..4).map(|r| vec![v(&[r as f32 + 1.0, 1.0])]).collect(),
            vec![vec![y.clone()]; 4],
            vec![
                vec![v(&[t, 2.0])],
                vec![v(&[t, 0.0])],
                vec![v(&[0.0, 2.0])],
                vec![v(&[t, 0.0])],
            ],
        );
    }
}

fn all_reduce_max_all_ranks_tie_on_a_subgroup(d: &Device) {
    // World 5, group [4, 1, 3]: every member holds x = [1.5]  →  y = [1.5], all 3 tie.
    // Cotangents (by group rank) 3, 6, 9  →  g_sum = 18, each member gets 18 / 3 = 6.
    // Also with the star, whose root is group rank 0 (global rank 4).
    for s in [
        Setup::sub(d, SUB_WORLD, &SUB_GROUP),
        Setup::sub(d, SUB_WORLD, &SUB_GROUP).star(),
    ] {
        hand(
            &s,
            &Coll::AllReduce { op: ReduceOp::Max },
            vec![vec![v(&[1.5])]; 3],
            vec![vec![v(&[3.0])], vec![v(&[6.0])], vec![v(&[9.0])]],
            vec![vec![v(&[1.5])]; 3],
            vec![vec![v(&[6.0])]; 3],
        );
    }
}

fn all_reduce_prod_with_zeros(d: &Device) {
    // y = product over 3 ranks, elementwise; cotangent 1 on every rank → g_sum = 3.
    // dJ/dx_j = g_sum · Π_{k≠j} x_k  (exact with zeros: no division by x_j).
    // Element 0: x = [2, 0, 5] (one zero): y = 0; rank 1 gets 3·(2·5) = 30, ranks 0, 2 get
    //            3·(0·5) = 0 and 3·(2·0) = 0.
    // Element 1: x = [0, 0, 5] (two zeros): y = 0 and every product of others has a zero → all 0.
    // Element 2: x = [2, 3, 4] (no zero): y = 24; grads 3·12 = 36, 3·8 = 24, 3·6 = 18.
    // Run on the direct path (exchange and star) and on the ring (3 elements ≥ 3 ranks).
    let y = v(&[0.0, 0.0, 24.0]);
    for s in [
        Setup::world(d, 3),
        Setup::world(d, 3).star(),
        Setup::world(d, 3).ring(),
    ] {
        hand(
            &s,
            &Coll::AllReduce { op: ReduceOp::Prod },
            vec![
                vec![v(&[2.0, 0.0, 2.0])],
                vec![v(&[0.0, 0.0, 3.0])],
                vec![v(&[5.0, 5.0, 4.0])],
            ],
            vec![vec![v(&[1.0, 1.0, 1.0])]; 3],
            vec![vec![y.clone()]; 3],
            vec![
                vec![v(&[0.0, 0.0, 36.0])],
                vec![v(&[30.0, 0.0, 24.0])],
                vec![v(&[0.0, 0.0, 18.0])],
            ],
        );
    }
}

fn all_reduce_max_with_nan_gives_zero_grad_there(d: &Device) {
    // Documented in autograd::dual: MAX/MIN propagate NaN and no rank "holds" a NaN extreme
    // (NaN != NaN), so that element's gradient is 0 on every rank; other elements are unaffected.
    // x0 = [NaN, 1], x1 = [1, 4], x2 = [2, 3] → y = [NaN, 4]; cotangents 1 → g_sum = [3, 3];
    // element 1: rank 1 alone holds 4 → 3.
    // The split among ties divides (3 / 1): exact on the CPU, within GPU_RTOL on a GPU.
    let s = Setup::world(d, 3);
    let coll = Coll::AllReduce { op: ReduceOp::Max };
    let xs = [
        vec![v(&[f32::NAN, 1.0])],
        vec![v(&[1.0, 4.0])],
        vec![v(&[2.0, 3.0])],
    ];
    let cots = [
        vec![v(&[1.0, 1.0])],
        vec![v(&[1.0, 1.0])],
        vec![v(&[1.0, 1.0])],
    ];
    let rs = run_case(&s, &coll, &xs, &cots);
    let want = [[0.0, 0.0], [0.0, 3.0], [0.0, 0.0]];
    for (r, rr) in rs.iter().enumerate() {
        let ctx = s.ctx(&coll, r);
        assert!(
            rr.outs[0].data[0].is_nan(),
            "{ctx}: y[0] should be NaN, got {:?}",
            rr.outs[0].data
        );
        assert_eq!(rr.outs[0].data[1], 4.0, "{ctx}: y[1]");
        if is_cpu(d) {
            assert_close(&ctx, "gradient", &rr.grads[0].data, &want[r], 0.0, 0.0);
        } else {
            // Zeros stay exact (no relative slack around 0).
            assert_close(
                &ctx,
                "gradient vs hand values",
                &rr.grads[0].data,
                &want[r],
                GPU_RTOL,
                0.0,
            );
        }
    }
    if !is_cpu(d) {
        let cpu = run_case(&s.on_cpu(), &coll, &xs, &cots);
        for (r, (rr, rc)) in rs.iter().zip(&cpu).enumerate() {
            assert_close(
                &s.ctx(&coll, r),
                "gradient vs the CPU's",
                &rr.grads[0].data,
                &rc.grads[0].data,
                GPU_RTOL,
                0.0,
            );
        }
    }
}

fn same_var_in_every_slot_accumulates(d: &Device) {
    // reduce_scatter(SUM, [a, a, a]) on 3 ranks with a_r = [r + 1]: every rank gets 1 + 2 + 3 = 6.
    // Cotangent on rank j: g_j = [j + 1]; each slot of rank r's list receives g_j, and the three
    // slots are the same var, so dJ/da_r = g_0 + g_1 + g_2 = 6 on every rank.
    // Host reduction and additions of small integers: exact on every backend.
    let res = run_local(3, test_opts(), |comm| async move {
        let tape = Tape::new();
        let g = comm.world();
        let r = comm.rank();
        let a = tape.var(vec_on(d, &[r as f32 + 1.0])?);
        let y = dist::reduce_scatter(&comm, &[a.clone(), a.clone(), a.clone()], ReduceOp::Sum, &g)
            .await?;
        let grads = tape
            .backward_from(&[(y.clone(), vec_on(d, &[r as f32 + 1.0])?)], &comm)
            .await?;
        let ga = grads.wrt(&a)?;
        Ok((y.value().try_to_vec()?, ga.try_to_vec()?, ga.device() == *d))
    });
    for (r, got) in res.into_iter().enumerate() {
        let ctx = format!(
            "[device={} world=3 op=reduce_scatter(Sum) root=- rank={r}]",
            d.name()
        );
        let (y, g, on_d) = got.unwrap_or_else(|e| panic!("{ctx}: {e}"));
        assert_close(&ctx, "y", &y, &[6.0], 0.0, 0.0);
        assert_close(&ctx, "grad a", &g, &[6.0], 0.0, 0.0);
        assert!(on_d, "{ctx}: grad a must be on the var's device");
    }
}

// ------------------------------------------------------------------------------------------------
// reduce / broadcast with roots ≠ 0
// ------------------------------------------------------------------------------------------------

fn reduce_avg_root_2_on_4_ranks(d: &Device) {
    // y = (x0 + x1 + x2 + x3) / 4 on root 2 only; x_r = [r + 1, 10(r + 1)] → y = [2.5, 25].
    // Only the root has an output; its cotangent is g = [4, -8].
    // dJ/dx_r = g / 4 = [1, -2] on EVERY rank (non-roots included).
    hand(
        &Setup::world(d, 4),
        &Coll::Reduce {
            root: 2,
            op: ReduceOp::Avg,
        },
        (0..4)
            .map(|r| vec![v(&[r as f32 + 1.0, 10.0 * (r as f32 + 1.0)])])
            .collect(),
        vec![vec![], vec![], vec![v(&[4.0, -8.0])], vec![]],
        vec![vec![], vec![], vec![v(&[2.5, 25.0])], vec![]],
        vec![vec![v(&[1.0, -2.0])]; 4],
    );
}

fn reduce_max_tie_and_prod_zero_root_not_zero(d: &Device) {
    // reduce(root = 1, MAX) on 3 ranks: x = [3, 7, 7] → y = 7 at root 1; cotangent 6 there.
    // Ranks 1 and 2 tie → each gets 6 / 2 = 3; rank 0 gets 0.
    hand(
        &Setup::world(d, 3),
        &Coll::Reduce {
            root: 1,
            op: ReduceOp::Max,
        },
        vec![vec![v(&[3.0])], vec![v(&[7.0])], vec![v(&[7.0])]],
        vec![vec![], vec![v(&[6.0])], vec![]],
        vec![vec![], vec![v(&[7.0])], vec![]],
        vec![vec![v(&[0.0])], vec![v(&[3.0])], vec![v(&[3.0])]],
    );
    // reduce(root = 3, PROD) on 4 ranks: x = [2, 0, 3, 5] → y = 0 at root 3; cotangent 2 there.
    // dJ/dx_j = 2 · Π_{k≠j} x_k: rank 1 (the zero) gets 2·(2·3·5) = 60, the others 0.
    hand(
        &Setup::world(d, 4),
        &Coll::Reduce {
            root: 3,
            op: ReduceOp::Prod,
        },
        vec![
            vec![v(&[2.0])],
            vec![v(&[0.0])],
            vec![v(&[3.0])],
            vec![v(&[5.0])],
        ],
        vec![vec![], vec![], vec![], vec![v(&[2.0])]],
        vec![vec![], vec![], vec![], vec![v(&[0.0])]],
        vec![
            vec![v(&[0.0])],
            vec![v(&[60.0])],
            vec![v(&[0.0])],
            vec![v(&[0.0])],
        ],
    );
}

fn broadcast_root_1_grads_go_to_root_only(d: &Device) {
    // Every rank gets root 1's x1 = [11, 12]; cotangents g_r = [r + 1, -(r + 1)] for r = 0..3,
    // Σ_r g_r = [10, -10]. Root 1's gradient is that sum; non-roots' inputs are unused → 0.
    let y = v(&[11.0, 12.0]);
    hand(
        &Setup::world(d, 4),
        &Coll::Broadcast { root: 1 },
        (0..4)
            .map(|r| vec![v(&[10.0 * r as f32 + 1.0, 10.0 * r as f32 + 2.0])])
            .collect(),
        (0..4)
            .map(|r| vec![v(&[r as f32 + 1.0, -(r as f32 + 1.0)])])
            .collect(),
        vec![vec![y.clone()]; 4],
        vec![
            vec![v(&[0.0, 0.0])],
            vec![v(&[10.0, -10.0])],
            vec![v(&[0.0, 0.0])],
            vec![v(&[0.0, 0.0])],
        ],
    );
}

// ------------------------------------------------------------------------------------------------
// gather / scatter on a subgroup (PyTorch #130515 zeroes these gradients)
// ------------------------------------------------------------------------------------------------

fn gather_on_subgroup_every_root(d: &Device) {
    // World 5, group [4, 1, 3] (group rank j ↔ global 4, 1, 3); global ranks 0 and 2 idle.
    // Group rank j holds x_j = [j + 1, 10(j + 1)]. The root gets [x_0, x_1, x_2]; its cotangent
    // list is c_j = [100 + j, 200 + j]; the gradient of x_j is c_j, on group rank j.
    // Roots 0 (global 4), 1 (global 1 = group rank 1), 2 (global 3, ≠ its group rank).
    for root in 0..3 {
        let xs: Vec<Vec<Arr>> = (0..3)
            .map(|j| vec![v(&[j as f32 + 1.0, 10.0 * (j as f32 + 1.0)])])
            .collect();
        let list: Vec<Arr> = (0..3)
            .map(|j| v(&[100.0 + j as f32, 200.0 + j as f32]))
            .collect();
        let cots = (0..3)
            .map(|r| if r == root { list.clone() } else { vec![] })
            .collect();
        let outs = (0..3)
            .map(|r| {
                if r == root {
                    xs.iter().map(|x| x[0].clone()).collect()
                } else {
                    vec![]
                }
            })
            .collect();
        let grads = (0..3).map(|j| vec![list[j].clone()]).collect();
        hand(
            &Setup::sub(d, SUB_WORLD, &SUB_GROUP),
            &Coll::Gather { root },
            xs,
            cots,
            outs,
            grads,
        );
    }
}

fn scatter_on_subgroup_every_root(d: &Device) {
    // World 5, group [4, 1, 3]. The root holds s_j = [j + 1, -(j + 1)] for j = 0..3; group rank j
    // gets s_j. Cotangent on group rank j: c_j = [10 + j, 20 + j]. The root's gradient for s_j is
    // c_j; other ranks have no inputs.
    for root in 0..3 {
        let list: Vec<Arr> = (0..3)
            .map(|j| v(&[j as f32 + 1.0, -(j as f32 + 1.0)]))
            .collect();
        let cots: Vec<Vec<Arr>> = (0..3)
            .map(|j| vec![v(&[10.0 + j as f32, 20.0 + j as f32])])
            .collect();
        let xs = (0..3)
            .map(|r| if r == root { list.clone() } else { vec![] })
            .collect();
        let outs = (0..3).map(|j| vec![list[j].clone()]).collect();
        let grads = (0..3)
            .map(|r| {
                if r == root {
                    cots.iter().map(|c| c[0].clone()).collect()
                } else {
                    vec![]
                }
            })
            .collect();
        hand(
            &Setup::sub(d, SUB_WORLD, &SUB_GROUP),
            &Coll::Scatter { root },
            xs,
            cots,
            outs,
            grads,
        );
    }
}

fn gather_input_also_used_locally(d: &Device) {
    // 3 ranks, root 2, x_r = [r + 1, -(r + 1)]; z = gather(x) on the root.
    // loss_r = 2·Σ x_r, plus on the root Σ_j (j + 1)·Σ z_j.
    // x_r reaches J twice (fan-out): 2 per element locally and (r + 1) per element through the
    // root's loss, so dJ/dx_r = r + 3 per element: [3, 3], [4, 4], [5, 5]. Products by 1, scales
    // and additions of small integers: exact on every backend.
    // On a GPU the non-root ranks add the gather's dual (scatter from the root, which has no input
    // on those ranks) to the local GPU term: both must live on x's device.
    const ROOT: usize = 2;
    let res = run_local(3, test_opts(), |comm| async move {
        let tape = Tape::new();
        let g = comm.world();
        let r = comm.rank() as f32;
        let x = tape.var(vec_on(d, &[r + 1.0, -(r + 1.0)])?);
        let mut loss = x.sum()?.scale(2.0)?;
        if let Some(z) = dist::gather(&comm, &x, ROOT, &g).await? {
            for (j, zj) in z.iter().enumerate() {
                loss = loss.add(&zj.sum()?.scale(j as f32 + 1.0)?)?;
            }
        }
        let grads = tape.backward(&loss, &comm).await?;
        read(&grads.wrt(&x)?)
    });
    let ctx = format!(
        "[device={} world=3 op=gather root={ROOT} + local use]",
        d.name()
    );
    for (r, got) in ranks_ok(&ctx, res).into_iter().enumerate() {
        let ctx = format!("{ctx} rank={r}");
        let want = r as f32 + 3.0;
        check_on(d, &ctx, "grad x", &got, &[want, want], 0.0);
    }
}

fn scattered_value_used_with_a_local_var(d: &Device) {
    // 2 ranks, root 0 scatters [a_0, a_1] = [[1, 2], [3, 4]]; rank r gets y_r = a_r and has its own
    // var w_r = [r + 1, 10]; loss_r = Σ y_r ⊙ w_r, so J = Σ_r ⟨a_r, w_r⟩:
    //   dJ/da_0 = w_0 = [1, 10], dJ/da_1 = w_1 = [2, 10] (on the root); dJ/dw_r = a_r.
    // Products by small integers and a sum's backward: exact on every backend.
    // On a GPU, rank 1 passes no input to scatter, yet its output must combine with its GPU var:
    // `CommOptions::device` says where such received tensors go.
    let opts = CommOptions {
        device: d.clone(),
        ..test_opts()
    };
    let res = run_local(2, opts, |comm| async move {
        let tape = Tape::new();
        let g = comm.world();
        let r = comm.rank();
        let a = [vec_on(d, &[1.0, 2.0])?, vec_on(d, &[3.0, 4.0])?].map(|t| tape.var(t));
        let list = (r == 0).then_some(&a[..]);
        let y = dist::scatter(&comm, &tape, list, 0, &g).await?;
        let w = tape.var(vec_on(d, &[r as f32 + 1.0, 10.0])?);
        let loss = y.mul(&w)?.sum()?;
        let grads = tape.backward(&loss, &comm).await?;
        let ga = if r == 0 {
            a.iter()
                .map(|v| read(&grads.wrt(v)?))
                .collect::<distgrad::Result<Vec<_>>>()?
        } else {
            vec![]
        };
        Ok((ga, read(&grads.wrt(&w)?)?))
    });
    let a = [[1.0, 2.0], [3.0, 4.0]];
    let ctx = format!(
        "[device={} world=2 op=scatter root=0 + local var]",
        d.name()
    );
    for (r, (ga, gw)) in ranks_ok(&ctx, res).into_iter().enumerate() {
        let ctx = format!("{ctx} rank={r}");
        check_on(d, &ctx, "grad w", &gw, &a[r], 0.0);
        if r == 0 {
            check_on(d, &ctx, "grad a_0", &ga[0], &[1.0, 10.0], 0.0);
            check_on(d, &ctx, "grad a_1", &ga[1], &[2.0, 10.0], 0.0);
        }
    }
}

fn received_value_used_with_a_local_var(d: &Device) {
    // 2 ranks: rank 0 sends b = [5, 6]; rank 1 receives y = b and has a var w = [2, 10];
    // loss_1 = Σ y ⊙ w (rank 0's loss is 0·Σ b, so it has one too), J = ⟨b, w⟩:
    //   dJ/db = w = [2, 10] (on rank 0), dJ/dw = b = [5, 6] (on rank 1). Exact on every backend.
    // On a GPU, recv has no input to take a device from (it lands on the CPU by default), yet its
    // output must combine with w: `Var::to_device` moves it, and moves its gradient back.
    let res = run_local(2, test_opts(), |comm| async move {
        let tape = Tape::new();
        let g = comm.world();
        let (gv, loss) = if comm.rank() == 0 {
            let b = tape.var(vec_on(d, &[5.0, 6.0])?);
            dist::send(&comm, &b, 1, &g).await?;
            (b.clone(), b.sum()?.scale(0.0)?)
        } else {
            let y = dist::recv(&comm, &tape, &[2], 0, &g).await?.to_device(d)?;
            let w = tape.var(vec_on(d, &[2.0, 10.0])?);
            (w.clone(), y.mul(&w)?.sum()?)
        };
        let grads = tape.backward(&loss, &comm).await?;
        read(&grads.wrt(&gv)?)
    });
    let want = [[2.0, 10.0], [5.0, 6.0]];
    let ctx = format!(
        "[device={} world=2 op=send/recv 0 -> 1 + local var]",
        d.name()
    );
    for (r, got) in ranks_ok(&ctx, res).into_iter().enumerate() {
        let ctx = format!("{ctx} rank={r}");
        let what = if r == 0 { "grad b" } else { "grad w" };
        check_on(d, &ctx, what, &got, &want[r], 0.0);
    }
}

// ------------------------------------------------------------------------------------------------
// all_gather ↔ reduce_scatter
// ------------------------------------------------------------------------------------------------

fn all_gather_grad_is_reduce_scatter_of_cotangents(d: &Device) {
    // 3 ranks, x_r = [r + 1]; every rank gets [[1], [2], [3]].
    // Rank r's cotangent for output j: c_r[j] = 10 r + j.
    // dJ/dx_j = Σ_r c_r[j] = 10·(0 + 1 + 2) + 3j = 30 + 3j → [30], [33], [36].
    // (The transposed mistake Σ_j c_r[j] would give 30r + 3 → 3, 33, 63.)
    let outs: Vec<Arr> = (0..3).map(|j| v(&[j as f32 + 1.0])).collect();
    hand(
        &Setup::world(d, 3),
        &Coll::AllGather,
        (0..3).map(|r| vec![v(&[r as f32 + 1.0])]).collect(),
        (0..3)
            .map(|r| (0..3).map(|j| v(&[10.0 * r as f32 + j as f32])).collect())
            .collect(),
        vec![outs; 3],
        vec![vec![v(&[30.0])], vec![v(&[33.0])], vec![v(&[36.0])]],
    );
}

fn reduce_scatter_grad_is_all_gather_of_cotangents(d: &Device) {
    // 3 ranks; rank r passes x_r[j] = [10 r + j] for j = 0..3. Rank j gets Σ_r x_r[j] = 30 + 3j.
    // Cotangent on rank j: g_j = [j + 1]. dJ/dx_r[j] = g_j = j + 1 on every rank r.
    // AVG: output (30 + 3j) / 3 = 10 + j, gradient g_j / 3.
    let xs: Vec<Vec<Arr>> = (0..3)
        .map(|r| (0..3).map(|j| v(&[10.0 * r as f32 + j as f32])).collect())
        .collect();
    let cots: Vec<Vec<Arr>> = (0..3).map(|j| vec![v(&[j as f32 + 1.0])]).collect();
    hand(
        &Setup::world(d, 3),
        &Coll::ReduceScatter { op: ReduceOp::Sum },
        xs.clone(),
        cots.clone(),
        (0..3).map(|j| vec![v(&[30.0 + 3.0 * j as f32])]).collect(),
        vec![vec![v(&[1.0]), v(&[2.0]), v(&[3.0])]; 3],
    );
    hand(
        &Setup::world(d, 3),
        &Coll::ReduceScatter { op: ReduceOp::Avg },
        xs,
        cots,
        (0..3).map(|j| vec![v(&[10.0 + j as f32])]).collect(),
        vec![vec![v(&[1.0 / 3.0]), v(&[2.0 / 3.0]), v(&[1.0])]; 3],
    );
}

fn reduce_scatter_max_tie_on_subgroup(d: &Device) {
    // World 5, group [4, 1, 3]. Block j is reduced onto group rank j with MAX.
    // Block 0: values by rank [4, 4, 1] → y0 = 4 (ranks 0 and 1 tie);
    // block 1: [0, 2, 2] → y1 = 2 (ranks 1 and 2 tie); block 2: [9, 3, 3] → y2 = 9 (rank 0 only).
    // Cotangents on the receiving ranks: g0 = 8, g1 = 6, g2 = 5.
    // Gradients (rank r, block j): block 0 → 4, 4, 0; block 1 → 0, 3, 3; block 2 → 5, 0, 0.
    let blocks = [[4.0, 4.0, 1.0], [0.0, 2.0, 2.0], [9.0, 3.0, 3.0]];
    let xs = (0..3)
        .map(|r| (0..3).map(|j| v(&[blocks[j][r]])).collect())
        .collect();
    let want = [[4.0, 0.0, 5.0], [4.0, 3.0, 0.0], [0.0, 3.0, 0.0]]; // [rank][block]
    hand(
        &Setup::sub(d, SUB_WORLD, &SUB_GROUP),
        &Coll::ReduceScatter { op: ReduceOp::Max },
        xs,
        vec![vec![v(&[8.0])], vec![v(&[6.0])], vec![v(&[5.0])]],
        vec![vec![v(&[4.0])], vec![v(&[2.0])], vec![v(&[9.0])]],
        (0..3)
            .map(|r| (0..3).map(|j| v(&[want[r][j]])).collect())
            .collect(),
    );
}

// ------------------------------------------------------------------------------------------------
// Objective conventions
// ------------------------------------------------------------------------------------------------

/// w replicated parameter, x_r per-rank data, y = all_reduce(SUM, w * x_r), loss = y.sum().
/// Returns per rank (loss, grad w).
/// Also checks that grad w lives on `d`.
fn objective_program(d: &Device, objective: Objective) -> Vec<(f32, Vec<f32>)> {
    let data = [[1.0f32, -1.0], [2.0, 0.5], [3.0, 2.0]];
    run_local(3, test_opts(), |comm| async move {
        let tape = Tape::with_objective(objective);
        let g = comm.world();
        let w = tape.var_invariant(vec_on(d, &[1.0, 2.0])?, &g);
        let x = tape.constant(vec_on(d, &data[comm.rank()])?);
        let y = dist::all_reduce(&comm, &w.mul(&x)?, ReduceOp::Sum, &g).await?;
        let loss = y.sum()?;
        let grads = tape.backward(&loss, &comm).await?;
        let gw = grads.wrt(&w)?;
        Ok((loss.value().item()?, gw.try_to_vec()?, gw.device().name()))
    })
    .into_iter()
    .enumerate()
    .map(|(r, res)| {
        let ctx = format!(
            "[device={} world=3 op=Sum objective={objective:?} rank={r}]",
            d.name()
        );
        let (loss, g, dev) = res.unwrap_or_else(|e| panic!("{ctx}: {e}"));
        assert_eq!(dev, d.name(), "{ctx}: grad w must be on the var's device");
        (loss, g)
    })
    .collect()
}

fn objective_conventions_differ_by_exactly_n(d: &Device) {
    // N = 3, w = [1, 2], x0 = [1, -1], x1 = [2, 0.5], x2 = [3, 2]; Σ x = [6, 1.5].
    // y = w ⊙ Σx = [6, 3] on every rank, loss = 9.
    //
    // Default (sum over ranks of each rank's loss): J = Σ_r loss_r = 3·Σ_i w_i (Σx)_i, and w is a
    // per-rank value, so rank r's copy gets dJ/dw_r = N · x_r:
    //   rank 0: [3, -3], rank 1: [6, 1.5], rank 2: [9, 6].
    // Replicated (loss invariant, counted once): J = Σ_i w_i (Σx)_i with one shared w:
    //   dJ/dw = Σx = [6, 1.5] on every rank.
    // The total gradient of the shared parameter under the default convention (what a
    // data-parallel step sums) is Σ_r N x_r = [18, 4.5] = N × the replicated gradient.
    //
    // The loss is a sum (y.sum()): exact on the CPU; on a GPU, within GPU_RTOL of the CPU's loss.
    let want_default = [[3.0, -3.0], [6.0, 1.5], [9.0, 6.0]];
    let def = objective_program(d, Objective::SumOfRankLosses);
    let rep = objective_program(d, Objective::Replicated);
    let cpu_losses = if is_cpu(d) {
        None
    } else {
        Some([
            objective_program(&Device::Cpu, Objective::SumOfRankLosses),
            objective_program(&Device::Cpu, Objective::Replicated),
        ])
    };
    for r in 0..3 {
        let ctx = |m: &str| {
            format!(
                "[device={} world=3 op=Sum root=- objective={m} rank={r}]",
                d.name()
            )
        };
        match &cpu_losses {
            None => {
                assert_eq!(def[r].0, 9.0, "{}: loss", ctx("SumOfRankLosses"));
                assert_eq!(rep[r].0, 9.0, "{}: loss", ctx("Replicated"));
            }
            Some([cd, cr]) => {
                for (m, got, cpu) in [("SumOfRankLosses", &def, cd), ("Replicated", &rep, cr)] {
                    assert_close(
                        &ctx(m),
                        "loss vs the CPU's",
                        &[got[r].0],
                        &[cpu[r].0],
                        GPU_RTOL,
                        0.0,
                    );
                    assert_close(&ctx(m), "loss", &[got[r].0], &[9.0], GPU_RTOL, 0.0);
                }
            }
        }
        assert_close(
            &ctx("SumOfRankLosses"),
            "grad w",
            &def[r].1,
            &want_default[r],
            1e-6,
            0.0,
        );
        assert_close(
            &ctx("Replicated"),
            "grad w",
            &rep[r].1,
            &[6.0, 1.5],
            1e-6,
            0.0,
        );
    }
    let total: Vec<f32> = (0..2)
        .map(|i| def.iter().map(|(_, g)| g[i]).sum())
        .collect();
    let n_times_rep: Vec<f32> = rep[0].1.iter().map(|g| 3.0 * g).collect();
    let ctx = format!("[device={} world=3 op=Sum all ranks]", d.name());
    assert_close(
        &ctx,
        "Σ_r default grad = N · replicated grad",
        &total,
        &n_times_rep,
        1e-6,
        0.0,
    );
    assert_close(&ctx, "Σ_r default grad", &total, &[18.0, 4.5], 1e-6, 0.0);
}

fn replicated_all_reduce_output_is_counted_once(d: &Device) {
    // Objective::Replicated, 3 ranks, the SAME cotangent c on every rank (the output is
    // invariant): J = ⟨c, y⟩ once, not Σ_ranks ⟨c, y⟩ = 3⟨c, y⟩ as in the default convention.
    let s = Setup::world(d, 3).replicated();
    // MAX: x = [3, 7, 7], c = 6 → J = 6·max; ranks 1 and 2 tie → 6 / 2 = 3 each, rank 0 gets 0.
    hand(
        &s,
        &Coll::AllReduce { op: ReduceOp::Max },
        vec![vec![v(&[3.0])], vec![v(&[7.0])], vec![v(&[7.0])]],
        vec![vec![v(&[6.0])]; 3],
        vec![vec![v(&[7.0])]; 3],
        vec![vec![v(&[0.0])], vec![v(&[3.0])], vec![v(&[3.0])]],
    );
    // PROD, c = 1: element 0 x = [2, 0, 5] → only rank 1 gets 2·5 = 10;
    // element 1 x = [2, 3, 4] → 3·4 = 12, 2·4 = 8, 2·3 = 6.
    hand(
        &s,
        &Coll::AllReduce { op: ReduceOp::Prod },
        vec![
            vec![v(&[2.0, 2.0])],
            vec![v(&[0.0, 3.0])],
            vec![v(&[5.0, 4.0])],
        ],
        vec![vec![v(&[1.0, 1.0])]; 3],
        vec![vec![v(&[0.0, 24.0])]; 3],
        vec![
            vec![v(&[0.0, 12.0])],
            vec![v(&[10.0, 8.0])],
            vec![v(&[0.0, 6.0])],
        ],
    );
    // SUM, c = [6, -3] → every rank gets c = [6, -3]; AVG → c / 3 = [2, -1].
    // x_r = [r, 2r] → sum [3, 6], mean [1, 2].
    let xs: Vec<Vec<Arr>> = (0..3)
        .map(|r| vec![v(&[r as f32, 2.0 * r as f32])])
        .collect();
    let c = vec![vec![v(&[6.0, -3.0])]; 3];
    hand(
        &s,
        &Coll::AllReduce { op: ReduceOp::Sum },
        xs.clone(),
        c.clone(),
        vec![vec![v(&[3.0, 6.0])]; 3],
        vec![vec![v(&[6.0, -3.0])]; 3],
    );
    hand(
        &s,
        &Coll::AllReduce { op: ReduceOp::Avg },
        xs,
        c,
        vec![vec![v(&[1.0, 2.0])]; 3],
        vec![vec![v(&[2.0, -1.0])]; 3],
    );
}

fn broadcast_of_a_replicated_parameter(d: &Device) {
    // 3 ranks, w = [1, 2], y = broadcast(w, root 1), loss_r = Σ c_r ⊙ y with per-rank constants
    // c_r = [r + 1, 10(r + 1)], so J = Σ_r ⟨c_r, w⟩ and Σ_r c_r = [6, 60].
    // Replicated (w invariant, one shared parameter): dJ/dw = [6, 60] on EVERY rank.
    // Default (w is each rank's own value; only the root's copy is read): root 1 gets [6, 60],
    // ranks 0 and 2 get [0, 0].
    for objective in [Objective::Replicated, Objective::SumOfRankLosses] {
        let res = run_local(3, test_opts(), |comm| async move {
            let tape = Tape::with_objective(objective);
            let g = comm.world();
            let w = tape.var_invariant(vec_on(d, &[1.0, 2.0])?, &g);
            let r = comm.rank() as f32;
            let c = tape.constant(vec_on(d, &[r + 1.0, 10.0 * (r + 1.0)])?);
            let y = dist::broadcast(&comm, &w, 1, &g).await?;
            let loss = c.mul(&y)?.sum()?;
            let grads = tape.backward(&loss, &comm).await?;
            read(&grads.wrt(&w)?)
        });
        for (r, got) in res.into_iter().enumerate() {
            let ctx = format!(
                "[device={} world=3 op=broadcast root=1 objective={objective:?} rank={r}]",
                d.name()
            );
            let got = got.unwrap_or_else(|e| panic!("{ctx}: {e}"));
            let want = match (objective, r) {
                (Objective::Replicated, _) | (_, 1) => [6.0, 60.0],
                _ => [0.0, 0.0],
            };
            check_on(d, &ctx, "grad w", &got, &want, 1e-6);
        }
    }
}

fn replicated_parameter_into_all_reduce_every_op(d: &Device) {
    // Objective::Replicated, 3 ranks, w = [2] invariant (one shared parameter), y = all_reduce(op, w)
    // (w is made varying first, its dual an all_reduce SUM), loss = y (invariant, counted once):
    //   SUM:  y = 3w = 6,   dy/dw = 3
    //   AVG:  y = w = 2,    dy/dw = 1
    //   PROD: y = w³ = 8,   dy/dw = 3w² = 12
    //   MAX / MIN: y = w = 2 (all three ranks tie), dy/dw = 1
    let cases = [
        (ReduceOp::Sum, 6.0, 3.0),
        (ReduceOp::Avg, 2.0, 1.0),
        (ReduceOp::Prod, 8.0, 12.0),
        (ReduceOp::Max, 2.0, 1.0),
        (ReduceOp::Min, 2.0, 1.0),
    ];
    for (op, want_y, want_g) in cases {
        let res = run_local(3, test_opts(), |comm| async move {
            let tape = Tape::with_objective(Objective::Replicated);
            let g = comm.world();
            let w = tape.var_invariant(vec_on(d, &[2.0])?, &g);
            let y = dist::all_reduce(&comm, &w, op, &g).await?;
            let grads = tape.backward(&y.sum()?, &comm).await?;
            Ok((read(&y.value())?, read(&grads.wrt(&w)?)?))
        });
        for (r, got) in res.into_iter().enumerate() {
            let ctx = format!(
                "[device={} world=3 op={op:?} root=- objective=Replicated rank={r}]",
                d.name()
            );
            let (y, g) = got.unwrap_or_else(|e| panic!("{ctx}: {e}"));
            check_on(d, &ctx, "y", &y, &[want_y], 1e-6);
            check_on(d, &ctx, "grad w", &g, &[want_g], 1e-6);
        }
    }
}

// ------------------------------------------------------------------------------------------------
// Data-parallel MLP step
// ------------------------------------------------------------------------------------------------

struct Mlp {
    w1: Vec<f32>, // [3, 4]
    b1: Vec<f32>, // [4]
    w2: Vec<f32>, // [4, 1]
    b2: Vec<f32>, // [1]
}

const ROWS: usize = 2; // rows per rank

fn mlp_params() -> Mlp {
    let mut rng = Rng::new(7);
    Mlp {
        w1: rng.vec(12, -1.0, 1.0),
        b1: rng.vec(4, -0.5, 0.5),
        w2: rng.vec(4, -1.0, 1.0),
        b2: rng.vec(1, -0.5, 0.5),
    }
}

/// Global data: `n · ROWS` rows of 3 features and a target each; rank r owns rows r·ROWS.. .
fn mlp_data(n: usize) -> (Vec<f32>, Vec<f32>) {
    let mut rng = Rng::new(100 + n as u64);
    (
        rng.vec(n * ROWS * 3, -2.0, 2.0),
        rng.vec(n * ROWS, -1.0, 1.0),
    )
}

/// tanh(x W1 + b1) W2 + b2, then the mean squared error against `t`; `p` = [W1, b1, W2, b2].
fn mlp_forward(p: [&Var; 4], x: &Var, t: &Var) -> distgrad::Result<Var> {
    let h = x.matmul(p[0])?.add(p[1])?.tanh()?;
    let y = h.matmul(p[2])?.add(p[3])?;
    y.mse_loss(t)
}

/// The parameters as vars on `d`.
fn param_vars(
    d: &Device,
    tape: &Tape,
    m: &Mlp,
    invariant: Option<&distgrad::Group>,
) -> distgrad::Result<[Var; 4]> {
    let ts = [
        Tensor::from_vec(m.w1.clone(), &[3, 4])?.to_device(d)?,
        Tensor::from_vec(m.b1.clone(), &[4])?.to_device(d)?,
        Tensor::from_vec(m.w2.clone(), &[4, 1])?.to_device(d)?,
        Tensor::from_vec(m.b2.clone(), &[1])?.to_device(d)?,
    ];
    Ok(ts.map(|t| match invariant {
        Some(g) => tape.var_invariant(t, g),
        None => tape.var(t),
    }))
}

/// Single process, all data, no collectives: gradient of the mean loss over the concatenation, on
/// the CPU (the reference for every backend). (A world of one rank only provides the `comm` that
/// `backward` takes; the tape has no collective.)
fn mlp_reference(n: usize) -> Vec<Vec<f32>> {
    let (x, t) = mlp_data(n);
    let m = mlp_params();
    let (x, t, m) = (&x, &t, &m);
    let res = run_local(1, test_opts(), |comm| async move {
        let tape = Tape::new();
        let p = param_vars(&Device::Cpu, &tape, m, None)?;
        let x = tape.constant(Tensor::from_vec(x.clone(), &[n * ROWS, 3])?);
        let t = tape.constant(Tensor::from_vec(t.clone(), &[n * ROWS, 1])?);
        let loss = mlp_forward([&p[0], &p[1], &p[2], &p[3]], &x, &t)?;
        let grads = tape.backward(&loss, &comm).await?;
        p.iter()
            .map(|v| Ok(grads.wrt(v)?.to_vec()))
            .collect::<distgrad::Result<Vec<_>>>()
    });
    res.into_iter().next().unwrap().expect("reference backward")
}

/// Per rank, the gradients after one data-parallel step. `replicated`: params are invariant, the
/// tape's loss is all_reduce(AVG, local loss) (Objective::Replicated) and the grads come straight
/// out of backward. Otherwise: local backward, then all_reduce(AVG) of each gradient. Parameters
/// and data live on `d`; each gradient comes back with the name of its device.
fn mlp_data_parallel(d: &Device, n: usize, replicated: bool) -> Vec<Vec<(Vec<f32>, &'static str)>> {
    let (x, t) = mlp_data(n);
    let m = mlp_params();
    let (x, t, m) = (&x, &t, &m);
    run_local(n, test_opts(), |comm| async move {
        let r = comm.rank();
        let g = comm.world();
        let tape = if replicated {
            Tape::with_objective(Objective::Replicated)
        } else {
            Tape::new()
        };
        let p = param_vars(d, &tape, m, replicated.then_some(&g))?;
        let xr = tape.constant(
            Tensor::from_vec(x[r * ROWS * 3..(r + 1) * ROWS * 3].to_vec(), &[ROWS, 3])?
                .to_device(d)?,
        );
        let tr = tape.constant(
            Tensor::from_vec(t[r * ROWS..(r + 1) * ROWS].to_vec(), &[ROWS, 1])?.to_device(d)?,
        );
        let local = mlp_forward([&p[0], &p[1], &p[2], &p[3]], &xr, &tr)?;
        if replicated {
            let loss = dist::all_reduce(&comm, &local, ReduceOp::Avg, &g).await?;
            let grads = tape.backward(&loss, &comm).await?;
            p.iter()
                .map(|v| read(&grads.wrt(v)?))
                .collect::<distgrad::Result<Vec<_>>>()
        } else {
            let grads = tape.backward(&local, &comm).await?;
            let mut out = Vec::new();
            for v in &p {
                out.push(read(
                    &comm.all_reduce(&grads.wrt(v)?, ReduceOp::Avg, &g).await?,
                )?);
            }
            Ok(out)
        }
    })
    .into_iter()
    .enumerate()
    .map(|(r, res)| {
        res.unwrap_or_else(|e| {
            panic!(
                "[device={} world={n} op=Avg rank={r} replicated={replicated}]: {e}",
                d.name()
            )
        })
    })
    .collect()
}

fn mlp_data_parallel_step_matches_single_process(d: &Device) {
    // mean over n·ROWS rows = (1/n) Σ_r (mean over rank r's ROWS rows), so the all_reduce(AVG) of
    // the per-rank gradients is the single-process gradient of the mean loss over all the data.
    // The reference is always the CPU's; 1e-4 already allows for the GPU's matmul/tanh/sums.
    let names = ["W1", "b1", "W2", "b2"];
    for n in [1, 2, 3, 4] {
        let want = mlp_reference(n);
        for replicated in [false, true] {
            let got = mlp_data_parallel(d, n, replicated);
            for (r, gr) in got.iter().enumerate() {
                for (i, name) in names.iter().enumerate() {
                    let ctx = format!(
                        "[device={} world={n} op=Avg root=- rank={r} replicated={replicated}]",
                        d.name()
                    );
                    let (vals, dev) = &gr[i];
                    assert_eq!(*dev, d.name(), "{ctx}: grad {name} on the params' device");
                    assert!(
                        vals.iter().all(|x| x.is_finite()),
                        "{ctx}: non-finite grad {name}"
                    );
                    assert_close(
                        &ctx,
                        &format!("grad {name} vs single process (CPU)"),
                        vals,
                        &want[i],
                        1e-4,
                        1e-6,
                    );
                }
            }
        }
    }
}

/// Replicated mode: a constant that is the same on every rank (`constant_invariant`) keeps an
/// invariant parameter's loss invariant, so it is counted once; per-rank data (`constant`) makes it
/// varying, so the loss is one per rank and the objective sums them.
fn replicated_constants_do_not_multiply_by_n(d: &Device) {
    use distgrad::{CommOptions, Communicator, Objective, Tape, Tensor, run_local};
    // w = 2 on every rank, c = 3; loss = sum(w * c) = 6.
    //   invariant c: the loss is invariant, counted once: dloss/dw = c = 3 on every rank.
    //   varying c:   pvary(w) * c on each of 3 ranks, objective = sum over ranks: dw = 3 * 3 = 9.
    // Products and a host all_reduce of small integers: exact on every backend.
    for (invariant, want) in [(true, 3.0f32), (false, 9.0)] {
        let res = run_local(3, CommOptions::default(), |comm| async move {
            let tape = Tape::with_objective(Objective::Replicated);
            let g = comm.world();
            let w = tape.var_invariant(Tensor::vector(&[2.0]).to_device(d)?, &g);
            let three = Tensor::vector(&[3.0]).to_device(d)?;
            let c = if invariant {
                tape.constant_invariant(three, &g)
            } else {
                tape.constant(three)
            };
            let loss = w.mul(&c)?.sum()?;
            let grads = tape.backward(&loss, &comm).await?;
            Ok((loss.invariant().is_some(), read(&grads.wrt(&w)?)?))
        });
        for (r, got) in res.into_iter().enumerate() {
            let ctx = format!(
                "[device={} invariant constant = {invariant}, rank {r}]",
                d.name()
            );
            let (loss_invariant, g) = got.unwrap_or_else(|e| panic!("{ctx}: {e}"));
            assert_eq!(loss_invariant, invariant, "{ctx}: loss invariance");
            assert_eq!(g.1, d.name(), "{ctx}: grad w on the var's device");
            assert_eq!(g.0, vec![want], "{ctx}: grad w");
        }
    }
}

on_every_device!(
    all_reduce_max_ties_split_equally,
    all_reduce_min_ties_split_equally,
    all_reduce_max_all_ranks_tie_on_a_subgroup,
    all_reduce_prod_with_zeros,
    all_reduce_max_with_nan_gives_zero_grad_there,
    same_var_in_every_slot_accumulates,
    reduce_avg_root_2_on_4_ranks,
    reduce_max_tie_and_prod_zero_root_not_zero,
    broadcast_root_1_grads_go_to_root_only,
    gather_on_subgroup_every_root,
    scatter_on_subgroup_every_root,
    gather_input_also_used_locally,
    scattered_value_used_with_a_local_var,
    received_value_used_with_a_local_var,
    all_gather_grad_is_reduce_scatter_of_cotangents,
    reduce_scatter_grad_is_all_gather_of_cotangents,
    reduce_scatter_max_tie_on_subgroup,
    objective_conventions_differ_by_exactly_n,
    replicated_all_reduce_output_is_counted_once,
    broadcast_of_a_replicated_parameter,
    replicated_parameter_into_all_reduce_every_op,
    mlp_data_parallel_step_matches_single_process,
    replicated_constants_do_not_multiply_by_n,
);
