//! The device layer: buffers accounted by category, and the kernels the model
//! runs layer by layer (llm.c style: every layer is a forward/backward pair).
//!
//! The model is generic over [`Backend`]. A backend owns its memory: buffers
//! ([`Buf`]) live on its device, kernels read and write them through views
//! ([`Src`], [`Dst`]) that may point into the middle of a buffer, and the
//! host sees them only through explicit transfers. Implementations: `cpu`,
//! and `gpu::Gpu` over a runtime: `opencl`, and `cuda` behind its feature.

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod gpu;
pub mod memory;
pub mod opencl;

pub use cpu::{AdamWStep, AttnShape, DecodeShape, WeightFormat, WeightLayout};
pub use memory::{Buf, Category, Dst, MemoryReport, RawView, Src};

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
}

/// An element type buffers hold: f32 for tensors, u32 for token ids
/// (sealed: device transfers copy raw bytes into it).
pub trait Elem: sealed::Sealed + Copy + Default + Send + Sync + 'static {}
impl Elem for f32 {}
impl Elem for u32 {}

/// Buffers and kernels of one device. Shapes are in each method's comment;
/// `rows` is B*T. Backward kernels accumulate (`+=`) into parameter
/// gradients and into `dinp` unless the comment says "overwritten".
#[allow(clippy::too_many_arguments)]
pub trait Backend: Send + Sync + Sized + Clone + 'static {
    /// Storage of `T` elements on the device.
    type Mem<T: Elem>: Send + Sync;
    /// A weight matrix laid out for [`Backend::matmul_decode`].
    type Packed: Send + Sync;

    /// The handle views carry: what the kernels find the buffer by.
    fn handle<T: Elem>(mem: &Self::Mem<T>) -> usize;
    /// The handle of storage about to be written through.
    fn handle_mut<T: Elem>(mem: &mut Self::Mem<T>) -> usize;

    /// A human-readable device name for reports.
    fn name(&self) -> String;
    /// Another handle on the same device with counters of its own (for work
    /// that must not count against a rank, such as sampling on rank 0).
    fn clone_fresh(&self) -> Self;
    /// The handle rank `world.rank()` trains with: a fresh one on this
    /// device, or, for thread ranks of a device-native group (NCCL, one
    /// GPU per rank), one on that rank's own device.
    fn for_rank(&self, _world: &dyn crate::comm::Comm) -> Result<Self> {
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
    /// Writable host memory behind a view, as [`Backend::host`].
    fn host_mut<'a, T: Elem>(&self, dst: Dst<'a, Self, T>) -> Option<&'a mut [T]>;
    /// Runs `f`, a loop issuing many small operations (a decoding loop),
    /// where this backend's operations are cheapest to issue: on the CPU,
    /// on a worker of the thread pool, so each parallel operation starts
    /// on the calling worker instead of being handed across threads.
    fn in_pool<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        f()
    }
    /// How many parts of consecutive rows a decoding step of `rows` rows
    /// runs as, each part through the whole model on its own
    /// ([`Backend::for_each_part`]), for a model of `matmul_params`
    /// parameters in its matmuls (`GptConfig::matmul_params`): one (every
    /// operation over all rows) unless this backend finds otherwise faster.
    fn decode_parts(&self, _rows: usize, _matmul_params: usize) -> usize {
        1
    }
    /// `f` of every part, side by side where this backend can run them so.
    fn for_each_part<T: Send, R: Send>(
        &self,
        parts: &mut [T],
        f: impl Fn(&mut T) -> R + Sync,
    ) -> Vec<R> {
        parts.iter_mut().map(f).collect()
    }
    /// The driver's free and total bytes of the device, where it says (CUDA).
    fn device_memory(&self) -> Option<(u64, u64)> {
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

    /// out (rows, C) = wte[tokens] + wpe[row % t].
    fn encoder_forward(
        &self,
        out: Dst<'_, Self>,
        tokens: Src<'_, Self, u32>,
        wte: Src<'_, Self>,
        wpe: Src<'_, Self>,
        t: usize,
        c: usize,
    );
    /// dwte[tokens] += dout; dwpe[row % t] += dout. `host_tokens` is the
    /// host's copy of `tokens`, from which a device plans a deterministic
    /// scatter.
    fn encoder_backward(
        &self,
        dwte: Dst<'_, Self>,
        dwpe: Dst<'_, Self>,
        dout: Src<'_, Self>,
        tokens: Src<'_, Self, u32>,
        host_tokens: &[u32],
        t: usize,
        c: usize,
    );
    /// out, inp (rows, C); mean, rstd (rows); eps inside the square root.
    #[allow(clippy::too_many_arguments)]
    fn layernorm_forward(
        &self,
        out: Dst<'_, Self>,
        mean: Dst<'_, Self>,
        rstd: Dst<'_, Self>,
        inp: Src<'_, Self>,
        w: Src<'_, Self>,
        b: Src<'_, Self>,
        c: usize,
        eps: f32,
    );
    /// dinp (rows, C) +=; dw, db (C) +=.
    fn layernorm_backward(
        &self,
        dinp: Dst<'_, Self>,
        dw: Dst<'_, Self>,
        db: Dst<'_, Self>,
        dout: Src<'_, Self>,
        inp: Src<'_, Self>,
        w: Src<'_, Self>,
        mean: Src<'_, Self>,
        rstd: Src<'_, Self>,
        c: usize,
    );
    /// The input half of [`Backend::layernorm_backward`]: dinp (rows, C) +=.
    /// By default the whole backward into a scratch dw and db (they cost a
    /// pass over the rows; a backend may skip them).
    fn layernorm_backward_input(
        &self,
        dinp: Dst<'_, Self>,
        dout: Src<'_, Self>,
        inp: Src<'_, Self>,
        w: Src<'_, Self>,
        mean: Src<'_, Self>,
        rstd: Src<'_, Self>,
        c: usize,
    ) -> Result<()> {
        let mut scratch = self.alloc(2 * c, Category::Other)?;
        let (dw, db) = scratch.d().split_at(c);
        self.layernorm_backward(dinp, dw, db, dout, inp, w, mean, rstd, c);
        Ok(())
    }
    /// The weight half of [`Backend::layernorm_backward`]: dw, db (C) +=.
    /// By default the whole backward into a scratch dinp.
    fn layernorm_backward_weight(
        &self,
        dw: Dst<'_, Self>,
        db: Dst<'_, Self>,
        dout: Src<'_, Self>,
        inp: Src<'_, Self>,
        w: Src<'_, Self>,
        mean: Src<'_, Self>,
        rstd: Src<'_, Self>,
        c: usize,
    ) -> Result<()> {
        let mut scratch = self.alloc(inp.len(), Category::Other)?;
        self.layernorm_backward(scratch.d(), dw, db, dout, inp, w, mean, rstd, c);
        Ok(())
    }
    /// out (rows, n) = [out +] inp (rows, k) @ W + bias.
    fn matmul_forward(
        &self,
        out: Dst<'_, Self>,
        inp: Src<'_, Self>,
        w: Src<'_, Self>,
        bias: Option<Src<'_, Self>>,
        layout: WeightLayout,
        rows: usize,
        k: usize,
        n: usize,
        accumulate: bool,
    );
    /// dinp (rows, k) overwritten; dw (k x n) +=; dbias (n) +=.
    fn matmul_backward(
        &self,
        dinp: Dst<'_, Self>,
        dw: Dst<'_, Self>,
        dbias: Option<Dst<'_, Self>>,
        dout: Src<'_, Self>,
        inp: Src<'_, Self>,
        w: Src<'_, Self>,
        layout: WeightLayout,
        rows: usize,
        k: usize,
        n: usize,
    );
    /// The input half of [`Backend::matmul_backward`]: dinp (rows, k)
    /// overwritten. By default the whole backward into a scratch dw (which
    /// reads the forward's `inp`; a backend should skip that product).
    fn matmul_backward_input(
        &self,
        dinp: Dst<'_, Self>,
        dout: Src<'_, Self>,
        inp: Src<'_, Self>,
        w: Src<'_, Self>,
        layout: WeightLayout,
        (rows, k, n): (usize, usize, usize),
    ) -> Result<()> {
        let mut dw = self.alloc(k * n, Category::Other)?;
        self.matmul_backward(dinp, dw.d(), None, dout, inp, w, layout, rows, k, n);
        Ok(())
    }
    /// The weight half of [`Backend::matmul_backward`]: dw (k x n) +=,
    /// dbias (n) +=. By default the whole backward into a scratch dinp (a
    /// backend should skip its product).
    fn matmul_backward_weight(
        &self,
        dw: Dst<'_, Self>,
        dbias: Option<Dst<'_, Self>>,
        dout: Src<'_, Self>,
        inp: Src<'_, Self>,
        w: Src<'_, Self>,
        layout: WeightLayout,
        (rows, k, n): (usize, usize, usize),
    ) -> Result<()> {
        let mut dinp = self.alloc(rows * k, Category::Other)?;
        self.matmul_backward(dinp.d(), dw, dbias, dout, inp, w, layout, rows, k, n);
        Ok(())
    }
    /// [`Backend::matmul_forward`] whose `inp` and `w` hold bfloat16 values
    /// (rounded by [`Backend::round_bf16`]): the same product, which a
    /// device with bf16 matrix units (CUDA's tensor cores) runs there.
    fn matmul_forward_bf16(
        &self,
        out: Dst<'_, Self>,
        inp: Src<'_, Self>,
        w: Src<'_, Self>,
        bias: Option<Src<'_, Self>>,
        layout: WeightLayout,
        rows: usize,
        k: usize,
        n: usize,
        accumulate: bool,
    ) {
        self.matmul_forward(out, inp, w, bias, layout, rows, k, n, accumulate)
    }
    /// [`Backend::matmul_backward`] whose `dout`, `inp` and `w` hold
    /// bfloat16 values, as [`Backend::matmul_forward_bf16`].
    fn matmul_backward_bf16(
        &self,
        dinp: Dst<'_, Self>,
        dw: Dst<'_, Self>,
        dbias: Option<Dst<'_, Self>>,
        dout: Src<'_, Self>,
        inp: Src<'_, Self>,
        w: Src<'_, Self>,
        layout: WeightLayout,
        rows: usize,
        k: usize,
        n: usize,
    ) {
        self.matmul_backward(dinp, dw, dbias, dout, inp, w, layout, rows, k, n)
    }
    /// W (k x n, in `layout`) laid out for [`Backend::matmul_decode`],
    /// stored in `format`.
    fn pack_decode_weight(
        &self,
        w: Src<'_, Self>,
        layout: WeightLayout,
        k: usize,
        n: usize,
        format: WeightFormat,
    ) -> Result<Self::Packed>;
    /// out (rows, n) = [out +] inp (rows, k) @ W + bias for few rows (one per
    /// sequence being decoded), W from [`Backend::pack_decode_weight`].
    fn matmul_decode(
        &self,
        out: Dst<'_, Self>,
        inp: Src<'_, Self>,
        packed: &Self::Packed,
        bias: Option<Src<'_, Self>>,
        rows: usize,
        k: usize,
        n: usize,
        accumulate: bool,
    );
    /// qkv (B, T, 3C) -> out (B, T, C), lse (B, NH, T).
    fn attention_forward(
        &self,
        out: Dst<'_, Self>,
        lse: Dst<'_, Self>,
        qkv: Src<'_, Self>,
        shape: AttnShape,
    );
    /// dqkv (B, T, 3C) overwritten.
    fn attention_backward(
        &self,
        dqkv: Dst<'_, Self>,
        dout: Src<'_, Self>,
        qkv: Src<'_, Self>,
        out: Src<'_, Self>,
        lse: Src<'_, Self>,
        shape: AttnShape,
    );
    /// Bidirectional attention with padding: every query of sequence b
    /// attends to its first `lens[b]` keys (1..=T). qkv (B, T, 3C) -> out
    /// (B, T, C), lse (B, NH, T).
    fn attention_padded_forward(
        &self,
        out: Dst<'_, Self>,
        lse: Dst<'_, Self>,
        qkv: Src<'_, Self>,
        lens: Src<'_, Self, u32>,
        shape: AttnShape,
    );
    /// dqkv (B, T, 3C) overwritten, for [`Backend::attention_padded_forward`].
    #[allow(clippy::too_many_arguments)]
    fn attention_padded_backward(
        &self,
        dqkv: Dst<'_, Self>,
        dout: Src<'_, Self>,
        qkv: Src<'_, Self>,
        out: Src<'_, Self>,
        lse: Src<'_, Self>,
        lens: Src<'_, Self, u32>,
        shape: AttnShape,
    );
    /// Decoding: qkv (b, 3c) queries against kcache, vcache (b, max_t, c) -> out (b, c).
    fn attention_decode(
        &self,
        out: Dst<'_, Self>,
        qkv: Src<'_, Self>,
        kcache: Src<'_, Self>,
        vcache: Src<'_, Self>,
        shape: DecodeShape,
    );
    /// out = act(inp), any shape.
    fn activation_forward(&self, out: Dst<'_, Self>, inp: Src<'_, Self>, act: Activation);
    /// d *= act'(inp), in place.
    fn activation_backward_inplace(&self, d: Dst<'_, Self>, inp: Src<'_, Self>, act: Activation);
    /// dst = value.
    fn fill(&self, dst: Dst<'_, Self>, value: f32);
    /// dst += src.
    fn add_inplace(&self, dst: Dst<'_, Self>, src: Src<'_, Self>);
    /// dst = src (the residual adds are fused into the projection matmuls,
    /// which accumulate onto a copy of the stream).
    fn copy(&self, dst: Dst<'_, Self>, src: Src<'_, Self>);
    /// x rounded to the nearest bfloat16 (ties to even) in place, kept as
    /// f32: the operands of a bf16 matmul (`--precision bf16`).
    fn round_bf16(&self, x: Dst<'_, Self>);
    /// losses (rows) from logits (rows, vp) whose first v columns are real;
    /// a row whose target is `data::IGNORE` has loss 0 (and gradient 0).
    fn crossentropy_forward(
        &self,
        losses: Dst<'_, Self>,
        logits: Src<'_, Self>,
        targets: Src<'_, Self, u32>,
        v: usize,
        vp: usize,
    );
    /// logits (rows, vp) -> dloss * d(sum of losses)/d logits, in place.
    fn crossentropy_backward_inplace(
        &self,
        logits: Dst<'_, Self>,
        targets: Src<'_, Self, u32>,
        v: usize,
        vp: usize,
        dloss: f32,
    );
    /// One AdamW update of a parameter slice and its moments.
    fn adamw(
        &self,
        param: Dst<'_, Self>,
        grad: Src<'_, Self>,
        m: Dst<'_, Self>,
        v: Dst<'_, Self>,
        step: AdamWStep,
        weight_decay: f32,
    );
    /// Peak FLOP/s of the device, measured on a GPT-2-shaped matmul; the
    /// denominator of MFU.
    fn measure_peak_flops(&self) -> f64;
    /// Whether every rank runs on this one device (so the job's peak is the
    /// device's), rather than each rank on a peak of its own (CPU cores).
    fn ranks_share_device(&self) -> bool {
        false
    }
    /// Sum in f64 (the loss over a batch's rows).
    fn sum(&self, x: Src<'_, Self>) -> Result<f64>;
    /// Sum of squares in f64.
    fn sum_squares(&self, x: Src<'_, Self>) -> Result<f64>;
}
