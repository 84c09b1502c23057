//! The `program` lesson: any program ([`crate::program`]) shown step by step: the inputs, each
//! step's result on every rank (a collective with its messages), the gradient of the global
//! objective with respect to each step's result (cotangents), the backward pass through each
//! collective step, last to first (the messages reversed, the collectives its dual really ran,
//! the cotangent of the step's result and the gradients of what the step read), and the
//! gradients of the inputs. (With `"steps"` the lesson trains the program instead, `training.rs`;
//! with `"compare_objectives"` it differentiates it under both objective conventions,
//! `objectives.rs`.)

use super::*;
use crate::collective::events::CallRecord;
use crate::program::{StepView, TracedRun, trace_rank};

/// Show `plan` (the lesson's program for this group) step by step (see the module docs).
pub(super) async fn run<T: Transport>(comm: &P2p<T>, plan: &Plan) -> Result<Vec<RankStep>> {
    let program = plan.program();
    let views = plan.views();
    comm.take_calls();
    comm.take_events();
    // The collectives each tape node's backward ran on this rank, and what it did in them.
    let mut ran_by_node: Vec<(usize, Vec<String>, Vec<CallRecord>)> = Vec::new();
    let mut forward_events = Vec::new();
    let run = trace_rank(
        comm,
        plan,
        || {
            comm.take_calls();
            forward_events = comm.take_events();
        },
        &mut |k| {
            let calls = recorded(comm);
            if !calls.is_empty() {
                ran_by_node.push((k, calls, comm.take_events()));
            }
        },
    )
    .await?;
    let me = comm.rank();
    let mut steps = forward_steps(plan, &views, &run, me).await?;
    // Each collective step this rank runs makes one call, in order: step k is steps[k + 1].
    let mut forward_events = forward_events.into_iter();
    for (k, v) in views.iter().enumerate() {
        if v.collective.is_some() && v.ranks.contains(&me) {
            steps[k + 1].events.extend(forward_events.next());
        }
    }
    let mut cotangents = Vec::new();
    let mut listed = std::collections::HashSet::new();
    // Each name once (ranks may bind one name in different steps: a pipeline's h0 is computed on
    // stage 0 and received on stage 1).
    for out in views.iter().filter_map(|v| v.out.as_ref()).rev() {
        if !listed.insert(out) {
            continue;
        }
        cotangents.push(Named::tensors(
            &format!("dF/d{out}"),
            value_of(out, &run.grads).await?,
        ));
    }
    steps.push(step(
        "cotangents: the gradient of the global objective with respect to each step's result"
            .into(),
        Phase::Cotangent,
        Vec::new(),
        cotangents,
    ));
    // The backward pass through each collective step, last to first: the collectives its dual ran
    // (on this rank) and the gradients of what the step read.
    for (k, v) in views.iter().enumerate().rev() {
        // Collective steps, and local steps that made an invariant value varying (the dual of
        // that is an all_reduce: Megatron's f).
        if v.collective.is_none() && v.made_varying.is_empty() {
            continue;
        }
        let nodes = run.nodes.get(k).cloned().unwrap_or_default();
        let calls: Vec<String> = ran_by_node
            .iter()
            .filter(|(n, _, _)| nodes.contains(n))
            .flat_map(|(_, c, _)| c.iter().cloned())
            .collect();
        let events: Vec<CallRecord> = ran_by_node
            .iter()
            .filter(|(n, _, _)| nodes.contains(n))
            .flat_map(|(_, _, e)| e.iter().cloned())
            .collect();
        // The cotangent that arrives at the step's result, and what its dual makes of it (on
        // the ranks that ran the step).
        let mut values = Vec::new();
        for name in v.out.iter().chain(&v.inputs) {
            values.push(Named::tensors(
                &format!("dF/d{name}"),
                shown(v, me, name, &run.grads).await?,
            ));
        }
        // What this rank's backward ran for the step (ranks differ: the dual of a send is a
        // recv on the sender, of a recv a send on the receiver).
        values.push(if calls.is_empty() {
            Named::tensors("backward ran", Vec::new())
        } else {
            Named::text("backward ran", calls.join(" + "))
        });
        let made = if v.made_varying.is_empty() {
            String::new()
        } else {
            format!(
                " ({} was made varying: its dual sums dF/d{} over the ranks)",
                v.made_varying.join(", "),
                v.made_varying.join(", dF/d")
            )
        };
        let mut b = step(
            format!("backward through {}{made}", v.label),
            Phase::Backward,
            backward_arrows(&[v], me, &calls),
            values,
        );
        // Ranks outside the step ran nothing for it; the step names what its members ran.
        b.collective = (!calls.is_empty()).then(|| calls.join(" + "));
        b.events = events;
        steps.push(b);
    }
    steps.push(step(
        "the gradients of the inputs".into(),
        Phase::Result,
        Vec::new(),
        input_grads(program, "dF/d", &run.grads).await?,
    ));
    Ok(steps)
}

/// The gradient of every input that takes one, named `<prefix><input>`.
pub(super) async fn input_grads(
    program: &Program,
    prefix: &str,
    grads: &std::collections::HashMap<String, Tensor>,
) -> Result<Vec<Named>> {
    let mut out = Vec::new();
    for inp in program.inputs.iter().filter(|i| i.grad) {
        out.push(Named::tensors(
            &format!("{prefix}{}", inp.name),
            value_of(&inp.name, grads).await?,
        ));
    }
    Ok(out)
}

/// Two runs' gradients combined by `f`, input by input, named `<prefix><input>` (nothing where
/// either run has none).
pub(super) async fn combined_grads(
    program: &Program,
    prefix: &str,
    [a, b]: [&std::collections::HashMap<String, Tensor>; 2],
    f: impl Fn(&Tensor, &Tensor) -> Result<Tensor>,
) -> Result<Vec<Named>> {
    let mut out = Vec::new();
    for inp in program.inputs.iter().filter(|i| i.grad) {
        let v = match (a.get(&inp.name), b.get(&inp.name)) {
            (Some(x), Some(y)) => vec![read(&f(x, y)?).await?],
            _ => Vec::new(),
        };
        out.push(Named::tensors(&format!("{prefix}{}", inp.name), v));
    }
    Ok(out)
}

/// The messages of a backward step through `views` as rank `me` shows them: the forward ones
/// reversed, none where `me` ran the steps and its dual sent nothing (an all_reduce under the
/// replicated objective, a barrier: no rank sent anything back).
pub(super) fn backward_arrows(
    views: &[&StepView],
    me: usize,
    ran: &[String],
) -> Vec<(usize, usize)> {
    if ran.is_empty() && views.iter().all(|v| v.ranks.contains(&me)) {
        return Vec::new();
    }
    views.iter().flat_map(|v| reversed(&v.arrows)).collect()
}

/// A value by name as shown: a list output's parts (`name.0`, `name.1`, ...) together; nothing
/// where this rank does not hold it.
pub(super) async fn value_of(
    name: &str,
    of: &std::collections::HashMap<String, Tensor>,
) -> Result<Vec<TensorJson>> {
    let parts: Vec<&Tensor> = match of.get(name) {
        Some(t) => vec![t],
        None => (0..)
            .map_while(|k| of.get(&format!("{name}.{k}")))
            .collect(),
    };
    let mut out = Vec::with_capacity(parts.len());
    for t in parts {
        out.push(read(t).await?);
    }
    Ok(out)
}

/// The inputs, then each step's result (a collective with its messages), from a traced run.
pub(super) async fn forward_steps(
    plan: &Plan,
    views: &[StepView],
    run: &TracedRun,
    me: usize,
) -> Result<Vec<RankStep>> {
    let mut steps = Vec::with_capacity(views.len() + 1);
    let mut inputs = Vec::new();
    for inp in &plan.program().inputs {
        inputs.push(
            Named::tensors(&inp.name, value_of(&inp.name, &run.values).await?)
                .kind(plan.value_kind(me, &inp.name)),
        );
    }
    steps.push(step("inputs".into(), Phase::Input, Vec::new(), inputs));
    for v in views {
        let mut values = Vec::new();
        match &v.out {
            Some(out) => {
                let kind = v.ranks.contains(&me).then(|| plan.value_kind(me, out));
                values.push(
                    Named::tensors(out, shown(v, me, out, &run.values).await?).kind(kind.flatten()),
                );
            }
            // A send binds nothing: show what it sends.
            None => {
                for name in &v.inputs {
                    values.push(Named::tensors(name, shown(v, me, name, &run.values).await?));
                }
            }
        }
        let made = if v.made_varying.is_empty() {
            String::new()
        } else {
            format!(
                " — made varying here: {} (its backward: an all_reduce)",
                v.made_varying.join(", ")
            )
        };
        let mut s = step(
            format!("forward: {}{made}", v.label),
            Phase::Forward,
            v.arrows.clone(),
            values,
        );
        s.collective = v.collective.clone();
        steps.push(s);
    }
    Ok(steps)
}

/// A value of step `v` as rank `me` shows it: nothing where `me` does not run the step (rank 1 of
/// a pipeline holds `h0` only once it received it, not at the step where stage 0 computes it).
async fn shown(
    v: &StepView,
    me: usize,
    name: &str,
    of: &std::collections::HashMap<String, Tensor>,
) -> Result<Vec<TensorJson>> {
    if v.ranks.contains(&me) {
        value_of(name, of).await
    } else {
        Ok(Vec::new())
    }
}
