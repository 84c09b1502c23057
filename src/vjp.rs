//! `distgrad vjp`: one collective, forward and backward, on N in-process ranks, from a JSON case.
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

use std::fmt::Write as _;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::collective::{CommOptions, Communicator, Kind, P2p, ReduceOp, Spec};
use crate::error::{Error, Result};
#[cfg(not(target_arch = "wasm32"))]
use crate::run::run_local;
use crate::tensor::Tensor;
use crate::transport::Transport;

/// Largest world a case may ask for (ranks are threads).
pub const MAX_WORLD: usize = 64;

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
                Some(_) => Err(Error::Input(format!(
                    "{what}: element {i} is beyond the f32 range (±3.4e38; inputs must be finite)"
                ))),
                None => Err(Error::Input(format!(
                    "{what}: element {i} is null (JSON has no NaN; inputs must be finite)"
                ))),
            })
            .collect::<Result<Vec<f32>>>()?;
        Tensor::from_vec(data, &self.shape).map_err(|e| Error::Input(format!("{what}: {e}")))
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
            Error::Input(format!(
                "unknown collective {s:?}; expected one of {}",
                names.join(", ")
            ))
        })
}

/// A case validated and decoded.
struct Plan {
    kind: Kind,
    world: usize,
    /// The call of each global rank (members only: index = position in `group`).
    specs: Vec<Spec>,
    group: Vec<usize>,
    /// How many input tensors each global rank passes.
    n_inputs: Vec<usize>,
}

fn plan(case: &Case) -> Result<Plan> {
    let which = parse_collective(&case.collective)?;
    let world = case.world;
    if world == 0 || world > MAX_WORLD {
        return Err(Error::Input(format!(
            "world must be 1..={MAX_WORLD}, got {world}"
        )));
    }
    let op = match (&case.op, which.takes_op()) {
        (Some(s), true) => ReduceOp::parse(s)?,
        (None, true) => ReduceOp::Sum,
        (Some(_), false) => return Err(Error::Input(format!("{} takes no \"op\"", which.name()))),
        (None, false) => ReduceOp::Sum,
    };
    let group = case.group.clone().unwrap_or_else(|| (0..world).collect());
    let mut seen = vec![false; world];
    for &g in &group {
        if g >= world || std::mem::replace(&mut seen[g], true) {
            return Err(Error::Input(format!(
                "group {group:?}: ranks must be distinct and below world {world}"
            )));
        }
    }
    if group.is_empty() {
        return Err(Error::Input("group must not be empty".into()));
    }
    let n = group.len();
    let root = match (case.root, which.takes_root()) {
        (Some(r), true) if r >= n => {
            return Err(Error::Input(format!(
                "root {r} is not a group rank (group size {n}; roots are group ranks)"
            )));
        }
        (Some(r), true) => r,
        (None, true) => 0,
        (Some(_), false) => {
            return Err(Error::Input(format!("{} takes no \"root\"", which.name())));
        }
        (None, false) => 0,
    };
    let perm = match (which, &case.perm) {
        (Kind::Permute, Some(p)) => p.clone(),
        (Kind::Permute, None) => {
            return Err(Error::Input(
                "permute needs \"perm\": [[src,dst],...]".into(),
            ));
        }
        (_, Some(_)) => return Err(Error::Input(format!("{} takes no \"perm\"", which.name()))),
        (_, None) => Vec::new(),
    };
    let splits = match (which, &case.in_splits, &case.out_splits) {
        (Kind::AllToAllSingle, Some(i), Some(o)) if i.len() == world && o.len() == world => {
            i.iter().cloned().zip(o.iter().cloned()).collect()
        }
        (Kind::AllToAllSingle, _, _) => {
            return Err(Error::Input(
                "all_to_all_single needs \"in_splits\" and \"out_splits\", one list per global rank".into(),
            ));
        }
        (_, None, None) => Vec::new(),
        _ => {
            return Err(Error::Input(format!(
                "{} takes no split sizes",
                which.name()
            )));
        }
    };
    let per_rank = |what: &str,
                    lists: &[Vec<TensorJson>],
                    count: &dyn Fn(usize) -> usize|
     -> Result<Vec<Vec<Tensor>>> {
        if lists.len() != world {
            return Err(Error::Input(format!(
                "\"{what}\" needs one list per global rank ({world}), got {}",
                lists.len()
            )));
        }
        lists
            .iter()
            .enumerate()
            .map(|(g, l)| {
                let want = count(g);
                if l.len() != want {
                    return Err(Error::Input(format!(
                        "{what} of rank {g}: {} takes {want} tensor(s) here, got {}",
                        which.name(),
                        l.len()
                    )));
                }
                l.iter()
                    .enumerate()
                    .map(|(i, t)| t.to_tensor(&format!("{what}[{g}][{i}]")))
                    .collect()
            })
            .collect()
    };
    // One call per member (only all_to_all_single's splits differ between ranks).
    let specs: Vec<Spec> = group
        .iter()
        .map(|&g| match which {
            Kind::Broadcast => Spec::Broadcast { root },
            Kind::Reduce => Spec::Reduce { root, op },
            Kind::AllReduce => Spec::AllReduce { op },
            Kind::Gather => Spec::Gather { root },
            Kind::Scatter => Spec::Scatter { root },
            Kind::AllGather => Spec::AllGather {},
            Kind::ReduceScatter => Spec::ReduceScatter { op },
            Kind::AllToAll => Spec::AllToAll {},
            Kind::AllToAllSingle => Spec::AllToAllSingle {
                in_splits: splits[g].0.clone(),
                out_splits: splits[g].1.clone(),
            },
            Kind::Permute => Spec::Permute { perm: perm.clone() },
            // parse_collective refuses these
            Kind::Send | Kind::Barrier => Spec::Barrier {},
        })
        .collect();
    for (r, spec) in specs.iter().enumerate() {
        spec.check(r, n)
            .map_err(|e| Error::Input(format!("rank {}: {e}", group[r])))?;
    }
    let group_rank = |g: usize| group.iter().position(|&x| x == g);
    let inputs = per_rank("inputs", &case.inputs, &|g| {
        group_rank(g).map_or(0, |r| specs[r].n_inputs(r, n))
    })?;
    let n_outputs = |g: usize| group_rank(g).map_or(0, |r| specs[r].n_outputs(r, n));
    if let Some(c) = &case.cotangents {
        per_rank("cotangents", c, &n_outputs)?;
    }
    Ok(Plan {
        kind: which,
        world,
        specs,
        group,
        n_inputs: inputs.iter().map(Vec::len).collect(),
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
        Error::Input(format!("case JSON: {e}{hint}"))
    })
}

/// A case's calls, validated: the group (global ranks) and each member's call, in group order.
pub(crate) fn case_calls(case: &Case) -> Result<(Vec<usize>, Vec<Spec>)> {
    plan(case).map(|p| (p.group, p.specs))
}

/// A validated case, ready to run on any communicator: the case and the one-collective program
/// it is ([`crate::program::from_case`]), which is what runs.
pub struct Prepared {
    case: Plan,
    program: crate::program::Plan,
}

impl Prepared {
    /// Validate a case and check its program.
    pub fn new(case_json: &Case) -> Result<Self> {
        let case = plan(case_json)?;
        // What the case check leaves to the program check: shapes that must agree across the
        // ranks, split sizes against the rows passed.
        let program = crate::program::from_case(case_json)?
            .plan(None)
            .map_err(|e| match e {
                Error::Input(m) => Error::Input(format!(
                    "{}: the ranks' inputs do not fit together (checked as the case's program, \
                     which --print-program shows): {m}",
                    case.kind.name()
                )),
                other => other,
            })?;
        Ok(Prepared { case, program })
    }

    /// World size.
    pub fn world(&self) -> usize {
        self.case.world
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
}

/// Run this rank's part of a case on `comm` (any transport): its program
/// ([`crate::program::from_case`]) forward and backward; the collective's outputs and the inputs'
/// gradients are read back. Calls are recorded to name the dual.
pub async fn run_rank<T: Transport>(comm: &P2p<T>, prepared: &Prepared) -> Result<RankResult> {
    let p = &prepared.case;
    let me = comm.rank();
    if comm.world_size() != p.world {
        return Err(Error::Input(format!(
            "case is for world {}, communicator has {}",
            p.world,
            comm.world_size()
        )));
    }
    comm.take_calls();
    let run = crate::program::trace_rank(
        comm,
        &prepared.program,
        || {
            comm.take_calls();
        },
        &mut |_| {},
    )
    .await?;
    let dual = comm
        .take_calls()
        .iter()
        .map(|(_, s)| short_sig(s))
        .collect();
    // The program's names (see from_case): inputs x or x0, x1, ...; output y or y.0, y.1, ...
    let n_in = p.n_inputs.iter().copied().max().unwrap_or(0);
    let input = |k: usize| {
        if n_in == 1 {
            "x".to_string()
        } else {
            format!("x{k}")
        }
    };
    let mut grads = Vec::with_capacity(p.n_inputs[me]);
    for k in 0..p.n_inputs[me] {
        let g = run.grads.get(&input(k)).ok_or_else(|| {
            Error::Input(format!(
                "rank {me}: the case's program has no input {}",
                input(k)
            ))
        })?;
        grads.push(TensorJson::read(g).await?);
    }
    let ys: Vec<&Tensor> = match run.values.get("y") {
        Some(y) => vec![y],
        None => (0..)
            .map_while(|k| run.values.get(&format!("y.{k}")))
            .collect(),
    };
    let mut outputs = Vec::with_capacity(ys.len());
    for y in ys {
        outputs.push(TensorJson::read(y).await?);
    }
    Ok(RankResult {
        outputs,
        grads,
        dual,
    })
}

/// Communicator options for running cases: calls recorded, 10 s timeout.
pub fn case_options() -> CommOptions {
    CommOptions {
        timeout: Duration::from_secs(10),
        record_calls: true,
        ..CommOptions::default()
    }
}

/// [`case_options`] for the ranks of a relay room, browser tabs and the native workers that join
/// them alike (every rank of a group must choose the same algorithms): small all_reduces go
/// through group rank 0 and back
/// ([`SmallAllReduce::Star`](crate::collective::SmallAllReduce::Star)), where every message costs the
/// sender and the receiver a fixed price (a tab's `postMessage`, a relay hop).
pub fn room_options() -> CommOptions {
    CommOptions {
        small_all_reduce: crate::collective::SmallAllReduce::Star,
        ..case_options()
    }
}

/// Put the ranks' results (index = global rank) together into the case's answer.
pub fn assemble(prepared: &Prepared, results: Vec<Result<RankResult>>) -> Result<CaseOutput> {
    let p = &prepared.case;
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
        return Err(Error::Input(format!(
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
        ..case_options()
    };
    let results = run_local(prepared.world(), opts, |comm| {
        let p = &prepared;
        async move { run_rank(&comm, p).await }
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
        ..case_options()
    };
    let results = crate::run::run_interleaved(prepared.world(), opts, |comm| {
        let p = &prepared;
        async move { run_rank(&comm, p).await }
    })
    .await;
    assemble(&prepared, results)
}

pub(crate) fn short_sig(s: &crate::collective::CallSig) -> String {
    let mut args = Vec::new();
    if let Some(op) = s.op {
        args.push(format!("op={}", op.name()));
    }
    if let Some(r) = s.root {
        args.push(format!("root={r}"));
    }
    if args.is_empty() {
        s.kind.name().to_string()
    } else {
        format!("{}({})", s.kind.name(), args.join(", "))
    }
}

/// A built-in example case for `distgrad vjp <collective> --world N`: small integer inputs that make
/// each collective's effect visible, cotangents `[1, r+1]` on rank `r`.
#[cfg(not(target_arch = "wasm32"))]
pub fn example_case(
    which: Kind,
    world: usize,
    op: ReduceOp,
    root: usize,
    group: Option<Vec<usize>>,
) -> Result<Case> {
    futures::executor::block_on(example_case_async(which, world, op, root, group))
}

/// [`example_case`] on any target (its forward probe runs the ranks interleaved on this task).
pub async fn example_case_async(
    which: Kind,
    world: usize,
    op: ReduceOp,
    root: usize,
    group: Option<Vec<usize>>,
) -> Result<Case> {
    if world == 0 || world > MAX_WORLD {
        return Err(Error::Input(format!(
            "world must be 1..={MAX_WORLD}, got {world}"
        )));
    }
    let members = group.clone().unwrap_or_else(|| (0..world).collect());
    let n = members.len();
    let t = |a: f32, b: f32| TensorJson {
        shape: vec![2],
        data: vec![Some(a), Some(b)],
    };
    let gr = |g: usize| members.iter().position(|&x| x == g);
    let inputs: Vec<Vec<TensorJson>> = (0..world)
        .map(|g| match gr(g) {
            None => Vec::new(),
            Some(r) => {
                let rf = r as f32;
                match which {
                    Kind::Scatter if r == root => (0..n)
                        .map(|j| t(j as f32 + 1.0, 10.0 * (j as f32 + 1.0)))
                        .collect(),
                    Kind::Scatter => Vec::new(),
                    Kind::ReduceScatter | Kind::AllToAll => (0..n)
                        .map(|j| t(10.0 * rf + j as f32 + 1.0, -(10.0 * rf + j as f32 + 1.0)))
                        .collect(),
                    Kind::AllToAllSingle => {
                        let rows = n; // rank r sends one row to each rank
                        vec![TensorJson {
                            shape: vec![rows, 1],
                            data: (0..rows)
                                .map(|j| Some(10.0 * rf + j as f32 + 1.0))
                                .collect(),
                        }]
                    }
                    // distinct values, with the extreme on different ranks per element
                    _ => vec![t(rf + 1.0, 2.0 * (n as f32 - rf))],
                }
            }
        })
        .collect();
    let mut case = Case {
        collective: which.name().to_string(),
        world,
        op: which.takes_op().then(|| op.name().to_string()),
        root: which.takes_root().then_some(root),
        perm: (which == Kind::Permute).then(|| (0..n).map(|i| (i, (i + 1) % n)).collect()),
        in_splits: None,
        out_splits: None,
        group: group.clone(),
        inputs,
        cotangents: None,
    };
    if which == Kind::AllToAllSingle {
        let s: Vec<Vec<usize>> = (0..world)
            .map(|g| {
                if gr(g).is_some() {
                    vec![1; n]
                } else {
                    Vec::new()
                }
            })
            .collect();
        case.in_splits = Some(s.clone());
        case.out_splits = Some(s);
    }
    // Cotangents [1, r+1] (or [1] per row) for every output, shaped like the outputs: run forward once
    // with default ones to learn the output shapes.
    let probe = run_case_interleaved(&case, &crate::backend::Device::Cpu).await?;
    case.cotangents = Some(
        probe
            .outputs
            .iter()
            .enumerate()
            .map(|(g, outs)| {
                outs.iter()
                    .map(|o| TensorJson {
                        shape: o.shape.clone(),
                        data: (0..o.data.len())
                            .map(|i| Some(if i % 2 == 0 { 1.0 } else { g as f32 + 1.0 }))
                            .collect(),
                    })
                    .collect()
            })
            .collect(),
    );
    Ok(case)
}

/// A tensor as the tables print it: `[1, 2]`, or `[2, 1]:[1, 2]` beyond one dimension.
pub fn fmt_t(t: &TensorJson) -> String {
    let vals: Vec<String> = t
        .data
        .iter()
        .map(|x| match x {
            Some(v) => fmt_value(*v),
            None => "nan".into(),
        })
        .collect();
    if t.shape.is_empty() && vals.len() == 1 {
        vals[0].clone()
    } else if t.shape.len() == 1 {
        format!("[{}]", vals.join(", "))
    } else {
        format!("{:?}:[{}]", t.shape, vals.join(", "))
    }
}

/// A value as the tables print it: shortest round-trip decimal, in exponent form where that is
/// shorter to read (|v| ≥ 1e7 or < 1e-4), `inf` / `-inf` for infinities.
fn fmt_value(v: f32) -> String {
    let a = v.abs();
    if a.is_finite() && a != 0.0 && !(1e-4..1e7).contains(&a) {
        format!("{v:e}")
    } else {
        format!("{v}")
    }
}

fn fmt_list(l: &[TensorJson]) -> String {
    if l.is_empty() {
        "-".into()
    } else {
        l.iter().map(fmt_t).collect::<Vec<_>>().join(" ")
    }
}

/// The per-rank table `distgrad vjp` prints.
pub fn render_table(case: &Case, out: &CaseOutput) -> String {
    let mut s = String::new();
    let mut head = format!("forward: {}", case.collective);
    // The defaults a case may leave out are shown too, where the collective takes them.
    let which = parse_collective(&case.collective).ok();
    match &case.op {
        Some(op) => {
            let _ = write!(head, " op={op}");
        }
        None if which.is_some_and(Kind::takes_op) => head.push_str(" op=sum"),
        None => {}
    }
    match case.root {
        Some(r) => {
            let _ = write!(head, " root={r}");
        }
        None if which.is_some_and(Kind::takes_root) => head.push_str(" root=0"),
        None => {}
    }
    if let Some(p) = &case.perm {
        let _ = write!(head, " perm={p:?}");
    }
    if let Some(g) = &case.group {
        let _ = write!(head, " group={g:?}");
    }
    let _ = writeln!(s, "{head}   world={}", case.world);
    let _ = writeln!(s, "backward (dual): {}", out.dual);
    let cots: Vec<String> = (0..case.world)
        .map(|g| match &case.cotangents {
            Some(c) => fmt_list(&c[g]),
            None => out.outputs[g]
                .iter()
                .map(|o| {
                    fmt_t(&TensorJson {
                        shape: o.shape.clone(),
                        data: vec![Some(1.0); o.data.len()],
                    })
                })
                .collect::<Vec<_>>()
                .join(" "),
        })
        .collect();
    let rows: Vec<[String; 5]> = (0..case.world)
        .map(|g| {
            [
                g.to_string(),
                fmt_list(&case.inputs[g]),
                fmt_list(&out.outputs[g]),
                if cots[g].is_empty() {
                    "-".into()
                } else {
                    cots[g].clone()
                },
                fmt_list(&out.grads[g]),
            ]
        })
        .collect();
    let header = ["rank", "inputs", "outputs", "cotangents", "grads"];
    s.push_str(&text_table(&header, &rows));
    s
}

/// A plain-text table: columns padded to their widest cell, `|` between them, a `-+-` rule under
/// the header, trailing spaces trimmed (the tables of `vjp`, `run` and `gradcheck`).
pub fn text_table<R: AsRef<[String]>>(header: &[&str], rows: &[R]) -> String {
    let widths: Vec<usize> = (0..header.len())
        .map(|c| {
            rows.iter()
                .map(|r| r.as_ref().get(c).map_or(0, |x| x.chars().count()))
                .chain([header[c].chars().count()])
                .max()
                .unwrap_or(0)
        })
        .collect();
    let line = |cells: &mut dyn Iterator<Item = &str>| {
        cells
            .zip(&widths)
            .map(|(c, w)| format!("{c:<w$}"))
            .collect::<Vec<_>>()
            .join(" | ")
            .trim_end()
            .to_string()
    };
    let mut s = line(&mut header.iter().copied());
    s.push('\n');
    s.push_str(
        &widths
            .iter()
            .map(|w| "-".repeat(*w))
            .collect::<Vec<_>>()
            .join("-+-"),
    );
    s.push('\n');
    for r in rows {
        s.push_str(&line(&mut r.as_ref().iter().map(String::as_str)));
        s.push('\n');
    }
    s
}
