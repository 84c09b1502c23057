//! Direct exchange: every message goes straight from its source to its destination. Used for small
//! payloads (one round instead of `2(n-1)` ring steps) and for the collectives whose data has no ring
//! structure (gather, scatter, all_to_all, permute, barrier).
//!
//! Reductions fold the ranks' contributions in group-rank order on every rank, so all_reduce results
//! are bitwise identical everywhere.

use bytes::Bytes;

use super::call::{Call, decode_tensor, encode_tensor_async};
use super::events::{Action, Chunk};
use super::{ReduceOp, chunk_bounds};
use crate::error::{Error, Result};
use crate::tensor::Tensor;
use crate::tensor::partial::{Partial, bytes_of, fold_host};
use crate::transport::Transport;

/// Fold `parts` (index = group rank, `None` = use `own`) in rank order; scale for Avg.
fn fold<T: Transport>(
    call: &Call<'_, T>,
    own: &[f32],
    parts: &[Option<Bytes>],
    op: ReduceOp,
) -> Vec<f32> {
    let mut acc = fold_host(own, parts, op.combine());
    call.finish_reduction(op, &mut acc);
    acc
}

/// Everyone sends `x` to everyone and folds in rank order.
pub(crate) async fn all_reduce<T: Transport>(
    call: &Call<'_, T>,
    x: &Tensor,
    op: ReduceOp,
) -> Result<Tensor> {
    let parts = exchange_all(call, x, false).await?;
    call.local(Action::Reduce, Chunk::whole(x.numel()));
    Tensor::from_vec(fold(call, x.cpu()?, &parts, op), x.shape())
}

/// Star all_reduce for small payloads (group size ≥ 3): every rank sends `x` to group rank 0,
/// which folds the `n` tensors in rank order and sends the result to every rank. `2(n-1)`
/// messages in two rounds instead of the exchange's `n(n-1)` in one. The signatures travel with
/// the data and are checked at the ends of the star ([`Call::star`]): the root checks every
/// rank's call before it sends anything, so no rank uses a result of mismatched calls. A rank in
/// another collective is caught by the root (if it sent the root its data) or by its successor
/// (which races its announcement); whoever sees it aborts the rest.
pub(crate) async fn all_reduce_star<T: Transport>(
    call: &Call<'_, T>,
    x: &Tensor,
    op: ReduceOp,
) -> Result<Tensor> {
    const ROOT: usize = 0;
    call.star(ROOT);
    let xb = bytes_of(x, 0, x.numel()).await?;
    let whole = Some(Chunk::whole(x.numel()));
    call.at(0, whole, whole);
    if call.me != ROOT {
        call.send(ROOT, xb.clone()).await?;
        call.at(1, None, whole);
        let b = call.recv_exact(ROOT, xb.len()).await?;
        return Tensor::from_shared_le_bytes(b, x.shape());
    }
    let mut parts = vec![None; call.n];
    for (j, p) in parts.iter_mut().enumerate() {
        if j != ROOT {
            *p = Some(call.recv_exact(j, xb.len()).await?);
        }
    }
    call.local(Action::Reduce, Chunk::whole(x.numel()));
    // The folded values are sent and kept as they are: one buffer, no copy.
    let ob = crate::pool::f32_bytes(fold(call, x.cpu()?, &parts, op));
    call.at(1, whole, None);
    // The successor first: its message carries the root's signature (see `Call::star`).
    for k in 1..call.n {
        call.send((ROOT + k) % call.n, ob.clone()).await?;
    }
    Tensor::from_shared_le_bytes(ob, x.shape())
}

/// Pairwise all_reduce for large payloads (group size ≥ 2, at least one element per rank): rank
/// `j` owns chunk `j`. Round 1: every rank sends chunk `j` of its input to rank `j`, and each owner
/// folds the `n` contributions to its chunk in group-rank order, in one pass over memory. Round 2:
/// every owner sends its finished chunk to every rank, and each rank assembles the result; or,
/// with `shared`, the owners send their chunks to rank 0, which assembles the result once and
/// sends that one buffer to every rank (where sends share memory, every rank's result is then the
/// same allocation). The same bytes per rank as the ring (`2(n-1)/n` of the payload each way) in
/// 2 rounds instead of `2(n-1)` steps, and about half the ring's passes over memory. Each chunk is
/// reduced once, so every rank gets bitwise the same result. The local steps run where `x` lives
/// ([`Partial`]).
pub(crate) async fn all_reduce_pairwise<T: Transport>(
    call: &Call<'_, T>,
    x: &Tensor,
    op: ReduceOp,
    shared: bool,
) -> Result<Tensor> {
    let (n, me) = (call.n, call.me);
    let chunks = chunk_bounds(x.numel(), n);
    let part = |j: usize| Some(Chunk::part(j, n, chunks[j].0, chunks[j].1));
    for k in 1..n {
        let j = (me + k) % n;
        let (s, l) = chunks[j];
        call.at(0, part(j), part(me));
        call.send(j, bytes_of(x, s, l).await?).await?;
    }
    let (s, l) = chunks[me];
    let mut parts = vec![None; n];
    for (j, p) in parts.iter_mut().enumerate() {
        if j != me {
            *p = Some(call.recv_exact(j, l * 4).await?);
        }
    }
    call.local(Action::Reduce, Chunk::part(me, n, s, l));
    let mut mine = Partial::fold_parts(x, s, l, &parts, op.combine())?;
    drop(parts);
    mine.finish(op.final_scale(call.n))?;
    let mine = mine.into_bytes().await?;
    let all = Some(Chunk::whole(x.numel()));
    let whole = if shared && me != 0 {
        call.at(1, part(me), None);
        call.send(0, mine).await?;
        call.at(2, None, all);
        call.recv_exact(0, x.numel() * 4).await?
    } else {
        if !shared {
            call.at(1, part(me), None);
            for k in 1..n {
                call.send((me + k) % n, mine.clone()).await?;
            }
        }
        let mut out = crate::pool::take(x.numel());
        for (j, &(s, l)) in chunks.iter().enumerate() {
            call.at(1, None, part(j));
            if j == me {
                crate::pool::extend_from_le_bytes(&mut out, &mine);
            } else {
                crate::pool::extend_from_le_bytes(&mut out, &call.recv_exact(j, l * 4).await?);
            }
            call.local(Action::Copy, Chunk::part(j, n, s, l));
        }
        let whole = crate::pool::f32_bytes(out);
        if shared {
            call.at(2, all, None);
            for k in 1..n {
                call.send(k, whole.clone()).await?;
            }
        }
        whole
    };
    Tensor::from_shared_le_bytes(whole, x.shape())?.to_device(&x.device())
}

/// Send `x` to every other rank, receive every other rank's equal-size tensor (`None` at our index).
/// (Recorded as chunks of tensor 0, or with `listed` as the sender's tensor of a list: an
/// all_gather's.)
async fn exchange_all<T: Transport>(
    call: &Call<'_, T>,
    x: &Tensor,
    listed: bool,
) -> Result<Vec<Option<Bytes>>> {
    let xb = bytes_of(x, 0, x.numel()).await?;
    let whole = |j: usize| {
        Some(if listed {
            Chunk::entry(j, x.numel())
        } else {
            Chunk::whole(x.numel())
        })
    };
    call.at(0, whole(call.me), None);
    for k in 1..call.n {
        call.send((call.me + k) % call.n, xb.clone()).await?;
    }
    let mut parts = vec![None; call.n];
    for (j, p) in parts.iter_mut().enumerate() {
        if j != call.me {
            call.at(0, None, whole(j));
            *p = Some(call.recv_exact(j, xb.len()).await?);
        }
    }
    Ok(parts)
}

/// Everyone gets everyone's `x`.
pub(crate) async fn all_gather<T: Transport>(
    call: &Call<'_, T>,
    x: &Tensor,
) -> Result<Vec<Tensor>> {
    let parts = exchange_all(call, x, true).await?;
    parts
        .iter()
        .map(|p| match p {
            None => Ok(x.clone()),
            Some(b) => Tensor::from_shared_le_bytes(b.clone(), x.shape()),
        })
        .collect()
}

/// Rank `j` gets the fold of everyone's `xs[j]`.
pub(crate) async fn reduce_scatter<T: Transport>(
    call: &Call<'_, T>,
    xs: &[Tensor],
    op: ReduceOp,
) -> Result<Tensor> {
    let numel = xs[call.me].numel();
    for k in 1..call.n {
        let j = (call.me + k) % call.n;
        call.at(0, Some(Chunk::entry(j, numel)), None);
        call.send(j, xs[j].to_le_bytes()?).await?;
    }
    let mine = Chunk::entry(call.me, numel);
    call.at(0, None, Some(mine));
    let mut parts = vec![None; call.n];
    for (j, p) in parts.iter_mut().enumerate() {
        if j != call.me {
            *p = Some(call.recv_exact(j, numel * 4).await?);
        }
    }
    call.local(Action::Reduce, mine);
    Tensor::from_vec(
        fold(call, xs[call.me].cpu()?, &parts, op),
        xs[call.me].shape(),
    )
}

/// Everyone sends `x` to the root.
pub(crate) async fn gather<T: Transport>(
    call: &Call<'_, T>,
    x: &Tensor,
    root: usize,
) -> Result<Option<Vec<Tensor>>> {
    if call.me != root {
        call.at(0, Some(Chunk::entry(call.me, x.numel())), None);
        call.send(root, bytes_of(x, 0, x.numel()).await?).await?;
        return Ok(None);
    }
    let mut out = Vec::with_capacity(call.n);
    for j in 0..call.n {
        if j == root {
            out.push(x.clone());
        } else {
            call.at(0, None, Some(Chunk::entry(j, x.numel())));
            let b = call.recv_exact(j, x.numel() * 4).await?;
            out.push(Tensor::from_shared_le_bytes(b, x.shape())?);
        }
    }
    Ok(Some(out))
}

/// The root sends `xs[j]` to rank `j` (with its shape: receivers do not know it).
pub(crate) async fn scatter<T: Transport>(
    call: &Call<'_, T>,
    xs: Option<&[Tensor]>,
    root: usize,
) -> Result<Tensor> {
    if call.me == root {
        let xs =
            xs.ok_or_else(|| Error::invalid("scatter", "the root must pass the list to scatter"))?;
        for k in 1..call.n {
            let j = (root + k) % call.n;
            call.at(0, Some(Chunk::entry(j, xs[j].numel())), None);
            call.send(j, encode_tensor_async(&xs[j]).await?).await?;
        }
        return Ok(xs[root].clone());
    }
    let b = call.recv(root).await?;
    let t = decode_tensor(b).ok_or_else(|| call.protocol(root, "malformed tensor"))?;
    call.received_as(Chunk::entry(call.me, t.numel()));
    Ok(t)
}

/// List all_to_all: `xs[j]` goes to rank `j`; output `i` comes from rank `i`. Shapes may differ.
pub(crate) async fn all_to_all<T: Transport>(
    call: &Call<'_, T>,
    xs: &[Tensor],
) -> Result<Vec<Tensor>> {
    for k in 1..call.n {
        let j = (call.me + k) % call.n;
        call.at(0, Some(Chunk::entry(j, xs[j].numel())), None);
        call.send(j, encode_tensor_async(&xs[j]).await?).await?;
    }
    let mut out = Vec::with_capacity(call.n);
    for (i, x) in xs.iter().enumerate() {
        if i == call.me {
            out.push(x.clone());
        } else {
            // The sender's list entry for this rank (its size is only known once it has come).
            let b = call.recv(i).await?;
            let t = decode_tensor(b).ok_or_else(|| call.protocol(i, "malformed tensor"))?;
            call.received_as(Chunk::entry(call.me, t.numel()));
            out.push(t);
        }
    }
    Ok(out)
}

/// Single-tensor all_to_all with split sizes along dim 0.
pub(crate) async fn all_to_all_single<T: Transport>(
    call: &Call<'_, T>,
    x: &Tensor,
    in_splits: &[usize],
    out_splits: &[usize],
) -> Result<Tensor> {
    let rest: Vec<usize> = x.shape()[1..].to_vec();
    let row: usize = rest.iter().product();
    let mut starts = Vec::with_capacity(call.n);
    let mut s = 0;
    for &k in in_splits {
        starts.push(s);
        s += k;
    }
    // Rows along dim 0 are contiguous: each piece is a range of the input (no copy on the CPU;
    // on a GPU only the pieces sent are read back).
    for k in 1..call.n {
        let j = (call.me + k) % call.n;
        // Named as all_to_all names its list: the piece for rank j.
        call.at(0, Some(Chunk::entry(j, in_splits[j] * row)), None);
        call.send(j, bytes_of(x, starts[j] * row, in_splits[j] * row).await?)
            .await?;
    }
    let mut parts = Vec::with_capacity(call.n);
    for (i, &rows) in out_splits.iter().enumerate() {
        let shape: Vec<usize> = std::iter::once(rows).chain(rest.iter().copied()).collect();
        call.at(
            0,
            None,
            Some(Chunk::entry(call.me, rows.saturating_mul(row))),
        );
        if i == call.me {
            if in_splits[i] != rows {
                return Err(Error::invalid(
                    "all_to_all_single",
                    format!(
                        "this rank ({i}) sends itself {} rows but out_splits expects {rows}",
                        in_splits[i]
                    ),
                ));
            }
            parts.push(x.slice(0, starts[i], rows)?);
            continue;
        }
        let b = call.recv(i).await?;
        if Some(b.len()) != rows.checked_mul(row).and_then(|x| x.checked_mul(4)) {
            return Err(Error::invalid(
                "all_to_all_single",
                format!(
                    "group rank {} expects {rows} rows from group rank {i} (its out_splits) but got {} (the sender's in_splits)",
                    call.me,
                    b.len() / 4 / row.max(1)
                ),
            ));
        }
        parts.push(Tensor::from_shared_le_bytes(b, &shape)?.to_device(&x.device())?);
    }
    Tensor::concat(&parts, 0)
}

/// `dst` gets `src`'s `x` for each pair; ranks that receive nothing get zeros.
pub(crate) async fn permute<T: Transport>(
    call: &Call<'_, T>,
    x: &Tensor,
    pairs: &[(usize, usize)],
) -> Result<Tensor> {
    let me = call.me;
    let whole = Some(Chunk::whole(x.numel()));
    call.at(0, whole, whole);
    if let Some(&(_, d)) = pairs.iter().find(|(s, d)| *s == me && *d != me) {
        call.send(d, bytes_of(x, 0, x.numel()).await?).await?;
    }
    match pairs.iter().find(|(_, d)| *d == me) {
        Some(&(s, _)) if s == me => Ok(x.clone()),
        Some(&(s, _)) => {
            let b = call.recv_exact(s, x.numel() * 4).await?;
            Tensor::from_shared_le_bytes(b, x.shape())
        }
        None => x.zeros_like(),
    }
}

/// Dissemination barrier: in round `k` send to `me + 2^k`, receive from `me - 2^k` (recorded as
/// rounds `first + k`).
pub(crate) async fn barrier<T: Transport>(call: &Call<'_, T>, first: usize) -> Result<()> {
    let n = call.n;
    let mut d = 1;
    let mut round = first;
    while d < n {
        call.at(round, None, None);
        round += 1;
        call.send((call.me + d) % n, Bytes::new()).await?;
        call.recv_exact((call.me + n - d) % n, 0).await?;
        d <<= 1;
    }
    Ok(())
}
