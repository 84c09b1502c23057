//! Programs: a small JSON description of what every rank computes — named inputs, a sequence of
//! local ops and collectives, a loss — that runs on any communicator ([`run_rank`]), in-process
//! (`run_local`, natively), and whose gradients [`mod@crate::gradcheck`] checks across the ranks.
//!
//! ```text
//! {"world": 3,
//!  "objective": "sum_of_rank_losses" | "replicated",          (default: sum_of_rank_losses)
//!  "inputs": [
//!    {"name": "x", "shape": [2, 3]},                           uniform in [-1, 1), per rank
//!    {"name": "w", "shape": [3, 2], "seed": 7, "replicated": true},   the same on every rank
//!    {"name": "t", "shape": [2], "values": [[1, 2], [3, 4], [5, 6]]}, one list per rank
//!    {"name": "c", "shape": [2], "value": [0.5, 1], "grad": false},  a constant
//!    {"name": "v", "shape": [2], "value": [1, 1], "per_rank": [1, -1]}, [1 + r, 1 - r] on rank r
//!    {"name": "r", "shapes": [[3, 1], [1, 1]], "ranks": [0, 2]}],     on ranks 0 and 2 only
//!  "steps": [
//!    {"op": "matmul", "in": ["x", "w"], "out": "h"},
//!    {"collective": "all_reduce", "op": "max", "in": ["h"], "out": "m"},
//!    {"collective": "all_gather", "in": ["m"], "out": "g", "group": [0, 2]},
//!    {"op": "sum", "in": ["g.1"], "out": "loss"}],
//!  "loss": "loss"}
//! ```
//!
//! - **Inputs** are the values the gradient is taken with respect to (unless `"grad": false`).
//!   Values: `"values"` (one list per rank), `"value"` (every rank; plus `r ·` `"per_rank"` on
//!   rank `r`: values that differ by rank in any world), or generated from `"seed"`
//!   (default: the input's index) uniformly in `"range"` (default `[-1, 1]`), different per rank
//!   unless `"replicated": true`. Under the replicated objective a replicated input is invariant
//!   over the world (like a closed-over value in JAX's shard_map).
//! - **Where an input lives**: `"ranks"` (global ranks) gives it to some ranks only (a scatter's
//!   list on the root); `"shapes"` instead of `"shape"` gives each of those ranks its own shape
//!   (uneven shards, an all_to_all_single with different row counts). `"values"` and `"shapes"`
//!   list one entry per rank that holds the input, in the order of `"ranks"`.
//! - **Local steps** (`"op"`): `add`, `sub`, `mul` (broadcasting), `matmul`, `scale` (`"by"`),
//!   `sum`, `mean`, `relu`, `tanh`, `square`, `reshape` (`"shape"`), `slice` (`"dim"`, `"start"`,
//!   `"len"`), `concat` (`"dim"`, any number of inputs), `mse_loss` — every differentiable op of
//!   the tape.
//! - **Collective steps** (`"collective"`): every kind of [`Spec`] with its fields (`op`, `root`,
//!   `perm`, `dst`, `src` + `shape`, `in_splits` / `out_splits`); `"group"` (global ranks, default
//!   all) runs it on a subgroup, roots and peers are group ranks. A collective whose output is a
//!   list (gather on the root, all_gather, all_to_all) binds `out.0`, `out.1`, ...; list inputs
//!   (scatter's root, reduce_scatter, all_to_all) name one value per group rank. `out.*` in a
//!   step's `"in"` names all the parts, in order (`concat` of an all_gather in any world).
//!   `all_to_all_single` may give its splits per group rank (a list of lists) and leave out
//!   `out_splits` (then rank `r` receives `in_splits[i][r]` rows from rank `i`).
//! - **`"dual"`** on a collective step picks its backward for a lesson that shows a wrong
//!   gradient beside the right one: `"distgrad"` (the default) or a wrong one ([`DualRule`]:
//!   `"seed"`, `"divide"`, `"global_root"`), refused where it would not change the backward.
//! - **`"ranks"`** (global ranks) limits a step to some ranks: a rank-dependent program, e.g. a
//!   `send` on rank 0 and the matching `recv` on rank 1. A collective other than send / recv runs
//!   on every member of its group.
//! - **`"for"` blocks** (`{"for": "s", "from": 0, "to": "last", "steps": [...]}`) repeat their
//!   steps for every value of a rank variable once the world is known, with expressions in rank
//!   fields (`"dst": "s+1"`), in names (`"out": "h{s}"`) and conditions (`"if": "s > 0"`): a
//!   pipeline or a ring written once for any world ([`Block`] says the rules).
//! - **The loss** is a one-element value; a rank without it contributes nothing. The global
//!   objective is the sum of the ranks' losses; under the replicated objective a loss that is
//!   invariant over a group counts once for the group (as [`crate::Objective`] says).
//!
//! Everything is checked before anything runs ([`Program::plan`]): unknown names and fields,
//! shapes, and what must agree across ranks (shapes of a collective's inputs, split sizes,
//! send / recv pairs), with the step and the ranks in the message.

mod check;
mod inputs;
mod one_device;
mod random;
mod repeat;
mod runner;
mod shapes;
mod traced;

use serde::{Deserialize, Serialize};

use crate::autograd::DualRule;
use crate::collective::Spec;
use crate::error::{ProgramError, Result};

pub use check::Plan;
pub use one_device::{MAX_ONE_DEVICE_ELEMENTS, OneDevice, one_device, one_device_with};
pub use random::{RandomOptions, random_program};
pub use repeat::{Block, MAX_EXPANDED_BYTES, MAX_EXPANDED_STEPS};
pub(crate) use runner::loss_weight;
#[cfg(not(target_arch = "wasm32"))]
pub use runner::run_local;
pub use runner::{Forward, RankRun, forward, forward_values, run_rank};
pub use shapes::lists_outputs;
pub use traced::{StepView, TracedRun, ValueKind, trace_rank};

/// Largest world a program may ask for: the one world limit of every command, lesson and page
/// (ranks are threads, tabs or processes).
pub const MAX_WORLD: usize = 64;

/// Largest tensor a program may declare or make (elements, 256 MiB of f32), so a typo cannot
/// exhaust memory.
pub const MAX_NUMEL: usize = 1 << 26;

/// Most elements all the values of a program may come to, every rank's inputs and results
/// together (1 GiB of f32; the tape keeps as much again for the gradients): what ranks simulated
/// in one tab hold at once.
pub const MAX_ELEMENTS: usize = 1 << 28;

/// Most arithmetic a program's local steps may ask for in one run, all ranks together: a matmul
/// counts `m·k·n` multiply-adds, any other op one per element it reads or writes (2^34, some
/// seconds to minutes on one CPU core).
pub const MAX_ARITHMETIC: u64 = 1 << 34;

/// A program: see the module docs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Program {
    /// What the file is: `"program"` (may be left out of a program file; see [`Format`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub format: Option<Format>,
    /// A heading (shown by the CLI and the page).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub title: Option<String>,
    /// Number of ranks.
    pub world: usize,
    /// The objective convention.
    #[serde(default)]
    pub objective: ObjectiveName,
    /// Named inputs.
    pub inputs: Vec<Input>,
    /// What every rank computes, in order.
    pub steps: Vec<Step>,
    /// Name of the loss value.
    pub loss: String,
}

/// What a JSON file of work holds, as its `"format"` field declares: a program, or a lesson (a
/// program with its narrative and how the page shows it: the `lesson` module, above this one).
/// Every command that takes a program takes a lesson too (`lesson::Work` reads either).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Format {
    /// A program (this module).
    Program,
    /// A lesson of the teaching demo.
    Lesson,
}

impl Format {
    /// The name in JSON and in messages.
    pub fn name(self) -> &'static str {
        match self {
            Format::Program => "program",
            Format::Lesson => "lesson",
        }
    }
}

/// The objective convention of a program (see [`crate::Objective`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ObjectiveName {
    /// The sum over ranks of each rank's loss (PyTorch's convention).
    #[default]
    SumOfRankLosses,
    /// Values know whether they are replicated; an invariant loss counts once (JAX's).
    Replicated,
}

impl ObjectiveName {
    /// The tape's objective.
    pub fn objective(self) -> crate::Objective {
        match self {
            ObjectiveName::SumOfRankLosses => crate::Objective::SumOfRankLosses,
            ObjectiveName::Replicated => crate::Objective::Replicated,
        }
    }
}

/// A named input.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Input {
    /// Name used by the steps.
    pub name: String,
    /// Shape on every rank that holds it (give this or `shapes`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shape: Option<Vec<usize>>,
    /// Shape per rank that holds it (in the order of `ranks`), where ranks hold different shapes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shapes: Option<Vec<Vec<usize>>>,
    /// The global ranks that hold it (default: every rank); on the others the name is unbound.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ranks: Option<Vec<usize>>,
    /// Values per rank that holds it, in the order of `ranks` (row-major).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub values: Option<Vec<Vec<f32>>>,
    /// Values, the same on every rank (with `per_rank`: on rank 0).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub value: Option<Vec<f32>>,
    /// With `value`: rank `r` (global) holds `value + r · per_rank`, so one description fits
    /// every world size.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub per_rank: Option<Vec<f32>>,
    /// Seed of generated values (default: the input's index).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seed: Option<u64>,
    /// Range of generated values (default `[-1, 1]`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub range: Option<(f32, f32)>,
    /// Whether the gradient is taken with respect to it (default true).
    #[serde(default = "yes", skip_serializing_if = "is_true")]
    pub grad: bool,
    /// The same value on every rank (generated values, or `value`).
    #[serde(default, skip_serializing_if = "is_false")]
    pub replicated: bool,
}

fn yes() -> bool {
    true
}

fn is_true(b: &bool) -> bool {
    *b
}

fn is_false(b: &bool) -> bool {
    !*b
}

/// A local differentiable op (the `"op"` of a local step).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case", deny_unknown_fields)]
pub enum LocalOp {
    /// `a + b` (broadcasting).
    Add {},
    /// `a - b` (broadcasting).
    Sub {},
    /// `a * b` elementwise (broadcasting).
    Mul {},
    /// `[m, k] x [k, n]`.
    Matmul {},
    /// `by * a`.
    Scale {
        /// The factor.
        by: f32,
    },
    /// Sum of all elements (one element).
    Sum {},
    /// Mean of all elements (one element).
    Mean {},
    /// `max(a, 0)`.
    Relu {},
    /// `tanh(a)`.
    Tanh {},
    /// `a * a`.
    Square {},
    /// Same values, new shape.
    Reshape {
        /// The new shape.
        shape: Vec<usize>,
    },
    /// `len` entries of dim `dim` from `start`.
    Slice {
        /// Dimension.
        dim: usize,
        /// First index.
        start: usize,
        /// Number of indices.
        len: usize,
    },
    /// The inputs joined along `dim`.
    Concat {
        /// Dimension.
        dim: usize,
    },
    /// `mean((a - b)^2)`.
    MseLoss {},
}

impl LocalOp {
    /// The op's name in JSON.
    pub fn name(&self) -> &'static str {
        match self {
            LocalOp::Add {} => "add",
            LocalOp::Sub {} => "sub",
            LocalOp::Mul {} => "mul",
            LocalOp::Matmul {} => "matmul",
            LocalOp::Scale { .. } => "scale",
            LocalOp::Sum {} => "sum",
            LocalOp::Mean {} => "mean",
            LocalOp::Relu {} => "relu",
            LocalOp::Tanh {} => "tanh",
            LocalOp::Square {} => "square",
            LocalOp::Reshape { .. } => "reshape",
            LocalOp::Slice { .. } => "slice",
            LocalOp::Concat { .. } => "concat",
            LocalOp::MseLoss {} => "mse_loss",
        }
    }

    /// Number of inputs (`None`: any number, at least one).
    pub fn arity(&self) -> Option<usize> {
        match self {
            LocalOp::Add {}
            | LocalOp::Sub {}
            | LocalOp::Mul {}
            | LocalOp::Matmul {}
            | LocalOp::MseLoss {} => Some(2),
            LocalOp::Concat { .. } => None,
            LocalOp::Scale { .. }
            | LocalOp::Sum {}
            | LocalOp::Mean {}
            | LocalOp::Relu {}
            | LocalOp::Tanh {}
            | LocalOp::Square {}
            | LocalOp::Reshape { .. }
            | LocalOp::Slice { .. } => Some(1),
        }
    }
}

/// What a step does.
#[derive(Debug, Clone, PartialEq)]
pub enum StepKind {
    /// A local op on each rank.
    Local(LocalOp),
    /// A collective call; `splits` holds all_to_all_single's per-group-rank split sizes when the
    /// step gives them as lists of lists (the call's own `in_splits` / `out_splits` are then
    /// filled per rank).
    Collective {
        /// The call (for all_to_all_single with per-rank splits: the splits are placeholders).
        spec: Spec,
        /// all_to_all_single's split sizes per group rank.
        splits: Option<Splits>,
    },
    /// A `"for"` block: steps repeated for each value of a rank variable, expanded when the
    /// world is known ([`Program::plan`]); a plan's program has none.
    For(Block),
}

/// all_to_all_single's split sizes given per group rank.
#[derive(Debug, Clone, PartialEq)]
pub struct Splits {
    /// `in_splits[r][j]`: rows group rank `r` sends to group rank `j`.
    pub in_splits: Vec<Vec<usize>>,
    /// `out_splits[r][i]`: rows group rank `r` receives from `i` (`None`: `in_splits[i][r]`).
    pub out_splits: Option<Vec<Vec<usize>>>,
}

/// One step of a program.
#[derive(Debug, Clone, PartialEq)]
pub struct Step {
    /// What it does.
    pub kind: StepKind,
    /// Names of its inputs (`"in"`).
    pub inputs: Vec<String>,
    /// Name of its output (`"out"`; a list output binds `out.0`, `out.1`, ...).
    pub out: Option<String>,
    /// The global ranks that run it (default: all ranks; a collective's group).
    pub ranks: Option<Vec<usize>>,
    /// A collective's group (global ranks; default: all ranks).
    pub group: Option<Vec<usize>>,
    /// A collective's backward when a lesson shows a wrong one (`"dual"`; default distgrad's):
    /// see [`DualRule`].
    pub dual: Option<DualRule>,
}

impl Step {
    /// A short description for messages: `all_reduce(op=max) [h] -> m`.
    pub fn describe(&self) -> String {
        let what = match &self.kind {
            StepKind::Local(op) => op.name().to_string(),
            StepKind::Collective {
                spec,
                splits: Some(_),
            } => spec.kind().name().to_string(),
            StepKind::Collective { spec, .. } => spec.to_string(),
            StepKind::For(b) => {
                let raw = |v: &serde_json::Value| match v {
                    serde_json::Value::String(t) => t.clone(),
                    other => other.to_string(),
                };
                format!("for {} in {}..={}", b.var, raw(&b.from), raw(&b.to))
            }
        };
        let out = self
            .out
            .as_deref()
            .map(|o| format!(" -> {o}"))
            .unwrap_or_default();
        let dual = match self.dual {
            Some(d) if d != DualRule::Distgrad => format!(" (dual: {})", d.name()),
            _ => String::new(),
        };
        format!("{what} [{}]{out}{dual}", self.inputs.join(", "))
    }
}

const STEP_KEYS: [&str; 5] = ["in", "out", "ranks", "group", "dual"];

impl<'de> Deserialize<'de> for Step {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        use serde::de::Error as _;
        let mut map = serde_json::Map::<String, serde_json::Value>::deserialize(d)?;
        if map.contains_key("for") {
            return Ok(Step {
                kind: StepKind::For(Block::from_map(map).map_err(D::Error::custom)?),
                inputs: Vec::new(),
                out: None,
                ranks: None,
                group: None,
                dual: None,
            });
        }
        if map.contains_key("if") {
            return Err(D::Error::custom(
                "\"if\" is for the steps of a \"for\" block (it tests the block's variable)",
            ));
        }
        let take = |map: &mut serde_json::Map<String, serde_json::Value>, k: &str| map.remove(k);
        let inputs: Vec<String> = match take(&mut map, "in") {
            Some(v) => {
                serde_json::from_value(v).map_err(|e| D::Error::custom(format!("\"in\": {e}")))?
            }
            None => Vec::new(),
        };
        let out: Option<String> = take(&mut map, "out")
            .map(serde_json::from_value)
            .transpose()
            .map_err(|e| D::Error::custom(format!("\"out\": {e}")))?;
        let ranks: Option<Vec<usize>> = take(&mut map, "ranks")
            .map(serde_json::from_value)
            .transpose()
            .map_err(|e| D::Error::custom(format!("\"ranks\": {e}")))?;
        let group: Option<Vec<usize>> = take(&mut map, "group")
            .map(serde_json::from_value)
            .transpose()
            .map_err(|e| D::Error::custom(format!("\"group\": {e}")))?;
        let dual: Option<DualRule> = take(&mut map, "dual")
            .map(serde_json::from_value)
            .transpose()
            .map_err(|e| {
                D::Error::custom(format!(
                    "\"dual\": {e} (the dual rules: {})",
                    DualRule::ALL.map(DualRule::name).join(", ")
                ))
            })?;
        if dual.is_some() && !map.contains_key("collective") {
            return Err(D::Error::custom(
                "\"dual\" is for a collective step (it picks the collective's backward)",
            ));
        }
        let kind = if map.contains_key("collective") {
            // all_to_all_single's splits may be given per group rank.
            let nested = |v: Option<&serde_json::Value>| {
                v.and_then(|v| v.as_array())
                    .and_then(|a| a.first())
                    .is_some_and(serde_json::Value::is_array)
            };
            let is_a2a =
                map.get("collective").and_then(|v| v.as_str()) == Some("all_to_all_single");
            if is_a2a && (nested(map.get("in_splits")) || !map.contains_key("out_splits")) {
                let ins: Vec<Vec<usize>> = match map.remove("in_splits") {
                    Some(v) => serde_json::from_value(v).map_err(|e| {
                        D::Error::custom(format!("\"in_splits\" (one list per group rank): {e}"))
                    })?,
                    None => return Err(D::Error::custom("all_to_all_single needs \"in_splits\"")),
                };
                let outs: Option<Vec<Vec<usize>>> = map
                    .remove("out_splits")
                    .map(serde_json::from_value)
                    .transpose()
                    .map_err(|e| {
                        D::Error::custom(format!("\"out_splits\" (one list per group rank): {e}"))
                    })?;
                map.insert("in_splits".into(), serde_json::json!([]));
                map.insert("out_splits".into(), serde_json::json!([]));
                let spec: Spec = serde_json::from_value(serde_json::Value::Object(map))
                    .map_err(D::Error::custom)?;
                StepKind::Collective {
                    spec,
                    splits: Some(Splits {
                        in_splits: ins,
                        out_splits: outs,
                    }),
                }
            } else {
                let spec: Spec = serde_json::from_value(serde_json::Value::Object(map))
                    .map_err(D::Error::custom)?;
                StepKind::Collective { spec, splits: None }
            }
        } else if map.contains_key("op") {
            StepKind::Local(
                serde_json::from_value(serde_json::Value::Object(map)).map_err(D::Error::custom)?,
            )
        } else {
            let keys: Vec<&String> = map.keys().collect();
            return Err(D::Error::custom(format!(
                "a step needs \"op\" (a local op) or \"collective\"; got keys {keys:?} besides {STEP_KEYS:?}"
            )));
        };
        Ok(Step {
            kind,
            inputs,
            out,
            ranks,
            group,
            dual,
        })
    }
}

impl Serialize for Step {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        use serde::ser::Error as _;
        let mut v = match &self.kind {
            StepKind::Local(op) => serde_json::to_value(op),
            StepKind::Collective { spec, .. } => serde_json::to_value(spec),
            StepKind::For(b) => return b.to_value().serialize(s),
        }
        .map_err(S::Error::custom)?;
        let map = v
            .as_object_mut()
            .ok_or_else(|| S::Error::custom("a step serializes to an object"))?;
        if let StepKind::Collective {
            splits:
                Some(Splits {
                    in_splits: ins,
                    out_splits: outs,
                }),
            ..
        } = &self.kind
        {
            map.insert("in_splits".into(), serde_json::json!(ins));
            match outs {
                Some(o) => map.insert("out_splits".into(), serde_json::json!(o)),
                None => map.remove("out_splits"),
            };
        }
        if !self.inputs.is_empty() {
            map.insert("in".into(), serde_json::json!(self.inputs));
        }
        if let Some(o) = &self.out {
            map.insert("out".into(), serde_json::json!(o));
        }
        if let Some(r) = &self.ranks {
            map.insert("ranks".into(), serde_json::json!(r));
        }
        if let Some(g) = &self.group {
            map.insert("group".into(), serde_json::json!(g));
        }
        if let Some(d) = self.dual {
            map.insert("dual".into(), serde_json::json!(d.name()));
        }
        v.serialize(s)
    }
}

impl Program {
    /// Parse a program from JSON text (errors say where). A file whose `"format"` says it is a
    /// lesson is refused here: `lesson::Work::parse` reads either.
    pub fn parse(json: &str) -> Result<Program> {
        let p: Program = serde_json::from_str(json).map_err(|e| ProgramError::Json {
            reader: "program",
            detail: e.to_string(),
        })?;
        match p.format {
            Some(f @ Format::Lesson) => Err(ProgramError::Format {
                declared: f.name(),
                reader: "program",
            }
            .into()),
            _ => Ok(p),
        }
    }

    /// The program for `world` ranks with its `"for"` blocks expanded (not checked otherwise;
    /// [`Program::plan`] checks): what `distgrad run --print-program` shows.
    pub fn expanded(&self, world: usize) -> Result<Program> {
        let (mut p, _) = repeat::expand(self, world)?;
        p.world = world;
        Ok(p)
    }

    /// Check everything for `world` ranks (the program's own world if `None`) and prepare each
    /// rank's inputs; see [`Plan`].
    pub fn plan(&self, world: Option<usize>) -> Result<Plan> {
        check::plan(self, world.unwrap_or(self.world))
    }
}
