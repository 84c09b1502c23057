//! The `program` lesson: any program ([`crate::program`]) shown step by step: the inputs, each
//! step's result on every rank (a collective with its messages), the gradient of the global
//! objective with respect to each step's result (cotangents), and the backward pass with the
//! collectives it really ran and the gradients of the inputs.

use super::*;
use crate::program::{Program, trace_rank};

pub(super) async fn run<T: Transport>(comm: &P2p<T>, lesson: &Lesson) -> Result<Vec<RankStep>> {
    let program = lesson
        .program
        .as_ref()
        .ok_or_else(|| Error::Input(format!("lesson {}: no \"program\"", lesson.name)))?;
    let plan = plan_for(lesson, program, comm.world_size())?;
    let views = plan.views();
    comm.take_calls();
    let run = trace_rank(comm, &plan, || {
        comm.take_calls();
    })
    .await?;
    let dual = duals(comm);
    let value = async |name: &str, of: &std::collections::HashMap<String, Tensor>| {
        // A list output binds name.0, name.1, ...: shown together.
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
        Ok::<_, Error>(out)
    };
    let mut steps = Vec::with_capacity(views.len() + 3);
    let mut inputs = Vec::new();
    for inp in &program.inputs {
        inputs.push(Named::tensors(
            &inp.name,
            value(&inp.name, &run.values).await?,
        ));
    }
    steps.push(step("inputs".into(), Phase::Input, Vec::new(), inputs));
    let mut backward_arrows = Vec::new();
    for v in &views {
        let mut values = Vec::new();
        if let Some(out) = &v.out {
            values.push(Named::tensors(out, value(out, &run.values).await?));
        }
        let mut s = step(
            format!("forward: {}", v.label),
            Phase::Forward,
            v.arrows.clone(),
            values,
        );
        s.collective = v.collective.clone();
        steps.push(s);
        backward_arrows.splice(0..0, reversed(&v.arrows));
    }
    let mut cotangents = Vec::new();
    for out in views.iter().filter_map(|v| v.out.as_ref()).rev() {
        cotangents.push(Named::tensors(
            &format!("dF/d{out}"),
            value(out, &run.grads).await?,
        ));
    }
    steps.push(step(
        "cotangents: the gradient of the global objective with respect to each step's result"
            .into(),
        Phase::Cotangent,
        Vec::new(),
        cotangents,
    ));
    let mut grads = Vec::new();
    for inp in program.inputs.iter().filter(|i| i.grad) {
        grads.push(Named::tensors(
            &format!("dF/d{}", inp.name),
            value(&inp.name, &run.grads).await?,
        ));
    }
    let mut b = step(
        format!(
            "backward (ran: {}): the gradients of the inputs",
            dual.clone().unwrap_or_default()
        ),
        Phase::Backward,
        backward_arrows,
        grads,
    );
    b.collective = dual;
    steps.push(b);
    Ok(steps)
}

/// The lesson's program checked for `world` ranks, saying so when the lesson was written for
/// another world.
fn plan_for(lesson: &Lesson, program: &Program, world: usize) -> Result<crate::program::Plan> {
    program.plan(Some(world)).map_err(|e| {
        Error::Input(format!(
            "lesson {}: {e}{}",
            lesson.name,
            if program.world != world {
                format!(
                    " (its program was written for {} ranks; this group has {world})",
                    program.world
                )
            } else {
                String::new()
            }
        ))
    })
}
