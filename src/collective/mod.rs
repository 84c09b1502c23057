//! Collectives: the [`Communicator`] trait (all_reduce, broadcast, ...), groups, reduce ops, the
//! one description of a call ([`Spec`]) and call signatures. [`P2p`] implements every collective from point-to-point messages over any
//! [`crate::transport::Transport`]: a ring for large all_reduce / all_gather / reduce_scatter
//! ([`ring`]), a binomial tree for broadcast / reduce ([`tree`]), direct exchange for small messages
//! and the rest, and the star through one rank for small all_reduces where messages cost more than
//! rounds ([`direct`], [`SmallAllReduce`]).
//!
//! These functions are not differentiable; [`crate::dist`] records them on a tape.

pub mod call;
pub mod direct;
pub mod events;
pub mod p2p;
pub mod ring;
pub mod sig;
pub mod spec;
pub mod tree;

use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::backend::{BinaryOp, Device};
use crate::error::{Error, Result};
use crate::tensor::Tensor;
pub use p2p::{AllReduceAlgo, CommOptions, P2p, SmallAllReduce};
pub use sig::{CallSig, Kind};
pub use spec::Spec;

/// How a reducing collective combines the ranks' tensors, elementwise.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ReduceOp {
    /// Sum.
    Sum,
    /// Mean over the group (sum, then divide by the group size).
    Avg,
    /// Product.
    Prod,
    /// Minimum (NaN-propagating).
    Min,
    /// Maximum (NaN-propagating).
    Max,
}

impl ReduceOp {
    /// All ops, for tests and tables.
    pub const ALL: [ReduceOp; 5] = [
        ReduceOp::Sum,
        ReduceOp::Avg,
        ReduceOp::Prod,
        ReduceOp::Min,
        ReduceOp::Max,
    ];

    /// The scale of the last local step over a group of `n` ranks: AVG divides the finished sum
    /// by `n`; the other ops have none.
    pub fn final_scale(self, n: usize) -> Option<f32> {
        (self == ReduceOp::Avg).then(|| 1.0 / n as f32)
    }

    /// The elementwise combine step (Avg combines as Sum and divides at the end).
    pub fn combine(self) -> BinaryOp {
        match self {
            ReduceOp::Sum | ReduceOp::Avg => BinaryOp::Add,
            ReduceOp::Prod => BinaryOp::Mul,
            ReduceOp::Min => BinaryOp::Min,
            ReduceOp::Max => BinaryOp::Max,
        }
    }

    /// Lower-case name (`"sum"`, ...).
    pub fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Avg => "avg",
            ReduceOp::Prod => "prod",
            ReduceOp::Min => "min",
            ReduceOp::Max => "max",
        }
    }

    /// Parse a lower-case name.
    pub fn parse(s: &str) -> Result<Self> {
        ReduceOp::ALL
            .into_iter()
            .find(|o| o.name() == s)
            .ok_or_else(|| {
                Error::Input(format!(
                    "unknown reduce op {s:?} (expected sum, avg, prod, min or max)"
                ))
            })
    }

    pub(crate) fn to_u8(self) -> u8 {
        match self {
            ReduceOp::Sum => 0,
            ReduceOp::Avg => 1,
            ReduceOp::Prod => 2,
            ReduceOp::Min => 3,
            ReduceOp::Max => 4,
        }
    }

    pub(crate) fn from_u8(x: u8) -> Option<Self> {
        ReduceOp::ALL.get(x as usize).copied()
    }
}

/// A set of global ranks that run collectives together. Roots and ranks given to collectives are
/// GROUP ranks (`0..size`); this type is the one place that maps them to global ranks and back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Group(Arc<GroupInner>);

#[derive(Debug, PartialEq, Eq)]
struct GroupInner {
    id: u32,
    ranks: Vec<usize>,
    me: Option<usize>,
}

impl Group {
    /// A group `id` of the given global ranks, seen from global rank `me_global`.
    pub(crate) fn new(id: u32, ranks: Vec<usize>, world: usize, me_global: usize) -> Result<Self> {
        if ranks.is_empty() {
            return Err(Error::invalid(
                "new_group",
                "a group needs at least one rank",
            ));
        }
        let mut seen = vec![false; world];
        for &r in &ranks {
            if r >= world {
                return Err(Error::invalid(
                    "new_group",
                    format!("rank {r} outside world of {world}"),
                ));
            }
            if std::mem::replace(&mut seen[r], true) {
                return Err(Error::invalid(
                    "new_group",
                    format!("rank {r} listed twice in {ranks:?}"),
                ));
            }
        }
        let me = ranks.iter().position(|&r| r == me_global);
        Ok(Group(Arc::new(GroupInner { id, ranks, me })))
    }

    /// Group id (0 = the world). Every rank creates groups in the same order, so ids agree.
    pub fn id(&self) -> u32 {
        self.0.id
    }

    /// Number of ranks in the group.
    pub fn size(&self) -> usize {
        self.0.ranks.len()
    }

    /// The global ranks, index = group rank.
    pub fn ranks(&self) -> &[usize] {
        &self.0.ranks
    }

    /// This process's group rank, or `None` if it is not a member.
    pub fn rank(&self) -> Option<usize> {
        self.0.me
    }

    /// Global rank of group rank `r` (caller guarantees `r < size`).
    pub fn global(&self, r: usize) -> usize {
        self.0.ranks[r]
    }

    /// Group rank of global rank `g`, if a member.
    pub fn group_rank_of(&self, g: usize) -> Option<usize> {
        self.0.ranks.iter().position(|&r| r == g)
    }

    /// This process's group rank, or an error naming the operation if it is not a member.
    pub fn require_member(&self, op: &'static str) -> Result<usize> {
        self.0.me.ok_or_else(|| {
            Error::invalid(
                op,
                format!(
                    "this rank is not a member of group {} (ranks {:?})",
                    self.0.id, self.0.ranks
                ),
            )
        })
    }

    /// Check that `r` is a valid group rank (e.g. a root).
    pub fn check_rank(&self, op: &'static str, what: &str, r: usize) -> Result<()> {
        if r >= self.size() {
            return Err(Error::invalid(
                op,
                format!(
                    "{what} {r} is not a rank of group {} (size {})",
                    self.0.id,
                    self.size()
                ),
            ));
        }
        Ok(())
    }
}

/// Collective communication among the ranks of a [`Group`]. All methods are `async`; every member of
/// the group must call the same collectives in the same order. Roots and peers are group ranks.
#[allow(async_fn_in_trait)] // futures are not Send in a browser; see crate::transport::Transport
pub trait Communicator {
    /// This process's global rank.
    fn rank(&self) -> usize;
    /// Number of global ranks.
    fn world_size(&self) -> usize;
    /// The group of all ranks.
    fn world(&self) -> Group;
    /// A new group of the given global ranks. Every rank (member or not) must call `new_group` in the
    /// same order, as in PyTorch, so that group ids agree.
    fn new_group(&self, ranks: &[usize]) -> Result<Group>;
    /// Where results that have no input to follow go (a `recv`, the outputs of a rank that only
    /// receives); programs and the gradient check put their inputs there too, so every operand of
    /// a rank's computation lives on one device.
    fn device(&self) -> Device;

    /// Every rank gets `root`'s `x` (all ranks pass a tensor of the same shape).
    async fn broadcast(&self, x: &Tensor, root: usize, group: &Group) -> Result<Tensor>;
    /// `root` gets `op` over all ranks' `x`; other ranks get `None`.
    async fn reduce(
        &self,
        x: &Tensor,
        root: usize,
        op: ReduceOp,
        group: &Group,
    ) -> Result<Option<Tensor>>;
    /// Every rank gets `op` over all ranks' `x`, bitwise identical on every rank.
    async fn all_reduce(&self, x: &Tensor, op: ReduceOp, group: &Group) -> Result<Tensor>;
    /// `root` gets every rank's `x` (equal shapes), in group-rank order; others get `None`.
    async fn gather(&self, x: &Tensor, root: usize, group: &Group) -> Result<Option<Vec<Tensor>>>;
    /// Rank `j` gets `xs[j]` from `root`; only the root passes `Some(xs)` (group-size equal-shape tensors).
    async fn scatter(&self, xs: Option<&[Tensor]>, root: usize, group: &Group) -> Result<Tensor>;
    /// Every rank gets every rank's `x` (equal shapes), in group-rank order.
    async fn all_gather(&self, x: &Tensor, group: &Group) -> Result<Vec<Tensor>>;
    /// Rank `j` gets `op` over all ranks' `xs[j]` (each rank passes group-size equal-shape tensors).
    async fn reduce_scatter(&self, xs: &[Tensor], op: ReduceOp, group: &Group) -> Result<Tensor>;
    /// Rank `j` gets `xs[j]` of every rank: output `i` is rank `i`'s `xs[me]`.
    async fn all_to_all(&self, xs: &[Tensor], group: &Group) -> Result<Vec<Tensor>>;
    /// Single-tensor all_to_all along dim 0: rows `in_splits[j]` go to rank `j`; rank `i` sends this
    /// rank `out_splits[i]` rows. Other dims must agree across ranks.
    async fn all_to_all_single(
        &self,
        x: &Tensor,
        in_splits: &[usize],
        out_splits: &[usize],
        group: &Group,
    ) -> Result<Tensor>;
    /// Send `x` to group rank `dst` (matched by a `recv` there).
    async fn send(&self, x: &Tensor, dst: usize, group: &Group) -> Result<()>;
    /// Receive a tensor of `shape` from group rank `src`.
    async fn recv(&self, shape: &[usize], src: usize, group: &Group) -> Result<Tensor>;
    /// For each `(src, dst)` pair, `dst` gets `src`'s `x`; a rank that receives nothing gets zeros.
    /// Each rank appears at most once as a source and once as a destination.
    async fn permute(&self, x: &Tensor, pairs: &[(usize, usize)], group: &Group) -> Result<Tensor>;
    /// Returns once every rank of the group has entered the barrier.
    async fn barrier(&self, group: &Group) -> Result<()>;
    /// Give up: every pending and later operation here and on every peer fails with `reason`
    /// (used when a rank cannot take part in what the others are waiting for).
    async fn abort(&self, reason: &str);
}

/// Split `n` elements into `parts` contiguous chunks, sizes differing by at most one.
pub fn chunk_bounds(n: usize, parts: usize) -> Vec<(usize, usize)> {
    let base = n / parts;
    let extra = n % parts;
    let mut start = 0;
    (0..parts)
        .map(|i| {
            let len = base + usize::from(i < extra);
            let r = (start, len);
            start += len;
            r
        })
        .collect()
}

/// The one shape of a list of tensors, one per group rank (`n`), or an error naming `op`.
pub(crate) fn list_shape(op: &'static str, xs: &[Tensor], n: usize) -> Result<Vec<usize>> {
    if xs.len() != n {
        return Err(Error::invalid(
            op,
            format!("need one tensor per group rank ({n}), got {}", xs.len()),
        ));
    }
    let shape = xs[0].shape().to_vec();
    if let Some(bad) = xs.iter().find(|x| x.shape() != shape.as_slice()) {
        return Err(Error::shape(
            op,
            &shape,
            bad.shape(),
            "all tensors of the list must have one shape",
        ));
    }
    Ok(shape)
}

/// Validate a permutation: pairs in range, each rank at most once as source and once as destination.
pub fn check_pairs(op: &'static str, pairs: &[(usize, usize)], n: usize) -> Result<()> {
    let mut src_seen = vec![false; n];
    let mut dst_seen = vec![false; n];
    for &(s, d) in pairs {
        if s >= n || d >= n {
            return Err(Error::invalid(
                op,
                format!("pair ({s}, {d}) outside group of size {n}"),
            ));
        }
        if std::mem::replace(&mut src_seen[s], true) {
            return Err(Error::invalid(
                op,
                format!("rank {s} is a source twice in {pairs:?}"),
            ));
        }
        if std::mem::replace(&mut dst_seen[d], true) {
            return Err(Error::invalid(
                op,
                format!("rank {d} is a destination twice in {pairs:?}"),
            ));
        }
    }
    Ok(())
}
