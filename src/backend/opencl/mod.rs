//! The OpenCL runtime of the GPU host layer (`backend::gpu`): context, one
//! in-order queue, the kernel program built from `src/backend/kernels/` as
//! OpenCL C, GEMMs on CLBlast. libOpenCL and CLBlast are opened at run
//! time: without them `open` errors and the CPU backend still works.

mod clblast;
mod runtime;

pub use runtime::ClRuntime;

/// The OpenCL backend.
pub type OpenCl = super::gpu::Gpu<ClRuntime>;
