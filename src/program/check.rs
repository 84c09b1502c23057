//! Everything about a program that can be checked before it runs: names, fields, shapes on every
//! rank, what must agree across the ranks of a collective, send / recv pairs, and (under the
//! replicated objective) which values are invariant over which group. The result is a [`Plan`]:
//! each rank's inputs and, per step, the call each rank makes.
//!
//! The [`Checker`] reads the program as it is written: one method per kind of entry (an input, a
//! local step, a collective step), each updating one typed state per rank ([`RankState`]); then
//! the checks that need the whole program (every message received, replication agreed, the
//! loss).

use std::collections::{BTreeMap, HashMap, HashSet};

use super::inputs::{InputPlan, ranks_of};
use super::shapes::{collective_shapes, group_specs, lists_outputs, local_shape};
use super::{
    Input, LocalOp, MAX_ARITHMETIC, MAX_ELEMENTS, MAX_NUMEL, MAX_WORLD, Program, Step, StepKind,
};
use crate::collective::{Kind, Spec};
use crate::error::{Error, ProgramError, Result};
use crate::tensor::Tensor;

/// A checked program for a world: each rank's inputs and each step's per-rank call.
#[derive(Debug, Clone)]
pub struct Plan {
    pub(super) program: Program,
    pub(super) world: usize,
    /// Distinct groups (global ranks), in order of first use; every rank creates them in this order.
    pub(super) groups: Vec<Vec<usize>>,
    pub(super) steps: Vec<Planned>,
    /// Per input: who holds it, with which shape, and how its values are made.
    pub(super) inputs: Vec<InputPlan>,
    /// Per rank, its inputs once that rank asked for them ([`Plan::inputs`]).
    pub(super) built: Vec<std::sync::OnceLock<Vec<Tensor>>>,
    /// Per rank, the shape of every value it binds.
    pub(super) shapes: Vec<HashMap<String, Vec<usize>>>,
    /// Replicated objective: per rank, the values invariant over a group (its global ranks).
    pub(super) invariant: Vec<HashMap<String, Vec<usize>>>,
}

/// One step as each rank runs it.
#[derive(Debug, Clone)]
pub(super) struct Planned {
    pub(super) index: usize,
    pub(super) what: What,
    pub(super) inputs: Vec<String>,
    pub(super) out: Option<String>,
    /// Replicated objective: the invariant values this step uses as per-rank values (made
    /// varying; the dual of that is an all_reduce over their group).
    pub(super) made_varying: Vec<String>,
}

#[derive(Debug, Clone)]
pub(super) enum What {
    /// A local op on the ranks marked `true`.
    Local(LocalOp, Vec<bool>),
    /// A collective on group `group` (index into `Plan::groups`); the call of each global rank
    /// (`None`: not taking part).
    Collective {
        group: usize,
        specs: Vec<Option<Spec>>,
        /// The backward the step asked for (`"dual"`).
        dual: crate::autograd::DualRule,
    },
}

impl Plan {
    /// Number of ranks.
    pub fn world(&self) -> usize {
        self.world
    }

    /// The program (its `"for"` blocks expanded, `name.*` inputs spelled out).
    pub fn program(&self) -> &Program {
        &self.program
    }

    /// The inputs of global rank `rank`, in the program's order (an empty tensor of shape `[0]`
    /// for an input the rank does not hold: [`Plan::holds`]). Made when a rank first asks: a tab
    /// makes its own rank's inputs, not every rank's.
    pub fn inputs(&self, rank: usize) -> &[Tensor] {
        let Some(built) = self.built.get(rank) else {
            return &[];
        };
        built.get_or_init(|| {
            self.inputs
                .iter()
                .map(|i| i.tensor(rank).unwrap_or_else(|| Tensor::vector(&[])))
                .collect()
        })
    }

    /// Whether global rank `rank` holds input `input` (the index in the program's order).
    pub fn holds(&self, rank: usize, input: usize) -> bool {
        self.inputs
            .get(input)
            .is_some_and(|i| i.holder(rank).is_some())
    }

    /// Whether input `input` is held by every rank with the same values everywhere (a parameter
    /// that data-parallel training keeps equal on every rank).
    pub fn same_on_every_rank(&self, input: usize) -> bool {
        self.inputs
            .get(input)
            .is_some_and(|i| i.same_everywhere(self.world))
    }

    /// Names of the inputs.
    pub fn input_names(&self) -> Vec<&str> {
        self.program
            .inputs
            .iter()
            .map(|i| i.name.as_str())
            .collect()
    }

    /// The shape of the value `name` on global rank `rank` (a list output's parts are
    /// `name.0`, `name.1`, ...), or `None` where the rank never binds it.
    pub fn shape(&self, rank: usize, name: &str) -> Option<&[usize]> {
        self.shapes.get(rank)?.get(name).map(Vec::as_slice)
    }
}

/// Steps of the expanded program as messages name them: `steps [0, 2]`, or where they came from
/// in a `"for"` block.
fn steps_at(steps: &[usize], origins: &[String]) -> String {
    let named: Vec<&str> = steps
        .iter()
        .map(|&k| origins.get(k).map_or("?", String::as_str))
        .collect();
    if steps
        .iter()
        .zip(&named)
        .all(|(k, n)| *n == format!("step {k}"))
    {
        format!("steps {steps:?}")
    } else {
        named.join("; ")
    }
}

fn check_name(what: &'static str, name: &str) -> Result<()> {
    if name.is_empty() || name.contains('.') || name.chars().any(char::is_whitespace) {
        return Err(ProgramError::Name {
            what,
            name: name.to_string(),
        }
        .into());
    }
    Ok(())
}

/// An error about a step; `at` says where it is in the program as written (`step 3`, or a step of
/// a `"for"` block: `step 0 (for s), its step 2 with s = 1`).
fn err(at: &str, s: &Step, detail: impl std::fmt::Display) -> Error {
    ProgramError::Step {
        at: at.to_string(),
        step: s.describe(),
        detail: detail.to_string(),
    }
    .into()
}

/// The program with every `name.*` in a step's inputs replaced by the parts of the list output
/// `name` (`name.0`, `name.1`, ... one per rank of the group of the collective that bound it).
fn expand_parts(p: &Program, world: usize, origins: &[String]) -> Result<Program> {
    let mut out = p.clone();
    // List outputs bound so far: name -> number of parts.
    let mut lists: HashMap<String, usize> = HashMap::new();
    for (si, s) in out.steps.iter_mut().enumerate() {
        if s.inputs.iter().any(|n| n.ends_with(".*")) {
            let mut names = Vec::with_capacity(s.inputs.len());
            for n in &s.inputs {
                match n.strip_suffix(".*") {
                    Some(base) => {
                        let k = lists.get(base).ok_or_else(|| {
                            err(
                                &origins[si],
                                s,
                                format!(
                                    "`{n}` names the parts of a list output (of gather, all_gather or all_to_all), and no earlier step binds `{base}` as one"
                                ),
                            )
                        })?;
                        names.extend((0..*k).map(|i| format!("{base}.{i}")));
                    }
                    None => names.push(n.clone()),
                }
            }
            s.inputs = names;
        }
        if let (StepKind::Collective { spec, .. }, Some(o)) = (&s.kind, &s.out)
            && lists_outputs(spec.kind())
        {
            lists.insert(o.clone(), s.group.as_ref().map_or(world, Vec::len));
        }
    }
    Ok(out)
}

/// A local op's arithmetic: a matmul `m·k·n` multiply-adds, any other op one per element it
/// reads or writes (saturating: a cost past `u64` is past any budget).
fn arithmetic(op: &LocalOp, ins: &[&Vec<usize>], out: &[usize]) -> u64 {
    let numel = |s: &[usize]| s.iter().fold(1u64, |a, &d| a.saturating_mul(d as u64));
    match (op, ins) {
        (LocalOp::Matmul {}, [a, b]) if a.len() == 2 && b.len() == 2 => numel(&[a[0], a[1], b[1]]),
        _ => ins
            .iter()
            .map(|s| numel(s))
            .chain([numel(out)])
            .fold(0u64, u64::saturating_add),
    }
}

/// Check `p` for `world` ranks and make its [`Plan`].
pub(super) fn plan(p: &Program, world: usize) -> Result<Plan> {
    if world == 0 || world > MAX_WORLD {
        return Err(ProgramError::World {
            world,
            max: MAX_WORLD,
        }
        .into());
    }
    // Messages name a step of a "for" block by where it came from, not by its place in the
    // expanded program.
    let (repeated, origins) = super::repeat::expand(p, world)?;
    let expanded = expand_parts(&repeated, world, &origins)?;
    let mut c = Checker::new(&expanded, &origins, world);
    for (i, inp) in expanded.inputs.iter().enumerate() {
        c.input(i, inp)?;
    }
    for (si, s) in expanded.steps.iter().enumerate() {
        c.step(si, s)?;
    }
    c.check_messages()?;
    if c.replicated {
        c.check_replication()?;
    }
    c.check_loss()?;
    Ok(c.finish())
}

/// What the checker knows of one rank at a point of the program.
#[derive(Debug, Clone, Default)]
struct RankState {
    /// The shape of every value bound on this rank so far.
    shapes: HashMap<String, Vec<usize>>,
    /// Under the replicated objective: the values invariant over a group (its global ranks).
    invariant: HashMap<String, Vec<usize>>,
    /// Values without gradient: constant inputs and what is computed only from them.
    constant: HashSet<String>,
}

/// Point-to-point messages by (group, src, dst) group ranks: (step, shape) in program order.
type Messages = BTreeMap<(usize, usize, usize), Vec<(usize, Vec<usize>)>>;

/// The step being checked, for messages: its index in the expanded program and where it came
/// from.
#[derive(Clone, Copy)]
struct At<'a> {
    index: usize,
    step: &'a Step,
    origin: &'a str,
}

impl At<'_> {
    fn err(&self, detail: impl std::fmt::Display) -> Error {
        err(self.origin, self.step, detail)
    }
}

/// Reads a program (its blocks expanded) entry by entry; see the module docs.
struct Checker<'p> {
    program: &'p Program,
    /// Where each step of the expanded program came from (`step 3`, a step of a block).
    origins: &'p [String],
    world: usize,
    replicated: bool,
    ranks: Vec<RankState>,
    /// Where each name was (last) bound, for messages.
    origin: HashMap<String, String>,
    groups: Vec<Vec<usize>>,
    steps: Vec<Planned>,
    sent: Messages,
    received: Messages,
    inputs: Vec<InputPlan>,
    /// Elements of every value bound so far, all ranks together ([`MAX_ELEMENTS`]).
    elements: usize,
    /// Arithmetic of the local steps so far, all ranks together ([`MAX_ARITHMETIC`]).
    arithmetic: u64,
    /// The invariant values the step being checked makes varying ([`Planned::made_varying`]).
    made_varying: std::cell::RefCell<Vec<String>>,
}

/// The group rank of global rank `g` in `members` (a member).
fn group_rank(members: &[usize], g: usize) -> usize {
    members.iter().position(|&m| m == g).unwrap_or_default()
}

impl<'p> Checker<'p> {
    fn new(program: &'p Program, origins: &'p [String], world: usize) -> Self {
        Checker {
            program,
            origins,
            world,
            replicated: program.objective == super::ObjectiveName::Replicated,
            ranks: vec![RankState::default(); world],
            origin: HashMap::new(),
            groups: Vec::new(),
            steps: Vec::with_capacity(program.steps.len()),
            sent: BTreeMap::new(),
            received: BTreeMap::new(),
            inputs: Vec::with_capacity(program.inputs.len()),
            elements: 0,
            arithmetic: 0,
            made_varying: std::cell::RefCell::new(Vec::new()),
        }
    }

    /// Input `i`: its values on every rank that holds it (a placeholder elsewhere).
    fn input(&mut self, i: usize, inp: &Input) -> Result<()> {
        check_name("input", &inp.name)?;
        if self.origin.contains_key(&inp.name) {
            return Err(ProgramError::DuplicateInput {
                name: inp.name.clone(),
            }
            .into());
        }
        self.origin.insert(inp.name.clone(), "an input".into());
        let plan = InputPlan::check(i, inp, self.world)?;
        let all: Vec<usize> = (0..self.world).collect();
        for &r in plan.holders() {
            let shape = plan.shape(r).unwrap_or_default().to_vec();
            self.count_elements(&shape, || format!("input {:?}", inp.name))?;
            let state = &mut self.ranks[r];
            state.shapes.insert(inp.name.clone(), shape);
            if self.replicated && inp.replicated {
                state.invariant.insert(inp.name.clone(), all.clone());
            }
            if !inp.grad {
                state.constant.insert(inp.name.clone());
            }
        }
        self.inputs.push(plan);
        Ok(())
    }

    /// Count a value of `shape` against the program's element budget ([`MAX_ELEMENTS`], all
    /// ranks together; one value at most [`MAX_NUMEL`]); `what` names it for the message.
    fn count_elements(&mut self, shape: &[usize], what: impl Fn() -> String) -> Result<()> {
        let n = crate::tensor::checked_numel(shape).filter(|&n| n <= MAX_NUMEL);
        let Some(n) = n else {
            return Err(ProgramError::TooLarge {
                what: what(),
                detail: format!("shape {shape:?} has more than {MAX_NUMEL} elements"),
            }
            .into());
        };
        self.elements = self.elements.saturating_add(n);
        if self.elements > MAX_ELEMENTS {
            return Err(ProgramError::TooLarge {
                what: what(),
                detail: format!(
                    "the program's values come to more than {MAX_ELEMENTS} elements ({} MiB of \
                     f32) on all ranks together",
                    MAX_ELEMENTS >> 18
                ),
            }
            .into());
        }
        Ok(())
    }

    /// Step `si` of the expanded program.
    fn step(&mut self, si: usize, s: &Step) -> Result<()> {
        let origins = self.origins;
        let at = At {
            index: si,
            step: s,
            origin: &origins[si],
        };
        if let Some(o) = &s.out {
            check_name("output", o).map_err(|x| at.err(x))?;
        }
        match &s.kind {
            StepKind::For(_) => Err(at.err("internal: a \"for\" block left after expansion")),
            StepKind::Local(op) => self.local(at, op),
            StepKind::Collective { spec, .. } => self.collective(at, spec),
        }
    }

    /// The shape of `name` on rank `r`, or why it has none there.
    fn lookup(&self, at: At, r: usize, name: &str) -> Result<Vec<usize>> {
        self.ranks[r].shapes.get(name).cloned().ok_or_else(|| {
            let hint = match self.origin.get(name) {
                Some(o) => format!(" ({o}, on other ranks)"),
                None => " (not defined by any earlier step or input)".into(),
            };
            at.err(format!("`{name}` is not defined on rank {r}{hint}"))
        })
    }

    /// Bind `name` on rank `r` (once per rank; different ranks may bind it in different steps).
    fn bind(&mut self, at: At, r: usize, name: String, shape: Vec<usize>) -> Result<()> {
        self.count_elements(&shape, || {
            format!(
                "{} ({}): `{name}` on rank {r}",
                at.origin,
                at.step.describe()
            )
        })?;
        if self.ranks[r].shapes.contains_key(&name) {
            let o = self.origin.get(&name).map_or("an input", String::as_str);
            return Err(at.err(format!("`{name}` is already defined on this rank ({o})")));
        }
        self.origin.insert(
            name.clone(),
            format!("{} ({})", at.origin, at.step.describe()),
        );
        self.ranks[r].shapes.insert(name, shape);
        Ok(())
    }

    /// Under the replicated objective, an invariant value made per-rank (any invariant input of
    /// a collective, or of a local op mixing it with other values) has an all_reduce over its
    /// group as gradient: every member of that group must run the step (`runs`, by global rank).
    fn pvary_ok(&self, at: At, r: usize, names: &[String], runs: &[bool]) -> Result<()> {
        for n in names {
            let Some(g) = self.ranks[r].invariant.get(n) else {
                continue;
            };
            if g.len() > 1 {
                let mut made = self.made_varying.borrow_mut();
                if !made.contains(n) {
                    made.push(n.clone());
                }
            }
            if let Some(out) = g.iter().find(|&&x| !runs[x]) {
                return Err(at.err(format!(
                    "under the replicated objective `{n}` is invariant over ranks {g:?}; used here as a per-rank value, its gradient is an all_reduce over them, but rank {out} does not take part with it here (only the ranks that pass it do; use a per-rank value, or the sum_of_rank_losses objective)"
                )));
            }
        }
        Ok(())
    }

    /// A local op on the ranks of `"ranks"` (default all).
    fn local(&mut self, at: At, op: &LocalOp) -> Result<()> {
        let s = at.step;
        if s.group.is_some() {
            return Err(at.err("a local op takes no \"group\""));
        }
        let runs = match &s.ranks {
            Some(r) => ranks_of("\"ranks\"", r, self.world).map_err(|x| at.err(x))?,
            None => vec![true; self.world],
        };
        let out = s
            .out
            .clone()
            .ok_or_else(|| at.err("a local op needs \"out\""))?;
        match op.arity() {
            Some(k) if s.inputs.len() != k => {
                return Err(at.err(format!("takes {k} input(s), got {}", s.inputs.len())));
            }
            None if s.inputs.is_empty() => return Err(at.err("takes at least one input")),
            _ => {}
        }
        for r in (0..self.world).filter(|&r| runs[r]) {
            let shapes = s
                .inputs
                .iter()
                .map(|n| self.lookup(at, r, n))
                .collect::<Result<Vec<_>>>()?;
            let refs: Vec<&Vec<usize>> = shapes.iter().collect();
            let shape = local_shape(op, &refs).map_err(|d| at.err(format!("rank {r}: {d}")))?;
            let cost = arithmetic(op, &refs, &shape);
            self.bind(at, r, out.clone(), shape)?;
            self.count_arithmetic(at, r, cost)?;
            let state = &mut self.ranks[r];
            if s.inputs.iter().all(|n| state.constant.contains(n)) {
                state.constant.insert(out.clone());
            }
            if self.replicated {
                self.local_invariance(at, r, &out, &runs)?;
            }
        }
        self.steps.push(Planned {
            index: at.index,
            what: What::Local(op.clone(), runs),
            inputs: s.inputs.clone(),
            out: s.out.clone(),
            made_varying: self.made_varying.take(),
        });
        Ok(())
    }

    /// Count a local op's arithmetic on rank `r` ([`arithmetic`]) against the program's budget
    /// ([`MAX_ARITHMETIC`], all ranks together).
    fn count_arithmetic(&mut self, at: At, r: usize, cost: u64) -> Result<()> {
        self.arithmetic = self.arithmetic.saturating_add(cost);
        if self.arithmetic > MAX_ARITHMETIC {
            return Err(ProgramError::TooLarge {
                what: format!("{} ({}) on rank {r}", at.origin, at.step.describe()),
                detail: format!(
                    "the program's local steps come to more than {MAX_ARITHMETIC} operations \
                     (about 2^{}) on all ranks together",
                    MAX_ARITHMETIC.ilog2()
                ),
            }
            .into());
        }
        Ok(())
    }

    /// A local op's output is invariant over a group where all its inputs are; mixing an
    /// invariant input with others makes it per-rank ([`Checker::pvary_ok`]).
    fn local_invariance(&mut self, at: At, r: usize, out: &str, runs: &[bool]) -> Result<()> {
        let inputs = &at.step.inputs;
        let groups: Vec<Option<&Vec<usize>>> = inputs
            .iter()
            .map(|n| self.ranks[r].invariant.get(n))
            .collect();
        match groups.first() {
            Some(Some(g)) if groups.iter().all(|x| *x == Some(*g)) => {
                let g = (*g).clone();
                self.ranks[r].invariant.insert(out.to_string(), g);
                Ok(())
            }
            _ => self.pvary_ok(at, r, inputs, runs),
        }
    }

    /// The index of group `members` in the plan's groups (added at its first use).
    fn group_index(&mut self, members: &[usize]) -> usize {
        match self.groups.iter().position(|g| g == members) {
            Some(i) => i,
            None => {
                self.groups.push(members.to_vec());
                self.groups.len() - 1
            }
        }
    }

    /// The global ranks that call a collective step: its `"ranks"` (send / recv only) or every
    /// member of its group.
    fn callers(&self, at: At, spec: &Spec, members: &[usize]) -> Result<Vec<usize>> {
        let is_p2p = matches!(spec, Spec::Send { .. } | Spec::Recv { .. });
        match &at.step.ranks {
            Some(r) => {
                ranks_of("\"ranks\"", r, self.world).map_err(|x| at.err(x))?;
                if let Some(out) = r.iter().find(|x| !members.contains(x)) {
                    return Err(at.err(format!("rank {out} is not in the group {members:?}")));
                }
                if !is_p2p && r.len() != members.len() {
                    return Err(at.err(format!(
                        "a {} runs on every member of its group {members:?}; \"ranks\" is for send / recv",
                        spec.kind().name()
                    )));
                }
                Ok(r.clone())
            }
            None if is_p2p => {
                Err(at.err("send / recv need \"ranks\": the ranks that send (or receive)"))
            }
            None => Ok(members.to_vec()),
        }
    }

    /// A collective step on its group.
    fn collective(&mut self, at: At, spec: &Spec) -> Result<()> {
        let s = at.step;
        let members = s.group.clone().unwrap_or_else(|| (0..self.world).collect());
        ranks_of("\"group\"", &members, self.world).map_err(|x| at.err(x))?;
        let n = members.len();
        let gi = self.group_index(&members);
        let callers = self.callers(at, spec, &members)?;
        let per_group = group_specs(&s.kind, n).map_err(|d| at.err(d))?;
        let who = |gr: usize| format!("group rank {gr} (rank {})", members[gr]);
        // Each caller's call and the shapes it passes (by group rank).
        let mut specs: Vec<Option<Spec>> = vec![None; self.world];
        let mut in_shapes: Vec<Vec<Vec<usize>>> = vec![Vec::new(); n];
        for &g in &callers {
            let gr = group_rank(&members, g);
            let call = &per_group[gr];
            call.check(gr, n)
                .map_err(|x| at.err(format!("{}: {x}", who(gr))))?;
            let k = call.n_inputs(gr, n);
            if k > 0 {
                if s.inputs.len() != k {
                    return Err(at.err(format!(
                        "{} takes {k} input(s) on {}, got {}",
                        call.kind().name(),
                        who(gr),
                        s.inputs.len()
                    )));
                }
                for name in &s.inputs {
                    in_shapes[gr].push(self.lookup(at, g, name)?);
                }
            } else if !s.inputs.is_empty() && call.kind() != Kind::Scatter {
                return Err(at.err(format!("{} takes no input", call.kind().name())));
            }
            if let Some(d) = s.dual {
                d.applies_to(call).map_err(|x| at.err(x))?;
            }
            specs[g] = Some(call.clone());
        }
        if self.replicated {
            self.collective_invariance(at, &members, &callers, &per_group)?;
        }
        let needs_out = callers.iter().any(|&g| {
            let gr = group_rank(&members, g);
            per_group[gr].n_outputs(gr, n) > 0
        });
        match (&s.out, needs_out) {
            (None, true) => return Err(at.err("needs \"out\"")),
            (Some(_), false) => {
                return Err(at.err(format!("{} has no output", spec.kind().name())));
            }
            _ => {}
        }
        match spec {
            Spec::Send { .. } | Spec::Recv { .. } => {
                self.messages(at, gi, &members, &callers, &per_group, &in_shapes)?;
            }
            Spec::Barrier {} => {}
            _ => {
                let outs =
                    collective_shapes(&per_group, &in_shapes, &who).map_err(|d| at.err(d))?;
                self.bind_outputs(at, spec.kind(), &members, outs)?;
            }
        }
        self.steps.push(Planned {
            index: at.index,
            what: What::Collective {
                group: gi,
                specs,
                dual: s.dual.unwrap_or_default(),
            },
            inputs: s.inputs.clone(),
            out: s.out.clone(),
            made_varying: self.made_varying.take(),
        });
        Ok(())
    }

    /// Under the replicated objective, the ranks that pass inputs to a collective make them
    /// per-rank (scatter: the root only), so the invariant ones must be passed by their whole
    /// group.
    fn collective_invariance(
        &self,
        at: At,
        members: &[usize],
        callers: &[usize],
        per_group: &[Spec],
    ) -> Result<()> {
        let n = members.len();
        let mut passing = vec![false; self.world];
        for &g in callers {
            let gr = group_rank(members, g);
            passing[g] = per_group[gr].n_inputs(gr, n) > 0;
        }
        for &g in callers.iter().filter(|&&g| passing[g]) {
            self.pvary_ok(at, g, &at.step.inputs, &passing)?;
        }
        Ok(())
    }

    /// A send / recv step: its messages (checked against each other once the whole program is
    /// read, [`Checker::check_messages`]) and a recv's output.
    fn messages(
        &mut self,
        at: At,
        gi: usize,
        members: &[usize],
        callers: &[usize],
        per_group: &[Spec],
        in_shapes: &[Vec<Vec<usize>>],
    ) -> Result<()> {
        for &g in callers {
            let gr = group_rank(members, g);
            match &per_group[gr] {
                Spec::Send { dst } => self
                    .sent
                    .entry((gi, gr, *dst))
                    .or_default()
                    .push((at.index, in_shapes[gr][0].clone())),
                Spec::Recv { src, shape } => {
                    self.received
                        .entry((gi, *src, gr))
                        .or_default()
                        .push((at.index, shape.clone()));
                    if let Some(o) = &at.step.out {
                        self.bind(at, g, o.clone(), shape.clone())?;
                    }
                }
                _ => {}
            }
        }
        Ok(())
    }

    /// Bind a collective's outputs on each member (`out`, or `out.0`, `out.1`, ... for a list);
    /// an all_reduce's output is invariant over its group under the replicated objective.
    fn bind_outputs(
        &mut self,
        at: At,
        kind: Kind,
        members: &[usize],
        outs: Vec<Vec<Vec<usize>>>,
    ) -> Result<()> {
        let Some(o) = &at.step.out else {
            return Ok(());
        };
        for (gr, shapes) in outs.into_iter().enumerate() {
            let g = members[gr];
            if lists_outputs(kind) {
                for (k, sh) in shapes.into_iter().enumerate() {
                    self.bind(at, g, format!("{o}.{k}"), sh)?;
                }
            } else if let Some(sh) = shapes.into_iter().next() {
                self.bind(at, g, o.clone(), sh)?;
                if self.replicated && kind == Kind::AllReduce {
                    self.ranks[g].invariant.insert(o.clone(), members.to_vec());
                }
            }
        }
        Ok(())
    }

    /// Every message sent is received, with the shape the receiver expects.
    fn check_messages(&self) -> Result<()> {
        let at = |v: &[(usize, Vec<usize>)]| {
            steps_at(&v.iter().map(|(s, _)| *s).collect::<Vec<_>>(), self.origins)
        };
        for (key, sends) in &self.sent {
            let recvs = self.received.get(key).map_or(&[][..], Vec::as_slice);
            let (g, src, dst) = *key;
            if sends.len() != recvs.len() {
                return Err(ProgramError::Unpaired {
                    group: self.groups[g].clone(),
                    src,
                    dst,
                    sent: sends.len(),
                    sent_at: at(sends),
                    received: recvs.len(),
                    received_at: at(recvs),
                }
                .into());
            }
            for ((ss, sh), (rs, rh)) in sends.iter().zip(recvs) {
                if sh != rh {
                    return Err(ProgramError::MessageShape {
                        sent_at: self.origins[*ss].clone(),
                        sent: sh.clone(),
                        received_at: self.origins[*rs].clone(),
                        received: rh.clone(),
                    }
                    .into());
                }
            }
        }
        for (key, recvs) in &self.received {
            if !self.sent.contains_key(key) {
                let (g, src, dst) = *key;
                return Err(ProgramError::Unsent {
                    group: self.groups[g].clone(),
                    src,
                    dst,
                    at: self.origins[recvs[0].0].clone(),
                }
                .into());
            }
        }
        Ok(())
    }

    /// Under the replicated objective a value is invariant (over one group) or varying, the same
    /// on every rank that has it, as in JAX's shard_map; else the ranks would disagree about which
    /// all_reduces the backward pass runs, and about how often the loss counts.
    fn check_replication(&self) -> Result<()> {
        let mut names: Vec<&String> = self.ranks.iter().flat_map(|s| s.shapes.keys()).collect();
        names.sort();
        names.dedup();
        for name in names {
            let holders: Vec<usize> = (0..self.world)
                .filter(|&r| self.ranks[r].shapes.contains_key(name))
                .collect();
            let kind = |r: usize| {
                let s = &self.ranks[r];
                (s.invariant.get(name), s.constant.contains(name))
            };
            let describe = |r: usize| match kind(r) {
                (Some(g), false) => format!("invariant over ranks {g:?}"),
                (Some(g), true) => format!("invariant over ranks {g:?}, without gradient"),
                (None, false) => "varying".to_string(),
                (None, true) => "varying, without gradient".to_string(),
            };
            let first = holders[0];
            if let Some(&other) = holders.iter().find(|&&r| kind(r) != kind(first))
                && (kind(first).0.is_some() || kind(other).0.is_some())
            {
                return Err(ProgramError::Replication {
                    name: name.clone(),
                    first_rank: first,
                    first: describe(first),
                    other_rank: other,
                    other: describe(other),
                    bound_by: self.origin.get(name).cloned().unwrap_or_default(),
                }
                .into());
            }
        }
        Ok(())
    }

    /// The loss: one element wherever it exists, and somewhere.
    fn check_loss(&self) -> Result<()> {
        let loss = &self.program.loss;
        check_name("loss", loss.split('.').next().unwrap_or_default())?;
        let mut has_loss = false;
        for (r, state) in self.ranks.iter().enumerate() {
            let Some(s) = state.shapes.get(loss) else {
                continue;
            };
            if crate::tensor::checked_numel(s) != Some(1) {
                return Err(ProgramError::LossShape {
                    name: loss.clone(),
                    shape: s.clone(),
                    rank: r,
                }
                .into());
            }
            has_loss = true;
            if let Some(g) = state.invariant.get(loss)
                && let Some(m) = g
                    .iter()
                    .find(|&&m| !self.ranks[m].shapes.contains_key(loss))
            {
                return Err(ProgramError::LossMissing {
                    name: loss.clone(),
                    group: g.clone(),
                    rank: *m,
                }
                .into());
            }
        }
        if !has_loss {
            return Err(ProgramError::NoLoss { name: loss.clone() }.into());
        }
        Ok(())
    }

    fn finish(self) -> Plan {
        Plan {
            program: self.program.clone(),
            world: self.world,
            groups: self.groups,
            steps: self.steps,
            built: (0..self.world)
                .map(|_| std::sync::OnceLock::new())
                .collect(),
            inputs: self.inputs,
            invariant: self.ranks.iter().map(|s| s.invariant.clone()).collect(),
            shapes: self.ranks.into_iter().map(|s| s.shapes).collect(),
        }
    }
}
