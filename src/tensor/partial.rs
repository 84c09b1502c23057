//! The local step of every reducing collective, as part of the tensor API: a partial reduction
//! that lives where its input lives. On the host it is a `Vec<f32>` folded with the CPU kernels;
//! for a GPU tensor it is a GPU buffer folded with the WGSL reduce-into kernel, and only what goes
//! on the wire is read back. The ring, tree and direct algorithms (`collective/`) are written once
//! against this type and never touch a backend's internals, so both backends run the same
//! chunking, order and operations: bitwise the same results. It knows elementwise combine ops
//! ([`BinaryOp`]) and scales, not reduce ops: AVG is the collective's `Sum` then a scale.

use bytes::Bytes;

use super::Tensor;
use crate::backend::{BinaryOp, Storage, cpu};
use crate::error::Result;
use crate::pool::f32_bytes;

/// A partial reduction: see the module docs.
pub enum Partial {
    /// Host values.
    Host(Vec<f32>),
    /// A flat GPU tensor of its own (never the caller's buffer).
    #[cfg(feature = "wgpu")]
    Gpu(Tensor),
}

impl Partial {
    /// A copy of elements `start..start+len` of `x` (flattened), on `x`'s device.
    pub fn copy_of(x: &Tensor, start: usize, len: usize) -> Result<Partial> {
        if len == 0 {
            return Ok(Partial::Host(Vec::new()));
        }
        match x.storage() {
            Storage::Cpu(_) => Ok(Partial::Host(x.cpu()?[start..start + len].to_vec())),
            #[cfg(feature = "wgpu")]
            // Folded into in place later: no host copy may come along.
            Storage::Gpu(_) => Ok(Partial::Gpu(
                x.reshape(&[x.numel()])?
                    .slice(0, start, len)?
                    .without_host_copy(),
            )),
        }
    }

    /// `op(x[start..start+len], got)`: this rank's elements combined with received bytes.
    pub fn combine(
        x: &Tensor,
        start: usize,
        len: usize,
        op: BinaryOp,
        got: &[u8],
    ) -> Result<Partial> {
        if len == 0 {
            return Ok(Partial::Host(Vec::new()));
        }
        match x.storage() {
            // One pass on the host: no copy of `x` first.
            Storage::Cpu(_) => Ok(Partial::Host(cpu::combine_le_bytes(
                op,
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
    pub fn fold_parts(
        x: &Tensor,
        start: usize,
        len: usize,
        parts: &[Option<Bytes>],
        op: BinaryOp,
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
                Ok(Partial::Host(cpu::fold_all(op, &refs)))
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
                    gpu.reduce_into_many(op, first, rest)?;
                }
                Ok(bufs
                    .into_iter()
                    .next()
                    .map_or(Partial::Host(Vec::new()), Partial::Gpu))
            }
        }
    }

    /// `self = op(self, got)` in place.
    pub fn fold(&mut self, op: BinaryOp, got: &[u8]) -> Result<()> {
        match self {
            Partial::Host(v) => cpu::reduce_into_le_bytes(op, v, got),
            #[cfg(feature = "wgpu")]
            Partial::Gpu(t) => {
                if let Storage::Gpu(acc) = t.storage() {
                    let incoming = acc.gpu().upload_le_bytes(got)?;
                    acc.gpu().reduce_into(op, acc, &incoming)?;
                }
            }
        }
        Ok(())
    }

    /// The reduction's last local step: multiply by `scale` where there is one (AVG: one over the
    /// group size), as [`scale_host`].
    pub fn finish(&mut self, scale: Option<f32>) -> Result<()> {
        let Some(k) = scale else { return Ok(()) };
        match self {
            Partial::Host(v) => scale_host(v, k),
            #[cfg(feature = "wgpu")]
            Partial::Gpu(t) => *t = t.scale(k)?,
        }
        Ok(())
    }

    /// The values as bytes to send (a GPU partial is read back: the transport boundary).
    pub async fn into_bytes(self) -> Result<Bytes> {
        match self {
            Partial::Host(v) => Ok(f32_bytes(v)),
            #[cfg(feature = "wgpu")]
            Partial::Gpu(t) => Ok(f32_bytes(t.read().await?)),
        }
    }

    /// The values as a tensor of `shape`, where they are (a GPU partial is not read back).
    pub fn into_tensor(self, shape: &[usize]) -> Result<Tensor> {
        match self {
            Partial::Host(v) => Tensor::from_vec(v, shape),
            #[cfg(feature = "wgpu")]
            Partial::Gpu(t) => t.reshape(shape),
        }
    }
}

/// The last step of a reduction on host values that has one (AVG: one over the group size).
pub fn scale_host(acc: &mut [f32], k: f32) {
    acc.iter_mut().for_each(|v| *v *= k);
}

/// Host values of `parts` (index = group rank, `None` = `own`) folded with `op` in rank order.
pub fn fold_host(own: &[f32], parts: &[Option<Bytes>], op: BinaryOp) -> Vec<f32> {
    let mut acc: Option<Vec<f32>> = None;
    for p in parts {
        match (&mut acc, p) {
            (None, None) => acc = Some(own.to_vec()),
            (None, Some(b)) => acc = Some(cpu::f32s_from_le_bytes(b)),
            (Some(a), None) => cpu::reduce_into(op, a, own),
            (Some(a), Some(b)) => cpu::reduce_into_le_bytes(op, a, b),
        }
    }
    acc.unwrap_or_default()
}

/// Elements `start..start+len` of `x` (flattened) as bytes to send: a zero-copy slice of a host
/// tensor or of a GPU tensor's host copy, else a readback of only those elements.
pub async fn bytes_of(x: &Tensor, start: usize, len: usize) -> Result<Bytes> {
    match x.storage() {
        Storage::Cpu(_) => Ok(x.to_le_bytes()?.slice(start * 4..(start + len) * 4)),
        #[cfg(feature = "wgpu")]
        Storage::Gpu(_) if x.has_host_copy() => {
            Ok(x.to_le_bytes()?.slice(start * 4..(start + len) * 4))
        }
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
