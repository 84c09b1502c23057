//! Central finite differences of the global objective  J = Σ_ranks ⟨cot_r, out_r⟩  against the
//! backward pass, for EVERY collective and every ReduceOp.
//!
//! One input element on one rank is perturbed by ±EPS at a time (the actual f32 step is used as the
//! denominator). All perturbed forwards of a case run in one `run_local` (see `common::objectives`).
//! - SUM / AVG and the data-movement collectives are linear: FD is exact up to rounding.
//! - PROD is multilinear in the ranks' inputs: central FD is exact too, zeros included (cases have
//!   one zero and two zeros in a slot).
//! - MAX / MIN: every slot's values are distinct across ranks with gaps ≥ 0.3 > 2·EPS, so the
//!   argmax does not move under the perturbation (ties are tested by hand in grad_hand).
//!
//! World sizes 1..=8 for all_reduce, {1, 2, 3, 5, 8} for the others, roots n-1 and n/2, and the
//! subgroup case world 5 / group [4, 1, 3] for every collective.
//!
//! Every test runs on each backend (`<test>::cpu`, and `<test>::gpu` when there is a GPU), inputs
//! as tensors on that device; the FD tolerance is far above the GPU's rounding. On the GPU the
//! single-collective tests run a representative subset of world sizes: see [`sizes`].

mod common;

use common::*;
use distgrad::{Communicator, ReduceOp, Tape, Tensor, Var, dist};

const EPS: f32 = 1e-2;
const SIZES: [usize; 5] = [1, 2, 3, 5, 8];

/// Largest world of the single-collective FD cases on a GPU.
const GPU_MAX_WORLD: usize = 3;

/// The world sizes of a single-collective FD test on `d`: all of `all` on the CPU; on a GPU those
/// up to [`GPU_MAX_WORLD`] (the subgroup case, a group of 3 in a world of 5, runs on both).
///
/// Why a subset: the GPU in CI is lavapipe (Vulkan in software), and every perturbed forward
/// uploads, reads back and re-uploads each rank's tensors, so the cost grows like n³ (n⁴ for the
/// list collectives): the full set took ~120 s extra in a debug build (the two reduce_scatter tests
/// ~75 s, mostly at n = 8), against ~6 s for this subset. What the GPU changes is where the local
/// math of the duals runs (Eq masks, tie splits, products of the other ranks' inputs, 1/N scales,
/// stack/unstack), and n ∈ {1, 2, 3} exercises all of it: every collective, every ReduceOp, both
/// algorithms (uneven ring chunks at n = 3), both objectives, roots n-1 and n/2, the empty product
/// of a single rank. Larger worlds change only the host-side schedules (collectives read GPU inputs
/// back at their entry), which the CPU run covers at every size. The multi-collective programs
/// below, the adjoint suite and the hand-derived suite run their full sets on the GPU.
fn sizes(d: &Device, all: impl IntoIterator<Item = usize>) -> Vec<usize> {
    all.into_iter()
        .filter(|&n| is_cpu(d) || n <= GPU_MAX_WORLD)
        .collect()
}

/// Inputs for a finite-difference case: moderate magnitudes (|x| in [0.3, 1.5]), adjusted for the
/// reduce op (distinct values for MAX/MIN, zeros for PROD).
fn fd_inputs(coll: &Coll, n: usize, shape: &[usize], seed: u64) -> Vec<Vec<Arr>> {
    let mut rng = Rng::new(seed);
    let mut xs = random_inputs(&mut rng, coll, n, shape, 0.3, 1.5);
    for l in xs.iter_mut() {
        for x in l.iter_mut() {
            for v in x.data.iter_mut() {
                if rng.next_u64() & 1 == 1 {
                    *v = -*v;
                }
            }
        }
    }
    let op = match coll {
        Coll::Reduce { op, .. } | Coll::AllReduce { op } | Coll::ReduceScatter { op } => Some(*op),
        _ => None,
    };
    match op {
        Some(ReduceOp::Max | ReduceOp::Min) => make_distinct(&mut rng, &mut xs),
        Some(ReduceOp::Prod) => add_zeros(&mut rng, &mut xs),
        _ => {}
    }
    xs
}

/// For every slot (input index k, element e) the ranks' values are a random permutation of
/// `-1.2 + 0.35 m + jitter` (jitter < 0.05): distinct, gaps ≥ 0.3.
fn make_distinct(rng: &mut Rng, xs: &mut [Vec<Arr>]) {
    let n = xs.len();
    for k in 0..xs[0].len() {
        for e in 0..xs[0][k].numel() {
            let mut vals: Vec<f32> = (0..n)
                .map(|m| -1.2 + 0.35 * m as f32 + rng.uniform(0.0, 0.05))
                .collect();
            rng.shuffle(&mut vals);
            for (r, v) in vals.into_iter().enumerate() {
                xs[r][k].data[e] = v;
            }
        }
    }
}

/// Slot (k, 0): exactly one rank holds 0. Slot (k, 1) (if any, n ≥ 2): two ranks hold 0.
fn add_zeros(rng: &mut Rng, xs: &mut [Vec<Arr>]) {
    let n = xs.len();
    for k in 0..xs[0].len() {
        let a = rng.below(n);
        xs[a][k].data[0] = 0.0;
        if n >= 2 && xs[0][k].numel() >= 2 {
            let b = (a + 1 + rng.below(n - 1)) % n;
            xs[a][k].data[1] = 0.0;
            xs[b][k].data[1] = 0.0;
        }
    }
}

/// Backward vs central finite differences for every input element on every rank, with random
/// cotangents.
fn fd_check(s: &Setup, coll: &Coll, xs: &[Vec<Arr>], seed: u64) {
    let mut rng = Rng::new(seed ^ 0xC0FF_EE00);
    let cots = random_like(&mut rng, &oracle(coll, xs), -1.0, 1.0);
    fd_check_with(s, coll, xs, &cots, 1.0);
}

/// Backward vs `FD(Σ_ranks ⟨cots_r, out_r⟩) / divisor` for every input element on every rank.
fn fd_check_with(s: &Setup, coll: &Coll, xs: &[Vec<Arr>], cots: &[Vec<Arr>], divisor: f64) {
    let rs = run_case(s, coll, xs, cots);
    check_forward(s, coll, xs, &rs);

    let mut ps = Vec::new();
    let mut slots = Vec::new();
    for (r, l) in xs.iter().enumerate() {
        for (k, x) in l.iter().enumerate() {
            for (e, &v) in x.data.iter().enumerate() {
                let (hi, lo) = (v + EPS, v - EPS);
                ps.push(Perturb {
                    rank: r,
                    input: k,
                    elem: e,
                    value: hi,
                });
                ps.push(Perturb {
                    rank: r,
                    input: k,
                    elem: e,
                    value: lo,
                });
                slots.push((r, k, e, hi as f64 - lo as f64));
            }
        }
    }
    let f = objectives(s, coll, xs, cots, &ps);
    for (i, &(r, k, e, step)) in slots.iter().enumerate() {
        let fd = (f[2 * i] - f[2 * i + 1]) / step / divisor;
        let g = rs[r].grads[k].data[e] as f64;
        assert!(
            (fd - g).abs() <= 1e-2 + 2e-2 * g.abs().max(fd.abs()),
            "{}: d J / d input {k}[{e}]: backward {g}, central FD {fd} (x = {}, eps {EPS})\n  inputs {:?}\n  grads of this rank {:?}",
            s.ctx(coll, r),
            xs[r][k].data[e],
            xs.iter()
                .map(|l| l.iter().map(|a| a.data.clone()).collect::<Vec<_>>())
                .collect::<Vec<_>>(),
            rs[r].grads[k].data
        );
    }
}

fn case(s: &Setup, coll: &Coll, shape: &[usize], seed: u64) {
    let xs = fd_inputs(coll, s.n(), shape, seed);
    fd_check(s, coll, &xs, seed);
}

fn sub(d: &Device) -> Setup {
    Setup::sub(d, SUB_WORLD, &SUB_GROUP)
}

fn all_reduce_every_op_world_1_to_8(d: &Device) {
    // Small payloads: the exchange, and the star through group rank 0.
    for star in [false, true] {
        let on = |s: Setup| if star { s.star() } else { s };
        for n in sizes(d, 1..=8) {
            for op in ReduceOp::ALL {
                case(
                    &on(Setup::world(d, n)),
                    &Coll::AllReduce { op },
                    &[3],
                    10 * n as u64 + u64::from(star),
                );
            }
        }
        for op in ReduceOp::ALL {
            case(&on(sub(d)), &Coll::AllReduce { op }, &[3], 1);
        }
    }
}

fn all_reduce_every_op_ring(d: &Device) {
    // numel 8 >= n: the large-payload algorithms, uneven chunks for n = 3, 5.
    for algo in LARGE_ALL_REDUCE {
        for n in sizes(d, [2, 3, 5, 8]) {
            for op in ReduceOp::ALL {
                case(
                    &Setup::world(d, n).ring().algo(algo),
                    &Coll::AllReduce { op },
                    &[8],
                    20 + n as u64,
                );
            }
        }
        for op in ReduceOp::ALL {
            case(&sub(d).ring().algo(algo), &Coll::AllReduce { op }, &[4], 2);
        }
    }
}

fn reduce_every_op_roots(d: &Device) {
    for n in sizes(d, SIZES) {
        for root in roots(n) {
            for op in ReduceOp::ALL {
                case(
                    &Setup::world(d, n),
                    &Coll::Reduce { root, op },
                    &[3],
                    30 + n as u64,
                );
            }
        }
    }
    for root in [2, 1] {
        for op in ReduceOp::ALL {
            case(&sub(d), &Coll::Reduce { root, op }, &[3], 3);
        }
    }
}

fn reduce_scatter_every_op(d: &Device) {
    for n in sizes(d, SIZES) {
        for op in ReduceOp::ALL {
            case(
                &Setup::world(d, n),
                &Coll::ReduceScatter { op },
                &[2],
                40 + n as u64,
            );
        }
    }
    for op in ReduceOp::ALL {
        case(&sub(d), &Coll::ReduceScatter { op }, &[2], 4);
    }
}

fn reduce_scatter_every_op_ring(d: &Device) {
    for n in sizes(d, [2, 3, 5, 8]) {
        for op in ReduceOp::ALL {
            case(
                &Setup::world(d, n).ring(),
                &Coll::ReduceScatter { op },
                &[2],
                50 + n as u64,
            );
        }
    }
    for op in ReduceOp::ALL {
        case(&sub(d).ring(), &Coll::ReduceScatter { op }, &[2], 5);
    }
}

fn broadcast_roots(d: &Device) {
    for n in sizes(d, SIZES) {
        for root in roots(n) {
            case(
                &Setup::world(d, n),
                &Coll::Broadcast { root },
                &[3],
                60 + n as u64,
            );
        }
    }
    for root in [2, 1] {
        case(&sub(d), &Coll::Broadcast { root }, &[3], 6);
    }
}

fn gather_roots(d: &Device) {
    for n in sizes(d, SIZES) {
        for root in roots(n) {
            case(
                &Setup::world(d, n),
                &Coll::Gather { root },
                &[2],
                70 + n as u64,
            );
        }
    }
    for root in [2, 1] {
        case(&sub(d), &Coll::Gather { root }, &[2], 7);
    }
}

fn scatter_roots(d: &Device) {
    for n in sizes(d, SIZES) {
        for root in roots(n) {
            case(
                &Setup::world(d, n),
                &Coll::Scatter { root },
                &[2],
                80 + n as u64,
            );
        }
    }
    for root in [2, 1] {
        case(&sub(d), &Coll::Scatter { root }, &[2], 8);
    }
}

fn all_gather(d: &Device) {
    for n in sizes(d, SIZES) {
        case(&Setup::world(d, n), &Coll::AllGather, &[2], 90 + n as u64);
    }
    for n in sizes(d, [2, 3, 5]) {
        case(
            &Setup::world(d, n).ring(),
            &Coll::AllGather,
            &[2],
            95 + n as u64,
        );
    }
    case(&sub(d), &Coll::AllGather, &[2], 9);
}

fn all_to_all_list(d: &Device) {
    for n in sizes(d, SIZES) {
        case(
            &Setup::world(d, n),
            &Coll::AllToAll { ragged: false },
            &[2],
            100 + n as u64,
        );
        case(
            &Setup::world(d, n),
            &Coll::AllToAll { ragged: true },
            &[],
            110 + n as u64,
        );
    }
    case(&sub(d), &Coll::AllToAll { ragged: false }, &[2], 10);
    case(&sub(d), &Coll::AllToAll { ragged: true }, &[], 11);
}

fn all_to_all_single_uneven(d: &Device) {
    for n in sizes(d, SIZES) {
        for variant in 0..2 {
            let coll = Coll::AllToAllSingle {
                in_splits: a2a_splits(n, variant),
                cols: 1,
            };
            case(
                &Setup::world(d, n),
                &coll,
                &[],
                120 + 2 * n as u64 + variant as u64,
            );
        }
    }
    let coll = Coll::AllToAllSingle {
        in_splits: a2a_splits(3, 0),
        cols: 2,
    };
    case(&sub(d), &coll, &[], 12);
}

fn permute_full_and_partial(d: &Device) {
    for n in sizes(d, SIZES) {
        for pairs in permute_cases(n) {
            case(
                &Setup::world(d, n),
                &Coll::Permute { pairs },
                &[2],
                140 + n as u64,
            );
        }
    }
    for pairs in permute_cases(3) {
        case(&sub(d), &Coll::Permute { pairs }, &[2], 13);
    }
}

fn send_recv(d: &Device) {
    for n in sizes(d, [2, 3, 5, 8]) {
        let coll = Coll::SendRecv {
            pairs: send_recv_pairs(n),
            shape: vec![2],
        };
        case(&Setup::world(d, n), &coll, &[], 150 + n as u64);
    }
    let coll = Coll::SendRecv {
        pairs: send_recv_pairs(3),
        shape: vec![2],
    };
    case(&sub(d), &coll, &[], 14);
}

fn all_reduce_every_op_replicated_objective(d: &Device) {
    // Objective::Replicated: the all_reduce output is invariant and counted ONCE, so with the same
    // cotangent c on every rank J_rep = ⟨c, y⟩ = (Σ_ranks ⟨c, y⟩) / n: the FD of the summed
    // objective divided by n.
    let mut cases: Vec<Setup> = sizes(d, 1..=8)
        .into_iter()
        .map(|n| Setup::world(d, n).replicated())
        .collect();
    cases.push(sub(d).replicated());
    for s in cases {
        for op in ReduceOp::ALL {
            let n = s.n();
            let coll = Coll::AllReduce { op };
            let xs = fd_inputs(&coll, n, &[3], 160 + n as u64);
            let c = Arr::random(&mut Rng::new(170 + n as u64), &[3], -1.0, 1.0);
            fd_check_with(&s, &coll, &xs, &vec![vec![c]; n], n as f64);
        }
    }
}

fn other_collectives_under_replicated_objective(d: &Device) {
    // Inputs are plain per-rank vars and these outputs are per-rank (varying): the objective is
    // still the sum over ranks, exactly as in the default convention.
    for s in [Setup::world(d, 3).replicated(), sub(d).replicated()] {
        let n = s.n();
        let colls = [
            Coll::Broadcast { root: n - 1 },
            Coll::Reduce {
                root: 1,
                op: ReduceOp::Avg,
            },
            Coll::Reduce {
                root: 1,
                op: ReduceOp::Max,
            },
            Coll::Gather { root: n - 1 },
            Coll::Scatter { root: 1 },
            Coll::AllGather,
            Coll::ReduceScatter { op: ReduceOp::Prod },
            Coll::AllToAll { ragged: false },
            Coll::Permute {
                pairs: permute_cases(n)[0].clone(),
            },
        ];
        for (i, coll) in colls.iter().enumerate() {
            case(&s, coll, &[2], 180 + i as u64);
        }
    }
}

/// Multi-collective programs, differentiated end to end (their backward runs the duals in reverse
/// order, interleaved with local derivatives). Every rank's input `a` has shape [2].
#[derive(Debug, Clone, Copy)]
enum Program {
    /// On the setup's group of n ranks:
    ///   b = broadcast(a, root n-1);  c = b ⊙ a;  d = all_gather(c);
    ///   e = reduce_scatter(SUM, [d_k ⊙ a]_k);  f = permute(e, shift by one);
    ///   p = all_reduce(PROD, tanh a);  z = gather(f, root n/2);
    ///   s = scatter(root n/2, [z_k ⊙ z_k]_k);  loss = Σ(f ⊙ a) + Σ(p ⊙ e) + Σ s.
    Chain,
    /// World of 4 split into A = [3, 1] and B = [0, 2] (every rank creates both, in order):
    ///   A: y = all_reduce(SUM, a ⊙ a, A);  B: y = broadcast(a, root 1 = global 2, B);
    ///   z = all_gather(y, world);  w = all_reduce(AVG, z_0 ⊙ a, own group);
    ///   loss = Σ_k (k + 1)·⟨z_k, a⟩ + Σ w.
    TwoSubgroups,
}

async fn program<C: Communicator>(
    p: Program,
    s: &Setup,
    comm: &C,
    tape: &Tape,
    a: &Var,
) -> distgrad::Result<Option<Var>> {
    match p {
        Program::Chain => {
            let g = s.make_group(comm)?;
            if g.rank().is_none() {
                return Ok(None);
            }
            let n = g.size();
            let b = dist::broadcast(comm, a, n - 1, &g).await?;
            let c = b.mul(a)?;
            let d = dist::all_gather(comm, &c, &g).await?;
            let da: Vec<Var> = d
                .iter()
                .map(|dk| dk.mul(a))
                .collect::<distgrad::Result<_>>()?;
            let e = dist::reduce_scatter(comm, &da, ReduceOp::Sum, &g).await?;
            let shift: Vec<(usize, usize)> = (0..n).map(|i| (i, (i + 1) % n)).collect();
            let f = dist::permute(comm, &e, &shift, &g).await?;
            let p = dist::all_reduce(comm, &a.tanh()?, ReduceOp::Prod, &g).await?;
            let root = n / 2;
            let z = dist::gather(comm, &f, root, &g).await?;
            let sq = z
                .map(|l| {
                    l.iter()
                        .map(|zk| zk.mul(zk))
                        .collect::<distgrad::Result<Vec<_>>>()
                })
                .transpose()?;
            let sc = dist::scatter(comm, tape, sq.as_deref(), root, &g).await?;
            Ok(Some(
                f.mul(a)?.sum()?.add(&p.mul(&e)?.sum()?)?.add(&sc.sum()?)?,
            ))
        }
        Program::TwoSubgroups => {
            let world = comm.world();
            let ga = comm.new_group(&[3, 1])?;
            let gb = comm.new_group(&[0, 2])?;
            let (mine, y) = if ga.rank().is_some() {
                (
                    ga.clone(),
                    dist::all_reduce(comm, &a.mul(a)?, ReduceOp::Sum, &ga).await?,
                )
            } else {
                (gb.clone(), dist::broadcast(comm, a, 1, &gb).await?)
            };
            let z = dist::all_gather(comm, &y, &world).await?;
            let w = dist::all_reduce(comm, &z[0].mul(a)?, ReduceOp::Avg, &mine).await?;
            let mut loss = w.sum()?;
            for (k, zk) in z.iter().enumerate() {
                loss = loss.add(&zk.mul(a)?.sum()?.scale(k as f32 + 1.0)?)?;
            }
            Ok(Some(loss))
        }
    }
}

/// Backward of `p` vs central FD (step `H`) of J = Σ_ranks loss_r, every element of every rank.
/// `xs` is indexed by GLOBAL rank (non-members' entries are unused). Inputs live on `s.device`, so
/// on a GPU the local ops (mul, tanh, sum, add, scale) run there too.
fn program_fd(p: Program, s: &Setup, seed: u64) {
    const H: f32 = 3e-3;
    let mut rng = Rng::new(seed);
    let xs: Vec<Vec<f32>> = (0..s.world)
        .map(|_| (0..2).map(|_| rng.signed(0.3, 0.8)).collect())
        .collect();
    // Perturbations (global rank, element, value); index 0 is the unperturbed run.
    let mut ps: Vec<Option<(usize, usize, f32)>> = vec![None];
    for (r, x) in xs.iter().enumerate() {
        for (e, &v) in x.iter().enumerate() {
            ps.push(Some((r, e, v + H)));
            ps.push(Some((r, e, v - H)));
        }
    }
    let (xs, ps) = (&xs, &ps);
    let dev = &s.device;
    let res = distgrad::run_local(s.world, s.opts.clone(), |comm| async move {
        let me = comm.rank();
        let tape = Tape::new();
        let a = tape.var(Tensor::vector(&xs[me]).to_device(dev)?);
        let Some(loss) = program(p, s, &comm, &tape, &a).await? else {
            return Ok(None);
        };
        let grad = tape.backward(&loss, &comm).await?.wrt(&a)?;
        let grad = (grad.try_to_vec()?, grad.device().name());
        let mut losses = Vec::new();
        for q in ps {
            let mut x = xs[me].clone();
            if let Some((r, e, v)) = *q
                && r == me
            {
                x[e] = v;
            }
            let tape = Tape::new();
            let a = tape.var(Tensor::vector(&x).to_device(dev)?);
            let loss = program(p, s, &comm, &tape, &a)
                .await?
                .expect("same membership");
            losses.push(loss.value().item()? as f64);
        }
        Ok(Some((grad, losses)))
    });
    let ctx = |global: usize| {
        format!(
            "[device={} world={} group={:?} {p:?} global_rank={global}]",
            dev.name(),
            s.world,
            s.group
        )
    };
    let mut grads: Vec<Option<Vec<f32>>> = vec![None; s.world];
    let mut total = vec![0.0f64; ps.len()];
    for (global, r) in res.into_iter().enumerate() {
        match r {
            Ok(Some(((g, g_dev), l))) => {
                assert_eq!(
                    g_dev,
                    dev.name(),
                    "{}: gradient must be on the input's device",
                    ctx(global)
                );
                grads[global] = Some(g);
                total.iter_mut().zip(l).for_each(|(t, x)| *t += x);
            }
            Ok(None) => {}
            Err(e) => panic!("{}: {e}", ctx(global)),
        }
    }
    let mut i = 1;
    for (r, x) in xs.iter().enumerate() {
        for (e, &v) in x.iter().enumerate() {
            let step = (v + H) as f64 - (v - H) as f64;
            let fd = (total[i] - total[i + 1]) / step;
            i += 2;
            // A rank that runs nothing has zero derivative (FD must agree: its input is unused).
            let g = grads[r].as_ref().map_or(0.0, |g| g[e] as f64);
            assert!(
                g.is_finite() && (fd - g).abs() <= 1e-2 + 2e-2 * g.abs().max(fd.abs()),
                "{}: dJ/da[{e}]: backward {g}, central FD {fd}",
                ctx(r)
            );
        }
    }
}

fn chained_collectives_fd(d: &Device) {
    for (i, s) in [
        Setup::world(d, 1),
        Setup::world(d, 2),
        Setup::world(d, 4),
        sub(d),
    ]
    .iter()
    .enumerate()
    {
        program_fd(Program::Chain, s, 190 + i as u64);
    }
}

fn two_subgroups_and_world_fd(d: &Device) {
    program_fd(Program::TwoSubgroups, &Setup::world(d, 4), 195);
}

on_every_device!(
    all_reduce_every_op_world_1_to_8,
    all_reduce_every_op_ring,
    reduce_every_op_roots,
    reduce_scatter_every_op,
    reduce_scatter_every_op_ring,
    broadcast_roots,
    gather_roots,
    scatter_roots,
    all_gather,
    all_to_all_list,
    all_to_all_single_uneven,
    permute_full_and_partial,
    send_recv,
    all_reduce_every_op_replicated_objective,
    other_collectives_under_replicated_objective,
    chained_collectives_fd,
    two_subgroups_and_world_fd,
);
