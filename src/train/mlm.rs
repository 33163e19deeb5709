//! Masked-language-model pretraining of a BERT from scratch (`train
//! --task mlm`): windows of a text's character tokens (the embedded
//! Shakespeare by default) with BERT's masking, 15% of the positions
//! predicted, of which 80% shown as `[MASK]` (one id past the characters),
//! 10% as a random character and 10% unchanged. Each step's masks are
//! drawn from the seed and the step, so a resumed run draws the same; the
//! validation batches' masks are fixed by the seed. The trained model is a
//! Hugging Face `BertForMaskedLM` folder.

use super::lm::val_loader;
use super::task::{mean_loss, Eval, Task, TaskKind, TrainStream};
use super::TrainConfig;
use crate::backend::Backend;
use crate::data::{Batch, DataLoader, Dataset, LoaderPosition, TokenizerSpec, IGNORE};
use crate::error::{Error, Result};
use crate::model::bert::{hf, BertConfig, BertHead, MASKED_PERCENT};
use crate::model::ModelConfig;
use crate::parallel::Strategy;
use crate::rng::Rng;
use std::path::Path;

/// A BERT masked language model on a character dataset.
pub struct MlmTask<'a> {
    pub model: BertConfig,
    pub data: &'a Dataset,
}

impl<'a> MlmTask<'a> {
    /// The encoder of `shape` (its layers and widths) over `data`'s
    /// characters plus `[MASK]`, with `seq_len` positions.
    pub fn new(shape: &BertConfig, data: &'a Dataset, seq_len: usize) -> Self {
        MlmTask {
            model: BertConfig {
                vocab_size: data.tokenizer.vocab_size() + 1,
                block_size: seq_len,
                head: BertHead::Mlm,
                ..shape.clone()
            },
            data,
        }
    }

    /// The id of `[MASK]` and the characters a random replacement is drawn from.
    fn mask(&self) -> (u32, usize) {
        let chars = self.data.tokenizer.vocab_size();
        (chars as u32, chars)
    }
}

/// The training windows, masked per step.
struct Masked<'a> {
    loader: DataLoader<'a>,
    seed: u64,
    mask: (u32, usize),
}

impl TrainStream for Masked<'_> {
    fn batches_per_epoch(&self) -> usize {
        self.loader.batches_per_epoch()
    }
    fn position(&self) -> LoaderPosition {
        self.loader.position
    }
    fn seek(&mut self, position: LoaderPosition) {
        self.loader.seek(position)
    }
    fn next_batch(&mut self, step: usize) -> Batch {
        // each batch's masks from the seed, the step and the batch's place
        // in the epoch alone, so a resume draws the same
        let p = self.loader.position;
        let key = (step as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ (p.batch as u64) << 40;
        let mut rng = Rng::new(self.seed ^ key);
        let (mask, vocab) = self.mask;
        mask_tokens(&self.loader.next_batch().inputs, mask, vocab, &mut rng)
    }
}

impl<B: Backend> Task<B> for MlmTask<'_> {
    fn kind(&self) -> TaskKind {
        TaskKind::Mlm
    }

    fn model(&self) -> ModelConfig {
        self.model.clone().into()
    }

    fn data_name(&self) -> String {
        self.data.name.clone()
    }

    fn data_summary(&self) -> String {
        let ds = self.data;
        format!(
            "{} ({} train / {} val characters, 15% masked)",
            ds.name,
            ds.train.len(),
            ds.val.len()
        )
    }

    fn tokenizer(&self) -> TokenizerSpec {
        self.data.tokenizer.spec()
    }

    fn fingerprint(&self) -> &str {
        self.data.fingerprint()
    }

    /// A fresh initialisation by the seed, or `cfg.init_from`: a Hugging
    /// Face `BertForMaskedLM` folder of this model (continued pretraining).
    fn initial_params(&self, cfg: &TrainConfig, _backend: &B) -> Result<Vec<f32>> {
        let Some(dir) = &cfg.init_from else {
            return Ok(ModelConfig::from(self.model.clone()).init_full(cfg.seed));
        };
        let (model, params) = hf::load_folder(dir, Some(BertHead::Mlm), cfg.seed)?;
        if model != self.model {
            return Err(Error::Config(format!(
                "{} holds a {model}, not the {} being trained",
                dir.display(),
                self.model
            )));
        }
        Ok(params)
    }

    fn train_stream(&self, cfg: &TrainConfig) -> Result<Box<dyn TrainStream + '_>> {
        let (b, t) = (cfg.batch_size, cfg.seq_len);
        Ok(Box::new(Masked {
            loader: DataLoader::new(&self.data.train, "train", b, t, cfg.seed, true)?,
            seed: cfg.seed,
            mask: self.mask(),
        }))
    }

    fn check_eval(&self, cfg: &TrainConfig) -> Result<()> {
        val_loader(self.data, cfg).map(drop)
    }

    fn evaluate(&self, strategy: &mut dyn Strategy, cfg: &TrainConfig) -> Result<Eval> {
        let b = cfg.batch_size;
        let mut val = val_loader(self.data, cfg)?;
        let n = cfg.eval_batches.clamp(1, val.batches_per_epoch());
        // the same batches and masks at every evaluation
        let mut rng = Rng::new(cfg.seed ^ 0x5EED);
        let (mask, vocab) = self.mask();
        let batches = std::iter::from_fn(|| {
            Some(mask_tokens(&val.next_batch().inputs, mask, vocab, &mut rng))
        });
        let loss = mean_loss(batches, n, |b| strategy.eval_loss(b))?;
        Ok(Eval {
            loss,
            examples: n * b,
            ..Eval::default()
        })
    }

    fn save_model(&self, _backend: B, params: &[f32], dir: &Path) -> Result<()> {
        hf::write_folder(&self.model, params, None, dir)
    }

    fn model_files(&self) -> &'static str {
        "a Hugging Face BertForMaskedLM folder: config.json, model.safetensors"
    }
}

/// A masked-LM folder's masked-token loss on `data`'s validation split,
/// on one rank (`cfg`: batch shape, `eval_batches`, and the seed that fixes
/// the masks; a run's own seed gives its own validation figure).
pub fn evaluate_folder<B: Backend + 'static>(
    backend: B,
    dir: &Path,
    data: &Dataset,
    cfg: &TrainConfig,
    threads: usize,
) -> Result<Eval> {
    let (model, params) = hf::load_folder(dir, None, 0)?;
    let chars = data.tokenizer.vocab_size();
    if model.head != BertHead::Mlm || model.vocab_size != chars + 1 {
        return Err(Error::Input(format!(
            "{} is a {model}, not a masked LM over {}'s {chars} characters and [MASK]",
            dir.display(),
            data.name
        )));
    }
    let task = MlmTask { model, data };
    super::evaluate_params(backend, &task, &params, cfg, threads, false)
}

/// BERT's masking of a batch of token windows: `mask` is the id of
/// `[MASK]`, `vocab` the ids a random replacement is drawn from.
pub fn mask_tokens(tokens: &[u32], mask: u32, vocab: usize, rng: &mut Rng) -> Batch {
    let mut inputs = tokens.to_vec();
    let mut targets = vec![IGNORE; tokens.len()];
    for (i, &tok) in tokens.iter().enumerate() {
        if rng.below(100) >= MASKED_PERCENT {
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

#[cfg(test)]
mod tests {
    use super::*;

    /// `count` of `n` draws is within 5 standard deviations of a binomial
    /// with success probability `p` (a false alarm once in ~3.5 million).
    fn binomial(what: &str, count: usize, n: usize, p: f64) {
        let (mean, sd) = (n as f64 * p, (n as f64 * p * (1.0 - p)).sqrt());
        assert!(
            (count as f64 - mean).abs() <= 5.0 * sd,
            "{what}: {count} of {n}, expected {mean:.0} +- {:.0} (5 sd)",
            5.0 * sd
        );
    }

    /// BERT's split, each share within binomial bounds: 15% of the
    /// positions predicted; of those 80% shown as [MASK], 10% as a random
    /// character (which is the original one time in `vocab`), 10% as they
    /// were; the random ones drawn from every character, never [MASK].
    #[test]
    fn masking_picks_15_percent_and_splits_them_80_10_10() {
        let vocab = 60;
        let tokens: Vec<u32> = (0..400_000).map(|i| (i * 7 % vocab) as u32).collect();
        let b = mask_tokens(&tokens, vocab as u32, vocab, &mut Rng::new(1));
        assert!((0..tokens.len()).all(|i| b.targets[i] == IGNORE || b.targets[i] == tokens[i]));
        assert!((0..tokens.len()).all(|i| b.targets[i] != IGNORE || b.inputs[i] == tokens[i]));
        let picked: Vec<usize> = (0..tokens.len())
            .filter(|&i| b.targets[i] != IGNORE)
            .collect();
        let n = picked.len();
        binomial("picked", n, tokens.len(), MASKED_PERCENT as f64 / 100.0);
        let count = |f: &dyn Fn(usize) -> bool| picked.iter().filter(|&&i| f(i)).count();
        let masked = count(&|i| b.inputs[i] == vocab as u32);
        let kept = count(&|i| b.inputs[i] == tokens[i]);
        let random = n - masked - kept;
        let v = vocab as f64;
        binomial("[MASK]", masked, n, 0.8);
        binomial("kept", kept, n, 0.1 + 0.1 / v);
        binomial("random", random, n, 0.1 * (1.0 - 1.0 / v));
        let mut seen = vec![0usize; vocab + 1];
        for &i in &picked {
            if b.inputs[i] != tokens[i] && b.inputs[i] != vocab as u32 {
                seen[b.inputs[i] as usize] += 1;
            }
        }
        assert_eq!(seen[vocab], 0, "a random replacement drew [MASK]");
        assert!(seen[..vocab].iter().all(|&c| c > 0), "{seen:?}");
    }
}
