//! zero2 and fsdp (ZeRO-3, FULL_SHARD). Rank r owns slice r of every unit
//! the model declares (its embeddings, each block, its head) of the
//! gradients and AdamW moments, and under fsdp of the parameters too: each
//! unit is all-gathered right before its forward and, unless it is still
//! gathered, again before its backward; its gradient is reduce-scattered as
//! soon as the unit's backward is done. A unit whose tensor a later unit
//! ties (GPT-2's and BERT's word embeddings, read again by the head) has a
//! gather buffer of its own and stays gathered from its forward to its
//! backward, as FSDP's root unit does: it is gathered once per forward.
//! Gathered parameters count as params; the gradient scratch as `other`.

use super::{check_finite, local_rows, OwnedState, StepConfig, StepStats, Strategy, Units};
use crate::backend::{Backend, Buf, Category, Dst, MemoryReport, Src};
use crate::comm::{device, Comm, CommStats};
use crate::data::Batch;
use crate::error::Result;
use crate::model::{AdamW, AdamWConfig, UnitGrads, UnitModel, UnitParams};

pub struct Sharded<B: Backend> {
    engine: Box<dyn UnitModel<B>>,
    units: Units,
    params: Params<B>,
    g_shard: Buf<B>,
    opt: AdamW<B>,
    /// A unit's full gradient before it is reduce-scattered ([BODY]), and
    /// the last unit's while a tied tensor's gradient is in [BODY] ([HEAD]).
    grad_unit: [Buf<B>; 2],
    rs_out: Buf<B>,
    dp: Box<dyn Comm>,
    b: usize,
    t: usize,
}

/// Gradient scratch slots.
const BODY: usize = 0;
const HEAD: usize = 1;

/// Where the parameters live.
enum Params<B: Backend> {
    /// zero2: whole on every rank.
    Whole(Buf<B>),
    /// fsdp: this rank's shard, gather buffers (slot 0 for units no later
    /// unit ties to, then one per tied-to unit), and which unit each holds.
    Sharded {
        shard: Buf<B>,
        gathered: Vec<Buf<B>>,
        slot_of: Vec<usize>,
        held: Vec<Option<usize>>,
    },
}

impl<B: Backend> Params<B> {
    /// Unit u's parameters: from the whole buffer (zero2) or its gather slot (fsdp).
    fn unit(&self, units: &Units, u: usize) -> Src<'_, B> {
        match self {
            Params::Whole(p) => p.slice(units.ranges[u].clone()),
            Params::Sharded {
                gathered, slot_of, ..
            } => gathered[slot_of[u]].slice(0..units.ranges[u].len()),
        }
    }

    /// Unit u's own parameters and its tied tensor's.
    fn of(&self, units: &Units, lay: &crate::model::ParamLayout, u: usize) -> UnitParams<'_, B> {
        UnitParams {
            own: self.unit(units, u),
            tied: lay.units[u].tied.as_ref().map(|t| {
                let at = t.range.start - units.ranges[t.unit].start;
                self.unit(units, t.unit).slice(at..at + t.range.len())
            }),
        }
    }

    /// Forgets what the gather buffers hold (the parameters changed).
    fn forget(&mut self) {
        if let Params::Sharded { held, .. } = self {
            held.iter_mut().for_each(|h| *h = None);
        }
    }
}

impl<B: Backend> Sharded<B> {
    pub fn new(
        engine: Box<dyn UnitModel<B>>,
        dp: Box<dyn Comm>,
        fsdp: bool,
        adamw: AdamWConfig,
        b: usize,
        t: usize,
    ) -> Result<Self> {
        let lay = engine.layout();
        let units = Units::new(lay, dp.size());
        let be = engine.backend();
        let last = units.ranges.len() - 1;
        let params = if fsdp {
            let (slot_of, sizes) = units.gather_slots(lay);
            Params::Sharded {
                shard: be.alloc(units.shard_total(), Category::Params)?,
                gathered: sizes
                    .iter()
                    .map(|&n| be.alloc(n, Category::Params))
                    .collect::<Result<_>>()?,
                held: vec![None; sizes.len()],
                slot_of,
            }
        } else {
            Params::Whole(be.alloc(lay.total(), Category::Params)?)
        };
        Ok(Sharded {
            g_shard: be.alloc(units.shard_total(), Category::Grads)?,
            opt: AdamW::new(be, units.shard_total(), adamw)?,
            grad_unit: [
                be.alloc(units.max_padded(), Category::Other)?,
                be.alloc(units.padded(last), Category::Other)?,
            ],
            rs_out: be.alloc(
                units.shard_len.iter().copied().max().unwrap_or(0),
                Category::Other,
            )?,
            params,
            units,
            engine,
            dp,
            b,
            t,
        })
    }

    /// fsdp: all-gathers unit u into its slot, unless the slot holds it already.
    fn fetch(&mut self, u: usize) -> Result<()> {
        if let Params::Sharded {
            shard,
            gathered,
            slot_of,
            held,
        } = &mut self.params
        {
            let slot = slot_of[u];
            if held[slot] == Some(u) {
                return Ok(());
            }
            let n = self.units.padded(u);
            device::all_gather(
                self.dp.as_ref(),
                self.engine.backend(),
                shard.slice(self.units.shard_of(u)),
                gathered[slot].slice_mut(0..n),
            )?;
            held[slot] = Some(u);
        }
        Ok(())
    }

    /// Reduce-scatters unit u's gradient from scratch `slot` and adds this rank's part to its shard.
    fn reduce(&mut self, u: usize, slot: usize) -> Result<()> {
        let s = self.units.shard_len[u];
        let be = self.engine.backend();
        device::reduce_scatter(
            self.dp.as_ref(),
            be,
            self.grad_unit[slot].slice(0..s * self.units.n),
            self.rs_out.slice_mut(0..s),
        )?;
        be.add_inplace(
            self.g_shard.slice_mut(self.units.shard_of(u)),
            self.rs_out.slice(0..s),
        );
        Ok(())
    }

    fn clear_grad(&mut self, u: usize, slot: usize) {
        let n = self.units.padded(u);
        self.engine
            .backend()
            .fill(self.grad_unit[slot].slice_mut(0..n), 0.0);
    }

    fn forward(&mut self, mb: &Batch, loss_terms: f32) -> Result<f32> {
        let b = self.b / self.dp.size();
        self.engine.begin(mb, b, self.t, loss_terms)?;
        // Each forward gathers afresh.
        self.params.forget();
        let mut loss = None;
        for u in 0..self.units.ranges.len() {
            self.fetch(u)?;
            if let Some(tied) = &self.engine.layout().units[u].tied {
                self.fetch(tied.unit)?;
            }
            let p = self.params.of(&self.units, self.engine.layout(), u);
            loss = self.engine.forward(u, p, None)?;
        }
        Ok(loss.expect("targets given"))
    }

    /// Backward right after `forward`: units that are still gathered (the
    /// last one, tied-to ones) are not gathered again.
    fn backward(&mut self, loss_scale: f32) -> Result<()> {
        let last = self.units.ranges.len() - 1;
        for u in (0..=last).rev() {
            self.fetch(u)?;
            let tied = self.engine.layout().units[u].tied.clone();
            // With a tied tensor the body slot takes its unit's gradient.
            let slot = if tied.is_some() { HEAD } else { BODY };
            self.clear_grad(u, slot);
            if let Some(t) = &tied {
                self.fetch(t.unit)?;
                self.clear_grad(t.unit, BODY);
            }
            {
                let p = self.params.of(&self.units, self.engine.layout(), u);
                let [body, head] = &mut self.grad_unit;
                let own_len = self.units.ranges[u].len();
                let (own, tied_g): (Dst<'_, B>, _) = match &tied {
                    Some(t) => {
                        let at = t.range.start - self.units.ranges[t.unit].start;
                        (
                            head.slice_mut(0..own_len),
                            Some(body.slice_mut(at..at + t.range.len())),
                        )
                    }
                    None => (body.slice_mut(0..own_len), None),
                };
                let g = UnitGrads { own, tied: tied_g };
                self.engine.backward(u, p, g, None, loss_scale)?;
            }
            self.reduce(u, slot)?;
            if let Some(t) = &tied {
                self.reduce(t.unit, BODY)?;
            }
        }
        Ok(())
    }
}

impl<B: Backend> Strategy for Sharded<B> {
    fn step(&mut self, micro_batches: &[Batch], cfg: StepConfig) -> Result<StepStats> {
        let (r, n) = (self.dp.rank(), self.dp.size());
        self.engine.backend().fill(self.g_shard.d(), 0.0);
        let scale = 1.0 / (micro_batches.len() * n) as f32;
        let mut loss = [0.0f32];
        for mb in micro_batches {
            let local = local_rows(mb, self.b, r, n);
            loss[0] += self.forward(&local, mb.loss_terms() as f32 / n as f32)?;
            self.backward(scale)?;
        }
        self.dp.all_reduce(&mut loss)?;
        let be = self.engine.backend();
        let mut sq = [be.sum_squares(self.g_shard.s())? as f32];
        self.dp.all_reduce(&mut sq)?;
        let grad_norm = sq[0].sqrt();
        check_finite(loss[0], grad_norm)?;
        let clip = if cfg.grad_clip > 0.0 && grad_norm > cfg.grad_clip {
            cfg.grad_clip / grad_norm
        } else {
            1.0
        };
        let segs = self.units.segments(r);
        let lay = self.engine.layout();
        match &mut self.params {
            Params::Sharded { shard, .. } => {
                self.opt
                    .update(be, shard.d(), self.g_shard.s(), lay, &segs, cfg.lr, clip)
            }
            Params::Whole(full) => {
                let mut p = be.alloc(self.units.shard_total(), Category::Other)?;
                self.units.shard_from(be, full.s(), r, p.d());
                self.opt
                    .update(be, p.d(), self.g_shard.s(), lay, &segs, cfg.lr, clip);
                let mut g = be.alloc(self.units.max_padded(), Category::Other)?;
                for u in 0..self.units.ranges.len() {
                    let range = self.units.ranges[u].clone();
                    device::all_gather(
                        self.dp.as_ref(),
                        be,
                        p.slice(self.units.shard_of(u)),
                        g.slice_mut(0..self.units.shard_len[u] * n),
                    )?;
                    be.copy(full.slice_mut(range.clone()), g.slice(0..range.len()));
                }
            }
        }
        self.params.forget();
        be.synchronize()?;
        Ok(StepStats {
            loss: loss[0] / (n * micro_batches.len()) as f32,
            grad_norm,
        })
    }

    fn eval_loss(&mut self, batch: &Batch) -> Result<f32> {
        let n = self.dp.size();
        let local = local_rows(batch, self.b, self.dp.rank(), n);
        let mut loss = [self.forward(&local, batch.loss_terms() as f32 / n as f32)?];
        self.dp.all_reduce(&mut loss)?;
        Ok(loss[0] / n as f32)
    }

    fn eval_outputs(&mut self, batch: &Batch) -> Result<(f32, Vec<f32>)> {
        let loss = self.eval_loss(batch)?;
        let mine = self.engine.outputs()?;
        let mut all = vec![0.0; mine.len() * self.dp.size()];
        self.dp.all_gather(&mine, &mut all)?;
        Ok((loss, all))
    }

    fn full_params(&mut self) -> Result<Vec<f32>> {
        if let Params::Whole(full) = &self.params {
            return self.engine.backend().to_host(full.s());
        }
        let mut out = vec![0.0; self.engine.layout().total()];
        for u in 0..self.units.ranges.len() {
            self.fetch(u)?;
            let range = self.units.ranges[u].clone();
            self.engine
                .backend()
                .download(self.params.unit(&self.units, u), &mut out[range])?;
        }
        Ok(out)
    }

    fn load_full(&mut self, full: &[f32]) -> Result<()> {
        self.params.forget();
        let be = self.engine.backend();
        match &mut self.params {
            Params::Whole(p) => be.upload(p.d(), full),
            Params::Sharded { shard, .. } => {
                be.upload(shard.d(), &self.units.shard_of_host(full, self.dp.rank()))
            }
        }
    }

    fn owned_state(&self) -> Result<OwnedState> {
        let be = self.engine.backend();
        let mut st = OwnedState::default();
        let (m, v) = (be.read(self.opt.m.s())?, be.read(self.opt.v.s())?);
        let (p, whole) = match &self.params {
            Params::Sharded { shard, .. } => (be.read(shard.s())?, false),
            Params::Whole(full) => (be.read(full.s())?, true),
        };
        for s in self.units.segments(self.dp.rank()) {
            let at = if whole { s.global } else { s.local };
            st.push(s.global, s.len, (&p[..], at), (&m[..], s.local), &v[..]);
        }
        Ok(st)
    }

    fn load_state(&mut self, params: &[f32], m: &[f32], v: &[f32], adam_step: u32) -> Result<()> {
        self.load_full(params)?;
        let r = self.dp.rank();
        let be = self.engine.backend();
        be.upload(self.opt.m.d(), &self.units.shard_of_host(m, r))?;
        be.upload(self.opt.v.d(), &self.units.shard_of_host(v, r))?;
        self.opt.step = adam_step;
        Ok(())
    }

    fn memory(&self) -> MemoryReport {
        self.engine.backend().memory_report()
    }

    fn comm_stats(&self) -> CommStats {
        self.dp.stats()
    }
}
