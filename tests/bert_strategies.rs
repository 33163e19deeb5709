//! Every strategy follows `single` for BERT as it does for GPT-2: the same
//! initial weights and global batches (padded sequences, token types,
//! masked-LM targets with ignored positions, one label per sequence, or
//! pretraining's both),
//! five AdamW steps with clipping; per-step losses within 1e-5, gradient
//! norms within 1e-5 of single's and final parameters within 1e-4 of the
//! largest, on 2 and 4 thread ranks, with accumulation and recomputation;
//! and with clipping off, where only the norm shows a norm counted wrongly.
//! Strategies drive BERT through the same model seam as GPT-2
//! (`model::UnitModel`).

#[path = "support/scratch.rs"]
mod scratch;
use scratch::scratch;

use distgpt::backend::cpu::Cpu;
use distgpt::data::{Batch, IGNORE};
use distgpt::model::bert::{init_full, BertConfig, BertHead};
use distgpt::model::AdamWConfig;
use distgpt::parallel::{self, launch, ParallelConfig, StepConfig, StrategyKind};
use distgpt::rng::Rng;
use std::time::Duration;

const B: usize = 8;
const T: usize = 12;
const STEPS: usize = 5;

fn model(head: BertHead) -> BertConfig {
    BertConfig {
        n_layer: 2,
        n_head: 4,
        n_embd: 32,
        n_inner: 64,
        block_size: 16,
        type_vocab: 2,
        vocab_size: 67,
        layer_norm_eps: 1e-12,
        head,
    }
}

/// `accum` global micro-batches, the same every step (so the loss must
/// fall): random tokens and types, lengths from 1 to T, a third of the real
/// tokens masked for MLM (the rest ignored) or a label per sequence, or
/// for pretraining both (a next-sentence label per sequence).
fn batches(cfg: &BertConfig, accum: usize) -> Vec<Batch> {
    let mut rng = Rng::new(7);
    (0..accum)
        .map(|_| {
            let lens: Vec<u32> = (0..B).map(|_| 1 + rng.below(T) as u32).collect();
            let inputs = (0..B * T)
                .map(|_| rng.below(cfg.vocab_size) as u32)
                .collect();
            let types = (0..B * T).map(|_| rng.below(2) as u32).collect();
            let targets = match cfg.head {
                BertHead::Mlm | BertHead::Pretrain => (0..B * T)
                    .map(|i| {
                        let real = (i % T) < lens[i / T] as usize;
                        match real && rng.below(3) == 0 {
                            true => rng.below(cfg.vocab_size) as u32,
                            false => IGNORE,
                        }
                    })
                    .collect(),
                BertHead::Classify { labels } => (0..B).map(|_| rng.below(labels) as u32).collect(),
            };
            let seq_targets = match cfg.head {
                BertHead::Pretrain => (0..B).map(|_| rng.below(2) as u32).collect(),
                _ => Vec::new(),
            };
            Batch {
                inputs,
                targets,
                types,
                lens,
                seq_targets,
            }
        })
        .collect()
}

/// What a run is compared by: every step's loss and global gradient norm,
/// and the final whole-model parameters (the same on every rank).
struct Run {
    losses: Vec<f32>,
    grad_norms: Vec<f32>,
    params: Vec<f32>,
}

/// A run with the gradient's global norm clipped at 1.
fn run(cfg: &BertConfig, par: ParallelConfig, accum: usize) -> Run {
    run_clipped(cfg, par, accum, 1.0)
}

/// A run clipping the gradient's global norm at `grad_clip` (0: off).
fn run_clipped(cfg: &BertConfig, par: ParallelConfig, accum: usize, grad_clip: f32) -> Run {
    let init = init_full(cfg, 3);
    let data = batches(cfg, accum);
    let out = launch::run_local(par.world_size, 2, Duration::from_secs(60), |world| {
        let mut s = parallel::build(
            Cpu::new(),
            cfg.clone(),
            par,
            world.as_ref(),
            AdamWConfig::default(),
            B,
            T,
        )?;
        s.load_full(&init)?;
        let (mut losses, mut grad_norms) = (Vec::new(), Vec::new());
        for _ in 0..STEPS {
            let st = s.step(
                &data,
                StepConfig {
                    lr: 3e-3,
                    grad_clip,
                },
            )?;
            losses.push(st.loss);
            grad_norms.push(st.grad_norm);
        }
        Ok(Run {
            losses,
            grad_norms,
            params: s.full_params()?,
        })
    })
    .unwrap_or_else(|e| panic!("{par:?}: {e}"));
    // `full_params` is the whole model on every rank, not only on rank 0
    let mut ranks = out.into_iter();
    let first = ranks.next().expect("rank 0");
    for (r, other) in ranks.enumerate() {
        assert!(
            other.params == first.params,
            "{par:?}: rank {}'s full_params differs from rank 0's",
            r + 1
        );
    }
    first
}

/// How far a run may be from single's: losses (absolute), gradient norms
/// (relative to single's), parameters (relative to the largest).
struct Tolerances {
    loss: f32,
    grad_norm: f32,
    params: f32,
}

/// Losses within 1e-5, gradient norms within 1e-5 of single's, parameters
/// within 1e-4 of the largest.
const FP32_TOL: Tolerances = Tolerances {
    loss: 1e-5,
    grad_norm: 1e-5,
    params: 1e-4,
};
/// In bf16 a different reduction order can flip a rounding (2^-8) of an
/// operand, tensor parallelism's split sums most of all, and AdamW turns a
/// flipped term of a small gradient into a whole step: the losses and norms
/// stay close, a parameter may move by more. Since attention's products
/// round their operands too (probabilities near 1 among them), tp's runs
/// end up to 5.6e-5 from single's losses, 7.1e-5 from its norms and 2.1e-3
/// of the largest parameter (2e-7, 1.4e-5 and 1.1e-4 before).
const BF16_TOL: Tolerances = Tolerances {
    loss: 1e-4,
    grad_norm: 2e-4,
    params: 5e-3,
};

fn assert_follows(want: &Run, got: &Run, what: &str) {
    assert_follows_within(want, got, what, &FP32_TOL)
}

fn assert_follows_within(want: &Run, got: &Run, what: &str, tol: &Tolerances) {
    for (i, (w, g)) in want.losses.iter().zip(&got.losses).enumerate() {
        assert!(
            (w - g).abs() <= tol.loss,
            "{what}: step {i} loss {g} vs single {w}"
        );
    }
    for (i, (w, g)) in want.grad_norms.iter().zip(&got.grad_norms).enumerate() {
        assert!(
            (w - g).abs() <= tol.grad_norm * w,
            "{what}: step {i} gradient norm {g} vs single {w}"
        );
    }
    let scale = want.params.iter().fold(0.0f32, |m, x| m.max(x.abs()));
    let err = want
        .params
        .iter()
        .zip(&got.params)
        .fold(0.0f32, |m, (w, g)| m.max((w - g).abs()));
    assert!(
        err <= tol.params * scale,
        "{what}: params max error {err} vs max |param| {scale}"
    );
}

fn par(strategy: StrategyKind, world_size: usize, tp: usize, recompute: bool) -> ParallelConfig {
    ParallelConfig {
        strategy,
        world_size,
        tp,
        recompute,
        precision: Default::default(),
        pipeline: Default::default(),
        offload: Default::default(),
        offload_serial: false,
    }
}

fn check_head(head: BertHead) {
    let cfg = model(head);
    let single = run(&cfg, par(StrategyKind::Single, 1, 1, false), 1);
    let single_accum = run(&cfg, par(StrategyKind::Single, 1, 1, false), 2);
    assert!(
        single.losses[STEPS - 1] < single.losses[0],
        "{head:?}: single's loss did not fall: {:?}",
        single.losses
    );
    use StrategyKind::*;
    for strategy in [Ddp, Zero1, Zero2, Fsdp] {
        for w in [2, 4] {
            let what = format!("{head:?} {strategy} on {w} ranks");
            assert_follows(&single, &run(&cfg, par(strategy, w, 1, false), 1), &what);
        }
        let what = format!("{head:?} {strategy} with accumulation");
        assert_follows(
            &single_accum,
            &run(&cfg, par(strategy, 2, 1, false), 2),
            &what,
        );
        let what = format!("{head:?} {strategy} with recomputation");
        assert_follows(&single, &run(&cfg, par(strategy, 2, 1, true), 1), &what);
    }
    for (strategy, w, tp) in [
        (Tp, 2, 1),
        (Tp, 4, 1),
        (Ddp, 4, 2),
        (Zero1, 4, 2),
        (Zero2, 4, 2),
        (Fsdp, 4, 2),
    ] {
        let what = format!("{head:?} {strategy} on {w} ranks, tp {tp}");
        assert_follows(&single, &run(&cfg, par(strategy, w, tp, false), 1), &what);
    }
    let what = format!("{head:?} tp with accumulation and recomputation");
    assert_follows(&single_accum, &run(&cfg, par(Tp, 2, 1, true), 2), &what);
    // pipelines stream the accumulation's micro-batches through 2 stages
    use distgpt::parallel::{Pipeline, Schedule};
    for schedule in [Schedule::GPipe, Schedule::OneFOneB] {
        for (strategy, w, tp) in [
            (Ddp, 2, 1),
            (Ddp, 4, 1),
            (Tp, 4, 2),
            (Zero2, 4, 1),
            (Fsdp, 8, 2),
        ] {
            let pipelined = ParallelConfig {
                pipeline: Pipeline::new(2, schedule, 2),
                ..par(strategy, w, tp, false)
            };
            let what = format!("{head:?} {schedule} pp 2 on {w} ranks, tp {tp}");
            assert_follows(&single_accum, &run(&cfg, pipelined, 2), &what);
        }
    }
}

#[test]
fn masked_lm_strategies_match_single_over_five_steps() {
    check_head(BertHead::Mlm);
}

#[test]
fn classifier_strategies_match_single_over_five_steps() {
    check_head(BertHead::Classify { labels: 3 });
}

#[test]
fn pretraining_strategies_match_single_over_five_steps() {
    check_head(BertHead::Pretrain);
}

/// With clipping off a wrong global norm moves no loss and no parameter,
/// so only the reported norm can show it: every layout's norm is single's,
/// a pipeline's with the masked-LM decoder's tied word embeddings (on the
/// first and last stage) counted once.
#[test]
fn every_layout_reports_singles_gradient_norm_with_clipping_off() {
    use distgpt::parallel::{Pipeline, Schedule};
    use StrategyKind::*;
    for head in [
        BertHead::Mlm,
        BertHead::Classify { labels: 3 },
        BertHead::Pretrain,
    ] {
        let cfg = model(head);
        let unclipped = |par| run_clipped(&cfg, par, 2, 0.0);
        let single = unclipped(par(Single, 1, 1, false));
        for (strategy, w, tp, pp) in [
            (Ddp, 2, 1, 1),
            (Zero1, 2, 1, 1),
            (Zero2, 2, 1, 1),
            (Fsdp, 2, 1, 1),
            (Tp, 2, 1, 1),
            (Ddp, 2, 1, 2),
            (Fsdp, 8, 2, 2),
        ] {
            let layout = ParallelConfig {
                pipeline: Pipeline::new(pp, Schedule::OneFOneB, 2),
                ..par(strategy, w, tp, false)
            };
            let what = format!("{head:?} {strategy} pp {pp} on {w} ranks, tp {tp}, clipping off");
            assert_follows(&single, &unclipped(layout), &what);
        }
    }
}

#[test]
fn bf16_moves_bert_training_within_bf16_rounding_and_every_strategy_follows_single_in_bf16() {
    use distgpt::model::Precision;
    use StrategyKind::*;
    for head in [
        BertHead::Mlm,
        BertHead::Classify { labels: 3 },
        BertHead::Pretrain,
    ] {
        let cfg = model(head);
        let bf16 = |strategy, w, tp, recompute| {
            let par = ParallelConfig {
                precision: Precision::Bf16,
                ..par(strategy, w, tp, recompute)
            };
            run(&cfg, par, 1)
        };
        let reference = bf16(Single, 1, 1, false);
        let fp32 = run(&cfg, par(Single, 1, 1, false), 1);
        let gaps: Vec<f32> = reference
            .losses
            .iter()
            .zip(&fp32.losses)
            .map(|(a, b)| (a - b).abs())
            .collect();
        // bf16 operands change the arithmetic (the switch acts): the
        // gradient norms by more than the tolerance below (1.4e-3 to
        // 1.6e-3 of fp32's; a classifier's losses move only 5e-5 in these
        // steps), the losses within bf16's 2^-8 of fp32
        let widest = reference
            .grad_norms
            .iter()
            .zip(&fp32.grad_norms)
            .fold(0.0f32, |m, (a, b)| m.max((a - b).abs() / b));
        assert!(
            widest > 2.0 * BF16_TOL.grad_norm,
            "{head:?}: bf16's norms are only {widest} from fp32's: the tolerance cannot tell \
             them apart"
        );
        for (g, f) in gaps.iter().zip(&fp32.losses) {
            assert!(g / f.abs() < 4e-3, "{head:?}: bf16 vs fp32 gaps {gaps:?}");
        }
        for (strategy, w, tp) in [
            (Ddp, 2, 1),
            (Zero1, 2, 1),
            (Zero2, 4, 1),
            (Fsdp, 2, 1),
            (Tp, 2, 1),
            (Ddp, 4, 2),
        ] {
            let what = format!("{head:?} {strategy} on {w} ranks (tp {tp}) in bf16");
            let got = bf16(strategy, w, tp, false);
            assert_follows_within(&reference, &got, &what, &BF16_TOL);
        }
        let what = format!("{head:?} fsdp with recomputation in bf16");
        let got = bf16(Fsdp, 2, 1, true);
        assert_follows_within(&reference, &got, &what, &BF16_TOL);
    }
}

#[test]
fn masked_lm_pretraining_on_shakespeare_lowers_the_validation_loss() {
    use distgpt::data::{Dataset, TokenizerKind};
    use distgpt::train::mlm::MlmTask;
    use distgpt::train::{train, TrainConfig};
    let ds = Dataset::load(None, TokenizerKind::Char).unwrap();
    let task = MlmTask::new(&model(BertHead::Mlm), &ds, 32);
    let cfg = TrainConfig {
        batch_size: 8,
        seq_len: 32,
        duration: distgpt::train::Duration::Steps(60),
        lr: 3e-3,
        min_lr: 3e-4,
        warmup_steps: 5,
        adamw: AdamWConfig::default(),
        grad_clip: 1.0,
        // the first evaluation after one step stands for the untrained model
        eval_every: 1,
        eval_batches: 4,
        sample_tokens: 0,
        seed: 1,
        out_dir: scratch("mlm"),
        overwrite: true,
        keep_checkpoints: 1,
        ..TrainConfig::default()
    };
    let par = par(StrategyKind::Ddp, 2, 1, false);
    let s = train(Cpu::new, &task, &cfg, par, 2, Duration::from_secs(60)).unwrap();
    let vals: Vec<f32> = s.history.iter().filter_map(|r| r.val_loss).collect();
    let (first, last) = (vals[0], *vals.last().unwrap());
    // from ln(vocabulary) towards the characters' entropy
    assert!(
        first > 3.5 && last < first - 0.8,
        "validation masked loss {first} -> {last}"
    );
    let _ = std::fs::remove_dir_all(&cfg.out_dir);
}

/// Next-sentence prediction learns what it can see, through the path a run
/// takes (the loader, the pairs, `parallel::build`, two ranks): a text of
/// two vocabularies in long blocks, where an unrelated second segment is
/// of the other vocabulary half the time, so that about 75% is the most a
/// model can get; pretraining goes from chance to 65% or more, where a
/// head that learned nothing stays at the share of one label.
#[test]
fn next_sentence_prediction_learns_a_visible_signal() {
    use distgpt::data::wordpiece::WordPiece;
    use distgpt::data::{Dataset, Tokenizer};
    use distgpt::train::mlm::MlmTask;
    use distgpt::train::{train, TrainConfig};
    let words = |p: char| -> Vec<String> { (0..30).map(|i| format!("{p}{i:02}")).collect() };
    let (x, y) = (words('x'), words('y'));
    let mut rng = Rng::new(11);
    let text: Vec<&str> = (0..40)
        .flat_map(|blk| {
            let set = if blk % 2 == 0 { &x } else { &y };
            (0..1500)
                .map(|_| set[rng.below(30)].as_str())
                .collect::<Vec<_>>()
        })
        .collect();
    let dir = scratch("nsp-blocks");
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("blocks.txt");
    std::fs::write(&path, text.join(" ")).unwrap();
    let specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"].map(String::from);
    let vocab = specials
        .into_iter()
        .chain(x.clone())
        .chain(y.clone())
        .collect();
    let wp = WordPiece::new(vocab).unwrap();
    let ds = Dataset::load_with(Some(&path), Tokenizer::WordPiece(Box::new(wp))).unwrap();
    let tiny = BertConfig::preset("bert-tiny").unwrap();
    let task = MlmTask::new(&tiny, &ds, 32).pretraining().unwrap();
    let cfg = TrainConfig {
        batch_size: 16,
        seq_len: 32,
        duration: distgpt::train::Duration::Steps(300),
        lr: 1e-3,
        min_lr: 1e-4,
        warmup_steps: 10,
        adamw: AdamWConfig::default(),
        grad_clip: 1.0,
        // the first evaluation after one step stands for the untrained model
        eval_every: 1,
        eval_batches: 16,
        sample_tokens: 0,
        seed: 1,
        out_dir: dir.join("run"),
        overwrite: true,
        keep_checkpoints: 1,
        ..TrainConfig::default()
    };
    let par = par(StrategyKind::Ddp, 2, 1, false);
    let s = train(Cpu::new, &task, &cfg, par, 2, Duration::from_secs(120)).unwrap();
    let acc: Vec<f64> = s.history.iter().filter_map(|r| r.val_accuracy).collect();
    let (first, last) = (acc[0], *acc.last().unwrap());
    assert!(
        first < 0.6 && last >= 0.65,
        "next-sentence accuracy {first} -> {last}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
