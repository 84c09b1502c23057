//! Finding the libraries: whether `libcuda` and `libnccl` can be loaded, how many CUDA devices
//! there are and which NCCL version is loaded.
//!
//! cudarc opens both libraries at run time (the crate builds without CUDA) and panics on first use
//! when one is missing; every entry point of this folder asks [`check_libraries`] first, so a
//! machine without them gets an error that says what is missing and how to provide it.

use cudarc::driver::CudaContext;

use crate::error::{Error, Result};

/// Whether libcuda and libnccl can be loaded; an error saying what is missing and how to fix it.
pub fn check_libraries() -> Result<()> {
    // SAFETY: these only try to open the shared libraries (libloading), calling nothing in them.
    let cuda = unsafe { cudarc::driver::sys::is_culib_present() };
    let nccl = unsafe { cudarc::nccl::sys::is_culib_present() };
    let mut missing = Vec::new();
    if !cuda {
        missing.push(
            "the CUDA driver (libcuda.so) was not found: this machine has no NVIDIA driver, or it is not on the loader path"
                .to_string(),
        );
    }
    if !nccl {
        missing.push(
            "NCCL (libnccl.so) was not found: install NCCL, or point LD_LIBRARY_PATH at a folder holding libnccl.so \
             (NCCL ships libnccl.so.2: add a symlink libnccl.so -> libnccl.so.2; the pip wheel nvidia-nccl-cu12/cu13 \
             keeps it in site-packages/nvidia/nccl/lib)"
                .to_string(),
        );
    }
    if missing.is_empty() {
        Ok(())
    } else {
        Err(Error::Nccl {
            op: "load",
            rank: None,
            detail: missing.join("; "),
        })
    }
}

/// The number of CUDA devices (after [`check_libraries`]).
pub fn device_count() -> Result<usize> {
    check_libraries()?;
    let n = CudaContext::device_count().map_err(|e| Error::Nccl {
        op: "device_count",
        rank: None,
        detail: format!("{e:?}"),
    })?;
    Ok(usize::try_from(n).unwrap_or(0))
}

/// The version of the NCCL library loaded (`2.28.9`), after [`check_libraries`].
pub fn version() -> Result<String> {
    check_libraries()?;
    let v = cudarc::nccl::result::get_nccl_version().map_err(|e| Error::Nccl {
        op: "version",
        rank: None,
        detail: format!("{e:?}"),
    })?;
    // NCCL_VERSION_CODE: major * 10000 + minor * 100 + patch since NCCL 2.9.
    Ok(format!("{}.{}.{}", v / 10000, v / 100 % 100, v % 100))
}
