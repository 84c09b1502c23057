//! Lessons of the teaching demo, as data (`www/lessons/<name>.json`), and the program each one runs.
//!
//! A lesson runs on every rank of a group (browser tabs, simulated ranks in one page, or
//! `distgrad run` in a terminal) and produces a [`Trace`]: a list of steps, each with the messages
//! drawn as arrows between ranks and every rank's values at that step. The page animates the trace;
//! `distgrad run` prints it. Both run the same code here, so they show the same numbers.
//!
//! Lesson JSON:
//! ```text
//! {"name": "all_gather", "title": "...", "why": "one or two sentences",
//!  "kind": "collective" | "objectives" | "data_parallel" | "tensor_parallel" | "pipeline_parallel",
//!  "collective": "all_gather", "op": "max", "root": 1,      (kind collective; op/root where used;
//!                                                           the last rank is root in smaller worlds)
//!  "world": 3,                                              (default world of `distgrad run`)
//!  "steps": 20, "lr": 0.3}                                  (kind data_parallel)
//! ```
//! - `collective`: inputs x → forward (arrows of the collective) → cotangents → backward (the same
//!   arrows reversed, and the name of the collective the backward pass really ran) → gradients.
//!   The inputs are those of `distgrad vjp`'s example; a rank may replace its own (same shape).
//! - `objectives`: `s = all_reduce(SUM, x)`, `loss = 0.5·sum(s²)` differentiated under both
//!   objective conventions: the gradients differ by exactly the world size N.
//! - `data_parallel`: linear regression, one data shard per rank, gradients averaged with
//!   all_reduce(AVG) each step; per step the loss of this rank and of the group, the weights and a
//!   hash of them (equal on every rank: the replicas stay identical).
//! - `tensor_parallel`: `Y = X·W` with the rows of X and the columns of W sharded across ranks:
//!   all_gather forward, and the backward pass runs reduce_scatter.
//! - `pipeline_parallel`: rank r is stage r of a chain `h_r = tanh(w_r ⊙ h_{r−1})` (`h_{−1}` = x on
//!   rank 0), each stage sending its activation on to the next; the last stage's loss is
//!   `0.5·sum(h²)`. Backward goes stage by stage the other way: each send's dual is a recv of the
//!   activation's gradient from the next stage, each recv's dual a send of the input's gradient
//!   back to the previous one.

use serde::{Deserialize, Serialize};

use crate::autograd::{Objective, Tape, Var};
use crate::collective::{Communicator, Kind, P2p, ReduceOp};
use crate::dist;
use crate::error::{Error, Result};
use crate::tensor::Tensor;
use crate::transport::Transport;
use crate::vjp::{self, Prepared, TensorJson};

/// What a lesson is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LessonKind {
    /// One collective forward and backward.
    Collective,
    /// The two objective conventions (sum of rank losses vs replicated loss).
    Objectives,
    /// Data-parallel training with all_reduce(AVG) of the gradients.
    DataParallel,
    /// A linear layer sharded across ranks (all_gather forward, reduce_scatter backward).
    TensorParallel,
    /// A chain of stages, one per rank (send forward, recv backward).
    PipelineParallel,
}

/// A lesson file: see the module docs.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Lesson {
    /// File name without `.json`.
    pub name: String,
    /// Heading.
    pub title: String,
    /// One or two sentences: why the backward pass is what it is.
    pub why: String,
    /// The program.
    pub kind: LessonKind,
    /// Collective name (kind `collective`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub collective: Option<String>,
    /// Reduce op.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub op: Option<String>,
    /// Root.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub root: Option<usize>,
    /// Default world size for `distgrad run`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub world: Option<usize>,
    /// Training steps (data_parallel; default 20).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub steps: Option<usize>,
    /// Learning rate (data_parallel; default 0.3).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lr: Option<f32>,
}

/// A named value a rank holds at a step: tensors, or a text (a hash).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Named {
    /// Name as shown (`x`, `y`, `dL/dx`, ...).
    pub name: String,
    /// Values (empty when `text` is set or the rank has none).
    #[serde(default)]
    pub tensors: Vec<TensorJson>,
    /// A text value instead of tensors.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub text: Option<String>,
}

impl Named {
    fn tensors(name: &str, tensors: Vec<TensorJson>) -> Self {
        Named {
            name: name.into(),
            tensors,
            text: None,
        }
    }

    fn text(name: &str, text: String) -> Self {
        Named {
            name: name.into(),
            tensors: Vec::new(),
            text: Some(text),
        }
    }

    /// The value as the page and the terminal print it.
    pub fn show(&self) -> String {
        match &self.text {
            Some(t) => t.clone(),
            None if self.tensors.is_empty() => "-".into(),
            None => self
                .tensors
                .iter()
                .map(vjp::fmt_t)
                .collect::<Vec<_>>()
                .join(" "),
        }
    }
}

/// The stage a step belongs to (colours the arrows).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    /// Starting values.
    Input,
    /// Forward pass.
    Forward,
    /// Cotangents seeded.
    Cotangent,
    /// Backward pass.
    Backward,
    /// A training step (forward, backward, all_reduce, update).
    Train,
    /// A conclusion.
    Result,
}

/// One step of one rank.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RankStep {
    /// What happens.
    pub label: String,
    /// Stage.
    pub phase: Phase,
    /// Collective that ran at this step, as recorded by the communicator (e.g. `reduce_scatter(op=sum)`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub collective: Option<String>,
    /// Messages as (from, to) ranks.
    pub arrows: Vec<(usize, usize)>,
    /// This rank's values.
    pub values: Vec<Named>,
}

/// One rank's trace of a lesson.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RankTrace {
    /// The rank.
    pub rank: usize,
    /// Its steps.
    pub steps: Vec<RankStep>,
}

/// One step of the whole group.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Step {
    /// What happens.
    pub label: String,
    /// Stage.
    pub phase: Phase,
    /// Collective that ran.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub collective: Option<String>,
    /// Messages as (from, to) ranks.
    pub arrows: Vec<(usize, usize)>,
    /// Every rank's values, index = rank.
    pub ranks: Vec<Vec<Named>>,
}

/// A lesson's trace: what the page shows and `distgrad run` prints.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Trace {
    /// Lesson name.
    pub lesson: String,
    /// Heading.
    pub title: String,
    /// Why the backward pass is what it is.
    pub why: String,
    /// World size.
    pub world: usize,
    /// The steps.
    pub steps: Vec<Step>,
}

/// Parse a lesson file's text.
pub fn parse(json: &str) -> Result<Lesson> {
    let l: Lesson =
        serde_json::from_str(json).map_err(|e| Error::Input(format!("lesson JSON: {e}")))?;
    if l.kind == LessonKind::Collective {
        let which = vjp::parse_collective(l.collective.as_deref().unwrap_or(""))?;
        if let Some(op) = &l.op {
            ReduceOp::parse(op)?;
        }
        if l.op.is_some() && !which.takes_op() {
            return Err(Error::Input(format!("{} takes no op", which.name())));
        }
    }
    Ok(l)
}

/// Forward messages of a collective over `world` ranks (the logical data movement).
pub fn arrows(
    which: Kind,
    world: usize,
    root: usize,
    perm: &[(usize, usize)],
) -> Vec<(usize, usize)> {
    let all = || {
        (0..world)
            .flat_map(|a| (0..world).filter(move |&b| b != a).map(move |b| (a, b)))
            .collect()
    };
    match which {
        Kind::Broadcast | Kind::Scatter => (0..world)
            .filter(|&r| r != root)
            .map(|r| (root, r))
            .collect(),
        Kind::Reduce | Kind::Gather => (0..world)
            .filter(|&r| r != root)
            .map(|r| (r, root))
            .collect(),
        Kind::AllGather
        | Kind::ReduceScatter
        | Kind::AllToAll
        | Kind::AllToAllSingle
        | Kind::AllReduce
        | Kind::Barrier => all(),
        Kind::Permute => perm.iter().copied().filter(|(a, b)| a != b).collect(),
        // Each rank names its own peer: no one picture for the world.
        Kind::Send => Vec::new(),
    }
}

fn reversed(a: &[(usize, usize)]) -> Vec<(usize, usize)> {
    a.iter().map(|&(x, y)| (y, x)).collect()
}

fn step(label: String, phase: Phase, arrows: Vec<(usize, usize)>, values: Vec<Named>) -> RankStep {
    RankStep {
        label,
        phase,
        collective: None,
        arrows,
        values,
    }
}

async fn read(t: &Tensor) -> Result<TensorJson> {
    TensorJson::read(t).await
}

fn duals<T: Transport>(comm: &P2p<T>) -> Option<String> {
    Some(ran(comm).unwrap_or_else(|| "nothing".into()))
}

/// The collective lesson's case for `world` ranks (`distgrad vjp`'s example).
pub async fn lesson_case(lesson: &Lesson, world: usize) -> Result<vjp::Case> {
    let which = vjp::parse_collective(lesson.collective.as_deref().unwrap_or(""))?;
    let op = ReduceOp::parse(lesson.op.as_deref().unwrap_or("sum"))?;
    // A lesson works with any number of tabs: in a world too small for its root, the last rank is
    // the root.
    let root = lesson.root.unwrap_or(0).min(world.saturating_sub(1));
    vjp::example_case_async(
        which,
        world,
        op,
        if which.takes_root() { root } else { 0 },
        None,
    )
    .await
}

/// Run this rank's part of `lesson` on `comm` (which must record calls: [`vjp::case_options`]).
/// `own_input` replaces this rank's input in a collective lesson (same shapes).
pub async fn run_rank<T: Transport>(
    comm: &P2p<T>,
    lesson: &Lesson,
    own_input: Option<Vec<TensorJson>>,
) -> Result<RankTrace> {
    let me = comm.rank();
    comm.take_calls();
    let steps = match lesson.kind {
        LessonKind::Collective => collective(comm, lesson, own_input).await?,
        LessonKind::Objectives => objectives(comm).await?,
        LessonKind::DataParallel => data_parallel(comm, lesson).await?,
        LessonKind::TensorParallel => tensor_parallel(comm).await?,
        LessonKind::PipelineParallel => pipeline_parallel(comm).await?,
    };
    Ok(RankTrace { rank: me, steps })
}

async fn collective<T: Transport>(
    comm: &P2p<T>,
    lesson: &Lesson,
    own_input: Option<Vec<TensorJson>>,
) -> Result<Vec<RankStep>> {
    let me = comm.rank();
    let world = comm.world_size();
    let mut case = lesson_case(lesson, world).await?;
    if let Some(x) = own_input {
        let want: Vec<&Vec<usize>> = case.inputs[me].iter().map(|t| &t.shape).collect();
        let got: Vec<&Vec<usize>> = x.iter().map(|t| &t.shape).collect();
        if want != got {
            return Err(Error::Input(format!(
                "rank {me}: edited input has shapes {got:?}, the lesson needs {want:?}"
            )));
        }
        case.inputs[me] = x;
    }
    let which = vjp::parse_collective(&case.collective)?;
    let perm = case.perm.clone().unwrap_or_default();
    let fwd = arrows(which, world, case.root.unwrap_or(0), &perm);
    let mut name = which.name().to_string();
    let mut args = Vec::new();
    if let Some(op) = &case.op {
        args.push(format!("op={op}"));
    }
    if let Some(r) = case.root {
        args.push(format!("root={r}"));
    }
    if !args.is_empty() {
        name = format!("{name}({})", args.join(", "));
    }
    let r = vjp::run_rank(comm, &Prepared::new(&case)?).await?;
    let cot = case
        .cotangents
        .as_ref()
        .map(|c| c[me].clone())
        .unwrap_or_default();
    let dual = if r.dual.is_empty() {
        "nothing".to_string()
    } else {
        r.dual.join(" + ")
    };
    let mut f = step(
        format!("forward: {name}"),
        Phase::Forward,
        fwd.clone(),
        vec![Named::tensors("y", r.outputs)],
    );
    f.collective = Some(name);
    let mut b = step(
        format!("backward: {dual}"),
        Phase::Backward,
        reversed(&fwd),
        vec![Named::tensors("dL/dx", r.grads)],
    );
    b.collective = Some(dual);
    Ok(vec![
        step(
            "inputs".into(),
            Phase::Input,
            Vec::new(),
            vec![Named::tensors("x", case.inputs[me].clone())],
        ),
        f,
        step(
            "cotangents dL/dy".into(),
            Phase::Cotangent,
            Vec::new(),
            vec![Named::tensors("dL/dy", cot)],
        ),
        b,
    ])
}

async fn objectives<T: Transport>(comm: &P2p<T>) -> Result<Vec<RankStep>> {
    let me = comm.rank();
    let n = comm.world_size();
    let device = comm.options().device.clone();
    let group = comm.world();
    let x0 = Tensor::from_vec(vec![me as f32 + 1.0, 2.0], &[2])?.to_device(&device)?;
    let all = arrows(Kind::AllReduce, n, 0, &[]);
    let mut out = vec![step(
        "inputs".into(),
        Phase::Input,
        Vec::new(),
        vec![Named::tensors("x", vec![read(&x0).await?])],
    )];
    let mut grads = Vec::new();
    for objective in [Objective::SumOfRankLosses, Objective::Replicated] {
        let tape = Tape::with_objective(objective);
        let x = tape.var(x0.clone());
        let s = dist::all_reduce(comm, &x, ReduceOp::Sum, &group).await?;
        comm.take_calls();
        let loss = s.square()?.sum()?.scale(0.5)?;
        if objective == Objective::SumOfRankLosses {
            let mut f = step(
                "forward: s = all_reduce(SUM, x); loss = 0.5·sum(s²)".into(),
                Phase::Forward,
                all.clone(),
                vec![
                    Named::tensors("s", vec![read(&s.value()).await?]),
                    Named::tensors("loss", vec![read(&loss.value()).await?]),
                ],
            );
            f.collective = Some("all_reduce(op=sum)".into());
            out.push(f);
        }
        let g = tape.backward(&loss, comm).await?.wrt(&x)?;
        let dual = duals(comm);
        let (label, arrows) = match objective {
            Objective::SumOfRankLosses => (
                "backward, objective = SUM of every rank's loss: dL/dx = N·s",
                reversed(&all),
            ),
            Objective::Replicated => (
                "backward, objective = the ONE replicated loss: dL/dx = s",
                Vec::new(),
            ),
        };
        let mut b = step(
            format!("{label} (ran: {})", dual.clone().unwrap_or_default()),
            Phase::Backward,
            arrows,
            vec![Named::tensors("dL/dx", vec![read(&g).await?])],
        );
        b.collective = dual;
        out.push(b);
        grads.push(g);
    }
    let ratio = grads[0].div(&grads[1])?;
    out.push(step(
        format!("the two gradients differ by the factor N = {n}"),
        Phase::Result,
        Vec::new(),
        vec![Named::tensors("ratio", vec![read(&ratio).await?])],
    ));
    Ok(out)
}

/// Samples per rank in the data-parallel lesson.
const SHARD: usize = 8;

async fn data_parallel<T: Transport>(comm: &P2p<T>, lesson: &Lesson) -> Result<Vec<RankStep>> {
    let me = comm.rank();
    let n = comm.world_size();
    let steps = lesson.steps.unwrap_or(20).clamp(1, 1000);
    let lr = lesson.lr.unwrap_or(0.3);
    let device = comm.options().device.clone();
    let group = comm.world();
    // This rank's shard: x uniform in [-1, 1)², y = 2·x0 - x1 + 0.5 + small noise.
    let xs = crate::train::uniform(1 + me as u64, SHARD * 2);
    let noise = crate::train::uniform(1000 + me as u64, SHARD);
    let ys: Vec<f32> = (0..SHARD)
        .map(|i| 2.0 * xs[2 * i] - xs[2 * i + 1] + 0.5 + 0.05 * noise[i])
        .collect();
    let x = Tensor::from_vec(xs, &[SHARD, 2])?.to_device(&device)?;
    let y = Tensor::from_vec(ys, &[SHARD, 1])?.to_device(&device)?;
    let mut w = vec![0.0f32; 3]; // w0, w1, b
    let all = arrows(Kind::AllReduce, n, 0, &[]);
    let mut out = vec![step(
        format!("rank {me} holds {SHARD} samples of y = 2·x₀ − x₁ + 0.5 (+ noise); w = 0"),
        Phase::Input,
        Vec::new(),
        vec![
            Named::tensors("w", vec![TensorJson::read(&Tensor::vector(&w)).await?]),
            Named::text("replica hash", crate::train::param_hash(&w)),
        ],
    )];
    for k in 1..=steps {
        let tape = Tape::new();
        let wv = tape.var(Tensor::from_vec(w[..2].to_vec(), &[2, 1])?.to_device(&device)?);
        let bv = tape.var(Tensor::from_vec(vec![w[2]], &[1])?.to_device(&device)?);
        let xv = tape.constant(x.clone());
        let yv = tape.constant(y.clone());
        let loss = xv.matmul(&wv)?.add(&bv)?.mse_loss(&yv)?;
        let grads = tape.backward(&loss, comm).await?;
        let g = Tensor::concat(&[grads.wrt(&wv)?.reshape(&[2])?, grads.wrt(&bv)?], 0)?;
        // Average the gradients over the ranks: every replica takes the same step.
        let g = comm.all_reduce(&g, ReduceOp::Avg, &group).await?;
        let group_loss = comm
            .all_reduce(&loss.value(), ReduceOp::Avg, &group)
            .await?;
        comm.take_calls();
        let g = g.read().await?;
        for (wi, gi) in w.iter_mut().zip(&g) {
            *wi -= lr * gi;
        }
        out.push(step(
            format!("step {k}: local gradient, all_reduce(AVG), w -= {lr}·g"),
            Phase::Train,
            all.clone(),
            vec![
                Named::tensors("loss", vec![read(&loss.value()).await?]),
                Named::tensors("group loss", vec![read(&group_loss).await?]),
                Named::tensors("w", vec![TensorJson::read(&Tensor::vector(&w)).await?]),
                Named::text("replica hash", crate::train::param_hash(&w)),
            ],
        ));
    }
    Ok(out)
}

async fn tensor_parallel<T: Transport>(comm: &P2p<T>) -> Result<Vec<RankStep>> {
    let me = comm.rank();
    let n = comm.world_size();
    let device = comm.options().device.clone();
    let group = comm.world();
    let rf = me as f32;
    // X is n×2 with row r on rank r; W is 2×n with column r on rank r.
    let x_r = Tensor::from_vec(vec![rf + 1.0, 1.0 - rf], &[1, 2])?.to_device(&device)?;
    let w_r = Tensor::from_vec(vec![1.0, rf + 1.0], &[2, 1])?.to_device(&device)?;
    let all = arrows(Kind::AllGather, n, 0, &[]);
    let tape = Tape::new();
    let xv = tape.var(x_r.clone());
    let wv = tape.var(w_r.clone());
    let mut out = vec![step(
        "inputs: row r of X and column r of W on rank r".into(),
        Phase::Input,
        Vec::new(),
        vec![
            Named::tensors("X_r", vec![read(&x_r).await?]),
            Named::tensors("W_r", vec![read(&w_r).await?]),
        ],
    )];
    let rows = dist::all_gather(comm, &xv, &group).await?;
    let full = Var::concat(&rows, 0)?;
    let mut f = step(
        "forward: X = all_gather(X_r)".into(),
        Phase::Forward,
        all.clone(),
        vec![Named::tensors("X", vec![read(&full.value()).await?])],
    );
    f.collective = duals(comm);
    out.push(f);
    let y = full.matmul(&wv)?;
    let loss = y.square()?.sum()?.scale(0.5)?;
    out.push(step(
        "forward (local): Y_r = X·W_r, loss_r = 0.5·sum(Y_r²)".into(),
        Phase::Forward,
        Vec::new(),
        vec![
            Named::tensors("Y_r", vec![read(&y.value()).await?]),
            Named::tensors("loss_r", vec![read(&loss.value()).await?]),
        ],
    ));
    let grads = tape.backward(&loss, comm).await?;
    let dual = duals(comm);
    let mut b = step(
        format!(
            "backward: dL/dX_r = {} of the per-rank dY_r·W_rᵀ",
            dual.clone().unwrap_or_default()
        ),
        Phase::Backward,
        reversed(&all),
        vec![
            Named::tensors("dL/dX_r", vec![read(&grads.wrt(&xv)?).await?]),
            Named::tensors("dL/dW_r", vec![read(&grads.wrt(&wv)?).await?]),
        ],
    );
    b.collective = dual;
    out.push(b);
    Ok(out)
}

/// The calls this rank's communicator recorded since the last look, in order.
fn recorded<T: Transport>(comm: &P2p<T>) -> Vec<String> {
    comm.take_calls()
        .iter()
        .map(|(_, s)| vjp::short_sig(s))
        .collect()
}

/// [`recorded`] as one text (`send/recv + send/recv`), or `None` when nothing ran.
fn ran<T: Transport>(comm: &P2p<T>) -> Option<String> {
    let calls = recorded(comm);
    (!calls.is_empty()).then(|| calls.join(" + "))
}

/// The pipeline lesson (see the module docs): one step per stage forward, the loss, one step per
/// stage backward. Every rank reports the same names at a step; the rank whose stage it is fills
/// them in (the others show `-`). The point-to-point calls each rank's communicator recorded are
/// in its values (`ran`, `backward ran`), and the backward steps name what the backward pass ran.
async fn pipeline_parallel<T: Transport>(comm: &P2p<T>) -> Result<Vec<RankStep>> {
    let me = comm.rank();
    let n = comm.world_size();
    let last = n - 1;
    let device = comm.options().device.clone();
    let group = comm.world();
    let rf = me as f32;
    let x = Tensor::vector(&[1.0, -2.0]).to_device(&device)?;
    let w = Tensor::vector(&[1.0 - 0.25 * rf, 0.5 + 0.25 * rf]).to_device(&device)?;
    let tape = Tape::new();
    let wv = tape.var(w.clone());
    let input_name = |s: usize| {
        if s == 0 {
            "x".to_string()
        } else {
            format!("h{}", s - 1)
        }
    };
    // A value shown only by the rank whose stage it is.
    let blank = |name: &str| Named::tensors(name, Vec::new());
    let mut out = vec![step(
        format!(
            "inputs: stage r (rank r) holds its weights w_r; the data x starts on stage 0; {n} stages"
        ),
        Phase::Input,
        Vec::new(),
        vec![
            if me == 0 {
                Named::tensors("x", vec![read(&x).await?])
            } else {
                blank("x")
            },
            Named::tensors("w_r", vec![read(&w).await?]),
        ],
    )];
    // Forward: stage s receives its input (sent in the step before), computes, sends it on.
    let mut mine = None;
    for s in 0..n {
        let received = format!("{} (received)", input_name(s));
        let mut values = Vec::new();
        if s == me {
            let xin = if me == 0 {
                tape.constant(x.clone())
            } else {
                dist::recv(comm, &tape, &[2], me - 1, &group)
                    .await?
                    .to_device(&device)?
            };
            let hv = wv.mul(&xin)?.tanh()?;
            if me < last {
                dist::send(comm, &hv, me + 1, &group).await?;
            }
            if me > 0 {
                values.push(Named::tensors(&received, vec![read(&xin.value()).await?]));
            }
            values.push(Named::tensors(
                &format!("h{s}"),
                vec![read(&hv.value()).await?],
            ));
            values.push(match ran(comm) {
                Some(r) => Named::text("ran", r),
                None => blank("ran"),
            });
            mine = Some((xin, hv));
        } else {
            if s > 0 {
                values.push(blank(&received));
            }
            values.extend([blank(&format!("h{s}")), blank("ran")]);
        }
        let label = if s < last {
            format!(
                "forward, stage {s}: h{s} = tanh(w{s} ⊙ {}), sent to stage {}",
                input_name(s),
                s + 1
            )
        } else {
            format!("forward, stage {s}: h{s} = tanh(w{s} ⊙ {})", input_name(s))
        };
        let arrows = if s < last {
            vec![(s, s + 1)]
        } else {
            Vec::new()
        };
        out.push(step(label, Phase::Forward, arrows, values));
    }
    let (input, h) =
        mine.ok_or_else(|| Error::Input(format!("rank {me}: its stage did not run")))?;
    let loss = h.square()?.sum()?.scale(0.5)?;
    out.push(step(
        format!("the loss, on the last stage: L = 0.5·sum(h{last}²)"),
        Phase::Forward,
        Vec::new(),
        vec![if me == last {
            Named::tensors("L", vec![read(&loss.value()).await?])
        } else {
            blank("L")
        }],
    ));
    // Backward: the last stage starts from its loss; the others from nothing of their own (the
    // duals of their sends bring their gradients in).
    let grads = if me == last {
        tape.backward(&loss, comm).await?
    } else {
        tape.backward_from(&[], comm).await?
    };
    // What this rank's backward ran, in order: the dual of its send (a recv from the next stage,
    // at boundary me+1), then the dual of its recv (a send to the previous one, at boundary me).
    let calls = recorded(comm);
    let expected = usize::from(me < last) + usize::from(me > 0);
    if calls.len() != expected {
        return Err(Error::Input(format!(
            "rank {me}: the backward pass ran {calls:?}, expected {expected} point-to-point calls"
        )));
    }
    let ran_at = |boundary: usize| -> Option<String> {
        if me < last && boundary == me + 1 {
            calls.first().cloned()
        } else if me > 0 && boundary == me {
            calls.last().cloned()
        } else {
            None
        }
    };
    let dh = read(&grads.wrt(&h)?).await?;
    let dw = read(&grads.wrt(&wv)?).await?;
    let din = read(&grads.wrt(&input)?).await?;
    if n == 1 {
        let mut b = step(
            "backward, stage 0 (the only one): dL/dh0 = h0, dL/dw0 = dL/dh0 ⊙ (1 − h0²) ⊙ x".into(),
            Phase::Backward,
            Vec::new(),
            vec![
                Named::tensors("dL/dh0", vec![dh]),
                Named::tensors("dL/dw0", vec![dw]),
            ],
        );
        b.collective = Some("nothing".into());
        out.push(b);
        return Ok(out);
    }
    // One step per boundary, from the last stage down: stage s computes its gradients and sends
    // dL/dh_{s−1} back; stage s−1 receives it (and stage 0, the last to, finishes dL/dw0).
    for s in (1..n).rev() {
        let p = s - 1;
        let (gs, ws, gp) = (
            format!("dL/dh{s}"),
            format!("dL/dw{s}"),
            format!("dL/dh{p}"),
        );
        let own = |name: &str, t: &TensorJson, mine: bool| {
            if mine {
                Named::tensors(name, vec![t.clone()])
            } else {
                blank(name)
            }
        };
        let mut values = vec![
            own(&gs, &dh, me == s),
            own(&ws, &dw, me == s),
            // Sent by stage s, received by stage s−1: the same numbers on both ends.
            if me == s {
                Named::tensors(&gp, vec![din.clone()])
            } else {
                own(&gp, &dh, me == p)
            },
        ];
        if p == 0 {
            values.push(own("dL/dw0", &dw, me == 0));
        }
        let ran = ran_at(s);
        values.push(match &ran {
            Some(c) => Named::text("backward ran", c.clone()),
            None => blank("backward ran"),
        });
        let head = if s == last {
            format!("dL/dh{s} = h{s} (from the loss)")
        } else {
            format!("dL/dh{s} came from stage {}", s + 1)
        };
        let mut label = format!(
            "backward, stage {s} → {p}: {head}; dL/dw{s} = dL/dh{s} ⊙ (1 − h{s}²) ⊙ h{p}; \
             dL/dh{p} = dL/dh{s} ⊙ (1 − h{s}²) ⊙ w{s} goes back: stage {s}'s recv runs its \
             dual, a send, and stage {p}'s send its dual, a recv"
        );
        if p == 0 {
            label.push_str("; stage 0 finishes dL/dw0 = dL/dh0 ⊙ (1 − h0²) ⊙ x");
        }
        let mut b = step(label, Phase::Backward, vec![(s, p)], values);
        b.collective = ran;
        out.push(b);
    }
    Ok(out)
}

/// Put the ranks' traces (index = rank) together; every rank must have run the same steps. A step
/// takes rank 0's label, arrows and collective (or, where rank 0 names none, the first rank's that
/// does: in a pipeline only two stages take part in a step).
pub fn assemble(lesson: &Lesson, traces: Vec<RankTrace>) -> Result<Trace> {
    let world = traces.len();
    let first = traces
        .first()
        .ok_or_else(|| Error::Input("no rank traces".into()))?;
    let mut steps: Vec<Step> = first
        .steps
        .iter()
        .map(|s| Step {
            label: s.label.clone(),
            phase: s.phase,
            collective: s.collective.clone(),
            arrows: s.arrows.clone(),
            ranks: Vec::with_capacity(world),
        })
        .collect();
    for (r, t) in traces.into_iter().enumerate() {
        if t.rank != r || t.steps.len() != steps.len() {
            return Err(Error::Input(format!(
                "rank {r}'s trace (rank {}, {} steps) does not match rank 0's ({} steps)",
                t.rank,
                t.steps.len(),
                steps.len()
            )));
        }
        for (s, rs) in steps.iter_mut().zip(t.steps) {
            // A step where only some ranks communicate names what the first of them recorded.
            if s.collective.is_none() {
                s.collective = rs.collective;
            }
            s.ranks.push(rs.values);
        }
    }
    Ok(Trace {
        lesson: lesson.name.clone(),
        title: lesson.title.clone(),
        why: lesson.why.clone(),
        world,
        steps,
    })
}

/// Run `lesson` on `world` ranks simulated in this process (interleaved on this task: the page's
/// single-tab mode and `distgrad run`). `inputs[r]`, where given, replaces rank r's input.
pub async fn run_simulated(
    lesson: &Lesson,
    world: usize,
    device: &crate::backend::Device,
    inputs: &[Option<Vec<TensorJson>>],
) -> Result<Trace> {
    if world == 0 || world > vjp::MAX_WORLD {
        return Err(Error::Input(format!(
            "world must be 1..={}, got {world}",
            vjp::MAX_WORLD
        )));
    }
    let opts = crate::collective::CommOptions {
        device: device.clone(),
        ..vjp::case_options()
    };
    let results = crate::run::run_interleaved(world, opts, |comm| async move {
        let own = inputs.get(comm.rank()).cloned().flatten();
        run_rank(&comm, lesson, own).await
    })
    .await;
    let mut traces = Vec::with_capacity(world);
    for (r, t) in results.into_iter().enumerate() {
        traces.push(t.map_err(|e| Error::Input(format!("rank {r}: {e}")))?);
    }
    assemble(lesson, traces)
}

/// The trace as text, one block per step (what `distgrad run` prints).
pub fn render(trace: &Trace) -> String {
    let mut s = format!(
        "lesson {}: {} (world {})\nwhy: {}\n",
        trace.lesson, trace.title, trace.world, trace.why
    );
    for (i, st) in trace.steps.iter().enumerate() {
        s.push_str(&format!("\nstep {i} [{:?}] {}\n", st.phase, st.label));
        if !st.arrows.is_empty() {
            // Wrapped at about 100 columns (an all_to_all of 64 ranks has 4032 arrows).
            let mut line = String::from("  messages:");
            for (x, y) in &st.arrows {
                let a = format!(" {x}→{y}");
                if line.chars().count() + a.chars().count() > 100 {
                    s.push_str(&line);
                    s.push('\n');
                    line = " ".repeat("  messages:".len());
                }
                line.push_str(&a);
            }
            s.push_str(&line);
            s.push('\n');
        }
        for (r, vals) in st.ranks.iter().enumerate() {
            let v: Vec<String> = vals
                .iter()
                .map(|n| format!("{} = {}", n.name, n.show()))
                .collect();
            s.push_str(&format!("  rank {r}: {}\n", v.join(", ")));
        }
    }
    s
}
