//! Binomial trees for rooted collectives: `ceil(log2 n)` rounds. Ranks are renumbered relative to
//! the root (`v = (me - root) mod n`); in round `k` the ranks `v < 2^k` send to `v + 2^k`.

use super::ReduceOp;
use super::p2p::Call;
use crate::backend::cpu;
use crate::error::Result;
use crate::tensor::Tensor;
use crate::transport::Transport;

/// Broadcast `root`'s `x`; every rank passed a tensor of the same shape (checked by the signature).
pub(crate) async fn broadcast<T: Transport>(
    call: &Call<'_, T>,
    x: &Tensor,
    root: usize,
) -> Result<Tensor> {
    let n = call.n;
    let v = (call.me + n - root) % n;
    let real = |vr: usize| (vr + root) % n;
    let mut data = x.to_le_bytes()?;
    let mut mask = 1;
    while mask < n {
        if v & mask != 0 {
            let parent = real(v - mask);
            data = call.recv_exact(parent, x.numel() * 4).await?;
            break;
        }
        mask <<= 1;
    }
    mask >>= 1;
    while mask > 0 {
        if v + mask < n {
            call.send(real(v + mask), data.clone()).await?;
        }
        mask >>= 1;
    }
    if v == 0 {
        Ok(x.clone())
    } else {
        Tensor::from_shared_le_bytes(data, x.shape())
    }
}

/// Reduce to `root`: children fold into their parents up the tree.
pub(crate) async fn reduce<T: Transport>(
    call: &Call<'_, T>,
    x: &Tensor,
    root: usize,
    op: ReduceOp,
) -> Result<Option<Tensor>> {
    let n = call.n;
    let v = (call.me + n - root) % n;
    let real = |vr: usize| (vr + root) % n;
    let mut acc = x.cpu()?.to_vec();
    let mut mask = 1;
    while mask < n {
        if v & mask == 0 {
            let child = v | mask;
            if child < n {
                let got = call.recv_exact(real(child), acc.len() * 4).await?;
                cpu::reduce_into_le_bytes(op.combine(), &mut acc, &got);
            }
        } else {
            call.send(real(v & !mask), crate::tensor::f32_bytes(acc))
                .await?;
            return Ok(None);
        }
        mask <<= 1;
    }
    call.finish_reduction(op, &mut acc);
    Tensor::from_vec(acc, x.shape()).map(Some)
}

/// [`reduce`] of a tensor on a GPU: each child's contribution is uploaded and folded into a copy
/// of `x` with the WGSL reduce-into kernel; only what goes to the parent is read back, and the
/// root's result stays on the GPU. Same tree and order as [`reduce`]: bitwise the same result.
#[cfg(feature = "wgpu")]
pub(crate) async fn reduce_gpu<T: Transport>(
    call: &Call<'_, T>,
    x: &Tensor,
    root: usize,
    op: ReduceOp,
) -> Result<Option<Tensor>> {
    use crate::backend::Storage;
    let n = call.n;
    let v = (call.me + n - root) % n;
    let real = |vr: usize| (vr + root) % n;
    let numel = x.numel();
    // A fresh copy: the caller's tensor is never written.
    let mut acc = x.reshape(&[numel])?.slice(0, 0, numel)?;
    let Storage::Gpu(a) = acc.storage() else {
        return Err(crate::Error::Gpu {
            op: "reduce",
            detail: "the GPU tree got a host tensor".into(),
        });
    };
    let mut mask = 1;
    while mask < n {
        if v & mask == 0 {
            let child = v | mask;
            if child < n {
                let got = call.recv_exact(real(child), numel * 4).await?;
                let mut incoming = Vec::with_capacity(numel);
                cpu::extend_from_le_bytes(&mut incoming, &got);
                let incoming = a.gpu().upload(&incoming)?;
                a.gpu().reduce_into(op.combine(), a, &incoming)?;
            }
        } else {
            let bytes = crate::tensor::f32_bytes(acc.read().await?);
            call.send(real(v & !mask), bytes).await?;
            return Ok(None);
        }
        mask <<= 1;
    }
    if op == ReduceOp::Avg {
        acc = acc.scale(1.0 / n as f32)?;
    }
    acc.reshape(x.shape()).map(Some)
}
