//! The `distgrad` command line: one file per subcommand, each with its flags (`clap::Args`) and
//! its `run`; this module parses and dispatches, and holds the choice types every subcommand
//! shares. Process orchestration (a relay in this process, rank processes, one process per GPU)
//! lives in [`launch`]. With no subcommand, [`start`] runs a short demo and says what to try next.
//!
//! Every flag with a fixed set of values is typed: the CLI's own choices are `clap::ValueEnum`s
//! ([`DeviceArg`], ...), and the library's (collectives, reduce ops, all_reduce algorithms, bench
//! ops) are parsed from the library's own `ALL` / `name` tables ([`named`]), so `--help` lists the
//! choices, clap refuses a typo with exit code 2, and the names are written once.

use std::process::ExitCode;

use clap::builder::{PossibleValuesParser, TypedValueParser};
use clap::{Parser, Subcommand, ValueEnum};

mod bench;
mod demo;
mod files;
mod gradcheck;
mod launch;
mod relay;
mod run;
mod start;
mod train;
mod vjp;
mod worker;

#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
#[command(
    name = "distgrad",
    version,
    about = "Distributed autograd through collectives",
    after_help = "Without a subcommand: a short demo (NCCL training on every GPU where a driver, \
                  GPUs and NCCL are present, else collectives on in-process ranks) and what to \
                  try next."
)]
struct Cli {
    #[command(subcommand)]
    cmd: Option<Cmd>,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run one collective forward and backward on N in-process ranks and show every rank's inputs,
    /// outputs, cotangents and gradients, and the dual collective the backward pass ran.
    ///
    /// `distgrad vjp all_gather --world 4` runs a built-in example; `distgrad vjp case.json` (or `-`
    /// for stdin) runs a case file (schema: docs/program-format.md).
    Vjp(vjp::VjpArgs),
    /// Run a program (`www/programs/*.json`: inputs, local ops, collectives, a loss) or a lesson of
    /// the teaching demo (`www/lessons/<name>.json`) on N ranks in this process: a program prints
    /// every rank's loss and gradients, a lesson its trace (every step's messages and every rank's
    /// values, as the web page shows them).
    Run(run::RunArgs),
    /// Check a program's (or a lesson's) gradients across its ranks: central differences of the global objective
    /// (every perturbed coordinate re-runs the program on all ranks) against what backward gave
    /// each rank; a table per rank and input and PASS (exit code 0), FAIL (1) or INCONCLUSIVE (3:
    /// at a tie across ranks, where a check per coordinate cannot confirm backward's choice).
    Gradcheck(gradcheck::GradcheckArgs),
    /// Data-parallel training of a small MLP with the gradients flowing through the collectives:
    /// on in-process ranks (`--backend local`) or one process per GPU over NCCL (`--backend nccl`,
    /// needs `--features native-nccl`; also runs under torchrun-style launchers: RANK,
    /// WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT).
    Train(train::TrainArgs),
    /// Run the relay: rooms, rank assignment, routing of data frames, WebRTC signaling, and (with
    /// --static) the web app's files, on one port.
    Relay(relay::RelayArgs),
    /// Join a relay room as one rank and run a case (built-in example or file) forward and backward.
    Worker(worker::WorkerArgs),
    /// Start a relay and N worker processes on this machine, run a collective forward and backward,
    /// and print the same per-rank table as `vjp`.
    Demo(demo::DemoArgs),
    /// Benchmarks: an nccl-tests-style table of collectives (with a memcpy line measured in the same
    /// run) and the tape's overhead per local op, or the WGSL kernels (`bench kernels`).
    Bench(bench::BenchArgs),
}

/// Where the tensors of a command live.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum DeviceArg {
    /// The CPU backend (the reference).
    Cpu,
    /// A GPU (wgpu); an error if there is none.
    Gpu,
    /// A GPU when an adapter exists, else the CPU (one log line says which).
    Auto,
}

impl DeviceArg {
    /// The library's backend choice this names.
    pub fn choice(self) -> distgrad::backend::Choice {
        use distgrad::backend::Choice;
        match self {
            DeviceArg::Cpu => Choice::Cpu,
            DeviceArg::Gpu => Choice::Gpu,
            DeviceArg::Auto => Choice::Auto,
        }
    }

    /// The device this names: the CPU as it is (no adapter search, no log line), else the
    /// backend selection's pick (which says which in one log line).
    pub fn open(self) -> distgrad::Result<distgrad::backend::Device> {
        match self {
            DeviceArg::Cpu => Ok(distgrad::backend::Device::Cpu),
            d => futures::executor::block_on(distgrad::backend::select(d.choice())),
        }
    }
}

/// How tensors reach NCCL (`--features native-nccl`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum DataPathArg {
    /// Through host memory: read back, uploaded to a CUDA buffer, downloaded.
    Staging,
    /// wgpu tensors on each rank's GPU, in Vulkan memory imported into CUDA: no host copy.
    Shared,
}

#[cfg(feature = "native-nccl")]
impl From<DataPathArg> for distgrad::nccl::DataPath {
    fn from(d: DataPathArg) -> Self {
        match d {
            DataPathArg::Staging => distgrad::nccl::DataPath::Staging,
            DataPathArg::Shared => distgrad::nccl::DataPath::Shared,
        }
    }
}

/// A flag's value as clap spells it on the command line (for commands this program starts).
pub fn flag_value<T: ValueEnum>(v: &T) -> String {
    v.to_possible_value()
        .map(|p| p.get_name().to_string())
        .unwrap_or_default()
}

/// A value parser over one of the library's closed sets (`ALL` and `name`): `--help` lists the
/// names and clap refuses anything else, without a second list of them here.
pub fn named<T: Copy + Send + Sync + 'static>(
    all: &'static [T],
    name: fn(T) -> &'static str,
) -> impl TypedValueParser<Value = T> {
    PossibleValuesParser::new(all.iter().map(|&t| name(t))).try_map(move |s: String| {
        all.iter()
            .copied()
            .find(|&t| name(t) == s)
            .ok_or_else(|| format!("unknown value {s:?}"))
    })
}

/// For commands that only compute and print (no sockets): a closed stdout (`| head`) ends the
/// process quietly, as for other command-line tools, instead of a panic in `println!`. Not for
/// commands with sockets: there Rust's ignored SIGPIPE turns a peer's close into an error.
fn quiet_on_closed_stdout() {
    #[cfg(unix)]
    // SAFETY: sets the signal's disposition back to the default, before this process starts
    // threads of its own (a driver's threads, if any, install no SIGPIPE handler).
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}

/// Benchmarks of an unoptimized build mislead (the CPU baselines above all): say so.
pub fn warn_if_debug_build() {
    if cfg!(debug_assertions) {
        eprintln!(
            "distgrad: note: this is a debug build, so its figures are not representative: \
             use `cargo run --release -- bench ...`"
        );
    }
}

/// A tokio runtime for the commands with sockets (`multi`: worker threads, for the relay).
pub fn runtime(multi: bool) -> distgrad::Result<tokio::runtime::Runtime> {
    let b = if multi {
        tokio::runtime::Builder::new_multi_thread()
    } else {
        tokio::runtime::Builder::new_current_thread()
    }
    .enable_all()
    .build();
    b.map_err(|e| distgrad::Error::Input(format!("cannot start the async runtime: {e}")))
}

/// Parse the command line, run the command, and turn an error into its message and exit code 2.
pub fn main() -> ExitCode {
    let cli = Cli::parse();
    match &cli.cmd {
        Some(Cmd::Vjp(_) | Cmd::Run(_)) => quiet_on_closed_stdout(),
        Some(Cmd::Gradcheck(g)) if g.in_process() => quiet_on_closed_stdout(),
        Some(Cmd::Train(t)) if t.backend == train::Backend::Local => quiet_on_closed_stdout(),
        _ => {}
    }
    let r = match cli.cmd {
        None => start::run(),
        Some(Cmd::Vjp(a)) => vjp::run(a),
        Some(Cmd::Run(a)) => run::run(a),
        Some(Cmd::Gradcheck(a)) => match gradcheck::run(a) {
            Ok(0) => Ok(()),
            Ok(code) => return ExitCode::from(code),
            Err(e) => Err(e),
        },
        Some(Cmd::Train(a)) => train::run(a),
        Some(Cmd::Relay(a)) => relay::run(a),
        Some(Cmd::Worker(a)) => worker::run(a),
        Some(Cmd::Demo(a)) => demo::run(a),
        Some(Cmd::Bench(a)) => bench::run(a),
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("distgrad: {e}");
            ExitCode::from(2)
        }
    }
}
