//! The shapes a step makes from the shapes it reads, per rank: a local op's output shape, the
//! call each member of a collective makes, and a collective's output shapes from every member's
//! input shapes (checking what must agree across the group). No values: the checker
//! ([`super::check`]) runs these on shapes only.

use super::{LocalOp, StepKind};
use crate::collective::{Kind, Spec};
use crate::tensor::broadcast_shape;

/// Whether a collective's output is a list (bound as `out.0`, `out.1`, ...).
pub fn lists_outputs(kind: Kind) -> bool {
    matches!(kind, Kind::Gather | Kind::AllGather | Kind::AllToAll)
}

/// The sum of `xs`, `None` on overflow.
fn checked_sum(xs: &[usize]) -> Option<usize> {
    xs.iter().try_fold(0usize, |a, &x| a.checked_add(x))
}

/// Output shape of a local op, or why not.
pub(super) fn local_shape(
    op: &LocalOp,
    ins: &[&Vec<usize>],
) -> std::result::Result<Vec<usize>, String> {
    let same = |a: &Vec<usize>, b: &Vec<usize>| {
        if a == b {
            Ok(a.clone())
        } else {
            Err(format!("shapes {a:?} and {b:?} must be equal"))
        }
    };
    match op {
        LocalOp::Add {} | LocalOp::Sub {} | LocalOp::Mul {} => {
            broadcast_shape(op.name(), ins[0], ins[1]).map_err(|e| e.to_string())
        }
        LocalOp::Matmul {} => match (ins[0].as_slice(), ins[1].as_slice()) {
            (&[m, k], &[k2, n]) if k == k2 => Ok(vec![m, n]),
            (a, b) => Err(format!("matmul needs [m, k] x [k, n], got {a:?} x {b:?}")),
        },
        LocalOp::Scale { by } if !by.is_finite() => Err(format!("scale by {by}: not finite")),
        LocalOp::Scale { .. } | LocalOp::Relu {} | LocalOp::Tanh {} | LocalOp::Square {} => {
            Ok(ins[0].clone())
        }
        LocalOp::Sum {} | LocalOp::Mean {} => Ok(Vec::new()),
        LocalOp::MseLoss {} => same(ins[0], ins[1]).map(|_| Vec::new()),
        LocalOp::Reshape { shape } => {
            let a = crate::tensor::checked_numel(ins[0]);
            if a.is_some() && a == crate::tensor::checked_numel(shape) {
                Ok(shape.clone())
            } else {
                Err(format!("cannot reshape {:?} to {shape:?}", ins[0]))
            }
        }
        LocalOp::Slice { dim, start, len } => {
            let s = ins[0];
            match start.checked_add(*len) {
                Some(end) if *dim < s.len() && end <= s[*dim] => {
                    let mut o = s.clone();
                    o[*dim] = *len;
                    Ok(o)
                }
                _ => Err(format!(
                    "slice dim {dim} {start}..{start}+{len} is outside shape {s:?}"
                )),
            }
        }
        LocalOp::Concat { dim } => {
            let first = ins[0];
            if *dim >= first.len() {
                return Err(format!("concat dim {dim} is outside shape {first:?}"));
            }
            let mut o = first.clone();
            o[*dim] = 0;
            for s in ins {
                let mut a = (*s).clone();
                if a.len() != first.len() {
                    return Err(format!("concat of {first:?} and {s:?}"));
                }
                o[*dim] = o[*dim]
                    .checked_add(a[*dim])
                    .ok_or_else(|| format!("concat along {dim}: the sizes overflow"))?;
                a[*dim] = first[*dim];
                if &a != first {
                    return Err(format!(
                        "concat along {dim}: {first:?} and {s:?} differ elsewhere"
                    ));
                }
            }
            Ok(o)
        }
    }
}

/// The call each group rank makes (all_to_all_single's per-rank splits filled in).
pub(super) fn group_specs(kind: &StepKind, n: usize) -> std::result::Result<Vec<Spec>, String> {
    match kind {
        StepKind::Local(_) | StepKind::For(_) => Err("internal: not a collective".into()),
        StepKind::Collective { spec, splits: None } => Ok(vec![spec.clone(); n]),
        StepKind::Collective {
            splits:
                Some(super::Splits {
                    in_splits: ins,
                    out_splits: outs,
                }),
            ..
        } => {
            if ins.len() != n || ins.iter().any(|s| s.len() != n) {
                return Err(format!(
                    "in_splits {ins:?}: one list of {n} sizes per group rank ({n})"
                ));
            }
            if let Some(o) = outs
                && (o.len() != n || o.iter().any(|s| s.len() != n))
            {
                return Err(format!(
                    "out_splits {o:?}: one list of {n} sizes per group rank ({n})"
                ));
            }
            Ok((0..n)
                .map(|r| Spec::AllToAllSingle {
                    in_splits: ins[r].clone(),
                    out_splits: match outs {
                        Some(o) => o[r].clone(),
                        None => ins.iter().map(|s| s[r]).collect(),
                    },
                })
                .collect())
        }
    }
}

/// Output shapes of a collective per group rank, from every member's input shapes.
pub(super) fn collective_shapes(
    specs: &[Spec],
    ins: &[Vec<Vec<usize>>],
    who: &dyn Fn(usize) -> String,
) -> std::result::Result<Vec<Vec<Vec<usize>>>, String> {
    let n = specs.len();
    let kind = specs[0].kind();
    let agree = |shapes: Vec<(usize, &Vec<usize>)>| -> std::result::Result<Vec<usize>, String> {
        let (r0, first) = shapes[0];
        for (r, s) in &shapes {
            if *s != first {
                return Err(format!(
                    "shapes must agree across the group: {} passes {first:?}, {} passes {s:?}",
                    who(r0),
                    who(*r)
                ));
            }
        }
        Ok(first.clone())
    };
    let singles = || agree((0..n).map(|r| (r, &ins[r][0])).collect());
    Ok(match &specs[0] {
        Spec::Broadcast { .. } | Spec::AllReduce { .. } | Spec::Permute { .. } => {
            vec![vec![singles()?]; n]
        }
        Spec::Reduce { root, .. } => {
            let s = singles()?;
            (0..n)
                .map(|r| if r == *root { vec![s.clone()] } else { vec![] })
                .collect()
        }
        Spec::Gather { root } => {
            let s = singles()?;
            (0..n)
                .map(|r| {
                    if r == *root {
                        vec![s.clone(); n]
                    } else {
                        vec![]
                    }
                })
                .collect()
        }
        Spec::AllGather {} => vec![vec![singles()?; n]; n],
        Spec::Scatter { root } => {
            let s = agree(ins[*root].iter().map(|s| (*root, s)).collect())?;
            vec![vec![s]; n]
        }
        Spec::ReduceScatter { .. } => {
            let all: Vec<(usize, &Vec<usize>)> = (0..n)
                .flat_map(|r| ins[r].iter().map(move |s| (r, s)))
                .collect();
            vec![vec![agree(all)?]; n]
        }
        Spec::AllToAll {} => (0..n)
            .map(|d| (0..n).map(|i| ins[i][d].clone()).collect())
            .collect(),
        Spec::AllToAllSingle { .. } => {
            let mut rest: Vec<(usize, Vec<usize>)> = Vec::with_capacity(n);
            for (r, spec) in specs.iter().enumerate() {
                let Spec::AllToAllSingle { in_splits, .. } = spec else {
                    return Err("internal: mixed calls".into());
                };
                let x = &ins[r][0];
                let rows = checked_sum(in_splits)
                    .ok_or_else(|| format!("{}: in_splits {in_splits:?} overflow", who(r)))?;
                if x.first() != Some(&rows) {
                    return Err(format!(
                        "{} sends in_splits {in_splits:?} ({rows} rows) of a tensor of shape {x:?}",
                        who(r)
                    ));
                }
                rest.push((r, x[1..].to_vec()));
            }
            agree(rest.iter().map(|(r, s)| (*r, s)).collect())
                .map_err(|e| format!("all but the first dimension: {e}"))?;
            let mut outs = Vec::with_capacity(n);
            for (me, spec) in specs.iter().enumerate() {
                let Spec::AllToAllSingle { out_splits, .. } = spec else {
                    return Err("internal: mixed calls".into());
                };
                for (i, other) in specs.iter().enumerate() {
                    let Spec::AllToAllSingle { in_splits, .. } = other else {
                        return Err("internal: mixed calls".into());
                    };
                    if out_splits[i] != in_splits[me] {
                        return Err(format!(
                            "{} expects {} rows from {}, which sends it {}",
                            who(me),
                            out_splits[i],
                            who(i),
                            in_splits[me]
                        ));
                    }
                }
                let rows = checked_sum(out_splits)
                    .ok_or_else(|| format!("{}: out_splits {out_splits:?} overflow", who(me)))?;
                let mut s = vec![rows];
                s.extend_from_slice(&rest[me].1);
                outs.push(vec![s]);
            }
            outs
        }
        Spec::Send { .. } | Spec::Recv { .. } | Spec::Barrier {} => {
            return Err("internal: point-to-point handled apart".into());
        }
    })
    .inspect(|o| debug_assert_eq!(o.len(), n, "{kind:?}: one list per group rank"))
}
