//! A `program` lesson with `"steps"`: the program trained data-parallel. Every rank runs the
//! program forward and backward on its own inputs (its data), the gradients of the trainable
//! inputs (those with gradient) are averaged over the ranks with one all_reduce(AVG), and every
//! rank takes the same step `p -= lr · g`: the replicas stay identical (the same hash on every
//! rank) while the loss falls.

use super::*;
use crate::program::run_rank;

/// Train the lesson's program for `steps` steps at learning rate `lr` (see the module docs).
pub(super) async fn run<T: Transport>(
    comm: &P2p<T>,
    lesson: &Lesson,
    plan: &Plan,
    steps: usize,
    lr: f32,
) -> Result<Vec<RankStep>> {
    let me = comm.rank();
    let n = comm.world_size();
    let program = plan.program();
    let mut inputs: Vec<Tensor> = plan.inputs(me).to_vec();
    // The trainable inputs: with gradient, held by every rank, starting equal everywhere.
    let trainable: Vec<usize> = (0..program.inputs.len())
        .filter(|&i| program.inputs[i].grad)
        .collect();
    if trainable.is_empty() {
        return Err(lesson.error("training needs an input with gradient (a parameter)".into()));
    }
    for &i in &trainable {
        let first = plan.inputs(0)[i].try_to_vec()?;
        for r in 0..n {
            if !plan.holds(r, i) || plan.inputs(r)[i].try_to_vec()? != first {
                return Err(lesson.error(format!(
                    "parameter {:?} must start equal on every rank (give it a \"value\" or make \
                     it \"replicated\"; data without gradient may differ per rank)",
                    program.inputs[i].name
                )));
            }
        }
    }
    let names: Vec<&str> = trainable
        .iter()
        .map(|&i| program.inputs[i].name.as_str())
        .collect();
    let params = |inputs: &[Tensor]| -> Result<Vec<f32>> {
        let mut all = Vec::new();
        for &i in &trainable {
            all.extend(inputs[i].try_to_vec()?);
        }
        Ok(all)
    };
    let shown = |inputs: &[Tensor]| -> Result<Vec<Named>> {
        let mut v = Vec::with_capacity(trainable.len() + 1);
        for &i in &trainable {
            v.push(Named::tensors(
                &program.inputs[i].name,
                vec![TensorJson::from_tensor(&inputs[i])?],
            ));
        }
        v.push(Named::text(
            "replica hash",
            crate::train::param_hash(&params(inputs)?),
        ));
        Ok(v)
    };
    let data: Vec<&str> = program
        .inputs
        .iter()
        .filter(|i| !i.grad)
        .map(|i| i.name.as_str())
        .collect();
    let mut out = vec![step(
        format!(
            "rank {me}: parameters {} (the same on every rank){}",
            names.join(", "),
            if data.is_empty() {
                String::new()
            } else {
                format!("; its own data {}", data.join(", "))
            }
        ),
        Phase::Input,
        Vec::new(),
        shown(&inputs)?,
    )];
    let all = arrows(Kind::AllReduce, n, 0, &[]);
    let group = comm.world();
    let device = comm.options().device.clone();
    for k in 1..=steps {
        let run = run_rank(comm, plan, Some(&inputs), true).await?;
        let loss = run.loss.ok_or_else(|| {
            lesson.error(format!(
                "rank {me} has no loss `{}` to train on",
                program.loss
            ))
        })?;
        // One bucket: every parameter's gradient, averaged over the ranks at once.
        let mut g = Vec::new();
        for &i in &trainable {
            match &run.grads[i] {
                Some(x) => g.extend_from_slice(x),
                None => g.extend(std::iter::repeat_n(0.0, inputs[i].numel())),
            }
        }
        let len = g.len();
        let g = Tensor::from_vec(g, &[len])?.to_device(&device)?;
        let g = comm
            .all_reduce(&g, ReduceOp::Avg, &group)
            .await?
            .read()
            .await?;
        let local = Tensor::from_vec(vec![loss], &[1])?.to_device(&device)?;
        let group_loss = comm.all_reduce(&local, ReduceOp::Avg, &group).await?;
        comm.take_calls();
        let mut at = 0;
        for &i in &trainable {
            let p = inputs[i].try_to_vec()?;
            let shape = inputs[i].shape().to_vec();
            let next: Vec<f32> = p
                .iter()
                .zip(&g[at..at + p.len()])
                .map(|(w, d)| w - lr * d)
                .collect();
            at += p.len();
            inputs[i] = Tensor::from_vec(next, &shape)?;
        }
        let mut values = vec![
            Named::tensors(
                "loss",
                vec![TensorJson::from_tensor(&Tensor::vector(&[loss]))?],
            ),
            Named::tensors("group loss", vec![read(&group_loss).await?]),
        ];
        values.extend(shown(&inputs)?);
        out.push(step(
            format!(
                "step {k}: gradients on each rank's data, all_reduce(AVG) of them, {} -= {lr}·g",
                names.join(", ")
            ),
            Phase::Train,
            all.clone(),
            values,
        ));
    }
    Ok(out)
}
