//! Autoregressive sampling with temperature and top-k. Each new token re-runs
//! the model over the (cropped) context; the KV-cache path is a later issue.

use crate::backend::Backend;
use crate::error::{Error, Result};
use crate::model::Gpt2;
use crate::rng::Rng;

#[derive(Clone, Copy, Debug)]
pub struct SampleConfig {
    pub max_new_tokens: usize,
    /// 0 means greedy.
    pub temperature: f32,
    /// Keep the k most likely tokens; 0 keeps all.
    pub top_k: usize,
    pub seed: u64,
}

/// Draws a token from logits (vocabulary only, no padding).
pub fn sample_token(logits: &[f32], cfg: &SampleConfig, rng: &mut Rng) -> u32 {
    let argmax = || {
        logits
            .iter()
            .enumerate()
            .fold((0, f32::NEG_INFINITY), |best, (i, &x)| {
                if x > best.1 {
                    (i, x)
                } else {
                    best
                }
            })
            .0 as u32
    };
    if cfg.temperature <= 0.0 {
        return argmax();
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
    let weights: Vec<f64> = idx
        .iter()
        .map(|&i| (((logits[i as usize] - max) / cfg.temperature) as f64).exp())
        .collect();
    let mut u = rng.uniform() * weights.iter().sum::<f64>();
    for (w, &i) in weights.iter().zip(&idx) {
        u -= w;
        if u <= 0.0 {
            return i;
        }
    }
    *idx.last().expect("vocabulary is not empty")
}

/// Extends `prompt` by up to `max_new_tokens`, calling `on_token` with each
/// new token; stops early at `stop` (not emitted).
pub fn generate<B: Backend>(
    model: &mut Gpt2<B>,
    prompt: &[u32],
    cfg: &SampleConfig,
    stop: Option<u32>,
    mut on_token: impl FnMut(u32),
) -> Result<Vec<u32>> {
    if prompt.is_empty() {
        return Err(Error::Input(
            "the prompt must hold at least one token".into(),
        ));
    }
    let mut rng = Rng::new(cfg.seed);
    let mut tokens = prompt.to_vec();
    let block = model.config.block_size;
    for _ in 0..cfg.max_new_tokens {
        let ctx = &tokens[tokens.len().saturating_sub(block)..];
        model.forward(ctx, None, 1, ctx.len())?;
        let next = sample_token(model.logits(0, ctx.len() - 1), cfg, &mut rng);
        if Some(next) == stop {
            break;
        }
        tokens.push(next);
        on_token(next);
    }
    Ok(tokens)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_and_top1_pick_the_argmax() {
        let logits = [0.1f32, 3.0, -1.0, 2.9];
        let mut rng = Rng::new(0);
        let greedy = SampleConfig {
            max_new_tokens: 1,
            temperature: 0.0,
            top_k: 0,
            seed: 0,
        };
        assert_eq!(sample_token(&logits, &greedy, &mut rng), 1);
        let top1 = SampleConfig {
            temperature: 1.0,
            top_k: 1,
            ..greedy
        };
        for _ in 0..20 {
            assert_eq!(sample_token(&logits, &top1, &mut rng), 1);
        }
        let top2 = SampleConfig {
            temperature: 1.0,
            top_k: 2,
            ..greedy
        };
        let picks: std::collections::BTreeSet<u32> = (0..200)
            .map(|_| sample_token(&logits, &top2, &mut rng))
            .collect();
        assert_eq!(picks, [1, 3].into_iter().collect());
    }
}
