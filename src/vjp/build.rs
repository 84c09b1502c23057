//! A case builds its one-collective program: the case's inputs, its collective, and a loss whose
//! gradient with respect to each output is the case's cotangent. What only the case form can get
//! wrong (the collective's name and arguments, one list of tensors per rank, the number of
//! tensors each rank passes, finite numbers) is checked here, as the case says it
//! ([`Calls::of`]); everything else by the program's own check ([`Program::plan`]).

use super::case_err;
use super::{Case, TensorJson, parse_collective};
use crate::collective::{Kind, ReduceOp, Spec};
use crate::error::Result;
use crate::program::{
    Input, LocalOp, MAX_WORLD, ObjectiveName, Program, Splits, Step, StepKind, lists_outputs,
};

/// A case's collective, checked: the group (global ranks), each member's call (in group order),
/// and how many tensors each global rank passes.
#[derive(Debug, Clone)]
pub(super) struct Calls {
    pub(super) kind: Kind,
    pub(super) world: usize,
    pub(super) group: Vec<usize>,
    pub(super) specs: Vec<Spec>,
    pub(super) n_inputs: Vec<usize>,
}

impl Calls {
    /// Check a case's collective, arguments and lists of tensors.
    pub(super) fn of(case: &Case) -> Result<Calls> {
        let kind = parse_collective(&case.collective)?;
        let world = case.world;
        if world == 0 || world > MAX_WORLD {
            return Err(case_err(format!(
                "world must be 1..={MAX_WORLD}, got {world}"
            )));
        }
        let group = case.group.clone().unwrap_or_else(|| (0..world).collect());
        let mut seen = vec![false; world];
        for &g in &group {
            if g >= world || std::mem::replace(&mut seen[g], true) {
                return Err(case_err(format!(
                    "group {group:?}: ranks must be distinct and below world {world}"
                )));
            }
        }
        if group.is_empty() {
            return Err(case_err("group must not be empty"));
        }
        let specs = member_specs(case, kind, &group)?;
        let n = group.len();
        for (r, spec) in specs.iter().enumerate() {
            spec.check(r, n)
                .map_err(|e| case_err(format!("rank {}: {e}", group[r])))?;
        }
        let calls = Calls {
            kind,
            world,
            n_inputs: Vec::new(),
            group,
            specs,
        };
        let inputs = calls.tensor_lists("inputs", &case.inputs, &|g| {
            calls.member(g).map_or(0, |r| calls.specs[r].n_inputs(r, n))
        })?;
        if let Some(c) = &case.cotangents {
            calls.tensor_lists("cotangents", c, &|g| calls.n_outputs(g))?;
        }
        Ok(Calls {
            n_inputs: inputs,
            ..calls
        })
    }

    /// The group rank of global rank `g`, if it is a member.
    pub(super) fn member(&self, g: usize) -> Option<usize> {
        self.group.iter().position(|&m| m == g)
    }

    /// How many outputs global rank `g` gets.
    pub(super) fn n_outputs(&self, g: usize) -> usize {
        let n = self.group.len();
        self.member(g).map_or(0, |r| self.specs[r].n_outputs(r, n))
    }

    /// One list of tensors per global rank, each of the length `count` says, every tensor whole
    /// and every number finite: how many each list holds.
    fn tensor_lists(
        &self,
        what: &str,
        lists: &[Vec<TensorJson>],
        count: &dyn Fn(usize) -> usize,
    ) -> Result<Vec<usize>> {
        if lists.len() != self.world {
            return Err(case_err(format!(
                "\"{what}\" needs one list per global rank ({}), got {}",
                self.world,
                lists.len()
            )));
        }
        lists
            .iter()
            .enumerate()
            .map(|(g, l)| {
                let want = count(g);
                if l.len() != want {
                    return Err(case_err(format!(
                        "{what} of rank {g}: {} takes {want} tensor(s) here, got {}",
                        self.kind.name(),
                        l.len()
                    )));
                }
                for (i, t) in l.iter().enumerate() {
                    t.to_tensor(&format!("{what}[{g}][{i}]"))?;
                }
                Ok(want)
            })
            .collect()
    }
}

/// The call of each member (only all_to_all_single's splits differ between ranks), from the
/// case's `op`, `root`, `perm` and splits, each refused where the collective takes none.
fn member_specs(case: &Case, kind: Kind, group: &[usize]) -> Result<Vec<Spec>> {
    let refuse = |field: &str| case_err(format!("{} takes no \"{field}\"", kind.name()));
    let op = match (&case.op, kind.takes_op()) {
        (Some(s), true) => ReduceOp::parse(s)?,
        (Some(_), false) => return Err(refuse("op")),
        (None, _) => ReduceOp::Sum,
    };
    let n = group.len();
    let root = match (case.root, kind.takes_root()) {
        (Some(r), true) if r >= n => {
            return Err(case_err(format!(
                "root {r} is not a group rank (group size {n}; roots are group ranks)"
            )));
        }
        (Some(r), true) => r,
        (Some(_), false) => return Err(refuse("root")),
        (None, _) => 0,
    };
    let perm = match (kind, &case.perm) {
        (Kind::Permute, Some(p)) => p.clone(),
        (Kind::Permute, None) => {
            return Err(case_err("permute needs \"perm\": [[src,dst],...]"));
        }
        (_, Some(_)) => return Err(refuse("perm")),
        (_, None) => Vec::new(),
    };
    let world = case.world;
    let splits: Vec<(Vec<usize>, Vec<usize>)> = match (kind, &case.in_splits, &case.out_splits) {
        (Kind::AllToAllSingle, Some(i), Some(o)) if i.len() == world && o.len() == world => {
            i.iter().cloned().zip(o.iter().cloned()).collect()
        }
        (Kind::AllToAllSingle, _, _) => {
            return Err(case_err(
                "all_to_all_single needs \"in_splits\" and \"out_splits\", one list per global rank",
            ));
        }
        (_, None, None) => Vec::new(),
        _ => {
            return Err(case_err(format!("{} takes no split sizes", kind.name())));
        }
    };
    Ok(group
        .iter()
        .map(|&g| match kind {
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
            // parse_collective refuses these (they are not in COLLECTIVES)
            Kind::Send | Kind::Barrier => Spec::Barrier {},
        })
        .collect())
}

/// The names of a case's program: its inputs `x` (`x0`, `x1`, ... where a rank passes a list),
/// its cotangents `c` (`c0`, `c1`, ...), and its output `y` (`y.0`, `y.1`, ... for a list).
pub(super) fn slot_names(base: &str, n: usize) -> Vec<String> {
    match n {
        1 => vec![base.to_string()],
        _ => (0..n).map(|k| format!("{base}{k}")).collect(),
    }
}

/// The names a collective's output binds: `y`, or `y.0`, `y.1`, ... for a list of `n`.
pub(super) fn output_names(kind: Kind, n: usize) -> Vec<String> {
    if lists_outputs(kind) {
        (0..n).map(|k| format!("y.{k}")).collect()
    } else {
        vec!["y".to_string(); n.min(1)]
    }
}

impl Case {
    /// The case as a program: inputs `x` (or `x0`, `x1`, ... where a rank passes a list) on the
    /// ranks that pass them, the collective with output `y` (`y.0`, `y.1`, ... for a list), and
    /// on each rank with outputs the loss `Σ_k sum(y_k ⊙ c_k)`, the cotangents `c_k` constants
    /// (`sum(y_k)` where the case gives none: cotangents of ones). Under the sum of rank losses
    /// the loss's gradient with respect to `y_k` is exactly `c_k`, so the program's gradients are
    /// the case's, bit for bit, and [`mod@crate::gradcheck`] can check them by finite
    /// differences.
    pub fn program(&self) -> Result<Program> {
        build(self, &Calls::of(self)?)
    }
}

/// [`Case::program`] of a case whose calls are checked.
pub(super) fn build(case: &Case, calls: &Calls) -> Result<Program> {
    let n_outputs: Vec<usize> = (0..case.world).map(|g| calls.n_outputs(g)).collect();
    let n_out = n_outputs.iter().copied().max().unwrap_or(0);
    // Ranks with outputs have the same number of them (0 elsewhere) for every collective.
    let holders: Vec<usize> = (0..case.world).filter(|&g| n_outputs[g] > 0).collect();
    if holders.iter().any(|&g| n_outputs[g] != n_out) {
        return Err(case_err(format!(
            "{}: ranks have different numbers of outputs ({n_outputs:?}); a program cannot \
             write this case's loss",
            calls.kind.name()
        )));
    }
    let n_in = case.inputs.iter().map(Vec::len).max().unwrap_or(0);
    let in_names = slot_names("x", n_in);
    let mut inputs = Vec::new();
    for (k, name) in in_names.iter().enumerate() {
        inputs.push(slot_input(name, &case.inputs, k, true)?);
    }
    let cot_names = slot_names("c", n_out);
    if let Some(c) = &case.cotangents {
        for (k, name) in cot_names.iter().enumerate() {
            inputs.push(slot_input(name, c, k, false)?);
        }
    }
    let mut steps = vec![collective_step(calls, in_names, n_out > 0)];
    let only = (holders.len() != case.world).then_some(holders);
    steps.extend(loss_steps(calls, n_out, case.cotangents.is_some(), &only));
    Ok(Program {
        format: None,
        title: Some(format!(
            "{}: a distgrad vjp case as a program",
            calls.kind.name()
        )),
        world: case.world,
        objective: ObjectiveName::SumOfRankLosses,
        inputs,
        steps,
        loss: "loss".into(),
    })
}

/// The case's collective as a step (all_to_all_single's splits per group rank).
fn collective_step(calls: &Calls, inputs: Vec<String>, has_out: bool) -> Step {
    let n = calls.group.len();
    let (spec, splits) = match &calls.specs[0] {
        Spec::AllToAllSingle { .. } => {
            let of = |s: &Spec| match s {
                Spec::AllToAllSingle {
                    in_splits,
                    out_splits,
                } => (in_splits.clone(), out_splits.clone()),
                _ => (Vec::new(), Vec::new()),
            };
            let (ins, outs): (Vec<_>, Vec<_>) = calls.specs.iter().map(of).unzip();
            let placeholder = Spec::AllToAllSingle {
                in_splits: Vec::new(),
                out_splits: Vec::new(),
            };
            let splits = Splits {
                in_splits: ins,
                out_splits: Some(outs),
            };
            (placeholder, Some(splits))
        }
        s => (s.clone(), None),
    };
    Step {
        kind: StepKind::Collective { spec, splits },
        inputs,
        out: has_out.then(|| "y".to_string()),
        ranks: None,
        group: (n != calls.world).then(|| calls.group.clone()),
        dual: None,
    }
}

/// The loss `Σ_k sum(y_k ⊙ c_k)` (`sum(y_k)` without cotangents) on the ranks `only` (all: `None`),
/// summed left to right.
fn loss_steps(
    calls: &Calls,
    n_out: usize,
    cotangents: bool,
    only: &Option<Vec<usize>>,
) -> Vec<Step> {
    let local = |op: LocalOp, inputs: Vec<String>, out: String| Step {
        kind: StepKind::Local(op),
        inputs,
        out: Some(out),
        ranks: only.clone(),
        group: None,
        dual: None,
    };
    let ys = output_names(calls.kind, n_out);
    let mut steps = Vec::new();
    let mut terms = Vec::new();
    for (k, (c, y)) in slot_names("c", n_out).iter().zip(ys).enumerate() {
        let term = if cotangents {
            let p = format!("p{k}");
            steps.push(local(LocalOp::Mul {}, vec![y, c.clone()], p.clone()));
            p
        } else {
            y
        };
        let l = if n_out == 1 {
            "loss".to_string()
        } else {
            format!("l{k}")
        };
        steps.push(local(LocalOp::Sum {}, vec![term], l.clone()));
        terms.push(l);
    }
    if n_out > 1 {
        let mut acc = terms[0].clone();
        for (k, t) in terms.iter().enumerate().skip(1) {
            let out = if k + 1 == n_out {
                "loss".to_string()
            } else {
                format!("a{k}")
            };
            steps.push(local(LocalOp::Add {}, vec![acc, t.clone()], out.clone()));
            acc = out;
        }
    }
    steps
}

/// Slot `k` of per-rank lists as an input held by the ranks whose list has it.
fn slot_input(name: &str, lists: &[Vec<TensorJson>], k: usize, grad: bool) -> Result<Input> {
    let world = lists.len();
    let held: Vec<(usize, &TensorJson)> = lists
        .iter()
        .enumerate()
        .filter_map(|(g, l)| l.get(k).map(|t| (g, t)))
        .collect();
    let values = held
        .iter()
        .map(|(g, t)| {
            t.data
                .iter()
                .enumerate()
                .map(|(i, x)| {
                    x.filter(|v| v.is_finite()).ok_or_else(|| {
                        case_err(format!("{name} on rank {g}: element {i} is not finite"))
                    })
                })
                .collect::<Result<Vec<f32>>>()
        })
        .collect::<Result<Vec<_>>>()?;
    let shapes: Vec<Vec<usize>> = held.iter().map(|(_, t)| t.shape.clone()).collect();
    let same = shapes.windows(2).all(|w| w[0] == w[1]);
    Ok(Input {
        name: name.to_string(),
        shape: same.then(|| shapes.first().cloned().unwrap_or_default()),
        shapes: (!same).then_some(shapes),
        ranks: (held.len() != world).then(|| held.iter().map(|(g, _)| *g).collect()),
        values: Some(values),
        value: None,
        per_rank: None,
        seed: None,
        range: None,
        grad,
        replicated: false,
    })
}
