//! `distgrad vjp`: one collective, forward and backward, from a JSON case: the short way to write
//! a one-collective program. A case is not a format with its own runner: it builds its program
//! ([`Case::program`]: inputs `x`, the collective, a loss whose gradient is the case's
//! cotangents), which runs like any other ([`crate::program::trace_rank`]); [`rank_result`]
//! reads the case's answer off that run. The built-in examples ([`example_case`]) are the
//! collective lessons' programs too.
//!
//! Input schema (one list per GLOBAL rank; ranks outside `group` pass and get empty lists):
//! ```text
//! {"collective": "broadcast|reduce|gather|scatter|all_gather|reduce_scatter|all_to_all|all_reduce|permute|all_to_all_single",
//!  "world": N, "op": "sum|avg|prod|min|max" (reduce, all_reduce, reduce_scatter; default sum),
//!  "root": group rank (broadcast, reduce, gather, scatter; default 0),
//!  "perm": [[src,dst],...] (permute, group ranks),
//!  "in_splits": [[..],...], "out_splits": [[..],...] (all_to_all_single: one list per global rank),
//!  "group": [global ranks] (optional subgroup),
//!  "inputs":     [[T,...], ...]  one T per input tensor,
//!  "cotangents": [[T,...], ...]  one T per output tensor (optional: ones)}
//! T = {"shape": [..], "data": [.. row-major ..]}
//! ```
//! Output: `{"dual": "...", "outputs": [[T,...],...], "grads": [[T,...],...]}`; `dual` names the
//! collectives the backward pass actually ran (recorded by the communicator, not looked up).
//!
//! List conventions: scatter, all_to_all and reduce_scatter take group-size lists; gather,
//! all_gather and all_to_all return them. gather's and reduce's outputs exist only on the root,
//! scatter's input only on the root. permute: one tensor in, one out; a rank receiving nothing gets
//! zeros. NaN: JSON has no NaN or infinity, so inputs are finite f32 numbers (`null` and numbers
//! beyond ±3.4e38 are rejected); a non-finite result is written as `null` (the tables say `nan`,
//! `inf` or `-inf`).

mod build;
mod example;
mod table;

use serde::{Deserialize, Serialize};

use crate::collective::events::CallRecord;
use crate::collective::{CommOptions, Communicator, Kind, P2p};
use crate::error::{Error, ProgramError, Result};
#[cfg(not(target_arch = "wasm32"))]
use crate::in_process::run_local;
use crate::program::{Plan, trace_rank};
use crate::tensor::Tensor;
use crate::transport::Transport;

use build::{Calls, build, output_names, slot_names};
pub use example::example_case;
pub use table::{fmt_t, render_table, text_table};

/// An error about a case as its reader says it (the collective, the field, the rank).
fn case_err(detail: impl Into<String>) -> Error {
    ProgramError::Case {
        detail: detail.into(),
    }
    .into()
}

/// A tensor in JSON.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TensorJson {
    /// Shape.
    pub shape: Vec<usize>,
    /// Row-major values. `null` in JSON = not finite: read as `None` (and refused as an input);
    /// a result's NaN is `None`, its ±inf is kept (JSON writes it as `null`, tables as `inf`).
    pub data: Vec<Option<f32>>,
}

impl TensorJson {
    fn to_tensor(&self, what: &str) -> Result<Tensor> {
        let data = self
            .data
            .iter()
            .enumerate()
            .map(|(i, x)| match x {
                Some(v) if v.is_finite() => Ok(*v),
                Some(_) => Err(case_err(format!(
                    "{what}: element {i} is beyond the f32 range (±3.4e38; inputs must be finite)"
                ))),
                None => Err(case_err(format!(
                    "{what}: element {i} is null (JSON has no NaN; inputs must be finite)"
                ))),
            })
            .collect::<Result<Vec<f32>>>()?;
        Tensor::from_vec(data, &self.shape).map_err(|e| case_err(format!("{what}: {e}")))
    }

    /// From a tensor (NaN becomes `None`); GPU tensors are read back.
    pub fn from_tensor(t: &Tensor) -> Result<Self> {
        Ok(Self::from_values(t.shape(), t.try_to_vec()?))
    }

    /// From a tensor on any device, read back asynchronously (works in a browser).
    pub async fn read(t: &Tensor) -> Result<Self> {
        Ok(Self::from_values(t.shape(), t.read().await?))
    }

    fn from_values(shape: &[usize], values: Vec<f32>) -> Self {
        TensorJson {
            shape: shape.to_vec(),
            data: values
                .into_iter()
                .map(|x| (!x.is_nan()).then_some(x))
                .collect(),
        }
    }
}

/// One case: see the module docs.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Case {
    /// Collective name.
    pub collective: String,
    /// Number of ranks.
    pub world: usize,
    /// Reduce op name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub op: Option<String>,
    /// Root (group rank).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub root: Option<usize>,
    /// Permute pairs (group ranks).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub perm: Option<Vec<(usize, usize)>>,
    /// all_to_all_single: rows sent to each group rank, per global rank.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub in_splits: Option<Vec<Vec<usize>>>,
    /// all_to_all_single: rows received from each group rank, per global rank.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub out_splits: Option<Vec<Vec<usize>>>,
    /// Subgroup (global ranks).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group: Option<Vec<usize>>,
    /// Inputs per global rank.
    pub inputs: Vec<Vec<TensorJson>>,
    /// Output cotangents per global rank (default: ones).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cotangents: Option<Vec<Vec<TensorJson>>>,
}

/// The answer to a case.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CaseOutput {
    /// The collective(s) the backward pass ran.
    pub dual: String,
    /// Outputs per global rank.
    pub outputs: Vec<Vec<TensorJson>>,
    /// Input gradients per global rank.
    pub grads: Vec<Vec<TensorJson>>,
}

/// The collectives a one-collective case runs, in schema order (every kind but barrier and
/// send/recv, whose peers differ per rank).
pub const COLLECTIVES: [Kind; 10] = [
    Kind::Broadcast,
    Kind::Reduce,
    Kind::Gather,
    Kind::Scatter,
    Kind::AllGather,
    Kind::ReduceScatter,
    Kind::AllToAll,
    Kind::AllReduce,
    Kind::Permute,
    Kind::AllToAllSingle,
];

/// Parse a case's collective name (one of [`COLLECTIVES`]).
pub fn parse_collective(s: &str) -> Result<Kind> {
    COLLECTIVES
        .into_iter()
        .find(|k| k.name() == s)
        .ok_or_else(|| {
            let names: Vec<_> = COLLECTIVES.iter().map(|k| k.name()).collect();
            case_err(format!(
                "unknown collective {s:?}; expected one of {}",
                names.join(", ")
            ))
        })
}

/// Parse a case from JSON text.
pub fn parse_case(json: &str) -> Result<Case> {
    serde_json::from_str(json).map_err(|e| {
        // A list, a number...: say what a case is rather than serde's "expected struct Case".
        let hint = match serde_json::from_str::<serde_json::Value>(json) {
            Ok(v) if !v.is_object() => {
                " (a case is one JSON object: `distgrad vjp all_gather --print-case` prints one)"
            }
            _ => "",
        };
        Error::from(ProgramError::Json {
            reader: "case",
            detail: format!("{e}{hint}"),
        })
    })
}

/// A case checked and made into its program ([`Case::program`]), ready to run on any
/// communicator ([`rank_result`]): the program's [`Plan`] is what runs; the case's calls say how
/// to read its answer.
pub struct Prepared {
    calls: Calls,
    plan: Plan,
}

impl Prepared {
    /// Check a case and its program.
    pub fn new(case: &Case) -> Result<Self> {
        let calls = Calls::of(case)?;
        // What the case check leaves to the program check: shapes that must agree across the
        // ranks, split sizes against the rows passed.
        let plan = build(case, &calls)?.plan(None).map_err(|e| match e {
            Error::Program(e) => Error::from(ProgramError::Case {
                detail: format!(
                    "{}: the ranks' inputs do not fit together (checked as the case's program, \
                     which --print-program shows): {e}",
                    calls.kind.name()
                ),
            }),
            other => other,
        })?;
        Ok(Prepared { calls, plan })
    }

    /// World size.
    pub fn world(&self) -> usize {
        self.calls.world
    }

    /// The plan of the case's program.
    pub fn plan(&self) -> &Plan {
        &self.plan
    }
}

/// One rank's part of a case's answer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RankResult {
    /// This rank's outputs.
    pub outputs: Vec<TensorJson>,
    /// This rank's input gradients.
    pub grads: Vec<TensorJson>,
    /// The collectives this rank's backward pass ran (empty outside the group).
    pub dual: Vec<String>,
    /// What this rank did in the forward call and in its dual, where the communicator records
    /// events ([`crate::collective::P2p::set_record_events`]): `(forward, backward)`.
    #[serde(skip)]
    pub events: (Vec<CallRecord>, Vec<CallRecord>),
}

/// This rank's part of a case's answer, run on `comm` (any transport): the case's program
/// ([`Case::program`]) forward and backward by [`trace_rank`]; the collective's outputs and the
/// inputs' gradients are read back, and the calls recorded during backward name the dual.
pub async fn rank_result<T: Transport>(comm: &P2p<T>, prepared: &Prepared) -> Result<RankResult> {
    let c = &prepared.calls;
    let me = comm.rank();
    if comm.world_size() != c.world {
        return Err(case_err(format!(
            "case is for world {}, communicator has {}",
            c.world,
            comm.world_size()
        )));
    }
    comm.take_calls();
    comm.take_events();
    let mut forward = Vec::new();
    let run = trace_rank(
        comm,
        &prepared.plan,
        || {
            comm.take_calls();
            forward = comm.take_events();
        },
        &mut |_| {},
    )
    .await?;
    let events = (forward, comm.take_events());
    let dual = comm
        .take_calls()
        .iter()
        .map(|(_, s)| short_sig(s))
        .collect();
    let names = slot_names("x", c.n_inputs.iter().copied().max().unwrap_or(0));
    let mut grads = Vec::with_capacity(c.n_inputs[me]);
    for x in names.iter().take(c.n_inputs[me]) {
        let g = run
            .grads
            .get(x)
            .ok_or_else(|| case_err(format!("rank {me}: the case's program has no input {x}")))?;
        grads.push(TensorJson::read(g).await?);
    }
    let mut outputs = Vec::new();
    for y in output_names(c.kind, c.n_outputs(me)) {
        if let Some(t) = run.values.get(&y) {
            outputs.push(TensorJson::read(t).await?);
        }
    }
    Ok(RankResult {
        outputs,
        grads,
        dual,
        events,
    })
}

/// Put the ranks' results (index = global rank) together into the case's answer.
pub fn assemble(prepared: &Prepared, results: Vec<Result<RankResult>>) -> Result<CaseOutput> {
    let p = &prepared.calls;
    let mut outputs = Vec::with_capacity(p.world);
    let mut grads = Vec::with_capacity(p.world);
    let mut dual = None;
    let mut errors = Vec::new();
    for (r, res) in results.into_iter().enumerate() {
        match res {
            Ok(rr) => {
                outputs.push(rr.outputs);
                grads.push(rr.grads);
                if dual.is_none() && p.group.contains(&r) {
                    dual = Some(rr.dual);
                }
            }
            Err(e) => errors.push(format!("rank {r}: {e}")),
        }
    }
    if !errors.is_empty() {
        return Err(case_err(format!(
            "{} failed:\n  {}",
            p.kind.name(),
            errors.join("\n  ")
        )));
    }
    let dual = dual.unwrap_or_default();
    Ok(CaseOutput {
        dual: if dual.is_empty() {
            "nothing".into()
        } else {
            dual.join(" + ")
        },
        outputs,
        grads,
    })
}

/// Run a case on `world` in-process ranks (native: ranks are threads), on the CPU.
#[cfg(not(target_arch = "wasm32"))]
pub fn run_case(case: &Case) -> Result<CaseOutput> {
    run_case_on(case, &crate::backend::Device::Cpu)
}

/// Run a case on `world` in-process ranks with every tensor on `device`.
#[cfg(not(target_arch = "wasm32"))]
pub fn run_case_on(case: &Case, device: &crate::backend::Device) -> Result<CaseOutput> {
    let prepared = Prepared::new(case)?;
    let opts = CommOptions {
        device: device.clone(),
        ..CommOptions::recorded()
    };
    let results = run_local(prepared.world(), opts, |comm| {
        let p = &prepared;
        async move { rank_result(&comm, p).await }
    });
    assemble(&prepared, results)
}

/// Run a case on `world` in-process ranks interleaved on the calling task (any target: a browser
/// page's simulated ranks), with every tensor on `device`.
pub async fn run_case_interleaved(
    case: &Case,
    device: &crate::backend::Device,
) -> Result<CaseOutput> {
    let prepared = Prepared::new(case)?;
    let opts = CommOptions {
        device: device.clone(),
        ..CommOptions::recorded()
    };
    let results = crate::in_process::run_interleaved(prepared.world(), opts, |comm| {
        let p = &prepared;
        async move { rank_result(&comm, p).await }
    })
    .await;
    assemble(&prepared, results)
}

pub(crate) fn short_sig(s: &crate::collective::CallSig) -> String {
    s.short()
}
