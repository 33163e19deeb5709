//! fp32 CPU backend: `gemm` crate matmuls and rayon-parallel kernels.

pub(crate) mod adamw;
pub(crate) mod attention;
pub mod blas;
#[cfg(test)]
pub(crate) mod check;
pub(crate) mod crossentropy;
mod decode;
mod dpbf16;
pub(crate) mod elementwise;
pub(crate) mod encoder;
pub mod hardware;
pub mod int8;
pub(crate) mod layernorm;
pub mod math;
pub(crate) mod matmul;
mod tile;

pub use adamw::AdamWStep;
pub use attention::{AttnShape, DecodeShape, Mask};
pub use decode::{round_to_bf16, PackedWeight, WeightFormat};
pub use matmul::WeightLayout;

use super::memory::{Buf, Category, Dst, MemoryStats, Src};
use super::ops::{Host, Lower, On};
use super::{
    Activation, ActivationBackward, AdamWUpdate, AttentionBackward, AttentionDecode,
    AttentionForward, CrossEntropyBackward, CrossEntropyForward, Decode, Device, Elem,
    EncoderBackward, EncoderForward, Kernels, LayerNormBackward, LayerNormForward, MatmulBackward,
    MatmulDecode, MatmulForward, PeakProbe,
};
use crate::error::{Error, Result};
use std::sync::Arc;

/// The CPU device; rayon's global pool decides the thread count. Its
/// buffers are host vectors, so views are plain slices.
#[derive(Clone, Default)]
pub struct Cpu {
    memory: Arc<MemoryStats>,
}

impl Cpu {
    pub fn new() -> Self {
        Cpu::default()
    }
}

/// How many tasks a decoding product of `rows` x k x n over `panels` column
/// panels is split into: each gets at least `grain` multiply-adds (a row
/// counted as four at least, as reading the weights is most of one row's
/// time), about a microsecond of its kernel's, below which handing it to
/// another thread costs more than it saves (a small model's decoding step is
/// hundreds of such products and other operations); at most four a thread
/// and one a panel.
pub(crate) fn product_tasks(rows: usize, k: usize, n: usize, panels: usize, grain: usize) -> usize {
    let most = (rayon::current_num_threads() * 4).min(panels);
    (rows.max(4) * k * n / grain).clamp(1, most.max(1))
}

/// The most matmul parameters a model may have for its decoding steps to
/// run as one part of the rows a thread ([`Decode::decode_parts`]): then
/// no operation is handed between threads, where a small model's hundreds
/// of operations a step each cost a hand-over (2-3 µs); a larger model's
/// matrices are read once a step for all rows instead of once a part. On
/// the 2-core machine this was measured on (32 MiB L3), batch 12, parts
/// against whole-batch operations: 0.8M parameters (the default model) fp32
/// 1.27x, int8 1.64x; 10.6M 1.11x, 2.03x; 37.7M 0.95x, 0.79x; GPT-2 124M
/// 0.95x, 0.83x.
const PARTS_MAX_PARAMS: usize = 16 << 20;

/// How many parameters a token of a batch's part may meet at most
/// ([`Decode::batch_parts`]): each part reads every weight again and keeps
/// its own copy of a unit's gradient, which pays while a part has tokens
/// enough to amortize them. Measured on 2 threads (Zen 5), parts against
/// both threads sharing every operation, tokens a part / parameters a
/// token: shakespeare-char 16 x 256 (2,048 / 11.9M) +3-6%, in bf16 +4%;
/// bert-minilm classify 32 x 128 (2,048 / 11.2M) +2%; GPT-2 124M 16 x
/// 128 (1,024 / 126M) -1.5%, 4 x 128 (256) -7%.
const PART_PARAMS_PER_TOKEN: f64 = 32_768.0;

/// The parts a rank on `threads` threads runs a batch of `rows`
/// sequences of `t` tokens in, for a model whose tokens each meet `params`
/// parameters: a part a thread, each with at least a token for every
/// [`PART_PARAMS_PER_TOKEN`] of them.
pub fn batch_parts(threads: usize, (rows, t): (usize, usize), params: f64) -> usize {
    let most = (rows * t) as f64 * PART_PARAMS_PER_TOKEN / params.max(1.0);
    threads.min(rows).min(most as usize).max(1)
}

/// The host slice behind a CPU view.
fn r<T>(s: Src<'_, Cpu, T>) -> &[T] {
    let v = s.raw();
    // SAFETY: a `Src<Cpu>` is only made by a `Buf<Cpu>` (a Vec whose pointer
    // is the handle) borrowed for the view's lifetime, with the range checked.
    unsafe { std::slice::from_raw_parts((v.handle as *const T).add(v.off), v.len) }
}

/// The writable host slice behind a CPU view.
fn w<T>(d: Dst<'_, Cpu, T>) -> &mut [T] {
    let v = d.raw();
    // SAFETY: as `r`; a `Dst` is made from an exclusive borrow of the buffer
    // and splits only into disjoint views.
    unsafe { std::slice::from_raw_parts_mut((v.handle as *mut T).add(v.off), v.len) }
}

/// A transfer between a view and a host slice of another length is refused.
fn same_len(view: usize, host: usize) -> Result<()> {
    if view == host {
        Ok(())
    } else {
        Err(Error::Input(format!(
            "a transfer between a view of {view} elements and a host buffer of {host}"
        )))
    }
}

impl Device for Cpu {
    type Mem<T: Elem> = Vec<T>;

    fn handle<T: Elem>(mem: &Vec<T>) -> usize {
        mem.as_ptr() as usize
    }
    fn handle_mut<T: Elem>(mem: &mut Vec<T>) -> usize {
        mem.as_mut_ptr() as usize
    }
    fn name(&self) -> String {
        // a build without the `avx512` feature says so: its runs and its
        // kept peak (keyed by this name) are not the default build's
        let threads = rayon::current_num_threads();
        format!(
            "cpu ({threads} thread{}{})",
            if threads == 1 { "" } else { "s" },
            if cfg!(feature = "avx512") {
                ""
            } else {
                ", fp32 on AVX2"
            }
        )
    }
    fn clone_fresh(&self) -> Self {
        Cpu::new()
    }
    fn memory(&self) -> &Arc<MemoryStats> {
        &self.memory
    }
    fn alloc_typed<T: Elem>(&self, len: usize, category: Category) -> Result<Buf<Self, T>> {
        Ok(Buf::new(
            crate::backend::memory::host_zeros(len),
            len,
            category,
            self.memory.clone(),
        ))
    }
    fn upload<T: Elem>(&self, dst: Dst<'_, Self, T>, src: &[T]) -> Result<()> {
        same_len(dst.len(), src.len())?;
        w(dst).copy_from_slice(src);
        Ok(())
    }
    fn download<T: Elem>(&self, src: Src<'_, Self, T>, dst: &mut [T]) -> Result<()> {
        same_len(src.len(), dst.len())?;
        dst.copy_from_slice(r(src));
        Ok(())
    }
    fn host<'a, T: Elem>(&self, src: Src<'a, Self, T>) -> Option<&'a [T]> {
        Some(r(src))
    }
    fn host_mut<'a, T: Elem>(&self, dst: Dst<'a, Self, T>) -> Option<&'a mut [T]> {
        Some(w(dst))
    }
    fn synchronize(&self) -> Result<()> {
        Ok(())
    }
    fn measure_peak(&self) -> PeakProbe {
        let (matmul, timings) = blas::measure(3);
        // the speed of the library the layers run on (the crate may keep
        // them against one up to 5% faster)
        let flops = timings
            .iter()
            .find(|t| t.lib == matmul.large)
            .map_or(0.0, |t| t.large_flops);
        let fastest = timings
            .iter()
            .map(|t| t.large_flops.max(t.small_flops))
            .fold(0.0, f64::max);
        PeakProbe {
            flops,
            hardware: hardware::measure_above(fastest),
            matmul: Some(matmul),
            timings,
        }
    }
}

/// Lowers the CPU's views to the host slices behind them.
struct ToHost;

impl<'a> Lower<On<'a, Cpu>, Host<'a>> for ToHost {
    fn input<T: Elem>(&self, x: Src<'a, Cpu, T>) -> &'a [T] {
        r(x)
    }
    fn output<T: Elem>(&self, x: Dst<'a, Cpu, T>) -> &'a mut [T] {
        w(x)
    }
}

impl Kernels for Cpu {
    fn encoder_forward(&self, op: EncoderForward<On<'_, Self>>) {
        encoder::encoder_forward(op.lower(&ToHost))
    }
    fn encoder_backward(&self, op: EncoderBackward<'_, On<'_, Self>>) {
        encoder::encoder_backward(op.lower(&ToHost))
    }
    fn layernorm_forward(&self, op: LayerNormForward<On<'_, Self>>) {
        layernorm::layernorm_forward(op.lower(&ToHost))
    }
    fn layernorm_backward(&self, op: LayerNormBackward<On<'_, Self>>) -> Result<()> {
        layernorm::layernorm_backward(op.lower(&ToHost));
        Ok(())
    }
    fn matmul_forward(&self, op: MatmulForward<On<'_, Self>>) {
        matmul::matmul_forward(op.lower(&ToHost))
    }
    fn matmul_backward(&self, op: MatmulBackward<On<'_, Self>>) {
        matmul::matmul_backward(op.lower(&ToHost))
    }
    fn attention_forward(&self, op: AttentionForward<On<'_, Self>>) {
        attention::attention_forward(op.lower(&ToHost))
    }
    fn attention_backward(&self, op: AttentionBackward<On<'_, Self>>) {
        attention::attention_backward(op.lower(&ToHost))
    }
    fn activation_forward(&self, out: Dst<'_, Self>, inp: Src<'_, Self>, act: Activation) {
        elementwise::activation_forward(w(out), r(inp), act)
    }
    fn activation_backward(&self, op: ActivationBackward<On<'_, Self>>) {
        elementwise::activation_backward(op.lower(&ToHost))
    }
    fn fill(&self, dst: Dst<'_, Self>, value: f32) {
        w(dst).fill(value)
    }
    fn add_inplace(&self, dst: Dst<'_, Self>, src: Src<'_, Self>) {
        elementwise::add_inplace(w(dst), r(src))
    }
    fn copy(&self, dst: Dst<'_, Self>, src: Src<'_, Self>) {
        elementwise::copy(w(dst), r(src))
    }
    /// Every route of `math::gemm` rounds a bf16 product's operands: the
    /// bf16 products as they pack them, fp32 arithmetic into scratch.
    const MATMUL_ROUNDS_BF16: bool = true;
    fn round_bf16(&self, dst: Dst<'_, Self>, src: Option<Src<'_, Self>>) {
        match src {
            Some(src) => elementwise::round_bf16_from(w(dst), r(src)),
            None => elementwise::round_bf16(w(dst)),
        }
    }
    fn crossentropy_forward(&self, op: CrossEntropyForward<On<'_, Self>>) {
        crossentropy::crossentropy_forward(op.lower(&ToHost))
    }
    fn crossentropy_backward(&self, op: CrossEntropyBackward<On<'_, Self>>) {
        crossentropy::crossentropy_backward(op.lower(&ToHost))
    }
    fn adamw(&self, op: AdamWUpdate<On<'_, Self>>) {
        adamw::adamw(op.lower(&ToHost))
    }
    fn sum(&self, x: Src<'_, Self>) -> Result<f64> {
        Ok(r(x).iter().map(|&v| v as f64).sum())
    }
    fn sum_squares(&self, x: Src<'_, Self>) -> Result<f64> {
        Ok(elementwise::sum_squares(r(x)))
    }
}

impl Decode for Cpu {
    type Packed = PackedWeight;

    fn pack_decode_weight(
        &self,
        wt: Src<'_, Self>,
        layout: WeightLayout,
        k: usize,
        n: usize,
        format: WeightFormat,
    ) -> Result<PackedWeight> {
        Ok(PackedWeight::new(r(wt), layout, k, n, format, &self.memory))
    }
    fn matmul_decode(&self, op: MatmulDecode<'_, On<'_, Self>, PackedWeight>) {
        decode::matmul_decode(op.lower(&ToHost))
    }
    fn attention_decode(&self, op: AttentionDecode<On<'_, Self>>) {
        attention::attention_decode(op.lower(&ToHost))
    }
    fn in_pool<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        // a scope's body runs on a worker (this one, if it is one already)
        rayon::scope(|_| f())
    }
    fn decode_parts(&self, rows: usize, matmul_params: usize) -> usize {
        match matmul_params <= PARTS_MAX_PARAMS {
            true => rayon::current_num_threads().min(rows),
            false => 1,
        }
    }
    /// [`batch_parts`] on this pool's threads.
    fn batch_parts(&self, rows: usize, t: usize, params: f64) -> usize {
        batch_parts(rayon::current_num_threads(), (rows, t), params)
    }
    fn for_each_part<T: Send, R: Send>(
        &self,
        parts: &mut [T],
        f: impl Fn(&mut T) -> R + Sync,
    ) -> Vec<R> {
        use rayon::prelude::*;
        parts.par_iter_mut().map(&f).collect()
    }
}
