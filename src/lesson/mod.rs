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
//!  "kind": "collective" | "program",
//!  "collective": "all_gather", "op": "max", "root": 1,      (kind collective; op/root where used;
//!                                                           the last rank is root in smaller worlds)
//!  "world": 3,                                              (default world of `distgrad run`)
//!  "steps": 20, "lr": 0.3,                    (kind program: train it data-parallel)
//!  "compare_objectives": true,             (kind program: differentiate it under both objectives)
//!  "program": {...}}                                        (kind program: a program's JSON)
//! ```
//! - `collective`: inputs x → forward (arrows of the collective) → cotangents → backward (the same
//!   arrows reversed, and the name of the collective the backward pass really ran) → gradients.
//!   The inputs are those of `distgrad vjp`'s example; a rank may replace its own (same shape).
//! - `program`: any program ([`crate::program`]): the inputs, each step's result on every rank
//!   (a collective's messages drawn), the gradient of the global objective with respect to each
//!   step's result, and the backward pass (the collectives it ran) with the inputs' gradients.
//!   A lesson is then a program plus its narrative (`title`, `why`). With `"steps"` (and `"lr"`,
//!   default 0.3) it trains the program data-parallel instead (`train.rs`): each step every rank
//!   runs it forward and backward on its own data, the parameters' gradients (inputs with
//!   gradient, equal on every rank at the start) are averaged with all_reduce(AVG) and every rank
//!   steps; per step the loss of this rank and of the group, the parameters and a hash of them
//!   (equal on every rank: the replicas stay identical). The data-parallel lesson is such a
//!   program: linear regression, one data shard per rank. With `"compare_objectives": true` it
//!   runs the program under both objective conventions (`objectives.rs`): the forward pass once,
//!   the backward pass under each with the collectives it ran, and the gradients' ratio (the
//!   two-objectives lesson: `s = all_reduce(SUM, x)`, `loss = ½·sum(s²)`, the factor is N). It runs at the group's
//!   world where its program fits one (values from `value` + `per_rank`, lists as `out.*`):
//!   the tensor-parallel lesson is such a program, and so is the pipeline lesson: a `"for"`
//!   block over the stage s (stage s receives `h{s-1}` from s − 1, computes
//!   `h{s} = tanh(w ⊙ h{s-1})` and sends it to s + 1; the last stage holds the loss), whose
//!   backward runs each send's dual, a recv, and each recv's dual, a send.
//!
//! One file per lesson kind (`collective.rs`, `program.rs`, and the
//! program lesson's modes `train.rs` and `objectives.rs`), each a `run` giving this rank's steps; the
//! lesson and trace types, the step helpers they share, and assembling / rendering traces are here.

mod collective;
mod objectives;
mod program;
mod train;

use serde::{Deserialize, Serialize};

use crate::collective::{Communicator, Kind, P2p, ReduceOp};
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
    /// Any program ([`crate::program`]) step by step.
    Program,
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
    /// Training steps (kind program: train the program data-parallel for this many steps).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub steps: Option<usize>,
    /// Learning rate of the training steps (default 0.3).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lr: Option<f32>,
    /// Kind `program`: differentiate the program under both objective conventions.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub compare_objectives: bool,
    /// The program (kind `program`; its `world` is `distgrad run`'s default).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub program: Option<crate::program::Program>,
}

impl Lesson {
    /// Whether the lesson trains its program (kind `program` with `"steps"`): its trace is a loss
    /// curve and replica hashes.
    pub fn trains(&self) -> bool {
        self.kind == LessonKind::Program && self.steps.is_some()
    }
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
    match (&l.program, l.kind) {
        (None, LessonKind::Program) => {
            return Err(Error::Input(format!(
                "lesson {}: kind \"program\" needs a \"program\"",
                l.name
            )));
        }
        (Some(_), k) if k != LessonKind::Program => {
            return Err(Error::Input(format!(
                "lesson {}: \"program\" is for kind \"program\" only",
                l.name
            )));
        }
        _ => {}
    }
    Ok(l)
}

/// Forward messages of a collective over `world` ranks (the logical data movement; see
/// [`crate::collective::spec::messages`]).
pub fn arrows(
    which: Kind,
    world: usize,
    root: usize,
    perm: &[(usize, usize)],
) -> Vec<(usize, usize)> {
    crate::collective::spec::messages(which, world, root, perm)
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
        LessonKind::Collective => collective::run(comm, lesson, own_input).await?,
        LessonKind::Program => program_lesson(comm, lesson).await?,
    };
    Ok(RankTrace { rank: me, steps })
}

/// A `program` lesson: shown step by step, trained (`"steps"`), or under both objectives.
async fn program_lesson<T: Transport>(comm: &P2p<T>, lesson: &Lesson) -> Result<Vec<RankStep>> {
    let program = lesson
        .program
        .as_ref()
        .ok_or_else(|| Error::Input(format!("lesson {}: no \"program\"", lesson.name)))?;
    match (lesson.compare_objectives, lesson.steps) {
        (true, Some(_)) => Err(Error::Input(format!(
            "lesson {}: \"steps\" (training) and \"compare_objectives\" do not go together",
            lesson.name
        ))),
        (true, None) => objectives::run(comm, lesson, program).await,
        (false, steps) => {
            let plan = program::plan_for(lesson, program, comm.world_size())?;
            match steps {
                Some(n) => train::run(comm, lesson, &plan, n).await,
                None => program::run(comm, program, &plan).await,
            }
        }
    }
}

/// The calls this rank's communicator recorded since the last look, in order.
fn recorded<T: Transport>(comm: &P2p<T>) -> Vec<String> {
    comm.take_calls()
        .iter()
        .map(|(_, s)| vjp::short_sig(s))
        .collect()
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
