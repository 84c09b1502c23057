//! The one error type of the library: a `thiserror` enum whose variants carry the context a user needs
//! to find the fault (op, rank, group, shapes), never a bare string from deep inside.

use std::time::Duration;

/// Result alias used across distgrad.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in distgrad.
#[derive(Debug, Clone, thiserror::Error, PartialEq)]
pub enum Error {
    /// A tensor was built from data whose length does not match its shape.
    #[error("{op}: shape {shape:?} needs {expected} elements, got {got}")]
    DataLength {
        /// The operation that built the tensor.
        op: &'static str,
        /// The requested shape.
        shape: Vec<usize>,
        /// `shape.iter().product()`.
        expected: usize,
        /// Length of the data that was given.
        got: usize,
    },
    /// Operand shapes do not fit the operation.
    #[error("{op}: incompatible shapes {lhs:?} and {rhs:?}{}", if .detail.is_empty() { String::new() } else { format!(" ({})", .detail) })]
    Shape {
        /// The operation.
        op: &'static str,
        /// First operand's shape.
        lhs: Vec<usize>,
        /// Second operand's shape (or the requested shape).
        rhs: Vec<usize>,
        /// What exactly is wrong.
        detail: String,
    },
    /// An argument is out of range or otherwise invalid (bad root, bad dim, bad split sizes...).
    #[error("{op}: {detail}")]
    Invalid {
        /// The operation.
        op: &'static str,
        /// What is wrong, with the offending values.
        detail: String,
    },
    /// Two tensors live on different backends.
    #[error("{op}: operands live on different backends ({lhs} vs {rhs})")]
    BackendMismatch {
        /// The operation.
        op: &'static str,
        /// Backend of the first operand.
        lhs: &'static str,
        /// Backend of the second operand.
        rhs: &'static str,
    },
    /// A `Var` from one tape was used with another tape.
    #[error("{op}: variable belongs to a different tape")]
    ForeignVar {
        /// The operation.
        op: &'static str,
    },
    /// Ranks called different collectives (or the same one with different arguments) at the same point.
    #[error(
        "collective mismatch in group {group} at call #{seq}: rank {rank} called {call} but rank {peer} called {peer_call}"
    )]
    Mismatch {
        /// Group id.
        group: u32,
        /// Sequence number of the call in that group.
        seq: u64,
        /// Global rank that detected the mismatch.
        rank: usize,
        /// Its call, as text.
        call: String,
        /// Global rank whose call differs.
        peer: usize,
        /// The peer's call, as text.
        peer_call: String,
    },
    /// A peer sent bytes that cannot be what the protocol says they are.
    #[error("rank {rank}: malformed message from rank {peer} in {call}: {detail}")]
    Protocol {
        /// Receiving global rank.
        rank: usize,
        /// Sending global rank.
        peer: usize,
        /// The call being executed.
        call: String,
        /// What was wrong.
        detail: String,
    },
    /// A wait for a peer's message exceeded the configured timeout.
    #[error("rank {rank}: timed out after {timeout:?} waiting for rank {peer} in {call}")]
    Timeout {
        /// Waiting global rank.
        rank: usize,
        /// Global rank that was awaited.
        peer: usize,
        /// The call being executed.
        call: String,
        /// The timeout in force.
        timeout: Duration,
    },
    /// A peer left (its transport closed) while a message from it was still awaited, or its
    /// connection was lost (then every pending op fails with this).
    #[error("rank {rank}: peer rank {peer} is gone{}{}",
        if .reason.is_empty() { String::new() } else { format!(": {}", .reason) },
        if .call.is_empty() { String::new() } else { format!(" (during {})", .call) })]
    PeerLost {
        /// Waiting global rank.
        rank: usize,
        /// The lost global rank.
        peer: usize,
        /// The call being executed (empty when unknown).
        call: String,
        /// How it was lost, when known (e.g. the relay's report of a broken connection).
        reason: String,
    },
    /// Another rank failed and aborted the communicator; every pending and later op fails with this.
    #[error("rank {rank}: aborted by rank {by}: {reason}")]
    Aborted {
        /// The rank that sees the abort.
        rank: usize,
        /// The rank that aborted.
        by: usize,
        /// The error that made it abort.
        reason: String,
    },
    /// A transport-level failure (closed connection, I/O error...).
    #[error("transport (rank {rank}): {detail}")]
    Transport {
        /// Local global rank.
        rank: usize,
        /// What failed.
        detail: String,
    },
    /// A GPU failure: no adapter, device lost, out of memory, buffer too large, kernel error.
    #[error("gpu {op}: {detail}")]
    Gpu {
        /// The operation.
        op: &'static str,
        /// What happened.
        detail: String,
    },
    /// NCCL or the CUDA driver failed, or is missing (feature `native-nccl`).
    #[error("nccl {op}{}: {detail}", .rank.map_or(String::new(), |r| format!(" on rank {r}")))]
    Nccl {
        /// The operation.
        op: &'static str,
        /// Global rank, once known.
        rank: Option<usize>,
        /// What happened, and what to do about it where known.
        detail: String,
    },
    /// The relay refused us or the connection to it failed.
    #[error("relay: {detail}")]
    Relay {
        /// What happened.
        detail: String,
    },
    /// A program, lesson or case that cannot run as written (found before it runs), or the
    /// ranks that failed running one.
    #[error(transparent)]
    Program(#[from] ProgramError),
    /// Bad user input to the CLI or a case file.
    #[error("{0}")]
    Input(String),
}

/// Why a program (or a lesson, or a case) cannot run as written. Each variant carries where the
/// fault is; its message is what `distgrad` prints.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ProgramError {
    /// The text is not JSON of the format its reader takes.
    #[error("{reader} JSON: {detail}")]
    Json {
        /// What was read: `program`, `lesson`, `case`.
        reader: &'static str,
        /// serde's message, with the line and column.
        detail: String,
    },
    /// The file's `"format"` names another kind of file than its reader takes.
    #[error("{reader} JSON: \"format\": \"{declared}\" is a {declared}, not a {reader}")]
    Format {
        /// What the file says it is: `program`, `lesson`.
        declared: &'static str,
        /// What was read: `program`, `lesson`.
        reader: &'static str,
    },
    /// The world is not one a program can run on.
    #[error("world must be 1..={max}, got {world}")]
    World {
        /// The world asked for.
        world: usize,
        /// The largest world (`program::MAX_WORLD`).
        max: usize,
    },
    /// The whole problem could not be computed on one device (`program::one_device`).
    #[error("one device: {detail}")]
    OneDevice {
        /// Why.
        detail: String,
    },
    /// A checked program runs on a communicator of another world.
    #[error("the program was checked for world {planned}, the communicator has {communicator}")]
    WorldMismatch {
        /// The world of the plan.
        planned: usize,
        /// The communicator's.
        communicator: usize,
    },
    /// A name that cannot be one.
    #[error(
        "{what} {name:?}: names are non-empty, without '.' (list outputs are `name.0`, `name.1`, ...) and without spaces"
    )]
    Name {
        /// What it names: `input`, `output`, `loss`.
        what: &'static str,
        /// The name as written.
        name: String,
    },
    /// A value, or all of a program's values or arithmetic together, beyond the program's caps
    /// (`program::MAX_NUMEL`, `MAX_ELEMENTS`, `MAX_ARITHMETIC`).
    #[error("{what}: {detail}")]
    TooLarge {
        /// Where: the input, or the step as written with the rank and the value.
        what: String,
        /// Which cap, with its size.
        detail: String,
    },
    /// Two inputs of one name.
    #[error("input {name:?} is declared twice")]
    DuplicateInput {
        /// The name.
        name: String,
    },
    /// An input whose fields cannot make its values.
    #[error("input {name:?}{}: {detail}", on_rank(*.rank))]
    Input {
        /// The input's name.
        name: String,
        /// The rank whose values are wrong, where it is one rank's.
        rank: Option<usize>,
        /// What is wrong.
        detail: String,
    },
    /// A `"for"` block that cannot be expanded.
    #[error("{at}: {detail}")]
    Block {
        /// Where: `step 0 (for s)`, or a step inside it with the variable's value.
        at: String,
        /// What is wrong.
        detail: String,
    },
    /// A step that cannot run as written.
    #[error("{at} ({step}): {detail}")]
    Step {
        /// Where it is written: `step 3`, or a step of a `"for"` block with the variable's value.
        at: String,
        /// What it does: `all_reduce(op=max) [h] -> m`.
        step: String,
        /// What is wrong, with the ranks and shapes.
        detail: String,
    },
    /// A rank sends a number of messages to another that the other does not receive.
    #[error(
        "group {group:?}: group rank {src} sends {sent} message(s) to group rank {dst} ({sent_at}), which receives {received} ({received_at})"
    )]
    Unpaired {
        /// The group (global ranks).
        group: Vec<usize>,
        /// Sending group rank.
        src: usize,
        /// Receiving group rank.
        dst: usize,
        /// Messages sent.
        sent: usize,
        /// The steps that send them.
        sent_at: String,
        /// Messages received.
        received: usize,
        /// The steps that receive them.
        received_at: String,
    },
    /// A rank receives from one that sends it nothing.
    #[error(
        "group {group:?}: group rank {dst} receives from group rank {src} ({at}), which sends nothing"
    )]
    Unsent {
        /// The group (global ranks).
        group: Vec<usize>,
        /// The group rank received from.
        src: usize,
        /// The receiving group rank.
        dst: usize,
        /// The step that receives.
        at: String,
    },
    /// A message received as another shape than it is sent.
    #[error("{sent_at} sends a {sent:?} tensor that {received_at} receives as {received:?}")]
    MessageShape {
        /// The sending step.
        sent_at: String,
        /// The shape sent.
        sent: Vec<usize>,
        /// The receiving step.
        received_at: String,
        /// The shape the receiver expects.
        received: Vec<usize>,
    },
    /// Under the replicated objective, a value replicated differently on two ranks.
    #[error(
        "under the replicated objective `{name}` is {first} on rank {first_rank} but {other} on rank {other_rank} (last bound by {bound_by}): a value's replication must be the same on every rank that has it (bind it with the same kind of step on every rank, or use the sum_of_rank_losses objective)"
    )]
    Replication {
        /// The value.
        name: String,
        /// A rank that has it.
        first_rank: usize,
        /// Its replication there (`varying`, `invariant over ranks [0, 1]`, ...).
        first: String,
        /// A rank where it differs.
        other_rank: usize,
        /// Its replication there.
        other: String,
        /// The step that last bound it.
        bound_by: String,
    },
    /// A loss that is not one element.
    #[error(
        "loss `{name}` has shape {shape:?} on rank {rank}; it must have one element (add a \"sum\" step)"
    )]
    LossShape {
        /// The loss's name.
        name: String,
        /// Its shape.
        shape: Vec<usize>,
        /// On which rank.
        rank: usize,
    },
    /// A loss invariant over a group that some member does not have.
    #[error(
        "under the replicated objective the loss `{name}` is invariant over ranks {group:?} and counts once for them, so each of them must have it; rank {rank} does not"
    )]
    LossMissing {
        /// The loss's name.
        name: String,
        /// The group it is invariant over.
        group: Vec<usize>,
        /// The member without it.
        rank: usize,
    },
    /// No rank has the loss.
    #[error("loss `{name}` is defined on no rank")]
    NoLoss {
        /// The loss's name.
        name: String,
    },
    /// A lesson that cannot run as written (on this world).
    #[error("lesson {name}: {detail}")]
    Lesson {
        /// The lesson's name.
        name: String,
        /// What is wrong.
        detail: String,
    },
    /// A `distgrad vjp` case that cannot be a program.
    #[error("{detail}")]
    Case {
        /// What is wrong, naming the collective, field and rank.
        detail: String,
    },
    /// Ranks failed while running a program (index = global rank).
    #[error("the program failed:\n  {}", .ranks.iter().map(|(r, e)| format!("rank {r}: {e}")).collect::<Vec<_>>().join("\n  "))]
    Failed {
        /// Each failed rank and its error.
        ranks: Vec<(usize, String)>,
    },
}

fn on_rank(rank: Option<usize>) -> String {
    rank.map(|r| format!(" on rank {r}")).unwrap_or_default()
}

impl Error {
    /// Shorthand for [`Error::Invalid`].
    pub fn invalid(op: &'static str, detail: impl Into<String>) -> Self {
        Error::Invalid {
            op,
            detail: detail.into(),
        }
    }

    /// Shorthand for [`Error::Shape`].
    pub fn shape(
        op: &'static str,
        lhs: &[usize],
        rhs: &[usize],
        detail: impl Into<String>,
    ) -> Self {
        Error::Shape {
            op,
            lhs: lhs.to_vec(),
            rhs: rhs.to_vec(),
            detail: detail.into(),
        }
    }
}
