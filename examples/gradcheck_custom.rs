//! A custom differentiable program over 4 in-process ranks, its gradients checked across the ranks.
//!
//! Each rank holds a slice of the rows of a batch `x` and a copy of a weight `w`; the program is a
//! small sequence-parallel block: the ranks exchange their activations (all_to_all), mix them,
//! and reduce a score to rank 2 with MAX. `gradcheck` perturbs every coordinate of every rank's
//! `x` and `w`, re-runs the whole program on all ranks, and compares with backward.
//!
//! `cargo run --example gradcheck_custom`

use distgrad::gradcheck::{CheckInput, Options};
use distgrad::{Communicator, ReduceOp, Tensor, dist};

fn main() -> distgrad::Result<()> {
    let world = 4;
    let x: Vec<Tensor> = (0..world)
        .map(|r| {
            let v: Vec<f32> = (0..6).map(|i| ((r * 6 + i) as f32 * 0.37).sin()).collect();
            Tensor::from_vec(v, &[2, 3])
        })
        .collect::<distgrad::Result<_>>()?;
    let w: Vec<Tensor> = (0..world)
        .map(|r| {
            let v: Vec<f32> = (0..9).map(|i| ((i + r) as f32 * 0.11).cos()).collect();
            Tensor::from_vec(v, &[3, 3])
        })
        .collect::<distgrad::Result<_>>()?;
    let inputs = [CheckInput::per_rank("x", x), CheckInput::per_rank("w", w)];

    let report = distgrad::gradcheck(
        world,
        &Options::default(),
        &inputs,
        async |comm, _tape, xs| {
            let (x, w) = (&xs[0], &xs[1]);
            let h = x.matmul(w)?.tanh()?; // [2, 3] per rank
            // Split the rows evenly among the ranks: every rank sends each rank a [2, 3] block scaled
            // by the destination, so all_to_all moves distinct values.
            let parts: Vec<_> = (0..comm.world_size())
                .map(|j| h.scale(1.0 + j as f32 * 0.5))
                .collect::<distgrad::Result<_>>()?;
            let got = dist::all_to_all(comm, &parts, &comm.world()).await?;
            let mixed = distgrad::Var::concat(&got, 0)?.relu()?; // [8, 3]
            let score = mixed.mul(&mixed)?.sum()?;
            // The score's maximum over the ranks lands on rank 2; only rank 2 has a loss.
            let best = dist::reduce(comm, &score, 2, ReduceOp::Max, &comm.world()).await?;
            Ok(best)
        },
    )?;
    print!("{}", report.render());
    if !report.passed {
        std::process::exit(1);
    }
    Ok(())
}
