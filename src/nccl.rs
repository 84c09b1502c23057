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
//!   NCCL send/recv. Lists are packed into one buffer.
//! - **Call checks**: before each collective the ranks all_gather their call signatures (a 256-byte
//!   record: kind, op, root, shape, arguments) and fail with [`Error::Mismatch`] naming both ranks
//!   when they differ, instead of NCCL hanging or mixing buffers. [`NcclOptions::check_calls`] turns
//!   it off. A rank that never calls still hangs NCCL: NCCL has no receive timeout.
//! - **Data path**: host staging (tensor → host → device buffer → NCCL → host → the input's device).
//!   The zero-copy path (Vulkan memory exported to CUDA) is not written yet;
//!   [`NcclComm::bench_all_reduce`] measures the staging beside NCCL on GPU-resident buffers (what
//!   zero-copy can reach) and [`NcclComm::copy_gbps`] the device's copy bandwidth.
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

use crate::backend::Device;
use crate::collective::{CallSig, Communicator, Group, Kind, ReduceOp, check_pairs, list_shape};
use crate::error::{Error, Result};
use crate::rendezvous::{LaunchEnv, Store, StoreServer};
use crate::tensor::Tensor;

/// Bytes of one call-signature record in the call check.
const SIG_BYTES: usize = 256;

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

/// Options of the NCCL communicator.
#[derive(Debug, Clone)]
pub struct NcclOptions {
    /// Compare the ranks' call signatures before each collective (one small all_gather).
    pub check_calls: bool,
    /// How long to wait for the store (rank 0 starting, the others joining).
    pub rendezvous_timeout: Duration,
    /// Where results go (the inputs' device wins where there is an input).
    pub device: Device,
}

impl Default for NcclOptions {
    fn default() -> Self {
        NcclOptions {
            check_calls: true,
            rendezvous_timeout: Duration::from_secs(120),
            device: Device::Cpu,
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
            Some(StoreServer::start(&env.master).or_else(|_| {
                let port = env.master.rsplit(':').next().unwrap_or("0");
                StoreServer::start(&format!("0.0.0.0:{port}"))
            })?)
        } else {
            None
        };
        let mut store = Store::connect(&env.master, opts.rendezvous_timeout)?;
        let ctx = CudaContext::new(env.local_rank).map_err(|e| nccl_err("init", env.rank, e))?;
        let stream = ctx.default_stream();
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

    /// Compare every rank's call with this one (see the module docs).
    fn check(&self, comm: &Comm, group: &Group, sig: &CallSig) -> Result<()> {
        let seq = {
            let mut s = self.seqs.borrow_mut();
            let e = s.entry(group.id()).or_insert(0);
            *e += 1;
            *e
        };
        if !self.opts.check_calls || group.size() == 1 {
            return Ok(());
        }
        let enc = sig.encode();
        if enc.len() + 4 > SIG_BYTES {
            // Too long to compare whole (huge permutations): compare kind and op only.
            return Ok(());
        }
        let mut rec = vec![0u8; SIG_BYTES];
        rec[..4].copy_from_slice(&(enc.len() as u32).to_le_bytes());
        rec[4..4 + enc.len()].copy_from_slice(&enc);
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
        for (r, rec) in all.chunks(SIG_BYTES).enumerate() {
            let len = u32::from_le_bytes([rec[0], rec[1], rec[2], rec[3]]) as usize;
            let theirs = rec.get(4..4 + len).and_then(CallSig::decode);
            let agrees = theirs.as_ref().is_some_and(|t| t.agrees(sig));
            if !agrees {
                return Err(Error::Mismatch {
                    group: group.id(),
                    seq,
                    rank: self.rank,
                    call: sig.to_string(),
                    peer: group.global(r),
                    peer_call: theirs
                        .map_or_else(|| "an unreadable call".into(), |t| t.to_string()),
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

    /// Grouped NCCL send/recv: `sends` (peer group rank, data) and `recvs` (peer, element count).
    fn exchange(
        &self,
        op: &'static str,
        comm: &Comm,
        sends: &[(usize, &[f32])],
        recvs: &[(usize, usize)],
    ) -> Result<Vec<Vec<f32>>> {
        let send_bufs: Vec<(usize, CudaSlice<f32>)> = sends
            .iter()
            .filter(|(_, d)| !d.is_empty())
            .map(|&(p, d)| Ok((p, self.upload(op, d)?)))
            .collect::<Result<_>>()?;
        let mut recv_bufs: Vec<(usize, usize, CudaSlice<f32>)> = recvs
            .iter()
            .map(|&(p, n)| Ok((p, n, self.zeros(op, n)?)))
            .collect::<Result<_>>()?;
        nc::group_start().map_err(|e| self.err(op, e))?;
        let mut res = Ok(());
        for (p, b) in &send_bufs {
            if let Err(e) = comm.send(b, *p as i32) {
                res = Err(self.err(op, e));
            }
        }
        for (p, n, b) in &mut recv_bufs {
            if *n == 0 {
                continue;
            }
            if let Err(e) = comm.recv(b, *p as i32) {
                res = Err(self.err(op, e));
            }
        }
        let end = nc::group_end().map_err(|e| self.err(op, e));
        res?;
        end?;
        recv_bufs
            .iter()
            .map(|(_, n, b)| {
                if *n == 0 {
                    Ok(Vec::new())
                } else {
                    self.download(op, b, *n)
                }
            })
            .collect()
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
        Ok(NcclBenchRow {
            bytes: n * 4,
            device_s,
            staged_s,
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
        group.check_rank("broadcast", "root", root)?;
        let (c, me) = self.comm(group, "broadcast")?;
        self.check(
            &c,
            group,
            &CallSig::new(Kind::Broadcast).root(root).shape(x.shape()),
        )?;
        let n = x.numel();
        let mut recv = self.zeros("broadcast", n)?;
        if me == root {
            let send = self.upload("broadcast", &Self::host(x)?)?;
            c.broadcast(Some(&send), &mut recv, root as i32)
        } else {
            c.broadcast(None::<&CudaSlice<f32>>, &mut recv, root as i32)
        }
        .map_err(|e| self.err("broadcast", e))?;
        self.out(
            self.download("broadcast", &recv, n)?,
            x.shape(),
            &x.device(),
        )
    }

    async fn reduce(
        &self,
        x: &Tensor,
        root: usize,
        op: ReduceOp,
        group: &Group,
    ) -> Result<Option<Tensor>> {
        group.check_rank("reduce", "root", root)?;
        let (c, me) = self.comm(group, "reduce")?;
        self.check(
            &c,
            group,
            &CallSig::new(Kind::Reduce)
                .op(op)
                .root(root)
                .shape(x.shape()),
        )?;
        let n = x.numel();
        let send = self.upload("reduce", &Self::host(x)?)?;
        let mut recv = self.zeros("reduce", n)?;
        if me == root {
            c.reduce(&send, Some(&mut recv), &to_nccl(op), root as i32)
        } else {
            c.reduce(
                &send,
                None::<&mut CudaSlice<f32>>,
                &to_nccl(op),
                root as i32,
            )
        }
        .map_err(|e| self.err("reduce", e))?;
        if me != root {
            // Keep the stream ordered before `send` is freed.
            self.stream
                .synchronize()
                .map_err(|e| self.err("reduce", e))?;
            return Ok(None);
        }
        Ok(Some(self.out(
            self.download("reduce", &recv, n)?,
            x.shape(),
            &x.device(),
        )?))
    }

    async fn all_reduce(&self, x: &Tensor, op: ReduceOp, group: &Group) -> Result<Tensor> {
        let (c, _) = self.comm(group, "all_reduce")?;
        self.check(
            &c,
            group,
            &CallSig::new(Kind::AllReduce).op(op).shape(x.shape()),
        )?;
        let n = x.numel();
        let send = self.upload("all_reduce", &Self::host(x)?)?;
        let mut recv = self.zeros("all_reduce", n)?;
        c.all_reduce(&send, &mut recv, &to_nccl(op))
            .map_err(|e| self.err("all_reduce", e))?;
        self.out(
            self.download("all_reduce", &recv, n)?,
            x.shape(),
            &x.device(),
        )
    }

    async fn gather(&self, x: &Tensor, root: usize, group: &Group) -> Result<Option<Vec<Tensor>>> {
        group.check_rank("gather", "root", root)?;
        let (c, me) = self.comm(group, "gather")?;
        self.check(
            &c,
            group,
            &CallSig::new(Kind::Gather).root(root).shape(x.shape()),
        )?;
        let mine = Self::host(x)?;
        let n = x.numel();
        if me != root {
            self.exchange("gather", &c, &[(root, &mine)], &[])?;
            return Ok(None);
        }
        let recvs: Vec<(usize, usize)> = (0..group.size())
            .filter(|&r| r != me)
            .map(|r| (r, n))
            .collect();
        let mut got = self.exchange("gather", &c, &[], &recvs)?.into_iter();
        let mut out = Vec::with_capacity(group.size());
        for r in 0..group.size() {
            let data = if r == me {
                mine.clone()
            } else {
                got.next().unwrap_or_default()
            };
            out.push(self.out(data, x.shape(), &x.device())?);
        }
        Ok(Some(out))
    }

    async fn scatter(&self, xs: Option<&[Tensor]>, root: usize, group: &Group) -> Result<Tensor> {
        group.check_rank("scatter", "root", root)?;
        let (c, me) = self.comm(group, "scatter")?;
        let mut sig = CallSig::new(Kind::Scatter).root(root);
        if me == root {
            let xs = xs.ok_or_else(|| {
                Error::invalid(
                    "scatter",
                    format!("the root (group rank {root}) must pass the list"),
                )
            })?;
            let shape = list_shape("scatter", xs, group.size())?;
            sig = sig.shape(&shape);
            self.check(&c, group, &sig)?;
            // Tell the others the shape, then send each its tensor.
            let dims: Vec<f32> = shape.iter().map(|&d| d as f32).collect();
            let mut head = vec![dims.len() as f32];
            head.extend(dims);
            let peers: Vec<usize> = (0..group.size()).filter(|&r| r != me).collect();
            let heads: Vec<(usize, &[f32])> = peers.iter().map(|&p| (p, head.as_slice())).collect();
            self.exchange("scatter", &c, &heads, &[])?;
            let hosts: Vec<Vec<f32>> = xs.iter().map(Self::host).collect::<Result<_>>()?;
            let sends: Vec<(usize, &[f32])> =
                peers.iter().map(|&p| (p, hosts[p].as_slice())).collect();
            self.exchange("scatter", &c, &sends, &[])?;
            return self.out(hosts[me].clone(), &shape, &xs[me].device());
        }
        self.check(&c, group, &sig)?;
        let head = self.exchange("scatter", &c, &[], &[(root, 9)])?.remove(0);
        let ndim = head.first().copied().unwrap_or(0.0) as usize;
        let shape: Vec<usize> = head
            .get(1..1 + ndim.min(8))
            .unwrap_or(&[])
            .iter()
            .map(|&d| d as usize)
            .collect();
        let n: usize = shape.iter().product();
        let data = self.exchange("scatter", &c, &[], &[(root, n)])?.remove(0);
        self.out(data, &shape, &self.opts.device)
    }

    async fn all_gather(&self, x: &Tensor, group: &Group) -> Result<Vec<Tensor>> {
        let (c, _) = self.comm(group, "all_gather")?;
        self.check(&c, group, &CallSig::new(Kind::AllGather).shape(x.shape()))?;
        let n = x.numel();
        let send = self.upload("all_gather", &Self::host(x)?)?;
        let mut recv = self.zeros("all_gather", n.max(1) * group.size())?;
        c.all_gather(&send, &mut recv)
            .map_err(|e| self.err("all_gather", e))?;
        let all = self.download("all_gather", &recv, n.max(1) * group.size())?;
        all.chunks(n.max(1))
            .map(|ch| self.out(ch[..n].to_vec(), x.shape(), &x.device()))
            .collect()
    }

    async fn reduce_scatter(&self, xs: &[Tensor], op: ReduceOp, group: &Group) -> Result<Tensor> {
        let (c, _) = self.comm(group, "reduce_scatter")?;
        let shape = list_shape("reduce_scatter", xs, group.size())?;
        self.check(
            &c,
            group,
            &CallSig::new(Kind::ReduceScatter).op(op).shape(&shape),
        )?;
        let n = xs[0].numel();
        let mut packed = Vec::with_capacity(n * xs.len());
        for x in xs {
            packed.extend(Self::host(x)?);
        }
        let send = self.upload("reduce_scatter", &packed)?;
        let mut recv = self.zeros("reduce_scatter", n)?;
        if n > 0 {
            c.reduce_scatter(&send, &mut recv, &to_nccl(op))
                .map_err(|e| self.err("reduce_scatter", e))?;
        }
        self.out(
            self.download("reduce_scatter", &recv, n)?,
            &shape,
            &xs[0].device(),
        )
    }

    async fn all_to_all(&self, xs: &[Tensor], group: &Group) -> Result<Vec<Tensor>> {
        let (c, me) = self.comm(group, "all_to_all")?;
        let shape = list_shape("all_to_all", xs, group.size())?;
        self.check(&c, group, &CallSig::new(Kind::AllToAll).shape(&shape))?;
        let hosts: Vec<Vec<f32>> = xs.iter().map(Self::host).collect::<Result<_>>()?;
        let n = xs[0].numel();
        let peers: Vec<usize> = (0..group.size()).filter(|&r| r != me).collect();
        let sends: Vec<(usize, &[f32])> = peers.iter().map(|&p| (p, hosts[p].as_slice())).collect();
        let recvs: Vec<(usize, usize)> = peers.iter().map(|&p| (p, n)).collect();
        let mut got = self.exchange("all_to_all", &c, &sends, &recvs)?.into_iter();
        (0..group.size())
            .map(|r| {
                let d = if r == me {
                    hosts[me].clone()
                } else {
                    got.next().unwrap_or_default()
                };
                self.out(d, &shape, &xs[0].device())
            })
            .collect()
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
        if in_splits.len() != g || out_splits.len() != g {
            return Err(Error::invalid(
                "all_to_all_single",
                format!("splits must have {g} entries (group size)"),
            ));
        }
        let rows = x.shape().first().copied().unwrap_or(0);
        if in_splits.iter().sum::<usize>() != rows {
            return Err(Error::invalid(
                "all_to_all_single",
                format!("in_splits {in_splits:?} do not add up to the {rows} rows of the input"),
            ));
        }
        let row: usize = x.shape().iter().skip(1).product();
        self.check(
            &c,
            group,
            &CallSig::new(Kind::AllToAllSingle).extra(vec![row as u64]),
        )?;
        let host = Self::host(x)?;
        let mut starts = Vec::with_capacity(g);
        let mut s = 0;
        for &k in in_splits {
            starts.push(s);
            s += k * row;
        }
        let peers: Vec<usize> = (0..g).filter(|&r| r != me).collect();
        let sends: Vec<(usize, &[f32])> = peers
            .iter()
            .map(|&p| (p, &host[starts[p]..starts[p] + in_splits[p] * row]))
            .collect();
        let recvs: Vec<(usize, usize)> = peers.iter().map(|&p| (p, out_splits[p] * row)).collect();
        let mut got = self
            .exchange("all_to_all_single", &c, &sends, &recvs)?
            .into_iter();
        let mut out = Vec::with_capacity(out_splits.iter().sum::<usize>() * row);
        for r in 0..g {
            if r == me {
                if in_splits[me] != out_splits[me] {
                    return Err(Error::invalid(
                        "all_to_all_single",
                        format!(
                            "rank sends itself {} rows but expects {}",
                            in_splits[me], out_splits[me]
                        ),
                    ));
                }
                out.extend_from_slice(&host[starts[me]..starts[me] + in_splits[me] * row]);
            } else {
                out.extend(got.next().unwrap_or_default());
            }
        }
        let mut shape = x.shape().to_vec();
        if shape.is_empty() {
            shape.push(0);
        }
        shape[0] = out_splits.iter().sum();
        self.out(out, &shape, &x.device())
    }

    async fn send(&self, x: &Tensor, dst: usize, group: &Group) -> Result<()> {
        group.check_rank("send", "dst", dst)?;
        let (c, _) = self.comm(group, "send")?;
        self.exchange("send", &c, &[(dst, &Self::host(x)?)], &[])?;
        Ok(())
    }

    async fn recv(&self, shape: &[usize], src: usize, group: &Group) -> Result<Tensor> {
        group.check_rank("recv", "src", src)?;
        let (c, _) = self.comm(group, "recv")?;
        let n: usize = shape.iter().product();
        let d = self.exchange("recv", &c, &[], &[(src, n)])?.remove(0);
        self.out(d, shape, &self.opts.device)
    }

    async fn permute(&self, x: &Tensor, pairs: &[(usize, usize)], group: &Group) -> Result<Tensor> {
        let (c, me) = self.comm(group, "permute")?;
        check_pairs("permute", pairs, group.size())?;
        let extra: Vec<u64> = pairs
            .iter()
            .flat_map(|&(a, b)| [a as u64, b as u64])
            .collect();
        self.check(
            &c,
            group,
            &CallSig::new(Kind::Permute).shape(x.shape()).extra(extra),
        )?;
        let host = Self::host(x)?;
        let to: Vec<usize> = pairs.iter().filter(|p| p.0 == me).map(|p| p.1).collect();
        let from: Vec<usize> = pairs.iter().filter(|p| p.1 == me).map(|p| p.0).collect();
        let mut out = vec![0.0; x.numel()];
        if to == [me] {
            out.clone_from(&host);
        }
        let sends: Vec<(usize, &[f32])> = to
            .iter()
            .filter(|&&d| d != me)
            .map(|&d| (d, host.as_slice()))
            .collect();
        let recvs: Vec<(usize, usize)> = from
            .iter()
            .filter(|&&s| s != me)
            .map(|&s| (s, x.numel()))
            .collect();
        if let Some(d) = self
            .exchange("permute", &c, &sends, &recvs)?
            .into_iter()
            .next()
        {
            out = d;
        }
        self.out(out, x.shape(), &x.device())
    }

    async fn barrier(&self, group: &Group) -> Result<()> {
        let (c, _) = self.comm(group, "barrier")?;
        self.check(&c, group, &CallSig::new(Kind::Barrier))?;
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
