//! The device layer: buffers accounted by category, and the kernels the model
//! runs layer by layer (llm.c style: every layer is a forward/backward pair).
//!
//! The model is generic over [`Backend`]: a [`Device`] (memory, transfers,
//! synchronization), its [`Kernels`] and its [`Decode`] steps. A backend
//! owns its memory: buffers ([`Buf`]) live on its device, kernels read and
//! write them through views ([`Src`], [`Dst`]) that may point into the
//! middle of a buffer, and the host sees them only through explicit
//! transfers. A kernel's arguments are one struct ([`ops`]). Implementations: `cpu`,
//! and `gpu::Gpu` over a runtime: `opencl`, and `cuda` behind its feature.

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod gpu;
pub mod kind;
pub mod memory;
pub mod opencl;
pub mod ops;
pub mod profile;
pub mod threads;

pub use cpu::{AttnShape, DecodeShape, WeightFormat};
pub use kind::{on, DeviceKind, OnBackend};
pub use memory::{Buf, Category, Dst, MemoryReport, PeakRow, Pending, Pinned, RawView, Src};
pub use ops::activation::{ActivationBackward, ActivationForward};
pub use ops::adamw::{AdamWStep, AdamWUpdate};
pub use ops::attention::{AttentionBackward, AttentionForward};
pub use ops::crossentropy::{CrossEntropyBackward, CrossEntropyForward};
pub use ops::encoder::{EncoderBackward, EncoderForward};
pub use ops::layernorm::{LayerNormBackward, LayerNormForward};
pub use ops::matmul::{MatmulBackward, MatmulForward, MatmulShape, WeightLayout};
pub use ops::rows::CopyRows;
pub use ops::{AttentionDecode, Kernel, MatmulDecode, On, Stored, StoredBuf, StoredDst, StoredSrc};
pub use threads::Threads;

/// Rows a column sum (a bias's gradient, layernorm's weight gradients)
/// adds into one partial at a time, on every backend: each chunk's rows in
/// order, then the chunks in order, so the sum depends on neither the
/// thread count nor the schedule, and the CPU adds as the GPU does.
pub const COLUMN_CHUNK_ROWS: usize = 64;

/// A pointwise nonlinearity.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activation {
    /// GELU, tanh approximation (GPT-2's `gelu_new`).
    GeluTanh,
    /// GELU, exact: x * Phi(x) with erf (BERT's `gelu`).
    GeluErf,
    /// tanh (BERT's pooler).
    Tanh,
}

use crate::error::Result;
use std::borrow::Cow;
use std::sync::Arc;

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for u32 {}
    impl Sealed for super::Bf16 {}
}

/// An element type buffers hold: f32 for tensors, u32 for token ids, bf16
/// for tensors stored in bfloat16 (sealed: device transfers copy raw bytes
/// into it).
pub trait Elem: sealed::Sealed + Copy + Default + Send + Sync + 'static {}
impl Elem for f32 {}
impl Elem for u32 {}
impl Elem for Bf16 {}

/// A bfloat16 value: the upper half of an f32's bits.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(transparent)]
pub struct Bf16(u16);

impl Bf16 {
    /// `x` rounded to nearest, ties to even; NaN stays NaN. Without a
    /// branch, so a loop of it vectorizes.
    #[inline(always)]
    pub fn from_f32(x: f32) -> Self {
        let bits = x.to_bits();
        let round = 0x7fff + ((bits >> 16) & 1);
        let rounded = (bits.wrapping_add(round) >> 16) as u16;
        Bf16(if x.is_nan() { 0x7fc0 } else { rounded })
    }

    /// The value, exactly, as an f32.
    #[inline(always)]
    pub fn to_f32(self) -> f32 {
        f32::from_bits((self.0 as u32) << 16)
    }

    /// The bfloat16's bits, as a library's bf16 product takes them.
    pub fn bits(self) -> u16 {
        self.0
    }
}

/// Buffers of one device: allocation, transfers, synchronization and
/// memory accounting. Its kernels are [`Kernels`], its decoding [`Decode`];
/// a [`Backend`] is all three.
pub trait Device: Send + Sync + Sized + Clone + 'static {
    /// Storage of `T` elements on the device.
    type Mem<T: Elem>: Send + Sync;

    /// The handle views carry: what the kernels find the buffer by.
    fn handle<T: Elem>(mem: &Self::Mem<T>) -> usize;
    /// The handle of storage about to be written through.
    fn handle_mut<T: Elem>(mem: &mut Self::Mem<T>) -> usize;

    /// A human-readable device name for reports.
    fn name(&self) -> String;
    /// Another handle on the same device with counters of its own (for work
    /// that must not count against a rank, such as sampling on rank 0).
    fn clone_fresh(&self) -> Self;
    /// The handle a rank trains with: a fresh one on this device, or, with
    /// `own_device: Some(rank)` (thread ranks of a device-native group such
    /// as NCCL's, one GPU per rank), one on that rank's own device
    /// (`comm::backend_for` says which).
    fn for_rank(&self, _own_device: Option<usize>) -> Result<Self> {
        Ok(self.clone_fresh())
    }
    /// The counters every buffer of this backend reports to.
    fn memory(&self) -> &Arc<memory::MemoryStats>;
    /// A zero-filled buffer of `len` elements.
    fn alloc_typed<T: Elem>(&self, len: usize, category: Category) -> Result<Buf<Self, T>>;
    /// A zero-filled buffer of `len` floats.
    fn alloc(&self, len: usize, category: Category) -> Result<Buf<Self>> {
        self.alloc_typed(len, category)
    }
    /// dst = src, host to device.
    fn upload<T: Elem>(&self, dst: Dst<'_, Self, T>, src: &[T]) -> Result<()>;
    /// dst = src, device to host (waits for the work queued before it).
    fn download<T: Elem>(&self, src: Src<'_, Self, T>, dst: &mut [T]) -> Result<()>;
    /// Starts copying `src` into `dst` on the host once the work queued so
    /// far has finished, on a copy queue beside the compute queue where the
    /// device has one, so that the work queued after it computes while it
    /// copies; the elements have landed when the returned [`Pending`] is
    /// waited (or dropped). Without a copy queue (the CPU) it copies now.
    ///
    /// # Safety
    /// Until the `Pending` is waited or dropped, `dst` stays allocated and
    /// nothing reads or writes it, and `src`'s buffer stays allocated and
    /// nothing writes it (work queued later is not ordered after the copy);
    /// where the device asks for it ([`Device::pin`]), `dst` lies in pinned
    /// memory.
    unsafe fn download_start(&self, src: Src<'_, Self>, dst: &mut [f32]) -> Result<Pending> {
        self.download(src, dst)?;
        Ok(Pending::landed())
    }
    /// Makes `host` a target [`Device::download_start`] can copy into
    /// without blocking the host (page-locked on CUDA; nothing elsewhere).
    ///
    /// # Safety
    /// `host` stays allocated until the returned [`Pinned`] is dropped.
    unsafe fn pin(&self, _host: &mut [f32]) -> Result<Pinned> {
        Ok(Pinned::unneeded())
    }
    /// A host copy of a view.
    fn to_host<T: Elem>(&self, src: Src<'_, Self, T>) -> Result<Vec<T>> {
        let mut out = vec![T::default(); src.len()];
        self.download(src, &mut out)?;
        Ok(out)
    }
    /// A view's elements on the host: borrowed where the device's memory is
    /// the host's, copied otherwise.
    fn read<'a, T: Elem>(&self, src: Src<'a, Self, T>) -> Result<Cow<'a, [T]>> {
        match self.host(src) {
            Some(h) => Ok(Cow::Borrowed(h)),
            None => self.to_host(src).map(Cow::Owned),
        }
    }
    /// The host memory behind a view when the device's memory is the
    /// host's (the CPU), so collectives and host code need no staging copy.
    fn host<'a, T: Elem>(&self, src: Src<'a, Self, T>) -> Option<&'a [T]>;
    /// Writable host memory behind a view, as [`Device::host`].
    fn host_mut<'a, T: Elem>(&self, dst: Dst<'a, Self, T>) -> Option<&'a mut [T]>;
    /// The driver's free and total bytes of the device, where it says (CUDA).
    fn device_memory(&self) -> Option<(u64, u64)> {
        None
    }
    /// How many buffers the device has allocated so far (the kernels'
    /// scratch and temporaries among them), where it allocates through a
    /// queue of its own (a GPU): a training step after the first should
    /// add none. None on the CPU.
    fn allocations(&self) -> Option<u64> {
        None
    }
    /// This backend's memory counters as a report, with the driver's view
    /// of the device beside them where there is one.
    fn memory_report(&self) -> MemoryReport {
        let mut r = self.memory().report();
        r.device_free_total = self.device_memory();
        r
    }
    /// The device address of a view's first element where the device's
    /// memory is addressed by pointers (CUDA), for a device-native
    /// collective (NCCL); None elsewhere.
    fn device_address(&self, _view: RawView, _elem_size: usize) -> Option<u64> {
        None
    }
    /// Waits for the queued work and reports the first device error since
    /// the last call (kernels are queued without a result, as on a GPU).
    fn synchronize(&self) -> Result<()>;
    /// Whether every rank runs on this one device (so the job's peak is the
    /// device's), rather than each rank on a peak of its own (CPU cores).
    fn ranks_share_device(&self) -> bool {
        false
    }
    /// How this backend's work meets the host's threads: whether rows run
    /// in parts side by side, and where a decoding loop is issued from.
    fn threads(&self) -> Threads {
        Threads::Queue
    }
}

/// The kernels the model runs layer by layer, each forward with its
/// backward; their arguments are the structs of [`ops`]. Backward kernels
/// accumulate (`+=`) into parameter gradients and into `dinp` unless the
/// struct says "overwritten".
pub trait Kernels: Device {
    /// Any [`Kernel`]: its shape checked (an error names the kernel and the
    /// operand too short), then run, timed while the profile is on.
    fn run<'a, K: Kernel<On<'a, Self>>>(&self, op: K) -> Result<()>;
    /// dst = value.
    fn fill(&self, dst: Dst<'_, Self>, value: f32);
    /// dst += src.
    fn add_inplace(&self, dst: Dst<'_, Self>, src: Src<'_, Self>);
    /// dst = src (the residual adds are fused into the projection matmuls,
    /// which accumulate onto a copy of the stream).
    fn copy(&self, dst: Dst<'_, Self>, src: Src<'_, Self>);
    /// x rounded to the nearest bfloat16 (ties to even) in place, kept as
    /// f32 (BERT's logits gradient under `--precision bf16`).
    fn round_bf16(&self, x: Dst<'_, Self>);
    /// dst = src rounded to the nearest bfloat16 (ties to even): the
    /// weights' bf16 copy under `--precision bf16`.
    fn to_bf16(&self, dst: Dst<'_, Self, Bf16>, src: Src<'_, Self>);
    /// Sum in f64 (the loss over a batch's rows).
    fn sum(&self, x: Src<'_, Self>) -> Result<f64>;
    /// Each of `xs`'s sum of squares in f64, in one call: a GPU queues
    /// every reduction and reads their partials back at once (a gradient's
    /// norm, one a tensor, without waiting once a tensor).
    fn sum_squares(&self, xs: &[Src<'_, Self>]) -> Result<Vec<f64>>;
}

/// Decoding: a few rows a step against packed weights and a KV cache.
pub trait Decode: Device {
    /// A weight matrix laid out for [`Decode::matmul_decode`].
    type Packed: Send + Sync;

    /// W (k x n, in `layout`) laid out for [`Decode::matmul_decode`],
    /// stored in `format`.
    fn pack_decode_weight(
        &self,
        w: Src<'_, Self>,
        layout: WeightLayout,
        k: usize,
        n: usize,
        format: WeightFormat,
    ) -> Result<Self::Packed>;
    fn matmul_decode(&self, op: MatmulDecode<'_, On<'_, Self>, Self::Packed>);
    fn attention_decode(&self, op: AttentionDecode<On<'_, Self>>);
}

/// Whether `be`'s buffers are host memory (the CPU), where moving state
/// to the host would move nothing.
pub fn memory_is_host<B: Device>(be: &B) -> Result<bool> {
    let probe = be.clone_fresh().alloc(1, Category::Other)?;
    Ok(be.host(probe.s()).is_some())
}

/// A device with its kernels and decoding, one of those there are
/// ([`kind`]): what the model is generic over.
pub trait Backend: Device + Kernels + Decode + kind::Listed {}

impl<B: Device + Kernels + Decode + kind::Listed> Backend for B {}
