//! The GPU the WGSL tests run on (lavapipe in CI). Without an adapter a test prints "skipped: ..."
//! and passes, unless DISTGRAD_REQUIRE_GPU=1 (set by .ci/run, which installs lavapipe), where the
//! missing adapter is a failure.

use std::sync::OnceLock;

use distgrad::backend::gpu::Gpu;

/// The shared test GPU, or `None` (after saying the test is skipped) when there is none.
pub fn gpu() -> Option<&'static Gpu> {
    static GPU: OnceLock<Result<Gpu, String>> = OnceLock::new();
    let g = GPU.get_or_init(|| futures::executor::block_on(Gpu::new()).map_err(|e| e.to_string()));
    match g {
        Ok(g) => Some(g),
        Err(e) if std::env::var("DISTGRAD_REQUIRE_GPU").as_deref() == Ok("1") => {
            panic!("DISTGRAD_REQUIRE_GPU=1 but no GPU adapter: {e}")
        }
        Err(e) => {
            println!("skipped: no GPU adapter ({e})");
            None
        }
    }
}
