//! The model's kernels on a GPU-style device, each with the semantics of its
//! CPU twin in `backend::cpu` (which outputs are overwritten, which
//! accumulate). Sources live in `src/backend/kernels/`, one dialect for
//! OpenCL C and CUDA; GEMMs go to the runtime's BLAS (CLBlast, cuBLAS).

use super::{u32_arg, Arg, Gemm, GpuError, Operand, Queue, Runtime, View, BLOCK};
use crate::backend::ops::{self, Stored};
use crate::backend::{Activation, WeightLayout, COLUMN_CHUNK_ROWS};

/// Most workgroups of a whole-buffer reduction (partials read back).
const REDUCE_GROUPS: usize = 256;

/// The prelude and every kernel file, as `build.rs` joins them: one
/// program (OpenCL C or CUDA C++).
pub fn program_source() -> &'static str {
    include_str!(concat!(env!("OUT_DIR"), "/program.cu"))
}

/// Workgroups for one thread per element of `n`.
pub(crate) fn groups(n: usize) -> usize {
    n.div_ceil(BLOCK)
}

/// An activation as the kernels number it (ACT_* in prelude.h).
pub(crate) fn act_code(act: Option<Activation>) -> u32 {
    match act {
        None => 0,
        Some(Activation::GeluTanh) => 1,
        Some(Activation::GeluErf) => 2,
        Some(Activation::Tanh) => 3,
    }
}

/// Errors unless `view` holds at least `n` elements ([`ops::need`]'s rule,
/// for the wrappers that are not yet a `Kernel`).
pub(super) fn need(what: &str, view: View, n: usize) -> Result<(), GpuError> {
    ops::need(what, &view, n).map_err(GpuError)
}

pub(crate) fn u32s(what: &str, n: usize) -> Result<Arg, GpuError> {
    Ok(Arg::U32(u32_arg(what, n)?))
}

/// An activation's backward folded into [`Queue::bias_backward`]'s pass:
/// its input (fp32 or bf16), the bias added to it, the activation, and
/// where the result goes rounded to bf16 instead of in place.
pub(crate) struct ActivationPass {
    pub inp: Stored<View, View>,
    pub bias: Option<View>,
    pub act: Activation,
    pub rounded: Option<View>,
}

impl<R: Runtime> Queue<R> {
    /// out (rows, n) = bias per row, or += bias with `accumulate`: where a
    /// product's bias goes before the product adds onto it.
    pub(crate) fn bias_forward(
        &self,
        out: Stored<View, View>,
        bias: View,
        (rows, n): (usize, usize),
        accumulate: bool,
    ) -> Result<(), GpuError> {
        let (out, out_bf16) = stored_view(out);
        let args = [
            Arg::View(out),
            Arg::View(bias),
            u32s("rows", rows)?,
            u32s("n", n)?,
            Arg::U32(accumulate as u32),
            Arg::U32(out_bf16),
        ];
        self.launch("bias_forward", groups(rows * n), &args)
    }

    /// dbias (n) += colsum(d) for d (rows, n; held in fp32, or in bf16
    /// without an activation); with an activation's pass, after d *=
    /// act'(inp [+ bias]) in place (or into its `rounded`, whose length
    /// `ActivationBackward`'s check has seen), in the same pass.
    pub(crate) fn bias_backward(
        &self,
        db: View,
        d: Stored<View, View>,
        act: Option<ActivationPass>,
        (rows, n): (usize, usize),
    ) -> Result<(), GpuError> {
        let (d, d_bf16) = stored_view(d);
        if d_bf16 == 1 && act.is_some() {
            return Err(GpuError(
                "an activation's pass needs its gradient held in fp32".into(),
            ));
        }
        need("bias gradient: output gradient", d, rows * n)?;
        need("bias gradient", db, n)?;
        let (inp, bias, act, rounded) = match act {
            Some(p) => (p.inp, p.bias, Some(p.act), p.rounded),
            None => (Stored::F32(d), None, None, None),
        };
        let (inp, inp_bf16) = stored_view(inp);
        need("bias gradient: activation input", inp, rows * n)?;
        if let Some(b) = bias {
            need("activation bias", b, n)?;
        }
        if rows == 0 || n == 0 {
            return Ok(());
        }
        let chunks = rows.div_ceil(COLUMN_CHUNK_ROWS);
        // Every partial is written before it is read: the queue's scratch.
        self.with_scratch([chunks * n], |[partials]| {
            let args = [
                Arg::View(partials),
                Arg::View(d),
                Arg::View(inp),
                // without a bias, any view: the kernel does not read it
                Arg::View(bias.unwrap_or(inp)),
                Arg::U32(bias.is_some().into()),
                u32s("rows", rows)?,
                u32s("n", n)?,
                u32s("chunks", chunks)?,
                u32s("chunk rows", COLUMN_CHUNK_ROWS)?,
                Arg::U32(act_code(act)),
                Arg::U32(inp_bf16),
                // without `rounded`, any view: the kernel does not write it
                Arg::View(rounded.unwrap_or(d)),
                Arg::U32(rounded.is_some().into()),
                Arg::U32(d_bf16),
            ];
            self.launch("bias_backward_partials", groups(chunks * n), &args)?;
            let args = [
                Arg::View(db),
                Arg::View(partials),
                u32s("chunks", chunks)?,
                u32s("n", n)?,
            ];
            self.launch("bias_backward_sum", groups(n), &args)
        })
    }

    /// c (m x n, column-major, ldc = m) per `g`, with empty sizes handled
    /// here (CLBlast rejects them).
    pub(crate) fn gemm(&self, mut g: Gemm) -> Result<(), GpuError> {
        let stored = g.a.bf16 || g.b.bf16 || g.c_bf16;
        if (stored && !g.bf16) || (g.c_bf16 && (g.beta != 0.0 || g.k == 0)) {
            return Err(GpuError(
                "a GEMM over bf16 storage needs bf16 products, and a bf16 output k > 0 and beta 0"
                    .into(),
            ));
        }
        if g.m == 0 || g.n == 0 || g.batch.count == 0 {
            return Ok(());
        }
        if g.c_span() > g.c.len {
            return Err(GpuError(format!(
                "GEMM output c: view of {} elements, the products write {}",
                g.c.len,
                g.c_span()
            )));
        }
        if let Some(r) = g.residual {
            if g.batch.count != 1 || g.ldc != g.m || g.c_bf16 || g.beta != 0.0 {
                return Err(GpuError(
                    "a GEMM's residual needs one product into a whole fp32 c, beta 0".into(),
                ));
            }
            need("GEMM residual", r, g.m * g.n)?;
            if g.k == 0 || !self.rt.adds_bias(&g) {
                // c = the residual, and the products onto it
                let mn = 0..g.m * g.n;
                self.pointwise("copy", g.c.part(mn.clone()), r.part(mn))?;
                (g.beta, g.residual) = (1.0, None);
            }
        }
        if let Some(bias) = g.bias {
            if g.batch.count != 1 || g.ldc != g.m {
                return Err(GpuError(
                    "a GEMM's bias needs one product into a whole c".into(),
                ));
            }
            need("GEMM bias", bias, g.m)?;
            if g.k == 0 || !self.rt.adds_bias(&g) {
                // c = [c +] bias first (a bf16 c: the bias rounded, as a
                // bf16 epilogue takes it), then the products onto it
                let c = match g.c_bf16 {
                    true => Stored::Bf16(g.c),
                    false => Stored::F32(g.c),
                };
                self.bias_forward(c, bias, (g.n, g.m), g.beta != 0.0)?;
                (g.beta, g.bias) = (1.0, None);
            }
        }
        if g.k == 0 {
            // No products: c = beta * c, with beta 0 or 1.
            if g.beta == 0.0 {
                for i in 0..g.batch.count {
                    self.fill(g.c.tail(i * g.batch.c).part(0..g.m * g.n), 0.0)?;
                }
            }
            return Ok(());
        }
        // SAFETY: the callers checked every operand view against the sizes
        // and leading dimensions of `g` (`need`, a `Kernel`'s check).
        unsafe { self.rt.sgemm(g) }
    }

    /// The kernels of the form `name(dst, src, n)` over n = src.len:
    /// "copy" (dst = src), "add_inplace" (dst += src), "round_bf16" (dst =
    /// src rounded to bfloat16, kept as f32; `dst` may be `src` itself) and
    /// "to_bf16" (dst, bf16, = src rounded to bfloat16).
    pub(crate) fn pointwise(&self, name: &str, dst: View, src: View) -> Result<(), GpuError> {
        need(name, dst, src.len)?;
        let args = [Arg::View(dst), Arg::View(src), u32s("n", src.len)?];
        self.launch(name, groups(src.len), &args)
    }

    /// dst = value.
    pub fn fill(&self, dst: View, value: f32) -> Result<(), GpuError> {
        let args = [Arg::View(dst), u32s("n", dst.len)?, Arg::F32(value)];
        self.launch("fill", groups(dst.len), &args)
    }

    /// Sum of squares of each of `xs`, in f64 (reproducible).
    pub fn sum_squares(&self, xs: &[View]) -> Result<Vec<f64>, GpuError> {
        self.reduce(xs, true)
    }

    /// Sum of x, in f64 (reproducible).
    pub fn sum(&self, x: View) -> Result<f64, GpuError> {
        Ok(self.reduce(&[x], false)?[0])
    }

    /// Each of `xs` summed (or its squares): every reduction's partials
    /// queued into one scratch, read back at once, and each view's added
    /// in f64. A view's partials depend only on its length, so its sum is
    /// the same whatever else is reduced with it.
    fn reduce(&self, xs: &[View], square: bool) -> Result<Vec<f64>, GpuError> {
        let counts: Vec<usize> = xs
            .iter()
            .map(|x| groups(x.len).clamp(1, REDUCE_GROUPS))
            .collect();
        let mut host = vec![0.0f32; counts.iter().sum()];
        self.with_scratch([host.len()], |[partials]| {
            let mut at = 0;
            for (&x, &g) in xs.iter().zip(&counts) {
                let args = [
                    Arg::View(partials.part(at..at + g)),
                    Arg::View(x),
                    u32s("n", x.len)?,
                    Arg::U32(square as u32),
                ];
                self.launch("reduce_partial", g, &args)?;
                at += g;
            }
            self.read(partials, &mut host)
        })?;
        let mut partials = host.as_slice();
        Ok(counts
            .iter()
            .map(|&g| {
                let (mine, rest) = partials.split_at(g);
                partials = rest;
                mine.iter().map(|&p| p as f64).sum()
            })
            .collect())
    }
}

/// W as a column-major GEMM operand standing for W_eff (k x n, what the
/// math calls W: `out = inp @ W_eff`), or for W_eff^T when `for_dinp`.
pub(crate) fn weight_operand(
    w: Stored<View, View>,
    layout: WeightLayout,
    k: usize,
    n: usize,
    for_dinp: bool,
) -> Operand {
    // InOut stores W_eff row-major: column-major it is W_eff^T (n x k), ld n.
    // OutIn stores W_eff^T row-major: column-major it is W_eff (k x n), ld k.
    let (stored_is_transposed, ld) = match layout {
        WeightLayout::InOut => (true, n),
        WeightLayout::OutIn => (false, k),
    };
    // The forward wants W_eff^T (n x k); the backward to dinp wants W_eff (k x n).
    stored_operand(w, stored_is_transposed == for_dinp, ld)
}

/// `view` (fp32) as a column-major GEMM operand with leading dimension `ld`.
pub(crate) fn operand(view: View, transpose: bool, ld: usize) -> Operand {
    stored_operand(Stored::F32(view), transpose, ld)
}

/// A stored tensor as a GEMM operand, as [`operand`].
pub(crate) fn stored_operand(x: Stored<View, View>, transpose: bool, ld: usize) -> Operand {
    let (view, bf16) = stored_view(x);
    Operand {
        view,
        transpose,
        ld,
        bf16: bf16 == 1,
    }
}

/// A stored operand's view, and 1 where it holds bf16 (the kernels' flag).
pub(crate) fn stored_view(x: Stored<View, View>) -> (View, u32) {
    match x {
        Stored::F32(v) => (v, 0),
        Stored::Bf16(v) => (v, 1),
    }
}
