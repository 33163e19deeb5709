//! The arguments of the kernels, one struct an operation, written once for
//! every level that runs it: the [`Kernels`](super::Kernels) trait takes
//! them over views of a backend's buffers ([`On`]), the CPU's kernels over
//! host slices ([`Host`]), a GPU runtime's over raw device views. A struct
//! is generic over its [`Operands`], and `lower` converts one kind into
//! another, operand by operand ([`Lower`]).
//!
//! A backward's halves (zb-h1's input and weight halves) are which outputs
//! are given; bf16 arithmetic is a field of the matmul.

use super::memory::{Dst, Src};
use super::{Activation, AttnShape, DecodeShape, Device, Elem, WeightLayout};
use std::marker::PhantomData;

/// What an operation's inputs (`In`) and outputs (`Out`) are.
pub trait Operands {
    type In<T: Elem>;
    type Out<T: Elem>;
}

/// Views of backend `B`'s buffers: what [`Kernels`](super::Kernels) takes.
pub struct On<'a, B>(PhantomData<&'a B>);

impl<'a, B: Device> Operands for On<'a, B> {
    type In<T: Elem> = Src<'a, B, T>;
    type Out<T: Elem> = Dst<'a, B, T>;
}

/// Host slices: what the CPU's kernels take.
pub struct Host<'a>(PhantomData<&'a ()>);

impl<'a> Operands for Host<'a> {
    type In<T: Elem> = &'a [T];
    type Out<T: Elem> = &'a mut [T];
}

/// Converts operands of kind `A` into kind `B`.
pub trait Lower<A: Operands, B: Operands> {
    fn input<T: Elem>(&self, x: A::In<T>) -> B::In<T>;
    fn output<T: Elem>(&self, x: A::Out<T>) -> B::Out<T>;
}

/// out (rows, C) = wte[tokens] + wpe[row % t]; rows is `tokens.len()`.
pub struct EncoderForward<O: Operands> {
    pub out: O::Out<f32>,
    pub tokens: O::In<u32>,
    pub wte: O::In<f32>,
    pub wpe: O::In<f32>,
    pub t: usize,
    pub c: usize,
}

/// dwte[tokens] += dout; dwpe[row % t] += dout. `host_tokens` is the host's
/// copy of `tokens`, from which a device plans a deterministic scatter.
pub struct EncoderBackward<'h, O: Operands> {
    pub dwte: O::Out<f32>,
    pub dwpe: O::Out<f32>,
    pub dout: O::In<f32>,
    pub tokens: O::In<u32>,
    pub host_tokens: &'h [u32],
    pub t: usize,
    pub c: usize,
}

/// out, inp (rows, C); mean, rstd (rows), kept for the backward; eps inside
/// the square root. rows is `mean.len()`.
pub struct LayerNormForward<O: Operands> {
    pub out: O::Out<f32>,
    pub mean: O::Out<f32>,
    pub rstd: O::Out<f32>,
    pub inp: O::In<f32>,
    pub w: O::In<f32>,
    pub b: O::In<f32>,
    pub c: usize,
    pub eps: f32,
}

/// The gradients of [`LayerNormForward`]: dinp (rows, C) +=; dw, db (C) +=.
/// A half is left out by leaving its outputs out: `dinp` None is the weight
/// half, `dwb` None the input half.
pub struct LayerNormBackward<O: Operands> {
    pub dinp: Option<O::Out<f32>>,
    /// dw and db.
    pub dwb: Option<(O::Out<f32>, O::Out<f32>)>,
    pub dout: O::In<f32>,
    pub inp: O::In<f32>,
    pub w: O::In<f32>,
    pub mean: O::In<f32>,
    pub rstd: O::In<f32>,
    pub c: usize,
}

/// A matmul's shape and arithmetic: inp (rows, k) @ W (k x n, in `layout`);
/// `bf16` when the operands hold bfloat16 values (rounded by
/// `round_bf16`), which a device with bf16 matrix units runs there.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MatmulShape {
    pub rows: usize,
    pub k: usize,
    pub n: usize,
    pub layout: WeightLayout,
    pub bf16: bool,
}

impl MatmulShape {
    /// An fp32 product of `(rows, k, n)` in `layout`.
    pub fn new((rows, k, n): (usize, usize, usize), layout: WeightLayout) -> Self {
        MatmulShape {
            rows,
            k,
            n,
            layout,
            bf16: false,
        }
    }
}

/// out (rows, n) = [out +] inp (rows, k) @ W + bias.
pub struct MatmulForward<O: Operands> {
    pub out: O::Out<f32>,
    pub inp: O::In<f32>,
    pub w: O::In<f32>,
    pub bias: Option<O::In<f32>>,
    pub shape: MatmulShape,
    /// Adds to `out` instead of overwriting it.
    pub accumulate: bool,
}

/// The gradients of [`MatmulForward`]: dinp (rows, k) overwritten; dw
/// (k x n) +=; dbias (n) +=. `dinp` None is the weight half (which never
/// reads `w`), `dw` None the input half (which never reads `inp`).
pub struct MatmulBackward<O: Operands> {
    pub dinp: Option<O::Out<f32>>,
    pub dw: Option<O::Out<f32>>,
    pub dbias: Option<O::Out<f32>>,
    pub dout: O::In<f32>,
    pub inp: O::In<f32>,
    pub w: O::In<f32>,
    pub shape: MatmulShape,
}

impl<'a, B: Device> MatmulBackward<On<'a, B>> {
    /// The input half alone: dinp (rows, k) = dout @ W^T, which reads no
    /// forward input (`inp` is `dout`, unread).
    pub fn input_half(
        dinp: Dst<'a, B>,
        dout: Src<'a, B>,
        w: Src<'a, B>,
        shape: MatmulShape,
    ) -> Self {
        MatmulBackward {
            dinp: Some(dinp),
            dw: None,
            dbias: None,
            dout,
            inp: dout,
            w,
            shape,
        }
    }
}

/// d *= act'(inp), in place, any shape: a matmul's output gradient turned
/// into its pre-activation's. With `dbias` (n), d and inp are (rows, n)
/// and the bias gradient of the product that made inp is added in the same
/// pass: dbias += colsum(d) after the multiply (in chunks of
/// [`COLUMN_CHUNK_ROWS`](super::COLUMN_CHUNK_ROWS) rows, as `matmul_backward`
/// sums a bias), instead of reading d again in the matmul's backward.
pub struct ActivationBackward<O: Operands> {
    pub d: O::Out<f32>,
    pub inp: O::In<f32>,
    pub act: Activation,
    pub dbias: Option<O::Out<f32>>,
}

/// qkv (B, T, 3C) -> out (B, T, C), lse (B, NH, T). Causal without `lens`;
/// with them bidirectional with padding: every query of sequence b attends
/// to its first `lens[b]` keys (1..=T).
pub struct AttentionForward<O: Operands> {
    pub out: O::Out<f32>,
    pub lse: O::Out<f32>,
    pub qkv: O::In<f32>,
    pub lens: Option<O::In<u32>>,
    pub shape: AttnShape,
}

/// The gradient of [`AttentionForward`]: dqkv (B, T, 3C) overwritten.
pub struct AttentionBackward<O: Operands> {
    pub dqkv: O::Out<f32>,
    pub dout: O::In<f32>,
    pub qkv: O::In<f32>,
    pub out: O::In<f32>,
    pub lse: O::In<f32>,
    pub lens: Option<O::In<u32>>,
    pub shape: AttnShape,
}

/// losses (rows) from logits (rows, vp) whose first v columns are real; a
/// row whose target is `data::IGNORE` has loss 0 (and gradient 0). rows is
/// `targets.len()`.
pub struct CrossEntropyForward<O: Operands> {
    pub losses: O::Out<f32>,
    pub logits: O::In<f32>,
    pub targets: O::In<u32>,
    pub v: usize,
    pub vp: usize,
}

/// logits (rows, vp) -> dloss * d(sum of losses)/d logits, in place.
pub struct CrossEntropyBackward<O: Operands> {
    pub logits: O::Out<f32>,
    pub targets: O::In<u32>,
    pub v: usize,
    pub vp: usize,
    pub dloss: f32,
}

/// One AdamW update of a parameter slice and its moments.
pub struct AdamWUpdate<O: Operands> {
    pub param: O::Out<f32>,
    pub grad: O::In<f32>,
    pub m: O::Out<f32>,
    pub v: O::Out<f32>,
    pub step: super::AdamWStep,
    /// 0 for tensors that are not decayed (biases, layernorms).
    pub weight_decay: f32,
}

/// out (rows, n) = [out +] inp (rows, k) @ W + bias for few rows (one per
/// sequence being decoded), W packed by `pack_decode_weight` (its layout
/// and format are the packing's).
pub struct MatmulDecode<'p, O: Operands, P: ?Sized> {
    pub out: O::Out<f32>,
    pub inp: O::In<f32>,
    pub w: &'p P,
    pub bias: Option<O::In<f32>>,
    /// (rows, k, n).
    pub dims: (usize, usize, usize),
    pub accumulate: bool,
}

/// Decoding: qkv (b, 3c) queries against kcache, vcache (b, max_t, c) ->
/// out (b, c).
pub struct AttentionDecode<O: Operands> {
    pub out: O::Out<f32>,
    pub qkv: O::In<f32>,
    pub kcache: O::In<f32>,
    pub vcache: O::In<f32>,
    pub shape: DecodeShape,
}

impl<A: Operands> EncoderForward<A> {
    pub fn lower<B: Operands>(self, f: &impl Lower<A, B>) -> EncoderForward<B> {
        EncoderForward {
            out: f.output(self.out),
            tokens: f.input(self.tokens),
            wte: f.input(self.wte),
            wpe: f.input(self.wpe),
            t: self.t,
            c: self.c,
        }
    }
}

impl<'h, A: Operands> EncoderBackward<'h, A> {
    pub fn lower<B: Operands>(self, f: &impl Lower<A, B>) -> EncoderBackward<'h, B> {
        EncoderBackward {
            dwte: f.output(self.dwte),
            dwpe: f.output(self.dwpe),
            dout: f.input(self.dout),
            tokens: f.input(self.tokens),
            host_tokens: self.host_tokens,
            t: self.t,
            c: self.c,
        }
    }
}

impl<A: Operands> LayerNormForward<A> {
    pub fn lower<B: Operands>(self, f: &impl Lower<A, B>) -> LayerNormForward<B> {
        LayerNormForward {
            out: f.output(self.out),
            mean: f.output(self.mean),
            rstd: f.output(self.rstd),
            inp: f.input(self.inp),
            w: f.input(self.w),
            b: f.input(self.b),
            c: self.c,
            eps: self.eps,
        }
    }
}

impl<A: Operands> LayerNormBackward<A> {
    pub fn lower<B: Operands>(self, f: &impl Lower<A, B>) -> LayerNormBackward<B> {
        LayerNormBackward {
            dinp: self.dinp.map(|d| f.output(d)),
            dwb: self.dwb.map(|(dw, db)| (f.output(dw), f.output(db))),
            dout: f.input(self.dout),
            inp: f.input(self.inp),
            w: f.input(self.w),
            mean: f.input(self.mean),
            rstd: f.input(self.rstd),
            c: self.c,
        }
    }
}

impl<A: Operands> MatmulForward<A> {
    pub fn lower<B: Operands>(self, f: &impl Lower<A, B>) -> MatmulForward<B> {
        MatmulForward {
            out: f.output(self.out),
            inp: f.input(self.inp),
            w: f.input(self.w),
            bias: self.bias.map(|b| f.input(b)),
            shape: self.shape,
            accumulate: self.accumulate,
        }
    }
}

impl<A: Operands> MatmulBackward<A> {
    pub fn lower<B: Operands>(self, f: &impl Lower<A, B>) -> MatmulBackward<B> {
        MatmulBackward {
            dinp: self.dinp.map(|d| f.output(d)),
            dw: self.dw.map(|d| f.output(d)),
            dbias: self.dbias.map(|d| f.output(d)),
            dout: f.input(self.dout),
            inp: f.input(self.inp),
            w: f.input(self.w),
            shape: self.shape,
        }
    }
}

impl<A: Operands> ActivationBackward<A> {
    pub fn lower<B: Operands>(self, f: &impl Lower<A, B>) -> ActivationBackward<B> {
        ActivationBackward {
            d: f.output(self.d),
            inp: f.input(self.inp),
            act: self.act,
            dbias: self.dbias.map(|d| f.output(d)),
        }
    }
}

impl<A: Operands> AttentionForward<A> {
    pub fn lower<B: Operands>(self, f: &impl Lower<A, B>) -> AttentionForward<B> {
        AttentionForward {
            out: f.output(self.out),
            lse: f.output(self.lse),
            qkv: f.input(self.qkv),
            lens: self.lens.map(|l| f.input(l)),
            shape: self.shape,
        }
    }
}

impl<A: Operands> AttentionBackward<A> {
    pub fn lower<B: Operands>(self, f: &impl Lower<A, B>) -> AttentionBackward<B> {
        AttentionBackward {
            dqkv: f.output(self.dqkv),
            dout: f.input(self.dout),
            qkv: f.input(self.qkv),
            out: f.input(self.out),
            lse: f.input(self.lse),
            lens: self.lens.map(|l| f.input(l)),
            shape: self.shape,
        }
    }
}

impl<A: Operands> CrossEntropyForward<A> {
    pub fn lower<B: Operands>(self, f: &impl Lower<A, B>) -> CrossEntropyForward<B> {
        CrossEntropyForward {
            losses: f.output(self.losses),
            logits: f.input(self.logits),
            targets: f.input(self.targets),
            v: self.v,
            vp: self.vp,
        }
    }
}

impl<A: Operands> CrossEntropyBackward<A> {
    pub fn lower<B: Operands>(self, f: &impl Lower<A, B>) -> CrossEntropyBackward<B> {
        CrossEntropyBackward {
            logits: f.output(self.logits),
            targets: f.input(self.targets),
            v: self.v,
            vp: self.vp,
            dloss: self.dloss,
        }
    }
}

impl<A: Operands> AdamWUpdate<A> {
    pub fn lower<B: Operands>(self, f: &impl Lower<A, B>) -> AdamWUpdate<B> {
        AdamWUpdate {
            param: f.output(self.param),
            grad: f.input(self.grad),
            m: f.output(self.m),
            v: f.output(self.v),
            step: self.step,
            weight_decay: self.weight_decay,
        }
    }
}

impl<'p, A: Operands, P: ?Sized> MatmulDecode<'p, A, P> {
    /// The same product with the weight seen as `w` (a packing's inner form).
    pub fn with_weight<Q: ?Sized>(self, w: &Q) -> MatmulDecode<'_, A, Q> {
        MatmulDecode {
            out: self.out,
            inp: self.inp,
            w,
            bias: self.bias,
            dims: self.dims,
            accumulate: self.accumulate,
        }
    }

    pub fn lower<B: Operands>(self, f: &impl Lower<A, B>) -> MatmulDecode<'p, B, P> {
        MatmulDecode {
            out: f.output(self.out),
            inp: f.input(self.inp),
            w: self.w,
            bias: self.bias.map(|b| f.input(b)),
            dims: self.dims,
            accumulate: self.accumulate,
        }
    }
}

impl<A: Operands> AttentionDecode<A> {
    pub fn lower<B: Operands>(self, f: &impl Lower<A, B>) -> AttentionDecode<B> {
        AttentionDecode {
            out: f.output(self.out),
            qkv: f.input(self.qkv),
            kcache: f.input(self.kcache),
            vcache: f.input(self.vcache),
            shape: self.shape,
        }
    }
}
