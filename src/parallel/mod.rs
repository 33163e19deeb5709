//! Parallel strategies: how a training step is split over ranks. For a fixed
//! seed and global batch every strategy follows `single`'s loss curve.
//!
//! Every layout is a pipeline of one or more stages (`pipeline::Pipelined`;
//! single, ddp, zero1/2, fsdp and tp are one stage): a rank runs its
//! stage's units, split over its tensor-parallel group (`tp`), and shares
//! the stage's state with its data-parallel replicas as its strategy says
//! (`stage::StageState`: replicated, zero1, zero2, fsdp).
//!
//! Strategies know a model only through `model::UnitModel` and the
//! `ParamLayout` it declares: no family is named here.

pub mod grid;
pub mod launch;
mod offload;
pub mod pipeline;
mod stage;

pub use grid::Grid;
pub use pipeline::{Pipeline, Pipelined, Schedule, Span};
pub use stage::{fsdp_gathered, stage_sizes, Sharing, StageSizes};

use crate::backend::{Backend, MemoryReport};
use crate::comm::{Comm, CommStats};
use crate::data::Batch;
use crate::error::{Error, Result};
use crate::model::parts::Parts;
use crate::model::unit::UnitModel;
use crate::model::{AdamWConfig, ModelConfig, Precision, TpPlace};
use serde::{Deserialize, Serialize};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum StrategyKind {
    /// One rank.
    Single,
    /// Full replicas, the gradient all-reduced once after the step's backward.
    Ddp,
    /// + optimizer state sharded.
    Zero1,
    /// + gradients sharded.
    Zero2,
    /// + parameters sharded (ZeRO-3, FULL_SHARD).
    #[value(alias = "zero3")]
    #[serde(alias = "zero3")]
    Fsdp,
    /// Megatron tensor parallelism.
    Tp,
}

impl StrategyKind {
    /// What its data-parallel replicas shard.
    pub fn sharing(self) -> Sharing {
        match self {
            StrategyKind::Single | StrategyKind::Ddp | StrategyKind::Tp => Sharing::Replicated,
            StrategyKind::Zero1 => Sharing::Zero1,
            StrategyKind::Zero2 => Sharing::Zero2,
            StrategyKind::Fsdp => Sharing::Fsdp,
        }
    }

    /// What the memory reports' "other" bytes are under this strategy, where
    /// it has any: buffers sized by the largest unit and by a shard, held
    /// for the run, which can outweigh what sharding saves.
    pub fn other_memory(self) -> Option<&'static str> {
        match self {
            StrategyKind::Zero1 => Some(
                "zero1's \"other\" is a padded unit's gradient scratch and the reduce-scatter's \
                 output (each sized by the largest unit) and copies of this rank's gradient and \
                 parameter shards for the update, held for the run; on two ranks the copies \
                 alone weigh what sharding the moments saves (in fp32), so zero1 x2 peaks above \
                 ddp x2, and zero1 saves from three ranks on",
            ),
            StrategyKind::Zero2 => Some(
                "zero2's \"other\" is a padded unit's gradient scratch (the head's too) and the \
                 reduce-scatter's output, each sized by the largest unit, and a copy of this \
                 rank's parameter shard for the update, held for the run",
            ),
            StrategyKind::Fsdp => Some(
                "fsdp's \"other\" is a padded unit's gradient scratch (the head's too) and the \
                 reduce-scatter's output, each sized by the largest unit",
            ),
            _ => None,
        }
    }
}

crate::display_as_flag!(StrategyKind);

/// What of a rank's training state lives in host memory while it trains
/// on a device (ZeRO-Offload; PyTorch FSDP's `CPUOffload`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Offload {
    /// Everything on the device.
    #[default]
    None,
    /// The AdamW moments and an fp32 master copy of the parameters this
    /// rank updates: its gradient goes to the host after its reduction,
    /// AdamW runs on the CPU, the updated parameters come back.
    Optimizer,
    /// + fsdp's parameter shards: gathered onto the device unit by unit.
    Params,
}

impl Offload {
    pub fn is_none(&self) -> bool {
        *self == Offload::None
    }
}

crate::display_as_flag!(Offload);

/// How the ranks are arranged.
#[derive(Clone, Copy, Debug, Serialize, Deserialize)]
pub struct ParallelConfig {
    pub strategy: StrategyKind,
    pub world_size: usize,
    /// Tensor-parallel group size; the data-parallel size is world / tp.
    pub tp: usize,
    /// Recompute each block's activations in the backward.
    pub recompute: bool,
    /// The matmuls' arithmetic (runs recorded before it existed are fp32).
    #[serde(default)]
    pub precision: Precision,
    /// Pipeline stages and their schedule (runs recorded before it existed have one stage).
    #[serde(default)]
    pub pipeline: Pipeline,
    /// What lives in host memory (runs recorded before it existed offload nothing).
    #[serde(default, skip_serializing_if = "Offload::is_none")]
    pub offload: Offload,
    /// With offload: the copies and the host update one after another
    /// instead of overlapped (to measure what the overlap buys).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub offload_serial: bool,
}

impl ParallelConfig {
    /// Short name of a layout: "fsdp x4", "ddp x8 (tp 2)".
    pub fn layout_name(&self) -> String {
        let p = self;
        let r = p.resolved();
        let rc = match (p.recompute, p.offload) {
            (false, Offload::None) => String::new(),
            (true, Offload::None) => " +recompute".into(),
            (false, o) => format!(" +offload {o}"),
            (true, o) => format!(" +recompute +offload {o}"),
        };
        if r.pipeline.stages == r.world_size && r.world_size > 1 {
            return format!("pp x{} ({}){rc}", r.world_size, r.pipeline);
        }
        let s = p.strategy.to_string();
        let base = if p.strategy == StrategyKind::Single {
            s
        } else {
            format!("{s} x{}", p.world_size)
        };
        let mesh = if p.tp > 1 && p.strategy != StrategyKind::Tp {
            format!(" (tp {})", p.tp)
        } else {
            String::new()
        };
        let pp = match p.pipeline.stages {
            1 => String::new(),
            k => format!(" (pp {k} {})", p.pipeline),
        };
        format!("{base}{mesh}{pp}{rc}")
    }

    /// One rank holding the whole model in fp32 (evaluation, timing).
    pub fn single() -> Self {
        ParallelConfig {
            strategy: StrategyKind::Single,
            world_size: 1,
            tp: 1,
            recompute: false,
            precision: Precision::Fp32,
            pipeline: Pipeline::default(),
            offload: Offload::None,
            offload_serial: false,
        }
    }

    /// The parts a rank runs its batch of `rows` sequences of `t` tokens
    /// in (`model::parts`): without pipeline stages or tensor parallelism,
    /// what `ask` (its backend's `Threads::batch_parts`) says for the rows, `t` and
    /// the parameters a token meets (the model's training FLOPs a token
    /// over 6); one otherwise.
    pub fn batch_parts(
        &self,
        model: &ModelConfig,
        rows: usize,
        t: usize,
        ask: impl FnOnce(usize, usize, f64) -> usize,
    ) -> usize {
        match (self.pipeline.stages, self.pipeline.virtual_stages, self.tp) {
            (1, 1, 1) => ask(rows, t, model.flops_per_token(t) / 6.0),
            _ => 1,
        }
    }

    /// Refuses impossible combinations before any work, saying what to change.
    pub fn validate(&self, model: &ModelConfig, global_batch: usize) -> Result<()> {
        let (w, tp, pp) = (self.world_size, self.tp, self.pipeline.stages);
        let bad = |m: String| Err(Error::Config(m));
        if w == 0 || tp == 0 || pp == 0 {
            return bad("--world-size, --tp and --pp must be at least 1".into());
        }
        if self.strategy == StrategyKind::Single && w != 1 {
            return bad(format!(
                "strategy single runs on one rank, not {w}: pick ddp, zero1, zero2, fsdp or tp"
            ));
        }
        if !w.is_multiple_of(tp * pp) {
            return bad(format!(
                "world size {w} is not divisible by the tensor-parallel size {tp} times the pipeline stages {pp}: \
                 make --world-size a multiple of --tp x --pp"
            ));
        }
        if pp > model.n_layer() {
            return bad(format!(
                "--pp {pp} is more stages than the model's {} blocks: every stage needs a block",
                model.n_layer()
            ));
        }
        let v = self.pipeline.virtual_stages;
        match self.pipeline.schedule {
            Schedule::Interleaved if pp < 2 => {
                return bad("the interleaved schedule needs --pp 2 or more".into());
            }
            Schedule::Interleaved if v < 2 => {
                return bad(format!(
                    "--virtual-stages {v}: the interleaved schedule needs 2 or more chunks a rank"
                ));
            }
            Schedule::Interleaved if pp * v > model.n_layer() => {
                return bad(format!(
                    "--pp {pp} x --virtual-stages {v} is {} chunks, more than the model's {} blocks: \
                     every chunk needs a block",
                    pp * v,
                    model.n_layer()
                ));
            }
            Schedule::ZbH1 if pp < 2 => {
                return bad("the zb-h1 schedule needs --pp 2 or more".into());
            }
            Schedule::GPipe if pp < 2 => {
                return bad(
                    "--schedule gpipe orders a pipeline's micro-batches: it needs --pp 2 or more"
                        .into(),
                );
            }
            Schedule::ZbH1 if self.recompute || self.precision != Precision::Fp32 => {
                return bad(
                    "the zb-h1 schedule runs in fp32 without --recompute: its weight halves \
                     read every block's activations, unrounded, after the input halves"
                        .into(),
                );
            }
            Schedule::ZbH1 if !model.splits_backward() => {
                return bad(format!(
                    "the zb-h1 schedule splits each backward in two, which {}'s engine \
                     cannot: use --schedule 1f1b",
                    model.family()
                ));
            }
            Schedule::GPipe | Schedule::OneFOneB | Schedule::ZbH1 if v != 1 => {
                return bad(format!(
                    "--virtual-stages {v} splits a rank's blocks for --schedule interleaved, not {}",
                    self.pipeline.schedule
                ));
            }
            _ => {}
        }
        if self.offload_serial && self.offload.is_none() {
            return bad("--offload-serial orders --offload's copies, but --offload is none: pass --offload optimizer or params, or leave --offload-serial out".into());
        }
        if self.offload == Offload::Params && self.strategy != StrategyKind::Fsdp {
            return bad(format!(
                "--offload params keeps fsdp's parameter shards on the host, but strategy {} \
                 holds whole parameters: use --strategy fsdp, or --offload optimizer",
                self.strategy
            ));
        }
        model.check_tp(tp)?;
        let dp = w / (tp * pp);
        if !global_batch.is_multiple_of(dp) {
            return bad(format!(
                "the global batch of {global_batch} sequences is not divisible by the data-parallel size {dp}: \
                 make --batch-size a multiple of {dp}"
            ));
        }
        Ok(())
    }

    /// Tensor-parallel size: `tp` for a mesh; every rank of a pipeline
    /// stage for strategy tp without --tp.
    pub fn resolved(mut self) -> Self {
        if self.strategy == StrategyKind::Tp && self.tp == 1 {
            self.tp = self.world_size / self.pipeline.stages.max(1);
        }
        self
    }

    /// Data-parallel size.
    pub fn dp(&self) -> usize {
        let r = self.resolved();
        r.world_size / (r.tp * r.pipeline.stages).max(1)
    }
}

/// What one optimizer step reports (the same on every rank).
#[derive(Clone, Copy, Debug)]
pub struct StepStats {
    /// Mean loss over the global batch of every micro-step.
    pub loss: f32,
    /// Global gradient norm before clipping.
    pub grad_norm: f32,
    /// Seconds this rank spent in the optimizer update (with offload's
    /// copies to and from the host).
    pub update_s: f64,
}

/// Optimizer-step settings that do not change the model.
#[derive(Clone, Copy, Debug)]
pub struct StepConfig {
    pub lr: f32,
    /// Clip the global gradient norm to this; 0 disables clipping.
    pub grad_clip: f32,
}

impl StepConfig {
    /// What the gradient is multiplied by so that its global norm is at
    /// most `grad_clip` (1 when it is already, or clipping is off).
    pub fn clip_scale(&self, grad_norm: f32) -> f32 {
        if self.grad_clip > 0.0 && grad_norm > self.grad_clip {
            self.grad_clip / grad_norm
        } else {
            1.0
        }
    }
}

/// One rank's part of a training strategy. Training (`step`), evaluation
/// (`eval_loss`, `eval_outputs`) and `full_params` are collective: every
/// rank of the world calls them together. Loading parameters or state
/// (each rank takes its part of the whole), reading this rank's state,
/// counters and timeline, and freeing its activations, are its own.
pub trait Strategy {
    /// Forward and backward over every global micro-batch (this rank takes
    /// its rows), then one optimizer update.
    fn step(&mut self, micro_batches: &[Batch], cfg: StepConfig) -> Result<StepStats>;
    /// Mean loss on a global batch, gradients untouched.
    fn eval_loss(&mut self, batch: &Batch) -> Result<f32>;
    /// The mean loss and the model's outputs for every row of a global
    /// batch (`UnitModel::outputs`, gathered over the data-parallel ranks
    /// in batch order), on every rank.
    fn eval_outputs(&mut self, batch: &Batch) -> Result<(f32, Vec<f32>)>;
    /// The whole model's parameters in the standard layout, on every rank.
    fn full_params(&mut self) -> Result<Vec<f32>>;
    /// Loads whole-model parameters (each rank keeps its part).
    fn load_full(&mut self, full: &[f32]) -> Result<()>;
    /// The parameters and AdamW moments this rank writes to a checkpoint,
    /// with where they sit in the whole-model layout (empty on ranks that
    /// hold only copies of another rank's state).
    fn owned_state(&self) -> Result<OwnedState>;
    /// Loads whole-model parameters and moments and the optimizer step count.
    fn load_state(&mut self, params: &[f32], m: &[f32], v: &[f32], adam_step: u32) -> Result<()>;
    /// This rank's memory counters by category.
    fn memory(&self) -> MemoryReport;
    /// This rank's communication so far, every group together.
    fn comm_stats(&self) -> CommStats;
    /// How many parts this rank runs its batch in (`model::parts`).
    fn batch_parts(&self) -> usize;
    /// Frees the activations kept between steps (the next step allocates
    /// them afresh): a run's end writes its model files and checkpoint in
    /// the room they held, within the training step's peak.
    fn free_activations(&mut self);
    /// The forwards and backwards of the last step's pipeline program
    /// (empty where the strategy runs no pipeline).
    fn timeline(&self) -> Vec<Span> {
        Vec::new()
    }
}

/// A rank's part of the training state, in whole-layout coordinates:
/// `params`, `m` and `v` are the concatenation of the `segments` runs.
#[derive(Clone, Debug, Default)]
pub struct OwnedState {
    /// (offset in the whole layout, length), in buffer order.
    pub segments: Vec<(usize, usize)>,
    pub params: Vec<f32>,
    pub m: Vec<f32>,
    pub v: Vec<f32>,
}

impl OwnedState {
    /// Appends the run of `len` elements at `global`, its values taken from
    /// the front of `p` and, when this state carries them, of the moments `mv`.
    fn push(&mut self, global: usize, len: usize, p: &[f32], mv: Option<[&[f32]; 2]>) {
        self.add_run(global, len);
        self.params.extend_from_slice(&p[..len]);
        if let Some([m, v]) = mv {
            self.m.extend_from_slice(&m[..len]);
            self.v.extend_from_slice(&v[..len]);
        }
    }

    /// Records a run of `len` elements at `global` after the others
    /// (joined to the last when they meet), its values added by the caller.
    fn add_run(&mut self, global: usize, len: usize) {
        match self.segments.last_mut() {
            Some(last) if last.0 + last.1 == global => last.1 += len,
            _ => self.segments.push((global, len)),
        }
    }

    /// Appends another part's runs after this one's (taking its buffers
    /// when this holds none).
    fn append(&mut self, o: OwnedState) {
        if self.segments.is_empty() {
            *self = o;
            return;
        }
        let moments = o.m.len() == o.params.len();
        let mut at = 0;
        for &(global, len) in &o.segments {
            let mv = moments.then(|| [&o.m[at..], &o.v[at..]]);
            self.push(global, len, &o.params[at..], mv);
            at += len;
        }
    }
}

/// Refuses to update from a non-finite loss or gradient norm, so the weights
/// stay those of the last good step. Both are global sums, so every rank
/// refuses together.
fn check_finite(loss: f32, grad_norm: f32) -> Result<()> {
    if loss.is_finite() && grad_norm.is_finite() {
        Ok(())
    } else {
        Err(Error::Diverged(format!(
            "loss {loss}, gradient norm {grad_norm}: the update was not applied"
        )))
    }
}

/// Rows of the global batch that data-parallel rank `r` of `n` trains on.
fn local_rows(batch: &Batch, b: usize, r: usize, n: usize) -> Batch {
    let per = b / n;
    batch.rows(b, r * per..(r + 1) * per)
}

/// Builds this rank's strategy over `world` (collective: it splits the world
/// into the strategy's own groups).
#[allow(clippy::too_many_arguments)]
pub fn build<B: Backend + 'static>(
    backend: B,
    model: impl Into<ModelConfig>,
    par: ParallelConfig,
    world: &dyn Comm,
    adamw: AdamWConfig,
    b: usize,
    t: usize,
) -> Result<Box<dyn Strategy>> {
    let (model, par) = (model.into(), par.resolved());
    par.validate(&model, b)?;
    if world.size() != par.world_size {
        return Err(Error::Config(format!(
            "the launch has {} ranks but --world-size is {}",
            world.size(),
            par.world_size
        )));
    }
    if !par.offload.is_none() && crate::backend::memory_is_host(&backend)? {
        return Err(Error::Config(format!(
            "--offload {} moves training state from a device's memory to the host's, but this \
             run's device, {}, keeps everything in host memory already: offload is for \
             --device opencl or cuda (or pass --offload none)",
            par.offload,
            backend.name()
        )));
    }
    let grid = Grid::of(&par);
    let place = TpPlace {
        rank: grid.coords(world.rank()).tp,
        size: grid.tp,
    };
    let engine = || model.engine(backend.clone(), place, par.recompute, par.precision);
    let parts = par.batch_parts(&model, b / grid.dp, t, |rows, t, params| {
        backend.threads().batch_parts(rows, t, params)
    });
    // an engine per chunk of blocks this rank holds
    let engines = match parts {
        1 => (0..par.pipeline.virtual_stages)
            .map(|_| engine())
            .collect::<Result<_>>()?,
        n => {
            let parts = (0..n).map(|_| engine()).collect::<Result<_>>()?;
            let engine: Box<dyn UnitModel<B>> = Box::new(Parts::new(parts)?);
            vec![engine]
        }
    };
    Ok(Box::new(Pipelined::new(
        engines, &model, world, &par, adamw, b, t,
    )?))
}

#[cfg(test)]
mod tests {
    use super::OwnedState;

    #[test]
    fn runs_that_meet_are_one_segment_and_a_first_part_is_taken_whole() {
        let mut a = OwnedState::default();
        a.push(10, 2, &[1.0, 2.0], Some([&[3.0, 4.0], &[5.0, 6.0]]));
        a.push(12, 1, &[7.0], Some([&[8.0], &[9.0]]));
        a.push(20, 1, &[0.5], Some([&[0.25], &[0.125]]));
        assert_eq!(a.segments, [(10, 3), (20, 1)]);
        assert_eq!(a.params, [1.0, 2.0, 7.0, 0.5]);
        assert_eq!(a.v, [5.0, 6.0, 9.0, 0.125]);
        let mut whole = OwnedState::default();
        whole.append(a.clone());
        assert_eq!(whole.segments, a.segments);
        assert_eq!((&whole.params, &whole.m), (&a.params, &a.m));
        // a second part after the first: its runs appended, meeting ones joined
        let mut b = OwnedState::default();
        b.push(21, 1, &[1.5], Some([&[2.5], &[3.5]]));
        whole.append(b);
        assert_eq!(whole.segments, [(10, 3), (20, 2)]);
        assert_eq!(whole.m, [3.0, 4.0, 8.0, 0.25, 2.5]);
    }
}
