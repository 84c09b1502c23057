//! `distgrad run`: a program on in-process ranks (every rank's loss and gradients), or a lesson of
//! the teaching demo, printed as the page shows it (every step's messages and every rank's
//! values); either as JSON with `--json`.

use distgrad::lesson::Work;

use super::DeviceArg;

/// Flags of `distgrad run`.
#[derive(clap::Args)]
pub struct RunArgs {
    /// The program or lesson file (its "format" says which; `-`: stdin).
    lesson: std::path::PathBuf,
    /// World size, 1..=64 (default: the program's or lesson's, else 3).
    #[arg(long)]
    world: Option<usize>,
    /// Print the trace as JSON.
    #[arg(long)]
    json: bool,
    /// Compute backend of the ranks, as in the page.
    #[arg(long, value_enum, default_value_t = DeviceArg::Cpu)]
    device: DeviceArg,
    /// Print, instead of running it, the program this file runs for the world as JSON, its "for"
    /// blocks expanded: a program's own, a program lesson's, or a
    /// collective lesson's one-collective program (the `distgrad vjp` case it shows);
    /// `distgrad run -` and `distgrad gradcheck -` take it.
    #[arg(long, conflicts_with = "json")]
    print_program: bool,
    /// Print, instead of the values, what every rank did in each collective call forward and
    /// backward: each message round by round (sender→receiver, the chunk it carried, bytes),
    /// each local fold and copy, and each rank's totals (with --json: every rank's records).
    #[arg(long, conflicts_with = "print_program")]
    events: bool,
    /// The algorithm of the collectives that have a choice (all_reduce, all_gather,
    /// reduce_scatter), whatever the size: ring, pairwise, shared, exchange or star (a
    /// collective lesson's trace then shows each call's events, as --events does).
    #[arg(long, conflicts_with = "print_program", value_parser = parse_algorithm)]
    algorithm: Option<distgrad::collective::events::Algorithm>,
}

fn parse_algorithm(s: &str) -> Result<distgrad::collective::events::Algorithm, String> {
    distgrad::collective::events::Algorithm::parse(s).map_err(|e| e.to_string())
}

/// Run `distgrad run`.
pub fn run(a: RunArgs) -> distgrad::Result<()> {
    let path = a.lesson.as_path();
    let work = super::files::read_work(path)?;
    let world = a.world.unwrap_or(work.world());
    if a.print_program {
        let what = match &work {
            Work::Program(_) => path.display().to_string(),
            Work::Lesson(l) => format!("lesson {}", l.name),
        };
        return print_program(&work.program_for(world)?, world, &what);
    }
    let device = a.device.open()?;
    let mut opts = distgrad::CommOptions {
        device: device.clone(),
        ..distgrad::CommOptions::recorded()
    };
    // The algorithm asked for, else a lesson's own.
    let lesson_algorithm = match &work {
        Work::Lesson(l) => l.algorithm,
        Work::Program(_) => None,
    };
    if let Some(algorithm) = a.algorithm.or(lesson_algorithm) {
        opts = opts.with_algorithm(algorithm)?;
    }
    if a.events {
        let plan = work.program_for(world)?.plan(Some(world))?;
        let events =
            futures::executor::block_on(distgrad::lesson::algorithm::run_simulated(&plan, opts))?;
        if a.json {
            let text = serde_json::to_string(&events)
                .map_err(|e| distgrad::Error::Input(e.to_string()))?;
            println!("{text}");
        } else {
            print!("{}", distgrad::lesson::algorithm::render(&events));
        }
        return Ok(());
    }
    let lesson = match work {
        Work::Program(program) => return run_program(&program, world, a.json, opts),
        Work::Lesson(lesson) => lesson,
    };
    let trace = futures::executor::block_on(distgrad::lesson::run_simulated_with(
        &lesson,
        world,
        opts,
        &[],
    ))?;
    if a.json {
        println!(
            "{}",
            serde_json::to_string(&trace).map_err(|e| distgrad::Error::Input(e.to_string()))?
        );
    } else {
        print!("{}", distgrad::lesson::render(&trace));
    }
    Ok(())
}

/// `--print-program`: the program as it runs for `world` ranks, its "for" blocks expanded, as
/// JSON; then checked, so a program the check refuses is printed (to find the step a message
/// counts) and its error returned. `what` names the file for messages.
fn print_program(
    program: &distgrad::program::Program,
    world: usize,
    what: &str,
) -> distgrad::Result<()> {
    let with = |e: distgrad::Error| distgrad::Error::Input(format!("{what}: {e}"));
    let expanded = program.expanded(world).map_err(with)?;
    println!(
        "{}",
        serde_json::to_string_pretty(&expanded)
            .map_err(|e| distgrad::Error::Input(e.to_string()))?
    );
    program.plan(Some(world)).map_err(with)?;
    Ok(())
}

/// `distgrad run prog.json`: every rank's loss and gradient per input.
fn run_program(
    program: &distgrad::program::Program,
    world: usize,
    json: bool,
    opts: distgrad::CommOptions,
) -> distgrad::Result<()> {
    let plan = program.plan(Some(world))?;
    let opts = distgrad::CommOptions {
        record_calls: false,
        timeout: distgrad::CommOptions::default().timeout,
        ..opts
    };
    let runs = distgrad::program::run_local(&plan, opts)?;
    print_runs(program, &plan, &runs, json)
}

/// Every rank's loss and gradients: a table, or JSON (one object per rank).
pub fn print_runs(
    program: &distgrad::program::Program,
    plan: &distgrad::program::Plan,
    runs: &[distgrad::program::RankRun],
    json: bool,
) -> distgrad::Result<()> {
    if json {
        let v: Vec<serde_json::Value> = runs
            .iter()
            .enumerate()
            .map(|(r, run)| {
                serde_json::json!({"rank": r, "loss": run.loss, "weight": run.weight, "grads": run.grads})
            })
            .collect();
        println!("{}", serde_json::Value::Array(v));
        return Ok(());
    }
    if let Some(t) = &program.title {
        println!("{t}");
    }
    let objective: f64 = runs.iter().map(|r| r.contribution()).sum();
    println!(
        "world={}  objective {:?}  F = {objective}",
        plan.world(),
        program.objective
    );
    let names = plan.input_names();
    let mut header = vec!["rank".to_string(), "loss".to_string()];
    header.extend(
        names
            .iter()
            .zip(&program.inputs)
            .filter(|(_, i)| i.grad)
            .map(|(n, _)| format!("d F / d {n}")),
    );
    let rows: Vec<Vec<String>> = runs
        .iter()
        .enumerate()
        .map(|(r, run)| {
            let mut row = vec![
                r.to_string(),
                run.loss.map_or("-".into(), |l| l.to_string()),
            ];
            for (i, (g, inp)) in run.grads.iter().zip(&program.inputs).enumerate() {
                if !inp.grad {
                    continue;
                }
                // "-": the rank does not hold the input (or backward did not run).
                row.push(g.as_ref().map_or_else(
                    || "-".to_string(),
                    |g| {
                        distgrad::vjp::fmt_t(&distgrad::vjp::TensorJson {
                            shape: plan.shape(r, names[i]).unwrap_or_default().to_vec(),
                            data: g.iter().map(|&x| (!x.is_nan()).then_some(x)).collect(),
                        })
                    },
                ));
            }
            row
        })
        .collect();
    let header: Vec<&str> = header.iter().map(String::as_str).collect();
    print!("{}", distgrad::vjp::text_table(&header, &rows));
    Ok(())
}
