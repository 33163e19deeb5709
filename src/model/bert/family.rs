//! BERT as a registered family: its config's answers to what the rest of
//! distgpt asks of a model, and its registration.

use super::config::{BertConfig, BertHead, MASKED_PERCENT, PRESETS};
use super::{activation_elems, init_full, layout, Engine};
use crate::backend::Backend;
use crate::data::wordpiece::{Normalizer, WordPiece};
use crate::data::{Batch, TokenizerSpec, IGNORE};
use crate::error::Result;
use crate::model::family::{
    Family, FamilyDims, FamilyEngine, HfFolder, ModelFiles, Registration, Reshape,
};
use crate::model::files::ModelMeta;
use crate::model::{ModelConfig, ParamLayout, Precision, SpanRun, TpPlace, UnitModel};
use crate::rng::Rng;

/// BERT, written as `{"bert": {...}}` in JSON.
pub static FAMILY: Registration = Registration {
    name: "BERT",
    key: Some("bert"),
    causal: false,
    presets: || PRESETS.to_vec(),
    preset: |name| BertConfig::preset(name).map(Into::into),
    from_json: |json| {
        serde_json::from_value::<BertConfig>(json)
            .map(Into::into)
            .map_err(|e| e.to_string())
    },
    // a Hugging Face folder: config.json, model.safetensors (and vocab.txt)
    model_files: Some(ModelFiles {
        what: "a Hugging Face folder: config.json, model.safetensors",
        write: write_folder,
        read: |dir| Ok(super::hf::load_folder(dir, None, 0)?.0.into()),
    }),
    hf: Some(HfFolder {
        model_type: "bert",
        export: write_folder,
        dropout: &[
            "hidden_dropout_prob",
            "attention_probs_dropout_prob",
            "classifier_dropout",
        ],
        import: |dir| {
            let (config, params) = super::hf::load_folder(dir, None, 0)?;
            let tokenizer = match dir.join("vocab.txt").exists() {
                true => super::hf::read_vocab(dir)?.spec(),
                // a folder without its vocabulary: only its size is known
                false => TokenizerSpec::WordPiece {
                    tokens: config.vocab_size,
                    checksum: String::new(),
                    normalizer: Normalizer::of_folder(dir)?,
                },
            };
            let meta = ModelMeta {
                config: config.into(),
                tokenizer,
                labels: super::hf::label_names(dir)?,
            };
            Ok((meta, params))
        },
    }),
};

/// Writes a BERT as a Hugging Face folder (with its `vocab.txt` where
/// given, which must be the vocabulary `meta` records).
fn write_folder(
    meta: &ModelMeta,
    params: &[f32],
    vocab: Option<&std::path::Path>,
    dir: &std::path::Path,
) -> Result<()> {
    let config = meta.config.bert().expect("a BERT config");
    let vocab = vocab
        .map(|v| WordPiece::recorded_at(v, &meta.tokenizer))
        .transpose()?;
    super::hf::write_folder(config, params, vocab.as_ref(), &meta.labels, dir)
}

impl Family for BertConfig {
    fn registration(&self) -> &'static Registration {
        &FAMILY
    }
    fn to_json(&self) -> serde_json::Value {
        serde_json::to_value(self).expect("a BERT config is JSON")
    }
    fn validate(&self) -> Result<()> {
        BertConfig::validate(self)
    }
    fn init_full(&self, seed: u64) -> Vec<f32> {
        init_full(self, seed)
    }
    fn flops_per_token(&self, t: usize) -> f64 {
        BertConfig::flops_per_token(self, t)
    }
    fn unsplit_flops_per_token(&self, t: usize) -> f64 {
        self.head_flops_per_token(t)
    }
    fn last_block_one_row_reduces(&self, recompute: bool) -> usize {
        match self.head {
            BertHead::Classify { .. } => 3 + 2 * usize::from(recompute),
            BertHead::Mlm | BertHead::Pretrain => 0,
        }
    }
    fn dims(&self) -> FamilyDims {
        FamilyDims {
            block_size: self.block_size,
            n_layer: self.n_layer,
            n_embd: self.n_embd,
            n_head: self.n_head,
            vocab_size: self.vocab_size,
        }
    }
    fn check_tp(&self, tp: usize) -> Result<()> {
        crate::model::tp::check_heads(self.n_head, tp)
    }
    fn layout(&self, tp: usize) -> ParamLayout {
        layout::layout(self, tp)
    }
    /// Token ids; a classifier's labels, or a masked LM's targets at 15% of
    /// the positions, the rest ignored (and pretraining's next-sentence
    /// labels beside them).
    fn synthetic_batch(&self, rng: &mut Rng, b: usize, t: usize) -> Batch {
        let inputs = (0..b * t)
            .map(|_| rng.below(self.vocab_size) as u32)
            .collect();
        let targets = match self.head {
            BertHead::Classify { labels } => (0..b).map(|_| rng.below(labels) as u32).collect(),
            BertHead::Mlm | BertHead::Pretrain => (0..b * t)
                .map(|_| match rng.below(100) < MASKED_PERCENT {
                    true => rng.below(self.vocab_size) as u32,
                    false => IGNORE,
                })
                .collect(),
        };
        let seq_targets = match self.head {
            BertHead::Pretrain => (0..b).map(|_| rng.below(2) as u32).collect(),
            _ => Vec::new(),
        };
        Batch {
            inputs,
            targets,
            seq_targets,
            ..Batch::default()
        }
    }
    fn activation_elems(&self, tp: usize, b: usize, t: usize, run: &SpanRun) -> usize {
        activation_elems(self, tp, b, t, run)
    }
    fn reshaped(&self, r: &Reshape) -> Option<Result<ModelConfig>> {
        let mut b = self.clone();
        b.n_layer = r.n_layer.unwrap_or(b.n_layer);
        b.n_head = r.n_head.unwrap_or(b.n_head);
        if let Some(e) = r.n_embd {
            (b.n_embd, b.n_inner) = (e, 4 * e);
        }
        b.block_size = r.block_size.unwrap_or(b.block_size);
        b.vocab_size = r.vocab_size.unwrap_or(b.vocab_size);
        Some(b.validate_shape().map(|()| b.into()))
    }
    fn bert(&self) -> Option<&BertConfig> {
        Some(self)
    }
}

impl FamilyEngine for BertConfig {
    fn engine<B: Backend>(
        &self,
        backend: B,
        tp: TpPlace,
        recompute: bool,
        precision: Precision,
    ) -> Result<Box<dyn UnitModel<B>>> {
        let engine = Engine::new(backend, self.clone(), tp, recompute, precision)?;
        Ok(Box::new(engine))
    }
}
