//! Local differentiable ops on [`Var`]s: forward here, derivatives in `backward.rs`. Composite ops
//! (`mse_loss`, `square`) are built from primitives and have no backward of their own.

use super::{Collective, Local, Objective, Op, Var};
use crate::backend::UnaryOp;
use crate::collective::Group;
use crate::error::{Error, Result};
use crate::tensor::Tensor;

impl Var {
    /// Replicated mode: make the inputs of a local op agree. If all are invariant across the same group
    /// the result is invariant too; otherwise invariant inputs are made varying (`pvary`, whose dual is
    /// an all_reduce) and the result is varying.
    fn unify(op: &'static str, inputs: &[&Var]) -> Result<(Vec<Var>, Option<Group>)> {
        let tape = inputs[0].tape.clone();
        for v in inputs {
            tape.check(op, v)?;
        }
        if tape.objective() == Objective::SumOfRankLosses {
            return Ok((inputs.iter().map(|v| (*v).clone()).collect(), None));
        }
        let groups: Vec<Option<Group>> = inputs.iter().map(|v| v.invariant()).collect();
        if let Some(Some(g)) = groups.first()
            && groups
                .iter()
                .all(|x| x.as_ref().map(Group::id) == Some(g.id()))
        {
            return Ok((
                inputs.iter().map(|v| (*v).clone()).collect(),
                Some(g.clone()),
            ));
        }
        let vars = inputs
            .iter()
            .zip(groups)
            .map(|(v, g)| match g {
                Some(g) => v.make_varying(&g),
                None => (*v).clone(),
            })
            .collect();
        Ok((vars, None))
    }

    /// Replicated mode: this invariant value, used as a per-rank (varying) value. Forward: identity.
    /// Backward: all_reduce(SUM) of the cotangent over `group`. A no-op for values without gradient.
    pub fn make_varying(&self, group: &Group) -> Var {
        if !self.requires_grad() {
            return self.tape.push_var(self.value(), false, None);
        }
        self.tape
            .record(
                Op::Collective(Collective::PVary {
                    group: group.clone(),
                }),
                &[self],
                vec![self.value()],
                None,
            )
            .remove(0)
    }

    fn binary(
        &self,
        op: Op,
        name: &'static str,
        rhs: &Var,
        f: impl Fn(&Tensor, &Tensor) -> Result<Tensor>,
    ) -> Result<Var> {
        let (vs, inv) = Self::unify(name, &[self, rhs])?;
        let out = f(&vs[0].value(), &vs[1].value())?;
        Ok(self
            .tape
            .record(op, &[&vs[0], &vs[1]], vec![out], inv)
            .remove(0))
    }

    fn unary(&self, op: Op, f: impl Fn(&Tensor) -> Result<Tensor>) -> Result<Var> {
        let out = f(&self.value())?;
        Ok(self
            .tape
            .record(op, &[self], vec![out], self.invariant())
            .remove(0))
    }

    /// `self + rhs` (broadcasting).
    pub fn add(&self, rhs: &Var) -> Result<Var> {
        self.binary(Op::Local(Local::Add), "add", rhs, Tensor::add)
    }

    /// `self - rhs` (broadcasting).
    pub fn sub(&self, rhs: &Var) -> Result<Var> {
        self.binary(Op::Local(Local::Sub), "sub", rhs, Tensor::sub)
    }

    /// `self * rhs` elementwise (broadcasting).
    pub fn mul(&self, rhs: &Var) -> Result<Var> {
        self.binary(Op::Local(Local::Mul), "mul", rhs, Tensor::mul)
    }

    /// Matrix product `[m,k] x [k,n]`.
    pub fn matmul(&self, rhs: &Var) -> Result<Var> {
        self.binary(Op::Local(Local::MatMul), "matmul", rhs, Tensor::matmul)
    }

    /// `c * self`.
    pub fn scale(&self, c: f32) -> Result<Var> {
        self.unary(Op::Local(Local::Scale(c)), |t| t.scale(c))
    }

    /// Sum of all elements (0-D).
    pub fn sum(&self) -> Result<Var> {
        self.unary(Op::Local(Local::Sum), Tensor::sum_all)
    }

    /// Mean of all elements (0-D). The mean of an empty tensor is NaN, as in NumPy.
    pub fn mean(&self) -> Result<Var> {
        self.unary(Op::Local(Local::Mean), |t| {
            t.sum_all()?.scale(1.0 / t.numel() as f32)
        })
    }

    /// `max(x, 0)`.
    pub fn relu(&self) -> Result<Var> {
        self.unary(Op::Local(Local::Relu), |t| t.unary(UnaryOp::Relu))
    }

    /// `tanh(x)`.
    pub fn tanh(&self) -> Result<Var> {
        self.unary(Op::Local(Local::Tanh), |t| t.unary(UnaryOp::Tanh))
    }

    /// Same values, new shape.
    pub fn reshape(&self, shape: &[usize]) -> Result<Var> {
        self.unary(Op::Local(Local::Reshape), |t| t.reshape(shape))
    }

    /// Elements `start..start+len` along `dim`.
    pub fn slice(&self, dim: usize, start: usize, len: usize) -> Result<Var> {
        self.unary(Op::Local(Local::Slice { dim, start }), |t| {
            t.slice(dim, start, len)
        })
    }

    /// Concatenate along `dim`.
    pub fn concat(parts: &[Var], dim: usize) -> Result<Var> {
        let first = parts
            .first()
            .ok_or_else(|| Error::invalid("concat", "need at least one var"))?;
        let refs: Vec<&Var> = parts.iter().collect();
        let (vs, inv) = Self::unify("concat", &refs)?;
        let out = Tensor::concat(&vs.iter().map(Var::value).collect::<Vec<_>>(), dim)?;
        let refs: Vec<&Var> = vs.iter().collect();
        Ok(first
            .tape
            .record(Op::Local(Local::Concat { dim }), &refs, vec![out], inv)
            .remove(0))
    }

    /// The same values on `device` (CPU ↔ GPU). Differentiable: the gradient goes back to this
    /// var's device.
    pub fn to_device(&self, device: &crate::backend::Device) -> Result<Var> {
        let from = self.value().device();
        self.unary(Op::Local(Local::ToDevice(from)), |t| t.to_device(device))
    }

    /// `self * self` (composite).
    pub fn square(&self) -> Result<Var> {
        self.mul(self)
    }

    /// Mean squared error `mean((self - target)^2)` (composite).
    pub fn mse_loss(&self, target: &Var) -> Result<Var> {
        if self.shape() != target.shape() {
            return Err(Error::shape(
                "mse_loss",
                &self.shape(),
                &target.shape(),
                "prediction and target must match",
            ));
        }
        self.sub(target)?.square()?.mean()
    }
}
