//! Duals that are wrong on purpose, for teaching: the backward passes other libraries ran (or
//! still run) for a collective, which a lesson puts next to distgrad's on the same inputs so the
//! gradient check can say which is right. A program step selects one with `"dual"` (see
//! [`crate::program`]); nothing else reaches them, and `distgrad gradcheck` fails them.
//!
//! | rule | collective | what its backward does | why it is wrong |
//! |---|---|---|---|
//! | `seed` | all_reduce(op) | all_reduce(op) of the cotangents (PyTorch's original functional collectives) | MAX / MIN: the largest cotangent reaches every rank, not the cotangents' sum the extreme's holder should get; PROD: a product of cotangents; under the replicated objective it sums an invariant loss's gradient over the ranks (× N) |
//! | `seed` | reduce(root, op) | broadcast(root) of the root's cotangent, whatever the op | right for SUM only |
//! | `divide` | all_reduce(PROD) | Σ cotangents × product / own input | 0 / 0 where this rank's input is 0 (the product of the others is not) |
//! | `global_root` | broadcast(root) on a subgroup | reduce(SUM) to the root, kept where this rank's GROUP rank equals the root's GLOBAL rank (PyTorch #130515) | on a subgroup where they differ the root's gradient is zeroed |
//! | `forget_reduce` | all_gather, all_reduce(SUM) | this rank's own cotangent only: all_gather's own chunk (no reduce_scatter), all_reduce's own (identity) | the other ranks' use of this rank's value is lost: a tensor-parallel shard learns only from its own rank's loss |

use serde::{Deserialize, Serialize};

use crate::collective::{Communicator, Group, ReduceOp, Spec};
use crate::error::{Error, Result};
use crate::tensor::Tensor;

/// Which backward a collective runs: distgrad's dual (the default, the table in
/// [`super::dual`]), or one of the wrong ones a lesson selects to show what goes wrong (the
/// module docs say what each does and why it is wrong).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DualRule {
    /// distgrad's dual.
    #[default]
    Distgrad,
    /// The seed's (PyTorch's original `torch.distributed.nn.functional`): all_reduce repeats
    /// its own op on the cotangents, reduce broadcasts whatever the op, neither knows the
    /// replicated objective.
    Seed,
    /// all_reduce(PROD): the product of the other ranks' inputs computed as product / own input.
    Divide,
    /// broadcast on a subgroup: the root's GLOBAL rank compared with this rank's GROUP rank.
    GlobalRoot,
    /// all_gather / all_reduce(SUM) without the reduce in backward: this rank's own cotangent
    /// only (a tensor-parallel layer's classic bug).
    ForgetReduce,
}

impl DualRule {
    /// Every rule, distgrad's first.
    pub const ALL: [DualRule; 5] = [
        DualRule::Distgrad,
        DualRule::Seed,
        DualRule::Divide,
        DualRule::GlobalRoot,
        DualRule::ForgetReduce,
    ];

    /// The name in JSON and in messages.
    pub fn name(self) -> &'static str {
        match self {
            DualRule::Distgrad => "distgrad",
            DualRule::Seed => "seed",
            DualRule::Divide => "divide",
            DualRule::GlobalRoot => "global_root",
            DualRule::ForgetReduce => "forget_reduce",
        }
    }

    /// The rule as a lesson names its backward: `the seed's dual`.
    pub fn label(self) -> &'static str {
        match self {
            DualRule::Distgrad => "distgrad's dual",
            DualRule::Seed => "the seed's dual",
            DualRule::Divide => "the dividing dual",
            DualRule::GlobalRoot => "the global-root dual",
            DualRule::ForgetReduce => "the dual that forgets the reduce",
        }
    }

    /// What the rule's backward does, in a few words (reports, the page).
    pub fn describe(self) -> &'static str {
        match self {
            DualRule::Distgrad => "distgrad's dual",
            DualRule::Seed => {
                "the seed's backward (PyTorch's original functional collectives): all_reduce repeats its op on the gradients, reduce broadcasts whatever the op"
            }
            DualRule::Divide => "the product of the others as product ÷ own input",
            DualRule::GlobalRoot => {
                "the root's global rank compared with this rank's group rank (PyTorch #130515)"
            }
            DualRule::ForgetReduce => {
                "the backward without its reduce: this rank's own cotangent only (all_gather's own chunk, all_reduce's own)"
            }
        }
    }

    /// Whether this rule changes the backward of `spec` (distgrad's applies to every call); a
    /// program step naming a rule for a call it does not change is refused, so a lesson cannot
    /// show a "wrong" dual that is the right one.
    pub fn applies_to(self, spec: &Spec) -> std::result::Result<(), String> {
        let ok = match (self, spec) {
            (DualRule::Distgrad, _) => true,
            (DualRule::Seed, Spec::AllReduce { .. } | Spec::Reduce { .. }) => true,
            (DualRule::Divide, Spec::AllReduce { op }) => *op == ReduceOp::Prod,
            (DualRule::GlobalRoot, Spec::Broadcast { .. }) => true,
            (DualRule::ForgetReduce, Spec::AllGather {}) => true,
            (DualRule::ForgetReduce, Spec::AllReduce { op }) => *op == ReduceOp::Sum,
            _ => false,
        };
        if ok {
            return Ok(());
        }
        let for_what = match self {
            DualRule::Distgrad => "",
            DualRule::Seed => "all_reduce and reduce",
            DualRule::Divide => "all_reduce(op=prod)",
            DualRule::GlobalRoot => "broadcast",
            DualRule::ForgetReduce => "all_gather and all_reduce(op=sum)",
        };
        Err(format!(
            "the \"{}\" dual is for {for_what}, not {spec} (the dual rules: {})",
            self.name(),
            DualRule::ALL.map(DualRule::name).join(", ")
        ))
    }
}

/// The call a wrong dual runs for: what ran, among which ranks, and whether its output was
/// marked invariant (all_reduce under the replicated objective).
pub(super) struct Called<'a> {
    pub(super) spec: &'a Spec,
    pub(super) group: &'a Group,
    pub(super) replicated: bool,
}

/// Run the wrong dual `rule` of the call `c` (see the module docs); `None` where the rule does
/// not change this call (distgrad's dual runs).
pub(super) async fn dual<C: Communicator>(
    rule: DualRule,
    c: Called<'_>,
    comm: &C,
    xs: &[Tensor],
    ys: &[Tensor],
    gs: &[Tensor],
) -> Result<Option<Vec<Tensor>>> {
    let Called {
        spec,
        group,
        replicated,
    } = c;
    Ok(Some(match (rule, spec) {
        (DualRule::Seed, Spec::AllReduce { op }) => {
            vec![comm.all_reduce(&gs[0], *op, group).await?]
        }
        (DualRule::Seed, Spec::Reduce { root, .. }) => {
            let g = match gs.first() {
                Some(g) => g.clone(),
                None => xs[0].zeros_like()?,
            };
            vec![comm.broadcast(&g, *root, group).await?]
        }
        (DualRule::Divide, Spec::AllReduce { op: ReduceOp::Prod }) => {
            let s = if replicated {
                gs[0].clone()
            } else {
                comm.all_reduce(&gs[0], ReduceOp::Sum, group).await?
            };
            vec![s.mul(&ys[0])?.div(&xs[0])?]
        }
        (DualRule::GlobalRoot, Spec::Broadcast { root }) => {
            vec![global_root(comm, &xs[0], &gs[0], *root, group).await?]
        }
        (DualRule::ForgetReduce, Spec::AllGather {}) => {
            let me = group.require_member("all_gather backward")?;
            vec![gs.get(me).cloned().ok_or_else(|| {
                Error::invalid(
                    "all_gather backward",
                    format!("no cotangent for group rank {me}"),
                )
            })?]
        }
        (DualRule::ForgetReduce, Spec::AllReduce { op: ReduceOp::Sum }) => vec![gs[0].clone()],
        _ => return Ok(None),
    }))
}

/// broadcast's backward with PyTorch #130515's comparison: reduce(SUM) to the root, then keep
/// the result where this rank's group rank equals the root's global rank.
async fn global_root<C: Communicator>(
    comm: &C,
    x: &Tensor,
    g: &Tensor,
    root: usize,
    group: &Group,
) -> Result<Tensor> {
    let me = group.require_member("broadcast backward")?;
    let s = comm.reduce(g, root, ReduceOp::Sum, group).await?;
    if root >= group.size() {
        return Err(Error::invalid(
            "broadcast backward",
            format!("root {root} outside a group of {}", group.size()),
        ));
    }
    match s {
        Some(s) if me == group.global(root) => Ok(s),
        _ => x.zeros_like(),
    }
}
