//! Differentiable collectives on [`Var`]s (the spirit of PyTorch's `torch.distributed.nn.functional`):
//! each runs the collective through a [`Communicator`] and records it on the tape, so that
//! [`Tape::backward`] runs its dual (see [`crate::autograd::dual`]).
//!
//! Roots and peers are GROUP ranks. Outputs are fresh tensors (out-of-place). In replicated mode
//! ([`Objective::Replicated`]) inputs that are invariant are first made varying, and all_reduce
//! outputs are invariant across the group.

use crate::autograd::{Collective, DualRule, Objective, Op, Tape, Var};
use crate::collective::{Communicator, Group, ReduceOp, Spec};
use crate::error::{Error, Result};
use crate::tensor::Tensor;

/// Replicated mode: an input only some ranks of its invariance group pass (scatter's root, a
/// send) cannot be made varying there: the dual of that is an all_reduce over the whole group,
/// which the other ranks would not run. Refuse it, naming the fix.
fn one_sided(op: &'static str, xs: &[Var]) -> Result<()> {
    match xs
        .iter()
        .find_map(|x| x.invariant().filter(|g| g.size() > 1))
    {
        Some(g) => Err(Error::invalid(
            op,
            format!(
                "under the replicated objective this rank's input is invariant over group {} ({} ranks), but only this rank passes it: make it varying on every rank of that group first (Var::make_varying)",
                g.id(),
                g.size()
            ),
        )),
        None => Ok(()),
    }
}

/// Replicated mode: invariant inputs enter a collective as varying values.
fn varying(x: &Var) -> Var {
    match x.invariant() {
        Some(g) => x.make_varying(&g),
        None => x.clone(),
    }
}

/// Record a call that ran (not replicated: outputs vary across ranks).
fn record(
    tape: &Tape,
    spec: Spec,
    group: &Group,
    inputs: &[&Var],
    outputs: Vec<Tensor>,
) -> Vec<Var> {
    let c = Collective::Call {
        spec,
        group: group.clone(),
        replicated: false,
        rule: DualRule::Distgrad,
    };
    tape.record(Op::Collective(c), inputs, outputs, None)
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
    let spec = Spec::Broadcast { root };
    Ok(record(x.tape(), spec, group, &[&x], vec![y]).remove(0))
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
    let spec = Spec::Reduce { root, op };
    let outs = record(x.tape(), spec, group, &[&x], y.into_iter().collect());
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
    let c = Collective::Call {
        spec: Spec::AllReduce { op },
        group: group.clone(),
        replicated,
        rule: DualRule::Distgrad,
    };
    let inv = replicated.then(|| group.clone());
    Ok(x.tape()
        .record(Op::Collective(c), &[&x], vec![y], inv)
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
    let spec = Spec::Gather { root };
    let outs = record(x.tape(), spec, group, &[&x], ys.unwrap_or_default());
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
    checked(comm, one_sided("scatter", xs.unwrap_or_default())).await?;
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
    let refs: Vec<&Var> = xs.iter().collect();
    Ok(record(tape, Spec::Scatter { root }, group, &refs, vec![y]).remove(0))
}

/// Every rank gets every rank's value; gradient: reduce_scatter(SUM).
pub async fn all_gather<C: Communicator>(comm: &C, x: &Var, group: &Group) -> Result<Vec<Var>> {
    let x = varying(x);
    let ys = comm.all_gather(&x.value(), group).await?;
    Ok(record(x.tape(), Spec::AllGather {}, group, &[&x], ys))
}

/// The tape of a non-empty list of vars, all on one tape (else abort: the others would wait).
async fn list_tape<C: Communicator>(comm: &C, op: &'static str, xs: &[Var]) -> Result<Tape> {
    let first = xs.first().ok_or_else(|| Error::invalid(op, "empty list"));
    let tape = checked(comm, first).await?.tape().clone();
    checked(comm, same_tape(op, &tape, xs)).await?;
    Ok(tape)
}

/// Rank `j` gets `op` over every rank's `xs[j]`; gradient: all_gather (and the op's local factor).
pub async fn reduce_scatter<C: Communicator>(
    comm: &C,
    xs: &[Var],
    op: ReduceOp,
    group: &Group,
) -> Result<Var> {
    let tape = list_tape(comm, "reduce_scatter", xs).await?;
    let xs: Vec<Var> = xs.iter().map(varying).collect();
    let values: Vec<Tensor> = xs.iter().map(Var::value).collect();
    let y = comm.reduce_scatter(&values, op, group).await?;
    let refs: Vec<&Var> = xs.iter().collect();
    Ok(record(&tape, Spec::ReduceScatter { op }, group, &refs, vec![y]).remove(0))
}

/// `xs[j]` goes to rank `j`; output `i` came from rank `i`. Gradient: all_to_all of the cotangents.
pub async fn all_to_all<C: Communicator>(comm: &C, xs: &[Var], group: &Group) -> Result<Vec<Var>> {
    let tape = list_tape(comm, "all_to_all", xs).await?;
    let xs: Vec<Var> = xs.iter().map(varying).collect();
    let values: Vec<Tensor> = xs.iter().map(Var::value).collect();
    let ys = comm.all_to_all(&values, group).await?;
    let refs: Vec<&Var> = xs.iter().collect();
    Ok(record(&tape, Spec::AllToAll {}, group, &refs, ys))
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
    let spec = Spec::AllToAllSingle {
        in_splits: in_splits.to_vec(),
        out_splits: out_splits.to_vec(),
    };
    Ok(record(x.tape(), spec, group, &[&x], vec![y]).remove(0))
}

/// Send `x` to group rank `dst`; gradient: receive the cotangent back from `dst`.
pub async fn send<C: Communicator>(comm: &C, x: &Var, dst: usize, group: &Group) -> Result<()> {
    checked(comm, one_sided("send", std::slice::from_ref(x))).await?;
    let x = varying(x);
    comm.send(&x.value(), dst, group).await?;
    record(x.tape(), Spec::Send { dst }, group, &[&x], vec![]);
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
    let spec = Spec::Recv {
        src,
        shape: shape.to_vec(),
    };
    Ok(record(tape, spec, group, &[], vec![y]).remove(0))
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
    let spec = Spec::Permute {
        perm: pairs.to_vec(),
    };
    Ok(record(x.tape(), spec, group, &[&x], vec![y]).remove(0))
}

/// Wait for every rank of the group; no gradient.
pub async fn barrier<C: Communicator>(comm: &C, tape: &Tape, group: &Group) -> Result<()> {
    comm.barrier(group).await?;
    record(tape, Spec::Barrier {}, group, &[], vec![]);
    Ok(())
}

/// Run the call `spec` describes on this rank's `xs` (as many as [`Spec::n_inputs`] says; recv
/// and barrier take none and record on `tape`) and record it: the outputs, as many as
/// [`Spec::n_outputs`] says (none off the root of reduce / gather, none for send and barrier).
///
/// This is the one forward of a described call: `vjp` cases, lessons, programs and the test suites
/// run collectives through it. A wrong number of inputs or arguments outside the group are
/// errors on this rank, and the group is aborted so the others do not wait.
pub async fn call<C: Communicator>(
    comm: &C,
    tape: &Tape,
    spec: &Spec,
    xs: &[Var],
    group: &Group,
) -> Result<Vec<Var>> {
    let me = group.require_member(spec.kind().name())?;
    let n = group.size();
    checked(comm, spec.check(me, n)).await?;
    let want = spec.n_inputs(me, n);
    if xs.len() != want {
        let e = Error::invalid(
            spec.kind().name(),
            format!(
                "{spec} takes {want} input tensor(s) on group rank {me} (group size {n}), got {}",
                xs.len()
            ),
        );
        return checked(comm, Err(e)).await;
    }
    let one = || &xs[0];
    Ok(match spec {
        Spec::Broadcast { root } => vec![broadcast(comm, one(), *root, group).await?],
        Spec::Reduce { root, op } => reduce(comm, one(), *root, *op, group)
            .await?
            .into_iter()
            .collect(),
        Spec::AllReduce { op } => vec![all_reduce(comm, one(), *op, group).await?],
        Spec::Gather { root } => gather(comm, one(), *root, group).await?.unwrap_or_default(),
        Spec::Scatter { root } => {
            let list = (me == *root).then_some(xs);
            vec![scatter(comm, tape, list, *root, group).await?]
        }
        Spec::AllGather {} => all_gather(comm, one(), group).await?,
        Spec::ReduceScatter { op } => vec![reduce_scatter(comm, xs, *op, group).await?],
        Spec::AllToAll {} => all_to_all(comm, xs, group).await?,
        Spec::AllToAllSingle {
            in_splits,
            out_splits,
        } => vec![all_to_all_single(comm, one(), in_splits, out_splits, group).await?],
        Spec::Permute { perm } => vec![permute(comm, one(), perm, group).await?],
        Spec::Send { dst } => {
            send(comm, one(), *dst, group).await?;
            vec![]
        }
        Spec::Recv { src, shape } => vec![recv(comm, tape, shape, *src, group).await?],
        Spec::Barrier {} => {
            barrier(comm, tape, group).await?;
            vec![]
        }
    })
}

#[cfg(all(test, not(target_arch = "wasm32")))]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::collective::CommOptions;
    use crate::in_process::run_local;

    fn opts() -> CommOptions {
        CommOptions {
            timeout: Duration::from_secs(5),
            ..CommOptions::default()
        }
    }

    /// A described call from JSON runs like the typed function: reduce(MAX) to root 1 of 3.
    #[test]
    fn call_from_json_matches_the_typed_function() {
        let spec: Spec =
            serde_json::from_str(r#"{"collective":"reduce","root":1,"op":"max"}"#).expect("spec");
        let res = run_local(3, opts(), |comm| {
            let spec = spec.clone();
            async move {
                let tape = Tape::new();
                let x = tape.var(Tensor::vector(&[comm.rank() as f32, -(comm.rank() as f32)]));
                let ys = call(&comm, &tape, &spec, std::slice::from_ref(&x), &comm.world()).await?;
                let grads = match ys.first() {
                    Some(y) => tape.backward(&y.sum()?, &comm).await?,
                    None => tape.backward_from(&[], &comm).await?,
                };
                let y: Vec<Vec<f32>> = ys.iter().map(|y| y.value().to_vec()).collect();
                Ok((y, grads.wrt(&x)?.to_vec()))
            }
        });
        let res: Vec<_> = res.into_iter().map(|r| r.expect("rank")).collect();
        // Only the root gets [max(0,1,2), max(0,-1,-2)] = [2, 0].
        assert_eq!(res[0].0, Vec::<Vec<f32>>::new());
        assert_eq!(res[1].0, vec![vec![2.0, 0.0]]);
        assert_eq!(res[2].0, Vec::<Vec<f32>>::new());
        // Gradient of the root's sum goes to the rank holding each maximum.
        assert_eq!(res[2].1, vec![1.0, 0.0]);
        assert_eq!(res[0].1, vec![0.0, 1.0]);
        assert_eq!(res[1].1, vec![0.0, 0.0]);
    }

    /// A wrong number of inputs is an error on that rank, and the others are released (abort),
    /// not left waiting for the timeout.
    #[test]
    fn call_refuses_wrong_arity_and_releases_the_others() {
        let started = std::time::Instant::now();
        let res = run_local(2, opts(), |comm| async move {
            let tape = Tape::new();
            let x = tape.var(Tensor::vector(&[1.0]));
            let xs = if comm.rank() == 0 {
                vec![x.clone(), x]
            } else {
                vec![x]
            };
            let spec = Spec::AllReduce { op: ReduceOp::Sum };
            call(&comm, &tape, &spec, &xs, &comm.world())
                .await
                .map(|ys| ys.len())
        });
        let e0 = res[0].as_ref().expect_err("rank 0 passed two inputs");
        assert!(
            e0.to_string()
                .contains("takes 1 input tensor(s) on group rank 0"),
            "{e0}"
        );
        assert!(res[1].is_err(), "rank 1 must fail too");
        assert!(
            started.elapsed() < Duration::from_secs(4),
            "released by abort"
        );
    }

    /// Peers outside the group and messages to oneself are refused before anything is sent.
    #[test]
    fn call_checks_peers() {
        let res = run_local(2, opts(), |comm| async move {
            let tape = Tape::new();
            let x = tape.var(Tensor::vector(&[1.0]));
            let spec = Spec::Send { dst: comm.rank() };
            call(&comm, &tape, &spec, &[x], &comm.world())
                .await
                .map(|ys| ys.len())
        });
        for r in res {
            let e = r.expect_err("send to self");
            assert!(e.to_string().contains("cannot message itself"), "{e}");
        }
    }
}
