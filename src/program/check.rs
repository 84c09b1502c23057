//! Everything about a program that can be checked before it runs: names, fields, shapes on every
//! rank, what must agree across the ranks of a collective, send / recv pairs. The result is a
//! [`Plan`]: each rank's inputs and, per step, the call each rank makes.

use std::collections::{BTreeMap, HashMap};

use super::{Input, LocalOp, MAX_NUMEL, MAX_WORLD, Program, Step, StepKind};
use crate::collective::{Kind, Spec};
use crate::error::{Error, Result};
use crate::tensor::{Tensor, broadcast_shape};

/// A checked program for a world: each rank's inputs and each step's per-rank call.
#[derive(Debug, Clone)]
pub struct Plan {
    pub(super) program: Program,
    pub(super) world: usize,
    /// Distinct groups (global ranks), in order of first use; every rank creates them in this order.
    pub(super) groups: Vec<Vec<usize>>,
    pub(super) steps: Vec<Planned>,
    /// Per rank, per input (an empty placeholder where the rank does not hold it).
    pub(super) inputs: Vec<Vec<Tensor>>,
    /// Per rank, per input: whether the rank holds it.
    pub(super) held: Vec<Vec<bool>>,
}

/// One step as each rank runs it.
#[derive(Debug, Clone)]
pub(super) struct Planned {
    pub(super) index: usize,
    pub(super) what: What,
    pub(super) inputs: Vec<String>,
    pub(super) out: Option<String>,
}

#[derive(Debug, Clone)]
pub(super) enum What {
    /// A local op on the ranks marked `true`.
    Local(LocalOp, Vec<bool>),
    /// A collective on group `group` (index into `Plan::groups`); the call of each global rank
    /// (`None`: not taking part).
    Collective {
        group: usize,
        specs: Vec<Option<Spec>>,
    },
}

impl Plan {
    /// Number of ranks.
    pub fn world(&self) -> usize {
        self.world
    }

    /// The program.
    pub fn program(&self) -> &Program {
        &self.program
    }

    /// The inputs of global rank `rank`, in the program's order (an empty tensor of shape `[0]`
    /// for an input the rank does not hold: [`Plan::holds`]).
    pub fn inputs(&self, rank: usize) -> &[Tensor] {
        self.inputs.get(rank).map_or(&[], Vec::as_slice)
    }

    /// Whether global rank `rank` holds input `input` (the index in the program's order).
    pub fn holds(&self, rank: usize, input: usize) -> bool {
        self.held
            .get(rank)
            .and_then(|h| h.get(input))
            .copied()
            .unwrap_or(false)
    }

    /// Names of the inputs.
    pub fn input_names(&self) -> Vec<&str> {
        self.program
            .inputs
            .iter()
            .map(|i| i.name.as_str())
            .collect()
    }
}

/// Whether a collective's output is a list (bound as `out.0`, `out.1`, ...).
pub(crate) fn lists_outputs(kind: Kind) -> bool {
    matches!(kind, Kind::Gather | Kind::AllGather | Kind::AllToAll)
}

/// An error about a step; `at` says where it is in the program as written (`step 3`, or a step of
/// a `"for"` block: `step 0 (for s), its step 2 with s = 1`).
fn err(at: &str, s: &Step, detail: impl std::fmt::Display) -> Error {
    Error::Input(format!("{at} ({}): {detail}", s.describe()))
}

/// Steps of the expanded program as messages name them: `steps [0, 2]`, or where they came from
/// in a `"for"` block.
fn steps_at(steps: &[usize], origins: &[String]) -> String {
    let named: Vec<&str> = steps
        .iter()
        .map(|&k| origins.get(k).map_or("?", String::as_str))
        .collect();
    if steps
        .iter()
        .zip(&named)
        .all(|(k, n)| *n == format!("step {k}"))
    {
        format!("steps {steps:?}")
    } else {
        named.join("; ")
    }
}

fn check_name(what: &str, name: &str) -> Result<()> {
    if name.is_empty() || name.contains('.') || name.chars().any(char::is_whitespace) {
        return Err(Error::Input(format!(
            "{what} {name:?}: names are non-empty, without '.' (list outputs are `name.0`, `name.1`, ...) and without spaces"
        )));
    }
    Ok(())
}

fn ranks_of(what: &str, ranks: &[usize], world: usize) -> Result<Vec<bool>> {
    let mut seen = vec![false; world];
    for &r in ranks {
        if r >= world || std::mem::replace(&mut seen[r], true) {
            return Err(Error::Input(format!(
                "{what} {ranks:?}: ranks must be distinct and below world {world}"
            )));
        }
    }
    if ranks.is_empty() {
        return Err(Error::Input(format!("{what} must not be empty")));
    }
    Ok(seen)
}

/// Seeded values for rank `rank` (the same on every rank if `rank` is `None`).
fn generated(seed: u64, rank: Option<usize>, n: usize, (lo, hi): (f32, f32)) -> Vec<f32> {
    let s = match rank {
        Some(r) => seed
            .wrapping_mul(0x100_0000_01B3)
            .wrapping_add(r as u64 + 1),
        None => seed.wrapping_mul(0x100_0000_01B3),
    };
    crate::train::uniform(s ^ 0x5EED, n)
        .into_iter()
        .map(|u| lo + (u + 1.0) * 0.5 * (hi - lo))
        .collect()
}

/// Each rank's value of input `index` (`None` on ranks that do not hold it).
fn input_values(index: usize, inp: &Input, world: usize) -> Result<Vec<Option<Tensor>>> {
    let what = format!("input {:?}", inp.name);
    let holders: Vec<usize> = match &inp.ranks {
        Some(r) => {
            ranks_of(&format!("{what}: \"ranks\""), r, world)?;
            r.clone()
        }
        None => (0..world).collect(),
    };
    let shapes: Vec<Vec<usize>> = match (&inp.shape, &inp.shapes) {
        (Some(s), None) => vec![s.clone(); holders.len()],
        (None, Some(s)) if s.len() == holders.len() => s.clone(),
        (None, Some(s)) => {
            return Err(Error::Input(format!(
                "{what}: \"shapes\" needs one shape per rank that holds it ({}), got {}",
                holders.len(),
                s.len()
            )));
        }
        _ => {
            return Err(Error::Input(format!(
                "{what}: give \"shape\" (every rank) or \"shapes\" (one per rank that holds it)"
            )));
        }
    };
    if inp.replicated && (inp.ranks.is_some() || inp.shapes.is_some()) {
        return Err(Error::Input(format!(
            "{what}: a replicated input is the same on every rank; it takes neither \"ranks\" nor \"shapes\""
        )));
    }
    let numels = shapes
        .iter()
        .map(|shape| {
            crate::tensor::checked_numel(shape)
                .filter(|&n| n <= MAX_NUMEL)
                .ok_or_else(|| {
                    Error::Input(format!(
                        "{what}: shape {shape:?} has more than {MAX_NUMEL} elements"
                    ))
                })
        })
        .collect::<Result<Vec<usize>>>()?;
    let given = [
        inp.values.is_some(),
        inp.value.is_some(),
        inp.seed.is_some(),
    ]
    .iter()
    .filter(|&&b| b)
    .count();
    if given > 1 {
        return Err(Error::Input(format!(
            "{what}: give one of \"values\", \"value\", \"seed\""
        )));
    }
    if inp.per_rank.is_some() && (inp.value.is_none() || inp.replicated) {
        return Err(Error::Input(format!(
            "{what}: \"per_rank\" adds r times itself to \"value\" on rank r: give \"value\" too, and not \"replicated\""
        )));
    }
    if inp.range.is_some() && (inp.values.is_some() || inp.value.is_some()) {
        return Err(Error::Input(format!(
            "{what}: \"range\" is for generated values"
        )));
    }
    let check = |v: &[f32], k: usize, whose: &str| -> Result<()> {
        if v.len() != numels[k] {
            return Err(Error::Input(format!(
                "{what}{whose}: shape {:?} needs {} values, got {}",
                shapes[k],
                numels[k],
                v.len()
            )));
        }
        if let Some(i) = v.iter().position(|x| !x.is_finite()) {
            return Err(Error::Input(format!(
                "{what}{whose}: value {i} is not finite"
            )));
        }
        Ok(())
    };
    // One list per holder, in the order of `holders`.
    let held: Vec<Vec<f32>> = if let Some(vs) = &inp.values {
        if inp.replicated {
            return Err(Error::Input(format!(
                "{what}: \"values\" are per rank; a replicated input takes \"value\" or \"seed\""
            )));
        }
        if vs.len() != holders.len() {
            let whom = if inp.ranks.is_some() {
                format!("rank of \"ranks\" ({})", holders.len())
            } else {
                format!("rank ({world})")
            };
            return Err(Error::Input(format!(
                "{what}: \"values\" needs one list per {whom}, got {}",
                vs.len()
            )));
        }
        for (k, v) in vs.iter().enumerate() {
            check(v, k, &format!(" on rank {}", holders[k]))?;
        }
        vs.clone()
    } else if let Some(v) = &inp.value {
        for (k, &r) in holders.iter().enumerate() {
            let whose = if inp.shapes.is_some() {
                format!(" on rank {r}")
            } else {
                String::new()
            };
            check(v, k, &whose)?;
        }
        match &inp.per_rank {
            Some(d) => {
                if d.len() != v.len() || d.iter().any(|x| !x.is_finite()) {
                    return Err(Error::Input(format!(
                        "{what}: \"per_rank\" needs {} finite values (one per value), got {}",
                        v.len(),
                        d.len()
                    )));
                }
                let mut out = Vec::with_capacity(holders.len());
                for (k, &r) in holders.iter().enumerate() {
                    let at: Vec<f32> = v.iter().zip(d).map(|(a, b)| a + r as f32 * b).collect();
                    check(&at, k, &format!(" on rank {r}"))?;
                    out.push(at);
                }
                out
            }
            None => vec![v.clone(); holders.len()],
        }
    } else {
        let range = inp.range.unwrap_or((-1.0, 1.0));
        if !(range.0.is_finite() && range.1.is_finite() && range.0 <= range.1) {
            return Err(Error::Input(format!(
                "{what}: range {range:?} must be finite and ordered"
            )));
        }
        let seed = inp.seed.unwrap_or(index as u64);
        holders
            .iter()
            .enumerate()
            .map(|(k, &r)| generated(seed, (!inp.replicated).then_some(r), numels[k], range))
            .collect()
    };
    let mut out = vec![None; world];
    for ((v, shape), &r) in held.into_iter().zip(&shapes).zip(&holders) {
        out[r] =
            Some(Tensor::from_vec(v, shape).map_err(|e| Error::Input(format!("{what}: {e}")))?);
    }
    Ok(out)
}

/// The program with every `name.*` in a step's inputs replaced by the parts of the list output
/// `name` (`name.0`, `name.1`, ... one per rank of the group of the collective that bound it).
fn expand_parts(p: &Program, world: usize, origins: &[String]) -> Result<Program> {
    let mut out = p.clone();
    // List outputs bound so far: name -> number of parts.
    let mut lists: HashMap<String, usize> = HashMap::new();
    for (si, s) in out.steps.iter_mut().enumerate() {
        if s.inputs.iter().any(|n| n.ends_with(".*")) {
            let mut names = Vec::with_capacity(s.inputs.len());
            for n in &s.inputs {
                match n.strip_suffix(".*") {
                    Some(base) => {
                        let k = lists.get(base).ok_or_else(|| {
                            err(
                                &origins[si],
                                s,
                                format!(
                                    "`{n}` names the parts of a list output (of gather, all_gather or all_to_all), and no earlier step binds `{base}` as one"
                                ),
                            )
                        })?;
                        names.extend((0..*k).map(|i| format!("{base}.{i}")));
                    }
                    None => names.push(n.clone()),
                }
            }
            s.inputs = names;
        }
        if let (StepKind::Collective { spec, .. }, Some(o)) = (&s.kind, &s.out)
            && lists_outputs(spec.kind())
        {
            lists.insert(o.clone(), s.group.as_ref().map_or(world, Vec::len));
        }
    }
    Ok(out)
}

/// Output shape of a local op, or why not.
fn local_shape(op: &LocalOp, ins: &[&Vec<usize>]) -> std::result::Result<Vec<usize>, String> {
    let same = |a: &Vec<usize>, b: &Vec<usize>| {
        if a == b {
            Ok(a.clone())
        } else {
            Err(format!("shapes {a:?} and {b:?} must be equal"))
        }
    };
    match op {
        LocalOp::Add {} | LocalOp::Sub {} | LocalOp::Mul {} => {
            broadcast_shape(op.name(), ins[0], ins[1]).map_err(|e| e.to_string())
        }
        LocalOp::Matmul {} => match (ins[0].as_slice(), ins[1].as_slice()) {
            (&[m, k], &[k2, n]) if k == k2 => Ok(vec![m, n]),
            (a, b) => Err(format!("matmul needs [m, k] x [k, n], got {a:?} x {b:?}")),
        },
        LocalOp::Scale { by } if !by.is_finite() => Err(format!("scale by {by}: not finite")),
        LocalOp::Scale { .. } | LocalOp::Relu {} | LocalOp::Tanh {} | LocalOp::Square {} => {
            Ok(ins[0].clone())
        }
        LocalOp::Sum {} | LocalOp::Mean {} => Ok(Vec::new()),
        LocalOp::MseLoss {} => same(ins[0], ins[1]).map(|_| Vec::new()),
        LocalOp::Reshape { shape } => {
            let a = crate::tensor::checked_numel(ins[0]);
            if a.is_some() && a == crate::tensor::checked_numel(shape) {
                Ok(shape.clone())
            } else {
                Err(format!("cannot reshape {:?} to {shape:?}", ins[0]))
            }
        }
        LocalOp::Slice { dim, start, len } => {
            let s = ins[0];
            match start.checked_add(*len) {
                Some(end) if *dim < s.len() && end <= s[*dim] => {
                    let mut o = s.clone();
                    o[*dim] = *len;
                    Ok(o)
                }
                _ => Err(format!(
                    "slice dim {dim} {start}..{start}+{len} is outside shape {s:?}"
                )),
            }
        }
        LocalOp::Concat { dim } => {
            let first = ins[0];
            if *dim >= first.len() {
                return Err(format!("concat dim {dim} is outside shape {first:?}"));
            }
            let mut o = first.clone();
            o[*dim] = 0;
            for s in ins {
                let mut a = (*s).clone();
                if a.len() != first.len() {
                    return Err(format!("concat of {first:?} and {s:?}"));
                }
                o[*dim] += a[*dim];
                a[*dim] = first[*dim];
                if &a != first {
                    return Err(format!(
                        "concat along {dim}: {first:?} and {s:?} differ elsewhere"
                    ));
                }
            }
            Ok(o)
        }
    }
}

/// The call each group rank makes (all_to_all_single's per-rank splits filled in).
fn group_specs(kind: &StepKind, n: usize) -> std::result::Result<Vec<Spec>, String> {
    match kind {
        StepKind::Local(_) | StepKind::For(_) => Err("internal: not a collective".into()),
        StepKind::Collective { spec, splits: None } => Ok(vec![spec.clone(); n]),
        StepKind::Collective {
            splits:
                Some(super::Splits {
                    in_splits: ins,
                    out_splits: outs,
                }),
            ..
        } => {
            if ins.len() != n || ins.iter().any(|s| s.len() != n) {
                return Err(format!(
                    "in_splits {ins:?}: one list of {n} sizes per group rank ({n})"
                ));
            }
            if let Some(o) = outs
                && (o.len() != n || o.iter().any(|s| s.len() != n))
            {
                return Err(format!(
                    "out_splits {o:?}: one list of {n} sizes per group rank ({n})"
                ));
            }
            Ok((0..n)
                .map(|r| Spec::AllToAllSingle {
                    in_splits: ins[r].clone(),
                    out_splits: match outs {
                        Some(o) => o[r].clone(),
                        None => ins.iter().map(|s| s[r]).collect(),
                    },
                })
                .collect())
        }
    }
}

/// Output shapes of a collective per group rank, from every member's input shapes.
fn collective_shapes(
    specs: &[Spec],
    ins: &[Vec<Vec<usize>>],
    who: &dyn Fn(usize) -> String,
) -> std::result::Result<Vec<Vec<Vec<usize>>>, String> {
    let n = specs.len();
    let kind = specs[0].kind();
    let agree = |shapes: Vec<(usize, &Vec<usize>)>| -> std::result::Result<Vec<usize>, String> {
        let (r0, first) = shapes[0];
        for (r, s) in &shapes {
            if *s != first {
                return Err(format!(
                    "shapes must agree across the group: {} passes {first:?}, {} passes {s:?}",
                    who(r0),
                    who(*r)
                ));
            }
        }
        Ok(first.clone())
    };
    let singles = || agree((0..n).map(|r| (r, &ins[r][0])).collect());
    Ok(match &specs[0] {
        Spec::Broadcast { .. } | Spec::AllReduce { .. } | Spec::Permute { .. } => {
            vec![vec![singles()?]; n]
        }
        Spec::Reduce { root, .. } => {
            let s = singles()?;
            (0..n)
                .map(|r| if r == *root { vec![s.clone()] } else { vec![] })
                .collect()
        }
        Spec::Gather { root } => {
            let s = singles()?;
            (0..n)
                .map(|r| {
                    if r == *root {
                        vec![s.clone(); n]
                    } else {
                        vec![]
                    }
                })
                .collect()
        }
        Spec::AllGather {} => vec![vec![singles()?; n]; n],
        Spec::Scatter { root } => {
            let s = agree(ins[*root].iter().map(|s| (*root, s)).collect())?;
            vec![vec![s]; n]
        }
        Spec::ReduceScatter { .. } => {
            let all: Vec<(usize, &Vec<usize>)> = (0..n)
                .flat_map(|r| ins[r].iter().map(move |s| (r, s)))
                .collect();
            vec![vec![agree(all)?]; n]
        }
        Spec::AllToAll {} => (0..n)
            .map(|d| (0..n).map(|i| ins[i][d].clone()).collect())
            .collect(),
        Spec::AllToAllSingle { .. } => {
            let mut rest: Vec<(usize, Vec<usize>)> = Vec::with_capacity(n);
            for (r, spec) in specs.iter().enumerate() {
                let Spec::AllToAllSingle { in_splits, .. } = spec else {
                    return Err("internal: mixed calls".into());
                };
                let x = &ins[r][0];
                let rows: usize = in_splits.iter().sum();
                if x.first() != Some(&rows) {
                    return Err(format!(
                        "{} sends in_splits {in_splits:?} ({rows} rows) of a tensor of shape {x:?}",
                        who(r)
                    ));
                }
                rest.push((r, x[1..].to_vec()));
            }
            agree(rest.iter().map(|(r, s)| (*r, s)).collect())
                .map_err(|e| format!("all but the first dimension: {e}"))?;
            let mut outs = Vec::with_capacity(n);
            for (me, spec) in specs.iter().enumerate() {
                let Spec::AllToAllSingle { out_splits, .. } = spec else {
                    return Err("internal: mixed calls".into());
                };
                for (i, other) in specs.iter().enumerate() {
                    let Spec::AllToAllSingle { in_splits, .. } = other else {
                        return Err("internal: mixed calls".into());
                    };
                    if out_splits[i] != in_splits[me] {
                        return Err(format!(
                            "{} expects {} rows from {}, which sends it {}",
                            who(me),
                            out_splits[i],
                            who(i),
                            in_splits[me]
                        ));
                    }
                }
                let mut s = vec![out_splits.iter().sum()];
                s.extend_from_slice(&rest[me].1);
                outs.push(vec![s]);
            }
            outs
        }
        Spec::Send { .. } | Spec::Recv { .. } | Spec::Barrier {} => {
            return Err("internal: point-to-point handled apart".into());
        }
    })
    .inspect(|o| debug_assert_eq!(o.len(), n, "{kind:?}: one list per group rank"))
}

/// Point-to-point messages by (group, src, dst) group ranks: (step, shape) in program order.
type Messages = BTreeMap<(usize, usize, usize), Vec<(usize, Vec<usize>)>>;

pub(super) fn plan(p: &Program, world: usize) -> Result<Plan> {
    if world == 0 || world > MAX_WORLD {
        return Err(Error::Input(format!(
            "world must be 1..={MAX_WORLD}, got {world}"
        )));
    }
    // Messages name a step of a "for" block by where it came from, not by its place in the
    // expanded program.
    let (repeated, origins) = super::repeat::expand(p, world)?;
    let expanded = expand_parts(&repeated, world, &origins)?;
    let p = &expanded;
    let mut env: Vec<HashMap<String, Vec<usize>>> = vec![HashMap::new(); world];
    // Replicated objective: the values invariant over a group (its global ranks), per rank.
    let replicated = p.objective == super::ObjectiveName::Replicated;
    let mut inv: Vec<HashMap<String, Vec<usize>>> = vec![HashMap::new(); world];
    // Values without gradient, per rank (a constant input and what is computed only from such).
    let mut nograd: Vec<std::collections::HashSet<String>> = vec![Default::default(); world];
    // Where each name was bound, for messages.
    let mut origin: HashMap<String, String> = HashMap::new();
    let mut inputs: Vec<Vec<Tensor>> = vec![Vec::new(); world];
    let mut held: Vec<Vec<bool>> = vec![Vec::new(); world];
    for (i, inp) in p.inputs.iter().enumerate() {
        check_name("input", &inp.name)?;
        if origin.contains_key(&inp.name) {
            return Err(Error::Input(format!(
                "input {:?} is declared twice",
                inp.name
            )));
        }
        origin.insert(inp.name.clone(), "an input".into());
        for (r, t) in input_values(i, inp, world)?.into_iter().enumerate() {
            let Some(t) = t else {
                // Not held here: a placeholder keeps the per-rank lists aligned.
                inputs[r].push(Tensor::from_vec(Vec::new(), &[0])?);
                held[r].push(false);
                continue;
            };
            env[r].insert(inp.name.clone(), t.shape().to_vec());
            if replicated && inp.replicated {
                inv[r].insert(inp.name.clone(), (0..world).collect());
            }
            if !inp.grad {
                nograd[r].insert(inp.name.clone());
            }
            inputs[r].push(t);
            held[r].push(true);
        }
    }
    let all: Vec<usize> = (0..world).collect();
    let mut groups: Vec<Vec<usize>> = Vec::new();
    let mut steps = Vec::with_capacity(p.steps.len());
    // Point-to-point messages: (group, src, dst) -> shapes sent / received, in program order.
    let mut sent: Messages = BTreeMap::new();
    let mut received: Messages = BTreeMap::new();
    for (si, s) in p.steps.iter().enumerate() {
        let e = |d: String| err(&origins[si], s, d);
        let lookup = |env: &HashMap<String, Vec<usize>>,
                      origin: &HashMap<String, String>,
                      r: usize,
                      name: &str| {
            env.get(name).cloned().ok_or_else(|| {
                let hint = match origin.get(name) {
                    Some(o) => format!(" ({o}, on other ranks)"),
                    None => " (not defined by any earlier step or input)".into(),
                };
                e(format!("`{name}` is not defined on rank {r}{hint}"))
            })
        };
        let bind = |env: &mut HashMap<String, Vec<usize>>,
                    origin: &mut HashMap<String, String>,
                    name: String,
                    shape: Vec<usize>|
         -> Result<()> {
            // A name is bound once per rank (different ranks may bind it in different steps).
            if env.contains_key(&name) {
                let o = origin.get(&name).map_or("an input", String::as_str);
                return Err(e(format!("`{name}` is already defined on this rank ({o})")));
            }
            origin.insert(name.clone(), format!("{} ({})", origins[si], s.describe()));
            env.insert(name, shape);
            Ok(())
        };
        if let Some(o) = &s.out {
            check_name("output", o).map_err(|x| e(x.to_string()))?;
        }
        // An invariant value made per-rank (here: any invariant input of a collective, or of a
        // local op mixing it with other values) has an all_reduce over its group as gradient:
        // every member of that group must run the step.
        let pvary_ok = |inv: &HashMap<String, Vec<usize>>, names: &[String], runs: &[bool]| {
            for n in names {
                if let Some(g) = inv.get(n)
                    && let Some(out) = g.iter().find(|&&r| !runs[r])
                {
                    return Err(e(format!(
                        "under the replicated objective `{n}` is invariant over ranks {g:?}; used here as a per-rank value, its gradient is an all_reduce over them, but rank {out} does not take part with it here (only the ranks that pass it do; use a per-rank value, or the sum_of_rank_losses objective)"
                    )));
                }
            }
            Ok(())
        };
        match &s.kind {
            StepKind::For(_) => {
                return Err(e("internal: a \"for\" block left after expansion".into()));
            }
            StepKind::Local(op) => {
                if s.group.is_some() {
                    return Err(e("a local op takes no \"group\"".into()));
                }
                let runs = match &s.ranks {
                    Some(r) => ranks_of("\"ranks\"", r, world).map_err(|x| e(x.to_string()))?,
                    None => vec![true; world],
                };
                let out = s
                    .out
                    .clone()
                    .ok_or_else(|| e("a local op needs \"out\"".into()))?;
                match op.arity() {
                    Some(k) if s.inputs.len() != k => {
                        return Err(e(format!("takes {k} input(s), got {}", s.inputs.len())));
                    }
                    None if s.inputs.is_empty() => {
                        return Err(e("takes at least one input".into()));
                    }
                    _ => {}
                }
                for r in (0..world).filter(|&r| runs[r]) {
                    let shapes = s
                        .inputs
                        .iter()
                        .map(|n| lookup(&env[r], &origin, r, n))
                        .collect::<Result<Vec<_>>>()?;
                    let refs: Vec<&Vec<usize>> = shapes.iter().collect();
                    let shape = local_shape(op, &refs).map_err(|d| e(format!("rank {r}: {d}")))?;
                    bind(&mut env[r], &mut origin, out.clone(), shape)?;
                    if s.inputs.iter().all(|n| nograd[r].contains(n)) {
                        nograd[r].insert(out.clone());
                    }
                    if replicated {
                        let groups: Vec<Option<&Vec<usize>>> =
                            s.inputs.iter().map(|n| inv[r].get(n)).collect();
                        match groups.first() {
                            Some(Some(g)) if groups.iter().all(|x| *x == Some(*g)) => {
                                let g = (*g).clone();
                                inv[r].insert(out.clone(), g);
                            }
                            _ => pvary_ok(&inv[r], &s.inputs, &runs)?,
                        }
                    }
                }
                steps.push(Planned {
                    index: si,
                    what: What::Local(op.clone(), runs),
                    inputs: s.inputs.clone(),
                    out: s.out.clone(),
                });
            }
            StepKind::Collective { spec, .. } => {
                let members = s.group.clone().unwrap_or_else(|| all.clone());
                ranks_of("\"group\"", &members, world).map_err(|x| e(x.to_string()))?;
                let n = members.len();
                let gi = match groups.iter().position(|g| *g == members) {
                    Some(i) => i,
                    None => {
                        groups.push(members.clone());
                        groups.len() - 1
                    }
                };
                let is_p2p = matches!(spec, Spec::Send { .. } | Spec::Recv { .. });
                let runs: Vec<usize> = match &s.ranks {
                    Some(r) => {
                        ranks_of("\"ranks\"", r, world).map_err(|x| e(x.to_string()))?;
                        if let Some(out) = r.iter().find(|x| !members.contains(x)) {
                            return Err(e(format!("rank {out} is not in the group {members:?}")));
                        }
                        if !is_p2p && r.len() != n {
                            return Err(e(format!(
                                "a {} runs on every member of its group {members:?}; \"ranks\" is for send / recv",
                                spec.kind().name()
                            )));
                        }
                        r.clone()
                    }
                    None if is_p2p => {
                        return Err(e(
                            "send / recv need \"ranks\": the ranks that send (or receive)".into(),
                        ));
                    }
                    None => members.clone(),
                };
                let per_group = group_specs(&s.kind, n).map_err(e)?;
                let who = |gr: usize| format!("group rank {gr} (rank {})", members[gr]);
                let mut specs: Vec<Option<Spec>> = vec![None; world];
                let mut in_shapes: Vec<Vec<Vec<usize>>> = vec![Vec::new(); n];
                for &g in &runs {
                    let gr = members.iter().position(|&m| m == g).unwrap_or_default();
                    let call = &per_group[gr];
                    call.check(gr, n)
                        .map_err(|x| e(format!("{}: {x}", who(gr))))?;
                    let k = call.n_inputs(gr, n);
                    if k > 0 {
                        if s.inputs.len() != k {
                            return Err(e(format!(
                                "{} takes {k} input(s) on {}, got {}",
                                call.kind().name(),
                                who(gr),
                                s.inputs.len()
                            )));
                        }
                        for name in &s.inputs {
                            in_shapes[gr].push(lookup(&env[g], &origin, g, name)?);
                        }
                    } else if !s.inputs.is_empty() && call.kind() != Kind::Scatter {
                        return Err(e(format!("{} takes no input", call.kind().name())));
                    }
                    specs[g] = Some(call.clone());
                }
                if replicated {
                    // Only the ranks that pass inputs make them per-rank (scatter: the root).
                    let mut passing = vec![false; world];
                    for &g in &runs {
                        let gr = members.iter().position(|&m| m == g).unwrap_or_default();
                        passing[g] = per_group[gr].n_inputs(gr, n) > 0;
                    }
                    for &g in runs.iter().filter(|&&g| passing[g]) {
                        pvary_ok(&inv[g], &s.inputs, &passing)?;
                    }
                }
                let needs_out = runs.iter().any(|&g| {
                    let gr = members.iter().position(|&m| m == g).unwrap_or_default();
                    per_group[gr].n_outputs(gr, n) > 0
                });
                match (&s.out, needs_out) {
                    (None, true) => return Err(e("needs \"out\"".into())),
                    (Some(_), false) => {
                        return Err(e(format!("{} has no output", spec.kind().name())));
                    }
                    _ => {}
                }
                if is_p2p {
                    for &g in &runs {
                        let gr = members.iter().position(|&m| m == g).unwrap_or_default();
                        match &per_group[gr] {
                            Spec::Send { dst } => sent
                                .entry((gi, gr, *dst))
                                .or_default()
                                .push((si, in_shapes[gr][0].clone())),
                            Spec::Recv { src, shape } => {
                                received
                                    .entry((gi, *src, gr))
                                    .or_default()
                                    .push((si, shape.clone()));
                                if let Some(o) = &s.out {
                                    bind(&mut env[g], &mut origin, o.clone(), shape.clone())?;
                                }
                            }
                            _ => {}
                        }
                    }
                } else if !matches!(spec, Spec::Barrier {}) {
                    let outs = collective_shapes(&per_group, &in_shapes, &who).map_err(e)?;
                    let list = lists_outputs(spec.kind());
                    for (gr, shapes) in outs.into_iter().enumerate() {
                        let g = members[gr];
                        let Some(o) = &s.out else { continue };
                        if list {
                            for (k, sh) in shapes.into_iter().enumerate() {
                                bind(&mut env[g], &mut origin, format!("{o}.{k}"), sh)?;
                            }
                        } else if let Some(sh) = shapes.into_iter().next() {
                            bind(&mut env[g], &mut origin, o.clone(), sh)?;
                            // all_reduce's output is invariant over its group.
                            if replicated && spec.kind() == Kind::AllReduce {
                                inv[g].insert(o.clone(), members.clone());
                            }
                        }
                    }
                }
                steps.push(Planned {
                    index: si,
                    what: What::Collective { group: gi, specs },
                    inputs: s.inputs.clone(),
                    out: s.out.clone(),
                });
            }
        }
    }
    // Every message sent is received, with the shape the receiver expects.
    for (key, sends) in &sent {
        let recvs = received.get(key).map_or(&[][..], Vec::as_slice);
        let (g, src, dst) = *key;
        let at = |v: &[(usize, Vec<usize>)]| {
            steps_at(&v.iter().map(|(s, _)| *s).collect::<Vec<_>>(), &origins)
        };
        if sends.len() != recvs.len() {
            return Err(Error::Input(format!(
                "group {:?}: group rank {src} sends {} message(s) to group rank {dst} ({}), which receives {} ({})",
                groups[g],
                sends.len(),
                at(sends),
                recvs.len(),
                at(recvs)
            )));
        }
        for ((ss, sh), (rs, rh)) in sends.iter().zip(recvs) {
            if sh != rh {
                return Err(Error::Input(format!(
                    "{} sends a {sh:?} tensor that {} receives as {rh:?}",
                    origins[*ss], origins[*rs]
                )));
            }
        }
    }
    for (key, recvs) in &received {
        if !sent.contains_key(key) {
            let (g, src, dst) = *key;
            return Err(Error::Input(format!(
                "group {:?}: group rank {dst} receives from group rank {src} ({}), which sends nothing",
                groups[g], origins[recvs[0].0]
            )));
        }
    }
    // Under the replicated objective a value is invariant (over one group) or varying, the same on
    // every rank that has it, as in JAX's shard_map; else the ranks would disagree about which
    // all_reduces the backward pass runs, and about how often the loss counts.
    if replicated {
        let mut names: Vec<&String> = env.iter().flat_map(|e| e.keys()).collect();
        names.sort();
        names.dedup();
        for name in names {
            let holders: Vec<usize> = (0..world).filter(|&r| env[r].contains_key(name)).collect();
            let kind = |r: usize| (inv[r].get(name), nograd[r].contains(name));
            let describe = |r: usize| match kind(r) {
                (Some(g), false) => format!("invariant over ranks {g:?}"),
                (Some(g), true) => format!("invariant over ranks {g:?}, without gradient"),
                (None, false) => "varying".to_string(),
                (None, true) => "varying, without gradient".to_string(),
            };
            let first = holders[0];
            if let Some(&other) = holders.iter().find(|&&r| kind(r) != kind(first))
                && (kind(first).0.is_some() || kind(other).0.is_some())
            {
                let o = origin.get(name).map_or("", String::as_str);
                return Err(Error::Input(format!(
                    "under the replicated objective `{name}` is {} on rank {first} but {} on rank {other} (last bound by {o}): a value's replication must be the same on every rank that has it (bind it with the same kind of step on every rank, or use the sum_of_rank_losses objective)",
                    describe(first),
                    describe(other)
                )));
            }
        }
    }
    // The loss: one element wherever it exists, and somewhere.
    check_name("loss", p.loss.split('.').next().unwrap_or_default())?;
    let mut has_loss = false;
    for (r, e) in env.iter().enumerate() {
        if let Some(s) = e.get(&p.loss) {
            if crate::tensor::checked_numel(s) != Some(1) {
                return Err(Error::Input(format!(
                    "loss `{}` has shape {s:?} on rank {r}; it must have one element (add a \"sum\" step)",
                    p.loss
                )));
            }
            has_loss = true;
            if let Some(g) = inv[r].get(&p.loss)
                && let Some(m) = g.iter().find(|&&m| !env[m].contains_key(&p.loss))
            {
                return Err(Error::Input(format!(
                    "under the replicated objective the loss `{}` is invariant over ranks {g:?} and counts once for them, so each of them must have it; rank {m} does not",
                    p.loss
                )));
            }
        }
    }
    if !has_loss {
        return Err(Error::Input(format!(
            "loss `{}` is defined on no rank",
            p.loss
        )));
    }
    Ok(Plan {
        program: p.clone(),
        world,
        groups,
        steps,
        inputs,
        held,
    })
}
