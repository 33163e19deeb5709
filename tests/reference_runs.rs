//! Every training task against an outside reference, through the path a run
//! takes: the task's own loader (its stream of batches, masks and padding),
//! `parallel::build` of a single rank, the run driver's schedule, clipping
//! and AdamW, and its evaluation. The reference is PyTorch / `transformers`
//! trained on the same starting weights and hyper-parameters
//! (scripts/make_reference_runs.py, fixtures in tests/fixtures/reference_runs),
//! whose batches come from the loaders' specification restated in Python,
//! not from distgpt. "Every layout follows single" cannot see a bug single
//! shares with every layout; these can: a lost padding length, a wrong
//! masking split, an epoch left out of a shuffle's seed, a wrong schedule,
//! decay or clipping each train other numbers.
//!
//! Tolerances are measured gaps with headroom, not guesses (each test prints
//! its own: `cargo test --test reference_runs -- --nocapture`). On an AMD
//! EPYC (family 25 model 17, Zen 4, AVX-512) the largest gaps were: losses
//! 4.8e-7 (lm), 1.8e-7 (classify); gradient norms 5.5e-7 relative; final
//! weights 1.8e-6 and 5.8e-6; the masked LM's (two micro-batches a step
//! since 2026-12-07), on an Intel Xeon (family 6 model 207, AVX-512 BF16):
//! loss 2.4e-7, gradient norm 1.2e-7, weights 5.3e-7; pretraining's there:
//! 9.5e-7, 1.9e-7, 2.4e-7. The tolerance, 2e-5,
//! is about 3.4 times the largest; the one-line bugs these tests were
//! checked against move the numbers by 1e-4 to 1e-1 (weighing a masked
//! LM's micro-batches alike, not by their masks: 2.8e-3 at its first step).
//! The bf16 run (`lm_bf16`, on the same Xeon) holds its first step to the
//! same tolerance and its later steps to their drift (its test says why).

mod fixture;
#[path = "support/scratch.rs"]
mod scratch;

use distgpt::backend::cpu::Cpu;
use distgpt::backend::Device;
use distgpt::checkpoint;
use distgpt::data::{Batch, Dataset, LossTerms, TokenizerKind, IGNORE};
use distgpt::model::bert::{hf, BertHead};
use distgpt::model::{AdamWConfig, ModelConfig, Precision, TpPlace, Whole};
use distgpt::parallel::ParallelConfig;
use distgpt::train::classify::{self, ClassifyTask};
use distgpt::train::lm::LmTask;
use distgpt::train::mlm::{self, MlmTask};
use distgpt::train::spec::TaskInputs;
use distgpt::train::{
    self, Duration, Eval, Task, TaskData, TaskKind, TrainConfig, TrainStream, TrainSummary,
};
use std::path::{Path, PathBuf};

/// How far distgpt may be from the reference.
struct Tolerance {
    /// Per-step losses and the final evaluation losses, absolute.
    loss: f32,
    /// Per-step gradient norms before clipping, relative.
    grad_norm: f32,
    /// Every final weight, absolute.
    weight: f32,
}

const TOLERANCE: Tolerance = Tolerance {
    loss: 2e-5,
    grad_norm: 2e-5,
    weight: 2e-5,
};

/// One task's reference run.
struct Reference {
    dir: PathBuf,
    hyper: serde_json::Value,
    bytes: Vec<u8>,
}

impl Reference {
    fn load(task: &str) -> Self {
        let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/reference_runs")
            .join(task);
        let text = std::fs::read_to_string(dir.join("run.json")).unwrap();
        Reference {
            hyper: serde_json::from_str(&text).unwrap(),
            bytes: std::fs::read(dir.join("reference.safetensors")).unwrap(),
            dir,
        }
    }

    /// The fixture's name (lm, lm_bf16, mlm, ...).
    fn name(&self) -> String {
        self.dir.file_name().unwrap().to_string_lossy().into_owned()
    }

    /// lm, mlm, pretrain or classify.
    fn task(&self) -> &str {
        self.hyper["task"].as_str().unwrap()
    }

    fn tensor(&self, name: &str) -> Vec<f32> {
        fixture::tensor(&self.bytes, name).1
    }

    fn has(&self, name: &str) -> bool {
        safetensors::SafeTensors::deserialize(&self.bytes)
            .unwrap()
            .tensor(name)
            .is_ok()
    }

    fn int(&self, key: &str) -> usize {
        self.hyper[key].as_u64().unwrap() as usize
    }

    fn float(&self, key: &str) -> f32 {
        self.hyper[key].as_f64().unwrap() as f32
    }

    /// The run's configuration as the fixture script trained it, starting
    /// from the fixture's initial weights.
    fn config(&self) -> TrainConfig {
        TrainConfig {
            batch_size: self.int("batch_size"),
            seq_len: self.int("seq_len"),
            grad_accum: self.int("grad_accum"),
            duration: Duration::Steps(self.int("steps")),
            lr: self.float("lr"),
            min_lr: self.float("min_lr"),
            warmup_steps: self.int("warmup"),
            adamw: AdamWConfig {
                beta1: self.float("beta1"),
                beta2: self.float("beta2"),
                eps: self.float("eps"),
                weight_decay: self.float("weight_decay"),
            },
            grad_clip: self.float("grad_clip"),
            eval_batches: self.int("eval_batches"),
            seed: self.int("seed") as u64,
            init_from: Some(self.init_dir()),
            out_dir: scratch::scratch(&format!("reference-{}", self.name())),
            peak_flops: Some(1e11),
            ..TrainConfig::default()
        }
    }

    /// Ids as whole numbers, -100 as [`IGNORE`].
    fn ids(&self, name: &str) -> Vec<u32> {
        self.tensor(name)
            .into_iter()
            .map(|x| if x < 0.0 { IGNORE } else { x as u32 })
            .collect()
    }

    /// The task's training stream gives the reference's micro-batches, in
    /// order, across the epoch boundary each fixture crosses.
    fn check_stream(&self, stream: &mut dyn TrainStream) {
        let (steps, accum) = (self.int("steps"), self.int("grad_accum"));
        for step in 0..steps {
            for k in 0..accum {
                let i = step * accum + k;
                let got = stream.next_batch(step);
                let at = format!("step {} micro-batch {k}", step + 1);
                assert_eq!(
                    got.inputs,
                    self.ids(&format!("batch.{i}.inputs")),
                    "{at}: inputs"
                );
                assert_eq!(
                    got.targets,
                    self.ids(&format!("batch.{i}.targets")),
                    "{at}: targets"
                );
                // a classifier's lengths before [PAD]; pretraining's token
                // types and next-sentence labels
                for (name, got) in [
                    ("lens", &got.lens),
                    ("types", &got.types),
                    ("seq_targets", &got.seq_targets),
                ] {
                    let key = format!("batch.{i}.{name}");
                    if self.has(&key) {
                        assert_eq!(got, &self.ids(&key), "{at}: {name}");
                    }
                }
            }
        }
    }

    /// Every step's learning rate, loss and gradient norm against the
    /// reference's, within [`TOLERANCE`]; with `drift` (a bf16 run), the
    /// losses after the first within it and their norms unchecked. The
    /// largest loss and (relative) norm gaps.
    fn check_steps(&self, s: &TrainSummary, drift: Option<f32>) -> (f32, f32) {
        let (lr, loss, norm) = (
            self.tensor("lr"),
            self.tensor("loss"),
            self.tensor("grad_norm"),
        );
        assert_eq!(s.history.len(), loss.len(), "steps");
        let (mut worst_loss, mut worst_norm) = (0.0f32, 0.0f32);
        for (i, r) in s.history.iter().enumerate() {
            let step = i + 1;
            assert!(
                (r.lr - lr[i]).abs() <= 1e-6 * lr[i],
                "step {step}: learning rate {} vs {}",
                r.lr,
                lr[i]
            );
            let later = drift.filter(|_| step > 1);
            let e = (r.loss - loss[i]).abs();
            worst_loss = worst_loss.max(e);
            assert!(
                e <= later.unwrap_or(TOLERANCE.loss),
                "step {step}: loss {} vs the reference's {}",
                r.loss,
                loss[i]
            );
            if later.is_some() {
                continue;
            }
            let e = (r.grad_norm - norm[i]).abs() / norm[i];
            worst_norm = worst_norm.max(e);
            assert!(
                e <= TOLERANCE.grad_norm,
                "step {step}: gradient norm {} vs the reference's {}",
                r.grad_norm,
                norm[i]
            );
        }
        (worst_loss, worst_norm)
    }

    /// The run's steps and final weights against the reference's.
    fn check_run(&self, model: &ModelConfig, s: &TrainSummary, final_params: &[f32]) {
        let (worst_loss, worst_norm) = self.check_steps(s, None);
        let norm = self.tensor("grad_norm");
        // the tokens each step counts for throughput: a classifier's real
        // tokens (its padding and a short batch's filler rows left out),
        // every token otherwise
        let accum = self.int("grad_accum");
        for (i, r) in s.history.iter().enumerate() {
            let want: f64 = (0..accum)
                .map(|k| {
                    let at = i * accum + k;
                    let lens = format!("batch.{at}.lens");
                    let real = |(&len, &target): (&f32, &u32)| (target != IGNORE).then_some(len);
                    match self.has(&lens) {
                        true => (self.tensor(&lens).iter())
                            .zip(&self.ids(&format!("batch.{at}.targets")))
                            .filter_map(real)
                            .sum::<f32>() as f64,
                        false => self
                            .tensor(&format!("batch.{}.inputs", i * accum + k))
                            .len() as f64,
                    }
                })
                .sum();
            let got = r.tokens_per_s * r.ms / 1e3;
            assert!(
                (got - want).abs() <= 1e-6 * want,
                "step {}: {got} tokens counted, {want} trained on",
                i + 1
            );
            // MFU: the model's FLOPs a token at those tokens/s over the
            // stated peak (--peak-tflops 0.1)
            let mfu = model.flops_per_token(self.int("seq_len")) * r.tokens_per_s / 1e11;
            assert!(
                (r.mfu - mfu).abs() <= 1e-9 * mfu,
                "step {}: MFU {} vs {mfu}",
                i + 1,
                r.mfu
            );
        }
        let epoch = self.tensor("epoch");
        for (i, r) in s.history.iter().enumerate() {
            assert!(
                (r.epoch - epoch[i] as f64).abs() <= 1e-6,
                "step {}: the record says epoch {}, the data stands at {}",
                i + 1,
                r.epoch,
                epoch[i]
            );
        }
        assert!(
            epoch.last().is_some_and(|&e| e > 1.0),
            "the fixture stays in its first epoch"
        );
        // the run's record names the task and the data
        let record = train::run_dir::read_record(&s.out_dir).unwrap();
        assert_eq!(record.task.to_string(), self.task());
        assert!(
            record
                .dataset
                .contains(self.hyper["data"].as_str().unwrap()),
            "run.json names the data {}",
            record.dataset
        );
        assert!(
            norm.iter().any(|&n| n > self.float("grad_clip")),
            "the reference clips at no step: clipping would go untested"
        );
        assert_eq!(s.params.len(), final_params.len(), "parameters");
        let layout = model.layout(1);
        let (mut worst_weight, mut worst_at) = (0.0f32, 0);
        for t in &layout.tensors {
            let key_bias = key_bias(&t.name, t.range().len());
            for i in t.range().filter(|i| !key_bias.contains(&(i - t.offset))) {
                let e = (s.params[i] - final_params[i]).abs();
                if e > worst_weight {
                    (worst_weight, worst_at) = (e, i);
                }
                assert!(
                    e <= TOLERANCE.weight,
                    "{} element {}: {} after the last step, the reference's {}",
                    t.name,
                    i - t.offset,
                    s.params[i],
                    final_params[i]
                );
            }
        }
        let tensor = layout
            .tensors
            .iter()
            .find(|t| t.range().contains(&worst_at))
            .map_or("?", |t| t.name.as_str());
        eprintln!(
            "{}: largest gaps: loss {worst_loss:.2e}, gradient norm {worst_norm:.2e} (relative), final weight {worst_weight:.2e} (in {tensor})",
            self.name()
        );
        // the model files the run wrote hold its final weights
        assert!(
            self.read_params(&s.out_dir) == s.params,
            "the run's model files differ from its final weights"
        );
        // the run moved the weights far past the tolerance: a step that did
        // nothing could not pass
        let init = self.initial_params();
        let moved = init
            .iter()
            .zip(final_params)
            .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(
            moved > 100.0 * TOLERANCE.weight,
            "training moved the weights by {moved}"
        );
    }

    /// A bf16 reference run: its first step's gradient
    /// ([`Reference::check_bf16_gradient`]), then the run through the
    /// path a run takes: the first step's loss and gradient norm within
    /// the fp32 runs' tolerance, later steps' losses and the validation
    /// loss within [`BF16_DRIFT`].
    fn check_bf16_run(&self, task: &dyn Task<Cpu>) {
        let model = Task::<Cpu>::model(task);
        self.check_bf16_gradient(&model, &self.initial_params());
        let s = run(task, self);
        let (drift, _) = self.check_steps(&s, Some(BF16_DRIFT));
        let val = s.val.expect("the run evaluates at its last step").loss;
        let want = self.tensor("val_loss")[0];
        eprintln!(
            "{}: losses within {drift:.2e}; val_loss {val} vs {want}",
            self.name()
        );
        assert!((val - want).abs() <= BF16_DRIFT, "val_loss {val} vs {want}");
    }

    /// The first step's gradient under `--precision bf16` (its
    /// micro-batches, each a share of the step's loss terms, as a run
    /// weighs them), element by element against the reference's
    /// `grad.<name>` read as the model's weights are, each gap measured
    /// against its tensor's largest: at most [`BF16_FLIPS`] of all the
    /// elements past the fp32 runs' tolerance, none past
    /// [`BF16_FLIPPED`]. A value a last fp32 bit apart on the two sides
    /// (a product's sums in BLIS's order, a LayerNorm's backward in
    /// distgpt's) now and then rounds to the other bf16 where it is held
    /// or multiplied: one bf16 step, which moves the gradients it feeds.
    /// Measured on the Xeon the header names: GPT-2's every element within
    /// 2.6e-7 where the products sum in PyTorch's order, 0.24% past (worst
    /// 9.1e-5) on BLIS; BERT's 3.2% past (worst 4.3e-4) on every library.
    /// A rounding point missed or added in the forward or in attention
    /// moves most of them: the q|k|v bias added unrounded (GPT-2 89%,
    /// worst 5.8e-3; BERT 80%, 3.9e-3), attention's P or dS unrounded in
    /// the backward (GPT-2 91%, 2.2e-3 and 1.5e-3), BERT's intermediate
    /// product held in fp32 (81%, 6.0e-3). A slip that moves one bias's
    /// gradient alone (q|k|v's gradient or BERT's logits' gradient summed
    /// unrounded: 0.3% and 3.4% of the elements) stays inside the bound:
    /// `a_bf16_qkv_gradient_is_held_in_bf16` guards those.
    fn check_bf16_gradient(&self, model: &ModelConfig, init: &[f32]) {
        let (b, t) = (self.int("batch_size"), self.int("seq_len"));
        let engine = model
            .engine(Cpu::new(), TpPlace::NONE, false, Precision::Bf16)
            .unwrap();
        let mut m = Whole::boxed(engine).unwrap();
        m.set_params(init).unwrap();
        let batches: Vec<Batch> = (0..self.int("grad_accum"))
            .map(|k| {
                Batch::lm(
                    self.ids(&format!("batch.{k}.inputs")),
                    self.ids(&format!("batch.{k}.targets")),
                )
            })
            .collect();
        let terms: LossTerms = batches.iter().map(Batch::loss_terms).sum();
        for batch in &batches {
            m.run_forward(batch, (b, t), terms, None).unwrap();
            m.run_backward(1.0, None, |_, _, _| Ok(())).unwrap();
        }
        let got = m.backend().to_host(m.grads.s()).unwrap();
        let want = self.reference_gradient();
        let (mut past, mut worst) = (0, (0.0f32, String::new()));
        for tensor in &model.layout(1).tensors {
            let (got, want) = (&got[tensor.range()], &want[tensor.range()]);
            let largest = want.iter().fold(f32::MIN_POSITIVE, |m, x| m.max(x.abs()));
            for (i, (g, w)) in got.iter().zip(want).enumerate() {
                let e = (g - w).abs() / largest;
                past += usize::from(e > TOLERANCE.weight);
                if e > worst.0 {
                    worst = (
                        e,
                        format!("{} element {i}: {g} vs the reference's {w}", tensor.name),
                    );
                }
            }
        }
        let share = past as f32 / got.len() as f32;
        eprintln!(
            "{}: {:.2}% of the first step's gradient past {:.0e} of its tensor's largest; worst {:.2e} ({})",
            self.name(), 100.0 * share, TOLERANCE.weight, worst.0, worst.1
        );
        assert!(
            share <= BF16_FLIPS && worst.0 <= BF16_FLIPPED,
            "{:.2}% of the first step's gradient past {:.0e} of its tensor's largest; worst {:.2e}: {}",
            100.0 * share, TOLERANCE.weight, worst.0, worst.1
        );
    }

    /// The reference's first-step gradient (`grad.<name>`) in the model's
    /// layout: written as a model folder beside the run's starting
    /// config, then read as the weights are.
    fn reference_gradient(&self) -> Vec<f32> {
        let dir = scratch::scratch(&format!("reference-{}-gradient", self.name()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::copy(self.init_dir().join("config.json"), dir.join("config.json")).unwrap();
        let st = safetensors::SafeTensors::deserialize(&self.bytes).unwrap();
        let grads: Vec<_> = st
            .tensors()
            .into_iter()
            .filter_map(|(n, v)| n.strip_prefix("grad.").map(|n| (n.to_string(), v)))
            .collect();
        std::fs::write(
            dir.join("model.safetensors"),
            safetensors::serialize(grads, &None).unwrap(),
        )
        .unwrap();
        self.read_params(&dir)
    }

    fn initial_params(&self) -> Vec<f32> {
        self.read_params(&self.init_dir())
    }

    /// The folder of the run's starting weights (and its text): its own,
    /// or, where `run.json` names another run's (`"init": "lm"`), that
    /// run's.
    fn source_dir(&self) -> PathBuf {
        match self.hyper["init"].as_str() {
            Some(run) => self.dir.with_file_name(run),
            None => self.dir.clone(),
        }
    }

    fn init_dir(&self) -> PathBuf {
        self.source_dir().join("init")
    }

    /// The run's parallel layout: single, in the run's precision.
    fn parallel(&self) -> ParallelConfig {
        ParallelConfig {
            precision: match self.hyper["precision"].as_str() {
                Some("bf16") => Precision::Bf16,
                _ => Precision::Fp32,
            },
            ..ParallelConfig::single()
        }
    }

    /// The weights in a model folder of this task's kind.
    fn read_params(&self, dir: &Path) -> Vec<f32> {
        let classifier = Some(BertHead::Classify { labels: 2 });
        match self.task() {
            "lm" => checkpoint::read_model(dir).unwrap().1,
            "mlm" => hf::load_folder(dir, Some(BertHead::Mlm), 0).unwrap().1,
            "pretrain" => hf::load_folder(dir, Some(BertHead::Pretrain), 0).unwrap().1,
            _ => hf::load_folder(dir, classifier, 0).unwrap().1,
        }
    }

    /// The validation figures after the last step: the loss, and the
    /// examples it was taken over.
    fn check_val(&self, val: Option<Eval>) {
        let val = val.expect("the run evaluates at its last step");
        self.check_eval_loss("val_loss", val.loss);
        let examples = self.tensor("val_examples")[0] as usize;
        assert_eq!(val.examples, examples, "validation examples");
        // pretraining's next-sentence predictions, scored as a classifier's
        if self.has("val_right") {
            let right = self.tensor("val_right");
            let accuracy = right[0] as f64 / right[1] as f64;
            assert_eq!(val.accuracy, Some(accuracy), "next-sentence accuracy");
            let f1 = self.tensor("val_f1")[0] as f64;
            let got = val.f1.expect("a next-sentence F1");
            assert!((got - f1).abs() < 1e-6, "next-sentence F1 {got} vs {f1}");
        }
    }

    fn check_eval_loss(&self, what: &str, got: f32) {
        let want = self.tensor(what)[0];
        eprintln!("{}: {what} {got} vs {want}", self.name());
        assert!(
            (got - want).abs() <= TOLERANCE.loss,
            "{what} {got} vs the reference's {want}"
        );
    }
}

/// The key bias's elements of an attention block's fused query/key/value
/// bias `name` of `len` elements (none for another tensor). Its gradient is
/// zero in exact arithmetic (softmax does not change when every score of a
/// query moves by the same q.b_k), so AdamW moves it on rounding noise,
/// normalised to about the learning rate a step, on both sides alike, and
/// it cannot change any output: it is left out of the weight comparison.
fn key_bias(name: &str, len: usize) -> std::ops::Range<usize> {
    match name.ends_with("attn.c_attn.bias") || name.ends_with("attention.self.qkv.bias") {
        true => len / 3..2 * len / 3,
        false => 0..0,
    }
}

/// The steps whose records carry a validation loss, and the test scores:
/// a classifier evaluates at each epoch's end and scores its test split;
/// the others evaluate at the last step only (no --eval-every), have no
/// test split and, as encoders, no sample.
fn check_evaluations(s: &TrainSummary, val_steps: &[usize], tested: bool) {
    let evaluated: Vec<usize> = s
        .history
        .iter()
        .filter(|r| r.val_loss.is_some())
        .map(|r| r.step)
        .collect();
    assert_eq!(evaluated, val_steps, "the steps evaluated");
    assert_eq!(s.test.is_some(), tested, "test scores");
}

/// Trains `task` as `reference` was, on one rank built by `parallel::build`.
fn run(task: &dyn Task<Cpu>, reference: &Reference) -> TrainSummary {
    let cfg = reference.config();
    reference.check_stream(task.train_stream(&cfg).unwrap().as_mut());
    train::train(
        Cpu::new,
        task,
        &cfg,
        reference.parallel(),
        2,
        std::time::Duration::from_secs(300),
    )
    .unwrap()
}

#[test]
fn gpt2_language_model_trains_as_pytorch_does() {
    gpt2_language_model("lm");
}

/// The same run under `--precision bf16` against PyTorch trained with
/// the rounding points docs/backends.md specifies (the script's
/// `gpt2_bf16_logits`: which activations are held in bf16, which
/// gradients, every product's operands rounded), not distgpt's kernels.
/// The first step is held to the fp32 runs' tolerance: its loss, its
/// gradient's norm and, through the engine every layout runs, its
/// gradient tensor by tensor. From the second step on, master weights
/// a few fp32 ulps apart (AdamW's first steps move every weight by about
/// the learning rate, whatever the size of its gradient) round to bf16
/// copies one bf16 step apart: the losses drift by about 1e-4, as any
/// two bf16 implementations' do, so they are held to [`BF16_DRIFT`].
#[test]
fn gpt2_language_model_in_bf16_trains_as_its_rounding_points_say() {
    let r = Reference::load("lm_bf16");
    let ds = Dataset::load(Some(&r.source_dir().join("text.txt")), TokenizerKind::Char).unwrap();
    let (meta, _) = checkpoint::read_model(&r.init_dir()).unwrap();
    let task = LmTask {
        model: meta.config,
        data: &ds,
    };
    r.check_bf16_run(&task);
}

/// BERT's masked LM under `--precision bf16`, as GPT-2's above: its own
/// rounding points (q|k|v, the intermediate product and GELU's output
/// held in bf16; the attention's output and the logits in fp32, the
/// logits' gradient in bf16), in the script's `bert_bf16_logits`.
#[test]
fn bert_masked_lm_in_bf16_trains_as_its_rounding_points_say() {
    let r = Reference::load("mlm_bf16");
    let ds = Dataset::load(Some(&r.source_dir().join("text.txt")), TokenizerKind::Char).unwrap();
    let (shape, _) = hf::load_folder(&r.init_dir(), Some(BertHead::Mlm), 0).unwrap();
    r.check_bf16_run(&MlmTask::new(&shape, &ds, r.int("seq_len")));
}

/// How far a bf16 run's losses after its first step may drift from the
/// reference's: about three and a half times the largest measured on the
/// Xeon the header names (GPT-2's steps up to 3.6e-4 and validation loss
/// 3.7e-4; BERT's masked LM's steps up to 5.8e-4 and validation loss
/// 7.1e-4, on the bf16 units), a fiftieth of what training moves either
/// loss in ten steps; a bf16 weight copy a step stale moves GPT-2's second
/// step by 0.17.
const BF16_DRIFT: f32 = 2.5e-3;

/// The share of the first step's gradient a bf16 rounding flipped by a
/// last fp32 bit may move past the fp32 tolerance (4.6 times BERT's
/// 3.2%).
const BF16_FLIPS: f32 = 0.15;

/// How far (of its tensor's largest) such a flip may move a gradient
/// (4.6 times BERT's 4.3e-4).
const BF16_FLIPPED: f32 = 2e-3;

fn gpt2_language_model(run_name: &str) {
    let r = Reference::load(run_name);
    let ds = Dataset::load(Some(&r.source_dir().join("text.txt")), TokenizerKind::Char).unwrap();
    let (meta, _) = checkpoint::read_model(&r.init_dir()).unwrap();
    let task = LmTask {
        model: meta.config,
        data: &ds,
    };
    let s = run(&task, &r);
    let want = checkpoint::read_model(&r.dir.join("final")).unwrap().1;
    r.check_run(&Task::<Cpu>::model(&task), &s, &want);
    r.check_val(s.val);
    check_evaluations(&s, &[10], false);
}

/// A step whose gradient is clipped to a global norm of 1e-12 has no
/// element above 1e-12, far below AdamW's eps (1e-8): torch.optim.AdamW's
/// update, `p (1 - lr wd) - lr m_hat / (sqrt(v_hat) + eps)`, then moves a
/// weight by at most lr 1e-4 past its decay, and the decay alone is left:
/// p (1 - lr wd) for the 2-D tensors (nanoGPT's rule), p for the rest. A
/// clip the step does not take at the asked norm (the reference's 1 is
/// the default), or a decay on the wrong tensors or at the wrong rate,
/// moves weights by about lr.
#[test]
fn a_gradient_clipped_to_almost_nothing_moves_the_weights_by_their_decay_alone() {
    let r = Reference::load("lm");
    let ds = Dataset::load(Some(&r.dir.join("text.txt")), TokenizerKind::Char).unwrap();
    let (meta, _) = checkpoint::read_model(&r.dir.join("init")).unwrap();
    let task = LmTask {
        model: meta.config,
        data: &ds,
    };
    let cfg = TrainConfig {
        duration: Duration::Steps(1),
        warmup_steps: 0,
        grad_clip: 1e-12,
        out_dir: scratch::scratch("reference-lm-clipped"),
        ..r.config()
    };
    let s = train::train(
        Cpu::new,
        &task,
        &cfg,
        ParallelConfig::single(),
        2,
        std::time::Duration::from_secs(300),
    )
    .unwrap();
    // without warmup the one step is at the peak rate
    let lr = cfg.lr;
    assert_eq!(s.history[0].lr, lr, "the step's learning rate");
    let decayed = 1.0 - lr * cfg.adamw.weight_decay;
    let init = r.initial_params();
    for t in &Task::<Cpu>::model(&task).layout(1).tensors {
        let factor = if t.full_shape.len() == 2 {
            decayed
        } else {
            1.0
        };
        for i in t.range() {
            let want = init[i] * factor;
            assert!(
                (s.params[i] - want).abs() <= lr * 1e-4 + 1e-7,
                "{} element {}: {} after the step, {want} by its decay alone ({} before)",
                t.name,
                i - t.offset,
                s.params[i],
                init[i]
            );
        }
    }
}

#[test]
fn bert_masked_lm_trains_as_transformers_does() {
    let r = Reference::load("mlm");
    let ds = Dataset::load(Some(&r.dir.join("text.txt")), TokenizerKind::Char).unwrap();
    let (shape, _) = hf::load_folder(&r.dir.join("init"), Some(BertHead::Mlm), 0).unwrap();
    let task = MlmTask::new(&shape, &ds, r.int("seq_len"));
    let s = run(&task, &r);
    let (_, want) = hf::load_folder(&r.dir.join("final"), Some(BertHead::Mlm), 0).unwrap();
    r.check_run(&Task::<Cpu>::model(&task), &s, &want);
    r.check_val(s.val);
    check_evaluations(&s, &[10], false);
    assert!(s.sample.is_empty(), "an encoder samples nothing");
    // `eval` of the reference's own final folder gives its validation loss
    let cfg = r.config();
    let folder = mlm::evaluate_folder(Cpu::new(), &r.dir.join("final"), &ds, &cfg, 2).unwrap();
    r.check_val(Some(folder));
    // and refuses a text of other characters, or a classifier's folder
    let other = Dataset::load(Some(&r.dir.join("../lm/text.txt")), TokenizerKind::Char).unwrap();
    assert_ne!(other.tokenizer.vocab_size(), ds.tokenizer.vocab_size());
    let final_dir = r.dir.join("final");
    let err = mlm::evaluate_folder(Cpu::new(), &final_dir, &other, &cfg, 2).unwrap_err();
    assert!(err.to_string().contains("not a masked LM"), "{err}");
    let classifier = r.dir.join("../classify/final");
    let err = mlm::evaluate_folder(Cpu::new(), &classifier, &ds, &cfg, 2).unwrap_err();
    assert!(err.to_string().contains("not a masked LM"), "{err}");
}

/// BERT's pretraining (masked LM and next-sentence prediction) from a
/// folder with its vocab.txt, on its WordPiece tokens of a text, built as
/// `train --task pretrain --init-from` builds it: the sentence pairs each
/// window is cut into, their token types and labels, masks that spare
/// [CLS] and [SEP], each head's loss weighed by its own targets over a
/// step's micro-batches, and the evaluation's next-sentence accuracy.
#[test]
fn bert_pretraining_trains_as_transformers_does() {
    let r = Reference::load("pretrain");
    let cfg = r.config();
    let text = r.dir.join("text.txt");
    // the model is the folder's: no preset is asked for
    let no_preset = |_| Err(distgpt::error::Error::Config("a preset".into()));
    let inputs = TaskInputs {
        model: &no_preset,
        init_from: cfg.init_from.as_deref(),
        data: Some(&text),
        tokenizer: TokenizerKind::Char,
        tokenizer_given: false,
        seq_len: Some(cfg.seq_len),
        block_size: None,
        train_examples: None,
        seed: cfg.seed,
    };
    let (data, seq_len) = TaskData::new(TaskKind::Pretrain, &inputs).unwrap();
    assert_eq!(seq_len, cfg.seq_len);
    let s = data.with_task(|task: &dyn Task<Cpu>| {
        let s = run(task, &r);
        let head = Some(BertHead::Pretrain);
        let (_, want) = hf::load_folder(&r.dir.join("final"), head, 0).unwrap();
        r.check_run(&task.model(), &s, &want);
        s
    });
    r.check_val(s.val);
    check_evaluations(&s, &[10], false);
    // the run's folder is a BertForPreTraining with the vocabulary it read
    let vocab = std::fs::read_to_string(s.out_dir.join("vocab.txt")).unwrap();
    assert_eq!(
        vocab,
        std::fs::read_to_string(r.dir.join("init/vocab.txt")).unwrap()
    );
}

#[test]
fn bert_classifier_fine_tunes_as_transformers_does() {
    let r = Reference::load("classify");
    let cfg = r.config();
    let task = ClassifyTask::new(
        cfg.init_from.as_ref().unwrap(),
        &r.dir.join("data"),
        None,
        cfg.seq_len,
        cfg.seed,
    )
    .unwrap();
    let s = run(&task, &r);
    let head = Some(BertHead::Classify { labels: 2 });
    let (_, want) = hf::load_folder(&r.dir.join("final"), head, 0).unwrap();
    r.check_run(&Task::<Cpu>::model(&task), &s, &want);
    // two epochs of three batches
    check_evaluations(&s, &[3, 6], true);
    // classify.json's epochs: each the mean of its steps' losses (the
    // reference's), its steps' time and throughput, its evaluation
    let epochs = classify::epoch_records(&s.history);
    assert_eq!(epochs.iter().map(|e| e.epoch).collect::<Vec<_>>(), [1, 2]);
    let loss = r.tensor("loss");
    for (e, steps) in epochs.iter().zip([0..3, 3..6]) {
        let want = loss[steps.clone()].iter().map(|&l| l as f64).sum::<f64>() / 3.0;
        let got = e.train_loss as f64;
        assert!(
            (got - want).abs() <= TOLERANCE.loss as f64,
            "epoch {}: train loss {got} vs {want}",
            e.epoch
        );
        let h = &s.history[steps];
        let seconds: f64 = h.iter().map(|r| r.ms / 1e3).sum();
        assert!(
            (e.seconds - seconds).abs() <= 1e-9 * seconds,
            "epoch {} seconds",
            e.epoch
        );
        let tokens: f64 = h.iter().map(|r| r.tokens_per_s * r.ms / 1e3).sum();
        let rate = tokens / seconds;
        assert!(
            (e.tokens_per_s - rate).abs() <= 1e-9 * rate,
            "epoch {} tokens/s",
            e.epoch
        );
        let last = h.last().unwrap();
        assert_eq!(Some(e.val.loss), last.val_loss);
        assert_eq!(
            (Some(e.val.accuracy), Some(e.val.f1)),
            (last.val_accuracy, last.val_f1)
        );
    }
    assert_eq!(epochs[1].val.loss, s.val.unwrap().loss);
    // a tenth of the steps warm up unless asked: 6 steps -> 1, 20 epochs of 3 -> 6
    assert_eq!(task.default_warmup(&cfg), 1);
    let long = TrainConfig {
        duration: Duration::Epochs(20.0),
        ..cfg.clone()
    };
    assert_eq!(task.default_warmup(&long), 6);
    for (split, eval) in [("val", s.val), ("test", s.test)] {
        let eval = eval.unwrap_or_else(|| panic!("no {split} scores"));
        r.check_eval_loss(&format!("{split}_loss"), eval.loss);
        let right = r.tensor(&format!("{split}_right"));
        assert_eq!(eval.examples, right[1] as usize, "{split} examples");
        let accuracy = right[0] as f64 / right[1] as f64;
        assert_eq!(eval.accuracy, Some(accuracy), "{split} accuracy");
        let f1 = r.tensor(&format!("{split}_f1"))[0] as f64;
        let got = eval.f1.unwrap();
        assert!((got - f1).abs() < 1e-6, "{split} F1 {got} vs {f1}");
    }
    // `eval` of the reference's own final folder gives its test scores
    let data = r.dir.join("data");
    let (b, t) = (cfg.batch_size, cfg.seq_len);
    let scores =
        classify::evaluate_folder(Cpu::new(), &r.dir.join("final"), &data, b, t, 2).unwrap();
    r.check_eval_loss("test_loss", scores.loss);
    let right = r.tensor("test_right");
    assert_eq!(scores.examples, right[1] as usize, "test examples");
    assert_eq!(
        scores.accuracy,
        right[0] as f64 / right[1] as f64,
        "test accuracy"
    );
}
