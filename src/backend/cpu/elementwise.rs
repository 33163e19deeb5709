//! Pointwise kernels: GELU, copy, add, squared norms.

use super::math::{gelu, gelu_grad};
use rayon::prelude::*;

const CHUNK: usize = 1 << 14;

/// out = gelu(inp), any shape.
pub fn gelu_forward(out: &mut [f32], inp: &[f32]) {
    out[..inp.len()]
        .par_chunks_mut(CHUNK)
        .zip(inp.par_chunks(CHUNK))
        .for_each(|(o, x)| o.iter_mut().zip(x).for_each(|(o, &x)| *o = gelu(x)));
}

/// d *= gelu'(inp): turns d loss / d gelu(inp) into d loss / d inp, in place.
pub fn gelu_backward_inplace(d: &mut [f32], inp: &[f32]) {
    d[..inp.len()]
        .par_chunks_mut(CHUNK)
        .zip(inp.par_chunks(CHUNK))
        .for_each(|(d, x)| d.iter_mut().zip(x).for_each(|(d, &x)| *d *= gelu_grad(x)));
}

/// dst = src.
pub fn copy(dst: &mut [f32], src: &[f32]) {
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
    use super::*;
    use crate::rng::Rng;

    fn gelu64(x: f64) -> f64 {
        let u = (2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x.powi(3));
        0.5 * x * (1.0 + u.tanh())
    }

    #[test]
    fn gelu_backward_matches_finite_differences() {
        let mut rng = Rng::new(6);
        let x = randn(&mut rng, 257, 3.0);
        let probe = randn(&mut rng, 257, 1.0);
        let mut out = vec![0.0; 257];
        gelu_forward(&mut out, &x);
        let want: Vec<f64> = to64(&x).into_iter().map(gelu64).collect();
        assert_close("out", &out, &want, 1e-6);
        let mut d = probe.clone();
        gelu_backward_inplace(&mut d, &x);
        let fd = finite_diff(&x, |v| {
            let o: Vec<f64> = v.iter().map(|&x| gelu64(x)).collect();
            probe_dot(&o, &probe)
        });
        assert_close("dx", &d, &fd, 1e-5);
    }

    #[test]
    fn sum_squares_is_exact_on_small_input() {
        let x: Vec<f32> = (0..37).map(|i| i as f32).collect();
        let want: f64 = (0..37).map(|i| (i * i) as f64).sum();
        assert_eq!(sum_squares(&x), want);
    }
}
