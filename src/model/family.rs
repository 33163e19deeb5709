//! Model families as data. A family is a config type implementing
//! [`Family`] (its shape, layout, initialisation, costs and synthetic
//! batches) and [`FamilyEngine`] (its unit-by-unit engine and, when it
//! decodes, its [`FamilyDecoder`]), with a [`Registration`] (its name, JSON
//! key, whether it is causal, presets, model files and Hugging Face
//! folder): all in its own folder, listed once here (`BUILTIN`) or
//! registered at run time ([`register`]). `parallel`, `plan`, `compare` and
//! the run driver hold a [`ModelConfig`] and ask it, naming no family;
//! BERT's tasks (`train::mlm`, `train::classify`) take its config from
//! [`Family::bert`] and the `lm` task any causal family (ARCHITECTURE.md
//! says where).

use super::bert::{self, BertConfig};
use super::files::{read_hf_config, ModelMeta};
use super::gpt2::{self, config::GptConfig};
use super::layout::{ParamLayout, TensorSpec};
use super::tp::TpPlace;
use super::unit::{SpanRun, UnitModel, Whole};
use super::Precision;
use crate::backend::cpu::Cpu;
use crate::backend::kind::{Each, Listed, Make, PerBackend};
use crate::backend::{Backend, WeightFormat};
use crate::data::Batch;
use crate::error::{Error, Result};
use crate::rng::Rng;
use crate::sample::SampleConfig;
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::fmt;
use std::path::Path;
use std::sync::{Arc, RwLock};

/// The largest model accepted of any family (2^36 parameters, far past
/// GPT-2 XL's 1.6B): a bound on what a crafted `model.json`, `config.json`
/// or checkpoint index can ask to allocate.
pub const MAX_PARAMS: usize = 1 << 36;

/// The families built in, each registered in its own folder.
const BUILTIN: [&Registration; 2] = [&gpt2::family::FAMILY, &bert::family::FAMILY];

/// Families registered at run time, after the built-in ones.
static REGISTERED: RwLock<Vec<&'static Registration>> = RwLock::new(Vec::new());

/// What every family's model has: positions, blocks (the units between the
/// embeddings and the head), the residual stream's width, attention heads
/// (tensor parallelism splits them).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FamilyDims {
    pub block_size: usize,
    pub n_layer: usize,
    pub n_embd: usize,
    pub n_head: usize,
    pub vocab_size: usize,
}

/// Changes to a model's shape (`--n-layer`, `--n-head`, `--n-embd`,
/// `--block-size` and the data's vocabulary), each left as it is where
/// None.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Reshape {
    pub n_layer: Option<usize>,
    pub n_head: Option<usize>,
    pub n_embd: Option<usize>,
    pub block_size: Option<usize>,
    pub vocab_size: Option<usize>,
}

/// Where a pruning sparsity applies (`prune --scope`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Scope {
    /// Each weight matrix (rows: each block) loses the same fraction.
    Matrix,
    /// One threshold over all the blocks' weight matrices (rows: heads and
    /// MLP units) together.
    Global,
}

/// A model family's configuration: what the rest of distgpt asks of a model.
pub trait Family: fmt::Debug + fmt::Display + Send + Sync + 'static {
    /// The family this config belongs to.
    fn registration(&self) -> &'static Registration;
    /// This config as JSON (read back by [`Registration::from_json`]).
    fn to_json(&self) -> serde_json::Value;
    /// Refuses shapes the family cannot build (checked before a layout is
    /// made from an untrusted file).
    fn validate(&self) -> Result<()>;
    /// The family's initialisation of the whole model.
    fn init_full(&self, seed: u64) -> Vec<f32>;
    /// Training FLOPs per token at sequence length t (the MFU numerator).
    fn flops_per_token(&self, t: usize) -> f64;
    /// Training FLOPs per token that tensor parallelism does not split (the
    /// replicated head: GPT-2's tied LM head; BERT's MLM transform and
    /// decoder, or its pooler and classifier, which see one row per sequence).
    fn unsplit_flops_per_token(&self, t: usize) -> f64;
    /// The share of those FLOPs' forward that a recomputing engine runs
    /// again in the backward, for `rows` tokens a micro-batch (GPT-2's
    /// head beyond its first chunk of logits).
    fn recomputed_unsplit_share(&self, _rows: usize) -> f64 {
        0.0
    }
    /// Of a tensor-parallel block's all-reduces of its (rows, C) stream
    /// (two forward, two backward, two more when the forward is
    /// recomputed), how many the last block makes on one row a sequence
    /// instead of every row (BERT's classifier's: all but its query, key
    /// and value's input gradient).
    fn last_block_one_row_reduces(&self, _recompute: bool) -> usize {
        0
    }
    /// Its positions, blocks, width and heads.
    fn dims(&self) -> FamilyDims;
    /// Refuses a tensor-parallel size the family cannot split by.
    fn check_tp(&self, tp: usize) -> Result<()>;
    /// Whether the engine splits a backward into its input and weight
    /// halves (`StageModel::split_backward`, the zb-h1 schedule's need).
    fn splits_backward(&self) -> bool {
        false
    }
    /// The parameter layout of one of `tp` tensor-parallel ranks.
    fn layout(&self, tp: usize) -> ParamLayout;
    /// A random batch of b x t of the family's kind (benchmarks): next
    /// tokens; a BERT classifier's labels; a masked LM's targets at 15% of
    /// the positions, the rest ignored.
    fn synthetic_batch(&self, rng: &mut Rng, b: usize, t: usize) -> Batch;
    /// 4-byte words of the activations one of `tp` ranks allocates
    /// for micro-batches of b sequences of t tokens when its engine
    /// runs as `run` says (a pipeline stage's units, all of them for one
    /// stage; its micro-batches in flight; its precision): the engine's
    /// own allocation, counted (`model::alloc`).
    fn activation_elems(&self, tp: usize, b: usize, t: usize, run: &SpanRun) -> usize;
    /// The shape tensor `t` of its layout is stored with in model files
    /// (its trailing rows may be padding the files leave out).
    fn file_shape(&self, t: &TensorSpec) -> Vec<usize> {
        t.shape.clone()
    }
    /// Whether tensor `t` is one of the blocks' weight matrices: what
    /// `quantize` stores in int8 (per output column) and `prune` prunes.
    fn block_matrix(&self, _t: &TensorSpec) -> bool {
        false
    }
    /// The model that keeps the rows (attention heads, MLP units) of its
    /// blocks' matrices a `sparsity` fraction of row pruning keeps, and its
    /// parameters; None for a family whose blocks cannot lose rows.
    fn prune_rows(
        &self,
        _params: &[f32],
        _sparsity: f64,
        _scope: Scope,
    ) -> Option<(ModelConfig, Vec<f32>)> {
        None
    }
    /// The same model with `r`'s changes, its shape checked (not its
    /// size); None for a family whose shape is fixed.
    fn reshaped(&self, _r: &Reshape) -> Option<Result<ModelConfig>> {
        None
    }
    /// This model as GPT-2, for what runs GPT-2 only; None for another
    /// family.
    fn gpt2(&self) -> Option<&GptConfig> {
        None
    }
    /// This model as a BERT encoder, for the tasks that train BERT's heads
    /// on one (mlm, pretrain, classify); None for another family.
    fn bert(&self) -> Option<&BertConfig> {
        None
    }
}

/// A family's engine and decoder, generic over the backend (what a
/// [`ModelConfig`] made from the family's config builds on each backend).
pub trait FamilyEngine: Family + Sized {
    /// The unit-by-unit engine of tensor-parallel rank `tp`.
    fn engine<B: Backend>(
        &self,
        backend: B,
        tp: TpPlace,
        recompute: bool,
        precision: Precision,
    ) -> Result<Box<dyn UnitModel<B>>>;
    /// Its decoder, for a family that generates (a causal language model).
    fn decoder<B: Backend>(&self) -> Option<&dyn FamilyDecoder<B>> {
        None
    }
}

/// What a generation asks of a family's decoder: the whole model's
/// parameters, the prompts, how to sample, the token that ends a row, how
/// the weights are stored, the tensor-parallel group splitting the model
/// (the call is then collective over it), and what sees each new token
/// (row, token) as it is made (on the group's rank 0).
pub struct Generation<'a> {
    pub params: &'a [f32],
    pub prompts: &'a [Vec<u32>],
    pub sample: &'a SampleConfig,
    pub stop: Option<u32>,
    pub format: WeightFormat,
    pub tp: Option<&'a dyn crate::comm::Comm>,
    pub on_token: &'a mut (dyn FnMut(usize, u32) + Send),
}

/// Teacher-forced evaluation through a family's decoder with its weights
/// stored as `format`, beside fp32 weights on the same tokens: `batches`
/// of (inputs, targets), each `rows` x `t` tokens.
pub struct DecodedRun<'a> {
    pub params: &'a [f32],
    pub format: WeightFormat,
    pub batches: Vec<(Vec<u32>, Vec<u32>)>,
    pub rows: usize,
    pub t: usize,
}

/// What a [`DecodedRun`] measured.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DecodedEval {
    /// Mean cross-entropy of the targets with the weights as asked.
    pub loss: f64,
    /// The same with fp32 weights.
    pub loss_f32: f64,
    /// Positions whose most likely next token is the fp32 decoder's.
    pub top1_agreement: f64,
    pub tokens: usize,
}

/// Greedy generation timed: the weights stored as `format` packed once
/// (timed apart, like loading), then `runs` generations of up to
/// `new_tokens` tokens after each of `prompts`.
pub struct TimedGeneration<'a> {
    pub params: &'a [f32],
    pub format: WeightFormat,
    pub prompts: &'a [Vec<u32>],
    pub new_tokens: usize,
    pub runs: usize,
}

/// What a [`TimedGeneration`] measured.
#[derive(Clone, Debug, PartialEq)]
pub struct GenerationTiming {
    /// Seconds packing the weights took.
    pub pack_seconds: f64,
    /// Each run: (seconds, seconds to the first new token, new tokens of
    /// the first row).
    pub runs: Vec<(f64, f64, usize)>,
}

/// A family's decoder on backend `B` (a causal language model's, with a
/// KV cache): what `generate`, `eval --weights`, `bench --generate` and
/// `prune` ask of it.
pub trait FamilyDecoder<B: Backend> {
    /// Every prompt continued, on `backend`.
    fn generate(&self, backend: B, run: Generation<'_>) -> Result<Vec<Vec<u32>>>;
    /// The teacher-forced losses of the decoder, as `run` asks.
    fn evaluate(&self, backend: B, run: DecodedRun<'_>) -> Result<DecodedEval>;
    /// Greedy generation timed, as `run` asks.
    fn time(&self, backend: B, run: TimedGeneration<'_>) -> Result<GenerationTiming>;
}

/// A family's [`FamilyEngine`] on backend `B`, its config's type erased.
trait FamilyOn<B: Backend>: Send + Sync {
    fn engine(&self, be: B, tp: TpPlace, recompute: bool, p: Precision) -> EngineResult<B>;
    fn decoder(&self) -> Option<&dyn FamilyDecoder<B>>;
}

type EngineResult<B> = Result<Box<dyn UnitModel<B>>>;

impl<F: FamilyEngine, B: Backend> FamilyOn<B> for F {
    fn engine(&self, be: B, tp: TpPlace, recompute: bool, p: Precision) -> EngineResult<B> {
        FamilyEngine::engine(self, be, tp, recompute, p)
    }
    fn decoder(&self) -> Option<&dyn FamilyDecoder<B>> {
        FamilyEngine::decoder(self)
    }
}

/// A family's [`FamilyOn`] of each backend.
struct OnEach;

impl PerBackend for OnEach {
    type On<B: Backend> = Arc<dyn FamilyOn<B>>;
}

/// One config shared as the [`FamilyOn`] of each backend.
impl<F: FamilyEngine> Make<OnEach> for Arc<F> {
    fn make<B: Backend>(&self) -> Arc<dyn FamilyOn<B>> {
        self.clone()
    }
}

/// What a family registers.
pub struct Registration {
    /// As users know it ("GPT-2").
    pub name: &'static str,
    /// The key its configs are written under in JSON (`{"bert": {...}}`);
    /// None for the one family written bare (GPT-2, as every file written
    /// before there were families has it).
    pub key: Option<&'static str>,
    /// Whether its models are causal language models (each position sees
    /// those before it), which `--task lm` trains; an encoder's are not.
    pub causal: bool,
    /// Its presets' names, for `--model` and its errors.
    pub presets: fn() -> Vec<&'static str>,
    /// A preset by name, or None for a name that is not this family's.
    pub preset: fn(&str) -> Option<ModelConfig>,
    /// A config from its JSON (as [`Family::to_json`] wrote it).
    pub from_json: fn(serde_json::Value) -> std::result::Result<ModelConfig, String>,
    /// The model files a run of it writes; None for a family that writes
    /// none.
    pub model_files: Option<ModelFiles>,
    /// Its Hugging Face folder (what `transformers` loads), where it has one.
    pub hf: Option<HfFolder>,
}

/// Reads a folder: the model's description and whole parameters.
pub type ReadFolder = fn(&Path) -> Result<(ModelMeta, Vec<f32>)>;

/// A family's Hugging Face folder: `config.json` and `model.safetensors`
/// under `transformers`' names, which `from_pretrained` loads.
#[derive(Clone, Copy)]
pub struct HfFolder {
    /// `config.json`'s `model_type` ("gpt2", "bert").
    pub model_type: &'static str,
    /// Writes the whole model's parameters as such a folder.
    pub export: WriteFiles,
    /// Reads such a folder.
    pub import: ReadFolder,
    /// `config.json`'s dropout rates, which distgpt does not train with.
    pub dropout: &'static [&'static str],
}

/// The dropout rates a Hugging Face folder's `config.json` trains with,
/// where above 0, as `key rate` (its family's [`HfFolder::dropout`]):
/// distgpt trains without dropout. Empty for a folder of no family's.
pub fn hf_dropout(dir: &Path) -> Vec<String> {
    let keys = hf_family(dir)
        .ok()
        .and_then(|r| r.hf)
        .map_or(&[][..], |h| h.dropout);
    let json = read_hf_config(dir).map_or(serde_json::Value::Null, |(_, j)| j);
    (keys.iter())
        .filter_map(|k| {
            json[*k]
                .as_f64()
                .filter(|p| *p > 0.0)
                .map(|p| format!("{k} {p}"))
        })
        .collect()
}

/// The registered family whose Hugging Face folder `dir` is, by its
/// `config.json`'s `model_type`.
pub fn hf_family(dir: &Path) -> Result<&'static Registration> {
    let (path, json) = read_hf_config(dir)?;
    // a GPT-2 folder written before `model_type` was, or by hand; a
    // `model_type` that is not a string names no family
    let kind = match &json["model_type"] {
        serde_json::Value::Null => "gpt2".to_string(),
        serde_json::Value::String(k) => k.clone(),
        other => other.to_string(),
    };
    let kind = kind.as_str();
    let families = families();
    families
        .iter()
        .find(|r| r.hf.is_some_and(|h| h.model_type == kind))
        .copied()
        .ok_or_else(|| {
            let known: Vec<&str> = families
                .iter()
                .filter_map(|r| r.hf.map(|h| h.model_type))
                .collect();
            let reason = format!(
                "model_type is {kind}: distgpt reads {} folders",
                known.join(", ")
            );
            Error::checkpoint(path, reason)
        })
}

/// Writes a model's whole parameters into a folder, with what describes
/// them (tokenizer, label names) and a vocabulary file, where the family
/// keeps one beside its weights.
pub type WriteFiles = fn(&ModelMeta, &[f32], Option<&Path>, &Path) -> Result<()>;

/// How a family's model is written as files, and read back.
#[derive(Clone, Copy)]
pub struct ModelFiles {
    /// What they are, for the closing lines ("model.safetensors, model.json").
    pub what: &'static str,
    /// Writes the whole model's parameters into a folder.
    pub write: WriteFiles,
    /// Reads and checks the files in a folder (checksums, finite weights),
    /// giving their config.
    pub read: fn(&Path) -> Result<ModelConfig>,
}

/// distgpt's own model files, for any family: `model.safetensors` under
/// the layout's names and `model.json` (`checkpoint::write_model`).
pub const DISTGPT_FILES: ModelFiles = ModelFiles {
    what: "model.safetensors, model.json",
    write: |meta, params, _, dir| {
        super::files::write_model(&meta.config, params, meta.tokenizer.clone(), dir, false)
    },
    read: |dir| Ok(super::files::read_model_files(dir)?.0.config),
};

/// Adds a family to those [`ModelConfig`] knows; refuses a name or JSON key
/// already taken.
pub fn register(family: &'static Registration) -> Result<()> {
    let mut registered = REGISTERED.write().unwrap_or_else(|e| e.into_inner());
    let taken = BUILTIN
        .iter()
        .chain(registered.iter())
        .find(|r| r.name == family.name || r.key == family.key);
    if let Some(r) = taken {
        return Err(Error::Config(format!(
            "the model family {} clashes with {} (name or JSON key)",
            family.name, r.name
        )));
    }
    registered.push(family);
    Ok(())
}

/// Every family known: the built-in ones, then those registered.
pub fn families() -> Vec<&'static Registration> {
    let registered = REGISTERED.read().unwrap_or_else(|e| e.into_inner());
    BUILTIN
        .iter()
        .copied()
        .chain(registered.iter().copied())
        .collect()
}

/// A model of one of the registered families. As JSON it is the family's
/// config under the family's key (`{"bert": {...}}`), a GPT-2 its bare
/// config (as every checkpoint index and run record before BERT has it).
#[derive(Clone)]
pub struct ModelConfig {
    family: Arc<dyn Family>,
    on: Arc<Each<OnEach>>,
}

impl<F: FamilyEngine> From<F> for ModelConfig {
    fn from(f: F) -> Self {
        let f = Arc::new(f);
        let on = Arc::new(Each::new(f.clone()));
        ModelConfig { family: f, on }
    }
}

/// The family's own methods ([`Family`]), called on the config.
impl std::ops::Deref for ModelConfig {
    type Target = dyn Family;
    fn deref(&self) -> &dyn Family {
        &*self.family
    }
}

impl fmt::Display for ModelConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.family.fmt(f)
    }
}

impl fmt::Debug for ModelConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.family.fmt(f)
    }
}

impl PartialEq for ModelConfig {
    fn eq(&self, other: &Self) -> bool {
        std::ptr::eq(self.registration(), other.registration())
            && self.family.to_json() == other.family.to_json()
    }
}

impl Serialize for ModelConfig {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        let json = self.family.to_json();
        match self.registration().key {
            Some(key) => serde_json::json!({ key: json }).serialize(s),
            None => json.serialize(s),
        }
    }
}

impl<'de> Deserialize<'de> for ModelConfig {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let value = serde_json::Value::deserialize(d)?;
        let families = families();
        let keyed = match &value {
            serde_json::Value::Object(m) if m.len() == 1 => {
                let (k, v) = m.iter().next().expect("one entry");
                families
                    .iter()
                    .find(|r| r.key == Some(k.as_str()))
                    .map(|r| (r, v.clone()))
            }
            _ => None,
        };
        let (family, json) = match keyed {
            Some(found) => found,
            None => {
                let bare = families.iter().find(|r| r.key.is_none());
                (bare.expect("one family is written bare"), value)
            }
        };
        (family.from_json)(json).map_err(serde::de::Error::custom)
    }
}

impl ModelConfig {
    /// A preset of any family by name.
    pub fn preset(name: &str) -> Result<Self> {
        let families = families();
        if let Some(c) = families.iter().find_map(|r| (r.preset)(name)) {
            return Ok(c);
        }
        let known: Vec<String> = families
            .iter()
            .map(|r| format!("{}: {}", r.name, (r.presets)().join(", ")))
            .collect();
        Err(Error::Config(format!(
            "unknown model preset '{name}' (known: {})",
            known.join("; ")
        )))
    }

    /// The family's name, as users know it.
    pub fn family(&self) -> &'static str {
        self.registration().name
    }

    /// Parameters stored (padded vocabularies included).
    pub fn num_params(&self) -> usize {
        self.layout(1).total()
    }

    /// Positions the model has.
    pub fn block_size(&self) -> usize {
        self.family.dims().block_size
    }

    /// Transformer blocks.
    pub fn n_layer(&self) -> usize {
        self.family.dims().n_layer
    }

    /// Width of the residual stream.
    pub fn n_embd(&self) -> usize {
        self.family.dims().n_embd
    }

    /// Attention heads (tensor parallelism splits them).
    pub fn n_head(&self) -> usize {
        self.family.dims().n_head
    }

    /// The ranges of the whole layout the blocks' weight matrices hold.
    pub fn block_matrices(&self) -> Vec<std::ops::Range<usize>> {
        let layout = self.layout(1);
        let matrices = layout.tensors.iter().filter(|t| self.block_matrix(t));
        matrices.map(|t| t.range()).collect()
    }

    /// The model that keeps the rows a `sparsity` fraction of row pruning
    /// keeps, with its parameters; refused, saying so, for a family whose
    /// blocks cannot lose rows.
    pub fn prune_rows(
        &self,
        params: &[f32],
        sparsity: f64,
        scope: Scope,
    ) -> Result<(ModelConfig, Vec<f32>)> {
        self.family.prune_rows(params, sparsity, scope).ok_or_else(|| {
            Error::Config(format!(
                "{} models cannot lose whole rows: prune --method rows needs a family whose blocks shrink (GPT-2's heads and MLP units); --method magnitude prunes single weights",
                self.family()
            ))
        })
    }

    /// Refuses a family with no tensor `quantize` stores in int8, saying so.
    pub fn check_quantizes(&self) -> Result<()> {
        match !self.block_matrices().is_empty() {
            true => Ok(()),
            false => Err(Error::Config(format!(
                "{} models have no tensor stored in int8: quantize needs a family that marks some (GPT-2's block matrices)",
                self.family()
            ))),
        }
    }

    /// The same model with `r`'s changes, its shape checked (not its
    /// size: `plan` prices models it would not allocate); a family whose
    /// shape is fixed is refused for any change.
    pub fn reshaped(&self, r: &Reshape) -> Result<ModelConfig> {
        if *r == Reshape::default() {
            return Ok(self.clone());
        }
        self.family.reshaped(r).unwrap_or_else(|| {
            Err(Error::Config(format!(
                "{} models have a fixed shape: --n-layer, --n-head, --n-embd, --block-size and another vocabulary do not apply",
                self.family()
            )))
        })
    }

    /// The same model with at most `n` blocks (what `plan`'s calibration
    /// times in place of a model too large to time); None for a family
    /// whose shape is fixed, which is then timed whole.
    pub fn with_layers(&self, n: usize) -> Option<ModelConfig> {
        let fewer = Reshape {
            n_layer: Some(n.min(self.n_layer())),
            ..Reshape::default()
        };
        self.reshaped(&fewer).ok()
    }

    /// Tokens in its vocabulary.
    pub fn vocab_size(&self) -> usize {
        self.family.dims().vocab_size
    }

    /// The unit-by-unit engine of tensor-parallel rank `tp`.
    pub fn engine<B: Backend>(
        &self,
        backend: B,
        tp: TpPlace,
        recompute: bool,
        precision: Precision,
    ) -> Result<Box<dyn UnitModel<B>>> {
        B::of(&self.on).engine(backend, tp, recompute, precision)
    }

    /// The whole model on `backend` in fp32 holding `params` (what an
    /// evaluation runs).
    pub fn whole<B: Backend>(
        &self,
        backend: B,
        params: &[f32],
    ) -> Result<Whole<B, dyn UnitModel<B>>> {
        let engine = self.engine(backend, TpPlace::NONE, false, Precision::Fp32)?;
        let mut whole = Whole::boxed(engine)?;
        whole.set_params(params)?;
        Ok(whole)
    }

    /// Whether the family decodes (on every backend alike).
    pub fn decodes(&self) -> bool {
        Cpu::of(&self.on).decoder().is_some()
    }

    /// The family's decoder on `B`, or the error of a family with none
    /// (naming the tool that needed one).
    pub fn decoder<B: Backend>(&self, tool: &str) -> Result<&dyn FamilyDecoder<B>> {
        B::of(&self.on).decoder().ok_or_else(|| {
            Error::Config(format!(
                "{tool} runs a causal language model's KV-cache decoder: {} models have none",
                self.family()
            ))
        })
    }

    /// `run`'s prompts continued by the family's decoder on `backend`; None
    /// for a family that has none.
    pub fn generate<B: Backend>(
        &self,
        backend: B,
        run: Generation<'_>,
    ) -> Result<Option<Vec<Vec<u32>>>> {
        let decoder = B::of(&self.on).decoder();
        decoder.map(|d| d.generate(backend, run)).transpose()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tools_ask_a_family_what_it_can_do() {
        let gpt = ModelConfig::preset("gpt2").unwrap();
        let bert = ModelConfig::preset("bert-minilm").unwrap();
        // calibration's shallower model: each family cuts its own blocks
        for m in [&gpt, &bert] {
            let cut = m.with_layers(2).expect("a built-in family can be cut");
            assert_eq!((cut.n_layer(), cut.n_embd()), (2, m.n_embd()), "{m}");
            assert_eq!(cut.family(), m.family());
        }
        // quantize and prune: GPT-2 marks its blocks' four matrices, BERT
        // marks none
        let tiny = ModelConfig::preset("tiny").unwrap();
        let named: Vec<String> = (tiny.layout(1).tensors.iter())
            .filter(|t| tiny.block_matrix(t))
            .map(|t| t.name.clone())
            .collect();
        let matrices = ["attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"];
        let expected: Vec<String> = (0..tiny.n_layer())
            .flat_map(|l| matrices.map(|m| format!("transformer.h.{l}.{m}.weight")))
            .collect();
        let mut sorted = named.clone();
        sorted.sort();
        let mut want = expected.clone();
        want.sort();
        assert_eq!(sorted, want);
        assert_eq!(tiny.block_matrices().len(), 4 * tiny.n_layer());
        assert!(bert.block_matrices().is_empty());
        gpt.check_quantizes().unwrap();
        let e = bert.check_quantizes().unwrap_err().to_string();
        assert!(
            e.contains("BERT models have no tensor stored in int8"),
            "{e}"
        );
        // row pruning: GPT-2 shrinks, BERT is refused in words
        let params = tiny.init_full(1);
        let (small, kept) = tiny.prune_rows(&params, 0.5, Scope::Matrix).unwrap();
        assert_eq!(kept.len(), small.num_params());
        assert!(small.num_params() < tiny.num_params());
        let e = bert.prune_rows(&[], 0.5, Scope::Global).unwrap_err();
        assert!(
            e.to_string().contains("BERT models cannot lose whole rows"),
            "{e}"
        );
        // decoding: BERT has no decoder, and each tool says which it is
        let be = Cpu::new();
        let run = DecodedRun {
            params: &[],
            format: WeightFormat::F32,
            batches: vec![],
            rows: 1,
            t: 1,
        };
        let e = bert
            .decoder("eval --weights")
            .map(|d| d.evaluate(be.clone(), run));
        let e = e.unwrap_err().to_string();
        assert!(
            e.contains("eval --weights runs a causal language model's KV-cache decoder: BERT models have none"),
            "{e}"
        );
        let run = TimedGeneration {
            params: &[],
            format: WeightFormat::F32,
            prompts: &[],
            new_tokens: 1,
            runs: 1,
        };
        let e = bert
            .decoder("bench --generate")
            .and_then(|d| d.time(be.clone(), run))
            .unwrap_err();
        assert!(e.to_string().contains(": bench --generate runs"), "{e}");
    }

    #[test]
    fn gpt2_decodes_every_job_through_the_registry() {
        let (tiny, be) = (ModelConfig::preset("tiny").unwrap(), Cpu::new());
        let params = tiny.init_full(1);
        let t = 6;
        let run = DecodedRun {
            params: &params,
            format: WeightFormat::F32,
            batches: vec![(vec![1; t], vec![2; t])],
            rows: 1,
            t,
        };
        let e = tiny.decoder("eval").unwrap().evaluate(be.clone(), run);
        let e = e.unwrap();
        assert_eq!((e.tokens, e.top1_agreement), (t, 1.0));
        assert!((e.loss - e.loss_f32).abs() < 1e-9, "{e:?}");
        // the decoder's loss is the training forward's on the same tokens
        let batch = crate::data::Batch::lm(vec![1; t], vec![2; t]);
        let mut whole = tiny.whole(be.clone(), &params).unwrap();
        let forward = whole.mean_loss([batch], 1, t).unwrap();
        assert!((e.loss - forward).abs() < 1e-4, "{} vs {forward}", e.loss);
        let run = TimedGeneration {
            params: &params,
            format: WeightFormat::F32,
            prompts: &[vec![1], vec![2, 3]],
            new_tokens: 3,
            runs: 2,
        };
        let timed = tiny.decoder("bench").unwrap().time(be.clone(), run);
        let timed = timed.unwrap();
        assert_eq!(timed.runs.len(), 2);
        assert!(timed.runs.iter().all(|&(s, first, n)| n == 3 && first <= s));
        let sample = SampleConfig {
            max_new_tokens: 4,
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            seed: 0,
        };
        let run = Generation {
            params: &params,
            prompts: &[vec![1, 2]],
            sample: &sample,
            stop: None,
            format: WeightFormat::F32,
            tp: None,
            on_token: &mut |_, _| {},
        };
        let out = tiny
            .generate(be.clone(), run)
            .unwrap()
            .expect("GPT-2 decodes");
        assert_eq!(out[0].len(), 4);
        let run = Generation {
            params: &[],
            prompts: &[vec![1]],
            sample: &sample,
            stop: None,
            format: WeightFormat::F32,
            tp: None,
            on_token: &mut |_, _| {},
        };
        let bert = ModelConfig::preset("bert-minilm").unwrap();
        assert!(bert.generate(be, run).unwrap().is_none());
    }

    #[test]
    fn a_shape_is_changed_by_its_own_family() {
        let bert = ModelConfig::preset("bert-minilm").unwrap();
        let changes = Reshape {
            n_layer: Some(2),
            n_head: Some(2),
            n_embd: Some(64),
            block_size: Some(16),
            vocab_size: Some(99),
        };
        let b = bert.reshaped(&changes).unwrap();
        let b = b.bert().unwrap();
        let got = (b.n_layer, b.n_head, b.n_embd, b.n_inner, b.block_size);
        assert_eq!((got, b.vocab_size), ((2, 2, 64, 256, 16), 99));
        let gpt = ModelConfig::preset("tiny").unwrap();
        let g = gpt.reshaped(&changes).unwrap();
        let dims = (g.n_layer(), g.n_head(), g.n_embd(), g.block_size());
        assert_eq!((dims, g.vocab_size()), ((2, 2, 64, 16), 99));
        // nothing asked: the same model
        assert_eq!(gpt.reshaped(&Reshape::default()).unwrap(), gpt);
        // the shape is checked
        let odd = Reshape {
            n_head: Some(5),
            ..Reshape::default()
        };
        assert!(gpt.reshaped(&odd).is_err());
        assert!(bert.reshaped(&odd).is_err());
        // calibration's cut: at most the model's blocks
        assert_eq!(gpt.with_layers(99).unwrap(), gpt);
    }

    #[test]
    fn a_hugging_face_folder_is_read_by_the_family_its_model_type_names() {
        let root = crate::testdir::TestDir::new("hf-family");
        let dir = root.path();
        let with = |json: &str| {
            std::fs::write(dir.join("config.json"), json).unwrap();
            hf_family(dir).map(|r| r.name)
        };
        assert_eq!(with(r#"{"model_type": "bert"}"#).unwrap(), "BERT");
        assert_eq!(with(r#"{"model_type": "gpt2"}"#).unwrap(), "GPT-2");
        // GPT-2 folders written by hand may leave it out
        assert_eq!(with(r#"{"n_layer": 2}"#).unwrap(), "GPT-2");
        let err = with(r#"{"model_type": "llama"}"#).unwrap_err().to_string();
        assert!(err.contains("llama") && err.contains("gpt2, bert"), "{err}");
        // a model_type that is no name is no GPT-2
        let err = with(r#"{"model_type": 5}"#).unwrap_err().to_string();
        assert!(
            err.contains("model_type is 5: distgpt reads gpt2, bert"),
            "{err}"
        );
    }

    #[test]
    fn every_preset_of_every_family_is_found_and_an_unknown_one_lists_them_all() {
        for r in families() {
            for name in (r.presets)() {
                let c = ModelConfig::preset(name).unwrap();
                assert_eq!(c.family(), r.name, "{name}");
                // JSON goes through the registry and back
                let json = serde_json::to_value(&c).unwrap();
                assert_eq!(serde_json::from_value::<ModelConfig>(json).unwrap(), c);
            }
        }
        let err = ModelConfig::preset("gpt3").unwrap_err().to_string();
        assert!(
            err.contains("GPT-2: ") && err.contains("BERT: bert-minilm"),
            "{err}"
        );
    }
}
