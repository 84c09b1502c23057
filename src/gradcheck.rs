//! A distributed gradient check: central differences of the GLOBAL objective (the sum of every
//! rank's loss, see [`crate::Objective`]) with respect to every rank's inputs, each perturbed
//! coordinate re-running the program on all ranks, compared with what backward gave each rank.
//!
//! Unlike `torch.autograd.gradcheck` or JAX's `check_grads`, the function checked is the whole
//! multi-rank program, run over the real communicator (in-process ranks here; the rank part,
//! [`rank_part`], runs on any [`Communicator`]).
//!
//! ```
//! use distgrad::gradcheck::{CheckInput, Options, gradcheck};
//! use distgrad::{Communicator, ReduceOp, Tensor, dist};
//!
//! // loss_r = sum(all_reduce(MAX, x_r) * x_r) on 3 ranks.
//! let x = CheckInput::per_rank("x", (0..3).map(|r| Tensor::vector(&[r as f32, 2.0 - r as f32])).collect());
//! let report = gradcheck(3, &Options::default(), &[x], async |comm, _tape, xs| {
//!     let m = dist::all_reduce(comm, &xs[0], ReduceOp::Max, &comm.world()).await?;
//!     Ok(Some(m.mul(&xs[0])?.sum()?))
//! })
//! .unwrap();
//! assert_eq!(report.verdict(), "PASS", "{}", report.render());
//! ```
//!
//! **Precision.** Programs run in f32 (the backends' type): the objective is summed over ranks in
//! f64, but each evaluation carries f32 rounding, about `1e-7 × |F|`, which a difference divides
//! by the step. Defaults: step `eps = 1e-2` (and `eps / 2`), pass when
//! `|numeric − backward| ≤ atol × max(1, |F|) + rtol × |backward|` with `atol = 1e-3`,
//! `rtol = 1e-2`.
//!
//! **Points where the function is not differentiable** (ties of max / min, relu at 0): the
//! one-sided slopes differ by a jump that does not shrink with the step. Such a coordinate is
//! reported as a kink, not passed silently: it passes if backward's value lies between the
//! one-sided slopes (distgrad splits ties equally); if it does not, the result is INCONCLUSIVE
//! (at a tie across ranks the objective is not differentiable jointly, and a check per
//! coordinate cannot confirm which subgradient backward chose). A coordinate that fails, or a kink
//! backward is not within, gets a second look at `eps / 16`: a kink near the point but not at
//! it passes there (said in the report). Where the second derivative jumps (`(x - max)^2` at a
//! tie) the central difference errs by O(eps); its first-order extrapolation is accepted too.
//!
//! **Large programs**: beyond [`Options::max_coordinates`] coordinates (or with
//! [`Options::directions`]) the check compares directional derivatives along random directions
//! `v` (all ranks' inputs at once): `⟨∇F, v⟩` from backward vs `(F(x + εv) − F(x − εv)) / 2ε`.

use std::fmt::Write as _;

use crate::autograd::{Objective, Tape, Var};
use crate::collective::{CommOptions, Communicator};
use crate::error::{Error, Result};
use crate::tensor::Tensor;

/// How to check.
#[derive(Debug, Clone)]
pub struct Options {
    /// Finite-difference step (the check also uses `eps / 2`).
    pub eps: f32,
    /// Relative tolerance (to backward's value).
    pub rtol: f64,
    /// Absolute tolerance, times `max(1, |F|)`.
    pub atol: f64,
    /// Check this many random directions instead of every coordinate.
    pub directions: Option<usize>,
    /// Beyond this many coordinates, check 16 random directions instead (said in the report).
    pub max_coordinates: usize,
    /// Seed of the random directions.
    pub seed: u64,
    /// The objective convention of the tapes.
    pub objective: Objective,
    /// Communicator options of the in-process ranks.
    pub comm: CommOptions,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            eps: 1e-2,
            rtol: 1e-2,
            atol: 1e-3,
            directions: None,
            max_coordinates: 2048,
            seed: 0,
            objective: Objective::SumOfRankLosses,
            comm: CommOptions {
                timeout: std::time::Duration::from_secs(30),
                ..CommOptions::default()
            },
        }
    }
}

/// One input of the checked function, on every rank.
#[derive(Debug, Clone)]
pub struct CheckInput {
    /// Name in the report.
    pub name: String,
    /// Value per rank (index = global rank).
    pub values: Vec<Tensor>,
    /// Whether to differentiate with respect to it (else it is a constant).
    pub grad: bool,
    /// The same value on every rank, invariant over the world under the replicated objective
    /// (perturbed on all ranks at once; each rank's gradient is compared with the derivative
    /// with respect to the shared value).
    pub replicated: bool,
}

impl CheckInput {
    /// A per-rank input with gradient.
    pub fn per_rank(name: &str, values: Vec<Tensor>) -> Self {
        CheckInput {
            name: name.to_string(),
            values,
            grad: true,
            replicated: false,
        }
    }
}

/// Whether an input is perturbed on all ranks at once.
fn shared(inp: &CheckInput, objective: Objective) -> bool {
    inp.replicated && objective == Objective::Replicated
}

/// What to evaluate: the same list on every rank.
#[derive(Debug, Clone, PartialEq)]
pub enum Mode {
    /// Every coordinate of every rank's inputs.
    Coordinates,
    /// This many random directions; `forced`: chosen because the program is too large.
    Directions {
        /// How many.
        count: usize,
        /// Whether the size of the program chose this mode.
        forced: bool,
    },
}

/// One coordinate of the inputs: element `elem` of input `input` on global rank `rank` (`None`:
/// a shared input, perturbed on every rank at once).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Coordinate {
    /// The rank whose input is perturbed (`None`: every rank's).
    pub rank: Option<usize>,
    /// Index of the input.
    pub input: usize,
    /// Element.
    pub elem: usize,
}

/// One perturbed evaluation of the program on all ranks.
#[derive(Debug, Clone)]
enum Perturb {
    /// `x[input][elem] += delta` on `rank` (`None`: on every rank, a shared input).
    Coord {
        rank: Option<usize>,
        input: usize,
        elem: usize,
        delta: f32,
    },
    /// `x += delta · v(direction)` on every rank.
    Direction { direction: usize, delta: f32 },
}

/// The evaluations the check runs, in order (the same on every rank).
fn perturbations(world: usize, inputs: &[CheckInput], o: &Options, mode: &Mode) -> Vec<Perturb> {
    let deltas = [o.eps, -o.eps, o.eps / 2.0, -o.eps / 2.0];
    let mut out = Vec::new();
    match mode {
        Mode::Coordinates => {
            for (i, inp) in inputs.iter().enumerate().filter(|(_, x)| x.grad) {
                let ranks: Vec<Option<usize>> = if shared(inp, o.objective) {
                    vec![None]
                } else {
                    (0..world).map(Some).collect()
                };
                for rank in ranks {
                    // Ranks may hold different sizes (or nothing) of an input.
                    let numel = inp.values.get(rank.unwrap_or(0)).map_or(0, Tensor::numel);
                    for elem in 0..numel {
                        for delta in deltas {
                            out.push(Perturb::Coord {
                                rank,
                                input: i,
                                elem,
                                delta,
                            });
                        }
                    }
                }
            }
        }
        Mode::Directions { count, .. } => {
            for direction in 0..*count {
                for delta in [o.eps, -o.eps] {
                    out.push(Perturb::Direction { direction, delta });
                }
            }
        }
    }
    out
}

/// The direction `v` of input `input` on `rank` (shared inputs: the same on every rank).
fn direction(o: &Options, d: usize, rank: usize, input: usize, shared: bool, n: usize) -> Vec<f32> {
    let r = if shared { 0 } else { rank as u64 + 1 };
    let seed = o
        .seed
        .wrapping_mul(0x9E37_79B9)
        .wrapping_add((d as u64) << 32)
        .wrapping_add(r << 16)
        .wrapping_add(input as u64);
    crate::train::uniform(seed, n)
}

fn choose_mode(world: usize, inputs: &[CheckInput], o: &Options) -> Mode {
    if let Some(count) = o.directions {
        return Mode::Directions {
            count,
            forced: false,
        };
    }
    let coords: usize = inputs
        .iter()
        .filter(|x| x.grad)
        .map(|x| {
            if shared(x, o.objective) {
                x.values.first().map_or(0, Tensor::numel)
            } else {
                x.values.iter().take(world).map(Tensor::numel).sum()
            }
        })
        .sum();
    if coords > o.max_coordinates {
        Mode::Directions {
            count: 16,
            forced: true,
        }
    } else {
        Mode::Coordinates
    }
}

/// One rank's results: its share of the objective at the point and at every perturbation, and
/// backward's gradients.
#[derive(Debug, Clone, PartialEq)]
pub struct RankPart {
    /// This rank's share of the objective at the unperturbed point.
    pub base: f64,
    /// Its share at each perturbation, in order.
    pub evals: Vec<f64>,
    /// Backward's gradient per input (empty for inputs without gradient).
    pub grads: Vec<Vec<f32>>,
}

async fn evaluate<C, F>(
    comm: &C,
    o: &Options,
    inputs: &[CheckInput],
    values: Vec<Tensor>,
    f: &F,
    backward: bool,
) -> Result<(f64, Vec<Vec<f32>>)>
where
    C: Communicator,
    F: AsyncFn(&C, &Tape, Vec<Var>) -> Result<Option<Var>>,
{
    let tape = Tape::with_objective(o.objective);
    let (world, device) = (comm.world(), comm.device());
    // The inputs live where the communicator puts what it receives.
    let xs: Vec<Var> = inputs
        .iter()
        .zip(values)
        .map(|(inp, t)| {
            let t = t.to_device(&device)?;
            Ok(tape.leaf(t, inp.grad, inp.replicated.then_some(&world)))
        })
        .collect::<Result<_>>()?;
    let loss = f(comm, &tape, xs.clone()).await?;
    let share = match &loss {
        Some(l) => {
            if l.value().numel() != 1 {
                let e = Error::shape(
                    "gradcheck",
                    &l.shape(),
                    &[],
                    "the loss must have one element",
                );
                comm.abort(&e.to_string()).await;
                return Err(e);
            }
            let v = f64::from(l.value().read().await?[0]);
            v * crate::program::loss_weight(l)
        }
        None => 0.0,
    };
    let mut grads = Vec::new();
    if backward {
        let g = match &loss {
            Some(l) => tape.backward(l, comm).await?,
            None => tape.backward_from(&[], comm).await?,
        };
        for (x, inp) in xs.iter().zip(inputs) {
            grads.push(if inp.grad {
                g.wrt(x)?.read().await?
            } else {
                Vec::new()
            });
        }
    }
    Ok((share, grads))
}

/// Forward runs of the program at each perturbation of this rank's inputs `mine`: this rank's share
/// of the objective at each.
async fn run_perturbed<C, F>(
    comm: &C,
    o: &Options,
    inputs: &[CheckInput],
    mine: &[Tensor],
    list: &[Perturb],
    f: &F,
) -> Result<Vec<f64>>
where
    C: Communicator,
    F: AsyncFn(&C, &Tape, Vec<Var>) -> Result<Option<Var>>,
{
    let me = comm.rank();
    let host: Vec<Vec<f32>> = futures::future::try_join_all(mine.iter().map(Tensor::read)).await?;
    let mut evals = Vec::with_capacity(list.len());
    for p in list {
        let mut values = host.clone();
        match *p {
            Perturb::Coord {
                rank,
                input,
                elem,
                delta,
            } => {
                if rank.is_none_or(|r| r == me) {
                    values[input][elem] += delta;
                }
            }
            Perturb::Direction {
                direction: d,
                delta,
            } => {
                for (i, inp) in inputs.iter().enumerate().filter(|(_, x)| x.grad) {
                    let v = direction(o, d, me, i, shared(inp, o.objective), values[i].len());
                    for (x, vi) in values[i].iter_mut().zip(v) {
                        *x += delta * vi;
                    }
                }
            }
        }
        let tensors = values
            .into_iter()
            .zip(mine)
            .map(|(v, t)| Tensor::from_vec(v, t.shape())?.to_device(&t.device()))
            .collect::<Result<Vec<_>>>()?;
        evals.push(evaluate(comm, o, inputs, tensors, f, false).await?.0);
    }
    Ok(evals)
}

/// This rank's inputs, or an error naming the input without a value for it.
fn my_inputs(me: usize, world: usize, inputs: &[CheckInput]) -> Result<Vec<Tensor>> {
    inputs
        .iter()
        .map(|x| {
            x.values.get(me).cloned().ok_or_else(|| {
                Error::Input(format!(
                    "input {:?} has {} value(s), one per rank of {world} needed",
                    x.name,
                    x.values.len()
                ))
            })
        })
        .collect()
}

/// The second look at coordinates that failed, on any communicator (every rank calls it with
/// the same list): this rank's share of the objective at `x ± eps`, `x ± eps / 2` of each (four
/// values per coordinate, in order).
pub async fn rank_refine<C, F>(
    comm: &C,
    o: &Options,
    inputs: &[CheckInput],
    coords: &[Coordinate],
    eps: f32,
    f: &F,
) -> Result<Vec<f64>>
where
    C: Communicator,
    F: AsyncFn(&C, &Tape, Vec<Var>) -> Result<Option<Var>>,
{
    let mine = my_inputs(comm.rank(), comm.world_size(), inputs)?;
    let list: Vec<Perturb> = coords
        .iter()
        .flat_map(|c| {
            [eps, -eps, eps / 2.0, -eps / 2.0].map(|delta| Perturb::Coord {
                rank: c.rank,
                input: c.input,
                elem: c.elem,
                delta,
            })
        })
        .collect();
    run_perturbed(comm, o, inputs, &mine, &list, f).await
}

/// This rank's part of the check, on any communicator: every rank of the world calls it with the
/// same inputs, options and function; [`assemble`] puts the parts together.
pub async fn rank_part<C, F>(
    comm: &C,
    o: &Options,
    inputs: &[CheckInput],
    f: &F,
) -> Result<RankPart>
where
    C: Communicator,
    F: AsyncFn(&C, &Tape, Vec<Var>) -> Result<Option<Var>>,
{
    let world = comm.world_size();
    let mine = my_inputs(comm.rank(), world, inputs)?;
    let (base, grads) = evaluate(comm, o, inputs, mine.clone(), f, true).await?;
    let mode = choose_mode(world, inputs, o);
    let evals = run_perturbed(
        comm,
        o,
        inputs,
        &mine,
        &perturbations(world, inputs, o, &mode),
        f,
    )
    .await?;
    Ok(RankPart { base, evals, grads })
}

/// What one check found for one rank's input.
#[derive(Debug, Clone, PartialEq)]
pub struct Row {
    /// Global rank.
    pub rank: usize,
    /// Input name.
    pub input: String,
    /// Coordinates compared.
    pub checked: usize,
    /// Largest `|numeric − backward|` (kinks left out).
    pub max_abs: f64,
    /// Largest `|numeric − backward| / max(|numeric|, |backward|)` (where either exceeds the
    /// absolute tolerance; kinks left out).
    pub max_rel: f64,
    /// The worst coordinate: `(element, backward, numeric)`.
    pub worst: Option<(usize, f64, f64)>,
    /// Coordinates at a kink (listed in [`Report::kinks`]).
    pub kinks: usize,
    /// Coordinates that passed only at the smaller step of the second look (a kink within `eps`
    /// of the point).
    pub refined: usize,
    /// Kinks where backward is not between the one-sided slopes: at a point where the objective
    /// is not differentiable (a tie of max / min across ranks) a per-coordinate check cannot
    /// confirm backward's choice of subgradient.
    pub inconclusive: usize,
    /// Coordinates that failed.
    pub failed: usize,
}

/// A coordinate where the objective is not differentiable.
#[derive(Debug, Clone, PartialEq)]
pub struct Kink {
    /// Global rank (of the gradient compared).
    pub rank: usize,
    /// Input name.
    pub input: String,
    /// Element.
    pub elem: usize,
    /// Slope to the left and to the right.
    pub slopes: (f64, f64),
    /// What backward gave.
    pub backward: f64,
    /// Whether backward's value lies between the slopes (a valid subgradient).
    pub within: bool,
}

/// One random direction's comparison.
#[derive(Debug, Clone, PartialEq)]
pub struct DirectionRow {
    /// Index.
    pub direction: usize,
    /// `⟨∇F, v⟩` from backward.
    pub backward: f64,
    /// `(F(x + εv) − F(x − εv)) / 2ε`.
    pub numeric: f64,
    /// Whether they agree within the tolerance.
    pub pass: bool,
}

/// How one coordinate compared.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Verdict {
    /// Backward agrees with the central difference (or, where the second derivative jumps, with
    /// its first-order extrapolation).
    Pass,
    /// Not differentiable here: one-sided slopes `(left, right)`; passes if backward lies
    /// between them.
    Kink {
        /// Slope to the left.
        left: f64,
        /// Slope to the right.
        right: f64,
        /// Whether backward lies between them.
        within: bool,
    },
    /// Failed at `eps` but passed at the second look's smaller step.
    Refined,
    /// Backward disagrees.
    Fail,
}

impl Verdict {
    /// Whether a smaller step should look again (a failure, or a kink backward is not within:
    /// both can come from a kink near, but not at, the point).
    pub fn needs_second_look(&self) -> bool {
        matches!(self, Verdict::Fail | Verdict::Kink { within: false, .. })
    }
}

/// One coordinate's comparison.
#[derive(Debug, Clone, PartialEq)]
pub struct CoordResult {
    /// The rank whose gradient is compared.
    pub grad_rank: usize,
    /// The perturbed coordinate.
    pub at: Coordinate,
    /// What backward gave.
    pub backward: f64,
    /// The numeric estimate.
    pub numeric: f64,
    /// The outcome.
    pub verdict: Verdict,
}

/// The result of a check.
#[derive(Debug, Clone, PartialEq)]
pub struct Report {
    /// Number of ranks.
    pub world: usize,
    /// The objective convention.
    pub objective: Objective,
    /// The global objective at the point.
    pub value: f64,
    /// How it was checked.
    pub mode: Mode,
    /// Finite-difference step.
    pub eps: f32,
    /// Relative tolerance.
    pub rtol: f64,
    /// Absolute tolerance (times `max(1, |F|)`).
    pub atol: f64,
    /// Every coordinate compared (coordinate mode).
    pub coords: Vec<CoordResult>,
    /// Per rank and input (coordinate mode), summarizing `coords`.
    pub rows: Vec<Row>,
    /// Non-differentiable coordinates.
    pub kinks: Vec<Kink>,
    /// Per direction (direction mode).
    pub directions: Vec<DirectionRow>,
    /// Runs of the program on all ranks (forward only, plus one forward + backward).
    pub evaluations: usize,
    /// Whether no comparison failed (see also `inconclusive`).
    pub passed: bool,
    /// Coordinates at kinks where backward is not between the one-sided slopes (see
    /// [`Row::inconclusive`]); the check says INCONCLUSIVE when there are some and nothing failed.
    pub inconclusive: usize,
}

impl Report {
    /// `PASS`, `FAIL` or `INCONCLUSIVE`.
    pub fn verdict(&self) -> &'static str {
        match (self.passed, self.inconclusive) {
            (false, _) => "FAIL",
            (true, 0) => "PASS",
            (true, _) => "INCONCLUSIVE",
        }
    }
}

/// Compare backward's `b` with the objective at `x` (`f0`) and at `x + eps, x − eps, x + eps/2,
/// x − eps/2` (`v`). Returns the numeric estimate and the verdict.
fn assess(o: &Options, f0: f64, v: [f64; 4], eps: f64, b: f64) -> (f64, Verdict) {
    let [p1, m1, p2, m2] = v;
    let tol = o.atol * f0.abs().max(1.0) + o.rtol * b.abs();
    let c1 = (p1 - m1) / (2.0 * eps);
    let c2 = (p2 - m2) / eps;
    // Where the second derivative jumps (e.g. (x - max)^2 at a tie) the central difference errs
    // by O(eps); its first-order extrapolation cancels that. For smooth functions both agree.
    let lin = 2.0 * c2 - c1;
    let (right, left) = ((p2 - f0) * 2.0 / eps, (f0 - m2) * 2.0 / eps);
    // The jump between the one-sided slopes: it halves with the step where the function is
    // smooth, and stays where it has a kink.
    let d1 = (p1 - 2.0 * f0 + m1) / eps;
    let d2 = (p2 - 2.0 * f0 + m2) * 2.0 / eps;
    if d2.abs() > tol && d2.abs() > 0.6 * d1.abs() {
        let within = b >= left.min(right) - tol && b <= left.max(right) + tol;
        return (
            c2,
            Verdict::Kink {
                left,
                right,
                within,
            },
        );
    }
    if (c2 - b).abs() <= tol {
        (c2, Verdict::Pass)
    } else if (lin - b).abs() <= tol {
        (lin, Verdict::Pass)
    } else {
        (c2, Verdict::Fail)
    }
}

/// Put the ranks' parts (index = global rank) together into the report.
pub fn assemble(o: &Options, inputs: &[CheckInput], parts: &[RankPart]) -> Result<Report> {
    let world = parts.len();
    let mode = choose_mode(world, inputs, o);
    let list = perturbations(world, inputs, o, &mode);
    if parts.iter().any(|p| p.evals.len() != list.len()) {
        return Err(Error::Input(
            "gradcheck: ranks evaluated different lists".into(),
        ));
    }
    let f0: f64 = parts.iter().map(|p| p.base).sum();
    let total = |k: usize| parts.iter().map(|p| p.evals[k]).sum::<f64>();
    let eps = f64::from(o.eps);
    let mut report = Report {
        world,
        objective: o.objective,
        value: f0,
        mode: mode.clone(),
        eps: o.eps,
        rtol: o.rtol,
        atol: o.atol,
        coords: Vec::new(),
        rows: Vec::new(),
        kinks: Vec::new(),
        directions: Vec::new(),
        evaluations: list.len() + 1,
        passed: true,
        inconclusive: 0,
    };
    match mode {
        Mode::Coordinates => {
            // Index of each coordinate's four evaluations.
            let mut at = std::collections::HashMap::new();
            for (k, p) in list.iter().enumerate().step_by(4) {
                if let Perturb::Coord {
                    rank, input, elem, ..
                } = p
                {
                    at.insert(
                        Coordinate {
                            rank: *rank,
                            input: *input,
                            elem: *elem,
                        },
                        k,
                    );
                }
            }
            for (rank, part) in parts.iter().enumerate() {
                for (i, inp) in inputs.iter().enumerate().filter(|(_, x)| x.grad) {
                    let who = if shared(inp, o.objective) {
                        None
                    } else {
                        Some(rank)
                    };
                    for (elem, &b) in part.grads[i].iter().enumerate() {
                        let c = Coordinate {
                            rank: who,
                            input: i,
                            elem,
                        };
                        let Some(&k) = at.get(&c) else { continue };
                        let b = f64::from(b);
                        let v = [total(k), total(k + 1), total(k + 2), total(k + 3)];
                        let (numeric, verdict) = assess(o, f0, v, eps, b);
                        report.coords.push(CoordResult {
                            grad_rank: rank,
                            at: c,
                            backward: b,
                            numeric,
                            verdict,
                        });
                    }
                }
            }
        }
        Mode::Directions { count, .. } => {
            let tol = |backward: f64| o.atol * f0.abs().max(1.0) + o.rtol * backward.abs();
            for d in 0..count {
                let numeric = (total(2 * d) - total(2 * d + 1)) / (2.0 * eps);
                let mut backward = 0.0;
                for (i, inp) in inputs.iter().enumerate().filter(|(_, x)| x.grad) {
                    let sh = shared(inp, o.objective);
                    // A shared input's derivative is one value (every rank holds it): count it once.
                    let ranks = if sh { 0..1 } else { 0..world };
                    for r in ranks {
                        let g = &parts[r].grads[i];
                        let v = direction(o, d, r, i, sh, g.len());
                        backward += g
                            .iter()
                            .zip(&v)
                            .map(|(&a, &b)| f64::from(a) * f64::from(b))
                            .sum::<f64>();
                    }
                }
                let pass = (numeric - backward).abs() <= tol(backward);
                report.passed &= pass;
                report.directions.push(DirectionRow {
                    direction: d,
                    backward,
                    numeric,
                    pass,
                });
            }
        }
    }
    summarize(&mut report, inputs);
    Ok(report)
}

/// The step of the second look at failed coordinates.
pub fn refine_eps(o: &Options) -> f32 {
    o.eps / 16.0
}

/// The coordinates a second look should re-check (those that failed), without repeats.
pub fn to_refine(report: &Report) -> Vec<Coordinate> {
    let mut out: Vec<Coordinate> = report
        .coords
        .iter()
        .filter(|c| c.verdict.needs_second_look())
        .map(|c| c.at)
        .collect();
    out.sort_by_key(|c| (c.rank, c.input, c.elem));
    out.dedup();
    out
}

/// Apply the second look: `evals` are the ranks' [`rank_refine`] results for `coords` at
/// [`refine_eps`]. A failed coordinate that passes at the smaller step is [`Verdict::Refined`]:
/// a kink lies within `eps` of the point, and the function is smooth closer in.
pub fn apply_refine(
    report: &mut Report,
    o: &Options,
    inputs: &[CheckInput],
    coords: &[Coordinate],
    evals: &[Vec<f64>],
) {
    let eps = f64::from(refine_eps(o));
    let total = |k: usize| {
        evals
            .iter()
            .map(|e| e.get(k).copied().unwrap_or(f64::NAN))
            .sum::<f64>()
    };
    let f0 = report.value;
    for c in report
        .coords
        .iter_mut()
        .filter(|c| c.verdict == Verdict::Fail)
    {
        let Some(j) = coords.iter().position(|x| *x == c.at) else {
            continue;
        };
        let k = 4 * j;
        let v = [total(k), total(k + 1), total(k + 2), total(k + 3)];
        let (numeric, verdict) = assess(o, f0, v, eps, c.backward);
        match verdict {
            Verdict::Pass => {
                c.verdict = Verdict::Refined;
                c.numeric = numeric;
            }
            // Closer in, still a kink: keep the one seen at the smaller step.
            Verdict::Kink { .. } => {
                c.verdict = verdict;
                c.numeric = numeric;
            }
            Verdict::Fail | Verdict::Refined => {}
        }
    }
    report.evaluations += 4 * coords.len();
    summarize(report, inputs);
}

/// Rows, kinks and the overall result from the coordinates.
fn summarize(report: &mut Report, inputs: &[CheckInput]) {
    if report.coords.is_empty() && !report.directions.is_empty() {
        return;
    }
    report.rows.clear();
    report.kinks.clear();
    report.passed = true;
    let scale_floor = report.atol;
    for c in &report.coords {
        let name = inputs.get(c.at.input).map_or("?", |x| x.name.as_str());
        let row = match report
            .rows
            .iter_mut()
            .find(|r| r.rank == c.grad_rank && r.input == name)
        {
            Some(r) => r,
            None => {
                report.rows.push(Row {
                    rank: c.grad_rank,
                    input: name.to_string(),
                    checked: 0,
                    max_abs: 0.0,
                    max_rel: 0.0,
                    worst: None,
                    kinks: 0,
                    refined: 0,
                    inconclusive: 0,
                    failed: 0,
                });
                report.rows.last_mut().expect("just pushed")
            }
        };
        row.checked += 1;
        // A NaN on either side is the worst error there is (a NaN compares false with any).
        let err = match (c.numeric - c.backward).abs() {
            e if e.is_nan() => f64::INFINITY,
            e => e,
        };
        match c.verdict {
            Verdict::Kink {
                left,
                right,
                within,
            } => {
                row.kinks += 1;
                if !within {
                    row.inconclusive += 1;
                }
                report.kinks.push(Kink {
                    rank: c.grad_rank,
                    input: name.to_string(),
                    elem: c.at.elem,
                    slopes: (left, right),
                    backward: c.backward,
                    within,
                });
                continue;
            }
            Verdict::Refined => row.refined += 1,
            Verdict::Fail => row.failed += 1,
            Verdict::Pass => {}
        }
        let scale = c.numeric.abs().max(c.backward.abs());
        let rel = if scale > scale_floor {
            err / scale
        } else {
            0.0
        };
        row.max_rel = row.max_rel.max(rel);
        if err >= row.max_abs {
            row.max_abs = err;
            row.worst = Some((c.at.elem, c.backward, c.numeric));
        }
    }
    report.passed = report.rows.iter().all(|r| r.failed == 0);
    report.inconclusive = report.rows.iter().map(|r| r.inconclusive).sum();
}

/// f64 values as pairs of f32 (`hi`, `lo`, exact to about 1e-14 relative), so that the ranks'
/// shares of the objective cross the f32 collectives without losing the digits a difference needs.
fn split_f64(xs: &[f64]) -> Vec<f32> {
    xs.iter()
        .flat_map(|&x| {
            let hi = x as f32;
            let lo = if x.is_finite() {
                (x - f64::from(hi)) as f32
            } else {
                0.0
            };
            [hi, lo]
        })
        .collect()
}

fn join_f64(xs: &[f32]) -> Vec<f64> {
    xs.chunks_exact(2)
        .map(|p| f64::from(p[0]) + f64::from(p[1]))
        .collect()
}

/// Every rank's values: an all_gather over the world of this rank's (equal-length) list.
async fn gather_all<C: Communicator>(comm: &C, mine: Vec<f32>) -> Result<Vec<Vec<f32>>> {
    let n = mine.len();
    let t = Tensor::from_vec(mine, &[n])?;
    let all = comm.all_gather(&t, &comm.world()).await?;
    all.iter()
        .map(|t| t.read())
        .collect::<futures::future::TryJoinAll<_>>()
        .await
}

/// The whole check on any communicator: every rank of the world calls it with the same
/// options, inputs and function, and every rank gets the same report (the ranks' parts are
/// exchanged through the communicator itself: one all_gather, and one more for a second look).
/// This is what worker processes over the relay or direct links, and browser tabs, run.
pub async fn check_on<C, F>(comm: &C, o: &Options, inputs: &[CheckInput], f: &F) -> Result<Report>
where
    C: Communicator,
    F: AsyncFn(&C, &Tape, Vec<Var>) -> Result<Option<Var>>,
{
    let part = match rank_part(comm, o, inputs, f).await {
        Ok(p) => p,
        Err(e) => {
            // The others would wait for this rank's part.
            comm.abort(&e.to_string()).await;
            return Err(e);
        }
    };
    // One flat list per rank, the same length everywhere: base, evals (as f64 pairs), grads
    // (padded to the longest rank's: ranks may hold inputs of different sizes, which every rank
    // knows from `inputs`).
    let lens = |r: usize| -> Vec<usize> {
        inputs
            .iter()
            .map(|x| match x.values.get(r) {
                Some(t) if x.grad => t.numel(),
                _ => 0,
            })
            .collect()
    };
    let shares = 2 * (1 + part.evals.len());
    let width = (0..comm.world_size())
        .map(|r| lens(r).iter().sum::<usize>())
        .max()
        .unwrap_or(0);
    let mut flat = split_f64(&[part.base]);
    flat.extend(split_f64(&part.evals));
    for g in &part.grads {
        flat.extend_from_slice(g);
    }
    if flat.len() > shares + width {
        return Err(Error::Input(format!(
            "gradcheck: rank {}'s gradients have {} values, its inputs {width} at most",
            comm.rank(),
            flat.len() - shares
        )));
    }
    flat.resize(shares + width, 0.0);
    let parts: Vec<RankPart> = gather_all(comm, flat)
        .await?
        .into_iter()
        .enumerate()
        .map(|(r, v)| {
            let f = join_f64(&v[..shares]);
            let lens = lens(r);
            let mut grads = Vec::with_capacity(lens.len());
            let mut at = shares;
            for &n in &lens {
                grads.push(v[at..at + n].to_vec());
                at += n;
            }
            RankPart {
                base: f[0],
                evals: f[1..].to_vec(),
                grads,
            }
        })
        .collect();
    let mut report = assemble(o, inputs, &parts)?;
    // Every rank has the same parts, so the same list to look at again.
    let coords = to_refine(&report);
    if !coords.is_empty() {
        let evals = rank_refine(comm, o, inputs, &coords, refine_eps(o), f).await?;
        let all: Vec<Vec<f64>> = gather_all(comm, split_f64(&evals))
            .await?
            .iter()
            .map(|v| join_f64(v))
            .collect();
        apply_refine(&mut report, o, inputs, &coords, &all);
    }
    Ok(report)
}

/// Check `f`'s gradients on `world` in-process ranks (threads). `f` gets the communicator, the
/// tape and this rank's inputs as vars (in `inputs`' order) and returns this rank's loss (`None`:
/// this rank has none); it is called once with backward and once per perturbation.
#[cfg(not(target_arch = "wasm32"))]
pub fn gradcheck<F>(world: usize, o: &Options, inputs: &[CheckInput], f: F) -> Result<Report>
where
    F: AsyncFn(&crate::in_process::LocalComm, &Tape, Vec<Var>) -> Result<Option<Var>> + Sync,
{
    let f = &f;
    let results = crate::in_process::run_local(world, o.comm.clone(), |comm| async move {
        check_on(&comm, o, inputs, f).await
    });
    let mut reports = Vec::with_capacity(world);
    let mut errors = Vec::new();
    for (r, res) in results.into_iter().enumerate() {
        match res {
            Ok(p) => reports.push(p),
            Err(e) => errors.push(format!("rank {r}: {e}")),
        }
    }
    if !errors.is_empty() {
        return Err(Error::Input(format!(
            "gradcheck: the program failed:\n  {}",
            errors.join("\n  ")
        )));
    }
    let first = reports.swap_remove(0);
    // Compared as printed: a NaN gradient (a wrong dual's 0 / 0) is not equal to itself.
    let same = |r: &Report| format!("{r:?}") == format!("{first:?}");
    if !reports.iter().all(same) {
        return Err(Error::Input(
            "gradcheck: the ranks' reports differ (internal error)".into(),
        ));
    }
    Ok(first)
}

/// A number as the table prints it.
fn num(x: f64) -> String {
    if x == 0.0 {
        "0".into()
    } else if !(1e-3..1e4).contains(&x.abs()) {
        format!("{x:.2e}")
    } else {
        format!("{x:.6}")
    }
}

impl Report {
    /// The report as JSON (what `distgrad gradcheck --json` prints and the page's test API
    /// returns): the verdict, the point, how it was checked, one row per rank and input, the
    /// kinks and the directions. Numbers that are not finite are `null`.
    pub fn to_json(&self) -> serde_json::Value {
        use serde_json::json;
        let objective = match self.objective {
            Objective::SumOfRankLosses => "sum_of_rank_losses",
            Objective::Replicated => "replicated",
        };
        let mode = match &self.mode {
            Mode::Coordinates => json!({"kind": "coordinates"}),
            Mode::Directions { count, forced } => {
                json!({"kind": "directions", "count": count, "forced": forced})
            }
        };
        let rows: Vec<serde_json::Value> = self
            .rows
            .iter()
            .map(|r| {
                json!({"rank": r.rank, "input": r.input, "checked": r.checked,
                    "max_abs": r.max_abs, "max_rel": r.max_rel, "kinks": r.kinks,
                    "refined": r.refined, "inconclusive": r.inconclusive, "failed": r.failed,
                    "worst": r.worst.map(|(e, b, n)| json!({"elem": e, "backward": b, "numeric": n}))})
            })
            .collect();
        let kinks: Vec<serde_json::Value> = self
            .kinks
            .iter()
            .map(|k| {
                json!({"rank": k.rank, "input": k.input, "elem": k.elem,
                    "left": k.slopes.0, "right": k.slopes.1, "backward": k.backward,
                    "within": k.within})
            })
            .collect();
        let directions: Vec<serde_json::Value> = self
            .directions
            .iter()
            .map(|d| {
                json!({"direction": d.direction, "backward": d.backward, "numeric": d.numeric,
                    "pass": d.pass})
            })
            .collect();
        json!({"verdict": self.verdict(), "world": self.world, "objective": objective,
            "value": self.value, "mode": mode, "eps": self.eps, "rtol": self.rtol,
            "atol": self.atol, "evaluations": self.evaluations, "rows": rows, "kinks": kinks,
            "directions": directions})
    }

    /// The table `distgrad gradcheck` prints.
    pub fn render(&self) -> String {
        let mut s = String::new();
        let objective = self.objective.describe();
        let _ = writeln!(
            s,
            "gradcheck: {} rank(s), objective {objective}, F = {} (f32 evaluation, summed in f64)",
            self.world,
            num(self.value)
        );
        match &self.mode {
            Mode::Coordinates => {
                let _ = writeln!(
                    s,
                    "every coordinate of every rank's inputs: central differences at eps = {} and {} (4 runs of all ranks each; {} runs)",
                    self.eps,
                    self.eps / 2.0,
                    self.evaluations
                );
            }
            Mode::Directions { count, forced } => {
                let why = if *forced {
                    " (too many coordinates for one run each)"
                } else {
                    ""
                };
                let _ = writeln!(
                    s,
                    "{count} random directions v{why}: <grad F, v> from backward vs (F(x+eps v) - F(x-eps v)) / 2 eps, eps = {} ({} runs)",
                    self.eps, self.evaluations
                );
            }
        }
        let _ = writeln!(
            s,
            "pass: |numeric - backward| <= {} * max(1, |F|) + {} * |backward|\n",
            self.atol, self.rtol
        );
        if !self.rows.is_empty() {
            let header = [
                "rank",
                "input",
                "checked",
                "max abs err",
                "max rel err",
                "worst (elem: backward vs numeric)",
                "result",
            ];
            let rows: Vec<[String; 7]> = self
                .rows
                .iter()
                .map(|r| {
                    [
                        r.rank.to_string(),
                        r.input.clone(),
                        r.checked.to_string(),
                        num(r.max_abs),
                        num(r.max_rel),
                        r.worst
                            .map(|(e, b, n)| format!("[{e}]: {} vs {}", num(b), num(n)))
                            .unwrap_or_else(|| "-".into()),
                        match (r.failed, r.inconclusive, r.kinks, r.refined) {
                            (0, 0, 0, 0) => "PASS".into(),
                            (0, 0, k, 0) => format!("PASS ({k} at a kink)"),
                            (0, 0, 0, n) => format!("PASS ({n} at eps/16)"),
                            (0, 0, k, n) => format!("PASS ({k} at a kink, {n} at eps/16)"),
                            (0, i, _, _) => format!("INCONCLUSIVE ({i})"),
                            (f, _, _, _) => format!("FAIL ({f})"),
                        },
                    ]
                })
                .collect();
            table(&mut s, &header, &rows);
        }
        if !self.directions.is_empty() {
            let header = [
                "direction",
                "backward <grad F, v>",
                "numeric",
                "abs err",
                "result",
            ];
            let rows: Vec<[String; 5]> = self
                .directions
                .iter()
                .map(|d| {
                    [
                        d.direction.to_string(),
                        num(d.backward),
                        num(d.numeric),
                        num((d.numeric - d.backward).abs()),
                        if d.pass { "PASS" } else { "FAIL" }.into(),
                    ]
                })
                .collect();
            table(&mut s, &header, &rows);
        }
        if !self.kinks.is_empty() {
            let _ = writeln!(
                s,
                "\nnot differentiable at {} coordinate(s) (one-sided slopes differ; backward must lie between them):",
                self.kinks.len()
            );
            for k in self.kinks.iter().take(20) {
                let _ = writeln!(
                    s,
                    "  rank {} {}[{}]: slopes {} (left) / {} (right), backward {} {}",
                    k.rank,
                    k.input,
                    k.elem,
                    num(k.slopes.0),
                    num(k.slopes.1),
                    num(k.backward),
                    if k.within {
                        "(within)"
                    } else {
                        "(OUTSIDE: FAIL)"
                    }
                );
            }
            if self.kinks.len() > 20 {
                let _ = writeln!(s, "  ... and {} more", self.kinks.len() - 20);
            }
        }
        let refined: usize = self.rows.iter().map(|r| r.refined).sum();
        if refined > 0 {
            let _ = writeln!(
                s,
                "\n{refined} coordinate(s) disagreed at eps but agree at eps/16 = {}: a point where the function is not differentiable lies within eps of them",
                self.eps / 16.0
            );
        }
        if self.passed && self.inconclusive > 0 {
            let _ = writeln!(
                s,
                "\n{} kink(s) where backward is not between the one-sided slopes: at a tie of max / min across ranks the objective is not differentiable and a check per coordinate cannot confirm the subgradient backward chose (distgrad splits ties equally); check at a point without ties (other values or seeds)",
                self.inconclusive
            );
        }
        let _ = writeln!(s, "\n{}", self.verdict());
        s
    }
}

fn table<const N: usize>(s: &mut String, header: &[&str; N], rows: &[[String; N]]) {
    s.push_str(&crate::vjp::text_table(header, rows));
}

/// The check's inputs for a program: its inputs with the values of `plan`.
pub fn program_inputs(plan: &crate::program::Plan) -> Vec<CheckInput> {
    let p = plan.program();
    p.inputs
        .iter()
        .enumerate()
        .map(|(i, inp)| CheckInput {
            name: inp.name.clone(),
            values: (0..plan.world())
                .map(|r| plan.inputs(r)[i].clone())
                .collect(),
            grad: inp.grad,
            replicated: inp.replicated,
        })
        .collect()
}

/// Check a program's gradients on any communicator (every rank of the program's world calls
/// this; every rank gets the report).
pub async fn check_program_on<C: Communicator>(
    comm: &C,
    plan: &crate::program::Plan,
    o: &Options,
) -> Result<Report> {
    let o = Options {
        objective: plan.program().objective.objective(),
        ..o.clone()
    };
    let inputs = program_inputs(plan);
    check_on(
        comm,
        &o,
        &inputs,
        &async |comm: &C, tape: &Tape, xs: Vec<Var>| {
            crate::program::forward(comm, tape, plan, &xs).await
        },
    )
    .await
}

/// Check a program's gradients on its world of in-process ranks.
#[cfg(not(target_arch = "wasm32"))]
pub fn gradcheck_program(plan: &crate::program::Plan, o: &Options) -> Result<Report> {
    let o = Options {
        objective: plan.program().objective.objective(),
        ..o.clone()
    };
    let inputs = program_inputs(plan);
    gradcheck(plan.world(), &o, &inputs, async |comm, tape, xs| {
        crate::program::forward(comm, tape, plan, &xs).await
    })
}
