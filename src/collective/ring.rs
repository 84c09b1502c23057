//! Ring algorithms, bandwidth-optimal for large payloads: each rank sends and receives `(n-1)/n` of
//! the data per phase, always to its successor and from its predecessor.
//!
//! all_reduce = reduce-scatter then all-gather over `n` chunks. Each chunk is reduced exactly once,
//! along one path (starting at the rank after its owner), then the finished chunk is passed around
//! unchanged, so every rank ends with bitwise identical results. On the CPU backend sends share the
//! chunk's memory (no copy); the only copies are the reduction itself and the final assembly.

use bytes::Bytes;
use futures::future::try_join;

use super::ReduceOp;
use super::call::Call;
use super::chunk_bounds;
use super::events::{Action, Chunk};
use crate::error::Result;
use crate::tensor::Tensor;
use crate::tensor::partial::{Partial, bytes_of};
use crate::transport::Transport;

/// Send `out` to the successor while receiving from the predecessor; check the received length.
async fn step<T: Transport>(call: &Call<'_, T>, out: Bytes, want_bytes: usize) -> Result<Bytes> {
    // try_join: if the receive fails (lost peer, abort) do not keep waiting on a blocked send.
    let recv = call.recv_exact(call.pred(), want_bytes);
    let ((), got) = try_join(call.send(call.succ(), out), recv).await?;
    Ok(got)
}

/// Ring all_reduce of `x` (group size ≥ 2), as successive ring passes over segments of
/// `n * segment` elements, so the chunks in flight stay in cache instead of streaming through
/// memory twice. The local steps run where `x` lives ([`Partial`]); the result goes there too.
pub(crate) async fn all_reduce<T: Transport>(
    call: &Call<'_, T>,
    x: &Tensor,
    op: ReduceOp,
    segment_bytes: usize,
) -> Result<Tensor> {
    let seg = (segment_bytes / 4).max(1) * call.n;
    let mut out = crate::pool::take(x.numel());
    let mut start = 0;
    let mut round = 0;
    while start < x.numel() {
        let len = seg.min(x.numel() - start);
        all_reduce_range(call, x, (start, len), round, op, &mut out).await?;
        start += len;
        round += 2 * (call.n - 1);
    }
    Tensor::from_vec(out, x.shape())?.to_device(&x.device())
}

/// One ring pass over the `len` elements of `x` from `base`, appending the result to `out`; its
/// steps recorded as rounds `round0..round0 + 2(n-1)`.
async fn all_reduce_range<T: Transport>(
    call: &Call<'_, T>,
    x: &Tensor,
    (base, len): (usize, usize),
    round0: usize,
    op: ReduceOp,
    out: &mut Vec<f32>,
) -> Result<()> {
    let (n, me) = (call.n, call.me);
    let chunks: Vec<(usize, usize)> = chunk_bounds(len, n)
        .into_iter()
        .map(|(s, l)| (base + s, l))
        .collect();
    let chunk = |c: usize| Chunk::part(c, n, chunks[c].0, chunks[c].1);

    // Reduce-scatter: at step s send chunk me-s, receive chunk me-s-1 and fold in our part of it.
    let (s0, l0) = chunks[me];
    let mut msg = bytes_of(x, s0, l0).await?;
    for s in 0..n - 1 {
        let c = (me + 2 * n - s - 1) % n;
        let (cs, cl) = chunks[c];
        call.at(round0 + s, Some(chunk((c + 1) % n)), Some(chunk(c)));
        let got = step(call, msg, cl * 4).await?;
        call.local(Action::Reduce, chunk(c));
        let mut acc = Partial::combine(x, cs, cl, op.combine(), &got)?;
        if s == n - 2 {
            acc.finish(op.final_scale(call.n))?;
        }
        msg = acc.into_bytes().await?;
    }
    // All-gather: we own chunk me+1.
    gather_phase(call, &chunks, round0 + n - 1, msg, out).await
}

/// all_reduce's second half, from round `round0`: this rank owns finished chunk `me+1` (`msg`);
/// pass the finished chunks around unchanged, then append them all, in order, to `out`.
async fn gather_phase<T: Transport>(
    call: &Call<'_, T>,
    chunks: &[(usize, usize)],
    round0: usize,
    mut msg: Bytes,
    out: &mut Vec<f32>,
) -> Result<()> {
    let (n, me) = (call.n, call.me);
    let chunk = |c: usize| Chunk::part(c, n, chunks[c].0, chunks[c].1);
    let mut parts: Vec<Bytes> = vec![Bytes::new(); n];
    parts[(me + 1) % n] = msg.clone();
    for s in 0..n - 1 {
        let c = (me + n - s) % n;
        call.at(round0 + s, Some(chunk((c + 1) % n)), Some(chunk(c)));
        let got = step(call, msg, chunks[c].1 * 4).await?;
        parts[c] = got.clone();
        msg = got;
    }
    for (c, p) in parts.iter().enumerate() {
        call.local(Action::Copy, chunk(c));
        crate::pool::extend_from_le_bytes(out, p);
    }
    Ok(())
}

/// Ring all_gather of equal-shape tensors (group size ≥ 1).
pub(crate) async fn all_gather<T: Transport>(
    call: &Call<'_, T>,
    x: &Tensor,
) -> Result<Vec<Tensor>> {
    let (n, me) = (call.n, call.me);
    let mut parts: Vec<Bytes> = vec![Bytes::new(); n];
    let mut out = bytes_of(x, 0, x.numel()).await?;
    let whole = |c: usize| Some(Chunk::entry(c, x.numel()));
    for s in 0..n - 1 {
        let c = (me + 2 * n - s - 1) % n;
        call.at(s, whole((c + 1) % n), whole(c));
        let got = step(call, out, x.numel() * 4).await?;
        parts[c] = got.clone();
        out = got;
    }
    // Our own part is the input itself (it stays where it is).
    parts
        .iter()
        .enumerate()
        .map(|(j, p)| {
            if j == me {
                Ok(x.clone())
            } else {
                Tensor::from_shared_le_bytes(p.clone(), x.shape())
            }
        })
        .collect()
}

/// Ring reduce_scatter: rank `j` ends with `op` over every rank's `xs[j]` (group size ≥ 2). The
/// local steps run where the tensors live ([`Partial`]); a GPU result is never read back.
pub(crate) async fn reduce_scatter<T: Transport>(
    call: &Call<'_, T>,
    xs: &[Tensor],
    op: ReduceOp,
) -> Result<Tensor> {
    let (n, me) = (call.n, call.me);
    let numel = xs[0].numel();
    // Block b starts at rank b+1 and ends, fully reduced, at rank b after n-1 steps.
    let mut out = bytes_of(&xs[(me + n - 1) % n], 0, numel).await?;
    for s in 0..n - 1 {
        let b = (me + 2 * n - 2 - s) % n;
        let block = |b: usize| Chunk::entry(b, numel);
        call.at(s, Some(block((b + 1) % n)), Some(block(b)));
        let got = step(call, out, numel * 4).await?;
        call.local(Action::Reduce, block(b));
        let mut acc = Partial::combine(&xs[b], 0, numel, op.combine(), &got)?;
        if s == n - 2 {
            acc.finish(op.final_scale(call.n))?;
            return acc.into_tensor(xs[0].shape());
        }
        out = acc.into_bytes().await?;
    }
    Err(crate::error::Error::invalid(
        "reduce_scatter",
        "the ring needs a group of two or more",
    ))
}
