//! Model families as data. A family is a config type implementing
//! [`Family`] (its shape, layout, initialisation, costs and synthetic
//! batches), [`FamilyEngine`] (its unit-by-unit engine) and, when it
//! decodes, [`FamilyDecoder`], with a [`Registration`] (its name, how it is
//! written in JSON, its presets, its model files, its Hugging Face folder):
//! all in its own folder, listed once here ([`BUILTIN`]) or registered at
//! run time ([`register`]). `parallel`, `train`, `checkpoint`, `plan` and
//! `compare` hold a [`ModelConfig`] and ask it; they never name a family.

use super::layout::{ParamLayout, TensorSpec};
use super::tp::TpPlace;
use super::unit::{Span, UnitModel};
use super::{bert, gpt2, Precision};
use crate::backend::{Backend, WeightFormat};
use crate::data::{Batch, TokenizerSpec};
use crate::error::{Error, Result};
use crate::rng::Rng;
use crate::sample::SampleConfig;
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::any::Any;
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
    /// Training FLOPs per token that tensor parallelism does not split.
    fn unsplit_flops_per_token(&self, t: usize) -> f64;
    /// Its positions, blocks, width and heads.
    fn dims(&self) -> FamilyDims;
    /// Refuses a tensor-parallel size the family cannot split by.
    fn check_tp(&self, tp: usize) -> Result<()>;
    /// Whether the engine splits a backward into its input and weight
    /// halves (`UnitModel::split_backward`, the zb-h1 schedule's need).
    fn splits_backward(&self) -> bool {
        false
    }
    /// The parameter layout of one of `tp` tensor-parallel ranks.
    fn layout(&self, tp: usize) -> ParamLayout;
    /// A random batch of b x t of the family's kind (benchmarks).
    fn synthetic_batch(&self, rng: &mut Rng, b: usize, t: usize) -> Batch;
    /// Elements of (activations, other scratch) one of `tp` ranks allocates
    /// for `bt` = (b sequences, t tokens) when its engine runs `span` =
    /// (units, recomputing blocks, its backward split in two).
    fn activation_elems(
        &self,
        tp: usize,
        bt: (usize, usize),
        span: (&Span, bool, bool),
        precision: Precision,
    ) -> (usize, usize);
    /// The shape tensor `t` of its layout is stored with in model files
    /// (its trailing rows may be padding the files leave out).
    fn file_shape(&self, t: &TensorSpec) -> Vec<usize> {
        t.shape.clone()
    }
    /// Whether `quantize` stores tensor `t` in int8 (per output column).
    fn int8_tensor(&self, _t: &TensorSpec) -> bool {
        false
    }
    /// The same model with at most `n` blocks (what `plan`'s calibration
    /// times in place of a model too large to time); None for a family
    /// that cannot be cut, which is then timed whole.
    fn with_layers(&self, _n: usize) -> Option<ModelConfig> {
        None
    }
    /// This config, to be downcast to the family's type.
    fn as_any(&self) -> &dyn Any;
}

/// A family's engine, generic over the backend (registered through
/// [`Registration::engine_of`]).
pub trait FamilyEngine: Family + Sized {
    /// The unit-by-unit engine of tensor-parallel rank `tp`.
    fn engine<B: Backend>(
        &self,
        backend: B,
        tp: TpPlace,
        recompute: bool,
        precision: Precision,
    ) -> Result<Box<dyn UnitModel<B>>>;
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

/// A family that decodes (a causal language model), generic over the
/// backend (registered through [`Registration::decoder_of`]).
pub trait FamilyDecoder: Family + Sized {
    /// Every prompt continued, on `backend`.
    fn generate<B: Backend>(&self, backend: B, run: Generation<'_>) -> Result<Vec<Vec<u32>>>;
}

/// A registered family's decoder on a backend, both erased.
pub type DecodeFn = fn(&dyn Any, Box<dyn Any>, Generation<'_>) -> Result<Vec<Vec<u32>>>;

/// The engine of a registered family on a backend, both erased: the
/// family's config, the backend (boxed), rank, recomputation, precision.
pub type EngineFn = fn(&dyn Any, Box<dyn Any>, TpPlace, bool, Precision) -> Result<Box<dyn Any>>;

/// What a family registers.
pub struct Registration {
    /// As users know it ("GPT-2").
    pub name: &'static str,
    /// The key its configs are written under in JSON (`{"bert": {...}}`);
    /// None for the one family written bare (GPT-2, as every file written
    /// before there were families has it).
    pub key: Option<&'static str>,
    /// Its presets' names, for `--model` and its errors.
    pub presets: fn() -> Vec<&'static str>,
    /// A preset by name, or None for a name that is not this family's.
    pub preset: fn(&str) -> Option<ModelConfig>,
    /// A config from its JSON (as [`Family::to_json`] wrote it).
    pub from_json: fn(serde_json::Value) -> std::result::Result<ModelConfig, String>,
    /// Its engine: [`Registration::engine_of`].
    pub engine: EngineFn,
    /// Its decoder, for a family that generates: [`Registration::decoder_of`].
    pub decoder: Option<DecodeFn>,
    /// The model files a run of it writes; None for a family that writes
    /// none.
    pub model_files: Option<ModelFiles>,
    /// Its Hugging Face folder (what `transformers` loads), where it has one.
    pub hf: Option<HfFolder>,
}

/// Reads a folder: the model's config, its tokenizer and whole parameters.
pub type ReadFolder = fn(&Path) -> Result<(ModelConfig, TokenizerSpec, Vec<f32>)>;

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
}

/// The registered family whose Hugging Face folder `dir` is, by its
/// `config.json`'s `model_type`.
pub fn hf_family(dir: &Path) -> Result<&'static Registration> {
    let path = dir.join("config.json");
    let text = std::fs::read_to_string(&path).map_err(|e| Error::io(&path, e))?;
    let json: serde_json::Value = serde_json::from_str(&text).map_err(|e| Error::Checkpoint {
        path: path.clone(),
        reason: format!("invalid JSON: {e}"),
    })?;
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
            Error::Checkpoint {
                path,
                reason: format!(
                    "model_type is {kind}: distgpt reads {} folders",
                    known.join(", ")
                ),
            }
        })
}

/// Writes a model's whole parameters into a folder, with the tokenizer
/// (and a vocabulary file, where the family keeps one beside its weights).
pub type WriteFiles = fn(&ModelConfig, &[f32], &TokenizerSpec, Option<&Path>, &Path) -> Result<()>;

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
    write: |config, params, tokenizer, _, dir| {
        super::files::write_model(config, params, tokenizer.clone(), dir, false)
    },
    read: |dir| Ok(super::files::read_model_files(dir)?.0.config),
};

impl Registration {
    /// The engine of family `F`, on every backend there is.
    pub const fn engine_of<F: FamilyEngine>() -> EngineFn {
        erased_engine::<F>
    }

    /// The decoder of family `F`, on every backend there is.
    pub const fn decoder_of<F: FamilyDecoder>() -> DecodeFn {
        erased_decoder::<F>
    }
}

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

/// Work to run on a backend of a type known only at run time.
trait OnBackend {
    type Out;
    fn run<B: Backend>(self, backend: B) -> Result<Self::Out>;
}

/// Runs `op` on `backend`, tried as each kind of backend there is (the
/// backends are a closed set; families are not).
fn on_backend<O: OnBackend>(backend: Box<dyn Any>, op: O) -> Result<O::Out> {
    let backend = match backend.downcast::<crate::backend::cpu::Cpu>() {
        Ok(be) => return op.run(*be),
        Err(be) => be,
    };
    #[cfg(feature = "cuda")]
    let backend = match backend.downcast::<crate::backend::cuda::Cuda>() {
        Ok(be) => return op.run(*be),
        Err(be) => be,
    };
    match backend.downcast::<crate::backend::opencl::OpenCl>() {
        Ok(be) => op.run(*be),
        Err(_) => Err(Error::Config(
            "a family's engine runs on the cpu, opencl and cuda backends only".into(),
        )),
    }
}

/// The family's config of type `F` behind `config`.
fn config_of<F: Family>(config: &dyn Any) -> &F {
    config
        .downcast_ref::<F>()
        .expect("a family registers the functions of its own config type")
}

/// [`EngineFn`] of family `F`.
fn erased_engine<F: FamilyEngine>(
    config: &dyn Any,
    backend: Box<dyn Any>,
    tp: TpPlace,
    recompute: bool,
    precision: Precision,
) -> Result<Box<dyn Any>> {
    struct Build<'f, F>(&'f F, TpPlace, bool, Precision);
    impl<F: FamilyEngine> OnBackend for Build<'_, F> {
        type Out = Box<dyn Any>;
        fn run<B: Backend>(self, be: B) -> Result<Box<dyn Any>> {
            let Build(f, tp, recompute, precision) = self;
            Ok(Box::new(f.engine(be, tp, recompute, precision)?))
        }
    }
    let op = Build(config_of::<F>(config), tp, recompute, precision);
    on_backend(backend, op)
}

/// [`DecodeFn`] of family `F`.
fn erased_decoder<F: FamilyDecoder>(
    config: &dyn Any,
    backend: Box<dyn Any>,
    run: Generation<'_>,
) -> Result<Vec<Vec<u32>>> {
    struct Decode<'f, 'g, F>(&'f F, Generation<'g>);
    impl<F: FamilyDecoder> OnBackend for Decode<'_, '_, F> {
        type Out = Vec<Vec<u32>>;
        fn run<B: Backend>(self, be: B) -> Result<Vec<Vec<u32>>> {
            self.0.generate(be, self.1)
        }
    }
    on_backend(backend, Decode(config_of::<F>(config), run))
}

/// A model of one of the registered families. As JSON it is the family's
/// config under the family's key (`{"bert": {...}}`), a GPT-2 its bare
/// config (as every checkpoint index and run record before BERT has it).
#[derive(Clone)]
pub struct ModelConfig(Arc<dyn Family>);

impl<F: Family> From<F> for ModelConfig {
    fn from(f: F) -> Self {
        ModelConfig(Arc::new(f))
    }
}

impl fmt::Display for ModelConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

impl fmt::Debug for ModelConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

impl PartialEq for ModelConfig {
    fn eq(&self, other: &Self) -> bool {
        std::ptr::eq(self.registration(), other.registration())
            && self.0.to_json() == other.0.to_json()
    }
}

impl Serialize for ModelConfig {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        let json = self.0.to_json();
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

    /// The family's own config, when it is of type `F`.
    pub fn get<F: Family>(&self) -> Option<&F> {
        self.0.as_any().downcast_ref()
    }

    /// The family this model belongs to.
    pub fn registration(&self) -> &'static Registration {
        self.0.registration()
    }

    /// The family's name, as users know it.
    pub fn family(&self) -> &'static str {
        self.registration().name
    }

    /// Refuses shapes the family cannot build.
    pub fn validate(&self) -> Result<()> {
        self.0.validate()
    }

    /// The family's initialisation of the whole model.
    pub fn init_full(&self, seed: u64) -> Vec<f32> {
        self.0.init_full(seed)
    }

    /// Training FLOPs per token at sequence length t (the MFU numerator).
    pub fn flops_per_token(&self, t: usize) -> f64 {
        self.0.flops_per_token(t)
    }

    /// Training FLOPs per token that tensor parallelism does not split (the
    /// replicated head: GPT-2's tied LM head; BERT's MLM transform and
    /// decoder, or its pooler and classifier, which see one row per sequence).
    pub fn unsplit_flops_per_token(&self, t: usize) -> f64 {
        self.0.unsplit_flops_per_token(t)
    }

    /// Parameters stored (padded vocabularies included).
    pub fn num_params(&self) -> usize {
        self.layout(1).total()
    }

    /// Positions the model has.
    pub fn block_size(&self) -> usize {
        self.0.dims().block_size
    }

    /// A random batch of b x t of the family's kind (benchmarks): next
    /// tokens; a BERT classifier's labels; a masked LM's targets at 15% of
    /// the positions, the rest ignored.
    pub fn synthetic_batch(&self, rng: &mut Rng, b: usize, t: usize) -> Batch {
        self.0.synthetic_batch(rng, b, t)
    }

    /// Elements of (activations, other scratch) one of `tp` tensor-parallel
    /// ranks allocates for b sequences of t tokens when its engine runs
    /// `units` only (a pipeline stage's; all of them for one stage): the
    /// engine's own allocation, counted (`model::alloc`); its backward split
    /// in two where `split` (`UnitModel::split_backward`).
    pub fn stage_activation_elems(
        &self,
        tp: usize,
        bt: (usize, usize),
        (units, recompute, split): (std::ops::Range<usize>, bool, bool),
        precision: Precision,
    ) -> (usize, usize) {
        let span = Span::of_units(units, self.n_layer());
        self.0
            .activation_elems(tp, bt, (&span, recompute, split), precision)
    }

    /// Transformer blocks.
    pub fn n_layer(&self) -> usize {
        self.0.dims().n_layer
    }

    /// Width of the residual stream.
    pub fn n_embd(&self) -> usize {
        self.0.dims().n_embd
    }

    /// Attention heads (tensor parallelism splits them).
    pub fn n_head(&self) -> usize {
        self.0.dims().n_head
    }

    /// Refuses a tensor-parallel size the family cannot split by.
    pub fn check_tp(&self, tp: usize) -> Result<()> {
        self.0.check_tp(tp)
    }

    /// Whether the family's engine splits a backward into its input and
    /// weight halves (`UnitModel::split_backward`, the zb-h1 schedule's need).
    pub fn splits_backward(&self) -> bool {
        self.0.splits_backward()
    }

    /// The parameter layout of one of `tp` tensor-parallel ranks.
    pub fn layout(&self, tp: usize) -> ParamLayout {
        self.0.layout(tp)
    }

    /// The shape tensor `t` is stored with in model files.
    pub fn file_shape(&self, t: &TensorSpec) -> Vec<usize> {
        self.0.file_shape(t)
    }

    /// Whether `quantize` stores tensor `t` in int8.
    pub fn int8_tensor(&self, t: &TensorSpec) -> bool {
        self.0.int8_tensor(t)
    }

    /// Refuses a family with no tensor `quantize` stores in int8, saying so.
    pub fn check_quantizes(&self) -> Result<()> {
        match self.layout(1).tensors.iter().any(|t| self.int8_tensor(t)) {
            true => Ok(()),
            false => Err(Error::Config(format!(
                "{} models have no tensor stored in int8: quantize needs a family that marks some (GPT-2's block matrices)",
                self.family()
            ))),
        }
    }

    /// The same model with at most `n` blocks, where the family can be
    /// cut ([`Family::with_layers`]).
    pub fn with_layers(&self, n: usize) -> Option<ModelConfig> {
        self.0.with_layers(n)
    }

    /// The unit-by-unit engine of tensor-parallel rank `tp`.
    pub fn engine<B: Backend>(
        &self,
        backend: B,
        tp: TpPlace,
        recompute: bool,
        precision: Precision,
    ) -> Result<Box<dyn UnitModel<B>>> {
        let engine = (self.registration().engine)(
            self.0.as_any(),
            Box::new(backend),
            tp,
            recompute,
            precision,
        )?;
        engine
            .downcast::<Box<dyn UnitModel<B>>>()
            .map(|e| *e)
            .map_err(|_| Error::Config(format!("the {} engine of another backend", self.family())))
    }

    /// `run`'s prompts continued by the family's decoder on `backend`; None
    /// for a family that has none.
    pub fn generate<B: Backend>(
        &self,
        backend: B,
        run: Generation<'_>,
    ) -> Result<Option<Vec<Vec<u32>>>> {
        match self.registration().decoder {
            Some(decode) => decode(self.0.as_any(), Box::new(backend), run).map(Some),
            None => Ok(None),
        }
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
        // quantize: GPT-2 marks its block matrices, BERT marks none
        gpt.check_quantizes().unwrap();
        let e = bert.check_quantizes().unwrap_err().to_string();
        assert!(
            e.contains("BERT models have no tensor stored in int8"),
            "{e}"
        );
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
