//! A program as the teaching demo shows it: each step's description and its messages between
//! global ranks (the same on every rank, read from the plan), and one rank's run with every value
//! it bound and the gradient of the global objective with respect to each.

use std::collections::HashMap;

use super::check::What;
use super::runner::{forward_values, input_vars};
use super::{Plan, StepKind};
use crate::autograd::{Tape, Var};
use crate::collective::{Communicator, ReduceOp, Spec};
use crate::error::Result;
use crate::tensor::Tensor;

/// One step of a plan as a picture.
#[derive(Debug, Clone, PartialEq)]
pub struct StepView {
    /// What it does: `all_reduce(op=max) [h] -> m`, with the ranks where not all take part.
    pub label: String,
    /// The collective's description (`None` for a local op).
    pub collective: Option<String>,
    /// Its messages as `(from, to)` global ranks, every rank's together.
    pub arrows: Vec<(usize, usize)>,
    /// The name it binds (a list output binds `out.0`, `out.1`, ...).
    pub out: Option<String>,
    /// The names it reads.
    pub inputs: Vec<String>,
    /// The global ranks that run it (a local op's ranks; the members of a collective's group
    /// that call it).
    pub ranks: Vec<usize>,
    /// Replicated objective: the invariant values it uses as per-rank values (made varying,
    /// whose dual is an all_reduce over their group).
    pub made_varying: Vec<String>,
}

/// What a value is across the ranks, as the page labels it: under the replicated objective
/// varying or invariant (JAX's shard_map), and in either objective unreduced where it holds a
/// partial sum that a later all_reduce or reduce_scatter completes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ValueKind {
    /// Different on each rank (replicated objective).
    Varying,
    /// The same on every rank of the group (global ranks; replicated objective).
    Invariant(Vec<usize>),
    /// This rank's part of a sum the named collective completes.
    Unreduced(String),
}

impl ValueKind {
    /// The label as shown: `varying`, `invariant`, `unreduced`.
    pub fn label(&self) -> &'static str {
        match self {
            ValueKind::Varying => "varying",
            ValueKind::Invariant(_) => "invariant",
            ValueKind::Unreduced(_) => "unreduced",
        }
    }
}

impl Plan {
    /// What value `name` is on global rank `rank` ([`ValueKind`]); `None` under the sum of
    /// rank losses for a value no later sum completes, or where the rank does not hold it.
    pub fn value_kind(&self, rank: usize, name: &str) -> Option<ValueKind> {
        if !self.shapes.get(rank)?.contains_key(name) {
            return None;
        }
        let invariant = self.invariant.get(rank).and_then(|m| m.get(name));
        // A varying value a step made and a later all_reduce / reduce_scatter sums: a partial
        // sum (a row-parallel matmul's output); an input is the data a lesson starts from.
        let is_input = self.program.inputs.iter().any(|i| i.name == name);
        if invariant.is_none() && !is_input {
            for p in &self.steps {
                if let What::Collective { specs, .. } = &p.what
                    && let Some(Some(spec)) = specs.get(rank)
                    && p.inputs.iter().any(|n| n == name)
                    && matches!(
                        spec,
                        Spec::AllReduce {
                            op: ReduceOp::Sum | ReduceOp::Avg
                        } | Spec::ReduceScatter {
                            op: ReduceOp::Sum | ReduceOp::Avg
                        }
                    )
                {
                    return Some(ValueKind::Unreduced(spec.to_string()));
                }
            }
        }
        if self.program.objective != super::ObjectiveName::Replicated {
            return None;
        }
        Some(match invariant {
            Some(g) => ValueKind::Invariant(g.clone()),
            None => ValueKind::Varying,
        })
    }

    /// Every step as a picture, in order (the same on every rank).
    pub fn views(&self) -> Vec<StepView> {
        self.steps
            .iter()
            .zip(&self.program.steps)
            .map(|(planned, step)| {
                let mut label = step.describe();
                let (collective, arrows, ranks) = match &planned.what {
                    What::Local(_, runs) => {
                        let on: Vec<usize> = (0..runs.len()).filter(|&r| runs[r]).collect();
                        if on.len() != runs.len() {
                            label.push_str(&format!(" on ranks {on:?}"));
                        }
                        (None, Vec::new(), on)
                    }
                    What::Collective { group, specs, .. } => {
                        let members = &self.groups[*group];
                        if members.len() != self.world {
                            label.push_str(&format!(" over ranks {members:?}"));
                        }
                        // send / recv: only some members call.
                        let calling: Vec<usize> = members
                            .iter()
                            .copied()
                            .filter(|&g| specs.get(g).is_some_and(Option::is_some))
                            .collect();
                        if calling.len() != members.len() {
                            label.push_str(&format!(" on ranks {calling:?}"));
                        }
                        let mut arrows = Vec::new();
                        for (gr, &g) in members.iter().enumerate() {
                            let Some(Some(spec)) = specs.get(g) else {
                                continue;
                            };
                            for (a, b) in spec.messages(gr, members.len()) {
                                let m = (members[a], members[b]);
                                if !arrows.contains(&m) {
                                    arrows.push(m);
                                }
                            }
                        }
                        let what = match &step.kind {
                            StepKind::Collective {
                                spec,
                                splits: Some(_),
                            } => spec.kind().name().to_string(),
                            StepKind::Collective { spec, .. } => spec.to_string(),
                            StepKind::Local(op) => op.name().to_string(),
                            StepKind::For(b) => format!("for {}", b.var),
                        };
                        (Some(what), arrows, calling)
                    }
                };
                StepView {
                    label,
                    collective,
                    arrows,
                    out: step.out.clone(),
                    inputs: step.inputs.clone(),
                    ranks,
                    made_varying: planned.made_varying.clone(),
                }
            })
            .collect()
    }
}

/// One rank's run of a program with everything it bound.
#[derive(Debug, Clone)]
pub struct TracedRun {
    /// Every value this rank bound, by name (inputs included).
    pub values: HashMap<String, Tensor>,
    /// The gradient of the global objective with respect to each of them (zeros where none
    /// reached it).
    pub grads: HashMap<String, Tensor>,
    /// This rank's loss, if it has one.
    pub loss: Option<Tensor>,
    /// Per step of the plan, the tape nodes it recorded on this rank (see
    /// [`crate::program::Forward::nodes`]).
    pub nodes: Vec<std::ops::Range<usize>>,
}

/// Run this rank's part of `plan` forward and backward on `comm`, keeping every bound value and
/// its gradient (every rank of the world calls this). `between` runs after the forward pass (e.g.
/// to look at the calls it made), `done(k)` after the backward step of tape node `k` (see
/// [`Tape::backward_observed`]; [`TracedRun::nodes`] says which step recorded which nodes).
pub async fn trace_rank<C: Communicator>(
    comm: &C,
    plan: &Plan,
    between: impl FnOnce(),
    done: &mut dyn FnMut(usize),
) -> Result<TracedRun> {
    let tape = Tape::with_objective(plan.program.objective.objective());
    let xs = input_vars(comm, &tape, plan, plan.inputs(comm.rank()))?;
    let fwd = forward_values(comm, &tape, plan, &xs).await?;
    let (loss, env) = (fwd.loss, fwd.env);
    between();
    let seeds = match &loss {
        Some(l) => vec![(l.clone(), l.value().full_like(1.0)?)],
        None => Vec::new(),
    };
    let grads = tape.backward_observed(&seeds, comm, done).await?;
    let mut values = HashMap::with_capacity(env.len());
    let mut gs = HashMap::with_capacity(env.len());
    for (name, v) in env {
        gs.insert(name.clone(), grads.wrt(&v)?);
        values.insert(name, v.value());
    }
    Ok(TracedRun {
        values,
        grads: gs,
        loss: loss.as_ref().map(Var::value),
        nodes: fwd.nodes,
    })
}
