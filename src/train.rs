//! `distgrad train`: data-parallel training of a small MLP on any [`Communicator`] (in-process
//! ranks, or NCCL on GPUs), with the gradients flowing through the collectives' duals.
//!
//! The program is written the JAX way ([`Objective::Replicated`]): the parameters are replicated
//! (invariant) leaves, each rank computes the loss of its own data shard, and the objective is
//! `all_reduce(AVG)` of those losses, counted once. Using a replicated parameter in per-rank math
//! makes it varying, whose dual is an all_reduce(SUM): so `backward` itself sums the ranks'
//! gradients — no hand-written gradient all_reduce — and every replica takes the same step. Each
//! step reports the group loss and a hash of the parameters, equal on every rank.
//!
//! Model: `y = tanh(x·W1 + b1)·W2 + b2` with 2 inputs and [`HIDDEN`] hidden units; data: `SHARD`
//! points per rank of `y = sin(2·x0) + 0.5·x1`, from a fixed generator (same on every target).

use crate::autograd::{Objective, Tape};
use crate::backend::Device;
use crate::collective::{Communicator, ReduceOp};
use crate::dist;
use crate::error::{Error, Result};
use crate::tensor::Tensor;

/// Hidden units.
pub const HIDDEN: usize = 16;

/// What to train.
#[derive(Debug, Clone)]
pub struct TrainConfig {
    /// Steps of gradient descent.
    pub steps: usize,
    /// Learning rate.
    pub lr: f32,
    /// Data points per rank.
    pub shard: usize,
}

impl Default for TrainConfig {
    fn default() -> Self {
        TrainConfig {
            steps: 200,
            lr: 0.2,
            shard: 64,
        }
    }
}

/// One rank's record of a run.
#[derive(Debug, Clone, PartialEq)]
pub struct TrainReport {
    /// The group loss (mean over ranks) before each step.
    pub losses: Vec<f32>,
    /// Hash of the parameters after each step (bitwise: equal hashes = identical replicas).
    pub hashes: Vec<String>,
    /// Final parameters, flattened (W1, b1, W2, b2).
    pub params: Vec<f32>,
}

/// Deterministic pseudo-random numbers in [-1, 1) (xorshift), the same on every target and rank.
pub fn uniform(seed: u64, n: usize) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

/// FNV-1a of the values' bits, as 8 hex digits.
pub fn param_hash(values: &[f32]) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for v in values {
        for b in v.to_bits().to_le_bytes() {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    }
    format!("{:08x}", h >> 32)
}

/// Rank `rank`'s data: `n` points `x` (n×2) and targets `y` (n×1).
pub fn shard(rank: usize, n: usize, device: &Device) -> Result<(Tensor, Tensor)> {
    let xs = uniform(1 + rank as u64, 2 * n);
    let ys: Vec<f32> = (0..n)
        .map(|i| (2.0 * xs[2 * i]).sin() + 0.5 * xs[2 * i + 1])
        .collect();
    Ok((
        Tensor::from_vec(xs, &[n, 2])?.to_device(device)?,
        Tensor::from_vec(ys, &[n, 1])?.to_device(device)?,
    ))
}

/// The initial parameters (values, shape): W1, b1, W2, b2; seeded, the same on every rank.
pub fn initial_params() -> Vec<(Vec<f32>, Vec<usize>)> {
    let scale = |v: Vec<f32>, k: f32| v.into_iter().map(|a| a * k).collect::<Vec<f32>>();
    vec![
        (scale(uniform(101, 2 * HIDDEN), 0.7), vec![2, HIDDEN]),
        (vec![0.0; HIDDEN], vec![HIDDEN]),
        (scale(uniform(202, HIDDEN), 0.25), vec![HIDDEN, 1]),
        (vec![0.0; 1], vec![1]),
    ]
}

/// Train on `comm`'s world with tensors on `device`; `progress` hears (step, group loss).
pub async fn train<C: Communicator>(
    comm: &C,
    cfg: &TrainConfig,
    device: &Device,
    mut progress: impl FnMut(usize, f32),
) -> Result<TrainReport> {
    if cfg.shard == 0 || cfg.steps == 0 {
        return Err(Error::Input(
            "train: steps and shard must be positive".into(),
        ));
    }
    let me = comm.rank();
    let group = comm.world();
    let (x, y) = shard(me, cfg.shard, device)?;
    let mut params = initial_params();
    let mut losses = Vec::with_capacity(cfg.steps);
    let mut hashes = Vec::with_capacity(cfg.steps);
    for step in 0..cfg.steps {
        let tape = Tape::with_objective(Objective::Replicated);
        let vars = params
            .iter()
            .map(|(v, s)| {
                Ok(tape.var_invariant(Tensor::from_vec(v.clone(), s)?.to_device(device)?, &group))
            })
            .collect::<Result<Vec<_>>>()?;
        let xv = tape.constant(x.clone());
        let yv = tape.constant(y.clone());
        let h = xv.matmul(&vars[0])?.add(&vars[1])?.tanh()?;
        let pred = h.matmul(&vars[2])?.add(&vars[3])?;
        let local = pred.mse_loss(&yv)?;
        let loss = dist::all_reduce(comm, &local, ReduceOp::Avg, &group).await?;
        let l = loss
            .value()
            .read()
            .await?
            .first()
            .copied()
            .unwrap_or(f32::NAN);
        if !l.is_finite() {
            return Err(Error::Input(format!(
                "train: the loss diverged at step {step} ({l})"
            )));
        }
        losses.push(l);
        progress(step, l);
        let grads = tape.backward(&loss, comm).await?;
        for ((v, _), var) in params.iter_mut().zip(&vars) {
            let g = grads.wrt(var)?.read().await?;
            for (p, gi) in v.iter_mut().zip(g) {
                *p -= cfg.lr * gi;
            }
        }
        let flat: Vec<f32> = params.iter().flat_map(|(v, _)| v.iter().copied()).collect();
        hashes.push(param_hash(&flat));
    }
    Ok(TrainReport {
        losses,
        hashes,
        params: params.into_iter().flat_map(|(v, _)| v).collect(),
    })
}
