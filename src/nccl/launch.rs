//! Launching: one process per GPU joins the world ([`NcclComm::from_launch`]) and later its
//! subgroups (`join_group`, called by `new_group`).
//!
//! The launch is described by torchrun's variables ([`LaunchEnv`]). Rank 0 serves a small TCP store
//! ([`crate::rendezvous`]) through which each group's leader hands its members the group's NCCL
//! unique id, under `nccl/group/<id>` (one NCCL communicator per group). The GPU is `LOCAL_RANK`:
//! NCCL refuses two ranks on one GPU. Everything that can fail on one rank (the GPU, the shared
//! data path's wgpu device) is done before the id is shared, so a failing rank leaves the others
//! waiting on the store, which times out, rather than inside NCCL, which does not.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::rc::Rc;
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaStream};
use cudarc::nccl::{Comm, Id};

use super::probe::{check_libraries, device_count};
use super::shared::Shared;
use super::{DataPath, NcclComm, NcclOptions, nccl_err};
use crate::backend::Device;
use crate::error::{Error, Result};
use crate::rendezvous::{LaunchEnv, Store, StoreServer};

impl NcclComm {
    /// Join the launch described by `env` (see [`LaunchEnv`]): rank 0 serves the store at
    /// `env.master`, every rank connects, and the world's NCCL communicator is created on GPU
    /// `env.local_rank`.
    pub fn from_launch(env: &LaunchEnv, opts: NcclOptions) -> Result<NcclComm> {
        check_gpu(env)?;
        let server = serve_store(env)?;
        let mut store =
            Store::connect(&env.master, opts.rendezvous_timeout, env.secret.as_deref())?;
        let ctx = CudaContext::new(env.local_rank).map_err(|e| nccl_err("init", env.rank, e))?;
        let stream = ctx.default_stream();
        // Before the NCCL id is shared: a rank failing here leaves the others waiting only for the
        // store (up to the rendezvous timeout), not inside NCCL, which never times out.
        let mut opts = opts;
        let shared = shared_path(&ctx, &stream, &mut opts, env.rank)?;
        let id = share_id(&mut store, 0, env.rank == 0, "init", env.rank)?;
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

    /// Create this rank's NCCL communicator of group `id`, where it is group rank `me` of `size`.
    /// Every member calls it (NCCL's creation is collective).
    pub(super) fn join_group(&self, id: u32, me: usize, size: usize) -> Result<()> {
        let nid = share_id(
            &mut self.store.borrow_mut(),
            id,
            me == 0,
            "new_group",
            self.rank,
        )?;
        let c = Comm::from_rank(self.stream.clone(), me, size, nid)
            .map_err(|e| self.err("new_group", e))?;
        self.comms.borrow_mut().insert(id, Rc::new(c));
        Ok(())
    }
}

/// The libraries load and this machine has a CUDA device for `env.local_rank`.
fn check_gpu(env: &LaunchEnv) -> Result<()> {
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
    Ok(())
}

/// On rank 0, the store's server at `env.master`; `None` elsewhere, and where the launcher serves
/// the store itself (`env.served`).
fn serve_store(env: &LaunchEnv) -> Result<Option<StoreServer>> {
    if env.rank != 0 || env.served {
        return Ok(None);
    }
    // Only where MASTER_ADDR says (never every interface): it must be rank 0's address.
    let server =
        StoreServer::start(&env.master, env.secret.as_deref()).map_err(|e| Error::Nccl {
            op: "init",
            rank: Some(0),
            detail: format!("{e} (MASTER_ADDR must name an address of rank 0's machine)"),
        })?;
    Ok(Some(server))
}

/// The shared pool when `opts` asks for the shared data path; results without an input then go to
/// the shared GPU unless `opts.device` names one.
fn shared_path(
    ctx: &Arc<CudaContext>,
    stream: &Arc<CudaStream>,
    opts: &mut NcclOptions,
    rank: usize,
) -> Result<Option<Shared>> {
    match opts.data_path {
        DataPath::Staging => Ok(None),
        DataPath::Shared => {
            let gpu = shared_gpu(ctx, &opts.device, rank)?;
            if opts.device == Device::Cpu {
                opts.device = Device::Gpu(gpu.clone());
            }
            Ok(Some(Shared::new(gpu, stream.clone(), rank)))
        }
    }
}

/// The NCCL unique id of group `group`: its leader makes it and puts it in the store under
/// `nccl/group/<group>`, the other members wait for it there.
fn share_id(
    store: &mut Store,
    group: u32,
    leader: bool,
    op: &'static str,
    rank: usize,
) -> Result<Id> {
    let key = format!("nccl/group/{group}");
    if leader {
        let id = Id::new().map_err(|e| nccl_err(op, rank, e))?;
        store.set(&key, &id_bytes(&id))?;
        Ok(id)
    } else {
        id_from(&store.get(&key)?)
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
