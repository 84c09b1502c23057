//! The `data_parallel` lesson: linear regression, one data shard per rank, gradients averaged
//! with all_reduce(AVG) each step.

use super::*;

/// Samples per rank in the data-parallel lesson.
const SHARD: usize = 8;

pub(super) async fn run<T: Transport>(comm: &P2p<T>, lesson: &Lesson) -> Result<Vec<RankStep>> {
    let me = comm.rank();
    let n = comm.world_size();
    let steps = lesson.steps.unwrap_or(20).clamp(1, 1000);
    let lr = lesson.lr.unwrap_or(0.3);
    let device = comm.options().device.clone();
    let group = comm.world();
    // This rank's shard: x uniform in [-1, 1)², y = 2·x0 - x1 + 0.5 + small noise.
    let xs = crate::train::uniform(1 + me as u64, SHARD * 2);
    let noise = crate::train::uniform(1000 + me as u64, SHARD);
    let ys: Vec<f32> = (0..SHARD)
        .map(|i| 2.0 * xs[2 * i] - xs[2 * i + 1] + 0.5 + 0.05 * noise[i])
        .collect();
    let x = Tensor::from_vec(xs, &[SHARD, 2])?.to_device(&device)?;
    let y = Tensor::from_vec(ys, &[SHARD, 1])?.to_device(&device)?;
    let mut w = vec![0.0f32; 3]; // w0, w1, b
    let all = arrows(Kind::AllReduce, n, 0, &[]);
    let mut out = vec![step(
        format!("rank {me} holds {SHARD} samples of y = 2·x₀ − x₁ + 0.5 (+ noise); w = 0"),
        Phase::Input,
        Vec::new(),
        vec![
            Named::tensors("w", vec![TensorJson::read(&Tensor::vector(&w)).await?]),
            Named::text("replica hash", crate::train::param_hash(&w)),
        ],
    )];
    for k in 1..=steps {
        let tape = Tape::new();
        let wv = tape.var(Tensor::from_vec(w[..2].to_vec(), &[2, 1])?.to_device(&device)?);
        let bv = tape.var(Tensor::from_vec(vec![w[2]], &[1])?.to_device(&device)?);
        let xv = tape.constant(x.clone());
        let yv = tape.constant(y.clone());
        let loss = xv.matmul(&wv)?.add(&bv)?.mse_loss(&yv)?;
        let grads = tape.backward(&loss, comm).await?;
        let g = Tensor::concat(&[grads.wrt(&wv)?.reshape(&[2])?, grads.wrt(&bv)?], 0)?;
        // Average the gradients over the ranks: every replica takes the same step.
        let g = comm.all_reduce(&g, ReduceOp::Avg, &group).await?;
        let group_loss = comm
            .all_reduce(&loss.value(), ReduceOp::Avg, &group)
            .await?;
        comm.take_calls();
        let g = g.read().await?;
        for (wi, gi) in w.iter_mut().zip(&g) {
            *wi -= lr * gi;
        }
        out.push(step(
            format!("step {k}: local gradient, all_reduce(AVG), w -= {lr}·g"),
            Phase::Train,
            all.clone(),
            vec![
                Named::tensors("loss", vec![read(&loss.value()).await?]),
                Named::tensors("group loss", vec![read(&group_loss).await?]),
                Named::tensors("w", vec![TensorJson::read(&Tensor::vector(&w)).await?]),
                Named::text("replica hash", crate::train::param_hash(&w)),
            ],
        ));
    }
    Ok(out)
}
