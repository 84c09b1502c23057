//! `distgrad train`: data-parallel training of a small MLP, on in-process ranks or one process per
//! GPU over NCCL (also under torchrun-style launchers).

use clap::ValueEnum;
use distgrad::train::{TrainConfig, TrainReport, train};
use distgrad::{CommOptions, Communicator as _};

use super::{DataPathArg, DeviceArg};

/// Where the ranks of `train` run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Backend {
    /// Threads of this process.
    Local,
    /// One process per GPU over NCCL (needs `--features native-nccl`).
    Nccl,
}

/// Flags of `distgrad train`.
#[derive(clap::Args)]
pub struct TrainArgs {
    /// Number of ranks (local: 1..=64; nccl: one per GPU).
    #[arg(long, default_value_t = 2)]
    world: usize,
    /// Where the ranks run.
    #[arg(long, value_enum, default_value_t = Backend::Local)]
    pub backend: Backend,
    /// Gradient steps.
    #[arg(long, default_value_t = 200)]
    steps: usize,
    /// Learning rate.
    #[arg(long, default_value_t = 0.2)]
    lr: f32,
    /// Compute backend of the ranks (with `--data-path shared`, each rank's own GPU).
    #[arg(long, value_enum, default_value_t = DeviceArg::Cpu)]
    device: DeviceArg,
    /// With `--backend nccl`: how tensors reach NCCL (`shared` implies the GPU as the device).
    #[arg(long, value_enum, default_value_t = DataPathArg::Staging)]
    data_path: DataPathArg,
}

/// Run `distgrad train`.
pub fn run(a: TrainArgs) -> distgrad::Result<()> {
    if a.steps == 0 {
        return Err(distgrad::Error::Input("--steps must be at least 1".into()));
    }
    if !(a.lr.is_finite() && a.lr > 0.0) {
        return Err(distgrad::Error::Input(format!(
            "--lr must be a positive number, got {}",
            a.lr
        )));
    }
    let cfg = TrainConfig {
        steps: a.steps,
        lr: a.lr,
        ..TrainConfig::default()
    };
    match a.backend {
        Backend::Local => local(a.world, &cfg, a.device),
        Backend::Nccl => nccl(a.world, &cfg, a.device, a.data_path),
    }
}

/// Steps between two printed losses.
fn every(cfg: &TrainConfig) -> usize {
    (cfg.steps / 10).max(1)
}

/// Train on `world` in-process ranks; print rank 0's losses, then every rank's hash.
pub fn local(world: usize, cfg: &TrainConfig, device: DeviceArg) -> distgrad::Result<()> {
    if world == 0 || world > distgrad::program::MAX_WORLD {
        return Err(distgrad::Error::Input(format!(
            "--world must be 1..={}",
            distgrad::program::MAX_WORLD
        )));
    }
    // Always through the selection, so the log line says where training runs.
    let device = futures::executor::block_on(distgrad::backend::select(device.choice()))?;
    let opts = CommOptions {
        device: device.clone(),
        ..CommOptions::default()
    };
    let every = every(cfg);
    let t0 = std::time::Instant::now();
    let results = distgrad::run_local(world, opts, |comm| {
        let device = &device;
        async move {
            let me = comm.rank();
            train(&comm, cfg, device, |step, loss| {
                if me == 0 && (step % every == 0 || step + 1 == cfg.steps) {
                    println!("step {step:>5}  group loss {loss:.6}");
                }
            })
            .await
        }
    });
    report(results, t0.elapsed())
}

/// Every rank's final loss and parameter hash, and whether the replicas are identical.
fn report(
    results: Vec<distgrad::Result<TrainReport>>,
    took: std::time::Duration,
) -> distgrad::Result<()> {
    let mut hashes = Vec::new();
    for (r, res) in results.into_iter().enumerate() {
        let rep = res.map_err(|e| distgrad::Error::Input(format!("rank {r}: {e}")))?;
        let last = rep.losses.last().copied().unwrap_or(f32::NAN);
        let hash = rep.hashes.last().cloned().unwrap_or_default();
        println!("rank {r}: final group loss {last:.6}, parameter hash {hash}");
        hashes.push(hash);
    }
    let same = hashes.windows(2).all(|w| w[0] == w[1]);
    println!(
        "replicas identical on every rank: {} ({:.2} s)",
        if same { "yes" } else { "NO" },
        took.as_secs_f64()
    );
    if same {
        Ok(())
    } else {
        Err(distgrad::Error::Input("replicas diverged".into()))
    }
}

#[cfg(not(feature = "native-nccl"))]
fn nccl(_: usize, _: &TrainConfig, _: DeviceArg, _: DataPathArg) -> distgrad::Result<()> {
    Err(distgrad::Error::Input(
        "this build has no NCCL backend: build with `cargo run --features native-nccl -- train --backend nccl`"
            .into(),
    ))
}

/// Under a launcher (RANK set): be that rank. Otherwise: start one process per GPU with the
/// launcher variables set, and wait for them.
#[cfg(feature = "native-nccl")]
pub fn nccl(
    world: usize,
    cfg: &TrainConfig,
    device: DeviceArg,
    data_path: DataPathArg,
) -> distgrad::Result<()> {
    use distgrad::nccl::{DataPath, NcclComm, NcclOptions};
    use distgrad::rendezvous::LaunchEnv;
    let Some(env) = LaunchEnv::from_env()? else {
        return super::launch::per_gpu(world, "train");
    };
    let data_path = DataPath::from(data_path);
    // The shared path opens the wgpu device of this rank's GPU itself.
    let device = match data_path {
        DataPath::Shared => distgrad::backend::Device::Cpu,
        DataPath::Staging => device.open()?,
    };
    let opts = NcclOptions {
        device,
        data_path,
        ..NcclOptions::default()
    };
    let comm = NcclComm::from_launch(&env, opts)?;
    let device = comm.device();
    if env.rank == 0 {
        println!(
            "compute: {}, data path: {data_path:?}, NCCL {}",
            device.describe(),
            distgrad::nccl::version().unwrap_or_else(|e| format!("version unknown ({e})"))
        );
    }
    let every = every(cfg);
    let t0 = std::time::Instant::now();
    let rep = futures::executor::block_on(train(&comm, cfg, &device, |step, loss| {
        if env.rank == 0 && (step % every == 0 || step + 1 == cfg.steps) {
            println!("step {step:>5}  group loss {loss:.6}");
        }
    }))?;
    println!(
        "rank {}: final group loss {:.6}, parameter hash {} ({:.2} s)",
        env.rank,
        rep.losses.last().copied().unwrap_or(f32::NAN),
        rep.hashes.last().cloned().unwrap_or_default(),
        t0.elapsed().as_secs_f64()
    );
    Ok(())
}
