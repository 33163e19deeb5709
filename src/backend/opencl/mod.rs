//! OpenCL device layer: buffers, views into them, and every non-attention
//! kernel the model runs, compiled at run time from `src/backend/kernels/`
//! (the same sources compile as CUDA). GEMMs go to CLBlast. libOpenCL and
//! CLBlast are opened at run time: without them `Device::open` errors and
//! the CPU backend still works.

mod attention;
mod backend;
mod clblast;
mod kernels;
mod runtime;
#[cfg(test)]
mod tests;

pub use backend::{OpenCl, PackedCl};
pub use kernels::program_source;
pub use runtime::Mem;
pub(crate) use runtime::{Device, View};
#[cfg(test)]
use runtime::{Element, BLOCK};

/// What went wrong, in words: the missing library or device, the failed
/// call, or the kernel build log.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct ClError(pub String);
