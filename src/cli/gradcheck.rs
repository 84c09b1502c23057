//! `distgrad gradcheck`: a program's gradients checked across its ranks by central differences of
//! the global objective (see the library's `gradcheck` module).

use clap::ValueEnum;
use distgrad::gradcheck::{Options, gradcheck_program};
use distgrad::program::{ObjectiveName, Program};

/// Flags of `distgrad gradcheck`.
#[derive(clap::Args)]
pub struct GradcheckArgs {
    /// The program file (JSON; `-` reads stdin). Not with `--random`.
    #[arg(required_unless_present = "random", conflicts_with = "random")]
    program: Option<std::path::PathBuf>,
    /// Check this many random programs instead (seeds from `--seed`): compositions of local ops
    /// and every collective over worlds 1..=8, subgroups, every reduce op, uneven splits, both
    /// objectives. Each failure prints its program.
    #[arg(long)]
    random: Option<u64>,
    /// World size, 1..=64 (default: the program's).
    #[arg(long)]
    world: Option<usize>,
    /// Objective convention (default: the program's).
    #[arg(long, value_enum)]
    objective: Option<ObjectiveArg>,
    /// Where the ranks run: in this process (the only transport `gradcheck` has today; relay and
    /// direct links come with worker processes that run programs).
    #[arg(long, value_enum, default_value_t = TransportArg::Local)]
    transport: TransportArg,
    /// Finite-difference step (the check also uses half of it).
    #[arg(long, default_value_t = 1e-2)]
    eps: f32,
    /// Relative tolerance.
    #[arg(long, default_value_t = 1e-2)]
    rtol: f64,
    /// Absolute tolerance (times max(1, |F|)).
    #[arg(long, default_value_t = 1e-3)]
    atol: f64,
    /// Check this many random directions instead of every coordinate.
    #[arg(long)]
    directions: Option<usize>,
    /// Seed of the random directions, and the first seed of `--random`.
    #[arg(long, default_value_t = 0)]
    seed: u64,
}

/// The objective conventions.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum ObjectiveArg {
    /// The sum over ranks of each rank's loss (PyTorch's convention).
    SumOfRankLosses,
    /// Values know whether they are replicated; an invariant loss counts once (JAX's).
    Replicated,
}

/// Where the ranks of a program run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum TransportArg {
    /// In-process ranks (threads).
    Local,
}

/// Read a program file (`-`: stdin).
pub fn read_program(path: &std::path::Path) -> distgrad::Result<Program> {
    let text = if path.as_os_str() == "-" {
        std::io::read_to_string(std::io::stdin())
            .map_err(|e| distgrad::Error::Input(format!("reading stdin: {e}")))?
    } else {
        std::fs::read_to_string(path)
            .map_err(|e| distgrad::Error::Input(format!("reading {}: {e}", path.display())))?
    };
    Program::parse(&text).map_err(|e| distgrad::Error::Input(format!("{}: {e}", path.display())))
}

/// Run `distgrad gradcheck`: the exit code (0 PASS, 1 FAIL, 3 INCONCLUSIVE).
pub fn run(a: GradcheckArgs) -> distgrad::Result<u8> {
    if !(a.eps.is_finite() && a.eps > 0.0) {
        return Err(distgrad::Error::Input(format!(
            "--eps {} must be a positive number",
            a.eps
        )));
    }
    if let Some(n) = a.random {
        return random(&a, n);
    }
    let path = a
        .program
        .as_deref()
        .ok_or_else(|| distgrad::Error::Input("give a program file or --random N".into()))?;
    let mut program = read_program(path)?;
    if let Some(o) = a.objective {
        program.objective = match o {
            ObjectiveArg::SumOfRankLosses => ObjectiveName::SumOfRankLosses,
            ObjectiveArg::Replicated => ObjectiveName::Replicated,
        };
    }
    if a.directions == Some(0) {
        return Err(distgrad::Error::Input(
            "--directions must be at least 1".into(),
        ));
    }
    let plan = program.plan(a.world)?;
    let TransportArg::Local = a.transport;
    let o = options(&a);
    if let Some(t) = &program.title {
        println!("{t}");
    }
    let report = gradcheck_program(&plan, &o)?;
    print!("{}", report.render());
    Ok(exit_code(&report))
}

fn exit_code(r: &distgrad::gradcheck::Report) -> u8 {
    match r.verdict() {
        "PASS" => 0,
        "INCONCLUSIVE" => 3,
        _ => 1,
    }
}

fn options(a: &GradcheckArgs) -> Options {
    Options {
        eps: a.eps,
        rtol: a.rtol,
        atol: a.atol,
        directions: a.directions,
        seed: a.seed,
        ..Options::default()
    }
}

/// `--random N`: check N random programs, print each failure's program and report, and a summary.
fn random(a: &GradcheckArgs, n: u64) -> distgrad::Result<u8> {
    use distgrad::program::{RandomOptions, random_program};
    let o = options(a);
    let ro = RandomOptions {
        objective: a.objective.map(|o| match o {
            ObjectiveArg::SumOfRankLosses => ObjectiveName::SumOfRankLosses,
            ObjectiveArg::Replicated => ObjectiveName::Replicated,
        }),
        ..RandomOptions::default()
    };
    let o = Options {
        comm: distgrad::CommOptions {
            timeout: std::time::Duration::from_secs(5),
            ..o.comm.clone()
        },
        ..o
    };
    let (mut passed, mut refused, mut failed, mut inconclusive) =
        (0u64, 0u64, Vec::new(), Vec::new());
    let started = std::time::Instant::now();
    for seed in a.seed..a.seed.saturating_add(n) {
        let p = random_program(seed, &ro);
        let plan = match p.plan(a.world.or(Some(p.world))) {
            Ok(plan) => plan,
            Err(_) => {
                refused += 1;
                continue;
            }
        };
        let json = || serde_json::to_string(&p).unwrap_or_default();
        match gradcheck_program(&plan, &o) {
            Ok(r) if r.verdict() == "PASS" => passed += 1,
            Ok(r) if r.passed => inconclusive.push(seed),
            Ok(r) => {
                println!("seed {seed}: FAIL\n{}\n{}", json(), r.render());
                failed.push(seed);
            }
            Err(e) => {
                println!("seed {seed}: ERROR {e}\n{}", json());
                failed.push(seed);
            }
        }
    }
    println!(
        "{n} random programs from seed {}: {passed} passed, {} failed {:?}, {} inconclusive (exact ties) {:?}, {refused} refused by the plan (the replicated objective's rules); {:.1} s",
        a.seed,
        failed.len(),
        failed,
        inconclusive.len(),
        inconclusive,
        started.elapsed().as_secs_f64()
    );
    Ok(if failed.is_empty() { 0 } else { 1 })
}
