//! The `distgrad` command line: `vjp` (one collective forward + backward, per-rank table), `bench`
//! (collective bandwidth and tape overhead), `relay` (the WebSocket relay), `worker` (one rank
//! through a relay) and `demo` (a relay plus N worker processes).
//!
//! The CLI is native only: on wasm32 this binary is the web app (`trunk build` compiles it for the
//! browser; see `distgrad::web`).

#[cfg(not(target_arch = "wasm32"))]
fn main() -> std::process::ExitCode {
    cli::main()
}

#[cfg(target_arch = "wasm32")]
fn main() {
    distgrad::web::start();
}

#[cfg(not(target_arch = "wasm32"))]
mod cli {
    use std::io::Read as _;
    use std::process::ExitCode;

    use clap::{Parser, Subcommand};
    use distgrad::bench::{self, BenchOp};
    use distgrad::transport::Transport as _;
    use distgrad::vjp::{self, Which};
    use distgrad::{AllReduceAlgo, CommOptions, Communicator, ReduceOp};

    #[global_allocator]
    static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

    #[derive(Parser)]
    #[command(
        name = "distgrad",
        version,
        about = "Distributed autograd through collectives"
    )]
    struct Cli {
        #[command(subcommand)]
        cmd: Cmd,
    }

    #[derive(Subcommand)]
    enum Cmd {
        /// Run one collective forward and backward on N in-process ranks and show every rank's inputs,
        /// outputs, cotangents and gradients, and the dual collective the backward pass ran.
        ///
        /// `distgrad vjp all_gather --world 4` runs a built-in example; `distgrad vjp case.json` (or `-`
        /// for stdin) runs a case file (schema: see the README).
        Vjp {
            /// A collective name (built-in example) or a case file path (`-` = stdin).
            what: String,
            /// World size for the built-in example, 1..=64 [default: 4].
            #[arg(long)]
            world: Option<usize>,
            /// Reduce op for the built-in example of reduce, all_reduce or reduce_scatter (sum,
            /// avg, prod, min, max) [default: sum].
            #[arg(long)]
            op: Option<String>,
            /// Root (group rank) for the built-in example of broadcast, reduce, gather or scatter
            /// [default: 0].
            #[arg(long)]
            root: Option<usize>,
            /// Subgroup for the built-in example, as comma-separated global ranks.
            #[arg(long, value_delimiter = ',')]
            group: Option<Vec<usize>>,
            /// Print the machine-readable JSON output instead of the table.
            #[arg(long)]
            json: bool,
            /// Print the case itself as JSON (e.g. to edit and feed back) and exit.
            #[arg(long)]
            print_case: bool,
            /// Compute backend: `cpu` (the reference, default), `gpu` (error if none) or `auto`
            /// (a GPU when an adapter exists, else the CPU; one log line says which).
            #[arg(long, default_value = "cpu")]
            device: String,
        },
        /// Run a lesson of the teaching demo (`www/lessons/<name>.json`) on N ranks in this process and
        /// print its trace: every step's messages and every rank's values, as the web page shows them.
        Run {
            /// The lesson file.
            lesson: std::path::PathBuf,
            /// World size, 1..=64 (default: the lesson's, else 3).
            #[arg(long)]
            world: Option<usize>,
            /// Print the trace as JSON.
            #[arg(long)]
            json: bool,
            /// Compute backend of the ranks: `cpu` (the reference, default), `gpu` (error if none)
            /// or `auto` (a GPU when an adapter exists, else the CPU), as in the page.
            #[arg(long, default_value = "cpu")]
            device: String,
        },
        /// Data-parallel training of a small MLP with the gradients flowing through the collectives:
        /// on in-process ranks (`--backend local`) or one process per GPU over NCCL (`--backend nccl`,
        /// needs `--features native-nccl`; also runs under torchrun-style launchers: RANK,
        /// WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT).
        Train {
            /// Number of ranks (local: 1..=64; nccl: one per GPU).
            #[arg(long, default_value_t = 2)]
            world: usize,
            /// `local` (threads of this process) or `nccl` (one process per GPU).
            #[arg(long, default_value = "local")]
            backend: String,
            /// Gradient steps.
            #[arg(long, default_value_t = 200)]
            steps: usize,
            /// Learning rate.
            #[arg(long, default_value_t = 0.2)]
            lr: f32,
            /// Compute backend of the local ranks: cpu, gpu or auto.
            #[arg(long, default_value = "cpu")]
            device: String,
            /// With `--backend nccl`: how tensors reach NCCL, `staging` (through the host) or
            /// `shared` (wgpu tensors on each rank's GPU, Vulkan memory imported into CUDA: no host
            /// copy; implies `--device gpu` on that GPU).
            #[arg(long, default_value = "staging")]
            data_path: String,
        },
        /// Run the relay: rooms, rank assignment, routing of data frames, WebRTC signaling, and (with
        /// --static) the web app's files, on one port.
        Relay {
            /// Address to listen on.
            #[arg(long, default_value = "127.0.0.1:8080")]
            addr: String,
            /// Serve this folder (the built web app) at `/`.
            #[arg(long = "static")]
            static_dir: Option<std::path::PathBuf>,
            /// Largest data-frame payload in bytes, at least 1024 (members split larger messages;
            /// the welcome tells them this limit).
            #[arg(long, default_value_t = 1 << 20)]
            max_frame: usize,
            /// Largest world size of a room.
            #[arg(long, default_value_t = 64)]
            max_members: u32,
            /// Most rooms at once.
            #[arg(long, default_value_t = 256)]
            max_rooms: usize,
            /// Bytes that may queue for one member before its senders are slowed down.
            #[arg(long, default_value_t = 16 << 20)]
            max_pending_bytes: usize,
            /// Close connections silent for this many seconds.
            #[arg(long, default_value_t = 30)]
            idle_timeout_secs: u64,
            /// Allowed browser origins (repeat or comma-separate); default: any.
            #[arg(long, value_delimiter = ',')]
            allowed_origin: Option<Vec<String>>,
            /// Refuse data streams: native members send their data on the WebSocket too.
            #[arg(long)]
            no_streams: bool,
            /// Forward data-stream payloads through a buffer instead of splice(2) (Linux).
            #[arg(long)]
            no_splice: bool,
            /// No Unix-domain socket for data streams: members on this host attach over TCP too.
            #[arg(long)]
            no_local_streams: bool,
        },
        /// Join a relay room as one rank and run a case (built-in example or file) forward and backward.
        Worker {
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
            /// DISTGRAD_TOKEN, which keeps it off the command line (where other local users can
            /// see it).
            #[arg(long, env = "DISTGRAD_TOKEN", hide_env_values = true)]
            token: Option<String>,
            /// Collective of the built-in example.
            #[arg(long, default_value = "all_reduce")]
            collective: String,
            /// A case file instead of the built-in example.
            #[arg(long)]
            case: Option<std::path::PathBuf>,
            /// Reduce op for the built-in example.
            #[arg(long, default_value = "sum")]
            op: String,
            /// Root (group rank) for the built-in example.
            #[arg(long, default_value_t = 0)]
            root: usize,
            /// Print this rank's result as one JSON line.
            #[arg(long)]
            json: bool,
            /// Seconds a collective may wait for a peer (browser tabs that are slow to start, or
            /// still trying WebRTC, need more than the default).
            #[arg(long, default_value_t = 10)]
            timeout_secs: u64,
            /// Seconds to wait for the room to fill (the other ranks to join).
            #[arg(long, default_value_t = 60)]
            fill_timeout_secs: u64,
            /// Exchange data with the room's other native workers over direct TCP links,
            /// listening on this address (e.g. 127.0.0.1:0); the relay only introduces them.
            /// Pairs that cannot link (browser tabs, workers without this flag) use the relay.
            #[arg(long)]
            direct: Option<std::net::SocketAddr>,
            /// Send data on the WebSocket (as browsers do) instead of a data stream to the relay.
            #[arg(long)]
            no_stream: bool,
        },
        /// Start a relay and N worker processes on this machine, run a collective forward and backward,
        /// and print the same per-rank table as `vjp`.
        Demo {
            /// Number of ranks.
            #[arg(long, default_value_t = 4)]
            world: usize,
            /// `relay` (processes through a local relay), `direct` (processes introduced by a local
            /// relay, data over direct TCP links) or `local` (threads).
            #[arg(long, default_value = "relay")]
            transport: String,
            /// Collective of the built-in example.
            #[arg(long, default_value = "all_reduce")]
            collective: String,
            /// Reduce op.
            #[arg(long, default_value = "sum")]
            op: String,
            /// Root (group rank).
            #[arg(long, default_value_t = 0)]
            root: usize,
            /// Print the machine-readable JSON output (as `vjp --json`) instead of the table.
            #[arg(long)]
            json: bool,
        },
        /// Benchmarks: an nccl-tests-style table of collectives (with a memcpy line measured in the same
        /// run) and the tape's overhead per local op.
        Bench {
            /// `collectives` (default) or `kernels` (the WGSL kernels against a 1-thread CPU loop).
            #[arg(default_value = "collectives")]
            what: String,
            /// Transport: `local` (ranks as threads of this process), `relay` (each rank a
            /// WebSocket plus a data stream to a relay, on its Unix-domain socket), `relay-tcp`
            /// (data streams over TCP, as from other hosts), `relay-ws` (data on the WebSocket too,
            /// as browsers send it), `relay-buffered` (streams, forwarded without splice(2)), `direct`
            /// (introduced by the relay, data over TCP links between the ranks) or `nccl` (one process per GPU, all_reduce only; needs
            /// `--features native-nccl`).
            #[arg(long, default_value = "local")]
            transport: String,
            /// Number of ranks.
            #[arg(long, default_value_t = 4)]
            world: usize,
            /// Smallest payload in bytes.
            #[arg(long, default_value_t = 4)]
            min_bytes: usize,
            /// Largest payload in bytes (per rank).
            #[arg(long, default_value_t = 64 << 20)]
            max_bytes: usize,
            /// Collectives, comma-separated.
            #[arg(
                long,
                value_delimiter = ',',
                default_value = "all_reduce,all_gather,broadcast"
            )]
            ops: Vec<String>,
            /// Algorithm of large all_reduces: `auto` (shared in-process, ring through the
            /// relay), `ring`, `pairwise` or `shared`. With `auto` in-process, the largest
            /// all_reduce is also measured with each algorithm, for comparison.
            #[arg(long, default_value = "auto")]
            algo: String,
            /// With `--transport nccl`: `shared` also measures the shared data path (wgpu tensors
            /// through Vulkan memory imported into CUDA; needs Vulkan on the GPU) beside staging.
            #[arg(long, default_value = "staging")]
            data_path: String,
            /// Run the ranks as processes (this program started once per rank, as gloo's ranks
            /// are) instead of threads of this one; transports through a relay only (the relay
            /// stays in this process).
            #[arg(long)]
            processes: bool,
            /// Where the tensors of `bench collectives` live: `cpu` (default) or `gpu` (wgpu
            /// tensors, in-process ranks only; the table then says how many bytes each call read
            /// back from the device).
            #[arg(long, default_value = "cpu")]
            device: String,
            /// `bench kernels`: f32 elements per input, comma-separated; a suffix K, M or G
            /// multiplies by 2^10, 2^20 or 2^30 (e.g. `16M,256M`).
            #[arg(long, value_delimiter = ',', default_value = "16M")]
            elements: Vec<String>,
            /// Internal: run as one rank of a `--processes` bench (relay URL, rank, the parent's
            /// memcpy GB/s; the room token comes in DISTGRAD_TOKEN).
            #[arg(long, hide = true, num_args = 3, value_names = ["URL", "RANK", "MEMCPY"])]
            bench_rank: Option<Vec<String>>,
        },
    }

    /// For commands that only compute and print (no sockets): a closed stdout (`| head`) ends the
    /// process quietly, as for other command-line tools, instead of a panic in `println!`. Not
    /// for commands with sockets: there Rust's ignored SIGPIPE turns a peer's close into an error.
    fn quiet_on_closed_stdout() {
        #[cfg(unix)]
        // SAFETY: sets the signal's disposition back to the default before any thread starts.
        unsafe {
            libc::signal(libc::SIGPIPE, libc::SIG_DFL);
        }
    }

    pub fn main() -> ExitCode {
        let cli = Cli::parse();
        match &cli.cmd {
            Cmd::Vjp { .. } | Cmd::Run { .. } => quiet_on_closed_stdout(),
            Cmd::Train { backend, .. } if backend == "local" => quiet_on_closed_stdout(),
            _ => {}
        }
        let r = match cli.cmd {
            Cmd::Vjp {
                what,
                world,
                op,
                root,
                group,
                json,
                print_case,
                device,
            } => run_vjp(&what, world, op, root, group, json, print_case, &device),
            Cmd::Run {
                lesson,
                world,
                json,
                device,
            } => run_lesson(&lesson, world, json, &device),
            Cmd::Train {
                world,
                backend,
                steps,
                lr,
                device,
                data_path,
            } => run_train(world, &backend, steps, lr, &device, &data_path),
            Cmd::Bench {
                what,
                transport,
                world,
                min_bytes,
                max_bytes,
                processes,
                device,
                elements,
                ..
            } if what == "kernels" => {
                if transport != "local"
                    || world != 4
                    || min_bytes != 4
                    || max_bytes != 64 << 20
                    || processes
                    || device != "cpu"
                {
                    eprintln!(
                        "distgrad: note: --transport, --world, --min-bytes, --max-bytes, \
                         --processes and --device apply to `bench collectives`; `bench kernels` \
                         runs on this process's GPU adapter with --elements per input"
                    );
                }
                elements
                    .iter()
                    .map(|e| parse_count(e))
                    .collect::<distgrad::Result<Vec<_>>>()
                    .and_then(|sizes| run_kernel_bench(&sizes))
            }
            Cmd::Bench { what, .. } if what != "collectives" => Err(distgrad::Error::Input(
                format!("unknown benchmark {what:?} (collectives or kernels)"),
            )),
            Cmd::Bench {
                what: _,
                transport,
                world,
                min_bytes,
                max_bytes,
                ops,
                algo,
                data_path,
                processes,
                device,
                elements: _,
                bench_rank,
            } => bench_rank
                .as_deref()
                .map(BenchChild::parse)
                .transpose()
                .and_then(|child| {
                    run_bench(BenchArgs {
                        transport,
                        world,
                        min: min_bytes,
                        max: max_bytes,
                        ops,
                        algo,
                        data_path,
                        processes,
                        device,
                        child,
                    })
                }),
            Cmd::Relay {
                addr,
                static_dir,
                max_frame,
                max_members,
                max_rooms,
                max_pending_bytes,
                idle_timeout_secs,
                allowed_origin,
                no_streams,
                no_splice,
                no_local_streams,
            } => {
                let cfg = distgrad::relay::RelayConfig {
                    max_frame,
                    max_members,
                    max_rooms,
                    max_pending_bytes,
                    idle_timeout: std::time::Duration::from_secs(idle_timeout_secs),
                    allowed_origins: allowed_origin,
                    static_dir,
                    streams: !no_streams,
                    splice: !no_splice,
                    local_streams: !no_local_streams,
                    ..Default::default()
                };
                run_relay(&addr, cfg)
            }
            Cmd::Worker {
                relay,
                room,
                world,
                rank,
                token,
                collective,
                case,
                op,
                root,
                json,
                timeout_secs,
                fill_timeout_secs,
                direct,
                no_stream,
            } => {
                let opts = WorkerOpts {
                    relay,
                    room,
                    world,
                    rank,
                    token,
                    timeout: std::time::Duration::from_secs(timeout_secs.max(1)),
                    fill_timeout: std::time::Duration::from_secs(fill_timeout_secs.max(1)),
                    direct,
                    no_stream,
                };
                run_worker(&opts, &collective, case.as_deref(), &op, root, json)
            }
            Cmd::Demo {
                world,
                transport,
                collective,
                op,
                root,
                json,
            } => run_demo(world, &transport, &collective, &op, root, json),
        };
        match r {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("distgrad: {e}");
                ExitCode::from(2)
            }
        }
    }

    #[allow(clippy::too_many_arguments)] // one per CLI flag
    fn run_vjp(
        what: &str,
        world: Option<usize>,
        op: Option<String>,
        root: Option<usize>,
        group: Option<Vec<usize>>,
        json: bool,
        print_case: bool,
        device: &str,
    ) -> distgrad::Result<()> {
        let choice = parse_choice(device)?;
        let input = |e: String| distgrad::Error::Input(e);
        let case = if let Ok(which) = Which::parse(what) {
            // Say so when a flag does not apply (scripts looping over collectives may pass both).
            let name = which.name();
            if op.is_some() && !which.uses_op() {
                eprintln!(
                    "distgrad: note: {name} takes no reduce op; --op ignored (it applies to \
                     reduce, all_reduce and reduce_scatter)"
                );
            }
            if root.is_some() && !which.uses_root() {
                eprintln!(
                    "distgrad: note: {name} has no root; --root ignored (it applies to \
                     broadcast, reduce, gather and scatter)"
                );
            }
            let op = ReduceOp::parse(op.as_deref().unwrap_or("sum"))?;
            vjp::example_case(which, world.unwrap_or(4), op, root.unwrap_or(0), group)?
        } else if (what == "-" || std::path::Path::new(what).exists())
            && (world.is_some() || op.is_some() || root.is_some() || group.is_some())
        {
            return Err(input(format!(
                "--world, --op, --root and --group shape the built-in examples; the case {what:?} \
                 sets its own (edit it, e.g. after --print-case)"
            )));
        } else if what == "-" {
            let mut s = String::new();
            std::io::stdin()
                .read_to_string(&mut s)
                .map_err(|e| distgrad::Error::Input(format!("reading stdin: {e}")))?;
            vjp::parse_case(&s)?
        } else if std::path::Path::new(what).exists() {
            let s = std::fs::read_to_string(what)
                .map_err(|e| distgrad::Error::Input(format!("reading {what}: {e}")))?;
            vjp::parse_case(&s)?
        } else if what.contains(['/', '\\', '.']) {
            // Looks like a path, not a collective's name.
            return Err(input(format!("no such case file {what:?}")));
        } else {
            // Neither a collective nor a file: say both.
            let e = Which::parse(what)
                .err()
                .map(|e| e.to_string())
                .unwrap_or_default();
            return Err(input(format!("{what:?} is not a file; {e}")));
        };
        if print_case {
            println!(
                "{}",
                serde_json::to_string_pretty(&case)
                    .map_err(|e| distgrad::Error::Input(e.to_string()))?
            );
            return Ok(());
        }
        let out = vjp::run_case_on(&case, &device_for(choice)?)?;
        print_answer(&case, &out, json)
    }

    /// `bench` (collectives) as given on the command line.
    struct BenchArgs {
        transport: String,
        world: usize,
        min: usize,
        max: usize,
        ops: Vec<String>,
        algo: String,
        data_path: String,
        processes: bool,
        /// `--device`: where the tensors live (`cpu` or `gpu`).
        device: String,
        /// Set when this process is one rank of a `--processes` run.
        child: Option<BenchChild>,
    }

    /// One rank of a `bench --processes` run: what the parent passes (hidden `--bench-rank`).
    struct BenchChild {
        relay: String,
        token: String,
        rank: u32,
        memcpy: f64,
    }

    impl BenchChild {
        fn parse(v: &[String]) -> distgrad::Result<BenchChild> {
            let bad = || {
                distgrad::Error::Input(format!(
                    "--bench-rank takes URL RANK MEMCPY_GBPS, got {v:?}"
                ))
            };
            let token = std::env::var(TOKEN_ENV).map_err(|_| {
                distgrad::Error::Input(format!("--bench-rank needs the room token in {TOKEN_ENV}"))
            })?;
            match v {
                [relay, rank, memcpy] => Ok(BenchChild {
                    relay: relay.clone(),
                    token,
                    rank: rank.parse().map_err(|_| bad())?,
                    memcpy: memcpy.parse().map_err(|_| bad())?,
                }),
                _ => Err(bad()),
            }
        }
    }

    /// Benchmarks of an unoptimized build mislead (the CPU baselines above all): say so.
    fn warn_if_debug_build() {
        if cfg!(debug_assertions) {
            eprintln!(
                "distgrad: note: this is a debug build, so its figures are not representative: \
                 use `cargo run --release -- bench ...`"
            );
        }
    }

    fn run_bench(a: BenchArgs) -> distgrad::Result<()> {
        if a.child.is_none() {
            warn_if_debug_build();
        }
        let (transport, world, min, max) = (a.transport.as_str(), a.world, a.min, a.max);
        let algo = AllReduceAlgo::parse(&a.algo)?;
        if world == 0 || world > 64 {
            return Err(distgrad::Error::Input(format!(
                "world must be 1..=64, got {world}"
            )));
        }
        if max < 4 || min > max {
            return Err(distgrad::Error::Input(format!(
                "--min-bytes {min} .. --max-bytes {max} holds no payload size (sizes run from \
                 --min-bytes, at least 4, times 4 each step, up to --max-bytes)"
            )));
        }
        if transport == "nccl" {
            if a.processes || a.child.is_some() {
                return Err(distgrad::Error::Input(
                    "--transport nccl starts its own processes (one per GPU): drop --processes"
                        .into(),
                ));
            }
            return run_bench_nccl(world, min, max, &a.data_path);
        }
        let ops: Vec<BenchOp> = a
            .ops
            .iter()
            .map(|s| BenchOp::parse(s))
            .collect::<distgrad::Result<_>>()?;
        let sizes = bench::sizes(min, max);
        let (route, what) = match transport {
            "local" => (None, "in-process threads"),
            "relay" => (
                Some(distgrad::run::RelayRoute::Stream),
                "each with a WebSocket and a data stream (Unix-domain socket) to a relay on 127.0.0.1",
            ),
            "relay-tcp" => (
                Some(distgrad::run::RelayRoute::StreamTcp),
                "each with a WebSocket and a TCP data stream to a relay on 127.0.0.1",
            ),
            "relay-ws" => (
                Some(distgrad::run::RelayRoute::WebSocket),
                "each with its own WebSocket (data included) to a relay on 127.0.0.1",
            ),
            "relay-buffered" => (
                Some(distgrad::run::RelayRoute::Stream),
                "as relay, the relay forwarding stream payloads through a buffer instead of splice(2)",
            ),
            "direct" => (
                Some(distgrad::run::RelayRoute::Direct),
                "introduced by a relay on 127.0.0.1, data over direct TCP links between them",
            ),
            other => {
                return Err(distgrad::Error::Input(format!(
                    "unknown transport {other:?} (local, relay, relay-tcp, relay-ws, relay-buffered or direct)"
                )));
            }
        };
        let local = route.is_none();
        if local && (a.processes || a.child.is_some()) {
            return Err(distgrad::Error::Input(
                "--processes needs a transport through a relay (relay, relay-tcp, relay-ws, relay-buffered or direct)".into(),
            ));
        }
        let choice = parse_choice(&a.device)?;
        if !local && choice != distgrad::backend::Choice::Cpu {
            return Err(distgrad::Error::Input(format!(
                "--device {} is for in-process ranks (--transport local); the relay transports \
                 bench host tensors",
                a.device
            )));
        }
        let device = device_for(choice)?;
        let base = if local {
            CommOptions::default()
        } else {
            CommOptions::for_network()
        };
        let opts = match algo {
            AllReduceAlgo::Auto => base,
            a => CommOptions {
                all_reduce: a,
                ..base
            },
        };
        let relay_cfg = distgrad::relay::RelayConfig {
            splice: transport != "relay-buffered",
            ..Default::default()
        };
        if let (Some(child), Some(route)) = (&a.child, route) {
            return bench_rank_process(child, route, &relay_cfg, opts, world, &ops, &sizes);
        }
        let memcpy = bench::memcpy_gbps(max.max(1 << 20));
        let who = match (local, a.processes) {
            (true, _) => String::new(),
            (false, true) => "processes, ".into(),
            (false, false) => "threads, ".into(),
        };
        let in_this = if local || a.processes {
            ""
        } else {
            " in this process"
        };
        println!("# distgrad bench: transport={transport} ({who}{what}{in_this}), world={world}");
        println!(
            "# memcpy {}: {memcpy:.2} GB/s (single thread, same run)",
            bench::fmt_bytes(max.max(1 << 20))
        );
        println!(
            "# busbw factors (nccl-tests): all_reduce 2(n-1)/n, all_gather (n-1)/n, broadcast 1"
        );
        let resolved = match (opts.all_reduce, local) {
            (AllReduceAlgo::Auto, true) => "shared (auto: in-process ranks share memory)",
            (AllReduceAlgo::Auto, false) => "ring (auto)",
            (a, _) => a.name(),
        };
        println!(
            "# all_reduce: direct exchange below {} per rank, {resolved} from there",
            bench::fmt_bytes(opts.ring_threshold)
        );
        #[cfg(feature = "wgpu")]
        if let distgrad::backend::Device::Gpu(g) = &device {
            println!(
                "# tensors on {} (read back/call: bytes each call read back from the device, per rank)",
                g.describe()
            );
        }
        println!(
            "{}",
            bench::table_header(device != distgrad::backend::Device::Cpu)
        );
        if a.processes {
            bench_processes(&a, relay_cfg, memcpy)?;
        } else {
            let results = match route {
                None => distgrad::run_local(world, opts, |comm| {
                    let (ops, sizes, device) = (&ops, &sizes, &device);
                    async move { rank_bench(&comm, ops, sizes, memcpy, device).await }
                }),
                Some(route) => distgrad::run::run_over_relay_via(
                    world,
                    relay_cfg,
                    opts,
                    route,
                    async |comm| {
                        rank_bench(comm, &ops, &sizes, memcpy, &distgrad::backend::Device::Cpu)
                            .await
                    },
                )?,
            };
            let mut rank0 = None;
            for (r, res) in results.into_iter().enumerate() {
                match res {
                    Ok(v) if r == 0 => rank0 = Some(v),
                    Ok(_) => {}
                    Err(e) => {
                        return Err(distgrad::Error::Input(format!(
                            "bench failed on rank {r}: {e}"
                        )));
                    }
                }
            }
            let rank0 =
                rank0.ok_or_else(|| distgrad::Error::Input("no result from rank 0".into()))?;
            print_bench_summary(&rank0, memcpy);
        }
        let largest = sizes.last().copied().filter(|&b| b >= (1 << 20));
        if let (true, AllReduceAlgo::Auto, true, Some(bytes)) =
            (local, algo, ops.contains(&BenchOp::AllReduce), largest)
        {
            let mut line = format!(
                "# all_reduce {} by algorithm (busbw, x memcpy):",
                bench::fmt_bytes(bytes)
            );
            for a in [
                AllReduceAlgo::Ring,
                AllReduceAlgo::Pairwise,
                AllReduceAlgo::Shared,
            ] {
                let opts = CommOptions {
                    all_reduce: a,
                    ..CommOptions::default()
                };
                let device = &device;
                let rows = distgrad::run_local(world, opts, |comm| async move {
                    bench::bench_all(
                        &comm,
                        &[BenchOp::AllReduce],
                        &[bytes],
                        memcpy,
                        false,
                        device,
                    )
                    .await
                });
                let row = rows
                    .into_iter()
                    .next()
                    .ok_or_else(|| distgrad::Error::Input("no ranks".into()))??;
                if let Some(r) = row.first() {
                    line += &format!(
                        " {} {:.3} GB/s ({:.2}x)",
                        a.name(),
                        r.busbw,
                        r.busbw / memcpy
                    );
                }
            }
            println!("{line}");
        }
        let (taped, raw) = bench::tape_overhead(200_000)?;
        println!(
            "# tape overhead: {taped:.3} us per recorded op on 1-element tensors vs {raw:.3} us untaped ({:.3} us/op added)",
            taped - raw
        );
        Ok(())
    }

    /// The closing lines of a collectives bench, from rank 0's result.
    fn print_bench_summary((rows, (p50, p99)): &RankBench, memcpy: f64) {
        if let Some(r) = rows.iter().rev().find(|r| r.op == BenchOp::AllReduce) {
            println!(
                "# all_reduce at {}: busbw {:.3} GB/s = {:.2}x memcpy",
                bench::fmt_bytes(r.bytes),
                r.busbw,
                r.busbw / memcpy
            );
        }
        println!(
            "# 16-byte all_reduce latency on rank 0: p50 {:.1} us, p99 {:.1} us",
            p50.as_secs_f64() * 1e6,
            p99.as_secs_f64() * 1e6
        );
    }

    /// `bench --processes`: a relay in this process and one `distgrad` process per rank; rank 0's
    /// output (the table as it goes, then the summary) is this command's output.
    fn bench_processes(
        a: &BenchArgs,
        relay_cfg: distgrad::relay::RelayConfig,
        memcpy: f64,
    ) -> distgrad::Result<()> {
        let relay = LocalRelay::start(relay_cfg)?;
        let token = distgrad::relay::random_token();
        let exe = std::env::current_exe().map_err(|e| distgrad::Error::Input(e.to_string()))?;
        let children: Vec<_> = (0..a.world)
            .map(|r| {
                std::process::Command::new(&exe)
                    .args(["bench", "--transport", &a.transport])
                    .args(["--world", &a.world.to_string()])
                    .args(["--min-bytes", &a.min.to_string()])
                    .args(["--max-bytes", &a.max.to_string()])
                    .args(["--ops", &a.ops.join(","), "--algo", &a.algo])
                    .args(["--bench-rank", &relay.url, &r.to_string()])
                    .arg(memcpy.to_string())
                    .env(TOKEN_ENV, &token)
                    .stdout(if r == 0 {
                        std::process::Stdio::inherit()
                    } else {
                        std::process::Stdio::null()
                    })
                    // Straight to ours: a rank's errors show as they happen.
                    .stderr(std::process::Stdio::inherit())
                    .spawn()
            })
            .collect();
        let failed: Vec<String> = wait_ranks("rank", children)
            .into_iter()
            .filter_map(|r| r.err())
            .collect();
        relay.stop();
        if failed.is_empty() {
            Ok(())
        } else {
            Err(distgrad::Error::Input(format!(
                "bench failed: {}",
                failed.join("; ")
            )))
        }
    }

    /// One rank of `bench --processes`: join the parent's relay, run the bench; rank 0 prints.
    fn bench_rank_process(
        child: &BenchChild,
        route: distgrad::run::RelayRoute,
        relay_cfg: &distgrad::relay::RelayConfig,
        opts: CommOptions,
        world: usize,
        ops: &[BenchOp],
        sizes: &[usize],
    ) -> distgrad::Result<()> {
        let world_u32 = u32::try_from(world)
            .map_err(|_| distgrad::Error::Input(format!("world {world} too large")))?;
        let rt = runtime(false)?;
        let rank0 = rt.block_on(async {
            let mut join = route.join_options("bench", world_u32, child.rank);
            join.token = Some(child.token.clone());
            join.max_payload = relay_cfg.max_frame;
            let t = distgrad::transport::ws::WsTransport::connect(&child.relay, join).await?;
            let comm = distgrad::P2p::new(t, opts);
            let r = rank_bench(
                &comm,
                ops,
                sizes,
                child.memcpy,
                &distgrad::backend::Device::Cpu,
            )
            .await;
            comm.into_transport().close().await;
            r
        })?;
        if child.rank == 0 {
            print_bench_summary(&rank0, child.memcpy);
        }
        Ok(())
    }

    type RankBench = (Vec<bench::Row>, (std::time::Duration, std::time::Duration));

    /// One rank's whole benchmark: the table (printed by rank 0 as it goes), then the latency.
    async fn rank_bench<C: Communicator>(
        comm: &C,
        ops: &[BenchOp],
        sizes: &[usize],
        memcpy: f64,
        device: &distgrad::backend::Device,
    ) -> distgrad::Result<RankBench> {
        let rows = bench::bench_all(comm, ops, sizes, memcpy, comm.rank() == 0, device).await?;
        let lat = bench::latency_16b(comm, 2000).await?;
        Ok((rows, lat))
    }

    fn runtime(multi: bool) -> distgrad::Result<tokio::runtime::Runtime> {
        let b = if multi {
            tokio::runtime::Builder::new_multi_thread()
        } else {
            tokio::runtime::Builder::new_current_thread()
        }
        .enable_all()
        .build();
        b.map_err(|e| distgrad::Error::Input(format!("cannot start the async runtime: {e}")))
    }

    fn run_lesson(
        path: &std::path::Path,
        world: Option<usize>,
        json: bool,
        device: &str,
    ) -> distgrad::Result<()> {
        let device = device_for(parse_choice(device)?)?;
        let text = std::fs::read_to_string(path)
            .map_err(|e| distgrad::Error::Input(format!("reading {}: {e}", path.display())))?;
        let lesson = distgrad::lesson::parse(&text).map_err(|e| {
            // The folder's index lists the lessons; it is not one.
            match serde_json::from_str::<serde_json::Value>(&text) {
                Ok(v) if v.get("lessons").is_some_and(|l| l.is_array()) => {
                    let names: Vec<&str> = v["lessons"]
                        .as_array()
                        .into_iter()
                        .flatten()
                        .filter_map(|l| l["name"].as_str())
                        .collect();
                    distgrad::Error::Input(format!(
                        "{} is the index of the lessons, not a lesson: run one of them, e.g. \
                         {}; they are: {}",
                        path.display(),
                        path.with_file_name("all_reduce_sum.json").display(),
                        names.join(", ")
                    ))
                }
                _ => e,
            }
        })?;
        let world = world.or(lesson.world).unwrap_or(3);
        let trace = futures::executor::block_on(distgrad::lesson::run_simulated(
            &lesson,
            world,
            &device,
            &[],
        ))?;
        if json {
            println!(
                "{}",
                serde_json::to_string(&trace).map_err(|e| distgrad::Error::Input(e.to_string()))?
            );
        } else {
            print!("{}", distgrad::lesson::render(&trace));
        }
        Ok(())
    }

    fn run_train(
        world: usize,
        backend: &str,
        steps: usize,
        lr: f32,
        device: &str,
        data_path: &str,
    ) -> distgrad::Result<()> {
        use distgrad::train::{TrainConfig, train};
        if steps == 0 {
            return Err(distgrad::Error::Input("--steps must be at least 1".into()));
        }
        if !(lr.is_finite() && lr > 0.0) {
            return Err(distgrad::Error::Input(format!(
                "--lr must be a positive number, got {lr}"
            )));
        }
        let cfg = TrainConfig {
            steps,
            lr,
            ..TrainConfig::default()
        };
        let every = (steps / 10).max(1);
        match backend {
            "local" => {
                if world == 0 || world > vjp::MAX_WORLD {
                    return Err(distgrad::Error::Input(format!(
                        "--world must be 1..={}",
                        vjp::MAX_WORLD
                    )));
                }
                let device =
                    futures::executor::block_on(distgrad::backend::select(parse_choice(device)?))?;
                let opts = CommOptions {
                    device: device.clone(),
                    ..CommOptions::default()
                };
                let t0 = std::time::Instant::now();
                let results = distgrad::run_local(world, opts, |comm| {
                    let (cfg, device) = (&cfg, &device);
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
            "nccl" => run_train_nccl(world, &cfg, every, device, data_path),
            other => Err(distgrad::Error::Input(format!(
                "unknown backend {other:?} (local or nccl)"
            ))),
        }
    }

    fn report(
        results: Vec<distgrad::Result<distgrad::train::TrainReport>>,
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

    /// The device `choice` names: the CPU as it is (no adapter search, no log line), else the
    /// backend selection's pick.
    fn device_for(
        choice: distgrad::backend::Choice,
    ) -> distgrad::Result<distgrad::backend::Device> {
        match choice {
            distgrad::backend::Choice::Cpu => Ok(distgrad::backend::Device::Cpu),
            choice => futures::executor::block_on(distgrad::backend::select(choice)),
        }
    }

    /// A count such as `1024`, `16M` or `1G` (suffixes K, M, G: times 2^10, 2^20, 2^30).
    fn parse_count(s: &str) -> distgrad::Result<usize> {
        let t = s.trim();
        let (digits, shift) = match t.char_indices().last() {
            Some((i, 'k' | 'K')) => (&t[..i], 10),
            Some((i, 'm' | 'M')) => (&t[..i], 20),
            Some((i, 'g' | 'G')) => (&t[..i], 30),
            _ => (t, 0),
        };
        digits
            .parse::<usize>()
            .ok()
            .and_then(|v| v.checked_mul(1usize << shift))
            .filter(|&v| v > 0)
            .ok_or_else(|| {
                distgrad::Error::Input(format!(
                    "--elements {s:?}: expected a positive count such as 1024, 16M or 1G"
                ))
            })
    }

    fn parse_choice(s: &str) -> distgrad::Result<distgrad::backend::Choice> {
        use distgrad::backend::Choice;
        match s {
            "cpu" => Ok(Choice::Cpu),
            "gpu" => Ok(Choice::Gpu),
            "auto" => Ok(Choice::Auto),
            o => Err(distgrad::Error::Input(format!(
                "--device {o:?}: expected cpu, gpu or auto"
            ))),
        }
    }

    #[cfg(not(feature = "native-nccl"))]
    fn run_train_nccl(
        _: usize,
        _: &distgrad::train::TrainConfig,
        _: usize,
        _: &str,
        _: &str,
    ) -> distgrad::Result<()> {
        Err(distgrad::Error::Input(
            "this build has no NCCL backend: build with `cargo run --features native-nccl -- train --backend nccl`"
                .into(),
        ))
    }

    #[cfg(not(feature = "native-nccl"))]
    fn run_bench_nccl(_: usize, _: usize, _: usize, _: &str) -> distgrad::Result<()> {
        Err(distgrad::Error::Input(
            "this build has no NCCL backend: build with `cargo run --release --features native-nccl -- bench --transport nccl`"
                .into(),
        ))
    }

    /// NCCL all_reduce on every GPU (one process each): per size, GPU-resident buffers (NCCL
    /// alone) beside the host-staged Communicator path and (with `--data-path shared`) the shared
    /// one, and the device's copy bandwidth.
    #[cfg(feature = "native-nccl")]
    fn run_bench_nccl(
        world: usize,
        min: usize,
        max: usize,
        data_path: &str,
    ) -> distgrad::Result<()> {
        use distgrad::nccl::{DataPath, NcclComm, NcclOptions};
        use distgrad::rendezvous::LaunchEnv;
        let data_path: DataPath = data_path.parse()?;
        let Some(env) = LaunchEnv::from_env()? else {
            return launch_per_gpu(world, "bench");
        };
        let opts = NcclOptions {
            data_path,
            ..NcclOptions::default()
        };
        let comm = NcclComm::from_launch(&env, opts)?;
        let n = env.world as f64;
        let factor = 2.0 * (n - 1.0) / n;
        let copy = comm.copy_gbps(max.clamp(1 << 20, 1 << 30))?;
        if env.rank == 0 {
            println!(
                "# distgrad bench: transport=nccl, world={}, NCCL {}",
                env.world,
                distgrad::nccl::version().unwrap_or_else(|e| format!("version unknown ({e})"))
            );
            if data_path == DataPath::Shared {
                println!("# shared data path on {}", comm.device().describe());
            }
            println!("# device copy (device to device, same run): {copy:.1} GB/s");
            println!("# busbw = algbw * 2(n-1)/n (nccl-tests); with one rank it is 0: read algbw");
            println!(
                "# device: NCCL alone on CUDA buffers; staged: a host tensor through the API; \
                 shared: a wgpu tensor through the API (no host copy)"
            );
            println!(
                "{:>10} {:>12} {:>10} {:>10} {:>8} {:>12} {:>10} {:>12} {:>10}",
                "size",
                "device(us)",
                "algbw",
                "busbw",
                "/copy",
                "staged(us)",
                "algbw",
                "shared(us)",
                "algbw"
            );
        }
        for bytes in bench::sizes(min, max) {
            let iters = ((1usize << 30) / bytes.max(1)).clamp(5, 200);
            let r = comm.bench_all_reduce(bytes, iters)?;
            if env.rank == 0 {
                let gbps = |s: f64| r.bytes as f64 / s / 1e9;
                let ad = gbps(r.device_s);
                let (sh_us, sh_bw) = match r.shared_s {
                    Some(s) => (format!("{:.1}", s * 1e6), format!("{:.2}", gbps(s))),
                    None => ("-".into(), "-".into()),
                };
                println!(
                    "{:>10} {:>12.1} {:>10.2} {:>10.2} {:>8.2} {:>12.1} {:>10.2} {:>12} {:>10}",
                    bench::fmt_bytes(r.bytes),
                    r.device_s * 1e6,
                    ad,
                    ad * factor,
                    ad * factor / copy,
                    r.staged_s * 1e6,
                    gbps(r.staged_s),
                    sh_us,
                    sh_bw
                );
            }
        }
        Ok(())
    }

    /// Under a launcher (RANK set): be that rank. Otherwise: start one process per GPU with the
    /// launcher variables set, and wait for them.
    #[cfg(feature = "native-nccl")]
    fn run_train_nccl(
        world: usize,
        cfg: &distgrad::train::TrainConfig,
        every: usize,
        device: &str,
        data_path: &str,
    ) -> distgrad::Result<()> {
        use distgrad::nccl::{DataPath, NcclComm, NcclOptions};
        use distgrad::rendezvous::LaunchEnv;
        let data_path: DataPath = data_path.parse()?;
        let choice = parse_choice(device)?;
        if let Some(env) = LaunchEnv::from_env()? {
            // The shared path opens the wgpu device of this rank's GPU itself.
            let device = match data_path {
                DataPath::Shared => distgrad::backend::Device::Cpu,
                DataPath::Staging => {
                    futures::executor::block_on(distgrad::backend::select(choice))?
                }
            };
            let opts = NcclOptions {
                device,
                data_path,
                ..NcclOptions::default()
            };
            let comm = NcclComm::from_launch(&env, opts)?;
            let device = comm.device().clone();
            if env.rank == 0 {
                println!("compute: {}, data path: {data_path:?}", device.describe());
            }
            let t0 = std::time::Instant::now();
            let rep = futures::executor::block_on(distgrad::train::train(
                &comm,
                cfg,
                &device,
                |step, loss| {
                    if env.rank == 0 && (step % every == 0 || step + 1 == cfg.steps) {
                        println!("step {step:>5}  group loss {loss:.6}");
                    }
                },
            ))?;
            println!(
                "rank {}: final group loss {:.6}, parameter hash {} ({:.2} s)",
                env.rank,
                rep.losses.last().copied().unwrap_or(f32::NAN),
                rep.hashes.last().cloned().unwrap_or_default(),
                t0.elapsed().as_secs_f64()
            );
            return Ok(());
        }
        launch_per_gpu(world, "train")
    }

    /// Start this same command once per GPU with torchrun's variables set, and wait for them.
    #[cfg(feature = "native-nccl")]
    fn launch_per_gpu(world: usize, what: &str) -> distgrad::Result<()> {
        distgrad::nccl::check_libraries()?;
        let gpus = distgrad::nccl::device_count()?;
        if world == 0 || world > gpus {
            return Err(distgrad::Error::Nccl {
                op: "launch",
                rank: None,
                detail: format!(
                    "--world {world} needs {world} GPUs (one per rank); this machine has {gpus}"
                ),
            });
        }
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map_err(|e| distgrad::Error::Input(format!("no free port: {e}")))?
            .port();
        let exe = std::env::current_exe()
            .map_err(|e| distgrad::Error::Input(format!("cannot find this program: {e}")))?;
        let args: Vec<String> = std::env::args().skip(1).collect();
        eprintln!("{what}: {world} processes (one per GPU), store at 127.0.0.1:{port}");
        let children: Vec<_> = (0..world)
            .map(|r| {
                std::process::Command::new(&exe)
                    .args(&args)
                    .env("RANK", r.to_string())
                    .env("WORLD_SIZE", world.to_string())
                    .env("LOCAL_RANK", r.to_string())
                    .env("MASTER_ADDR", "127.0.0.1")
                    .env("MASTER_PORT", port.to_string())
                    .spawn()
                    .map_err(|e| distgrad::Error::Input(format!("starting rank {r}: {e}")))
            })
            .collect::<distgrad::Result<_>>()?;
        let mut failed = Vec::new();
        for (r, mut c) in children.into_iter().enumerate() {
            match c.wait() {
                Ok(s) if s.success() => {}
                Ok(s) => failed.push(format!("rank {r} exited with {s}")),
                Err(e) => failed.push(format!("rank {r}: {e}")),
            }
        }
        if failed.is_empty() {
            Ok(())
        } else {
            Err(distgrad::Error::Input(failed.join("; ")))
        }
    }

    fn run_relay(addr: &str, cfg: distgrad::relay::RelayConfig) -> distgrad::Result<()> {
        cfg.check()
            .map_err(|e| distgrad::Error::Input(format!("relay: {e}")))?;
        runtime(true)?.block_on(async {
            let listener = tokio::net::TcpListener::bind(addr)
                .await
                .map_err(|e| distgrad::Error::Input(format!("cannot listen on {addr}: {e}")))?;
            let local = listener
                .local_addr()
                .map_err(|e| distgrad::Error::Input(e.to_string()))?;
            println!("distgrad relay listening on ws://{local}/ws");
            println!(
                "native members' data streams (same port): {}",
                match (cfg.streams, cfg.splice) {
                    (false, _) => "off (data on the WebSockets)",
                    (true, true) => "on (forwarded with splice where the OS has it)",
                    (true, false) => "on (forwarded through a buffer)",
                }
            );
            if cfg.streams {
                println!(
                    "members on this host: {}",
                    if cfg.local_streams && cfg!(unix) {
                        "data streams on a Unix-domain socket (its path is in their welcome)"
                    } else {
                        "data streams over TCP"
                    }
                );
            }
            if let Some(d) = &cfg.static_dir {
                println!("serving {} at http://{local}/", d.display());
            }
            // Ctrl-C or SIGTERM (kill, service managers): stop cleanly, which also removes the
            // Unix-domain socket's directory. The handlers exist before anything is served: the
            // shutdown future first runs inside `serve`, after the socket directory is made.
            #[cfg(unix)]
            let stop = {
                use tokio::signal::unix::{SignalKind, signal};
                let handler = |kind: SignalKind| {
                    signal(kind).map_err(|e| {
                        distgrad::Error::Input(format!("cannot handle a stop signal: {e}"))
                    })
                };
                let (mut int, mut term) = (
                    handler(SignalKind::interrupt())?,
                    handler(SignalKind::terminate())?,
                );
                async move {
                    tokio::select! {
                        _ = int.recv() => {}
                        _ = term.recv() => {}
                    }
                }
            };
            #[cfg(not(unix))]
            let stop = async {
                let _ = tokio::signal::ctrl_c().await;
            };
            let shutdown = async move {
                stop.await;
                println!("distgrad relay: shutting down");
            };
            distgrad::relay::serve(listener, cfg, shutdown)
                .await
                .map_err(|e| distgrad::Error::Input(format!("relay failed: {e}")))
        })
    }

    struct WorkerOpts {
        relay: String,
        room: String,
        world: usize,
        rank: Option<u32>,
        token: Option<String>,
        timeout: std::time::Duration,
        fill_timeout: std::time::Duration,
        direct: Option<std::net::SocketAddr>,
        no_stream: bool,
    }

    fn load_case(
        collective: &str,
        case: Option<&std::path::Path>,
        world: usize,
        op: &str,
        root: usize,
    ) -> distgrad::Result<vjp::Case> {
        match case {
            Some(path) => {
                let s = std::fs::read_to_string(path).map_err(|e| {
                    distgrad::Error::Input(format!("reading {}: {e}", path.display()))
                })?;
                vjp::parse_case(&s)
            }
            None => vjp::example_case(
                Which::parse(collective)?,
                world,
                ReduceOp::parse(op)?,
                root,
                None,
            ),
        }
    }

    fn run_worker(
        o: &WorkerOpts,
        collective: &str,
        case: Option<&std::path::Path>,
        op: &str,
        root: usize,
        json: bool,
    ) -> distgrad::Result<()> {
        let case = load_case(collective, case, o.world, op, root)?;
        let prepared = vjp::Prepared::new(&case)?;
        let world =
            u32::try_from(o.world).map_err(|_| distgrad::Error::Input("world too large".into()))?;
        let mut join = distgrad::transport::ws::JoinOptions::new(&o.room, world);
        join.rank = o.rank;
        join.token = o.token.clone();
        join.direct = o.direct;
        join.stream = !o.no_stream;
        join.ready_timeout = o.fill_timeout;
        // Said as soon as the relay admits us: the others need the token to join.
        let (room, created, fill) = (o.room.clone(), o.token.is_none(), o.fill_timeout);
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
                        "rank {rank} joined room {room:?}: {} of {world} ranks present, waiting \
                         up to {}s for {waiting} more",
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
                    timeout: o.timeout,
                    ..vjp::case_options()
                },
            );
            let r = vjp::run_rank(&comm, &prepared).await;
            comm.into_transport().close().await;
            r
        })?;
        if json {
            println!(
                "{}",
                serde_json::to_string(&result)
                    .map_err(|e| distgrad::Error::Input(e.to_string()))?
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

    fn run_demo(
        world: usize,
        transport: &str,
        collective: &str,
        op: &str,
        root: usize,
        json: bool,
    ) -> distgrad::Result<()> {
        let case = load_case(collective, None, world, op, root)?;
        let out = match transport {
            "local" => vjp::run_case(&case)?,
            "relay" => demo_over_relay(&case, collective, op, root, false)?,
            "direct" => demo_over_relay(&case, collective, op, root, true)?,
            other => {
                return Err(distgrad::Error::Input(format!(
                    "unknown transport {other:?} (relay, direct or local)"
                )));
            }
        };
        print_answer(&case, &out, json)
    }

    /// A relay on an ephemeral loopback port of 127.0.0.1, in its own thread and runtime, for
    /// the worker processes of `demo` and `bench --processes`; stopped (and its thread joined) by
    /// [`LocalRelay::stop`] or when dropped, on any path out of the caller.
    struct LocalRelay {
        url: String,
        stop: Option<tokio::sync::oneshot::Sender<()>>,
        thread: Option<std::thread::JoinHandle<()>>,
    }

    impl LocalRelay {
        fn start(cfg: distgrad::relay::RelayConfig) -> distgrad::Result<LocalRelay> {
            let (addr_tx, addr_rx) = std::sync::mpsc::channel();
            let (stop, stop_rx) = tokio::sync::oneshot::channel::<()>();
            let rt = runtime(true)?;
            let thread = std::thread::spawn(move || {
                rt.block_on(async move {
                    let listener = match tokio::net::TcpListener::bind("127.0.0.1:0").await {
                        Ok(l) => l,
                        Err(e) => {
                            let _ = addr_tx.send(Err(e.to_string()));
                            return;
                        }
                    };
                    let _ = addr_tx.send(listener.local_addr().map_err(|e| e.to_string()));
                    let _ = distgrad::relay::serve(listener, cfg, async {
                        let _ = stop_rx.await;
                    })
                    .await;
                })
            });
            let addr = addr_rx
                .recv()
                .map_err(|_| distgrad::Error::Input("relay thread died".into()))?
                .map_err(|e| distgrad::Error::Input(format!("relay: {e}")))?;
            Ok(LocalRelay {
                url: format!("ws://{addr}/ws"),
                stop: Some(stop),
                thread: Some(thread),
            })
        }

        /// Stop serving and wait for the relay's thread.
        fn stop(self) {
            drop(self);
        }
    }

    impl Drop for LocalRelay {
        fn drop(&mut self) {
            if let Some(s) = self.stop.take() {
                let _ = s.send(());
            }
            if let Some(t) = self.thread.take() {
                let _ = t.join();
            }
        }
    }

    /// Where a parent hands the room token to its rank processes (not on their command lines,
    /// which other local users can read).
    const TOKEN_ENV: &str = "DISTGRAD_TOKEN";

    /// What a rank process left: its piped output (empty where not piped).
    struct Finished {
        stdout: Vec<u8>,
        stderr: Vec<u8>,
    }

    /// Wait for every rank process (`what` names them in errors). The first that fails, or that
    /// did not start, gets the others killed: they would otherwise wait for a peer that is gone
    /// until their own timeouts. Piped outputs are read as they come (a full pipe never blocks
    /// a rank). A failed rank's error carries its status and the end of its piped stderr.
    fn wait_ranks(
        what: &str,
        children: Vec<std::io::Result<std::process::Child>>,
    ) -> Vec<Result<Finished, String>> {
        use std::io::Read;
        fn drain<R: Read + Send + 'static>(
            pipe: Option<R>,
        ) -> Option<std::thread::JoinHandle<Vec<u8>>> {
            pipe.map(|mut p| {
                std::thread::spawn(move || {
                    let mut v = Vec::new();
                    let _ = p.read_to_end(&mut v);
                    v
                })
            })
        }
        let collect = |h: Option<std::thread::JoinHandle<Vec<u8>>>| {
            h.map(|h| h.join().unwrap_or_default()).unwrap_or_default()
        };
        struct Running {
            child: std::process::Child,
            out: Option<std::thread::JoinHandle<Vec<u8>>>,
            err: Option<std::thread::JoinHandle<Vec<u8>>>,
        }
        let mut results: Vec<Option<Result<Finished, String>>> = Vec::new();
        let mut running: Vec<Option<Running>> = Vec::new();
        let mut first_failure: Option<String> = None;
        for (r, c) in children.into_iter().enumerate() {
            match c {
                Ok(mut child) => {
                    let out = drain(child.stdout.take());
                    let err = drain(child.stderr.take());
                    running.push(Some(Running { child, out, err }));
                    results.push(None);
                }
                Err(e) => {
                    first_failure.get_or_insert_with(|| format!("{what} {r} did not start"));
                    running.push(None);
                    results.push(Some(Err(format!("starting {what} {r}: {e}"))));
                }
            }
        }
        while running.iter().any(Option::is_some) {
            if let Some(why) = &first_failure {
                for (r, slot) in running.iter_mut().enumerate() {
                    if let Some(mut p) = slot.take() {
                        let _ = p.child.kill();
                        let _ = p.child.wait();
                        // Its readers are left to end on their own (a grandchild may still
                        // hold the pipes open).
                        drop((p.out, p.err));
                        results[r] = Some(Err(format!("{what} {r} stopped: {why}")));
                    }
                }
                break;
            }
            let mut progressed = false;
            for (r, slot) in running.iter_mut().enumerate() {
                let Some(p) = slot.as_mut() else { continue };
                let status = match p.child.try_wait() {
                    Ok(None) => continue,
                    Ok(Some(s)) => Ok(s),
                    Err(e) => Err(e),
                };
                progressed = true;
                let Some(p) = slot.take() else { continue };
                let (stdout, stderr) = (collect(p.out), collect(p.err));
                results[r] = Some(match status {
                    Ok(s) if s.success() => Ok(Finished { stdout, stderr }),
                    Ok(s) => {
                        first_failure.get_or_insert_with(|| format!("{what} {r} failed"));
                        let text = String::from_utf8_lossy(&stderr);
                        let text = text.trim();
                        // The end of a long stderr is where the reason is.
                        let mut cut = text.len().saturating_sub(2000);
                        while !text.is_char_boundary(cut) {
                            cut += 1;
                        }
                        let tail = &text[cut..];
                        Err(if tail.is_empty() {
                            format!("{what} {r} {s} (its errors above)")
                        } else {
                            format!("{what} {r} {s}: {tail}")
                        })
                    }
                    Err(e) => {
                        first_failure.get_or_insert_with(|| format!("{what} {r} was lost"));
                        Err(format!("{what} {r}: {e}"))
                    }
                });
            }
            if !progressed {
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
        }
        results
            .into_iter()
            .enumerate()
            .map(|(r, x)| x.unwrap_or_else(|| Err(format!("{what} {r}: no result"))))
            .collect()
    }

    /// A relay on an ephemeral loopback port (its own thread and runtime) plus `world` worker processes.
    fn demo_over_relay(
        case: &vjp::Case,
        collective: &str,
        op: &str,
        root: usize,
        direct: bool,
    ) -> distgrad::Result<vjp::CaseOutput> {
        let world = case.world;
        let prepared = vjp::Prepared::new(case)?;
        let relay = LocalRelay::start(distgrad::relay::RelayConfig::default())?;
        let url = relay.url.clone();
        let token = distgrad::relay::random_token();
        eprintln!("demo: relay at {url}, room \"demo\", {world} worker processes");
        let exe = std::env::current_exe().map_err(|e| distgrad::Error::Input(e.to_string()))?;
        let children: Vec<_> = (0..world)
            .map(|r| {
                std::process::Command::new(&exe)
                    .args(["worker", "--relay", &url, "--room", "demo", "--json"])
                    .env(TOKEN_ENV, &token)
                    .args(["--world", &world.to_string(), "--rank", &r.to_string()])
                    .args([
                        "--collective",
                        collective,
                        "--op",
                        op,
                        "--root",
                        &root.to_string(),
                    ])
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

    #[cfg(feature = "wgpu")]
    fn run_kernel_bench(sizes: &[usize]) -> distgrad::Result<()> {
        warn_if_debug_build();
        let gpu = futures::executor::block_on(distgrad::backend::gpu::Gpu::new())?;
        println!("# distgrad bench kernels: adapter {}", gpu.describe());
        println!(
            "# GB/s: bytes each kernel reads + writes in device memory per second; x copy: ratio \
             to the device's own buffer-to-buffer copy measured in the same run; the 1-thread CPU \
             loop up to {} elements",
            CPU_KERNEL_MAX
        );
        let limits = gpu.limits();
        println!(
            "# limits: largest buffer {} bytes, storage binding {} bytes",
            limits.max_buffer_size, limits.max_storage_buffer_binding_size
        );
        for &n in sizes {
            let with_cpu = n <= CPU_KERNEL_MAX;
            let b = bench::kernels(&gpu, n, with_cpu)?;
            let cuda = cuda_copy_gbps(b.n * 4);
            println!(
                "## {} f32 per input ({} per buffer); a wait on the device {:.1} us, a 4-byte \
                 readback {:.1} us (medians)",
                b.n,
                bench::fmt_bytes(b.n * 4),
                b.sync_us,
                b.readback_us
            );
            match &cuda {
                Some(Ok(c)) => println!(
                    "# CUDA device-to-device copy of the same size, same run: {c:.2} GB/s (x CUDA: \
                     ratio to it)"
                ),
                Some(Err(e)) => println!("# CUDA copy not measured: {e}"),
                None => {}
            }
            let cuda = cuda.and_then(|c| c.ok());
            println!(
                "{:>26} {:>10} {:>8} {:>8} {:>14} {:>8}",
                "kernel", "GPU GB/s", "x copy", "x CUDA", "1-thread CPU", "GPU/CPU"
            );
            for r in &b.rows {
                let (cpu, ratio) = match r.cpu_gbps {
                    Some(c) => (format!("{c:.2}"), format!("{:.2}", r.gpu_gbps / c)),
                    None => ("-".into(), "-".into()),
                };
                let x_cuda = cuda.map_or("-".into(), |c| format!("{:.2}", r.gpu_gbps / c));
                println!(
                    "{:>26} {:>10.2} {:>8.2} {:>8} {:>14} {:>8}",
                    r.name,
                    r.gpu_gbps,
                    r.gpu_gbps / b.device_copy_gbps,
                    x_cuda,
                    cpu,
                    ratio
                );
            }
        }
        Ok(())
    }

    /// CUDA's own device-to-device copy for `bench kernels` (the NCCL build, where CUDA loads):
    /// `None` when this build has no CUDA or the machine has no CUDA device.
    #[cfg(feature = "native-nccl")]
    fn cuda_copy_gbps(bytes: usize) -> Option<distgrad::Result<f64>> {
        match distgrad::nccl::device_count() {
            Ok(n) if n > 0 => Some(distgrad::nccl::cuda_copy_gbps(0, bytes)),
            _ => None,
        }
    }

    #[cfg(all(feature = "wgpu", not(feature = "native-nccl")))]
    fn cuda_copy_gbps(_: usize) -> Option<distgrad::Result<f64>> {
        None
    }

    /// Largest size at which `bench kernels` also times the 1-thread CPU loop (16M f32: larger
    /// ones would spend seconds per row on the host).
    #[cfg(feature = "wgpu")]
    const CPU_KERNEL_MAX: usize = 16 << 20;

    #[cfg(not(feature = "wgpu"))]
    fn run_kernel_bench(_: &[usize]) -> distgrad::Result<()> {
        Err(distgrad::Error::Input(
            "this build has no WGSL backend (build with the `wgpu` feature)".into(),
        ))
    }

    /// A case's answer as JSON (`--json`) or as the per-rank table.
    fn print_answer(case: &vjp::Case, out: &vjp::CaseOutput, json: bool) -> distgrad::Result<()> {
        if json {
            let text =
                serde_json::to_string(out).map_err(|e| distgrad::Error::Input(e.to_string()))?;
            println!("{text}");
        } else {
            print!("{}", vjp::render_table(case, out));
        }
        Ok(())
    }

    #[cfg(test)]
    mod tests {
        use super::wait_ranks;
        use std::process::{Command, Stdio};

        fn sh(script: &str) -> std::io::Result<std::process::Child> {
            Command::new("sh")
                .args(["-c", script])
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
        }

        #[test]
        fn all_ranks_succeeding_give_their_outputs() {
            let got = wait_ranks("rank", vec![sh("echo zero"), sh("echo one; echo note >&2")]);
            let got: Vec<_> = got.into_iter().map(|r| r.expect("ok")).collect();
            assert_eq!(got[0].stdout, b"zero\n");
            assert_eq!(got[1].stdout, b"one\n");
            assert_eq!(got[1].stderr, b"note\n");
        }

        /// One rank fails: the others, which would wait for it (here: a minute), are killed at
        /// once, and every error says what happened to whom.
        #[test]
        fn a_failed_rank_stops_the_others() {
            let t0 = std::time::Instant::now();
            let got = wait_ranks(
                "rank",
                vec![
                    sh("exec sleep 60"),
                    sh("sleep 1; echo boom >&2; exit 3"),
                    sh("exec sleep 60"),
                    sh("echo fine"),
                ],
            );
            assert!(
                t0.elapsed() < std::time::Duration::from_secs(30),
                "the waiting ranks were not stopped ({:?})",
                t0.elapsed()
            );
            let mut got = got.into_iter();
            let errs: Vec<String> = got
                .by_ref()
                .take(3)
                .map(|r| r.err().expect("ranks 0..3 fail"))
                .collect();
            // The rank that had finished before the failure keeps its result.
            let fine = got.next().expect("rank 3").expect("rank 3 succeeded");
            assert_eq!(fine.stdout, b"fine\n");
            assert!(
                errs[1].contains("rank 1") && errs[1].contains("boom"),
                "{}",
                errs[1]
            );
            assert!(errs[1].contains('3'), "the exit status: {}", errs[1]);
            for r in [0, 2] {
                assert!(
                    errs[r].contains(&format!("rank {r} stopped: rank 1 failed")),
                    "{}",
                    errs[r]
                );
            }
        }

        #[test]
        fn a_rank_that_did_not_start_stops_the_others() {
            let missing = Command::new("/nonexistent/distgrad-test-binary").spawn();
            let got = wait_ranks("worker", vec![sh("exec sleep 60"), missing]);
            let errs: Vec<String> = got
                .into_iter()
                .map(|r| r.err().expect("all fail"))
                .collect();
            assert!(errs[1].starts_with("starting worker 1"), "{}", errs[1]);
            assert!(
                errs[0].contains("worker 0 stopped: worker 1 did not start"),
                "{}",
                errs[0]
            );
        }
    }
}
