//! Binomial trees for rooted collectives: `ceil(log2 n)` rounds. Ranks are renumbered relative to
//! the root (`v = (me - root) mod n`); in round `k` the ranks `v < 2^k` send to `v + 2^k`.

use super::ReduceOp;
use super::call::Call;
use crate::error::Result;
use crate::tensor::Tensor;
use crate::tensor::partial::{Partial, bytes_of};
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
    // Only the root's input is sent (read back, for a GPU tensor); the others' only give the shape.
    let mut data = if v == 0 {
        bytes_of(x, 0, x.numel()).await?
    } else {
        bytes::Bytes::new()
    };
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

/// Reduce to `root`: children fold into their parents up the tree. The local steps run where `x`
/// lives ([`Partial`]); only what goes to the parent is read back, and the root's result stays on
/// `x`'s device.
pub(crate) async fn reduce<T: Transport>(
    call: &Call<'_, T>,
    x: &Tensor,
    root: usize,
    op: ReduceOp,
) -> Result<Option<Tensor>> {
    let n = call.n;
    let v = (call.me + n - root) % n;
    let real = |vr: usize| (vr + root) % n;
    let numel = x.numel();
    let mut acc = Partial::copy_of(x, 0, numel)?;
    let mut mask = 1;
    while mask < n {
        if v & mask == 0 {
            let child = v | mask;
            if child < n {
                let got = call.recv_exact(real(child), numel * 4).await?;
                acc.fold(op.combine(), &got)?;
            }
        } else {
            call.send(real(v & !mask), acc.into_bytes().await?).await?;
            return Ok(None);
        }
        mask <<= 1;
    }
    acc.finish(op.final_scale(call.n))?;
    acc.into_tensor(x.shape()).map(Some)
}
