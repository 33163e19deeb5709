//! Masked-language-model pretraining of a BERT from scratch (`distgpt
//! train --task mlm`): windows of a text's character tokens (the embedded
//! Shakespeare by default) with BERT's masking, 15% of the positions
//! predicted, of which 80% shown as `[MASK]` (one id past the characters),
//! 10% as a random character and 10% unchanged; any strategy, on thread ranks or under mpirun, on any device.
//! Reports the masked-token loss on the validation split (its masks fixed
//! by the seed) at the start, every `eval_every` steps and at the end.
//! Writes training-state checkpoints (`checkpoint::state`, as GPT-2 runs
//! do) every `checkpoint_every` steps, at the end and when a signal stops
//! it; resumes from one exactly (each step's masks are drawn from the seed
//! and the step, the loader seeks to the checkpoint's position); the
//! trained model is a Hugging Face folder in the run directory.

use super::schedule::LrSchedule;
use crate::backend::Backend;
use crate::checkpoint::state;
use crate::comm::Comm;
use crate::data::{Batch, DataLoader, Dataset, IGNORE};
use crate::error::{Error, Result};
use crate::metrics;
use crate::model::bert::{hf, BertConfig, BertHead};
use crate::model::{AdamWConfig, ModelConfig};
use crate::parallel::{self, ParallelConfig, StepConfig};
use crate::rng::Rng;
use indicatif::ProgressBar;
use serde::Serialize;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::time::Instant;

/// What `train --task mlm` was asked for.
#[derive(Clone, Debug)]
pub struct MlmConfig {
    /// The encoder's shape (its vocabulary and positions are set here).
    pub model: BertConfig,
    pub steps: usize,
    pub batch_size: usize,
    pub seq_len: usize,
    pub lr: f32,
    pub warmup: usize,
    pub adamw: AdamWConfig,
    pub grad_clip: f32,
    pub eval_every: usize,
    pub eval_batches: usize,
    pub seed: u64,
    pub progress: bool,
    /// The run directory: checkpoints, and the model's folder at the end
    /// (rank 0's, on every rank; a new run's must be absent or empty).
    pub out_dir: PathBuf,
    /// Empty a new run's directory that holds an earlier run.
    pub overwrite: bool,
    /// Steps between checkpoints (0: only at the end and on a stop).
    pub checkpoint_every: usize,
    pub keep_checkpoints: usize,
    /// A checkpoint directory to continue from.
    pub resume: Option<PathBuf>,
}

#[derive(Clone, Debug, Serialize)]
pub struct MlmSummary {
    pub model: String,
    pub layout: String,
    /// The step trained from (0, or the resumed checkpoint's) and to.
    pub start: usize,
    pub steps: usize,
    /// A signal stopped the run (after a checkpoint) before `steps`.
    pub stopped: bool,
    /// (step, validation masked-token loss), the first before any update.
    pub val_losses: Vec<(usize, f32)>,
    pub first_loss: f32,
    pub final_loss: f32,
    pub tokens_per_s: f64,
    pub mfu: f64,
    pub seconds: f64,
}

/// BERT's masking of a batch of token windows: `mask` is the id of
/// `[MASK]`, `vocab` the ids a random replacement is drawn from.
pub fn mask_tokens(tokens: &[u32], mask: u32, vocab: usize, rng: &mut Rng) -> Batch {
    let mut inputs = tokens.to_vec();
    let mut targets = vec![IGNORE; tokens.len()];
    for (i, &tok) in tokens.iter().enumerate() {
        if rng.below(100) >= 15 {
            continue;
        }
        targets[i] = tok;
        inputs[i] = match rng.below(10) {
            0..8 => mask,
            8 => rng.below(vocab) as u32,
            _ => tok,
        };
    }
    Batch {
        inputs,
        targets,
        ..Batch::default()
    }
}

/// One rank's pretraining (collective); rank 0 returns the summary.
/// `peak_flops` is the peak of all ranks together (MFU's denominator).
pub fn mlm_rank<B: Backend + 'static>(
    backend: B,
    ds: &Dataset,
    cfg: &MlmConfig,
    par: ParallelConfig,
    world: &dyn Comm,
    peak_flops: f64,
) -> Result<Option<MlmSummary>> {
    let (b, t) = (cfg.batch_size, cfg.seq_len);
    if cfg.steps == 0 || b == 0 || t == 0 {
        return Err(Error::Config(
            "--steps, --batch-size and --seq-len must be at least 1".into(),
        ));
    }
    let started = Instant::now();
    let chars = ds.tokenizer.vocab_size();
    let model = BertConfig {
        vocab_size: chars + 1,
        block_size: t,
        head: BertHead::Mlm,
        ..cfg.model.clone()
    };
    let family = ModelConfig::from(model.clone());
    let mask = chars as u32;
    let sched = LrSchedule {
        max_lr: cfg.lr,
        min_lr: cfg.lr / 10.0,
        warmup_steps: cfg.warmup,
        total_steps: cfg.steps,
    };
    // The validation batches and their masks are the same at every evaluation.
    let val_batches: Vec<Batch> = {
        let mut loader = DataLoader::new(&ds.val, "val", b, t, cfg.seed, false)?;
        let mut rng = Rng::new(cfg.seed ^ 0x5EED);
        (0..cfg.eval_batches.clamp(1, loader.batches_per_epoch()))
            .map(|_| mask_tokens(&loader.next_batch().inputs, mask, chars, &mut rng))
            .collect()
    };
    let lead = world.rank() == 0;
    let mut s = parallel::build(backend, model.clone(), par, world, cfg.adamw, b, t)?;
    let mut loader = DataLoader::new(&ds.train, "train", b, t, cfg.seed, true)?;
    let start = match &cfg.resume {
        None => {
            s.load_full(&family.init_full(cfg.seed))?;
            0
        }
        Some(dir) => {
            let ckpt = state::load(dir)?;
            let bad = |reason: String| Error::Checkpoint {
                path: dir.clone(),
                reason,
            };
            if ckpt.index.model != family {
                return Err(bad(format!(
                    "holds a {}, not the {family} being trained",
                    ckpt.index.model
                )));
            }
            if ckpt.index.tokenizer != ds.tokenizer.spec() || ckpt.index.data != ds.fingerprint() {
                return Err(bad(format!(
                    "was trained on other data than {}: resume with the run's own --data",
                    ds.name
                )));
            }
            if ckpt.index.step >= cfg.steps {
                return Err(bad(format!(
                    "is at step {}, not before --steps {}",
                    ckpt.index.step, cfg.steps
                )));
            }
            s.load_state(&ckpt.params, &ckpt.m, &ckpt.v, ckpt.index.adam_step)?;
            loader.seek(ckpt.index.loader);
            ckpt.index.step
        }
    };
    let out_dir = super::ready_run_dir(world, &cfg.out_dir, start, cfg.overwrite)?;
    let val = |s: &mut Box<dyn parallel::Strategy>| -> Result<f32> {
        let mut sum = 0.0;
        for vb in &val_batches {
            sum += s.eval_loss(vb)?;
        }
        Ok(sum / val_batches.len() as f32)
    };
    let mut val_losses = vec![(start, val(&mut s)?)];
    let pb = match cfg.progress && lead {
        true => metrics::progress_bar(cfg.steps as u64, "mlm"),
        false => ProgressBar::hidden(),
    };
    pb.set_position(start as u64);
    let mut losses = Vec::with_capacity(cfg.steps - start);
    let t0 = Instant::now();
    let mut stopped = false;
    for step in start..cfg.steps {
        // each step's masks from the seed and the step alone, so a resume draws the same
        let mut rng = Rng::new(cfg.seed ^ (step as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15));
        let batch = mask_tokens(&loader.next_batch().inputs, mask, chars, &mut rng);
        let step_cfg = StepConfig {
            lr: sched.at(step),
            grad_clip: cfg.grad_clip,
        };
        let st = s.step(&[batch], step_cfg)?;
        losses.push(st.loss);
        pb.set_message(format!("masked loss {:.4}", st.loss));
        pb.inc(1);
        // a signal stops every rank after this step, with a checkpoint
        let mut stop = [u32::from(super::INTERRUPTED.load(Ordering::SeqCst))];
        world.all_reduce(&mut stop)?;
        stopped = stop[0] != 0 && step + 1 < cfg.steps;
        let last = step + 1 == cfg.steps || stopped;
        let every = cfg.checkpoint_every;
        if last || (every > 0 && (step + 1).is_multiple_of(every)) {
            let info = state::SaveInfo {
                step: step + 1,
                adam_step: (step + 1) as u32,
                loader: loader.position,
                strategy: &par.strategy.to_string(),
                tp: par.resolved().tp,
                params_total: family.num_params(),
                model: &family,
                tokenizer: &ds.tokenizer.spec(),
                data: ds.fingerprint(),
                keep: cfg.keep_checkpoints,
                extra: None,
            };
            state::save(&out_dir, &info, &s.owned_state()?, world)?;
        }
        if last || (cfg.eval_every > 0 && (step + 1).is_multiple_of(cfg.eval_every)) {
            let v = val(&mut s)?;
            val_losses.push((step + 1, v));
            if lead {
                let msg = format!(
                    "step {}: train masked loss {:.4} | val {v:.4}",
                    step + 1,
                    st.loss
                );
                metrics::say(&pb, &msg);
            }
        }
        if stopped {
            break;
        }
    }
    let seconds = t0.elapsed().as_secs_f64();
    pb.finish_and_clear();
    let full = s.full_params()?;
    if !lead {
        return Ok(None);
    }
    hf::write_folder(&model, &full, None, &out_dir)?;
    let tokens_per_s = (losses.len() * b * t) as f64 / seconds;
    Ok(Some(MlmSummary {
        model: model.to_string(),
        layout: format!("{} x{}", par.strategy, par.world_size),
        start,
        steps: start + losses.len(),
        stopped,
        first_loss: losses[0],
        final_loss: *losses.last().expect("at least one step"),
        val_losses,
        tokens_per_s,
        mfu: metrics::mfu(family.flops_per_token(t), tokens_per_s, peak_flops),
        seconds: started.elapsed().as_secs_f64(),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn masking_predicts_about_15_percent_mostly_behind_mask() {
        let tokens: Vec<u32> = (0..20_000).map(|i| (i % 60) as u32).collect();
        let b = mask_tokens(&tokens, 60, 60, &mut Rng::new(1));
        let picked: Vec<usize> = (0..tokens.len())
            .filter(|&i| b.targets[i] != IGNORE)
            .collect();
        let share = picked.len() as f64 / tokens.len() as f64;
        assert!((0.14..0.16).contains(&share), "{share}");
        let masked = picked.iter().filter(|&&i| b.inputs[i] == 60).count() as f64;
        assert!((0.77..0.83).contains(&(masked / picked.len() as f64)));
        assert!(picked.iter().all(|&i| b.targets[i] == tokens[i]));
        assert!((0..tokens.len()).all(|i| b.targets[i] != IGNORE || b.inputs[i] == tokens[i]));
    }
}
