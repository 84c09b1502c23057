//! Binomial trees for rooted collectives: `ceil(log2 n)` rounds. Ranks are renumbered relative to
//! the root (`v = (me - root) mod n`); in round `k` the ranks `v < 2^k` send to `v + 2^k`.

use super::ReduceOp;
use super::call::Call;
use super::events::{Action, Chunk};
use crate::error::Result;
use crate::tensor::Tensor;
use crate::tensor::partial::{Partial, bytes_of};
use crate::transport::Transport;

/// The rounds of a binomial tree over `n` ranks: `ceil(log2 n)`.
pub(crate) fn rounds(n: usize) -> usize {
    n.next_power_of_two().trailing_zeros() as usize
}

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
    // The message over distance `mask` goes in round levels - 1 - log2(mask): the root's to
    // the farthest subtree first.
    let levels = rounds(n);
    let whole = Some(Chunk::whole(x.numel()));
    let round = |mask: usize| levels - 1 - mask.trailing_zeros() as usize;
    let mut mask = 1;
    while mask < n {
        if v & mask != 0 {
            let parent = real(v - mask);
            call.at(round(mask), None, whole);
            data = call.recv_exact(parent, x.numel() * 4).await?;
            break;
        }
        mask <<= 1;
    }
    mask >>= 1;
    while mask > 0 {
        if v + mask < n {
            call.at(round(mask), whole, None);
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
    let whole = Chunk::whole(numel);
    let mut mask = 1;
    while mask < n {
        // Round log2(mask): the ranks at distance `mask` from their parent send.
        call.at(mask.trailing_zeros() as usize, Some(whole), Some(whole));
        if v & mask == 0 {
            let child = v | mask;
            if child < n {
                let got = call.recv_exact(real(child), numel * 4).await?;
                call.local(Action::Reduce, whole);
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
