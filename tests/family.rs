//! A third model family added from outside the library, touching nothing
//! in it: a toy MLP language model (token and position embeddings, residual
//! GELU MLP blocks, an untied head) written on the backend's kernels, with
//! its config, layout, engine and one registration call. Every layout
//! drives it as it drives GPT-2 and BERT, and follows `single`.

#[path = "support/scratch.rs"]
mod scratch;
use scratch::scratch;

use distgpt::backend::cpu::Cpu;
use distgpt::backend::{
    Activation, ActivationBackward, ActivationForward, Backend, Buf, Category,
    CrossEntropyBackward, CrossEntropyForward, Dst, EncoderBackward, EncoderForward,
    MatmulBackward, MatmulForward, MatmulShape, WeightLayout,
};
use distgpt::checkpoint;
use distgpt::comm::Comm;
use distgpt::data::{Batch, Dataset, LossTerms, TokenizerKind, TokenizerSpec};
use distgpt::error::{Error, Result};
use distgpt::model::family::{self, Family, FamilyDims, FamilyEngine, Registration};
use distgpt::model::{
    AdamWConfig, EngineCore, ModelConfig, ParamLayout, Precision, SpanRun, StageModel, TpPlace,
    TpSplit, UnitGrads, UnitKind, UnitModel, UnitParams,
};
use distgpt::parallel::{self, launch, ParallelConfig, StepConfig, StrategyKind};
use distgpt::rng::Rng;
use distgpt::train::{train_lm, Duration as Steps, TrainConfig};
use serde::{Deserialize, Serialize};
use std::ops::Range;
use std::time::Duration;

// ---- the family: config, layout, registration ----

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
struct Toy {
    vocab: usize,
    n_embd: usize,
    n_hidden: usize,
    n_layer: usize,
    block_size: usize,
}

static TOY: Registration = Registration {
    name: "toy MLP",
    key: Some("toy_mlp"),
    causal: true,
    presets: || vec!["toy-mlp"],
    preset: |name| (name == "toy-mlp").then(|| Toy::preset().into()),
    from_json: |j| {
        serde_json::from_value::<Toy>(j)
            .map(Into::into)
            .map_err(|e| e.to_string())
    },
    model_files: Some(family::DISTGPT_FILES),
    hf: None,
};

impl Toy {
    fn preset() -> Self {
        Toy {
            vocab: 29,
            n_embd: 16,
            n_hidden: 32,
            n_layer: 3,
            block_size: 8,
        }
    }
}

impl std::fmt::Display for Toy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "a toy MLP of {} blocks x {} wide",
            self.n_layer, self.n_embd
        )
    }
}

impl Family for Toy {
    fn registration(&self) -> &'static Registration {
        &TOY
    }
    fn to_json(&self) -> serde_json::Value {
        serde_json::to_value(self).unwrap()
    }
    fn validate(&self) -> Result<()> {
        Ok(())
    }
    fn init_full(&self, seed: u64) -> Vec<f32> {
        let mut rng = Rng::new(seed);
        let mut p: Vec<f32> = (0..self.layout(1).total())
            .map(|_| 0.1 * rng.normal() as f32)
            .collect();
        // biases start at zero
        for t in self.layout(1).tensors.iter().filter(|t| t.shape.len() == 1) {
            p[t.range()].fill(0.0);
        }
        p
    }
    fn flops_per_token(&self, _t: usize) -> f64 {
        6.0 * (self.n_layer * 2 * self.n_embd * self.n_hidden + self.n_embd * self.vocab) as f64
    }
    fn unsplit_flops_per_token(&self, _t: usize) -> f64 {
        self.flops_per_token(0)
    }
    fn dims(&self) -> FamilyDims {
        FamilyDims {
            block_size: self.block_size,
            n_layer: self.n_layer,
            n_embd: self.n_embd,
            n_head: 1,
            vocab_size: self.vocab,
        }
    }
    fn check_tp(&self, tp: usize) -> Result<()> {
        match tp {
            1 => Ok(()),
            _ => Err(Error::Config(
                "the toy MLP has no tensor parallelism".into(),
            )),
        }
    }
    fn layout(&self, _tp: usize) -> ParamLayout {
        let (c, f, v, rep) = (self.n_embd, self.n_hidden, self.vocab, TpSplit::Replicated);
        let mut b = ParamLayout::builder(1);
        b.unit("embeddings")
            .tensor("wte", &[v, c], rep)
            .tensor("wpe", &[self.block_size, c], rep);
        for l in 0..self.n_layer {
            b.unit(format!("block {l}"))
                .tensor(format!("{l}.w1"), &[c, f], rep)
                .tensor(format!("{l}.b1"), &[f], rep)
                .tensor(format!("{l}.w2"), &[f, c], rep)
                .tensor(format!("{l}.b2"), &[c], rep);
        }
        b.unit("head").tensor("head", &[c, v], rep);
        b.build()
    }
    fn synthetic_batch(&self, rng: &mut Rng, b: usize, t: usize) -> Batch {
        let mut ids = || (0..b * t).map(|_| rng.below(self.vocab) as u32).collect();
        Batch::lm(ids(), ids())
    }
    fn activation_elems(&self, _tp: usize, b: usize, t: usize, _: &SpanRun) -> usize {
        let (rows, l) = (b * t, self.n_layer);
        rows * (2 + (l + 1) * self.n_embd + 2 * l * self.n_hidden + self.vocab + 1)
    }
}

impl FamilyEngine for Toy {
    fn engine<B: Backend>(
        &self,
        backend: B,
        tp: TpPlace,
        _recompute: bool,
        _precision: Precision,
    ) -> Result<Box<dyn UnitModel<B>>> {
        let layout = self.layout(1);
        Ok(Box::new(ToyEngine {
            core: EngineCore {
                backend,
                whole: layout.clone(),
                layout,
                tp,
            },
            cfg: self.clone(),
            slots: Vec::new(),
            at: 0,
        }))
    }
}

// ---- the engine ----

struct Acts<B: Backend> {
    shape: (usize, usize, f32, bool),
    host_tokens: Vec<u32>,
    tokens: Buf<B, u32>,
    targets: Buf<B, u32>,
    /// The residual stream entering each block and the head.
    resid: Buf<B>,
    /// Each block's pre-activation and GELU output.
    h: Buf<B>,
    g: Buf<B>,
    logits: Buf<B>,
    losses: Buf<B>,
    dres: Buf<B>,
    dtmp: Buf<B>,
    dg: Buf<B>,
}

struct ToyEngine<B: Backend> {
    core: EngineCore<B>,
    cfg: Toy,
    /// Each slot's activations (`UnitModel::hold`) and the slot held.
    slots: Vec<Option<Acts<B>>>,
    at: usize,
}

impl<B: Backend> ToyEngine<B> {
    fn slot(&mut self) -> &mut Option<Acts<B>> {
        if self.slots.len() <= self.at {
            self.slots.resize_with(self.at + 1, || None);
        }
        &mut self.slots[self.at]
    }
    fn acts(&mut self) -> &mut Acts<B> {
        self.slot().as_mut().expect("begun")
    }
    /// Block l's w1, b1, w2, b2 within its unit.
    fn parts(&self, l: usize) -> [Range<usize>; 4] {
        let lay = &self.core.layout;
        let start = lay.unit(l + 1).start;
        let t = |name: String| {
            let r = lay.tensors.iter().find(|t| t.name == name).unwrap().range();
            r.start - start..r.end - start
        };
        [
            t(format!("{l}.w1")),
            t(format!("{l}.b1")),
            t(format!("{l}.w2")),
            t(format!("{l}.b2")),
        ]
    }
}

impl<B: Backend> UnitModel<B> for ToyEngine<B> {
    fn core(&self) -> &EngineCore<B> {
        &self.core
    }
    fn begin(&mut self, batch: &Batch, b: usize, t: usize, loss_terms: LossTerms) -> Result<()> {
        let loss_terms = loss_terms.targets;
        let Toy {
            vocab,
            n_embd: c,
            n_hidden: f,
            n_layer: l,
            ..
        } = self.cfg;
        let rows = b * t;
        if batch.inputs.len() != rows || batch.inputs.iter().any(|&x| x as usize >= vocab) {
            return Err(Error::Input("a toy batch of other rows or tokens".into()));
        }
        let has_targets = !batch.targets.is_empty();
        if self
            .slot()
            .as_ref()
            .is_none_or(|a| (a.shape.0, a.shape.1) != (b, t))
        {
            let be = self.core.backend.clone();
            let a = |n: usize| be.alloc(n, Category::Activations);
            *self.slot() = Some(Acts {
                shape: (b, t, loss_terms, has_targets),
                host_tokens: Vec::new(),
                tokens: be.alloc_typed(rows, Category::Activations)?,
                targets: be.alloc_typed(rows, Category::Activations)?,
                resid: a((l + 1) * rows * c)?,
                h: a(l * rows * f)?,
                g: a(l * rows * f)?,
                logits: a(rows * vocab)?,
                losses: a(rows)?,
                dres: a(rows * c)?,
                dtmp: a(rows * c)?,
                dg: a(rows * f)?,
            });
        }
        let be = self.core.backend.clone();
        let acts = self.acts();
        acts.shape = (b, t, loss_terms, has_targets);
        acts.host_tokens = batch.inputs.clone();
        be.upload(acts.tokens.d(), &batch.inputs)?;
        if has_targets {
            be.upload(acts.targets.d(), &batch.targets)?;
        }
        Ok(())
    }
    fn outputs(&self) -> Result<Vec<f32>> {
        let a = self.slots[self.at].as_ref().expect("begun");
        self.core.backend.to_host(a.logits.s())
    }
    fn forward(
        &mut self,
        u: usize,
        p: UnitParams<'_, B>,
        _: Option<&dyn Comm>,
    ) -> Result<Option<f32>> {
        let Toy {
            vocab: v,
            n_embd: c,
            n_hidden: f,
            n_layer: nl,
            ..
        } = self.cfg;
        let parts = match UnitKind::of(u, nl) {
            UnitKind::Block(l) => Some(self.parts(l)),
            _ => None,
        };
        let be = self.core.backend.clone();
        let a = self.acts();
        let (b, t, terms, has_targets) = a.shape;
        let rows = b * t;
        match UnitKind::of(u, nl) {
            UnitKind::Embeddings => be.run(EncoderForward {
                out: a.resid.slice_mut(0..rows * c),
                tokens: a.tokens.s(),
                wte: p.own.fp32.first(v * c),
                wpe: p.own.fp32.from(v * c),
                t,
                c,
            })?,
            UnitKind::Block(l) => {
                let [w1, b1, w2, b2] = parts.unwrap().map(|r| p.own.fp32.slice(r));
                let (lo, hi) = a.resid.d().split_at((l + 1) * rows * c);
                let (x, mut out) = (lo.into_src().from(l * rows * c), hi.first(rows * c));
                be.copy(out.rb(), x);
                let mut h = a.h.slice_mut(l * rows * f..(l + 1) * rows * f);
                let mut g = a.g.slice_mut(l * rows * f..(l + 1) * rows * f);
                let io = |dims| MatmulShape::new(dims, WeightLayout::InOut);
                be.run(MatmulForward {
                    out: h.rb().into(),
                    inp: x.into(),
                    w: w1.into(),
                    bias: None,
                    residual: None,
                    shape: io((rows, c, f)),
                    accumulate: false,
                })?;
                // the first bias, added in the activation's passes
                be.run(ActivationForward {
                    out: g.rb().into(),
                    inp: h.src().into(),
                    bias: Some(b1),
                    act: Activation::GeluTanh,
                })?;
                be.run(MatmulForward {
                    out: out.into(),
                    inp: g.src().into(),
                    w: w2.into(),
                    bias: Some(b2),
                    residual: None,
                    shape: io((rows, f, c)),
                    accumulate: true,
                })?;
            }
            UnitKind::Head => {
                be.run(MatmulForward {
                    out: a.logits.d().into(),
                    inp: a.resid.slice(nl * rows * c..(nl + 1) * rows * c).into(),
                    w: p.own.fp32.into(),
                    bias: None,
                    residual: None,
                    shape: MatmulShape::new((rows, c, v), WeightLayout::InOut),
                    accumulate: false,
                })?;
                if !has_targets {
                    return Ok(None);
                }
                be.run(CrossEntropyForward {
                    losses: a.losses.d(),
                    logits: a.logits.s().into(),
                    targets: a.targets.s(),
                    v,
                    vp: v,
                })?;
                return Ok(Some((be.sum(a.losses.s())? / terms as f64) as f32));
            }
        }
        Ok(None)
    }
    fn backward(
        &mut self,
        u: usize,
        p: UnitParams<'_, B>,
        g: UnitGrads<'_, B>,
        _: Option<&dyn Comm>,
        loss_scale: f32,
    ) -> Result<()> {
        let Toy {
            vocab: v,
            n_embd: c,
            n_hidden: f,
            n_layer: nl,
            ..
        } = self.cfg;
        let parts = match UnitKind::of(u, nl) {
            UnitKind::Block(l) => Some(self.parts(l)),
            _ => None,
        };
        let be = self.core.backend.clone();
        let a = self.acts();
        let (b, t, terms, _) = a.shape;
        let rows = b * t;
        let io = |dims| MatmulShape::new(dims, WeightLayout::InOut);
        match UnitKind::of(u, nl) {
            UnitKind::Head => {
                be.run(CrossEntropyBackward {
                    logits: a.logits.d().into(),
                    targets: a.targets.s(),
                    v,
                    vp: v,
                    dloss: loss_scale / terms,
                })?;
                be.run(MatmulBackward {
                    dinp: Some(a.dres.d()),
                    dw: Some(g.own),
                    dbias: None,
                    dout: a.logits.s().into(),
                    inp: a.resid.slice(nl * rows * c..(nl + 1) * rows * c).into(),
                    w: p.own.fp32.into(),
                    shape: io((rows, c, v)),
                })?;
            }
            UnitKind::Block(l) => {
                let [w1, b1, w2, _] = parts.clone().unwrap().map(|r| p.own.fp32.slice(r));
                let [r1, rb1, r2, rb2] = parts.unwrap();
                let mut gd = g.own;
                let (dw2, db2) = gd.rb().split2(r2, rb2);
                be.run(MatmulBackward {
                    dinp: Some(a.dg.d()),
                    dw: Some(dw2),
                    dbias: Some(db2),
                    dout: a.dres.s().into(),
                    inp: a.g.slice(l * rows * f..(l + 1) * rows * f).into(),
                    w: w2.into(),
                    shape: io((rows, f, c)),
                })?;
                let h = a.h.slice(l * rows * f..(l + 1) * rows * f);
                let (dw1, db1) = gd.split2(r1, rb1);
                be.run(ActivationBackward {
                    d: a.dg.d(),
                    inp: h.into(),
                    bias: Some(b1),
                    act: Activation::GeluTanh,
                    dbias: Some(db1),
                    rounded: None,
                })?;
                be.run(MatmulBackward {
                    dinp: Some(a.dtmp.d()),
                    dw: Some(dw1),
                    dbias: None,
                    dout: a.dg.s().into(),
                    inp: a.resid.slice(l * rows * c..(l + 1) * rows * c).into(),
                    w: w1.into(),
                    shape: io((rows, c, f)),
                })?;
                be.add_inplace(a.dres.d(), a.dtmp.s());
            }
            UnitKind::Embeddings => {
                let (dwte, dwpe) = g.own.split_at(v * c);
                be.run(EncoderBackward {
                    dwte,
                    dwpe,
                    dout: a.dres.s(),
                    tokens: a.tokens.s(),
                    host_tokens: &a.host_tokens,
                    t,
                    c,
                })?;
            }
        }
        Ok(())
    }
    fn hold(&mut self, slot: usize) {
        self.at = slot;
    }
    fn free_activations(&mut self) {
        self.slots.clear();
    }
    fn as_stage(&mut self) -> Result<&mut dyn StageModel<B>> {
        Ok(self)
    }
}

impl<B: Backend> StageModel<B> for ToyEngine<B> {
    fn boundary(&mut self, u: usize) -> Dst<'_, B> {
        let c = self.cfg.n_embd;
        let a = self.acts();
        let rows = a.shape.0 * a.shape.1;
        a.resid.slice_mut((u - 1) * rows * c..u * rows * c)
    }
    fn boundary_grad(&mut self) -> Dst<'_, B> {
        self.acts().dres.d()
    }
    fn set_units(&mut self, _units: Range<usize>) {}
}

// ---- the family in use ----

fn registered() -> ModelConfig {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| family::register(&TOY).unwrap());
    ModelConfig::preset("toy-mlp").unwrap()
}

const B: usize = 4;

fn run(par: ParallelConfig, grad_clip: f32) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let model = registered();
    let t = model.block_size();
    let init = model.init_full(5);
    let batch = model.synthetic_batch(&mut Rng::new(9), B, t);
    let mut out = launch::run_local(par.world_size, 2, Duration::from_secs(60), |world| {
        let mut s = parallel::build(
            distgpt::backend::cpu::Cpu::new(),
            model.clone(),
            par,
            world.as_ref(),
            AdamWConfig::default(),
            B,
            t,
        )?;
        s.load_full(&init)?;
        let (mut losses, mut norms) = (Vec::new(), Vec::new());
        for _ in 0..5 {
            let st = s.step(
                std::slice::from_ref(&batch),
                StepConfig {
                    lr: 1e-2,
                    grad_clip,
                },
            )?;
            losses.push(st.loss);
            norms.push(st.grad_norm);
        }
        Ok((losses, norms, s.full_params()?))
    })
    .unwrap_or_else(|e| panic!("{par:?}: {e}"));
    out.swap_remove(0)
}

#[test]
fn a_family_registered_from_outside_trains_under_every_layout_as_single_does() {
    let model = registered();
    assert_eq!(model.family(), "toy MLP");
    // JSON names the family by its key and reads back through the registry
    let json = serde_json::to_value(&model).unwrap();
    assert!(json.get("toy_mlp").is_some(), "{json}");
    assert_eq!(serde_json::from_value::<ModelConfig>(json).unwrap(), model);
    assert!(model.check_tp(2).is_err());

    // model files: written and read back through the family's description
    let dir = scratch("toy-family");
    let params = model.init_full(1);
    let chars = TokenizerSpec::Char {
        chars: "abcdefghijklmnopqrstuvwxyz .".into(),
    };
    distgpt::model::files::write_model(&model, &params, chars, &dir, false).unwrap();
    let (meta, back) = checkpoint::read_model(&dir).unwrap();
    assert_eq!((meta.config, back), (model.clone(), params));
    distgpt::model::files::verify_model_files(&dir, &model).unwrap();
    std::fs::remove_dir_all(&dir).unwrap();

    for clip in [1.0, 0.0] {
        let single = run(ParallelConfig::single(), clip);
        assert!(single.0[4] < single.0[0], "the loss falls: {:?}", single.0);
        let mut layouts: Vec<ParallelConfig> = [
            StrategyKind::Ddp,
            StrategyKind::Zero1,
            StrategyKind::Zero2,
            StrategyKind::Fsdp,
        ]
        .into_iter()
        .map(|s| ParallelConfig {
            strategy: s,
            world_size: 2,
            ..ParallelConfig::single()
        })
        .collect();
        for (stages, world) in [(2, 2), (2, 4)] {
            let mut p = ParallelConfig {
                strategy: StrategyKind::Zero1,
                world_size: world,
                ..ParallelConfig::single()
            };
            p.pipeline.stages = stages;
            layouts.push(p);
        }
        for par in layouts {
            let got = run(par, clip);
            for (step, ((a, b), (na, nb))) in got
                .0
                .iter()
                .zip(&single.0)
                .zip(got.1.iter().zip(&single.1))
                .enumerate()
            {
                assert!(
                    (a - b).abs() <= 1e-5,
                    "{par:?} clip {clip}: step {step} loss {a} vs {b}"
                );
                assert!(
                    (na - nb).abs() <= 1e-5 * nb,
                    "{par:?} clip {clip}: step {step} norm {na} vs {nb}"
                );
            }
            let scale = single.2.iter().fold(0.0f32, |m, x| m.max(x.abs()));
            let err = got
                .2
                .iter()
                .zip(&single.2)
                .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
            assert!(
                err <= 1e-4 * scale,
                "{par:?} clip {clip}: parameters differ by {err}"
            );
        }
    }
}

/// A run directory's config for the toy: batch 4 x its block, `steps` steps.
fn train_config(out: &std::path::Path, steps: usize) -> TrainConfig {
    TrainConfig {
        batch_size: B,
        seq_len: Toy::preset().block_size,
        duration: Steps::Steps(steps),
        checkpoint_every: 3,
        out_dir: out.to_path_buf(),
        peak_flops: Some(1e11),
        ..TrainConfig::default()
    }
}

#[test]
fn the_run_driver_trains_checkpoints_and_resumes_a_registered_family_bit_exactly() {
    registered();
    let ds = Dataset::load(None, TokenizerKind::Char).unwrap();
    let model = Toy {
        vocab: ds.tokenizer.vocab_size(),
        ..Toy::preset()
    };
    let dir = |name: &str| scratch(&format!("toy-{name}"));
    let par = ParallelConfig {
        strategy: StrategyKind::Fsdp,
        world_size: 2,
        ..ParallelConfig::single()
    };
    let wait = Duration::from_secs(60);
    let train =
        |cfg: &TrainConfig| train_lm(Cpu::new, model.clone(), &ds, cfg, par, 2, wait).unwrap();
    let whole = train(&train_config(&dir("whole"), 6));
    let split = dir("split");
    let first = train(&TrainConfig {
        stop_after: Some(3),
        ..train_config(&split, 6)
    });
    let second = train(&TrainConfig {
        resume: Some(checkpoint::state::latest(&split).unwrap()),
        ..train_config(&split, 6)
    });
    let losses: Vec<f32> = first.losses.iter().chain(&second.losses).copied().collect();
    assert_eq!(losses, whole.losses, "per-step losses");
    assert!(second.params == whole.params, "final weights differ");
    // the run's model files are the toy's, readable through its description
    let (meta, params) = checkpoint::read_model(&split).unwrap();
    assert_eq!(meta.config, ModelConfig::from(model));
    assert!(params == whole.params);
}

/// The path `distgpt train` takes: the `lm` task's spec builds the run
/// from inputs (the model asked for, resolved with the data's vocabulary),
/// and a resume makes the task again from the run's record.
#[test]
fn the_lm_task_spec_builds_and_resumes_a_registered_family_as_train_does() {
    use distgpt::train::spec::TaskInputs;
    use distgpt::train::{self as run, TaskData, TaskKind};
    registered();
    let toy = |vocab: Option<usize>| -> Result<ModelConfig> {
        let preset = Toy::preset();
        Ok(Toy {
            vocab: vocab.unwrap_or(preset.vocab),
            ..preset
        }
        .into())
    };
    let inputs = TaskInputs {
        model: &toy,
        init_from: None,
        data: None,
        tokenizer: TokenizerKind::Char,
        tokenizer_given: false,
        seq_len: None,
        block_size: None,
        train_examples: None,
        seed: 0,
    };
    let (data, seq) = TaskData::new(TaskKind::Lm, &inputs).unwrap();
    assert_eq!(seq, Toy::preset().block_size);
    let par = ParallelConfig {
        strategy: StrategyKind::Zero2,
        world_size: 2,
        ..ParallelConfig::single()
    };
    let wait = Duration::from_secs(60);
    let train = |data: &TaskData, cfg: &TrainConfig| {
        data.with_task::<Cpu, _>(|task| run::train(Cpu::new, task, cfg, par, 2, wait))
            .unwrap()
    };
    let whole = train(&data, &train_config(&scratch("toy-spec-whole"), 6));
    let split = scratch("toy-spec-split");
    train(
        &data,
        &TrainConfig {
            stop_after: Some(3),
            ..train_config(&split, 6)
        },
    );
    let record = run::run_dir::read_record(&split).unwrap();
    let ckpt = checkpoint::state::latest(&split).unwrap();
    let index = checkpoint::state::read_index(&ckpt).unwrap();
    let again = TaskData::from_record(&record, &index.tokenizer, &split).unwrap();
    assert_eq!(again.model(), data.model());
    let second = train(
        &again,
        &TrainConfig {
            resume: Some(ckpt),
            ..train_config(&split, 6)
        },
    );
    assert!(second.params == whole.params, "final weights differ");
}
