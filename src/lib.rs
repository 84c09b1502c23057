//! # distgrad — distributed autograd through collectives
//!
//! Each rank records a [`Tape`] of local ops and collectives; [`Tape::backward`] walks it in reverse
//! and runs, for every collective, its **dual** collective (broadcast ↔ reduce, gather ↔ scatter,
//! all_gather ↔ reduce_scatter, all_to_all ↔ all_to_all, all_reduce ↔ all_reduce, send ↔ recv), so
//! gradients flow across ranks. Gradients are right for every reduce op (MAX/MIN split among tied
//! ranks, PROD exact with zeros), on subgroups, and under two explicit objective conventions
//! ([`Objective`]).
//!
//! ```
//! use distgrad::{CommOptions, Communicator, ReduceOp, Tape, Tensor, dist, run_local};
//!
//! // 3 ranks; rank r holds x = [r+1]; y = all_reduce(SUM, x * x); each rank's loss = y.
//! let results = run_local(3, CommOptions::default(), |comm| async move {
//!     let tape = Tape::new();
//!     let x = tape.var(Tensor::vector(&[comm.rank() as f32 + 1.0]));
//!     let y = dist::all_reduce(&comm, &x.mul(&x)?, ReduceOp::Sum, &comm.world()).await?;
//!     let grads = tape.backward(&y.sum()?, &comm).await?;
//!     Ok((y.value().to_vec(), grads.wrt(&x)?.to_vec()))
//! });
//! for (r, res) in results.into_iter().enumerate() {
//!     let (y, gx) = res.unwrap();
//!     assert_eq!(y, vec![14.0]); // 1 + 4 + 9
//!     // objective = sum over 3 ranks of y, so d/dx_r = 3 * 2 x_r
//!     assert_eq!(gx, vec![6.0 * (r as f32 + 1.0)]);
//! }
//! ```
//!
//! # Layout
//! - [`tensor`]: [`Tensor`], an immutable f32 array of any shape; shape checks live here;
//!   [`tensor::partial`] is the local step of every reducing collective, on the tensor's device.
//! - [`backend`]: where numbers live and local kernels run ([`backend::cpu`] is the reference;
//!   `backend::gpu` (feature `wgpu`) has the WGSL kernels of `shaders/`).
//! - [`autograd`]: [`Tape`], [`Var`], local differentiable ops and backward; **the dual table** is
//!   [`autograd::dual`], one exhaustive match.
//! - [`dist`]: differentiable collectives on vars (record their [`collective::Spec`] on the tape);
//!   [`dist::call`] runs any described call.
//! - [`collective`]: the [`Communicator`] trait, [`Group`] (the one global↔group rank mapping),
//!   [`ReduceOp`], [`collective::Spec`] (THE description of one call: kind, op, root, peer,
//!   permutation, splits; serde-able), call signatures derived from it, and [`P2p`]: every collective from point-to-point messages
//!   (ring, tree, direct and pairwise algorithms, each talking through one `collective::call`
//!   that checks every message's signature; [`AllReduceAlgo`] picks the large all_reduce's,
//!   [`SmallAllReduce`] the small one's).
//!   Imports run one way inside it: p2p → the algorithms → call (messages), no circle; their
//!   local steps are the tensor API's [`tensor::partial`], never a backend's internals.
//! - [`transport`]: the [`transport::Transport`] trait (async, tag-matched bytes), the shared
//!   [`transport::Mailbox`], the in-process transport, (native) the WebSocket transport with
//!   its direct TCP links between native ranks (`transport::tcp_links`) and (wasm32) the browser's
//!   (`transport::browser`: WebSocket to the relay, WebRTC data channels, BroadcastChannels).
//!   Both relay clients drive one protocol without sockets ([`transport::session`]). It moves
//!   bytes: it imports the wire and the buffer pool, nothing of tensors or collectives.
//! - [`wire`]: the one wire format (data-frame header, tags, JSON control messages) of relay and
//!   clients.
//! - [`pool`]: recycled host buffers and their byte views, shared by wire, transports and compute.
//! - `relay` (native): the WebSocket relay server: rooms, ranks, routing, signaling, static files,
//!   data streams (`relay/stream.rs`), per-address admission limits, TLS. It imports no client
//!   transport.
//! - [`in_process`]: run N ranks in one process: as threads (`run_local`) or interleaved on one task
//!   ([`in_process::run_interleaved`], also in a browser page), or as threads over a relay.
//! - [`web`]: the views' markup ([`web::markup`], plain Rust, tested natively) and (wasm32) the
//!   rank page, one file per concern under `web/page/` (state, DOM helpers,
//!   URL parameters, the tabs' control bus, ranks, free play, lessons, diagram, bench, test API).
//! - [`program`]: THE one description of work — named inputs, local ops and collectives (each a
//!   [`collective::Spec`]), a loss — in JSON, checked before they run ([`program::Plan`]), run on
//!   any communicator ([`program::run_rank`]).
//! - [`vjp`]: the case format of `distgrad vjp`, a builder of one-collective programs, and the
//!   built-in example of each collective.
//! - [`gradcheck`](mod@gradcheck): the distributed gradient check (central differences of the
//!   global objective, every rank re-running per coordinate) behind `distgrad gradcheck`.
//! - [`lesson`]: the teaching demo's lessons (JSON in `www/lessons/`): a program plus its
//!   narrative and how it is shown, and their traces, shown by the page and printed by
//!   `distgrad run`; one file per view. [`lesson::Work`] reads a program or a lesson file.
//! - [`bench`](mod@bench): the benchmarks behind `distgrad bench`.
//! - [`train`]: data-parallel training through the collectives' duals (`distgrad train`).
//! - `rendezvous` (native): launcher variables (RANK, WORLD_SIZE, ...) and a TCP store for
//!   multi-process launches.
//! - `tls` (native): the TLS crypto provider of the relay's HTTPS and of `wss://` members.
//! - `nccl` (feature `native-nccl`): the NCCL communicator (wgpu compute, NCCL collectives).
//! - [`error`]: the one error enum.
//!
//! # Adding a collective
//! 1. A variant of [`collective::Spec`] (its JSON form comes with it). The compiler then points at
//!    every match on it: [`collective::Spec::kind`] and the arity / check methods beside it, the
//!    dual table ([`autograd::dual`]), [`dist::call`].
//! 2. Its wire kind in [`collective::Kind`] (the next code; `Kind::ALL`, `Kind::name`).
//! 3. A [`Communicator`] method: its algorithm in [`P2p`] (one file under `collective/`) and its
//!    NCCL mapping in `nccl` (build with `--features native-nccl`: the trait has no defaults, so a
//!    missing arm does not compile).
//! 4. Its differentiable function in [`dist`] (records the `Spec`); `vjp::COLLECTIVES` if a
//!    one-collective case can run it.
//! 5. Tests: a `Coll` variant in `tests/common` (its oracle is written independently of the
//!    library; `Coll::specs` maps it to the `Spec`s the library runs), which the three gradient
//!    suites iterate.

#![warn(missing_docs)]

pub mod autograd;
pub mod backend;
pub mod bench;
pub mod collective;
pub mod data;
pub mod dist;
pub mod error;
pub mod gradcheck;
pub mod lesson;
#[cfg(all(feature = "native-nccl", target_os = "linux"))]
pub mod nccl;
pub mod pool;
pub mod program;
#[cfg(all(feature = "native-nccl", not(target_os = "linux")))]
compile_error!(
    "feature `native-nccl` needs Linux (NCCL and the Vulkan-CUDA memory sharing are Linux-only)"
);
pub mod in_process;
#[cfg(not(target_arch = "wasm32"))]
pub mod relay;
#[cfg(not(target_arch = "wasm32"))]
pub mod rendezvous;
pub mod tensor;
#[cfg(not(target_arch = "wasm32"))]
pub mod tls;
pub mod train;
pub mod transport;
pub mod vjp;
pub mod web;
pub mod wire;

pub use autograd::{Grads, Objective, Tape, Var};
pub use collective::{
    AllReduceAlgo, CommOptions, Communicator, Group, P2p, ReduceOp, SmallAllReduce,
};
pub use error::{Error, ProgramError, Result};
#[cfg(not(target_arch = "wasm32"))]
pub use gradcheck::gradcheck;
pub use in_process::LocalComm;
#[cfg(not(target_arch = "wasm32"))]
pub use in_process::run_local;
pub use tensor::Tensor;

/// Read `data` as a program or lesson file and check what it runs at worlds 1 to 4, as a tab does
/// with what a member of its room sends: nothing may panic, and checking makes no inputs. The
/// fuzz target `programs` calls this.
pub fn fuzz_programs(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(work) = lesson::Work::parse(text) else {
        return;
    };
    for world in 1..=4 {
        if let Ok(p) = work.program_for(world) {
            let _ = p.plan(Some(world));
        }
    }
}

/// Feed `data` to every decoder of bytes that arrive from the network: the wire's (frame header,
/// control JSON, stream hello) and the collectives' (call signature, whole-tensor message). The
/// fuzz target calls this; none of them may panic.
pub fn fuzz_decoders(data: &[u8]) {
    wire::fuzz_decoders(data);
    let _ = collective::CallSig::decode(data);
    let _ = collective::call::decode_tensor(bytes::Bytes::copy_from_slice(data));
}
