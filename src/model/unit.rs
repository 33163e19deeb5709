//! The seam between model families and everything above them. A family
//! (`gpt2`, `bert`) declares its units in a [`ParamLayout`] and runs them
//! through [`UnitModel`]: one forward and one backward call per unit, on
//! parameter slices the caller hands in. Strategies drive any family
//! through this trait alone, gathering, reducing and sharding unit by unit.

use super::alloc::ActAlloc;
use super::bf16::Precision;
use super::layout::ParamLayout;
use super::tp::TpPlace;
use crate::backend::cpu::Cpu;
use crate::backend::{Backend, Bf16, Buf, Category, Dst, Src, Stored, StoredSrc};
use crate::comm::Comm;
use crate::data::{Batch, LossTerms, IGNORE};
use crate::error::{Error, Result};
use std::ops::{Deref, DerefMut, Range};

/// What unit u is in a family laid out as embeddings, `n_layer` blocks,
/// head (GPT-2's and BERT's order).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UnitKind {
    Embeddings,
    Block(usize),
    Head,
}

impl UnitKind {
    pub fn of(u: usize, n_layer: usize) -> Self {
        match u {
            0 => UnitKind::Embeddings,
            u if u <= n_layer => UnitKind::Block(u - 1),
            _ => UnitKind::Head,
        }
    }
}

/// The units an engine runs, which it sizes its activations for: all of
/// them, or a pipeline stage's (a run of blocks, with the head or not).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Span {
    pub blocks: Range<usize>,
    pub head: bool,
}

/// What an engine sizes its buffers for: the units it runs, whether it
/// recomputes its blocks in the backward, whether its backward is split
/// in two (`StageModel::split_backward`, the zb-h1 schedule's), how
/// many micro-batches it holds at once (a pipeline schedule's in flight),
/// and its precision (what the tensors held in bf16 under bf16 take).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SpanRun {
    pub span: Span,
    pub recompute: bool,
    pub split: bool,
    pub in_flight: usize,
    pub precision: Precision,
}

impl SpanRun {
    /// One micro-batch's run of `span`: what an engine sizes a slot's
    /// buffers for (`Held` keeps a set a slot).
    pub fn one(span: &Span, recompute: bool, split: bool, precision: Precision) -> Self {
        SpanRun {
            span: span.clone(),
            recompute,
            split,
            in_flight: 1,
            precision,
        }
    }

    /// Elements of the activations of the micro-batches in flight, from
    /// one set of the blocks' buffers (what `blocks` allocates) and one
    /// micro-batch's kept ones (`kept`'s), each run against a tally: the
    /// blocks' a set each, or recomputed one set they share.
    pub(crate) fn in_flight_elems<A, K>(
        &self,
        blocks: impl FnOnce(&ActAlloc<'_, Cpu>) -> Result<A>,
        kept: impl FnOnce(&ActAlloc<'_, Cpu>) -> Result<K>,
    ) -> usize {
        let be = Cpu::new();
        let (b, k) = (ActAlloc::tally(&be), ActAlloc::tally(&be));
        blocks(&b).expect("a tally allocates nothing");
        kept(&k).expect("a tally allocates nothing");
        let sets = if self.recompute { 1 } else { self.in_flight };
        sets * b.counted() + self.in_flight * k.counted()
    }
}

impl Span {
    /// Every unit of a model with `n_layer` blocks.
    pub fn all(n_layer: usize) -> Self {
        Span {
            blocks: 0..n_layer,
            head: true,
        }
    }

    /// The blocks and head among `units` (0 the embeddings, 1..=L the
    /// blocks, L + 1 the head).
    pub fn of_units(units: Range<usize>, n_layer: usize) -> Self {
        Span {
            blocks: units.start.max(1) - 1..units.end.min(n_layer + 1).max(1) - 1,
            head: units.end > n_layer + 1,
        }
    }

    /// Activation slots for the blocks' own buffers: one under recomputation.
    pub fn slots(&self, recompute: bool) -> usize {
        if recompute {
            1
        } else {
            self.blocks.len()
        }
    }

    /// Block l's slot.
    pub fn slot(&self, l: usize, recompute: bool) -> usize {
        if recompute {
            0
        } else {
            l - self.blocks.start
        }
    }

    /// Copies of the residual stream a micro-batch keeps for the backward:
    /// every block's input and the span's output; recomputed without the
    /// head, the output (sent on at once) is not kept.
    pub fn kept_resid(&self, recompute: bool) -> usize {
        self.blocks.len() + usize::from(!recompute || self.head)
    }

    /// Where the residual stream entering block l (l = the last block + 1:
    /// the head's input) sits among the span's `blocks + 1` copies.
    pub fn resid(&self, l: usize) -> usize {
        l - self.blocks.start
    }
}

/// Refuses a batch of `tokens` that is not `b` sequences of `t`, `t` from
/// 1 to the model's `block_size`.
pub(crate) fn check_batch(tokens: &[u32], b: usize, t: usize, block_size: usize) -> Result<()> {
    if t == 0 || t > block_size {
        return Err(Error::Input(format!(
            "sequence length {t} must be between 1 and the model's block size {block_size}"
        )));
    }
    match tokens.len() == b * t {
        true => Ok(()),
        false => Err(Error::Input(format!(
            "got {} tokens for a batch of {b} x {t}",
            tokens.len()
        ))),
    }
}

/// Refuses `what` ids (token ids, types, targets) not below `limit`;
/// with `ignore`, [`IGNORE`] marks an id to pass over.
pub(crate) fn check_ids(what: &str, ids: &[u32], limit: usize, ignore: bool) -> Result<()> {
    let bad = |&x: &u32| x as usize >= limit && !(ignore && x == IGNORE);
    match ids.iter().position(bad) {
        Some(i) => Err(Error::Input(format!(
            "{what} {} at position {i} is not below {limit}",
            ids[i]
        ))),
        None => Ok(()),
    }
}

/// Residual copy `r` of a micro-batch ([`Span::resid`]) among the `kept`
/// ones, or past them the stage's output `out`.
pub(crate) fn resid<'a, B: Backend>(
    kept: &'a Buf<B>,
    out: &'a Buf<B>,
    r: usize,
    btc: usize,
) -> Src<'a, B> {
    match (r + 1) * btc <= kept.len() {
        true => kept.s().part(r, btc),
        false => out.s().first(btc),
    }
}

/// [`resid`], to write.
pub(crate) fn resid_mut<'a, B: Backend>(
    kept: &'a mut Buf<B>,
    out: &'a mut Buf<B>,
    r: usize,
    btc: usize,
) -> Dst<'a, B> {
    match (r + 1) * btc <= kept.len() {
        true => kept.d().part(r, btc),
        false => out.d().first(btc),
    }
}

/// Residual copies `r` and `r + 1`: a block's input and the output it writes.
pub(crate) fn resid_io<'a, B: Backend>(
    kept: &'a mut Buf<B>,
    out: &'a mut Buf<B>,
    r: usize,
    btc: usize,
) -> (Src<'a, B>, Dst<'a, B>) {
    if (r + 2) * btc <= kept.len() {
        let (lo, hi) = kept.d().split_at((r + 1) * btc);
        return (lo.into_src().from(r * btc), hi.first(btc));
    }
    (kept.s().part(r, btc), out.d().first(btc))
}

/// What every family's engine holds besides its config and activations:
/// the backend, this rank's layout (its tensor-parallel part), the whole
/// model's, and its tensor-parallel place.
pub struct EngineCore<B: Backend> {
    pub backend: B,
    pub layout: ParamLayout,
    pub whole: ParamLayout,
    pub tp: TpPlace,
}

/// The activations an engine holds, a set per micro-batch slot
/// ([`UnitModel::hold`]): each slot's kept buffers `K` and batch `S`, and
/// the blocks' activations `A`, a set per slot or, when the blocks are
/// recomputed, one set the slots share. A slot allocates at its first
/// `begin` and keeps its buffers for the next micro-batch it holds, so an
/// engine holds as many sets as its pipeline keeps micro-batches in flight.
pub(crate) struct Held<K, A, S> {
    kept: Vec<Option<K>>,
    acts: Vec<Option<A>>,
    batch: Vec<Option<S>>,
    at: usize,
    shared: bool,
}

const BEGUN: &str = "begin() before the units";

/// Readies slot `at` of `v`: what `make` makes unless it holds one that
/// `fits` (one that does not is freed first).
fn ready<T>(
    v: &mut Vec<Option<T>>,
    at: usize,
    fits: impl FnOnce(&T) -> bool,
    make: impl FnOnce() -> Result<T>,
) -> Result<&mut T> {
    v.resize_with(v.len().max(at + 1), || None);
    let held = v[at].take().filter(fits);
    Ok(v[at].insert(held.map_or_else(make, Ok)?))
}

impl<K, A, S> Held<K, A, S> {
    /// Nothing held yet; `shared`: the slots share one set of activations.
    pub fn new(shared: bool) -> Self {
        Held {
            kept: Vec::new(),
            acts: Vec::new(),
            batch: Vec::new(),
            at: 0,
            shared,
        }
    }

    /// The slot whose activations the current one runs on.
    fn acts_at(&self) -> usize {
        self.at * usize::from(!self.shared)
    }

    pub fn hold(&mut self, slot: usize) {
        self.at = slot;
    }

    pub fn kept(&self) -> &K {
        self.kept[self.at].as_ref().expect(BEGUN)
    }

    pub fn acts(&self) -> &A {
        self.acts[self.acts_at()].as_ref().expect(BEGUN)
    }

    pub fn batch(&self) -> &S {
        self.batch[self.at].as_ref().expect(BEGUN)
    }

    /// The current slot's kept buffers, activations and batch.
    pub fn get_mut(&mut self) -> (&mut K, &mut A, &S) {
        let (at, a) = (self.at, self.acts_at());
        let (kept, batch) = (self.kept[at].as_mut(), self.batch[at].as_ref());
        let acts = self.acts[a].as_mut().expect(BEGUN);
        (kept.expect(BEGUN), acts, batch.expect(BEGUN))
    }

    /// Readies the current slot's activations.
    pub fn ready_acts(
        &mut self,
        fits: impl FnOnce(&A) -> bool,
        make: impl FnOnce() -> Result<A>,
    ) -> Result<()> {
        let a = self.acts_at();
        ready(&mut self.acts, a, fits, make).map(|_| ())
    }

    /// Readies the current slot's kept buffers.
    pub fn ready_kept(
        &mut self,
        fits: impl FnOnce(&K) -> bool,
        make: impl FnOnce() -> Result<K>,
    ) -> Result<&mut K> {
        ready(&mut self.kept, self.at, fits, make)
    }

    pub fn set_batch(&mut self, batch: S) {
        let n = self.batch.len().max(self.at + 1);
        self.batch.resize_with(n, || None);
        self.batch[self.at] = Some(batch);
    }

    /// Frees what the micro-batches hold (the shared activations stay).
    pub fn release(&mut self) {
        (self.kept, self.batch) = (Vec::new(), Vec::new());
        if !self.shared {
            self.acts = Vec::new();
        }
    }

    /// Frees every activation (the next `begin` sizes them afresh).
    pub fn clear(&mut self) {
        *self = Held {
            at: self.at,
            ..Held::new(self.shared)
        };
    }
}

/// A run of parameters: their fp32 values and, where the strategy keeps
/// one (`--precision bf16`), their bf16 copy, which the products read in
/// place of rounding the fp32 values themselves (the same values).
pub struct Weights<'a, B> {
    pub fp32: Src<'a, B>,
    pub bf16: Option<Src<'a, B, Bf16>>,
}

impl<B> Clone for Weights<'_, B> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<B> Copy for Weights<'_, B> {}

impl<'a, B> From<Src<'a, B>> for Weights<'a, B> {
    /// fp32 values without a copy.
    fn from(fp32: Src<'a, B>) -> Self {
        Weights { fp32, bf16: None }
    }
}

impl<'a, B: Backend> Weights<'a, B> {
    /// Elements `r` of both.
    pub fn slice(self, r: Range<usize>) -> Self {
        Weights {
            fp32: self.fp32.slice(r.clone()),
            bf16: self.bf16.map(|x| x.slice(r)),
        }
    }

    /// What a product reads: the bf16 copy where there is one.
    pub fn product(self) -> StoredSrc<'a, B> {
        match self.bf16 {
            Some(x) => Stored::Bf16(x),
            None => Stored::F32(self.fp32),
        }
    }
}

/// A unit's parameters: its own slice and, where it reads one, the tied
/// tensor of an earlier unit.
pub struct UnitParams<'a, B: Backend> {
    pub own: Weights<'a, B>,
    pub tied: Option<Weights<'a, B>>,
}

impl<'a, B: Backend> UnitParams<'a, B> {
    /// `unit`'s slices of a whole parameter buffer (no bf16 copy).
    pub fn of(params: &'a Buf<B>, unit: &super::layout::Unit) -> Self {
        UnitParams {
            own: params.slice(unit.range.clone()).into(),
            tied: unit
                .tied
                .as_ref()
                .map(|x| params.slice(x.range.clone()).into()),
        }
    }
}

/// Where a unit's backward accumulates: its own gradient slice and the
/// tied tensor's gradient.
pub struct UnitGrads<'a, B: Backend> {
    pub own: Dst<'a, B>,
    pub tied: Option<Dst<'a, B>>,
}

/// A model family's unit-by-unit forward and backward, holding a batch's
/// activations (a batch a slot, `hold`). Units run forward 0, 1, ... and
/// backward in reverse; the last unit's forward computes the loss.
pub trait UnitModel<B: Backend>: Send {
    fn core(&self) -> &EngineCore<B>;
    fn backend(&self) -> &B {
        &self.core().backend
    }
    /// This rank's layout (its tensor-parallel part).
    fn layout(&self) -> &ParamLayout {
        &self.core().layout
    }
    /// The whole model's layout.
    fn whole_layout(&self) -> &ParamLayout {
        &self.core().whole
    }
    fn tp(&self) -> TpPlace {
        self.core().tp
    }
    /// Checks a batch of `b` sequences of `t`, readies the activations and
    /// copies it to the device. Each mean loss divides its summed loss by
    /// its count of `loss_terms` (a data-parallel rank passes the global
    /// batch's counts over the group size, so ranks' means average to the
    /// global one).
    fn begin(&mut self, batch: &Batch, b: usize, t: usize, loss_terms: LossTerms) -> Result<()>;
    /// The last forward's outputs on the host: the head's logits, padding
    /// dropped (a classifier's (B, labels), a language model's (B*T, V),
    /// BERT pretraining's next-sentence head's (B, 2)).
    fn outputs(&self) -> Result<Vec<f32>>;
    /// Unit u's forward; the last unit returns the mean loss when the batch
    /// has targets.
    fn forward(
        &mut self,
        u: usize,
        p: UnitParams<'_, B>,
        tp: Option<&dyn Comm>,
    ) -> Result<Option<f32>>;
    /// Unit u's backward (the last unit's for `loss_scale` times the mean
    /// loss), accumulating into `g`.
    fn backward(
        &mut self,
        u: usize,
        p: UnitParams<'_, B>,
        g: UnitGrads<'_, B>,
        tp: Option<&dyn Comm>,
        loss_scale: f32,
    ) -> Result<()>;
    /// Holds the activations of the batches begun from now on, and runs
    /// the units on them, in slot `slot` (slot 0 until told): a
    /// pipeline stage keeps a slot per micro-batch in flight.
    fn hold(&mut self, slot: usize);
    /// Frees the activations the slots hold; the next `begin` allocates afresh.
    fn free_activations(&mut self);
    /// How many parts it runs a batch in ([`super::parts::Parts`]).
    fn batch_parts(&self) -> usize {
        1
    }
    /// This engine as a pipeline stage's (a batch in parts runs without
    /// stages: `parallel::build`).
    fn as_stage(&mut self) -> Result<&mut dyn StageModel<B>> {
        Err(Error::Config("this engine runs no pipeline stage".into()))
    }
}

/// What only a pipeline stage asks of an engine: the residual stream at
/// its boundaries, the units it runs and, for zero-bubble schedules, each
/// backward in two halves.
pub trait StageModel<B: Backend>: UnitModel<B> {
    /// The residual stream entering unit u (u >= 1) for the current batch,
    /// (B*T, C): a pipeline stage writes the activation it receives here
    /// before running unit u, or reads unit u - 1's output here to send it.
    fn boundary(&mut self, u: usize) -> Dst<'_, B>;
    /// The residual stream's gradient for the current batch, (B*T, C): it
    /// holds d(output) before a block's backward and d(input) after, so a
    /// stage without the head writes the gradient it receives here before
    /// its backward and sends what its first unit's backward leaves.
    fn boundary_grad(&mut self) -> Dst<'_, B>;
    /// Runs only `units` from now on (a pipeline stage's), allocating
    /// activations for them alone.
    fn set_units(&mut self, units: Range<usize>);
    /// Splits every backward in two from the next `begin` on (zero-bubble
    /// schedules): `backward_input` makes the gradient for the unit below
    /// and keeps what `backward_weight` later turns into the parameters'
    /// gradients. A family that cannot says so.
    fn split_backward(&mut self) -> Result<()> {
        Err(Error::Config(
            "this model family cannot split its backward into input and weight halves".into(),
        ))
    }
    /// Unit u's input half (after `split_backward`).
    fn backward_input(
        &mut self,
        _u: usize,
        _p: UnitParams<'_, B>,
        _tp: Option<&dyn Comm>,
        _loss_scale: f32,
    ) -> Result<()> {
        self.split_backward()
    }
    /// Unit u's weight half, after its input half: accumulates into `g`.
    fn backward_weight(
        &mut self,
        _u: usize,
        _p: UnitParams<'_, B>,
        _g: UnitGrads<'_, B>,
    ) -> Result<()> {
        self.split_backward()
    }
}

/// A model with whole parameter and gradient buffers (this rank's
/// tensor-parallel part): what the replicated strategies keep.
pub struct Whole<B: Backend, M: ?Sized> {
    pub engine: Box<M>,
    pub params: Buf<B>,
    pub grads: Buf<B>,
}

impl<B: Backend, M: ?Sized> Deref for Whole<B, M> {
    type Target = M;
    fn deref(&self) -> &M {
        &self.engine
    }
}

impl<B: Backend, M: ?Sized> DerefMut for Whole<B, M> {
    fn deref_mut(&mut self) -> &mut M {
        &mut self.engine
    }
}

impl<B: Backend, M: UnitModel<B> + ?Sized> Whole<B, M> {
    /// The engine with zeroed parameter and gradient buffers.
    pub fn with_engine(engine: M) -> Result<Self>
    where
        M: Sized,
    {
        Self::boxed(Box::new(engine))
    }

    /// [`Whole::with_engine`] of a boxed engine (a `dyn UnitModel`).
    pub fn boxed(engine: Box<M>) -> Result<Self> {
        let n = engine.layout().total();
        Ok(Whole {
            params: engine.backend().alloc(n, Category::Params)?,
            grads: engine.backend().alloc(n, Category::Grads)?,
            engine,
        })
    }

    pub fn zero_grads(&mut self) {
        self.engine.backend().fill(self.grads.d(), 0.0);
    }

    /// This rank's parameters, copied to the host.
    pub fn params_host(&self) -> Result<Vec<f32>> {
        self.engine.backend().to_host(self.params.s())
    }

    /// Sets this rank's parameters from a host copy laid out as its layout.
    pub fn set_params(&mut self, local: &[f32]) -> Result<()> {
        self.engine.backend().upload(self.params.d(), local)
    }

    /// Sets this rank's part of a whole-model parameter buffer.
    pub fn load_full(&mut self, full: &[f32]) -> Result<()> {
        let e = &self.engine;
        let mut local = vec![0.0; e.layout().total()];
        super::tp::shard_tp(full, e.whole_layout(), e.layout(), e.tp(), &mut local);
        self.set_params(&local)
    }

    /// The mean over `batches` (each b x t, with targets) of their losses.
    pub fn mean_loss(
        &mut self,
        batches: impl IntoIterator<Item = Batch>,
        b: usize,
        t: usize,
    ) -> Result<f64> {
        let (mut sum, mut n) = (0.0f64, 0usize);
        for batch in batches {
            let terms = batch.loss_terms();
            let loss = self
                .run_forward(&batch, (b, t), terms, None)?
                .ok_or_else(|| Error::Input("a batch without targets has no loss".into()))?;
            (sum, n) = (sum + loss as f64, n + 1);
        }
        Ok(sum / n.max(1) as f64)
    }

    /// Runs every unit on a batch; the mean loss (over `loss_terms`) when it has targets.
    pub fn run_forward(
        &mut self,
        batch: &Batch,
        (b, t): (usize, usize),
        loss_terms: LossTerms,
        tp: Option<&dyn Comm>,
    ) -> Result<Option<f32>> {
        let Whole { engine, params, .. } = self;
        engine.begin(batch, b, t, loss_terms)?;
        let mut loss = None;
        for u in 0..engine.layout().units.len() {
            let unit = &engine.layout().units[u];
            let p = UnitParams::of(params, unit);
            loss = engine.forward(u, p, tp)?;
        }
        Ok(loss)
    }

    /// Accumulates into `grads` the gradient of `loss_scale` times the mean
    /// loss of the last forward, calling `unit_done` with each unit's index
    /// and gradient as soon as it is final (the hook where data parallelism
    /// reduces it). A unit whose tensor a later unit ties is final after its
    /// own backward, the last to run.
    pub fn run_backward(
        &mut self,
        loss_scale: f32,
        tp: Option<&dyn Comm>,
        mut unit_done: impl FnMut(&B, usize, Dst<'_, B>) -> Result<()>,
    ) -> Result<()> {
        let Whole {
            engine,
            params,
            grads,
        } = self;
        let lay = engine.layout().clone();
        for (u, unit) in lay.units.iter().enumerate().rev() {
            let p = UnitParams::of(params, unit);
            let (own, tied) = match &unit.tied {
                Some(tied) => {
                    let (tg, g) = grads.d().split2(tied.range.clone(), unit.range.clone());
                    (g, Some(tg))
                }
                None => (grads.slice_mut(unit.range.clone()), None),
            };
            engine.backward(u, p, UnitGrads { own, tied }, tp, loss_scale)?;
            unit_done(engine.backend(), u, grads.slice_mut(unit.range.clone()))?;
        }
        Ok(())
    }
}
