//! The `distgrad` program. Natively it is the command line (`src/cli/`: parse, then one file per
//! subcommand); on wasm32 it is the web app (`trunk build` compiles it for the browser; see
//! `distgrad::web`).

#[cfg(not(target_arch = "wasm32"))]
mod cli;

#[cfg(not(target_arch = "wasm32"))]
fn main() -> std::process::ExitCode {
    cli::main()
}

#[cfg(target_arch = "wasm32")]
fn main() {
    distgrad::web::start();
}
