//! The local step of every reducing collective: a partial reduction that lives where its input
//! lives. On the host it is a `Vec<f32>` folded with the CPU kernels; for a GPU tensor it is a GPU
//! buffer folded with the WGSL reduce-into kernel, and only what goes on the wire is read back.
//! The ring and tree algorithms are written once against this type, so both backends run the same
//! chunking, order and operations: bitwise the same results.

use bytes::Bytes;

use super::ReduceOp;
use super::p2p::Call;
use crate::backend::{Storage, cpu};
use crate::error::Result;
use crate::tensor::{Tensor, f32_bytes};
use crate::transport::Transport;

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

    /// The op's last local step (AVG divides by the group size), as [`Call::finish_reduction`].
    pub(crate) fn finish<T: Transport>(&mut self, call: &Call<'_, T>, op: ReduceOp) -> Result<()> {
        match self {
            Partial::Host(v) => call.finish_reduction(op, v),
            #[cfg(feature = "wgpu")]
            Partial::Gpu(t) => {
                if op == ReduceOp::Avg {
                    *t = t.scale(1.0 / call.n as f32)?;
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

/// Elements `start..start+len` of `x` (flattened) as bytes to send: a zero-copy slice of a host
/// tensor, a readback of only those elements of a GPU tensor.
pub(crate) async fn bytes_of(x: &Tensor, start: usize, len: usize) -> Result<Bytes> {
    match x.storage() {
        Storage::Cpu(_) => Ok(x.to_le_bytes()?.slice(start * 4..(start + len) * 4)),
        #[cfg(feature = "wgpu")]
        Storage::Gpu(_) => Partial::copy_of(x, start, len)?.into_bytes().await,
    }
}
