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
//! tensor parallelism (the engine's tp group). Every layout is such a
//! pipeline: single, ddp, zero1, zero2, fsdp and tp are one stage.
//!
//! `schedule` makes each rank's program (its passes and messages, checked
//! before the first step); `Pipelined` runs it. A chunk's engine holds each
//! micro-batch in flight in a slot of its own (`UnitModel::hold`), sized
//! for the chunk's units alone (`StageModel::set_units`).

mod schedule;

use schedule::link;
pub use schedule::{
    ideal_run, in_flight, measured_bubble, on_one_clock, partition, programs, ranks_tasks, tasks,
    wall_clock_s, zb_h1_bubble, Exchange, Message, Pass, Pipeline, Program, Schedule, Span, Step,
    Task,
};

use super::grid::{Grid, Groups};
use super::stage::{HostOffload, StageMap, StageState};
use super::{
    check_finite, local_rows, Offload, OwnedState, ParallelConfig, StepConfig, StepStats, Strategy,
};
use crate::backend::cpu::Cpu;
use crate::backend::{Backend, Buf, Category, Device, MemoryReport};
use crate::comm::{Comm, CommStats};
use crate::data::{Batch, LossTerms};
use crate::error::{Error, Result};
use crate::model::tp::{shard_tp, TpSplit};
use crate::model::{AdamWConfig, ModelConfig, Precision, UnitModel};
use std::time::Instant;

/// One of a rank's virtual stages (a run of contiguous units; one a rank
/// except when interleaved): an engine holding activations for its units
/// alone, and its state as the stage's replicas share it.
struct Chunk<B: Backend> {
    /// Its virtual stage: chunk c of rank s is c p + s.
    stage: usize,
    engine: Box<dyn UnitModel<B>>,
    map: StageMap,
    state: StageState<B>,
    /// The micro-batch in flight in each of the engine's slots (none: free).
    slots: Vec<Option<usize>>,
}

impl<B: Backend> Chunk<B> {
    /// Holds micro-batch `mb` in the engine's first free slot.
    fn take_slot(&mut self, mb: usize) {
        let at = self.slots.iter().position(Option::is_none);
        let at = at.unwrap_or(self.slots.len());
        self.slots.resize(self.slots.len().max(at + 1), None);
        self.slots[at] = Some(mb);
        self.engine.hold(at);
    }

    /// Runs the engine on micro-batch `mb`'s slot, which it frees when
    /// `done`; `order` says which pass must have taken it.
    fn resume(&mut self, mb: usize, order: &str, done: bool) {
        let at = self.slots.iter().position(|&i| i == Some(mb)).expect(order);
        self.engine.hold(at);
        if done {
            self.slots[at] = None;
        }
    }
}

pub struct Pipelined<B: Backend> {
    chunks: Vec<Chunk<B>>,
    /// [`StageState::update`]'s scratch, the largest chunk's.
    update_scratch: Option<Buf<B>>,
    /// The pipeline (stage s is rank s), the data-parallel replicas of this
    /// stage, the tensor-parallel group.
    pp: Box<dyn Comm>,
    dp: Box<dyn Comm>,
    tp: Option<Box<dyn Comm>>,
    /// The first and last stage at this (dp, tp) position, which sum the
    /// gradient of the unit a tied tensor lives in, and the chunk and piece
    /// that unit is on this rank (none on other ranks, or without a tie
    /// across stages).
    tie: Option<(Box<dyn Comm>, usize, usize)>,
    pipe: Pipeline,
    /// Each micro-batch count's program for this rank, once checked.
    programs: Vec<(usize, Program)>,
    b: usize,
    t: usize,
    /// The residual stream's width (what flows between stages per token).
    width: usize,
    /// What this stage computed when in the last step's program, on the
    /// wall clock every rank of a machine shares (read at each pass: a
    /// clock of the rank's own drew a late rank's passes before their input).
    timeline: Vec<Span>,
    /// Under offload, the host memory's counters.
    host: Option<Cpu>,
}

impl<B: Backend> Pipelined<B> {
    /// Collective over `world` (it makes this rank's groups and the
    /// tied-tensor groups). One engine per chunk
    /// (`par.pipeline.virtual_stages` of them); batches of `b` x `t`.
    pub fn new(
        engines: Vec<Box<dyn UnitModel<B>>>,
        model: &ModelConfig,
        world: &dyn Comm,
        par: &ParallelConfig,
        adamw: AdamWConfig,
        b: usize,
        t: usize,
    ) -> Result<Self> {
        let grid = Grid::of(par);
        let Groups { pp, dp, tp } = grid.groups(world)?;
        let (s, p) = (pp.rank(), pp.size());
        let lay = engines[0].layout().clone();
        let stages = partition(&lay, p * engines.len());
        // the virtual stages owning and reading a tied tensor, and its unit
        let tied_ends = lay.units.iter().enumerate().find_map(|(u, unit)| {
            let t = unit.tied.as_ref()?;
            let (owner, reader) = (
                stages.iter().position(|r| r.contains(&t.unit))?,
                stages.iter().position(|r| r.contains(&u))?,
            );
            (owner != reader).then_some((owner, reader, t.unit))
        });
        let ends = tied_ends.map_or(vec![], |(a, z, _)| vec![a % p, z % p]);
        let tie_group = grid.stages_group(world, &ends)?;
        let mut chunks = Vec::new();
        let mut tie_piece = None;
        let (pipe, sharing) = (par.pipeline, par.strategy.sharing());
        let host = (!par.offload.is_none()).then(Cpu::new);
        let offload = host.as_ref().map(|host| HostOffload {
            host,
            params: par.offload == Offload::Params,
            overlap: !par.offload_serial,
        });
        for (c, mut engine) in engines.into_iter().enumerate() {
            let stage = c * p + s;
            let map = StageMap::of(&lay, &stages, stage);
            for u in map.units.start + 1..map.units.end {
                if lay.units[u].range.start != lay.units[u - 1].range.end {
                    return Err(Error::Config(format!(
                        "{model}: units {} and {u} are not adjacent in the parameter layout",
                        u - 1
                    )));
                }
            }
            let be = engine.backend();
            let mut state = StageState::new(be, &lay, &map, sharing, dp.as_ref(), adamw, offload)?;
            if par.precision == Precision::Bf16 {
                state.keep_bf16_copy(be)?;
            }
            if pipe.schedule == Schedule::ZbH1 {
                engine.as_stage()?.split_backward()?;
            }
            if let Some((a, z, owner)) = tied_ends.filter(|&(a, z, _)| stage == a || stage == z) {
                // the owner's unit, or the reader's copy of it (piece 0)
                let k = if owner >= map.units.start {
                    state.piece(owner)
                } else {
                    debug_assert!(stage == z && stage != a);
                    0
                };
                state.set_tied_across(k);
                tie_piece = Some((c, k));
            }
            if map.units.len() < lay.units.len() {
                engine.as_stage()?.set_units(map.units.clone());
            }
            chunks.push(Chunk {
                stage,
                engine,
                map,
                state,
                slots: Vec::new(),
            });
        }
        // one update's scratch for all chunks (they update in turn), counted from the start
        let need = chunks.iter().map(|c| c.state.update_scratch()).max();
        let update_scratch = match (need, chunks.first()) {
            (Some(n), Some(c)) if n > 0 => Some(c.engine.backend().alloc(n, Category::Other)?),
            _ => None,
        };
        Ok(Pipelined {
            chunks,
            update_scratch,
            pp,
            dp,
            tp,
            tie: tie_piece.map(|(c, k)| (tie_group, c, k)),
            pipe,
            programs: Vec::new(),
            b,
            t,
            width: model.n_embd(),
            timeline: Vec::new(),
            host,
        })
    }

    /// Virtual stages in the whole pipeline.
    fn virtual_stages(&self) -> usize {
        self.pp.size() * self.chunks.len()
    }

    /// The engine of the first chunk (every chunk's has the same layouts).
    fn engine(&self) -> &dyn UnitModel<B> {
        self.chunks[0].engine.as_ref()
    }

    /// Readies chunk c's engine for a micro-batch in the slot it holds.
    fn begin(&mut self, c: usize, mb: &Batch, terms: LossTerms) -> Result<()> {
        let n = self.dp.size();
        self.chunks[c].engine.begin(mb, self.b / n, self.t, terms)
    }

    /// Chunk c's units forward on the begun micro-batch from the activation
    /// `input` (none on the first virtual stage); returns the loss (the last
    /// virtual stage) and the activation for the next one.
    fn run_forward(
        &mut self,
        c: usize,
        input: Option<Vec<f32>>,
    ) -> Result<(Option<f32>, Option<Vec<f32>>)> {
        let last = self.chunks[c].stage + 1 == self.virtual_stages();
        let Pipelined { chunks, dp, tp, .. } = self;
        let ch = &mut chunks[c];
        let be = ch.engine.backend().clone_fresh();
        let units = ch.map.units.clone();
        if let Some(x) = input {
            be.upload(ch.engine.as_stage()?.boundary(units.start), &x)?;
        }
        let lay = ch.engine.layout().clone();
        let mut loss = None;
        for u in units.clone() {
            ch.state.ready(dp.as_ref(), &be, &lay, u)?;
            let p = ch.state.params(&lay, u);
            loss = ch.engine.forward(u, p, tp.as_deref())?;
        }
        let out = match last {
            true => None,
            false => Some(be.to_host(ch.engine.as_stage()?.boundary(units.end).into_src())?),
        };
        Ok((loss, out))
    }

    /// Chunk c's units backward (`pass`) on micro-batch `mb` from the
    /// gradient `grad` (none on the last virtual stage); returns the
    /// gradient for the previous virtual stage. Under zb-h1 a
    /// `Pass::Backward` runs only the input halves and the micro-batch stays
    /// in flight for its `Pass::Weight`, the weight halves.
    fn run_backward(
        &mut self,
        c: usize,
        mb: usize,
        pass: Pass,
        grad: Option<Vec<f32>>,
        loss_scale: f32,
    ) -> Result<Option<Vec<f32>>> {
        let Pipelined { chunks, dp, tp, .. } = self;
        let ch = &mut chunks[c];
        let be = ch.engine.backend().clone_fresh();
        let input_half = pass == Pass::Backward && self.pipe.schedule == Schedule::ZbH1;
        match pass {
            Pass::Weight => ch.resume(mb, "an input half before its weight half", true),
            _ => ch.resume(mb, "a forward before its backward", !input_half),
        }
        if let Some(g) = grad {
            be.upload(ch.engine.as_stage()?.boundary_grad(), &g)?;
        }
        let lay = ch.engine.layout().clone();
        for u in ch.map.units.clone().rev() {
            ch.state.ready(dp.as_ref(), &be, &lay, u)?;
            if input_half {
                let p = ch.state.params(&lay, u);
                ch.engine
                    .as_stage()?
                    .backward_input(u, p, tp.as_deref(), loss_scale)?;
                continue;
            }
            let (p, g) = ch.state.unit(&be, &lay, u);
            match pass {
                Pass::Weight => ch.engine.as_stage()?.backward_weight(u, p, g)?,
                _ => ch.engine.backward(u, p, g, tp.as_deref(), loss_scale)?,
            }
            ch.state.backward_done(dp.as_ref(), &be, &lay, u)?;
        }
        let out = match (ch.stage, pass) {
            (0, _) | (_, Pass::Weight) => None,
            _ => Some(be.to_host(ch.engine.as_stage()?.boundary_grad().into_src())?),
        };
        Ok(out)
    }

    /// This rank's program for m micro-batches (made and checked once).
    fn program(&mut self, m: usize) -> Result<Program> {
        if let Some((_, prog)) = self.programs.iter().find(|(k, _)| *k == m) {
            return Ok(prog.clone());
        }
        let prog = programs(self.pipe, m)?.swap_remove(self.pp.rank());
        self.programs.push((m, prog.clone()));
        Ok(prog)
    }

    /// Runs this rank's program for `mbs` local micro-batches; returns the
    /// sum of their losses (the last stage's; zero elsewhere).
    fn run_program(&mut self, mbs: &[(Batch, LossTerms)], loss_scale: f32) -> Result<f32> {
        let prog = self.program(mbs.len())?;
        let mut loss = 0.0f32;
        let len = mbs.first().map_or(0, |mb| self.boundary_len(&mb.0));
        self.timeline.clear();
        let (s, pipe) = (self.pp.rank(), self.pipe);
        // received and not yet used, made and not yet sent
        let mut inbox: Vec<(Message, Vec<f32>)> = Vec::new();
        let mut outbox: Vec<(Message, Vec<f32>)> = Vec::new();
        let take = |v: &mut Vec<(Message, Vec<f32>)>, msg: Message| {
            let at = v
                .iter()
                .position(|(x, _)| *x == msg)
                .expect("the program orders it");
            v.swap_remove(at).1
        };
        for step in &prog.steps {
            let task = match *step {
                Step::Run(task) => task,
                Step::Swap(e) => {
                    let y = e.send.map(|(to, msg)| (to, take(&mut outbox, msg)));
                    let mut x = e.recv.map(|(from, msg)| (from, msg, vec![0.0f32; len]));
                    match (&y, x.as_mut()) {
                        (Some((to, y)), Some((from, _, x))) => {
                            self.pp.send_recv(y, *to, x, *from)?
                        }
                        (Some((to, y)), None) => self.pp.send(y, *to)?,
                        (None, Some((from, _, x))) => self.pp.recv(x, *from)?,
                        (None, None) => {}
                    }
                    inbox.extend(x.map(|(_, msg, x)| (msg, x)));
                    continue;
                }
            };
            let input = link(&task, s, pipe, false).map(|(_, msg)| take(&mut inbox, msg));
            let (c, i) = (task.chunk, task.micro_batch);
            let start = wall_clock_s();
            let output = match task.pass {
                Pass::Forward => {
                    self.chunks[c].take_slot(i);
                    self.begin(c, &mbs[i].0, mbs[i].1)?;
                    let (l, y) = self.run_forward(c, input)?;
                    loss += l.unwrap_or(0.0);
                    y
                }
                pass => self.run_backward(c, i, pass, input, loss_scale)?,
            };
            if let Some((_, msg)) = link(&task, s, pipe, true) {
                outbox.push((
                    msg,
                    output.expect("a task with a successor makes its input"),
                ));
            }
            self.timeline.push(Span {
                pass: task.pass,
                chunk: c,
                micro_batch: i,
                start,
                end: wall_clock_s(),
            });
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
        let (mut split, mut rep) = (0.0, 0.0);
        for ch in &self.chunks {
            let be = ch.engine.backend();
            let (s, r) = ch
                .state
                .grad_squares(be, ch.engine.layout(), self.dp.rank())?;
            (split, rep) = (split + s, rep + r);
        }
        if self.chunks[0].state.sharded() {
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

    /// What chunk c writes to a checkpoint as replica r of its stage (its
    /// parameters, and moments when `moments`), in whole-layout
    /// coordinates: its stage state's runs of the (tensor-parallel) layout
    /// mapped through each tensor's split, a replicated tensor by tp rank 0
    /// only. Every value of the model has exactly one writer per replica set.
    fn owned(&self, c: usize, r: usize, moments: bool) -> Result<OwnedState> {
        let ch = &self.chunks[c];
        let local = ch.state.owned(ch.engine.backend(), r, moments)?;
        let tp = ch.engine.tp();
        let whole = ch.engine.whole_layout();
        // (where in the whole layout, how many, where in `local`)
        let mut runs = Vec::new();
        let mut base = 0;
        for &(start, n) in &local.segments {
            let run = start..start + n;
            for (w, l) in whole.tensors.iter().zip(&ch.engine.layout().tensors) {
                let lr = l.range();
                if lr.end <= run.start || run.end <= lr.start {
                    continue;
                }
                if w.split == TpSplit::Replicated && tp.rank != 0 {
                    continue;
                }
                // the tensor's local elements, run by run of the whole tensor
                let mut at = lr.start;
                for (full_at, len) in w.split.runs(&w.full_shape, tp.size, tp.rank) {
                    let (a, b) = (at.max(run.start), (at + len).min(run.end));
                    if a < b {
                        runs.push((w.offset + full_at + a - at, b - a, base + a - run.start));
                    }
                    at += len;
                }
            }
            base += n;
        }
        let mut st = OwnedState::default();
        // Runs that take every value in the order the stage holds them make
        // its buffers the checkpoint's as they are: no second copy of the
        // parameters and moments at the end of a run.
        let mut next = 0;
        let in_order = runs.iter().all(|&(_, len, from)| {
            let ok = from == next;
            next += len;
            ok
        }) && next == local.params.len();
        for &(global, len, from) in &runs {
            match in_order {
                true => st.add_run(global, len),
                false => {
                    let mv = moments.then(|| [&local.m[from..], &local.v[from..]]);
                    st.push(global, len, &local.params[from..], mv);
                }
            }
        }
        if in_order {
            (st.params, st.m, st.v) = (local.params, local.m, local.v);
        }
        Ok(st)
    }

    /// Chunk c's part of a whole-layout host buffer, as its buffers hold it.
    fn stage_part(&self, c: usize, full: &[f32]) -> Vec<f32> {
        let ch = &self.chunks[c];
        let e = &ch.engine;
        let mut local = vec![0.0; e.layout().total()];
        shard_tp(full, e.whole_layout(), e.layout(), e.tp(), &mut local);
        let copied = ch.map.copy.iter().flat_map(|cp| &local[cp.clone()]);
        copied.chain(&local[ch.map.own.clone()]).copied().collect()
    }

    /// This data-parallel rank's rows of a global batch.
    fn local(&self, batch: &Batch) -> Batch {
        local_rows(batch, self.b, self.dp.rank(), self.dp.size())
    }
}

impl<B: Backend> Strategy for Pipelined<B> {
    fn step(&mut self, micro_batches: &[Batch], cfg: StepConfig) -> Result<StepStats> {
        let be = self.engine().backend().clone_fresh();
        let n = self.dp.size();
        let m = micro_batches.len();
        for ch in &mut self.chunks {
            ch.state.begin_step(&be, m);
        }
        // a step is the batch of all its micro-batches' rows: each divides
        // by the step's count, so a short micro-batch (a classifier's last
        // of an epoch, a masked LM's fewer masks) weighs its rows, as the
        // same rows in one batch or over data-parallel ranks do
        let terms = (micro_batches.iter().map(Batch::loss_terms))
            .sum::<LossTerms>()
            .per_rank(n);
        let mbs: Vec<(Batch, LossTerms)> = (micro_batches.iter())
            .map(|mb| (self.local(mb), terms))
            .collect();
        let mut loss = [self.run_program(&mbs, 1.0 / n as f32)?];
        for (c, ch) in self.chunks.iter_mut().enumerate() {
            let tie = match &self.tie {
                Some((g, tc, k)) if *tc == c => Some((g.as_ref(), *k)),
                _ => None,
            };
            ch.state.reduce_all(self.dp.as_ref(), &be, tie)?;
        }
        self.dp.all_reduce(&mut loss)?;
        let loss = self.share_loss(loss[0])? / n as f32;
        let grad_norm = self.grad_norm()?;
        check_finite(loss, grad_norm)?;
        let clip = cfg.clip_scale(grad_norm);
        let t0 = Instant::now();
        let Pipelined {
            chunks,
            dp,
            update_scratch,
            ..
        } = self;
        for ch in chunks {
            let lay = ch.engine.layout().clone();
            let scratch = update_scratch.as_mut().map(|b| b.d());
            ch.state.update(
                dp.as_ref(),
                ch.engine.backend(),
                &lay,
                cfg.lr,
                clip,
                scratch,
            )?;
        }
        be.synchronize()?;
        Ok(StepStats {
            loss,
            grad_norm,
            update_s: t0.elapsed().as_secs_f64(),
        })
    }

    fn eval_loss(&mut self, batch: &Batch) -> Result<f32> {
        let n = self.dp.size();
        let (mb, terms) = (self.local(batch), batch.loss_terms().per_rank(n));
        let p = self.pp.size();
        let mut loss = 0.0;
        for c in 0..self.chunks.len() {
            let vs = self.chunks[c].stage;
            let input = match vs {
                0 => None,
                _ => {
                    let mut x = vec![0.0f32; self.boundary_len(&mb)];
                    self.pp.recv(&mut x, (vs - 1) % p)?;
                    Some(x)
                }
            };
            // between steps every slot is free: the evaluation takes the first
            self.chunks[c].engine.hold(0);
            self.begin(c, &mb, terms)?;
            let (l, y) = self.run_forward(c, input)?;
            loss += l.unwrap_or(0.0);
            if let Some(y) = y {
                self.pp.send(&y, (vs + 1) % p)?;
            }
        }
        let mut loss = [loss];
        self.dp.all_reduce(&mut loss)?;
        Ok(self.share_loss(loss[0])? / n as f32)
    }

    fn eval_outputs(&mut self, batch: &Batch) -> Result<(f32, Vec<f32>)> {
        let loss = self.eval_loss(batch)?;
        let last = self.virtual_stages() - 1;
        let mine = match self.chunks.last_mut().filter(|ch| ch.stage == last) {
            Some(ch) => ch.engine.outputs()?,
            None => Vec::new(),
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
        // a replicated stage's replicas each hold it all: each fills its own
        // copy as replica 0 would, and only sharded stages sum over dp
        let sharded = self.chunks[0].state.sharded();
        let r = if sharded { self.dp.rank() } else { 0 };
        let mut full = vec![0.0f32; self.engine().whole_layout().total()];
        for c in 0..self.chunks.len() {
            let mine = self.owned(c, r, false)?;
            let mut at = 0;
            for (global, len) in mine.segments {
                full[global..global + len].copy_from_slice(&mine.params[at..at + len]);
                at += len;
            }
        }
        // every value has one writer and zeros elsewhere: the sums are exact
        if let Some(tp) = self.tp.as_deref() {
            tp.all_reduce(&mut full)?;
        }
        if self.pp.size() > 1 {
            self.pp.all_reduce(&mut full)?;
        }
        if sharded && self.dp.size() > 1 {
            self.dp.all_reduce(&mut full)?;
        }
        Ok(full)
    }

    fn load_full(&mut self, full: &[f32]) -> Result<()> {
        let r = self.dp.rank();
        for c in 0..self.chunks.len() {
            let part = self.stage_part(c, full);
            let ch = &mut self.chunks[c];
            ch.state.load_params(ch.engine.backend(), r, &part)?;
        }
        Ok(())
    }

    fn owned_state(&self) -> Result<OwnedState> {
        let mut st = OwnedState::default();
        for c in 0..self.chunks.len() {
            st.append(self.owned(c, self.dp.rank(), true)?);
        }
        Ok(st)
    }

    fn load_state(&mut self, params: &[f32], m: &[f32], v: &[f32], adam_step: u32) -> Result<()> {
        self.load_full(params)?;
        let r = self.dp.rank();
        for c in 0..self.chunks.len() {
            let (m, v) = (self.stage_part(c, m), self.stage_part(c, v));
            let ch = &mut self.chunks[c];
            ch.state.load_moments(ch.engine.backend(), r, &m, &v)?;
            ch.state.set_adam_step(adam_step);
        }
        Ok(())
    }

    fn memory(&self) -> MemoryReport {
        let mut r = self.engine().backend().memory_report();
        r.host = self.host.as_ref().map(|c| Box::new(c.memory_report()));
        r
    }

    fn batch_parts(&self) -> usize {
        self.engine().batch_parts()
    }

    fn free_activations(&mut self) {
        for ch in &mut self.chunks {
            ch.slots.clear();
            ch.engine.free_activations();
        }
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
        if let Some((tie, ..)) = &self.tie {
            s.add(&tie.stats());
        }
        s
    }
}
