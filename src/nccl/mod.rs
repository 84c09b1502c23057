//! NCCL collectives on NVIDIA GPUs (feature `native-nccl`): a [`Communicator`] whose collectives
//! are NCCL calls, so the tape and the dual table run unchanged on real GPUs.
//!
//! - **Loading**: cudarc opens `libcuda` and `libnccl` at run time, so the crate builds without
//!   CUDA. [`check_libraries`] says what is missing (cudarc itself would panic) and how to provide it.
//! - **Launch**: one process per GPU. [`NcclComm::from_launch`] takes torchrun's variables
//!   ([`LaunchEnv`]); rank 0 serves a small TCP store ([`crate::rendezvous`]) that hands every rank
//!   the NCCL unique id of the world and of each subgroup (one NCCL communicator per group, created
//!   by its members in `new_group`). The GPU is `LOCAL_RANK` (NCCL refuses two ranks on one GPU).
//! - **Mapping**: all_reduce / reduce / reduce_scatter with every [`ReduceOp`] (AVG is NCCL's own),
//!   broadcast, all_gather natively; gather, scatter, all_to_all, permute and send/recv as grouped
//!   NCCL send/recv (a list is one buffer per peer part, or one packed buffer where NCCL takes one).
//! - **Call checks**: before each collective the ranks all_gather their call signatures (a 256-byte
//!   record: kind, op, root, shape, arguments; a signature too long for it is sent as SHA-256
//!   digests of its shape and arguments, [`CallSig::record`], so the check is never skipped) and
//!   fail with [`Error::Mismatch`] naming both ranks when they differ, instead of NCCL hanging or
//!   mixing buffers. A rank whose own arguments are wrong (a root outside the group, a list of the
//!   wrong length, bad splits or pairs) still takes part, sending the reason instead of a call, so
//!   every rank fails together naming it. [`NcclOptions::check_calls`] turns it off. A rank that
//!   never calls still hangs NCCL: NCCL has no receive timeout.
//! - **Data path** ([`DataPath`]): host staging (tensor → host → CUDA buffer → NCCL → host → the
//!   input's device), or shared memory: wgpu tensors on the communicator's own GPU are copied on the
//!   GPU into Vulkan memory that CUDA imported (`shared.rs`), NCCL works there, and the results are
//!   copied on the GPU into new tensors; nothing crosses to the host (every collective; only
//!   scatter's 9-number shape head and the call checks' records are host values).
//!   [`NcclComm::bench_all_reduce`] measures NCCL alone on CUDA buffers, the staged path and (when
//!   shared) the shared path, beside the device's copy bandwidth ([`NcclComm::copy_gbps`]).
//!
//! The calls block the calling thread until the GPU is done (the `async` methods complete when first
//! polled); one process drives one GPU.
//!
//! # Layout
//! One file per concern; [`NcclComm`] is declared here and each file adds the methods of its
//! concern.
//! - `mod.rs`: the public types ([`NcclComm`], [`NcclOptions`], [`DataPath`]), the re-exports and
//!   the two lookups every file uses (a group's NCCL communicator, an error naming this rank).
//! - `probe.rs`: finding `libcuda` and `libnccl`, the device count, the NCCL version.
//! - `launch.rs`: joining the launch ([`NcclComm::from_launch`]) and a subgroup: the store, the
//!   NCCL ids, the GPU and the shared data path's wgpu device.
//! - `comm.rs`: the [`Communicator`] impl, one NCCL mapping per collective.
//! - `checks.rs`: the call check run before each collective.
//! - `buffers.rs`: tensors into device buffers and back, on either data path; grouped send/recv.
//! - `shared.rs`: the shared data path's pool of Vulkan buffers imported into CUDA.
//! - `measure.rs`: the timings `distgrad bench` prints ([`NcclComm::bench_all_reduce`],
//!   [`cuda_copy_gbps`]); not named `bench.rs`, a name the crate gives to the benchmark runners.
//!
//! [`Communicator`]: crate::collective::Communicator
//! [`LaunchEnv`]: crate::rendezvous::LaunchEnv
//! [`ReduceOp`]: crate::collective::ReduceOp
//! [`CallSig::record`]: crate::collective::CallSig::record

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::rc::Rc;
use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::CudaStream;
use cudarc::nccl::Comm;

mod buffers;
mod checks;
mod comm;
mod launch;
mod measure;
mod probe;
mod shared;

pub use measure::{NcclBenchRow, cuda_copy_gbps};
pub use probe::{check_libraries, device_count, version};

use crate::backend::Device;
use crate::collective::Group;
use crate::error::{Error, Result};
use crate::rendezvous::{Store, StoreServer};
use shared::Shared;

/// Options of the NCCL communicator.
#[derive(Debug, Clone)]
pub struct NcclOptions {
    /// Compare the ranks' call signatures before each collective (one small all_gather).
    pub check_calls: bool,
    /// How long to wait for the store (rank 0 starting, the others joining).
    pub rendezvous_timeout: Duration,
    /// Where results go (the inputs' device wins where there is an input). With
    /// [`DataPath::Shared`] and a CPU here, results without an input land on the shared GPU
    /// ([`NcclComm::device`](crate::collective::Communicator::device)).
    pub device: Device,
    /// How tensors reach NCCL.
    pub data_path: DataPath,
}

/// How a tensor's numbers reach NCCL (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DataPath {
    /// Through the host: read back, uploaded to a CUDA buffer, downloaded, put on the input's device.
    #[default]
    Staging,
    /// wgpu tensors on the communicator's GPU go through Vulkan memory imported into CUDA (no host
    /// copy); the communicator opens the wgpu device of its CUDA device (same UUID) or checks that
    /// [`NcclOptions::device`] is that one. Other tensors are staged. Linux with Vulkan only.
    Shared,
}

impl std::str::FromStr for DataPath {
    type Err = Error;
    fn from_str(s: &str) -> Result<DataPath> {
        match s {
            "staging" => Ok(DataPath::Staging),
            "shared" | "zero-copy" => Ok(DataPath::Shared),
            _ => Err(Error::Input(format!(
                "unknown data path {s:?}: use `staging` or `shared`"
            ))),
        }
    }
}

impl Default for NcclOptions {
    fn default() -> Self {
        NcclOptions {
            check_calls: true,
            rendezvous_timeout: Duration::from_secs(120),
            device: Device::Cpu,
            data_path: DataPath::Staging,
        }
    }
}

/// A communicator over NCCL: see the module docs.
pub struct NcclComm {
    rank: usize,
    world: usize,
    stream: Arc<CudaStream>,
    comms: RefCell<HashMap<u32, Rc<Comm>>>,
    seqs: RefCell<HashMap<u32, u64>>,
    next_group: Cell<u32>,
    store: RefCell<Store>,
    opts: NcclOptions,
    shared: Option<Shared>,
    _server: Option<StoreServer>,
}

/// An NCCL or CUDA failure of `op` on `rank`, with cudarc's error as the detail.
fn nccl_err(op: &'static str, rank: usize, e: impl std::fmt::Debug) -> Error {
    Error::Nccl {
        op,
        rank: Some(rank),
        detail: format!("{e:?}"),
    }
}

impl NcclComm {
    /// This rank's NCCL communicator of `group` and its rank in it (an error when not a member).
    fn comm(&self, group: &Group, op: &'static str) -> Result<(Rc<Comm>, usize)> {
        let me = group.require_member(op)?;
        let c = self
            .comms
            .borrow()
            .get(&group.id())
            .cloned()
            .ok_or_else(|| Error::Nccl {
                op,
                rank: Some(self.rank),
                detail: format!("group {} has no NCCL communicator here", group.id()),
            })?;
        Ok((c, me))
    }

    /// [`nccl_err`] on this rank.
    fn err(&self, op: &'static str, e: impl std::fmt::Debug) -> Error {
        nccl_err(op, self.rank, e)
    }
}
