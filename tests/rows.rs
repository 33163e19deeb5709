//! Row pruning physically shrinks GPT-2's blocks: the shrunk model computes
//! what the dense model with the same heads and MLP units zeroed computes,
//! has per-block widths in its config, and saves, loads, exports, decodes
//! and trains under every strategy like any other model.

mod common;

use distgpt::backend::cpu::Cpu;
use distgpt::backend::Device;
use distgpt::checkpoint::state;
use distgpt::data::{Dataset, TokenizerKind, TokenizerSpec};
use distgpt::model::gpt2::config::BlockWidth;
use distgpt::model::gpt2::kv::{DecodeWeights, Decoder};
use distgpt::model::gpt2::rows::{select_rows, shrink, KeptRows};
use distgpt::model::gpt2::BlockParam;
use distgpt::model::{Gpt2, GptConfig, ParamLayout, TpPlace};
use distgpt::parallel::{ParallelConfig, Pipeline, Schedule, StrategyKind};
use distgpt::prune::Scope;
use distgpt::train::{train_lm, TrainConfig, TrainSummary};
use std::time::Duration as Wait;

#[path = "support/gpt2_files.rs"]
mod gpt2_files;
use gpt2_files::{load_model, save_model};

/// Three blocks of four heads (head size 8) and 128 MLP units.
fn dense_config() -> GptConfig {
    GptConfig {
        n_layer: 3,
        n_head: 4,
        n_embd: 32,
        block_size: 16,
        vocab_size: 50,
        blocks: Vec::new(),
    }
}

fn random_model(cfg: &GptConfig, seed: u64) -> Gpt2<Cpu> {
    let mut m = Gpt2::new(Cpu::new(), cfg.clone()).unwrap();
    m.init_weights(seed).unwrap();
    // larger biases and norms than the initialisation's, so a wrongly
    // copied one shows
    let mut p = m.params_host().unwrap();
    let lay = ParamLayout::new(cfg);
    for l in 0..cfg.n_layer {
        for bp in BlockParam::ALL {
            let r = lay.block_param(l, bp);
            if lay.block_param(l, bp).len() < 200 {
                for (i, x) in p[r].iter_mut().enumerate() {
                    *x += 0.05 * ((i * 7 + l * 3 + bp as usize) % 11) as f32 - 0.25;
                }
            }
        }
    }
    m.set_params(&p).unwrap();
    m
}

/// The dense parameters with every head and unit `kept` drops zeroed, the
/// shapes unchanged: written here, apart from the pruning code.
fn masked(cfg: &GptConfig, params: &[f32], kept: &KeptRows) -> Vec<f32> {
    let (lay, c, d) = (ParamLayout::new(cfg), cfg.n_embd, cfg.head_dim());
    let (a, f) = (cfg.n_head * d, 4 * c);
    let mut p = params.to_vec();
    for l in 0..cfg.n_layer {
        let t = |bp| lay.block_param(l, bp);
        for h in (0..cfg.n_head).filter(|h| !kept.heads[l].contains(h)) {
            for col in (0..3).flat_map(|g| (g * a + h * d)..(g * a + (h + 1) * d)) {
                for r in 0..c {
                    p[t(BlockParam::QkvW).start + r * 3 * a + col] = 0.0;
                }
                p[t(BlockParam::QkvB).start + col] = 0.0;
            }
            let proj = t(BlockParam::AttnProjW).start;
            p[proj + h * d * c..proj + (h + 1) * d * c].fill(0.0);
        }
        for j in (0..f).filter(|j| !kept.hidden[l].contains(j)) {
            for r in 0..c {
                p[t(BlockParam::FcW).start + r * f + j] = 0.0;
            }
            p[t(BlockParam::FcB).start + j] = 0.0;
            let proj = t(BlockParam::FcProjW).start;
            p[proj + j * c..proj + (j + 1) * c].fill(0.0);
        }
    }
    p
}

/// Parameters that are zero but for the weights each head and MLP unit
/// owns (as `masked` drops them): head h of block l's all `head(l, h)`,
/// unit j's all `unit(l, j)`. Heads own equally many weights, and units
/// too, so their L2 norms rank as these values do.
fn owned_weights(
    cfg: &GptConfig,
    head: impl Fn(usize, usize) -> f32,
    unit: impl Fn(usize, usize) -> f32,
) -> Vec<f32> {
    let (lay, c, d) = (ParamLayout::new(cfg), cfg.n_embd, cfg.head_dim());
    let (a, f) = (cfg.n_head * d, 4 * c);
    let mut p = vec![0.0; lay.total()];
    for l in 0..cfg.n_layer {
        let t = |bp| lay.block_param(l, bp);
        for h in 0..cfg.n_head {
            let v = head(l, h);
            for col in (0..3).flat_map(|g| (g * a + h * d)..(g * a + (h + 1) * d)) {
                for r in 0..c {
                    p[t(BlockParam::QkvW).start + r * 3 * a + col] = v;
                }
                p[t(BlockParam::QkvB).start + col] = v;
            }
            let proj = t(BlockParam::AttnProjW).start;
            p[proj + h * d * c..proj + (h + 1) * d * c].fill(v);
        }
        for j in 0..f {
            let v = unit(l, j);
            for r in 0..c {
                p[t(BlockParam::FcW).start + r * f + j] = v;
            }
            p[t(BlockParam::FcB).start + j] = v;
            let proj = t(BlockParam::FcProjW).start;
            p[proj + j * c..proj + (j + 1) * c].fill(v);
        }
    }
    p
}

/// Per block, the indices below `n` that `keep` takes, in order.
fn kept_by(n_layer: usize, n: usize, keep: impl Fn(usize, usize) -> bool) -> Vec<Vec<usize>> {
    (0..n_layer)
        .map(|l| (0..n).filter(|&i| keep(l, i)).collect())
        .collect()
}

#[test]
fn rows_pruning_keeps_the_heads_and_units_of_the_largest_norms() {
    let cfg = dense_config();
    let (n_head, f) = (cfg.n_head, 4 * cfg.n_embd);
    // head h of block l ranks (h + l) % 4 in its block, unit j (37 j + 11 l)
    // % 128 (a permutation: 37 is odd); rank 0 the smallest
    let head_rank = |l: usize, h: usize| (h + l) % n_head;
    let unit_rank = |l: usize, j: usize| (37 * j + 11 * l) % f;
    // per block: half of each, the larger half
    let params = owned_weights(
        &cfg,
        |l, h| head_rank(l, h) as f32 + 1.0,
        |l, j| unit_rank(l, j) as f32 + 1.0,
    );
    let kept = select_rows(&cfg, &params, 0.5, Scope::Matrix);
    let want_heads = kept_by(cfg.n_layer, n_head, |l, h| head_rank(l, h) >= n_head / 2);
    let want_hidden = kept_by(cfg.n_layer, f, |l, j| unit_rank(l, j) >= f / 2);
    assert_eq!(kept.heads, want_heads, "per block: the heads kept");
    assert_eq!(kept.hidden, want_hidden, "per block: the units kept");
    // over all blocks, each block's largest and then the largest of the
    // rest: block 2's weights 2000 more than block 1's, 1000 more than
    // block 0's, so half of the 12 heads are block 2's 4 and blocks 0 and
    // 1's largest; half of the 384 units block 2's 128, block 1's 63
    // largest and block 0's largest
    let params = owned_weights(
        &cfg,
        |l, h| 1000.0 * l as f32 + head_rank(l, h) as f32 + 1.0,
        |l, j| 1000.0 * l as f32 + unit_rank(l, j) as f32 + 1.0,
    );
    let kept = select_rows(&cfg, &params, 0.5, Scope::Global);
    let want_heads = kept_by(cfg.n_layer, n_head, |l, h| {
        l == 2 || head_rank(l, h) == n_head - 1
    });
    let want_hidden = kept_by(cfg.n_layer, f, |l, j| match l {
        2 => true,
        1 => unit_rank(l, j) >= f - 63,
        _ => unit_rank(l, j) == f - 1,
    });
    assert_eq!(kept.heads, want_heads, "over all blocks: the heads kept");
    assert_eq!(kept.hidden, want_hidden, "over all blocks: the units kept");
}

fn batch(cfg: &GptConfig) -> (Vec<u32>, Vec<u32>) {
    let n = 2 * cfg.block_size;
    let v = cfg.vocab_size;
    (
        (0..n).map(|i| ((i * 13 + 5) % v) as u32).collect(),
        (0..n).map(|i| ((i * 29 + 1) % v) as u32).collect(),
    )
}

/// Loss and every position's logits of a forward over `batch`.
fn outputs(m: &mut Gpt2<Cpu>) -> (f32, Vec<f32>) {
    let cfg = m.config.clone();
    let (x, y) = batch(&cfg);
    let loss = m.forward(&x, Some(&y), 2, cfg.block_size).unwrap().unwrap();
    let logits = (0..2)
        .flat_map(|b| (0..cfg.block_size).map(move |t| (b, t)))
        .flat_map(|(b, t)| m.engine.logits(b, t).unwrap())
        .collect();
    (loss, logits)
}

fn assert_close(a: &[f32], b: &[f32], tol: f32, what: &str) {
    assert_eq!(a.len(), b.len(), "{what}");
    let worst = a
        .iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max);
    assert!(worst <= tol, "{what}: differs by {worst}");
}

#[test]
fn a_shrunk_model_computes_what_the_masked_dense_model_computes() {
    let cfg = dense_config();
    let mut dense = random_model(&cfg, 5);
    let params = dense.params_host().unwrap();
    for (sparsity, scope) in [
        (0.5, Scope::Matrix),
        (0.25, Scope::Matrix),
        (0.6, Scope::Global),
    ] {
        let kept = select_rows(&cfg, &params, sparsity, scope);
        let (small_cfg, small_params) = shrink(&cfg, &params, &kept);
        let what = format!("{scope:?} {sparsity}: {small_cfg}");
        // the widths: what the scope asks, at least one of each per block
        let heads: usize = small_cfg.blocks.iter().map(|b| b.heads).sum();
        let hidden: usize = small_cfg.blocks.iter().map(|b| b.hidden).sum();
        let want = |n: usize| ((1.0 - sparsity) * n as f64).round() as usize;
        assert_eq!(heads, want(cfg.n_layer * cfg.n_head), "{what}");
        assert_eq!(hidden, want(cfg.n_layer * 4 * cfg.n_embd), "{what}");
        assert!(small_cfg.blocks.iter().all(|b| b.heads >= 1));
        if scope == Scope::Matrix {
            assert!(
                small_cfg.blocks.iter().all(|b| b.heads == want(4)),
                "{what}"
            );
        }
        // physically smaller, exactly by the dropped rows' weights
        let (d, c) = (cfg.head_dim(), cfg.n_embd);
        let dropped_heads = cfg.n_layer * cfg.n_head - heads;
        let dropped_units = cfg.n_layer * 4 * c - hidden;
        assert_eq!(
            small_cfg.num_params(),
            cfg.num_params()
                - dropped_heads * (3 * d * (c + 1) + d * c)
                - dropped_units * (2 * c + 1),
            "{what}"
        );
        assert_eq!(small_params.len(), small_cfg.num_params());
        let mut small = Gpt2::new(Cpu::new(), small_cfg.clone()).unwrap();
        small.set_params(&small_params).unwrap();
        dense.set_params(&masked(&cfg, &params, &kept)).unwrap();
        let (loss, logits) = outputs(&mut small);
        let (mloss, mlogits) = outputs(&mut dense);
        assert!((loss - mloss).abs() <= 1e-5, "{what}: {loss} vs {mloss}");
        assert_close(&logits, &mlogits, 1e-4, &what);
        // the backward too: the kept rows' gradients are the masked model's
        // (a zeroed head or unit passes no gradient on)
        let grads = |m: &mut Gpt2<Cpu>| {
            m.zero_grads();
            let cfg = m.config.clone();
            let (x, y) = batch(&cfg);
            m.forward(&x, Some(&y), 2, cfg.block_size).unwrap();
            m.backward(1.0).unwrap();
            m.backend().to_host(m.grads.s()).unwrap()
        };
        let (_, kept_grads) = shrink(&cfg, &grads(&mut dense), &kept);
        assert_close(
            &grads(&mut small),
            &kept_grads,
            1e-5,
            &format!("{what}: gradients"),
        );
        assert_decodes_as_the_forward(&small, &logits, &what);
    }
    // the widest block first, then a narrower one: each block's cache and
    // scratch sized apart
    let kept = KeptRows {
        heads: vec![vec![0, 1, 3], vec![2], vec![1, 2]],
        hidden: vec![(0..100).collect(), (7..30).collect(), (50..128).collect()],
    };
    let (small_cfg, small_params) = shrink(&cfg, &params, &kept);
    let mut small = Gpt2::new(Cpu::new(), small_cfg.clone()).unwrap();
    small.set_params(&small_params).unwrap();
    dense.set_params(&masked(&cfg, &params, &kept)).unwrap();
    let (_, logits) = outputs(&mut small);
    assert_close(&logits, &outputs(&mut dense).1, 1e-4, "uneven widths");
    assert_decodes_as_the_forward(&small, &logits, "uneven widths");
}

/// The KV-cache decoder, token by token, gives the forward's `logits` of
/// the first row of [`batch`].
fn assert_decodes_as_the_forward(model: &Gpt2<Cpu>, logits: &[f32], what: &str) {
    let cfg = &model.config;
    let (x, _) = batch(cfg);
    let place = TpPlace::NONE;
    let weights = DecodeWeights::new(
        &Cpu::new(),
        cfg,
        place,
        model.params.s(),
        Default::default(),
    )
    .unwrap();
    let mut dec = Decoder::new(Cpu::new(), cfg.clone(), place, 1, 8).unwrap();
    for (pos, &tok) in x[..8].iter().enumerate() {
        dec.step(&weights, &[tok], pos, None, true).unwrap();
        let want = &logits[pos * cfg.vocab_size..(pos + 1) * cfg.vocab_size];
        let got = dec.logits(0).unwrap();
        assert_close(&got, want, 1e-4, &format!("{what}, decoded {pos}"));
    }
}

#[test]
fn a_pruned_model_saves_loads_and_exports_in_the_dense_shape() {
    let cfg = dense_config();
    let m = random_model(&cfg, 9);
    let params = m.params_host().unwrap();
    let kept = select_rows(&cfg, &params, 0.5, Scope::Global);
    let (small_cfg, small_params) = shrink(&cfg, &params, &kept);
    let mut small = Gpt2::new(Cpu::new(), small_cfg.clone()).unwrap();
    small.set_params(&small_params).unwrap();
    let (loss, logits) = outputs(&mut small);
    let dir = common::scratch("rows");
    // a character vocabulary of the model's size (the first characters of
    // Shakespeare's), as config.json must record it
    let tok = match Dataset::load(None, TokenizerKind::Char)
        .unwrap()
        .tokenizer
        .spec()
    {
        TokenizerSpec::Char { chars } => TokenizerSpec::Char {
            chars: chars.chars().take(cfg.vocab_size).collect(),
        },
        other => panic!("a character vocabulary, not {other:?}"),
    };
    save_model(&small, tok.clone(), &dir.join("own")).unwrap();
    let (mut back, meta) = load_model(Cpu::new(), &dir.join("own")).unwrap();
    assert_eq!(meta.config, small_cfg.into());
    assert_eq!(back.params_host().unwrap(), small_params);
    let (l2, g2) = outputs(&mut back);
    assert_eq!((l2, &g2), (loss, &logits));
    // transformers' GPT-2 has one width: the export is dense, pruned rows zero
    distgpt::model::gpt2::hf::export(&small, &tok, &dir.join("hf")).unwrap();
    let (mut hf, meta) = load_model(Cpu::new(), &dir.join("hf")).unwrap();
    assert_eq!(meta.config, cfg.into());
    let (l3, g3) = outputs(&mut hf);
    assert!((l3 - loss).abs() <= 1e-5, "{l3} vs {loss}");
    assert_close(&g3, &logits, 1e-4, "exported");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_model_with_per_block_widths_trains_under_every_strategy_as_single() {
    let ds = Dataset::load(None, TokenizerKind::Char).unwrap();
    let model = GptConfig {
        n_layer: 4,
        blocks: [(2, 64), (1, 16), (2, 96), (2, 32)]
            .map(|(heads, hidden)| BlockWidth { heads, hidden })
            .to_vec(),
        ..common::tiny_model(&ds)
    };
    let run = |strategy, (dp, pp, tp): (usize, usize, usize), schedule, tag: &str| {
        let par = ParallelConfig {
            strategy,
            world_size: dp * pp * tp,
            tp,
            recompute: false,
            precision: Default::default(),
            pipeline: Pipeline::new(pp, schedule, 2),
            offload: Default::default(),
            offload_serial: false,
        };
        let cfg = common::five_steps(&format!("rows-{tag}"), 2);
        train_lm(
            Cpu::new,
            model.clone(),
            &ds,
            &cfg,
            par,
            2,
            Wait::from_secs(120),
        )
        .unwrap_or_else(|e| panic!("{tag}: {e}"))
    };
    use Schedule::{OneFOneB, ZbH1};
    use StrategyKind::*;
    let single: TrainSummary = run(Single, (1, 1, 1), OneFOneB, "single");
    for (strategy, mesh, schedule, tag) in [
        (Ddp, (2, 1, 1), OneFOneB, "ddp"),
        (Zero1, (2, 1, 1), OneFOneB, "zero1"),
        (Zero2, (2, 1, 1), OneFOneB, "zero2"),
        (Fsdp, (2, 1, 1), OneFOneB, "fsdp"),
        (Ddp, (1, 2, 1), OneFOneB, "pp2"),
        (Fsdp, (1, 2, 1), ZbH1, "pp2-zb"),
    ] {
        common::assert_follows(&single, &run(strategy, mesh, schedule, tag), tag);
    }
    // block 1 has one head: tensor parallelism over two ranks is refused in words
    let par = ParallelConfig {
        strategy: Tp,
        world_size: 2,
        tp: 2,
        recompute: false,
        precision: Default::default(),
        pipeline: Pipeline::new(1, Schedule::OneFOneB, 1),
        offload: Default::default(),
        offload_serial: false,
    };
    let cfg = common::five_steps("rows-tp", 1);
    let Err(err) = train_lm(
        Cpu::new,
        model.clone(),
        &ds,
        &cfg,
        par,
        2,
        Wait::from_secs(60),
    ) else {
        panic!("one head cannot be split over two ranks");
    };
    let err = err.to_string();
    assert!(err.contains("block 1") && err.contains("1 heads"), "{err}");
    let even = GptConfig {
        blocks: [(2, 64), (2, 16), (2, 96), (2, 32)]
            .map(|(heads, hidden)| BlockWidth { heads, hidden })
            .to_vec(),
        ..model
    };
    let tp_run = |strategy, world_size, tp| {
        let par = ParallelConfig {
            strategy,
            world_size,
            tp,
            ..par
        };
        let cfg = common::five_steps(&format!("rows-tp-{strategy}"), 2);
        let wait = Wait::from_secs(120);
        train_lm(Cpu::new, even.clone(), &ds, &cfg, par, 2, wait).unwrap()
    };
    let single = tp_run(Single, 1, 1);
    common::assert_follows(&single, &tp_run(Tp, 2, 2), "tp 2");
    common::assert_follows(&single, &tp_run(Fsdp, 4, 2), "fsdp x tp 2");
}

/// A pruned model's checkpoints keep its widths: fsdp stops and resumes bit
/// for bit, and the checkpoint resumes under tensor parallelism as it would
/// have gone on under fsdp.
#[test]
fn a_pruned_model_stops_and_resumes_bit_exactly_and_reshards() {
    let ds = Dataset::load(None, TokenizerKind::Char).unwrap();
    let model = GptConfig {
        n_layer: 3,
        blocks: [(2, 64), (2, 16), (2, 96)]
            .map(|(heads, hidden)| BlockWidth { heads, hidden })
            .to_vec(),
        ..common::tiny_model(&ds)
    };
    let run = |cfg: &TrainConfig, strategy, tp| {
        let par = ParallelConfig {
            strategy,
            world_size: 2,
            tp,
            recompute: false,
            precision: Default::default(),
            pipeline: Pipeline::new(1, Schedule::OneFOneB, 1),
            offload: Default::default(),
            offload_serial: false,
        };
        let wait = Wait::from_secs(120);
        train_lm(Cpu::new, model.clone(), &ds, cfg, par, 2, wait).unwrap()
    };
    let whole = run(&common::five_steps("rows-whole", 1), StrategyKind::Fsdp, 1);
    let split = common::five_steps("rows-split", 1);
    let first = run(
        &TrainConfig {
            stop_after: Some(3),
            ..split.clone()
        },
        StrategyKind::Fsdp,
        1,
    );
    let resumed = |strategy, tp| {
        let cfg = TrainConfig {
            resume: Some(state::at_step(&split.out_dir, 3).unwrap()),
            ..split.clone()
        };
        run(&cfg, strategy, tp)
    };
    let second = resumed(StrategyKind::Fsdp, 1);
    let losses: Vec<f32> = first.losses.iter().chain(&second.losses).copied().collect();
    assert_eq!(losses, whole.losses, "per-step losses");
    assert!(second.params == whole.params, "final weights differ");
    let tp = resumed(StrategyKind::Tp, 2);
    assert_close(
        &tp.losses,
        &whole.losses[3..],
        1e-5,
        "resumed under tp 2: losses",
    );
    let largest = whole.params.iter().fold(0.0f32, |m, p| m.max(p.abs()));
    assert_close(
        &tp.params,
        &whole.params,
        1e-4 * largest,
        "resumed under tp 2: weights",
    );
}
