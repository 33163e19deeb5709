//! distgpt's own bf16 matmul for `--precision bf16` on CPUs with
//! AVX512-BF16: `vdpbf16ps` multiplies 32 pairs of bfloat16 and adds each
//! pair's two products to one of 16 fp32 sums, twice the multiply-adds of
//! an fp32 FMA in one instruction.
//!
//! `dst = [dst +] scale * lhs @ rhs`: both operands are rounded to bfloat16
//! (to nearest even) as they are packed, in pairs along k, into panels: the
//! left one in panels of [`MR`] rows, the right one in panels of [`NR`]
//! columns, each panel pair by pair. A micro-kernel keeps an `MR x NR`
//! block of sums in 24 registers over up to [`KC`] pairs at a time (its
//! right panel's slice stays in L1, the left block's in L2) and adds it,
//! scaled, to `dst`. The smaller operand is packed whole up front; the
//! larger one a block at a time by the rayon task that multiplies it
//! ([`MC`] rows, or [`NC`] column panels, by a share of the other side),
//! into a scratch that stays in cache, so it is never written out packed
//! and read back.
//! Every product of two bfloat16 is exact in fp32, so the result differs
//! from fp32 arithmetic on the rounded operands in the order of its sums
//! only.
//!
//! Operands and the output may each be held in fp32 or in bfloat16
//! ([`Element`]): a bfloat16 operand is packed as it is (its rounding is
//! exact), and a bfloat16 output has each micro-kernel block summed in an
//! fp32 tile in the order the fp32 output's passes over k sum it, then
//! stored rounded, so it is the fp32 output rounded, bit for bit.

use super::math::{Dims, Mat};
use super::{round_to_bf16, Element};
use crate::backend::Bf16;

/// Rows of the micro-kernel's block (one broadcast pair each).
const MR: usize = 12;
/// Columns of the micro-kernel's block: two registers of 16 sums.
const NR: usize = 32;
/// The most pairs of k a micro-kernel call sums before it adds to `dst`.
const KC: usize = 192;
/// The most rows of a task's block where the tasks pack the left operand
/// (in micro-panels of [`MR`]).
const MC: usize = 8 * MR;
/// The most column panels of a task's block where they pack the right one.
const NC: usize = 8;

/// Whether this CPU runs [`gemm()`] (AVX512-BF16, and AVX-512F, BW and VL
/// with it).
pub fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx512vl")
            && is_x86_feature_detected!("avx512bf16")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

thread_local! {
    /// The operand packed up front.
    static PACKED: super::math::Scratch<u32> = const { super::math::Scratch::new(Vec::new()) };
    /// A task's block of the operand the tasks pack.
    static BLOCK: super::math::Scratch<u32> = const { super::math::Scratch::new(Vec::new()) };
}

/// What a product's sums go onto in `dst`: nothing (overwritten), its
/// values, or, for a bfloat16 `dst`, a bias of `n` columns rounded to
/// bfloat16, added in fp32 before each sum is rounded (as a bf16 GEMM's
/// epilogue adds a bf16 bias).
#[derive(Clone, Copy)]
pub(crate) enum Onto<'a> {
    Over,
    Add,
    Bias(&'a [f32]),
}

impl From<bool> for Onto<'_> {
    /// Added to where `accumulate`, else overwritten.
    fn from(accumulate: bool) -> Self {
        match accumulate {
            true => Onto::Add,
            false => Onto::Over,
        }
    }
}

/// `dst (m x n) = [dst +] scale * lhs (m x k) @ rhs (k x n)` on bfloat16
/// operands (rounded here where held in fp32) with fp32 sums, split over
/// the pool when `threads` is more than 1. Returns false, doing nothing,
/// where the CPU has no AVX512-BF16, a view has no unit stride, a
/// bfloat16 `dst` is to be accumulated onto, or a bias is to go onto an
/// fp32 `dst` or one stored by columns (the caller runs the product
/// another way).
///
/// # Safety
/// As `math::gemm`: every element the views address for these sizes is
/// inside a live allocation, and `dst` aliases neither operand; k is at
/// least 1 (no pair would overwrite `dst`).
#[allow(clippy::too_many_arguments)] // a BLAS call's own arguments
pub(super) unsafe fn gemm<D: Element, L: Element, R: Element>(
    dims: Dims,
    dst: Mat<*mut D>,
    lhs: Mat<*const L>,
    rhs: Mat<*const R>,
    onto: Onto,
    scale: f32,
    threads: usize,
) -> bool {
    let Dims { m, n, k } = dims;
    let biased = matches!(onto, Onto::Bias(_));
    if dst.col_stride != 1 && !biased {
        // dst's rows contiguous: dst^T = rhs^T lhs^T (n x m)
        return dst.row_stride == 1
            && gemm(
                Dims { m: n, n: m, k },
                dst.t(),
                rhs.t(),
                lhs.t(),
                onto,
                scale,
                threads,
            );
    }
    let unit = |row_stride: isize, col_stride: isize| col_stride == 1 || row_stride == 1;
    if !available()
        || !unit(lhs.row_stride, lhs.col_stride)
        || !unit(rhs.row_stride, rhs.col_stride)
        || dst.col_stride != 1
        || (D::BF16 && matches!(onto, Onto::Add))
        || (!D::BF16 && biased)
    {
        return false;
    }
    debug_assert!(k > 0, "an empty product: the caller's fp32 route fills dst");
    // the larger operand is packed by the tasks a block at a time, the
    // smaller one up front
    let own = match m >= n {
        true => Side::Left,
        false => Side::Right,
    };
    let pairs = k.div_ceil(2);
    let shared = match own {
        Side::Left => n.div_ceil(NR) * NR * pairs,
        Side::Right => m.div_ceil(MR) * MR * pairs,
    };
    super::math::with_scratch(&PACKED, shared, |packed| {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the CPU has AVX512-BF16 (checked above); the views'
        // elements are readable and their sizes are the product's.
        unsafe {
            // the right operand as its columns' rows: (n x k)
            let rhs = rhs.t();
            match own {
                Side::Left => {
                    let (x, lanes, width) = (rhs, n, NR);
                    pack(packed, Operand { x, lanes, width }, k, threads)
                }
                Side::Right => {
                    let (x, lanes, width) = (lhs, m, MR);
                    pack(packed, Operand { x, lanes, width }, k, threads)
                }
            }
            multiply(lhs, rhs, own, packed, dims, dst, onto, scale, threads);
        }
    });
    true
}

/// Which operand the tasks pack.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Side {
    Left,
    Right,
}

/// The blocks of `dst` the tasks take: the packing side cut evenly into
/// blocks of at most [`MC`] rows, or of at most [`NC`] column panels (in a
/// multiple of `threads` blocks where there are panels enough, so no thread
/// waits on a last one), and the other side in as few cuts as give each
/// thread two tasks. How many, and block `t`'s first row, rows, first
/// panel and panels.
fn blocks(
    m: usize,
    n: usize,
    own: Side,
    threads: usize,
) -> (usize, impl Fn(usize) -> [usize; 4] + Sync + Send) {
    let (micro, panels) = (m.div_ceil(MR), n.div_ceil(NR));
    let others = |cuts: usize, most: usize| (2 * threads).div_ceil(cuts).min(most);
    let (row_cuts, col_cuts) = match own {
        Side::Left => {
            let cuts = m.div_ceil(MC);
            (cuts, others(cuts, panels))
        }
        Side::Right => {
            let cuts = panels.div_ceil(NC).next_multiple_of(threads).min(panels);
            (others(cuts, micro), cuts)
        }
    };
    // cut i of `units` in `cuts`: as even as whole units allow
    let span = |i: usize, cuts: usize, units: usize| (i * units / cuts, (i + 1) * units / cuts);
    (row_cuts * col_cuts, move |t| {
        let ((u0, u1), (q0, q1)) = (
            span(t / col_cuts, row_cuts, micro),
            span(t % col_cuts, col_cuts, panels),
        );
        [u0 * MR, (u1 * MR).min(m) - u0 * MR, q0, q1 - q0]
    })
}

/// Pairs of k a micro-kernel call sums: the product's pairs cut evenly
/// into the fewest passes of at most [`KC`].
fn depth(pairs: usize) -> usize {
    pairs.div_ceil(pairs.div_ceil(KC))
}

/// An operand as packing reads it: its view (`lanes x k`, a unit stride
/// on one side), its lanes, and the width of the panels they go in.
#[derive(Clone, Copy)]
struct Operand<T> {
    x: Mat<*const T>,
    lanes: usize,
    width: usize,
}

/// Packs an operand up front in panels with all `k` of it, over the pool:
/// a task a panel where each lane's k is contiguous, else [`PACK_PAIRS`]
/// pairs of every panel a task (so the source is read row after row).
///
/// # Safety
/// AVX512-BF16; the operand's elements readable; `out` holds every panel.
#[cfg(target_arch = "x86_64")]
unsafe fn pack<T: Element>(out: &mut [u32], operand: Operand<T>, k: usize, threads: usize) {
    let Operand { x, lanes, width } = operand;
    let pairs = k.div_ceil(2);
    let panels = lanes.div_ceil(width);
    debug_assert!(out.len() >= panels * pairs * width);
    let (from, to) = (x.ptr as usize, out.as_mut_ptr() as usize);
    let at = |lane: usize, p0: usize| Mat {
        ptr: (from as *const T)
            .offset(lane as isize * x.row_stride + (2 * p0) as isize * x.col_stride),
        ..x
    };
    let into = |q: usize, p0: usize| (to as *mut u32).add((q * pairs + p0) * width);
    if x.col_stride == 1 {
        // SAFETY: panel q is its own part of `out`, read from its lanes
        tasks(panels, threads, |q| unsafe {
            let lanes = width.min(lanes - q * width);
            pack_panels(into(q, 0), pairs, at(q * width, 0), lanes, k, pairs, width)
        });
    } else {
        // SAFETY: pairs p0.. of every panel are this task's
        tasks(pairs.div_ceil(PACK_PAIRS), threads, |t| unsafe {
            let p0 = t * PACK_PAIRS;
            let n = PACK_PAIRS.min(pairs - p0);
            pack_panels(into(0, p0), pairs, at(0, p0), lanes, k - 2 * p0, n, width)
        });
    }
}

/// Pairs of k a task of [`pack`] takes across every panel.
const PACK_PAIRS: usize = 8;

/// Packs `pairs` pairs of `lanes` lanes of `x` (a unit stride on one
/// side; `depth` elements of k left from its first) as bfloat16 pairs in
/// panels of `width` lanes: panel `q`, pair `p`, lane `l` at
/// `out + (q * stride + p) * width + l`, its low half element `2p` of the
/// lane's row, its high half `2p + 1` (0 past `depth`). Lanes past the
/// last are left as they are (their sums are never stored). Where each
/// lane's k is contiguous a panel at a time (transposing 16 lanes by 16
/// pairs in registers); where the lanes are, [`PACK_PAIRS`] pairs of
/// every panel at a time, so rows are read whole.
///
/// # Safety
/// AVX512-BF16; `x`'s elements readable; `out` holds every panel.
#[cfg(target_arch = "x86_64")]
unsafe fn pack_panels<T: Element>(
    out: *mut u32,
    stride: usize,
    x: Mat<*const T>,
    lanes: usize,
    depth: usize,
    pairs: usize,
    width: usize,
) {
    let lane = |q: usize, p0: usize| Mat {
        ptr: x
            .ptr
            .offset((q * width) as isize * x.row_stride + (2 * p0) as isize * x.col_stride),
        ..x
    };
    let valid = |q: usize| width.min(lanes - q * width);
    let panels = lanes.div_ceil(width);
    if x.col_stride == 1 {
        for q in 0..panels {
            let out = out.add(q * stride * width);
            avx512::pack_along(out, lane(q, 0), valid(q), (2 * pairs).min(depth), width);
        }
    } else {
        for p0 in (0..pairs).step_by(PACK_PAIRS) {
            let n = PACK_PAIRS.min(pairs - p0);
            // the next pairs' rows asked for ahead
            let next = 2 * (p0 + PACK_PAIRS)..(2 * (p0 + 2 * PACK_PAIRS)).min(depth);
            for d in next {
                let row = x.ptr.offset(d as isize * x.col_stride);
                for l in (0..lanes).step_by(16) {
                    std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(
                        row.add(l) as *const i8,
                    );
                }
            }
            for q in 0..panels {
                let out = out.add((q * stride + p0) * width);
                avx512::pack_across(out, lane(q, p0), valid(q), n, depth - 2 * p0, width);
            }
        }
    }
}

/// A view as an address and strides, which tasks may share.
fn address<T>(x: Mat<*const T>) -> Mat<usize> {
    Mat {
        ptr: x.ptr as usize,
        row_stride: x.row_stride,
        col_stride: x.col_stride,
    }
}

/// [`address`]'s view again, from `offset` elements on.
///
/// # Safety
/// `offset` stays inside the view's allocation.
unsafe fn view<T>(x: Mat<usize>, offset: isize) -> Mat<*const T> {
    Mat {
        ptr: (x.ptr as *const T).offset(offset),
        row_stride: x.row_stride,
        col_stride: x.col_stride,
    }
}

/// `f(0..count)`, over the pool when `threads` is more than 1.
fn tasks(count: usize, threads: usize, f: impl Fn(usize) + Sync + Send) {
    use rayon::prelude::*;
    if threads > 1 {
        (0..count).into_par_iter().for_each(f);
    } else {
        (0..count).for_each(f);
    }
}

/// Every block of `dst`: the side `own` names packed by the task that
/// needs it, its block's next pairs at a time (all of them for a bfloat16
/// `dst`, whose sums are rounded once), into its thread's scratch (where
/// they stay in cache while the block is multiplied by them); the other
/// packed up front into `packed` by [`pack`]. `lhs` is `m x k`, `rhs` the
/// right operand's columns' rows (`n x k`).
///
/// # Safety
/// AVX512-BF16; the operands' elements readable with a unit stride on one
/// side; `packed` as said; `dst` addresses `m x n` writable floats with
/// unit column stride.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)] // a BLAS call's own arguments
unsafe fn multiply<D: Element, L: Element, R: Element>(
    lhs: Mat<*const L>,
    rhs: Mat<*const R>,
    own: Side,
    packed: &[u32],
    dims: Dims,
    dst: Mat<*mut D>,
    onto: Onto,
    scale: f32,
    threads: usize,
) {
    let Dims { m, n, k } = dims;
    let accumulate = matches!(onto, Onto::Add);
    let pairs = k.div_ceil(2);
    // pairs a micro-kernel call sums, and pairs packed at a time: as many,
    // or, for a bfloat16 dst, all of them, its block's calls summed in an
    // fp32 tile in the same order (so it is the fp32 dst rounded)
    let kc = depth(pairs);
    let span = match D::BF16 {
        true => pairs,
        false => kc,
    };
    let (shared, c, ldc) = (packed.as_ptr() as usize, dst.ptr as usize, dst.row_stride);
    // the views as addresses, which the tasks may share
    let (lhs, rhs) = (address(lhs), address(rhs));
    let block = |[i0, rows, q0, panels]: [usize; 4], mine: &mut [u32]| {
        let (micro, cols) = (rows.div_ceil(MR), (n - q0 * NR).min(panels * NR));
        for p0 in (0..pairs).step_by(span) {
            let span = span.min(pairs - p0);
            let (x, first, lanes, width) = match own {
                Side::Left => (lhs, i0, rows, MR),
                Side::Right => (rhs, q0 * NR, cols, NR),
            };
            let at = first as isize * x.row_stride + (2 * p0) as isize * x.col_stride;
            let (into, depth) = (mine.as_mut_ptr(), k - 2 * p0);
            // SAFETY: this block's pairs p0.. into this task's scratch
            unsafe {
                match own {
                    Side::Left => {
                        pack_panels(into, span, view::<L>(x, at), lanes, depth, span, width)
                    }
                    Side::Right => {
                        pack_panels(into, span, view::<R>(x, at), lanes, depth, span, width)
                    }
                }
            };
            // pair p of this span of micro-panel u of the block's rows,
            // and of panel q of its columns
            let shared = |unit: usize, p: usize, width: usize| {
                (shared as *const u32).add((unit * pairs + p0 + p) * width)
            };
            let a = |u: usize, p: usize| match own {
                Side::Left => mine[(u * span + p) * MR..].as_ptr(),
                Side::Right => shared(i0 / MR + u, p, MR),
            };
            let b = |q: usize, p: usize| match own {
                Side::Left => shared(q0 + q, p, NR),
                Side::Right => mine[(q * span + p) * NR..].as_ptr(),
            };
            let run = |u: usize, q: usize| {
                let (i, j) = (i0 + u * MR, (q0 + q) * NR);
                let cp = (c as *mut D).offset(i as isize * ldc + j as isize);
                let (rows, cols) = (MR.min(m - i), NR.min(n - j));
                let (a, b) = (|p| a(u, p), |p| b(q, p));
                // SAFETY: the block lies inside the packed panels and dst
                unsafe {
                    if !D::BF16 {
                        let (add, cp) = (accumulate || p0 > 0, cp as *mut f32);
                        return avx512::kernel(span, a(0), b(0), cp, ldc, rows, cols, add, scale);
                    }
                    let mut tile = [0.0f32; MR * NR];
                    for p in (0..span).step_by(kc) {
                        let (kc, at) = (kc.min(span - p), tile.as_mut_ptr());
                        avx512::kernel(kc, a(p), b(p), at, NR as isize, MR, NR, p > 0, scale);
                    }
                    if let Onto::Bias(bias) = onto {
                        add_bias(&mut tile, &bias[j..j + cols], rows);
                    }
                    avx512::round(&tile, cp as *mut Bf16, ldc, rows, cols)
                }
            };
            // a panel's pairs stay in L1 while the block's rows pass
            for q in 0..panels {
                for u in 0..micro {
                    run(u, q)
                }
            }
        }
    };
    let (count, at) = blocks(m, n, own, threads);
    let mine = match own {
        Side::Left => MC * span,
        Side::Right => NC * NR * span,
    };
    tasks(count, threads, |t| {
        super::math::with_scratch(&BLOCK, mine, |mine| block(at(t), mine))
    });
}

/// A tile's first `rows` rows of sums plus `bias` (its columns' values)
/// rounded to bfloat16.
#[cfg(target_arch = "x86_64")]
fn add_bias(tile: &mut [f32; MR * NR], bias: &[f32], rows: usize) {
    for sums in tile.chunks_exact_mut(NR).take(rows) {
        for (x, &b) in sums.iter_mut().zip(bias) {
            *x += round_to_bf16(b);
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::{Bf16, Element, Mat, MR, NR};
    use std::arch::x86_64::*;
    use std::mem::transmute;

    /// The low `n` bits set (n <= 16).
    fn mask(n: usize) -> u16 {
        ((1u32 << n.min(16)) - 1) as u16
    }

    /// An `MR x NR` block of `dst` (its first `rows x cols` stored) plus
    /// `scale` times the sums of `kc` pairs of `a`'s micro-panel against
    /// `b`'s panel; `add`: onto what `dst` holds, else over it.
    #[target_feature(enable = "avx512f,avx512bf16")]
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn kernel(
        kc: usize,
        a: *const u32,
        b: *const u32,
        c: *mut f32,
        ldc: isize,
        rows: usize,
        cols: usize,
        add: bool,
        scale: f32,
    ) {
        let mut acc = [_mm512_setzero_ps(); 2 * MR];
        for p in 0..kc {
            let bp = b.add(p * NR) as *const i32;
            let b0: __m512bh = transmute(_mm512_loadu_epi32(bp));
            let b1: __m512bh = transmute(_mm512_loadu_epi32(bp.add(16)));
            let ap = a.add(p * MR);
            for r in 0..MR {
                let pair: __m512bh = transmute(_mm512_set1_epi32(*ap.add(r) as i32));
                acc[2 * r] = _mm512_dpbf16_ps(acc[2 * r], pair, b0);
                acc[2 * r + 1] = _mm512_dpbf16_ps(acc[2 * r + 1], pair, b1);
            }
        }
        let masks = [mask(cols), mask(cols.saturating_sub(16))];
        let s = _mm512_set1_ps(scale);
        for r in 0..MR {
            if r < rows {
                let row = c.offset(r as isize * ldc);
                for (h, &mk) in masks.iter().enumerate() {
                    let at = row.add(16 * h);
                    let old = match add {
                        true => _mm512_maskz_loadu_ps(mk, at),
                        false => _mm512_setzero_ps(),
                    };
                    _mm512_mask_storeu_ps(at, mk, _mm512_fmadd_ps(acc[2 * r + h], s, old));
                }
            }
        }
    }

    /// An `MR x NR` tile of fp32 sums stored rounded into `dst` (its first
    /// `rows x cols`) as [`Bf16::from_f32`] rounds: to nearest even, NaN to
    /// the quiet NaN, and subnormals kept (which `vcvtneps2bf16` flushes).
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    pub unsafe fn round(tile: &[f32; MR * NR], c: *mut Bf16, ldc: isize, rows: usize, cols: usize) {
        let (one, half) = (_mm512_set1_epi32(1), _mm512_set1_epi32(0x7fff));
        for (r, sums) in tile.chunks_exact(NR).take(rows).enumerate() {
            let row = c.offset(r as isize * ldc) as *mut i16;
            for h in 0..NR / 16 {
                let wide = _mm512_loadu_ps(sums[16 * h..].as_ptr());
                let bits = _mm512_castps_si512(wide);
                let odd = _mm512_and_si512(_mm512_srli_epi32::<16>(bits), one);
                let up = _mm512_add_epi32(bits, _mm512_add_epi32(half, odd));
                let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(wide, wide);
                let held = _mm512_mask_mov_epi32(
                    _mm512_srli_epi32::<16>(up),
                    nan,
                    _mm512_set1_epi32(0x7fc0),
                );
                let held = _mm512_cvtepi32_epi16(held);
                _mm256_mask_storeu_epi16(row.add(16 * h), mask(cols.saturating_sub(16 * h)), held);
            }
        }
    }

    /// 16 values from `at` as floats (the first `n` of them; zeros after).
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    unsafe fn load<T: Element>(at: *const T, n: usize) -> __m512 {
        if T::BF16 {
            // a bfloat16 is its float's upper half
            let held = _mm256_maskz_loadu_epi16(mask(n), at as *const i16);
            return _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(held)));
        }
        let at = at as *const f32;
        match n >= 16 {
            true => _mm512_loadu_ps(at),
            false => _mm512_maskz_loadu_ps(mask(n), at),
        }
    }

    /// 16 pairs of each of 16 lanes made 16 lanes of each of 16 pairs:
    /// `x[i]`'s element `j` to `x[j]`'s element `i`.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn transpose(x: &mut [__m512i; 16]) {
        let mut t = [_mm512_setzero_si512(); 16];
        for i in (0..16).step_by(2) {
            t[i] = _mm512_unpacklo_epi32(x[i], x[i + 1]);
            t[i + 1] = _mm512_unpackhi_epi32(x[i], x[i + 1]);
        }
        for i in (0..16).step_by(4) {
            x[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
            x[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
            x[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
            x[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
        }
        for h in [0, 8] {
            for i in 0..4 {
                t[h + i] = _mm512_shuffle_i32x4::<0x88>(x[h + i], x[h + i + 4]);
                t[h + i + 4] = _mm512_shuffle_i32x4::<0xdd>(x[h + i], x[h + i + 4]);
            }
        }
        for i in 0..8 {
            x[i] = _mm512_shuffle_i32x4::<0x88>(t[i], t[i + 8]);
            x[i + 8] = _mm512_shuffle_i32x4::<0xdd>(t[i], t[i + 8]);
        }
    }

    /// [`super::pack`]'s panel (`valid` of its `width` lanes) where each
    /// lane's k is contiguous: 32 floats of a lane make its next 16 pairs,
    /// and 16 lanes' are transposed to 16 pairs' before they are stored.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
    pub unsafe fn pack_along<T: Element>(
        out: *mut u32,
        x: Mat<*const T>,
        valid: usize,
        k: usize,
        width: usize,
    ) {
        let mut rows = [_mm512_setzero_si512(); 16];
        for g in (0..valid).step_by(16) {
            let lanes = (valid - g).min(16);
            for k0 in (0..k).step_by(32) {
                let left = k - k0;
                for (l, row) in rows.iter_mut().enumerate() {
                    *row = match l < lanes {
                        true => {
                            let at = x.ptr.offset((g + l) as isize * x.row_stride).add(k0);
                            let hi = match left > 16 {
                                true => load(at.add(16), left - 16),
                                false => _mm512_setzero_ps(),
                            };
                            transmute::<__m512bh, __m512i>(_mm512_cvtne2ps_pbh(hi, load(at, left)))
                        }
                        false => _mm512_setzero_si512(),
                    };
                }
                transpose(&mut rows);
                for (t, pair) in rows.iter().take(left.div_ceil(2).min(16)).enumerate() {
                    let at = out.add((k0 / 2 + t) * width + g) as *mut i32;
                    _mm512_mask_storeu_epi32(at, mask(lanes), *pair);
                }
            }
        }
    }

    /// [`super::pack_panels`]' `pairs` pairs of a panel (`valid` of its
    /// `width` lanes; `depth` elements of k left from the first) where the
    /// lanes are contiguous: each pair is two rows of 16 lanes, rounded
    /// into one register and interleaved.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
    pub unsafe fn pack_across<T: Element>(
        out: *mut u32,
        x: Mat<*const T>,
        valid: usize,
        pairs: usize,
        depth: usize,
        width: usize,
    ) {
        // element 2i of a pair's register is lane i of its low row, 2i + 1
        // lane i of its high row (rounded, they are elements i and 16 + i)
        let order: [u16; 32] = std::array::from_fn(|j| (j / 2 + 16 * (j % 2)) as u16);
        let order = _mm512_loadu_epi16(order.as_ptr() as *const i16);
        let at = |d: usize| x.ptr.offset(d as isize * x.col_stride);
        for p in 0..pairs {
            for l0 in (0..valid).step_by(16) {
                let n = (valid - l0).min(16);
                let hi = match 2 * p + 1 < depth {
                    true => load(at(2 * p + 1).add(l0), n),
                    false => _mm512_setzero_ps(),
                };
                let both = _mm512_cvtne2ps_pbh(hi, load(at(2 * p).add(l0), n));
                let v = _mm512_permutexvar_epi16(order, transmute::<__m512bh, __m512i>(both));
                _mm512_mask_storeu_epi32(out.add(p * width + l0) as *mut i32, mask(n), v);
            }
        }
    }
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;
    use std::arch::x86_64::*;

    #[test]
    fn sixteen_lanes_of_sixteen_pairs_transpose() {
        if !available() {
            eprintln!("no AVX512-BF16 here: the kernel's transpose cannot run");
            return;
        }
        let mut x = [[0u32; 16]; 16];
        for (i, row) in x.iter_mut().enumerate() {
            for (j, v) in row.iter_mut().enumerate() {
                *v = (i * 16 + j) as u32;
            }
        }
        // SAFETY: the CPU has AVX-512 (checked above)
        let got: [[u32; 16]; 16] = unsafe {
            let mut regs = x.map(|row| _mm512_loadu_epi32(row.as_ptr() as *const i32));
            avx512::transpose(&mut regs);
            regs.map(|r| std::mem::transmute(r))
        };
        for i in 0..16 {
            for j in 0..16 {
                assert_eq!(got[j][i], x[i][j], "[{i}][{j}]");
            }
        }
    }
}

#[cfg(all(test, target_arch = "x86_64"))]
mod storage {
    use super::*;
    use crate::rng::Rng;

    /// A tile of sums is stored rounded as [`Bf16::from_f32`] rounds (ties
    /// to even, NaN, infinities, subnormals kept), its first rows and
    /// columns only.
    #[test]
    fn a_tile_is_stored_rounded_as_a_bf16_is() {
        if !available() {
            eprintln!("no AVX512-BF16 here: the kernel cannot run");
            return;
        }
        let mut rng = Rng::new(9);
        let special = [
            f32::NAN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            1e-39,
            -3e-40,
            f32::from_bits(0x3f80_8000), // a tie, rounded down to even
            f32::from_bits(0x3f81_8000), // a tie, rounded up to even
            f32::from_bits(0x7f7f_ffff), // rounds to infinity
            0.0,
            -0.0,
        ];
        let tile: [f32; MR * NR] = std::array::from_fn(|i| match special.get(i % 40) {
            Some(&x) => x,
            None => rng.normal() as f32,
        });
        let (rows, cols, ldc) = (MR - 1, NR - 3, NR + 5);
        let mut dst = vec![Bf16::from_f32(7.0); MR * ldc];
        // SAFETY: the CPU has AVX-512 (checked above); dst holds the rows.
        unsafe { avx512::round(&tile, dst.as_mut_ptr(), ldc as isize, rows, cols) };
        for r in 0..MR {
            for c in 0..ldc {
                let want = match r < rows && c < cols {
                    true => Bf16::from_f32(tile[r * NR + c]),
                    false => Bf16::from_f32(7.0),
                };
                assert_eq!(
                    dst[r * ldc + c],
                    want,
                    "[{r}][{c}] of {}",
                    tile[r * NR + c.min(NR - 1)]
                );
            }
        }
    }

    /// `out (m x n, transposed where dst_t) = [out +] a (m x k) @ b (k x n)`
    /// (both row-major) on `threads` of `pool`; whether it ran.
    #[allow(clippy::too_many_arguments)]
    fn product<D: Element + Send, L: Element + Sync, R: Element + Sync>(
        pool: &rayon::ThreadPool,
        (m, n, k): (usize, usize, usize),
        out: &mut [D],
        dst_t: bool,
        a: &[L],
        b: &[R],
        onto: Onto,
        threads: usize,
    ) -> bool {
        let dst = match dst_t {
            true => Mat::new(out.as_mut_ptr(), 1, m),
            false => Mat::new(out.as_mut_ptr(), n, 1),
        };
        let (a, b) = (Mat::new(a.as_ptr(), k, 1), Mat::new(b.as_ptr(), n, 1));
        let strides = (dst.row_stride, dst.col_stride);
        let (dst, a, b) = (dst.ptr as usize, address(a), address(b));
        pool.install(|| {
            // SAFETY: each buffer holds what its view addresses.
            unsafe {
                let dst = Mat {
                    ptr: dst as *mut D,
                    row_stride: strides.0,
                    col_stride: strides.1,
                };
                let (a, b) = (view::<L>(a, 0), view::<R>(b, 0));
                gemm(Dims { m, n, k }, dst, a, b, onto, 1.0, threads)
            }
        })
    }

    /// A product of operands held in bfloat16 is the product of their
    /// values held in fp32, and a bfloat16 output the fp32 output rounded:
    /// bit for bit, for
    /// either layout of dst, over more than one kernel call's pairs, on
    /// one thread and two; a bfloat16 output with a bias the fp32 output
    /// plus the bias rounded to bf16, rounded; a bfloat16 output to
    /// accumulate onto, and a bias onto an fp32 or a transposed output, refused.
    #[test]
    fn bf16_operands_and_outputs_are_their_fp32_values() {
        if !available() {
            eprintln!("no AVX512-BF16 here: the kernel cannot run");
            return;
        }
        let mut rng = Rng::new(5);
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .unwrap();
        for (m, n, k) in [(5, 9, 7), (13, 40, 16), (30, 70, 800), (97, 33, 385)] {
            let mut randn =
                |len: usize| -> Vec<f32> { (0..len).map(|_| rng.normal() as f32).collect() };
            let (a, b, bias) = (randn(m * k), randn(k * n), randn(n));
            let held = |x: &[f32]| -> Vec<Bf16> { x.iter().map(|&v| Bf16::from_f32(v)).collect() };
            let (ah, bh) = (held(&a), held(&b));
            let wide = |x: &[Bf16]| -> Vec<f32> { x.iter().map(|v| v.to_f32()).collect() };
            let (aw, bw) = (wide(&ah), wide(&bh));
            for (threads, dst_t) in [(1, false), (2, false), (2, true)] {
                let at = format!("{m}x{n}x{k} on {threads}, dst transposed {dst_t}");
                let dims = (m, n, k);
                let (mut want, mut got) = (vec![1.0f32; m * n], vec![1.0f32; m * n]);
                let add = Onto::Add;
                assert!(product(
                    &pool, dims, &mut want, dst_t, &aw, &bw, add, threads
                ));
                assert!(product(
                    &pool, dims, &mut got, dst_t, &ah, &bh, add, threads
                ));
                assert!(got == want, "{at}: bf16 operands, fp32 dst");
                let mut fp32 = vec![0.0f32; m * n];
                let over = Onto::Over;
                assert!(product(
                    &pool, dims, &mut fp32, dst_t, &a, &b, over, threads
                ));
                let mut out = vec![Bf16::default(); m * n];
                assert!(product(
                    &pool, dims, &mut out, dst_t, &a, &bh, over, threads
                ));
                assert!(
                    out == held(&fp32),
                    "{at}: a bf16 dst is not the fp32 one rounded"
                );
                assert!(
                    !product(&pool, dims, &mut out, dst_t, &a, &b, add, threads),
                    "{at}: accumulated onto a bf16 dst"
                );
                let onto = Onto::Bias(&bias);
                let biased = product(&pool, dims, &mut out, dst_t, &a, &bh, onto, threads);
                assert_eq!(biased, !dst_t, "{at}: a bias onto a bf16 dst");
                if biased {
                    let plus = fp32
                        .iter()
                        .enumerate()
                        .map(|(i, &x)| x + round_to_bf16(bias[i % n]));
                    let want: Vec<Bf16> = plus.map(Bf16::from_f32).collect();
                    assert!(
                        out == want,
                        "{at}: not the fp32 dst plus its bf16 bias, rounded"
                    );
                }
                let mut f = vec![0.0f32; m * n];
                assert!(
                    !product(&pool, dims, &mut f, dst_t, &a, &b, onto, threads),
                    "{at}: a bias onto an fp32 dst"
                );
            }
        }
    }
}

#[cfg(test)]
mod tiling {
    use super::*;

    /// The tasks' blocks cover the output once, each within the scratch
    /// its task packs into (at most MC rows, or NC panels, on its side),
    /// and the passes over k cover it once, each at most KC pairs.
    #[test]
    fn the_tasks_tile_the_output_once_within_their_scratch() {
        let sizes: [usize; 11] = [1, 11, 12, 13, 95, 96, 97, 300, 385, 1000, 4096];
        for (m, n) in sizes.iter().flat_map(|&m| sizes.map(|n| (m, n))) {
            for threads in 1..=6 {
                for own in [Side::Left, Side::Right] {
                    let (micro, panels) = (m.div_ceil(MR), n.div_ceil(NR));
                    let (count, at) = blocks(m, n, own, threads);
                    let mut seen = vec![0u8; micro * panels];
                    for t in 0..count {
                        let [i0, rows, q0, per] = at(t);
                        assert!(rows > 0 && per > 0, "{m}x{n} on {threads}: empty block {t}");
                        assert!(i0 % MR == 0 && i0 + rows <= m && q0 + per <= panels);
                        match own {
                            Side::Left => assert!(rows <= MC, "{m}x{n} on {threads}: {rows} rows"),
                            Side::Right => assert!(per <= NC, "{m}x{n} on {threads}: {per} panels"),
                        }
                        for u in i0 / MR..(i0 + rows).div_ceil(MR) {
                            for q in q0..q0 + per {
                                seen[u * panels + q] += 1;
                            }
                        }
                    }
                    assert!(
                        seen.iter().all(|&s| s == 1),
                        "{m}x{n} on {threads}: not tiled once"
                    );
                    if own == Side::Right && panels >= threads {
                        assert_eq!(count % threads, 0, "{n} columns on {threads} threads");
                    }
                }
            }
        }
        for pairs in [1, 2, 191, 192, 193, 384, 385, 2048] {
            let kc = depth(pairs);
            let passes = pairs.div_ceil(kc);
            assert!(
                kc <= KC && passes == pairs.div_ceil(KC),
                "{pairs} pairs in {kc}"
            );
            assert!(
                passes * kc - pairs < passes,
                "{pairs} pairs cut unevenly into {kc}"
            );
        }
    }
}
