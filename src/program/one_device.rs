//! The whole problem on one device: every rank's part of a plan computed on ONE tape, each
//! collective written as the local arithmetic it stands for (an all_reduce SUM is the sum of the
//! ranks' tensors, an all_gather their list, a send binds the receiver's name to the sender's
//! value, ...), and differentiated by ordinary local autograd. No communicator carries data and no
//! collective's dual runs, so the gradients it gives are an independent reference for the
//! distributed ones: the gradient a single device computes for the unsharded problem.
//!
//! The objective is the program's: the sum over ranks of each rank's loss, where under the
//! replicated objective a loss invariant over a group of k ranks counts 1/k on each of them (once
//! in all), and a replicated input is ONE value shared by every rank (its gradient sums every
//! rank's use of it, as the dual of "make varying" does); under the sum of rank losses every
//! rank's copy is its own value.
//!
//! Ranks run their steps in order, each as far as it can: a recv waits for the matching send, a
//! collective for every member of its group to reach it. A program that deadlocks here deadlocks
//! on real ranks too, and is refused with the ranks and steps that wait.
//!
//! At ties, MAX and MIN share the gradient equally among the ranks holding the extreme (the
//! convention of PyTorch's `amax`, and of the all_reduce MAX dual). Their value is the extreme
//! itself; where an input is infinite it is NaN here (the reference is for finite values).

use std::collections::{HashMap, VecDeque};

use super::check::What;
use super::runner::local;
use super::shapes::lists_outputs;
use super::{ObjectiveName, Plan};
use crate::autograd::{Tape, Var};
use crate::collective::{ReduceOp, Spec};
use crate::error::{Error, ProgramError, Result};
use crate::tensor::Tensor;

/// Most elements one device holds for the whole problem's inputs (all ranks together) before
/// [`one_device`] refuses: 2^24 (64 MiB of f32). A lesson's are a few dozen.
pub const MAX_ONE_DEVICE_ELEMENTS: usize = 1 << 24;

/// What one device computes for the whole problem ([`one_device`]).
#[derive(Debug, Clone, PartialEq)]
pub struct OneDevice {
    /// The global objective: `Σ_r weight_r · loss_r`.
    pub objective: f64,
    /// Each rank's loss (`None` where it has none).
    pub losses: Vec<Option<f32>>,
    /// `grads[r][i]`: the gradient of the objective with respect to input `i` as rank `r` holds it
    /// (`None` where `r` does not hold it or it takes no gradient); a replicated input under the
    /// replicated objective is one value, so every rank shows its one gradient.
    pub grads: Vec<Vec<Option<Vec<f32>>>>,
}

/// One rank's place in the plan while the device runs it.
struct Rank {
    env: HashMap<String, Var>,
    pc: usize,
}

/// Run `plan` for all its ranks on one device (the CPU) from `inputs[r]` (rank `r`'s inputs in
/// the program's order, as [`Plan::inputs`] gives them) and differentiate the global objective
/// (see the module docs).
pub async fn one_device(plan: &Plan, inputs: &[Vec<Tensor>]) -> Result<OneDevice> {
    one_device_with(plan, inputs, false).await
}

/// [`one_device`], or with `data_parallel` the problem data-parallel training solves: every
/// input with gradient that starts equal on every rank (a parameter) is ONE value the ranks
/// share, and the objective is the mean of the ranks' losses, so its gradient is the average of
/// the ranks' gradients that data-parallel training all_reduces (full-batch gradient descent).
pub async fn one_device_with(
    plan: &Plan,
    inputs: &[Vec<Tensor>],
    data_parallel: bool,
) -> Result<OneDevice> {
    let world = plan.world;
    let err = |detail: String| -> Error { ProgramError::OneDevice { detail }.into() };
    if inputs.len() != world {
        return Err(err(format!(
            "{} ranks' inputs for a world of {world}",
            inputs.len()
        )));
    }
    let elements: usize = inputs.iter().flatten().map(Tensor::numel).sum();
    if elements > MAX_ONE_DEVICE_ELEMENTS {
        return Err(err(format!(
            "the inputs of all ranks together hold {elements} elements, more than one device \
             here holds ({MAX_ONE_DEVICE_ELEMENTS})"
        )));
    }
    let tape = Tape::new();
    let replicated = plan.program.objective == ObjectiveName::Replicated;
    let mut shared: HashMap<usize, Var> = HashMap::new();
    let mut leaves: Vec<Vec<Option<Var>>> = Vec::with_capacity(world);
    let mut ranks: Vec<Rank> = Vec::with_capacity(world);
    for (r, values) in inputs.iter().enumerate() {
        let mut env = HashMap::new();
        let mut mine = Vec::new();
        for (i, inp) in plan.program.inputs.iter().enumerate() {
            if !plan.holds(r, i) {
                mine.push(None);
                continue;
            }
            let t = values
                .get(i)
                .ok_or_else(|| err(format!("rank {r} has no value for input `{}`", inp.name)))?
                .to_device(&crate::backend::Device::Cpu)?;
            // Under the replicated objective a replicated input is one value, used by every rank
            // (and, data-parallel, every parameter).
            let one_value = (replicated && inp.replicated)
                || (data_parallel && inp.grad && plan.same_on_every_rank(i));
            let v = if one_value {
                shared
                    .entry(i)
                    .or_insert_with(|| tape.leaf(t, inp.grad, None))
                    .clone()
            } else {
                tape.leaf(t, inp.grad, None)
            };
            env.insert(inp.name.clone(), v.clone());
            mine.push(inp.grad.then_some(v));
        }
        leaves.push(mine);
        ranks.push(Rank { env, pc: 0 });
    }
    run_steps(plan, &tape, &mut ranks)?;
    // The global objective, on the tape.
    let holders = ranks
        .iter()
        .filter(|r| r.env.contains_key(&plan.program.loss))
        .count()
        .max(1);
    let mut total: Option<Var> = None;
    let mut losses = vec![None; world];
    for (r, rank) in ranks.iter().enumerate() {
        let Some(loss) = rank.env.get(&plan.program.loss) else {
            continue;
        };
        losses[r] = Some(loss.value().item()?);
        let weight = match plan
            .invariant
            .get(r)
            .and_then(|m| m.get(&plan.program.loss))
        {
            _ if data_parallel => 1.0 / holders as f32,
            Some(group) if replicated => 1.0 / group.len() as f32,
            _ => 1.0,
        };
        let term = if weight == 1.0 {
            loss.clone()
        } else {
            loss.scale(weight)?
        };
        total = Some(match total {
            None => term,
            Some(t) => t.add(&term)?,
        });
    }
    let total =
        total.ok_or_else(|| err(format!("no rank holds the loss `{}`", plan.program.loss)))?;
    let objective = f64::from(total.value().item()?);
    // Nothing on the tape communicates: a communicator of one rank is never used.
    let solo = crate::in_process::solo();
    let g = tape.backward(&total, &solo).await?;
    let mut grads = Vec::with_capacity(world);
    for mine in &leaves {
        let mut row = Vec::with_capacity(mine.len());
        for leaf in mine {
            row.push(match leaf {
                Some(v) => Some(g.wrt(v)?.read().await?),
                None => None,
            });
        }
        grads.push(row);
    }
    Ok(OneDevice {
        objective,
        losses,
        grads,
    })
}

/// What a rank waits for when it cannot go on.
enum Wait {
    /// Its steps are done.
    Done,
    /// A recv from `from` with nothing sent yet.
    Recv { from: usize },
    /// A collective every member of its group must reach.
    Group,
}

/// Run every rank's steps (see the module docs).
fn run_steps(plan: &Plan, tape: &Tape, ranks: &mut [Rank]) -> Result<()> {
    // Sent and not yet received values, by (from, to) global ranks.
    let mut queues: HashMap<(usize, usize), VecDeque<Var>> = HashMap::new();
    loop {
        let before: Vec<usize> = ranks.iter().map(|r| r.pc).collect();
        let mut waits = Vec::with_capacity(ranks.len());
        for r in 0..ranks.len() {
            waits.push(advance(plan, ranks, r, &mut queues)?);
        }
        if waits.iter().all(|w| matches!(w, Wait::Done)) {
            return Ok(());
        }
        // A send may have freed a rank that waited on its recv earlier in this pass.
        if ranks.iter().zip(&before).any(|(r, &b)| r.pc != b) {
            continue;
        }
        // The first collective whose whole group waits at it runs.
        let ready = (0..ranks.len()).find(|&r| {
            matches!(waits[r], Wait::Group) && {
                let k = ranks[r].pc;
                members(plan, k).iter().all(|&m| ranks[m].pc == k)
            }
        });
        let Some(r) = ready else {
            let stuck: Vec<String> = waits
                .iter()
                .enumerate()
                .filter_map(|(r, w)| {
                    let at = plan.steps.get(ranks[r].pc)?;
                    let step = plan.program.steps.get(at.index)?.describe();
                    match w {
                        Wait::Done => None,
                        Wait::Recv { from } => {
                            Some(format!("rank {r} at `{step}` waits for rank {from}"))
                        }
                        Wait::Group => Some(format!("rank {r} waits at `{step}`")),
                    }
                })
                .collect();
            return Err(ProgramError::OneDevice {
                detail: format!("the ranks wait for each other: {}", stuck.join("; ")),
            }
            .into());
        };
        let k = ranks[r].pc;
        collective(plan, tape, ranks, k)?;
        for m in members(plan, k) {
            ranks[m].pc += 1;
        }
    }
}

/// The global ranks taking part in collective step `k`.
fn members(plan: &Plan, k: usize) -> Vec<usize> {
    match &plan.steps[k].what {
        What::Collective { group, .. } => plan.groups[*group].clone(),
        What::Local(..) => Vec::new(),
    }
}

/// Rank `r`'s value named `name` (the plan said it would be bound).
fn get(plan: &Plan, rank: &Rank, r: usize, k: usize, name: &str) -> Result<Var> {
    rank.env.get(name).cloned().ok_or_else(|| {
        ProgramError::Step {
            at: format!("step {}", plan.steps[k].index),
            step: plan.program.steps[plan.steps[k].index].describe(),
            detail: format!("`{name}` is not defined on rank {r} (one device)"),
        }
        .into()
    })
}

/// Move rank `r` on through its local steps, sends and ready recvs; say what stops it.
fn advance(
    plan: &Plan,
    ranks: &mut [Rank],
    r: usize,
    queues: &mut HashMap<(usize, usize), VecDeque<Var>>,
) -> Result<Wait> {
    loop {
        let k = ranks[r].pc;
        let Some(s) = plan.steps.get(k) else {
            return Ok(Wait::Done);
        };
        match &s.what {
            What::Local(op, runs) => {
                if runs.get(r).copied().unwrap_or(false) {
                    let ins = s
                        .inputs
                        .iter()
                        .map(|n| get(plan, &ranks[r], r, k, n))
                        .collect::<Result<Vec<_>>>()?;
                    let y = local(op, &ins)?;
                    if let Some(o) = &s.out {
                        ranks[r].env.insert(o.clone(), y);
                    }
                }
            }
            What::Collective { group, specs, .. } => {
                let g = &plan.groups[*group];
                match specs.get(r) {
                    None | Some(None) => {}
                    Some(Some(Spec::Send { dst })) => {
                        let x = get(plan, &ranks[r], r, k, &s.inputs[0])?;
                        queues.entry((r, g[*dst])).or_default().push_back(x);
                    }
                    Some(Some(Spec::Recv { src, .. })) => {
                        let from = g[*src];
                        let Some(x) = queues.get_mut(&(from, r)).and_then(VecDeque::pop_front)
                        else {
                            return Ok(Wait::Recv { from });
                        };
                        if let Some(o) = &s.out {
                            ranks[r].env.insert(o.clone(), x);
                        }
                    }
                    Some(Some(Spec::Barrier {})) if g.len() == 1 => {}
                    Some(Some(_)) => return Ok(Wait::Group),
                }
            }
        }
        ranks[r].pc += 1;
    }
}

/// Run collective step `k` for every member of its group, as local arithmetic on the tape.
fn collective(plan: &Plan, tape: &Tape, ranks: &mut [Rank], k: usize) -> Result<()> {
    let s = &plan.steps[k];
    let What::Collective { group, specs, .. } = &s.what else {
        return Ok(());
    };
    let g = plan.groups[*group].clone();
    let n = g.len();
    let mut ins: Vec<Vec<Var>> = Vec::with_capacity(n);
    let mut member_specs: Vec<&Spec> = Vec::with_capacity(n);
    for (j, &r) in g.iter().enumerate() {
        let spec =
            specs
                .get(r)
                .and_then(Option::as_ref)
                .ok_or_else(|| ProgramError::OneDevice {
                    detail: format!(
                        "rank {r} is in the group of step {} but has no call",
                        s.index
                    ),
                })?;
        let xs = if spec.n_inputs(j, n) == 0 {
            Vec::new()
        } else {
            s.inputs
                .iter()
                .map(|name| get(plan, &ranks[r], r, k, name))
                .collect::<Result<Vec<_>>>()?
        };
        ins.push(xs);
        member_specs.push(spec);
    }
    let outs = outputs(tape, &member_specs, &ins)?;
    let Some(o) = &s.out else {
        return Ok(());
    };
    for (&r, ys) in g.iter().zip(outs) {
        if lists_outputs(member_specs[0].kind()) {
            for (i, y) in ys.into_iter().enumerate() {
                ranks[r].env.insert(format!("{o}.{i}"), y);
            }
        } else if let Some(y) = ys.into_iter().next() {
            ranks[r].env.insert(o.clone(), y);
        }
    }
    Ok(())
}

/// What every member of a group gets from a collective (index = group rank), from what each
/// passed (`ins[j]`: group rank j's tensors), written with local ops.
fn outputs(tape: &Tape, specs: &[&Spec], ins: &[Vec<Var>]) -> Result<Vec<Vec<Var>>> {
    let n = specs.len();
    let first = |j: usize| -> Result<Var> {
        ins.get(j).and_then(|x| x.first()).cloned().ok_or_else(|| {
            ProgramError::OneDevice {
                detail: format!(
                    "group rank {j} passed no tensor to {}",
                    specs[0].kind().name()
                ),
            }
            .into()
        })
    };
    let nth = |j: usize, i: usize| -> Result<Var> {
        ins.get(j).and_then(|x| x.get(i)).cloned().ok_or_else(|| {
            ProgramError::OneDevice {
                detail: format!(
                    "group rank {j} passed no tensor {i} to {}",
                    specs[0].kind().name()
                ),
            }
            .into()
        })
    };
    let all_first = || (0..n).map(first).collect::<Result<Vec<_>>>();
    Ok(match specs[0] {
        Spec::Broadcast { root } => {
            let x = first(*root)?;
            vec![vec![x]; n]
        }
        Spec::Reduce { root, op } => {
            let y = reduce(tape, *op, &all_first()?)?;
            (0..n)
                .map(|j| {
                    if j == *root {
                        vec![y.clone()]
                    } else {
                        Vec::new()
                    }
                })
                .collect()
        }
        Spec::AllReduce { op } => vec![vec![reduce(tape, *op, &all_first()?)?]; n],
        Spec::Gather { root } => {
            let xs = all_first()?;
            (0..n)
                .map(|j| if j == *root { xs.clone() } else { Vec::new() })
                .collect()
        }
        Spec::Scatter { root } => (0..n)
            .map(|j| nth(*root, j).map(|x| vec![x]))
            .collect::<Result<_>>()?,
        Spec::AllGather {} => vec![all_first()?; n],
        Spec::ReduceScatter { op } => (0..n)
            .map(|j| {
                let xs = (0..n).map(|i| nth(i, j)).collect::<Result<Vec<_>>>()?;
                Ok(vec![reduce(tape, *op, &xs)?])
            })
            .collect::<Result<_>>()?,
        Spec::AllToAll {} => (0..n)
            .map(|j| (0..n).map(|i| nth(i, j)).collect::<Result<Vec<_>>>())
            .collect::<Result<_>>()?,
        Spec::AllToAllSingle { .. } => all_to_all_single(tape, specs, &all_first()?)?,
        Spec::Permute { perm } => {
            let mut out = Vec::with_capacity(n);
            for j in 0..n {
                out.push(vec![match perm.iter().find(|&&(_, d)| d == j) {
                    Some(&(src, _)) => first(src)?,
                    // A rank that receives nothing gets zeros of its own tensor's shape.
                    None => tape.constant(Tensor::zeros(&first(j)?.shape())),
                }]);
            }
            out
        }
        Spec::Barrier {} => vec![Vec::new(); n],
        Spec::Send { .. } | Spec::Recv { .. } => {
            return Err(ProgramError::OneDevice {
                detail: "a send or recv is matched rank to rank, not as a group".into(),
            }
            .into());
        }
    })
}

/// all_to_all_single: group rank i's tensor, cut along dim 0 by its `in_splits`, piece j going
/// to j; rank j's output the pieces it gets, in rank order.
fn all_to_all_single(tape: &Tape, specs: &[&Spec], xs: &[Var]) -> Result<Vec<Vec<Var>>> {
    let n = specs.len();
    let mut pieces: Vec<Vec<Option<Var>>> = vec![vec![None; n]; n];
    for (i, (spec, x)) in specs.iter().zip(xs).enumerate() {
        let Spec::AllToAllSingle { in_splits, .. } = spec else {
            return Err(ProgramError::OneDevice {
                detail: format!("group rank {i} called another collective than all_to_all_single"),
            }
            .into());
        };
        let mut start = 0;
        for (j, &len) in in_splits.iter().enumerate() {
            if len > 0 && j < n {
                pieces[i][j] = Some(x.slice(0, start, len)?);
            }
            start += len;
        }
    }
    let mut out = Vec::with_capacity(n);
    for (j, x) in xs.iter().enumerate() {
        let got: Vec<Var> = (0..n).filter_map(|i| pieces[i][j].clone()).collect();
        out.push(vec![if got.is_empty() {
            let mut shape = x.shape();
            if let Some(rows) = shape.first_mut() {
                *rows = 0;
            }
            tape.constant(Tensor::zeros(&shape))
        } else {
            Var::concat(&got, 0)?
        }]);
    }
    Ok(out)
}

/// `op` over `xs`, elementwise, in rank order, as local ops.
fn reduce(tape: &Tape, op: ReduceOp, xs: &[Var]) -> Result<Var> {
    let fold = |f: fn(&Var, &Var) -> Result<Var>| -> Result<Var> {
        let mut acc = xs[0].clone();
        for x in &xs[1..] {
            acc = f(&acc, x)?;
        }
        Ok(acc)
    };
    match op {
        ReduceOp::Sum => fold(Var::add),
        ReduceOp::Avg => fold(Var::add)?.scale(1.0 / xs.len() as f32),
        ReduceOp::Prod => fold(Var::mul),
        ReduceOp::Max => extreme(tape, xs, true),
        ReduceOp::Min => extreme(tape, xs, false),
    }
}

/// The elementwise maximum (or minimum) of `xs`: its value is the extreme itself, its gradient
/// goes to the ranks holding it, shared equally at ties: `e + Σ_r m_r ⊙ (x_r − x̄_r)`, where `e`
/// and `x̄_r` are constants equal to the values (so the sum is exactly zero) and `m_r` is 1/count
/// where `x_r` holds the extreme.
fn extreme(tape: &Tape, xs: &[Var], max: bool) -> Result<Var> {
    let values: Vec<Vec<f32>> = xs
        .iter()
        .map(|x| x.value().try_to_vec())
        .collect::<Result<_>>()?;
    let shape = xs[0].shape();
    let len = values[0].len();
    let mut e = values[0].clone();
    for v in &values[1..] {
        for (a, &b) in e.iter_mut().zip(v) {
            // NaN-propagating, as the collective is.
            if a.is_nan() || b.is_nan() {
                *a = f32::NAN;
            } else if (max && b > *a) || (!max && b < *a) {
                *a = b;
            }
        }
    }
    let mut count = vec![0f32; len];
    for v in &values {
        for ((c, &x), &m) in count.iter_mut().zip(v).zip(&e) {
            if x == m {
                *c += 1.0;
            }
        }
    }
    let mut y = tape.constant(Tensor::from_vec(e.clone(), &shape)?);
    for (x, v) in xs.iter().zip(&values) {
        let mask: Vec<f32> = v
            .iter()
            .zip(&e)
            .zip(&count)
            .map(|((&x, &m), &c)| if x == m { 1.0 / c } else { 0.0 })
            .collect();
        let zero = x.sub(&tape.constant(x.value()))?;
        y = y.add(&tape.constant(Tensor::from_vec(mask, &shape)?).mul(&zero)?)?;
    }
    Ok(y)
}
