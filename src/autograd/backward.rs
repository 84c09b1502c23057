//! The backward pass: one exhaustive match over [`Op`], collectives included (their duals live in
//! [`super::dual`]). Adding an op variant does not compile until its derivative exists here.

use super::dual::dual;
use super::{Grads, Local, Node, Op, Tape, Var};
use crate::backend::UnaryOp;
use crate::collective::Communicator;
use crate::error::{Error, Result};
use crate::tensor::Tensor;

impl Tape {
    /// Differentiate the scalar `loss` (seed 1.0) and return the gradients of every var. Collective
    /// duals communicate through `comm`, so every rank must call `backward` (same tape structure).
    pub async fn backward<C: Communicator>(&self, loss: &Var, comm: &C) -> Result<Grads> {
        if loss.value().numel() != 1 {
            return Err(Error::shape(
                "backward",
                &loss.shape(),
                &[],
                "loss must have one element; use backward_from with explicit cotangents",
            ));
        }
        let seed = loss.value().full_like(1.0)?;
        self.backward_from(&[(loss.clone(), seed)], comm).await
    }

    /// Differentiate with explicit cotangents `(output, d objective / d output)`.
    ///
    /// If anything fails, the communicator is aborted, so other ranks fail instead of waiting for
    /// this rank's part of the backward pass.
    pub async fn backward_from<C: Communicator>(
        &self,
        seeds: &[(Var, Tensor)],
        comm: &C,
    ) -> Result<Grads> {
        self.backward_observed(seeds, comm, &mut |_| {}).await
    }

    /// [`Tape::backward_from`], calling `done(k)` after the backward step of node `k` (the k-th
    /// recorded op, counted as [`Tape::len`] counts; nodes are visited last to first, and nodes no
    /// gradient reached are skipped, except collectives, whose duals always run). The teaching
    /// demo uses it to tell which collectives each step's backward ran.
    pub async fn backward_observed<C: Communicator>(
        &self,
        seeds: &[(Var, Tensor)],
        comm: &C,
        done: &mut dyn FnMut(usize),
    ) -> Result<Grads> {
        let r = self.backward_inner(seeds, comm, done).await;
        if let Err(e) = &r
            && !matches!(e, Error::Aborted { .. })
        {
            comm.abort(&e.to_string()).await;
        }
        r
    }

    async fn backward_inner<C: Communicator>(
        &self,
        seeds: &[(Var, Tensor)],
        comm: &C,
        done: &mut dyn FnMut(usize),
    ) -> Result<Grads> {
        let n_vars = self.0.borrow().vars.len();
        let mut grads: Vec<Option<Tensor>> = vec![None; n_vars];
        for (v, g) in seeds {
            self.check("backward", v)?;
            if g.shape() != v.shape().as_slice() {
                return Err(Error::shape(
                    "backward",
                    &v.shape(),
                    g.shape(),
                    "cotangent shape must equal the output's",
                ));
            }
            accumulate(&mut grads, v.id, g.clone())?;
        }
        let nodes: Vec<Node> = self.0.borrow().nodes.clone();
        for (k, node) in nodes.iter().enumerate().rev() {
            let is_collective = matches!(node.op, Op::Collective(_));
            if !is_collective && node.outputs.iter().all(|&o| grads[o].is_none()) {
                continue;
            }
            let xs: Vec<Tensor> = node.inputs.iter().map(|&i| self.value_of(i)).collect();
            let ys: Vec<Tensor> = node.outputs.iter().map(|&o| self.value_of(o)).collect();
            let gs: Vec<Tensor> = node
                .outputs
                .iter()
                .zip(&ys)
                .map(|(&o, y)| match grads[o].clone() {
                    Some(g) => Ok(g),
                    None => y.zeros_like(),
                })
                .collect::<Result<_>>()?;
            let gx = match &node.op {
                Op::Collective(c) => dual(c, comm, &xs, &ys, &gs).await?,
                // A device move's gradient moves back; reading a GPU tensor is asynchronous in a
                // browser, so this one local op is handled here.
                Op::Local(Local::ToDevice(from)) => vec![gs[0].moved_to(from).await?],
                Op::Local(op) => local_backward(op, &xs, &ys, &gs[0])?,
            };
            for (&i, g) in node.inputs.iter().zip(gx) {
                if self.0.borrow().vars[i].requires_grad {
                    accumulate(&mut grads, i, g)?;
                }
            }
            done(k);
        }
        Ok(Grads { grads })
    }
}

/// Gradient accumulation on fan-out.
fn accumulate(grads: &mut [Option<Tensor>], id: usize, g: Tensor) -> Result<()> {
    grads[id] = Some(match grads[id].take() {
        Some(prev) => prev.add(&g)?,
        None => g,
    });
    Ok(())
}

/// Derivatives of the local ops: input cotangents from the output cotangent `g`.
fn local_backward(op: &Local, xs: &[Tensor], ys: &[Tensor], g: &Tensor) -> Result<Vec<Tensor>> {
    Ok(match op {
        // Broadcasting in forward = summing over the broadcast dims in backward.
        Local::Add => vec![g.sum_to(xs[0].shape())?, g.sum_to(xs[1].shape())?],
        Local::Sub => vec![
            g.sum_to(xs[0].shape())?,
            g.scale(-1.0)?.sum_to(xs[1].shape())?,
        ],
        // d(ab)/da = b, d(ab)/db = a
        Local::Mul => vec![
            g.mul(&xs[1])?.sum_to(xs[0].shape())?,
            g.mul(&xs[0])?.sum_to(xs[1].shape())?,
        ],
        Local::Scale(c) => vec![g.scale(*c)?],
        // C = AB: dA = G Bᵀ, dB = Aᵀ G
        Local::MatMul => vec![g.matmul(&xs[1].t()?)?, xs[0].t()?.matmul(g)?],
        Local::Sum => vec![g.broadcast_scalar(xs[0].shape())?],
        Local::Mean => vec![xs[0].full_like(1.0 / xs[0].numel() as f32)?.mul(g)?],
        Local::Relu => vec![g.mul(&xs[0].unary(UnaryOp::Step)?)?],
        // d tanh(x)/dx = 1 - tanh(x)^2, from the saved output
        Local::Tanh => vec![g.mul(&ys[0].full_like(1.0)?.sub(&ys[0].unary(UnaryOp::Square)?)?)?],
        Local::Reshape => vec![g.reshape(xs[0].shape())?],
        Local::Slice { dim, start } => {
            // Put g back in place, zeros around it.
            let (dim, start) = (*dim, *start);
            let full = xs[0].shape();
            let len = g.shape()[dim];
            let mut parts = Vec::with_capacity(3);
            let with = |n: usize| {
                let mut s = full.to_vec();
                s[dim] = n;
                Tensor::zeros(&s).to_device(&g.device())
            };
            if start > 0 {
                parts.push(with(start)?);
            }
            parts.push(g.clone());
            if start + len < full[dim] {
                parts.push(with(full[dim] - start - len)?);
            }
            vec![Tensor::concat(&parts, dim)?]
        }
        Local::ToDevice(from) => vec![g.to_device(from)?],
        Local::Concat { dim } => {
            let mut start = 0;
            let mut out = Vec::with_capacity(xs.len());
            for x in xs {
                let len = x.shape()[*dim];
                out.push(g.slice(*dim, start, len)?);
                start += len;
            }
            out
        }
    })
}
