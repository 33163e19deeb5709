//! The backends there are, written once: the kind `--device` names, the
//! one dispatch from a kind to its backend ([`on`]), and a table holding a
//! value for each backend ([`Each`]) that code generic over the backend
//! indexes by type (a family's engine builder, `model::family`).

use super::cpu::Cpu;
#[cfg(feature = "cuda")]
use super::cuda::Cuda;
use super::opencl::OpenCl;
use super::Backend;
use crate::error::Result;

/// A kind of backend, as `--device` names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum DeviceKind {
    Cpu,
    Opencl,
    Cuda,
}

/// Work generic over the backend, run on one chosen at run time ([`on`]).
pub trait OnBackend {
    type Out;
    fn run<B: Backend>(self, backend: B) -> Self::Out;
}

/// `op` run on device `index` of `kind` (the CPU has one); a cuda device
/// in a build without CUDA is an error that says how to rebuild.
pub fn on<O: OnBackend>(kind: DeviceKind, index: usize, op: O) -> Result<O::Out> {
    Ok(match kind {
        DeviceKind::Cpu => op.run(Cpu::new()),
        DeviceKind::Opencl => op.run(OpenCl::open(index)?),
        #[cfg(feature = "cuda")]
        DeviceKind::Cuda => op.run(Cuda::open(index)?),
        #[cfg(not(feature = "cuda"))]
        DeviceKind::Cuda => return Err(crate::error::Error::Device(format!(
            "--device cuda (device {index}) needs CUDA support: rebuild with `cargo build --release --features cuda`"
        ))),
    })
}

/// A type for each backend: `On<B>` for backend `B` (what [`Each`] holds).
pub trait PerBackend {
    type On<B: Backend>;
}

/// What makes a [`PerBackend`]'s value on any backend.
pub trait Make<P: PerBackend> {
    fn make<B: Backend>(&self) -> P::On<B>;
}

/// A `P::On<B>` for each backend `B` there is, found by type ([`Listed::of`]).
pub struct Each<P: PerBackend> {
    cpu: P::On<Cpu>,
    opencl: P::On<OpenCl>,
    #[cfg(feature = "cuda")]
    cuda: P::On<Cuda>,
}

impl<P: PerBackend> Each<P> {
    /// `m`'s value on each backend.
    pub fn new(m: impl Make<P>) -> Self {
        Each {
            cpu: m.make(),
            opencl: m.make(),
            #[cfg(feature = "cuda")]
            cuda: m.make(),
        }
    }
}

/// A backend's place in [`Each`] (every [`Backend`] has one).
pub trait Listed: Sized {
    /// The value of this backend.
    fn of<P: PerBackend>(each: &Each<P>) -> &P::On<Self>
    where
        Self: Backend;
}

impl Listed for Cpu {
    fn of<P: PerBackend>(each: &Each<P>) -> &P::On<Self> {
        &each.cpu
    }
}

impl Listed for OpenCl {
    fn of<P: PerBackend>(each: &Each<P>) -> &P::On<Self> {
        &each.opencl
    }
}

#[cfg(feature = "cuda")]
impl Listed for Cuda {
    fn of<P: PerBackend>(each: &Each<P>) -> &P::On<Self> {
        &each.cuda
    }
}
