//! fp32 CPU backend: `gemm` crate matmuls and rayon-parallel kernels.

pub(crate) mod adamw;
pub(crate) mod attention;
#[cfg(test)]
pub(crate) mod check;
pub(crate) mod crossentropy;
mod decode;
pub(crate) mod elementwise;
pub(crate) mod encoder;
pub(crate) mod layernorm;
pub mod math;
pub(crate) mod matmul;

pub use adamw::AdamWStep;
pub use attention::{AttnShape, DecodeShape};
pub use decode::{PackedWeight, WeightFormat};
pub use matmul::WeightLayout;

use super::memory::MemoryStats;
use super::Backend;
use std::sync::Arc;

/// The CPU device; rayon's global pool decides the thread count.
#[derive(Clone, Default)]
pub struct Cpu {
    memory: Arc<MemoryStats>,
}

impl Cpu {
    pub fn new() -> Self {
        Cpu::default()
    }
}

impl Backend for Cpu {
    fn name(&self) -> String {
        format!("cpu ({} threads)", rayon::current_num_threads())
    }
    fn clone_fresh(&self) -> Self {
        Cpu::new()
    }
    fn memory(&self) -> &Arc<MemoryStats> {
        &self.memory
    }
    fn encoder_forward(
        &self,
        out: &mut [f32],
        tokens: &[u32],
        wte: &[f32],
        wpe: &[f32],
        t: usize,
        c: usize,
    ) {
        encoder::encoder_forward(out, tokens, wte, wpe, t, c)
    }
    fn encoder_backward(
        &self,
        dwte: &mut [f32],
        dwpe: &mut [f32],
        dout: &[f32],
        tokens: &[u32],
        t: usize,
        c: usize,
    ) {
        encoder::encoder_backward(dwte, dwpe, dout, tokens, t, c)
    }
    fn layernorm_forward(
        &self,
        out: &mut [f32],
        mean: &mut [f32],
        rstd: &mut [f32],
        inp: &[f32],
        w: &[f32],
        b: &[f32],
        c: usize,
    ) {
        layernorm::layernorm_forward(out, mean, rstd, inp, w, b, c)
    }
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
    ) {
        layernorm::layernorm_backward(dinp, dw, db, dout, inp, w, mean, rstd, c)
    }
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
    ) {
        matmul::matmul_forward(out, inp, w, bias, layout, rows, k, n, accumulate)
    }
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
    ) {
        matmul::matmul_backward(dinp, dw, dbias, dout, inp, w, layout, rows, k, n)
    }
    fn pack_decode_weight(
        &self,
        w: &[f32],
        layout: WeightLayout,
        k: usize,
        n: usize,
        format: WeightFormat,
    ) -> PackedWeight {
        PackedWeight::new(w, layout, k, n, format, &self.memory)
    }
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
    ) {
        decode::matmul_decode(out, inp, packed, bias, rows, k, n, accumulate)
    }
    fn attention_forward(&self, out: &mut [f32], lse: &mut [f32], qkv: &[f32], shape: AttnShape) {
        attention::attention_forward(out, lse, qkv, shape)
    }
    fn attention_backward(
        &self,
        dqkv: &mut [f32],
        dout: &[f32],
        qkv: &[f32],
        out: &[f32],
        lse: &[f32],
        shape: AttnShape,
    ) {
        attention::attention_backward(dqkv, dout, qkv, out, lse, shape)
    }
    fn attention_decode(
        &self,
        out: &mut [f32],
        qkv: &[f32],
        kcache: &[f32],
        vcache: &[f32],
        shape: DecodeShape,
    ) {
        attention::attention_decode(out, qkv, kcache, vcache, shape)
    }
    fn gelu_forward(&self, out: &mut [f32], inp: &[f32]) {
        elementwise::gelu_forward(out, inp)
    }
    fn gelu_backward_inplace(&self, d: &mut [f32], inp: &[f32]) {
        elementwise::gelu_backward_inplace(d, inp)
    }
    fn copy(&self, dst: &mut [f32], src: &[f32]) {
        elementwise::copy(dst, src)
    }
    fn crossentropy_forward(
        &self,
        losses: &mut [f32],
        logits: &[f32],
        targets: &[u32],
        v: usize,
        vp: usize,
    ) {
        crossentropy::crossentropy_forward(losses, logits, targets, v, vp)
    }
    fn crossentropy_backward_inplace(
        &self,
        logits: &mut [f32],
        targets: &[u32],
        v: usize,
        vp: usize,
        dloss: f32,
    ) {
        crossentropy::crossentropy_backward_inplace(logits, targets, v, vp, dloss)
    }
    fn adamw(
        &self,
        param: &mut [f32],
        grad: &[f32],
        m: &mut [f32],
        v: &mut [f32],
        step: AdamWStep,
        weight_decay: f32,
    ) {
        adamw::adamw(param, grad, m, v, step, weight_decay)
    }
    fn measure_peak_flops(&self) -> f64 {
        math::measure_matmul_flops()
    }
    fn sum_squares(&self, x: &[f32]) -> f64 {
        elementwise::sum_squares(x)
    }
}
