//! Running a checked program on one rank (any communicator, any target) and on in-process ranks.

use std::collections::HashMap;

use super::check::What;
use super::shapes::lists_outputs;
use super::{LocalOp, Plan};
use crate::autograd::{Tape, Var};
use crate::collective::{Communicator, Group};
use crate::error::{Error, ProgramError, Result};
use crate::tensor::Tensor;

/// One rank's run of a program.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct RankRun {
    /// This rank's loss (`None`: the loss does not exist on this rank).
    pub loss: Option<f32>,
    /// How much this rank's loss counts in the global objective: 1, or 1/k for a loss invariant
    /// over a group of k ranks under the replicated objective.
    pub weight: f64,
    /// Gradient of the global objective with respect to each input (read back to the host;
    /// `None` for inputs without gradient or not held by this rank, or when backward did not run).
    pub grads: Vec<Option<Vec<f32>>>,
}

impl RankRun {
    /// This rank's share of the global objective (`weight × loss`, 0 without a loss).
    pub fn contribution(&self) -> f64 {
        self.loss.map_or(0.0, |l| self.weight * f64::from(l))
    }
}

/// The groups of a plan, created in the plan's order (every rank must call this, members or not).
pub(crate) fn make_groups<C: Communicator>(comm: &C, plan: &Plan) -> Result<Vec<Group>> {
    let all: Vec<usize> = (0..plan.world).collect();
    plan.groups
        .iter()
        .map(|g| {
            if *g == all {
                Ok(comm.world())
            } else {
                comm.new_group(g)
            }
        })
        .collect()
}

/// This rank's inputs as vars on `tape`: gradient where the program asks for one; a replicated
/// input under the replicated objective is invariant over the world.
pub(crate) fn input_vars<C: Communicator>(
    comm: &C,
    tape: &Tape,
    plan: &Plan,
    values: &[Tensor],
) -> Result<Vec<Var>> {
    let (world, device) = (comm.world(), comm.device());
    plan.program
        .inputs
        .iter()
        .zip(values)
        .map(|(inp, t)| {
            let t = t.to_device(&device)?;
            Ok(tape.leaf(t, inp.grad, inp.replicated.then_some(&world)))
        })
        .collect()
}

/// A local step on this rank's inputs `xs`.
pub(super) fn local(op: &LocalOp, xs: &[Var]) -> Result<Var> {
    let a = &xs[0];
    match op {
        LocalOp::Add {} => a.add(&xs[1]),
        LocalOp::Sub {} => a.sub(&xs[1]),
        LocalOp::Mul {} => a.mul(&xs[1]),
        LocalOp::Matmul {} => a.matmul(&xs[1]),
        LocalOp::Scale { by } => a.scale(*by),
        LocalOp::Sum {} => a.sum(),
        LocalOp::Mean {} => a.mean(),
        LocalOp::Relu {} => a.relu(),
        LocalOp::Tanh {} => a.tanh(),
        LocalOp::Square {} => a.square(),
        LocalOp::Reshape { shape } => a.reshape(shape),
        LocalOp::Slice { dim, start, len } => a.slice(*dim, *start, *len),
        LocalOp::Concat { dim } => Var::concat(xs, *dim),
        LocalOp::MseLoss {} => a.mse_loss(&xs[1]),
    }
}

/// Run the program's steps on this rank from its input vars `xs` (the program's order); returns
/// the loss where this rank has one. Every rank of the world must call this (groups are created
/// by all).
pub async fn forward<C: Communicator>(
    comm: &C,
    tape: &Tape,
    plan: &Plan,
    xs: &[Var],
) -> Result<Option<Var>> {
    Ok(forward_values(comm, tape, plan, xs).await?.loss)
}

/// A forward pass with everything it made (see [`forward_values`]).
pub struct Forward {
    /// This rank's loss, where it has one.
    pub loss: Option<Var>,
    /// Every value this rank bound, by name (inputs included; a list output's parts as `out.0`,
    /// `out.1`, ...).
    pub env: HashMap<String, Var>,
    /// Per step of the plan, the tape nodes it recorded on this rank (empty where it did not
    /// run here).
    pub nodes: Vec<std::ops::Range<usize>>,
}

/// [`forward`], keeping every value this rank bound and which tape nodes each step recorded.
pub async fn forward_values<C: Communicator>(
    comm: &C,
    tape: &Tape,
    plan: &Plan,
    xs: &[Var],
) -> Result<Forward> {
    let me = comm.rank();
    if comm.world_size() != plan.world {
        return Err(ProgramError::WorldMismatch {
            planned: plan.world,
            communicator: comm.world_size(),
        }
        .into());
    }
    let groups = make_groups(comm, plan)?;
    let mut env: HashMap<String, Var> = plan
        .program
        .inputs
        .iter()
        .enumerate()
        .zip(xs)
        .filter(|((i, _), _)| plan.holds(me, *i))
        .map(|((_, inp), x)| (inp.name.clone(), x.clone()))
        .collect();
    let get = |env: &HashMap<String, Var>, name: &str, step: usize| {
        env.get(name).cloned().ok_or_else(|| {
            Error::from(ProgramError::Step {
                at: format!("step {step}"),
                step: plan.program.steps[step].describe(),
                detail: format!("`{name}` is not defined on rank {me} (the plan said it would be)"),
            })
        })
    };
    let mut nodes = Vec::with_capacity(plan.steps.len());
    for s in &plan.steps {
        let first = tape.len();
        match &s.what {
            What::Local(op, runs) => {
                if !runs.get(me).copied().unwrap_or(false) {
                    nodes.push(first..first);
                    continue;
                }
                let ins = s
                    .inputs
                    .iter()
                    .map(|n| get(&env, n, s.index))
                    .collect::<Result<Vec<_>>>()?;
                let y = local(op, &ins)?;
                if let Some(o) = &s.out {
                    env.insert(o.clone(), y);
                }
            }
            What::Collective { group, specs, dual } => {
                let Some(Some(spec)) = specs.get(me) else {
                    nodes.push(first..first);
                    continue;
                };
                let g = &groups[*group];
                let gr = g.require_member("program step")?;
                let ins = if spec.n_inputs(gr, g.size()) == 0 {
                    Vec::new()
                } else {
                    s.inputs
                        .iter()
                        .map(|n| get(&env, n, s.index))
                        .collect::<Result<Vec<_>>>()?
                };
                let ys = crate::dist::call(comm, tape, spec, &ins, g).await?;
                if *dual != crate::autograd::DualRule::Distgrad {
                    tape.use_dual(first..tape.len(), *dual);
                }
                if let Some(o) = &s.out {
                    if lists_outputs(spec.kind()) {
                        for (k, y) in ys.into_iter().enumerate() {
                            env.insert(format!("{o}.{k}"), y);
                        }
                    } else if let Some(y) = ys.into_iter().next() {
                        env.insert(o.clone(), y);
                    }
                }
            }
        }
        nodes.push(first..tape.len());
    }
    Ok(Forward {
        loss: env.get(&plan.program.loss).cloned(),
        env,
        nodes,
    })
}

/// The weight of a loss in the global objective (see [`RankRun::weight`]).
pub(crate) fn loss_weight(loss: &Var) -> f64 {
    loss.invariant().map_or(1.0, |g| 1.0 / g.size() as f64)
}

/// Run this rank's part of `plan` on `comm`: forward from `inputs` (this rank's inputs; `None`:
/// the plan's), then, if `backward`, the backward pass (every rank takes part, with or without a
/// loss).
pub async fn run_rank<C: Communicator>(
    comm: &C,
    plan: &Plan,
    inputs: Option<&[Tensor]>,
    backward: bool,
) -> Result<RankRun> {
    let tape = Tape::with_objective(plan.program.objective.objective());
    let values = inputs.unwrap_or_else(|| plan.inputs(comm.rank()));
    let xs = input_vars(comm, &tape, plan, values)?;
    let loss = forward(comm, &tape, plan, &xs).await?;
    let mut run = RankRun {
        loss: match &loss {
            Some(l) => Some(l.value().read().await?.first().copied().unwrap_or(f32::NAN)),
            None => None,
        },
        weight: loss.as_ref().map_or(1.0, loss_weight),
        grads: vec![None; xs.len()],
    };
    if backward {
        let grads = match &loss {
            Some(l) => tape.backward(l, comm).await?,
            None => tape.backward_from(&[], comm).await?,
        };
        let me = comm.rank();
        for (i, (slot, (x, inp))) in run
            .grads
            .iter_mut()
            .zip(xs.iter().zip(&plan.program.inputs))
            .enumerate()
        {
            if inp.grad && plan.holds(me, i) {
                *slot = Some(grads.wrt(x)?.read().await?);
            }
        }
    }
    Ok(run)
}

/// Run `plan` forward and backward on its world of in-process ranks (threads); results by rank.
#[cfg(not(target_arch = "wasm32"))]
pub fn run_local(plan: &Plan, opts: crate::collective::CommOptions) -> Result<Vec<RankRun>> {
    let results = crate::in_process::run_local(plan.world, opts, |comm| async move {
        run_rank(&comm, plan, None, true).await
    });
    let mut out = Vec::with_capacity(results.len());
    let mut failed = Vec::new();
    for (r, res) in results.into_iter().enumerate() {
        match res {
            Ok(run) => out.push(run),
            Err(e) => failed.push((r, e.to_string())),
        }
    }
    if failed.is_empty() {
        Ok(out)
    } else {
        Err(ProgramError::Failed { ranks: failed }.into())
    }
}
