//! distgpt's own fp32 product for a thread's small products, attention's
//! per-tile ones (a block of query rows against a tile of keys; a head's
//! width or a tile of keys wide): `dst (m x n) = [dst +] scale * lhs (m x
//! k) @ rhs (k x n)`. The right operand is read as k rows of n floats one
//! after another, copied so into this thread's scratch where it is not
//! (a tile of keys or values read transposed goes through registers eight
//! by eight); the left one's elements are broadcast from wherever its
//! strides put them; and a block of `MR x NR` sums stays in registers over
//! the whole depth (at most a few hundred here: nothing is blocked along
//! it). It is the built-in library's product for such shapes
//! ([`gemm_on`](super::math::gemm_on)), so the matmul probe times it as
//! the built-in's "attention blocks".
//!
//! AVX-512 (where the build has the `avx512` feature and the CPU has
//! AVX-512F) takes widths that are multiples of 32, AVX2 + FMA multiples of
//! 16; the `gemm` crate runs the rest.

use super::math::{with_scratch, Dims, Mat, Scratch};

thread_local! {
    /// A right operand copied into contiguous rows.
    static RHS: Scratch<f32> = const { Scratch::new(Vec::new()) };
}

/// An instruction set's micro-kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Kernel {
    #[cfg(all(target_arch = "x86_64", feature = "avx512"))]
    Avx512,
    #[cfg(avx2_fma)]
    Avx2,
}

impl Kernel {
    /// Every kernel this build and CPU can run, widest first.
    pub(super) fn available() -> &'static [Kernel] {
        static KERNELS: std::sync::OnceLock<Vec<Kernel>> = std::sync::OnceLock::new();
        KERNELS.get_or_init(|| {
            let all = [
                #[cfg(all(target_arch = "x86_64", feature = "avx512"))]
                (Kernel::Avx512, is_x86_feature_detected!("avx512f")),
                #[cfg(avx2_fma)]
                (Kernel::Avx2, true),
            ];
            all.into_iter()
                .filter(|&(_, here)| here)
                .map(|(k, _)| k)
                .collect()
        })
    }

    /// Its instruction set, as a user reads it.
    pub(super) fn name(self) -> &'static str {
        match self {
            #[cfg(all(target_arch = "x86_64", feature = "avx512"))]
            Kernel::Avx512 => "AVX-512",
            #[cfg(avx2_fma)]
            Kernel::Avx2 => "AVX2",
        }
    }

    /// The columns its block holds: the product's width must be a multiple.
    fn width(self) -> usize {
        match self {
            #[cfg(all(target_arch = "x86_64", feature = "avx512"))]
            Kernel::Avx512 => x86::avx512::NR,
            #[cfg(avx2_fma)]
            Kernel::Avx2 => x86::avx2::NR,
        }
    }

    /// The widest kernel that takes a width of n.
    pub(super) fn for_width(n: usize) -> Option<Kernel> {
        Kernel::available()
            .iter()
            .copied()
            .find(|k| n.is_multiple_of(k.width()))
    }
}

/// `dst (m x n) = [dst +] scale * lhs (m x k) @ rhs (k x n)` on `kernel`
/// (whose width divides n; dst's rows contiguous), on this thread.
///
/// # Safety
/// As [`gemm_on`](super::math::gemm_on): every element the views address
/// for these sizes lies in a live allocation, and dst aliases neither
/// operand.
pub(super) unsafe fn product_on(
    kernel: Kernel,
    dst: Mat<*mut f32>,
    lhs: Mat<*const f32>,
    rhs: Mat<*const f32>,
    dims: Dims,
    accumulate: bool,
    scale: f32,
) {
    let Dims { m, n, k } = dims;
    assert!(dst.col_stride == 1 && n.is_multiple_of(kernel.width()));
    if m == 0 || n == 0 {
        return;
    }
    let run = |b: *const f32| {
        let (c, ldc) = (dst.ptr, dst.row_stride as usize);
        match kernel {
            #[cfg(all(target_arch = "x86_64", feature = "avx512"))]
            Kernel::Avx512 => x86::avx512::product(c, ldc, lhs, b, dims, accumulate, scale),
            #[cfg(avx2_fma)]
            Kernel::Avx2 => x86::avx2::product(c, ldc, lhs, b, dims, accumulate, scale),
        }
    };
    if rhs.col_stride == 1 && rhs.row_stride as usize == n {
        return run(rhs.ptr);
    }
    with_scratch(&RHS, k * n, |b| {
        copy_rows(b, rhs, k, n);
        run(b.as_ptr())
    })
}

/// out (rows x cols, its rows one after another) = the view x: a copy
/// where x's rows are contiguous, else (a transpose) eight by eight
/// through registers where the build has AVX2.
///
/// # Safety
/// x addresses rows x cols readable elements; out holds rows * cols.
pub(super) unsafe fn copy_rows(out: &mut [f32], x: Mat<*const f32>, rows: usize, cols: usize) {
    let at = |i: usize, j: usize| {
        x.ptr
            .offset(i as isize * x.row_stride + j as isize * x.col_stride)
    };
    if x.col_stride == 1 {
        for (i, row) in out.chunks_exact_mut(cols).take(rows).enumerate() {
            row.copy_from_slice(std::slice::from_raw_parts(at(i, 0), cols));
        }
        return;
    }
    let (mut i0, mut j0) = (0, 0);
    #[cfg(all(target_arch = "x86_64", target_feature = "avx2"))]
    if x.row_stride == 1 {
        (i0, j0) = (rows - rows % 8, cols - cols % 8);
        for i in (0..i0).step_by(8) {
            for j in (0..j0).step_by(8) {
                x86::transpose8(
                    out.as_mut_ptr().add(i * cols + j),
                    cols,
                    at(i, j),
                    x.col_stride,
                );
            }
        }
    }
    // what the blocks of eight left: the last columns of the blocks' rows,
    // then the last rows
    for i in 0..rows {
        let from = if i < i0 { j0 } else { 0 };
        for (j, o) in out[i * cols..(i + 1) * cols]
            .iter_mut()
            .enumerate()
            .skip(from)
        {
            *o = *at(i, j);
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    #[cfg(target_feature = "avx2")]
    use std::arch::x86_64::*;

    /// Eight rows of eight at out (`ldo` apart) from eight columns of
    /// eight contiguous floats at x (`col_stride` apart).
    #[cfg(target_feature = "avx2")]
    #[inline(always)]
    pub unsafe fn transpose8(out: *mut f32, ldo: usize, x: *const f32, col_stride: isize) {
        let c: [__m256; 8] =
            std::array::from_fn(|j| _mm256_loadu_ps(x.offset(j as isize * col_stride)));
        // pairs of columns interleaved, then quads, then the halves swapped
        let u0 = _mm256_unpacklo_ps(c[0], c[1]);
        let u1 = _mm256_unpackhi_ps(c[0], c[1]);
        let u2 = _mm256_unpacklo_ps(c[2], c[3]);
        let u3 = _mm256_unpackhi_ps(c[2], c[3]);
        let u4 = _mm256_unpacklo_ps(c[4], c[5]);
        let u5 = _mm256_unpackhi_ps(c[4], c[5]);
        let u6 = _mm256_unpacklo_ps(c[6], c[7]);
        let u7 = _mm256_unpackhi_ps(c[6], c[7]);
        let s0 = _mm256_shuffle_ps::<0x44>(u0, u2);
        let s1 = _mm256_shuffle_ps::<0xee>(u0, u2);
        let s2 = _mm256_shuffle_ps::<0x44>(u1, u3);
        let s3 = _mm256_shuffle_ps::<0xee>(u1, u3);
        let s4 = _mm256_shuffle_ps::<0x44>(u4, u6);
        let s5 = _mm256_shuffle_ps::<0xee>(u4, u6);
        let s6 = _mm256_shuffle_ps::<0x44>(u5, u7);
        let s7 = _mm256_shuffle_ps::<0xee>(u5, u7);
        let rows = [
            _mm256_permute2f128_ps::<0x20>(s0, s4),
            _mm256_permute2f128_ps::<0x20>(s1, s5),
            _mm256_permute2f128_ps::<0x20>(s2, s6),
            _mm256_permute2f128_ps::<0x20>(s3, s7),
            _mm256_permute2f128_ps::<0x31>(s0, s4),
            _mm256_permute2f128_ps::<0x31>(s1, s5),
            _mm256_permute2f128_ps::<0x31>(s2, s6),
            _mm256_permute2f128_ps::<0x31>(s3, s7),
        ];
        for (i, r) in rows.iter().enumerate() {
            _mm256_storeu_ps(out.add(i * ldo), *r);
        }
    }

    /// Writes the micro-kernels of one instruction set: `$lanes` floats a
    /// register, `NR / $lanes` registers a row of the block.
    macro_rules! kernels {
        ($isa:ident, $feature:literal, $reg:ty, $lanes:literal, $mr:literal, $nr:literal,
         $zero:ident, $set1:ident, $load:ident, $store:ident, $fmadd:ident, $mul:ident, $add:ident) => {
            pub mod $isa {
                use super::super::{Dims, Mat};
                use std::arch::x86_64::*;

                /// Rows of the block (one broadcast each per step of k).
                const MR: usize = $mr;
                /// Columns of the block.
                pub const NR: usize = $nr;
                const REGS: usize = NR / $lanes;

                /// [`super::super::product_on`] with rhs's rows one after another
                /// and dst's (at `c`) `ldc` apart.
                ///
                /// # Safety
                /// The CPU has the instruction set; as `product_on`.
                #[target_feature(enable = $feature)]
                pub unsafe fn product(
                    c: *mut f32,
                    ldc: usize,
                    a: Mat<*const f32>,
                    b: *const f32,
                    dims: Dims,
                    add: bool,
                    scale: f32,
                ) {
                    let Dims { m, n, k } = dims;
                    for i0 in (0..m).step_by(MR) {
                        let rows = (m - i0).min(MR);
                        // a last block of fewer rows reads its last row again
                        // (and stores only its own)
                        let ap: [*const f32; MR] = std::array::from_fn(|r| {
                            a.ptr.offset((i0 + r.min(rows - 1)) as isize * a.row_stride)
                        });
                        for j0 in (0..n).step_by(NR) {
                            let at = c.add(i0 * ldc + j0);
                            block(
                                at,
                                ldc,
                                rows,
                                &ap,
                                a.col_stride,
                                b.add(j0),
                                n,
                                k,
                                add,
                                scale,
                            );
                        }
                    }
                }

                /// One block: `rows` rows of dst at c from the sums over k of
                /// `ap`'s rows (elements `acs` apart) times NR columns of b.
                #[target_feature(enable = $feature)]
                #[inline]
                #[allow(clippy::too_many_arguments)]
                unsafe fn block(
                    c: *mut f32,
                    ldc: usize,
                    rows: usize,
                    ap: &[*const f32; MR],
                    acs: isize,
                    b: *const f32,
                    ldb: usize,
                    k: usize,
                    add: bool,
                    scale: f32,
                ) {
                    let mut acc: [[$reg; REGS]; MR] = [[$zero(); REGS]; MR];
                    for p in 0..k {
                        let bp = b.add(p * ldb);
                        let bv: [$reg; REGS] = std::array::from_fn(|v| $load(bp.add(v * $lanes)));
                        let off = p as isize * acs;
                        for (row, a) in acc.iter_mut().zip(ap) {
                            let av = $set1(*a.offset(off));
                            for (s, &bv) in row.iter_mut().zip(&bv) {
                                *s = $fmadd(av, bv, *s);
                            }
                        }
                    }
                    let s = $set1(scale);
                    for (r, row) in acc.iter().enumerate().take(rows) {
                        let out = c.add(r * ldc);
                        for (v, &sum) in row.iter().enumerate() {
                            let at = out.add(v * $lanes);
                            let x = $mul(sum, s);
                            $store(at, if add { $add(x, $load(at)) } else { x });
                        }
                    }
                }
            }
        };
    }

    #[cfg(all(target_feature = "avx2", target_feature = "fma"))]
    kernels!(
        avx2,
        "avx2,fma",
        __m256,
        8,
        6,
        16,
        _mm256_setzero_ps,
        _mm256_set1_ps,
        _mm256_loadu_ps,
        _mm256_storeu_ps,
        _mm256_fmadd_ps,
        _mm256_mul_ps,
        _mm256_add_ps
    );
    #[cfg(feature = "avx512")]
    kernels!(
        avx512,
        "avx512f",
        __m512,
        16,
        8,
        32,
        _mm512_setzero_ps,
        _mm512_set1_ps,
        _mm512_loadu_ps,
        _mm512_storeu_ps,
        _mm512_fmadd_ps,
        _mm512_mul_ps,
        _mm512_add_ps
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::Rng;

    /// Each kernel against a sum in f64, over row counts around its block,
    /// depths of one and more, both layouts of each operand, accumulating
    /// or not.
    #[test]
    fn tile_products_match_a_reference_on_every_kernel() {
        let kernels = Kernel::available();
        #[cfg(target_arch = "x86_64")]
        assert!(
            !kernels.is_empty(),
            "an x86-64-v3 build always has the AVX2 kernel"
        );
        let mut rng = Rng::new(7);
        for &kernel in kernels {
            let w = kernel.width();
            for (m, n, k) in [
                (1, w, 1),
                (5, w, 3),
                (6, 2 * w, 64),
                (7, w, 17),
                (64, 4 * w, 64),
                (65, w, 130),
            ] {
                for (lhs_t, rhs_t, add) in [
                    (false, false, false),
                    (true, true, true),
                    (false, true, true),
                    (true, false, false),
                ] {
                    let a: Vec<f32> = (0..m * k).map(|_| rng.normal() as f32).collect();
                    let b: Vec<f32> = (0..k * n).map(|_| rng.normal() as f32).collect();
                    let ldc = n + 3;
                    let c0: Vec<f32> = (0..m * ldc).map(|_| rng.normal() as f32).collect();
                    let lhs = match lhs_t {
                        true => Mat::new(a.as_ptr(), 1, m),
                        false => Mat::new(a.as_ptr(), k, 1),
                    };
                    let rhs = match rhs_t {
                        true => Mat::new(b.as_ptr(), 1, k),
                        false => Mat::new(b.as_ptr(), n, 1),
                    };
                    let at = |x: &Mat<*const f32>, i: usize, j: usize| unsafe {
                        *x.ptr
                            .offset(i as isize * x.row_stride + j as isize * x.col_stride)
                            as f64
                    };
                    let scale = 0.3f32;
                    let mut c = c0.clone();
                    unsafe {
                        product_on(
                            kernel,
                            Mat::new(c.as_mut_ptr(), ldc, 1),
                            lhs,
                            rhs,
                            Dims { m, n, k },
                            add,
                            scale,
                        )
                    };
                    for i in 0..m {
                        for j in 0..ldc {
                            let want = match j < n {
                                true => {
                                    let s: f64 =
                                        (0..k).map(|p| at(&lhs, i, p) * at(&rhs, p, j)).sum();
                                    scale as f64 * s
                                        + if add { c0[i * ldc + j] as f64 } else { 0.0 }
                                }
                                false => c0[i * ldc + j] as f64,
                            };
                            let got = c[i * ldc + j] as f64;
                            assert!(
                                (got - want).abs() <= 1e-5 * (1.0 + want.abs()) * (k as f64).sqrt(),
                                "{kernel:?} ({m}, {n}, {k}) lhs^T {lhs_t} rhs^T {rhs_t} add {add}: [{i}, {j}] {got} vs {want}"
                            );
                        }
                    }
                }
            }
        }
    }

    /// The built-in library's small products on one thread, as attention
    /// calls them and with dst stored by column (the product turned
    /// around onto the kernel), against a sum in f64.
    #[test]
    fn the_built_ins_small_products_match_a_reference_either_way_round() {
        use super::super::blas::MatmulLib;
        let (m, n, k) = (48, 64, 40);
        let mut rng = Rng::new(8);
        let a: Vec<f32> = (0..m * k).map(|_| rng.normal() as f32).collect();
        let b: Vec<f32> = (0..k * n).map(|_| rng.normal() as f32).collect();
        let want: Vec<f64> = (0..m * n)
            .map(|ij| {
                let (i, j) = (ij / n, ij % n);
                (0..k)
                    .map(|p| a[i * k + p] as f64 * b[p * n + j] as f64)
                    .sum()
            })
            .collect();
        for by_cols in [false, true] {
            let mut c = vec![f32::NAN; m * n];
            let dst = match by_cols {
                true => Mat::new(c.as_mut_ptr(), 1, m),
                false => Mat::new(c.as_mut_ptr(), n, 1),
            };
            let (lhs, rhs) = (Mat::new(a.as_ptr(), k, 1), Mat::new(b.as_ptr(), n, 1));
            // SAFETY: each buffer holds what its view addresses.
            unsafe {
                super::super::math::gemm_on(
                    MatmulLib::Gemm,
                    Dims { m, n, k },
                    dst,
                    lhs,
                    rhs,
                    false,
                    1.0,
                    1,
                )
            };
            for (ij, w) in want.iter().enumerate() {
                let (i, j) = (ij / n, ij % n);
                let got = match by_cols {
                    true => c[j * m + i],
                    false => c[ij],
                };
                assert!(
                    (got as f64 - w).abs() < 1e-4,
                    "by columns {by_cols}: [{i}, {j}] {got} vs {w}"
                );
            }
        }
    }
}
