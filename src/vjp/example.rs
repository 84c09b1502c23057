//! The built-in example case of each collective (`distgrad vjp <collective>`, the demo's
//! collective lessons, the page's free play): small numbers that make the collective's effect
//! visible.

use super::build::{Calls, build, output_names};
use super::case_err;
use super::{Case, TensorJson};
use crate::collective::{Kind, ReduceOp};
use crate::error::Result;
use crate::program::MAX_WORLD;

/// A built-in example case for `distgrad vjp <collective> --world N`: small integer inputs that
/// make each collective's effect visible (distinct values, the extreme on different ranks per
/// element), cotangents `[1, r+1]` on global rank `r` for every output, shaped like it.
pub fn example_case(
    which: Kind,
    world: usize,
    op: ReduceOp,
    root: usize,
    group: Option<Vec<usize>>,
) -> Result<Case> {
    if world == 0 || world > MAX_WORLD {
        return Err(case_err(format!(
            "world must be 1..={MAX_WORLD}, got {world}"
        )));
    }
    let members = group.clone().unwrap_or_else(|| (0..world).collect());
    let n = members.len();
    let inputs: Vec<Vec<TensorJson>> = (0..world)
        .map(|g| match members.iter().position(|&x| x == g) {
            None => Vec::new(),
            Some(r) => example_inputs(which, r, n, root),
        })
        .collect();
    let mut case = Case {
        collective: which.name().to_string(),
        world,
        op: which.takes_op().then(|| op.name().to_string()),
        root: which.takes_root().then_some(root),
        perm: (which == Kind::Permute).then(|| (0..n).map(|i| (i, (i + 1) % n)).collect()),
        in_splits: None,
        out_splits: None,
        group,
        inputs,
        cotangents: None,
    };
    if which == Kind::AllToAllSingle {
        // Rank r sends one row to each rank.
        let s: Vec<Vec<usize>> = (0..world)
            .map(|g| {
                if members.contains(&g) {
                    vec![1; n]
                } else {
                    Vec::new()
                }
            })
            .collect();
        case.in_splits = Some(s.clone());
        case.out_splits = Some(s);
    }
    case.cotangents = Some(example_cotangents(&case)?);
    Ok(case)
}

/// Group rank `r`'s inputs in the example of `which` (of `n` ranks, root `root`).
fn example_inputs(which: Kind, r: usize, n: usize, root: usize) -> Vec<TensorJson> {
    let t = |a: f32, b: f32| TensorJson {
        shape: vec![2],
        data: vec![Some(a), Some(b)],
    };
    let rf = r as f32;
    match which {
        Kind::Scatter if r == root => (0..n)
            .map(|j| t(j as f32 + 1.0, 10.0 * (j as f32 + 1.0)))
            .collect(),
        Kind::Scatter => Vec::new(),
        Kind::ReduceScatter | Kind::AllToAll => (0..n)
            .map(|j| t(10.0 * rf + j as f32 + 1.0, -(10.0 * rf + j as f32 + 1.0)))
            .collect(),
        Kind::AllToAllSingle => vec![TensorJson {
            shape: vec![n, 1],
            data: (0..n).map(|j| Some(10.0 * rf + j as f32 + 1.0)).collect(),
        }],
        _ => vec![t(rf + 1.0, 2.0 * (n as f32 - rf))],
    }
}

/// Cotangents `[1, g+1, 1, g+1, ...]` on global rank `g` for each of its outputs, shaped like
/// them: the shapes come from the check of the case's program (cotangents of ones).
fn example_cotangents(case: &Case) -> Result<Vec<Vec<TensorJson>>> {
    let calls = Calls::of(case)?;
    let plan = build(case, &calls)?.plan(None)?;
    Ok((0..case.world)
        .map(|g| {
            output_names(calls.kind, calls.n_outputs(g))
                .iter()
                .map(|y| {
                    let shape = plan.shape(g, y).unwrap_or_default().to_vec();
                    let numel: usize = shape.iter().product();
                    TensorJson {
                        shape,
                        data: (0..numel)
                            .map(|i| Some(if i % 2 == 0 { 1.0 } else { g as f32 + 1.0 }))
                            .collect(),
                    }
                })
                .collect()
        })
        .collect())
}
