//! Lessons of the teaching demo: a lesson is a [`Program`] plus its narrative (`title`, `why`)
//! and how it is shown ([`View`]). Lesson files live in `www/lessons/<name>.json`; any command
//! that takes a program takes a lesson too ([`Work`] reads either, told apart by `"format"`).
//!
//! A lesson runs on every rank of a group (browser tabs, simulated ranks in one page, or
//! `distgrad run` in a terminal) and produces a [`Trace`]: a list of steps, each with the messages
//! drawn as arrows between ranks and every rank's values at that step. The page animates the
//! trace; `distgrad run` prints it. Both run the same code here, so they show the same numbers.
//!
//! Lesson JSON:
//! ```text
//! {"format": "lesson", "name": "all_gather", "title": "...", "why": "one or two sentences",
//!  "kind": "collective" | "program",
//!  "collective": "all_gather", "op": "max", "root": 1,      (kind collective: the short form;
//!                                                           op/root where used; the last rank
//!                                                           is root in smaller worlds)
//!  "world": 3,                                              (the world it is written for)
//!  "steps": 20, "lr": 0.3,                    (kind program: train it data-parallel)
//!  "sharded": true,                  (with "steps": parameters as the program holds them)
//!  "compare_objectives": true,             (kind program: differentiate it under both objectives)
//!  "compare_duals": true,                  (kind program: its wrong "dual" beside distgrad's)
//!  "program": {...},                                       (kind program: a program's JSON)
//!  "algorithm": "ring",                  (optional: what its collectives take where they have
//!                                        the choice, whatever the size; default the room's)
//!  "min_world": 3}                       (optional: the fewest ranks it runs on, default 1)
//! ```
//! `"format"` may be left out of lesson files written before it (a `"kind"` says lesson).
//!
//! - `collective` ([`View::Collective`]): the short form of a one-collective program, the
//!   [`crate::vjp`] example case of that collective for the group's world ([`lesson_case`]):
//!   inputs x → forward (arrows of the collective) → cotangents → backward (the same arrows
//!   reversed, and the name of the collective the backward pass really ran) → gradients. A rank
//!   may replace its own input (same shape).
//! - `program` ([`View::Steps`]): any program ([`crate::program`]): the inputs, each step's
//!   result on every rank (a collective's messages drawn), the gradient of the global objective
//!   with respect to each step's result, and the backward pass (the collectives it ran) with the
//!   inputs' gradients. It runs at the group's world where its program fits one (values from
//!   `value` + `per_rank`, lists as `out.*`, `"for"` blocks over the ranks): the tensor-parallel
//!   lesson is such a program, and so is the pipeline lesson: a `"for"` block over the stage s
//!   (stage s receives `h{s-1}` from s − 1, computes `h{s} = tanh(w ⊙ h{s-1})` and sends it to
//!   s + 1; the last stage holds the loss), whose backward runs each send's dual, a recv, and
//!   each recv's dual, a send.
//! - With `"steps"` ([`View::Train`], `"lr"` default 0.3) the program is trained data-parallel
//!   (`training.rs`): each step every rank runs it forward and backward on its own data, the
//!   parameters' gradients (inputs with gradient, equal on every rank at the start) are averaged
//!   with all_reduce(AVG) and every rank steps; per step the loss of this rank and of the group,
//!   the parameters and a hash of them (equal on every rank: the replicas stay identical). With
//!   `"sharded": true` the parameters are held as the program holds them (a tensor-parallel
//!   layer's shards): each rank steps its own with its own gradient, no averaging; the
//!   program's collectives carry everything. Either way the trace carries one device's training
//!   of the whole problem from the same start ([`OneDeviceView::curve`]), drawn beside the
//!   group's loss.
//! - With `"compare_duals": true` ([`View::CompareDuals`]) the program names a wrong backward
//!   on some collective step (`"dual": "seed"`, see [`crate::autograd::DualRule`]) and is
//!   differentiated with it and with distgrad's (`duals.rs`): both gradients, their difference,
//!   and the distributed gradient check of each, rank by rank (wrong: FAIL, or INCONCLUSIVE at a
//!   tie; right: PASS).
//! - With `"compare_objectives": true` ([`View::CompareObjectives`]) the program is
//!   differentiated under both objective conventions (`objectives.rs`): the forward pass once,
//!   the backward pass under each with the collectives it ran, and the gradients' ratio (the
//!   two-objectives lesson: `s = all_reduce(SUM, x)`, `loss = ½·sum(s²)`, the factor is N).
//!
//! One file per view (`collective.rs`, `steps.rs`, `training.rs`, `objectives.rs`), each a `run`
//! giving this rank's steps; the trace types, assembling and rendering traces in `trace.rs`.

pub mod algorithm;
mod collective;
mod duals;
mod objectives;
mod one_device;
mod steps;
mod trace;
mod training;

use serde::{Deserialize, Serialize};

use crate::collective::events::Algorithm;
use crate::collective::{CommOptions, Communicator, Kind, P2p, ReduceOp};
use crate::error::{Error, ProgramError, Result};
use crate::program::{Format, MAX_WORLD, Plan, Program};
use crate::tensor::Tensor;
use crate::transport::Transport;
use crate::vjp::{self, TensorJson};

pub use trace::{Named, OneDeviceView, Phase, RankStep, RankTrace, Step, Trace, render};

/// Put the ranks' traces (index = rank) together (every rank must have run the same steps; see
/// `trace.rs`) and compute, once for the group, one device's gradients for the
/// whole problem beside theirs (`one_device.rs`).
pub async fn assemble(lesson: &Lesson, traces: Vec<RankTrace>) -> Result<Trace> {
    let mut trace = trace::assemble_steps(lesson, traces)?;
    trace.one_device = Some(one_device::view(lesson, &trace.steps, trace.world).await);
    Ok(trace)
}

/// A lesson: a program, its narrative and how it is shown (see the module docs). Its JSON is
/// the lesson file's ([`parse`]).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(try_from = "LessonFile", into = "LessonFile")]
pub struct Lesson {
    /// File name without `.json`.
    pub name: String,
    /// Heading.
    pub title: String,
    /// One or two sentences: why the backward pass is what it is.
    pub why: String,
    /// The world it is written for: `distgrad run`'s default (a group of another size runs it at
    /// its own, [`Lesson::program_for`]).
    pub world: usize,
    /// How it is shown.
    pub view: View,
    /// What it runs, for [`Lesson::world`] ranks.
    pub program: Program,
    /// The algorithm its collectives take where they have the choice (`"algorithm": "ring"`,
    /// whatever the tensors' size: [`CommOptions::with_algorithm`]); `None`: the room's.
    pub algorithm: Option<Algorithm>,
    /// The fewest ranks it runs on (`"min_world"`, default 1): a lesson on a subgroup of ranks
    /// 1 and 2 needs 3.
    pub min_world: usize,
}

/// How a lesson is shown (the page and `distgrad run` alike).
#[derive(Debug, Clone, PartialEq)]
pub enum View {
    /// One collective: inputs, outputs, cotangents, what backward ran, gradients. The lesson's
    /// program is the collective's example case, made again for each world.
    Collective(CollectiveForm),
    /// Every step of the program forward, then backward through each collective.
    Steps,
    /// The program trained: data-parallel (the parameters replicated, their gradients averaged
    /// over the ranks), or as written (`sharded`: each rank steps its own parameters with its
    /// own gradient; the program's collectives do all the communication).
    Train {
        /// Training steps.
        steps: usize,
        /// Learning rate.
        lr: f32,
        /// Parameters sharded as the program holds them (`"sharded": true`), not replicated.
        sharded: bool,
    },
    /// The program differentiated under both objective conventions.
    CompareObjectives,
    /// The program's wrong duals beside distgrad's, the gradient check deciding.
    CompareDuals,
}

/// The short form of a collective lesson: which collective, with which op and root.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CollectiveForm {
    /// The collective.
    pub kind: Kind,
    /// Its reduce op, where it takes one (`None`: sum).
    pub op: Option<ReduceOp>,
    /// Its root, where it takes one (`None`: 0; the last rank in a smaller world).
    pub root: Option<usize>,
}

impl CollectiveForm {
    /// The example case of this collective for `world` ranks ([`vjp::example_case`]).
    pub fn case(&self, world: usize) -> Result<vjp::Case> {
        let root = self.root.unwrap_or(0).min(world.saturating_sub(1));
        vjp::example_case(
            self.kind,
            world,
            self.op.unwrap_or(ReduceOp::Sum),
            if self.kind.takes_root() { root } else { 0 },
            None,
        )
    }
}

impl Lesson {
    /// Whether the lesson trains its program: its trace is a loss curve and replica hashes.
    pub fn trains(&self) -> bool {
        matches!(self.view, View::Train { .. })
    }

    /// The program the lesson runs on `world` ranks: a collective lesson's example case made for
    /// that world, else the lesson's program (whose check takes the world).
    pub fn program_for(&self, world: usize) -> Result<Program> {
        if world < self.min_world {
            return Err(self.error(format!(
                "it needs at least {} ranks; this group has {world}",
                self.min_world
            )));
        }
        match &self.view {
            View::Collective(form) => form.case(world)?.program(),
            _ => Ok(self.program.clone()),
        }
    }

    /// The lesson's program checked for `world` ranks, saying so when the lesson was written for
    /// another world.
    pub fn plan_for(&self, world: usize) -> Result<Plan> {
        let program = self.program_for(world)?;
        self.plan_program(&program, world)
    }

    /// An error about this lesson.
    fn error(&self, detail: String) -> Error {
        ProgramError::Lesson {
            name: self.name.clone(),
            detail,
        }
        .into()
    }

    /// `program` (the lesson's, changed) checked for `world` ranks, errors naming the lesson.
    fn plan_program(&self, program: &Program, world: usize) -> Result<Plan> {
        program.plan(Some(world)).map_err(|e| {
            let other = if program.world != world {
                format!(
                    " (its program was written for {} ranks; this group has {world})",
                    program.world
                )
            } else {
                String::new()
            };
            self.error(format!("{e}{other}"))
        })
    }
}

/// The kind a lesson file names (`"kind"`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
enum LessonKind {
    Collective,
    Program,
}

/// A lesson file as written.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct LessonFile {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    format: Option<Format>,
    name: String,
    title: String,
    why: String,
    kind: LessonKind,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    collective: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    op: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    root: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    world: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    steps: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    lr: Option<f32>,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    sharded: bool,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    compare_objectives: bool,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    compare_duals: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    program: Option<Program>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    algorithm: Option<Algorithm>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    min_world: Option<usize>,
}

/// Most training steps a lesson may ask for.
const MAX_TRAIN_STEPS: usize = 100_000;

impl TryFrom<LessonFile> for Lesson {
    type Error = Error;

    fn try_from(f: LessonFile) -> Result<Lesson> {
        let at = |detail: String| -> Error {
            ProgramError::Lesson {
                name: f.name.clone(),
                detail,
            }
            .into()
        };
        if let Some(declared @ Format::Program) = f.format {
            return Err(ProgramError::Format {
                declared: declared.name(),
                reader: "lesson",
            }
            .into());
        }
        let view = view_of(&f).map_err(at)?;
        let world = f.world.or(f.program.as_ref().map(|p| p.world)).unwrap_or(3);
        if world == 0 || world > MAX_WORLD {
            return Err(at(format!(
                "\"world\" must be 1..={MAX_WORLD}, got {world}"
            )));
        }
        let program = match (&view, f.program) {
            (View::Collective(form), None) => form.case(world)?.program()?,
            (View::Collective(_), Some(_)) => {
                return Err(at("\"program\" is for kind \"program\" only".into()));
            }
            (_, Some(p)) => p,
            (_, None) => return Err(at("kind \"program\" needs a \"program\"".into())),
        };
        let min_world = f.min_world.unwrap_or(1);
        if min_world == 0 || min_world > world {
            return Err(at(format!(
                "\"min_world\" must be 1..={world} (the world it is written for), got {min_world}"
            )));
        }
        if view == View::CompareDuals
            && !program.steps.iter().any(|s| {
                s.dual
                    .is_some_and(|d| d != crate::autograd::DualRule::Distgrad)
            })
        {
            return Err(at(
                "\"compare_duals\" needs a collective step with a wrong \"dual\" (e.g. \"dual\": \"seed\")"
                    .into(),
            ));
        }
        if let Some(a) = f.algorithm {
            CommOptions::default()
                .with_algorithm(a)
                .map_err(|e| at(e.to_string()))?;
        }
        Ok(Lesson {
            name: f.name,
            title: f.title,
            why: f.why,
            world,
            view,
            program,
            algorithm: f.algorithm,
            min_world,
        })
    }
}

/// The view a lesson file asks for, its fields checked against its kind.
fn view_of(f: &LessonFile) -> std::result::Result<View, String> {
    if f.sharded && f.steps.is_none() {
        return Err("\"sharded\" is for training (\"steps\")".into());
    }
    if f.kind == LessonKind::Collective {
        if f.steps.is_some() || f.lr.is_some() || f.compare_objectives || f.compare_duals {
            return Err(
                "\"steps\", \"lr\", \"compare_objectives\" and \"compare_duals\" are for kind \"program\""
                    .into(),
            );
        }
        let kind = vjp::parse_collective(f.collective.as_deref().unwrap_or(""))
            .map_err(|e| e.to_string())?;
        let op =
            f.op.as_deref()
                .map(ReduceOp::parse)
                .transpose()
                .map_err(|e| e.to_string())?;
        if op.is_some() && !kind.takes_op() {
            return Err(format!("{} takes no op", kind.name()));
        }
        return Ok(View::Collective(CollectiveForm {
            kind,
            op,
            root: f.root,
        }));
    }
    if f.collective.is_some() || f.op.is_some() || f.root.is_some() {
        return Err(
            "\"collective\", \"op\" and \"root\" are the short form of kind \"collective\"".into(),
        );
    }
    if f.compare_duals {
        if f.compare_objectives || f.steps.is_some() || f.lr.is_some() {
            return Err(
                "\"compare_duals\" goes alone (not with \"compare_objectives\", \"steps\" or \"lr\")"
                    .into(),
            );
        }
        return Ok(View::CompareDuals);
    }
    match (f.compare_objectives, f.steps, f.lr) {
        (true, Some(_), _) => {
            Err("\"steps\" (training) and \"compare_objectives\" do not go together".into())
        }
        (true, None, _) => Ok(View::CompareObjectives),
        (false, None, Some(_)) => Err("\"lr\" is for training (\"steps\")".into()),
        (false, None, None) => Ok(View::Steps),
        (false, Some(steps), lr) => {
            let lr = lr.unwrap_or(0.3);
            if !lr.is_finite() || lr <= 0.0 {
                return Err(format!("\"lr\" must be a positive number, got {lr}"));
            }
            Ok(View::Train {
                steps: steps.clamp(1, MAX_TRAIN_STEPS),
                lr,
                sharded: f.sharded,
            })
        }
    }
}

impl From<Lesson> for LessonFile {
    fn from(l: Lesson) -> LessonFile {
        let mut f = LessonFile {
            format: Some(Format::Lesson),
            name: l.name,
            title: l.title,
            why: l.why,
            kind: LessonKind::Program,
            collective: None,
            op: None,
            root: None,
            world: Some(l.world),
            steps: None,
            lr: None,
            sharded: false,
            compare_objectives: false,
            compare_duals: false,
            program: Some(l.program),
            algorithm: l.algorithm,
            min_world: (l.min_world > 1).then_some(l.min_world),
        };
        match l.view {
            View::Collective(form) => {
                f.kind = LessonKind::Collective;
                f.collective = Some(form.kind.name().to_string());
                f.op = form.op.map(|o| o.name().to_string());
                f.root = form.root;
                f.program = None;
            }
            View::Steps => {}
            View::Train { steps, lr, sharded } => {
                f.steps = Some(steps);
                f.lr = Some(lr);
                f.sharded = sharded;
            }
            View::CompareObjectives => f.compare_objectives = true,
            View::CompareDuals => f.compare_duals = true,
        }
        f
    }
}

/// Parse a lesson file's text.
pub fn parse(json: &str) -> Result<Lesson> {
    serde_json::from_str(json).map_err(|e| {
        ProgramError::Json {
            reader: "lesson",
            detail: e.to_string(),
        }
        .into()
    })
}

/// A file of work, as its `"format"` declares: a program or a lesson. Files without the field
/// are read as written before it: a lesson has a `"kind"`, anything else is a program.
#[derive(Debug, Clone)]
pub enum Work {
    /// A program file.
    Program(Program),
    /// A lesson file.
    Lesson(Box<Lesson>),
}

impl Work {
    /// Read a program or a lesson.
    pub fn parse(json: &str) -> Result<Work> {
        #[derive(Deserialize)]
        struct Head {
            #[serde(default)]
            format: Option<Format>,
            #[serde(default)]
            kind: Option<serde::de::IgnoredAny>,
        }
        let format = match serde_json::from_str::<Head>(json) {
            Ok(Head {
                format: Some(f), ..
            }) => f,
            Ok(Head { kind: Some(_), .. }) => Format::Lesson,
            // Not an object, or not JSON: the program reader says why.
            _ => Format::Program,
        };
        match format {
            Format::Program => Program::parse(json).map(Work::Program),
            Format::Lesson => parse(json).map(|l| Work::Lesson(Box::new(l))),
        }
    }

    /// The world it is written for.
    pub fn world(&self) -> usize {
        match self {
            Work::Program(p) => p.world,
            Work::Lesson(l) => l.world,
        }
    }

    /// The program it runs on `world` ranks ([`Lesson::program_for`]).
    pub fn program_for(&self, world: usize) -> Result<Program> {
        match self {
            Work::Program(p) => Ok(p.clone()),
            Work::Lesson(l) => l.program_for(world),
        }
    }
}

/// The collective lesson's case for `world` ranks (`distgrad vjp`'s example); an error for a
/// lesson of another view.
pub fn lesson_case(lesson: &Lesson, world: usize) -> Result<vjp::Case> {
    match &lesson.view {
        View::Collective(form) => form.case(world),
        _ => Err(ProgramError::Lesson {
            name: lesson.name.clone(),
            detail: "not a collective lesson".into(),
        }
        .into()),
    }
}

/// Forward messages of a collective over `world` ranks (the logical data movement; see
/// [`crate::collective::spec::messages`]).
fn arrows(which: Kind, world: usize, root: usize, perm: &[(usize, usize)]) -> Vec<(usize, usize)> {
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
        events: Vec::new(),
    }
}

async fn read(t: &Tensor) -> Result<TensorJson> {
    TensorJson::read(t).await
}

/// This rank's trace of `lesson` run on `comm` (which must record calls:
/// [`CommOptions::recorded`]). `own_input` replaces this rank's input in a collective lesson
/// (same shapes).
pub async fn rank_trace<T: Transport>(
    comm: &P2p<T>,
    lesson: &Lesson,
    own_input: Option<Vec<TensorJson>>,
) -> Result<RankTrace> {
    let me = comm.rank();
    comm.take_calls();
    // The lessons that show steps record what each rank did, for the algorithm view; the
    // lesson's algorithm holds for its run.
    let shows = matches!(lesson.view, View::Collective(_) | View::Steps);
    let recorded = comm.set_record_events(shows);
    let algorithm = comm.algorithm();
    if lesson.algorithm.is_some() {
        comm.set_algorithm(lesson.algorithm)?;
    }
    let steps = run_view(comm, lesson, own_input).await;
    comm.set_record_events(recorded);
    comm.set_algorithm(algorithm)?;
    comm.take_events();
    Ok(RankTrace {
        rank: me,
        steps: steps?,
    })
}

/// This rank's steps of `lesson` (see [`rank_trace`]).
async fn run_view<T: Transport>(
    comm: &P2p<T>,
    lesson: &Lesson,
    own_input: Option<Vec<TensorJson>>,
) -> Result<Vec<RankStep>> {
    let world = comm.world_size();
    Ok(match &lesson.view {
        View::Collective(form) => collective::run(comm, form, own_input).await?,
        View::Steps => steps::run(comm, &lesson.plan_for(world)?).await?,
        View::Train { steps, lr, sharded } => {
            let how = training::How {
                steps: *steps,
                lr: *lr,
                sharded: *sharded,
            };
            training::run(comm, lesson, &lesson.plan_for(world)?, how).await?
        }
        View::CompareObjectives => objectives::run(comm, lesson).await?,
        View::CompareDuals => duals::run(comm, lesson).await?,
    })
}

/// The calls this rank's communicator recorded since the last look, in order.
fn recorded<T: Transport>(comm: &P2p<T>) -> Vec<String> {
    comm.take_calls()
        .iter()
        .map(|(_, s)| vjp::short_sig(s))
        .collect()
}

/// Run `lesson` on `world` ranks simulated in this process (interleaved on this task: the page's
/// single-tab mode and `distgrad run`). `inputs[r]`, where given, replaces rank r's input.
pub async fn run_simulated(
    lesson: &Lesson,
    world: usize,
    device: &crate::backend::Device,
    inputs: &[Option<Vec<TensorJson>>],
) -> Result<Trace> {
    let opts = CommOptions {
        device: device.clone(),
        ..CommOptions::recorded()
    };
    run_simulated_with(lesson, world, opts, inputs).await
}

/// [`run_simulated`] with the communicators' options (`opts`: e.g. an algorithm chosen,
/// [`CommOptions::with_algorithm`]; calls are recorded whatever they say).
pub async fn run_simulated_with(
    lesson: &Lesson,
    world: usize,
    opts: CommOptions,
    inputs: &[Option<Vec<TensorJson>>],
) -> Result<Trace> {
    if world == 0 || world > MAX_WORLD {
        return Err(ProgramError::World {
            world,
            max: MAX_WORLD,
        }
        .into());
    }
    let opts = CommOptions {
        record_calls: true,
        ..opts
    };
    let results = crate::in_process::run_interleaved(world, opts, |comm| async move {
        let own = inputs.get(comm.rank()).cloned().flatten();
        rank_trace(&comm, lesson, own).await
    })
    .await;
    let mut traces = Vec::with_capacity(world);
    for (r, t) in results.into_iter().enumerate() {
        traces.push(t.map_err(|e| Error::Input(format!("rank {r}: {e}")))?);
    }
    assemble(lesson, traces).await
}
