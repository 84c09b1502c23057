//! `distgrad worker`: one rank of a relay room, running a case (built-in example or file) or a
//! program forward and backward and printing its share of the answer, or checking a program's
//! gradients with the room's other ranks (`--gradcheck`: every rank prints the report).

use distgrad::collective::Kind;
use distgrad::transport::Transport as _;
use distgrad::vjp;
use distgrad::{CommOptions, ReduceOp};

use super::{named, runtime};

/// Flags of `distgrad worker`.
#[derive(clap::Args)]
pub struct WorkerArgs {
    /// Relay WebSocket URL.
    #[arg(long, default_value = "ws://127.0.0.1:8080/ws")]
    relay: String,
    /// Room name.
    #[arg(long)]
    room: String,
    /// World size.
    #[arg(long)]
    world: usize,
    /// Wanted rank (default: any free rank).
    #[arg(long)]
    rank: Option<u32>,
    /// Room token (default: create the room with a random token, printed). Also read from
    /// DISTGRAD_TOKEN, which keeps it off the command line (where other local users can see it).
    #[arg(long, env = super::launch::TOKEN_ENV, hide_env_values = true)]
    token: Option<String>,
    /// For a wss:// relay with a self-signed certificate: trust this PEM certificate too.
    #[arg(long, env = "DISTGRAD_CA_CERT")]
    ca_cert: Option<std::path::PathBuf>,
    /// The built-in example to run.
    #[command(flatten)]
    example: Example,
    /// A case file instead of the built-in example.
    #[arg(long)]
    case: Option<std::path::PathBuf>,
    /// A program file instead of a case: this rank's loss and gradients (see `distgrad run`).
    #[arg(long, conflicts_with = "case")]
    program: Option<std::path::PathBuf>,
    /// With --program: check its gradients across the room's ranks (every rank prints the report).
    #[arg(long, requires = "program")]
    gradcheck: bool,
    /// How to check (with --gradcheck).
    #[command(flatten)]
    check: super::gradcheck::CheckFlags,
    /// Print this rank's result as one JSON line.
    #[arg(long)]
    json: bool,
    /// With --gradcheck: print the report as JSON (`gradcheck --json`) instead of the table.
    #[arg(long, requires = "gradcheck")]
    report_json: bool,
    /// Seconds a collective may wait for a peer (browser tabs that are slow to start, or still
    /// trying WebRTC, need more than the default).
    #[arg(long, default_value_t = 10)]
    timeout_secs: u64,
    /// Seconds to wait for the room to fill (the other ranks to join).
    #[arg(long, default_value_t = 60)]
    fill_timeout_secs: u64,
    /// Exchange data with the room's other native workers over direct TCP links, listening on
    /// this address (e.g. 127.0.0.1:0); the relay only introduces them. Pairs that cannot link
    /// (browser tabs, workers without this flag) use the relay.
    #[arg(long)]
    direct: Option<std::net::SocketAddr>,
    /// Send data on the WebSocket (as browsers do) instead of a data stream to the relay.
    #[arg(long)]
    no_stream: bool,
}

/// The built-in example of `worker` and `demo`: which collective, with which op and root.
#[derive(clap::Args, Clone, Copy)]
pub struct Example {
    /// Collective of the built-in example.
    #[arg(long, default_value = "all_reduce", value_parser = named(&vjp::COLLECTIVES, Kind::name))]
    pub collective: Kind,
    /// Reduce op of the built-in example.
    #[arg(long, default_value = "sum", value_parser = named(&ReduceOp::ALL, ReduceOp::name))]
    pub op: ReduceOp,
    /// Root (group rank) of the built-in example.
    #[arg(long, default_value_t = 0)]
    pub root: usize,
}

impl Example {
    /// The case a worker (or the demo) runs on `world` ranks: a case file, or this example.
    pub fn case(self, file: Option<&std::path::Path>, world: usize) -> distgrad::Result<vjp::Case> {
        match file {
            Some(path) => {
                let s = std::fs::read_to_string(path).map_err(|e| {
                    distgrad::Error::Input(format!("reading {}: {e}", path.display()))
                })?;
                vjp::parse_case(&s)
            }
            None => vjp::example_case(self.collective, world, self.op, self.root, None),
        }
    }

    /// The flags that name this example, for a worker process started with it.
    pub fn flags(self) -> [String; 6] {
        [
            "--collective".into(),
            self.collective.name().into(),
            "--op".into(),
            self.op.name().into(),
            "--root".into(),
            self.root.to_string(),
        ]
    }
}

/// What a worker runs.
enum Job {
    Case(vjp::Prepared),
    Program(distgrad::program::Plan),
    Check(distgrad::program::Plan),
}

/// What a worker prints.
enum Done {
    Case(vjp::RankResult),
    Program(distgrad::program::RankRun),
    Check(String),
}

/// Run `distgrad worker`.
pub fn run(o: WorkerArgs) -> distgrad::Result<()> {
    let job = match &o.program {
        Some(path) => {
            let (program, world) = super::files::read_program(path, Some(o.world))?;
            let plan = o.check.apply(program).plan(Some(world))?;
            if o.gradcheck {
                Job::Check(plan)
            } else {
                Job::Program(plan)
            }
        }
        None => Job::Case(vjp::Prepared::new(
            &o.example.case(o.case.as_deref(), o.world)?,
        )?),
    };
    let world =
        u32::try_from(o.world).map_err(|_| distgrad::Error::Input("world too large".into()))?;
    let timeout = std::time::Duration::from_secs(o.timeout_secs.max(1));
    let fill = std::time::Duration::from_secs(o.fill_timeout_secs.max(1));
    let mut join = distgrad::transport::ws::JoinOptions::new(&o.room, world);
    join.rank = o.rank;
    join.token = o.token.clone();
    join.ca_cert = o.ca_cert.clone();
    join.direct = o.direct;
    join.stream = !o.no_stream;
    join.ready_timeout = fill;
    // Said as soon as the relay admits us: the others need the token to join.
    let (room, created) = (o.room.clone(), o.token.is_none());
    join.on_welcome = Some(distgrad::transport::ws::OnWelcome(std::sync::Arc::new(
        move |rank, token, members| {
            if created {
                eprintln!(
                    "room {room:?} created, token: {token} (the others join with \
                     DISTGRAD_TOKEN={token}, or --token {token})"
                );
            }
            let waiting = world as usize - members.len().min(world as usize);
            if waiting > 0 {
                eprintln!(
                    "rank {rank} joined room {room:?}: {} of {world} ranks present, waiting up \
                     to {}s for {waiting} more",
                    members.len(),
                    fill.as_secs()
                );
            }
        },
    )));
    let result = runtime(false)?.block_on(async {
        let t = distgrad::transport::ws::WsTransport::connect(&o.relay, join).await?;
        eprintln!(
            "rank {}: data through the relay on {}",
            t.rank(),
            match t.data_stream_route() {
                Some(distgrad::transport::ws::StreamRoute::Unix) => {
                    "a data stream (the relay's Unix-domain socket)"
                }
                Some(distgrad::transport::ws::StreamRoute::Tcp) => "a data stream (TCP)",
                None => "the WebSocket",
            }
        );
        if o.direct.is_some() {
            let linked = t.direct_peers();
            let rest = if linked.len() + 1 >= o.world {
                ""
            } else {
                ", the others through the relay"
            };
            eprintln!("rank {}: direct links to ranks {linked:?}{rest}", t.rank());
        }
        let comm = distgrad::P2p::new(
            t,
            CommOptions {
                timeout,
                ..CommOptions::room()
            },
        );
        let r = match &job {
            Job::Case(prepared) => vjp::rank_result(&comm, prepared).await.map(Done::Case),
            Job::Program(plan) => distgrad::program::run_rank(&comm, plan, None, true)
                .await
                .map(Done::Program),
            Job::Check(plan) => {
                super::gradcheck::worker_check(&comm, plan, &o.check, o.report_json)
                    .await
                    .map(Done::Check)
            }
        };
        comm.into_transport().close().await;
        r
    })?;
    let result = match result {
        Done::Case(r) => r,
        Done::Program(run) => {
            println!(
                "{}",
                serde_json::to_string(&run).map_err(|e| distgrad::Error::Input(e.to_string()))?
            );
            return Ok(());
        }
        Done::Check(text) => {
            print!("{text}");
            return Ok(());
        }
    };
    if o.json {
        println!(
            "{}",
            serde_json::to_string(&result).map_err(|e| distgrad::Error::Input(e.to_string()))?
        );
    } else {
        println!("dual: {}", result.dual.join(" + "));
        println!(
            "outputs: {}",
            serde_json::to_string(&result.outputs).unwrap_or_default()
        );
        println!(
            "grads: {}",
            serde_json::to_string(&result.grads).unwrap_or_default()
        );
    }
    Ok(())
}
