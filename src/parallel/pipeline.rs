//! Pipeline parallelism: the model's units split into contiguous stages
//! (balanced by their matmul work; the embeddings on the first, the head on
//! the last), one stage per rank of a pipeline group, micro-batches flowing
//! between neighbours over `Comm::send`/`recv`. Each stage keeps only its
//! units' parameters, gradients and AdamW moments, and a copy of the unit
//! holding a tied tensor it reads but does not own (GPT-2's `[wte | wpe]`
//! on the last stage): the first and last stage sum that unit's gradient,
//! so both copies take the same update, as Megatron keeps its embeddings in
//! sync. Stages compose with data parallelism — each stage's replicas share
//! its state as ddp, zero1, zero2 or fsdp do (`stage::StageState`) — and
//! tensor parallelism (the engine's tp group, as in `single`). A single
//! stage is how sharded data parallelism runs over a tensor-parallel mesh.
//!
//! Schedules: GPipe (every micro-batch forward, then every backward: m in
//! flight) and 1F1B (after p - s - 1 warm-up forwards stage s alternates one
//! forward and one backward: at most p - s in flight). A stage holds a
//! micro-batch's activations by stashing the engine's (`UnitModel::stash`);
//! the engine sizes them for the stage's units alone (`set_units`).

use super::grid::{Grid, Groups};
use super::stage::{Sharing, StageMap, StageState};
use super::{check_finite, local_rows, OwnedState, StepConfig, StepStats, Strategy};
use crate::backend::{Backend, MemoryReport};
use crate::comm::{Comm, CommStats};
use crate::data::Batch;
use crate::error::{Error, Result};
use crate::model::layout::{shard_tp, TpSplit};
use crate::model::{AdamWConfig, ModelConfig, ParamLayout, UnitModel};
use serde::{Deserialize, Serialize};
use std::any::Any;
use std::collections::VecDeque;
use std::ops::Range;
use std::time::Instant;

/// How micro-batches flow through the stages.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
pub enum Schedule {
    /// All forwards, then all backwards (GPipe): every micro-batch in flight.
    #[value(name = "gpipe")]
    #[serde(rename = "gpipe")]
    GPipe,
    /// One forward, one backward (PipeDream-flush, Megatron's default).
    #[default]
    #[value(name = "1f1b")]
    #[serde(rename = "1f1b")]
    OneFOneB,
}

impl std::fmt::Display for Schedule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Schedule::GPipe => "gpipe",
            Schedule::OneFOneB => "1f1b",
        })
    }
}

/// Pipeline stages and their schedule.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Pipeline {
    pub stages: usize,
    pub schedule: Schedule,
}

impl Default for Pipeline {
    fn default() -> Self {
        Pipeline {
            stages: 1,
            schedule: Schedule::default(),
        }
    }
}

/// One step of a stage's program.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    /// Forward of micro-batch i.
    Forward(usize),
    /// Backward of micro-batch i.
    Backward(usize),
    /// Receive the next activation from the previous stage.
    RecvForward,
    /// Send the oldest activation to the next stage.
    SendForward,
    /// Receive the next gradient from the next stage.
    RecvBackward,
    /// Send the oldest gradient to the previous stage.
    SendBackward,
    /// Send an activation to the next stage and receive a gradient from it.
    SendForwardRecvBackward,
    /// Send a gradient to the previous stage and receive an activation from it.
    SendBackwardRecvForward,
}

/// Stage `s` of `p`'s program for `m` micro-batches.
pub fn program(schedule: Schedule, s: usize, p: usize, m: usize) -> Vec<Op> {
    let (first, last) = (s == 0, s + 1 == p);
    let mut ops = Vec::new();
    let mut push = |op: Op, skip: bool| {
        if !skip {
            ops.push(op);
        }
    };
    match schedule {
        Schedule::GPipe => {
            for i in 0..m {
                push(Op::RecvForward, first);
                push(Op::Forward(i), false);
                push(Op::SendForward, last);
            }
            for i in 0..m {
                push(Op::RecvBackward, last);
                push(Op::Backward(i), false);
                push(Op::SendBackward, first);
            }
        }
        Schedule::OneFOneB => {
            let warmup = (p - s - 1).min(m);
            let steady = m - warmup;
            for i in 0..warmup {
                push(Op::RecvForward, first);
                push(Op::Forward(i), false);
                push(Op::SendForward, last);
            }
            if steady > 0 {
                push(Op::RecvForward, first);
            }
            for i in 0..steady {
                push(Op::Forward(warmup + i), false);
                push(Op::SendForwardRecvBackward, last);
                push(Op::Backward(i), false);
                if i + 1 == steady {
                    push(Op::SendBackward, first);
                } else {
                    push(Op::SendBackwardRecvForward, first);
                }
            }
            for i in steady..m {
                push(Op::RecvBackward, last);
                push(Op::Backward(i), false);
                push(Op::SendBackward, first);
            }
        }
    }
    ops
}

/// Splits units 0..n (embeddings, blocks, head) into `p` contiguous stages
/// of at least one block each, minimising the largest stage's cost (each
/// unit's matmul parameters, a tied tensor read counted with its reader, the
/// embeddings' lookup free). Returns each stage's unit range.
pub fn partition(layout: &ParamLayout, p: usize) -> Vec<Range<usize>> {
    let n = layout.units.len();
    let cost: Vec<f64> = layout
        .units
        .iter()
        .enumerate()
        .map(|(u, unit)| match u {
            0 => 0.0,
            _ => (unit.range.len() + unit.tied.as_ref().map_or(0, |t| t.range.len())) as f64,
        })
        .collect();
    // blocks are units 1..n-1; stage k takes blocks [cut[k], cut[k+1])
    let blocks = n - 2;
    let sum = |a: usize, b: usize| -> f64 { cost[1 + a..1 + b].iter().sum() };
    let extra = |k: usize| if k + 1 == p { cost[n - 1] } else { 0.0 };
    // best[k][j]: least max cost of stages 0..=k over the first j blocks
    let mut best = vec![vec![f64::INFINITY; blocks + 1]; p];
    let mut from = vec![vec![0usize; blocks + 1]; p];
    for (j, b) in best[0].iter_mut().enumerate().skip(1) {
        *b = sum(0, j) + extra(0);
    }
    for k in 1..p {
        for j in k + 1..=blocks {
            for i in k..j {
                let c = best[k - 1][i].max(sum(i, j) + extra(k));
                if c < best[k][j] {
                    best[k][j] = c;
                    from[k][j] = i;
                }
            }
        }
    }
    let mut cuts = vec![blocks; p + 1];
    cuts[0] = 0;
    for k in (1..p).rev() {
        cuts[k] = from[k][cuts[k + 1]];
    }
    (0..p)
        .map(|k| {
            let lo = if k == 0 { 0 } else { 1 + cuts[k] };
            let hi = if k + 1 == p { n } else { 1 + cuts[k + 1] };
            lo..hi
        })
        .collect()
}

/// Micro-batches whose activations stage s of p holds at once.
pub fn in_flight(schedule: Schedule, s: usize, p: usize, m: usize) -> usize {
    match schedule {
        Schedule::GPipe => m,
        Schedule::OneFOneB => (p - s).min(m),
    }
}

pub struct Pipelined<B: Backend> {
    engine: Box<dyn UnitModel<B>>,
    map: StageMap,
    /// The stage's parameters, gradients and moments, as its replicas share them.
    state: StageState<B>,
    /// The pipeline (stage s is rank s), the data-parallel replicas of this
    /// stage, the tensor-parallel group.
    pp: Box<dyn Comm>,
    dp: Box<dyn Comm>,
    tp: Option<Box<dyn Comm>>,
    /// The first and last stage at this (dp, tp) position, which sum the
    /// gradient of the unit a tied tensor lives in, and that unit's piece
    /// of this stage (none on other stages, or without a tie across stages).
    tie: Option<(Box<dyn Comm>, usize)>,
    schedule: Schedule,
    b: usize,
    t: usize,
    /// The residual stream's width (what flows between stages per token).
    width: usize,
    /// Activations of micro-batches in flight, oldest first, and spare ones.
    in_flight: VecDeque<Box<dyn Any>>,
    spare: Vec<Box<dyn Any>>,
    /// Activations and gradients received but not yet used, made but not yet sent.
    inbox_act: VecDeque<Vec<f32>>,
    inbox_grad: VecDeque<Vec<f32>>,
    outbox_act: VecDeque<Vec<f32>>,
    outbox_grad: VecDeque<Vec<f32>>,
    /// What this stage computed when in the last step's program.
    timeline: Vec<Span>,
}

/// A forward or backward a stage ran, in seconds from its step's start.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Span {
    pub backward: bool,
    pub micro_batch: usize,
    pub start: f64,
    pub end: f64,
}

/// The fraction of a pipelined step's program a stage idles, by the
/// schedule's formula: (p - 1) slots of m + p - 1 for m micro-batches on p
/// stages (GPipe and 1F1B alike; 1F1B keeps fewer activations, not fewer
/// idle slots).
pub fn bubble(p: usize, m: usize) -> f64 {
    (p - 1) as f64 / (m + p - 1) as f64
}

/// The idle fraction of a step's programs, measured: one minus the mean
/// busy time of every rank's spans over the span from the earliest start to
/// the latest end.
pub fn measured_bubble(timelines: &[Vec<Span>]) -> Option<f64> {
    let spans = || timelines.iter().flatten();
    let start = spans().map(|s| s.start).min_by(f64::total_cmp)?;
    let end = spans().map(|s| s.end).max_by(f64::total_cmp)?;
    let busy: f64 = spans().map(|s| s.end - s.start).sum::<f64>() / timelines.len() as f64;
    Some(1.0 - busy / (end - start))
}

impl<B: Backend> Pipelined<B> {
    /// Collective over `world` (it makes the tied-tensor groups).
    pub fn new(
        mut engine: Box<dyn UnitModel<B>>,
        model: &ModelConfig,
        (grid, groups): (Grid, Groups),
        world: &dyn Comm,
        (schedule, sharing): (Schedule, Sharing),
        adamw: AdamWConfig,
        (b, t): (usize, usize),
    ) -> Result<Self> {
        let Groups { pp, dp, tp } = groups;
        let (s, p) = (pp.rank(), pp.size());
        let lay = engine.layout().clone();
        let stages = partition(&lay, p);
        let map = StageMap::of(&lay, &stages, s);
        for u in map.units.start + 1..map.units.end {
            if lay.units[u].range.start != lay.units[u - 1].range.end {
                return Err(Error::Config(format!(
                    "{model}: units {} and {u} are not adjacent in the parameter layout",
                    u - 1
                )));
            }
        }
        let tied_ends = lay.units.iter().enumerate().find_map(|(u, unit)| {
            let t = unit.tied.as_ref()?;
            let (owner, reader) = (
                stages.iter().position(|r| r.contains(&t.unit))?,
                stages.iter().position(|r| r.contains(&u))?,
            );
            (owner != reader).then_some((owner, reader, t.unit))
        });
        let ends = tied_ends.as_ref().map_or(vec![], |(a, z, _)| vec![*a, *z]);
        let mine = ends.contains(&s);
        let tie_group = grid.stages_group(world, &ends)?;
        let state = StageState::new(engine.backend(), &lay, &map, sharing, dp.size(), adamw)?;
        let tie = match tied_ends {
            // the owner's unit, or the reader's copy of it (piece 0)
            Some((_, _, owner)) if mine => {
                let k = if owner >= map.units.start {
                    state.piece(owner)
                } else {
                    0
                };
                Some((tie_group, k))
            }
            _ => None,
        };
        engine.set_units(map.units.clone());
        Ok(Pipelined {
            engine,
            map,
            state,
            pp,
            dp,
            tp,
            tie,
            schedule,
            b,
            t,
            width: model.n_embd(),
            in_flight: VecDeque::new(),
            spare: Vec::new(),
            inbox_act: VecDeque::new(),
            inbox_grad: VecDeque::new(),
            outbox_act: VecDeque::new(),
            outbox_grad: VecDeque::new(),
            timeline: Vec::new(),
        })
    }

    fn first(&self) -> bool {
        self.pp.rank() == 0
    }

    fn last(&self) -> bool {
        self.pp.rank() + 1 == self.pp.size()
    }

    /// Readies the engine for a micro-batch, on spare activations if any.
    fn begin(&mut self, mb: &Batch, terms: f32) -> Result<()> {
        if let Some(s) = self.spare.pop() {
            self.engine.restore(s);
        }
        let n = self.dp.size();
        self.engine.begin(mb, self.b / n, self.t, terms)
    }

    /// The stage's units forward on the begun micro-batch (its input
    /// received first unless this is the first stage); the loss on the last.
    fn run_forward(&mut self) -> Result<Option<f32>> {
        let be = self.engine.backend().clone_fresh();
        let units = self.map.units.clone();
        if !self.first() {
            let x = self
                .inbox_act
                .pop_front()
                .expect("an activation is received before its forward");
            be.upload(self.engine.boundary(units.start), &x)?;
        }
        let lay = self.engine.layout().clone();
        let mut loss = None;
        for u in units.clone() {
            self.state.ready(self.dp.as_ref(), &be, &lay, u)?;
            let p = self.state.params(&lay, u);
            loss = self.engine.forward(u, p, self.tp.as_deref())?;
        }
        if !self.last() {
            let y = be.to_host(self.engine.boundary(units.end).into_src())?;
            self.outbox_act.push_back(y);
        }
        Ok(loss)
    }

    /// The stage's units backward on the oldest micro-batch in flight.
    fn run_backward(&mut self, loss_scale: f32) -> Result<()> {
        let be = self.engine.backend().clone_fresh();
        let oldest = self
            .in_flight
            .pop_front()
            .expect("a forward before its backward");
        self.engine.restore(oldest);
        if !self.last() {
            let g = self
                .inbox_grad
                .pop_front()
                .expect("a gradient is received before its backward");
            be.upload(self.engine.boundary_grad(), &g)?;
        }
        let lay = self.engine.layout().clone();
        for u in self.map.units.clone().rev() {
            self.state.ready(self.dp.as_ref(), &be, &lay, u)?;
            let (p, g) = self.state.unit(&be, &lay, u);
            self.engine
                .backward(u, p, g, self.tp.as_deref(), loss_scale)?;
            self.state.backward_done(self.dp.as_ref(), &be, &lay, u)?;
        }
        if !self.first() {
            let g = be.to_host(self.engine.boundary_grad().into_src())?;
            self.outbox_grad.push_back(g);
        }
        self.spare.push(self.engine.stash());
        Ok(())
    }

    /// Runs this stage's program for `mbs` local micro-batches; returns the
    /// sum of their losses (last stage; zero elsewhere).
    fn run_program(&mut self, mbs: &[(Batch, f32)], loss_scale: f32) -> Result<f32> {
        let (s, p) = (self.pp.rank(), self.pp.size());
        let mut loss = 0.0f32;
        let len = mbs.first().map_or(0, |mb| self.boundary_len(&mb.0));
        let t0 = Instant::now();
        self.timeline.clear();
        for op in program(self.schedule, s, p, mbs.len()) {
            let start = t0.elapsed().as_secs_f64();
            let span = |backward, micro_batch| Span {
                backward,
                micro_batch,
                start,
                end: t0.elapsed().as_secs_f64(),
            };
            match op {
                Op::Forward(i) => {
                    self.begin(&mbs[i].0, mbs[i].1)?;
                    if let Some(l) = self.run_forward()? {
                        loss += l;
                    }
                    self.in_flight.push_back(self.engine.stash());
                    self.timeline.push(span(false, i));
                }
                Op::Backward(i) => {
                    self.run_backward(loss_scale)?;
                    self.timeline.push(span(true, i));
                }
                Op::RecvForward => {
                    let mut x = vec![0.0f32; len];
                    self.pp.recv(&mut x, s - 1)?;
                    self.inbox_act.push_back(x);
                }
                Op::SendForward => {
                    let y = self.outbox_act.pop_front().expect("a forward made it");
                    self.pp.send(&y, s + 1)?;
                }
                Op::RecvBackward => {
                    let mut g = vec![0.0f32; len];
                    self.pp.recv(&mut g, s + 1)?;
                    self.inbox_grad.push_back(g);
                }
                Op::SendBackward => {
                    let g = self.outbox_grad.pop_front().expect("a backward made it");
                    self.pp.send(&g, s - 1)?;
                }
                Op::SendForwardRecvBackward => {
                    let y = self.outbox_act.pop_front().expect("a forward made it");
                    let mut g = vec![0.0f32; y.len()];
                    self.pp.send_recv(&y, s + 1, &mut g, s + 1)?;
                    self.inbox_grad.push_back(g);
                }
                Op::SendBackwardRecvForward => {
                    let g = self.outbox_grad.pop_front().expect("a backward made it");
                    let mut x = vec![0.0f32; g.len()];
                    self.pp.send_recv(&g, s - 1, &mut x, s - 1)?;
                    self.inbox_act.push_back(x);
                }
            }
        }
        Ok(loss)
    }

    /// Floats crossing a stage boundary for a local micro-batch.
    fn boundary_len(&self, mb: &Batch) -> usize {
        mb.inputs.len() * self.width
    }

    /// The loss of the last stage, on every stage.
    fn share_loss(&self, loss: f32) -> Result<f32> {
        let mut x = [loss];
        self.pp.broadcast(&mut x, self.pp.size() - 1)?;
        Ok(x[0])
    }

    /// Global gradient norm: shards summed over the replicas,
    /// tensor-parallel parts over tp, stages over the pipeline, a tied copy
    /// not counted twice.
    fn grad_norm(&self) -> Result<f32> {
        let be = self.engine.backend();
        let lay = self.engine.layout();
        let (mut split, mut rep) = self.state.grad_squares(be, lay, self.dp.rank())?;
        if self.state.sharded() {
            let mut x = [split, rep];
            self.dp.all_reduce(&mut x)?;
            [split, rep] = x;
        }
        if let Some(tp) = self.tp.as_deref() {
            let mut x = [split];
            tp.all_reduce(&mut x)?;
            split = x[0];
        }
        let mut total = [split + rep];
        self.pp.all_reduce(&mut total)?;
        Ok(total[0].sqrt() as f32)
    }

    /// Every value this rank owns in whole-layout coordinates, from
    /// host copies of its buffers (`bufs`): dp rank 0 writes, a replicated
    /// tensor by tp rank 0, a tied copy by its owner only.
    fn owned(&self, bufs: &[&[f32]]) -> (Vec<(usize, usize)>, Vec<Vec<f32>>) {
        let mut segs: Vec<(usize, usize)> = Vec::new();
        let mut out = vec![Vec::new(); bufs.len()];
        if self.dp.rank() != 0 {
            return (segs, out);
        }
        let tp = self.engine.tp();
        let whole = self.engine.whole_layout();
        for (w, l) in whole.tensors.iter().zip(&self.engine.layout().tensors) {
            let r = l.range();
            let mine = r.start >= self.map.own.start && r.end <= self.map.own.end;
            if !mine || (w.split == TpSplit::Replicated && tp.rank != 0) {
                continue;
            }
            let mut at = self.map.local(&r).start;
            for (full_at, len) in w.split.runs(&w.full_shape, tp.size, tp.rank) {
                let global = w.offset + full_at;
                match segs.last_mut() {
                    Some(last) if last.0 + last.1 == global => last.1 += len,
                    _ => segs.push((global, len)),
                }
                for (o, b) in out.iter_mut().zip(bufs) {
                    o.extend_from_slice(&b[at..at + len]);
                }
                at += len;
            }
        }
        (segs, out)
    }

    /// This stage's part of a whole-layout host buffer, as its buffers hold it.
    fn stage_part(&self, full: &[f32]) -> Vec<f32> {
        let e = &self.engine;
        let mut local = vec![0.0; e.layout().total()];
        shard_tp(full, e.whole_layout(), e.layout(), e.tp(), &mut local);
        let mut mine = Vec::with_capacity(self.map.len());
        if let Some(c) = &self.map.copy {
            mine.extend_from_slice(&local[c.clone()]);
        }
        mine.extend_from_slice(&local[self.map.own.clone()]);
        mine
    }

    /// The local rows of a global batch with their loss terms per rank.
    fn local(&self, batch: &Batch) -> (Batch, f32) {
        let (r, n) = (self.dp.rank(), self.dp.size());
        (
            local_rows(batch, self.b, r, n),
            batch.loss_terms() as f32 / n as f32,
        )
    }
}

impl<B: Backend> Strategy for Pipelined<B> {
    fn step(&mut self, micro_batches: &[Batch], cfg: StepConfig) -> Result<StepStats> {
        let be = self.engine.backend().clone_fresh();
        self.state.begin_step(&be);
        let n = self.dp.size();
        let m = micro_batches.len();
        let mbs: Vec<(Batch, f32)> = micro_batches.iter().map(|mb| self.local(mb)).collect();
        let mut loss = [self.run_program(&mbs, 1.0 / (m * n) as f32)?];
        let tie = self.tie.as_ref().map(|(g, k)| (g.as_ref(), *k));
        self.state.reduce_all(self.dp.as_ref(), &be, tie)?;
        self.dp.all_reduce(&mut loss)?;
        let loss = self.share_loss(loss[0])? / (n * m) as f32;
        let grad_norm = self.grad_norm()?;
        check_finite(loss, grad_norm)?;
        let clip = if cfg.grad_clip > 0.0 && grad_norm > cfg.grad_clip {
            cfg.grad_clip / grad_norm
        } else {
            1.0
        };
        let lay = self.engine.layout().clone();
        // the engine's own handle: the update's transient shard counts against this rank
        let counted = self.engine.backend();
        self.state
            .update(self.dp.as_ref(), counted, &lay, cfg.lr, clip)?;
        be.synchronize()?;
        Ok(StepStats { loss, grad_norm })
    }

    fn eval_loss(&mut self, batch: &Batch) -> Result<f32> {
        let n = self.dp.size();
        let mb = self.local(batch);
        let (s, p) = (self.pp.rank(), self.pp.size());
        if s > 0 {
            let mut x = vec![0.0f32; self.boundary_len(&mb.0)];
            self.pp.recv(&mut x, s - 1)?;
            self.inbox_act.push_back(x);
        }
        self.begin(&mb.0, mb.1)?;
        let loss = self.run_forward()?.unwrap_or(0.0);
        if s + 1 < p {
            let y = self.outbox_act.pop_front().expect("the forward made it");
            self.pp.send(&y, s + 1)?;
        }
        self.spare.push(self.engine.stash());
        let mut loss = [loss];
        self.dp.all_reduce(&mut loss)?;
        Ok(self.share_loss(loss[0])? / n as f32)
    }

    fn eval_outputs(&mut self, batch: &Batch) -> Result<(f32, Vec<f32>)> {
        let loss = self.eval_loss(batch)?;
        let mine = match self.last() {
            true => {
                let s = self.spare.pop().expect("the evaluation's activations");
                self.engine.restore(s);
                let out = self.engine.outputs()?;
                self.spare.push(self.engine.stash());
                out
            }
            false => Vec::new(),
        };
        let mut all = vec![0.0; mine.len() * self.dp.size()];
        self.dp.all_gather(&mine, &mut all)?;
        let last = self.pp.size() - 1;
        let mut len = [all.len() as u64];
        self.pp.broadcast(&mut len, last)?;
        all.resize(len[0] as usize, 0.0);
        self.pp.broadcast(&mut all, last)?;
        Ok((loss, all))
    }

    fn full_params(&mut self) -> Result<Vec<f32>> {
        let [p, ..] = self
            .state
            .host_state(self.dp.as_ref(), self.engine.backend())?;
        let (segs, vals) = self.owned(&[&p]);
        let mut full = vec![0.0f32; self.engine.whole_layout().total()];
        let mut at = 0;
        for (global, len) in segs {
            full[global..global + len].copy_from_slice(&vals[0][at..at + len]);
            at += len;
        }
        // every value has one owner and zeros elsewhere: the sums are exact
        if let Some(tp) = self.tp.as_deref() {
            tp.all_reduce(&mut full)?;
        }
        self.pp.all_reduce(&mut full)?;
        self.dp.all_reduce(&mut full)?;
        Ok(full)
    }

    fn load_full(&mut self, full: &[f32]) -> Result<()> {
        let part = self.stage_part(full);
        let r = self.dp.rank();
        self.state.load_params(self.engine.backend(), r, &part)
    }

    fn owned_state(&self) -> Result<OwnedState> {
        let [p, m, v] = self
            .state
            .host_state(self.dp.as_ref(), self.engine.backend())?;
        let (segments, mut vals) = self.owned(&[&p, &m, &v]);
        let v = vals.pop().expect("v");
        let m = vals.pop().expect("m");
        let params = vals.pop().expect("params");
        Ok(OwnedState {
            segments,
            params,
            m,
            v,
        })
    }

    fn load_state(&mut self, params: &[f32], m: &[f32], v: &[f32], adam_step: u32) -> Result<()> {
        self.load_full(params)?;
        let (m, v) = (self.stage_part(m), self.stage_part(v));
        let r = self.dp.rank();
        self.state.load_moments(self.engine.backend(), r, &m, &v)?;
        self.state.opt.step = adam_step;
        Ok(())
    }

    fn memory(&self) -> MemoryReport {
        self.engine.backend().memory_report()
    }

    fn timeline(&self) -> Vec<Span> {
        // one stage (sharded data parallelism over tp) is no pipeline
        match self.pp.size() {
            1 => Vec::new(),
            _ => self.timeline.clone(),
        }
    }

    fn comm_stats(&self) -> CommStats {
        let mut s = self.dp.stats();
        s.add(&self.pp.stats());
        if let Some(tp) = &self.tp {
            s.add(&tp.stats());
        }
        if let Some((tie, _)) = &self.tie {
            s.add(&tie.stats());
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::GptConfig;

    #[test]
    fn one_f_one_b_keeps_at_most_p_minus_s_in_flight_and_gpipe_m() {
        for (p, m) in [(2, 4), (4, 8), (4, 2), (3, 1)] {
            for s in 0..p {
                for schedule in [Schedule::GPipe, Schedule::OneFOneB] {
                    let ops = program(schedule, s, p, m);
                    let (mut live, mut peak, mut f, mut b) = (0i64, 0i64, 0, 0);
                    for op in &ops {
                        match op {
                            Op::Forward(i) => {
                                assert_eq!(*i, f, "forwards in order");
                                f += 1;
                                live += 1;
                            }
                            Op::Backward(i) => {
                                assert_eq!(*i, b, "backwards in order");
                                assert!(b < f, "a backward after its forward");
                                b += 1;
                                live -= 1;
                            }
                            _ => {}
                        }
                        peak = peak.max(live);
                    }
                    assert_eq!((f, b), (m, m), "{schedule} s{s} p{p} m{m}");
                    let want = in_flight(schedule, s, p, m);
                    assert_eq!(peak as usize, want, "{schedule} s{s} p{p} m{m}: {ops:?}");
                }
            }
        }
    }

    /// Runs every stage's program on an ideal machine (a forward takes 1,
    /// a backward 2, messages are free, a stage waits only for what it
    /// receives) and returns each stage's spans.
    fn simulate(schedule: Schedule, p: usize, m: usize) -> Vec<Vec<Span>> {
        let progs: Vec<Vec<Op>> = (0..p).map(|s| program(schedule, s, p, m)).collect();
        let (mut at, mut clock) = (vec![0; p], vec![0.0f64; p]);
        // when micro-batch i's forward / backward finished on each stage
        let mut fwd = vec![vec![None::<f64>; m]; p];
        let mut bwd = vec![vec![None::<f64>; m]; p];
        let mut spans = vec![Vec::new(); p];
        while (0..p).any(|s| at[s] < progs[s].len()) {
            let mut moved = false;
            for s in 0..p {
                while let Some(&op) = progs[s].get(at[s]) {
                    let (backward, i, cost) = match op {
                        Op::Forward(i) => (false, i, 1.0),
                        Op::Backward(i) => (true, i, 2.0),
                        _ => {
                            at[s] += 1;
                            continue;
                        }
                    };
                    let ready = match (backward, s) {
                        (false, 0) => Some(0.0),
                        (false, _) => fwd[s - 1][i],
                        (true, _) if s + 1 == p => fwd[s][i],
                        (true, _) => bwd[s + 1][i],
                    };
                    let Some(ready) = ready else { break };
                    let start = clock[s].max(ready);
                    clock[s] = start + cost;
                    let done = if backward { &mut bwd } else { &mut fwd };
                    done[s][i] = Some(clock[s]);
                    spans[s].push(Span {
                        backward,
                        micro_batch: i,
                        start,
                        end: clock[s],
                    });
                    at[s] += 1;
                    moved = true;
                }
            }
            assert!(moved, "{schedule} p{p} m{m}: the programs deadlock");
        }
        spans
    }

    #[test]
    fn on_an_ideal_machine_both_schedules_idle_as_the_bubble_formula_says() {
        for (p, m) in [(2, 4), (4, 8), (4, 4), (3, 7), (2, 1)] {
            for schedule in [Schedule::GPipe, Schedule::OneFOneB] {
                let got = measured_bubble(&simulate(schedule, p, m)).unwrap();
                let want = bubble(p, m);
                assert!(
                    (got - want).abs() < 1e-12,
                    "{schedule} p{p} m{m}: {got} idle vs formula {want}"
                );
            }
        }
    }

    #[test]
    fn stages_are_contiguous_hold_a_block_each_and_balance_the_head() {
        let cfg = GptConfig {
            n_layer: 6,
            n_head: 2,
            n_embd: 32,
            block_size: 16,
            vocab_size: 1024,
        };
        let lay = ParamLayout::new(&cfg);
        let n = lay.units.len();
        for p in 1..=6 {
            let stages = partition(&lay, p);
            assert_eq!(stages.len(), p);
            assert_eq!(stages[0].start, 0);
            assert_eq!(stages[p - 1].end, n);
            for k in 1..p {
                assert_eq!(stages[k].start, stages[k - 1].end);
            }
            // every stage has a block
            assert!(stages
                .iter()
                .all(|r| r.clone().any(|u| u >= 1 && u < n - 1)));
        }
        // the head reads a 1024 x 32 embedding (more than two blocks' work):
        // at 2 stages the last takes fewer blocks
        let two = partition(&lay, 2);
        assert!(two[1].len() - 1 < two[0].len() - 1, "{two:?}");
    }
}
