//! A `program` lesson with `"compare_objectives": true`: its program differentiated under both
//! objective conventions. The forward pass is the same (its values labelled with their kind
//! under the replicated objective: the loss after an all_reduce is invariant); the backward pass
//! under the sum of every rank's loss (PyTorch's) and under the one replicated loss (JAX's) runs
//! different collectives. Under each, the gradient of the objective with respect to every value
//! (the cotangents), then the two divided, value by value: an invariant value's cotangent is the
//! same per rank under both (under the sum each rank's copy carries it, N copies; under the
//! replicated loss one shared value does), and the factor N, the number of ranks that share the
//! loss, appears where the all_reduce's backward sums the N copies (identity under the
//! replicated loss): on the inputs.

use super::steps::{forward_steps, value_of};
use super::*;
use crate::program::{ObjectiveName, TracedRun, trace_rank};

/// Run the lesson's program under both objectives (see the module docs).
pub(super) async fn run<T: Transport>(comm: &P2p<T>, lesson: &Lesson) -> Result<Vec<RankStep>> {
    let program = &lesson.program_for(comm.world_size())?;
    let me = comm.rank();
    let mut runs: Vec<(TracedRun, Vec<String>)> = Vec::with_capacity(2);
    let mut plans = Vec::with_capacity(2);
    for objective in [ObjectiveName::SumOfRankLosses, ObjectiveName::Replicated] {
        let mut p = program.clone();
        p.objective = objective;
        let plan = lesson.plan_program(&p, comm.world_size())?;
        comm.take_calls();
        let run = trace_rank(
            comm,
            &plan,
            || {
                comm.take_calls();
            },
            &mut |_| {},
        )
        .await?;
        runs.push((run, recorded(comm)));
        plans.push(plan);
    }
    // The values are the same under both; their kinds are the replicated objective's.
    let replicated = &plans[1];
    let views = replicated.views();
    let mut steps = forward_steps(replicated, &views, &runs[1].0, me).await?;
    // Every value, in the order the program makes them (inputs first), each once.
    let mut names: Vec<&str> = Vec::new();
    for n in program
        .inputs
        .iter()
        .map(|i| i.name.as_str())
        .chain(views.iter().filter_map(|v| v.out.as_deref()))
    {
        if !names.contains(&n) {
            names.push(n);
        }
    }
    for (k, (run, ran)) in runs.iter().enumerate() {
        let (said, label, arrows) = if k == 0 {
            (
                "cotangents, objective = the SUM of every rank's loss: each rank's copy of a value is its own, with its own cotangent, and every rank's loss counts",
                "backward, objective = the SUM of every rank's loss",
                // The messages of the forward collectives, reversed.
                views
                    .iter()
                    .rev()
                    .flat_map(|v| reversed(&v.arrows))
                    .collect::<Vec<_>>(),
            )
        } else {
            (
                "cotangents, objective = the ONE replicated loss: an invariant value is one value the ranks share, and the shared loss counts once",
                "backward, objective = the ONE replicated loss",
                Vec::new(),
            )
        };
        steps.push(step(
            said.into(),
            Phase::Cotangent,
            Vec::new(),
            cotangents_of(&names, &run.grads).await?,
        ));
        let dual = if ran.is_empty() {
            "nothing".to_string()
        } else {
            ran.join(" + ")
        };
        let grads = super::steps::input_grads(program, "dL/d", &run.grads).await?;
        let mut b = step(
            format!("{label} (ran: {dual})"),
            Phase::Backward,
            arrows,
            grads,
        );
        b.collective = Some(dual);
        steps.push(b);
    }
    // The two divided, value by value: the inputs' gradients and every value's cotangent.
    let mut ratios = Vec::with_capacity(names.len());
    for n in &names {
        let v = match (runs[0].0.grads.get(*n), runs[1].0.grads.get(*n)) {
            (Some(a), Some(b)) => vec![read(&a.div(b)?).await?],
            _ => Vec::new(),
        };
        ratios.push(Named::tensors(&format!("ratio {n}"), v).kind(replicated.value_kind(me, n)));
    }
    steps.push(step(
        "the two divided, value by value: an invariant value has the same cotangent per rank under both (under the sum N copies carry it, under the replicated loss one shared value); the factor N, the number of ranks that share the loss, appears where the all_reduce's backward sums the N copies (under the replicated loss it passes the one value's on)".into(),
        Phase::Result,
        Vec::new(),
        ratios,
    ));
    Ok(steps)
}

/// The gradient of the objective with respect to each of `names`, named `dL/d<name>`.
async fn cotangents_of(
    names: &[&str],
    grads: &std::collections::HashMap<String, Tensor>,
) -> Result<Vec<Named>> {
    let mut out = Vec::with_capacity(names.len());
    for n in names {
        out.push(Named::tensors(
            &format!("dL/d{n}"),
            value_of(n, grads).await?,
        ));
    }
    Ok(out)
}
