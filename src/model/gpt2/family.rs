//! GPT-2 as a registered family: its config's answers to what the rest of
//! distgpt asks of a model, and its registration.

use super::config::{GptConfig, PRESETS};
use super::layout::WTE;
use super::{activation_elems, init_full, layout, Engine};
use crate::backend::Backend;
use crate::data::Batch;
use crate::error::Result;
use crate::model::family::{
    Family, FamilyDecoder, FamilyDims, FamilyEngine, HfFolder, Registration, Reshape, Scope,
    DISTGPT_FILES,
};
use crate::model::gpt2::rows::{select_rows, shrink};
use crate::model::layout::TensorSpec;
use crate::model::ModelConfig;
use crate::model::{ParamLayout, Precision, SpanRun, TpPlace, UnitModel};
use crate::rng::Rng;

/// GPT-2, written bare in JSON (as every file before families has it).
pub static FAMILY: Registration = Registration {
    name: "GPT-2",
    key: None,
    causal: true,
    presets: || PRESETS.iter().map(|p| p.0).collect(),
    preset: |name| GptConfig::preset(name).ok().map(Into::into),
    from_json: |json| {
        serde_json::from_value::<GptConfig>(json)
            .map(Into::into)
            .map_err(|e| e.to_string())
    },
    model_files: Some(DISTGPT_FILES),
    hf: Some(HfFolder {
        model_type: "gpt2",
        export: |meta, params, _, dir| {
            let config = meta.config.gpt2().expect("a GPT-2 config");
            super::hf::export_params(config, params, &meta.tokenizer, dir)
        },
        dropout: &["embd_pdrop", "resid_pdrop", "attn_pdrop"],
        import: super::hf::import,
    }),
};

impl Family for GptConfig {
    fn registration(&self) -> &'static Registration {
        &FAMILY
    }
    fn to_json(&self) -> serde_json::Value {
        serde_json::to_value(self).expect("a GPT-2 config is JSON")
    }
    fn validate(&self) -> Result<()> {
        GptConfig::validate(self)
    }
    fn init_full(&self, seed: u64) -> Vec<f32> {
        init_full(self, seed)
    }
    fn flops_per_token(&self, t: usize) -> f64 {
        GptConfig::flops_per_token(self, t)
    }
    fn unsplit_flops_per_token(&self, _t: usize) -> f64 {
        // the tied LM head
        6.0 * (self.padded_vocab() * self.n_embd) as f64
    }
    fn recomputed_unsplit_share(&self, rows: usize) -> f64 {
        // every chunk of logits but the last, which the forward keeps
        let chunk = super::logits_rows(rows, self.padded_vocab(), true, super::LOGITS_CHUNK);
        let n = rows.div_ceil(chunk) as f64;
        (n - 1.0) / n
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
        GptConfig::check_tp(self, tp)
    }
    fn splits_backward(&self) -> bool {
        true
    }
    fn layout(&self, tp: usize) -> ParamLayout {
        layout::layout(self, tp)
    }
    fn synthetic_batch(&self, rng: &mut Rng, b: usize, t: usize) -> Batch {
        let mut ids = || {
            (0..b * t)
                .map(|_| rng.below(self.vocab_size) as u32)
                .collect()
        };
        Batch::lm(ids(), ids())
    }
    fn activation_elems(&self, tp: usize, b: usize, t: usize, run: &SpanRun) -> usize {
        activation_elems(self, tp, b * t, run)
    }
    /// The word embeddings without their padding rows.
    fn file_shape(&self, t: &TensorSpec) -> Vec<usize> {
        match t.name == WTE {
            true => vec![self.vocab_size, self.n_embd],
            false => t.shape.clone(),
        }
    }
    /// The blocks' weight matrices (embeddings, norms and biases stay fp32).
    fn block_matrix(&self, t: &TensorSpec) -> bool {
        t.shape.len() == 2 && t.name.contains(".h.")
    }
    fn prune_rows(
        &self,
        params: &[f32],
        sparsity: f64,
        scope: Scope,
    ) -> Option<(ModelConfig, Vec<f32>)> {
        let kept = select_rows(self, params, sparsity, scope);
        let (small, params) = shrink(self, params, &kept);
        Some((small.into(), params))
    }
    fn reshaped(&self, r: &Reshape) -> Option<Result<ModelConfig>> {
        let mut g = self.clone();
        g.n_layer = r.n_layer.unwrap_or(g.n_layer);
        g.n_head = r.n_head.unwrap_or(g.n_head);
        g.n_embd = r.n_embd.unwrap_or(g.n_embd);
        g.block_size = r.block_size.unwrap_or(g.block_size);
        g.vocab_size = r.vocab_size.unwrap_or(g.vocab_size);
        // a pruned model's blocks keep their widths, the cut ones go
        g.blocks.truncate(g.n_layer);
        Some(g.validate_shape().map(|()| g.into()))
    }
    fn gpt2(&self) -> Option<&GptConfig> {
        Some(self)
    }
}

impl FamilyEngine for GptConfig {
    fn engine<B: Backend>(
        &self,
        backend: B,
        tp: TpPlace,
        recompute: bool,
        precision: Precision,
    ) -> Result<Box<dyn UnitModel<B>>> {
        let mut e = Engine::new(backend, self.clone(), tp, recompute)?;
        e.set_precision(precision);
        Ok(Box::new(e))
    }
    fn decoder<B: Backend>(&self) -> Option<&dyn FamilyDecoder<B>> {
        Some(self)
    }
}
