//! The `cuda` device (feature `cuda`), first part: the NVIDIA driver, NVRTC
//! and cuBLAS are found at run time and the GPUs listed and opened. The
//! kernels and GEMMs are not wired to a `Backend` yet (issue 12), so
//! `--device cuda` stops with an error after finding the GPU. cudarc panics
//! on a library it cannot open, so every entry checks the libraries first and
//! errors naming what to install. Libraries are found on the loader's path:
//! for pip-installed CUDA (`nvidia-*-cu12` wheels) put their `nvidia/*/lib`
//! folders on `LD_LIBRARY_PATH`.

use crate::error::{Error, Result};
use cudarc::driver::{CudaContext, DriverError};

fn driver_error(e: DriverError) -> Error {
    Error::Device(format!("CUDA driver: {e}"))
}

/// Errors unless the driver library opens.
fn check_driver() -> Result<()> {
    // SAFETY: only tries to dlopen the library; calls nothing in it.
    if unsafe { cudarc::driver::sys::is_culib_present() } {
        Ok(())
    } else {
        Err(Error::Device(
            "no CUDA driver (libcuda.so.1) found: install the NVIDIA driver".into(),
        ))
    }
}

/// Errors unless the driver, NVRTC and cuBLAS libraries all open.
fn check_libraries() -> Result<()> {
    check_driver()?;
    // SAFETY: as in `check_driver`.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err(Error::Device(
            "libnvrtc.so.12 not found: install the CUDA toolkit, or \
             `pip install nvidia-cuda-nvrtc-cu12` and put its nvidia/cuda_nvrtc/lib on LD_LIBRARY_PATH"
                .into(),
        ));
    }
    // SAFETY: as in `check_driver`.
    if !unsafe { cudarc::cublas::sys::is_culib_present() } {
        return Err(Error::Device(
            "libcublas.so.12 not found: install the CUDA toolkit, or \
             `pip install nvidia-cublas-cu12` and put its nvidia/cublas/lib on LD_LIBRARY_PATH"
                .into(),
        ));
    }
    Ok(())
}

/// Opens GPU `index` and says its name, compute capability and the driver's
/// free/total memory.
fn describe(index: usize) -> Result<String> {
    let ctx = CudaContext::new(index).map_err(driver_error)?;
    let name = ctx.name().map_err(driver_error)?;
    let (major, minor) = ctx.compute_capability().map_err(driver_error)?;
    let (free, total) = ctx.mem_get_info().map_err(driver_error)?;
    Ok(format!(
        "{name} (sm_{major}{minor}, {} of {} MiB free)",
        free >> 20,
        total >> 20
    ))
}

/// One line per GPU, in the order `--cuda-device` counts them.
pub fn devices() -> Result<Vec<String>> {
    check_driver()?;
    let count = CudaContext::device_count().map_err(driver_error)?;
    (0..count.max(0) as usize).map(describe).collect()
}

/// Opens GPU `index` once every library the backend needs is found, and
/// describes it.
pub fn probe(index: usize) -> Result<String> {
    check_libraries()?;
    let count = CudaContext::device_count().map_err(driver_error)?.max(0) as usize;
    if index >= count {
        return Err(Error::Device(format!(
            "no CUDA device {index}: the driver reports {count}"
        )));
    }
    describe(index)
}
