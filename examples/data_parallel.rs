//! Data-parallel training on 4 in-process ranks, written as the math says: the parameters are
//! replicated (invariant over the ranks), each rank computes the loss of its own batch, and the
//! objective is their mean, `all_reduce(AVG)`. Under the replicated objective the backward pass
//! finds the gradient all_reduce by itself (the dual of using a replicated parameter per rank),
//! so every rank gets the gradient of the mean loss and takes the same SGD step, as DDP does.
//! The replicas stay bitwise identical, and a single-device run on the whole batch ends at the
//! same parameters.
//!
//! `cargo run --example data_parallel`

use distgrad::{Communicator, Objective, ReduceOp, Tape, Tensor, dist};

const WORLD: usize = 4;
const STEPS: usize = 60;

/// The batch of rank `r`: x in [-1, 1], target y = 2x - 1 + a little curvature.
fn batch(r: usize) -> (Vec<f32>, Vec<f32>) {
    let x: Vec<f32> = (0..8).map(|i| ((r * 8 + i) as f32 / 16.0) - 1.0).collect();
    let y = x.iter().map(|v| 2.0 * v - 1.0 + 0.1 * v * v).collect();
    (x, y)
}

fn main() -> distgrad::Result<()> {
    let results = distgrad::run_local(WORLD, distgrad::CommOptions::default(), |comm| async move {
        let (x, y) = batch(comm.rank());
        let x = Tensor::from_vec(x, &[8, 1])?;
        let y = Tensor::from_vec(y, &[8, 1])?;
        let (mut w, mut b) = (
            Tensor::from_vec(vec![0.0], &[1, 1])?,
            Tensor::vector(&[0.0]),
        );
        let mut losses = Vec::new();
        let world = comm.world();
        for _ in 0..STEPS {
            let tape = Tape::with_objective(Objective::Replicated);
            let (wv, bv) = (
                tape.var_invariant(w.clone(), &world),
                tape.var_invariant(b.clone(), &world),
            );
            let pred = tape.constant(x.clone()).matmul(&wv)?.add(&bv)?;
            let loss = pred.mse_loss(&tape.constant(y.clone()))?;
            let mean = dist::all_reduce(&comm, &loss, ReduceOp::Avg, &world).await?;
            let grads = tape.backward(&mean, &comm).await?;
            w = w.sub(&grads.wrt(&wv)?.scale(0.5)?)?;
            b = b.sub(&grads.wrt(&bv)?.scale(0.5)?)?;
            losses.push(mean.value().to_vec()[0]);
        }
        Ok((losses, w.to_vec(), b.to_vec()))
    });
    let results: Vec<_> = results.into_iter().collect::<distgrad::Result<_>>()?;
    let (losses, w, b) = &results[0];
    for (r, res) in results.iter().enumerate() {
        assert_eq!((&res.1, &res.2), (w, b), "rank {r}'s replica differs");
    }
    println!(
        "loss (mean over ranks): step 0 {:.4} -> step {} {:.5}",
        losses[0],
        STEPS - 1,
        losses[STEPS - 1]
    );
    println!(
        "w = {:.4}, b = {:.4} on every rank (fit of y = 2x - 1 + 0.1x^2)",
        w[0], b[0]
    );

    // The single-device reference: the same model trained on the whole batch at once.
    let (mut w1, mut b1) = (0.0f32, 0.0f32);
    let all: Vec<(f32, f32)> = (0..WORLD)
        .flat_map(|r| {
            let (x, y) = batch(r);
            x.into_iter().zip(y)
        })
        .collect();
    let n = all.len() as f32;
    for _ in 0..STEPS {
        let (mut gw, mut gb) = (0.0, 0.0);
        for &(x, y) in &all {
            let e = w1 * x + b1 - y;
            gw += 2.0 * e * x / n;
            gb += 2.0 * e / n;
        }
        w1 -= 0.5 * gw;
        b1 -= 0.5 * gb;
    }
    println!("single-device reference: w = {w1:.4}, b = {b1:.4}");
    if (w1 - w[0]).abs() > 1e-4 || (b1 - b[0]).abs() > 1e-4 {
        eprintln!("data-parallel and single-device runs disagree");
        std::process::exit(1);
    }
    Ok(())
}
