//! Pruning (`distgpt prune`) in an iterative schedule: prune to s1,
//! fine-tune k steps, evaluate, prune to s2, ... Each level's validation
//! loss (before and after its fine-tuning), and when asked its time per
//! training step and per generated token, go into a table and figures.
//! Embeddings, layernorms and the projections' biases are never pruned.
//!
//! A model of any family, asked of its family what it has: magnitude
//! pruning needs its blocks' weight matrices (`Family::block_matrix`), row
//! pruning a family whose blocks shrink (`Family::prune_rows`), int8 losses
//! and token times its decoder; a family without one is refused in words.
//!
//! Magnitude: the blocks' weight matrices (GPT-2's four a block) lose
//! their smallest entries, per matrix or over all of them at once, held at
//! zero while fine-tuning; the matrices keep their shapes, so this saves no
//! time. Rows: whole attention heads and MLP units go, per block or over
//! all blocks, and the model shrinks to per-block widths
//! (`GptConfig::blocks`).

use crate::backend::{Backend, WeightFormat};
use crate::comm::{local, Comm};
use crate::data::{Batch, DataLoader, Dataset};
use crate::error::{Error, Result};
use crate::figure::{self, Figure, Series};
use crate::metrics::Spread;
pub use crate::model::family::Scope;
use crate::model::family::{DecodedRun, TimedGeneration};
use crate::model::{AdamWConfig, ModelConfig};
use crate::parallel::{self, ParallelConfig, StepConfig};
use serde::Serialize;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// A model being pruned: its shape and whole parameters, on the host, run
/// on `backend`.
pub struct Model<B> {
    pub backend: B,
    pub config: ModelConfig,
    pub params: Vec<f32>,
}

/// Keep flags over the whole layout (true outside `ranges`): within each
/// group of ranges (one per matrix, or all together) the `sparsity`
/// fraction of entries with the smallest magnitudes is dropped, ties broken
/// by position, so exactly round(sparsity * n) entries of a group go.
pub fn magnitude_mask(
    params: &[f32],
    ranges: &[Range<usize>],
    sparsity: f64,
    scope: Scope,
) -> Vec<bool> {
    let mut keep = vec![true; params.len()];
    let groups: Vec<Vec<Range<usize>>> = match scope {
        Scope::Matrix => ranges.iter().map(|r| vec![r.clone()]).collect(),
        Scope::Global => vec![ranges.to_vec()],
    };
    for group in groups {
        let mut idx: Vec<usize> = group.iter().flat_map(|r| r.clone()).collect();
        let drop = ((sparsity * idx.len() as f64).round() as usize).min(idx.len());
        if drop == 0 {
            continue;
        }
        let key = |&i: &usize| (params[i].abs(), i);
        idx.select_nth_unstable_by(drop - 1, |a, b| {
            let (ka, kb) = (key(a), key(b));
            ka.0.total_cmp(&kb.0).then(ka.1.cmp(&kb.1))
        });
        for &i in &idx[..drop] {
            keep[i] = false;
        }
    }
    keep
}

/// Zeroes every entry `keep` drops.
pub fn apply(params: &mut [f32], keep: &[bool]) {
    params
        .iter_mut()
        .zip(keep)
        .filter(|(_, &k)| !k)
        .for_each(|(p, _)| *p = 0.0);
}

/// The fraction of zeros among the entries of `ranges`.
pub fn sparsity(params: &[f32], ranges: &[Range<usize>]) -> f64 {
    let (zeros, n) = ranges.iter().fold((0usize, 0usize), |(z, n), r| {
        (
            z + params[r.clone()].iter().filter(|&&x| x == 0.0).count(),
            n + r.len(),
        )
    });
    zeros as f64 / n.max(1) as f64
}

/// What a pruning step removes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Method {
    /// Single weights by magnitude; the matrices keep their shapes.
    Magnitude,
    /// Whole attention heads and MLP units by L2 norm; the matrices shrink.
    Rows,
}

crate::display_as_flag!(Method);

/// How the speed of each level is measured (`prune --sweep`).
#[derive(Clone, Copy, Debug, Serialize)]
pub struct Timing {
    /// Training steps timed one by one (after one untimed) at the sweep's
    /// batch; their median counts.
    pub steps: usize,
    /// Tokens generated at batch 1 (greedy, KV cache) in each of three
    /// timed runs; the median run counts.
    pub tokens: usize,
}

/// How a sweep runs.
#[derive(Clone, Debug, Serialize)]
pub struct SweepConfig {
    /// Increasing sparsity targets in (0, 1).
    pub levels: Vec<f64>,
    pub method: Method,
    pub scope: Scope,
    /// Fine-tuning steps after each pruning (0: none).
    pub finetune_steps: usize,
    pub lr: f32,
    pub batch_size: usize,
    pub seq_len: usize,
    /// Validation batches per evaluation.
    pub eval_batches: usize,
    pub seed: u64,
    /// Also evaluate each level with int8 weights (the KV-cache decoder,
    /// CPU only), beside its fp32 loss.
    pub int8: bool,
    /// Measure each level's time per training step and per generated token.
    pub timing: Option<Timing>,
}

/// Refuses sparsity levels that are not a rising list within (0, 1), each
/// named as given.
pub fn check_levels(levels: &[f64]) -> Result<()> {
    let bad = |m: String| Err(Error::Config(m));
    if levels.is_empty() {
        return bad("--sparsity needs at least one level".into());
    }
    if let Some(s) = levels.iter().find(|s| !(**s > 0.0 && **s < 1.0)) {
        return bad(format!("sparsity {s} must be above 0 and below 1"));
    }
    if levels.windows(2).any(|w| w[1] <= w[0]) {
        return bad(format!(
            "sparsity levels {levels:?} must increase: each level prunes the previous one further"
        ));
    }
    Ok(())
}

impl SweepConfig {
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(Error::Config(m));
        check_levels(&self.levels)?;
        if !(self.lr > 0.0 && self.lr.is_finite()) {
            return bad(format!("--lr {} must be a positive number", self.lr));
        }
        if self.batch_size == 0 || self.seq_len == 0 || self.eval_batches == 0 {
            return bad("--batch-size, --seq-len and --eval-batches must be at least 1".into());
        }
        if self.timing.is_some_and(|t| t.steps == 0 || t.tokens == 0) {
            return bad("--time-steps and --time-tokens must be at least 1".into());
        }
        Ok(())
    }
}

/// A level's measured speed.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct Speed {
    /// Milliseconds per training step (forward, backward, AdamW).
    pub step_ms: f64,
    /// Milliseconds per generated token at batch 1, fp32 weights.
    pub token_ms: f64,
    /// The same with int8 weights, when the sweep asks for int8.
    pub token_ms_int8: Option<f64>,
}

/// One level of a sweep (level 0: the dense model).
#[derive(Clone, Debug, Serialize)]
pub struct Level {
    /// The target fraction of pruned weights.
    pub target: f64,
    /// The fraction of the blocks' weight-matrix entries gone: zeros
    /// (magnitude) or rows removed (rows), after fine-tuning.
    pub sparsity: f64,
    /// Parameters the model stores.
    pub params: usize,
    /// Validation loss right after pruning, and after fine-tuning.
    pub val_loss_pruned: f64,
    pub val_loss: f64,
    /// The fine-tuned level with int8 weights, when asked.
    pub val_loss_int8: Option<f64>,
    /// Its speed, when asked.
    pub speed: Option<Speed>,
}

/// The first `eval_batches` batches of the validation split.
fn val_batches(ds: &Dataset, cfg: &SweepConfig) -> Result<Vec<Batch>> {
    let mut val = DataLoader::new(&ds.val, "val", cfg.batch_size, cfg.seq_len, 0, false)?;
    let n = cfg.eval_batches.min(val.batches_per_epoch());
    Ok((0..n).map(|_| val.next_batch()).collect())
}

/// The mean validation loss over `eval_batches` batches of the validation
/// split, through the family's engine in fp32.
pub fn val_loss<B: Backend>(model: &Model<B>, ds: &Dataset, cfg: &SweepConfig) -> Result<f64> {
    let mut whole = model
        .config
        .whole(model.backend.clone_fresh(), &model.params)?;
    whole.mean_loss(val_batches(ds, cfg)?, cfg.batch_size, cfg.seq_len)
}

/// The validation loss with the blocks' weights in int8, through the
/// family's KV-cache decoder (as `eval --weights int8`), on the batches
/// `val_loss` uses.
pub fn val_loss_int8<B: Backend>(model: &Model<B>, ds: &Dataset, cfg: &SweepConfig) -> Result<f64> {
    let batches = val_batches(ds, cfg)?;
    let run = DecodedRun {
        params: &model.params,
        format: WeightFormat::Int8,
        batches: batches.into_iter().map(|b| (b.inputs, b.targets)).collect(),
        rows: cfg.batch_size,
        t: cfg.seq_len,
    };
    let be = model.backend.clone_fresh();
    Ok(model
        .config
        .decoder("prune --int8")?
        .evaluate(be, run)?
        .loss)
}

/// A one-rank strategy holding `model`'s parameters, for fine-tuning and timing.
fn single_rank<B: Backend>(
    model: &Model<B>,
    cfg: &SweepConfig,
    comm: &dyn Comm,
) -> Result<Box<dyn parallel::Strategy>> {
    let single = ParallelConfig::single();
    let be = model.backend.clone_fresh();
    let (config, adamw) = (model.config.clone(), AdamWConfig::default());
    let (b, t) = (cfg.batch_size, cfg.seq_len);
    let mut strategy = parallel::build(be, config, single, comm, adamw, b, t)?;
    strategy.load_full(&model.params)?;
    Ok(strategy)
}

/// Fine-tunes `finetune_steps` steps on the training split with the step
/// every single-rank run takes (`parallel`'s: gradient norm clipped at 1,
/// non-finite losses refused, AdamW), a fresh optimizer per level; with
/// `keep`, the pruned entries go back to zero after each step.
fn finetune<B: Backend>(
    model: &mut Model<B>,
    ds: &Dataset,
    cfg: &SweepConfig,
    keep: Option<&[bool]>,
    level: usize,
) -> Result<()> {
    if cfg.finetune_steps == 0 {
        return Ok(());
    }
    let (b, t) = (cfg.batch_size, cfg.seq_len);
    let seed = cfg.seed.wrapping_add(level as u64);
    let mut train = DataLoader::new(&ds.train, "train", b, t, seed, true)?;
    let (_world, comms) = local::world(1, Duration::from_secs(60));
    let mut strategy = single_rank(model, cfg, &comms[0])?;
    let step = StepConfig {
        lr: cfg.lr,
        grad_clip: 1.0,
    };
    for _ in 0..cfg.finetune_steps {
        strategy.step(&[train.next_batch()], step)?;
        if let Some(keep) = keep {
            let mut p = strategy.full_params()?;
            apply(&mut p, keep);
            strategy.load_full(&p)?;
        }
    }
    model.params = strategy.full_params()?;
    Ok(())
}

/// Times `timing.steps` training steps one by one (after one untimed) on
/// a copy of the model, and three greedy generations of `timing.tokens`
/// tokens at batch 1 through the family's decoder (fp32, and int8 when the
/// sweep asks); each time is the median, so a step or a run that another
/// process slowed does not count.
pub fn measure_speed<B: Backend>(
    model: &Model<B>,
    ds: &Dataset,
    cfg: &SweepConfig,
    timing: Timing,
) -> Result<Speed> {
    let (b, t) = (cfg.batch_size, cfg.seq_len);
    let mut train = DataLoader::new(&ds.train, "train", b, t, cfg.seed, true)?;
    let (_world, comms) = local::world(1, Duration::from_secs(60));
    let mut strategy = single_rank(model, cfg, &comms[0])?;
    let step = StepConfig {
        lr: cfg.lr,
        grad_clip: 1.0,
    };
    strategy.step(&[train.next_batch()], step)?;
    let mut steps = Vec::new();
    for _ in 0..timing.steps {
        let start = Instant::now();
        strategy.step(&[train.next_batch()], step)?;
        steps.push(1e3 * start.elapsed().as_secs_f64());
    }
    let per_token = |format| -> Result<f64> {
        let run = TimedGeneration {
            params: &model.params,
            format,
            prompts: &[vec![0]],
            new_tokens: timing.tokens.min(model.config.block_size() - 1),
            runs: 3,
        };
        let be = model.backend.clone_fresh();
        let timed = model.config.decoder("prune's timing")?.time(be, run)?;
        let runs = timed.runs.iter();
        Ok(Spread::of(runs.map(|&(s, _, n)| 1e3 * s / n.max(1) as f64)).median)
    };
    Ok(Speed {
        step_ms: Spread::of(steps).median,
        token_ms: per_token(WeightFormat::F32)?,
        token_ms_int8: cfg
            .int8
            .then(|| per_token(WeightFormat::Int8))
            .transpose()?,
    })
}

/// The entries of the blocks' weight matrices.
fn matrix_entries(config: &ModelConfig) -> usize {
    config.block_matrices().iter().map(Range::len).sum()
}

/// Level 0: the model as it is, evaluated (and timed) as every level is;
/// a pruned level is this of its fine-tuned model, with what pruning
/// left before the fine-tuning.
pub fn dense_level<B: Backend>(model: &Model<B>, ds: &Dataset, cfg: &SweepConfig) -> Result<Level> {
    let val_loss = val_loss(model, ds, cfg)?;
    Ok(Level {
        target: 0.0,
        sparsity: 0.0,
        params: model.config.num_params(),
        val_loss_pruned: val_loss,
        val_loss,
        val_loss_int8: cfg
            .int8
            .then(|| val_loss_int8(model, ds, cfg))
            .transpose()?,
        speed: cfg
            .timing
            .map(|t| measure_speed(model, ds, cfg, t))
            .transpose()?,
    })
}

/// Refuses a family whose blocks mark no weight matrices to prune (BERT's).
pub fn check_family(config: &ModelConfig) -> Result<()> {
    if matrix_entries(config) == 0 {
        return Err(Error::Config(format!(
            "{} models mark no weight matrices in their blocks: prune needs a family that does (GPT-2's)",
            config.family()
        )));
    }
    Ok(())
}

/// Runs the schedule on `model` (left at the last level: with `rows` a
/// smaller model), calling `report(level)` as each level finishes.
pub fn sweep<B: Backend>(
    model: &mut Model<B>,
    ds: &Dataset,
    cfg: &SweepConfig,
    mut report: impl FnMut(&Level),
) -> Result<Vec<Level>> {
    cfg.validate()?;
    check_family(&model.config)?;
    let dense = matrix_entries(&model.config);
    let mut levels = Vec::new();
    for (i, &target) in cfg.levels.iter().enumerate() {
        let keep = match cfg.method {
            Method::Magnitude => {
                let ranges = model.config.block_matrices();
                let keep = magnitude_mask(&model.params, &ranges, target, cfg.scope);
                apply(&mut model.params, &keep);
                Some(keep)
            }
            Method::Rows => {
                let pruned = model.config.prune_rows(&model.params, target, cfg.scope)?;
                (model.config, model.params) = pruned;
                None
            }
        };
        let val_loss_pruned = val_loss(model, ds, cfg)?;
        finetune(model, ds, cfg, keep.as_deref(), i)?;
        let sparsity = match cfg.method {
            Method::Magnitude => sparsity(&model.params, &model.config.block_matrices()),
            Method::Rows => 1.0 - matrix_entries(&model.config) as f64 / dense as f64,
        };
        let level = Level {
            target,
            sparsity,
            val_loss_pruned,
            ..dense_level(model, ds, cfg)?
        };
        report(&level);
        levels.push(level);
    }
    Ok(levels)
}

/// One method's sweep, level 0 (the dense model) first.
#[derive(Clone, Debug, Serialize)]
pub struct MethodRun {
    pub method: Method,
    pub levels: Vec<Level>,
}

/// `prune.csv`: a row a method and level.
fn csv(runs: &[MethodRun]) -> String {
    let opt = |x: Option<f64>| x.map_or(String::new(), |v| v.to_string());
    let mut out = String::from(
        "method,target,sparsity,params,val_loss_pruned,val_loss,val_loss_int8,step_ms,token_ms,token_ms_int8\n",
    );
    for run in runs {
        for l in &run.levels {
            let sp = l.speed;
            out += &format!(
                "{},{},{},{},{},{},{},{},{},{}\n",
                run.method,
                l.target,
                l.sparsity,
                l.params,
                l.val_loss_pruned,
                l.val_loss,
                opt(l.val_loss_int8),
                opt(sp.map(|s| s.step_ms)),
                opt(sp.map(|s| s.token_ms)),
                opt(sp.and_then(|s| s.token_ms_int8)),
            );
        }
    }
    out
}

/// Writes `prune.csv` and `prune.json` (config and every method's levels)
/// and the figures (PNG and SVG) into `dir`: validation loss vs sparsity,
/// and with timing, time per training step and per generated token.
pub fn write_report(dir: &Path, cfg: &SweepConfig, runs: &[MethodRun]) -> Result<Vec<PathBuf>> {
    std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    let csv_path = dir.join("prune.csv");
    crate::store::write_atomic(&csv_path, csv(runs).as_bytes())?;
    // a sweep's config names no one method: each run names its own
    let mut config = serde_json::to_value(cfg).expect("a sweep's config is JSON");
    if let (true, Some(fields)) = (runs.len() > 1, config.as_object_mut()) {
        fields.remove("method");
    }
    let json = serde_json::json!({ "config": config, "runs": runs });
    let json_path = dir.join("prune.json");
    crate::store::write_json(&json_path, &json)?;
    let scope = match cfg.scope {
        Scope::Matrix => "per block",
        Scope::Global => "global",
    };
    let series = |label: String, levels: &[Level], f: &dyn Fn(&Level) -> Option<f64>| {
        let points = levels
            .iter()
            .filter_map(|l| Some(((100.0 * l.target).round(), f(l)?)));
        Series::new(label, points.collect())
    };
    let mut losses = Vec::new();
    let (mut steps, mut tokens) = (Vec::new(), Vec::new());
    for run in runs {
        let (m, ls) = (run.method, &run.levels[..]);
        losses.push(series(format!("{m}: right after pruning"), ls, &|l| {
            Some(l.val_loss_pruned)
        }));
        if cfg.finetune_steps > 0 {
            let label = format!("{m}: after {} fine-tuning steps", cfg.finetune_steps);
            losses.push(series(label, ls, &|l| Some(l.val_loss)));
        }
        if cfg.int8 {
            losses.push(series(format!("{m}: fine-tuned, in int8"), ls, &|l| {
                l.val_loss_int8
            }));
        }
        if cfg.timing.is_some() {
            steps.push(series(format!("{m}"), ls, &|l| Some(l.speed?.step_ms)));
            tokens.push(series(format!("{m}, fp32"), ls, &|l| {
                Some(l.speed?.token_ms)
            }));
            if cfg.int8 {
                tokens.push(series(format!("{m}, int8"), ls, &|l| {
                    l.speed?.token_ms_int8
                }));
            }
        }
    }
    let methods: Vec<String> = runs.iter().map(|r| r.method.to_string()).collect();
    let figure = |stem: &str, title: String, y_label: &str, series: Vec<Series>, y_from_zero| {
        let x_label = "target sparsity of the blocks' weight matrices (%)";
        Figure::lines(stem, title, x_label, y_label, series, true, y_from_zero)
    };
    let mut figures = vec![figure(
        "prune_val_loss",
        format!(
            "Pruning ({}, {scope}): validation loss vs sparsity",
            methods.join(" and ")
        ),
        "validation loss",
        losses,
        false,
    )];
    if cfg.timing.is_some() {
        let batch = format!("batch {} x {}", cfg.batch_size, cfg.seq_len);
        figures.push(figure(
            "prune_step_time",
            format!("Time per training step ({batch}) vs sparsity"),
            "ms per step",
            steps,
            true,
        ));
        figures.push(figure(
            "prune_token_time",
            "Time per generated token (batch 1, KV cache) vs sparsity".into(),
            "ms per token",
            tokens,
            true,
        ));
    }
    let mut written = vec![csv_path, json_path];
    for fig in &figures {
        written.extend(figure::write(dir, fig)?);
    }
    Ok(written)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn masks_drop_exactly_the_smallest_per_matrix_or_globally() {
        // Two "matrices": [0..4) and [5..9); index 4 is not prunable.
        let p = [0.5, -0.1, 0.3, -0.2, 0.0, 4.0, -3.0, 2.0, 0.05];
        let ranges = [0..4, 5..9];
        let keep = magnitude_mask(&p, &ranges, 0.5, Scope::Matrix);
        assert_eq!(
            keep,
            [true, false, true, false, true, true, true, false, false]
        );
        let keep = magnitude_mask(&p, &ranges, 0.5, Scope::Global);
        assert_eq!(
            keep,
            [true, false, false, false, true, true, true, true, false]
        );
        let mut q = p;
        apply(&mut q, &keep);
        assert_eq!(
            q[4], 0.0,
            "outside the ranges: untouched (it was zero already)"
        );
        assert_eq!(sparsity(&q, &ranges), 0.5);
        // Ties go by position, so the count is exact.
        let flat = [1.0f32; 10];
        let all = std::iter::once(0..10).collect::<Vec<_>>();
        let keep = magnitude_mask(&flat, &all, 0.3, Scope::Matrix);
        assert_eq!(keep.iter().filter(|&&k| !k).count(), 3);
        assert_eq!(&keep[..4], [false, false, false, true]);
    }

    fn schedule(levels: Vec<f64>) -> SweepConfig {
        SweepConfig {
            levels,
            method: Method::Magnitude,
            scope: Scope::Matrix,
            finetune_steps: 0,
            lr: 1e-4,
            batch_size: 2,
            seq_len: 8,
            eval_batches: 1,
            seed: 0,
            int8: false,
            timing: None,
        }
    }

    #[test]
    fn a_family_whose_blocks_mark_no_matrices_is_refused_in_words() {
        let ds = Dataset::load(None, crate::data::TokenizerKind::Char).unwrap();
        let mut bert = Model {
            backend: crate::backend::cpu::Cpu::new(),
            config: ModelConfig::preset("bert-tiny").unwrap(),
            params: vec![],
        };
        let e = sweep(&mut bert, &ds, &schedule(vec![0.5]), |_| {}).unwrap_err();
        assert!(
            e.to_string()
                .contains("BERT models mark no weight matrices in their blocks"),
            "{e}"
        );
    }

    #[test]
    fn bad_schedules_are_refused_in_words() {
        let cfg = schedule;
        let e = |l| cfg(l).validate().unwrap_err().to_string();
        assert!(e(vec![]).contains("at least one level"));
        assert!(e(vec![0.5, 1.0]).contains("below 1"));
        assert!(e(vec![0.5, 0.3]).contains("must increase"));
        assert!(cfg(vec![0.1, 0.5, 0.9]).validate().is_ok());
    }
}
