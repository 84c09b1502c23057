//! The `distgrad` command line: `vjp` (one collective forward + backward, per-rank table) and
//! `bench` (collective bandwidth and tape overhead).

use std::io::Read as _;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use distgrad::ReduceOp;
use distgrad::bench::{self, BenchOp};
use distgrad::vjp::{self, Which};

#[cfg(not(target_arch = "wasm32"))]
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
        /// World size for the built-in example.
        #[arg(long, default_value_t = 4)]
        world: usize,
        /// Reduce op for the built-in example (sum, avg, prod, min, max).
        #[arg(long, default_value = "sum")]
        op: String,
        /// Root (group rank) for the built-in example.
        #[arg(long, default_value_t = 0)]
        root: usize,
        /// Subgroup for the built-in example, as comma-separated global ranks.
        #[arg(long, value_delimiter = ',')]
        group: Option<Vec<usize>>,
        /// Print the machine-readable JSON output instead of the table.
        #[arg(long)]
        json: bool,
        /// Print the case itself as JSON (e.g. to edit and feed back) and exit.
        #[arg(long)]
        print_case: bool,
    },
    /// Benchmarks: an nccl-tests-style table of collectives (with a memcpy line measured in the same
    /// run) and the tape's overhead per local op.
    Bench {
        /// Transport: `local` (ranks as threads of this process).
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
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let r = match cli.cmd {
        Cmd::Vjp {
            what,
            world,
            op,
            root,
            group,
            json,
            print_case,
        } => run_vjp(&what, world, &op, root, group, json, print_case),
        Cmd::Bench {
            transport,
            world,
            min_bytes,
            max_bytes,
            ops,
        } => run_bench(&transport, world, min_bytes, max_bytes, &ops),
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("distgrad: {e}");
            ExitCode::from(2)
        }
    }
}

fn run_vjp(
    what: &str,
    world: usize,
    op: &str,
    root: usize,
    group: Option<Vec<usize>>,
    json: bool,
    print_case: bool,
) -> distgrad::Result<()> {
    let case = if let Ok(which) = Which::parse(what) {
        vjp::example_case(which, world, ReduceOp::parse(op)?, root, group)?
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
    } else {
        // Neither a collective nor a file: say both.
        let e = Which::parse(what)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        return Err(distgrad::Error::Input(format!(
            "{what:?} is not a file; {e}"
        )));
    };
    if print_case {
        println!(
            "{}",
            serde_json::to_string_pretty(&case)
                .map_err(|e| distgrad::Error::Input(e.to_string()))?
        );
        return Ok(());
    }
    let out = vjp::run_case(&case)?;
    if json {
        println!(
            "{}",
            serde_json::to_string(&out).map_err(|e| distgrad::Error::Input(e.to_string()))?
        );
    } else {
        print!("{}", vjp::render_table(&case, &out));
    }
    Ok(())
}

fn run_bench(
    transport: &str,
    world: usize,
    min: usize,
    max: usize,
    ops: &[String],
) -> distgrad::Result<()> {
    if transport != "local" {
        return Err(distgrad::Error::Input(format!(
            "transport {transport:?} is not available in this build (available: local)"
        )));
    }
    if world == 0 || world > 64 {
        return Err(distgrad::Error::Input(format!(
            "world must be 1..=64, got {world}"
        )));
    }
    let ops: Vec<BenchOp> = ops
        .iter()
        .map(|s| BenchOp::parse(s))
        .collect::<distgrad::Result<_>>()?;
    let memcpy = bench::memcpy_gbps(max.max(1 << 20));
    println!("# distgrad bench: transport=local (threads), world={world}");
    println!(
        "# memcpy {}: {memcpy:.2} GB/s (single thread, same run)",
        bench::fmt_bytes(max.max(1 << 20))
    );
    println!("# busbw factors (nccl-tests): all_reduce 2(n-1)/n, all_gather (n-1)/n, broadcast 1");
    println!(
        "{:>12} {:>12} {:>12} {:>10} {:>10} {:>10}",
        "op", "size", "time(us)", "algbw", "busbw", "busbw/memcpy"
    );
    let mut last = Vec::new();
    for &op in &ops {
        for bytes in bench::sizes(min, max) {
            let row = bench::bench_one(op, world, bytes)?;
            println!(
                "{:>12} {:>12} {:>12.1} {:>10.3} {:>10.3} {:>10.2}",
                op.name(),
                bench::fmt_bytes(row.bytes),
                row.time.as_secs_f64() * 1e6,
                row.algbw,
                row.busbw,
                row.busbw / memcpy
            );
            last.push(row);
        }
    }
    if let Some(r) = last.iter().rev().find(|r| r.op == BenchOp::AllReduce) {
        println!(
            "# all_reduce at {}: busbw {:.3} GB/s = {:.2}x memcpy (target >= 0.5x)",
            bench::fmt_bytes(r.bytes),
            r.busbw,
            r.busbw / memcpy
        );
    }
    let (taped, raw) = bench::tape_overhead(200_000)?;
    println!(
        "# tape overhead: {taped:.3} us per recorded op on 1-element tensors vs {raw:.3} us untaped ({:.3} us/op added)",
        taped - raw
    );
    Ok(())
}
