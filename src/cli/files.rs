//! Reading the files commands take: a program or a lesson (told apart by its `"format"`,
//! [`distgrad::lesson::Work`]), from a path or stdin (`-`), errors naming the file.

use std::path::Path;

use distgrad::lesson::Work;
use distgrad::program::Program;

/// A file's text (`-`: stdin).
pub fn read_text(path: &Path) -> distgrad::Result<String> {
    if path.as_os_str() == "-" {
        std::io::read_to_string(std::io::stdin())
            .map_err(|e| distgrad::Error::Input(format!("reading stdin: {e}")))
    } else {
        std::fs::read_to_string(path)
            .map_err(|e| distgrad::Error::Input(format!("reading {}: {e}", path.display())))
    }
}

/// A program or lesson file (`-`: stdin).
pub fn read_work(path: &Path) -> distgrad::Result<Work> {
    let text = read_text(path)?;
    Work::parse(&text).map_err(|e| match lesson_index(&text) {
        // The lessons folder's index lists the lessons; it is not one.
        Some(names) => distgrad::Error::Input(format!(
            "{} is the index of the lessons, not a lesson: run one of them, e.g. {}; they are: {}",
            path.display(),
            path.with_file_name("all_reduce_sum.json").display(),
            names.join(", ")
        )),
        None => distgrad::Error::Input(format!("{}: {e}", path.display())),
    })
}

/// The program a program or lesson file runs on `world` ranks (default: the world it is written
/// for), and that world.
pub fn read_program(path: &Path, world: Option<usize>) -> distgrad::Result<(Program, usize)> {
    let work = read_work(path)?;
    let world = world.unwrap_or(work.world());
    let program = work
        .program_for(world)
        .map_err(|e| distgrad::Error::Input(format!("{}: {e}", path.display())))?;
    Ok((program, world))
}

/// The lesson names of `www/lessons/index.json`'s text, if that is what it is.
fn lesson_index(text: &str) -> Option<Vec<String>> {
    #[derive(serde::Deserialize)]
    struct Entry {
        name: String,
    }
    #[derive(serde::Deserialize)]
    struct Index {
        lessons: Vec<Entry>,
    }
    let index: Index = serde_json::from_str(text).ok()?;
    Some(index.lessons.into_iter().map(|e| e.name).collect())
}
