//! Reverse-mode autograd whose tape records local ops AND collectives.
//!
//! A [`Tape`] belongs to one rank. [`Var`]s are handles to values on it; ops on vars record a node
//! (only when some input requires a gradient, and never inside a [`Tape::no_grad`] region).
//! Collectives (see [`crate::dist`]) are always recorded while recording is on, because every rank
//! must run their duals in backward whether or not a gradient reached them locally.
//!
//! [`Tape::backward`] is `async`: it walks the nodes in reverse and, for a collective, runs its dual
//! collective ([`dual`]), so gradients cross ranks. The two objective conventions are explicit, see
//! [`Objective`].

mod backward;
pub mod dual;
mod ops;
mod wrong;

use std::cell::RefCell;
use std::rc::Rc;

use crate::collective::Group;
use crate::error::{Error, Result};
use crate::tensor::Tensor;
pub use dual::{Collective, DualRule};

/// What global objective a backward pass differentiates.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Objective {
    /// The seed's (PyTorch's) convention: the objective is the SUM over ranks of each rank's loss.
    /// Every value is per-rank; the dual of `all_reduce(SUM)` is `all_reduce(SUM)`.
    #[default]
    SumOfRankLosses,
    /// JAX shard_map's convention: values know whether they are replicated (invariant) across a
    /// group. `all_reduce` output is invariant and counted once, so its dual is the identity; an
    /// invariant value entering per-rank math is made varying, and that step's dual is an all_reduce.
    Replicated,
}

impl Objective {
    /// The convention in words (reports, the page).
    pub fn describe(self) -> &'static str {
        match self {
            Objective::SumOfRankLosses => "sum of rank losses",
            Objective::Replicated => "replicated (an invariant loss counts once)",
        }
    }
}

/// One recorded op: a local op (derivative in `backward.rs`) or a collective (dual in `dual.rs`).
#[derive(Debug, Clone)]
pub(crate) enum Op {
    Local(Local),
    Collective(Collective),
}

/// Local differentiable primitives.
#[derive(Debug, Clone)]
pub(crate) enum Local {
    Add,
    Sub,
    Mul,
    Scale(f32),
    MatMul,
    Sum,
    Mean,
    Relu,
    Tanh,
    Reshape,
    Slice {
        dim: usize,
        start: usize,
    },
    Concat {
        dim: usize,
    },
    /// Moved to another device; holds the device it came from.
    ToDevice(crate::backend::Device),
}

#[derive(Debug, Clone)]
pub(crate) struct Node {
    pub op: Op,
    pub inputs: Vec<usize>,
    pub outputs: Vec<usize>,
}

#[derive(Debug)]
struct VarData {
    value: Tensor,
    requires_grad: bool,
    /// Replicated mode only: the group this value is invariant (identical) across.
    invariant: Option<Group>,
}

#[derive(Debug, Default)]
struct TapeInner {
    vars: Vec<VarData>,
    nodes: Vec<Node>,
    objective: Objective,
    no_grad_depth: usize,
}

/// One rank's autograd tape. Cheap to clone (shared handle).
#[derive(Debug, Clone, Default)]
pub struct Tape(Rc<RefCell<TapeInner>>);

/// A value on a tape. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Var {
    id: usize,
    tape: Tape,
}

/// Restores recording when dropped; see [`Tape::no_grad`].
pub struct NoGradGuard(Tape);

impl Drop for NoGradGuard {
    fn drop(&mut self) {
        self.0.0.borrow_mut().no_grad_depth -= 1;
    }
}

impl Tape {
    /// A tape with the default objective ([`Objective::SumOfRankLosses`]).
    pub fn new() -> Self {
        Self::default()
    }

    /// A tape with the given objective convention.
    pub fn with_objective(objective: Objective) -> Self {
        let t = Self::default();
        t.0.borrow_mut().objective = objective;
        t
    }

    /// The objective convention.
    pub fn objective(&self) -> Objective {
        self.0.borrow().objective
    }

    /// A leaf that requires a gradient (a parameter or an input to differentiate by).
    pub fn var(&self, value: Tensor) -> Var {
        self.push_var(value, true, None)
    }

    /// A leaf without gradient (data, targets). In replicated mode this is per-rank (varying)
    /// data: an invariant value combined with it is made varying. For a constant that is the same
    /// on every rank of a group use [`Tape::constant_invariant`].
    pub fn constant(&self, value: Tensor) -> Var {
        self.push_var(value, false, None)
    }

    /// Replicated mode: a leaf without gradient whose value is identical on every rank of `group`
    /// (a replicated constant, like a closed-over constant in JAX). Combining it with invariant
    /// values keeps them invariant, so the loss is still counted once. In the default mode this is
    /// the same as [`Tape::constant`].
    pub fn constant_invariant(&self, value: Tensor, group: &Group) -> Var {
        self.leaf(value, false, Some(group))
    }

    /// Replicated mode: a leaf requiring a gradient whose value is identical on every rank of `group`
    /// (a replicated parameter). In the default mode this is the same as [`Tape::var`].
    pub fn var_invariant(&self, value: Tensor, group: &Group) -> Var {
        self.leaf(value, true, Some(group))
    }

    /// A leaf with or without gradient (`grad`), invariant over `invariant_over` where given (in
    /// replicated mode; in the default mode every leaf is per-rank): [`Tape::var`],
    /// [`Tape::constant`] and their invariant forms in one call, for inputs described by data.
    pub fn leaf(&self, value: Tensor, grad: bool, invariant_over: Option<&Group>) -> Var {
        let inv = invariant_over
            .filter(|_| self.objective() == Objective::Replicated)
            .cloned();
        self.push_var(value, grad, inv)
    }

    /// Stop recording until the guard is dropped (works across `.await`).
    pub fn no_grad(&self) -> NoGradGuard {
        self.0.borrow_mut().no_grad_depth += 1;
        NoGradGuard(self.clone())
    }

    /// Whether ops are being recorded now.
    pub fn is_recording(&self) -> bool {
        self.0.borrow().no_grad_depth == 0
    }

    /// Number of recorded nodes (ops); node `k` is the k-th op recorded (see
    /// [`Tape::backward_observed`]).
    pub fn len(&self) -> usize {
        self.0.borrow().nodes.len()
    }

    /// Whether nothing has been recorded.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn push_var(&self, value: Tensor, requires_grad: bool, invariant: Option<Group>) -> Var {
        let mut t = self.0.borrow_mut();
        t.vars.push(VarData {
            value,
            requires_grad,
            invariant,
        });
        Var {
            id: t.vars.len() - 1,
            tape: self.clone(),
        }
    }

    pub(crate) fn check(&self, op: &'static str, v: &Var) -> Result<()> {
        if Rc::ptr_eq(&self.0, &v.tape.0) {
            Ok(())
        } else {
            Err(Error::ForeignVar { op })
        }
    }

    /// Record `op` producing `outputs` from `inputs`; returns the output vars. Local ops are recorded
    /// only if an input requires grad; collectives whenever recording is on.
    pub(crate) fn record(
        &self,
        op: Op,
        inputs: &[&Var],
        outputs: Vec<Tensor>,
        invariant: Option<Group>,
    ) -> Vec<Var> {
        let is_collective = matches!(op, Op::Collective(_));
        let recording = self.is_recording();
        let requires_grad =
            recording && (is_collective || inputs.iter().any(|v| v.requires_grad()));
        let outs: Vec<Var> = outputs
            .into_iter()
            .map(|t| self.push_var(t, requires_grad, invariant.clone()))
            .collect();
        if requires_grad {
            self.0.borrow_mut().nodes.push(Node {
                op,
                inputs: inputs.iter().map(|v| v.id).collect(),
                outputs: outs.iter().map(|v| v.id).collect(),
            });
        }
        outs
    }

    /// Make the collective calls among nodes `nodes` (as [`Tape::len`] counts them) run the wrong
    /// dual `rule` in backward: a program step's `"dual"` (a teaching lesson's; see
    /// [`DualRule`]), and nothing else.
    pub(crate) fn use_dual(&self, nodes: std::ops::Range<usize>, rule: DualRule) {
        let mut t = self.0.borrow_mut();
        for n in t.nodes.get_mut(nodes).into_iter().flatten() {
            if let Op::Collective(Collective::Call { rule: r, .. }) = &mut n.op {
                *r = rule;
            }
        }
    }

    fn value_of(&self, id: usize) -> Tensor {
        self.0.borrow().vars[id].value.clone()
    }
}

impl Var {
    /// The value.
    pub fn value(&self) -> Tensor {
        self.tape.value_of(self.id)
    }

    /// Shape of the value.
    pub fn shape(&self) -> Vec<usize> {
        self.tape.0.borrow().vars[self.id].value.shape().to_vec()
    }

    /// Whether gradients flow to this var.
    pub fn requires_grad(&self) -> bool {
        self.tape.0.borrow().vars[self.id].requires_grad
    }

    /// Replicated mode: the group this value is invariant across, if any.
    pub fn invariant(&self) -> Option<Group> {
        self.tape.0.borrow().vars[self.id].invariant.clone()
    }

    /// The tape this var lives on.
    pub fn tape(&self) -> &Tape {
        &self.tape
    }

    /// Index on the tape.
    pub fn id(&self) -> usize {
        self.id
    }
}

/// Gradients from one backward pass, by var.
#[derive(Debug, Clone)]
pub struct Grads {
    grads: Vec<Option<Tensor>>,
}

impl Grads {
    /// The gradient of `v`, if any reached it.
    pub fn get(&self, v: &Var) -> Option<&Tensor> {
        self.grads.get(v.id).and_then(Option::as_ref)
    }

    /// The gradient of `v`, zeros (on `v`'s device) if none reached it.
    pub fn wrt(&self, v: &Var) -> Result<Tensor> {
        match self.get(v) {
            Some(g) => Ok(g.clone()),
            None => v.value().zeros_like(),
        }
    }
}
