//! int8 matrix products for decoding: W quantized once per output column
//! (symmetric, scale = max |w| / 127, fp32 scales), the input quantized per
//! row as it comes (the same rule); int8 x int8 products summed in i32, then
//! scaled back to f32. Four kernels compute the same integers, chosen at run
//! time by what the CPU has: AVX-512 VNNI, AVX-VNNI, AVX2, or plain Rust.

use super::math::SendPtr;
use super::product_tasks;
use crate::backend::memory::{Category, HostBuf, MemoryStats};
use crate::backend::ops::{Host, MatmulDecode};
use crate::backend::WeightLayout;
use rayon::prelude::*;
use std::sync::Arc;

/// Output columns per i32 vector (16 lanes of a 512-bit register).
const LANES: usize = 16;
/// Output columns per packed panel: two vectors' worth, interleaved group
/// by group so a panel (and a run of panels) is one stream of memory.
pub const PANEL: usize = 2 * LANES;
/// Input values per i32 lane step (what one VNNI instruction sums).
const GROUP: usize = 4;
/// Bytes of one group of a panel.
const GROUP_BYTES: usize = PANEL * GROUP;
/// How far ahead of its loads a kernel prefetches the weight stream, in
/// bytes: a product of many rows spends long enough on each group that the
/// hardware prefetcher alone leaves the loads waiting on memory.
const AHEAD: usize = 4096;
/// Rows of the input sharing one pass over a panel: as many as keep their
/// sums in registers (AVX-512 has 32 vector registers, AVX2 16).
const ROWS: usize = 4;
const ROWS_512: usize = 12;
/// Bytes of int8 weights from which a one-row product takes the weight-only
/// path. A model of such matrices streams them from memory at every token,
/// which hides the weight-only kernel's extra arithmetic (three vector
/// instructions per 16 products where VNNI needs one per 64), and its
/// products are closer to fp32; a smaller model's matrices stay in cache,
/// where that arithmetic is the cost: int8 x int8 does the 4 x 128 default
/// model's products for a token in 13 µs instead of 21. GPT-2 124M's
/// smallest matrix is 576 KiB, the default model's largest 64 KiB.
const STREAMED: usize = 256 << 10;
/// Multiply-adds a task of [`matmul_int8`] gets at least
/// ([`product_tasks`]): about a microsecond of the VNNI kernels' at 12 rows
/// (a hand-over to another thread cost 2-3 µs on the 2-core machine this
/// was measured on).
const GRAIN: usize = 1 << 18;

crate::named_enum! {
    /// A kernel: which instructions sum the int8 products.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub enum Kernel {
        Avx512Vnni = "AVX-512 VNNI",
        AvxVnni = "AVX-VNNI",
        Avx2 = "AVX2",
        Portable = "portable",
    }
    fn name
}

/// The instruction-set extensions a kernel choice depends on.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Features {
    pub avx512_vnni: bool,
    pub avx_vnni: bool,
    pub avx2: bool,
}

impl Features {
    /// What this CPU has.
    pub fn detect() -> Features {
        #[cfg(target_arch = "x86_64")]
        {
            Features {
                avx512_vnni: is_x86_feature_detected!("avx512f")
                    && is_x86_feature_detected!("avx512bw")
                    && is_x86_feature_detected!("avx512vnni"),
                avx_vnni: is_x86_feature_detected!("avx2") && is_x86_feature_detected!("avxvnni"),
                avx2: is_x86_feature_detected!("avx2"),
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        Features::default()
    }
}

impl Kernel {
    /// The fastest kernel `f` can run.
    pub fn best(f: Features) -> Kernel {
        if f.avx512_vnni {
            Kernel::Avx512Vnni
        } else if f.avx_vnni {
            Kernel::AvxVnni
        } else if f.avx2 {
            Kernel::Avx2
        } else {
            Kernel::Portable
        }
    }

    /// The kernel for this CPU (detected once).
    pub fn here() -> Kernel {
        static HERE: std::sync::OnceLock<Kernel> = std::sync::OnceLock::new();
        *HERE.get_or_init(|| Kernel::best(Features::detect()))
    }

    /// Input rows one pass over a panel serves.
    fn rows_per_pass(self) -> usize {
        match self {
            Kernel::Avx512Vnni => ROWS_512,
            _ => ROWS,
        }
    }

    /// Whether the kernel multiplies the biased (+ 128, unsigned) input
    /// codes, so its sums come out 128 x the column sums too high.
    fn biased(self) -> bool {
        matches!(self, Kernel::Avx512Vnni | Kernel::AvxVnni)
    }
}

/// 1.5 x 2^23: a float of magnitude at most 2^22 added to it is rounded to
/// an integer (to nearest, ties to even), which lands in the sum's low
/// mantissa bits as two's complement.
const ROUNDER: f32 = 12_582_912.0;

/// The symmetric int8 code of `x` at `scale`, in [-127, 127], ties to even,
/// NaN to 0: clamped first, then rounded by [`ROUNDER`] instead of a float to
/// integer conversion, so a loop of these compiles to vector instructions
/// (a saturating conversion does not); the integer clamp (a no-op on
/// values already in range) lets the narrowing to bytes be saturating packs.
#[inline(always)]
fn quantize(x: f32, inv_scale: f32) -> i8 {
    let y = x * inv_scale;
    let y = if y.is_nan() { 0.0 } else { y };
    let y = y.clamp(-127.0, 127.0);
    ((y + ROUNDER).to_bits() as i32 - ROUNDER.to_bits() as i32).clamp(-127, 127) as i8
}

/// codes = row's int8 codes at scale 1 / inv, each xor `flip`.
#[inline(always)]
fn quantize_row(codes: &mut [u8], row: &[f32], inv: f32, flip: u8) {
    for (c, &v) in codes.iter_mut().zip(row) {
        *c = quantize(v, inv) as u8 ^ flip;
    }
}

/// The scale of values whose largest magnitude is `max_abs` (1 for all zeros).
fn scale_of(max_abs: f32) -> f32 {
    if max_abs > 0.0 && max_abs.is_finite() {
        max_abs / 127.0
    } else {
        1.0
    }
}

/// The largest magnitude in `x` (NaN passed over), in lanes the compiler
/// can vectorize, each a compare and select (`f32::max` adds a NaN test).
fn max_abs(x: &[f32]) -> f32 {
    #[inline(always)]
    fn larger(m: f32, v: f32) -> f32 {
        if v > m {
            v
        } else {
            m
        }
    }
    let mut lanes = [0.0f32; 16];
    let chunks = x.chunks_exact(16);
    let tail = chunks
        .remainder()
        .iter()
        .fold(0.0f32, |m, v| larger(m, v.abs()));
    for c in chunks {
        for (m, v) in lanes.iter_mut().zip(c) {
            *m = larger(*m, v.abs());
        }
    }
    // halves folded onto each other, then the tail's
    let mut width = 16;
    while width > 1 {
        width /= 2;
        for i in 0..width {
            lanes[i] = larger(lanes[i], lanes[i + width]);
        }
    }
    larger(lanes[0], tail)
}

/// The int8 scale of each of W's n columns (k rows, read through `at(i, j)`).
fn column_scales(at: &(impl Fn(usize, usize) -> f32 + Sync), k: usize, n: usize) -> Vec<f32> {
    (0..n)
        .into_par_iter()
        .map(|j| scale_of((0..k).map(|i| at(i, j).abs()).fold(0.0, f32::max)))
        .collect()
}

/// W (k x n, row-major) as int8 codes (row-major) and a scale per column:
/// the codes and scales [`Int8Weight`] packs, for storing a model in int8.
pub fn quantize_columns(w: &[f32], k: usize, n: usize) -> (Vec<i8>, Vec<f32>) {
    assert!(w.len() >= k * n);
    let scales = column_scales(&|i, j| w[i * n + j], k, n);
    let codes = (0..k * n)
        .map(|e| quantize(w[e], 1.0 / scales[e % n]))
        .collect();
    (codes, scales)
}

/// W in int8, packed for the kernels: panel p, group g holds columns
/// 32p..32p+32 of rows 4g..4g+4 as 32 x 4 bytes (column-major within the
/// group), zero past k and n; panels follow each other.
pub struct Int8Weight {
    k: usize,
    n: usize,
    data: HostBuf<i8>,
    /// Per column: w ≈ code * scale (one past n).
    scales: Vec<f32>,
    /// Per column: 128 x the sum of its codes (what the biased kernels'
    /// sums carry too much).
    offsets: Vec<i32>,
}

impl Int8Weight {
    /// Quantizes W (k x n, in `layout`), counted as parameters in `stats`.
    pub fn new(
        w: &[f32],
        layout: WeightLayout,
        k: usize,
        n: usize,
        stats: &Arc<MemoryStats>,
    ) -> Int8Weight {
        assert!(w.len() >= k * n);
        let at = |i: usize, j: usize| match layout {
            WeightLayout::InOut => w[i * n + j],
            WeightLayout::OutIn => w[j * k + i],
        };
        let (panels, groups) = (n.div_ceil(PANEL), k.div_ceil(GROUP));
        let mut scales = vec![1.0f32; panels * PANEL];
        scales[..n].copy_from_slice(&column_scales(&at, k, n));
        let mut data = HostBuf::zeros(
            panels * groups * GROUP_BYTES,
            Category::Params,
            stats.clone(),
        );
        data.par_chunks_mut(groups * GROUP_BYTES)
            .enumerate()
            .for_each(|(p, panel)| {
                for c in 0..PANEL.min(n - p * PANEL) {
                    let j = p * PANEL + c;
                    let inv = 1.0 / scales[j];
                    for i in 0..k {
                        panel[(i / GROUP) * GROUP_BYTES + c * GROUP + i % GROUP] =
                            quantize(at(i, j), inv);
                    }
                }
            });
        let offsets = (0..panels * PANEL)
            .map(|j| {
                let (p, c) = (j / PANEL, j % PANEL);
                let codes = (0..groups).flat_map(|g| {
                    let at = (p * groups + g) * GROUP_BYTES + c * GROUP;
                    data[at..at + GROUP].iter().map(|&v| v as i32)
                });
                128 * codes.sum::<i32>()
            })
            .collect();
        Int8Weight {
            k,
            n,
            data,
            scales,
            offsets,
        }
    }

    /// Panel p's codes.
    fn panel(&self, p: usize) -> &[i8] {
        let len = self.k.div_ceil(GROUP) * GROUP_BYTES;
        &self.data[p * len..(p + 1) * len]
    }
}

/// Rows of int8 input, each padded with zeros to a multiple of 4 values,
/// as one kernel multiplies them.
pub struct Int8Rows {
    /// The codes: signed, or + 128 as unsigned bytes for a biased kernel
    /// (the VNNI kernels').
    codes: Vec<u8>,
    biased: bool,
    scales: Vec<f32>,
    stride: usize,
}

impl Int8Rows {
    /// Quantizes `rows` rows of `k` values each, one scale per row, for
    /// `kernel`, which must run on this CPU (`Kernel::here`, or one of
    /// `Kernel::available`'s in the tests): private, as a safe public
    /// function taking any kernel ran AVX-512 on a CPU without it.
    fn new(x: &[f32], rows: usize, k: usize, kernel: Kernel) -> Int8Rows {
        assert!(x.len() >= rows * k);
        let stride = k.div_ceil(GROUP) * GROUP;
        let flip = if kernel.biased() { 0x80 } else { 0 };
        let mut codes = vec![flip; rows * stride];
        let mut scales = vec![1.0f32; rows];
        for (r, scale) in scales.iter_mut().enumerate() {
            let row = &x[r * k..(r + 1) * k];
            *scale = scale_of(max_abs(row));
            let codes = &mut codes[r * stride..][..k];
            match kernel {
                // SAFETY: the AVX-512 VNNI kernel is only chosen where the
                // CPU has AVX-512 F and BW.
                #[cfg(target_arch = "x86_64")]
                Kernel::Avx512Vnni => unsafe { x86::quantize_row(codes, row, 1.0 / *scale, flip) },
                _ => quantize_row(codes, row, 1.0 / *scale, flip),
            }
        }
        Int8Rows {
            codes,
            biased: kernel.biased(),
            scales,
            stride,
        }
    }

    /// Row r's code i, signed.
    #[cfg(test)]
    fn code(&self, r: usize, i: usize) -> i8 {
        let flip = if self.biased { 0x80 } else { 0 };
        (self.codes[r * self.stride + i] ^ flip) as i8
    }

    /// Rows r0..r0 + nr.
    fn rows(&self, r0: usize, nr: usize) -> &[u8] {
        &self.codes[r0 * self.stride..(r0 + nr) * self.stride]
    }
}

/// tile (rows x 32) = every row's codes times panel p's columns, exact but
/// for [`excess`] in every row.
fn panel_sums(
    kernel: Kernel,
    tile: &mut [i32],
    x: &Int8Rows,
    w: &Int8Weight,
    p: usize,
    rows: usize,
) {
    assert_eq!(x.stride, w.k.div_ceil(GROUP) * GROUP);
    assert_eq!(
        x.biased,
        kernel.biased(),
        "rows quantized for another kernel"
    );
    assert!(x.codes.len() >= rows * x.stride && tile.len() >= rows * PANEL);
    let panel = w.panel(p);
    let per_pass = kernel.rows_per_pass();
    for r0 in (0..rows).step_by(per_pass) {
        let nr = per_pass.min(rows - r0);
        let out = &mut tile[r0 * PANEL..(r0 + nr) * PANEL];
        panel_product(kernel, out, x.rows(r0, nr), x.stride, panel);
    }
}

/// What [`panel_sums`] by `kernel` leaves too much in each of panel p's
/// columns: a biased kernel's 128 x the column's code sum.
fn excess(kernel: Kernel, w: &Int8Weight, p: usize) -> [i32; PANEL] {
    match kernel.biased() {
        true => w.offsets[p * PANEL..(p + 1) * PANEL]
            .try_into()
            .expect("whole panels"),
        false => [0; PANEL],
    }
}

/// What a product multiplies W's codes with.
enum Input {
    /// Rows quantized per token: int8 x int8 products.
    Int8(Int8Rows),
    /// One f32 row, zero-padded to whole groups: the weight-only path.
    F32(Vec<f32>),
}

/// out (rows, n) = [out +] x (rows, k) @ W + bias, in int8 with this CPU's
/// kernel. One row against a matrix of `STREAMED` bytes or more (batch-1
/// decoding bound by reading the weights) takes the weight-only path: the
/// codes are widened to f32 in registers and multiplied with the f32 input,
/// so only the weights are quantized.
pub fn matmul_int8(op: MatmulDecode<'_, Host<'_>, Int8Weight>) {
    let MatmulDecode {
        out,
        inp: x,
        w,
        bias,
        dims: (rows, k, n),
        accumulate,
    } = op;
    assert_eq!((k, n), (w.k, w.n), "the packed weight's shape");
    assert!(out.len() >= rows * n && x.len() >= rows * k && bias.is_none_or(|b| b.len() >= n));
    let kernel = Kernel::here();
    let input = if rows == 1 && k * n >= STREAMED {
        let mut padded = vec![0.0f32; k.div_ceil(GROUP) * GROUP];
        padded[..k].copy_from_slice(&x[..k]);
        Input::F32(padded)
    } else {
        Input::Int8(Int8Rows::new(x, rows, k, kernel))
    };
    let dst = &SendPtr(out.as_mut_ptr());
    // a contiguous run of panels a task: the kernels' prefetches run ahead
    // along it
    let panels = n.div_ceil(PANEL);
    let tasks = product_tasks(rows, k, n, panels, GRAIN);
    (0..tasks).into_par_iter().for_each(|t| {
        let mut tile = vec![0i32; rows * PANEL];
        let mut dots = [0.0f32; PANEL];
        for p in panels * t / tasks..panels * (t + 1) / tasks {
            let (j0, width) = (p * PANEL, PANEL.min(n - p * PANEL));
            let ws: &[f32; PANEL] = w.scales[j0..j0 + PANEL].try_into().expect("whole panels");
            let b = bias.map(|b| {
                let mut padded = [0.0f32; PANEL];
                padded[..width].copy_from_slice(&b[j0..j0 + width]);
                padded
            });
            // SAFETY: row r's columns j0..j0 + width lie inside out (rows x
            // n, checked above) and belong to this task alone.
            let out_row = |r: usize| unsafe { dst.slice(r * n + j0, width) };
            match &input {
                Input::F32(x) => {
                    weight_only_panel(kernel, &mut dots, x, w.panel(p));
                    finish(out_row(0), |j| dots[j], ws, b.as_ref(), accumulate);
                }
                Input::Int8(q) => {
                    panel_sums(kernel, &mut tile, q, w, p, rows);
                    let excess = excess(kernel, w, p);
                    for (r, sums) in tile.chunks_exact(PANEL).enumerate() {
                        let (sums, xs): (&[i32; PANEL], f32) =
                            (sums.try_into().expect("a panel's sums"), q.scales[r]);
                        let value = |j: usize| (sums[j] - excess[j]) as f32 * xs;
                        finish(out_row(r), value, ws, b.as_ref(), accumulate);
                    }
                }
            }
        }
    });
}

/// o (one row of a panel's columns) = [o +] value(j) x the column scales +
/// the bias, j over the whole panel (the scales and bias padded to it), o
/// its columns that exist: fixed-size loops the compiler vectorizes.
#[inline(always)]
fn finish(
    o: &mut [f32],
    value: impl Fn(usize) -> f32,
    ws: &[f32; PANEL],
    b: Option<&[f32; PANEL]>,
    accumulate: bool,
) {
    let mut v = [0.0f32; PANEL];
    for j in 0..PANEL {
        v[j] = value(j) * ws[j];
    }
    if let Some(b) = b {
        for j in 0..PANEL {
            v[j] += b[j];
        }
    }
    if accumulate {
        o.iter_mut().zip(&v).for_each(|(o, &v)| *o += v);
    } else if let Ok(o) = <&mut [f32; PANEL]>::try_from(&mut *o) {
        *o = v;
    } else {
        o.copy_from_slice(&v[..o.len()]);
    }
}

/// out = x (f32, whole groups) . one panel's codes widened to f32, by the
/// f32 kernel of `kernel`'s CPU (AVX-512 F where it has AVX-512 VNNI, AVX2
/// + FMA on other x86-64, plain Rust elsewhere).
fn weight_only_panel(kernel: Kernel, out: &mut [f32; PANEL], x: &[f32], panel: &[i8]) {
    assert_eq!(panel.len(), x.len() * PANEL);
    assert_eq!(x.len() % GROUP, 0);
    match kernel {
        // SAFETY: bounds checked above; AVX-512 VNNI implies AVX-512 F, and
        // every x86-64 build of distgpt targets AVX2 + FMA (x86-64-v3).
        #[cfg(target_arch = "x86_64")]
        Kernel::Avx512Vnni => unsafe { x86::avx512_weight_only(out, x, panel) },
        #[cfg(target_arch = "x86_64")]
        Kernel::AvxVnni | Kernel::Avx2 => unsafe { x86::avx2_weight_only(out, x, panel) },
        _ => portable_weight_only(out, x, panel),
    }
}

/// The same in plain Rust.
fn portable_weight_only(out: &mut [f32; PANEL], x: &[f32], panel: &[i8]) {
    out.fill(0.0);
    for (block, xs) in panel.chunks_exact(GROUP_BYTES).zip(x.chunks_exact(GROUP)) {
        for (c, o) in out.iter_mut().enumerate() {
            let codes = &block[c * GROUP..(c + 1) * GROUP];
            *o += codes
                .iter()
                .zip(xs)
                .map(|(&q, &v)| q as f32 * v)
                .sum::<f32>();
        }
    }
}

/// out (nr x 32) = x (nr rows of `stride` codes, as `kernel` multiplies
/// them) . one panel (biased kernels: 128 x the column sums too high).
fn panel_product(kernel: Kernel, out: &mut [i32], x: &[u8], stride: usize, panel: &[i8]) {
    let nr = out.len() / PANEL;
    assert!(x.len() >= nr * stride);
    assert_eq!(panel.len(), stride * PANEL);
    match kernel {
        Kernel::Portable => portable(out, x, stride, panel, nr),
        // SAFETY: bounds checked above; `Kernel::best` offers a
        // kernel only when the CPU has its instructions.
        #[cfg(target_arch = "x86_64")]
        Kernel::Avx512Vnni => unsafe { x86::avx512_vnni(out, x, stride, panel, nr) },
        #[cfg(target_arch = "x86_64")]
        Kernel::AvxVnni => unsafe { x86::avx_vnni(out, x, stride, panel, nr) },
        #[cfg(target_arch = "x86_64")]
        Kernel::Avx2 => unsafe { x86::avx2(out, x, stride, panel, nr) },
        #[cfg(not(target_arch = "x86_64"))]
        _ => unreachable!("only the portable kernel exists off x86-64"),
    }
}

/// The same sums in plain Rust (x signed codes as bytes).
fn portable(out: &mut [i32], x: &[u8], stride: usize, panel: &[i8], nr: usize) {
    for r in 0..nr {
        let row = &x[r * stride..(r + 1) * stride];
        let o = &mut out[r * PANEL..(r + 1) * PANEL];
        o.fill(0);
        for (g, block) in panel.chunks_exact(GROUP_BYTES).enumerate() {
            let xs = &row[g * GROUP..(g + 1) * GROUP];
            for (c, o) in o.iter_mut().enumerate() {
                *o += block[c * GROUP..(c + 1) * GROUP]
                    .iter()
                    .zip(xs)
                    .map(|(&w, &v)| w as i32 * v as i8 as i32)
                    .sum::<i32>();
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{AHEAD, GROUP, GROUP_BYTES, LANES, PANEL, ROWS, ROWS_512};
    use std::arch::x86_64::*;

    /// [`super::quantize_row`] compiled for AVX-512 (16 lanes, and each
    /// vector narrowed to bytes by one `vpmovdb`).
    ///
    /// # Safety
    /// The CPU must have AVX-512 F and BW.
    #[target_feature(enable = "avx512f,avx512bw")]
    pub unsafe fn quantize_row(codes: &mut [u8], row: &[f32], inv: f32, flip: u8) {
        super::quantize_row(codes, row, inv, flip)
    }

    /// Four input codes of row `r`, group `g`, as one i32.
    #[inline(always)]
    unsafe fn four<T>(x: *const T, stride: usize, r: usize, g: usize) -> i32 {
        (x.add(r * stride + g * GROUP) as *const i32).read_unaligned()
    }

    /// Asks for the group `AHEAD` bytes past group g (two cache lines; a
    /// prefetch past the end of the weights is harmless).
    #[inline(always)]
    unsafe fn prefetch_ahead(wp: *const i8, g: usize) {
        let at = wp.wrapping_add(g * GROUP_BYTES + AHEAD);
        _mm_prefetch::<_MM_HINT_T0>(at);
        _mm_prefetch::<_MM_HINT_T0>(at.wrapping_add(64));
    }

    /// `x` holds the biased codes (+ 128, unsigned): the sums come out
    /// 128 x the column sums too high.
    ///
    /// # Safety
    /// The CPU must have AVX-512 F, BW and VNNI; `out` holds nr x 32 sums,
    /// `x` nr rows of `stride` codes, `panel` stride x 32 codes.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    pub unsafe fn avx512_vnni(out: &mut [i32], x: &[u8], stride: usize, panel: &[i8], nr: usize) {
        // A row count known at compile time keeps the sums in registers.
        match nr {
            1 => avx512_rows::<1>(out, x, stride, panel),
            2 => avx512_rows::<2>(out, x, stride, panel),
            3 => avx512_rows::<3>(out, x, stride, panel),
            4 => avx512_rows::<4>(out, x, stride, panel),
            5 => avx512_rows::<5>(out, x, stride, panel),
            6 => avx512_rows::<6>(out, x, stride, panel),
            7 => avx512_rows::<7>(out, x, stride, panel),
            8 => avx512_rows::<8>(out, x, stride, panel),
            9 => avx512_rows::<9>(out, x, stride, panel),
            10 => avx512_rows::<10>(out, x, stride, panel),
            11 => avx512_rows::<11>(out, x, stride, panel),
            _ => avx512_rows::<ROWS_512>(out, x, stride, panel),
        }
    }

    /// [`avx512_vnni`] for R rows: each broadcast of an input group feeds
    /// both halves of the panel (2R accumulators).
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    unsafe fn avx512_rows<const R: usize>(out: &mut [i32], x: &[u8], stride: usize, panel: &[i8]) {
        let (xp, wp) = (x.as_ptr(), panel.as_ptr());
        let mut lo = [_mm512_setzero_si512(); R];
        let mut hi = [_mm512_setzero_si512(); R];
        for g in 0..stride / GROUP {
            prefetch_ahead(wp, g);
            let at = wp.add(g * GROUP_BYTES);
            let a = _mm512_loadu_si512(at as *const _);
            let b = _mm512_loadu_si512(at.add(LANES * GROUP) as *const _);
            for r in 0..R {
                let v = _mm512_set1_epi32(four(xp, stride, r, g));
                lo[r] = _mm512_dpbusd_epi32(lo[r], v, a);
                hi[r] = _mm512_dpbusd_epi32(hi[r], v, b);
            }
        }
        for r in 0..R {
            let o = out.as_mut_ptr().add(r * PANEL);
            _mm512_storeu_si512(o as *mut _, lo[r]);
            _mm512_storeu_si512(o.add(LANES) as *mut _, hi[r]);
        }
    }

    /// `x` biased as for [`avx512_vnni`]; the panel a 16-column half at a time.
    ///
    /// # Safety
    /// The CPU must have AVX2 and AVX-VNNI; bounds as [`avx512_vnni`], nr <= 4.
    #[target_feature(enable = "avx2,avxvnni")]
    pub unsafe fn avx_vnni(out: &mut [i32], x: &[u8], stride: usize, panel: &[i8], nr: usize) {
        halves(out, x.as_ptr(), stride, panel, nr, |acc, v, w| {
            _mm256_dpbusd_avx_epi32(acc, v, w)
        });
    }

    /// Without VNNI: |x| (u8) times w with x's sign (i8) in pairs to i16
    /// (at most 2 x 127 x 127, so never saturating), pairs to i32.
    ///
    /// # Safety
    /// The CPU must have AVX2; bounds as [`avx512_vnni`], nr <= 4.
    #[target_feature(enable = "avx2")]
    pub unsafe fn avx2(out: &mut [i32], x: &[u8], stride: usize, panel: &[i8], nr: usize) {
        let ones = _mm256_set1_epi16(1);
        halves(out, x.as_ptr(), stride, panel, nr, |acc, v, w| {
            let mag = _mm256_sign_epi8(v, v);
            let dot = _mm256_madd_epi16(_mm256_maddubs_epi16(mag, _mm256_sign_epi8(w, v)), ones);
            _mm256_add_epi32(acc, dot)
        });
    }

    /// The 256-bit kernels' pass: each 16-column half of the panel, nr <= 4
    /// rows at a time, `step(acc, four input codes broadcast, 8 columns' codes)`
    /// adding the products to acc.
    #[inline(always)]
    unsafe fn halves<T>(
        out: &mut [i32],
        xp: *const T,
        stride: usize,
        panel: &[i8],
        nr: usize,
        step: impl Fn(__m256i, __m256i, __m256i) -> __m256i,
    ) {
        for half in 0..2 {
            let wp = panel.as_ptr().add(half * LANES * GROUP);
            let mut lo = [_mm256_setzero_si256(); ROWS];
            let mut hi = [_mm256_setzero_si256(); ROWS];
            for g in 0..stride / GROUP {
                if half == 0 {
                    prefetch_ahead(wp, g);
                }
                let (wl, wh) = quarters(wp, g);
                for r in 0..nr {
                    let v = _mm256_set1_epi32(four(xp, stride, r, g));
                    lo[r] = step(lo[r], v, wl);
                    hi[r] = step(hi[r], v, wh);
                }
            }
            store(out, half, &lo, &hi, nr);
        }
    }

    /// [`super::weight_only_panel`] with AVX-512 F: byte i of every
    /// column's 4-byte lane sign-extended to i32 (shift left, shift right),
    /// converted, times input value 4g + i; an accumulator per (half, i).
    ///
    /// # Safety
    /// The CPU must have AVX-512 F; `x` holds whole groups and `panel`
    /// x.len() x 32 codes.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn avx512_weight_only(out: &mut [f32; PANEL], x: &[f32], panel: &[i8]) {
        let wp = panel.as_ptr();
        let mut acc = [[_mm512_setzero_ps(); GROUP]; 2];
        for g in 0..x.len() / GROUP {
            prefetch_ahead(wp, g);
            let xs = x.as_ptr().add(g * GROUP);
            for (half, acc) in acc.iter_mut().enumerate() {
                let codes =
                    _mm512_loadu_si512(wp.add(g * GROUP_BYTES + half * LANES * GROUP) as *const _);
                let bytes = [
                    _mm512_srai_epi32::<24>(_mm512_slli_epi32::<24>(codes)),
                    _mm512_srai_epi32::<24>(_mm512_slli_epi32::<16>(codes)),
                    _mm512_srai_epi32::<24>(_mm512_slli_epi32::<8>(codes)),
                    _mm512_srai_epi32::<24>(codes),
                ];
                for (i, (a, b)) in acc.iter_mut().zip(bytes).enumerate() {
                    *a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(b), _mm512_set1_ps(*xs.add(i)), *a);
                }
            }
        }
        for (half, acc) in acc.iter().enumerate() {
            let sum = _mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3]));
            _mm512_storeu_ps(out.as_mut_ptr().add(half * LANES), sum);
        }
    }

    /// [`avx512_weight_only`] with AVX2 + FMA, 8 columns a vector.
    ///
    /// # Safety
    /// The CPU must have AVX2 and FMA; bounds as [`avx512_weight_only`].
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn avx2_weight_only(out: &mut [f32; PANEL], x: &[f32], panel: &[i8]) {
        let wp = panel.as_ptr();
        // per 8-column quarter: one accumulator for bytes 0 and 2, one for 1 and 3
        let mut acc = [[_mm256_setzero_ps(); 2]; PANEL / 8];
        for g in 0..x.len() / GROUP {
            prefetch_ahead(wp, g);
            let xs = x.as_ptr().add(g * GROUP);
            let v = [0, 1, 2, 3].map(|i| _mm256_set1_ps(*xs.add(i)));
            for (q, acc) in acc.iter_mut().enumerate() {
                let codes = _mm256_loadu_si256(wp.add(g * GROUP_BYTES + q * 32) as *const _);
                let bytes = [
                    _mm256_srai_epi32::<24>(_mm256_slli_epi32::<24>(codes)),
                    _mm256_srai_epi32::<24>(_mm256_slli_epi32::<16>(codes)),
                    _mm256_srai_epi32::<24>(_mm256_slli_epi32::<8>(codes)),
                    _mm256_srai_epi32::<24>(codes),
                ];
                for (i, b) in bytes.into_iter().enumerate() {
                    acc[i % 2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(b), v[i], acc[i % 2]);
                }
            }
        }
        for (q, acc) in acc.iter().enumerate() {
            _mm256_storeu_ps(out.as_mut_ptr().add(q * 8), _mm256_add_ps(acc[0], acc[1]));
        }
    }

    /// Group g of a panel's half (16 columns x 4 codes at `wp`) as two
    /// 8-column quarters.
    #[inline(always)]
    unsafe fn quarters(wp: *const i8, g: usize) -> (__m256i, __m256i) {
        let b = wp.add(g * GROUP_BYTES);
        (
            _mm256_loadu_si256(b as *const _),
            _mm256_loadu_si256(b.add(32) as *const _),
        )
    }

    /// Rows' sums for columns 16 half..16 half + 16: `out[r]` = [`lo[r]` | `hi[r]`].
    #[inline(always)]
    unsafe fn store(
        out: &mut [i32],
        half: usize,
        lo: &[__m256i; ROWS],
        hi: &[__m256i; ROWS],
        nr: usize,
    ) {
        for r in 0..nr {
            let o = out.as_mut_ptr().add(r * PANEL + half * LANES);
            _mm256_storeu_si256(o as *mut _, lo[r]);
            _mm256_storeu_si256(o.add(8) as *mut _, hi[r]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::Rng;

    impl Kernel {
        /// Every kernel `f` can run, fastest first.
        pub fn available(f: Features) -> Vec<Kernel> {
            let mut out = Vec::new();
            if f.avx512_vnni {
                out.push(Kernel::Avx512Vnni);
            }
            if f.avx_vnni {
                out.push(Kernel::AvxVnni);
            }
            if f.avx2 {
                out.push(Kernel::Avx2);
            }
            out.push(Kernel::Portable);
            out
        }
    }

    impl Int8Weight {
        /// Code of row i, column j.
        fn code(&self, i: usize, j: usize) -> i8 {
            let (p, c, groups) = (j / PANEL, j % PANEL, self.k.div_ceil(GROUP));
            self.data[(p * groups + i / GROUP) * GROUP_BYTES + c * GROUP + i % GROUP]
        }

        /// What W holds after quantization (its codes times their scales), k x n.
        pub fn dequantized(&self) -> Vec<f32> {
            let mut out = vec![0.0; self.k * self.n];
            for i in 0..self.k {
                for j in 0..self.n {
                    out[i * self.n + j] = self.code(i, j) as f32 * self.scales[j];
                }
            }
            out
        }
    }

    /// sums (rows x panels*32) = the exact i32 products of every row's codes
    /// with every column, by `kernel` (which this CPU must have).
    pub fn products(kernel: Kernel, x: &Int8Rows, w: &Int8Weight, rows: usize) -> Vec<i32> {
        let panels = w.n.div_ceil(PANEL);
        let width = panels * PANEL;
        let mut sums = vec![0i32; rows * width];
        let mut tile = vec![0i32; rows * PANEL];
        for p in 0..panels {
            panel_sums(kernel, &mut tile, x, w, p, rows);
            let excess = excess(kernel, w, p);
            for r in 0..rows {
                let row = &mut sums[r * width + p * PANEL..][..PANEL];
                for ((s, &t), &e) in row.iter_mut().zip(&tile[r * PANEL..]).zip(&excess) {
                    *s = t - e;
                }
            }
        }
        sums
    }

    fn random(n: usize, seed: u64) -> Vec<f32> {
        let mut rng = Rng::new(seed);
        (0..n).map(|_| rng.normal() as f32).collect()
    }

    /// The products by definition: every code widened to i64.
    fn reference(x: &Int8Rows, w: &Int8Weight, rows: usize) -> Vec<i64> {
        let deq = |i: usize, j: usize| {
            let (p, c, groups) = (j / PANEL, j % PANEL, w.k.div_ceil(GROUP));
            w.data[(p * groups + i / GROUP) * PANEL * GROUP + c * GROUP + i % GROUP] as i64
        };
        let mut out = vec![0i64; rows * w.n];
        for r in 0..rows {
            for j in 0..w.n {
                out[r * w.n + j] = (0..w.k).map(|i| x.code(r, i) as i64 * deq(i, j)).sum();
            }
        }
        out
    }

    #[test]
    fn quantizing_rounds_ties_to_even_clamps_and_sends_nan_to_zero() {
        let plain =
            |x: f32, inv: f32| (x * inv).round_ties_even().clamp(-127.0, 127.0) as i32 as i8;
        let mut xs = vec![
            0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, -126.5, 127.5, -127.5,
        ];
        xs.extend([
            0.0,
            -0.0,
            1e-30,
            1e30,
            -1e30,
            f32::INFINITY,
            f32::NEG_INFINITY,
        ]);
        xs.extend(random(4096, 9).iter().map(|v| v * 200.0));
        for &x in &xs {
            for inv in [1.0, 0.37, 127.0 / 3.1] {
                assert_eq!(quantize(x, inv), plain(x, inv), "{x} x {inv}");
            }
        }
        assert_eq!(quantize(f32::NAN, 1.0), 0);
    }

    #[test]
    fn every_kernel_this_cpu_has_gives_the_exact_integer_products() {
        let stats = Arc::new(MemoryStats::default());
        let kernels = Kernel::available(Features::detect());
        eprintln!("int8 kernels here: {kernels:?}");
        // Sizes that are not multiples of the group (4), the panel (32) or the
        // row tiles (4, 12), and runs of panels past the prefetch distance.
        for (rows, k, n) in [
            (1, 1, 1),
            (3, 5, 17),
            (7, 131, 50),
            (4, 64, 16),
            (9, 768, 33),
            (13, 100, 20),
            (12, 64, 32),
            (16, 200, 70),
            (12, 768, 96),
        ] {
            let w = random(k * n, 1 + k as u64);
            let x = random(rows * k, 2 + n as u64);
            for layout in [WeightLayout::InOut, WeightLayout::OutIn] {
                let packed = Int8Weight::new(&w, layout, k, n, &stats);
                let want = reference(&Int8Rows::new(&x, rows, k, Kernel::Portable), &packed, rows);
                let width = n.div_ceil(PANEL) * PANEL;
                for &kernel in &kernels {
                    let q = Int8Rows::new(&x, rows, k, kernel);
                    let got = products(kernel, &q, &packed, rows);
                    for r in 0..rows {
                        for j in 0..n {
                            assert_eq!(
                                got[r * width + j] as i64,
                                want[r * n + j],
                                "{kernel:?} rows {rows} k {k} n {n} at ({r}, {j})"
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn every_weight_only_kernel_this_cpu_has_matches_an_f64_reference() {
        let stats = Arc::new(MemoryStats::default());
        for (k, n) in [(1, 1), (5, 17), (131, 50), (768, 96)] {
            let w = random(k * n, 3 + k as u64);
            let x = random(k, 4 + n as u64);
            let packed = Int8Weight::new(&w, WeightLayout::InOut, k, n, &stats);
            let mut padded = vec![0.0f32; k.div_ceil(GROUP) * GROUP];
            padded[..k].copy_from_slice(&x);
            for kernel in Kernel::available(Features::detect()) {
                for p in 0..n.div_ceil(PANEL) {
                    let mut got = [0.0f32; PANEL];
                    weight_only_panel(kernel, &mut got, &padded, packed.panel(p));
                    for (c, &got) in got.iter().enumerate().take(n - p * PANEL) {
                        let j = p * PANEL + c;
                        let terms = (0..k).map(|i| x[i] as f64 * packed.code(i, j) as f64);
                        let (want, size) = terms.fold((0.0, 0.0), |(s, a), t| (s + t, a + t.abs()));
                        assert!(
                            (got as f64 - want).abs() <= 1e-6 * size.max(1.0),
                            "{kernel:?} weight-only k {k} n {n} column {j}: {got} vs {want}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn one_row_is_multiplied_by_the_dequantized_weights_in_f32() {
        // the weight-only path: only W is quantized, so the product is
        // x @ dequantized(W) to float rounding, with bias and accumulation
        let stats = Arc::new(MemoryStats::default());
        let (k, n) = (1000, STREAMED.div_ceil(1000));
        let (w, x, bias) = (random(k * n, 11), random(k, 12), random(n, 13));
        let packed = Int8Weight::new(&w, WeightLayout::InOut, k, n, &stats);
        let deq = packed.dequantized();
        let mut out = vec![0.25f32; n];
        matmul_int8(MatmulDecode {
            out: &mut out,
            inp: &x,
            w: &packed,
            bias: Some(&bias),
            dims: (1, k, n),
            accumulate: true,
        });
        for j in 0..n {
            let want: f64 = (0..k)
                .map(|i| x[i] as f64 * deq[i * n + j] as f64)
                .sum::<f64>()
                + bias[j] as f64
                + 0.25;
            assert!(
                (out[j] as f64 - want).abs() < 1e-4,
                "column {j}: {} vs {want}",
                out[j]
            );
        }
    }

    #[test]
    fn one_row_against_a_small_matrix_is_an_int8_product() {
        // below STREAMED the row is quantized as every row of a batch is:
        // its result is bit for bit that row's within a batch
        let stats = Arc::new(MemoryStats::default());
        let (k, n) = (200, 70);
        let (w, x) = (random(k * n, 14), random(k, 15));
        let packed = Int8Weight::new(&w, WeightLayout::InOut, k, n, &stats);
        let (mut one, mut two) = (vec![0.0f32; n], vec![0.0f32; 2 * n]);
        matmul_int8(MatmulDecode {
            out: &mut one,
            inp: &x,
            w: &packed,
            bias: None,
            dims: (1, k, n),
            accumulate: false,
        });
        matmul_int8(MatmulDecode {
            out: &mut two,
            inp: &[x.clone(), x].concat(),
            w: &packed,
            bias: None,
            dims: (2, k, n),
            accumulate: false,
        });
        assert_eq!(one, two[..n]);
    }

    #[test]
    fn extreme_codes_do_not_saturate() {
        // Every code at +-127: the AVX2 pairs reach 2 x 127 x 127.
        let stats = Arc::new(MemoryStats::default());
        let (rows, k, n) = (2, 64, 16);
        let w: Vec<f32> = (0..k * n)
            .map(|i| if i % 3 == 0 { -1.0 } else { 1.0 })
            .collect();
        let x: Vec<f32> = (0..rows * k)
            .map(|i| if i % 2 == 0 { -1.0 } else { 1.0 })
            .collect();
        let packed = Int8Weight::new(&w, WeightLayout::InOut, k, n, &stats);
        let want = reference(&Int8Rows::new(&x, rows, k, Kernel::Portable), &packed, rows);
        for kernel in Kernel::available(Features::detect()) {
            let got = products(kernel, &Int8Rows::new(&x, rows, k, kernel), &packed, rows);
            for r in 0..rows {
                for j in 0..n {
                    assert_eq!(got[r * PANEL + j] as i64, want[r * n + j], "{kernel:?}");
                }
            }
        }
    }

    #[test]
    fn the_dispatcher_takes_the_fastest_kernel_the_cpu_has() {
        let f = |avx512_vnni, avx_vnni, avx2| Features {
            avx512_vnni,
            avx_vnni,
            avx2,
        };
        assert_eq!(Kernel::best(f(true, true, true)), Kernel::Avx512Vnni);
        assert_eq!(Kernel::best(f(false, true, true)), Kernel::AvxVnni);
        assert_eq!(Kernel::best(f(false, false, true)), Kernel::Avx2);
        assert_eq!(Kernel::best(f(false, false, false)), Kernel::Portable);
        assert_eq!(
            Kernel::available(f(true, false, true)),
            [Kernel::Avx512Vnni, Kernel::Avx2, Kernel::Portable]
        );
        assert_eq!(Kernel::here(), Kernel::best(Features::detect()));
    }

    #[test]
    fn the_int8_product_is_within_quantization_error_of_fp32() {
        let stats = Arc::new(MemoryStats::default());
        let (rows, k, n) = (3, 256, 40);
        let w = random(k * n, 7);
        let x = random(rows * k, 8);
        let bias = random(n, 9);
        let packed = Int8Weight::new(&w, WeightLayout::InOut, k, n, &stats);
        let mut out = vec![0.5f32; rows * n];
        matmul_int8(MatmulDecode {
            out: &mut out,
            inp: &x,
            w: &packed,
            bias: Some(&bias),
            dims: (rows, k, n),
            accumulate: true,
        });
        let (mut err2, mut out2, mut worst) = (0.0f64, 0.0f64, 0.0f64);
        for r in 0..rows {
            for j in 0..n {
                let exact: f32 =
                    (0..k).map(|i| x[r * k + i] * w[i * n + j]).sum::<f32>() + bias[j] + 0.5;
                let e = (out[r * n + j] - exact).abs() as f64;
                err2 += e * e;
                out2 += (exact as f64).powi(2);
                worst = worst.max(e);
            }
        }
        // Both factors are rounded to 1/254 of their row's or column's
        // largest magnitude: about 1% of the output's RMS, never far more.
        let rms = (out2 / (rows * n) as f64).sqrt();
        let rel = (err2 / out2).sqrt();
        assert!(rel < 0.02, "RMS error {:.2}% of the output's", 100.0 * rel);
        assert!(worst < 0.06 * rms, "worst error {worst} against RMS {rms}");
        let deq = packed.dequantized();
        let worst = w
            .iter()
            .zip(&deq)
            .enumerate()
            .map(|(i, (a, b))| (a - b).abs() / packed.scales[i % n])
            .fold(0.0f32, f32::max);
        assert!(worst <= 0.5 + 1e-4, "a weight moved {worst} steps");
        assert_eq!(
            stats.report().current_bytes.params,
            (k.div_ceil(4) * 4 * n.div_ceil(PANEL) * PANEL) as u64
        );
    }
}
