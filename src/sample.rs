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
