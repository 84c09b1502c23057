//! Differentiable collectives on [`Var`]s (the spirit of PyTorch's `torch.distributed.nn.functional`):
//! each runs the collective through a [`Communicator`] and records it on the tape, so that
//! [`Tape::backward`] runs its dual (see [`crate::autograd::dual`]).
//!
//! Roots and peers are GROUP ranks. Outputs are fresh tensors (out-of-place). In replicated mode
//! ([`Objective::Replicated`]) inputs that are invariant are first made varying, and all_reduce
//! outputs are invariant across the group.

use crate::autograd::{Collective, Objective, Op, Tape, Var};
use crate::collective::{Communicator, Group, ReduceOp};
use crate::error::{Error, Result};
use crate::tensor::Tensor;

/// Replicated mode: invariant inputs enter a collective as varying values.
fn varying(x: &Var) -> Var {
    match x.invariant() {
        Some(g) => x.make_varying(&g),
        None => x.clone(),
    }
}

fn record(
    tape: &Tape,
    c: Collective,
    inputs: &[&Var],
    outputs: Vec<Tensor>,
    inv: Option<Group>,
) -> Vec<Var> {
    tape.record(Op::Collective(c), inputs, outputs, inv)
}

/// A local check before a collective: if it fails, abort so the other ranks do not wait for us.
async fn checked<C: Communicator, R>(comm: &C, r: Result<R>) -> Result<R> {
    if let Err(e) = &r {
        comm.abort(&e.to_string()).await;
    }
    r
}

fn same_tape(op: &'static str, tape: &Tape, xs: &[Var]) -> Result<()> {
    xs.iter().try_for_each(|x| tape.check(op, x))
}

/// Every rank gets `root`'s value; gradient: reduce(root, SUM) back to the root, zeros elsewhere.
pub async fn broadcast<C: Communicator>(
    comm: &C,
    x: &Var,
    root: usize,
    group: &Group,
) -> Result<Var> {
    let x = varying(x);
    let y = comm.broadcast(&x.value(), root, group).await?;
    let c = Collective::Broadcast {
        root,
        group: group.clone(),
    };
    Ok(record(x.tape(), c, &[&x], vec![y], None).remove(0))
}

/// `root` gets `op` over all ranks (`Some`), others `None`; gradient: broadcast(root) and the op's
/// local factor.
pub async fn reduce<C: Communicator>(
    comm: &C,
    x: &Var,
    root: usize,
    op: ReduceOp,
    group: &Group,
) -> Result<Option<Var>> {
    let x = varying(x);
    let y = comm.reduce(&x.value(), root, op, group).await?;
    let c = Collective::Reduce {
        root,
        op,
        group: group.clone(),
    };
    let outs = record(x.tape(), c, &[&x], y.into_iter().collect(), None);
    Ok(outs.into_iter().next())
}

/// Every rank gets `op` over all ranks. Default objective: gradient all_reduce(SUM/AVG) of the
/// cotangents (times the op's local factor for MAX/MIN/PROD). Replicated objective: the output is
/// invariant and the all_reduce in the gradient disappears.
pub async fn all_reduce<C: Communicator>(
    comm: &C,
    x: &Var,
    op: ReduceOp,
    group: &Group,
) -> Result<Var> {
    let x = varying(x);
    let replicated = x.tape().objective() == Objective::Replicated;
    let y = comm.all_reduce(&x.value(), op, group).await?;
    let c = Collective::AllReduce {
        op,
        group: group.clone(),
        replicated,
    };
    Ok(record(
        x.tape(),
        c,
        &[&x],
        vec![y],
        replicated.then(|| group.clone()),
    )
    .remove(0))
}

/// `root` gets every rank's value (`Some`, group-rank order); gradient: scatter(root).
pub async fn gather<C: Communicator>(
    comm: &C,
    x: &Var,
    root: usize,
    group: &Group,
) -> Result<Option<Vec<Var>>> {
    let x = varying(x);
    let ys = comm.gather(&x.value(), root, group).await?;
    let is_root = ys.is_some();
    let c = Collective::Gather {
        root,
        group: group.clone(),
    };
    let outs = record(x.tape(), c, &[&x], ys.unwrap_or_default(), None);
    Ok(is_root.then_some(outs))
}

/// Rank `j` gets the root's `xs[j]`; only the root passes `Some(xs)`. Gradient: gather(root).
pub async fn scatter<C: Communicator>(
    comm: &C,
    tape: &Tape,
    xs: Option<&[Var]>,
    root: usize,
    group: &Group,
) -> Result<Var> {
    let xs: Vec<Var> = xs
        .map(|xs| xs.iter().map(varying).collect())
        .unwrap_or_default();
    checked(comm, same_tape("scatter", tape, &xs)).await?;
    let values: Vec<Tensor> = xs.iter().map(Var::value).collect();
    let list = (group.rank() == Some(root)).then_some(values.as_slice());
    if list.is_none() && !xs.is_empty() {
        let e = Error::invalid("scatter", format!("only the root ({root}) passes a list"));
        return checked(comm, Err(e)).await;
    }
    let y = comm.scatter(list, root, group).await?;
    let c = Collective::Scatter {
        root,
        group: group.clone(),
    };
    let refs: Vec<&Var> = xs.iter().collect();
    Ok(record(tape, c, &refs, vec![y], None).remove(0))
}

/// Every rank gets every rank's value; gradient: reduce_scatter(SUM).
pub async fn all_gather<C: Communicator>(comm: &C, x: &Var, group: &Group) -> Result<Vec<Var>> {
    let x = varying(x);
    let ys = comm.all_gather(&x.value(), group).await?;
    let c = Collective::AllGather {
        group: group.clone(),
    };
    Ok(record(x.tape(), c, &[&x], ys, None))
}

/// Rank `j` gets `op` over every rank's `xs[j]`; gradient: all_gather (and the op's local factor).
pub async fn reduce_scatter<C: Communicator>(
    comm: &C,
    xs: &[Var],
    op: ReduceOp,
    group: &Group,
) -> Result<Var> {
    let first = xs
        .first()
        .ok_or_else(|| Error::invalid("reduce_scatter", "empty list"));
    let first = checked(comm, first).await?;
    let tape = first.tape().clone();
    checked(comm, same_tape("reduce_scatter", &tape, xs)).await?;
    let xs: Vec<Var> = xs.iter().map(varying).collect();
    let values: Vec<Tensor> = xs.iter().map(Var::value).collect();
    let y = comm.reduce_scatter(&values, op, group).await?;
    let c = Collective::ReduceScatter {
        op,
        group: group.clone(),
    };
    let refs: Vec<&Var> = xs.iter().collect();
    Ok(record(&tape, c, &refs, vec![y], None).remove(0))
}

/// `xs[j]` goes to rank `j`; output `i` came from rank `i`. Gradient: all_to_all of the cotangents.
pub async fn all_to_all<C: Communicator>(comm: &C, xs: &[Var], group: &Group) -> Result<Vec<Var>> {
    let first = xs
        .first()
        .ok_or_else(|| Error::invalid("all_to_all", "empty list"));
    let first = checked(comm, first).await?;
    let tape = first.tape().clone();
    checked(comm, same_tape("all_to_all", &tape, xs)).await?;
    let xs: Vec<Var> = xs.iter().map(varying).collect();
    let values: Vec<Tensor> = xs.iter().map(Var::value).collect();
    let ys = comm.all_to_all(&values, group).await?;
    let c = Collective::AllToAll {
        group: group.clone(),
    };
    let refs: Vec<&Var> = xs.iter().collect();
    Ok(record(&tape, c, &refs, ys, None))
}

/// Single-tensor all_to_all along dim 0 with uneven splits; gradient: the same with splits swapped.
pub async fn all_to_all_single<C: Communicator>(
    comm: &C,
    x: &Var,
    in_splits: &[usize],
    out_splits: &[usize],
    group: &Group,
) -> Result<Var> {
    let x = varying(x);
    let y = comm
        .all_to_all_single(&x.value(), in_splits, out_splits, group)
        .await?;
    let c = Collective::AllToAllSingle {
        in_splits: in_splits.to_vec(),
        out_splits: out_splits.to_vec(),
        group: group.clone(),
    };
    Ok(record(x.tape(), c, &[&x], vec![y], None).remove(0))
}

/// Send `x` to group rank `dst`; gradient: receive the cotangent back from `dst`.
pub async fn send<C: Communicator>(comm: &C, x: &Var, dst: usize, group: &Group) -> Result<()> {
    let x = varying(x);
    comm.send(&x.value(), dst, group).await?;
    let c = Collective::Send {
        dst,
        group: group.clone(),
    };
    record(x.tape(), c, &[&x], vec![], None);
    Ok(())
}

/// Receive a tensor of `shape` from group rank `src`; gradient: send the cotangent back to `src`.
pub async fn recv<C: Communicator>(
    comm: &C,
    tape: &Tape,
    shape: &[usize],
    src: usize,
    group: &Group,
) -> Result<Var> {
    let y = comm.recv(shape, src, group).await?;
    let c = Collective::Recv {
        src,
        group: group.clone(),
    };
    Ok(record(tape, c, &[], vec![y], None).remove(0))
}

/// `dst` gets `src`'s value for each `(src, dst)` pair, zeros if it receives nothing; gradient:
/// permute with the inverse pairs.
pub async fn permute<C: Communicator>(
    comm: &C,
    x: &Var,
    pairs: &[(usize, usize)],
    group: &Group,
) -> Result<Var> {
    let x = varying(x);
    let y = comm.permute(&x.value(), pairs, group).await?;
    let c = Collective::Permute {
        pairs: pairs.to_vec(),
        group: group.clone(),
    };
    Ok(record(x.tape(), c, &[&x], vec![y], None).remove(0))
}

/// Wait for every rank of the group; no gradient.
pub async fn barrier<C: Communicator>(comm: &C, tape: &Tape, group: &Group) -> Result<()> {
    comm.barrier(group).await?;
    record(
        tape,
        Collective::Barrier {
            group: group.clone(),
        },
        &[],
        vec![],
        None,
    );
    Ok(())
}
