//! `distgrad demo`: a relay and N worker processes on this machine (or in-process ranks) running
//! one collective forward and backward, printed as `vjp` prints it.

use clap::ValueEnum;
use distgrad::vjp;

use super::launch::{LocalRelay, TOKEN_ENV, wait_ranks};
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
    /// Print the machine-readable JSON output (as `vjp --json`) instead of the table.
    #[arg(long)]
    json: bool,
}

/// Run `distgrad demo`.
pub fn run(a: DemoArgs) -> distgrad::Result<()> {
    let case = a.example.case(None, a.world)?;
    let out = match a.transport {
        DemoTransport::Local => vjp::run_case(&case)?,
        DemoTransport::Relay | DemoTransport::Direct => over_relay(&case, &a)?,
    };
    print_answer(&case, &out, a.json)
}

/// A relay on an ephemeral loopback port (its own thread and runtime) plus one worker process
/// per rank, each given the room token in its environment.
fn over_relay(case: &vjp::Case, a: &DemoArgs) -> distgrad::Result<vjp::CaseOutput> {
    let world = case.world;
    let prepared = vjp::Prepared::new(case)?;
    let relay = LocalRelay::start(distgrad::relay::RelayConfig::default())?;
    let url = relay.url.clone();
    let token = distgrad::relay::random_token();
    eprintln!("demo: relay at {url}, room \"demo\", {world} worker processes");
    let exe = std::env::current_exe().map_err(|e| distgrad::Error::Input(e.to_string()))?;
    let direct = a.transport == DemoTransport::Direct;
    let children: Vec<_> = (0..world)
        .map(|r| {
            std::process::Command::new(&exe)
                .args(["worker", "--relay", &url, "--room", "demo", "--json"])
                .env(TOKEN_ENV, &token)
                .args(["--world", &world.to_string(), "--rank", &r.to_string()])
                .args(a.example.flags())
                .args(if direct {
                    &["--direct", "127.0.0.1:0"][..]
                } else {
                    &[][..]
                })
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
        })
        .collect();
    let results = wait_ranks("worker", children)
        .into_iter()
        .enumerate()
        .map(|(r, res)| {
            let done = res.map_err(distgrad::Error::Input)?;
            // Say which pairs linked directly (the workers' own report).
            for line in String::from_utf8_lossy(&done.stderr).lines() {
                if line.contains("direct links") {
                    eprintln!("demo: {line}");
                }
            }
            serde_json::from_slice::<vjp::RankResult>(&done.stdout)
                .map_err(|e| distgrad::Error::Input(format!("worker {r} output: {e}")))
        })
        .collect();
    relay.stop();
    vjp::assemble(&prepared, results)
}
