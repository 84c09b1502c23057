//! A `distgrad vjp` case as a one-collective program, so a case and a program are one format:
//! the case's inputs, its collective, and a loss whose gradient with respect to each output is
//! the case's cotangent.

use super::check::lists_outputs;
use super::{Input, LocalOp, Program, Splits, Step, StepKind};
use crate::collective::Spec;
use crate::error::{Error, Result};
use crate::vjp::{Case, TensorJson};

/// The case as a program: inputs `x` (or `x0`, `x1`, ... where a rank passes a list) on the ranks
/// that pass them, the collective with output `y` (`y.0`, `y.1`, ... for a list), and on each rank
/// with outputs the loss `Σ_k sum(y_k ⊙ c_k)`, the cotangents `c_k` constants (`sum(y_k)` where
/// the case gives none: cotangents of ones). Under the sum of rank losses the loss's gradient
/// with respect to `y_k` is exactly `c_k`, so the program's gradients are the case's, bit for
/// bit, and [`mod@crate::gradcheck`] can check them by finite differences.
pub fn from_case(case: &Case) -> Result<Program> {
    let (group, specs) = crate::vjp::case_calls(case)?;
    let world = case.world;
    let n = group.len();
    let member = |g: usize| group.iter().position(|&m| m == g);
    let n_outputs: Vec<usize> = (0..world)
        .map(|g| member(g).map_or(0, |r| specs[r].n_outputs(r, n)))
        .collect();
    let kind = specs[0].kind();
    let mut inputs = Vec::new();
    let n_in = case.inputs.iter().map(Vec::len).max().unwrap_or(0);
    let in_names = slot_names("x", n_in);
    for (k, name) in in_names.iter().enumerate() {
        inputs.push(slot_input(name, &case.inputs, k, true)?);
    }
    let n_out = n_outputs.iter().copied().max().unwrap_or(0);
    // Ranks with outputs have the same number of them (0 elsewhere) for every collective.
    let holders: Vec<usize> = (0..world).filter(|&g| n_outputs[g] > 0).collect();
    if holders.iter().any(|&g| n_outputs[g] != n_out) {
        return Err(Error::Input(format!(
            "{}: ranks have different numbers of outputs ({n_outputs:?}); a program cannot write \
             this case's loss",
            kind.name()
        )));
    }
    let cot_names = slot_names("c", n_out);
    if let Some(c) = &case.cotangents {
        for (k, name) in cot_names.iter().enumerate() {
            inputs.push(slot_input(name, c, k, false)?);
        }
    }
    let (spec, splits) = match &specs[0] {
        Spec::AllToAllSingle { .. } => {
            let of = |s: &Spec| match s {
                Spec::AllToAllSingle {
                    in_splits,
                    out_splits,
                } => (in_splits.clone(), out_splits.clone()),
                _ => (Vec::new(), Vec::new()),
            };
            let (ins, outs): (Vec<_>, Vec<_>) = specs.iter().map(of).unzip();
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
    let only = |ranks: &[usize]| (ranks.len() != world).then(|| ranks.to_vec());
    let mut steps = vec![Step {
        kind: StepKind::Collective { spec, splits },
        inputs: in_names,
        out: (n_out > 0).then(|| "y".to_string()),
        ranks: None,
        group: (n != world).then(|| group.clone()),
    }];
    let local = |op: LocalOp, inputs: Vec<String>, out: String| Step {
        kind: StepKind::Local(op),
        inputs,
        out: Some(out),
        ranks: only(&holders),
        group: None,
    };
    let list = lists_outputs(kind);
    let mut terms = Vec::new();
    for (k, c) in cot_names.iter().enumerate() {
        let y = if list { format!("y.{k}") } else { "y".into() };
        let term = if case.cotangents.is_some() {
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
    // loss = l0 + l1 + ... (left to right).
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
    Ok(Program {
        title: Some(format!("{}: a distgrad vjp case as a program", kind.name())),
        world,
        objective: super::ObjectiveName::SumOfRankLosses,
        inputs,
        steps,
        loss: "loss".into(),
    })
}

/// `base` for one slot, `base0`, `base1`, ... for several.
fn slot_names(base: &str, n: usize) -> Vec<String> {
    match n {
        1 => vec![base.to_string()],
        _ => (0..n).map(|k| format!("{base}{k}")).collect(),
    }
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
                        Error::Input(format!("{name} on rank {g}: element {i} is not finite"))
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
