//! The model families, as one configuration type: what `parallel`,
//! `train`, `plan` and `compare` hold. Adding a family is a folder under
//! `src/model/`, its kernels, and a variant here.

use super::bert::{self, BertConfig, BertHead};
use super::gpt2;
use super::gpt2::config::GptConfig;
use super::layout::ParamLayout;
use super::tp::TpPlace;
use super::unit::UnitModel;
use super::Precision;
use crate::backend::Backend;
use crate::data::{Batch, IGNORE};
use crate::error::{Error, Result};
use crate::rng::Rng;
use serde::{Deserialize, Serialize};

/// The largest model accepted of any family (2^36 parameters, far past
/// GPT-2 XL's 1.6B): a bound on what a crafted `model.json`, `config.json`
/// or checkpoint index can ask to allocate.
pub const MAX_PARAMS: usize = 1 << 36;

/// A model of one of the families. As JSON a GPT-2 is its bare config (as
/// every checkpoint index and run record before BERT has it, so their
/// checksums still hold) and a BERT is `{"bert": {...}}`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(into = "Repr", from = "Repr")]
pub enum ModelConfig {
    Gpt2(GptConfig),
    Bert(BertConfig),
}

/// `ModelConfig` on disk.
#[derive(Clone, Serialize, Deserialize)]
#[serde(untagged)]
enum Repr {
    // first: a GPT-2 config has no "bert" key
    Bert { bert: BertConfig },
    Gpt2(GptConfig),
}

impl From<ModelConfig> for Repr {
    fn from(m: ModelConfig) -> Repr {
        match m {
            ModelConfig::Gpt2(c) => Repr::Gpt2(c),
            ModelConfig::Bert(bert) => Repr::Bert { bert },
        }
    }
}

impl From<Repr> for ModelConfig {
    fn from(r: Repr) -> ModelConfig {
        match r {
            Repr::Gpt2(c) => ModelConfig::Gpt2(c),
            Repr::Bert { bert } => ModelConfig::Bert(bert),
        }
    }
}

impl From<BertConfig> for ModelConfig {
    fn from(c: BertConfig) -> Self {
        ModelConfig::Bert(c)
    }
}

impl From<GptConfig> for ModelConfig {
    fn from(c: GptConfig) -> Self {
        ModelConfig::Gpt2(c)
    }
}

impl std::fmt::Display for ModelConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ModelConfig::Gpt2(c) => c.fmt(f),
            ModelConfig::Bert(c) => c.fmt(f),
        }
    }
}

impl ModelConfig {
    /// A GPT-2 or BERT preset by name.
    pub fn preset(name: &str) -> Result<Self> {
        match BertConfig::preset(name) {
            Some(c) => Ok(c.into()),
            None => GptConfig::preset(name).map(Into::into),
        }
    }

    /// Refuses shapes the family cannot build (checked before a layout is
    /// made from an untrusted file).
    pub fn validate(&self) -> Result<()> {
        match self {
            ModelConfig::Gpt2(c) => c.validate(),
            ModelConfig::Bert(c) => c.validate(),
        }
    }

    /// The family's initialisation of the whole model.
    pub fn init_full(&self, seed: u64) -> Vec<f32> {
        match self {
            ModelConfig::Gpt2(c) => gpt2::init_full(c, seed),
            ModelConfig::Bert(c) => bert::init_full(c, seed),
        }
    }

    /// Training FLOPs per token at sequence length t (the MFU numerator).
    pub fn flops_per_token(&self, t: usize) -> f64 {
        match self {
            ModelConfig::Gpt2(c) => c.flops_per_token(t),
            ModelConfig::Bert(c) => c.flops_per_token(t),
        }
    }

    /// Parameters stored (padded vocabularies included).
    pub fn num_params(&self) -> usize {
        self.layout(1).total()
    }

    /// Positions the model has.
    pub fn block_size(&self) -> usize {
        match self {
            ModelConfig::Gpt2(c) => c.block_size,
            ModelConfig::Bert(c) => c.block_size,
        }
    }

    /// A random batch of b x t of the family's kind (benchmarks): next
    /// tokens; a BERT classifier's labels; a masked LM's targets at 15% of
    /// the positions, the rest ignored.
    pub fn synthetic_batch(&self, rng: &mut Rng, b: usize, t: usize) -> Batch {
        match self {
            ModelConfig::Gpt2(c) => {
                let mut ids = || (0..b * t).map(|_| rng.below(c.vocab_size) as u32).collect();
                Batch::lm(ids(), ids())
            }
            ModelConfig::Bert(c) => {
                let inputs = (0..b * t).map(|_| rng.below(c.vocab_size) as u32).collect();
                let targets = match c.head {
                    BertHead::Classify { labels } => {
                        (0..b).map(|_| rng.below(labels) as u32).collect()
                    }
                    BertHead::Mlm => (0..b * t)
                        .map(|_| match rng.below(100) < 15 {
                            true => rng.below(c.vocab_size) as u32,
                            false => IGNORE,
                        })
                        .collect(),
                };
                Batch {
                    inputs,
                    targets,
                    ..Batch::default()
                }
            }
        }
    }

    /// Training FLOPs per token that tensor parallelism does not split (the
    /// replicated head: GPT-2's tied LM head; BERT's MLM transform and
    /// decoder, or its pooler and classifier, which see one row per sequence).
    pub fn unsplit_flops_per_token(&self, t: usize) -> f64 {
        match self {
            ModelConfig::Gpt2(c) => 6.0 * (c.padded_vocab() * c.n_embd) as f64,
            ModelConfig::Bert(c) => c.head_flops_per_token(t),
        }
    }

    /// Elements of (activations, other scratch) one of `tp` tensor-parallel
    /// ranks allocates for b sequences of t tokens when its engine runs
    /// `units` only (a pipeline stage's; all of them for one stage): the
    /// engine's own allocation, counted (`model::alloc`); its backward split
    /// in two where `split` (`UnitModel::split_backward`; GPT-2 only).
    pub fn stage_activation_elems(
        &self,
        tp: usize,
        (b, t): (usize, usize),
        (units, recompute, split): (std::ops::Range<usize>, bool, bool),
        precision: Precision,
    ) -> (usize, usize) {
        let span = super::Span::of_units(units, self.n_layer());
        match self {
            ModelConfig::Gpt2(c) => {
                gpt2::activation_elems(c, tp, b * t, (&span, recompute, split), precision)
            }
            ModelConfig::Bert(c) => {
                bert::activation_elems(c, tp, (b, t), (&span, recompute), precision)
            }
        }
    }

    /// Transformer blocks.
    pub fn n_layer(&self) -> usize {
        match self {
            ModelConfig::Gpt2(c) => c.n_layer,
            ModelConfig::Bert(c) => c.n_layer,
        }
    }

    /// Width of the residual stream.
    pub fn n_embd(&self) -> usize {
        match self {
            ModelConfig::Gpt2(c) => c.n_embd,
            ModelConfig::Bert(c) => c.n_embd,
        }
    }

    /// Attention heads (tensor parallelism splits them).
    pub fn n_head(&self) -> usize {
        match self {
            ModelConfig::Gpt2(c) => c.n_head,
            ModelConfig::Bert(c) => c.n_head,
        }
    }

    /// Refuses a tensor-parallel size that does not divide the heads (and
    /// a pruned GPT-2's per-block heads and MLP units).
    pub fn check_tp(&self, tp: usize) -> Result<()> {
        match self {
            ModelConfig::Gpt2(c) => c.check_tp(tp),
            ModelConfig::Bert(c) if !c.n_head.is_multiple_of(tp) => Err(Error::Config(format!(
                "n_head ({}) is not divisible by the tensor-parallel size {tp}: choose --tp among the divisors of n_head",
                c.n_head
            ))),
            ModelConfig::Bert(_) => Ok(()),
        }
    }

    /// The family's name, as users know it.
    pub fn family(&self) -> &'static str {
        match self {
            ModelConfig::Gpt2(_) => "GPT-2",
            ModelConfig::Bert(_) => "BERT",
        }
    }

    /// Whether the family's engine splits a backward into its input and
    /// weight halves (`UnitModel::split_backward`, the zb-h1 schedule's need).
    pub fn splits_backward(&self) -> bool {
        match self {
            ModelConfig::Gpt2(_) => true,
            ModelConfig::Bert(_) => false,
        }
    }

    /// The parameter layout of one of `tp` tensor-parallel ranks.
    pub fn layout(&self, tp: usize) -> ParamLayout {
        match self {
            ModelConfig::Gpt2(c) => gpt2::layout::layout(c, tp),
            ModelConfig::Bert(c) => bert::layout::layout(c, tp),
        }
    }

    /// The unit-by-unit engine of tensor-parallel rank `tp`.
    pub fn engine<B: Backend + 'static>(
        &self,
        backend: B,
        tp: TpPlace,
        recompute: bool,
        precision: Precision,
    ) -> Result<Box<dyn UnitModel<B>>> {
        Ok(match self {
            ModelConfig::Gpt2(c) => {
                let mut e = gpt2::Engine::new(backend, c.clone(), tp, recompute)?;
                e.set_precision(precision);
                Box::new(e)
            }
            ModelConfig::Bert(c) => Box::new(bert::Engine::new(
                backend,
                c.clone(),
                tp,
                recompute,
                precision,
            )?),
        })
    }
}
