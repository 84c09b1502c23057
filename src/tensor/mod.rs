//! [`Tensor`]: an immutable f32 array of any shape, row-major, on one backend.
//!
//! Tensors are values: every op returns a new tensor (out-of-place, which is what autograd needs) and
//! clones are cheap because storage is shared. Shapes are checked here, once, before any backend runs.
//!
//! [`partial`]: the local step of reducing collectives (a partial reduction that stays where its
//! input lives), so that the algorithms use this API and never a backend's internals.

pub mod partial;

use bytes::Bytes;

#[cfg(feature = "wgpu")]
use crate::backend::gpu::{At, GpuBuf};
use crate::backend::{BinaryOp, Device, Storage, UnaryOp, cpu};
use crate::error::{Error, Result};
use crate::pool::f32_bytes;

/// The most elements of a GPU tensor whose values are only on the host for which
/// [`Tensor::unary`] computes on the host instead of uploading and dispatching a kernel.
pub const HOST_UNARY_MAX: usize = 1024;

/// An f32 tensor: a shape and a shared, contiguous, row-major storage.
///
/// A GPU tensor made from host values ([`Tensor::to_device`]: an upload, and so a collective's
/// result assembled on the host, as the direct and ring all_reduce and every gather's parts are)
/// keeps those host bytes beside its buffer (shared, not copied),
/// so that reading it or sending it again needs no readback: the readbacks of a collective's
/// input and of a dual's cotangent are what made the browser's WebGPU path slow. Tensors are
/// immutable, so the two copies cannot diverge. A tensor computed on the GPU has none. This costs
/// host memory equal to the tensor's size while it lives. The upload itself is made when a kernel,
/// copy or readback first uses the buffer ([`crate::backend::gpu::Gpu::upload_lazy`]): a gradient
/// that only goes on to a collective never goes to the device.
#[derive(Debug, Clone)]
pub struct Tensor {
    shape: Vec<usize>,
    storage: Storage,
    /// The host copy of a GPU tensor's values, when they were known on the host (see above).
    #[cfg(feature = "wgpu")]
    host: Option<Bytes>,
}

impl PartialEq for Tensor {
    /// Same device, same shape and bitwise-equal values (NaN == NaN with the same bits). GPU
    /// tensors are read back to compare.
    fn eq(&self, other: &Self) -> bool {
        self.device() == other.device()
            && self.shape == other.shape
            && match (self.try_to_vec(), other.try_to_vec()) {
                (Ok(a), Ok(b)) => a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()),
                _ => false,
            }
    }
}

/// Borrowed numbers of a tensor, per backend.
enum View<'a> {
    Cpu(&'a [f32]),
    #[cfg(feature = "wgpu")]
    Gpu(&'a GpuBuf),
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

    /// A tensor of `shape` filled with `value` (on the CPU).
    pub fn full(shape: &[usize], value: f32) -> Self {
        let n = shape.iter().product();
        Self::from_cpu(shape.to_vec(), vec![value; n])
    }

    /// Zeros of `shape` (on the CPU).
    pub fn zeros(shape: &[usize]) -> Self {
        Self::full(shape, 0.0)
    }

    /// Ones of `shape` (on the CPU).
    pub fn ones(shape: &[usize]) -> Self {
        Self::full(shape, 1.0)
    }

    pub(crate) fn from_cpu(shape: Vec<usize>, data: Vec<f32>) -> Self {
        debug_assert_eq!(shape.iter().product::<usize>(), data.len());
        Tensor {
            shape,
            storage: Storage::Cpu(f32_bytes(data)),
            #[cfg(feature = "wgpu")]
            host: None,
        }
    }

    #[cfg(feature = "wgpu")]
    pub(crate) fn from_gpu(shape: Vec<usize>, buf: GpuBuf) -> Self {
        Tensor {
            shape,
            storage: Storage::Gpu(buf),
            host: None,
        }
    }

    /// A GPU tensor uploaded from `host` (little-endian f32 bytes, 4-byte aligned) when first
    /// used there, keeping them as its host copy.
    #[cfg(feature = "wgpu")]
    fn uploaded(shape: Vec<usize>, g: &crate::backend::gpu::Gpu, host: Bytes) -> Result<Self> {
        Ok(Tensor {
            shape,
            storage: Storage::Gpu(g.upload_lazy(host.clone())?),
            host: Some(host),
        })
    }

    /// The host copy of a GPU tensor's values, if it has one (see [`Tensor`]); `None` on the CPU.
    #[cfg(feature = "wgpu")]
    fn host_copy(&self) -> Option<&Bytes> {
        match self.storage {
            Storage::Gpu(_) => self.host.as_ref(),
            Storage::Cpu(_) => None,
        }
    }

    /// The host copy of a GPU tensor whose buffer was never made on the device (a lazy upload
    /// nothing has used yet): its values are only in host memory, so an op that reads them once
    /// and makes a smaller result (a reduction) is cheaper there than an upload and a kernel.
    #[cfg(feature = "wgpu")]
    fn host_only(&self) -> Option<&[u8]> {
        match &self.storage {
            Storage::Gpu(b) if !b.is_on_device() => self.host.as_deref(),
            _ => None,
        }
    }

    /// `f` of this tensor's values, computed on the host when they are only there
    /// ([`Tensor::host_only`]), as a GPU tensor of `shape` on the same device keeping the result
    /// as its host copy; `None` when the values are on the device (run the kernel then).
    #[cfg(feature = "wgpu")]
    fn on_host(
        &self,
        g: &crate::backend::gpu::Gpu,
        shape: &[usize],
        f: impl FnOnce(&[f32]) -> Vec<f32>,
    ) -> Option<Result<Tensor>> {
        let h = self.host_only()?;
        let out = f(&cpu::f32s_of_le_bytes(h));
        Some(Self::uploaded(shape.to_vec(), g, f32_bytes(out)))
    }

    /// Whether this is a GPU tensor that keeps a host copy of its values (see [`Tensor`]): reading
    /// it or sending it needs no readback.
    pub fn has_host_copy(&self) -> bool {
        #[cfg(feature = "wgpu")]
        return self.host_copy().is_some();
        #[cfg(not(feature = "wgpu"))]
        false
    }

    /// The same tensor without a host copy (see [`Tensor`]): its host memory is released when no
    /// other clone holds it, and reads go to the device (tests check the device's numbers this
    /// way; a buffer about to be written in place must not carry one).
    pub fn without_host_copy(&self) -> Tensor {
        #[allow(unused_mut)]
        let mut t = self.clone();
        #[cfg(feature = "wgpu")]
        {
            t.host = None;
        }
        t
    }

    fn view(&self) -> View<'_> {
        match &self.storage {
            // Every CPU storage is 4-byte aligned little-endian f32 by construction (`from_cpu`,
            // `from_shared_le_bytes`), so this view cannot fail.
            Storage::Cpu(b) => View::Cpu(bytemuck::try_cast_slice(b).unwrap_or_default()),
            #[cfg(feature = "wgpu")]
            Storage::Gpu(b) => View::Gpu(b),
        }
    }

    /// A tensor of the same shape and device filled with `value`.
    pub fn full_like(&self, value: f32) -> Result<Self> {
        Self::full(&self.shape, value).to_device(&self.device())
    }

    /// Zeros of the same shape and device.
    pub fn zeros_like(&self) -> Result<Self> {
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

    /// The storage (shared). Never write into a GPU tensor's buffer through it: tensors are values,
    /// and one may keep a host copy of its numbers ([`Tensor::has_host_copy`]) that such a write
    /// would leave stale.
    pub fn storage(&self) -> &Storage {
        &self.storage
    }

    /// The values as little-endian f32 bytes when they are in host memory without a readback:
    /// a CPU tensor's storage, a GPU tensor's host copy (shared either way).
    fn host_bytes(&self) -> Option<Bytes> {
        match &self.storage {
            Storage::Cpu(b) => Some(b.clone()),
            #[cfg(feature = "wgpu")]
            Storage::Gpu(_) => self.host.clone(),
        }
    }

    /// This tensor on `device` (a copy across backends, a cheap clone otherwise). A GPU tensor
    /// made here keeps the host values it was uploaded from (see [`Tensor`]); a GPU tensor with a
    /// host copy moves to the CPU without a readback.
    pub fn to_device(&self, device: &Device) -> Result<Tensor> {
        if &self.device() == device {
            return Ok(self.clone());
        }
        match device {
            Device::Cpu => match self.host_bytes() {
                Some(b) => Self::from_shared_le_bytes(b, &self.shape),
                None => Ok(Self::from_cpu(self.shape.clone(), self.try_to_vec()?)),
            },
            #[cfg(feature = "wgpu")]
            Device::Gpu(g) => {
                let host = match self.host_bytes() {
                    Some(b) => b,
                    None => f32_bytes(self.try_to_vec()?),
                };
                Self::uploaded(self.shape.clone(), g, host)
            }
        }
    }

    /// This tensor on `device`, reading a GPU tensor back asynchronously: works in a browser, where
    /// [`Tensor::to_device`] cannot leave the GPU.
    pub async fn moved_to(&self, device: &Device) -> Result<Tensor> {
        if &self.device() == device || self.host_bytes().is_some() {
            return self.to_device(device);
        }
        let host = Self::from_cpu(self.shape.clone(), self.read().await?);
        host.to_device(device)
    }

    /// The values, row-major, in host memory; works on every backend and target (a GPU tensor is
    /// read back asynchronously, as a browser requires, unless it has a host copy).
    pub async fn read(&self) -> Result<Vec<f32>> {
        match (self.view(), self.host_bytes()) {
            (View::Cpu(v), _) => Ok(v.to_vec()),
            #[cfg(feature = "wgpu")]
            (View::Gpu(_), Some(b)) => Ok(cpu::f32s_from_le_bytes(&b)),
            #[cfg(feature = "wgpu")]
            (View::Gpu(b), None) => b.gpu().read(b).await,
        }
    }

    /// The values, row-major, in host memory. A GPU tensor without a host copy is read back by
    /// blocking on the device, which a browser cannot do: there use [`Tensor::read`].
    pub fn try_to_vec(&self) -> Result<Vec<f32>> {
        match (self.view(), self.host_bytes()) {
            (View::Cpu(v), _) => Ok(v.to_vec()),
            #[cfg(feature = "wgpu")]
            (View::Gpu(_), Some(b)) => Ok(cpu::f32s_from_le_bytes(&b)),
            #[cfg(all(feature = "wgpu", not(target_arch = "wasm32")))]
            (View::Gpu(b), None) => b.gpu().read_blocking(b),
            #[cfg(all(feature = "wgpu", target_arch = "wasm32"))]
            (View::Gpu(_), None) => Err(Error::Gpu {
                op: "read",
                detail: "a browser cannot block on the GPU: use Tensor::read().await".into(),
            }),
        }
    }

    /// The values, row-major, in host memory.
    ///
    /// # Panics
    /// If a GPU tensor cannot be read back (device lost, or called in a browser): use
    /// [`Tensor::try_to_vec`] or [`Tensor::read`] to handle that as an error.
    pub fn to_vec(&self) -> Vec<f32> {
        match self.try_to_vec() {
            Ok(v) => v,
            Err(e) => panic!("Tensor::to_vec: {e}"),
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
        Ok(self.try_to_vec()?[0])
    }

    /// Host values of a CPU tensor (the collectives' CPU paths; GPU inputs are brought to the host
    /// at the transport boundary before they get here).
    pub(crate) fn cpu(&self) -> Result<&[f32]> {
        match self.view() {
            View::Cpu(v) => Ok(v),
            #[cfg(feature = "wgpu")]
            View::Gpu(_) => Err(Error::Gpu {
                op: "host access",
                detail: "a GPU tensor reached a CPU-only path (bring it to the host first)".into(),
            }),
        }
    }

    /// The values as little-endian f32 bytes. On the CPU backend this shares the storage (no
    /// copy), as does a GPU tensor's host copy; other GPU tensors are read back (the transport
    /// boundary).
    pub fn to_le_bytes(&self) -> Result<Bytes> {
        match self.host_bytes() {
            Some(b) => Ok(b),
            None => Ok(f32_bytes(self.try_to_vec()?)),
        }
    }

    /// A tensor of `shape` from little-endian f32 bytes (on the CPU).
    pub fn from_le_bytes(bytes: &[u8], shape: &[usize]) -> Result<Self> {
        check_byte_len("Tensor::from_le_bytes", bytes.len(), shape)?;
        Ok(Self::from_cpu(
            shape.to_vec(),
            cpu::f32s_from_le_bytes(bytes),
        ))
    }

    /// A CPU tensor of `shape` over little-endian f32 `bytes`, sharing them when they are 4-byte
    /// aligned (a message from an in-process peer: no copy), copying otherwise.
    pub fn from_shared_le_bytes(bytes: Bytes, shape: &[usize]) -> Result<Self> {
        check_byte_len("Tensor::from_shared_le_bytes", bytes.len(), shape)?;
        if bytemuck::try_cast_slice::<u8, f32>(&bytes).is_err() {
            return Ok(Self::from_cpu(
                shape.to_vec(),
                cpu::f32s_from_le_bytes(&bytes),
            ));
        }
        Ok(Tensor {
            shape: shape.to_vec(),
            storage: Storage::Cpu(bytes),
            #[cfg(feature = "wgpu")]
            host: None,
        })
    }

    fn mismatch(&self, op: &'static str, other: &Tensor) -> Error {
        Error::BackendMismatch {
            op,
            lhs: self.device().name(),
            rhs: other.device().name(),
        }
    }

    /// Elementwise binary op with NumPy broadcasting.
    pub fn binary(&self, op: BinaryOp, rhs: &Tensor) -> Result<Tensor> {
        let name = binary_name(op);
        let out_shape = broadcast_shape(name, &self.shape, &rhs.shape)?;
        match (self.view(), rhs.view()) {
            (View::Cpu(a), View::Cpu(b)) => Ok(Self::from_cpu(
                out_shape.clone(),
                cpu::binary_broadcast(op, a, &self.shape, b, &rhs.shape, &out_shape),
            )),
            #[cfg(feature = "wgpu")]
            (View::Gpu(a), View::Gpu(b)) => {
                let n: usize = out_shape.iter().product();
                let strides = (self.shape != out_shape || rhs.shape != out_shape).then(|| {
                    (
                        cpu::broadcast_strides(&self.shape, &out_shape),
                        cpu::broadcast_strides(&rhs.shape, &out_shape),
                    )
                });
                let st = strides
                    .as_ref()
                    .map(|(sa, sb)| (out_shape.as_slice(), sa.as_slice(), sb.as_slice()));
                Ok(Self::from_gpu(
                    out_shape.clone(),
                    a.gpu().binary(op, a, b, n, st)?,
                ))
            }
            #[cfg(feature = "wgpu")]
            _ => Err(self.mismatch(name, rhs)),
        }
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
    ///
    /// A small GPU tensor whose values are still only on the host (at most
    /// [`HOST_UNARY_MAX`] elements: a loss and its like, such as the scaling of a mean) is computed
    /// there, keeping its host copy: the arithmetic costs less than an upload, a dispatch and a
    /// readback.
    pub fn unary(&self, op: UnaryOp) -> Result<Tensor> {
        match self.view() {
            View::Cpu(a) => Ok(Self::from_cpu(self.shape.clone(), cpu::unary(op, a))),
            #[cfg(feature = "wgpu")]
            View::Gpu(a) => {
                if self.numel() <= HOST_UNARY_MAX
                    && let Some(t) = self.on_host(a.gpu(), &self.shape, |v| cpu::unary(op, v))
                {
                    return t;
                }
                Ok(Self::from_gpu(self.shape.clone(), a.gpu().unary(op, a)?))
            }
        }
    }

    /// `c * self`.
    pub fn scale(&self, c: f32) -> Result<Tensor> {
        self.unary(UnaryOp::Scale(c))
    }

    /// Sum over all elements; a 0-D tensor.
    ///
    /// A GPU tensor whose values are still only on the host (a collective's result that no kernel
    /// has read: see [`Tensor`]) is summed there, as the CPU backend sums, and the result is a GPU
    /// tensor with its host copy: the upload of the whole input, a kernel and the readback of the
    /// result are saved (measured in the browser, WebGPU on SwiftShader, 4 tabs: the loss of the
    /// 1 MiB all_reduce forward + backward cost 17-22 ms of each step on the device).
    pub fn sum_all(&self) -> Result<Tensor> {
        match self.view() {
            View::Cpu(a) => Ok(Tensor::scalar(cpu::sum_all(a))),
            #[cfg(feature = "wgpu")]
            View::Gpu(a) => {
                if let Some(t) = self.on_host(a.gpu(), &[], |v| vec![cpu::sum_all(v)]) {
                    return t;
                }
                Ok(Self::from_gpu(Vec::new(), a.gpu().sum_all(a)?))
            }
        }
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
        if target == self.shape.as_slice() {
            return Ok(self.clone());
        }
        match self.view() {
            View::Cpu(a) => Ok(Self::from_cpu(
                target.to_vec(),
                cpu::sum_to(a, &self.shape, target),
            )),
            #[cfg(feature = "wgpu")]
            View::Gpu(a) => {
                // Values only on the host: summed there, as `sum_all`.
                if let Some(t) =
                    self.on_host(a.gpu(), target, |v| cpu::sum_to(v, &self.shape, target))
                {
                    return t;
                }
                Ok(Self::from_gpu(
                    target.to_vec(),
                    a.gpu().sum_to(a, &self.shape, target)?,
                ))
            }
        }
    }

    /// Matrix product of `[m,k]` and `[k,n]`.
    pub fn matmul(&self, rhs: &Tensor) -> Result<Tensor> {
        let (m, k, n) = match (self.shape.as_slice(), rhs.shape.as_slice()) {
            (&[m, k], &[k2, n]) if k == k2 => (m, k, n),
            _ => {
                return Err(Error::shape(
                    "matmul",
                    &self.shape,
                    &rhs.shape,
                    "need [m,k] x [k,n]",
                ));
            }
        };
        match (self.view(), rhs.view()) {
            (View::Cpu(a), View::Cpu(b)) => {
                Ok(Self::from_cpu(vec![m, n], cpu::matmul(a, b, m, k, n)))
            }
            #[cfg(feature = "wgpu")]
            (View::Gpu(a), View::Gpu(b)) => {
                Ok(Self::from_gpu(vec![m, n], a.gpu().matmul(a, b, m, k, n)?))
            }
            #[cfg(feature = "wgpu")]
            _ => Err(self.mismatch("matmul", rhs)),
        }
    }

    /// Transpose of a 2-D tensor.
    pub fn t(&self) -> Result<Tensor> {
        let &[m, n] = self.shape.as_slice() else {
            return Err(Error::shape(
                "transpose",
                &self.shape,
                &[],
                "need a 2-D tensor",
            ));
        };
        match self.view() {
            View::Cpu(a) => Ok(Self::from_cpu(vec![n, m], cpu::transpose(a, m, n))),
            #[cfg(feature = "wgpu")]
            View::Gpu(a) => {
                let g = a.gpu();
                let out = g.alloc(m * n)?;
                let (from, to) = (
                    At {
                        offset: 0,
                        strides: &[1, n],
                    },
                    At {
                        offset: 0,
                        strides: &[m, 1],
                    },
                );
                g.copy_strided(a, from, &out, to, &[n, m])?;
                Ok(Self::from_gpu(vec![n, m], out))
            }
        }
    }

    /// The value of a one-element tensor repeated to `shape`, on the same device (the backward of
    /// a sum). On a GPU: one copy kernel, or, when the value is known on the host (a backward
    /// seed: [`Tensor::has_host_copy`]), a fill there and an upload, as [`Tensor::full_like`], so
    /// the result keeps its host copy (a collective sends it without a readback; measured in the
    /// browser, WebGPU on SwiftShader, 4 tabs: the 1 MiB all_reduce forward + backward 107 ms
    /// with the kernel, 76 ms with the upload).
    pub fn broadcast_scalar(&self, shape: &[usize]) -> Result<Tensor> {
        if self.numel() != 1 {
            return Err(Error::shape(
                "broadcast_scalar",
                &self.shape,
                shape,
                "need a tensor of exactly one element",
            ));
        }
        let n = checked_numel(shape).ok_or_else(|| {
            Error::shape("broadcast_scalar", &self.shape, shape, "too many elements")
        })?;
        match self.view() {
            View::Cpu(a) => Ok(Self::from_cpu(shape.to_vec(), vec![a[0]; n])),
            #[cfg(feature = "wgpu")]
            View::Gpu(a) => {
                if let Some(v) = self
                    .host_copy()
                    .and_then(|h| cpu::f32s_of_le_bytes(h).first().copied())
                {
                    return Self::full(shape, v).to_device(&self.device());
                }
                let g = a.gpu();
                let out = g.alloc(n)?;
                let zeros = vec![0; shape.len()];
                let dense = cpu::strides(shape);
                g.copy_strided(
                    a,
                    At {
                        offset: 0,
                        strides: &zeros,
                    },
                    &out,
                    At {
                        offset: 0,
                        strides: &dense,
                    },
                    shape,
                )?;
                Ok(Self::from_gpu(shape.to_vec(), out))
            }
        }
    }

    /// Same data, new shape (shares storage).
    pub fn reshape(&self, shape: &[usize]) -> Result<Tensor> {
        if checked_numel(shape) != Some(self.numel()) {
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
            #[cfg(feature = "wgpu")]
            host: self.host.clone(),
        })
    }

    /// Elements `start..start+len` along `dim`.
    pub fn slice(&self, dim: usize, start: usize, len: usize) -> Result<Tensor> {
        let end = start.checked_add(len);
        if dim >= self.shape.len() || end.is_none_or(|end| end > self.shape[dim]) {
            return Err(Error::invalid(
                "slice",
                format!(
                    "dim {dim} range {start}..{start}+{len} out of bounds for shape {:?}",
                    self.shape
                ),
            ));
        }
        let mut shape = self.shape.clone();
        shape[dim] = len;
        match self.view() {
            View::Cpu(a) => Ok(Self::from_cpu(
                shape,
                cpu::slice(a, &self.shape, dim, start, len),
            )),
            #[cfg(feature = "wgpu")]
            View::Gpu(a) => {
                let g = a.gpu();
                let src = cpu::strides(&self.shape);
                // A slice of a contiguous range (every dim before `dim` is 1) of a tensor with a
                // host copy is that range of the copy, uploaded when first used: no kernel.
                if self.shape[..dim].iter().all(|&d| d == 1)
                    && let Some(h) = self.host_copy()
                {
                    let inner = src[dim] * 4;
                    return Self::uploaded(shape, g, h.slice(start * inner..(start + len) * inner));
                }
                let n: usize = shape.iter().product();
                let out = g.alloc(n)?;
                let dst = cpu::strides(&shape);
                let from = At {
                    offset: start * src[dim],
                    strides: &src,
                };
                g.copy_strided(
                    a,
                    from,
                    &out,
                    At {
                        offset: 0,
                        strides: &dst,
                    },
                    &shape,
                )?;
                Ok(Self::from_gpu(shape, out))
            }
        }
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
            if p.device() != first.device() {
                return Err(first.mismatch("concat", p));
            }
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
        let mut shape = first.shape.clone();
        shape[dim] = parts.iter().map(|p| p.shape[dim]).sum();
        match first.view() {
            View::Cpu(_) => {
                let outer: usize = first.shape[..dim].iter().product();
                let inner: usize = first.shape[dim + 1..].iter().product();
                let views = parts
                    .iter()
                    .map(|p| Ok((p.cpu()?, p.shape[dim])))
                    .collect::<Result<Vec<_>>>()?;
                Ok(Self::from_cpu(shape, cpu::concat(&views, outer, inner)))
            }
            #[cfg(feature = "wgpu")]
            View::Gpu(b0) => {
                let g = b0.gpu();
                let out = g.alloc(shape.iter().product())?;
                let dst = cpu::strides(&shape);
                let mut at = 0;
                for p in parts {
                    let View::Gpu(b) = p.view() else {
                        return Err(first.mismatch("concat", p));
                    };
                    let src = cpu::strides(&p.shape);
                    let to = At {
                        offset: at * dst[dim],
                        strides: &dst,
                    };
                    g.copy_strided(
                        b,
                        At {
                            offset: 0,
                            strides: &src,
                        },
                        &out,
                        to,
                        &p.shape,
                    )?;
                    at += p.shape[dim];
                }
                Ok(Self::from_gpu(shape, out))
            }
        }
    }

    /// For equal-shape tensors `x_0..x_{n-1}` return `prod_{k != j} x_k` for each `j`, exact with
    /// zeros (no division): prefix and suffix products, on whatever device the inputs live.
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
        if matches!(first.view(), View::Cpu(_)) {
            let slices = xs
                .iter()
                .map(Tensor::cpu)
                .collect::<Result<Vec<&[f32]>>>()?;
            return Ok(cpu::product_of_others(&slices)
                .into_iter()
                .map(|d| Self::from_cpu(first.shape.clone(), d))
                .collect());
        }
        // Same order of multiplications as the CPU path: prefix[j] = x_0 ... x_{j-1},
        // out[j] = prefix[j] * suffix[j] with suffix[j] = x_{j+1} ... x_{n-1} built from the right.
        let n = xs.len();
        let mut prefix = vec![first.full_like(1.0)?];
        for x in xs.iter().take(n - 1) {
            let next = prefix.last().map(|p| p.mul(x)).transpose()?;
            prefix.extend(next);
        }
        let mut out = vec![None; n];
        let mut suffix = first.full_like(1.0)?;
        for j in (0..n).rev() {
            out[j] = Some(prefix[j].mul(&suffix)?);
            if j > 0 {
                suffix = suffix.mul(&xs[j])?;
            }
        }
        Ok(out.into_iter().flatten().collect())
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

/// `len` bytes must hold exactly the f32 elements of `shape`.
fn check_byte_len(op: &'static str, len: usize, shape: &[usize]) -> Result<()> {
    let n = checked_numel(shape)
        .ok_or_else(|| Error::shape(op, shape, &[], "element count overflows"))?;
    if n.checked_mul(4) != Some(len) {
        return Err(Error::DataLength {
            op,
            shape: shape.to_vec(),
            expected: n,
            got: len / 4,
        });
    }
    Ok(())
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shared_bytes_are_used_in_place_when_aligned_and_copied_otherwise() {
        let t = Tensor::vector(&[1.0, -2.5, 3.25]);
        let b = t.to_le_bytes().unwrap();
        let shared = Tensor::from_shared_le_bytes(b.clone(), &[3]).unwrap();
        assert_eq!(shared.to_vec(), vec![1.0, -2.5, 3.25]);
        let Storage::Cpu(inner) = shared.storage() else {
            unreachable!()
        };
        assert_eq!(
            inner.as_ptr(),
            b.as_ptr(),
            "aligned bytes must be shared, not copied"
        );
        // one byte in: misaligned, so the values are copied into aligned storage
        let mut raw = vec![0u8];
        raw.extend_from_slice(&b);
        let odd = Bytes::from(raw).slice(1..);
        let copied = Tensor::from_shared_le_bytes(odd, &[3]).unwrap();
        assert_eq!(copied.to_vec(), vec![1.0, -2.5, 3.25]);
        assert!(Tensor::from_shared_le_bytes(b, &[4]).is_err());
    }
}
