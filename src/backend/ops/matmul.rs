//! Matmul with fused bias, forward and backward, as kernels: the `gemm`
//! crate's products (`cpu::math::gemm`) on the CPU, the runtime's BLAS on
//! a GPU.
//!
//! Weights are either `InOut` (k x n, Hugging Face Conv1D: `out = inp @ w`)
//! or `OutIn` (n x k, nn.Linear / the tied embedding: `out = inp @ w^T`).

use super::{
    convert, need, widened, Checked, Extent, Held, Host, Kernel, Lower, Operands, Queued, Stored,
};
use crate::backend::cpu::blas::{self, gemm_stored};
use crate::backend::cpu::math::{column_sums, gemm, with_scratch, Mat, Scratch};
use crate::backend::cpu::round_to_bf16;
use crate::backend::cpu::{dpbf16::Onto, Element};
use crate::backend::gpu::{
    stored_operand, stored_view, weight_operand, Gemm, Queue, Raw, Runtime, View,
};
use crate::backend::profile::matmul_flops;
use crate::backend::Bf16;
use crate::backend::COLUMN_CHUNK_ROWS;
use rayon::prelude::*;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WeightLayout {
    InOut,
    OutIn,
}

/// A matmul's shape and arithmetic: inp (rows, k) @ W (k x n, in `layout`);
/// `bf16` when the products take the operands (the input, the weight, the
/// output gradient) rounded to bfloat16, as every backend does itself (a
/// device with bf16 matrix units runs them there); a bias's gradient sums
/// the fp32 output gradient.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MatmulShape {
    pub rows: usize,
    pub k: usize,
    pub n: usize,
    pub layout: WeightLayout,
    pub bf16: bool,
}

impl MatmulShape {
    /// An fp32 product of `(rows, k, n)` in `layout`.
    pub fn new((rows, k, n): (usize, usize, usize), layout: WeightLayout) -> Self {
        MatmulShape {
            rows,
            k,
            n,
            layout,
            bf16: false,
        }
    }

    /// The same product, its operands rounded to bf16 where `bf16`.
    pub fn with_bf16(self, bf16: bool) -> Self {
        MatmulShape { bf16, ..self }
    }
}

operation! {
    /// out (rows, n) = [out or residual +] inp (rows, k) @ W + bias. An
    /// fp32 `residual` (rows, n) is where the products go onto in place of
    /// `out`'s own values (a projection onto the residual stream: one pass
    /// where a copy into `out` and an accumulation took two; cuBLASLt's
    /// C other than its D). An `out` stored in
    /// bf16 (the LM head's logits, GPT-2's q|k|v, under `--precision bf16`)
    /// takes bf16 products, no accumulation, and each sum rounded after the
    /// bias rounded to bf16 is added (autocast's bf16 linear); an `inp`
    /// stored in bf16 (GPT-2's GELU output) or a `w` (the weights' bf16
    /// copy) takes bf16 products.
    pub struct MatmulForward<O> {
        stored_output out: f32,
        stored_input inp: f32,
        stored_input w: f32,
        maybe_input bias: f32,
        maybe_input residual: f32,
        value shape: MatmulShape,
        /// Adds to `out` instead of overwriting it.
        value accumulate: bool,
    }
}

operation! {
    /// The gradients of [`MatmulForward`]: dinp (rows, k) overwritten; dw
    /// (k x n) +=; dbias (n) +=. `dinp` None is the weight half (which never
    /// reads `w`), `dw` None the input half (which never reads `inp`). A
    /// `dout` stored in bf16 (GPT-2's q|k|v gradient under `--precision
    /// bf16`) takes bf16 products, its bias gradient the sum of its values;
    /// an `inp` or `w` stored in bf16, bf16 products.
    pub struct MatmulBackward<O> {
        maybe_output dinp: f32,
        maybe_output dw: f32,
        maybe_output dbias: f32,
        stored_input dout: f32,
        stored_input inp: f32,
        stored_input w: f32,
        value shape: MatmulShape,
    }
}

impl<O: Operands> Kernel<O> for MatmulForward<O> {
    const NAME: &'static str = "matmul_forward";

    fn check(&self) -> Result<(), String> {
        let MatmulShape { rows, k, n, .. } = self.shape;
        need("out", &self.out, rows * n)?;
        need("inp", &self.inp, rows * k)?;
        need("w", &self.w, k * n)?;
        let onto = self.accumulate || self.residual.is_some();
        if self.out.is_bf16() && onto {
            return Err("an output stored in bf16 takes no accumulation or residual".into());
        }
        if self.accumulate && self.residual.is_some() {
            return Err("a product goes onto its output or onto a residual, not both".into());
        }
        if let Some(r) = &self.residual {
            need("residual", r, rows * n)?;
        }
        self.bias.as_ref().map_or(Ok(()), |b| need("bias", b, n))
    }

    fn flops(&self) -> f64 {
        matmul_flops(self.shape, 1)
    }

    fn cpu<'a>(self, host: &impl Lower<O, Host<'a>>) {
        forward(self.lower(host))
    }

    /// One GEMM, the bias in its epilogue where the device's GEMM takes
    /// one (`Queue::gemm` adds it first where not).
    fn gpu<R: Runtime>(self, q: &Queue<R>, raw: &impl Lower<O, Raw>, _: Checked) -> Queued {
        let op = self.lower(raw);
        let MatmulShape { rows, k, n, .. } = op.shape;
        let (out, c_bf16) = stored_view(op.out);
        let bf16 = op.shape.bf16 || c_bf16 == 1 || op.inp.is_bf16() || op.w.is_bf16();
        let layout = op.shape.layout;
        // Row-major out (rows, n) is column-major out^T (n x rows) = W^T @ inp^T.
        let ab = [
            weight_operand(op.w, layout, k, n, false),
            stored_operand(op.inp, false, k),
        ];
        q.gemm(Gemm {
            beta: f32::from(u8::from(op.accumulate)),
            bias: op.bias,
            residual: op.residual,
            c_bf16: c_bf16 == 1,
            ..Gemm::new([n, rows, k], ab, out, n, bf16)
        })
    }
}

impl<O: Operands> Kernel<O> for MatmulBackward<O> {
    const NAME: &'static str = "matmul_backward";

    fn check(&self) -> Result<(), String> {
        let MatmulShape { rows, k, n, .. } = self.shape;
        need("dout", &self.dout, rows * n)?;
        if let Some(dinp) = &self.dinp {
            need("dinp", dinp, rows * k)?;
            need("w", &self.w, k * n)?;
        }
        if let Some(dw) = &self.dw {
            need("inp", &self.inp, rows * k)?;
            need("dw", dw, k * n)?;
        }
        self.dbias
            .as_ref()
            .map_or(Ok(()), |db| need("dbias", db, n))
    }

    fn flops(&self) -> f64 {
        let products = self.dinp.is_some() as usize + self.dw.is_some() as usize;
        matmul_flops(self.shape, products)
    }

    fn cpu<'a>(self, host: &impl Lower<O, Host<'a>>) {
        backward(self.lower(host))
    }

    /// Under bf16 products an fp32 `dout` that both products read is
    /// rounded once, into the queue's scratch, not by each GEMM.
    fn gpu<R: Runtime>(self, q: &Queue<R>, raw: &impl Lower<O, Raw>, _: Checked) -> Queued {
        let op = self.lower(raw);
        let MatmulShape { rows, n, .. } = op.shape;
        let bf16 = op.shape.bf16 || op.dout.is_bf16() || op.inp.is_bf16() || op.w.is_bf16();
        let (dout, held) = stored_view(op.dout);
        match bf16 && held == 0 && op.dinp.is_some() && op.dw.is_some() {
            // two bf16 values a scratch word
            true => q.with_scratch([(rows * n).div_ceil(2)], |[words]| {
                let rounded = View {
                    off: 2 * words.off,
                    len: rows * n,
                    ..words
                };
                q.pointwise("to_bf16", rounded, dout.part(0..rows * n))?;
                products(q, &op, Stored::Bf16(rounded), bf16)
            })?,
            false => products(q, &op, op.dout, bf16)?,
        }
        match op.dbias {
            Some(db) => q.bias_backward(db, op.dout, None, (rows, n)),
            None => Ok(()),
        }
    }
}

/// `op`'s two products on a GPU, from `dout` (`op.dout`, or its rounded copy).
fn products<R: Runtime>(
    q: &Queue<R>,
    op: &MatmulBackward<Raw>,
    dout: Stored<View, View>,
    bf16: bool,
) -> Queued {
    let MatmulShape {
        rows, k, n, layout, ..
    } = op.shape;
    let dout = |transpose| stored_operand(dout, transpose, n);
    if let Some(dinp) = op.dinp {
        // dinp^T (k x rows) = W @ dout^T.
        let ab = [weight_operand(op.w, layout, k, n, true), dout(false)];
        q.gemm(Gemm::new([k, rows, n], ab, dinp, k, bf16))?;
    }
    let Some(dw) = op.dw else { return Ok(()) };
    let ([m, cols], ab) = match layout {
        // dw (k, n) += inp^T @ dout: column-major dw^T (n x k) += dout^T @ inp.
        WeightLayout::InOut => ([n, k], [dout(false), stored_operand(op.inp, true, k)]),
        // dw (n, k) += dout^T @ inp: column-major dw^T (k x n) += inp^T @ dout.
        WeightLayout::OutIn => ([k, n], [stored_operand(op.inp, false, k), dout(true)]),
    };
    q.gemm(Gemm {
        beta: 1.0,
        ..Gemm::new([m, cols, rows], ab, dw, m, bf16)
    })
}

fn weight_mat<T>(w: T, layout: WeightLayout, k: usize, n: usize) -> Mat<T> {
    match layout {
        WeightLayout::InOut => Mat::new(w, n, 1),
        WeightLayout::OutIn => Mat::new(w, 1, k),
    }
}

/// out (rows, n) = [out +] inp (rows, k) @ W + bias.
fn forward(op: MatmulForward<Host<'_>>) {
    forward_on(op, true)
}

/// [`forward`], bf16 storage read and written by the bf16 kernel that
/// runs here where `native` (the tests' switch to the other route).
fn forward_on(op: MatmulForward<Host<'_>>, native: bool) {
    let MatmulForward {
        out,
        inp,
        w,
        bias,
        residual,
        shape,
        accumulate,
    } = op;
    let MatmulShape {
        rows, k, n, layout, ..
    } = shape;
    assert!(out.extent() >= rows * n && inp.extent() >= rows * k && w.extent() >= k * n);
    let (inp, w) = (inp.part(0..rows * k), w.part(0..k * n));
    let shape = shape.with_bf16(shape.bf16 || inp.is_bf16() || w.is_bf16());
    let threads = rayon::current_num_threads();
    let out = match out {
        Stored::F32(out) => &mut out[..rows * n],
        Stored::Bf16(out) => {
            let out = &mut out[..rows * n];
            return forward_rounded(out, inp, w, bias.map(|b| &b[..n]), shape, native);
        }
    };
    // The bias goes onto an output the product adds to before the product,
    // and onto one it starts after it, so that the product only writes that
    // output: read back tile by tile inside the product, a freshly written
    // bias cost the shakespeare-char step 1-2% more than this sequential
    // pass. Only the rounding order can differ (and only where the product
    // sums its depth in several blocks, the bias now added last).
    let add_bias = |out: &mut [f32]| {
        if let Some(b) = bias {
            out.par_chunks_mut(n)
                .for_each(|row| row.iter_mut().zip(b).for_each(|(o, &bb)| *o += bb));
        }
    };
    // a residual and the bias go onto the output in one pass: what a copy
    // and the bias's pass onto it leave
    match residual {
        Some(r) => out
            .par_chunks_mut(n.max(1))
            .zip(r[..rows * n].par_chunks(n.max(1)))
            .for_each(|(o, r)| match bias {
                Some(b) => o
                    .iter_mut()
                    .zip(r)
                    .zip(b)
                    .for_each(|((o, &r), &b)| *o = r + b),
                None => o.copy_from_slice(r),
            }),
        None if accumulate => add_bias(out),
        None => {}
    }
    let accumulate = accumulate || residual.is_some();
    let to = Mat::new(out.as_mut_ptr(), n, 1);
    let (lhs, rhs) = (HeldMat::of(inp, k, 1), weight_held(w, layout, k, n));
    // SAFETY (both): sizes were checked above; out does not alias inp or w.
    let done = native
        && (inp.is_bf16() || w.is_bf16())
        && unsafe { gemm_held((rows, n, k), to, lhs, rhs, accumulate.into()) };
    if !done {
        let bf16 = shape.bf16;
        operand(&WIDENED_W, w, bf16, |w| {
            operand(&WIDENED, inp, bf16, |inp| unsafe {
                gemm(
                    in_bf16(bf16),
                    (rows, n, k),
                    to,
                    Mat::new(inp.as_ptr(), k, 1),
                    weight_mat(w.as_ptr(), layout, k, n),
                    accumulate,
                    1.0,
                    threads,
                )
            })
        });
    }
    if !accumulate {
        add_bias(out);
    }
}

/// A product's operand as its storage holds it, a matrix view of it.
type HeldMat = Stored<Mat<*const f32>, Mat<*const Bf16>>;

impl HeldMat {
    /// `x` with these strides.
    fn of(x: Held, row_stride: usize, col_stride: usize) -> Self {
        x.map(
            |x| Mat::new(x.as_ptr(), row_stride, col_stride),
            |x| Mat::new(x.as_ptr(), row_stride, col_stride),
        )
    }

    /// The transpose view.
    fn t(self) -> Self {
        self.map(Mat::t, Mat::t)
    }
}

/// W (k x n, in `layout`) as it is held.
fn weight_held(w: Held, layout: WeightLayout, k: usize, n: usize) -> HeldMat {
    match layout {
        WeightLayout::InOut => HeldMat::of(w, n, 1),
        WeightLayout::OutIn => HeldMat::of(w, 1, k),
    }
}

/// [`gemm_stored`] on this pool, each operand read as it is held.
///
/// # Safety
/// As `gemm_stored`.
unsafe fn gemm_held<D: Element>(
    dims: (usize, usize, usize),
    dst: Mat<*mut D>,
    lhs: HeldMat,
    rhs: HeldMat,
    onto: Onto,
) -> bool {
    let t = rayon::current_num_threads();
    // SAFETY: as this function's
    unsafe {
        match (lhs, rhs) {
            (HeldMat::F32(l), HeldMat::F32(r)) => gemm_stored(dims, dst, l, r, onto, t),
            (HeldMat::F32(l), HeldMat::Bf16(r)) => gemm_stored(dims, dst, l, r, onto, t),
            (HeldMat::Bf16(l), HeldMat::F32(r)) => gemm_stored(dims, dst, l, r, onto, t),
            (HeldMat::Bf16(l), HeldMat::Bf16(r)) => gemm_stored(dims, dst, l, r, onto, t),
        }
    }
}

/// [`forward`] into a bf16 `out` (rows x n; no accumulation), in bf16
/// products, each sum rounded after its `bias` (n) rounded to bf16 is
/// added, as a bf16 GEMM's epilogue adds a bf16 bias: where `native`, by
/// the bf16 kernel that stores its sums rounded, if it runs here; else
/// column blocks of the product in fp32 staging, each stored rounded.
fn forward_rounded(
    out: &mut [Bf16],
    inp: Held,
    w: Held,
    bias: Option<&[f32]>,
    shape: MatmulShape,
    native: bool,
) {
    let (rows, k, n, layout) = (shape.rows, shape.k, shape.n, shape.layout);
    let threads = rayon::current_num_threads();
    let to = Mat::new(out.as_mut_ptr(), n, 1);
    let (lhs, rhs) = (HeldMat::of(inp, k, 1), weight_held(w, layout, k, n));
    let onto = bias.map_or(Onto::Over, Onto::Bias);
    // SAFETY: the caller checked the sizes; out does not alias inp or w.
    if native && unsafe { gemm_held((rows, n, k), to, lhs, rhs, onto) } {
        return;
    }
    operand(&WIDENED_W, w, true, |w| {
        operand(&WIDENED, inp, true, |inp| {
            staged(rows, n, |stage, cols| {
                let nc = cols.len();
                let w_cols =
                    weight_mat(w[first_col(layout, k, cols.start)..].as_ptr(), layout, k, n);
                // SAFETY: sizes were checked above; the stage is its own buffer.
                unsafe {
                    gemm(
                        in_bf16(true),
                        (rows, nc, k),
                        Mat::new(stage.as_mut_ptr(), nc, 1),
                        Mat::new(inp.as_ptr(), k, 1),
                        w_cols,
                        false,
                        1.0,
                        threads,
                    );
                }
                let bias = bias.map(|b| &b[cols.clone()]);
                out.par_chunks_mut(n)
                    .zip(stage.par_chunks(nc))
                    .for_each(|(o, s)| {
                        let o = o[cols.clone()].iter_mut().zip(s);
                        match bias {
                            Some(b) => o.zip(b).for_each(|((o, &x), &b)| {
                                *o = Bf16::from_f32(x + round_to_bf16(b))
                            }),
                            None => o.for_each(|(o, &x)| *o = Bf16::from_f32(x)),
                        }
                    });
            })
        })
    })
}

/// Floats of fp32 staging a product with a bf16 operand or output holds at
/// once (32 MiB, what a thread's scratch keeps).
const STAGE: usize = 1 << 23;

thread_local! {
    /// [`staged`]'s fp32 columns.
    static STAGED: Scratch<f32> = const { Scratch::new(Vec::new()) };
    /// [`operand`]'s input, weight and output gradient.
    static WIDENED: Scratch<f32> = const { Scratch::new(Vec::new()) };
    static WIDENED_W: Scratch<f32> = const { Scratch::new(Vec::new()) };
    static ROUNDED_DOUT: Scratch<f32> = const { Scratch::new(Vec::new()) };
}

/// Whether a product with `bf16` operands runs in bf16 arithmetic here
/// (on a bf16 product, which rounds its operands itself); else its
/// operands come rounded from [`operand`], and it runs in fp32.
fn in_bf16(bf16: bool) -> bool {
    bf16 && blas::bf16_arithmetic()
}

/// `f` on `x` in fp32 as a product with `bf16` operands takes it: a bf16
/// tensor's values widened into this thread's `scratch` (bf16 values
/// already); an fp32 one as it is, or, where the product runs in fp32
/// arithmetic ([`in_bf16`] false), its values rounded into `scratch`, in
/// one pass (the product would round a widened copy again).
fn operand<R>(
    scratch: &'static std::thread::LocalKey<Scratch<f32>>,
    x: Held,
    bf16: bool,
    f: impl FnOnce(&[f32]) -> R,
) -> R {
    match x {
        Stored::F32(x) if bf16 && !in_bf16(bf16) => with_scratch(scratch, x.len(), |r| {
            convert(r, x, true, round_to_bf16);
            f(r)
        }),
        x => widened(scratch, x, true, f),
    }
}

/// `f` on blocks of the columns `0..n` of a (rows, n) product, each with
/// fp32 staging for those columns of every row (row stride the block's
/// width): wide enough to keep the products large, narrow enough that the
/// staging stays [`STAGE`] floats (or one row of 16).
fn staged(rows: usize, n: usize, mut f: impl FnMut(&mut [f32], std::ops::Range<usize>)) {
    let width = (STAGE / rows.max(1)).max(16).min(n.max(1));
    with_scratch(&STAGED, rows * width, |stage| {
        for c0 in (0..n).step_by(width) {
            let cols = c0..n.min(c0 + width);
            f(&mut stage[..rows * cols.len()], cols);
        }
    })
}

/// Where column `c0` of W (k x n, in `layout`) starts in its storage.
fn first_col(layout: WeightLayout, k: usize, c0: usize) -> usize {
    match layout {
        WeightLayout::InOut => c0,
        WeightLayout::OutIn => c0 * k,
    }
}

/// dinp = dout @ W^T (overwritten); dw += inp^T @ dout; dbias +=
/// colsum(dout); each half only when its outputs are given.
fn backward(op: MatmulBackward<Host<'_>>) {
    backward_on(op, true)
}

/// [`backward`], bf16 storage read by the bf16 kernel that runs here where
/// `native` (the tests' switch to the other route).
fn backward_on(op: MatmulBackward<Host<'_>>, native: bool) {
    let MatmulBackward {
        dinp,
        dw,
        dbias,
        dout,
        inp,
        w,
        shape,
    } = op;
    let (rows, k, n, layout) = (shape.rows, shape.k, shape.n, shape.layout);
    assert!(dout.extent() >= rows * n);
    assert!(dinp
        .as_ref()
        .is_none_or(|d| d.len() >= rows * k && w.extent() >= k * n));
    assert!(dw
        .as_ref()
        .is_none_or(|d| d.len() >= k * n && inp.extent() >= rows * k));
    let inp = inp.part(0..inp.extent().min(rows * k));
    let w = w.part(0..w.extent().min(k * n));
    let shape = shape.with_bf16(shape.bf16 || inp.is_bf16() || w.is_bf16());
    let threads = rayon::current_num_threads();
    let dout = match dout {
        Stored::F32(dout) => &dout[..rows * n],
        Stored::Bf16(dout) => {
            let dout = &dout[..rows * n];
            backward_stored(dinp, dw, dout, inp, w, shape, native);
            if let Some(db) = dbias {
                bias_backward(db, dout, n, Bf16::to_f32);
            }
            return;
        }
    };
    // SAFETY (all): sizes were checked above; destinations are distinct buffers.
    let dinp = dinp.and_then(|dinp| {
        let to = Mat::new(dinp.as_mut_ptr(), k, 1);
        let (d, w_t) = (
            Mat::new(dout.as_ptr(), n, 1),
            weight_held(w, layout, k, n).t(),
        );
        let done = native
            && w.is_bf16()
            && unsafe { gemm_held((rows, k, n), to, HeldMat::F32(d), w_t, Onto::Over) };
        (!done).then_some(dinp)
    });
    let dw = dw.and_then(|dw| {
        let to = weight_mat(dw.as_mut_ptr(), layout, k, n);
        let (d, inp_t) = (Mat::new(dout.as_ptr(), n, 1), HeldMat::of(inp, k, 1).t());
        let done = native
            && inp.is_bf16()
            && unsafe { gemm_held((k, n, rows), to, inp_t, HeldMat::F32(d), Onto::Add) };
        (!done).then_some(dw)
    });
    // what is left, on fp32 products: dout rounded once for both
    let bf16 = shape.bf16;
    let left = dinp.is_some() || dw.is_some();
    let dout_held = Stored::F32(if left { dout } else { &[][..] });
    operand(&ROUNDED_DOUT, dout_held, bf16, |d| {
        let d = Mat::new(d.as_ptr(), n, 1);
        if let Some(dinp) = dinp {
            let to = Mat::new(dinp.as_mut_ptr(), k, 1);
            operand(&WIDENED_W, w, bf16, |w| unsafe {
                let w = weight_mat(w.as_ptr(), layout, k, n).t();
                gemm(in_bf16(bf16), (rows, k, n), to, d, w, false, 1.0, threads)
            });
        }
        if let Some(dw) = dw {
            let to = weight_mat(dw.as_mut_ptr(), layout, k, n);
            operand(&WIDENED, inp, bf16, |inp| unsafe {
                let inp = Mat::new(inp.as_ptr(), k, 1).t();
                gemm(in_bf16(bf16), (k, n, rows), to, inp, d, true, 1.0, threads)
            });
        }
    });
    if let Some(db) = dbias {
        bias_backward(db, dout, n, |d| d);
    }
}

/// [`backward`]'s products for a `dout` stored in bf16, in bf16 products:
/// where `native`, each half by the bf16 kernel
/// that reads `dout` as it is, if it runs here; else `dout`'s column blocks
/// widened into fp32 staging, dinp summed over them, dw's columns a block
/// at a time.
fn backward_stored(
    dinp: Option<&mut [f32]>,
    dw: Option<&mut [f32]>,
    dout: &[Bf16],
    inp: Held,
    w: Held,
    shape: MatmulShape,
    native: bool,
) {
    let (rows, k, n, layout) = (shape.rows, shape.k, shape.n, shape.layout);
    let threads = rayon::current_num_threads();
    let dout_mat = HeldMat::Bf16(Mat::new(dout.as_ptr(), n, 1));
    // SAFETY (both): the caller checked the sizes; destinations are distinct buffers.
    let mut dinp = match dinp {
        Some(d) if native => {
            let (to, w_t) = (
                Mat::new(d.as_mut_ptr(), k, 1),
                weight_held(w, layout, k, n).t(),
            );
            let done = unsafe { gemm_held((rows, k, n), to, dout_mat, w_t, Onto::Over) };
            (!done).then_some(d)
        }
        dinp => dinp,
    };
    let mut dw = match dw {
        Some(d) if native => {
            let to = weight_mat(d.as_mut_ptr(), layout, k, n);
            let inp_t = HeldMat::of(inp, k, 1).t();
            let done = unsafe { gemm_held((k, n, rows), to, inp_t, dout_mat, Onto::Add) };
            (!done).then_some(d)
        }
        dw => dw,
    };
    if dinp.is_none() && dw.is_none() {
        return;
    }
    // the input in fp32 only where dw is left to stage, the weight where dinp is
    let none = Stored::F32(&[][..]);
    let inp = if dw.is_some() { inp } else { none };
    let w = if dinp.is_some() { w } else { none };
    operand(&WIDENED_W, w, true, |w| {
        operand(&WIDENED, inp, true, |inp| {
            staged(rows, n, |stage, cols| {
                let nc = cols.len();
                // dout's bf16 values, widened: already as a bf16 product takes them
                stage
                    .par_chunks_mut(nc)
                    .zip(dout.par_chunks(n))
                    .for_each(|(s, d)| convert(s, &d[cols.clone()], false, Bf16::to_f32));
                if let Some(dinp) = dinp.as_deref_mut() {
                    let w_cols = &w[first_col(layout, k, cols.start)..];
                    // SAFETY: sizes were checked above; destinations are distinct buffers.
                    unsafe {
                        gemm(
                            in_bf16(true),
                            (rows, k, nc),
                            Mat::new(dinp.as_mut_ptr(), k, 1),
                            Mat::new(stage.as_ptr(), nc, 1),
                            weight_mat(w_cols.as_ptr(), layout, k, n).t(),
                            cols.start > 0,
                            1.0,
                            threads,
                        );
                    }
                }
                if let Some(dw) = dw.as_deref_mut() {
                    let at = dw[first_col(layout, k, cols.start)..].as_mut_ptr();
                    // SAFETY: sizes were checked above; destinations are distinct buffers.
                    unsafe {
                        gemm(
                            in_bf16(true),
                            (k, nc, rows),
                            weight_mat(at, layout, k, n),
                            Mat::new(inp.as_ptr(), k, 1).t(),
                            Mat::new(stage.as_ptr(), nc, 1),
                            true,
                            1.0,
                            threads,
                        );
                    }
                }
            })
        })
    })
}

/// db (n) += sum over rows of dout (rows, n), in [`column_sums`]' chunks.
fn bias_backward<T: Copy + Sync>(
    db: &mut [f32],
    dout: &[T],
    n: usize,
    wide: impl Fn(T) -> f32 + Sync,
) {
    if n == 0 {
        return;
    }
    let db = &mut db[..n];
    column_sums(
        &mut [db],
        dout.par_chunks(COLUMN_CHUNK_ROWS * n),
        |rows, p| {
            for row in rows.chunks_exact(n) {
                p.iter_mut().zip(row).for_each(|(p, &d)| *p += wide(d));
            }
        },
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::check::*;
    use crate::rng::Rng;

    fn reference(
        inp: &[f64],
        w: &[f64],
        b: &[f64],
        layout: WeightLayout,
        rows: usize,
        k: usize,
        n: usize,
    ) -> Vec<f64> {
        let mut out = vec![0.0; rows * n];
        for r in 0..rows {
            for j in 0..n {
                let mut s = b[j];
                for i in 0..k {
                    let wij = match layout {
                        WeightLayout::InOut => w[i * n + j],
                        WeightLayout::OutIn => w[j * k + i],
                    };
                    s += inp[r * k + i] * wij;
                }
                out[r * n + j] = s;
            }
        }
        out
    }

    /// A product stored in bf16 is the fp32 product (bf16 products) with
    /// each sum rounded (with a bias, the sum plus the bias rounded to
    /// bf16, as a bf16 epilogue adds it), and a bf16 output gradient gives what the same
    /// values held in fp32 give: by the bf16 kernel that reads and writes
    /// bf16 storage (where it runs), bit for bit at every size; staged in
    /// fp32, bit for bit within one staging block (as cuBLAS takes either),
    /// and over many blocks (a GPT-2 head's 2,048 x 50,304) within the
    /// rounding of dinp's sums split at the blocks.
    #[test]
    fn bf16_storage_is_the_rounding_of_the_fp32_product() {
        let mut rng = Rng::new(11);
        for (rows, k, n, layout) in [
            (5, 7, 9, WeightLayout::InOut),
            (6, 16, 40, WeightLayout::OutIn),
            // more than one kernel call's pairs (KC) in each sum
            (30, 800, 70, WeightLayout::InOut),
            (2048, 8, 4200, WeightLayout::OutIn),
        ] {
            let shape = MatmulShape::new((rows, k, n), layout).with_bf16(true);
            let (inp, w) = (randn(&mut rng, rows * k, 1.0), randn(&mut rng, k * n, 1.0));
            let mut fp32 = vec![f32::NAN; rows * n];
            forward(MatmulForward {
                out: Stored::F32(&mut fp32),
                inp: Stored::F32(&inp),
                w: Stored::F32(&w),
                bias: None,
                residual: None,
                shape,
                accumulate: false,
            });
            let rounded: Vec<Bf16> = fp32.iter().map(|&x| Bf16::from_f32(x)).collect();
            let bias = randn(&mut rng, n, 1.0);
            let bias_bf16: Vec<f32> = bias.iter().map(|&b| round_to_bf16(b)).collect();
            forward(MatmulForward {
                out: Stored::F32(&mut fp32),
                inp: Stored::F32(&inp),
                w: Stored::F32(&w),
                bias: Some(&bias_bf16),
                residual: None,
                shape,
                accumulate: false,
            });
            let biased: Vec<Bf16> = fp32.iter().map(|&x| Bf16::from_f32(x)).collect();
            let dout: Vec<Bf16> = randn(&mut rng, rows * n, 1.0)
                .into_iter()
                .map(Bf16::from_f32)
                .collect();
            let wide: Vec<f32> = dout.iter().map(|x| x.to_f32()).collect();
            // a bias's gradient: the sums of the values, whichever way held
            let db0 = randn(&mut rng, n, 1.0);
            let dbias = [Stored::F32(&wide[..]), Stored::Bf16(&dout[..])].map(|dout| {
                let mut db = db0.clone();
                backward(MatmulBackward {
                    dinp: None,
                    dw: None,
                    dbias: Some(&mut db),
                    dout,
                    inp: Stored::F32(&inp),
                    w: Stored::F32(&w),
                    shape,
                });
                db
            });
            assert!(
                dbias[0] == dbias[1],
                "({rows}, {k}, {n}): dbias of a bf16 dout"
            );
            assert!(dbias[0] != db0, "({rows}, {k}, {n}): dbias unchanged");
            let dw0 = randn(&mut rng, k * n, 1.0);
            let (mut dinp, mut dw) = (vec![f32::NAN; rows * k], dw0.clone());
            backward(MatmulBackward {
                dinp: Some(&mut dinp),
                dw: Some(&mut dw),
                dbias: None,
                dout: Stored::F32(&wide),
                inp: Stored::F32(&inp),
                w: Stored::F32(&w),
                shape,
            });
            let want = (dinp, dw);
            for native in [false, true] {
                let route = match native && crate::backend::cpu::blas::stores_bf16() {
                    true => "the bf16 kernel",
                    false => "staged",
                };
                let at = format!("({rows}, {k}, {n}) {route}");
                let mut held = vec![Bf16::default(); rows * n];
                let (held_inp, held_w) = (Stored::F32(&inp[..]), Stored::F32(&w[..]));
                forward_rounded(&mut held, held_inp, held_w, None, shape, native);
                assert!(held == rounded, "{at}: not the rounded product");
                forward_rounded(&mut held, held_inp, held_w, Some(&bias), shape, native);
                assert!(
                    held == biased,
                    "{at}: not the rounded product plus its bf16 bias"
                );
                let (mut dinp, mut dw) = (vec![f32::NAN; rows * k], dw0.clone());
                backward_stored(
                    Some(&mut dinp),
                    Some(&mut dw),
                    &dout,
                    Stored::F32(&inp),
                    Stored::F32(&w),
                    shape,
                    native,
                );
                let got = (dinp, dw);
                if route == "the bf16 kernel" || rows * n <= STAGE {
                    assert!(got == want, "{at}: not the fp32-held gradient's");
                    // each half alone
                    let (mut dinp, mut dw) = (vec![f32::NAN; rows * k], dw0.clone());
                    let inp = Stored::F32(&inp[..]);
                    backward_stored(
                        Some(&mut dinp),
                        None,
                        &dout,
                        inp,
                        Stored::F32(&w),
                        shape,
                        native,
                    );
                    backward_stored(
                        None,
                        Some(&mut dw),
                        &dout,
                        inp,
                        Stored::F32(&w),
                        shape,
                        native,
                    );
                    assert!((dinp, dw) == want, "{at}: a half alone");
                } else {
                    // dw's columns are whole sums in either; dinp's sums of n
                    // products (each under 25 here) split at the blocks differ
                    // by their rounding, n u 25 < 7e-3
                    assert!(got.1 == want.1, "{at}: dw");
                    let worst = got.0.iter().zip(&want.0).map(|(a, b)| (a - b).abs());
                    let worst = worst.fold(0.0, f32::max);
                    assert!(worst > 0.0 && worst < 7e-3, "{at}: dinp {worst}");
                }
            }
        }
    }

    /// An input stored in bf16 gives what its values held in fp32 give
    /// in bf16 products, bit for bit: into an fp32 output with a bias,
    /// added to or not, into a bf16 output, and as the input of dw beside
    /// an output gradient in either storage, on either route.
    #[test]
    fn a_bf16_input_is_its_fp32_values() {
        let mut rng = Rng::new(13);
        for (rows, k, n, layout) in [
            (5, 7, 9, WeightLayout::InOut),
            (30, 800, 70, WeightLayout::OutIn),
        ] {
            let shape = MatmulShape::new((rows, k, n), layout).with_bf16(true);
            let bf16 = |x: Vec<f32>| -> Vec<Bf16> { x.into_iter().map(Bf16::from_f32).collect() };
            let held = bf16(randn(&mut rng, rows * k, 1.0));
            let wide: Vec<f32> = held.iter().map(|x| x.to_f32()).collect();
            let (w, b, out0) = (
                randn(&mut rng, k * n, 1.0),
                randn(&mut rng, n, 1.0),
                randn(&mut rng, rows * n, 1.0),
            );
            let dout = randn(&mut rng, rows * n, 1.0);
            let dout_held = bf16(dout.clone());
            for native in [false, true] {
                let at = format!("({rows}, {k}, {n}), native {native}");
                // the fp32-held input, the bf16 one, and the bf16 one given
                // a shape asking for fp32 products (it takes bf16's)
                let fp32_shape = shape.with_bf16(false);
                let inputs = || {
                    [
                        (Stored::F32(&wide[..]), shape),
                        (Stored::Bf16(&held[..]), shape),
                        (Stored::Bf16(&held[..]), fp32_shape),
                    ]
                };
                let same = |runs: &[Vec<f32>; 3]| runs[1] == runs[0] && runs[2] == runs[0];
                // each forward on a thread of its own: no scratch another
                // left can stand in for what this one must write itself
                let fresh = |f: &(dyn Fn() -> Vec<f32> + Sync)| {
                    std::thread::scope(|s| s.spawn(f).join().unwrap())
                };
                for accumulate in [false, true] {
                    let runs = inputs().map(|(inp, shape)| {
                        fresh(&|| {
                            let mut out = out0.clone();
                            let (out_s, bias) = (Stored::F32(&mut out[..]), Some(&b[..]));
                            let op = MatmulForward {
                                out: out_s,
                                inp,
                                w: Stored::F32(&w[..]),
                                bias,
                                residual: None,
                                shape,
                                accumulate,
                            };
                            forward_on(op, native);
                            out
                        })
                    });
                    assert!(same(&runs), "{at}: forward, accumulate {accumulate}");
                }
                let [want, got, _] = inputs().map(|(inp, shape)| {
                    let mut out = vec![Bf16::default(); rows * n];
                    forward_rounded(&mut out, inp, Stored::F32(&w), None, shape, native);
                    out
                });
                assert!(got == want, "{at}: into bf16");
                for dout in [Stored::F32(&dout[..]), Stored::Bf16(&dout_held[..])] {
                    let runs = inputs().map(|(inp, shape)| {
                        let mut dw: Vec<f32> = w.iter().map(|x| 0.5 * x).collect();
                        let (dinp, dbias) = (None, None);
                        let op = MatmulBackward {
                            dinp,
                            dw: Some(&mut dw[..]),
                            dbias,
                            dout,
                            inp,
                            w: Stored::F32(&w[..]),
                            shape,
                        };
                        backward_on(op, native);
                        dw
                    });
                    assert!(same(&runs), "{at}: dw, dout bf16 {}", dout.is_bf16());
                }
            }
        }
    }

    /// A weight stored in bf16 (the weights' bf16 copy) gives what its
    /// values held in fp32 give in bf16 products, bit for bit, and takes
    /// them where the shape asks fp32's: the product with a bias (added to
    /// or not) and into bf16, the backward's three gradients from an fp32
    /// output gradient and two from a bf16 one, on either route.
    #[test]
    fn a_bf16_weight_is_its_rounded_values() {
        let mut rng = Rng::new(17);
        for (rows, k, n, layout) in [
            (5, 7, 9, WeightLayout::InOut),
            (30, 800, 70, WeightLayout::OutIn),
        ] {
            let fp32_shape = MatmulShape::new((rows, k, n), layout);
            let shape = fp32_shape.with_bf16(true);
            let values = randn(&mut rng, k * n, 1.0);
            let copy: Vec<Bf16> = values.iter().map(|&x| Bf16::from_f32(x)).collect();
            let (inp, b) = (randn(&mut rng, rows * k, 1.0), randn(&mut rng, n, 1.0));
            let (out0, dout) = (
                randn(&mut rng, rows * n, 1.0),
                randn(&mut rng, rows * n, 1.0),
            );
            let dout_held: Vec<Bf16> = dout.iter().map(|&x| Bf16::from_f32(x)).collect();
            let inp = Stored::F32(&inp[..]);
            for native in [false, true] {
                let at = format!("({rows}, {k}, {n}), native {native}");
                let weights = || {
                    [
                        (Stored::F32(&values[..]), shape),
                        (Stored::Bf16(&copy[..]), fp32_shape),
                    ]
                };
                for accumulate in [false, true] {
                    let [want, got] = weights().map(|(w, shape)| {
                        let mut out = out0.clone();
                        let op = MatmulForward {
                            out: Stored::F32(&mut out[..]),
                            inp,
                            w,
                            bias: Some(&b[..]),
                            residual: None,
                            shape,
                            accumulate,
                        };
                        forward_on(op, native);
                        out
                    });
                    assert!(got == want, "{at}: forward, accumulate {accumulate}");
                }
                let [want, got] = weights().map(|(w, shape)| {
                    let mut out = vec![Bf16::default(); rows * n];
                    forward_rounded(&mut out, inp, w, None, shape, native);
                    out
                });
                assert!(got == want, "{at}: into bf16");
                for dout in [Stored::F32(&dout[..]), Stored::Bf16(&dout_held[..])] {
                    let [want, got] = weights().map(|(w, shape)| {
                        let (mut dinp, mut dw, mut db) =
                            (vec![f32::NAN; rows * k], vec![0.5; k * n], vec![0.25; n]);
                        let dbias = (!dout.is_bf16()).then_some(&mut db[..]);
                        let op = MatmulBackward {
                            dinp: Some(&mut dinp[..]),
                            dw: Some(&mut dw[..]),
                            dbias,
                            dout,
                            inp,
                            w,
                            shape,
                        };
                        backward_on(op, native);
                        (dinp, dw, db)
                    });
                    assert!(got == want, "{at}: backward, dout bf16 {}", dout.is_bf16());
                }
            }
        }
    }

    /// Each operand one element shorter than its shape (rows 2, k 3, n 4)
    /// asks is refused by the check every backend runs, by its name; at
    /// their lengths none is.
    #[test]
    fn an_operand_shorter_than_its_shape_is_refused_by_name() {
        let (rows, k, n) = (2, 3, 4);
        let lens = [rows * n, rows * k, k * n, rows * n, n];
        let names = ["out", "inp", "w", "residual", "bias"];
        for short in [None, Some(0), Some(1), Some(2), Some(3), Some(4)] {
            let len = |i: usize| lens[i] - usize::from(short == Some(i));
            let [inp, w, residual, bias] = [1, 2, 3, 4].map(|i| vec![1.0f32; len(i)]);
            let mut out = vec![0.0f32; len(0)];
            let op = MatmulForward::<Host> {
                out: Stored::F32(&mut out),
                inp: Stored::F32(&inp),
                w: Stored::F32(&w),
                bias: Some(&bias),
                residual: Some(&residual),
                shape: MatmulShape::new((rows, k, n), WeightLayout::InOut),
                accumulate: false,
            };
            match (short, op.check()) {
                (None, got) => assert_eq!(got, Ok(()), "every operand at its length"),
                (Some(i), Err(e)) => {
                    let want = format!("{}: view of {}", names[i], lens[i] - 1);
                    assert!(e.starts_with(&want), "{}: {e}", names[i]);
                }
                (Some(i), Ok(())) => panic!("{} one short was taken", names[i]),
            }
        }
    }

    /// A bf16 output takes no accumulation and no residual, and a product
    /// goes onto its output or a residual, not both: refused by the check
    /// every backend runs.
    #[test]
    fn bf16_storage_refuses_what_it_cannot_round() {
        let (x, mut h, mut f) = (vec![1.0f32; 4], vec![Bf16::default(); 4], vec![0.0; 4]);
        let shape = MatmulShape::new((2, 2, 2), WeightLayout::InOut);
        for (bias, accumulate, residual) in [
            (true, false, false),
            (false, true, false),
            (true, true, false),
            (true, false, true),
        ] {
            let err = MatmulForward::<Host> {
                out: Stored::Bf16(&mut h),
                inp: Stored::F32(&x),
                w: Stored::F32(&x),
                bias: bias.then_some(&x[..2]),
                residual: residual.then_some(&x[..]),
                shape,
                accumulate,
            }
            .check();
            assert_eq!(
                err.is_err(),
                accumulate || residual,
                "bias {bias}, accumulate {accumulate}, residual {residual}"
            );
        }
        let both = MatmulForward::<Host> {
            out: Stored::F32(&mut f),
            inp: Stored::F32(&x),
            w: Stored::F32(&x),
            bias: None,
            residual: Some(&x[..]),
            shape,
            accumulate: true,
        };
        assert!(both.check().is_err(), "accumulate and a residual");
    }

    /// A product onto a residual is the residual copied into the output
    /// and the product accumulated onto it, bit for bit (the output's own
    /// values never read): fp32 and bf16 products, an input held in bf16,
    /// with a bias and without, on either CPU route; a residual too short
    /// is refused.
    #[test]
    fn a_residual_is_a_copy_and_an_accumulation() {
        let mut rng = Rng::new(19);
        let (rows, k, n) = (30, 200, 70);
        let (inp, w, b) = (
            randn(&mut rng, rows * k, 1.0),
            randn(&mut rng, k * n, 1.0),
            randn(&mut rng, n, 1.0),
        );
        let held: Vec<Bf16> = inp.iter().map(|&x| Bf16::from_f32(x)).collect();
        let residual = randn(&mut rng, rows * n, 1.0);
        for (bf16, inp) in [
            (false, Stored::F32(&inp[..])),
            (true, Stored::F32(&inp[..])),
            (true, Stored::Bf16(&held[..])),
        ] {
            let shape = MatmulShape::new((rows, k, n), WeightLayout::OutIn).with_bf16(bf16);
            for (native, bias) in [(false, true), (true, true), (true, false)] {
                let bias = bias.then_some(&b[..]);
                let mut want = residual.clone();
                let op = |out, residual, accumulate| MatmulForward {
                    out: Stored::F32(out),
                    inp,
                    w: Stored::F32(&w[..]),
                    bias,
                    residual,
                    shape,
                    accumulate,
                };
                forward_on(op(&mut want[..], None, true), native);
                let mut got = vec![f32::NAN; rows * n];
                forward_on(op(&mut got[..], Some(&residual[..]), false), native);
                let at = format!("bf16 {bf16}, inp bf16 {}, native {native}", inp.is_bf16());
                assert!(got == want, "{at}, bias {}", bias.is_some());
            }
        }
        let mut out = vec![0.0; rows * n];
        let short = MatmulForward::<Host> {
            out: Stored::F32(&mut out),
            inp: Stored::F32(&inp),
            w: Stored::F32(&w),
            bias: None,
            residual: Some(&residual[1..]),
            shape: MatmulShape::new((rows, k, n), WeightLayout::OutIn),
            accumulate: false,
        };
        assert!(short.check().is_err(), "a short residual");
    }

    #[test]
    fn matmul_backward_matches_finite_differences() {
        for layout in [WeightLayout::InOut, WeightLayout::OutIn] {
            let (rows, k, n) = (5, 7, 9);
            let mut rng = Rng::new(1);
            let inp = randn(&mut rng, rows * k, 1.0);
            let w = randn(&mut rng, k * n, 1.0);
            let b = randn(&mut rng, n, 1.0);
            let probe = randn(&mut rng, rows * n, 1.0);

            // NaN: a product that read its output first would keep it
            let mut out = vec![f32::NAN; rows * n];
            forward(MatmulForward {
                out: Stored::F32(&mut out),
                inp: Stored::F32(&inp),
                w: Stored::F32(&w),
                bias: Some(&b),
                residual: None,
                shape: MatmulShape::new((rows, k, n), layout),
                accumulate: false,
            });
            let want = reference(&to64(&inp), &to64(&w), &to64(&b), layout, rows, k, n);
            assert_close("out", &out, &want, 1e-5);

            let mut dinp = vec![0.0; rows * k];
            let mut dw = vec![0.0; k * n];
            let mut db = vec![0.0; n];
            backward(MatmulBackward {
                dinp: Some(&mut dinp),
                dw: Some(&mut dw),
                dbias: Some(&mut db),
                dout: Stored::F32(&probe),
                inp: Stored::F32(&inp),
                w: Stored::F32(&w),
                shape: MatmulShape::new((rows, k, n), layout),
            });

            let (w64, b64, i64_) = (to64(&w), to64(&b), to64(&inp));
            let f_inp =
                |x: &[f64]| probe_dot(&reference(x, &w64, &b64, layout, rows, k, n), &probe);
            assert_close("dinp", &dinp, &finite_diff(&inp, f_inp), 1e-5);
            let f_w = |x: &[f64]| probe_dot(&reference(&i64_, x, &b64, layout, rows, k, n), &probe);
            assert_close("dw", &dw, &finite_diff(&w, f_w), 1e-5);
            let f_b = |x: &[f64]| probe_dot(&reference(&i64_, &w64, x, layout, rows, k, n), &probe);
            assert_close("db", &db, &finite_diff(&b, f_b), 1e-5);
        }
    }

    #[test]
    fn accumulate_adds_to_existing_output() {
        let (rows, k, n) = (3, 4, 70);
        let mut rng = Rng::new(2);
        let inp = randn(&mut rng, rows * k, 1.0);
        let w = randn(&mut rng, k * n, 1.0);
        let b = randn(&mut rng, n, 1.0);
        let base = randn(&mut rng, rows * n, 1.0);
        let mut out = base.clone();
        forward(MatmulForward {
            out: Stored::F32(&mut out),
            inp: Stored::F32(&inp),
            w: Stored::F32(&w),
            bias: Some(&b),
            residual: None,
            shape: MatmulShape::new((rows, k, n), WeightLayout::InOut),
            accumulate: true,
        });
        let want = reference(
            &to64(&inp),
            &to64(&w),
            &to64(&b),
            WeightLayout::InOut,
            rows,
            k,
            n,
        );
        let want: Vec<f64> = want.iter().zip(&base).map(|(a, &b)| a + b as f64).collect();
        assert_close("out", &out, &want, 1e-5);
    }
}
