//! `distgrad vjp`: one collective forward and backward on in-process ranks, as a per-rank table
//! or JSON; a built-in example per collective, or a case file.

use std::io::Read as _;

use distgrad::ReduceOp;
use distgrad::vjp;

use super::{DeviceArg, named};

/// Flags of `distgrad vjp`.
#[derive(clap::Args)]
pub struct VjpArgs {
    /// A collective name (built-in example) or a case file path (`-` = stdin).
    what: String,
    /// World size for the built-in example, 1..=64 [default: 4].
    #[arg(long)]
    world: Option<usize>,
    /// Reduce op for the built-in example of reduce, all_reduce or reduce_scatter [default: sum].
    #[arg(long, value_parser = named(&ReduceOp::ALL, ReduceOp::name))]
    op: Option<ReduceOp>,
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
    /// Print the case as a one-collective program (`distgrad run` / `gradcheck` take it) and
    /// exit.
    #[arg(long, conflicts_with = "print_case")]
    print_program: bool,
    /// Compute backend.
    #[arg(long, value_enum, default_value_t = DeviceArg::Cpu)]
    device: DeviceArg,
}

/// Run `distgrad vjp`.
pub fn run(a: VjpArgs) -> distgrad::Result<()> {
    let what = a.what.as_str();
    let input = |e: String| distgrad::Error::Input(e);
    let case = if let Ok(which) = vjp::parse_collective(what) {
        // Say so when a flag does not apply (scripts looping over collectives may pass both).
        let name = which.name();
        if a.op.is_some() && !which.takes_op() {
            eprintln!(
                "distgrad: note: {name} takes no reduce op; --op ignored (it applies to \
                 reduce, all_reduce and reduce_scatter)"
            );
        }
        if a.root.is_some() && !which.takes_root() {
            eprintln!(
                "distgrad: note: {name} has no root; --root ignored (it applies to \
                 broadcast, reduce, gather and scatter)"
            );
        }
        let op = a.op.unwrap_or(ReduceOp::Sum);
        vjp::example_case(
            which,
            a.world.unwrap_or(4),
            op,
            a.root.unwrap_or(0),
            a.group,
        )?
    } else if (what == "-" || std::path::Path::new(what).exists())
        && (a.world.is_some() || a.op.is_some() || a.root.is_some() || a.group.is_some())
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
        let e = vjp::parse_collective(what)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        return Err(input(format!("{what:?} is not a file; {e}")));
    };
    if a.print_case {
        println!(
            "{}",
            serde_json::to_string_pretty(&case)
                .map_err(|e| distgrad::Error::Input(e.to_string()))?
        );
        return Ok(());
    }
    if a.print_program {
        let program = case.program()?;
        println!(
            "{}",
            serde_json::to_string_pretty(&program)
                .map_err(|e| distgrad::Error::Input(e.to_string()))?
        );
        return Ok(());
    }
    let out = vjp::run_case_on(&case, &a.device.open()?)?;
    print_answer(&case, &out, a.json)
}

/// A case's answer as JSON (`--json`) or as the per-rank table.
pub fn print_answer(case: &vjp::Case, out: &vjp::CaseOutput, json: bool) -> distgrad::Result<()> {
    if json {
        let text = serde_json::to_string(out).map_err(|e| distgrad::Error::Input(e.to_string()))?;
        println!("{text}");
    } else {
        print!("{}", vjp::render_table(case, out));
    }
    Ok(())
}
