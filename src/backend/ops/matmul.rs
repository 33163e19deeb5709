//! Matmul with fused bias, forward and backward, as kernels: the `gemm`
//! crate's products (`cpu::math::gemm`) on the CPU, the runtime's BLAS on
//! a GPU.
//!
//! Weights are either `InOut` (k x n, Hugging Face Conv1D: `out = inp @ w`)
//! or `OutIn` (n x k, nn.Linear / the tied embedding: `out = inp @ w^T`).

use super::{need, Checked, Host, Kernel, Lower, Operands, Queued};
use crate::backend::cpu::math::{column_sums, gemm, Mat};
use crate::backend::gpu::{operand, weight_operand, Batch, Gemm, Queue, Raw, Runtime};
use crate::backend::profile::matmul_flops;
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
}

operation! {
    /// out (rows, n) = [out +] inp (rows, k) @ W + bias.
    pub struct MatmulForward<O> {
        output out: f32,
        input inp: f32,
        input w: f32,
        maybe_input bias: f32,
        value shape: MatmulShape,
        /// Adds to `out` instead of overwriting it.
        value accumulate: bool,
    }
}

operation! {
    /// The gradients of [`MatmulForward`]: dinp (rows, k) overwritten; dw
    /// (k x n) +=; dbias (n) +=. `dinp` None is the weight half (which never
    /// reads `w`), `dw` None the input half (which never reads `inp`).
    pub struct MatmulBackward<O> {
        maybe_output dinp: f32,
        maybe_output dw: f32,
        maybe_output dbias: f32,
        input dout: f32,
        input inp: f32,
        input w: f32,
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
        match &self.bias {
            Some(b) => need("bias", b, n),
            None => Ok(()),
        }
    }

    fn flops(&self) -> f64 {
        matmul_flops(self.shape, 1)
    }

    fn cpu<'a>(self, host: &impl Lower<O, Host<'a>>) {
        forward(self.lower(host))
    }

    /// The bias first (copied, or added where the product accumulates),
    /// then the product onto it.
    fn gpu<R: Runtime>(self, q: &Queue<R>, raw: &impl Lower<O, Raw>, _: Checked) -> Queued {
        let op = self.lower(raw);
        let MatmulShape { rows, k, n, .. } = op.shape;
        let (layout, bf16) = (op.shape.layout, op.shape.bf16);
        if let Some(b) = op.bias {
            q.bias_forward(op.out, b, (rows, n), op.accumulate)?;
        }
        // Row-major out (rows, n) is column-major out^T (n x rows) = W^T @ inp^T.
        q.gemm(Gemm {
            m: n,
            n: rows,
            k,
            a: weight_operand(op.w, layout, k, n, false),
            b: operand(op.inp, false, k),
            beta: if op.accumulate || op.bias.is_some() {
                1.0
            } else {
                0.0
            },
            c: op.out,
            ldc: n,
            bf16,
            batch: Batch::ONE,
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
        match &self.dbias {
            Some(db) => need("dbias", db, n),
            None => Ok(()),
        }
    }

    fn flops(&self) -> f64 {
        let products = self.dinp.is_some() as usize + self.dw.is_some() as usize;
        matmul_flops(self.shape, products)
    }

    fn cpu<'a>(self, host: &impl Lower<O, Host<'a>>) {
        backward(self.lower(host))
    }

    fn gpu<R: Runtime>(self, q: &Queue<R>, raw: &impl Lower<O, Raw>, _: Checked) -> Queued {
        let op = self.lower(raw);
        let MatmulShape { rows, k, n, .. } = op.shape;
        let (layout, bf16) = (op.shape.layout, op.shape.bf16);
        if let Some(dinp) = op.dinp {
            // dinp^T (k x rows) = W @ dout^T.
            q.gemm(Gemm {
                m: k,
                n: rows,
                k: n,
                a: weight_operand(op.w, layout, k, n, true),
                b: operand(op.dout, false, n),
                beta: 0.0,
                c: dinp,
                ldc: k,
                bf16,
                batch: Batch::ONE,
            })?;
        }
        if let Some(dw) = op.dw {
            q.gemm(match layout {
                // dw (k, n) += inp^T @ dout: column-major dw^T (n x k) += dout^T @ inp.
                WeightLayout::InOut => Gemm {
                    m: n,
                    n: k,
                    k: rows,
                    a: operand(op.dout, false, n),
                    b: operand(op.inp, true, k),
                    beta: 1.0,
                    c: dw,
                    ldc: n,
                    bf16,
                    batch: Batch::ONE,
                },
                // dw (n, k) += dout^T @ inp: column-major dw^T (k x n) += inp^T @ dout.
                WeightLayout::OutIn => Gemm {
                    m: k,
                    n,
                    k: rows,
                    a: operand(op.inp, false, k),
                    b: operand(op.dout, true, n),
                    beta: 1.0,
                    c: dw,
                    ldc: k,
                    bf16,
                    batch: Batch::ONE,
                },
            })?;
        }
        match op.dbias {
            Some(db) => q.bias_backward(db, (op.dout, op.dout, None, None), (rows, n)),
            None => Ok(()),
        }
    }
}

fn weight_mat<T>(w: T, layout: WeightLayout, k: usize, n: usize) -> Mat<T> {
    match layout {
        WeightLayout::InOut => Mat::new(w, n, 1),
        WeightLayout::OutIn => Mat::new(w, 1, k),
    }
}

/// out (rows, n) = [out +] inp (rows, k) @ W + bias.
fn forward(op: MatmulForward<Host<'_>>) {
    let MatmulForward {
        out,
        inp,
        w,
        bias,
        shape,
        accumulate,
    } = op;
    let MatmulShape {
        rows,
        k,
        n,
        layout,
        bf16,
    } = shape;
    assert!(out.len() >= rows * n && inp.len() >= rows * k && w.len() >= k * n);
    let out = &mut out[..rows * n];
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
    if accumulate {
        add_bias(out);
    }
    // SAFETY: sizes were checked above; out does not alias inp or w.
    unsafe {
        gemm(
            bf16,
            (rows, n, k),
            Mat::new(out.as_mut_ptr(), n, 1),
            Mat::new(inp.as_ptr(), k, 1),
            weight_mat(w.as_ptr(), layout, k, n),
            accumulate,
            1.0,
            rayon::current_num_threads(),
        );
    }
    if !accumulate {
        add_bias(out);
    }
}

/// dinp = dout @ W^T (overwritten); dw += inp^T @ dout; dbias +=
/// colsum(dout); each half only when its outputs are given.
fn backward(op: MatmulBackward<Host<'_>>) {
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
    let threads = rayon::current_num_threads();
    if let Some(dinp) = dinp {
        assert!(dinp.len() >= rows * k && dout.len() >= rows * n && w.len() >= k * n);
        // SAFETY: sizes were checked above; destinations are distinct buffers.
        unsafe {
            gemm(
                shape.bf16,
                (rows, k, n),
                Mat::new(dinp.as_mut_ptr(), k, 1),
                Mat::new(dout.as_ptr(), n, 1),
                weight_mat(w.as_ptr(), layout, k, n).t(),
                false,
                1.0,
                threads,
            );
        }
    }
    if let Some(dw) = dw {
        assert!(dout.len() >= rows * n && inp.len() >= rows * k && dw.len() >= k * n);
        // SAFETY: sizes were checked above; destinations are distinct buffers.
        unsafe {
            gemm(
                shape.bf16,
                (k, n, rows),
                weight_mat(dw.as_mut_ptr(), layout, k, n),
                Mat::new(inp.as_ptr(), k, 1).t(),
                Mat::new(dout.as_ptr(), n, 1),
                true,
                1.0,
                threads,
            );
        }
    }
    if let Some(db) = dbias {
        bias_backward(db, &dout[..rows * n], n);
    }
}

/// db (n) += sum over rows of dout (rows, n), in [`column_sums`]' chunks.
fn bias_backward(db: &mut [f32], dout: &[f32], n: usize) {
    if n == 0 {
        return;
    }
    let db = &mut db[..n];
    column_sums(
        &mut [db],
        dout.par_chunks(COLUMN_CHUNK_ROWS * n),
        |rows, p| {
            for row in rows.chunks_exact(n) {
                p.iter_mut().zip(row).for_each(|(p, &d)| *p += d);
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
                out: &mut out,
                inp: &inp,
                w: &w,
                bias: Some(&b),
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
                dout: &probe,
                inp: &inp,
                w: &w,
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
            out: &mut out,
            inp: &inp,
            w: &w,
            bias: Some(&b),
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
