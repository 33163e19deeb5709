//! Pointwise kernels: activations, copy, add, squared norms.

use super::math::{column_sums, gelu, gelu_erf, gelu_erf_grad, gelu_grad, tanh_exp, widest};
use crate::backend::ops::{activation_bias_width, ActivationBackward, ActivationForward, Host};
use crate::backend::{Activation, COLUMN_CHUNK_ROWS};
use rayon::prelude::*;

const CHUNK: usize = 1 << 14;

widest! {
    /// out = act(inp) over one chunk; where `b` is not empty (n wide), the
    /// chunk is rows of n and out = act(inp + b).
    fn activate(out: &mut [f32], inp: &[f32], b: &[f32], act: Activation) {
        #[inline(always)]
        fn by(out: &mut [f32], inp: &[f32], b: &[f32], f: impl Fn(f32) -> f32) {
            if b.is_empty() {
                return out.iter_mut().zip(inp).for_each(|(o, &x)| *o = f(x));
            }
            for (o, x) in out.chunks_exact_mut(b.len()).zip(inp.chunks_exact(b.len())) {
                for ((o, &x), &b) in o.iter_mut().zip(x).zip(b) {
                    *o = f(x + b);
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
    /// d *= act'(x) over one chunk; where `b` is not empty (n wide), the
    /// chunk is rows of n and d *= act'(x + b), and where `p` is not empty
    /// too (n wide), the rows' sums after the multiply are added to p.
    fn scale_chunk(d: &mut [f32], x: &[f32], b: &[f32], p: &mut [f32], act: Activation) {
        #[inline(always)]
        fn by(d: &mut [f32], x: &[f32], b: &[f32], p: &mut [f32], f: impl Fn(f32) -> f32) {
            if b.is_empty() {
                return d.iter_mut().zip(x).for_each(|(d, &x)| *d *= f(x));
            }
            for (d, x) in d.chunks_exact_mut(b.len()).zip(x.chunks_exact(b.len())) {
                if p.is_empty() {
                    d.iter_mut().zip(x).zip(b).for_each(|((d, &x), &b)| *d *= f(x + b));
                    continue;
                }
                for (((d, &x), &b), p) in d.iter_mut().zip(x).zip(b).zip(p.iter_mut()) {
                    *d *= f(x + b);
                    *p += *d;
                }
            }
        }
        match act {
            Activation::GeluTanh => by(d, x, b, p, gelu_grad),
            Activation::GeluErf => by(d, x, b, p, gelu_erf_grad),
            Activation::Tanh => by(d, x, b, p, |x| {
                let t = tanh_exp(x);
                1.0 - t * t
            }),
        }
    }
}

/// [`activation_bias_width`], whose refusal is a caller's bug here.
fn bias_width(len: usize, bias: Option<&[f32]>, grad: Option<usize>) -> usize {
    activation_bias_width(len, bias.map(<[f32]>::len), grad).unwrap_or_else(|e| panic!("{e}"))
}

/// The elements a task takes: about [`CHUNK`], in whole rows of a bias n
/// wide (n = 0: none).
fn span(n: usize) -> usize {
    match n {
        0 => CHUNK,
        n => n * CHUNK.div_ceil(n),
    }
}

/// out = act(inp + bias), any shape; with a bias (n), inp is (rows, n)
/// ([`ActivationForward`]).
pub fn activation_forward(op: ActivationForward<Host<'_>>) {
    let ActivationForward {
        out,
        inp,
        bias,
        act,
    } = op;
    let span = span(bias_width(inp.len(), bias, None));
    let b = bias.unwrap_or_default();
    out[..inp.len()]
        .par_chunks_mut(span)
        .zip(inp.par_chunks(span))
        .for_each(|(o, x)| activate(o, x, b, act));
}

/// d *= act'(inp + bias): turns d loss / d act(inp + bias) into d loss /
/// d inp, in place; with `dbias` (n), d is (rows, n) and the bias gradient
/// of the product that made inp (d's column sums after the multiply) is
/// added to dbias in the same pass ([`column_sums`]' chunks).
pub fn activation_backward(op: ActivationBackward<Host<'_>>) {
    let ActivationBackward {
        d,
        inp,
        bias,
        act,
        dbias,
    } = op;
    let d = &mut d[..inp.len()];
    let Some(db) = dbias.filter(|db| !db.is_empty()) else {
        let span = span(bias_width(inp.len(), bias, None));
        let b = bias.unwrap_or_default();
        d.par_chunks_mut(span)
            .zip(inp.par_chunks(span))
            .for_each(|(d, x)| scale_chunk(d, x, b, &mut [], act));
        return;
    };
    // a bias of zeros where none is given: x + 0 only turns -0 into +0,
    // where every act' has the same value
    let zeros;
    let b = match bias {
        Some(b) => b,
        None => {
            zeros = vec![0.0; db.len()];
            &zeros
        }
    };
    let n = bias_width(inp.len(), Some(b), Some(db.len()));
    let span = COLUMN_CHUNK_ROWS * n;
    let chunks = d.par_chunks_mut(span).zip(inp.par_chunks(span));
    column_sums(&mut [db], chunks, |(d, x), p| scale_chunk(d, x, b, p, act));
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
    /// formulas give element by element in the kernel's order (x + b
    /// first where there is a bias; the bias gradient summed a chunk of
    /// rows at a time, the chunks then in order), on every instruction set
    /// this CPU runs them on (`widest!`: AVX-512's copy where it has it,
    /// and the build's own).
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
        let col_sums = |d: &[f32]| {
            let mut sums = vec![0.5f32; n];
            for chunk in d.chunks(COLUMN_CHUNK_ROWS * n) {
                let mut part = vec![0.0f32; n];
                for row in chunk.chunks(n) {
                    part.iter_mut().zip(row).for_each(|(p, &v)| *p += v);
                }
                sums.iter_mut().zip(&part).for_each(|(s, &p)| *s += p);
            }
            sums
        };
        for (act, f, df) in formulas {
            let mut rng = Rng::new(9);
            // past one CHUNK, so the parallel chunks are exercised too
            let x = randn(&mut rng, CHUNK + rows * n, 4.0);
            let probe = randn(&mut rng, x.len(), 1.0);
            let b = randn(&mut rng, n, 1.0);
            let z: Vec<f32> = (0..rows * n).map(|i| x[i] + b[i % n]).collect();
            let want_out: Vec<f32> = x.iter().map(|&x| f(x)).collect();
            let want_out_b: Vec<f32> = z.iter().map(|&z| f(z)).collect();
            let want: Vec<f32> = x.iter().zip(&probe).map(|(&x, &p)| p * df(x)).collect();
            let want_b: Vec<f32> = z.iter().zip(&probe).map(|(&z, &p)| p * df(z)).collect();
            let (want_db, want_db_b) = (col_sums(&want[..rows * n]), col_sums(&want_b));
            let runs = on_each_width(|| {
                let (x, probe) = (&x[..], &probe[..]);
                let forward = |len, bias| {
                    let mut out = vec![0.0; len];
                    let inp = &x[..len];
                    activation_forward(ActivationForward {
                        out: &mut out,
                        inp,
                        bias,
                        act,
                    });
                    out
                };
                let backward = |len, bias, with_db: bool| {
                    let (mut d, mut db) = (probe[..len].to_vec(), vec![0.5f32; n]);
                    activation_backward(ActivationBackward {
                        d: &mut d,
                        inp: &x[..len],
                        bias,
                        act,
                        dbias: with_db.then_some(&mut db[..]),
                    });
                    [d, db]
                };
                let [d_b, db_b] = backward(rows * n, Some(&b[..]), true);
                let [d_rows, db] = backward(rows * n, None, true);
                [
                    forward(x.len(), None),
                    forward(rows * n, Some(&b[..])),
                    backward(x.len(), None, false)[0].clone(),
                    backward(rows * n, Some(&b[..]), false)[0].clone(),
                    d_b,
                    db_b,
                    d_rows,
                    db,
                ]
            });
            for (width, [out, out_b, d, d_b_only, d_b, db_b, d_rows, db]) in
                runs.into_iter().enumerate()
            {
                let at = format!("{act:?}, instruction set {width}");
                assert_eq!(bits(&out), bits(&want_out), "{at}: forward");
                assert_eq!(bits(&out_b), bits(&want_out_b), "{at}: forward, a bias");
                assert_eq!(bits(&d), bits(&want), "{at}: backward");
                assert_eq!(bits(&d_b_only), bits(&want_b), "{at}: backward, a bias");
                assert_eq!(
                    bits(&d_b),
                    bits(&want_b),
                    "{at}: backward, a bias and its gradient"
                );
                assert_eq!(bits(&db_b), bits(&want_db_b), "{at}: the bias's gradient");
                assert_eq!(
                    bits(&d_rows),
                    bits(&want[..rows * n]),
                    "{at}: bias gradient only"
                );
                assert_eq!(bits(&db), bits(&want_db), "{at}: a gradient without a bias");
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
                inp: &x,
                bias: None,
                act,
            });
            let want: Vec<f64> = to64(&x).into_iter().map(f).collect();
            assert_close(&format!("{act:?} out"), &out, &want, 1e-6);
            let mut d = probe.clone();
            activation_backward(ActivationBackward {
                d: &mut d,
                inp: &x,
                bias: None,
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
    /// against f64, and for loss = probe . act(z) the gradients of x and b
    /// by finite differences, over rows that span three chunks (the last
    /// short), dbias added onto one that was not zero; d the same with
    /// and without dbias.
    #[test]
    fn a_fused_bias_matches_f64_and_finite_differences() {
        let (rows, n) = (2 * COLUMN_CHUNK_ROWS + 5, 7);
        for (act, f) in references() {
            let mut rng = Rng::new(8);
            let x = randn(&mut rng, rows * n, 1.5);
            let b = randn(&mut rng, n, 0.5);
            let probe = randn(&mut rng, rows * n, 1.0);
            let start = randn(&mut rng, n, 1.0);
            let mut out = vec![0.0; rows * n];
            activation_forward(ActivationForward {
                out: &mut out,
                inp: &x,
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
                inp: &x,
                bias: Some(&b),
                act,
                dbias: Some(&mut db),
            });
            let loss = |x: &[f64], b: &[f64]| {
                let o: Vec<f64> = (0..rows * n).map(|i| f(x[i] + b[i % n])).collect();
                probe_dot(&o, &probe)
            };
            let fd_b = finite_diff(&b, |bv| loss(&to64(&x), bv));
            let want: Vec<f64> = fd_b
                .iter()
                .zip(&start)
                .map(|(g, &s)| g + s as f64)
                .collect();
            assert_close(&format!("{act:?} dbias"), &db, &want, 1e-4);
            let fd_x = finite_diff(&x, |xv| loss(xv, &to64(&b)));
            assert_close(&format!("{act:?} dx"), &d, &fd_x, 1e-4);
            let mut plain = probe.clone();
            activation_backward(ActivationBackward {
                d: &mut plain,
                inp: &x,
                bias: Some(&b),
                act,
                dbias: None,
            });
            assert_eq!(d, plain, "{act:?}: d differs without dbias");
        }
    }

    #[test]
    fn sum_squares_is_exact_on_small_input() {
        let x: Vec<f32> = (0..37).map(|i| i as f32).collect();
        let want: f64 = (0..37).map(|i| (i * i) as f64).sum();
        assert_eq!(sum_squares(&x), want);
    }
}
