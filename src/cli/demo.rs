//! `distgrad demo`: a relay and N worker processes on this machine (or in-process ranks) running
//! one collective forward and backward, printed as `vjp` prints it, or a program (`--program`),
//! printed as `run` prints it.

use clap::ValueEnum;
use distgrad::vjp;

use super::launch::workers_over_relay;
use super::vjp::print_answer;
use super::worker::Example;

/// How the demo's ranks talk.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum DemoTransport {
    /// Worker processes through a relay on this machine.
    Relay,
    /// Worker processes introduced by a local relay, data over direct TCP links.
    Direct,
    /// Threads of this process.
    Local,
}

/// Flags of `distgrad demo`.
#[derive(clap::Args)]
pub struct DemoArgs {
    /// Number of ranks.
    #[arg(long, default_value_t = 4)]
    world: usize,
    /// How the ranks talk.
    #[arg(long, value_enum, default_value_t = DemoTransport::Relay)]
    transport: DemoTransport,
    /// The built-in example to run.
    #[command(flatten)]
    example: Example,
    /// Print the machine-readable JSON output (as `vjp --json`, or `run --json` for a program)
    /// instead of the table.
    #[arg(long)]
    json: bool,
    /// Run this program file (see `distgrad run`) instead of one collective: every rank's loss and
    /// gradients.
    #[arg(long)]
    program: Option<std::path::PathBuf>,
    /// World size of the program (default: the program's). The built-in example uses --world.
    #[arg(long = "program-world")]
    world_override: Option<usize>,
}

/// Run `distgrad demo`.
pub fn run(a: DemoArgs) -> distgrad::Result<()> {
    if let Some(p) = &a.program {
        return program_over_relay(p, &a);
    }
    let case = a.example.case(None, a.world)?;
    let out = match a.transport {
        DemoTransport::Local => vjp::run_case(&case)?,
        DemoTransport::Relay | DemoTransport::Direct => over_relay(&case, &a)?,
    };
    print_answer(&case, &out, a.json)
}

/// A relay on an ephemeral loopback port plus one worker process per rank.
fn over_relay(case: &vjp::Case, a: &DemoArgs) -> distgrad::Result<vjp::CaseOutput> {
    let prepared = vjp::Prepared::new(case)?;
    let direct = a.transport == DemoTransport::Direct;
    let done = workers_over_relay("demo", case.world, direct, &a.example.flags())?;
    let results = done
        .iter()
        .enumerate()
        .map(|(r, d)| {
            serde_json::from_slice::<vjp::RankResult>(&d.stdout)
                .map_err(|e| distgrad::Error::Input(format!("worker {r} output: {e}")))
        })
        .collect();
    vjp::assemble(&prepared, results)
}

/// `demo --program`: a program on worker processes; every rank's loss and gradients.
fn program_over_relay(path: &std::path::Path, a: &DemoArgs) -> distgrad::Result<()> {
    let (program, world) = super::files::read_program(path, a.world_override)?;
    let plan = program.plan(Some(world))?;
    let mut args = vec!["--program".to_string(), path.display().to_string()];
    args.extend(["--timeout-secs".into(), "30".into()]);
    let runs = match a.transport {
        DemoTransport::Local => {
            distgrad::program::run_local(&plan, distgrad::CommOptions::default())?
        }
        t => workers_over_relay("demo", world, t == DemoTransport::Direct, &args)?
            .iter()
            .enumerate()
            .map(|(r, d)| {
                serde_json::from_slice::<distgrad::program::RankRun>(&d.stdout)
                    .map_err(|e| distgrad::Error::Input(format!("worker {r} output: {e}")))
            })
            .collect::<distgrad::Result<Vec<_>>>()?,
    };
    super::run::print_runs(&program, &plan, &runs, a.json)
}
