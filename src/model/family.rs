//! The model families, as one configuration type: what `parallel`,
//! `train`, `plan` and `compare` hold. Adding a family is a folder under
//! `src/model/`, its kernels, and a variant here.

use super::bert::{self, BertConfig};
use super::config::GptConfig;
use super::gpt2;
use super::layout::{ParamLayout, TpPlace};
use super::unit::UnitModel;
use super::Precision;
use crate::backend::Backend;
use crate::error::{Error, Result};

/// A model of one of the families.
#[derive(Clone, Debug, PartialEq)]
pub enum ModelConfig {
    Gpt2(GptConfig),
    Bert(BertConfig),
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

impl ModelConfig {
    /// Attention heads (tensor parallelism splits them).
    pub fn n_head(&self) -> usize {
        match self {
            ModelConfig::Gpt2(c) => c.n_head,
            ModelConfig::Bert(c) => c.n_head,
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
            ModelConfig::Bert(c) => {
                if precision != Precision::Fp32 {
                    return Err(Error::Config(
                        "--precision bf16 is GPT-2's only for now: train BERT in fp32".into(),
                    ));
                }
                Box::new(bert::Engine::new(backend, c.clone(), tp, recompute)?)
            }
        })
    }
}
