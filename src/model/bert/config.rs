//! BERT configurations: the encoder's shape and which head sits on it.

use crate::error::{Error, Result};
use serde::{Deserialize, Serialize};

/// The percentage of tokens BERT's masking picks as masked-LM targets
/// (`train::mlm::mask_tokens`, the synthetic batches).
pub const MASKED_PERCENT: usize = 15;

/// What the encoder is trained for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BertHead {
    /// `BertForMaskedLM`: the transform (dense, GELU, LayerNorm) and the
    /// decoder tied to the word embeddings, loss on the masked tokens.
    Mlm,
    /// `BertForSequenceClassification`: the pooler (dense + tanh on the
    /// first token) and a linear classifier, one label per sequence.
    Classify { labels: usize },
    /// `BertForPreTraining`: the masked-LM head and, on the pooler, the
    /// two-way next-sentence head (`cls.seq_relationship`); the loss is
    /// the masked-token mean plus the next-sentence mean.
    Pretrain,
}

impl BertHead {
    /// Whether the masked-LM head (tied to the word embeddings) is on.
    pub fn has_mlm(self) -> bool {
        matches!(self, BertHead::Mlm | BertHead::Pretrain)
    }

    /// The labels of the pooler's classifier, where there is one.
    pub fn pooled_labels(self) -> Option<usize> {
        match self {
            BertHead::Mlm => None,
            BertHead::Classify { labels } => Some(labels),
            BertHead::Pretrain => Some(2),
        }
    }

    /// Hugging Face's class for a model with this head.
    pub fn architecture(self) -> &'static str {
        match self {
            BertHead::Mlm => "BertForMaskedLM",
            BertHead::Classify { .. } => "BertForSequenceClassification",
            BertHead::Pretrain => "BertForPreTraining",
        }
    }
}

/// Shape of a BERT encoder (Hugging Face `BertConfig`'s fields). The word
/// embedding is padded to [`BertConfig::padded_vocab`] rows.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct BertConfig {
    pub n_layer: usize,
    pub n_head: usize,
    /// hidden_size.
    pub n_embd: usize,
    /// intermediate_size.
    pub n_inner: usize,
    /// max_position_embeddings.
    pub block_size: usize,
    pub type_vocab: usize,
    pub vocab_size: usize,
    pub layer_norm_eps: f32,
    pub head: BertHead,
}

impl std::fmt::Display for BertConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "BERT {} layers x {} heads x {} wide (MLP {}), {} positions, vocabulary {}, ",
            self.n_layer, self.n_head, self.n_embd, self.n_inner, self.block_size, self.vocab_size
        )?;
        match self.head {
            BertHead::Mlm => write!(f, "masked-LM head"),
            BertHead::Classify { labels } => write!(f, "{labels}-way classifier"),
            BertHead::Pretrain => write!(f, "masked-LM and next-sentence heads"),
        }
    }
}

/// BERT shapes by name (classifier heads have 2 labels).
pub const PRESETS: [&str; 6] = [
    "bert-minilm",        // all-MiniLM-L6-v2's encoder (6 x 384), a 2-way classifier, 22.7M
    "bert-minilm-mlm",    // the same encoder with the masked-LM head
    "bert-base",          // BERT-base (12 x 768), a 2-way classifier, 109M
    "bert-base-mlm",      // BERT-base with the masked-LM head
    "bert-base-pretrain", // BERT-base with the masked-LM and next-sentence heads
    "bert-tiny",          // 2 x 128, a 2-way classifier, for tests
];

impl BertConfig {
    /// A named shape (see [`PRESETS`]), or `None` for a name that is not BERT's.
    pub fn preset(name: &str) -> Option<Self> {
        let classify = BertHead::Classify { labels: 2 };
        let base = BertConfig {
            n_layer: 12,
            n_head: 12,
            n_embd: 768,
            n_inner: 3072,
            ..Self::mini_lm(classify)
        };
        Some(match name {
            "bert-minilm" => Self::mini_lm(classify),
            "bert-minilm-mlm" => Self::mini_lm(BertHead::Mlm),
            "bert-base" => base,
            "bert-base-mlm" => BertConfig {
                head: BertHead::Mlm,
                ..base.clone()
            },
            "bert-base-pretrain" => BertConfig {
                head: BertHead::Pretrain,
                ..base
            },
            "bert-tiny" => BertConfig {
                n_layer: 2,
                n_head: 2,
                n_embd: 128,
                n_inner: 512,
                ..Self::mini_lm(classify)
            },
            _ => return None,
        })
    }

    /// Training FLOPs per token at sequence length t: 6 per matmul weight
    /// (blocks, the head's dense layers, the MLM decoder tied to the word
    /// embeddings; embedding lookups excluded) plus attention's 12 * L * T * C,
    /// as `GptConfig::flops_per_token` counts. A classifier's last block runs
    /// its attention output and feed-forward products on one row per
    /// sequence, as its loss reads no other: those count once per sequence.
    pub fn flops_per_token(&self, t: usize) -> f64 {
        let (c, f) = (self.n_embd as f64, self.n_inner as f64);
        let block = 4.0 * c * c + 2.0 * c * f;
        let unread = match self.head {
            BertHead::Mlm | BertHead::Pretrain => 0.0,
            BertHead::Classify { .. } => (c * c + 2.0 * c * f) * (1.0 - 1.0 / t as f64),
        };
        6.0 * (self.n_layer as f64 * block - unread)
            + self.head_flops_per_token(t)
            + 12.0 * (self.n_layer * t * self.n_embd) as f64
    }

    /// The head's share of `flops_per_token`. The masked-LM head runs on
    /// the rows with a target alone: [`MASKED_PERCENT`] of them on average.
    pub fn head_flops_per_token(&self, t: usize) -> f64 {
        let c = self.n_embd as f64;
        let mlm = match self.head.has_mlm() {
            true => (c * c + c * self.padded_vocab() as f64) * MASKED_PERCENT as f64 / 100.0,
            false => 0.0,
        };
        // the pooler and classifier see one row per sequence
        let pooled = self
            .head
            .pooled_labels()
            .map_or(0.0, |labels| (c * c + c * labels as f64) / t as f64);
        6.0 * (mlm + pooled)
    }

    /// all-MiniLM-L6-v2's encoder (6 layers, 384 wide, 12 heads) with `head`.
    pub fn mini_lm(head: BertHead) -> Self {
        BertConfig {
            n_layer: 6,
            n_head: 12,
            n_embd: 384,
            n_inner: 1536,
            block_size: 512,
            type_vocab: 2,
            vocab_size: 30522,
            layer_norm_eps: 1e-12,
            head,
        }
    }

    /// Vocabulary rounded up to a multiple of 64 (the word embedding's rows).
    pub fn padded_vocab(&self) -> usize {
        self.vocab_size.div_ceil(64) * 64
    }

    /// Classes the head's per-token or per-sequence targets range over:
    /// the vocabulary (a masked LM's, pretraining's) or the labels.
    pub fn classes(&self) -> usize {
        match self.head {
            BertHead::Mlm | BertHead::Pretrain => self.vocab_size,
            BertHead::Classify { labels } => labels,
        }
    }

    /// Refuses shapes the kernels cannot run, and models past
    /// [`MAX_PARAMS`](crate::model::family::MAX_PARAMS).
    pub fn validate(&self) -> Result<()> {
        self.validate_shape()?;
        match super::layout::layout_len(self) {
            Some(n) if n <= crate::model::family::MAX_PARAMS => Ok(()),
            _ => Err(Error::Config(format!(
                "{self} is more than {} parameters",
                crate::model::family::MAX_PARAMS
            ))),
        }
    }

    /// Refuses shapes the kernels cannot run, of any size whose count of
    /// parameters fits a `usize`: what `plan` prices (it allocates nothing).
    pub fn validate_shape(&self) -> Result<()> {
        let c = self;
        let dims = [
            c.n_layer,
            c.n_head,
            c.n_embd,
            c.n_inner,
            c.block_size,
            c.type_vocab,
            c.vocab_size,
            c.classes(),
        ];
        if dims.contains(&0) {
            return Err(Error::Config(format!(
                "every model dimension must be positive, got {c}"
            )));
        }
        if !c.n_embd.is_multiple_of(c.n_head) {
            return Err(Error::Config(format!(
                "hidden size ({}) must be divisible by the heads ({})",
                c.n_embd, c.n_head
            )));
        }
        if !(c.layer_norm_eps > 0.0 && c.layer_norm_eps.is_finite()) {
            return Err(Error::Config(format!(
                "layer_norm_eps {} must be positive",
                c.layer_norm_eps
            )));
        }
        match super::layout::layout_len(c) {
            Some(_) => Ok(()),
            None => Err(Error::Config(format!(
                "{c} has more parameters than can be counted"
            ))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each preset carries the head its name says: `-mlm` the masked LM's,
    /// `-pretrain` BERT's pretraining heads, the rest a 2-way classifier.
    #[test]
    fn every_preset_has_the_head_its_name_says() {
        for name in PRESETS {
            let want = match name {
                n if n.ends_with("-mlm") => BertHead::Mlm,
                n if n.ends_with("-pretrain") => BertHead::Pretrain,
                _ => BertHead::Classify { labels: 2 },
            };
            assert_eq!(BertConfig::preset(name).unwrap().head, want, "{name}");
        }
    }
}
