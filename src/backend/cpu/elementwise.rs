//! Pointwise kernels: activations, copy, add, squared norms.

use super::math::{column_sums, gelu, gelu_erf, gelu_erf_grad, gelu_grad, tanh_exp, widest};
use crate::backend::ops::{ActivationBackward, ActivationForward, Host};
use crate::backend::{Activation, COLUMN_CHUNK_ROWS};
use rayon::prelude::*;

const CHUNK: usize = 1 << 14;

widest! {
    /// out = act(inp) over one chunk; where `b` is not empty (n wide), the
    /// chunk is rows of n, each first added b in place.
    fn activate(out: &mut [f32], inp: &mut [f32], b: &[f32], act: Activation) {
        #[inline(always)]
        fn by(out: &mut [f32], inp: &mut [f32], b: &[f32], f: impl Fn(f32) -> f32) {
            if b.is_empty() {
                return out.iter_mut().zip(&*inp).for_each(|(o, &x)| *o = f(x));
            }
            for (o, x) in out.chunks_exact_mut(b.len()).zip(inp.chunks_exact_mut(b.len())) {
                for ((o, x), &b) in o.iter_mut().zip(x).zip(b) {
                    *x += b;
                    *o = f(*x);
                }
            }
        }
        match act {
            Activation::GeluTanh => by(out, inp, b, gelu),
            Activation::GeluErf => by(out, inp, b, gelu_erf),
            Activation::Tanh => by(out, inp, b, tanh_exp),
        }
    }
}

widest! {
    /// d *= act'(x) over one chunk; where `p` is not empty (n wide), the
    /// chunk is rows of n whose sums after the multiply are added to p.
    fn scale_chunk(d: &mut [f32], x: &[f32], p: &mut [f32], act: Activation) {
        #[inline(always)]
        fn by(d: &mut [f32], x: &[f32], p: &mut [f32], f: impl Fn(f32) -> f32) {
            if p.is_empty() {
                return d.iter_mut().zip(x).for_each(|(d, &x)| *d *= f(x));
            }
            for (d, x) in d.chunks_exact_mut(p.len()).zip(x.chunks_exact(p.len())) {
                for ((d, &x), p) in d.iter_mut().zip(x).zip(p.iter_mut()) {
                    *d *= f(x);
                    *p += *d;
                }
            }
        }
        match act {
            Activation::GeluTanh => by(d, x, p, gelu_grad),
            Activation::GeluErf => by(d, x, p, gelu_erf_grad),
            Activation::Tanh => by(d, x, p, |x| {
                let t = tanh_exp(x);
                1.0 - t * t
            }),
        }
    }
}

/// out = act(inp), any shape; with a bias (n), inp is (rows, n) and gets
/// it first, in place ([`ActivationForward`]).
pub fn activation_forward(op: ActivationForward<Host<'_>>) {
    let ActivationForward {
        out,
        inp,
        bias,
        act,
    } = op;
    let b = bias.unwrap_or_default();
    // chunks of whole rows where there is a bias, about CHUNK elements
    let span = match b.len() {
        0 => CHUNK,
        n => {
            assert!(
                inp.len().is_multiple_of(n),
                "activation of {} elements in rows of {n}",
                inp.len()
            );
            n * CHUNK.div_ceil(n)
        }
    };
    out[..inp.len()]
        .par_chunks_mut(span)
        .zip(inp.par_chunks_mut(span))
        .for_each(|(o, x)| activate(o, x, b, act));
}

/// d *= act'(inp): turns d loss / d act(inp) into d loss / d inp, in
/// place; with `dbias` (n), d is (rows, n) and the bias gradient of the
/// product that made inp (d's column sums after the multiply) is added to
/// dbias in the same pass ([`column_sums`]' chunks).
pub fn activation_backward(op: ActivationBackward<Host<'_>>) {
    let ActivationBackward { d, inp, act, dbias } = op;
    let d = &mut d[..inp.len()];
    let Some(db) = dbias.filter(|db| !db.is_empty()) else {
        d.par_chunks_mut(CHUNK)
            .zip(inp.par_chunks(CHUNK))
            .for_each(|(d, x)| scale_chunk(d, x, &mut [], act));
        return;
    };
    let n = db.len();
    assert!(
        inp.len().is_multiple_of(n),
        "activation gradient of {} elements in rows of {n}",
        inp.len()
    );
    let span = COLUMN_CHUNK_ROWS * n;
    let chunks = d.par_chunks_mut(span).zip(inp.par_chunks(span));
    column_sums(&mut [db], chunks, |(d, x), p| scale_chunk(d, x, p, act));
}

/// dst = value, in parallel chunks past one.
pub fn fill(dst: &mut [f32], value: f32) {
    if dst.len() <= CHUNK {
        return dst.fill(value);
    }
    dst.par_chunks_mut(CHUNK).for_each(|d| d.fill(value));
}

/// dst = src.
pub fn copy(dst: &mut [f32], src: &[f32]) {
    if src.len() <= CHUNK {
        // one chunk (a decoding step's rows): handing it to the thread pool
        // costs more than copying it
        dst[..src.len()].copy_from_slice(src);
        return;
    }
    dst[..src.len()]
        .par_chunks_mut(CHUNK)
        .zip(src.par_chunks(CHUNK))
        .for_each(|(d, s)| d.copy_from_slice(s));
}

/// x rounded to the nearest bfloat16 in place, kept as f32.
pub fn round_bf16(x: &mut [f32]) {
    x.par_chunks_mut(CHUNK)
        .for_each(|c| c.iter_mut().for_each(|v| *v = super::round_to_bf16(*v)));
}

/// dst = src rounded to the nearest bfloat16, kept as f32, in one pass.
pub fn round_bf16_from(dst: &mut [f32], src: &[f32]) {
    dst[..src.len()]
        .par_chunks_mut(CHUNK)
        .zip(src.par_chunks(CHUNK))
        .for_each(|(d, s)| {
            d.iter_mut()
                .zip(s)
                .for_each(|(d, &s)| *d = super::round_to_bf16(s))
        });
}

/// dst += src.
pub fn add_inplace(dst: &mut [f32], src: &[f32]) {
    dst[..src.len()]
        .par_chunks_mut(CHUNK)
        .zip(src.par_chunks(CHUNK))
        .for_each(|(d, s)| d.iter_mut().zip(s).for_each(|(d, &s)| *d += s));
}

/// Sum of squares in f64, for gradient norms.
pub fn sum_squares(x: &[f32]) -> f64 {
    x.par_chunks(CHUNK)
        .map(|c| {
            let mut acc = [0.0f32; 8];
            let it = c.chunks_exact(8);
            let tail: f32 = it.remainder().iter().map(|v| v * v).sum();
            for v in it {
                for i in 0..8 {
                    acc[i] += v[i] * v[i];
                }
            }
            acc.iter().map(|&a| a as f64).sum::<f64>() + tail as f64
        })
        .sum()
}

#[cfg(test)]
mod tests {
    use super::super::check::*;
    use super::super::math::on_each_width;
    use super::*;
    use crate::rng::Rng;

    fn gelu64(x: f64) -> f64 {
        let u = (2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x.powi(3));
        0.5 * x * (1.0 + u.tanh())
    }

    /// erf in f64: its Maclaurin series below |x| = 2.5, 1 - erfc by
    /// erfc's continued fraction above (each accurate to ~1e-14 there).
    fn erf64(x: f64) -> f64 {
        let a = x.abs();
        if a < 2.5 {
            let (mut term, mut sum) = (x, x);
            for n in 1..200 {
                term *= -x * x / n as f64;
                sum += term / (2 * n + 1) as f64;
            }
            return sum * 2.0 / std::f64::consts::PI.sqrt();
        }
        let mut cf = a;
        for k in (1..200).rev() {
            cf = a + k as f64 / 2.0 / cf;
        }
        let erfc = (-a * a).exp() / (std::f64::consts::PI.sqrt() * cf);
        (1.0 - erfc).copysign(x)
    }

    fn gelu_erf64(x: f64) -> f64 {
        0.5 * x * (1.0 + erf64(x / 2f64.sqrt()))
    }

    type Reference = fn(f64) -> f64;

    /// Each activation with its f64 reference.
    fn references() -> [(Activation, Reference); 3] {
        [
            (Activation::GeluTanh, gelu64),
            (Activation::GeluErf, gelu_erf64),
            (Activation::Tanh, f64::tanh),
        ]
    }

    #[test]
    fn rounding_into_another_buffer_is_rounding_in_place() {
        let mut rng = Rng::new(5);
        // past one chunk, so the chunks of both buffers must line up
        let mut x = randn(&mut rng, CHUNK + 77, 30.0);
        x.extend([
            f32::NAN,
            f32::from_bits(0x3f80_8000),
            f32::from_bits(0x3f81_8000),
        ]);
        let mut want = x.clone();
        round_bf16(&mut want);
        let mut got = vec![0.0; x.len() + 3];
        round_bf16_from(&mut got, &x);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&got[..x.len()]), bits(&want));
        assert_eq!(got[x.len()..], [0.0; 3], "past src's length: untouched");
        assert_ne!(bits(&want), bits(&x), "rounding changed nothing");
    }

    /// Each activation's kernels give, bit for bit, what its scalar
    /// formulas give element by element in the kernel's order (the bias
    /// gradient summed a chunk of rows at a time, the chunks then in
    /// order), on every instruction set this CPU runs them on
    /// (`widest!`: AVX-512's copy where it has it, and the build's own).
    #[test]
    fn activations_give_their_scalar_formulas_bits_on_every_instruction_set() {
        let (rows, n) = (2 * COLUMN_CHUNK_ROWS + 3, 37);
        type Scalar = fn(f32) -> f32;
        let formulas: [(Activation, Scalar, Scalar); 3] = [
            (Activation::GeluTanh, gelu, gelu_grad),
            (Activation::GeluErf, gelu_erf, gelu_erf_grad),
            (Activation::Tanh, tanh_exp, |x| {
                1.0 - tanh_exp(x) * tanh_exp(x)
            }),
        ];
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        for (act, f, df) in formulas {
            let mut rng = Rng::new(9);
            // past one CHUNK, so the parallel chunks are exercised too
            let x = randn(&mut rng, CHUNK + rows * n, 4.0);
            let probe = randn(&mut rng, x.len(), 1.0);
            let want_out: Vec<f32> = x.iter().map(|&x| f(x)).collect();
            let want: Vec<f32> = x.iter().zip(&probe).map(|(&x, &p)| p * df(x)).collect();
            let b = randn(&mut rng, n, 1.0);
            let want_z: Vec<f32> = x[..rows * n]
                .iter()
                .enumerate()
                .map(|(i, &x)| x + b[i % n])
                .collect();
            let want_out_b: Vec<f32> = want_z.iter().map(|&z| f(z)).collect();
            let mut want_db = vec![0.5f32; n];
            for chunk in want[..rows * n].chunks(COLUMN_CHUNK_ROWS * n) {
                let mut part = vec![0.0f32; n];
                for row in chunk.chunks(n) {
                    part.iter_mut().zip(row).for_each(|(p, &v)| *p += v);
                }
                want_db.iter_mut().zip(&part).for_each(|(s, &p)| *s += p);
            }
            for (width, [out, z, out_b, d, d_rows, db]) in on_each_width(|| {
                let (mut out, mut x_in) = (vec![0.0; x.len()], x.clone());
                activation_forward(ActivationForward {
                    out: &mut out,
                    inp: &mut x_in,
                    bias: None,
                    act,
                });
                assert_eq!(bits(&x_in), bits(&x), "no bias: the input is left");
                let (mut out_b, mut z) = (vec![0.0; rows * n], x[..rows * n].to_vec());
                activation_forward(ActivationForward {
                    out: &mut out_b,
                    inp: &mut z,
                    bias: Some(&b),
                    act,
                });
                let mut d = probe.clone();
                activation_backward(ActivationBackward {
                    d: &mut d,
                    inp: &x,
                    act,
                    dbias: None,
                });
                let (mut d_rows, mut db) = (probe[..rows * n].to_vec(), vec![0.5f32; n]);
                activation_backward(ActivationBackward {
                    d: &mut d_rows,
                    inp: &x[..rows * n],
                    act,
                    dbias: Some(&mut db),
                });
                [out, z, out_b, d, d_rows, db]
            })
            .into_iter()
            .enumerate()
            {
                let at = format!("{act:?}, instruction set {width}");
                assert_eq!(bits(&out), bits(&want_out), "{at}: forward");
                assert_eq!(bits(&z), bits(&want_z), "{at}: a bias added in place");
                assert_eq!(bits(&out_b), bits(&want_out_b), "{at}: forward with a bias");
                assert_eq!(bits(&d), bits(&want), "{at}: backward");
                assert_eq!(bits(&d_rows), bits(&want[..rows * n]), "{at}: with a bias");
                assert_eq!(bits(&db), bits(&want_db), "{at}: bias gradient");
            }
        }
    }

    #[test]
    fn activation_backwards_match_finite_differences() {
        for (act, f) in references() {
            let mut rng = Rng::new(6);
            let x = randn(&mut rng, 257, 3.0);
            let probe = randn(&mut rng, 257, 1.0);
            let mut out = vec![0.0; 257];
            activation_forward(ActivationForward {
                out: &mut out,
                inp: &mut x.clone(),
                bias: None,
                act,
            });
            let want: Vec<f64> = to64(&x).into_iter().map(f).collect();
            assert_close(&format!("{act:?} out"), &out, &want, 1e-6);
            let mut d = probe.clone();
            activation_backward(ActivationBackward {
                d: &mut d,
                inp: &x,
                act,
                dbias: None,
            });
            let fd = finite_diff(&x, |v| {
                let o: Vec<f64> = v.iter().map(|&x| f(x)).collect();
                probe_dot(&o, &probe)
            });
            assert_close(&format!("{act:?} dx"), &d, &fd, 1e-5);
        }
    }

    /// The fused bias: for z = x + b (b broadcast over rows of n), act(z)
    /// against f64, z as the forward leaves it in place, and for loss =
    /// probe . act(z) d loss / d b by finite differences, over
    /// rows that span three chunks (the last short), added onto a dbias
    /// that was not zero; d itself as the unfused pass leaves it.
    #[test]
    fn a_fused_bias_gradient_matches_finite_differences() {
        let (rows, n) = (2 * COLUMN_CHUNK_ROWS + 5, 7);
        for (act, f) in references() {
            let mut rng = Rng::new(8);
            let x = randn(&mut rng, rows * n, 1.5);
            let b = randn(&mut rng, n, 0.5);
            let probe = randn(&mut rng, rows * n, 1.0);
            let start = randn(&mut rng, n, 1.0);
            let (mut out, mut z) = (vec![0.0; rows * n], x.clone());
            activation_forward(ActivationForward {
                out: &mut out,
                inp: &mut z,
                bias: Some(&b),
                act,
            });
            let want: Vec<f64> = (0..rows * n)
                .map(|i| f(x[i] as f64 + b[i % n] as f64))
                .collect();
            assert_close(&format!("{act:?} out with a bias"), &out, &want, 1e-6);
            let (mut d, mut db) = (probe.clone(), start.clone());
            activation_backward(ActivationBackward {
                d: &mut d,
                inp: &z,
                act,
                dbias: Some(&mut db),
            });
            let fd = finite_diff(&b, |bv| {
                let o: Vec<f64> = (0..rows * n).map(|i| f(x[i] as f64 + bv[i % n])).collect();
                probe_dot(&o, &probe)
            });
            let want: Vec<f64> = fd.iter().zip(&start).map(|(g, &s)| g + s as f64).collect();
            assert_close(&format!("{act:?} dbias"), &db, &want, 1e-4);
            let mut plain = probe.clone();
            activation_backward(ActivationBackward {
                d: &mut plain,
                inp: &z,
                act,
                dbias: None,
            });
            assert_eq!(d, plain, "{act:?}: d differs from the unfused pass");
        }
    }

    #[test]
    fn sum_squares_is_exact_on_small_input() {
        let x: Vec<f32> = (0..37).map(|i| i as f32).collect();
        let want: f64 = (0..37).map(|i| (i * i) as f64).sum();
        assert_eq!(sum_squares(&x), want);
    }
}
