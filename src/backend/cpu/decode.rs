//! Matmuls with few rows (one per sequence being decoded), which are bound by
//! reading the weights. The weights are packed once into panels of
//! [`PANEL`] output columns, each panel `k` rows deep and contiguous, so a
//! product streams every weight exactly once and sequentially; a register
//! tile of up to [`ROWS`] input rows x [`PANEL`] columns consumes it in one
//! pass, which spreads the memory traffic evenly over the arithmetic.

use super::int8::{matmul_int8, Int8Weight};
use super::math::SendPtr;
use super::product_tasks;
use crate::backend::memory::{Category, HostBuf, MemoryStats};
use crate::backend::ops::{Host, MatmulDecode};
use crate::backend::{Bf16, WeightLayout};
use rayon::prelude::*;
use std::sync::Arc;

crate::named_enum! {
    /// How packed decoding weights are stored (`generate --weights`).
    #[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
    pub enum WeightFormat {
        /// The model's fp32 weights: the same logits as the training forward.
        #[default]
        F32 = "f32",
        /// Rounded to bfloat16 once: half the bytes per token, logits within
        /// bf16 rounding of fp32 (arithmetic stays fp32).
        Bf16 = "bf16",
        /// int8 per output column with fp32 scales, the activations quantized
        /// per token: a quarter of the bytes, int8 x int8 products (VNNI, AVX2
        /// or portable, as the CPU has them; CPU only).
        Int8 = "int8",
    }
    fn name
}

/// An element a CPU kernel's operand or output is held in, a packed panel
/// included: fp32, or bfloat16 (read as it is; stored rounded).
pub trait Element: Copy + Default + Send + Sync {
    const BF16: bool;
    fn from_f32(x: f32) -> Self;
    /// The value as a bf16 product takes it: an fp32 one rounded, a bf16
    /// one widened.
    fn product_value(self) -> f32;
    /// (Used by the portable product.)
    #[cfg(any(test, not(avx2_fma)))]
    fn to_f32(self) -> f32;
    /// Eight stored values from `p` as f32 lanes.
    ///
    /// # Safety
    /// `p` must point to eight readable values.
    #[cfg(avx2_fma)]
    unsafe fn load8(p: *const Self) -> std::arch::x86_64::__m256;
}

impl Element for f32 {
    const BF16: bool = false;
    fn from_f32(x: f32) -> Self {
        x
    }
    fn product_value(self) -> f32 {
        round_to_bf16(self)
    }
    #[cfg(any(test, not(avx2_fma)))]
    fn to_f32(self) -> f32 {
        self
    }
    #[cfg(avx2_fma)]
    #[inline(always)]
    unsafe fn load8(p: *const Self) -> std::arch::x86_64::__m256 {
        std::arch::x86_64::_mm256_loadu_ps(p)
    }
}

impl Element for Bf16 {
    const BF16: bool = true;
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        Bf16::from_f32(x)
    }
    fn product_value(self) -> f32 {
        self.to_f32()
    }
    #[cfg(any(test, not(avx2_fma)))]
    fn to_f32(self) -> f32 {
        Bf16::to_f32(self)
    }
    /// Widens eight u16 to u32 and shifts them into the high half.
    #[cfg(avx2_fma)]
    #[inline(always)]
    unsafe fn load8(p: *const Self) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        let wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(p as *const __m128i));
        _mm256_castsi256_ps(_mm256_slli_epi32::<16>(wide))
    }
}

/// `x` as bf16 would store it, widened back: what a bf16 panel holds.
#[inline]
pub fn round_to_bf16(x: f32) -> f32 {
    f32::from_bits((Bf16::from_f32(x).0 as u32) << 16)
}

/// A weight matrix packed for `matmul_decode`.
pub enum PackedWeight {
    F32(HostBuf<f32>),
    Bf16(HostBuf<Bf16>),
    Int8(Int8Weight),
}

impl PackedWeight {
    /// Packs W (k x n, in `layout`) in `format`, counted as parameters.
    pub fn new(
        w: &[f32],
        layout: WeightLayout,
        k: usize,
        n: usize,
        format: WeightFormat,
        stats: &Arc<MemoryStats>,
    ) -> Self {
        fn packed<T: Element>(
            w: &[f32],
            layout: WeightLayout,
            k: usize,
            n: usize,
            stats: &Arc<MemoryStats>,
        ) -> HostBuf<T> {
            let mut buf = HostBuf::zeros(packed_len(k, n), Category::Params, stats.clone());
            pack(&mut buf, w, layout, k, n);
            buf
        }
        match format {
            WeightFormat::F32 => PackedWeight::F32(packed(w, layout, k, n, stats)),
            WeightFormat::Bf16 => PackedWeight::Bf16(packed(w, layout, k, n, stats)),
            WeightFormat::Int8 => PackedWeight::Int8(Int8Weight::new(w, layout, k, n, stats)),
        }
    }
}

/// Output columns per packed panel (two AVX vectors).
pub const PANEL: usize = 16;
/// Input rows per register tile (12 accumulators of the 16 AVX registers).
const ROWS: usize = 6;
/// Multiply-adds a task of a packed product gets at least
/// ([`product_tasks`]): about a microsecond of the fp32 kernel's.
const GRAIN: usize = 1 << 16;
/// Depth of a panel block kept in L1 while every row group passes over it.
const DEPTH: usize = 512;

/// Elements that W (k x n) takes once packed.
fn packed_len(k: usize, n: usize) -> usize {
    k * n.div_ceil(PANEL) * PANEL
}

/// Packs W into panels: panel p holds W[i, 16p + c] at p*16k + 16i + c,
/// zero past column n.
fn pack<T: Element>(dst: &mut [T], w: &[f32], layout: WeightLayout, k: usize, n: usize) {
    assert!(dst.len() >= packed_len(k, n) && w.len() >= k * n);
    dst[..packed_len(k, n)]
        .par_chunks_mut(k * PANEL)
        .enumerate()
        .for_each(|(p, panel)| {
            for c in 0..PANEL {
                let j = p * PANEL + c;
                for i in 0..k {
                    panel[i * PANEL + c] = T::from_f32(match (j < n, layout) {
                        (false, _) => 0.0,
                        (true, WeightLayout::InOut) => w[i * n + j],
                        (true, WeightLayout::OutIn) => w[j * k + i],
                    });
                }
            }
        });
}

/// out (rows, n) = [out +] inp (rows, k) @ W + bias.
pub fn matmul_decode(op: MatmulDecode<'_, Host<'_>, PackedWeight>) {
    match op.w {
        PackedWeight::F32(p) => packed_product(op.with_weight(&p[..])),
        PackedWeight::Bf16(p) => packed_product(op.with_weight(&p[..])),
        PackedWeight::Int8(w) => matmul_int8(op.with_weight(w)),
    }
}

/// [`matmul_decode`] on f32 or bf16 panels.
fn packed_product<T: Element>(op: MatmulDecode<'_, Host<'_>, [T]>) {
    let MatmulDecode {
        out,
        inp,
        w: packed,
        bias,
        dims: (rows, k, n),
        accumulate,
    } = op;
    assert!(out.len() >= rows * n && inp.len() >= rows * k);
    assert!(packed.len() >= packed_len(k, n) && bias.is_none_or(|b| b.len() >= n));
    let panels = n.div_ceil(PANEL);
    let tasks = product_tasks(rows, k, n, panels, GRAIN);
    let dst = &SendPtr(out.as_mut_ptr());
    let groups = rows.div_ceil(ROWS);
    (0..tasks).into_par_iter().for_each(|t| {
        // One PANEL-wide accumulator tile per row, ROWS rows per register tile.
        let mut tiles = vec![0.0f32; groups * ROWS * PANEL];
        for p in panels * t / tasks..panels * (t + 1) / tasks {
            let (j0, width) = (p * PANEL, PANEL.min(n - p * PANEL));
            // SAFETY: rows r, columns j0..j0 + width are inside out and
            // belong to this task's panel alone.
            let out_row = |r: usize| unsafe { dst.slice(r * n + j0, width) };
            for (r, acc) in tiles.chunks_exact_mut(PANEL).take(rows).enumerate() {
                acc.fill(0.0);
                if accumulate {
                    acc[..width].copy_from_slice(out_row(r));
                }
                if let Some(b) = bias {
                    acc[..width]
                        .iter_mut()
                        .zip(&b[j0..j0 + width])
                        .for_each(|(a, &b)| *a += b);
                }
            }
            let panel = &packed[p * k * PANEL..(p + 1) * k * PANEL];
            // Every row group passes over a block while it is in L1; each
            // prefetches its share of the stream DEPTH rows ahead.
            for i0 in (0..k).step_by(DEPTH) {
                let depth = DEPTH.min(k - i0);
                let w = &panel[i0 * PANEL..(i0 + depth) * PANEL];
                for (g, tile) in tiles.chunks_exact_mut(ROWS * PANEL).enumerate() {
                    let (r0, nr) = (g * ROWS, ROWS.min(rows - g * ROWS));
                    let tile: &mut [f32; ROWS * PANEL] = tile.try_into().expect("tile size");
                    let x = &inp[r0 * k..(r0 + nr) * k];
                    let ahead = Ahead {
                        at: w
                            .as_ptr()
                            .wrapping_add((DEPTH + g * depth / groups) * PANEL),
                        step: PANEL / groups,
                    };
                    match nr {
                        1 => tile_product::<T, 1>(tile, x, k, i0, w, ahead),
                        2 => tile_product::<T, 2>(tile, x, k, i0, w, ahead),
                        3 => tile_product::<T, 3>(tile, x, k, i0, w, ahead),
                        4 => tile_product::<T, 4>(tile, x, k, i0, w, ahead),
                        5 => tile_product::<T, 5>(tile, x, k, i0, w, ahead),
                        _ => tile_product::<T, 6>(tile, x, k, i0, w, ahead),
                    }
                }
            }
            for (r, acc) in tiles.chunks_exact(PANEL).take(rows).enumerate() {
                out_row(r).copy_from_slice(&acc[..width]);
            }
        }
    });
}

/// Where a tile prefetches: `at + i * step` at its step i.
#[derive(Clone, Copy)]
struct Ahead<T> {
    at: *const T,
    step: usize,
}

/// tile (R x PANEL) += x[:, i0..i0 + depth] @ w (depth x PANEL); x has R
/// rows of stride k.
#[inline(always)]
fn tile_product<T: Element, const R: usize>(
    tile: &mut [f32; ROWS * PANEL],
    x: &[f32],
    k: usize,
    i0: usize,
    w: &[T],
    ahead: Ahead<T>,
) {
    let depth = w.len() / PANEL;
    assert!(R <= ROWS && x.len() >= (R - 1) * k + i0 + depth);
    #[cfg(avx2_fma)]
    // SAFETY: bounds checked above; AVX2 + FMA are enabled for this build.
    unsafe {
        avx2::tile_product::<T, R>(tile, x.as_ptr().add(i0), k, w.as_ptr(), depth, ahead)
    }
    #[cfg(not(avx2_fma))]
    {
        let _ = ahead;
        portable_tile_product::<T, R>(tile, x, k, i0, w);
    }
}

/// The same product in plain Rust (other targets, and the reference the
/// vector path is tested against).
#[cfg(any(test, not(avx2_fma)))]
fn portable_tile_product<T: Element, const R: usize>(
    tile: &mut [f32; ROWS * PANEL],
    x: &[f32],
    k: usize,
    i0: usize,
    w: &[T],
) {
    for (i, wrow) in w.chunks_exact(PANEL).enumerate() {
        for r in 0..R {
            let xv = x[r * k + i0 + i];
            tile[r * PANEL..(r + 1) * PANEL]
                .iter_mut()
                .zip(wrow)
                .for_each(|(a, &w)| *a += xv * w.to_f32());
        }
    }
}

#[cfg(avx2_fma)]
mod avx2 {
    use super::{Ahead, Element, PANEL, ROWS};
    use std::arch::x86_64::*;

    /// Two accumulators per row (one per half panel), a broadcast of x per
    /// row and step, two weight loads per step. Up to 3 rows, two steps run
    /// on separate accumulators so the FMA latency does not serialise them.
    ///
    /// # Safety
    /// `x` must have R rows of stride `k` with `depth` readable floats each;
    /// `w` must hold `depth * PANEL` values.
    #[inline(always)]
    pub unsafe fn tile_product<T: Element, const R: usize>(
        tile: &mut [f32; ROWS * PANEL],
        x: *const f32,
        k: usize,
        w: *const T,
        depth: usize,
        ahead: Ahead<T>,
    ) {
        let t = tile.as_mut_ptr();
        let zero = _mm256_setzero_ps();
        let (mut lo, mut hi) = ([zero; R], [zero; R]);
        let (mut lo2, mut hi2) = ([zero; R], [zero; R]);
        for r in 0..R {
            lo[r] = _mm256_loadu_ps(t.add(r * PANEL));
            hi[r] = _mm256_loadu_ps(t.add(r * PANEL + 8));
        }
        let mut i = 0;
        if R <= 3 {
            while i + 2 <= depth {
                let (w0, w1) = (w.add(i * PANEL), w.add((i + 1) * PANEL));
                _mm_prefetch::<_MM_HINT_T0>(ahead.at.wrapping_add(i * ahead.step) as *const i8);
                _mm_prefetch::<_MM_HINT_T0>(
                    ahead.at.wrapping_add((i + 1) * ahead.step) as *const i8
                );
                let (a0, a1) = (T::load8(w0), T::load8(w0.add(8)));
                let (b0, b1) = (T::load8(w1), T::load8(w1.add(8)));
                for r in 0..R {
                    let x0 = _mm256_broadcast_ss(&*x.add(r * k + i));
                    let x1 = _mm256_broadcast_ss(&*x.add(r * k + i + 1));
                    lo[r] = _mm256_fmadd_ps(x0, a0, lo[r]);
                    hi[r] = _mm256_fmadd_ps(x0, a1, hi[r]);
                    lo2[r] = _mm256_fmadd_ps(x1, b0, lo2[r]);
                    hi2[r] = _mm256_fmadd_ps(x1, b1, hi2[r]);
                }
                i += 2;
            }
        }
        while i < depth {
            let w0 = w.add(i * PANEL);
            _mm_prefetch::<_MM_HINT_T0>(ahead.at.wrapping_add(i * ahead.step) as *const i8);
            let (a0, a1) = (T::load8(w0), T::load8(w0.add(8)));
            for r in 0..R {
                let x0 = _mm256_broadcast_ss(&*x.add(r * k + i));
                lo[r] = _mm256_fmadd_ps(x0, a0, lo[r]);
                hi[r] = _mm256_fmadd_ps(x0, a1, hi[r]);
            }
            i += 1;
        }
        for r in 0..R {
            _mm256_storeu_ps(t.add(r * PANEL), _mm256_add_ps(lo[r], lo2[r]));
            _mm256_storeu_ps(t.add(r * PANEL + 8), _mm256_add_ps(hi[r], hi2[r]));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::check::*;
    use super::*;
    use crate::rng::Rng;

    #[test]
    fn bf16_rounds_to_nearest_even() {
        let bf = |x: f32| Bf16::from_f32(x).to_f32();
        assert_eq!(bf(1.0), 1.0);
        assert_eq!(bf(-3.5), -3.5);
        // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties go to the even 1.
        assert_eq!(bf(1.0 + 1.0 / 256.0), 1.0);
        // 1 + 3 * 2^-8 is halfway between 1 + 2^-7 and 1 + 2^-6: to the even 1 + 2^-6.
        assert_eq!(bf(1.0 + 3.0 / 256.0), 1.0 + 1.0 / 64.0);
        assert_eq!(bf(1.0 + 1.0 / 256.0 + 1e-6), 1.0 + 1.0 / 128.0);
        assert!(bf(f32::NAN).is_nan());
        assert_eq!(bf(f32::INFINITY), f32::INFINITY);
        let x = 0.123_456_79f32;
        assert!((bf(x) - x).abs() <= x * 2f32.powi(-9));
    }

    #[test]
    fn packed_product_matches_an_f64_reference_for_every_format_row_count_and_layout() {
        let mut rng = Rng::new(5);
        // n not a multiple of the panel, k over one depth block.
        let (k, n) = (DEPTH + 37, 3 * PANEL + 5);
        let stats = Arc::new(MemoryStats::default());
        let formats = [
            (WeightFormat::F32, (|x| x) as fn(f32) -> f32),
            (WeightFormat::Bf16, |x| Bf16::from_f32(x).to_f32()),
        ];
        for (format, stored) in formats {
            for layout in [WeightLayout::InOut, WeightLayout::OutIn] {
                let w = randn(&mut rng, k * n, 1.0 / (k as f64).sqrt());
                let bias = randn(&mut rng, n, 1.0);
                let packed = PackedWeight::new(&w, layout, k, n, format, &stats);
                let wij = |i: usize, j: usize| {
                    stored(match layout {
                        WeightLayout::InOut => w[i * n + j],
                        WeightLayout::OutIn => w[j * k + i],
                    }) as f64
                };
                for rows in [1, 2, 5, 6, 7, 12, 13] {
                    let inp = randn(&mut rng, rows * k, 1.0);
                    let base = randn(&mut rng, rows * n, 1.0);
                    for (bias, accumulate) in [(None, false), (Some(&bias[..]), true)] {
                        let want: Vec<f64> = (0..rows * n)
                            .map(|o| {
                                let (r, j) = (o / n, o % n);
                                let start = if accumulate { base[o] as f64 } else { 0.0 };
                                let b = bias.map_or(0.0, |b| b[j] as f64);
                                let dot: f64 =
                                    (0..k).map(|i| inp[r * k + i] as f64 * wij(i, j)).sum();
                                start + b + dot
                            })
                            .collect();
                        let mut got = base.clone();
                        matmul_decode(MatmulDecode {
                            out: &mut got,
                            inp: &inp,
                            w: &packed,
                            bias,
                            dims: (rows, k, n),
                            accumulate,
                        });
                        assert_close(format.name(), &got, &want, 1e-5);
                    }
                }
            }
        }
        let bytes = |format| {
            let before = stats.report().current_bytes.params;
            let _p = PackedWeight::new(&[0.0; 32 * 8], WeightLayout::InOut, 32, 8, format, &stats);
            stats.report().current_bytes.params - before
        };
        // 8 columns pad to one 16-column panel of 32 rows.
        assert_eq!(bytes(WeightFormat::F32), 32 * 16 * 4);
        assert_eq!(bytes(WeightFormat::Bf16), 32 * 16 * 2);
    }

    #[test]
    fn vector_tile_matches_the_portable_one() {
        let mut rng = Rng::new(6);
        let (k, depth) = (40, 33);
        let x = randn(&mut rng, ROWS * k, 1.0);
        let w = randn(&mut rng, depth * PANEL, 1.0);
        let half: Vec<Bf16> = w.iter().map(|&v| Bf16::from_f32(v)).collect();
        let start = randn(&mut rng, ROWS * PANEL, 1.0);
        // Paired steps (2 rows) and single steps (5 rows), both formats.
        let mut a: [f32; ROWS * PANEL] = start.clone().try_into().unwrap();
        let mut b = a;
        let ahead = Ahead {
            at: w.as_ptr(),
            step: PANEL,
        };
        tile_product::<f32, 2>(&mut a, &x, k, 7, &w, ahead);
        portable_tile_product::<f32, 2>(&mut b, &x, k, 7, &w);
        assert_close("tile 2", &a, &to64(&b), 1e-5);
        assert_eq!(a[2 * PANEL..], start[2 * PANEL..]);
        tile_product::<f32, 5>(&mut a, &x, k, 7, &w, ahead);
        portable_tile_product::<f32, 5>(&mut b, &x, k, 7, &w);
        assert_close("tile 5", &a, &to64(&b), 1e-5);
        let ahead = Ahead {
            at: half.as_ptr(),
            step: PANEL,
        };
        tile_product::<Bf16, 3>(&mut a, &x, k, 7, &half, ahead);
        portable_tile_product::<Bf16, 3>(&mut b, &x, k, 7, &half);
        assert_close("bf16 tile 3", &a, &to64(&b), 1e-5);
        tile_product::<Bf16, 6>(&mut a, &x, k, 7, &half, ahead);
        portable_tile_product::<Bf16, 6>(&mut b, &x, k, 7, &half);
        assert_close("bf16 tile 6", &a, &to64(&b), 1e-5);
    }
}
