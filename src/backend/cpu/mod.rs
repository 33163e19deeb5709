//! fp32 CPU backend: `gemm` crate matmuls and rayon-parallel kernels.

pub(crate) mod attention;
pub mod blas;
#[cfg(test)]
pub(crate) mod check;
mod decode;
pub(crate) mod dpbf16;
pub(crate) mod elementwise;
pub mod hardware;
pub mod int8;
pub mod math;
mod tile;

pub use attention::{AttnShape, DecodeShape, Mask};
pub(crate) use decode::Element;
pub use decode::{round_to_bf16, PackedWeight, WeightFormat};

use super::WeightLayout;

use super::memory::{Buf, Category, Dst, MemoryStats, Src};
use super::ops::{checked, Host, Kernel, Lower, On};
use super::profile;
use super::{AttentionDecode, Bf16, Decode, Device, Elem, Kernels, MatmulDecode, Threads};
use crate::error::{Error, Result};
use std::sync::Arc;

/// The CPU device; the rayon pool it runs in decides the thread count:
/// the global one, or the pool each thread rank installs for itself
/// (`parallel::launch`). Its buffers are host vectors, so views are plain
/// slices.
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
    fn threads(&self) -> Threads {
        Threads::Pool
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

/// A CPU kernel, counted while the profile is on (nothing to wait for).
fn cpu_timed<R>(name: &'static str, flops: f64, run: impl FnOnce() -> R) -> R {
    profile::PROCESS.timed(name, flops, || (), run)
}

impl Kernels for Cpu {
    fn run<'a, K: Kernel<On<'a, Self>>>(&self, op: K) -> Result<()> {
        checked(&op)?;
        cpu_timed(K::NAME, op.flops(), || op.cpu(&ToHost));
        Ok(())
    }
    fn fill(&self, dst: Dst<'_, Self>, value: f32) {
        cpu_timed("fill", 0.0, || elementwise::fill(w(dst), value))
    }
    fn add_inplace(&self, dst: Dst<'_, Self>, src: Src<'_, Self>) {
        cpu_timed("add_inplace", 0.0, || {
            elementwise::add_inplace(w(dst), r(src))
        })
    }
    fn copy(&self, dst: Dst<'_, Self>, src: Src<'_, Self>) {
        cpu_timed("copy", 0.0, || elementwise::copy(w(dst), r(src)))
    }
    fn round_bf16(&self, x: Dst<'_, Self>) {
        cpu_timed("round_bf16", 0.0, || elementwise::round_bf16(w(x)))
    }
    fn to_bf16(&self, dst: Dst<'_, Self, Bf16>, src: Src<'_, Self>) {
        cpu_timed("to_bf16", 0.0, || elementwise::to_bf16(w(dst), r(src)))
    }
    fn sum(&self, x: Src<'_, Self>) -> Result<f64> {
        cpu_timed("sum", 0.0, || Ok(r(x).iter().map(|&v| v as f64).sum()))
    }
    fn sum_squares(&self, xs: &[Src<'_, Self>]) -> Result<Vec<f64>> {
        let each = || xs.iter().map(|&x| elementwise::sum_squares(r(x))).collect();
        cpu_timed("sum_squares", 0.0, || Ok(each()))
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
}
