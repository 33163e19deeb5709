//! GPT-2's generation loop over a batch of prompts with the KV cache, on
//! one rank or tensor-parallel ranks (tp rank 0 samples and broadcasts, so
//! every rank feeds the same tokens), and the teacher-forced evaluation of
//! its decoder.

use super::kv::{DecodeWeights, Decoder};
use crate::backend::{Backend, WeightFormat};
use crate::comm::Comm;
use crate::error::{Error, Result};
use crate::model::family::{
    DecodedEval, DecodedRun, FamilyDecoder, Generation, GenerationTiming, TimedGeneration,
};
use crate::model::{Engine, Gpt2, GptConfig, TpPlace};
use crate::rng::Rng;
use crate::sample::{argmax, sample_token, SampleConfig};
use std::time::Instant;

/// What the lead rank broadcasts for a row that takes no token at this
/// position (a prompt still being read, or a finished row): no vocabulary
/// reaches u32::MAX.
const NO_TOKEN: u32 = u32::MAX;

impl<B: Backend> Gpt2<B> {
    /// This whole model's weights packed for its decoder as `format`.
    fn decode_weights(&self, format: WeightFormat) -> Result<DecodeWeights<'_, B>> {
        DecodeWeights::new(
            self.backend(),
            &self.config,
            TpPlace::NONE,
            self.params.s(),
            format,
        )
    }

    /// A decoder of this whole model for `b` rows of up to `max_t`
    /// positions, on a fresh handle of its backend.
    fn decoder(&self, b: usize, max_t: usize) -> Result<Decoder<B>> {
        Decoder::new(
            self.backend().clone_fresh(),
            self.config.clone(),
            TpPlace::NONE,
            b,
            max_t,
        )
    }
}

/// Continues every prompt by up to `max_new_tokens`, stopping a row at
/// `stop` (not emitted) or when the cache is full; `on_token(row, token)`
/// sees each new token as it is made. Returns the new tokens of each row.
#[allow(clippy::too_many_arguments)]
pub fn decode<B: Backend>(
    decoder: &mut Decoder<B>,
    weights: &DecodeWeights<'_, B>,
    prompts: &[Vec<u32>],
    max_t: usize,
    cfg: &SampleConfig,
    stop: Option<u32>,
    tp: Option<&dyn Comm>,
    mut on_token: impl FnMut(usize, u32),
) -> Result<Vec<Vec<u32>>> {
    cfg.validate()?;
    if let Some(r) = prompts.iter().position(|p| p.is_empty() || p.len() > max_t) {
        return Err(Error::Input(format!(
            "prompt {r} has {} tokens; it needs 1 to {} (the model's block size)",
            prompts[r].len(),
            decoder.config.block_size
        )));
    }
    let n = prompts.len();
    let mut rng = Rng::new(cfg.seed);
    let mut seqs = prompts.to_vec();
    let mut new = vec![Vec::new(); n];
    let mut done: Vec<bool> = vec![cfg.max_new_tokens == 0; n];
    let lead = tp.is_none_or(|g| g.rank() == 0);
    // every prompt's positions before the shortest one's last go through in
    // one pass; the steps start at that last position, where it samples
    let start = match done.iter().all(|&d| d) {
        true => 0,
        false => prompts.iter().map(Vec::len).min().unwrap_or(1) - 1,
    };
    if start > 0 {
        let tokens: Vec<u32> = prompts.iter().flat_map(|p| &p[..start]).copied().collect();
        decoder.prefill(weights, &tokens, start, tp)?;
    }
    for pos in start..max_t {
        if done.iter().all(|&d| d) {
            break;
        }
        let tokens: Vec<u32> = seqs
            .iter()
            .map(|s| s.get(pos).copied().unwrap_or(0))
            .collect();
        // rows still inside their prompt sample nothing: a step where none
        // samples skips the LM head
        let samples: Vec<bool> = (0..n)
            .map(|r| !done[r] && pos + 1 == seqs[r].len())
            .collect();
        decoder.step(weights, &tokens, pos, tp, samples.contains(&true))?;
        let mut next: Vec<u32> = (0..n)
            .map(|r| {
                let sample = lead && samples[r];
                Ok(if sample {
                    sample_token(&decoder.logits(r)?, cfg, &mut rng)
                } else {
                    NO_TOKEN
                })
            })
            .collect::<Result<_>>()?;
        if let Some(g) = tp {
            g.broadcast(&mut next, 0)?;
        }
        for (r, &t) in next.iter().enumerate() {
            if t == NO_TOKEN {
                continue;
            }
            if Some(t) == stop {
                done[r] = true;
                continue;
            }
            seqs[r].push(t);
            new[r].push(t);
            on_token(r, t);
            // a row holding max_t tokens feeds its last and samples once more
            done[r] = new[r].len() >= cfg.max_new_tokens || seqs[r].len() > max_t;
        }
    }
    Ok(new)
}

/// The positions a cache holds for prompts of up to `longest` tokens and
/// `want` new ones: every token fed but the last one sampled, at most the
/// model's `block` (where a row feeds its last position and samples once
/// more: the longest context is the whole block, as nanoGPT's).
fn cache_positions(longest: usize, want: usize, block: usize) -> usize {
    (longest + want.max(1) - 1).min(block).max(1)
}

/// Generation from a whole model on one rank, fp32 weights. A single prompt may run past
/// the block size: when the cache is full, decoding restarts from the last
/// half block of text. A batch stops at the block size.
pub fn generate<B: Backend>(
    model: &Gpt2<B>,
    prompts: &[Vec<u32>],
    cfg: &SampleConfig,
    stop: Option<u32>,
    on_token: impl FnMut(usize, u32) + Send,
) -> Result<Vec<Vec<u32>>> {
    let weights = model.decode_weights(WeightFormat::F32)?;
    generate_packed(model, &weights, prompts, cfg, stop, on_token)
}

/// GPT-2's decoder, from its whole parameters.
impl<B: Backend> FamilyDecoder<B> for GptConfig {
    /// `run`'s prompts continued on `backend`, stored as its format;
    /// **collective** over `run.tp` when it has more than one rank, split
    /// by heads and MLP columns (the whole model is on the host; only this
    /// rank's share goes to `backend`; rank 0 samples, and its `on_token`
    /// sees every token; a batch stops at the block size).
    fn generate(&self, backend: B, run: Generation<'_>) -> Result<Vec<Vec<u32>>> {
        let config = self;
        let Generation {
            params,
            prompts,
            sample: cfg,
            stop,
            format,
            tp,
            on_token,
        } = run;
        let Some(tp) = tp.filter(|g| g.size() > 1) else {
            let model = Gpt2::with_params(backend, config.clone(), params)?;
            let weights = model.decode_weights(format)?;
            return generate_packed(&model, &weights, prompts, cfg, stop, on_token);
        };
        let place = TpPlace {
            rank: tp.rank(),
            size: tp.size(),
        };
        let engine = Engine::new(backend.clone_fresh(), config.clone(), place, false)?;
        let mut part = Gpt2::with_engine(engine)?;
        part.load_full(params)?;
        let longest = prompts.iter().map(Vec::len).max().unwrap_or(0);
        let max_t = cache_positions(longest, cfg.max_new_tokens, config.block_size);
        let weights = DecodeWeights::new(part.backend(), config, place, part.params.s(), format)?;
        let mut dec = Decoder::new(backend, config.clone(), place, prompts.len(), max_t)?;
        decode(
            &mut dec,
            &weights,
            prompts,
            max_t,
            cfg,
            stop,
            Some(tp),
            on_token,
        )
    }

    /// The teacher-forced decoder losses ([`evaluate_decoded`]).
    fn evaluate(&self, backend: B, run: DecodedRun<'_>) -> Result<DecodedEval> {
        let model = Gpt2::with_params(backend, self.clone(), run.params)?;
        evaluate_decoded(&model, run.format, run.batches, run.rows, run.t)
    }

    /// Greedy generation timed: the weights packed once (timed apart),
    /// then each run's seconds, seconds to its first new token and the new
    /// tokens of its shortest row.
    fn time(&self, backend: B, run: TimedGeneration<'_>) -> Result<GenerationTiming> {
        let model = Gpt2::with_params(backend, self.clone(), run.params)?;
        let t0 = Instant::now();
        let weights = model.decode_weights(run.format)?;
        let pack_seconds = t0.elapsed().as_secs_f64();
        let greedy = SampleConfig {
            max_new_tokens: run.new_tokens,
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            seed: 0,
        };
        let runs = (0..run.runs)
            .map(|_| {
                let t0 = Instant::now();
                let mut first = None;
                let out = generate_packed(&model, &weights, run.prompts, &greedy, None, |_, _| {
                    first.get_or_insert_with(|| t0.elapsed().as_secs_f64());
                })?;
                let secs = t0.elapsed().as_secs_f64();
                let fewest = out.iter().map(Vec::len).min().unwrap_or(0);
                Ok((secs, first.unwrap_or(secs), fewest))
            })
            .collect::<Result<_>>()?;
        Ok(GenerationTiming { pack_seconds, runs })
    }
}

/// [`generate`] with the model's weights already packed (to pack once for
/// many generations).
pub fn generate_packed<B: Backend>(
    model: &Gpt2<B>,
    weights: &DecodeWeights<'_, B>,
    prompts: &[Vec<u32>],
    cfg: &SampleConfig,
    stop: Option<u32>,
    mut on_token: impl FnMut(usize, u32) + Send,
) -> Result<Vec<Vec<u32>>> {
    let block = model.config.block_size;
    let mut out = vec![Vec::new(); prompts.len()];
    let mut context = prompts.to_vec();
    let mut seed = cfg.seed;
    loop {
        let longest = context.iter().map(Vec::len).max().unwrap_or(0);
        let want = cfg.max_new_tokens - out[0].len();
        let max_t = cache_positions(longest, want, block);
        let mut dec = model.decoder(context.len(), max_t)?;
        let window = SampleConfig {
            max_new_tokens: want,
            seed,
            ..*cfg
        };
        let new = model.backend().threads().in_pool(|| {
            decode(
                &mut dec,
                weights,
                &context,
                max_t,
                &window,
                stop,
                None,
                &mut on_token,
            )
        })?;
        let full = context[0].len() + new[0].len() > max_t;
        for (o, n) in out.iter_mut().zip(&new) {
            o.extend_from_slice(n);
        }
        if prompts.len() != 1 || !full || out[0].len() >= cfg.max_new_tokens {
            return Ok(out);
        }
        let mut all = context[0].clone();
        all.extend_from_slice(&new[0]);
        // the newest half of the window (at least one token) goes on
        context[0] = all[all.len() - block.div_ceil(2)..].to_vec();
        seed = seed.wrapping_add(1);
    }
}

/// Teacher-forced evaluation through the KV-cache decoder with the weights
/// stored as `format`, beside the fp32 decoder on the same tokens (each
/// batch one prefill that scores every position): the validation loss of
/// both and how often their next-token argmax agree.
/// `batches` yields (inputs, targets) of `rows` x `t` tokens.
pub fn evaluate_decoded<B: Backend>(
    model: &Gpt2<B>,
    format: WeightFormat,
    batches: impl IntoIterator<Item = (Vec<u32>, Vec<u32>)>,
    rows: usize,
    t: usize,
) -> Result<DecodedEval> {
    let pack = |f| model.decode_weights(f);
    let (asked, full) = (pack(format)?, pack(WeightFormat::F32)?);
    let decoder = || model.decoder(rows, t);
    let (mut loss, mut loss_f32, mut agree, mut n) = (0.0f64, 0.0f64, 0usize, 0usize);
    for (inputs, targets) in batches {
        if inputs.len() != rows * t || targets.len() != rows * t {
            return Err(Error::Input(format!(
                "a batch of {} tokens where {rows} x {t} were expected",
                inputs.len()
            )));
        }
        let (mut dq, mut df) = (decoder()?, decoder()?);
        // each (row, position)'s target, named where the model cannot score it
        let target = |r: usize, pos: usize, vocab: usize| {
            let target = targets[r * t + pos] as usize;
            match target < vocab {
                true => Ok(target),
                false => Err(Error::Input(format!(
                    "token {target} is outside the model's vocabulary of {vocab}"
                ))),
            }
        };
        // the asked weights' most likely token at each, for the agreement
        let mut top = vec![0usize; rows * t];
        model.backend().threads().in_pool(|| {
            dq.prefill_logits(&asked, &inputs, t, &mut |r, pos, q| {
                loss += cross_entropy(q, target(r, pos, q.len())?);
                top[r * t + pos] = argmax(q);
                n += 1;
                Ok(())
            })?;
            df.prefill_logits(&full, &inputs, t, &mut |r, pos, f| {
                loss_f32 += cross_entropy(f, target(r, pos, f.len())?);
                agree += usize::from(top[r * t + pos] == argmax(f));
                Ok(())
            })
        })?;
    }
    let per = |x: f64| x / n.max(1) as f64;
    Ok(DecodedEval {
        loss: per(loss),
        loss_f32: per(loss_f32),
        top1_agreement: per(agree as f64),
        tokens: n,
    })
}

/// -log `softmax(logits)[target]`, in f64.
fn cross_entropy(logits: &[f32], target: usize) -> f64 {
    let max = logits.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v)) as f64;
    let sum: f64 = logits.iter().map(|&v| (v as f64 - max).exp()).sum();
    max + sum.ln() - logits[target] as f64
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::Cpu;
    use crate::model::GptConfig;

    fn greedy(max_new_tokens: usize) -> SampleConfig {
        SampleConfig {
            max_new_tokens,
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            seed: 0,
        }
    }

    #[test]
    fn greedy_top1_and_top_p_pick_from_the_right_set() {
        let logits = [0.1f32, 3.0, -1.0, 2.9];
        let mut rng = Rng::new(0);
        assert_eq!(sample_token(&logits, &greedy(1), &mut rng), 1);
        let top1 = SampleConfig {
            temperature: 1.0,
            top_k: 1,
            ..greedy(1)
        };
        assert!((0..20).all(|_| sample_token(&logits, &top1, &mut rng) == 1));
        let top2 = SampleConfig {
            temperature: 1.0,
            top_k: 2,
            ..greedy(1)
        };
        let picks: std::collections::BTreeSet<u32> = (0..200)
            .map(|_| sample_token(&logits, &top2, &mut rng))
            .collect();
        assert_eq!(picks, [1, 3].into_iter().collect());
        // p(1) ~ 0.50, p(3) ~ 0.45: top-p 0.9 keeps both, 0.4 only the first.
        let nucleus = SampleConfig {
            temperature: 1.0,
            top_p: 0.4,
            ..greedy(1)
        };
        assert!((0..50).all(|_| sample_token(&logits, &nucleus, &mut rng) == 1));
    }

    /// A prompt's first positions fed in one prefill leave the caches a
    /// step-by-step feed leaves: the next step's logits agree, for rows in
    /// two parts, across attention's query blocks (64 rows), in every
    /// weight format.
    #[test]
    fn a_prefill_leaves_the_caches_its_steps_would() {
        let mut cfg = GptConfig::preset("tiny").unwrap();
        (cfg.vocab_size, cfg.block_size) = (50, 160);
        let mut model = Gpt2::new(Cpu::new(), cfg.clone()).unwrap();
        model.init_weights(7).unwrap();
        let (b, t) = (3, 150);
        let mut rng = Rng::new(11);
        let tokens: Vec<u32> = (0..b * (t + 1)).map(|_| rng.below(50) as u32).collect();
        let row = |r: usize, p: usize| tokens[r * (t + 1) + p];
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .unwrap();
        for format in [WeightFormat::F32, WeightFormat::Bf16, WeightFormat::Int8] {
            let weights = model.decode_weights(format).unwrap();
            let next = |prefill: bool| {
                pool.install(|| {
                    let mut dec =
                        Decoder::new(Cpu::new(), cfg.clone(), TpPlace::NONE, b, t + 1).unwrap();
                    if prefill {
                        let first: Vec<u32> = (0..b)
                            .flat_map(|r| (0..t).map(move |p| row(r, p)))
                            .collect();
                        dec.prefill(&weights, &first, t, None).unwrap();
                    } else {
                        for p in 0..t {
                            let at: Vec<u32> = (0..b).map(|r| row(r, p)).collect();
                            dec.step(&weights, &at, p, None, false).unwrap();
                        }
                    }
                    let last: Vec<u32> = (0..b).map(|r| row(r, t)).collect();
                    dec.step(&weights, &last, t, None, true).unwrap();
                    (0..b).map(|r| dec.logits(r).unwrap()).collect::<Vec<_>>()
                })
            };
            let (stepped, prefilled) = (next(false), next(true));
            for (r, (want, got)) in stepped.iter().zip(&prefilled).enumerate() {
                let worst = want
                    .iter()
                    .zip(got)
                    .map(|(w, g)| (w - g).abs() / w.abs().max(1.0))
                    .fold(0.0f32, f32::max);
                assert!(worst < 1e-5, "{format:?} row {r}: logits differ by {worst}");
            }
        }
        let mut dec = Decoder::new(Cpu::new(), cfg.clone(), TpPlace::NONE, b, 8).unwrap();
        let weights = model.decode_weights(WeightFormat::F32).unwrap();
        for (tokens, t, said) in [
            (
                vec![1; 3 * 9],
                9,
                "positions 0..9 of 3 rows takes 27 tokens, got 27 (the cache holds 8",
            ),
            (
                vec![1; 5],
                2,
                "positions 0..2 of 3 rows takes 6 tokens, got 5",
            ),
            (vec![], 0, "positions 0..0 of 3 rows"),
            (
                vec![50; 6],
                2,
                "token id 50 is outside the vocabulary of 50",
            ),
        ] {
            let err = dec
                .prefill(&weights, &tokens, t, None)
                .unwrap_err()
                .to_string();
            assert!(err.contains(said), "{err}");
        }
    }

    /// A row feeds its last position and samples once more: a prompt one
    /// short of the block gets two new tokens, the second drawn from the
    /// whole block as the full forward (and nanoGPT) draws it, in a batch
    /// and alone. A batch stopped a token short; one prompt slid its window
    /// there and drew it from the last half block.
    #[test]
    fn the_last_new_token_is_drawn_from_the_whole_block() {
        let mut cfg = GptConfig::preset("tiny").unwrap();
        cfg.vocab_size = 50;
        let block = cfg.block_size;
        let mut model = Gpt2::new(Cpu::new(), cfg).unwrap();
        model.init_weights(3).unwrap();
        let prompt: Vec<u32> = (0..block - 1).map(|i| (i * 7 % 50) as u32).collect();
        let mut seq = prompt.clone();
        for _ in 0..2 {
            model.forward(&seq, None, 1, seq.len()).unwrap();
            seq.push(argmax(&model.logits(0, seq.len() - 1).unwrap()) as u32);
        }
        let want = &seq[block - 1..];
        for (prompts, asked) in [(vec![prompt.clone(); 2], 3), (vec![prompt.clone()], 2)] {
            let got = generate(&model, &prompts, &greedy(asked), None, |_, _| {}).unwrap();
            for g in got {
                assert_eq!(g, want, "{} prompt(s)", prompts.len());
            }
        }
    }

    #[test]
    fn kv_cache_decoding_matches_full_forward_greedy_continuation() {
        let mut cfg = GptConfig::preset("tiny").unwrap();
        cfg.vocab_size = 50;
        let mut model = Gpt2::new(Cpu::new(), cfg).unwrap();
        model.init_weights(3).unwrap();
        // the second set has steps where no row samples (the LM head
        // skipped) and steps where one row samples inside the other's prompt
        for prompts in [
            vec![vec![1, 2, 3], vec![7]],
            vec![vec![1, 2, 3, 4], vec![7, 9]],
        ] {
            let got = generate(&model, &prompts, &greedy(12), None, |_, _| {}).unwrap();
            for (p, g) in prompts.iter().zip(&got) {
                // Reference: re-run the whole model on the growing sequence.
                let mut seq = p.clone();
                for _ in 0..12 {
                    model.forward(&seq, None, 1, seq.len()).unwrap();
                    let logits = model.logits(0, seq.len() - 1).unwrap();
                    let mut rng = Rng::new(0);
                    seq.push(sample_token(&logits, &greedy(1), &mut rng));
                }
                assert_eq!(&seq[p.len()..], g.as_slice(), "prompts {prompts:?}");
            }
        }
    }
}
