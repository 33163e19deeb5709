//! The device layer: buffers accounted by category, and the kernels the model
//! runs layer by layer (llm.c style: every layer is a forward/backward pair).
//!
//! The model is generic over [`Backend`]; `cpu` is the one implementation today.

pub mod cpu;
pub mod memory;
pub mod opencl;

pub use cpu::{AdamWStep, AttnShape, DecodeShape, PackedWeight, WeightFormat, WeightLayout};
pub use memory::{Buf, Category, MemoryReport};

use std::sync::Arc;

/// Buffers and kernels of one device. Shapes are in each method's comment;
/// `rows` is B*T. Backward kernels accumulate (`+=`) into parameter
/// gradients and into `dinp` unless the comment says "overwritten".
#[allow(clippy::too_many_arguments)]
pub trait Backend: Send + Sync {
    /// A human-readable device name for reports.
    fn name(&self) -> String;
    /// Another handle on the same device with counters of its own (for work
    /// that must not count against a rank, such as sampling on rank 0).
    fn clone_fresh(&self) -> Self
    where
        Self: Sized;
    /// The counters every buffer of this backend reports to.
    fn memory(&self) -> &Arc<memory::MemoryStats>;
    /// A zero-filled buffer of `len` floats.
    fn alloc(&self, len: usize, category: Category) -> Buf {
        Buf::zeros(len, category, self.memory().clone())
    }

    /// out (rows, C) = wte[tokens] + wpe[row % t].
    fn encoder_forward(
        &self,
        out: &mut [f32],
        tokens: &[u32],
        wte: &[f32],
        wpe: &[f32],
        t: usize,
        c: usize,
    );
    /// dwte[tokens] += dout; dwpe[row % t] += dout.
    fn encoder_backward(
        &self,
        dwte: &mut [f32],
        dwpe: &mut [f32],
        dout: &[f32],
        tokens: &[u32],
        t: usize,
        c: usize,
    );
    /// out, inp (rows, C); mean, rstd (rows).
    fn layernorm_forward(
        &self,
        out: &mut [f32],
        mean: &mut [f32],
        rstd: &mut [f32],
        inp: &[f32],
        w: &[f32],
        b: &[f32],
        c: usize,
    );
    /// dinp (rows, C) +=; dw, db (C) +=.
    fn layernorm_backward(
        &self,
        dinp: &mut [f32],
        dw: &mut [f32],
        db: &mut [f32],
        dout: &[f32],
        inp: &[f32],
        w: &[f32],
        mean: &[f32],
        rstd: &[f32],
        c: usize,
    );
    /// out (rows, n) = [out +] inp (rows, k) @ W + bias.
    fn matmul_forward(
        &self,
        out: &mut [f32],
        inp: &[f32],
        w: &[f32],
        bias: Option<&[f32]>,
        layout: WeightLayout,
        rows: usize,
        k: usize,
        n: usize,
        accumulate: bool,
    );
    /// dinp (rows, k) overwritten; dw (k x n) +=; dbias (n) +=.
    fn matmul_backward(
        &self,
        dinp: &mut [f32],
        dw: &mut [f32],
        dbias: Option<&mut [f32]>,
        dout: &[f32],
        inp: &[f32],
        w: &[f32],
        layout: WeightLayout,
        rows: usize,
        k: usize,
        n: usize,
    );
    /// W (k x n, in `layout`) laid out for [`Backend::matmul_decode`],
    /// stored in `format`.
    fn pack_decode_weight(
        &self,
        w: &[f32],
        layout: WeightLayout,
        k: usize,
        n: usize,
        format: WeightFormat,
    ) -> PackedWeight;
    /// out (rows, n) = [out +] inp (rows, k) @ W + bias for few rows (one per
    /// sequence being decoded), W from [`Backend::pack_decode_weight`].
    fn matmul_decode(
        &self,
        out: &mut [f32],
        inp: &[f32],
        packed: &PackedWeight,
        bias: Option<&[f32]>,
        rows: usize,
        k: usize,
        n: usize,
        accumulate: bool,
    );
    /// qkv (B, T, 3C) -> out (B, T, C), lse (B, NH, T).
    fn attention_forward(&self, out: &mut [f32], lse: &mut [f32], qkv: &[f32], shape: AttnShape);
    /// dqkv (B, T, 3C) overwritten.
    fn attention_backward(
        &self,
        dqkv: &mut [f32],
        dout: &[f32],
        qkv: &[f32],
        out: &[f32],
        lse: &[f32],
        shape: AttnShape,
    );
    /// Decoding: qkv (b, 3c) queries against kcache, vcache (b, max_t, c) -> out (b, c).
    fn attention_decode(
        &self,
        out: &mut [f32],
        qkv: &[f32],
        kcache: &[f32],
        vcache: &[f32],
        shape: DecodeShape,
    );
    /// out = gelu(inp), any shape.
    fn gelu_forward(&self, out: &mut [f32], inp: &[f32]);
    /// d *= gelu'(inp), in place.
    fn gelu_backward_inplace(&self, d: &mut [f32], inp: &[f32]);
    /// dst = src (the residual adds are fused into the projection matmuls,
    /// which accumulate onto a copy of the stream).
    fn copy(&self, dst: &mut [f32], src: &[f32]);
    /// losses (rows) from logits (rows, vp) whose first v columns are real.
    fn crossentropy_forward(
        &self,
        losses: &mut [f32],
        logits: &[f32],
        targets: &[u32],
        v: usize,
        vp: usize,
    );
    /// logits (rows, vp) -> dloss * d(sum of losses)/d logits, in place.
    fn crossentropy_backward_inplace(
        &self,
        logits: &mut [f32],
        targets: &[u32],
        v: usize,
        vp: usize,
        dloss: f32,
    );
    /// One AdamW update of a parameter slice and its moments.
    fn adamw(
        &self,
        param: &mut [f32],
        grad: &[f32],
        m: &mut [f32],
        v: &mut [f32],
        step: AdamWStep,
        weight_decay: f32,
    );
    /// Peak FLOP/s of the device, measured on a GPT-2-shaped matmul; the
    /// denominator of MFU.
    fn measure_peak_flops(&self) -> f64;
    /// Sum of squares in f64.
    fn sum_squares(&self, x: &[f32]) -> f64;
}
