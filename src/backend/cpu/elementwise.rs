//! Pointwise primitives: fill, copy, add, bf16 rounding, squared norms.

use crate::backend::ops::convert;
use crate::backend::Bf16;
use rayon::prelude::*;

/// Elements a task takes.
pub(crate) const CHUNK: usize = 1 << 14;

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

/// dst = src rounded to the nearest bfloat16.
pub fn to_bf16(dst: &mut [Bf16], src: &[f32]) {
    dst[..src.len()]
        .par_chunks_mut(CHUNK)
        .zip(src.par_chunks(CHUNK))
        .for_each(|(d, s)| convert(d, s, false, Bf16::from_f32));
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
    use super::*;

    #[test]
    fn sum_squares_is_exact_on_small_input() {
        let x: Vec<f32> = (0..37).map(|i| i as f32).collect();
        let want: f64 = (0..37).map(|i| (i * i) as f64).sum();
        assert_eq!(sum_squares(&x), want);
    }
}
