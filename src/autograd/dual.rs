//! THE DUAL TABLE: for every collective, the collective its backward pass runs.
//!
//! One exhaustive `match` over [`Spec`] in `dual`, no `_ =>` arm, so a new collective does not
//! compile until its dual is written here. Conventions (see [`super::Objective`]): by default the global objective is
//! the sum over ranks of each rank's loss, so "everyone's cotangents summed" is an
//! `all_reduce(SUM, g)`; in replicated mode an all_reduce output is invariant, its cotangent already
//! is that sum, and the all_reduce in the dual disappears.
//!
//! | forward | backward |
//! |---|---|
//! | broadcast(root) | reduce(root, SUM); non-root inputs get zero |
//! | reduce(root, SUM / AVG) | broadcast(root) (then × 1/N for AVG) |
//! | reduce(root, MAX / MIN) | broadcast(root) of (g, y), mask = x == y, ties split (all_reduce of masks) |
//! | reduce(root, PROD) | broadcast(root) × product of the other ranks' inputs (all_gather; exact with zeros) |
//! | all_reduce(SUM / AVG) | all_reduce(SUM / AVG) (replicated: identity / × 1/N) |
//! | all_reduce(MAX / MIN) | mask × all_reduce(SUM, g) / ties |
//! | all_reduce(PROD) | all_reduce(SUM, g) × product of the other ranks' inputs |
//! | gather(root) / scatter(root) | scatter(root) / gather(root) |
//! | all_gather / reduce_scatter(SUM) | reduce_scatter(SUM) / all_gather |
//! | reduce_scatter(AVG / MAX / MIN / PROD) | all_gather, then the local factor as for all_reduce |
//! | all_to_all / all_to_all_single(in, out) | all_to_all / all_to_all_single(out, in) |
//! | send(to) / recv(from) | recv(from = to) / send(to = from) |
//! | permute(pairs) | permute(inverse pairs) |
//! | barrier | nothing |
//! | pvary (replicated mode: invariant made varying) | all_reduce(SUM) |
//!
//! Max/Min ties: the gradient is split equally among the ranks holding the extreme. NaN inputs: no
//! rank "holds" a NaN extreme (NaN ≠ NaN), so those elements get zero gradient.

use crate::backend::BinaryOp;
use crate::collective::{Communicator, Group, ReduceOp, Spec};
use crate::error::{Error, Result};
use crate::tensor::Tensor;

pub use super::wrong::DualRule;

/// A collective as the tape records it: the call's description ([`Spec`], the one place its
/// arguments live) and its group, or the replicated mode's conversion of an invariant value.
#[derive(Debug, Clone)]
pub enum Collective {
    /// A collective call.
    Call {
        /// What ran (this rank's view; roots and peers are group ranks).
        spec: Spec,
        /// Among which ranks.
        group: Group,
        /// all_reduce under the replicated objective: the output was marked invariant.
        replicated: bool,
        /// Which backward runs: distgrad's dual unless a lesson asked for a wrong one.
        rule: DualRule,
    },
    /// Replicated mode: an invariant value used as a per-rank value.
    PVary {
        /// The group it is invariant over.
        group: Group,
    },
}

/// Run the dual of `c`: from the forward inputs `xs`, outputs `ys` and output cotangents `gs` (zeros
/// where none arrived), return the input cotangents, one per input.
pub(crate) async fn dual<C: Communicator>(
    c: &Collective,
    comm: &C,
    xs: &[Tensor],
    ys: &[Tensor],
    gs: &[Tensor],
) -> Result<Vec<Tensor>> {
    if let Collective::Call {
        spec,
        group,
        replicated,
        rule,
    } = c
        && *rule != DualRule::Distgrad
    {
        let called = super::wrong::Called {
            spec,
            group,
            replicated: *replicated,
        };
        if let Some(gx) = super::wrong::dual(*rule, called, comm, xs, ys, gs).await? {
            return Ok(gx);
        }
    }
    table(c, comm, xs, ys, gs).await
}

/// The dual table itself (the module docs), for distgrad's rule.
async fn table<C: Communicator>(
    c: &Collective,
    comm: &C,
    xs: &[Tensor],
    ys: &[Tensor],
    gs: &[Tensor],
) -> Result<Vec<Tensor>> {
    let (spec, group, replicated) = match c {
        Collective::Call {
            spec,
            group,
            replicated,
            ..
        } => (spec, group, *replicated),
        Collective::PVary { group } => {
            return Ok(vec![comm.all_reduce(&gs[0], ReduceOp::Sum, group).await?]);
        }
    };
    Ok(match spec {
        Spec::Broadcast { root } => {
            let s = comm.reduce(&gs[0], *root, ReduceOp::Sum, group).await?;
            vec![match s {
                Some(s) => s,
                None => xs[0].zeros_like()?,
            }]
        }
        Spec::Reduce { root, op } => {
            let x = &xs[0];
            let g = match gs.first() {
                Some(g) => g.clone(),
                None => x.zeros_like()?,
            };
            let n = group.size() as f32;
            match op {
                ReduceOp::Sum => vec![comm.broadcast(&g, *root, group).await?],
                ReduceOp::Avg => vec![comm.broadcast(&g, *root, group).await?.scale(1.0 / n)?],
                ReduceOp::Max | ReduceOp::Min => {
                    let y = match ys.first() {
                        Some(y) => y.clone(),
                        None => x.zeros_like()?,
                    };
                    let gy = comm.broadcast(&stack(&[&g, &y])?, *root, group).await?;
                    let [g, y] = unstack(&gy, x.shape())?;
                    let mask = x.binary(BinaryOp::Eq, &y)?;
                    let ties = comm.all_reduce(&mask, ReduceOp::Sum, group).await?;
                    vec![split_ties(&g, &mask, &ties)?]
                }
                ReduceOp::Prod => {
                    let g = comm.broadcast(&g, *root, group).await?;
                    vec![g.mul(&others_product(comm, x, group).await?)?]
                }
            }
        }
        Spec::AllReduce { op } => {
            let (x, y, g) = (&xs[0], &ys[0], &gs[0]);
            let n = group.size() as f32;
            // Sum over ranks of the cotangents: already done when the output is invariant.
            let summed = async |g: &Tensor| {
                if replicated {
                    Ok(g.clone())
                } else {
                    comm.all_reduce(g, ReduceOp::Sum, group).await
                }
            };
            match op {
                ReduceOp::Sum => vec![summed(g).await?],
                ReduceOp::Avg if replicated => vec![g.scale(1.0 / n)?],
                ReduceOp::Avg => vec![comm.all_reduce(g, ReduceOp::Avg, group).await?],
                ReduceOp::Max | ReduceOp::Min => {
                    let mask = x.binary(BinaryOp::Eq, y)?;
                    let (s, ties) = if replicated {
                        (
                            g.clone(),
                            comm.all_reduce(&mask, ReduceOp::Sum, group).await?,
                        )
                    } else {
                        // One all_reduce carries both the cotangents and the tie counts.
                        let both = comm
                            .all_reduce(&stack(&[g, &mask])?, ReduceOp::Sum, group)
                            .await?;
                        let [s, t] = unstack(&both, x.shape())?;
                        (s, t)
                    };
                    vec![split_ties(&s, &mask, &ties)?]
                }
                ReduceOp::Prod => {
                    let s = summed(g).await?;
                    vec![s.mul(&others_product(comm, x, group).await?)?]
                }
            }
        }
        Spec::Gather { root } => {
            let list = (!gs.is_empty()).then_some(gs);
            // Non-roots pass no list: bring the gradient to the input's device explicitly.
            vec![
                comm.scatter(list, *root, group)
                    .await?
                    .to_device(&xs[0].device())?,
            ]
        }
        Spec::Scatter { root } => comm.gather(&gs[0], *root, group).await?.unwrap_or_default(),
        Spec::AllGather {} => {
            vec![comm.reduce_scatter(gs, ReduceOp::Sum, group).await?]
        }
        Spec::ReduceScatter { op } => {
            let (g, y) = (&gs[0], &ys[0]);
            let n = group.size() as f32;
            match op {
                ReduceOp::Sum => comm.all_gather(g, group).await?,
                ReduceOp::Avg => comm
                    .all_gather(g, group)
                    .await?
                    .iter()
                    .map(|t| t.scale(1.0 / n))
                    .collect::<Result<_>>()?,
                ReduceOp::Max | ReduceOp::Min => {
                    let gys = comm.all_gather(&stack(&[g, y])?, group).await?;
                    let mut parts = Vec::with_capacity(xs.len());
                    let mut masks = Vec::with_capacity(xs.len());
                    for (x, gy) in xs.iter().zip(&gys) {
                        let [gi, yi] = unstack(gy, x.shape())?;
                        let m = x.binary(BinaryOp::Eq, &yi)?;
                        parts.push(gi);
                        masks.push(m);
                    }
                    let ties = comm
                        .all_reduce(
                            &stack(&masks.iter().collect::<Vec<_>>())?,
                            ReduceOp::Sum,
                            group,
                        )
                        .await?;
                    let ties = unstack_n(&ties, xs[0].shape(), xs.len())?;
                    parts
                        .iter()
                        .zip(&masks)
                        .zip(&ties)
                        .map(|((gi, m), t)| split_ties(gi, m, t))
                        .collect::<Result<_>>()?
                }
                ReduceOp::Prod => {
                    let gl = comm.all_gather(g, group).await?;
                    let me = group.require_member("reduce_scatter backward")?;
                    // Every rank's whole input list, so block i's other factors are known here.
                    let lists = comm
                        .all_gather(&stack(&xs.iter().collect::<Vec<_>>())?, group)
                        .await?;
                    let lists = lists
                        .iter()
                        .map(|l| unstack_n(l, xs[0].shape(), xs.len()))
                        .collect::<Result<Vec<_>>>()?;
                    let mut out = Vec::with_capacity(xs.len());
                    for (i, gi) in gl.iter().enumerate() {
                        let block: Vec<Tensor> = lists.iter().map(|l| l[i].clone()).collect();
                        out.push(gi.mul(&Tensor::product_of_others(&block)?[me])?);
                    }
                    out
                }
            }
        }
        Spec::AllToAll {} => comm.all_to_all(gs, group).await?,
        Spec::AllToAllSingle {
            in_splits,
            out_splits,
        } => {
            vec![
                comm.all_to_all_single(&gs[0], out_splits, in_splits, group)
                    .await?,
            ]
        }
        Spec::Send { dst } => {
            vec![
                comm.recv(xs[0].shape(), *dst, group)
                    .await?
                    .to_device(&xs[0].device())?,
            ]
        }
        Spec::Recv { src, .. } => {
            comm.send(&gs[0], *src, group).await?;
            vec![]
        }
        Spec::Permute { perm } => {
            let inverse: Vec<(usize, usize)> = perm.iter().map(|&(s, d)| (d, s)).collect();
            vec![comm.permute(&gs[0], &inverse, group).await?]
        }
        Spec::Barrier {} => vec![],
    })
}

/// `g * mask / max(ties, 1)`: the cotangent shared equally among the ranks holding the extreme.
fn split_ties(g: &Tensor, mask: &Tensor, ties: &Tensor) -> Result<Tensor> {
    let one = Tensor::scalar(1.0).to_device(&ties.device())?;
    g.mul(mask)?.div(&ties.binary(BinaryOp::Max, &one)?)
}

/// `prod_{k != me} x_k` over the group, exact with zeros (all_gather, then prefix/suffix products).
async fn others_product<C: Communicator>(comm: &C, x: &Tensor, group: &Group) -> Result<Tensor> {
    let all = comm.all_gather(x, group).await?;
    let me = group.require_member("product of others")?;
    Ok(Tensor::product_of_others(&all)?.swap_remove(me))
}

/// Flatten and concatenate equal-shape tensors (to send several in one collective).
fn stack(ts: &[&Tensor]) -> Result<Tensor> {
    let flat: Vec<Tensor> = ts
        .iter()
        .map(|t| t.reshape(&[t.numel()]))
        .collect::<Result<_>>()?;
    Tensor::concat(&flat, 0)
}

/// Inverse of [`stack`] for two tensors.
fn unstack(t: &Tensor, shape: &[usize]) -> Result<[Tensor; 2]> {
    let v = unstack_n(t, shape, 2)?;
    let [a, b]: [Tensor; 2] = v
        .try_into()
        .map_err(|_| Error::invalid("unstack", "internal: expected two parts"))?;
    Ok([a, b])
}

/// Inverse of [`stack`] for `k` tensors of `shape`.
fn unstack_n(t: &Tensor, shape: &[usize], k: usize) -> Result<Vec<Tensor>> {
    let n: usize = shape.iter().product();
    if t.numel() != n * k {
        return Err(Error::shape(
            "unstack",
            t.shape(),
            shape,
            format!("expected {k} parts"),
        ));
    }
    (0..k)
        .map(|i| t.slice(0, i * n, n)?.reshape(shape))
        .collect()
}
