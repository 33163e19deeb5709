//! LayerNorm over the last dimension, forward and backward, as kernels
//! (`kernels/layernorm.cu` on a GPU); eps is the model's (GPT-2 1e-5, BERT
//! 1e-12).

use super::{need, Checked, Extent, Host, Kernel, Lower, Operands, Queued, Stored};
use crate::backend::cpu::math::{column_sums, sum};
use crate::backend::gpu::{groups, stored_view, u32s, Arg, Queue, Raw, Runtime};
use crate::backend::{Bf16, COLUMN_CHUNK_ROWS};
use rayon::prelude::*;

operation! {
    /// out, inp (rows, C); mean, rstd (rows), kept for the backward; eps inside
    /// the square root. rows is `mean.len()`. An `out` stored in bf16
    /// (GPT-2's under `--precision bf16`, which only products read) takes
    /// each value rounded; the statistics stay fp32.
    pub struct LayerNormForward<O> {
        stored_output out: f32,
        output mean: f32,
        output rstd: f32,
        input inp: f32,
        input w: f32,
        input b: f32,
        value c: usize,
        value eps: f32,
    }
}

operation! {
    /// The gradients of [`LayerNormForward`]: dinp (rows, C) += (or =, without
    /// `accumulate`: no zeroing pass first); dw, db (C) +=. A half is left
    /// out by leaving its outputs out: `dinp` None is the weight half, `dwb`
    /// None the input half.
    pub struct LayerNormBackward<O> {
        maybe_output dinp: f32,
        /// dw and db.
        maybe_outputs2 dwb: f32,
        input dout: f32,
        input inp: f32,
        input w: f32,
        input mean: f32,
        input rstd: f32,
        value c: usize,
        value accumulate: bool,
    }
}

impl<O: Operands> Kernel<O> for LayerNormForward<O> {
    const NAME: &'static str = "layernorm_forward";

    fn check(&self) -> Result<(), String> {
        let (rows, c) = (self.mean.extent(), self.c);
        need("out", &self.out, rows * c)?;
        need("inp", &self.inp, rows * c)?;
        need("rstd", &self.rstd, rows)?;
        need("w", &self.w, c)?;
        need("b", &self.b, c)
    }

    fn cpu<'a>(self, host: &impl Lower<O, Host<'a>>) {
        forward(self.lower(host))
    }

    fn gpu<R: Runtime>(self, q: &Queue<R>, raw: &impl Lower<O, Raw>, _: Checked) -> Queued {
        let op = self.lower(raw);
        let (out, bf16) = stored_view(op.out);
        let args = [
            Arg::View(out),
            Arg::View(op.mean),
            Arg::View(op.rstd),
            Arg::View(op.inp),
            Arg::View(op.w),
            Arg::View(op.b),
            u32s("c", op.c)?,
            Arg::F32(op.eps),
            Arg::U32(bf16),
        ];
        q.launch("layernorm_forward", op.mean.len, &args)
    }
}

impl<O: Operands> Kernel<O> for LayerNormBackward<O> {
    const NAME: &'static str = "layernorm_backward";

    fn check(&self) -> Result<(), String> {
        let (rows, c) = (self.mean.extent(), self.c);
        need("dout", &self.dout, rows * c)?;
        need("inp", &self.inp, rows * c)?;
        need("w", &self.w, c)?;
        need("rstd", &self.rstd, rows)?;
        if let Some(dinp) = &self.dinp {
            need("dinp", dinp, rows * c)?;
        }
        if let Some((dw, db)) = &self.dwb {
            need("dw", dw, c)?;
            need("db", db, c)?;
        }
        Ok(())
    }

    fn cpu<'a>(self, host: &impl Lower<O, Host<'a>>) {
        backward(self.lower(host))
    }

    /// dinp row by row; dw, db as per-chunk partials, then a fixed-order sum.
    fn gpu<R: Runtime>(self, q: &Queue<R>, raw: &impl Lower<O, Raw>, _: Checked) -> Queued {
        let op = self.lower(raw);
        let (rows, c) = (op.mean.len, op.c);
        if rows == 0 || c == 0 {
            return Ok(());
        }
        if let Some(dinp) = op.dinp {
            let args = [
                Arg::View(dinp),
                Arg::View(op.dout),
                Arg::View(op.inp),
                Arg::View(op.w),
                Arg::View(op.mean),
                Arg::View(op.rstd),
                u32s("c", c)?,
                Arg::U32(op.accumulate as u32),
            ];
            q.launch("layernorm_backward_dinp", rows, &args)?;
        }
        let Some((dw, db)) = op.dwb else {
            return Ok(());
        };
        let chunks = rows.div_ceil(COLUMN_CHUNK_ROWS);
        // Every partial is written before it is read: the queue's scratch.
        q.with_scratch([chunks * 2 * c], |[partials]| {
            let args = [
                Arg::View(partials),
                Arg::View(op.dout),
                Arg::View(op.inp),
                Arg::View(op.mean),
                Arg::View(op.rstd),
                u32s("rows", rows)?,
                u32s("c", c)?,
                u32s("chunks", chunks)?,
                u32s("chunk rows", COLUMN_CHUNK_ROWS)?,
            ];
            q.launch("layernorm_backward_partials", groups(chunks * c), &args)?;
            let args = [
                Arg::View(dw),
                Arg::View(db),
                Arg::View(partials),
                u32s("chunks", chunks)?,
                u32s("c", c)?,
            ];
            q.launch("layernorm_backward_params", groups(c), &args)
        })
    }
}

/// Values a task normalizes at least: fewer cost more to hand over than to do.
const GRAIN: usize = 1 << 13;

/// inp, out are (rows, c); mean, rstd are (rows) and kept for the backward.
fn forward(mut op: LayerNormForward<Host<'_>>) {
    match std::mem::replace(&mut op.out, Stored::F32(&mut [])) {
        Stored::F32(out) => normalize(out, op, |v| v),
        Stored::Bf16(out) => normalize(out, op, Bf16::from_f32),
    }
}

/// [`forward`] into `out`, each value as `put` stores it (`op.out` unused).
fn normalize<T: Send>(
    out: &mut [T],
    op: LayerNormForward<Host<'_>>,
    put: impl Fn(f32) -> T + Sync,
) {
    let LayerNormForward {
        mean,
        rstd,
        inp,
        w,
        b,
        c,
        eps,
        ..
    } = op;
    let rows = mean.len();
    out[..rows * c]
        .par_chunks_mut(c)
        .zip(inp[..rows * c].par_chunks(c))
        .zip(mean.par_iter_mut().zip(rstd.par_iter_mut()))
        // a decoding step's few rows stay on one thread
        .with_min_len(GRAIN.div_ceil(c))
        .for_each(|((o, x), (m, rs))| {
            let mu = sum(x) / c as f32;
            // value i in lane i % 8, in whole chunks of 8 that vectorize
            let mut acc = [0.0f32; 8];
            let (body, tail) = x.split_at(c - c % 8);
            for chunk in body.chunks_exact(8).chain([tail]) {
                for (a, &v) in acc.iter_mut().zip(chunk) {
                    let d = v - mu;
                    *a += d * d;
                }
            }
            let var = acc.iter().sum::<f32>() / c as f32;
            let r = 1.0 / (var + eps).sqrt();
            for (((o, &x), &w), &b) in o.iter_mut().zip(x).zip(&w[..c]).zip(&b[..c]) {
                *o = put((x - mu) * r * w + b);
            }
            *m = mu;
            *rs = r;
        });
}

/// dinp += d/dinp (dinp = d/dinp without `accumulate`); dw += sum over
/// rows of dout * norm; db += sum of dout; each half only when its outputs
/// are given.
fn backward(mut op: LayerNormBackward<Host<'_>>) {
    if let Some((dw, db)) = op.dwb.take() {
        backward_weight(dw, db, &op);
    }
    if let Some(dinp) = op.dinp.take() {
        backward_input(dinp, &op);
    }
}

/// The input half of the backward: dinp (+)= d/dinp, row by row.
/// One pass gathers a row's two sums (of dnorm = dout * w, and of dnorm
/// times x - mean) in eight lanes, a second writes its gradient; dnorm is
/// recomputed rather than stored (the same product, so the same bits).
/// In zipped iterators it runs in half the time that indexed loops over a
/// scratch row took (`bench --profile`, default run: 34 → 17.5 ms a step
/// for both halves).
fn backward_input(dinp: &mut [f32], op: &LayerNormBackward<Host<'_>>) {
    let (dout, inp, mean, rstd, c) = (op.dout, op.inp, op.mean, op.rstd, op.c);
    let (rows, w, accumulate) = (mean.len(), &op.w[..c], op.accumulate);
    let body = c - c % 8;
    dinp[..rows * c]
        .par_chunks_mut(c)
        .zip(dout[..rows * c].par_chunks(c))
        .zip(inp[..rows * c].par_chunks(c))
        .zip(mean.par_iter().zip(rstd))
        .with_min_len(GRAIN.div_ceil(c))
        .for_each(|(((di, d), x), (&mu, &rs))| {
            // value i in lane i % 8: sums in the order `math::sum` keeps
            let (mut dn_sum, mut dn_x) = ([0.0f32; 8], [0.0f32; 8]);
            let lanes = d[..body].chunks_exact(8).zip(x[..body].chunks_exact(8));
            for ((d, x), w) in lanes.zip(w[..body].chunks_exact(8)) {
                for l in 0..8 {
                    let dn = d[l] * w[l];
                    dn_sum[l] += dn;
                    dn_x[l] += dn * (x[l] - mu);
                }
            }
            let tail: f32 = (body..c).map(|i| d[i] * w[i]).sum();
            for (l, i) in (body..c).enumerate() {
                dn_x[l] += d[i] * w[i] * (x[i] - mu);
            }
            let dnorm_mean = (dn_sum.iter().sum::<f32>() + tail) / c as f32;
            let dnorm_norm_mean = dn_x.iter().sum::<f32>() * rs / c as f32;
            for (((di, &d), &x), &w) in di.iter_mut().zip(d).zip(x).zip(w) {
                let norm = (x - mu) * rs;
                let g = (d * w - dnorm_mean - norm * dnorm_norm_mean) * rs;
                *di = if accumulate { *di + g } else { g };
            }
        });
}

/// The weight half of the backward: dw += sum over rows of dout *
/// norm, db += sum of dout, in [`column_sums`]' chunks (a fixed order,
/// whatever rayon's schedule).
fn backward_weight(dw: &mut [f32], db: &mut [f32], op: &LayerNormBackward<Host<'_>>) {
    let (dout, inp, mean, rstd, c) = (op.dout, op.inp, op.mean, op.rstd, op.c);
    let rows = mean.len();
    let chunks = (0..rows).into_par_iter().step_by(COLUMN_CHUNK_ROWS);
    column_sums(&mut [&mut dw[..c], &mut db[..c]], chunks, |r0, part| {
        let (pw, pb) = part.split_at_mut(c);
        for r in r0..(r0 + COLUMN_CHUNK_ROWS).min(rows) {
            let x = &inp[r * c..(r + 1) * c];
            let d = &dout[r * c..(r + 1) * c];
            let (mu, rs) = (mean[r], rstd[r]);
            for i in 0..c {
                pw[i] += d[i] * ((x[i] - mu) * rs);
                pb[i] += d[i];
            }
        }
    });
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// [`forward`] of `x` (rows of `c`) into new vectors: its
    /// (out, mean, rstd), for tests.
    pub(crate) fn forward_into_new(
        x: &[f32],
        (w, b): (&[f32], &[f32]),
        c: usize,
        eps: f32,
    ) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
        let rows = x.len() / c;
        let (mut out, mut mean, mut rstd) = (vec![0.0; rows * c], vec![0.0; rows], vec![0.0; rows]);
        forward(LayerNormForward {
            out: Stored::F32(&mut out),
            mean: &mut mean,
            rstd: &mut rstd,
            inp: x,
            w,
            b,
            c,
            eps,
        });
        (out, mean, rstd)
    }
    use crate::backend::cpu::check::*;
    use crate::rng::Rng;

    fn reference(x: &[f64], w: &[f64], b: &[f64], c: usize) -> Vec<f64> {
        x.chunks(c)
            .flat_map(|row| {
                let mu = row.iter().sum::<f64>() / c as f64;
                let var = row.iter().map(|v| (v - mu).powi(2)).sum::<f64>() / c as f64;
                let r = 1.0 / (var + 1e-5f64).sqrt();
                (0..c)
                    .map(move |i| (row[i] - mu) * r * w[i] + b[i])
                    .collect::<Vec<_>>()
            })
            .collect()
    }

    /// An output stored in bf16 is the fp32 output rounded, bit for bit,
    /// the statistics the same, over more than one task's rows.
    #[test]
    fn a_bf16_output_is_the_fp32_output_rounded() {
        let mut rng = Rng::new(5);
        let (rows, c) = (2 * GRAIN / 40 + 3, 40);
        let x = randn(&mut rng, rows * c, 2.0);
        let (w, b) = (randn(&mut rng, c, 1.0), randn(&mut rng, c, 1.0));
        let (out, mean, rstd) = forward_into_new(&x, (&w, &b), c, 1e-5);
        let mut held = vec![Bf16::default(); rows * c];
        let (mut m, mut r) = (vec![0.0; rows], vec![0.0; rows]);
        forward(LayerNormForward {
            out: Stored::Bf16(&mut held),
            mean: &mut m,
            rstd: &mut r,
            inp: &x,
            w: &w,
            b: &b,
            c,
            eps: 1e-5,
        });
        let rounded: Vec<Bf16> = out.iter().map(|&v| Bf16::from_f32(v)).collect();
        assert!(held == rounded, "bf16 norm");
        assert_eq!((m, r), (mean, rstd), "statistics");
    }

    #[test]
    fn layernorm_backward_matches_finite_differences() {
        let (rows, c) = (70, 12);
        let mut rng = Rng::new(3);
        let x = randn(&mut rng, rows * c, 2.0);
        let w = randn(&mut rng, c, 1.0);
        let b = randn(&mut rng, c, 1.0);
        let probe = randn(&mut rng, rows * c, 1.0);

        let (out, mean, rstd) = forward_into_new(&x, (&w, &b), c, 1e-5);
        assert_close(
            "out",
            &out,
            &reference(&to64(&x), &to64(&w), &to64(&b), c),
            1e-5,
        );

        // without `accumulate`, dinp's old values (NaN here) are never read
        let (mut dx, mut dw, mut db) = (vec![f32::NAN; rows * c], vec![0.0; c], vec![0.0; c]);
        backward(LayerNormBackward {
            dinp: Some(&mut dx),
            dwb: Some((&mut dw, &mut db)),
            dout: &probe,
            inp: &x,
            w: &w,
            mean: &mean,
            rstd: &rstd,
            c,
            accumulate: false,
        });
        let (x64, w64, b64) = (to64(&x), to64(&w), to64(&b));
        let fx = |v: &[f64]| probe_dot(&reference(v, &w64, &b64, c), &probe);
        assert_close("dx", &dx, &finite_diff(&x, fx), 1e-4);
        let fw = |v: &[f64]| probe_dot(&reference(&x64, v, &b64, c), &probe);
        assert_close("dw", &dw, &finite_diff(&w, fw), 1e-4);
        let fb = |v: &[f64]| probe_dot(&reference(&x64, &w64, v, c), &probe);
        assert_close("db", &db, &finite_diff(&b, fb), 1e-4);
    }

    #[test]
    fn each_half_alone_adds_what_both_together_add() {
        let (rows, c) = (130, 20);
        let mut rng = Rng::new(4);
        let x = randn(&mut rng, rows * c, 2.0);
        let w = randn(&mut rng, c, 1.0);
        let b = randn(&mut rng, c, 1.0);
        let probe = randn(&mut rng, rows * c, 1.0);
        let (_, mean, rstd) = forward_into_new(&x, (&w, &b), c, 1e-5);
        // gradients already holding values: both halves add onto them
        let base = randn(&mut rng, rows * c + 2 * c, 1.0);
        let run = |input: bool, weight: bool| {
            let mut g = base.clone();
            let (dx, dwb) = g.split_at_mut(rows * c);
            let (dw, db) = dwb.split_at_mut(c);
            backward(LayerNormBackward {
                dinp: input.then_some(dx),
                dwb: weight.then_some((dw, db)),
                dout: &probe,
                inp: &x,
                w: &w,
                mean: &mean,
                rstd: &rstd,
                c,
                accumulate: true,
            });
            g
        };
        let both = run(true, true);
        let (input, weight) = (run(true, false), run(false, true));
        assert_eq!(&both[..rows * c], &input[..rows * c], "input half");
        assert_eq!(
            &base[rows * c..],
            &input[rows * c..],
            "input half left dw, db"
        );
        assert_eq!(&both[rows * c..], &weight[rows * c..], "weight half");
        assert_eq!(
            &base[..rows * c],
            &weight[..rows * c],
            "weight half left dinp"
        );
        assert!(
            both.iter().zip(&base).all(|(a, b)| a != b),
            "a gradient not added to"
        );
    }
}
