//! `distgrad gradcheck`: a program's gradients checked across its ranks by central differences of
//! the global objective (see the library's `gradcheck` module).

use clap::ValueEnum;
use distgrad::gradcheck::{Options, gradcheck_program};
use distgrad::program::{ObjectiveName, Program};

/// Flags of `distgrad gradcheck`.
#[derive(clap::Args)]
pub struct GradcheckArgs {
    /// The program or lesson file (JSON; `-` reads stdin). Not with `--random`.
    #[arg(required_unless_present = "random", conflicts_with = "random")]
    program: Option<std::path::PathBuf>,
    /// Check this many random programs instead (seeds from `--seed`): compositions of local ops
    /// and every collective over worlds 1..=8, subgroups, every reduce op, uneven splits, both
    /// objectives. Each failure prints its program.
    #[arg(long)]
    random: Option<u64>,
    /// World size, 1..=64 (default: the program's or lesson's).
    #[arg(long)]
    world: Option<usize>,
    /// Where the ranks run: threads of this process, or worker processes through a relay
    /// started here, or worker processes over direct TCP links (the relay introducing them).
    #[arg(long, value_enum, default_value_t = TransportArg::Local)]
    transport: TransportArg,
    /// How to check.
    #[command(flatten)]
    check: CheckFlags,
    /// Print the report as JSON (verdict, one row per rank and input, kinks, directions)
    /// instead of the table.
    #[arg(long)]
    json: bool,
}

/// The report as printed: the table, or JSON (`json`).
pub fn show(report: &distgrad::gradcheck::Report, json: bool) -> String {
    if json {
        format!("{}\n", report.to_json())
    } else {
        report.render()
    }
}

impl GradcheckArgs {
    /// Whether the ranks are threads of this process (no sockets, no relay here).
    pub fn in_process(&self) -> bool {
        self.transport == TransportArg::Local
    }
}

/// How to check (shared by `gradcheck` and the workers it starts).
#[derive(clap::Args, Clone, Debug)]
pub struct CheckFlags {
    /// Objective convention (default: the program's).
    #[arg(long, value_enum)]
    objective: Option<ObjectiveArg>,
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

impl CheckFlags {
    /// Refuse values that cannot work.
    fn validate(&self) -> distgrad::Result<()> {
        if !(self.eps.is_finite() && self.eps > 0.0) {
            return Err(distgrad::Error::Input(format!(
                "--eps {} must be a positive number",
                self.eps
            )));
        }
        if self.directions == Some(0) {
            return Err(distgrad::Error::Input(
                "--directions must be at least 1".into(),
            ));
        }
        if !(self.rtol >= 0.0 && self.atol >= 0.0) {
            return Err(distgrad::Error::Input(
                "--rtol and --atol must be at least 0".into(),
            ));
        }
        Ok(())
    }

    /// The library's options.
    pub fn options(&self) -> Options {
        Options {
            eps: self.eps,
            rtol: self.rtol,
            atol: self.atol,
            directions: self.directions,
            seed: self.seed,
            ..Options::default()
        }
    }

    /// The program with the objective overridden where asked.
    pub fn apply(&self, mut program: Program) -> Program {
        if let Some(o) = self.objective {
            program.objective = o.name();
        }
        program
    }

    /// The same flags for a worker's command line.
    fn to_args(&self) -> Vec<String> {
        let mut v = vec![
            "--eps".into(),
            self.eps.to_string(),
            "--rtol".into(),
            self.rtol.to_string(),
            "--atol".into(),
            self.atol.to_string(),
            "--seed".into(),
            self.seed.to_string(),
        ];
        if let Some(d) = self.directions {
            v.extend(["--directions".into(), d.to_string()]);
        }
        if let Some(o) = self.objective {
            v.extend([
                "--objective".into(),
                o.to_possible_value()
                    .map(|p| p.get_name().to_string())
                    .unwrap_or_default(),
            ]);
        }
        v
    }
}

/// The objective conventions.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum ObjectiveArg {
    /// The sum over ranks of each rank's loss (PyTorch's convention).
    SumOfRankLosses,
    /// Values know whether they are replicated; an invariant loss counts once (JAX's).
    Replicated,
}

impl ObjectiveArg {
    fn name(self) -> ObjectiveName {
        match self {
            ObjectiveArg::SumOfRankLosses => ObjectiveName::SumOfRankLosses,
            ObjectiveArg::Replicated => ObjectiveName::Replicated,
        }
    }
}

/// Where the ranks of a program run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum TransportArg {
    /// In-process ranks (threads).
    Local,
    /// Worker processes through a relay started here.
    Relay,
    /// Worker processes over direct TCP links (a relay started here introduces them).
    Direct,
}

/// Run `distgrad gradcheck`: the exit code (0 PASS, 1 FAIL, 3 INCONCLUSIVE).
pub fn run(a: GradcheckArgs) -> distgrad::Result<u8> {
    a.check.validate()?;
    if let Some(n) = a.random {
        return random(&a, n);
    }
    let path = a
        .program
        .as_deref()
        .ok_or_else(|| distgrad::Error::Input("give a program file or --random N".into()))?;
    let (program, world) = super::files::read_program(path, a.world)?;
    let program = a.check.apply(program);
    let plan = program.plan(Some(world))?;
    if let Some(t) = program.title.as_ref().filter(|_| !a.json) {
        println!("{t}");
    }
    let text = match a.transport {
        TransportArg::Local => show(&gradcheck_program(&plan, &a.check.options())?, a.json),
        t => {
            if path.as_os_str() == "-" {
                return Err(distgrad::Error::Input(
                    "worker processes read the program from a file: give its path, not -".into(),
                ));
            }
            // Every worker runs the whole check and gets the same report.
            let mut args = vec![
                "--program".to_string(),
                path.display().to_string(),
                "--gradcheck".into(),
                "--timeout-secs".into(),
                "60".into(),
            ];
            args.extend(a.check.to_args());
            if a.json {
                args.push("--report-json".into());
            }
            let done = super::launch::workers_over_relay(
                "gradcheck",
                plan.world(),
                t == TransportArg::Direct,
                &args,
            )?;
            let texts: Vec<String> = done
                .iter()
                .map(|d| String::from_utf8_lossy(&d.stdout).into_owned())
                .collect();
            if let Some(r) = texts.iter().position(|t| *t != texts[0]) {
                return Err(distgrad::Error::Input(format!(
                    "the workers' reports differ (rank 0 and rank {r}):\n{}\n{}",
                    texts[0], texts[r]
                )));
            }
            texts.into_iter().next().unwrap_or_default()
        }
    };
    print!("{text}");
    Ok(exit_code(&text))
}

/// The exit code of a printed report (the table's last line is the verdict; JSON has a
/// `verdict` field).
fn exit_code(text: &str) -> u8 {
    let json = serde_json::from_str::<serde_json::Value>(text).ok();
    let verdict = match &json {
        Some(v) => v["verdict"].as_str().unwrap_or_default(),
        None => text.trim_end().lines().last().unwrap_or_default(),
    };
    match verdict {
        "PASS" => 0,
        "INCONCLUSIVE" => 3,
        _ => 1,
    }
}

/// Run this rank's part of a program's check in a worker (every rank prints the report).
pub async fn worker_check<C: distgrad::Communicator>(
    comm: &C,
    plan: &distgrad::program::Plan,
    flags: &CheckFlags,
    json: bool,
) -> distgrad::Result<String> {
    Ok(show(
        &distgrad::gradcheck::check_program_on(comm, plan, &flags.options()).await?,
        json,
    ))
}

/// `--random N`: check N random programs, print each failure's program and report, and a summary.
fn random(a: &GradcheckArgs, n: u64) -> distgrad::Result<u8> {
    use distgrad::program::{RandomOptions, random_program};
    if a.transport != TransportArg::Local {
        return Err(distgrad::Error::Input(
            "--random runs its programs on in-process ranks (--transport local)".into(),
        ));
    }
    if a.json {
        return Err(distgrad::Error::Input(
            "--json prints one program's report; --random prints a summary of many".into(),
        ));
    }
    let o = a.check.options();
    let ro = RandomOptions {
        objective: a.check.objective.map(ObjectiveArg::name),
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
    for seed in a.check.seed..a.check.seed.saturating_add(n) {
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
        a.check.seed,
        failed.len(),
        failed,
        inconclusive.len(),
        inconclusive,
        started.elapsed().as_secs_f64()
    );
    Ok(if failed.is_empty() { 0 } else { 1 })
}
