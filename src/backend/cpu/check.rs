//! Test helpers: random inputs and central finite differences of an f64
//! reference, the yardstick every kernel's backward is held to.

use crate::rng::Rng;

pub fn randn(rng: &mut Rng, n: usize, scale: f64) -> Vec<f32> {
    (0..n).map(|_| (rng.normal() * scale) as f32).collect()
}

pub fn to64(x: &[f32]) -> Vec<f64> {
    x.iter().map(|&v| v as f64).collect()
}

/// d f / d x by central differences, f evaluated in f64.
pub fn finite_diff(x: &[f32], f: impl Fn(&[f64]) -> f64) -> Vec<f64> {
    let mut xs = to64(x);
    let h = 1e-6;
    (0..xs.len())
        .map(|i| {
            let orig = xs[i];
            xs[i] = orig + h;
            let up = f(&xs);
            xs[i] = orig - h;
            let down = f(&xs);
            xs[i] = orig;
            (up - down) / (2.0 * h)
        })
        .collect()
}

/// Asserts |a - b| <= tol * (1 + |b|) elementwise.
pub fn assert_close(what: &str, got: &[f32], want: &[f64], tol: f64) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let err = (g as f64 - w).abs();
        assert!(
            err <= tol * (1.0 + w.abs()),
            "{what}[{i}]: got {g}, want {w} (err {err})"
        );
    }
}

/// sum_i out_i * probe_i: a scalar whose gradient w.r.t. `out` is `probe`.
pub fn probe_dot(out: &[f64], probe: &[f32]) -> f64 {
    out.iter().zip(probe).map(|(o, &p)| o * p as f64).sum()
}
