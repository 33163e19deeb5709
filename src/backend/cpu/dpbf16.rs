//! distgpt's own bf16 matmul for `--precision bf16` on CPUs with
//! AVX512-BF16: `vdpbf16ps` multiplies 32 pairs of bfloat16 and adds each
//! pair's two products to one of 16 fp32 sums, twice the multiply-adds of
//! an fp32 FMA in one instruction.
//!
//! `dst = [dst +] scale * lhs @ rhs`: both operands are rounded to bfloat16
//! (to nearest even) as they are packed, in pairs along k, into panels: the
//! left one in panels of [`MR`] rows, the right one in panels of [`NR`]
//! columns, each panel pair by pair. A micro-kernel keeps an `MR x NR`
//! block of sums in 24 registers over [`KC`] pairs at a time (its right
//! panel's slice stays in L1, the left block's in L2) and adds it, scaled,
//! to `dst`. Blocks of [`MC`] rows by [`NC`] panels are the rayon tasks.
//! Every product of two bfloat16 is exact in fp32, so the result differs
//! from fp32 arithmetic on the rounded operands in the order of its sums
//! only.

use super::math::Mat;

/// Rows of the micro-kernel's block (one broadcast pair each).
const MR: usize = 12;
/// Columns of the micro-kernel's block: two registers of 16 sums.
const NR: usize = 32;
/// Pairs of k a micro-kernel call sums before it adds to `dst`.
const KC: usize = 128;
/// Rows of a task's block (in micro-panels of [`MR`]).
const MC: usize = 8 * MR;
/// Column panels of a task's block.
const NC: usize = 8;

/// Whether this CPU runs [`gemm`] (AVX512-BF16, and AVX-512F with it).
pub fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bf16")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

thread_local! {
    /// Packed operands, kept for the next product on this thread (as a
    /// BLAS keeps its packing buffers) up to [`KEPT`] pairs.
    static PACKED: std::cell::Cell<Vec<u32>> = const { std::cell::Cell::new(Vec::new()) };
}

/// The most packed pairs a thread keeps between products (16 MiB): a
/// larger buffer (a wide vocabulary's head) is freed after its product.
const KEPT: usize = 1 << 22;

/// `dst (m x n) = [dst +] scale * lhs (m x k) @ rhs (k x n)` on bfloat16
/// operands (rounded here) with fp32 sums, split over the pool when
/// `threads` is more than 1. Returns false, doing nothing, where the CPU has
/// no AVX512-BF16 or a view has no unit stride (the caller runs the product
/// in fp32 instead).
///
/// # Safety
/// As `math::gemm`: every element the views address for these sizes is
/// inside a live allocation, and `dst` aliases neither operand.
#[allow(clippy::too_many_arguments)] // a BLAS call's own arguments
pub(super) unsafe fn gemm(
    (m, n, k): (usize, usize, usize),
    dst: Mat<*mut f32>,
    lhs: Mat<*const f32>,
    rhs: Mat<*const f32>,
    accumulate: bool,
    scale: f32,
    threads: usize,
) -> bool {
    // dst's rows must be contiguous; else dst^T = rhs^T lhs^T
    let (dst, lhs, rhs, m, n) = if dst.col_stride == 1 {
        (dst, lhs, rhs, m, n)
    } else if dst.row_stride == 1 {
        (dst.t(), rhs.t(), lhs.t(), n, m)
    } else {
        return false;
    };
    let unit = |x: Mat<*const f32>| x.col_stride == 1 || x.row_stride == 1;
    if !available() || !unit(lhs) || !unit(rhs) {
        return false;
    }
    if m == 0 || n == 0 {
        return true;
    }
    let pairs = k.div_ceil(2);
    let (a_len, b_len) = (m.div_ceil(MR) * MR * pairs, n.div_ceil(NR) * NR * pairs);
    let mut packed = PACKED.take();
    packed.clear();
    packed.resize(a_len + b_len, 0);
    let (a, b) = packed.split_at_mut(a_len);
    // the right operand as its columns' rows: (n x k)
    #[cfg(target_arch = "x86_64")]
    // SAFETY: the CPU has AVX512-BF16 (checked above); the views' elements
    // are readable and their sizes are the product's.
    unsafe {
        pack(a, lhs, (m, k), MR, threads);
        pack(b, rhs.t(), (n, k), NR, threads);
        multiply(a, b, (m, n, pairs), dst, accumulate, scale, threads);
    }
    if packed.capacity() <= KEPT {
        PACKED.set(packed);
    }
    true
}

/// The blocks of `dst` the tasks take, rows `MC` at a time by `NC` panels:
/// how many, and block `t`'s first row and first panel.
fn blocks(m: usize, n: usize) -> (usize, impl Fn(usize) -> (usize, usize) + Sync + Send) {
    let cols = n.div_ceil(NR).div_ceil(NC);
    (m.div_ceil(MC) * cols, move |t| {
        (t / cols * MC, t % cols * NC)
    })
}

/// Packs `x` (`lanes x k`, a unit stride on one side) as bfloat16 pairs in
/// panels of `width` lanes: panel `q`, pair `p`, lane `l` is at
/// `((q * pairs + p) * width + l)`, its low half element `2p` of the
/// lane's row, its high half `2p + 1` (0 past k). Lanes past the last
/// are left as they are (their sums are never stored).
///
/// # Safety
/// AVX512-BF16; `x`'s elements readable; `out` holds every panel.
#[cfg(target_arch = "x86_64")]
unsafe fn pack(
    out: &mut [u32],
    x: Mat<*const f32>,
    (lanes, k): (usize, usize),
    width: usize,
    threads: usize,
) {
    use rayon::prelude::*;
    let pairs = k.div_ceil(2);
    let addr = x.ptr as usize;
    let panel = |(q, out): (usize, &mut [u32])| {
        let x = Mat {
            ptr: (addr as *const f32).offset((q * width) as isize * x.row_stride),
            ..x
        };
        let valid = width.min(lanes - q * width);
        // SAFETY: the panel's lanes are the view's rows q * width ..
        unsafe {
            if x.col_stride == 1 {
                avx512::pack_along(out, x, valid, k, width)
            } else {
                avx512::pack_across(out, x, valid, k, width)
            }
        }
    };
    let len = pairs * width;
    if threads > 1 {
        out.par_chunks_mut(len).enumerate().for_each(panel);
    } else {
        out.chunks_mut(len).enumerate().for_each(panel);
    }
}

/// Every block of `dst` from the packed operands.
///
/// # Safety
/// AVX512-BF16; `a` and `b` packed by [`pack`] for this product; `dst`
/// addresses `m x n` writable floats with unit column stride.
#[cfg(target_arch = "x86_64")]
unsafe fn multiply(
    a: &[u32],
    b: &[u32],
    (m, n, pairs): (usize, usize, usize),
    dst: Mat<*mut f32>,
    accumulate: bool,
    scale: f32,
    threads: usize,
) {
    use rayon::prelude::*;
    let (a, b, c) = (a.as_ptr() as usize, b.as_ptr() as usize, dst.ptr as usize);
    let ldc = dst.row_stride;
    let block = |(i0, q0): (usize, usize)| {
        let rows = MC.min(m - i0);
        let panels = NC.min(n.div_ceil(NR) - q0);
        for p0 in (0..pairs).step_by(KC) {
            let kc = KC.min(pairs - p0);
            let add = accumulate || p0 > 0;
            for q in q0..q0 + panels {
                let cols = NR.min(n - q * NR);
                let bp = (b as *const u32).add((q * pairs + p0) * NR);
                for i in (i0..i0 + rows).step_by(MR) {
                    let ap = (a as *const u32).add((i / MR * pairs + p0) * MR);
                    let cp = (c as *mut f32).offset(i as isize * ldc + (q * NR) as isize);
                    // SAFETY: the block lies inside the packed panels and dst
                    unsafe {
                        avx512::kernel(kc, ap, bp, cp, ldc, (MR.min(m - i), cols), add, scale)
                    };
                }
            }
        }
    };
    let (count, at) = blocks(m, n);
    if threads > 1 {
        (0..count).into_par_iter().map(at).for_each(block);
    } else {
        (0..count).map(at).for_each(block);
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::{Mat, MR, NR};
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
        (rows, cols): (usize, usize),
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

    /// 16 floats from `at` (the first `n` of them; zeros after).
    #[target_feature(enable = "avx512f")]
    unsafe fn load(at: *const f32, n: usize) -> __m512 {
        match n >= 16 {
            true => _mm512_loadu_ps(at),
            false => _mm512_maskz_loadu_ps(mask(n), at),
        }
    }

    /// [`super::pack`]'s panel where each lane's k is contiguous: 32
    /// floats of a lane make its next 16 pairs.
    #[target_feature(enable = "avx512f,avx512bf16")]
    pub unsafe fn pack_along(
        out: &mut [u32],
        x: Mat<*const f32>,
        valid: usize,
        k: usize,
        width: usize,
    ) {
        let mut pairs = [0u32; 16];
        for l in 0..valid {
            let row = x.ptr.offset(l as isize * x.row_stride);
            for k0 in (0..k).step_by(32) {
                let left = k - k0;
                let lo = load(row.add(k0), left);
                let hi = match left > 16 {
                    true => load(row.add(k0 + 16), left - 16),
                    false => _mm512_setzero_ps(),
                };
                let both: __m512i = transmute(_mm512_cvtne2ps_pbh(hi, lo));
                _mm512_storeu_epi32(pairs.as_mut_ptr() as *mut i32, both);
                for (t, &v) in pairs.iter().take(left.div_ceil(2).min(16)).enumerate() {
                    *out.get_unchecked_mut((k0 / 2 + t) * width + l) = v;
                }
            }
        }
    }

    /// [`super::pack`]'s panel where the lanes are contiguous: each pair
    /// is two rows of 16 lanes, rounded and interleaved.
    #[target_feature(enable = "avx512f,avx512bf16")]
    pub unsafe fn pack_across(
        out: &mut [u32],
        x: Mat<*const f32>,
        valid: usize,
        k: usize,
        width: usize,
    ) {
        for p in 0..k.div_ceil(2) {
            let depth = |d: usize| x.ptr.offset(d as isize * x.col_stride);
            for l0 in (0..valid).step_by(16) {
                let n = (valid - l0).min(16);
                let lo = _mm512_cvtneps_pbh(load(depth(2 * p).add(l0), n));
                let hi = match 2 * p + 1 < k {
                    true => _mm512_cvtneps_pbh(load(depth(2 * p + 1).add(l0), n)),
                    false => transmute::<__m256i, __m256bh>(_mm256_setzero_si256()),
                };
                let lo = _mm512_cvtepu16_epi32(transmute::<__m256bh, __m256i>(lo));
                let hi = _mm512_cvtepu16_epi32(transmute::<__m256bh, __m256i>(hi));
                let v = _mm512_or_si512(lo, _mm512_slli_epi32::<16>(hi));
                let at = out.as_mut_ptr().add(p * width + l0) as *mut i32;
                _mm512_mask_storeu_epi32(at, mask(n), v);
            }
        }
    }
}
