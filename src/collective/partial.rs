//! The local step of every reducing collective: a partial reduction that lives where its input
//! lives. On the host it is a `Vec<f32>` folded with the CPU kernels; for a GPU tensor it is a GPU
//! buffer folded with the WGSL reduce-into kernel, and only what goes on the wire is read back.
//! The ring and tree algorithms are written once against this type, so both backends run the same
//! chunking, order and operations: bitwise the same results.

use bytes::Bytes;

use super::ReduceOp;
use crate::backend::{Storage, cpu};
use crate::error::Result;
use crate::pool::f32_bytes;
use crate::tensor::Tensor;

/// A partial reduction: see the module docs.
pub(crate) enum Partial {
    /// Host values.
    Host(Vec<f32>),
    /// A flat GPU tensor of its own (never the caller's buffer).
    #[cfg(feature = "wgpu")]
    Gpu(Tensor),
}

impl Partial {
    /// A copy of elements `start..start+len` of `x` (flattened), on `x`'s device.
    pub(crate) fn copy_of(x: &Tensor, start: usize, len: usize) -> Result<Partial> {
        if len == 0 {
            return Ok(Partial::Host(Vec::new()));
        }
        match x.storage() {
            Storage::Cpu(_) => Ok(Partial::Host(x.cpu()?[start..start + len].to_vec())),
            #[cfg(feature = "wgpu")]
            Storage::Gpu(_) => Ok(Partial::Gpu(x.reshape(&[x.numel()])?.slice(0, start, len)?)),
        }
    }

    /// `op(x[start..start+len], got)`: this rank's elements combined with received bytes.
    pub(crate) fn combine(
        x: &Tensor,
        start: usize,
        len: usize,
        op: ReduceOp,
        got: &[u8],
    ) -> Result<Partial> {
        if len == 0 {
            return Ok(Partial::Host(Vec::new()));
        }
        match x.storage() {
            // One pass on the host: no copy of `x` first.
            Storage::Cpu(_) => Ok(Partial::Host(cpu::combine_le_bytes(
                op.combine(),
                &x.cpu()?[start..start + len],
                got,
            ))),
            #[cfg(feature = "wgpu")]
            Storage::Gpu(_) => {
                let mut p = Partial::copy_of(x, start, len)?;
                p.fold(op, got)?;
                Ok(p)
            }
        }
    }

    /// `op` over every rank's elements `start..start+len`, folded in group-rank order: `parts[j]` is
    /// rank `j`'s contribution as received bytes, `None` marks this rank's own (taken from `x`).
    /// One pass over memory on the host; on the GPU the received parts are uploaded and folded in
    /// with the fused reduce-into, in the same order (bitwise the host's result).
    pub(crate) fn fold_parts(
        x: &Tensor,
        start: usize,
        len: usize,
        parts: &[Option<Bytes>],
        op: ReduceOp,
    ) -> Result<Partial> {
        if len == 0 {
            return Ok(Partial::Host(Vec::new()));
        }
        match x.storage() {
            Storage::Cpu(_) => {
                let own = &x.cpu()?[start..start + len];
                let inputs: Vec<std::borrow::Cow<'_, [f32]>> = parts
                    .iter()
                    .map(|p| match p {
                        None => std::borrow::Cow::Borrowed(own),
                        Some(b) => cpu::f32s_of_le_bytes(b),
                    })
                    .collect();
                let refs: Vec<&[f32]> = inputs.iter().map(|c| c.as_ref()).collect();
                Ok(Partial::Host(cpu::fold_all(op.combine(), &refs)))
            }
            #[cfg(feature = "wgpu")]
            Storage::Gpu(_) => {
                // Every part on the GPU (received ones uploaded, ours copied out of `x`), then
                // one fused fold into the first, in rank order.
                let gpu = gpu_of(x)?;
                let mut bufs = Vec::with_capacity(parts.len());
                for p in parts {
                    let t = match p {
                        None => Partial::copy_of(x, start, len)?.into_tensor(&[len])?,
                        Some(b) => Tensor::from_gpu(vec![len], gpu.upload_le_bytes(b)?),
                    };
                    bufs.push(t);
                }
                let raw: Vec<&crate::backend::gpu::GpuBuf> = bufs
                    .iter()
                    .filter_map(|t| match t.storage() {
                        Storage::Gpu(b) => Some(b),
                        Storage::Cpu(_) => None,
                    })
                    .collect();
                if let Some((first, rest)) = raw.split_first() {
                    gpu.reduce_into_many(op.combine(), first, rest)?;
                }
                Ok(bufs
                    .into_iter()
                    .next()
                    .map_or(Partial::Host(Vec::new()), Partial::Gpu))
            }
        }
    }

    /// `self = op(self, got)` in place.
    pub(crate) fn fold(&mut self, op: ReduceOp, got: &[u8]) -> Result<()> {
        match self {
            Partial::Host(v) => cpu::reduce_into_le_bytes(op.combine(), v, got),
            #[cfg(feature = "wgpu")]
            Partial::Gpu(t) => {
                if let Storage::Gpu(acc) = t.storage() {
                    let incoming = acc.gpu().upload_le_bytes(got)?;
                    acc.gpu().reduce_into(op.combine(), acc, &incoming)?;
                }
            }
        }
        Ok(())
    }

    /// The op's last local step over a group of `n` (AVG divides by it), as [`finish_host`].
    pub(crate) fn finish(&mut self, n: usize, op: ReduceOp) -> Result<()> {
        match self {
            Partial::Host(v) => finish_host(op, n, v),
            #[cfg(feature = "wgpu")]
            Partial::Gpu(t) => {
                if op == ReduceOp::Avg {
                    *t = t.scale(1.0 / n as f32)?;
                }
            }
        }
        Ok(())
    }

    /// The values as bytes to send (a GPU partial is read back: the transport boundary).
    pub(crate) async fn into_bytes(self) -> Result<Bytes> {
        match self {
            Partial::Host(v) => Ok(f32_bytes(v)),
            #[cfg(feature = "wgpu")]
            Partial::Gpu(t) => Ok(f32_bytes(t.read().await?)),
        }
    }

    /// The values as a tensor of `shape`, where they are (a GPU partial is not read back).
    pub(crate) fn into_tensor(self, shape: &[usize]) -> Result<Tensor> {
        match self {
            Partial::Host(v) => Tensor::from_vec(v, shape),
            #[cfg(feature = "wgpu")]
            Partial::Gpu(t) => t.reshape(shape),
        }
    }
}

/// The last step of every reducing algorithm on host values: `Avg` divides the finished sum by the
/// group size `n`.
pub(crate) fn finish_host(op: ReduceOp, n: usize, acc: &mut [f32]) {
    if op == ReduceOp::Avg {
        let k = 1.0 / n as f32;
        acc.iter_mut().for_each(|v| *v *= k);
    }
}

/// Elements `start..start+len` of `x` (flattened) as bytes to send: a zero-copy slice of a host
/// tensor, a readback of only those elements of a GPU tensor.
pub(crate) async fn bytes_of(x: &Tensor, start: usize, len: usize) -> Result<Bytes> {
    match x.storage() {
        Storage::Cpu(_) => Ok(x.to_le_bytes()?.slice(start * 4..(start + len) * 4)),
        #[cfg(feature = "wgpu")]
        Storage::Gpu(_) if start == 0 && len == x.numel() => Ok(f32_bytes(x.read().await?)),
        #[cfg(feature = "wgpu")]
        Storage::Gpu(_) => Partial::copy_of(x, start, len)?.into_bytes().await,
    }
}

/// The GPU a tensor lives on.
#[cfg(feature = "wgpu")]
fn gpu_of(x: &Tensor) -> Result<crate::backend::gpu::Gpu> {
    match x.storage() {
        Storage::Gpu(b) => Ok(b.gpu().clone()),
        Storage::Cpu(_) => Err(crate::error::Error::invalid(
            "fold",
            "expected a GPU tensor",
        )),
    }
}
