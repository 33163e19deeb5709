//! Scalar helpers the CPU kernels share: a vectorisable `exp`, the tanh-GELU
//! pieces, and the one matmul entry point (the `gemm` crate or a BLAS).

use super::blas;
use gemm::Parallelism;
use rayon::prelude::*;

/// Whether this build and CPU run `widest!`'s AVX-512 copies: the
/// `avx512` feature (as for the products) and AVX-512 F, BW, DQ and VL.
pub fn avx512() -> bool {
    #[cfg(test)]
    if NARROW.load(std::sync::atomic::Ordering::Relaxed) {
        return false;
    }
    #[cfg(all(target_arch = "x86_64", feature = "avx512"))]
    {
        static HERE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *HERE.get_or_init(|| {
            is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("avx512bw")
                && is_x86_feature_detected!("avx512dq")
                && is_x86_feature_detected!("avx512vl")
        })
    }
    #[cfg(not(all(target_arch = "x86_64", feature = "avx512")))]
    false
}

/// Tests: while set, [`widest!`] runs the build's own copy. Both copies
/// give the same bits, so setting it changes no other test's results.
#[cfg(test)]
static NARROW: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Tests: `f` on every copy [`widest!`] can run here (AVX-512's where the
/// CPU has it, then the build's own), one at a time.
#[cfg(test)]
pub(crate) fn on_each_width<R>(f: impl Fn() -> R) -> Vec<R> {
    use std::sync::atomic::Ordering::Relaxed;
    static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _held = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let mut out = vec![];
    if avx512() {
        out.push(f());
    }
    NARROW.store(true, Relaxed);
    out.push(f());
    NARROW.store(false, Relaxed);
    out
}

/// `fn name(args) -> ret { body }` compiled twice from the one body: for
/// the build's target (x86-64-v3: AVX2, 8 lanes) and for AVX-512 (16
/// lanes), which runs where [`avx512`] says so. The compiler widens the
/// loops it already vectorises and nothing else: both give the same bits
/// (a float reduction keeps the order the code writes, whatever the
/// width), so every result and test holds on either path. Only where it
/// was measured to pay: the activations and the attention's tasks, whose
/// arithmetic (an `exp` an element, and a division for GELU) the build's
/// 8 lanes leave as the bound. Layernorm ran slower so (a row of 384 at a
/// time, its sums 8 lanes by design; its backward, since rewritten in one
/// pass for its sums, no faster), and AdamW and the cross-entropy no
/// faster (memory bound).
macro_rules! widest {
    ($(#[$attr:meta])* $vis:vis fn $name:ident($($arg:ident: $ty:ty),* $(,)?) $(-> $ret:ty)? $body:block) => {
        $(#[$attr])*
        $vis fn $name($($arg: $ty),*) $(-> $ret)? {
            #[inline(always)]
            fn body($($arg: $ty),*) $(-> $ret)? $body
            #[cfg(all(target_arch = "x86_64", feature = "avx512"))]
            if $crate::backend::cpu::math::avx512() {
                #[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl")]
                unsafe fn wide($($arg: $ty),*) $(-> $ret)? {
                    body($($arg),*)
                }
                // SAFETY: the CPU has AVX-512 F, BW, DQ and VL.
                return unsafe { wide($($arg),*) };
            }
            body($($arg),*)
        }
    };
}
pub(crate) use widest;

/// a x b + c: one fused instruction (one rounding) where the build has FMA,
/// a multiply and an add otherwise (`mul_add` without the instruction is a
/// slow library call).
#[inline(always)]
pub fn fma(a: f32, b: f32, c: f32) -> f32 {
    #[cfg(target_feature = "fma")]
    {
        a.mul_add(b, c)
    }
    #[cfg(not(target_feature = "fma"))]
    {
        a * b + c
    }
}

/// exp(x) to about 2 ulp, branch-free so loops over it auto-vectorise
/// (Cephes-style range reduction + degree-6 polynomial).
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    let x = x.clamp(-87.3, 88.3);
    let n = fma(x, LOG2E, 0.5).floor();
    let r = fma(n, -LN2_LO, fma(n, -LN2_HI, x));
    let z = r * r;
    let mut p = 1.987_569_1e-4;
    for c in [
        1.398_199_9e-3,
        8.333_452e-3,
        4.166_579_6e-2,
        1.666_666_5e-1,
        0.5,
    ] {
        p = fma(p, r, c);
    }
    let y = fma(p, z, r) + 1.0;
    // 2^n from the bits of the float n + 127 + 2^23, whose low mantissa bits
    // are the biased exponent (1..=254 after the clamp): no float-to-int
    // cast, whose saturating semantics would keep the loop scalar
    let scale = f32::from_bits((n + 127.0 + 8_388_608.0).to_bits() << 23);
    y * scale
}

/// Lanes the row reductions below keep, so they vectorise: a float
/// reduction the compiler may not reorder runs one element at a time.
pub(crate) const LANES: usize = 8;

/// The largest of xs (minus infinity for none).
#[inline]
pub fn row_max(xs: &[f32]) -> f32 {
    let mut lanes = [f32::NEG_INFINITY; LANES];
    let mut chunks = xs.chunks_exact(LANES);
    for chunk in &mut chunks {
        for (l, &x) in lanes.iter_mut().zip(chunk) {
            *l = if x > *l { x } else { *l };
        }
    }
    let tail = chunks
        .remainder()
        .iter()
        .fold(f32::NEG_INFINITY, |a, &x| a.max(x));
    lanes.iter().fold(tail, |a, &x| a.max(x))
}

/// `xs[i] = exp(xs[i] - shift)`; returns their sum. The exps are a loop of
/// their own, which a wider instruction set widens (`widest!`); the sum
/// keeps its eight lanes.
#[inline]
pub fn exp_shifted_sum(xs: &mut [f32], shift: f32) -> f32 {
    xs.iter_mut().for_each(|x| *x = exp(*x - shift));
    let mut lanes = [0.0f32; LANES];
    let mut chunks = xs.chunks_exact(LANES);
    for chunk in &mut chunks {
        for (l, x) in lanes.iter_mut().zip(chunk) {
            *l += *x;
        }
    }
    let tail = chunks.remainder().iter().fold(0.0, |t, &x| t + x);
    tail + lanes.iter().sum::<f32>()
}

const GELU_SCALE: f32 = 0.797_884_6; // sqrt(2 / pi)
const GELU_CUBE: f32 = 0.044_715;

#[inline(always)]
fn tanh(u: f32) -> f32 {
    1.0 - 2.0 / (exp(2.0 * u) + 1.0)
}

/// GELU with the tanh approximation (GPT-2's `gelu_new`), as
/// x sigmoid(2u) = x / (1 + exp(-2u)), u = sqrt(2 / pi) (x + 0.044715 x^3),
/// which is 0.5 x (1 + tanh(u)) in fewer operations.
#[inline(always)]
pub fn gelu(x: f32) -> f32 {
    let minus_2u = x * fma(-2.0 * GELU_SCALE * GELU_CUBE, x * x, -2.0 * GELU_SCALE);
    x / (1.0 + exp(minus_2u))
}

/// d gelu(x) / dx.
#[inline(always)]
pub fn gelu_grad(x: f32) -> f32 {
    let u = GELU_SCALE * (x + GELU_CUBE * x * x * x);
    let t = tanh(u);
    let du = GELU_SCALE * (1.0 + 3.0 * GELU_CUBE * x * x);
    0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * du
}

/// tanh(x), through the same exp.
#[inline(always)]
pub fn tanh_exp(x: f32) -> f32 {
    tanh(x)
}

/// erf(x): Abramowitz and Stegun 7.1.26 (absolute error below 1.5e-7).
#[inline(always)]
pub fn erf(x: f32) -> f32 {
    let a = x.abs();
    let t = 1.0 / (1.0 + 0.327_591_1 * a);
    let y = 1.0
        - (((((1.061_405_4 * t - 1.453_152_1) * t) + 1.421_413_8) * t - 0.284_496_72) * t
            + 0.254_829_6)
            * t
            * exp(-a * a);
    y.copysign(x)
}

/// Exact GELU, x * Phi(x) (BERT's `gelu`).
#[inline(always)]
pub fn gelu_erf(x: f32) -> f32 {
    0.5 * x * (1.0 + erf(x * std::f32::consts::FRAC_1_SQRT_2))
}

/// d gelu_erf(x) / dx = Phi(x) + x phi(x).
#[inline(always)]
pub fn gelu_erf_grad(x: f32) -> f32 {
    const INV_SQRT_2PI: f32 = 0.398_942_3;
    0.5 * (1.0 + erf(x * std::f32::consts::FRAC_1_SQRT_2)) + x * INV_SQRT_2PI * exp(-0.5 * x * x)
}

/// Column sums in chunks of [`COLUMN_CHUNK_ROWS`](crate::backend::COLUMN_CHUNK_ROWS) rows: `chunks` yields
/// the chunks in row order and `part(chunk, partial)` adds a chunk's rows,
/// in order, into its partial (zeroed, as wide as `outs` together), the
/// chunks side by side; then every partial, chunk after chunk, is added
/// into `outs`, which take the partial's columns in turn. The order of the
/// additions is fixed, whatever the threads: the GPU's order.
pub fn column_sums<T: Send>(
    outs: &mut [&mut [f32]],
    chunks: impl IndexedParallelIterator<Item = T>,
    part: impl Fn(T, &mut [f32]) + Sync,
) {
    let width: usize = outs.iter().map(|o| o.len()).sum();
    if width == 0 {
        return;
    }
    let mut partials = vec![0.0f32; chunks.len() * width];
    partials
        .par_chunks_mut(width)
        .zip(chunks)
        .for_each(|(p, chunk)| part(chunk, p));
    for p in partials.chunks_exact(width) {
        let mut at = 0;
        for out in outs.iter_mut() {
            out.iter_mut().zip(&p[at..]).for_each(|(o, &v)| *o += v);
            at += out.len();
        }
    }
}

/// Sum with eight independent lanes, so it vectorises.
#[inline]
pub fn sum(xs: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let chunks = xs.chunks_exact(8);
    let tail = chunks.remainder();
    for c in chunks {
        for i in 0..8 {
            acc[i] += c[i];
        }
    }
    acc.iter().sum::<f32>() + tail.iter().sum::<f32>()
}

/// Dot product with eight independent lanes.
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    let mut acc = [0.0f32; 8];
    let ca = a.chunks_exact(8);
    let cb = b.chunks_exact(8);
    let tail: f32 = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in ca.zip(cb) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// A product's sizes: `dst (m x n) = lhs (m x k) @ rhs (k x n)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Dims {
    pub m: usize,
    pub n: usize,
    pub k: usize,
}

/// A row-major-or-strided matrix operand: element (i, j) is at
/// `ptr + i * row_stride + j * col_stride`.
#[derive(Clone, Copy)]
pub struct Mat<T> {
    pub ptr: T,
    pub row_stride: isize,
    pub col_stride: isize,
}

impl<T> Mat<T> {
    pub fn new(ptr: T, row_stride: usize, col_stride: usize) -> Self {
        Mat {
            ptr,
            row_stride: row_stride as isize,
            col_stride: col_stride as isize,
        }
    }

    /// The transpose view of the same memory.
    pub fn t(self) -> Self {
        Mat {
            ptr: self.ptr,
            row_stride: self.col_stride,
            col_stride: self.row_stride,
        }
    }
}

/// `dst (m x n) = [dst +] scale * lhs (m x k) @ rhs (k x n)`, on the
/// library chosen for its class (`blas`), else the `gemm` crate. With
/// `bf16` (`--precision bf16`) on the operands rounded to bfloat16: in bf16
/// arithmetic on the product chosen for that where one is
/// (`blas::current_bf16`; it rounds them as it packs them), else in fp32 on
/// copies rounded into this thread's scratch.
///
/// # Safety
/// Every element addressed through the three operands for the given sizes
/// must lie inside live allocations, and `dst` must not alias `lhs` or `rhs`.
#[allow(clippy::too_many_arguments)] // a BLAS call's own arguments
pub unsafe fn gemm(
    bf16: bool,
    (m, n, k): (usize, usize, usize),
    dst: Mat<*mut f32>,
    lhs: Mat<*const f32>,
    rhs: Mat<*const f32>,
    accumulate: bool,
    scale: f32,
    threads: usize,
) {
    let dims = Dims { m, n, k };
    let on_bf16 = || {
        let lib = blas::current_bf16()?;
        blas::gemm(lib, true, dims, dst, lhs, rhs, accumulate, scale, threads).then_some(())
    };
    let lib = blas::current(blas::Class::of(m, n, k));
    if !bf16 {
        return gemm_on(lib, dims, dst, lhs, rhs, accumulate, scale, threads);
    }
    if on_bf16().is_some() {
        return;
    }
    with_scratch(&ROUNDED, m * k + k * n, |scratch| {
        let (a, b) = scratch.split_at_mut(m * k);
        let (a_row, a_col) = round_compact(lhs, m, k, a, super::round_to_bf16);
        let (b_row, b_col) = round_compact(rhs, k, n, b, super::round_to_bf16);
        let lhs = Mat::new(a.as_ptr(), a_row, a_col);
        let rhs = Mat::new(b.as_ptr(), b_row, b_col);
        gemm_on(lib, dims, dst, lhs, rhs, accumulate, scale, threads);
    })
}

thread_local! {
    /// [`gemm`]'s rounded operands in fp32 arithmetic.
    static ROUNDED: Scratch<f32> = const { Scratch::new(Vec::new()) };
}

/// A thread's scratch for a product's operands, kept for its next product
/// (as a BLAS keeps its packing buffers) up to [`KEPT_SCRATCH`] bytes and
/// not counted: a larger one (a wide vocabulary's head) is freed after.
pub(crate) type Scratch<T> = std::cell::Cell<Vec<T>>;

/// The most scratch a thread keeps between products (32 MiB).
const KEPT_SCRATCH: usize = 32 << 20;

/// `f` on `len` elements of this thread's `scratch` (their values left
/// from an earlier product: `f` writes what it reads).
pub(crate) fn with_scratch<T: Copy + Default, R>(
    scratch: &'static std::thread::LocalKey<Scratch<T>>,
    len: usize,
    f: impl FnOnce(&mut [T]) -> R,
) -> R {
    let mut buf = scratch.take();
    if buf.len() < len {
        buf.resize(len, T::default());
    }
    let out = f(&mut buf[..len]);
    if buf.capacity() * std::mem::size_of::<T>() <= KEPT_SCRATCH {
        scratch.set(buf);
    }
    out
}

/// A `rows x cols` view, each element through `f` (a rounding), into `out`
/// without gaps: its rows one after another, or its columns where it is
/// stored by column (row stride 1), reading only the elements it
/// addresses. Returns the copy's (row stride, column stride).
///
/// # Safety
/// The view's elements are readable; `out` holds `rows * cols`.
pub(super) unsafe fn round_compact<T: Send>(
    x: Mat<*const f32>,
    rows: usize,
    cols: usize,
    out: &mut [T],
    f: impl Fn(f32) -> T + Sync,
) -> (usize, usize) {
    use rayon::prelude::*;
    let by_cols = x.row_stride == 1 && x.col_stride != 1;
    let (runs, len, run_stride, step) = match by_cols {
        true => (cols, rows, x.col_stride, x.row_stride),
        false => (rows, cols, x.row_stride, x.col_stride),
    };
    let addr = x.ptr as usize;
    out[..runs * len]
        .par_chunks_mut(len.max(1))
        .with_min_len((1 << 14) / len.max(1))
        .enumerate()
        .for_each(|(i, run)| {
            let from = (addr as *const f32).offset(i as isize * run_stride);
            if step == 1 {
                // SAFETY: run i of the view: `len` elements from its start
                let from = unsafe { std::slice::from_raw_parts(from, len) };
                run.iter_mut().zip(from).for_each(|(t, &v)| *t = f(v));
            } else {
                for (j, t) in run.iter_mut().enumerate() {
                    // SAFETY: element j of run i lies in the view
                    *t = f(unsafe { *from.offset(j as isize * step) });
                }
            }
        });
    match by_cols {
        true => (1, len),
        false => (len, 1),
    }
}

/// [`gemm()`] on `lib`, whatever is chosen (the built-in where `lib` cannot
/// take the operands or is not here). The built-in runs a `Small` product
/// on one thread on distgpt's tile kernel (`tile`) where its width
/// suits one, everything else on the `gemm` crate.
///
/// # Safety
/// As [`gemm()`].
#[allow(clippy::too_many_arguments)] // a BLAS call's own arguments
pub unsafe fn gemm_on(
    lib: blas::MatmulLib,
    dims: Dims,
    dst: Mat<*mut f32>,
    lhs: Mat<*const f32>,
    rhs: Mat<*const f32>,
    accumulate: bool,
    scale: f32,
    threads: usize,
) {
    let Dims { m, n, k } = dims;
    if m == 0 || n == 0 {
        return;
    }
    if lib != blas::MatmulLib::Gemm
        && blas::gemm(lib, false, dims, dst, lhs, rhs, accumulate, scale, threads)
    {
        return;
    }
    if lib == blas::MatmulLib::Gemm
        && threads <= 1
        && blas::Class::of(m, n, k) == blas::Class::Small
    {
        let views = Views::of(dims, dst, lhs, rhs).rows_contiguous();
        if let Some(Views {
            dst,
            lhs,
            rhs,
            dims,
        }) = views
        {
            if let Some(kernel) = super::tile::Kernel::for_width(dims.n) {
                return super::tile::product_on(kernel, dst, lhs, rhs, dims, accumulate, scale);
            }
        }
    }
    let par = if threads > 1 {
        Parallelism::Rayon(threads)
    } else {
        Parallelism::None
    };
    gemm::gemm(
        m,
        n,
        k,
        dst.ptr,
        dst.col_stride,
        dst.row_stride,
        accumulate,
        lhs.ptr,
        lhs.col_stride,
        lhs.row_stride,
        rhs.ptr,
        rhs.col_stride,
        rhs.row_stride,
        1.0,
        scale,
        false,
        false,
        false,
        par,
    );
}

/// A product's views with its sizes: `dst = lhs @ rhs`.
#[derive(Clone, Copy)]
pub(super) struct Views {
    pub dst: Mat<*mut f32>,
    pub lhs: Mat<*const f32>,
    pub rhs: Mat<*const f32>,
    pub dims: Dims,
}

impl Views {
    pub fn of(dims: Dims, dst: Mat<*mut f32>, lhs: Mat<*const f32>, rhs: Mat<*const f32>) -> Self {
        Views {
            dst,
            lhs,
            rhs,
            dims,
        }
    }

    /// The same product with `dst`'s rows contiguous: as given where its
    /// column stride is 1, else as `dst^T = rhs^T lhs^T` (`n x m`) where
    /// its row stride is; None where neither is.
    pub fn rows_contiguous(self) -> Option<Views> {
        let Views {
            dst,
            lhs,
            rhs,
            dims,
        } = self;
        if dst.col_stride == 1 {
            Some(self)
        } else if dst.row_stride == 1 {
            Some(Views {
                dst: dst.t(),
                lhs: rhs.t(),
                rhs: lhs.t(),
                dims: Dims {
                    m: dims.n,
                    n: dims.m,
                    k: dims.k,
                },
            })
        } else {
            None
        }
    }
}

/// A raw pointer that may cross threads: kernels hand disjoint regions of
/// one buffer to rayon tasks.
#[derive(Clone, Copy)]
pub struct SendPtr<T = f32>(pub *mut T);
unsafe impl<T> Send for SendPtr<T> {}
unsafe impl<T> Sync for SendPtr<T> {}

impl<T> SendPtr<T> {
    /// The pointer; a method, so closures capture the whole `Send` wrapper.
    pub fn get(self) -> *mut T {
        self.0
    }

    /// `len` elements from `offset`.
    ///
    /// # Safety
    /// They must lie inside the buffer and be written by the caller's task
    /// alone.
    pub(super) unsafe fn slice<'a>(&self, offset: usize, len: usize) -> &'a mut [T] {
        std::slice::from_raw_parts_mut(self.0.add(offset), len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fast_exp_matches_std_to_few_ulp() {
        let mut x = -80.0f32;
        while x < 80.0 {
            let rel = ((exp(x) - x.exp()) / x.exp()).abs();
            assert!(rel < 5e-7, "x={x} rel={rel}");
            x += 0.0137;
        }
    }

    #[test]
    fn gelu_matches_the_tanh_formula_in_f64() {
        let mut x = -12.0f32;
        while x < 12.0 {
            let xd = x as f64;
            let u = (2.0 / std::f64::consts::PI).sqrt() * (xd + 0.044715 * xd.powi(3));
            let want = 0.5 * xd * (1.0 + u.tanh());
            let err = (gelu(x) as f64 - want).abs();
            assert!(
                err <= 1e-6 * want.abs().max(1e-3),
                "x={x}: {} vs {want}",
                gelu(x)
            );
            x += 0.00731;
        }
        assert!(gelu(-200.0).abs() < 1e-30);
        assert_eq!(gelu(200.0), 200.0);
    }

    #[test]
    fn gelu_grad_matches_finite_difference() {
        for i in -60..60 {
            let x = i as f64 * 0.1;
            let h = 1e-3f32;
            let fd = (gelu(x as f32 + h) - gelu(x as f32 - h)) / (2.0 * h);
            assert!((fd - gelu_grad(x as f32)).abs() < 2e-3, "x={x}");
        }
    }
}
