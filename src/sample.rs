//! Drawing a token from a row of logits: greedy, temperature, top-k and
//! top-p, with a seeded generator (every family's decoder samples here).

use crate::backend::cpu::math::row_max;
use crate::error::{Error, Result};
use crate::rng::Rng;

#[derive(Clone, Copy, Debug)]
pub struct SampleConfig {
    pub max_new_tokens: usize,
    /// 0 means greedy.
    pub temperature: f32,
    /// Keep the k most likely tokens; 0 keeps all.
    pub top_k: usize,
    /// Keep the most likely tokens whose probabilities sum to p; 1 keeps all.
    pub top_p: f32,
    pub seed: u64,
}

impl SampleConfig {
    /// Refuses settings that cannot sample, naming the flag.
    pub fn validate(&self) -> Result<()> {
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return Err(Error::Config(format!(
                "--temperature {} must be a number >= 0 (0: greedy)",
                self.temperature
            )));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(Error::Config(format!(
                "--top-p {} must be in (0, 1] (1 keeps every token)",
                self.top_p
            )));
        }
        Ok(())
    }
}

/// Draws a token from logits (vocabulary only, no padding).
pub fn sample_token(logits: &[f32], cfg: &SampleConfig, rng: &mut Rng) -> u32 {
    if cfg.temperature <= 0.0 {
        return argmax(logits) as u32;
    }
    let mut idx: Vec<u32> = (0..logits.len() as u32).collect();
    if cfg.top_k > 0 && cfg.top_k < idx.len() {
        idx.select_nth_unstable_by(cfg.top_k - 1, |&a, &b| {
            logits[b as usize].total_cmp(&logits[a as usize])
        });
        idx.truncate(cfg.top_k);
    }
    let max = idx
        .iter()
        .map(|&i| logits[i as usize])
        .fold(f32::NEG_INFINITY, f32::max);
    let mut weighted: Vec<(u32, f64)> = idx
        .iter()
        .map(|&i| {
            (
                i,
                (((logits[i as usize] - max) / cfg.temperature) as f64).exp(),
            )
        })
        .collect();
    if cfg.top_p < 1.0 {
        weighted.sort_by(|a, b| b.1.total_cmp(&a.1));
        let total: f64 = weighted.iter().map(|w| w.1).sum();
        let mut acc = 0.0;
        let keep = weighted
            .iter()
            .position(|w| {
                acc += w.1 / total;
                acc >= cfg.top_p as f64
            })
            .map_or(weighted.len(), |i| i + 1);
        weighted.truncate(keep);
    }
    let mut u = rng.uniform() * weighted.iter().map(|w| w.1).sum::<f64>();
    for &(i, w) in &weighted {
        u -= w;
        if u <= 0.0 {
            return i;
        }
    }
    weighted.last().expect("vocabulary is not empty").0
}

/// The index of the largest value (the first of equals; 0 for none), in
/// two passes the compiler vectorizes.
pub fn argmax(v: &[f32]) -> usize {
    let max = row_max(v);
    v.iter().position(|&x| x == max).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// How often each token is drawn in `n` draws.
    fn counts(logits: &[f32], cfg: &SampleConfig, n: usize) -> Vec<usize> {
        let mut rng = Rng::new(cfg.seed);
        let mut counts = vec![0; logits.len()];
        for _ in 0..n {
            counts[sample_token(logits, cfg, &mut rng) as usize] += 1;
        }
        counts
    }

    /// Each count within 5 standard deviations of a binomial's mean at
    /// `p` (a token of probability 0 never drawn).
    fn assert_drawn_at(counts: &[usize], p: &[f64], what: &str) {
        let n: usize = counts.iter().sum();
        for (i, (&c, &p)) in counts.iter().zip(p).enumerate() {
            let (mean, sd) = (n as f64 * p, (n as f64 * p * (1.0 - p)).sqrt());
            assert!(
                (c as f64 - mean).abs() <= 5.0 * sd,
                "{what}: token {i} drawn {c} of {n} times, expected {mean:.0} +- {:.0}",
                5.0 * sd
            );
        }
    }

    fn sampling(temperature: f32, top_p: f32) -> SampleConfig {
        SampleConfig {
            max_new_tokens: 1,
            temperature,
            top_k: 0,
            top_p,
            seed: 5,
        }
    }

    #[test]
    fn a_temperature_divides_the_logits_before_the_softmax() {
        // logits 0, ln 2, ln 4: softmax(l / 0.5) is 1 : 4 : 16, softmax(l / 2)
        // is 1 : sqrt 2 : 2
        let logits = [0.0, 2f32.ln(), 4f32.ln()];
        let r2 = 2f64.sqrt();
        for (t, p) in [
            (0.5, [1.0 / 21.0, 4.0 / 21.0, 16.0 / 21.0]),
            (1.0, [1.0 / 7.0, 2.0 / 7.0, 4.0 / 7.0]),
            (2.0, [1.0 / (3.0 + r2), r2 / (3.0 + r2), 2.0 / (3.0 + r2)]),
        ] {
            let drawn = counts(&logits, &sampling(t, 1.0), 20_000);
            assert_drawn_at(&drawn, &p, &format!("temperature {t}"));
        }
    }

    #[test]
    fn top_p_keeps_the_fewest_likeliest_tokens_whose_probabilities_reach_p() {
        // exp of the logits: 1.1052, 20.0855, 0.3679, 18.1741 (sum 39.7327),
        // so the tokens by probability are 1 (0.5055), 3 (0.4574), 0
        // (0.0278), 2 (0.0093)
        let logits = [0.1f32, 3.0, -1.0, 2.9];
        let e = [0.1f64.exp(), 3f64.exp(), (-1f64).exp(), 2.9f64.exp()];
        for (top_p, kept) in [
            (0.5, vec![1]),
            (0.9, vec![1, 3]),
            (0.97, vec![1, 3, 0]),
            (1.0, vec![0, 1, 2, 3]),
        ] {
            let sum: f64 = kept.iter().map(|&i| e[i]).sum();
            let p: Vec<f64> = (0..4)
                .map(|i| if kept.contains(&i) { e[i] / sum } else { 0.0 })
                .collect();
            let drawn = counts(&logits, &sampling(1.0, top_p), 20_000);
            assert_drawn_at(&drawn, &p, &format!("top-p {top_p}"));
        }
    }
}
