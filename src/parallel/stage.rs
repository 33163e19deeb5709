//! A pipeline stage's training state and how the stage's data-parallel
//! replicas share it. The state is the stage's units' parameters,
//! gradients and AdamW moments, plus a copy of the unit holding a tied
//! tensor the stage reads while an earlier stage owns it (GPT-2's `[wte |
//! wpe]` on the last stage). Its pieces — the copied unit, then each of the
//! stage's units — are contiguous runs of its buffers, `[copy | own units]`.
//!
//! Sharing, as ZeRO counts it: `Replicated` (ddp: every replica holds
//! everything and all-reduces the gradient), `Zero1` (moments sharded: the
//! gradient is reduce-scattered at the step's end, each rank updates its
//! shard and all-gathers the parameters), `Zero2` (+ gradients sharded:
//! each piece's gradient is reduce-scattered as soon as its backward is
//! done, micro-batch by micro-batch) and `Fsdp` (+ parameters sharded: a
//! piece is all-gathered before it runs and stays gathered while its gather
//! buffer is not needed for another; a piece a tied tensor lives in has a
//! gather buffer of its own). Rank r of n owns slice r of every piece,
//! padded to a multiple of n (`Pieces`); a copied unit is padded and sliced
//! as its owner is, so the stages holding a tie sum its gradient shard for
//! shard.

use super::offload::HostState;
use super::pipeline::{Pass, Pipeline, Task};
use super::OwnedState;
use crate::backend::cpu::Cpu;
use crate::backend::{Backend, Bf16, Buf, Category, Dst, Src};
use crate::comm::{device, Comm};
use crate::error::Result;
use crate::model::tp::TpSplit;
use crate::model::{
    AdamW, AdamWConfig, ParamLayout, Segment, UnitGrads, UnitParams, Updated, Weights,
};
use std::borrow::Cow;
use std::ops::Range;

/// How a stage's data-parallel replicas share its state: what ZeRO shards
/// ([`super::StrategyKind::sharing`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sharing {
    /// Nothing: every replica holds it all (single, ddp, tp).
    Replicated,
    /// The optimizer's moments.
    Zero1,
    /// + the gradients.
    Zero2,
    /// + the parameters (ZeRO-3).
    Fsdp,
}

impl Sharing {
    /// Whether each replica holds a shard of anything.
    pub fn sharded(self) -> bool {
        self != Sharing::Replicated
    }

    /// Whether each replica accumulates only its shard of the gradient
    /// (zero2, fsdp: each unit's gradient is reduce-scattered into it as
    /// the unit's backward ends), not the whole stage's (replicated, and
    /// zero1, which reduce-scatters it into its slice at the step's end).
    pub fn shards_grads(self) -> bool {
        matches!(self, Sharing::Zero2 | Sharing::Fsdp)
    }

    /// Whether a replica's reduced gradient is final once its backward
    /// ends, before the step's collectives, among `dp` replicas (zero2 and
    /// fsdp reduce-scatter it unit by unit; a replicated stage with no
    /// other replica needs no reduction): where offload starts it down.
    pub fn grads_final_in_backward(self, dp: usize) -> bool {
        self.shards_grads() || (self == Sharing::Replicated && dp == 1)
    }
}

/// Where a stage's tensors sit in its buffers: `[copied unit | own units]`.
pub struct StageMap {
    /// This stage's units.
    pub units: Range<usize>,
    /// Their range of the (tensor-parallel) layout.
    pub own: Range<usize>,
    /// The layout range of the unit holding a tied tensor this stage reads
    /// but an earlier stage owns.
    pub copy: Option<Range<usize>>,
}

impl StageMap {
    /// Stage s of the stages `stages` (each a range of units).
    pub fn of(lay: &ParamLayout, stages: &[Range<usize>], s: usize) -> Self {
        let units = stages[s].clone();
        let own = lay.units[units.start].range.start..lay.units[units.end - 1].range.end;
        let copy = lay.units[units.clone()]
            .iter()
            .filter_map(|u| u.tied.as_ref())
            .find(|t| t.unit < units.start)
            .map(|t| lay.units[t.unit].range.clone());
        StageMap { units, own, copy }
    }

    /// Each piece's layout range: the copied unit, then the stage's units.
    fn pieces(&self, lay: &ParamLayout) -> Vec<Range<usize>> {
        let own = self.units.clone().map(|u| lay.units[u].range.clone());
        self.copy.iter().cloned().chain(own).collect()
    }
}

/// The pieces' sizes under a sharing over n replicas, in floats, as
/// `StageState` allocates them (`plan` prices a stage with them).
#[derive(Clone, Copy, Debug, Default)]
pub struct StageSizes {
    /// The stage's whole buffers.
    pub len: usize,
    /// One rank's shard of every piece.
    pub shard: usize,
    /// The largest piece padded to a multiple of n.
    pub max_padded: usize,
    /// The largest single shard.
    pub max_shard: usize,
    /// The padded piece of a unit that reads a tied tensor (zero where none does).
    pub head_padded: usize,
    /// fsdp's gather buffers together.
    pub gathered: usize,
}

impl std::ops::AddAssign for StageSizes {
    /// Two chunks' sizes on one rank: each allocates its own buffers.
    fn add_assign(&mut self, o: StageSizes) {
        self.len += o.len;
        self.shard += o.shard;
        self.max_padded += o.max_padded;
        self.max_shard += o.max_shard;
        self.head_padded += o.head_padded;
        self.gathered += o.gathered;
    }
}

/// The pieces of a stage and their shards: each padded to a multiple of
/// the replicas n and sliced over them, rank r owning slice r (padding is
/// zeros, never dropped).
struct Pieces {
    /// Each piece's layout range.
    layout: Vec<Range<usize>>,
    /// Each piece's range in the stage's whole buffers.
    buf: Vec<Range<usize>>,
    /// Each piece's shard length (its length / n, rounded up) and offset
    /// in a rank's shard buffer.
    shard_len: Vec<usize>,
    shard_at: Vec<usize>,
    n: usize,
    /// The first unit of the stage and whether piece 0 is a copy.
    first_unit: usize,
    copied: bool,
    /// Under fsdp, each piece's gather buffer (0: the shared one; a
    /// tied-to piece its own) and each buffer's size.
    slot_of: Vec<usize>,
    slots: Vec<usize>,
    /// The piece of the unit that reads a tied tensor, if any.
    head: Option<usize>,
}

impl Pieces {
    fn new(lay: &ParamLayout, map: &StageMap, n: usize) -> Self {
        let layout = map.pieces(lay);
        let starts = |lens: &[usize]| -> Vec<usize> {
            lens.iter()
                .scan(0, |at, &l| {
                    *at += l;
                    Some(*at - l)
                })
                .collect()
        };
        let lens: Vec<usize> = layout.iter().map(|r| r.len()).collect();
        let shard_len: Vec<usize> = lens.iter().map(|l| l.div_ceil(n)).collect();
        let buf = starts(&lens).into_iter().zip(&lens).map(|(a, l)| a..a + l);
        let mut p = Pieces {
            buf: buf.collect(),
            shard_at: starts(&shard_len),
            shard_len,
            n,
            slot_of: vec![0; layout.len()],
            layout,
            first_unit: map.units.start,
            copied: map.copy.is_some(),
            slots: vec![0],
            head: None,
        };
        for u in map.units.clone() {
            if let Some((k, _)) = p.tied(lay, u) {
                p.head = Some(p.piece(u));
                if p.slot_of[k] == 0 {
                    p.slot_of[k] = p.slots.len();
                    p.slots.push(p.padded(k));
                }
            }
        }
        for k in 0..p.layout.len() {
            if p.slot_of[k] == 0 {
                p.slots[0] = p.slots[0].max(p.padded(k));
            }
        }
        p
    }

    /// The piece of the stage's unit u.
    fn piece(&self, u: usize) -> usize {
        usize::from(self.copied) + u - self.first_unit
    }

    /// The piece holding unit u's tied tensor and the tensor's range in it.
    fn tied(&self, lay: &ParamLayout, u: usize) -> Option<(usize, Range<usize>)> {
        let t = lay.units[u].tied.as_ref()?;
        let k = match t.unit >= self.first_unit {
            true => self.piece(t.unit),
            false => 0,
        };
        let at = t.range.start - self.layout[k].start;
        Some((k, at..at + t.range.len()))
    }

    fn len(&self, k: usize) -> usize {
        self.layout[k].len()
    }

    /// Piece k padded to a multiple of n.
    fn padded(&self, k: usize) -> usize {
        self.shard_len[k] * self.n
    }

    /// Piece k's slice of a rank's shard buffer.
    fn shard_of(&self, k: usize) -> Range<usize> {
        self.shard_at[k]..self.shard_at[k] + self.shard_len[k]
    }

    /// Rank r's part of piece k, as a range of the piece: its slice when
    /// `sharded` (short or empty where it falls in the padding), else all
    /// of it.
    fn part(&self, k: usize, r: usize, sharded: bool) -> Range<usize> {
        let (s, len) = (self.shard_len[k], self.len(k));
        match sharded {
            true => (r * s).min(len)..(r * s + s).min(len),
            false => 0..len,
        }
    }

    /// Rank r's nonempty parts of the pieces: (piece, part).
    fn parts(&self, r: usize, sharded: bool) -> impl Iterator<Item = (usize, Range<usize>)> + '_ {
        (0..self.layout.len())
            .map(move |k| (k, self.part(k, r, sharded)))
            .filter(|(_, part)| !part.is_empty())
    }

    /// Where a part of piece k lies in a rank's shard buffer (`shard`), or
    /// in the stage's whole buffer.
    fn at(&self, k: usize, part: &Range<usize>, shard: bool) -> Range<usize> {
        let at = match shard {
            true => self.shard_at[k],
            false => self.buf[k].start + part.start,
        };
        at..at + part.len()
    }

    fn sizes(&self) -> StageSizes {
        StageSizes {
            len: self.buf.last().map_or(0, |r| r.end),
            shard: self.shard_total(),
            max_padded: (0..self.layout.len())
                .map(|k| self.padded(k))
                .max()
                .unwrap_or(0),
            max_shard: self.shard_len.iter().copied().max().unwrap_or(0),
            head_padded: self.head.map_or(0, |k| self.padded(k)),
            gathered: self.slots.iter().sum(),
        }
    }

    /// Floats in one rank's shard buffer.
    fn shard_total(&self) -> usize {
        self.shard_len.iter().sum()
    }

    /// Copies rank r's shard of every piece out of the stage's whole buffer (on the device).
    fn shard_from<B: Backend>(&self, be: &B, full: Src<'_, B>, r: usize, mut out: Dst<'_, B>) {
        be.fill(out.rb(), 0.0);
        for (k, part) in self.parts(r, true) {
            let (to, from) = (self.at(k, &part, true), self.at(k, &part, false));
            be.copy(out.rb().slice(to), full.slice(from));
        }
    }

    /// Rank r's shard of every piece of the stage's whole host buffer.
    fn shard_of_host(&self, full: &[f32], r: usize) -> Vec<f32> {
        let mut out = vec![0.0; self.shard_total()];
        for (k, part) in self.parts(r, true) {
            out[self.at(k, &part, true)].copy_from_slice(&full[self.at(k, &part, false)]);
        }
        out
    }
}

/// The sizes `StageState` allocates for stage s of `stages` over n replicas.
pub fn stage_sizes(lay: &ParamLayout, stages: &[Range<usize>], s: usize, n: usize) -> StageSizes {
    Pieces::new(lay, &StageMap::of(lay, stages, s), n).sizes()
}

/// Elements rank `s` of a pipeline's stages all-gathers in a step under
/// fsdp over `n` replicas, as its `tasks` run (`ranks_tasks`): before
/// each unit runs (forward, backward and zb-h1's weight half), its piece
/// and the piece holding a tied tensor it reads, unless the piece's
/// gather buffer still holds it. Each chunk has its buffers; a step starts
/// with them empty (the update changed the parameters).
pub fn fsdp_gathered(
    lay: &ParamLayout,
    stages: &[Range<usize>],
    pipe: Pipeline,
    s: usize,
    n: usize,
    tasks: &[Task],
) -> usize {
    let chunks: Vec<(StageMap, Pieces)> = (0..pipe.virtual_stages)
        .map(|c| StageMap::of(lay, stages, c * pipe.stages + s))
        .map(|map| {
            let p = Pieces::new(lay, &map, n);
            (map, p)
        })
        .collect();
    let mut held: Vec<Vec<Option<usize>>> = chunks
        .iter()
        .map(|(_, p)| vec![None; p.slots.len()])
        .collect();
    let mut gathered = 0;
    for task in tasks {
        let (map, p) = &chunks[task.chunk];
        let units: Vec<usize> = match task.pass {
            Pass::Forward => map.units.clone().collect(),
            Pass::Backward | Pass::Weight => map.units.clone().rev().collect(),
        };
        for u in units {
            let tied = p.tied(lay, u).map(|(k, _)| k);
            for k in std::iter::once(p.piece(u)).chain(tied) {
                let slot = &mut held[task.chunk][p.slot_of[k]];
                if *slot != Some(k) {
                    *slot = Some(k);
                    gathered += p.padded(k);
                }
            }
        }
    }
    gathered
}

/// The parameters on the device.
enum Params<B: Backend> {
    /// Replicated, zero1, zero2: the whole stage on every replica.
    Whole(Buf<B>),
    /// fsdp: this rank's shard and the gather buffers.
    Sharded(Buf<B>, Gathered<B>),
}

/// fsdp's gather buffers and which piece each holds.
struct Gathered<B: Backend> {
    bufs: Vec<Buf<B>>,
    held: Vec<Option<usize>>,
}

impl<B: Backend> Gathered<B> {
    /// Forgets what the buffers hold (the parameters changed).
    fn forget(&mut self) {
        self.held.iter_mut().for_each(|h| *h = None);
    }
}

/// The parameters and where their update runs. Each variant's optimizer
/// comes first, so that it drops first: under offload it waits out the
/// copies still reading the device buffers.
enum Home<B: Backend> {
    /// The parameters (whole, or fsdp's shard) on the device, updated
    /// there or on the host (`--offload`).
    Device(Optimizer<B>, Params<B>),
    /// fsdp `--offload params`: the shard is the host's master copy, the
    /// device keeps the gather buffers alone.
    Host(HostState, Gathered<B>),
}

impl<B: Backend> Home<B> {
    /// The host's state, under offload.
    fn host(&mut self) -> Option<&mut HostState> {
        match self {
            Home::Device(Optimizer::Host(h), _) | Home::Host(h, _) => Some(h),
            Home::Device(Optimizer::Device(_), _) => None,
        }
    }

    /// fsdp's gather buffers.
    fn gathered(&mut self) -> Option<&mut Gathered<B>> {
        match self {
            Home::Device(_, Params::Sharded(_, g)) | Home::Host(_, g) => Some(g),
            Home::Device(_, Params::Whole(_)) => None,
        }
    }

    /// Where piece k's parameters lie: (the buffer, its range there, the
    /// part of the buffers it takes): in the whole stage (a part a piece),
    /// or in the buffer it is gathered in (a part a buffer).
    fn place(&self, pc: &Pieces, k: usize) -> (usize, Range<usize>, usize) {
        match self {
            Home::Device(_, Params::Whole(_)) => (0, pc.buf[k].clone(), k),
            Home::Device(_, Params::Sharded(_, _)) | Home::Host(_, _) => {
                (pc.slot_of[k], 0..pc.len(k), pc.slot_of[k])
            }
        }
    }

    /// Unit u's parameters, with their bf16 copy where kept.
    fn params<'a>(
        &'a self,
        pc: &Pieces,
        copies: Option<&'a Copies<B>>,
        lay: &ParamLayout,
        u: usize,
    ) -> UnitParams<'a, B> {
        // range r of piece k
        let weights = |k: usize, r: Range<usize>| {
            let (buf, range, _) = self.place(pc, k);
            let fp32 = self.buf(buf).slice(range.clone()).slice(r.clone());
            let bf16 = copies.map(|c| c.bufs[buf].slice(range).slice(r));
            Weights { fp32, bf16 }
        };
        let k = pc.piece(u);
        UnitParams {
            own: weights(k, 0..pc.len(k)),
            tied: pc.tied(lay, u).map(|(t, r)| weights(t, r)),
        }
    }

    /// Buffer i of the parameters the units read ([`Home::place`]'s).
    fn buf(&self, i: usize) -> &Buf<B> {
        match self {
            Home::Device(_, Params::Whole(p)) => p,
            Home::Device(_, Params::Sharded(_, g)) | Home::Host(_, g) => &g.bufs[i],
        }
    }
}

/// Where a rank's offloaded state goes (`--offload`): the host that holds
/// and counts it, whether fsdp's parameter shards go too (`params`), and
/// whether the copies overlap the backward.
#[derive(Clone, Copy)]
pub struct HostOffload<'a> {
    pub host: &'a Cpu,
    pub params: bool,
    pub overlap: bool,
}

/// Where the AdamW update runs: on the device, or on the host (offload).
enum Optimizer<B: Backend> {
    Device(AdamW<B>),
    Host(HostState),
}

/// Gradient scratch slots (zero2, fsdp): a piece's gradient before its
/// reduce-scatter, and the head's while the tied piece's is in [BODY].
/// zero1 and zero2 also pad a piece's gradient and gather parameters in [BODY].
const BODY: usize = 0;
const HEAD: usize = 1;

pub struct StageState<B: Backend> {
    // First, so it drops first: under offload its optimizer waits out the
    // copies still reading the device buffers below.
    home: Home<B>,
    sharing: Sharing,
    pieces: Pieces,
    /// Where the gradient accumulates: the whole stage's, or this rank's
    /// shard of it ([`Sharing::shards_grads`]).
    grad: Buf<B>,
    scratch: Vec<Buf<B>>,
    rs_out: Option<Buf<B>>,
    /// Under offload, when each piece's reduced gradient is final (and can
    /// start down to the host): the gradients each piece receives per
    /// micro-batch (its unit's, and a reader's of a tied tensor in it), how
    /// many it has received this step, and the step's micro-batches.
    final_after: Vec<usize>,
    received: Vec<usize>,
    micro_batches: usize,
    /// The piece a tied tensor's stages all-reduce at the step's end
    /// (final only then).
    tied_across: Option<usize>,
    /// Under `--precision bf16`, the parameters' bf16 copy.
    copies: Option<Copies<B>>,
}

/// The parameters' bf16 copy, which the products read under `--precision
/// bf16`: a buffer beside each fp32 one the units read (the whole stage's,
/// or each of fsdp's gather buffers), and for each of its parts (a piece's
/// range, or a gather buffer) the piece it holds rounded. A replicated
/// stage's update on the device rounds every piece in its own pass; else a
/// piece is rounded when a unit first reads it after its values change (a
/// sharded or host update, a load, a gather). No product rounds a weight
/// itself.
struct Copies<B: Backend> {
    bufs: Vec<Buf<B, Bf16>>,
    rounded: Vec<Option<usize>>,
}

impl<B: Backend> Copies<B> {
    /// Forgets what the buffers hold (the parameters changed).
    fn forget(&mut self) {
        self.rounded.iter_mut().for_each(|h| *h = None);
    }
}

impl<B: Backend> StageState<B> {
    /// The state of this rank's replica among `dp`'s; with `offload` the
    /// optimizer on its host, counted there.
    pub fn new(
        be: &B,
        lay: &ParamLayout,
        map: &StageMap,
        sharing: Sharing,
        dp: &dyn Comm,
        adamw: AdamWConfig,
        offload: Option<HostOffload<'_>>,
    ) -> Result<Self> {
        let (r, n) = (dp.rank(), dp.size());
        let pieces = Pieces::new(lay, map, n);
        let z = pieces.sizes();
        let sharded = sharing.sharded();
        let opt_len = if sharded { z.shard } else { z.len };
        let opt = match offload {
            Some(HostOffload { host, overlap, .. }) => {
                let segs = segments(&pieces, sharing, r);
                let chunk = super::offload::CHUNK;
                let state = HostState::new(be, host, opt_len, chunk, &segs, adamw, overlap)?;
                Optimizer::Host(state)
            }
            None => Optimizer::Device(AdamW::new(be, opt_len, adamw)?),
        };
        let host_shard = sharing == Sharing::Fsdp && offload.is_some_and(|o| o.params);
        let mut final_after = vec![0; pieces.layout.len()];
        for u in map.units.clone() {
            final_after[pieces.piece(u)] += 1;
            if let Some((t, _)) = pieces.tied(lay, u) {
                final_after[t] += 1;
            }
        }
        let gathered = || -> Result<Gathered<B>> {
            Ok(Gathered {
                bufs: pieces
                    .slots
                    .iter()
                    .map(|&n| be.alloc(n, Category::Params))
                    .collect::<Result<_>>()?,
                held: vec![None; pieces.slots.len()],
            })
        };
        let home = match (opt, sharing) {
            (Optimizer::Host(h), Sharing::Fsdp) if host_shard => Home::Host(h, gathered()?),
            (opt, Sharing::Fsdp) => Home::Device(
                opt,
                Params::Sharded(be.alloc(z.shard, Category::Params)?, gathered()?),
            ),
            (opt, _) => Home::Device(opt, Params::Whole(be.alloc(z.len, Category::Params)?)),
        };
        let grad_len = if sharing.shards_grads() {
            z.shard
        } else {
            z.len
        };
        let grad = be.alloc(grad_len, Category::Grads)?;
        let mut scratch = Vec::new();
        if sharded {
            scratch.push(be.alloc(z.max_padded, Category::Other)?);
        }
        if sharing.shards_grads() && z.head_padded > 0 {
            scratch.push(be.alloc(z.head_padded, Category::Other)?);
        }
        Ok(StageState {
            rs_out: sharded
                .then(|| be.alloc(z.max_shard, Category::Other))
                .transpose()?,
            home,
            sharing,
            received: vec![0; final_after.len()],
            final_after,
            micro_batches: 0,
            tied_across: None,
            copies: None,
            pieces,
            grad,
            scratch,
        })
    }

    /// Keeps the parameters' bf16 copy for the products to read
    /// (`--precision bf16`).
    pub fn keep_bf16_copy(&mut self, be: &B) -> Result<()> {
        // a buffer beside each the units read, and its parts: a piece each
        // of the whole stage's, one each gather buffer
        let (lens, parts): (Vec<usize>, usize) = match &self.home {
            Home::Device(_, Params::Whole(p)) => (vec![p.len()], self.pieces.layout.len()),
            Home::Device(_, Params::Sharded(_, g)) | Home::Host(_, g) => {
                (g.bufs.iter().map(|b| b.len()).collect(), g.bufs.len())
            }
        };
        self.copies = Some(Copies {
            bufs: lens
                .iter()
                .map(|&n| be.alloc_typed(n, Category::Params))
                .collect::<Result<_>>()?,
            rounded: vec![None; parts],
        });
        Ok(())
    }

    /// Rounds piece k into the bf16 copy, unless it holds it already.
    fn round(&mut self, be: &B, k: usize) {
        let Some(c) = self.copies.as_mut() else {
            return;
        };
        let (buf, range, part) = self.home.place(&self.pieces, k);
        if c.rounded[part] != Some(k) {
            let fp32 = self.home.buf(buf).slice(range.clone());
            be.to_bf16(c.bufs[buf].slice_mut(range), fp32);
            c.rounded[part] = Some(k);
        }
    }

    /// Marks piece k as a tied tensor the stages holding it all-reduce at
    /// the step's end.
    pub fn set_tied_across(&mut self, k: usize) {
        self.tied_across = Some(k);
    }

    /// The piece the stage's unit u is.
    pub fn piece(&self, u: usize) -> usize {
        self.pieces.piece(u)
    }

    /// Zeroes the gradient accumulators before a step of `micro_batches`.
    pub fn begin_step(&mut self, be: &B, micro_batches: usize) {
        if let Some(h) = self.home.host() {
            h.forget_early();
        }
        be.fill(self.grad.d(), 0.0);
        self.received.iter_mut().for_each(|n| *n = 0);
        self.micro_batches = micro_batches;
    }

    /// Counts a gradient piece k received; at the step's last, where no
    /// collective is left to come (zero2 and fsdp reduced it already, a
    /// replicated stage with no other replica needs none), starts it down.
    fn count_gradient(&mut self, be: &B, k: usize, dp: &dyn Comm) -> Result<()> {
        self.received[k] += 1;
        if self.sharing.grads_final_in_backward(dp.size())
            && self.received[k] == self.final_after[k] * self.micro_batches
        {
            self.start_download(be, k, dp.rank())?;
        }
        Ok(())
    }

    /// Under offload: starts replica r's reduced gradient of piece k, final
    /// from here on, down to the host (`HostState::download_early`), to
    /// where the host's buffer holds it (the shard's order when sharded);
    /// never a piece the stages' tie all-reduces at the step's end.
    fn start_download(&mut self, be: &B, k: usize, r: usize) -> Result<()> {
        if self.tied_across == Some(k) {
            return Ok(());
        }
        let (part, at) = self.my_grad(k, r);
        let owned = self.pieces.at(k, &part, self.sharded());
        let g = &self.grad;
        match self.home.host() {
            Some(h) => h.download_early(be, owned, g.slice(at)),
            None => Ok(()),
        }
    }

    /// Readies the pieces unit u reads: all-gathered (fsdp), unless their
    /// buffers hold them, and rounded into the bf16 copy where it is kept.
    pub fn ready(&mut self, dp: &dyn Comm, be: &B, lay: &ParamLayout, u: usize) -> Result<()> {
        let k = self.pieces.piece(u);
        let tied = self.pieces.tied(lay, u).map(|(t, _)| t);
        for k in std::iter::once(k).chain(tied) {
            self.fetch(dp, be, k)?;
            self.round(be, k);
        }
        Ok(())
    }

    fn fetch(&mut self, dp: &dyn Comm, be: &B, k: usize) -> Result<()> {
        let (pc, slot) = (&self.pieces, self.pieces.slot_of[k]);
        let (mine, gathered) = match &mut self.home {
            Home::Device(_, Params::Whole(_)) => return Ok(()),
            Home::Device(_, Params::Sharded(_, g)) | Home::Host(_, g)
                if g.held[slot] == Some(k) =>
            {
                return Ok(())
            }
            Home::Device(_, Params::Sharded(shard, g)) => (shard.slice(pc.shard_of(k)), g),
            Home::Host(h, g) => {
                // the shard is on the host: up into the staging buffer first
                let stage = self.rs_out.as_mut().expect("sharded");
                h.upload(be, pc.shard_of(k), stage.slice_mut(0..pc.shard_len[k]))?;
                (stage.slice(0..pc.shard_len[k]), g)
            }
        };
        device::all_gather(dp, be, mine, gathered.bufs[slot].slice_mut(0..pc.padded(k)))?;
        gathered.held[slot] = Some(k);
        Ok(())
    }

    /// Unit u's parameters (readied first: `ready`).
    pub fn params(&self, lay: &ParamLayout, u: usize) -> UnitParams<'_, B> {
        self.home.params(&self.pieces, self.copies.as_ref(), lay, u)
    }

    /// Unit u's parameters and where its backward accumulates: the whole
    /// gradient (replicated, zero1) or cleared scratch that `backward_done`
    /// reduce-scatters (zero2, fsdp).
    pub fn unit(
        &mut self,
        be: &B,
        lay: &ParamLayout,
        u: usize,
    ) -> (UnitParams<'_, B>, UnitGrads<'_, B>) {
        let pc = &self.pieces;
        let (k, tied) = (pc.piece(u), pc.tied(lay, u));
        let grads = match (&tied, self.sharing.shards_grads()) {
            (Some((t, r)), false) => {
                let tr = pc.buf[*t].start + r.start..pc.buf[*t].start + r.end;
                let (tg, own) = self.grad.d().split2(tr, pc.buf[k].clone());
                UnitGrads {
                    own,
                    tied: Some(tg),
                }
            }
            (None, false) => UnitGrads {
                own: self.grad.slice_mut(pc.buf[k].clone()),
                tied: None,
            },
            (_, true) => {
                let slot = if tied.is_some() { HEAD } else { BODY };
                be.fill(self.scratch[slot].slice_mut(0..pc.padded(k)), 0.0);
                if let Some((t, _)) = &tied {
                    be.fill(self.scratch[BODY].slice_mut(0..pc.padded(*t)), 0.0);
                }
                match (&tied, self.scratch.as_mut_slice()) {
                    (Some((_, r)), [body, head]) => UnitGrads {
                        own: head.slice_mut(0..pc.len(k)),
                        tied: Some(body.slice_mut(r.clone())),
                    },
                    (_, scratch) => UnitGrads {
                        own: scratch[BODY].slice_mut(0..pc.len(k)),
                        tied: None,
                    },
                }
            }
        };
        (self.home.params(pc, self.copies.as_ref(), lay, u), grads)
    }

    /// zero2, fsdp: reduce-scatters the gradient unit u's backward left in
    /// scratch (and its tied piece's) into this rank's shard. Under offload
    /// a piece's part this rank updates starts down to the host here once
    /// it is final.
    pub fn backward_done(
        &mut self,
        dp: &dyn Comm,
        be: &B,
        lay: &ParamLayout,
        u: usize,
    ) -> Result<()> {
        let tied = self.pieces.tied(lay, u);
        let k = self.pieces.piece(u);
        if self.sharing.shards_grads() {
            let slot = if tied.is_some() { HEAD } else { BODY };
            self.reduce(dp, be, k, slot)?;
            if let Some((t, _)) = tied {
                self.reduce(dp, be, t, BODY)?;
            }
        }
        self.count_gradient(be, k, dp)?;
        if let Some((t, _)) = tied {
            self.count_gradient(be, t, dp)?;
        }
        Ok(())
    }

    /// Reduce-scatters piece k's padded gradient in scratch `slot` and adds
    /// this rank's part to its shard (zero2, fsdp), or puts it in this
    /// rank's slice of the whole gradient (zero1).
    fn reduce(&mut self, dp: &dyn Comm, be: &B, k: usize, slot: usize) -> Result<()> {
        let pc = &self.pieces;
        let s = pc.shard_len[k];
        let out = self.rs_out.as_mut().expect("sharded");
        device::reduce_scatter(
            dp,
            be,
            self.scratch[slot].slice(0..pc.padded(k)),
            out.slice_mut(0..s),
        )?;
        if self.sharing.shards_grads() {
            be.add_inplace(self.grad.slice_mut(pc.shard_of(k)), out.slice(0..s))
        } else {
            let part = pc.part(k, dp.rank(), true);
            let len = part.len();
            be.copy(
                self.grad.slice_mut(pc.at(k, &part, false)),
                out.slice(0..len),
            );
        }
        Ok(())
    }

    /// Rank r's part of piece k once its gradient is reduced (the whole
    /// piece where replicated), and where the gradient buffer holds it.
    fn my_grad(&self, k: usize, r: usize) -> (Range<usize>, Range<usize>) {
        let part = self.pieces.part(k, r, self.sharded());
        let at = self.pieces.at(k, &part, self.sharing.shards_grads());
        (part, at)
    }

    /// After the step's last backward: the gradient summed over the
    /// replicas (all-reduced, or reduce-scattered into the shards), and the
    /// tied piece `tie` summed over the stages that hold it.
    pub fn reduce_all(
        &mut self,
        dp: &dyn Comm,
        be: &B,
        tie: Option<(&dyn Comm, usize)>,
    ) -> Result<()> {
        match self.sharing {
            Sharing::Replicated => {
                let g = &mut self.grad;
                if dp.size() > 1 {
                    device::all_reduce(dp, be, g.d())?;
                }
                if let Some((group, k)) = tie {
                    device::all_reduce(group, be, g.slice_mut(self.pieces.buf[k].clone()))?;
                }
                if dp.size() > 1 {
                    // (one replica's started in the backward)
                    for k in 0..self.pieces.layout.len() {
                        self.start_download(be, k, dp.rank())?;
                    }
                }
                return Ok(());
            }
            Sharing::Zero1 => {
                for k in 0..self.pieces.layout.len() {
                    let (len, pad) = (self.pieces.len(k), self.pieces.padded(k));
                    let g = &self.grad;
                    be.copy(
                        self.scratch[BODY].slice_mut(0..len),
                        g.slice(self.pieces.buf[k].clone()),
                    );
                    be.fill(self.scratch[BODY].slice_mut(len..pad), 0.0);
                    self.reduce(dp, be, k, BODY)?;
                    self.start_download(be, k, dp.rank())?;
                }
            }
            Sharing::Zero2 | Sharing::Fsdp => {}
        }
        if let Some((group, k)) = tie {
            // the stages holding the tie shard it alike: slice for slice
            let (_, at) = self.my_grad(k, dp.rank());
            device::all_reduce(group, be, self.grad.slice_mut(at))?;
        }
        Ok(())
    }

    /// The squared norm of the reduced gradient this rank holds, split
    /// into tensor-parallel-split and replicated tensors (the copied unit
    /// not counted: its owner counts it). Sharded: this rank's shard only.
    pub fn grad_squares(&self, be: &B, lay: &ParamLayout, r: usize) -> Result<(f64, f64)> {
        let (mut pieces, mut replicated) = (Vec::new(), Vec::new());
        for k in usize::from(self.pieces.copied)..self.pieces.layout.len() {
            let (part, at) = self.my_grad(k, r);
            let global = self.pieces.layout[k].start + part.start;
            for t in &lay.tensors {
                let tr = t.range();
                let (a, b) = (tr.start.max(global), tr.end.min(global + part.len()));
                if a < b {
                    pieces.push(
                        self.grad
                            .slice(at.start + a - global..at.start + b - global),
                    );
                    replicated.push(t.split == TpSplit::Replicated);
                }
            }
        }
        let (mut split, mut rep) = (0.0f64, 0.0f64);
        for (sq, replicated) in be.sum_squares(&pieces)?.into_iter().zip(replicated) {
            match replicated {
                true => rep += sq,
                false => split += sq,
            }
        }
        Ok((split, rep))
    }

    /// Whether the gradient is sharded over the replicas (its norm is summed over them).
    pub fn sharded(&self) -> bool {
        self.sharing.sharded()
    }

    /// Floats of scratch [`StageState::update`] takes: zero1's reduced
    /// slices gathered into shard order, and (zero1, zero2) the shard of the
    /// parameters it updates before gathering them back. Held by the rank
    /// for every step (the largest of its chunks'), not allocated a step.
    pub fn update_scratch(&self) -> usize {
        let shard = self.pieces.shard_total();
        let grads = self.sharing == Sharing::Zero1;
        let params =
            self.sharing.sharded() && matches!(self.home, Home::Device(_, Params::Whole(_)));
        (usize::from(grads) + usize::from(params)) * shard
    }

    /// One AdamW update of what this rank owns (zero1, zero2: then the
    /// parameters all-gathered back into every replica's whole copy), in
    /// `scratch` of at least [`StageState::update_scratch`] floats (none
    /// where that is 0).
    pub fn update(
        &mut self,
        dp: &dyn Comm,
        be: &B,
        lay: &ParamLayout,
        lr: f32,
        clip: f32,
        scratch: Option<Dst<'_, B>>,
    ) -> Result<()> {
        let r = dp.rank();
        let pc = &self.pieces;
        let segs = segments(pc, self.sharing, r);
        let shard = pc.shard_total();
        // zero1's reduced slices, gathered into shard order for the update
        let (grads, mut mine) = match self.sharing {
            Sharing::Zero1 => {
                let (mut g, rest) = scratch.expect("update_scratch's floats").split_at(shard);
                pc.shard_from(be, self.grad.s(), r, g.rb());
                (g.into_src(), Some(rest))
            }
            _ => (self.grad.s(), scratch),
        };
        let step = |opt: &mut Optimizer<B>, params: Dst<'_, B>| -> Result<()> {
            match opt {
                Optimizer::Device(o) => o.update(be, params, grads, lay, &segs, lr, clip),
                Optimizer::Host(h) => h.update(be, grads, Some(params), lay, lr, clip),
            }
        };
        match (&mut self.home, self.sharing) {
            (Home::Host(h, g), _) => {
                h.update(be, grads, None, lay, lr, clip)?;
                g.forget();
            }
            (Home::Device(opt, Params::Sharded(shard, g)), _) => {
                step(opt, shard.d())?;
                g.forget();
            }
            (Home::Device(Optimizer::Device(o), Params::Whole(p)), Sharing::Replicated) => {
                // the weights' bf16 copy rounded in the update's own pass
                let copy = self.copies.as_mut().map(|c| c.bufs[0].d());
                let params = Updated {
                    params: p.d(),
                    copy,
                };
                o.update(be, params, grads, lay, &segs, lr, clip)?;
                if let Some(c) = self.copies.as_mut() {
                    c.rounded
                        .iter_mut()
                        .enumerate()
                        .for_each(|(k, h)| *h = Some(k));
                }
                return Ok(());
            }
            (Home::Device(opt, Params::Whole(p)), Sharing::Replicated) => step(opt, p.d())?,
            (Home::Device(opt, Params::Whole(p)), _) => {
                let mut mine = mine.take().expect("update_scratch's floats").first(shard);
                if let Optimizer::Device(_) = opt {
                    // the host's master copy is the update's input under offload
                    pc.shard_from(be, p.s(), r, mine.rb());
                }
                step(opt, mine.rb())?;
                let gather = &mut self.scratch[BODY];
                for k in 0..pc.layout.len() {
                    device::all_gather(
                        dp,
                        be,
                        mine.src().slice(pc.shard_of(k)),
                        gather.slice_mut(0..pc.padded(k)),
                    )?;
                    be.copy(p.slice_mut(pc.buf[k].clone()), gather.slice(0..pc.len(k)));
                }
            }
        }
        if let Some(c) = self.copies.as_mut() {
            c.forget();
        }
        Ok(())
    }

    /// What replica r writes to a checkpoint, as host copies: runs of the
    /// stage's own units with their parameters (and moments, when
    /// `moments`), the segments in this rank's (tensor-parallel) layout's
    /// coordinates; the copied unit is its owner's. Replicated: replica 0
    /// writes every run; sharded: each replica its slice of every piece, so
    /// each value has exactly one writer.
    pub fn owned(&self, be: &B, r: usize, moments: bool) -> Result<OwnedState> {
        let pc = &self.pieces;
        let mut out = OwnedState::default();
        if !self.sharded() && r != 0 {
            return Ok(out);
        }
        let params = match &self.home {
            Home::Device(_, Params::Whole(p) | Params::Sharded(p, _)) => be.read(p.s())?,
            Home::Host(h, _) => Cow::Owned(h.params()),
        };
        let mv: Option<[Cow<'_, [f32]>; 2]> = match (moments, &self.home) {
            (false, _) => None,
            (true, Home::Device(Optimizer::Device(o), _)) => {
                Some([be.read(o.m.s())?, be.read(o.v.s())?])
            }
            (true, Home::Device(Optimizer::Host(h), _) | Home::Host(h, _)) => {
                Some(h.moments().map(Cow::Owned))
            }
        };
        let whole = matches!(self.home, Home::Device(_, Params::Whole(_)));
        for (k, part) in pc
            .parts(r, self.sharded())
            .filter(|(k, _)| *k >= usize::from(pc.copied))
        {
            // the moments are the update's: its shard where sharded
            let at_m = pc.at(k, &part, self.sharded()).start;
            let at_p = pc.at(k, &part, !whole).start;
            let mv = mv.as_ref().map(|[m, v]| [&m[at_m..], &v[at_m..]]);
            out.push(
                pc.layout[k].start + part.start,
                part.len(),
                &params[at_p..],
                mv,
            );
        }
        Ok(out)
    }

    /// Loads the stage's whole parameters (`[copy | own units]`, host); replica r keeps its part.
    pub fn load_params(&mut self, be: &B, r: usize, whole: &[f32]) -> Result<()> {
        let sharded = self.sharded();
        let part = || match sharded {
            true => Cow::Owned(self.pieces.shard_of_host(whole, r)),
            false => Cow::Borrowed(whole),
        };
        if let Some(h) = self.home.host() {
            h.load_params(&part());
        }
        if let Some(g) = self.home.gathered() {
            g.forget();
        }
        if let Some(c) = self.copies.as_mut() {
            c.forget();
        }
        match &mut self.home {
            Home::Device(_, Params::Whole(p)) => be.upload(p.d(), whole),
            Home::Device(_, Params::Sharded(s, _)) => be.upload(s.d(), &part()),
            Home::Host(..) => Ok(()),
        }
    }

    /// Loads the stage's whole moments (host); replica r keeps its part.
    pub fn load_moments(&mut self, be: &B, r: usize, m: &[f32], v: &[f32]) -> Result<()> {
        let part = |x: &[f32]| match self.sharded() {
            true => self.pieces.shard_of_host(x, r),
            false => x.to_vec(),
        };
        let (m, v) = (part(m), part(v));
        match &mut self.home {
            Home::Device(Optimizer::Device(o), _) => {
                be.upload(o.m.d(), &m)?;
                be.upload(o.v.d(), &v)
            }
            Home::Device(Optimizer::Host(h), _) | Home::Host(h, _) => {
                h.load_moments(&m, &v);
                Ok(())
            }
        }
    }

    /// Sets the optimizer's step count (a resumed run's).
    pub fn set_adam_step(&mut self, step: u32) {
        match &mut self.home {
            Home::Device(Optimizer::Device(o), _) => o.step = step,
            Home::Device(Optimizer::Host(h), _) | Home::Host(h, _) => h.set_step(step),
        }
    }
}

/// The update's segments over the buffer rank r updates: a replicated
/// stage's whole buffer, or this rank's shard of every piece.
fn segments(pc: &Pieces, sharing: Sharing, r: usize) -> Vec<Segment> {
    let sharded = sharing.sharded();
    pc.parts(r, sharded)
        .map(|(k, part)| Segment {
            global: pc.layout[k].start + part.start,
            local: pc.at(k, &part, sharded).start,
            len: part.len(),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::GptConfig;

    #[test]
    fn shards_of_all_ranks_tile_every_piece_with_padding() {
        let lay = ParamLayout::new(&GptConfig::preset("tiny").unwrap());
        // the whole model as one stage
        let map = StageMap {
            units: 0..lay.units.len(),
            own: 0..lay.total(),
            copy: None,
        };
        let pc = Pieces::new(&lay, &map, 3);
        let mut covered = vec![0u8; lay.total()];
        for r in 0..3 {
            for s in segments(&pc, Sharing::Zero1, r) {
                covered[s.global..s.global + s.len]
                    .iter_mut()
                    .for_each(|c| *c += 1);
            }
        }
        assert!(covered.iter().all(|&c| c == 1));
        assert!(pc.shard_total() * 3 >= lay.total());
    }
}
