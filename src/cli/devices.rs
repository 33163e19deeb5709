//! `distgpt devices`: the CPU, every OpenCL and CUDA device there is, and
//! the CPU's peak FLOP/s that MFU is stated against.

use anyhow::Result;
use clap::Args;
use distgpt::backend::cpu::Cpu;
use distgpt::backend::Device;

#[derive(Args)]
pub struct DevicesArgs {
    /// Measure the peak FLOP/s again (best of three matmul probes; do it on
    /// a quiet machine) and keep it for MFU.
    #[arg(long)]
    measure: bool,
}

/// One line per device of runtime `R`, or one saying why there are none.
fn list_gpus<R: distgpt::backend::gpu::Runtime>() {
    match R::list() {
        Ok(names) => {
            for (i, n) in names.iter().enumerate() {
                distgpt::outln!("{} {i}: {n}", R::KIND);
            }
        }
        Err(e) => distgpt::outln!("{}: {e}", R::KIND),
    }
}

pub fn run(a: DevicesArgs) -> Result<()> {
    let cpu = Cpu::new();
    distgpt::outln!("cpu: {}", cpu.name());
    list_gpus::<distgpt::backend::opencl::ClRuntime>();
    #[cfg(feature = "cuda")]
    list_gpus::<distgpt::backend::cuda::CudaRuntime>();
    #[cfg(not(feature = "cuda"))]
    distgpt::outln!("cuda: not built in (rebuild with `--features cuda`)");
    let peak = if a.measure {
        Some(distgpt::metrics::peak::of(&cpu, true))
    } else {
        distgpt::metrics::peak::cached(&cpu)
    };
    match peak {
        Some(p) => distgpt::outln!(
            "cpu peak for MFU: {:.1} GFLOP/s ({})",
            p.flops / 1e9,
            p.source
        ),
        None => distgpt::outln!(
            "cpu peak for MFU: not measured yet (the first run measures it; `distgpt devices --measure` now)"
        ),
    }
    Ok(())
}
