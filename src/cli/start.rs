//! `distgrad` with no subcommand (a bare `cargo run`): a short demo that says what it runs and
//! why, then what to try next. Where this build has NCCL and the machine a driver, GPUs and the
//! NCCL library, it trains on every GPU over NCCL (one process each); otherwise it runs one
//! collective forward and backward and a short training on in-process ranks, and names what the
//! GPU path is missing.

use distgrad::ReduceOp;
use distgrad::collective::Kind;
use distgrad::train::TrainConfig;
use distgrad::vjp;

use super::DeviceArg;

/// Ranks of the in-process demo.
const WORLD: usize = 4;
/// Most GPUs the NCCL demo trains on.
const MAX_GPUS: usize = 8;

/// Run the demo.
pub fn run() -> distgrad::Result<()> {
    let cfg = TrainConfig {
        steps: 100,
        ..TrainConfig::default()
    };
    // A rank process the NCCL demo started (with torchrun's variables): be that rank.
    if cfg!(feature = "native-nccl") && std::env::var_os("RANK").is_some() {
        return gpu_demo(&cfg);
    }
    match gpu_path() {
        Ok((gpus, nccl)) => {
            let world = gpus.min(MAX_GPUS);
            println!(
                "distgrad: NCCL {nccl} and {gpus} GPU(s) found, so the demo trains a small MLP \
                 data-parallel on {world} GPU(s), one process each, its gradients all_reduced by \
                 NCCL through the autograd tape ({} steps).\n",
                cfg.steps
            );
            gpu_demo(&cfg)?;
        }
        Err(why) => {
            // Only computing and printing from here: a closed stdout (`| head`) ends quietly.
            super::quiet_on_closed_stdout();
            println!(
                "distgrad: the demo runs on {WORLD} in-process ranks (threads of this process): \
                 {why}.\n"
            );
            println!(
                "1. One all_reduce(sum) forward and backward: every rank's input, output and \
                 gradient, and the dual collective the backward pass ran.\n"
            );
            let case = vjp::example_case(Kind::AllReduce, WORLD, ReduceOp::Sum, 0, None)?;
            let out = vjp::run_case(&case)?;
            print!("{}", vjp::render_table(&case, &out));
            println!(
                "\n2. Data-parallel training of a small MLP: each rank's loss on its own shard, the \
                 gradients all_reduced by the backward pass; equal parameter hashes mean the \
                 replicas stayed identical.\n"
            );
            super::train::local(WORLD, &cfg, DeviceArg::Cpu)?;
        }
    }
    println!("{}", NEXT);
    Ok(())
}

/// What to try next (`distgrad` is `cargo run --release --` from a checkout).
const NEXT: &str = "
Try next (`distgrad` = `cargo run --release --` in a checkout):
  scripts/web.sh                                 the teaching demo in the browser: every tab is a rank
  distgrad vjp all_gather --world 4              any collective forward + backward, rank by rank
  distgrad run www/lessons/all_reduce_sum.json   a lesson of the teaching demo in the terminal
  distgrad train --world 4 --device auto         the training above, on a GPU through WGSL if one is there
  distgrad train --backend nccl                  one process per GPU over NCCL (--features native-nccl)
  distgrad bench                                 the collectives' bandwidth beside memcpy
  distgrad --help                                every command";

/// The number of CUDA devices and the NCCL version, or why the GPU path is not taken.
#[cfg(feature = "native-nccl")]
fn gpu_path() -> Result<(usize, String), String> {
    let no = |e: distgrad::Error| format!("no GPU path on this machine ({e})");
    let gpus = distgrad::nccl::device_count().map_err(no)?;
    if gpus == 0 {
        return Err("no GPU path on this machine (the CUDA driver sees no device)".into());
    }
    let nccl = distgrad::nccl::version().map_err(no)?;
    Ok((gpus, nccl))
}

#[cfg(not(feature = "native-nccl"))]
fn gpu_path() -> Result<(usize, String), String> {
    Err(
        "this build has no NCCL; the GPU path needs `cargo run --release --features \
         native-nccl` and an NVIDIA driver, GPUs and libnccl on the machine"
            .into(),
    )
}

#[cfg(feature = "native-nccl")]
fn gpu_demo(cfg: &TrainConfig) -> distgrad::Result<()> {
    let world = distgrad::nccl::device_count()?.min(MAX_GPUS);
    super::train::nccl(world, cfg, DeviceArg::Cpu, super::DataPathArg::Staging)
}

#[cfg(not(feature = "native-nccl"))]
fn gpu_demo(_: &TrainConfig) -> distgrad::Result<()> {
    Err(distgrad::Error::Input(
        "this build has no NCCL backend (build with `--features native-nccl`)".into(),
    ))
}
