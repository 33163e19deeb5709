//! zero2 and fsdp (ZeRO-3, FULL_SHARD). Rank r owns slice r of every unit
//! ([wte | wpe], each block, [ln_f]) of the gradients and AdamW moments, and
//! under fsdp of the parameters too: each unit is all-gathered right before
//! its forward and again before its backward, and its gradient is
//! reduce-scattered as soon as the unit's backward is done. Gathered
//! parameters count as params (one unit, plus [ln_f] beside [wte | wpe] in
//! the head); the one-unit gradient scratch counts as `other`.

use super::{check_finite, local_rows, OwnedState, StepConfig, StepStats, Strategy, Units};
use crate::backend::{Backend, Buf, Category, MemoryReport};
use crate::comm::{Comm, CommStats};
use crate::data::Batch;
use crate::error::Result;
use crate::model::{AdamW, AdamWConfig, Engine};

pub struct Sharded<B: Backend> {
    engine: Engine<B>,
    units: Units,
    /// zero2: the whole parameters; fsdp: none (only `p_shard`).
    full: Option<Buf>,
    /// fsdp: this rank's parameter shard.
    p_shard: Option<Buf>,
    g_shard: Buf,
    opt: AdamW,
    /// fsdp gather buffers: [0] any unit, [1] ln_f while [0] holds the embeddings.
    gathered: [Buf; 2],
    /// One unit's full gradient before it is reduce-scattered, and ln_f's.
    grad_unit: [Buf; 2],
    rs_out: Buf,
    dp: Box<dyn Comm>,
    b: usize,
    t: usize,
}

/// Unit u's parameters: from the whole buffer (zero2) or gather slot `slot` (fsdp).
fn view<'a>(
    full: &'a Option<Buf>,
    gathered: &'a [Buf; 2],
    units: &Units,
    u: usize,
    slot: usize,
) -> &'a [f32] {
    match full {
        Some(p) => &p[units.ranges[u].clone()],
        None => &gathered[slot][..units.ranges[u].len()],
    }
}

impl<B: Backend> Sharded<B> {
    pub fn new(
        engine: Engine<B>,
        dp: Box<dyn Comm>,
        fsdp: bool,
        adamw: AdamWConfig,
        b: usize,
        t: usize,
    ) -> Self {
        let units = Units::new(&engine.layout, engine.config.n_layer, dp.size());
        let be = &engine.backend;
        let lnf_padded = units.shard_len[units.final_norm()] * units.n;
        let (full, p_shard, gathered) = if fsdp {
            let g = [
                be.alloc(units.max_padded(), Category::Params),
                be.alloc(lnf_padded, Category::Params),
            ];
            (
                None,
                Some(be.alloc(units.shard_total(), Category::Params)),
                g,
            )
        } else {
            (
                Some(be.alloc(engine.layout.total(), Category::Params)),
                None,
                [be.alloc(0, Category::Params), be.alloc(0, Category::Params)],
            )
        };
        Sharded {
            g_shard: be.alloc(units.shard_total(), Category::Grads),
            opt: AdamW::new(be, units.shard_total(), adamw),
            grad_unit: [
                be.alloc(units.max_padded(), Category::Other),
                be.alloc(lnf_padded, Category::Other),
            ],
            rs_out: be.alloc(
                units.shard_len.iter().copied().max().unwrap_or(0),
                Category::Other,
            ),
            full,
            p_shard,
            gathered,
            units,
            engine,
            dp,
            b,
            t,
        }
    }

    /// fsdp: all-gathers unit u into gather slot `slot`.
    fn fetch(&mut self, u: usize, slot: usize) -> Result<()> {
        if let Some(shard) = &self.p_shard {
            let n = self.units.shard_len[u] * self.units.n;
            self.dp.all_gather(
                &shard[self.units.shard_of(u)],
                &mut self.gathered[slot][..n],
            )?;
        }
        Ok(())
    }

    /// Reduce-scatters unit u's gradient from scratch `slot` and adds this rank's part to its shard.
    fn reduce(&mut self, u: usize, slot: usize) -> Result<()> {
        let s = self.units.shard_len[u];
        self.dp.reduce_scatter(
            &self.grad_unit[slot][..s * self.units.n],
            &mut self.rs_out[..s],
        )?;
        let dst = &mut self.g_shard[self.units.shard_of(u)];
        dst.iter_mut()
            .zip(&self.rs_out[..s])
            .for_each(|(g, &x)| *g += x);
        Ok(())
    }

    fn clear_grad(&mut self, u: usize, slot: usize) {
        let n = self.units.shard_len[u] * self.units.n;
        self.grad_unit[slot][..n].fill(0.0);
    }

    fn forward(&mut self, mb: &Batch) -> Result<f32> {
        let (emb, lnf) = (self.units.embeddings(), self.units.final_norm());
        self.engine.begin(
            &mb.inputs,
            Some(&mb.targets),
            self.b / self.dp.size(),
            self.t,
        )?;
        self.fetch(emb, 0)?;
        self.engine
            .embed_forward(view(&self.full, &self.gathered, &self.units, emb, 0));
        for l in 0..self.engine.config.n_layer {
            let u = self.units.block(l);
            self.fetch(u, 0)?;
            self.engine.block_forward(
                l,
                view(&self.full, &self.gathered, &self.units, u, 0),
                None,
            )?;
        }
        self.fetch(emb, 0)?;
        self.fetch(lnf, 1)?;
        let wte_len = self.engine.layout.wte().len();
        let wte = &view(&self.full, &self.gathered, &self.units, emb, 0)[..wte_len];
        let loss = self
            .engine
            .head_forward(wte, view(&self.full, &self.gathered, &self.units, lnf, 1));
        Ok(loss.expect("targets given"))
    }

    /// Backward right after `forward` (the head's units are still gathered).
    fn backward(&mut self, loss_scale: f32) -> Result<()> {
        let (emb, lnf) = (self.units.embeddings(), self.units.final_norm());
        let wte_len = self.engine.layout.wte().len();
        self.clear_grad(emb, 0);
        self.clear_grad(lnf, 1);
        {
            let wte = &view(&self.full, &self.gathered, &self.units, emb, 0)[..wte_len];
            let lnf_p = view(&self.full, &self.gathered, &self.units, lnf, 1);
            let [g0, g1] = &mut self.grad_unit;
            let lnf_len = self.units.ranges[lnf].len();
            self.engine.head_backward(
                wte,
                lnf_p,
                &mut g0[..wte_len],
                &mut g1[..lnf_len],
                loss_scale,
            )?;
        }
        self.reduce(emb, 0)?;
        self.reduce(lnf, 1)?;
        for l in (0..self.engine.config.n_layer).rev() {
            let u = self.units.block(l);
            self.fetch(u, 0)?;
            self.clear_grad(u, 0);
            let len = self.units.ranges[u].len();
            let p = view(&self.full, &self.gathered, &self.units, u, 0);
            self.engine
                .block_backward(l, p, &mut self.grad_unit[0][..len], None)?;
            self.reduce(u, 0)?;
        }
        self.clear_grad(emb, 0);
        let emb_len = self.units.ranges[emb].len();
        self.engine
            .embed_backward(&mut self.grad_unit[0][..emb_len]);
        self.reduce(emb, 0)
    }
}

impl<B: Backend> Strategy for Sharded<B> {
    fn step(&mut self, micro_batches: &[Batch], cfg: StepConfig) -> Result<StepStats> {
        let (r, n) = (self.dp.rank(), self.dp.size());
        self.g_shard.fill(0.0);
        let scale = 1.0 / (micro_batches.len() * n) as f32;
        let mut loss = [0.0f32];
        for mb in micro_batches {
            let local = local_rows(mb, self.b, self.t, r, n);
            loss[0] += self.forward(&local)?;
            self.backward(scale)?;
        }
        self.dp.all_reduce(&mut loss)?;
        let be = &self.engine.backend;
        let mut sq = [be.sum_squares(&self.g_shard) as f32];
        self.dp.all_reduce(&mut sq)?;
        let grad_norm = sq[0].sqrt();
        check_finite(loss[0], grad_norm)?;
        let clip = if cfg.grad_clip > 0.0 && grad_norm > cfg.grad_clip {
            cfg.grad_clip / grad_norm
        } else {
            1.0
        };
        let segs = self.units.segments(r);
        let lay = &self.engine.layout;
        match (&mut self.full, &mut self.p_shard) {
            (_, Some(p)) => self
                .opt
                .update(be, p, &self.g_shard, lay, &segs, cfg.lr, clip),
            (Some(full), None) => {
                let mut p = be.alloc(self.units.shard_total(), Category::Other);
                self.units.shard_from(full, r, &mut p);
                self.opt
                    .update(be, &mut p, &self.g_shard, lay, &segs, cfg.lr, clip);
                let mut g = be.alloc(self.units.max_padded(), Category::Other);
                for u in 0..self.units.ranges.len() {
                    let range = self.units.ranges[u].clone();
                    let gathered = &mut g[..self.units.shard_len[u] * n];
                    self.dp.all_gather(&p[self.units.shard_of(u)], gathered)?;
                    full[range.clone()].copy_from_slice(&gathered[..range.len()]);
                }
            }
            (None, None) => unreachable!("zero2 keeps whole parameters, fsdp a shard"),
        }
        Ok(StepStats {
            loss: loss[0] / (n * micro_batches.len()) as f32,
            grad_norm,
        })
    }

    fn eval_loss(&mut self, batch: &Batch) -> Result<f32> {
        let n = self.dp.size();
        let local = local_rows(batch, self.b, self.t, self.dp.rank(), n);
        let mut loss = [self.forward(&local)?];
        self.dp.all_reduce(&mut loss)?;
        Ok(loss[0] / n as f32)
    }

    fn full_params(&mut self) -> Result<Vec<f32>> {
        if let Some(full) = &self.full {
            return Ok(full.to_vec());
        }
        let mut out = vec![0.0; self.engine.layout.total()];
        for u in 0..self.units.ranges.len() {
            self.fetch(u, 0)?;
            let range = self.units.ranges[u].clone();
            out[range.clone()].copy_from_slice(&self.gathered[0][..range.len()]);
        }
        Ok(out)
    }

    fn load_full(&mut self, full: &[f32]) {
        match (&mut self.full, &mut self.p_shard) {
            (Some(p), _) => p.copy_from_slice(full),
            (None, Some(s)) => self.units.shard_from(full, self.dp.rank(), s),
            (None, None) => unreachable!("zero2 keeps whole parameters, fsdp a shard"),
        }
    }

    fn owned_state(&self) -> OwnedState {
        let mut st = OwnedState::default();
        let (m, v) = (&self.opt.m[..], &self.opt.v[..]);
        for s in self.units.segments(self.dp.rank()) {
            let p = match (&self.full, &self.p_shard) {
                (_, Some(shard)) => (&shard[..], s.local),
                (Some(full), None) => (&full[..], s.global),
                (None, None) => unreachable!("zero2 keeps whole parameters, fsdp a shard"),
            };
            st.push(s.global, s.len, p, (m, s.local), v);
        }
        st
    }

    fn load_state(&mut self, params: &[f32], m: &[f32], v: &[f32], adam_step: u32) {
        self.load_full(params);
        let r = self.dp.rank();
        self.units.shard_from(m, r, &mut self.opt.m);
        self.units.shard_from(v, r, &mut self.opt.v);
        self.opt.step = adam_step;
    }

    fn memory(&self) -> MemoryReport {
        self.engine.backend.memory().report()
    }

    fn comm_stats(&self) -> CommStats {
        self.dp.stats()
    }
}
