//! `distgrad run`: a lesson of the teaching demo on in-process ranks, printed as the page shows
//! it (every step's messages and every rank's values), or as JSON.

use super::DeviceArg;

/// Flags of `distgrad run`.
#[derive(clap::Args)]
pub struct RunArgs {
    /// The lesson file.
    lesson: std::path::PathBuf,
    /// World size, 1..=64 (default: the lesson's, else 3).
    #[arg(long)]
    world: Option<usize>,
    /// Print the trace as JSON.
    #[arg(long)]
    json: bool,
    /// Compute backend of the ranks, as in the page.
    #[arg(long, value_enum, default_value_t = DeviceArg::Cpu)]
    device: DeviceArg,
}

/// Run `distgrad run`.
pub fn run(a: RunArgs) -> distgrad::Result<()> {
    let device = a.device.open()?;
    let path = a.lesson.as_path();
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
    let world = a.world.or(lesson.world).unwrap_or(3);
    let trace = futures::executor::block_on(distgrad::lesson::run_simulated(
        &lesson,
        world,
        &device,
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
