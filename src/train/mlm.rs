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
//!
//! BERT's full pretraining (`train --task pretrain`, `BertForPreTraining`)
//! adds next-sentence prediction on WordPiece tokens: each window is cut
//! at a drawn token into `[CLS] A [SEP] B [SEP]`, B the tokens that follow
//! A or, half the time, as many from a drawn place of the split; the loss
//! is the masked-token mean plus the next-sentence mean, and evaluation
//! reports the next-sentence accuracy beside it.

use super::classify::{predicted, Scores};
use super::lm::val_loader;
use super::task::{mean_loss, Eval, Task, TaskKind, TrainStream};
use super::TrainConfig;
use crate::backend::Backend;
use crate::data::{
    Batch, DataLoader, Dataset, LoaderPosition, Split, Tokenizer, TokenizerSpec, IGNORE,
};
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
    /// vocabulary (characters get `[MASK]` one past them), with `positions`
    /// positions (a run's sequence length, or more).
    pub fn new(shape: &BertConfig, data: &'a Dataset, positions: usize) -> Self {
        MlmTask {
            model: BertConfig {
                vocab_size: mlm_vocab(&data.tokenizer),
                block_size: positions,
                head: BertHead::Mlm,
                ..shape.clone()
            },
            data,
        }
    }

    /// The same with BERT's pretraining heads (masked LM and next-sentence
    /// prediction, `BertForPreTraining`): `data` must be WordPiece tokens.
    pub fn pretraining(self) -> Result<Self> {
        if !matches!(self.data.tokenizer, Tokenizer::WordPiece(_)) {
            return Err(Error::Config(format!(
                "--task pretrain makes sentence pairs as [CLS] A [SEP] B [SEP]: {} is {}, with \
                 no [CLS] or [SEP]; prepare WordPiece shards (`data prepare --tokenizer wordpiece`) \
                 or give --init-from a BERT folder",
                self.data.name,
                crate::data::describe(&self.data.tokenizer.spec())
            )));
        }
        Ok(MlmTask {
            model: BertConfig {
                head: BertHead::Pretrain,
                ..self.model
            },
            data: self.data,
        })
    }

    /// The id of `[MASK]` and the ids a random replacement is drawn from
    /// (every token, as transformers draws them; every character).
    fn mask(&self) -> MaskIds {
        match &self.data.tokenizer {
            Tokenizer::WordPiece(wp) => MaskIds {
                mask: wp.mask,
                vocab: wp.vocab_size(),
            },
            t => MaskIds {
                mask: t.vocab_size() as u32,
                vocab: t.vocab_size(),
            },
        }
    }

    /// Pretraining's sentence pairs, their unrelated segments drawn from
    /// `split` (None for a masked LM alone).
    fn pairs<'s>(&self, split: &'s Split) -> Option<Pairs<'s>> {
        match (&self.data.tokenizer, self.model.head) {
            (Tokenizer::WordPiece(wp), BertHead::Pretrain) => Some(Pairs {
                split,
                cls: wp.cls,
                sep: wp.sep,
            }),
            _ => None,
        }
    }
}

/// The task that trains a BERT with `head` from text: BERT's pretraining
/// for its pretraining heads, a masked LM's otherwise.
pub fn task_of(head: BertHead) -> TaskKind {
    match head {
        BertHead::Pretrain => TaskKind::Pretrain,
        _ => TaskKind::Mlm,
    }
}

/// The shortest sequence a sentence pair fits in.
const PAIR_SEQ_LEN: usize = 5;

/// Refuses a sequence length a model with `head` cannot be trained or
/// evaluated at: pretraining's sentence pairs need `PAIR_SEQ_LEN`.
pub fn check_seq_len(head: BertHead, seq: usize) -> Result<()> {
    if head == BertHead::Pretrain && seq < PAIR_SEQ_LEN {
        return Err(Error::Config(format!(
            "--seq-len {seq}: BERT's pretraining needs at least {PAIR_SEQ_LEN} positions ([CLS] A [SEP] B [SEP], each segment a token or more)"
        )));
    }
    Ok(())
}

/// A masked LM's vocabulary over tokenizer `t`: WordPiece's own (it has
/// `[MASK]`), or the characters and `[MASK]` after them.
pub fn mlm_vocab(t: &Tokenizer) -> usize {
    match t {
        Tokenizer::WordPiece(wp) => wp.vocab_size(),
        t => t.vocab_size() + 1,
    }
}

/// What pretraining's sentence pairs are made of: the split an unrelated
/// second segment is drawn from, and the ids of `[CLS]` and `[SEP]`.
#[derive(Clone, Copy)]
struct Pairs<'a> {
    split: &'a Split,
    cls: u32,
    sep: u32,
}

impl Pairs<'_> {
    /// Each window of t tokens as `[CLS] A [SEP] B [SEP]` (token types 0
    /// up to A's `[SEP]`, 1 after): A its first k tokens (k drawn from 1 to
    /// t - 4), B the t - 3 - k tokens that follow A (next-sentence label 0)
    /// or, half the time, as many from a place drawn in the split (label 1).
    /// Segments end at a drawn token, not at a sentence's end: the stream
    /// keeps no sentence boundaries. Inputs, token types and labels.
    fn cut(&self, windows: &[u32], t: usize, rng: &mut Rng) -> (Vec<u32>, Vec<u32>, Vec<u32>) {
        let body = t - 3;
        let (mut inputs, mut types, mut labels) = (Vec::new(), Vec::new(), Vec::new());
        for w in windows.chunks(t) {
            let k = 1 + rng.below(body - 1);
            let (second, label) = match rng.below(2) {
                0 => (w[k..body].to_vec(), 0),
                _ => {
                    let other = self.split.random_run(body - k, rng);
                    (other.expect("the split holds a window of t + 1 tokens"), 1)
                }
            };
            inputs.push(self.cls);
            inputs.extend_from_slice(&w[..k]);
            inputs.push(self.sep);
            inputs.extend(second);
            inputs.push(self.sep);
            types.extend(std::iter::repeat_n(0, k + 2));
            types.extend(std::iter::repeat_n(1, body - k + 1));
            labels.push(label);
        }
        (inputs, types, labels)
    }
}

/// The examples a batch of windows of `t` tokens makes, drawn with `rng`:
/// BERT's masking of every token, or for pretraining the windows cut into
/// sentence pairs first and every token but `[CLS]` and `[SEP]` masked.
fn examples(
    windows: &[u32],
    t: usize,
    mask: MaskIds,
    pairs: Option<Pairs<'_>>,
    rng: &mut Rng,
) -> Batch {
    let Some(p) = pairs else {
        return mask_tokens(windows, &[], mask, rng);
    };
    let (inputs, types, labels) = p.cut(windows, t, rng);
    Batch {
        types,
        seq_targets: labels,
        ..mask_tokens(&inputs, &[p.cls, p.sep], mask, rng)
    }
}

/// The training windows, made into examples per step.
struct Masked<'a> {
    loader: DataLoader<'a>,
    seed: u64,
    mask: MaskIds,
    pairs: Option<Pairs<'a>>,
    t: usize,
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
        let windows = self.loader.next_batch().inputs;
        examples(&windows, self.t, self.mask, self.pairs, &mut rng)
    }
}

impl<B: Backend> Task<B> for MlmTask<'_> {
    fn kind(&self) -> TaskKind {
        task_of(self.model.head)
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
            Tokenizer::Gpt2(_) => "GPT-2 BPE tokens",
            Tokenizer::Char { .. } => "characters",
        };
        let pairs = match self.model.head {
            BertHead::Pretrain => "; sentence pairs, half of them unrelated",
            _ => "",
        };
        format!(
            "{} ({} train / {} val {what}, 15% masked{pairs})",
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
        let task = Task::<B>::kind(self).to_string();
        let (model, params) =
            super::classify::pretrained_weights(dir, self.model.head, cfg.seed, &task)?;
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
            pairs: self.pairs(&self.data.train),
            t,
        }))
    }

    fn check_eval(&self, cfg: &TrainConfig) -> Result<()> {
        check_seq_len(self.model.head, cfg.seq_len)?;
        val_loader(self.data, cfg).map(drop)
    }

    /// The masked-token loss on fixed validation batches; pretraining's
    /// loss (masked-LM plus next-sentence) and next-sentence accuracy.
    fn evaluate(&self, strategy: &mut dyn Strategy, cfg: &TrainConfig) -> Result<Eval> {
        let (b, t) = (cfg.batch_size, cfg.seq_len);
        let mut val = val_loader(self.data, cfg)?;
        let n = cfg.eval_batches.clamp(1, val.batches_per_epoch());
        // the same batches, masks and pairs at every evaluation
        let mut rng = Rng::new(cfg.seed ^ 0x5EED);
        let (mask, pairs) = (self.mask(), self.pairs(&self.data.val));
        let batches = std::iter::from_fn(|| {
            let windows = val.next_batch().inputs;
            Some(examples(&windows, t, mask, pairs, &mut rng))
        });
        if pairs.is_none() {
            let loss = mean_loss(batches, n, |b| strategy.eval_loss(b))?;
            return Ok(Eval {
                loss,
                examples: n * b,
                ..Eval::default()
            });
        }
        // the next-sentence head's predictions, scored as a classifier's
        let mut pairs = Vec::with_capacity(n * b);
        let loss = mean_loss(batches, n, |batch| {
            let (loss, logits) = strategy.eval_outputs(batch)?;
            pairs.extend(predicted(&logits, &batch.seq_targets, 2));
            Ok(loss)
        })?;
        let s = Scores::of(&pairs, 2, loss);
        Ok(Eval {
            loss,
            accuracy: Some(s.accuracy),
            f1: Some(s.f1),
            examples: n * b,
        })
    }

    fn vocab(&self) -> Option<String> {
        match &self.data.tokenizer {
            Tokenizer::WordPiece(wp) => Some(wp.vocab_text()),
            _ => None,
        }
    }

    fn save_model(&self, _backend: B, params: &[f32], dir: &Path) -> Result<()> {
        let vocab = match &self.data.tokenizer {
            Tokenizer::WordPiece(wp) => Some(wp.as_ref()),
            _ => None,
        };
        hf::write_folder(&self.model, params, vocab, &[], dir)
    }

    fn model_files(&self) -> &'static str {
        match (&self.data.tokenizer, self.model.head) {
            (Tokenizer::WordPiece(_), BertHead::Pretrain) => {
                "a Hugging Face BertForPreTraining folder: config.json, model.safetensors, vocab.txt and the tokenizer's files"
            }
            (Tokenizer::WordPiece(_), _) => {
                "a Hugging Face BertForMaskedLM folder: config.json, model.safetensors, vocab.txt and the tokenizer's files"
            }
            (Tokenizer::Gpt2(_), _) => "a Hugging Face BertForMaskedLM folder: config.json, model.safetensors (GPT-2 BPE ids: no vocab.txt)",
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
    super::classify::untrained(dir, None)?;
    let (meta, params) = crate::checkpoint::read_model(dir)?;
    let vocab = mlm_vocab(&data.tokenizer);
    let model = match meta.config.bert() {
        Some(m) if m.head.has_mlm() && m.vocab_size == vocab => m.clone(),
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
            let [then, now] = crate::data::describe_apart(&recorded.spec(), &data.tokenizer.spec());
            return Err(Error::Input(format!(
                "{} was trained on {then}, but {} is tokenized with {now}",
                dir.display(),
                data.name,
            )));
        }
    }
    let task = MlmTask { model, data };
    super::evaluate_params(backend, &task, &params, cfg, threads, false)
}

/// What masking a token writes: the id of `[MASK]`, and how many ids a
/// random replacement is drawn from.
#[derive(Clone, Copy, Debug)]
pub struct MaskIds {
    pub mask: u32,
    pub vocab: usize,
}

/// BERT's masking of a batch of token windows with `ids`; tokens in
/// `fixed` (`[CLS]`, `[SEP]`) are never picked.
pub fn mask_tokens(tokens: &[u32], fixed: &[u32], ids: MaskIds, rng: &mut Rng) -> Batch {
    let MaskIds { mask, vocab } = ids;
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
    let open: Vec<usize> = (0..tokens.len())
        .filter(|&i| !fixed.contains(&tokens[i]))
        .collect();
    let mut picked = 0;
    for &i in &open {
        if rng.below(100) < MASKED_PERCENT {
            pick(i, rng);
            picked += 1;
        }
    }
    // a batch with nothing to predict would have no loss (0 / 0): one
    // position, drawn like the rest, is predicted
    if picked == 0 && !open.is_empty() {
        let i = open[rng.below(open.len())];
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

    /// No token of the validation split reaches a training batch, on each
    /// task that trains on text (a language model's windows, a masked LM's,
    /// pretraining's sentence pairs, whose unrelated halves are drawn from
    /// a split) and each way a split is made (a text's last tenth, and
    /// shards named by their split). The text's training part is made of
    /// words the validation part never uses, so a token is its split's.
    #[test]
    fn no_validation_token_reaches_a_training_batch_or_pair() {
        use crate::backend::cpu::Cpu;
        use crate::data::wordpiece::{WordPiece, SPECIAL};
        let (train_words, val_words) = (["to", "be", "or", "not"], ["is", "question"]);
        let vocab = || {
            let tokens = SPECIAL.iter().chain(&train_words).chain(&val_words);
            WordPiece::new(tokens.map(|t| t.to_string()).collect()).unwrap()
        };
        let wp = vocab();
        let val_ids: Vec<u32> = val_words.iter().map(|w| wp.encode(w)[0]).collect();
        // 900 tokens, then 100: the validation split is the last tenth
        let text = "to be or not ".repeat(225) + &"is question ".repeat(50);
        let dir = crate::testdir::TestDir::new("no-val-in-train");
        let (file, shards) = (dir.path().join("text.txt"), dir.path().join("shards"));
        std::fs::write(&file, text).unwrap();
        let tokenizer = || Tokenizer::WordPiece(Box::new(vocab()));
        let from_text = Dataset::load_with(Some(&file), tokenizer()).unwrap();
        crate::data::write_shards(&from_text, &shards).unwrap();
        let from_shards = Dataset::load_with(Some(&shards), tokenizer()).unwrap();
        let cfg = TrainConfig {
            batch_size: 4,
            seq_len: 8,
            ..TrainConfig::default()
        };
        let shape = BertConfig::preset("bert-tiny").unwrap();
        for ds in [&from_text, &from_shards] {
            assert_eq!((ds.train.len(), ds.val.len()), (900, 100));
            let lm = super::super::lm::LmTask {
                model: crate::model::GptConfig::preset("tiny").unwrap().into(),
                data: ds,
            };
            let mlm = MlmTask::new(&shape, ds, cfg.seq_len);
            let pretrain = MlmTask::new(&shape, ds, cfg.seq_len).pretraining().unwrap();
            let tasks: [&dyn Task<Cpu>; 3] = [&lm, &mlm, &pretrain];
            for task in tasks {
                let mut stream = task.train_stream(&cfg).unwrap();
                // two epochs: every window, and some 200 pairs, half of
                // them with a drawn second segment
                for step in 0..2 * stream.batches_per_epoch() {
                    let b = stream.next_batch(step);
                    let seen: Vec<u32> = match task.kind() {
                        // a window's tokens and the tokens that follow them
                        TaskKind::Lm => b.inputs.iter().chain(&b.targets).copied().collect(),
                        // a masked position's token is its target (its
                        // input may be [MASK] or any token of the vocabulary)
                        _ => (b.inputs.iter().zip(&b.targets))
                            .map(|(&x, &y)| if y == IGNORE { x } else { y })
                            .collect(),
                    };
                    for x in seen {
                        assert!(
                            !val_ids.contains(&x),
                            "{}: validation token {x} ({}) in step {step}'s batch",
                            task.kind(),
                            wp.decode(&[x])
                        );
                    }
                }
            }
        }
    }

    /// A pretraining folder evaluated at fewer positions than a sentence
    /// pair takes is refused in words (it once panicked on an overflow).
    #[test]
    fn a_pretraining_folder_is_not_evaluated_at_fewer_positions_than_a_pair() {
        let tokens = [
            "[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "to", "be", "or", "not",
        ];
        let wp = crate::data::wordpiece::WordPiece::new(tokens.map(String::from).to_vec()).unwrap();
        let dir = crate::testdir::TestDir::new("pretrain-seq");
        let model = dir.path().join("model");
        hf::write_tiny(&wp, BertHead::Pretrain, &model);
        let text = dir.path().join("text.txt");
        std::fs::write(&text, "to be or not to be ".repeat(40)).unwrap();
        let ds = Dataset::load_with(Some(&text), Tokenizer::WordPiece(Box::new(wp))).unwrap();
        for t in 1..=5 {
            let train = TrainConfig {
                batch_size: 2,
                seq_len: t,
                eval_batches: 1,
                ..TrainConfig::default()
            };
            let e = evaluate_folder(crate::backend::cpu::Cpu::new(), &model, &ds, &train, 1);
            match t {
                5 => assert!(e.is_ok(), "{t}: {:?}", e.err().map(|e| e.to_string())),
                _ => {
                    let err = e.expect_err("refused").to_string();
                    assert!(
                        err.contains(&format!("--seq-len {t}")) && err.contains("at least 5"),
                        "{err}"
                    );
                }
            }
        }
    }

    /// A masked LM on GPT-2 BPE shards is described by what its tokens
    /// are, never as characters (its folder has no vocabulary a BERT reads).
    #[test]
    fn a_masked_lm_on_gpt2_tokens_is_not_described_as_characters() {
        let dir = crate::testdir::TestDir::new("mlm-gpt2-words");
        let text = dir.path().join("text.txt");
        std::fs::write(&text, "to be or not to be ".repeat(40)).unwrap();
        let gpt2 = Tokenizer::from_spec(&TokenizerSpec::Gpt2).unwrap();
        let ds = Dataset::load_with(Some(&text), gpt2).unwrap();
        let task = MlmTask::new(&BertConfig::preset("bert-tiny").unwrap(), &ds, 16);
        let summary = <MlmTask as Task<crate::backend::cpu::Cpu>>::data_summary(&task);
        let files = <MlmTask as Task<crate::backend::cpu::Cpu>>::model_files(&task);
        for said in [summary.as_str(), files] {
            assert!(!said.contains("character"), "{said}");
            assert!(said.contains("GPT-2 BPE"), "{said}");
        }
    }

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
        let ids = MaskIds {
            mask: vocab as u32,
            vocab,
        };
        let b = mask_tokens(&tokens, &[], ids, &mut Rng::new(1));
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

    /// Pretraining's pairs: `[CLS] A [SEP] B [SEP]` with token types 0
    /// then 1 and no padding; label 0 where B is the window's next tokens,
    /// 1 where B is a run of the split from elsewhere (drawn: not the
    /// continuation), half each; the cut drawn over every place; `[CLS]`
    /// and `[SEP]` never masked, every other position as before.
    #[test]
    fn pairs_are_cls_a_sep_b_sep_half_of_them_continuations() {
        let (cls, sep, t) = (9000u32, 9001u32, 12usize);
        // a split of distinct tokens, so that where B came from is plain
        let split = Split {
            parts: vec![crate::data::Part::Memory((0..5000).collect())],
        };
        let p = Pairs {
            split: &split,
            cls,
            sep,
        };
        let mut rng = Rng::new(3);
        let (b, mut labels, mut cuts) = (2000, [0usize; 2], vec![0usize; t]);
        let windows: Vec<u32> = (0..b as u32)
            .flat_map(|i| (0..t as u32).map(move |j| i * 2 + j))
            .collect();
        let (inputs, types, nsp) = p.cut(&windows, t, &mut rng);
        assert_eq!((inputs.len(), types.len(), nsp.len()), (b * t, b * t, b));
        for (i, ((x, ty), &label)) in inputs.chunks(t).zip(types.chunks(t)).zip(&nsp).enumerate() {
            let w = &windows[i * t..(i + 1) * t];
            let seps: Vec<usize> = (0..t).filter(|&j| x[j] == sep).collect();
            assert_eq!((x[0], seps.len(), seps[1]), (cls, 2, t - 1), "{x:?}");
            let k = seps[0] - 1;
            cuts[k] += 1;
            assert_eq!(&x[1..=k], &w[..k], "A is the window's start");
            assert!(ty[..=k + 1].iter().all(|&y| y == 0) && ty[k + 2..].iter().all(|&y| y == 1));
            let second = &x[k + 2..t - 1];
            assert!(
                second.windows(2).all(|p| p[1] == p[0] + 1),
                "B is a run: {second:?}"
            );
            match label {
                0 => assert_eq!(second, &w[k..t - 3], "label 0: B follows A"),
                _ => assert_ne!(second[0], w[k], "label 1: B drawn elsewhere"),
            }
            labels[label as usize] += 1;
        }
        binomial("continuations", labels[0], b, 0.5);
        // every cut from 1 to t - 4 tokens of A is drawn
        assert!(
            cuts[1..t - 3].iter().all(|&c| c > 0) && cuts[0] == 0,
            "{cuts:?}"
        );
        let ids = MaskIds {
            mask: 9002,
            vocab: 5000,
        };
        let masked = mask_tokens(&inputs, &[cls, sep], ids, &mut rng);
        for (j, &x) in inputs.iter().enumerate() {
            if x == cls || x == sep {
                assert_eq!((masked.targets[j], masked.inputs[j]), (IGNORE, x));
            }
        }
        let open = inputs.iter().filter(|&&x| x != cls && x != sep).count();
        binomial("picked", masked.loss_terms().targets as usize, open, 0.15);
    }

    /// A batch too short to be sure of a masked position still has one
    /// (else its loss is 0 / 0), drawn like the rest; longer batches are
    /// masked as before.
    #[test]
    fn every_batch_has_a_position_to_predict() {
        let mut shown = [0usize; 3];
        for seed in 0..3000 {
            let tokens = [3u32, 1, 4, 1];
            let ids = MaskIds {
                mask: 60,
                vocab: 60,
            };
            let b = mask_tokens(&tokens, &[], ids, &mut Rng::new(seed));
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
