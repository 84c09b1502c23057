//! [`Spec`]: THE description of one collective call as one rank makes it (which collective, its
//! reduce op, root, peer, permutation, split sizes), serde-able. Everything else about a call is
//! derived from it:
//!
//! - the signature ranks compare before they exchange data ([`Spec::sig`], [`Spec::kind`]);
//! - what the tape records and the dual table matches on ([`crate::autograd::Collective`]);
//! - the forward of a described call on vars ([`crate::dist::call`]), used by `vjp` cases, lessons,
//!   programs and the test suites;
//! - how many tensors go in and come out on each rank ([`Spec::n_inputs`], [`Spec::n_outputs`]) and
//!   which arguments are valid for a group ([`Spec::check`]).
//!
//! JSON: the `"collective"` field names the kind, the other fields are its arguments, e.g.
//! `{"collective": "reduce", "root": 1, "op": "max"}`, `{"collective": "permute", "perm": [[0, 1]]}`.
//! `op` defaults to `sum` and `root` to 0. Roots and peers are GROUP ranks.

use std::fmt;

use serde::{Deserialize, Serialize};

use super::{CallSig, Kind, ReduceOp};
use crate::error::{Error, Result};

/// One collective call on one rank: the collective and its arguments (roots and peers are group
/// ranks; `all_to_all_single`'s splits and the peers of `send` / `recv` are this rank's own).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "collective", rename_all = "snake_case", deny_unknown_fields)]
pub enum Spec {
    /// Every rank gets `root`'s tensor.
    Broadcast {
        /// Group rank that sends.
        #[serde(default)]
        root: usize,
    },
    /// `root` gets `op` over every rank's tensor.
    Reduce {
        /// Group rank that receives.
        #[serde(default)]
        root: usize,
        /// How the tensors combine.
        #[serde(default = "sum")]
        op: ReduceOp,
    },
    /// Every rank gets `op` over every rank's tensor.
    AllReduce {
        /// How the tensors combine.
        #[serde(default = "sum")]
        op: ReduceOp,
    },
    /// `root` gets every rank's tensor (one output per group rank).
    Gather {
        /// Group rank that receives.
        #[serde(default)]
        root: usize,
    },
    /// Rank `j` gets the root's `j`-th tensor (the root passes one per group rank).
    Scatter {
        /// Group rank that sends.
        #[serde(default)]
        root: usize,
    },
    /// Every rank gets every rank's tensor.
    AllGather {},
    /// Rank `j` gets `op` over every rank's `j`-th tensor (each passes one per group rank).
    ReduceScatter {
        /// How the tensors combine.
        #[serde(default = "sum")]
        op: ReduceOp,
    },
    /// List form: this rank's `j`-th tensor goes to rank `j`; output `i` came from rank `i`.
    AllToAll {},
    /// One tensor split along dim 0: `in_splits[j]` rows go to rank `j`, `out_splits[i]` rows
    /// come from rank `i`.
    AllToAllSingle {
        /// Rows this rank sends to each group rank.
        in_splits: Vec<usize>,
        /// Rows this rank receives from each group rank.
        out_splits: Vec<usize>,
    },
    /// For each `(src, dst)` pair `dst` gets `src`'s tensor; a rank receiving nothing gets zeros.
    Permute {
        /// `(src, dst)` group-rank pairs; each rank at most once as source and as destination.
        perm: Vec<(usize, usize)>,
    },
    /// Send this rank's tensor to `dst` (matched by a `recv` there). No output.
    Send {
        /// Group rank that receives.
        dst: usize,
    },
    /// Receive a tensor of `shape` from `src`. No input.
    Recv {
        /// Group rank that sends.
        src: usize,
        /// Shape of the received tensor.
        shape: Vec<usize>,
    },
    /// Wait for every rank of the group. No input, no output.
    Barrier {},
}

fn sum() -> ReduceOp {
    ReduceOp::Sum
}

impl Spec {
    /// The collective's kind (what signatures and tables name).
    pub fn kind(&self) -> Kind {
        match self {
            Spec::Broadcast { .. } => Kind::Broadcast,
            Spec::Reduce { .. } => Kind::Reduce,
            Spec::AllReduce { .. } => Kind::AllReduce,
            Spec::Gather { .. } => Kind::Gather,
            Spec::Scatter { .. } => Kind::Scatter,
            Spec::AllGather {} => Kind::AllGather,
            Spec::ReduceScatter { .. } => Kind::ReduceScatter,
            Spec::AllToAll {} => Kind::AllToAll,
            Spec::AllToAllSingle { .. } => Kind::AllToAllSingle,
            Spec::Permute { .. } => Kind::Permute,
            // Both ends of a message compare one signature.
            Spec::Send { .. } | Spec::Recv { .. } => Kind::Send,
            Spec::Barrier {} => Kind::Barrier,
        }
    }

    /// The reduce op, for reducing collectives.
    pub fn op(&self) -> Option<ReduceOp> {
        match self {
            Spec::Reduce { op, .. } | Spec::AllReduce { op } | Spec::ReduceScatter { op } => {
                Some(*op)
            }
            _ => None,
        }
    }

    /// The root, for rooted collectives.
    pub fn root(&self) -> Option<usize> {
        match self {
            Spec::Broadcast { root }
            | Spec::Reduce { root, .. }
            | Spec::Gather { root }
            | Spec::Scatter { root } => Some(*root),
            _ => None,
        }
    }

    /// The part of the call signature every rank knows from the description alone (kind, op,
    /// root); communicators add the shape and their own agreed arguments.
    pub fn sig(&self) -> CallSig {
        let mut s = CallSig::new(self.kind());
        s.op = self.op();
        s.root = self.root();
        s
    }

    /// Number of input tensors group rank `me` passes, in a group of `n`.
    pub fn n_inputs(&self, me: usize, n: usize) -> usize {
        match self {
            Spec::Scatter { root } => usize::from(me == *root) * n,
            Spec::ReduceScatter { .. } | Spec::AllToAll {} => n,
            Spec::Recv { .. } | Spec::Barrier {} => 0,
            Spec::Broadcast { .. }
            | Spec::Reduce { .. }
            | Spec::AllReduce { .. }
            | Spec::Gather { .. }
            | Spec::AllGather {}
            | Spec::AllToAllSingle { .. }
            | Spec::Permute { .. }
            | Spec::Send { .. } => 1,
        }
    }

    /// Number of output tensors group rank `me` gets, in a group of `n`.
    pub fn n_outputs(&self, me: usize, n: usize) -> usize {
        match self {
            Spec::Reduce { root, .. } => usize::from(me == *root),
            Spec::Gather { root } => usize::from(me == *root) * n,
            Spec::AllGather {} | Spec::AllToAll {} => n,
            Spec::Send { .. } | Spec::Barrier {} => 0,
            Spec::Broadcast { .. }
            | Spec::AllReduce { .. }
            | Spec::Scatter { .. }
            | Spec::ReduceScatter { .. }
            | Spec::AllToAllSingle { .. }
            | Spec::Permute { .. }
            | Spec::Recv { .. } => 1,
        }
    }

    /// Check the arguments against a group of `n` ranks in which this rank is `me`: roots and peers
    /// in range (a rank does not send to itself), permutations valid, one split size per rank.
    pub fn check(&self, me: usize, n: usize) -> Result<()> {
        let name = self.kind().name();
        let in_group = |what: &str, r: usize| {
            if r < n {
                Ok(())
            } else {
                Err(Error::invalid(
                    name,
                    format!("{what} {r} is not a group rank (group size {n})"),
                ))
            }
        };
        match self {
            Spec::Broadcast { root }
            | Spec::Reduce { root, .. }
            | Spec::Gather { root }
            | Spec::Scatter { root } => in_group("root", *root),
            Spec::Permute { perm } => super::check_pairs("permute", perm, n),
            Spec::AllToAllSingle {
                in_splits,
                out_splits,
            } => {
                if in_splits.len() != n || out_splits.len() != n {
                    return Err(Error::invalid(
                        name,
                        format!(
                            "need one split size per group rank ({n}): in_splits {in_splits:?}, out_splits {out_splits:?}"
                        ),
                    ));
                }
                Ok(())
            }
            Spec::Send { dst: peer } | Spec::Recv { src: peer, .. } => {
                in_group("peer", *peer)?;
                if *peer == me {
                    return Err(Error::invalid(
                        name,
                        format!("group rank {me} cannot message itself"),
                    ));
                }
                Ok(())
            }
            Spec::AllReduce { .. }
            | Spec::AllGather {}
            | Spec::ReduceScatter { .. }
            | Spec::AllToAll {}
            | Spec::Barrier {} => Ok(()),
        }
    }
}

/// Short form, as traces and the `vjp` table print it: `all_reduce(op=sum)`, `broadcast(root=1)`,
/// `send(dst=2)`, `permute(perm=[(0, 1)])`.
impl fmt::Display for Spec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut args = Vec::new();
        if let Some(op) = self.op() {
            args.push(format!("op={}", op.name()));
        }
        if let Some(r) = self.root() {
            args.push(format!("root={r}"));
        }
        let name = match self {
            Spec::Send { dst } => {
                args.push(format!("dst={dst}"));
                "send"
            }
            Spec::Recv { src, .. } => {
                args.push(format!("src={src}"));
                "recv"
            }
            Spec::Permute { perm } => {
                args.push(format!("perm={perm:?}"));
                "permute"
            }
            Spec::AllToAllSingle {
                in_splits,
                out_splits,
            } => {
                args.push(format!(
                    "in_splits={in_splits:?}, out_splits={out_splits:?}"
                ));
                "all_to_all_single"
            }
            _ => self.kind().name(),
        };
        if args.is_empty() {
            write!(f, "{name}")
        } else {
            write!(f, "{name}({})", args.join(", "))
        }
    }
}

/// The messages of a collective of `kind` over `n` group ranks, as `(from, to)` group-rank
/// pairs: the logical data movement the teaching demo draws (whatever algorithm carries it).
/// A send / recv names its own peer, so it has no one picture ([`Spec::messages`] gives a rank's).
pub fn messages(kind: Kind, n: usize, root: usize, perm: &[(usize, usize)]) -> Vec<(usize, usize)> {
    let all = || {
        (0..n)
            .flat_map(|a| (0..n).filter(move |&b| b != a).map(move |b| (a, b)))
            .collect()
    };
    match kind {
        Kind::Broadcast | Kind::Scatter => {
            (0..n).filter(|&r| r != root).map(|r| (root, r)).collect()
        }
        Kind::Reduce | Kind::Gather => (0..n).filter(|&r| r != root).map(|r| (r, root)).collect(),
        Kind::AllGather
        | Kind::ReduceScatter
        | Kind::AllToAll
        | Kind::AllToAllSingle
        | Kind::AllReduce
        | Kind::Barrier => all(),
        Kind::Permute => perm.iter().copied().filter(|(a, b)| a != b).collect(),
        Kind::Send => Vec::new(),
    }
}

impl Spec {
    /// The messages of this call made by group rank `me` of `n`, or of the whole call where every
    /// rank's is the same picture: `(from, to)` group-rank pairs (see [`messages`]). A send is its
    /// one message; a recv draws none (its sender does).
    pub fn messages(&self, me: usize, n: usize) -> Vec<(usize, usize)> {
        match self {
            Spec::Send { dst } => vec![(me, *dst)],
            Spec::Recv { .. } => Vec::new(),
            Spec::Permute { perm } => messages(Kind::Permute, n, 0, perm),
            other => messages(other.kind(), n, other.root().unwrap_or(0), &[]),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_names_and_defaults() {
        let s: Spec = serde_json::from_str(r#"{"collective": "reduce", "root": 2}"#).unwrap();
        assert_eq!(
            s,
            Spec::Reduce {
                root: 2,
                op: ReduceOp::Sum
            }
        );
        let s: Spec =
            serde_json::from_str(r#"{"collective": "permute", "perm": [[0, 1], [1, 0]]}"#).unwrap();
        assert_eq!(
            s,
            Spec::Permute {
                perm: vec![(0, 1), (1, 0)]
            }
        );
        assert_eq!(
            serde_json::to_string(&Spec::AllReduce { op: ReduceOp::Max }).unwrap(),
            r#"{"collective":"all_reduce","op":"max"}"#
        );
        // Unknown kinds and fields are errors, not ignored.
        assert!(serde_json::from_str::<Spec>(r#"{"collective": "all_reduse"}"#).is_err());
        assert!(
            serde_json::from_str::<Spec>(r#"{"collective": "all_gather", "root": 1}"#).is_err()
        );
    }

    #[test]
    fn sig_and_display_come_from_the_spec() {
        let s = Spec::Reduce {
            root: 1,
            op: ReduceOp::Max,
        };
        assert_eq!(
            s.sig(),
            CallSig::new(Kind::Reduce).op(ReduceOp::Max).root(1)
        );
        assert_eq!(s.to_string(), "reduce(op=max, root=1)");
        assert_eq!(Spec::Send { dst: 2 }.kind(), Kind::Send);
        assert_eq!(
            Spec::Recv {
                src: 0,
                shape: vec![2]
            }
            .kind(),
            Kind::Send
        );
        assert_eq!(Spec::AllGather {}.to_string(), "all_gather");
    }

    #[test]
    fn arities_and_checks() {
        let sc = Spec::Scatter { root: 1 };
        assert_eq!(
            (sc.n_inputs(1, 3), sc.n_inputs(0, 3), sc.n_outputs(0, 3)),
            (3, 0, 1)
        );
        let g = Spec::Gather { root: 0 };
        assert_eq!(
            (g.n_inputs(2, 3), g.n_outputs(0, 3), g.n_outputs(1, 3)),
            (1, 3, 0)
        );
        assert!(sc.check(0, 2).is_ok());
        assert!(sc.check(0, 1).is_err());
        assert!(Spec::Send { dst: 1 }.check(1, 2).is_err());
        assert!(
            Spec::Permute {
                perm: vec![(0, 1), (1, 1)]
            }
            .check(0, 2)
            .is_err()
        );
        let a2a = Spec::AllToAllSingle {
            in_splits: vec![1, 2],
            out_splits: vec![1],
        };
        assert!(a2a.check(0, 2).is_err());
    }
}
