//! A unit's kernel calls, one line each: [`Ops`] binds what every call in
//! a block or head shares (the backend, whether matmuls run in bf16,
//! the LayerNorm width and eps, the unit's weights and gradients and where
//! each parameter lies in them), so the passes read as the model's layers.

use super::bf16::{matmul_backward, matmul_forward};
use super::unit::Weights;
use crate::backend::{
    Activation, ActivationBackward, ActivationForward, Backend, Bf16, Buf, CrossEntropyBackward,
    CrossEntropyForward, Dst, LayerNormBackward, LayerNormForward, MatmulBackward, MatmulForward,
    MatmulShape, On, Src, Stored, StoredBuf, StoredDst, StoredSrc, WeightLayout,
};
use crate::error::Result;
use std::ops::Range;

/// A product of `(rows, k)` by a weight stored (in, out), (k, n).
pub fn io(rows: usize, k: usize, n: usize) -> MatmulShape {
    MatmulShape::new((rows, k, n), WeightLayout::InOut)
}

/// A LayerNorm's per-row mean and rstd, kept from its forward for its backward.
pub struct Stats<'a, B> {
    pub mean: Src<'a, B>,
    pub rstd: Src<'a, B>,
}

impl<'a, B: Backend> Stats<'a, B> {
    /// Slot `s`'s statistics of `rows` rows, in buffers holding a slot per layer.
    pub fn slot(mean: &'a Buf<B>, rstd: &'a Buf<B>, s: usize, rows: usize) -> Self {
        let (mean, rstd) = (mean.s().part(s, rows), rstd.s().part(s, rows));
        Stats { mean, rstd }
    }

    /// The first `n` rows' statistics.
    pub fn first(self, n: usize) -> Self {
        let (mean, rstd) = (self.mean.first(n), self.rstd.first(n));
        Stats { mean, rstd }
    }
}

/// A LayerNorm's outputs: its values (fp32, or bf16 where only products
/// read them) and the per-row mean and rstd its backward reads.
pub struct Normed<'a, B> {
    pub out: StoredDst<'a, B>,
    pub mean: Dst<'a, B>,
    pub rstd: Dst<'a, B>,
}

impl<'a, B: Backend> Normed<'a, B> {
    /// `out`, with the first `n` rows of slot `s`'s statistics in buffers
    /// holding a slot of `rows` per layer (where [`Stats::slot`] reads them).
    pub fn slot(
        out: impl Into<StoredDst<'a, B>>,
        mean: &'a mut Buf<B>,
        rstd: &'a mut Buf<B>,
        s: usize,
        rows: usize,
        n: usize,
    ) -> Self {
        let out = out.into();
        let (mean, rstd) = (mean.d().part(s, rows), rstd.d().part(s, rows));
        let (mean, rstd) = (mean.first(n), rstd.first(n));
        Normed { out, mean, rstd }
    }

    /// The same outputs, reborrowed.
    pub fn rb(&mut self) -> Normed<'_, B> {
        Normed {
            out: self.out.rb(),
            mean: self.mean.rb(),
            rstd: self.rstd.rb(),
        }
    }
}

/// Where a gradient that only bf16 products read is held: rounded into a
/// bf16 activation's slot that nothing reads any more (GELU's output, once
/// the MLP's backward has read it), where the activation is held in bf16,
/// the slot is `free` (not kept for a split backward's weight half) and
/// wide enough; else in fp32 scratch. GELU's gradient and q|k|v's go
/// there, as autocast holds them.
pub struct Rounded {
    slot: Option<Range<usize>>,
    /// Whether the gradient is held in bf16 (`--precision bf16`).
    bf16: bool,
}

impl Rounded {
    /// `len` values at the start of `slot` in `buf`, where they fit.
    pub fn new<B: Backend>(buf: &StoredBuf<B>, slot: Range<usize>, len: usize, free: bool) -> Self {
        let fits = free && buf.is_bf16() && len <= slot.len();
        Rounded {
            slot: fits.then(|| slot.start..slot.start + len),
            bf16: buf.is_bf16(),
        }
    }

    /// Under bf16, the gradient written into fp32 `scratch` (its slot too
    /// narrow: a BERT whose intermediate is under 3C, a pruned MLP)
    /// rounded where it lies, so it holds the slot's values and what sums
    /// it (a bias's gradient) sums the same, whatever the shapes.
    pub fn round_scratch<B: Backend>(&self, be: &B, scratch: Dst<'_, B>) {
        if self.bf16 && self.slot.is_none() {
            be.round_bf16(scratch);
        }
    }

    /// The slot, where the gradient goes there (else None: `scratch`).
    pub fn bf16<'a, B: Backend>(&self, buf: &'a mut StoredBuf<B>) -> Option<Dst<'a, B, Bf16>> {
        self.slot.clone().and_then(|r| buf.slice_mut(r).bf16())
    }

    /// Where the gradient is written: the slot, or `scratch`.
    pub fn dst<'a, B: Backend>(
        &self,
        buf: &'a mut StoredBuf<B>,
        scratch: Dst<'a, B>,
    ) -> StoredDst<'a, B> {
        match self.slot.clone() {
            Some(r) => buf.slice_mut(r),
            None => Stored::F32(scratch),
        }
    }

    /// Where the gradient is read: the slot, or `scratch`.
    pub fn src<'a, B: Backend>(
        &self,
        buf: &'a StoredBuf<B>,
        scratch: Src<'a, B>,
    ) -> StoredSrc<'a, B> {
        match self.slot.clone() {
            Some(r) => buf.slice(r),
            None => Stored::F32(scratch),
        }
    }
}

/// Where a LayerNorm's backward puts its input gradient: overwritten,
/// added on (into a residual's gradient), or nowhere (the weight half).
pub enum Dinp<'a, B> {
    Set(Dst<'a, B>),
    Add(Dst<'a, B>),
    Skip,
}

/// One unit's kernels on parameters named `P`: `p` the unit's weights,
/// `g` its gradients where the pass takes them (they accumulate), `at`
/// where a parameter lies in both.
pub struct Ops<'s, B: Backend, P> {
    pub be: &'s B,
    pub bf16: bool,
    pub c: usize,
    eps: f32,
    p: Weights<'s, B>,
    pub g: Option<Dst<'s, B>>,
    at: &'s dyn Fn(P) -> Range<usize>,
}

impl<'s, B: Backend, P: Copy> Ops<'s, B, P> {
    /// A unit's kernels: LayerNorms of width `c` (eps `eps`), bf16
    /// matmuls where `bf16`.
    pub fn new(
        be: &'s B,
        bf16: bool,
        c: usize,
        eps: f32,
        p: impl Into<Weights<'s, B>>,
        g: Option<Dst<'s, B>>,
        at: &'s dyn Fn(P) -> Range<usize>,
    ) -> Self {
        Ops {
            be,
            bf16,
            c,
            eps,
            p: p.into(),
            g,
            at,
        }
    }

    /// Parameter `x`.
    pub fn w(&self, x: P) -> Src<'s, B> {
        self.p.fp32.slice((self.at)(x))
    }

    /// Weight `x` as a product reads it: its bf16 copy where there is one.
    pub fn mw(&self, x: P) -> StoredSrc<'s, B> {
        self.p.slice((self.at)(x)).product()
    }

    /// LayerNorm (weight `w`, bias `b`) of `inp` into `to`.
    pub fn ln(&self, to: Normed<'_, B>, inp: Src<'_, B>, w: P, b: P) -> Result<()> {
        let (w, b, c, eps) = (self.w(w), self.w(b), self.c, self.eps);
        let Normed { out, mean, rstd } = to;
        self.be.run(LayerNormForward {
            out,
            mean,
            rstd,
            inp,
            w,
            b,
            c,
            eps,
        })
    }

    /// [`Ops::ln`]'s backward: the input gradient as `dinp` says; `w`'s
    /// and `b`'s where the pass takes gradients.
    pub fn ln_back(
        &mut self,
        dinp: Dinp<'_, B>,
        dout: Src<'_, B>,
        inp: Src<'_, B>,
        kept: Stats<'_, B>,
        w: P,
        b: P,
    ) -> Result<()> {
        let (wv, c, at) = (self.w(w), self.c, self.at);
        let (dinp, accumulate) = match dinp {
            Dinp::Set(d) => (Some(d), false),
            Dinp::Add(d) => (Some(d), true),
            Dinp::Skip => (None, true),
        };
        let dwb = self.g.as_mut().map(|g| g.rb().split2(at(w), at(b)));
        let Stats { mean, rstd } = kept;
        self.be.run(LayerNormBackward {
            dinp,
            dwb,
            dout,
            inp,
            w: wv,
            mean,
            rstd,
            c,
            accumulate,
        })
    }

    /// [`matmul_forward`] of `inp` by weight `w` plus bias `b` where given, into `out`.
    pub fn linear<'o>(
        &mut self,
        out: impl Into<StoredDst<'o, B>>,
        inp: Src<'_, B>,
        w: P,
        b: Option<P>,
        shape: MatmulShape,
    ) -> Result<()> {
        let (w, bias) = (self.mw(w), b.map(|b| self.w(b)));
        let op = MatmulForward {
            out: out.into(),
            inp: inp.into(),
            w,
            bias,
            residual: None,
            shape,
            accumulate: false,
        };
        self.matmul(op)
    }

    /// [`matmul_forward`]: `op`, its products in bf16 where the pass's are.
    pub fn matmul(&mut self, op: MatmulForward<On<'_, B>>) -> Result<()> {
        matmul_forward(self.be, self.bf16, op)
    }

    /// [`Ops::linear`]'s backward, its products in bf16 where the pass's
    /// are: `dinp` overwritten; `w`'s gradient (and `b`'s, where given)
    /// accumulated where the pass takes gradients; given no `dinp`, the
    /// split backward's weight half alone, in fp32 (as it always ran).
    pub fn linear_back<'i>(
        &mut self,
        dinp: Option<Dst<'i, B>>,
        dout: impl Into<StoredSrc<'i, B>>,
        inp: impl Into<StoredSrc<'i, B>>,
        w: P,
        b: Option<P>,
        shape: MatmulShape,
    ) -> Result<()> {
        let (wv, at) = (self.mw(w), self.at);
        let (dw, dbias) = match (self.g.as_mut(), b) {
            (None, _) => (None, None),
            (Some(g), None) => (Some(g.rb().slice(at(w))), None),
            (Some(g), Some(b)) => {
                let (dw, db) = g.rb().split2(at(w), at(b));
                (Some(dw), Some(db))
            }
        };
        let op = MatmulBackward {
            dinp,
            dw,
            dbias,
            dout: dout.into(),
            inp: inp.into(),
            w: wv,
            shape,
        };
        match op.dinp {
            Some(_) => matmul_backward(self.be, self.bf16, op),
            None => self.be.run(op),
        }
    }

    /// Cross-entropy of `logits` (rows, vp; the first `v` real) against
    /// `targets`, one loss a row.
    pub fn ce(
        &self,
        losses: Dst<'_, B>,
        logits: Src<'_, B>,
        targets: Src<'_, B, u32>,
        v: usize,
        vp: usize,
    ) -> Result<()> {
        let op = CrossEntropyForward {
            losses,
            logits: logits.into(),
            targets,
            v,
            vp,
        };
        self.be.run(op)
    }

    /// [`Ops::ce`]'s backward for `dloss` a row's loss: the logits' gradient in their place.
    pub fn ce_back(
        &self,
        logits: Dst<'_, B>,
        targets: Src<'_, B, u32>,
        v: usize,
        vp: usize,
        dloss: f32,
    ) -> Result<()> {
        let op = CrossEntropyBackward {
            logits: logits.into(),
            targets,
            v,
            vp,
            dloss,
        };
        self.be.run(op)
    }

    /// `act` of `inp` plus bias `b` into `out` (each fp32, or stored in bf16).
    pub fn act<'o, 'i>(
        &self,
        out: impl Into<StoredDst<'o, B>>,
        inp: impl Into<StoredSrc<'i, B>>,
        b: P,
        act: Activation,
    ) -> Result<()> {
        let bias = Some(self.w(b));
        self.be.run(ActivationForward {
            out: out.into(),
            inp: inp.into(),
            bias,
            act,
        })
    }

    /// [`Ops::act`]'s backward in place in `d` (or, given `rounded`, there
    /// rounded to bf16, d only read); `b`'s gradient where the pass takes
    /// gradients.
    pub fn act_back<'i>(
        &mut self,
        d: Dst<'_, B>,
        inp: impl Into<StoredSrc<'i, B>>,
        b: P,
        act: Activation,
        rounded: Option<Dst<'_, B, Bf16>>,
    ) -> Result<()> {
        let (bias, at) = (Some(self.w(b)), (self.at)(b));
        let dbias = self.g.as_mut().map(|g| g.rb().slice(at));
        self.be.run(ActivationBackward {
            d,
            inp: inp.into(),
            bias,
            act,
            dbias,
            rounded,
        })
    }
}
