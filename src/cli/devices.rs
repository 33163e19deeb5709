//! `distgpt devices`: the CPU, every OpenCL and CUDA device there is, and
//! the CPU's peaks that MFU is stated against and its matmul libraries.

use anyhow::Result;
use clap::Args;
use distgpt::backend::cpu::blas::MatmulLib;
use distgpt::backend::cpu::Cpu;
use distgpt::backend::Device;

#[derive(Args)]
pub struct DevicesArgs {
    /// Measure the peaks again (the CPU's hardware peak, and every matmul
    /// library's speed, best of three; do it on a quiet machine) and keep
    /// them, with the fastest library, for MFU and the CPU's matmuls.
    #[arg(long)]
    measure: bool,
}

/// Where `--precision bf16`'s products run, and why.
fn bf16_route(p: &distgpt::metrics::peak::Peak) -> String {
    use distgpt::backend::cpu::blas;
    if let Some(lib) = p.matmul.and_then(|m| m.bf16) {
        return format!("in bf16 arithmetic on {}", lib.bf16_name());
    }
    let why = if !blas::native_bf16() {
        "this CPU has no AVX512-BF16".to_string()
    } else if !MatmulLib::ALL.into_iter().any(|l| l.has_bf16()) {
        "no library with a bf16 product is here (MKL: PyPI's mkl, scripts/fetch-mkl)".into()
    } else if p.timings.iter().all(|t| t.bf16_flops.is_none()) {
        "none timed: a check against the gemm crate failed (said when measured), or an \
         older measurement (`distgpt devices --measure`)"
            .into()
    } else {
        "no bf16 product beat the fp32 library by 5%".into()
    };
    format!("in fp32 on the rounded operands ({why})")
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
    {
        list_gpus::<distgpt::backend::cuda::CudaRuntime>();
        let libs = distgpt::backend::cuda::loaded_libraries();
        let libs: Vec<String> = libs.iter().map(|p| p.display().to_string()).collect();
        distgpt::outln!(
            "cuda libraries loaded: {}",
            if libs.is_empty() {
                "none".to_string()
            } else {
                libs.join(", ")
            }
        );
    }
    #[cfg(not(feature = "cuda"))]
    distgpt::outln!("cuda: not built in (rebuild with `--features cuda`)");
    let peak = if a.measure {
        Some(distgpt::metrics::peak::of(&cpu, true))
    } else {
        distgpt::metrics::peak::cached(&cpu)
    };
    match peak {
        Some(p) => {
            // MFU is stated against the hardware's peak where it is known;
            // the best matmul is a probe of this machine's products
            match &p.hardware {
                Some(hw) => distgpt::outln!(
                    "cpu hardware peak (what MFU is stated against): {:.0} GFLOP/s = {}",
                    hw.flops / 1e9,
                    hw.describe()
                ),
                None => distgpt::outln!(
                    "cpu hardware peak: not known for this CPU; MFU is stated against the best matmul"
                ),
            }
            if let Some(hw) = p.hardware_peak(true).filter(|h| Some(h) != p.hardware.as_ref()) {
                distgpt::outln!(
                    "cpu bf16 hardware peak (--precision bf16's): {:.0} GFLOP/s = {}",
                    hw.flops / 1e9,
                    hw.describe()
                );
            }
            distgpt::outln!(
                "cpu {}: {:.1} GFLOP/s ({})",
                p.matmul_name(),
                p.flops / 1e9,
                p.source
            );
            for t in &p.timings {
                let path = t.lib.path().map(|f| format!(" ({f})")).unwrap_or_default();
                let bf16 = t
                    .bf16_flops
                    .map(|f| {
                        // the built-in's bf16 product is not the gemm crate
                        let on = match t.lib {
                            MatmulLib::Gemm => format!(" ({})", t.lib.bf16_name()),
                            _ => String::new(),
                        };
                        format!(", bf16 layers{on} {:6.1} GFLOP/s", f / 1e9)
                    })
                    .unwrap_or_default();
                let small = t.lib.small_kernel().map(|k| format!(" ({k})")).unwrap_or_default();
                distgpt::outln!(
                    "  {:<10} layers {:6.1} GFLOP/s, attention blocks{small} {:6.1} GFLOP/s{bf16}{path}",
                    t.lib.name(),
                    t.large_flops / 1e9,
                    t.small_flops / 1e9
                );
            }
            distgpt::outln!("cpu bf16 products (--precision bf16): {}", bf16_route(&p));
        }
        None => distgpt::outln!(
            "cpu peaks: not measured yet (the first run measures them; `distgpt devices --measure` now)"
        ),
    }
    Ok(())
}
