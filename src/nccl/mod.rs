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
//!   record: kind, op, root, shape, arguments; a signature too long for it is sent as SHA-256 digests
//!   of its shape and arguments, [`CallSig::record`], so the check is never skipped) and fail with [`Error::Mismatch`] naming both ranks
//!   when they differ, instead of NCCL hanging or mixing buffers. A rank whose own arguments are
//!   wrong (a root outside the group, a list of the wrong length, bad splits or pairs) still takes
//!   part, sending the reason instead of a call, so every rank fails together naming it.
//!   [`NcclOptions::check_calls`] turns it off. A rank that never calls still hangs NCCL: NCCL has no receive timeout.
//! - **Data path** ([`DataPath`]): host staging (tensor → host → CUDA buffer → NCCL → host → the
//!   input's device), or shared memory: wgpu tensors on the communicator's own GPU are copied on the
//!   GPU into Vulkan memory that CUDA imported ([`shared`]), NCCL works there, and the results are
//!   copied on the GPU into new tensors; nothing crosses to the host (every collective; only
//!   scatter's 9-number shape head and the call checks' records are host values).
//!   [`NcclComm::bench_all_reduce`] measures NCCL alone on CUDA buffers, the staged path and (when
//!   shared) the shared path, beside the device's copy bandwidth ([`NcclComm::copy_gbps`]).
//!
//! The calls block the calling thread until the GPU is done (the `async` methods complete when first
//! polled); one process drives one GPU.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::rc::Rc;
use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use cudarc::nccl::{self as nc, Comm, Id};

mod shared;
use shared::{DevBuf, Part, Shared};

use crate::backend::{Device, Storage};
use crate::collective::{
    CallSig, Communicator, Group, Kind, ReduceOp, Spec, check_pairs, list_shape,
};
use crate::error::{Error, Result};
use crate::rendezvous::{LaunchEnv, Store, StoreServer};
use crate::tensor::Tensor;

/// Bytes of one call-signature record in the call check.
const SIG_BYTES: usize = 256;

/// Elements of scatter's shape head: the number of dimensions, then up to 8 sizes.
const HEAD: usize = 9;

/// Scatter's head marker for "the root's shape does not fit the head": every rank fails.
const HEAD_REFUSED: u32 = u32::MAX;

/// Whether libcuda and libnccl can be loaded; an error saying what is missing and how to fix it.
pub fn check_libraries() -> Result<()> {
    // SAFETY: these only try to open the shared libraries (libloading), calling nothing in them.
    let cuda = unsafe { cudarc::driver::sys::is_culib_present() };
    let nccl = unsafe { cudarc::nccl::sys::is_culib_present() };
    let mut missing = Vec::new();
    if !cuda {
        missing.push(
            "the CUDA driver (libcuda.so) was not found: this machine has no NVIDIA driver, or it is not on the loader path"
                .to_string(),
        );
    }
    if !nccl {
        missing.push(
            "NCCL (libnccl.so) was not found: install NCCL, or point LD_LIBRARY_PATH at a folder holding libnccl.so \
             (NCCL ships libnccl.so.2: add a symlink libnccl.so -> libnccl.so.2; the pip wheel nvidia-nccl-cu12/cu13 \
             keeps it in site-packages/nvidia/nccl/lib)"
                .to_string(),
        );
    }
    if missing.is_empty() {
        Ok(())
    } else {
        Err(Error::Nccl {
            op: "load",
            rank: None,
            detail: missing.join("; "),
        })
    }
}

/// The number of CUDA devices (after [`check_libraries`]).
pub fn device_count() -> Result<usize> {
    check_libraries()?;
    let n = CudaContext::device_count().map_err(|e| Error::Nccl {
        op: "device_count",
        rank: None,
        detail: format!("{e:?}"),
    })?;
    Ok(usize::try_from(n).unwrap_or(0))
}

/// The version of the NCCL library loaded (`2.28.9`), after [`check_libraries`].
pub fn version() -> Result<String> {
    check_libraries()?;
    let v = cudarc::nccl::result::get_nccl_version().map_err(|e| Error::Nccl {
        op: "version",
        rank: None,
        detail: format!("{e:?}"),
    })?;
    // NCCL_VERSION_CODE: major * 10000 + minor * 100 + patch since NCCL 2.9.
    Ok(format!("{}.{}.{}", v / 10000, v / 100 % 100, v % 100))
}

/// GB/s, counting bytes read and written, of CUDA's device-to-device copy between two buffers of
/// `bytes` on CUDA device `ordinal`: the device's own copy, which `distgrad bench kernels` puts
/// beside the WGSL kernels (wgpu's buffer-to-buffer copy may take another route). Best of three
/// batches, each long enough that the stream synchronization is a small part of it.
pub fn cuda_copy_gbps(ordinal: usize, bytes: usize) -> Result<f64> {
    let n = device_count()?;
    if ordinal >= n {
        return Err(Error::Nccl {
            op: "copy",
            rank: None,
            detail: format!("CUDA device {ordinal} asked for, this machine has {n}"),
        });
    }
    let err = |e: cudarc::driver::DriverError| nccl_err("copy", 0, e);
    let ctx = CudaContext::new(ordinal).map_err(err)?;
    let stream = ctx.default_stream();
    let elems = (bytes / 4).max(1);
    let src = stream.alloc_zeros::<f32>(elems).map_err(err)?;
    let mut dst = stream.alloc_zeros::<f32>(elems).map_err(err)?;
    let moved = 8.0 * elems as f64;
    let batch = ((32e9 / moved).ceil() as usize).clamp(1, 256);
    stream.memcpy_dtod(&src, &mut dst).map_err(err)?;
    stream.synchronize().map_err(err)?;
    let mut best = f64::INFINITY;
    for _ in 0..3 {
        let t0 = std::time::Instant::now();
        for _ in 0..batch {
            stream.memcpy_dtod(&src, &mut dst).map_err(err)?;
        }
        stream.synchronize().map_err(err)?;
        best = best.min(t0.elapsed().as_secs_f64() / batch as f64);
    }
    Ok(moved / best / 1e9)
}

/// Options of the NCCL communicator.
#[derive(Debug, Clone)]
pub struct NcclOptions {
    /// Compare the ranks' call signatures before each collective (one small all_gather).
    pub check_calls: bool,
    /// How long to wait for the store (rank 0 starting, the others joining).
    pub rendezvous_timeout: Duration,
    /// Where results go (the inputs' device wins where there is an input). With
    /// [`DataPath::Shared`] and a CPU here, results without an input land on the shared GPU
    /// ([`NcclComm::device`]).
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

fn nccl_err(op: &'static str, rank: usize, e: impl std::fmt::Debug) -> Error {
    Error::Nccl {
        op,
        rank: Some(rank),
        detail: format!("{e:?}"),
    }
}

fn to_nccl(op: ReduceOp) -> nc::ReduceOp {
    match op {
        ReduceOp::Sum => nc::ReduceOp::Sum,
        ReduceOp::Avg => nc::ReduceOp::Avg,
        ReduceOp::Prod => nc::ReduceOp::Prod,
        ReduceOp::Min => nc::ReduceOp::Min,
        ReduceOp::Max => nc::ReduceOp::Max,
    }
}

/// The wgpu device on the same GPU as `ctx`: `device` when it is that one, else opened by UUID.
fn shared_gpu(
    ctx: &Arc<CudaContext>,
    device: &Device,
    rank: usize,
) -> Result<crate::backend::gpu::Gpu> {
    let uuid = ctx.uuid().map_err(|e| nccl_err("init", rank, e))?;
    let uuid: [u8; 16] = uuid.bytes.map(|b| b as u8);
    let hex = crate::backend::gpu::hex(&uuid);
    match device {
        Device::Gpu(g) if g.device_uuid() == Some(uuid) => Ok(g.clone()),
        Device::Gpu(g) => Err(Error::Nccl {
            op: "init",
            rank: Some(rank),
            detail: format!(
                "the shared data path needs the wgpu device on this rank's CUDA device (UUID {hex}); \
                 {} is {}",
                g.describe(),
                if g.device_uuid().is_some() {
                    "another one"
                } else {
                    "not a Vulkan device"
                }
            ),
        }),
        Device::Cpu => futures::executor::block_on(crate::backend::gpu::Gpu::with_device_uuid(
            uuid,
        ))
        .map_err(|e| Error::Nccl {
            op: "init",
            rank: Some(rank),
            detail: format!("the shared data path needs wgpu on this rank's GPU: {e}"),
        }),
    }
}

fn id_bytes(id: &Id) -> Vec<u8> {
    id.internal().iter().map(|&c| c as u8).collect()
}

fn id_from(bytes: &[u8]) -> Result<Id> {
    if bytes.len() != 128 {
        return Err(Error::Nccl {
            op: "rendezvous",
            rank: None,
            detail: format!("NCCL id of {} bytes (expected 128)", bytes.len()),
        });
    }
    let mut a = [0 as std::ffi::c_char; 128];
    for (d, &s) in a.iter_mut().zip(bytes) {
        *d = s as std::ffi::c_char;
    }
    Ok(Id::uninit(a))
}

impl NcclComm {
    /// Join the launch described by `env` (see [`LaunchEnv`]): rank 0 serves the store at
    /// `env.master`, every rank connects, and the world's NCCL communicator is created on GPU
    /// `env.local_rank`.
    pub fn from_launch(env: &LaunchEnv, opts: NcclOptions) -> Result<NcclComm> {
        check_libraries()?;
        let n = device_count()?;
        if n == 0 {
            return Err(Error::Nccl {
                op: "init",
                rank: Some(env.rank),
                detail: "no CUDA device".into(),
            });
        }
        if env.local_rank >= n {
            return Err(Error::Nccl {
                op: "init",
                rank: Some(env.rank),
                detail: format!(
                    "LOCAL_RANK {} but this machine has {n} CUDA device(s): NCCL needs one GPU per rank",
                    env.local_rank
                ),
            });
        }
        let server = if env.rank == 0 {
            // Only where MASTER_ADDR says (never every interface): it must be rank 0's address.
            Some(
                StoreServer::start(&env.master, env.secret.as_deref()).map_err(|e| {
                    Error::Nccl {
                        op: "init",
                        rank: Some(0),
                        detail: format!(
                            "{e} (MASTER_ADDR must name an address of rank 0's machine)"
                        ),
                    }
                })?,
            )
        } else {
            None
        };
        let mut store =
            Store::connect(&env.master, opts.rendezvous_timeout, env.secret.as_deref())?;
        let ctx = CudaContext::new(env.local_rank).map_err(|e| nccl_err("init", env.rank, e))?;
        let stream = ctx.default_stream();
        // Before the NCCL id is shared: a rank failing here leaves the others waiting only for the
        // store (up to the rendezvous timeout), not inside NCCL, which never times out.
        let mut opts = opts;
        let shared = match opts.data_path {
            DataPath::Staging => None,
            DataPath::Shared => {
                let gpu = shared_gpu(&ctx, &opts.device, env.rank)?;
                if opts.device == Device::Cpu {
                    opts.device = Device::Gpu(gpu.clone());
                }
                Some(Shared::new(gpu, stream.clone(), env.rank))
            }
        };
        let id = if env.rank == 0 {
            let id = Id::new().map_err(|e| nccl_err("init", env.rank, e))?;
            store.set("nccl/group/0", &id_bytes(&id))?;
            id
        } else {
            id_from(&store.get("nccl/group/0")?)?
        };
        let comm = Comm::from_rank(stream.clone(), env.rank, env.world, id)
            .map_err(|e| nccl_err("init", env.rank, e))?;
        let mut comms = HashMap::new();
        comms.insert(0, Rc::new(comm));
        Ok(NcclComm {
            rank: env.rank,
            world: env.world,
            stream,
            comms: RefCell::new(comms),
            seqs: RefCell::new(HashMap::new()),
            next_group: Cell::new(1),
            store: RefCell::new(store),
            opts,
            shared,
            _server: server,
        })
    }

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

    fn err(&self, op: &'static str, e: impl std::fmt::Debug) -> Error {
        nccl_err(op, self.rank, e)
    }

    fn upload(&self, op: &'static str, v: &[f32]) -> Result<CudaSlice<f32>> {
        // NCCL rejects zero-length buffers on some paths: keep at least one element.
        if v.is_empty() {
            return self
                .stream
                .alloc_zeros::<f32>(1)
                .map_err(|e| self.err(op, e));
        }
        self.stream.clone_htod(v).map_err(|e| self.err(op, e))
    }

    fn zeros(&self, op: &'static str, n: usize) -> Result<CudaSlice<f32>> {
        self.stream
            .alloc_zeros::<f32>(n.max(1))
            .map_err(|e| self.err(op, e))
    }

    fn download(&self, op: &'static str, b: &CudaSlice<f32>, n: usize) -> Result<Vec<f32>> {
        let mut v = self.stream.clone_dtoh(b).map_err(|e| self.err(op, e))?;
        v.truncate(n);
        Ok(v)
    }

    /// The shared pool, when tensors on `dev` can reach NCCL without the host.
    fn shared_on(&self, dev: &Device) -> Option<&Shared> {
        match (dev, &self.shared) {
            (Device::Gpu(g), Some(s)) if *g == s.gpu => Some(s),
            _ => None,
        }
    }

    /// A device buffer holding `xs` one after another (at least one element).
    fn input(&self, op: &'static str, xs: &[&Tensor]) -> Result<DevBuf> {
        let n: usize = xs.iter().map(|x| x.numel()).sum();
        let shared = self
            .shared
            .as_ref()
            .filter(|_| xs.iter().all(|x| self.shared_on(&x.device()).is_some()));
        let Some(s) = shared else {
            let mut host = Vec::with_capacity(n);
            for x in xs {
                host.extend(Self::host(x)?);
            }
            return Ok(DevBuf::Cuda(self.upload(op, &host)?));
        };
        let lease = s.lease(op, n)?;
        let mut at = 0;
        for x in xs {
            if let Storage::Gpu(b) = x.storage() {
                s.gpu.copy_range(b, 0, lease.gpu_buf(), at, x.numel())?;
                at += x.numel();
            }
        }
        // NCCL reads only after wgpu has written.
        s.gpu.sync()?;
        Ok(DevBuf::Shared(lease))
    }

    /// A device buffer for `n` results that go to `dev` (at least one element).
    fn output(&self, op: &'static str, n: usize, dev: &Device) -> Result<DevBuf> {
        match self.shared_on(dev) {
            Some(s) => Ok(DevBuf::Shared(s.lease(op, n)?)),
            None => Ok(DevBuf::Cuda(self.zeros(op, n)?)),
        }
    }

    /// Tensors on `dev` from NCCL's results in `b`: `count` consecutive runs of `shape`'s elements,
    /// each `stride` elements after the previous.
    fn finish(
        &self,
        op: &'static str,
        b: DevBuf,
        shape: &[usize],
        count: usize,
        stride: usize,
        dev: &Device,
    ) -> Result<Vec<Tensor>> {
        let n: usize = shape.iter().product();
        match b {
            DevBuf::Cuda(c) => {
                let all = self.download(op, &c, stride * count.saturating_sub(1) + n)?;
                (0..count)
                    .map(|i| self.out(all[i * stride..i * stride + n].to_vec(), shape, dev))
                    .collect()
            }
            DevBuf::Shared(lease) => {
                let s = self.shared_on(dev).ok_or_else(|| Error::Nccl {
                    op,
                    rank: Some(self.rank),
                    detail: "shared results for a device that is not the shared GPU".into(),
                })?;
                // wgpu reads only after NCCL has written.
                self.stream.synchronize().map_err(|e| self.err(op, e))?;
                let mut out = Vec::with_capacity(count);
                for i in 0..count {
                    let t = s.gpu.alloc(n)?;
                    s.gpu.copy_range(lease.gpu_buf(), i * stride, &t, 0, n)?;
                    out.push(Tensor::from_gpu(shape.to_vec(), t));
                }
                // The lease goes back to the pool only after wgpu's copies are done.
                s.gpu.sync()?;
                Ok(out)
            }
        }
    }

    /// The one tensor of [`NcclComm::finish`] with `count` 1.
    fn finish_one(
        &self,
        op: &'static str,
        b: DevBuf,
        shape: &[usize],
        dev: &Device,
    ) -> Result<Tensor> {
        let mut v = self.finish(op, b, shape, 1, 0, dev)?;
        v.pop().ok_or_else(|| Error::Nccl {
            op,
            rank: Some(self.rank),
            detail: "no result".into(),
        })
    }

    /// The call check where this rank's own arguments may be wrong (`sig` is then the error): a
    /// rank with wrong arguments still takes part in the check, sending the reason instead of a
    /// call, so its peers fail with it (naming it) instead of waiting for it inside NCCL.
    fn check_args(&self, comm: &Comm, group: &Group, sig: Result<CallSig>) -> Result<()> {
        match sig {
            Ok(sig) => self.check(comm, group, &sig),
            Err(e) => {
                let rec = crate::collective::sig::refusal_record(&e.to_string(), SIG_BYTES);
                // The peers learn the reason from the exchange; our own error is the one to give.
                let _ = self.exchange_records(comm, group, rec, None);
                Err(e)
            }
        }
    }

    /// Compare every rank's call with this one (see the module docs).
    fn check(&self, comm: &Comm, group: &Group, sig: &CallSig) -> Result<()> {
        // Long signatures travel as digests: the check is never skipped.
        self.exchange_records(comm, group, sig.record(SIG_BYTES), Some(sig))
    }

    /// All-gather one check record per rank (`rec`, ours) and compare each with `sig` (`None`: we
    /// only tell the others why we have no call).
    fn exchange_records(
        &self,
        comm: &Comm,
        group: &Group,
        rec: Vec<u8>,
        sig: Option<&CallSig>,
    ) -> Result<()> {
        let seq = {
            let mut s = self.seqs.borrow_mut();
            let e = s.entry(group.id()).or_insert(0);
            *e += 1;
            *e
        };
        if !self.opts.check_calls || group.size() == 1 {
            return Ok(());
        }
        let send = self
            .stream
            .clone_htod(&rec)
            .map_err(|e| self.err("call check", e))?;
        let mut recv = self
            .stream
            .alloc_zeros::<u8>(SIG_BYTES * group.size())
            .map_err(|e| self.err("call check", e))?;
        comm.all_gather(&send, &mut recv)
            .map_err(|e| self.err("call check", e))?;
        let all = self
            .stream
            .clone_dtoh(&recv)
            .map_err(|e| self.err("call check", e))?;
        let Some(sig) = sig else { return Ok(()) };
        for (r, rec) in all.chunks(SIG_BYTES).enumerate() {
            if let Err(peer_call) = sig.agrees_record(rec) {
                return Err(Error::Mismatch {
                    group: group.id(),
                    seq,
                    rank: self.rank,
                    call: sig.to_string(),
                    peer: group.global(r),
                    peer_call,
                });
            }
        }
        Ok(())
    }

    fn host(x: &Tensor) -> Result<Vec<f32>> {
        x.try_to_vec()
    }

    fn out(&self, data: Vec<f32>, shape: &[usize], dev: &Device) -> Result<Tensor> {
        Tensor::from_vec(data, shape)?.to_device(dev)
    }

    /// Receive buffers for `(peer, element count)` pairs, for results on `dev`.
    fn recv_bufs(
        &self,
        op: &'static str,
        recvs: &[(usize, usize)],
        dev: &Device,
    ) -> Result<Vec<(usize, usize, DevBuf)>> {
        recvs
            .iter()
            .map(|&(p, n)| Ok((p, n, self.output(op, n, dev)?)))
            .collect()
    }

    /// Grouped NCCL send/recv: `sends` (peer group rank, region) and `recvs` (peer, element
    /// count, buffer of exactly that many elements, or one for zero). Empty transfers are skipped.
    fn exchange(
        &self,
        op: &'static str,
        comm: &Comm,
        sends: &[(usize, Part<'_>)],
        recvs: &mut [(usize, usize, DevBuf)],
    ) -> Result<()> {
        nc::group_start().map_err(|e| self.err(op, e))?;
        let mut res = Ok(());
        for (p, part) in sends {
            if part.len == 0 {
                continue;
            }
            if let Err(e) = comm.send(part, *p as i32) {
                res = Err(self.err(op, e));
            }
        }
        for (p, n, b) in recvs.iter_mut() {
            if *n == 0 {
                continue;
            }
            debug_assert!(
                cudarc::driver::DeviceSlice::len(b) >= *n,
                "{op}: receive buffer shorter than the message"
            );
            if let Err(e) = comm.recv(b, *p as i32) {
                res = Err(self.err(op, e));
            }
        }
        let end = nc::group_end().map_err(|e| self.err(op, e));
        res?;
        end.map(|_| ())
    }

    /// One tensor of `shape` on `dev` from consecutive regions of device buffers (all staged or
    /// all shared).
    fn finish_concat(
        &self,
        op: &'static str,
        parts: &[Part<'_>],
        shape: &[usize],
        dev: &Device,
    ) -> Result<Tensor> {
        let total: usize = parts.iter().map(|p| p.len).sum();
        let all_shared = parts.iter().all(|p| matches!(p.buf, DevBuf::Shared(_)));
        match self.shared_on(dev) {
            Some(s) if all_shared => {
                self.stream.synchronize().map_err(|e| self.err(op, e))?;
                let out = s.gpu.alloc(total)?;
                let mut at = 0;
                for p in parts {
                    if let DevBuf::Shared(l) = p.buf {
                        s.gpu.copy_range(l.gpu_buf(), p.start, &out, at, p.len)?;
                    }
                    at += p.len;
                }
                s.gpu.sync()?;
                Ok(Tensor::from_gpu(shape.to_vec(), out))
            }
            _ if parts.iter().all(|p| matches!(p.buf, DevBuf::Cuda(_))) => {
                let mut host = Vec::with_capacity(total);
                for p in parts.iter().filter(|p| p.len > 0) {
                    host.extend(self.stream.clone_dtoh(p).map_err(|e| self.err(op, e))?);
                }
                self.out(host, shape, dev)
            }
            _ => Err(Error::Nccl {
                op,
                rank: Some(self.rank),
                detail: "staged and shared buffers mixed in one result".into(),
            }),
        }
    }
}

/// One size of the NCCL all_reduce benchmark ([`NcclComm::bench_all_reduce`]).
#[derive(Debug, Clone, Copy)]
pub struct NcclBenchRow {
    /// Bytes per rank.
    pub bytes: usize,
    /// Seconds per call with both buffers resident on the GPU (NCCL alone: what a zero-copy
    /// path from the compute buffers can reach).
    pub device_s: f64,
    /// Seconds per call through the [`Communicator`] API with a host tensor: host staging
    /// (upload, NCCL, download) plus the call check.
    pub staged_s: f64,
    /// Seconds per call through the [`Communicator`] API with a tensor on the shared GPU
    /// ([`DataPath::Shared`]: device copies in and out, NCCL, the call check); `None` when the
    /// communicator stages.
    pub shared_s: Option<f64>,
}

impl NcclComm {
    /// Device-to-device copy bandwidth of this rank's GPU (GB/s of bytes copied; the baseline
    /// beside NCCL's bus bandwidth).
    pub fn copy_gbps(&self, bytes: usize) -> Result<f64> {
        let n = (bytes / 4).max(1);
        let src = self.zeros("bench", n)?;
        let mut dst = self.zeros("bench", n)?;
        let sync = |s: &Self| s.stream.synchronize().map_err(|e| s.err("bench", e));
        self.stream
            .memcpy_dtod(&src, &mut dst)
            .map_err(|e| self.err("bench", e))?;
        sync(self)?;
        let iters = 20;
        let t0 = std::time::Instant::now();
        for _ in 0..iters {
            self.stream
                .memcpy_dtod(&src, &mut dst)
                .map_err(|e| self.err("bench", e))?;
        }
        sync(self)?;
        Ok((n * 4 * iters) as f64 / t0.elapsed().as_secs_f64() / 1e9)
    }

    /// all_reduce(SUM) of `bytes` per rank over the world, `iters` calls after one warm-up, both
    /// with GPU-resident buffers and through the Communicator API with a host tensor. Every rank
    /// must call it with the same arguments.
    pub fn bench_all_reduce(&self, bytes: usize, iters: usize) -> Result<NcclBenchRow> {
        let g = self.world();
        let (c, _) = self.comm(&g, "bench")?;
        let n = (bytes / 4).max(1);
        let iters = iters.max(1);
        let sync = |s: &Self| s.stream.synchronize().map_err(|e| s.err("bench", e));
        let send = self.upload("bench", &vec![1.0f32; n])?;
        let mut recv = self.zeros("bench", n)?;
        let op = to_nccl(ReduceOp::Sum);
        c.all_reduce(&send, &mut recv, &op)
            .map_err(|e| self.err("bench", e))?;
        sync(self)?;
        let t0 = std::time::Instant::now();
        for _ in 0..iters {
            c.all_reduce(&send, &mut recv, &op)
                .map_err(|e| self.err("bench", e))?;
        }
        sync(self)?;
        let device_s = t0.elapsed().as_secs_f64() / iters as f64;
        let x = Tensor::full(&[n], 1.0);
        futures::executor::block_on(self.all_reduce(&x, ReduceOp::Sum, &g))?;
        let t0 = std::time::Instant::now();
        for _ in 0..iters {
            futures::executor::block_on(self.all_reduce(&x, ReduceOp::Sum, &g))?;
        }
        let staged_s = t0.elapsed().as_secs_f64() / iters as f64;
        let shared_s = match &self.shared {
            None => None,
            Some(s) => {
                let x = x.to_device(&Device::Gpu(s.gpu.clone()))?;
                let y = futures::executor::block_on(self.all_reduce(&x, ReduceOp::Sum, &g))?;
                // Check the result once: every rank gave ones, so each element is the world size.
                let got = y.try_to_vec()?;
                let want = self.world as f32;
                if let Some((i, v)) = got.iter().enumerate().find(|(_, v)| **v != want) {
                    return Err(Error::Nccl {
                        op: "bench",
                        rank: Some(self.rank),
                        detail: format!("shared all_reduce gave {v} at {i}, expected {want}"),
                    });
                }
                let t0 = std::time::Instant::now();
                for _ in 0..iters {
                    futures::executor::block_on(self.all_reduce(&x, ReduceOp::Sum, &g))?;
                }
                Some(t0.elapsed().as_secs_f64() / iters as f64)
            }
        };
        Ok(NcclBenchRow {
            bytes: n * 4,
            device_s,
            staged_s,
            shared_s,
        })
    }
}

impl Communicator for NcclComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world
    }

    fn world(&self) -> Group {
        Group::new(0, (0..self.world).collect(), self.world, self.rank)
            .expect("0..world is a valid group")
    }

    /// The device results without an input go to ([`NcclOptions::device`]; the shared GPU when
    /// the data path is shared and no device was given).
    fn device(&self) -> Device {
        self.opts.device.clone()
    }

    fn new_group(&self, ranks: &[usize]) -> Result<Group> {
        let id = self.next_group.get();
        let g = Group::new(id, ranks.to_vec(), self.world, self.rank)?;
        self.next_group.set(id + 1);
        if let Some(me) = g.rank() {
            let key = format!("nccl/group/{id}");
            let mut store = self.store.borrow_mut();
            let nid = if me == 0 {
                let nid = Id::new().map_err(|e| self.err("new_group", e))?;
                store.set(&key, &id_bytes(&nid))?;
                nid
            } else {
                id_from(&store.get(&key)?)?
            };
            let c = Comm::from_rank(self.stream.clone(), me, g.size(), nid)
                .map_err(|e| self.err("new_group", e))?;
            self.comms.borrow_mut().insert(id, Rc::new(c));
        }
        Ok(g)
    }

    async fn broadcast(&self, x: &Tensor, root: usize, group: &Group) -> Result<Tensor> {
        let (c, me) = self.comm(group, "broadcast")?;
        let sig = group
            .check_rank("broadcast", "root", root)
            .map(|()| Spec::Broadcast { root }.sig().shape(x.shape()));
        self.check_args(&c, group, sig)?;
        let dev = x.device();
        let mut recv = self.output("broadcast", x.numel(), &dev)?;
        if me == root {
            let send = self.input("broadcast", &[x])?;
            c.broadcast(Some(&send), &mut recv, root as i32)
        } else {
            c.broadcast(None::<&DevBuf>, &mut recv, root as i32)
        }
        .map_err(|e| self.err("broadcast", e))?;
        self.finish_one("broadcast", recv, x.shape(), &dev)
    }

    async fn reduce(
        &self,
        x: &Tensor,
        root: usize,
        op: ReduceOp,
        group: &Group,
    ) -> Result<Option<Tensor>> {
        let (c, me) = self.comm(group, "reduce")?;
        let sig = group
            .check_rank("reduce", "root", root)
            .map(|()| Spec::Reduce { root, op }.sig().shape(x.shape()));
        self.check_args(&c, group, sig)?;
        let dev = x.device();
        let send = self.input("reduce", &[x])?;
        let mut recv = if me == root {
            Some(self.output("reduce", x.numel(), &dev)?)
        } else {
            None
        };
        c.reduce(&send, recv.as_mut(), &to_nccl(op), root as i32)
            .map_err(|e| self.err("reduce", e))?;
        match recv {
            Some(recv) => Ok(Some(self.finish_one("reduce", recv, x.shape(), &dev)?)),
            None => {
                // Keep the stream ordered before `send` is freed.
                self.stream
                    .synchronize()
                    .map_err(|e| self.err("reduce", e))?;
                Ok(None)
            }
        }
    }

    async fn all_reduce(&self, x: &Tensor, op: ReduceOp, group: &Group) -> Result<Tensor> {
        let (c, _) = self.comm(group, "all_reduce")?;
        self.check(&c, group, &Spec::AllReduce { op }.sig().shape(x.shape()))?;
        let dev = x.device();
        let send = self.input("all_reduce", &[x])?;
        let mut recv = self.output("all_reduce", x.numel(), &dev)?;
        c.all_reduce(&send, &mut recv, &to_nccl(op))
            .map_err(|e| self.err("all_reduce", e))?;
        self.finish_one("all_reduce", recv, x.shape(), &dev)
    }

    async fn gather(&self, x: &Tensor, root: usize, group: &Group) -> Result<Option<Vec<Tensor>>> {
        let (c, me) = self.comm(group, "gather")?;
        let sig = group
            .check_rank("gather", "root", root)
            .map(|()| Spec::Gather { root }.sig().shape(x.shape()));
        self.check_args(&c, group, sig)?;
        let n = x.numel();
        if me != root {
            let send = self.input("gather", &[x])?;
            self.exchange("gather", &c, &[(root, Part::new(&send, 0, n)?)], &mut [])?;
            return Ok(None);
        }
        let dev = x.device();
        let peers: Vec<(usize, usize)> = (0..group.size())
            .filter(|&r| r != me)
            .map(|r| (r, n))
            .collect();
        let mut recvs = self.recv_bufs("gather", &peers, &dev)?;
        self.exchange("gather", &c, &[], &mut recvs)?;
        let mut got = recvs.into_iter();
        let mut out = Vec::with_capacity(group.size());
        for r in 0..group.size() {
            if r == me {
                out.push(x.clone());
            } else if let Some((_, _, b)) = got.next() {
                out.push(self.finish_one("gather", b, x.shape(), &dev)?);
            }
        }
        Ok(Some(out))
    }

    async fn scatter(&self, xs: Option<&[Tensor]>, root: usize, group: &Group) -> Result<Tensor> {
        let (c, me) = self.comm(group, "scatter")?;
        let sig = Spec::Scatter { root }.sig();
        if let Err(e) = group.check_rank("scatter", "root", root) {
            self.check_args(&c, group, Err(e.clone()))?;
            return Err(e);
        }
        if me == root {
            let args = xs
                .ok_or_else(|| {
                    Error::invalid(
                        "scatter",
                        format!("the root (group rank {root}) must pass the list"),
                    )
                })
                .and_then(|xs| Ok((xs, list_shape("scatter", xs, group.size())?)));
            let (xs, shape) = match args {
                Ok(a) => a,
                Err(e) => {
                    self.check_args(&c, group, Err(e.clone()))?;
                    return Err(e);
                }
            };
            self.check(&c, group, &sig.shape(&shape))?;
            // Tell the others the shape (a fixed-size head: NCCL needs equal counts on both
            // sides), then send each its tensor. The numbers travel as the bits of u32s in f32
            // slots (exact at any size); a shape the head cannot hold is sent as the marker
            // `HEAD_REFUSED`, so every rank fails here instead of waiting for data.
            let fits = shape.len() < HEAD && shape.iter().all(|&d| u32::try_from(d).is_ok());
            let mut head = vec![f32::from_bits(0); HEAD];
            head[0] = f32::from_bits(if fits {
                shape.len() as u32
            } else {
                HEAD_REFUSED
            });
            if fits {
                for (h, &d) in head[1..].iter_mut().zip(&shape) {
                    *h = f32::from_bits(d as u32);
                }
            }
            let head = DevBuf::Cuda(self.upload("scatter", &head)?);
            let peers: Vec<usize> = (0..group.size()).filter(|&r| r != me).collect();
            let heads: Vec<(usize, Part<'_>)> = peers
                .iter()
                .map(|&p| Ok((p, Part::new(&head, 0, HEAD)?)))
                .collect::<Result<_>>()?;
            self.exchange("scatter", &c, &heads, &mut [])?;
            if !fits {
                return Err(Error::invalid(
                    "scatter",
                    format!(
                        "shape {shape:?} cannot be sent to the other ranks: at most {} dimensions of at most {} elements",
                        HEAD - 1,
                        u32::MAX
                    ),
                ));
            }
            let n = xs[me].numel();
            let bufs: Vec<(usize, DevBuf)> = peers
                .iter()
                .map(|&p| Ok((p, self.input("scatter", &[&xs[p]])?)))
                .collect::<Result<_>>()?;
            let sends: Vec<(usize, Part<'_>)> = bufs
                .iter()
                .map(|(p, b)| Ok((*p, Part::new(b, 0, n)?)))
                .collect::<Result<_>>()?;
            self.exchange("scatter", &c, &sends, &mut [])?;
            return Ok(xs[me].clone());
        }
        self.check(&c, group, &sig)?;
        let mut head = [(root, HEAD, DevBuf::Cuda(self.zeros("scatter", HEAD)?))];
        self.exchange("scatter", &c, &[], &mut head)?;
        let head = match &head[0].2 {
            DevBuf::Cuda(b) => self.download("scatter", b, HEAD)?,
            DevBuf::Shared(_) => {
                return Err(self.err("scatter", "the shape head was not a CUDA buffer"));
            }
        };
        let ndim = head.first().map_or(HEAD_REFUSED, |h| h.to_bits());
        let shape: Vec<usize> = match head.get(1..1 + ndim as usize) {
            Some(dims) if ndim != HEAD_REFUSED => {
                dims.iter().map(|d| d.to_bits() as usize).collect()
            }
            _ => {
                return Err(Error::invalid(
                    "scatter",
                    format!(
                        "the root (group rank {root}) passed a shape that cannot be sent: more than {} dimensions, or one over {} elements",
                        HEAD - 1,
                        u32::MAX
                    ),
                ));
            }
        };
        let n: usize = shape.iter().product();
        let dev = self.opts.device.clone();
        let mut recv = self.recv_bufs("scatter", &[(root, n)], &dev)?;
        self.exchange("scatter", &c, &[], &mut recv)?;
        let (_, _, b) = recv
            .pop()
            .ok_or_else(|| self.err("scatter", "no receive buffer"))?;
        self.finish_one("scatter", b, &shape, &dev)
    }

    async fn all_gather(&self, x: &Tensor, group: &Group) -> Result<Vec<Tensor>> {
        let (c, _) = self.comm(group, "all_gather")?;
        self.check(&c, group, &Spec::AllGather {}.sig().shape(x.shape()))?;
        // Each rank's part takes at least one slot (NCCL refuses empty buffers).
        let slot = x.numel().max(1);
        let dev = x.device();
        let send = self.input("all_gather", &[x])?;
        let mut recv = self.output("all_gather", slot * group.size(), &dev)?;
        c.all_gather(&send, &mut recv)
            .map_err(|e| self.err("all_gather", e))?;
        self.finish("all_gather", recv, x.shape(), group.size(), slot, &dev)
    }

    async fn reduce_scatter(&self, xs: &[Tensor], op: ReduceOp, group: &Group) -> Result<Tensor> {
        let (c, _) = self.comm(group, "reduce_scatter")?;
        let shape = list_shape("reduce_scatter", xs, group.size());
        let sig = shape
            .as_ref()
            .map(|s| Spec::ReduceScatter { op }.sig().shape(s))
            .map_err(Clone::clone);
        self.check_args(&c, group, sig)?;
        let shape = shape?;
        let n = xs[0].numel();
        let dev = xs[0].device();
        let refs: Vec<&Tensor> = xs.iter().collect();
        let send = self.input("reduce_scatter", &refs)?;
        let mut recv = self.output("reduce_scatter", n, &dev)?;
        if n > 0 {
            c.reduce_scatter(&send, &mut recv, &to_nccl(op))
                .map_err(|e| self.err("reduce_scatter", e))?;
        }
        self.finish_one("reduce_scatter", recv, &shape, &dev)
    }

    async fn all_to_all(&self, xs: &[Tensor], group: &Group) -> Result<Vec<Tensor>> {
        let (c, me) = self.comm(group, "all_to_all")?;
        let shape = list_shape("all_to_all", xs, group.size());
        let sig = shape
            .as_ref()
            .map(|s| Spec::AllToAll {}.sig().shape(s))
            .map_err(Clone::clone);
        self.check_args(&c, group, sig)?;
        let shape = shape?;
        let n = xs[0].numel();
        let dev = xs[0].device();
        let peers: Vec<usize> = (0..group.size()).filter(|&r| r != me).collect();
        let bufs: Vec<(usize, DevBuf)> = peers
            .iter()
            .map(|&p| Ok((p, self.input("all_to_all", &[&xs[p]])?)))
            .collect::<Result<_>>()?;
        let sends: Vec<(usize, Part<'_>)> = bufs
            .iter()
            .map(|(p, b)| Ok((*p, Part::new(b, 0, n)?)))
            .collect::<Result<_>>()?;
        let want: Vec<(usize, usize)> = peers.iter().map(|&p| (p, n)).collect();
        let mut recvs = self.recv_bufs("all_to_all", &want, &dev)?;
        self.exchange("all_to_all", &c, &sends, &mut recvs)?;
        let mut got = recvs.into_iter();
        let mut out = Vec::with_capacity(group.size());
        for r in 0..group.size() {
            if r == me {
                // Like every other part of the result, the own part lives on the input's device.
                out.push(xs[me].to_device(&dev)?);
            } else if let Some((_, _, b)) = got.next() {
                out.push(self.finish_one("all_to_all", b, &shape, &dev)?);
            }
        }
        Ok(out)
    }

    async fn all_to_all_single(
        &self,
        x: &Tensor,
        in_splits: &[usize],
        out_splits: &[usize],
        group: &Group,
    ) -> Result<Tensor> {
        let (c, me) = self.comm(group, "all_to_all_single")?;
        let g = group.size();
        let rows = x.shape().first().copied().unwrap_or(0);
        let row: usize = x.shape().iter().skip(1).product();
        let sig = if in_splits.len() != g || out_splits.len() != g {
            Err(Error::invalid(
                "all_to_all_single",
                format!("splits must have {g} entries (group size)"),
            ))
        } else if in_splits.iter().sum::<usize>() != rows {
            Err(Error::invalid(
                "all_to_all_single",
                format!("in_splits {in_splits:?} do not add up to the {rows} rows of the input"),
            ))
        } else {
            Ok(CallSig::new(Kind::AllToAllSingle).extra(vec![row as u64]))
        };
        self.check_args(&c, group, sig)?;
        let dev = x.device();
        let send = self.input("all_to_all_single", &[x])?;
        let mut starts = Vec::with_capacity(g);
        let mut s = 0;
        for &k in in_splits {
            starts.push(s);
            s += k * row;
        }
        let peers: Vec<usize> = (0..g).filter(|&r| r != me).collect();
        let sends: Vec<(usize, Part<'_>)> = peers
            .iter()
            .map(|&p| Ok((p, Part::new(&send, starts[p], in_splits[p] * row)?)))
            .collect::<Result<_>>()?;
        let want: Vec<(usize, usize)> = peers.iter().map(|&p| (p, out_splits[p] * row)).collect();
        let mut recvs = self.recv_bufs("all_to_all_single", &want, &dev)?;
        self.exchange("all_to_all_single", &c, &sends, &mut recvs)?;
        // Checked after the exchange, so that the peers' calls complete (NCCL cannot time out).
        if in_splits[me] != out_splits[me] {
            return Err(Error::invalid(
                "all_to_all_single",
                format!(
                    "rank sends itself {} rows but expects {}",
                    in_splits[me], out_splits[me]
                ),
            ));
        }
        let mut parts = Vec::with_capacity(g);
        let mut got = recvs.iter();
        for r in 0..g {
            if r == me {
                parts.push(Part::new(&send, starts[me], in_splits[me] * row)?);
            } else if let Some((_, n, b)) = got.next() {
                parts.push(Part::new(b, 0, *n)?);
            }
        }
        let mut shape = x.shape().to_vec();
        if shape.is_empty() {
            shape.push(0);
        }
        shape[0] = out_splits.iter().sum();
        self.finish_concat("all_to_all_single", &parts, &shape, &dev)
    }

    async fn send(&self, x: &Tensor, dst: usize, group: &Group) -> Result<()> {
        group.check_rank("send", "dst", dst)?;
        let (c, _) = self.comm(group, "send")?;
        let b = self.input("send", &[x])?;
        self.exchange("send", &c, &[(dst, Part::new(&b, 0, x.numel())?)], &mut [])
    }

    async fn recv(&self, shape: &[usize], src: usize, group: &Group) -> Result<Tensor> {
        group.check_rank("recv", "src", src)?;
        let (c, _) = self.comm(group, "recv")?;
        let n: usize = shape.iter().product();
        let dev = self.opts.device.clone();
        let mut recv = self.recv_bufs("recv", &[(src, n)], &dev)?;
        self.exchange("recv", &c, &[], &mut recv)?;
        let (_, _, b) = recv
            .pop()
            .ok_or_else(|| self.err("recv", "no receive buffer"))?;
        self.finish_one("recv", b, shape, &dev)
    }

    async fn permute(&self, x: &Tensor, pairs: &[(usize, usize)], group: &Group) -> Result<Tensor> {
        let (c, me) = self.comm(group, "permute")?;
        let sig = check_pairs("permute", pairs, group.size()).map(|()| {
            let extra: Vec<u64> = pairs
                .iter()
                .flat_map(|&(a, b)| [a as u64, b as u64])
                .collect();
            CallSig::new(Kind::Permute).shape(x.shape()).extra(extra)
        });
        self.check_args(&c, group, sig)?;
        let n = x.numel();
        let dev = x.device();
        let to: Vec<usize> = pairs.iter().filter(|p| p.0 == me).map(|p| p.1).collect();
        let from: Vec<usize> = pairs.iter().filter(|p| p.1 == me).map(|p| p.0).collect();
        let send = if to.iter().any(|&d| d != me) {
            Some(self.input("permute", &[x])?)
        } else {
            None
        };
        let sends: Vec<(usize, Part<'_>)> = match &send {
            Some(b) => to
                .iter()
                .filter(|&&d| d != me)
                .map(|&d| Ok((d, Part::new(b, 0, n)?)))
                .collect::<Result<_>>()?,
            None => Vec::new(),
        };
        let want: Vec<(usize, usize)> =
            from.iter().filter(|&&s| s != me).map(|&s| (s, n)).collect();
        let mut recvs = self.recv_bufs("permute", &want, &dev)?;
        self.exchange("permute", &c, &sends, &mut recvs)?;
        if let Some((_, _, b)) = recvs.into_iter().next() {
            return self.finish_one("permute", b, x.shape(), &dev);
        }
        if to == [me] {
            return Ok(x.clone());
        }
        // Nobody sends to this rank: zeros (what the in-process group gives).
        Tensor::zeros(x.shape()).to_device(&dev)
    }

    async fn barrier(&self, group: &Group) -> Result<()> {
        let (c, _) = self.comm(group, "barrier")?;
        self.check(&c, group, &Spec::Barrier {}.sig())?;
        let send = self.upload("barrier", &[0.0])?;
        let mut recv = self.zeros("barrier", 1)?;
        c.all_reduce(&send, &mut recv, &nc::ReduceOp::Sum)
            .map_err(|e| self.err("barrier", e))?;
        self.stream
            .synchronize()
            .map_err(|e| self.err("barrier", e))
    }

    async fn abort(&self, reason: &str) {
        // NCCL cannot tell the peers; dropping the communicators aborts them locally, and the
        // peers' pending calls fail when NCCL notices (or hang: NCCL has no receive timeout).
        let _ = reason;
        self.comms.borrow_mut().clear();
    }
}
