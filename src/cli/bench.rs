//! `distgrad bench`: the nccl-tests-style table of collectives over any transport (in-process
//! threads, processes through a relay, direct links, NCCL), each beside a baseline measured in the
//! same run, and `bench kernels` (the WGSL kernels beside the device's own copy).

use clap::ValueEnum;
use distgrad::backend::Device;
use distgrad::bench::{self, BenchOp};
use distgrad::in_process::RelayRoute;
use distgrad::{AllReduceAlgo, CommOptions, Communicator, SmallAllReduce};

use super::launch::{LocalRelay, TOKEN_ENV, wait_ranks};
use super::{DataPathArg, DeviceArg, flag_value, named, runtime, warn_if_debug_build};

/// What `bench` measures.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum What {
    /// The collectives' table.
    Collectives,
    /// The WGSL kernels on this process's GPU adapter.
    Kernels,
}

/// How the ranks of `bench collectives` talk.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Transport {
    /// Ranks as threads of this process.
    Local,
    /// Each rank a WebSocket plus a data stream to a relay, on its Unix-domain socket.
    Relay,
    /// Data streams over TCP, as from other hosts.
    RelayTcp,
    /// Data on the WebSocket too, as browsers send it.
    RelayWs,
    /// Data streams, forwarded by the relay through a buffer instead of splice(2).
    RelayBuffered,
    /// Introduced by the relay, data over TCP links between the ranks.
    Direct,
    /// One process per GPU over NCCL, all_reduce only (needs `--features native-nccl`).
    Nccl,
}

impl Transport {
    /// The relay route, or `None` for in-process ranks and NCCL; and how the header describes it.
    fn route(self) -> (Option<RelayRoute>, &'static str) {
        match self {
            Transport::Local | Transport::Nccl => (None, "in-process threads"),
            Transport::Relay => (
                Some(RelayRoute::Stream),
                "each with a WebSocket and a data stream (Unix-domain socket) to a relay on 127.0.0.1",
            ),
            Transport::RelayTcp => (
                Some(RelayRoute::StreamTcp),
                "each with a WebSocket and a TCP data stream to a relay on 127.0.0.1",
            ),
            Transport::RelayWs => (
                Some(RelayRoute::WebSocket),
                "each with its own WebSocket (data included) to a relay on 127.0.0.1",
            ),
            Transport::RelayBuffered => (
                Some(RelayRoute::Stream),
                "as relay, the relay forwarding stream payloads through a buffer instead of splice(2)",
            ),
            Transport::Direct => (
                Some(RelayRoute::Direct),
                "introduced by a relay on 127.0.0.1, data over direct TCP links between them",
            ),
        }
    }
}

/// Flags of `distgrad bench`.
#[derive(clap::Args)]
pub struct BenchArgs {
    /// What to measure.
    #[arg(value_enum, default_value_t = What::Collectives)]
    what: What,
    /// How the ranks talk.
    #[arg(long, value_enum, default_value_t = Transport::Local)]
    transport: Transport,
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
        default_value = "all_reduce,all_gather,broadcast",
        value_parser = named(&BenchOp::ALL, BenchOp::name)
    )]
    ops: Vec<BenchOp>,
    /// Algorithm of large all_reduces (`auto`: shared in-process, ring through the relay). With
    /// `auto` in-process, the largest all_reduce is also measured with each algorithm.
    #[arg(long, default_value = "auto", value_parser = named(&AllReduceAlgo::ALL, AllReduceAlgo::name))]
    algo: AllReduceAlgo,
    /// Algorithm of small all_reduces (below the ring threshold, 3 ranks or more): `exchange`
    /// (every rank to every other, one round) or `star` (through rank 0 and back, two rounds,
    /// `2(n-1)` messages; what a relay room's ranks use).
    #[arg(long, default_value = "exchange", value_parser = named(&SmallAllReduce::ALL, SmallAllReduce::name))]
    small_algo: SmallAllReduce,
    /// With `--transport nccl`: `shared` also measures the shared data path (wgpu tensors through
    /// Vulkan memory imported into CUDA; needs Vulkan on the GPU) beside staging.
    #[arg(long, value_enum, default_value_t = DataPathArg::Staging)]
    data_path: DataPathArg,
    /// Run the ranks as processes (this program started once per rank, as gloo's ranks are)
    /// instead of threads of this one; transports through a relay only (the relay stays in this
    /// process).
    #[arg(long)]
    processes: bool,
    /// Where the tensors of `bench collectives` live (`gpu`: in-process ranks only; the table then
    /// says how many bytes each call read back from the device).
    #[arg(long, value_enum, default_value_t = DeviceArg::Cpu)]
    device: DeviceArg,
    /// `bench kernels`: f32 elements per input, comma-separated; a suffix K, M or G multiplies by
    /// 2^10, 2^20 or 2^30 (e.g. `16M,256M`).
    #[arg(long, value_delimiter = ',', default_value = "16M", value_parser = parse_count)]
    elements: Vec<usize>,
    /// Internal: run as one rank of a `--processes` bench (relay URL, rank, the parent's memcpy
    /// GB/s; the room token comes in DISTGRAD_TOKEN).
    #[arg(long, hide = true, num_args = 3, value_names = ["URL", "RANK", "MEMCPY"])]
    bench_rank: Option<Vec<String>>,
}

/// A count such as `1024`, `16M` or `1G` (suffixes K, M, G: times 2^10, 2^20, 2^30).
fn parse_count(s: &str) -> Result<usize, String> {
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
        .ok_or_else(|| format!("expected a positive count such as 1024, 16M or 1G, got {s:?}"))
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

/// Run `distgrad bench`.
pub fn run(a: BenchArgs) -> distgrad::Result<()> {
    match a.what {
        What::Kernels => {
            let defaults = a.transport == Transport::Local
                && a.world == 4
                && a.min_bytes == 4
                && a.max_bytes == 64 << 20
                && !a.processes
                && a.device == DeviceArg::Cpu;
            if !defaults {
                eprintln!(
                    "distgrad: note: --transport, --world, --min-bytes, --max-bytes, --processes \
                     and --device apply to `bench collectives`; `bench kernels` runs on this \
                     process's GPU adapter with --elements per input"
                );
            }
            kernels(&a.elements)
        }
        What::Collectives => {
            let child = a.bench_rank.as_deref().map(BenchChild::parse).transpose()?;
            collectives(&a, child)
        }
    }
}

fn collectives(a: &BenchArgs, child: Option<BenchChild>) -> distgrad::Result<()> {
    if child.is_none() {
        warn_if_debug_build();
    }
    let (world, min, max, algo) = (a.world, a.min_bytes, a.max_bytes, a.algo);
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
    if a.transport == Transport::Nccl {
        if a.processes || child.is_some() {
            return Err(distgrad::Error::Input(
                "--transport nccl starts its own processes (one per GPU): drop --processes".into(),
            ));
        }
        return nccl(world, min, max, a.data_path);
    }
    let sizes = bench::sizes(min, max);
    let (route, what) = a.transport.route();
    let local = route.is_none();
    if local && (a.processes || child.is_some()) {
        return Err(distgrad::Error::Input(
            "--processes needs a transport through a relay (relay, relay-tcp, relay-ws, relay-buffered or direct)".into(),
        ));
    }
    if !local && a.device != DeviceArg::Cpu {
        return Err(distgrad::Error::Input(format!(
            "--device {} is for in-process ranks (--transport local); the relay transports bench \
             host tensors",
            flag_value(&a.device)
        )));
    }
    let device = a.device.open()?;
    let base = if local {
        CommOptions::default()
    } else {
        CommOptions::for_network()
    };
    let opts = match algo {
        AllReduceAlgo::Auto => base,
        algo => CommOptions {
            all_reduce: algo,
            ..base
        },
    };
    let opts = CommOptions {
        small_all_reduce: a.small_algo,
        ..opts
    };
    let relay_cfg = distgrad::relay::RelayConfig {
        splice: a.transport != Transport::RelayBuffered,
        // Its own relay, whose rank processes all start with the token it made.
        client_tokens: true,
        ..Default::default()
    };
    if let (Some(child), Some(route)) = (&child, route) {
        return rank_process(child, route, &relay_cfg, opts, world, &a.ops, &sizes);
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
    println!(
        "# distgrad bench: transport={} ({who}{what}{in_this}), world={world}",
        flag_value(&a.transport)
    );
    println!(
        "# memcpy {}: {memcpy:.2} GB/s (single thread, same run)",
        bench::fmt_bytes(max.max(1 << 20))
    );
    println!("# busbw factors (nccl-tests): all_reduce 2(n-1)/n, all_gather (n-1)/n, broadcast 1");
    let resolved = match (opts.all_reduce, local) {
        (AllReduceAlgo::Auto, true) => "shared (auto: in-process ranks share memory)",
        (AllReduceAlgo::Auto, false) => "ring (auto)",
        (algo, _) => algo.name(),
    };
    let small = match (opts.small_all_reduce, world) {
        (SmallAllReduce::Star, 3..) => "the star through rank 0",
        _ => "direct exchange",
    };
    println!(
        "# all_reduce: {small} below {} per rank, {resolved} from there",
        bench::fmt_bytes(opts.ring_threshold)
    );
    #[cfg(feature = "wgpu")]
    if let Device::Gpu(g) = &device {
        println!(
            "# tensors on {} (read back/call: bytes each call read back from the device, per rank)",
            g.describe()
        );
    }
    println!("{}", bench::table_header(device != Device::Cpu));
    let ops = &a.ops;
    if a.processes {
        processes(a, relay_cfg, memcpy)?;
    } else {
        let results = match route {
            None => distgrad::run_local(world, opts, |comm| {
                let (sizes, device) = (&sizes, &device);
                async move { rank_bench(&comm, ops, sizes, memcpy, device).await }
            }),
            Some(route) => distgrad::in_process::run_over_relay_via(
                world,
                relay_cfg,
                opts,
                route,
                async |comm| rank_bench(comm, ops, &sizes, memcpy, &Device::Cpu).await,
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
        let rank0 = rank0.ok_or_else(|| distgrad::Error::Input("no result from rank 0".into()))?;
        print_summary(&rank0, memcpy);
    }
    let largest = sizes.last().copied().filter(|&b| b >= (1 << 20));
    if let (true, AllReduceAlgo::Auto, true, Some(bytes)) =
        (local, algo, ops.contains(&BenchOp::AllReduce), largest)
    {
        let mut line = format!(
            "# all_reduce {} by algorithm (busbw, x memcpy):",
            bench::fmt_bytes(bytes)
        );
        for algo in [
            AllReduceAlgo::Ring,
            AllReduceAlgo::Pairwise,
            AllReduceAlgo::Shared,
        ] {
            let opts = CommOptions {
                all_reduce: algo,
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
                    algo.name(),
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

type RankBench = (Vec<bench::Row>, (std::time::Duration, std::time::Duration));

/// The closing lines of a collectives bench, from rank 0's result.
fn print_summary((rows, (p50, p99)): &RankBench, memcpy: f64) {
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
fn processes(
    a: &BenchArgs,
    relay_cfg: distgrad::relay::RelayConfig,
    memcpy: f64,
) -> distgrad::Result<()> {
    let relay = LocalRelay::start(relay_cfg)?;
    let token =
        distgrad::relay::random_token().map_err(|e| distgrad::Error::Input(e.to_string()))?;
    let exe = std::env::current_exe().map_err(|e| distgrad::Error::Input(e.to_string()))?;
    let ops: Vec<&str> = a.ops.iter().map(|o| o.name()).collect();
    let children: Vec<_> = (0..a.world)
        .map(|r| {
            std::process::Command::new(&exe)
                .args(["bench", "--transport", &flag_value(&a.transport)])
                .args(["--world", &a.world.to_string()])
                .args(["--min-bytes", &a.min_bytes.to_string()])
                .args(["--max-bytes", &a.max_bytes.to_string()])
                .args(["--ops", &ops.join(","), "--algo", a.algo.name()])
                .args(["--small-algo", a.small_algo.name()])
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
fn rank_process(
    child: &BenchChild,
    route: RelayRoute,
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
        let r = rank_bench(&comm, ops, sizes, child.memcpy, &Device::Cpu).await;
        comm.into_transport().close().await;
        r
    })?;
    if child.rank == 0 {
        print_summary(&rank0, child.memcpy);
    }
    Ok(())
}

/// One rank's whole benchmark: the table (printed by rank 0 as it goes), then the latency.
async fn rank_bench<C: Communicator>(
    comm: &C,
    ops: &[BenchOp],
    sizes: &[usize],
    memcpy: f64,
    device: &Device,
) -> distgrad::Result<RankBench> {
    let rows = bench::bench_all(comm, ops, sizes, memcpy, comm.rank() == 0, device).await?;
    let lat = bench::latency_16b(comm, 2000).await?;
    Ok((rows, lat))
}

#[cfg(not(feature = "native-nccl"))]
fn nccl(_: usize, _: usize, _: usize, _: DataPathArg) -> distgrad::Result<()> {
    Err(distgrad::Error::Input(
        "this build has no NCCL backend: build with `cargo run --release --features native-nccl -- bench --transport nccl`"
            .into(),
    ))
}

/// NCCL all_reduce on every GPU (one process each): per size, GPU-resident buffers (NCCL alone)
/// beside the host-staged Communicator path and (with `--data-path shared`) the shared one, and
/// the device's copy bandwidth.
#[cfg(feature = "native-nccl")]
fn nccl(world: usize, min: usize, max: usize, data_path: DataPathArg) -> distgrad::Result<()> {
    use distgrad::nccl::{DataPath, NcclComm, NcclOptions};
    use distgrad::rendezvous::LaunchEnv;
    let data_path = DataPath::from(data_path);
    let Some(env) = LaunchEnv::from_env()? else {
        return super::launch::per_gpu(world, "bench");
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

#[cfg(feature = "wgpu")]
fn kernels(sizes: &[usize]) -> distgrad::Result<()> {
    warn_if_debug_build();
    let gpu = futures::executor::block_on(distgrad::backend::gpu::Gpu::new())?;
    println!("# distgrad bench kernels: adapter {}", gpu.describe());
    println!(
        "# GB/s: bytes each kernel reads + writes in device memory per second; x copy: ratio to \
         the device's own buffer-to-buffer copy measured in the same run; the 1-thread CPU loop up \
         to {CPU_KERNEL_MAX} elements"
    );
    let limits = gpu.limits();
    println!(
        "# limits: largest buffer {} bytes, storage binding {} bytes",
        limits.max_buffer_size, limits.max_storage_buffer_binding_size
    );
    for &n in sizes {
        let b = bench::kernels(&gpu, n, n <= CPU_KERNEL_MAX)?;
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

/// Largest size at which `bench kernels` also times the 1-thread CPU loop (16M f32: larger ones
/// would spend seconds per row on the host).
#[cfg(feature = "wgpu")]
const CPU_KERNEL_MAX: usize = 16 << 20;

#[cfg(not(feature = "wgpu"))]
fn kernels(_: &[usize]) -> distgrad::Result<()> {
    Err(distgrad::Error::Input(
        "this build has no WGSL backend (build with the `wgpu` feature)".into(),
    ))
}
