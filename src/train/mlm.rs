//! Masked-language-model pretraining of a BERT (`train --task mlm`):
//! windows of a text's tokens with BERT's masking, 15% of the positions
//! predicted (at least one in every batch), of which 80% shown as `[MASK]`,
//! 10% as a random token and 10% unchanged. The tokens are WordPiece's
//! where the run has a vocabulary: continued pretraining of a BERT folder
//! (`--init-from`: all-MiniLM-L6-v2, bert-base, an earlier run) on its
//! own, or shards prepared with a learned one (`data prepare --tokenizer
//! wordpiece`); a plain text without either trains on its characters, with
//! `[MASK]` one id past them and the characters recorded in every
//! checkpoint. Each step's masks are drawn from the seed and the step, so a
//! resumed run draws the same; the validation batches' masks are fixed by
//! the seed. The trained model is a Hugging Face `BertForMaskedLM` folder,
//! with the WordPiece vocabulary and tokenizer files where there is one
//! (in every checkpoint too), so it feeds `--task classify --init-from`.

use super::lm::val_loader;
use super::task::{mean_loss, Eval, Task, TaskKind, TrainStream};
use super::TrainConfig;
use crate::backend::Backend;
use crate::data::{Batch, DataLoader, Dataset, LoaderPosition, Tokenizer, TokenizerSpec, IGNORE};
use crate::error::{Error, Result};
use crate::model::bert::{hf, BertConfig, BertHead, MASKED_PERCENT};
use crate::model::ModelConfig;
use crate::parallel::Strategy;
use crate::rng::Rng;
use std::path::Path;

/// A BERT masked language model on a dataset's tokens.
pub struct MlmTask<'a> {
    pub model: BertConfig,
    pub data: &'a Dataset,
}

impl<'a> MlmTask<'a> {
    /// The encoder of `shape` (its layers and widths) over `data`'s
    /// vocabulary (characters get `[MASK]` one past them), with `seq_len`
    /// positions.
    pub fn new(shape: &BertConfig, data: &'a Dataset, seq_len: usize) -> Self {
        MlmTask {
            model: BertConfig {
                vocab_size: mlm_vocab(&data.tokenizer),
                block_size: seq_len,
                head: BertHead::Mlm,
                ..shape.clone()
            },
            data,
        }
    }

    /// The id of `[MASK]` and the ids a random replacement is drawn from
    /// (every token, as transformers draws them; every character).
    fn mask(&self) -> (u32, usize) {
        match &self.data.tokenizer {
            Tokenizer::WordPiece(wp) => (wp.mask, wp.vocab_size()),
            t => (t.vocab_size() as u32, t.vocab_size()),
        }
    }
}

/// A masked LM's vocabulary over tokenizer `t`: WordPiece's own (it has
/// `[MASK]`), or the characters and `[MASK]` after them.
pub fn mlm_vocab(t: &Tokenizer) -> usize {
    match t {
        Tokenizer::WordPiece(wp) => wp.vocab_size(),
        t => t.vocab_size() + 1,
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
        let what = match ds.tokenizer {
            Tokenizer::WordPiece(_) => "WordPiece tokens",
            _ => "characters",
        };
        format!(
            "{} ({} train / {} val {what}, 15% masked)",
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
        let (model, params) =
            super::classify::pretrained_weights(dir, BertHead::Mlm, cfg.seed, "mlm")?;
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

    fn vocab(&self) -> Option<String> {
        match &self.data.tokenizer {
            Tokenizer::WordPiece(wp) => Some(wp.vocab_text()),
            _ => None,
        }
    }

    fn save_model(&self, _backend: B, params: &[f32], dir: &Path) -> Result<()> {
        let vocab = Task::<B>::vocab(self);
        hf::write_folder(&self.model, params, vocab.as_deref(), dir)
    }

    fn model_files(&self) -> &'static str {
        match self.data.tokenizer {
            Tokenizer::WordPiece(_) => {
                "a Hugging Face BertForMaskedLM folder: config.json, model.safetensors, vocab.txt and the tokenizer's files"
            }
            _ => "a Hugging Face BertForMaskedLM folder: config.json, model.safetensors (characters: no vocab.txt)",
        }
    }
}

/// The tokenizer a masked LM in `dir` (a run, a checkpoint, a Hugging Face
/// folder) was trained with, as recorded: the WordPiece vocabulary kept
/// beside it, or a character vocabulary its run's checkpoints record. A
/// folder without either is refused: its vocabulary is unknown.
pub fn recorded_tokenizer(dir: &Path) -> Result<Tokenizer> {
    let recorded = crate::checkpoint::read_any_meta(dir)?.tokenizer;
    if let TokenizerSpec::WordPiece { checksum, .. } = &recorded {
        if !checksum.is_empty() {
            return Tokenizer::from_spec_in(&recorded, &crate::checkpoint::model_dir(dir));
        }
    }
    // model files without their vocabulary: a run's checkpoints record it
    match crate::checkpoint::state::latest(dir) {
        Ok(ckpt) => {
            let spec = crate::checkpoint::state::read_index(&ckpt)?.tokenizer;
            Tokenizer::from_spec_in(&spec, &ckpt)
        }
        Err(_) => Err(Error::Input(format!(
            "{} has no vocab.txt and no checkpoint that records its vocabulary: a \
             masked LM trained on characters is evaluated through its run directory",
            dir.display()
        ))),
    }
}

/// A masked LM's masked-token loss on `data`'s validation split, on one
/// rank. `dir`: a run, a checkpoint or a Hugging Face `BertForMaskedLM`
/// folder; where it records its tokenizer, `data` must have been tokenized
/// with it (`eval` reads the data with [`recorded_tokenizer`]). `cfg`: batch
/// shape, `eval_batches`, and the seed that fixes the masks (a run's own
/// seed gives its own validation figure).
pub fn evaluate_folder<B: Backend + 'static>(
    backend: B,
    dir: &Path,
    data: &Dataset,
    cfg: &TrainConfig,
    threads: usize,
) -> Result<Eval> {
    let (meta, params) = crate::checkpoint::read_model(dir)?;
    let vocab = mlm_vocab(&data.tokenizer);
    let model = match meta.config.get::<BertConfig>() {
        Some(m) if m.head == BertHead::Mlm && m.vocab_size == vocab => m.clone(),
        _ => {
            return Err(Error::Input(format!(
                "{} is a {}, not a masked LM over {}'s {} ({vocab} ids with [MASK])",
                dir.display(),
                meta.config,
                data.name,
                crate::data::describe(&data.tokenizer.spec()),
            )))
        }
    };
    if let Ok(recorded) = recorded_tokenizer(dir) {
        if recorded.spec() != data.tokenizer.spec() {
            return Err(Error::Input(format!(
                "{} was trained on {}, but {} is tokenized with {}",
                dir.display(),
                crate::data::describe(&recorded.spec()),
                data.name,
                crate::data::describe(&data.tokenizer.spec())
            )));
        }
    }
    let task = MlmTask { model, data };
    super::evaluate_params(backend, &task, &params, cfg, threads, false)
}

/// BERT's masking of a batch of token windows: `mask` is the id of
/// `[MASK]`, `vocab` the ids a random replacement is drawn from.
pub fn mask_tokens(tokens: &[u32], mask: u32, vocab: usize, rng: &mut Rng) -> Batch {
    let mut inputs = tokens.to_vec();
    let mut targets = vec![IGNORE; tokens.len()];
    let mut pick = |i: usize, rng: &mut Rng| {
        let tok = tokens[i];
        targets[i] = tok;
        inputs[i] = match rng.below(10) {
            0..8 => mask,
            8 => rng.below(vocab) as u32,
            _ => tok,
        };
    };
    let mut picked = 0;
    for i in 0..tokens.len() {
        if rng.below(100) < MASKED_PERCENT {
            pick(i, rng);
            picked += 1;
        }
    }
    // a batch with nothing to predict would have no loss (0 / 0): one
    // position, drawn like the rest, is predicted
    if picked == 0 && !tokens.is_empty() {
        let i = rng.below(tokens.len());
        pick(i, rng);
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

    /// A batch too short to be sure of a masked position still has one
    /// (else its loss is 0 / 0), drawn like the rest; longer batches are
    /// masked as before.
    #[test]
    fn every_batch_has_a_position_to_predict() {
        let mut shown = [0usize; 3];
        for seed in 0..3000 {
            let tokens = [3u32, 1, 4, 1];
            let b = mask_tokens(&tokens, 60, 60, &mut Rng::new(seed));
            let picked: Vec<usize> = (0..4).filter(|&i| b.targets[i] != IGNORE).collect();
            assert!(!picked.is_empty(), "seed {seed}: nothing to predict");
            for i in picked {
                assert_eq!(b.targets[i], tokens[i]);
                shown[match b.inputs[i] {
                    60 => 0,
                    x if x == tokens[i] => 1,
                    _ => 2,
                }] += 1;
            }
        }
        // the extra positions are shown as the others are, 80/10/10
        let n = shown.iter().sum();
        binomial("[MASK]", shown[0], n, 0.8);
        binomial("kept", shown[1], n, 0.1 + 0.1 / 60.0);
    }
}
