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
    /// Bad user input to the CLI or a case file.
    #[error("{0}")]
    Input(String),
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
