//! [`Tensor`]: an immutable f32 array of any shape, row-major, on one backend.
//!
//! Tensors are values: every op returns a new tensor (out-of-place, which is what autograd needs) and
//! clones are cheap because storage is shared. Shapes are checked here, once, before any backend runs.

use std::sync::Arc;

use bytes::Bytes;

use crate::backend::{BinaryOp, Device, Storage, UnaryOp, cpu};
use crate::error::{Error, Result};

/// An f32 tensor: a shape and a shared, contiguous, row-major storage.
#[derive(Debug, Clone)]
pub struct Tensor {
    shape: Vec<usize>,
    storage: Storage,
}

impl PartialEq for Tensor {
    /// Same shape and bitwise-equal values (NaN == NaN with the same bits).
    fn eq(&self, other: &Self) -> bool {
        self.shape == other.shape
            && self
                .to_vec()
                .iter()
                .zip(other.to_vec().iter())
                .all(|(a, b)| a.to_bits() == b.to_bits())
    }
}

impl Tensor {
    /// A tensor from row-major data; fails if `data.len()` is not the product of `shape`.
    pub fn from_vec(data: Vec<f32>, shape: &[usize]) -> Result<Self> {
        let expected = checked_numel(shape).ok_or_else(|| {
            Error::shape("Tensor::from_vec", shape, &[], "element count overflows")
        })?;
        if data.len() != expected {
            return Err(Error::DataLength {
                op: "Tensor::from_vec",
                shape: shape.to_vec(),
                expected,
                got: data.len(),
            });
        }
        Ok(Self::from_cpu(shape.to_vec(), data))
    }

    /// A 1-D tensor from a slice.
    pub fn vector(data: &[f32]) -> Self {
        Self::from_cpu(vec![data.len()], data.to_vec())
    }

    /// A 0-D tensor (shape `[]`) holding one number.
    pub fn scalar(x: f32) -> Self {
        Self::from_cpu(Vec::new(), vec![x])
    }

    /// A tensor of `shape` filled with `value`.
    pub fn full(shape: &[usize], value: f32) -> Self {
        let n = shape.iter().product();
        Self::from_cpu(shape.to_vec(), vec![value; n])
    }

    /// Zeros of `shape`.
    pub fn zeros(shape: &[usize]) -> Self {
        Self::full(shape, 0.0)
    }

    /// Ones of `shape`.
    pub fn ones(shape: &[usize]) -> Self {
        Self::full(shape, 1.0)
    }

    pub(crate) fn from_cpu(shape: Vec<usize>, data: Vec<f32>) -> Self {
        debug_assert_eq!(shape.iter().product::<usize>(), data.len());
        Tensor {
            shape,
            storage: Storage::Cpu(Arc::new(data)),
        }
    }

    /// A tensor of the same shape and device filled with `value`.
    pub fn full_like(&self, value: f32) -> Self {
        Self::full(&self.shape, value)
    }

    /// Zeros of the same shape and device.
    pub fn zeros_like(&self) -> Self {
        self.full_like(0.0)
    }

    /// The shape.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// The backend holding the numbers.
    pub fn device(&self) -> Device {
        self.storage.device()
    }

    /// The storage (shared).
    pub fn storage(&self) -> &Storage {
        &self.storage
    }

    /// The values, row-major, copied to host memory.
    pub fn to_vec(&self) -> Vec<f32> {
        match &self.storage {
            Storage::Cpu(v) => v.as_ref().clone(),
        }
    }

    /// The single value of a one-element tensor.
    pub fn item(&self) -> Result<f32> {
        if self.numel() != 1 {
            return Err(Error::shape(
                "item",
                &self.shape,
                &[],
                "tensor must have exactly one element",
            ));
        }
        Ok(self.to_vec()[0])
    }

    /// Borrow host values (CPU storage only). Used by the CPU paths of the collectives.
    pub(crate) fn cpu(&self) -> &[f32] {
        match &self.storage {
            Storage::Cpu(v) => v,
        }
    }

    /// The values as little-endian f32 bytes. On the CPU backend this shares the storage (no copy).
    pub fn to_le_bytes(&self) -> Bytes {
        match &self.storage {
            Storage::Cpu(v) if cfg!(target_endian = "little") => {
                Bytes::from_owner(LeF32(v.clone()))
            }
            Storage::Cpu(v) => v
                .iter()
                .flat_map(|x| x.to_le_bytes())
                .collect::<Vec<u8>>()
                .into(),
        }
    }

    /// A tensor of `shape` from little-endian f32 bytes.
    pub fn from_le_bytes(bytes: &[u8], shape: &[usize]) -> Result<Self> {
        let n = checked_numel(shape).ok_or_else(|| {
            Error::shape(
                "Tensor::from_le_bytes",
                shape,
                &[],
                "element count overflows",
            )
        })?;
        if bytes.len() != n * 4 {
            return Err(Error::DataLength {
                op: "Tensor::from_le_bytes",
                shape: shape.to_vec(),
                expected: n,
                got: bytes.len() / 4,
            });
        }
        Ok(Self::from_cpu(
            shape.to_vec(),
            cpu::f32s_from_le_bytes(bytes),
        ))
    }

    fn same_device(&self, op: &'static str, other: &Tensor) -> Result<()> {
        if self.device() != other.device() {
            return Err(Error::BackendMismatch {
                op,
                lhs: self.device().name(),
                rhs: other.device().name(),
            });
        }
        Ok(())
    }

    /// Elementwise binary op with NumPy broadcasting.
    pub fn binary(&self, op: BinaryOp, rhs: &Tensor) -> Result<Tensor> {
        let name = binary_name(op);
        self.same_device(name, rhs)?;
        let out_shape = broadcast_shape(name, &self.shape, &rhs.shape)?;
        let data = cpu::binary_broadcast(
            op,
            self.cpu(),
            &self.shape,
            rhs.cpu(),
            &rhs.shape,
            &out_shape,
        );
        Ok(Self::from_cpu(out_shape, data))
    }

    /// `self + rhs` (broadcasting).
    pub fn add(&self, rhs: &Tensor) -> Result<Tensor> {
        self.binary(BinaryOp::Add, rhs)
    }
    /// `self - rhs` (broadcasting).
    pub fn sub(&self, rhs: &Tensor) -> Result<Tensor> {
        self.binary(BinaryOp::Sub, rhs)
    }
    /// `self * rhs` (broadcasting).
    pub fn mul(&self, rhs: &Tensor) -> Result<Tensor> {
        self.binary(BinaryOp::Mul, rhs)
    }
    /// `self / rhs` (broadcasting).
    pub fn div(&self, rhs: &Tensor) -> Result<Tensor> {
        self.binary(BinaryOp::Div, rhs)
    }

    /// Elementwise unary op.
    pub fn unary(&self, op: UnaryOp) -> Tensor {
        Self::from_cpu(self.shape.clone(), cpu::unary(op, self.cpu()))
    }

    /// `c * self`.
    pub fn scale(&self, c: f32) -> Tensor {
        self.unary(UnaryOp::Scale(c))
    }

    /// Sum over all elements; a 0-D tensor.
    pub fn sum_all(&self) -> Tensor {
        Tensor::scalar(cpu::sum_all(self.cpu()))
    }

    /// Sum down to `target`, a shape this one broadcasts from (the backward of broadcasting).
    pub fn sum_to(&self, target: &[usize]) -> Result<Tensor> {
        let b = broadcast_shape("sum_to", target, &self.shape)?;
        if b != self.shape {
            return Err(Error::shape(
                "sum_to",
                &self.shape,
                target,
                "target does not broadcast to this shape",
            ));
        }
        Ok(Self::from_cpu(
            target.to_vec(),
            cpu::sum_to(self.cpu(), &self.shape, target),
        ))
    }

    /// Matrix product of `[m,k]` and `[k,n]`.
    pub fn matmul(&self, rhs: &Tensor) -> Result<Tensor> {
        self.same_device("matmul", rhs)?;
        match (self.shape.as_slice(), rhs.shape.as_slice()) {
            (&[m, k], &[k2, n]) if k == k2 => Ok(Self::from_cpu(
                vec![m, n],
                cpu::matmul(self.cpu(), rhs.cpu(), m, k, n),
            )),
            _ => Err(Error::shape(
                "matmul",
                &self.shape,
                &rhs.shape,
                "need [m,k] x [k,n]",
            )),
        }
    }

    /// Transpose of a 2-D tensor.
    pub fn t(&self) -> Result<Tensor> {
        match self.shape.as_slice() {
            &[m, n] => Ok(Self::from_cpu(vec![n, m], cpu::transpose(self.cpu(), m, n))),
            _ => Err(Error::shape(
                "transpose",
                &self.shape,
                &[],
                "need a 2-D tensor",
            )),
        }
    }

    /// Same data, new shape (shares storage).
    pub fn reshape(&self, shape: &[usize]) -> Result<Tensor> {
        if shape.iter().product::<usize>() != self.numel() {
            return Err(Error::shape(
                "reshape",
                &self.shape,
                shape,
                "element counts differ",
            ));
        }
        Ok(Tensor {
            shape: shape.to_vec(),
            storage: self.storage.clone(),
        })
    }

    /// Elements `start..start+len` along `dim`.
    pub fn slice(&self, dim: usize, start: usize, len: usize) -> Result<Tensor> {
        if dim >= self.shape.len()
            || start
                .checked_add(len)
                .is_none_or(|end| end > self.shape[dim])
        {
            return Err(Error::invalid(
                "slice",
                format!(
                    "dim {dim} range {start}..{} out of bounds for shape {:?}",
                    start + len,
                    self.shape
                ),
            ));
        }
        let mut shape = self.shape.clone();
        shape[dim] = len;
        Ok(Self::from_cpu(
            shape,
            cpu::slice(self.cpu(), &self.shape, dim, start, len),
        ))
    }

    /// Concatenate along `dim`; all other dims must agree.
    pub fn concat(parts: &[Tensor], dim: usize) -> Result<Tensor> {
        let first = parts
            .first()
            .ok_or_else(|| Error::invalid("concat", "need at least one tensor"))?;
        if dim >= first.shape.len() {
            return Err(Error::invalid(
                "concat",
                format!("dim {dim} out of range for shape {:?}", first.shape),
            ));
        }
        for p in parts {
            first.same_device("concat", p)?;
            let ok = p.shape.len() == first.shape.len()
                && p.shape
                    .iter()
                    .zip(&first.shape)
                    .enumerate()
                    .all(|(d, (a, b))| d == dim || a == b);
            if !ok {
                return Err(Error::shape(
                    "concat",
                    &first.shape,
                    &p.shape,
                    format!("dims other than {dim} must agree"),
                ));
            }
        }
        let outer: usize = first.shape[..dim].iter().product();
        let inner: usize = first.shape[dim + 1..].iter().product();
        let data = cpu::concat(
            &parts
                .iter()
                .map(|p| (p.cpu(), p.shape[dim]))
                .collect::<Vec<_>>(),
            outer,
            inner,
        );
        let mut shape = first.shape.clone();
        shape[dim] = parts.iter().map(|p| p.shape[dim]).sum();
        Ok(Self::from_cpu(shape, data))
    }

    /// For equal-shape tensors `x_0..x_{n-1}` return `prod_{k != j} x_k` for each `j`, exact with zeros.
    pub fn product_of_others(xs: &[Tensor]) -> Result<Vec<Tensor>> {
        let Some(first) = xs.first() else {
            return Ok(Vec::new());
        };
        for x in xs {
            if x.shape != first.shape {
                return Err(Error::shape(
                    "product_of_others",
                    &first.shape,
                    &x.shape,
                    "equal shapes needed",
                ));
            }
        }
        let slices: Vec<&[f32]> = xs.iter().map(|x| x.cpu()).collect();
        Ok(cpu::product_of_others(&slices)
            .into_iter()
            .map(|d| Self::from_cpu(first.shape.clone(), d))
            .collect())
    }
}

/// Little-endian bytes of `v` without copying (on little-endian targets).
pub(crate) fn f32_bytes(v: Vec<f32>) -> Bytes {
    Tensor::from_cpu(vec![v.len()], v).to_le_bytes()
}

/// Zero-copy owner that exposes an `Arc<Vec<f32>>` as little-endian bytes.
struct LeF32(Arc<Vec<f32>>);

impl AsRef<[u8]> for LeF32 {
    fn as_ref(&self) -> &[u8] {
        bytemuck::cast_slice(self.0.as_slice())
    }
}

fn binary_name(op: BinaryOp) -> &'static str {
    match op {
        BinaryOp::Add => "add",
        BinaryOp::Sub => "sub",
        BinaryOp::Mul => "mul",
        BinaryOp::Div => "div",
        BinaryOp::Max => "max",
        BinaryOp::Min => "min",
        BinaryOp::Eq => "eq",
    }
}

/// Product of the dims, `None` on overflow. Zero dims count as 1 so that no partial product of
/// the shape (strides, inner sizes) can overflow either.
pub(crate) fn checked_numel(shape: &[usize]) -> Option<usize> {
    shape
        .iter()
        .try_fold(1usize, |a, &d| a.checked_mul(d.max(1)))?;
    Some(shape.iter().product())
}

/// NumPy broadcast of two shapes.
pub fn broadcast_shape(op: &'static str, a: &[usize], b: &[usize]) -> Result<Vec<usize>> {
    let n = a.len().max(b.len());
    let mut out = vec![0; n];
    for i in 0..n {
        let da = if i + a.len() >= n {
            a[i + a.len() - n]
        } else {
            1
        };
        let db = if i + b.len() >= n {
            b[i + b.len() - n]
        } else {
            1
        };
        out[i] = match (da, db) {
            (x, y) if x == y => x,
            (1, y) => y,
            (x, 1) => x,
            _ => return Err(Error::shape(op, a, b, "shapes do not broadcast")),
        };
    }
    Ok(out)
}
