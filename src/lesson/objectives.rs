//! A `program` lesson with `"compare_objectives": true`: its program differentiated under both
//! objective conventions. The forward pass is the same; the backward pass under the sum of
//! every rank's loss (PyTorch's) and under the one replicated loss (JAX's) runs different
//! collectives, and where every rank holds the same loss the gradients differ by exactly the
//! number of ranks that share it.

use super::steps::{combined_grads, forward_steps, input_grads};
use super::*;
use crate::program::{ObjectiveName, trace_rank};

/// Run the lesson's program under both objectives (see the module docs).
pub(super) async fn run<T: Transport>(comm: &P2p<T>, lesson: &Lesson) -> Result<Vec<RankStep>> {
    let program = &lesson.program_for(comm.world_size())?;
    let mut traces = Vec::with_capacity(2);
    let mut steps = Vec::new();
    for objective in [ObjectiveName::SumOfRankLosses, ObjectiveName::Replicated] {
        let mut p = program.clone();
        p.objective = objective;
        let plan = lesson.plan_program(&p, comm.world_size())?;
        let views = plan.views();
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
        let ran = recorded(comm);
        if objective == ObjectiveName::SumOfRankLosses {
            steps = forward_steps(&plan, &views, &run, comm.rank()).await?;
        }
        let grads = input_grads(&p, "dL/d", &run.grads).await?;
        let (label, arrows) = match objective {
            ObjectiveName::SumOfRankLosses => (
                "backward, objective = the SUM of every rank's loss",
                // The messages of the forward collectives, reversed.
                views
                    .iter()
                    .rev()
                    .flat_map(|v| reversed(&v.arrows))
                    .collect::<Vec<_>>(),
            ),
            ObjectiveName::Replicated => {
                ("backward, objective = the ONE replicated loss", Vec::new())
            }
        };
        let dual = if ran.is_empty() {
            "nothing".to_string()
        } else {
            ran.join(" + ")
        };
        let mut b = step(
            format!("{label} (ran: {dual})"),
            Phase::Backward,
            arrows,
            grads,
        );
        b.collective = Some(dual);
        steps.push(b);
        traces.push(run);
    }
    // The ratio of the two gradients, input by input.
    let ratios = combined_grads(
        program,
        "ratio ",
        [&traces[0].grads, &traces[1].grads],
        Tensor::div,
    )
    .await?;
    steps.push(step(
        "the two gradients, divided: the factor is the number of ranks that share the loss".into(),
        Phase::Result,
        Vec::new(),
        ratios,
    ));
    Ok(steps)
}
