//! The kernels, one struct an operation, written once for every level that
//! runs it: the [`Kernels`](super::Kernels) trait takes them over views of
//! a backend's buffers ([`On`]), the CPU's kernels over host slices
//! ([`Host`]), a GPU runtime's over raw device views. A struct is generic
//! over its [`Operands`], and `lower` converts one kind into another,
//! operand by operand ([`Lower`]); both come from one list of fields in an
//! `operation!` block.
//!
//! A kernel that is a [`Kernel`] lives in one file here (`layernorm.rs`,
//! `matmul.rs`) beside its source in `kernels/`: its structs, the one shape
//! check every backend runs, the work MFU counts, the CPU's body and the
//! GPU's launch; `Kernels::run` runs any of them.
//!
//! A backward's halves (zb-h1's input and weight halves) are which outputs
//! are given; bf16 arithmetic is a field of the matmul.

pub use encoder::{EncoderBackward, EncoderForward};
pub use layernorm::{LayerNormBackward, LayerNormForward};
pub use matmul::{MatmulBackward, MatmulForward, MatmulShape, WeightLayout};

use super::gpu::{GpuError, Queue, Raw, Runtime};
use super::memory::{Dst, Src};
use super::profile::Op;
use super::{Activation, AttnShape, DecodeShape, Device, Elem};
use std::marker::PhantomData;

/// How many elements an operand holds, whatever its kind.
pub trait Extent {
    fn extent(&self) -> usize;
}

impl<B, T> Extent for Src<'_, B, T> {
    fn extent(&self) -> usize {
        self.len()
    }
}

impl<B, T> Extent for Dst<'_, B, T> {
    fn extent(&self) -> usize {
        self.len()
    }
}

impl<T> Extent for &[T] {
    fn extent(&self) -> usize {
        self.len()
    }
}

impl<T> Extent for &mut [T] {
    fn extent(&self) -> usize {
        self.len()
    }
}

/// What an operation's inputs (`In`) and outputs (`Out`) are.
pub trait Operands {
    type In<T: Elem>: Extent;
    type Out<T: Elem>: Extent;
}

/// An operation's argument struct over operands `O` as a kernel: the shape
/// check every backend runs before it, the floating-point work MFU counts
/// (only products), the CPU's body and the GPU's launch. A new kernel is a
/// file in `ops/` with its impls, its source in `kernels/` and its line in
/// the profile's `Op` list.
pub trait Kernel<O: Operands>: Sized {
    /// The profile's counter.
    const OP: Op;
    /// Why the operands cannot hold the shape, if they cannot.
    fn check(&self) -> Result<(), String>;
    fn flops(&self) -> f64 {
        0.0
    }
    /// Runs on the host, its operands lowered by `host`.
    fn cpu<'a>(self, host: &impl Lower<O, Host<'a>>);
    /// Queues the launch on `queue`, its operands lowered by `raw`; only
    /// after [`Kernel::check`] passed (`Checked`), which is what makes the
    /// launch's views hold what the kernel reads and writes.
    fn gpu<R: Runtime>(
        self,
        queue: &Queue<R>,
        raw: &impl Lower<O, Raw>,
        checked: Checked,
    ) -> Result<(), GpuError>;
}

/// Operands as they are: a kernel run over the kind it was built over.
pub struct AsIs;

impl<O: Operands> Lower<O, O> for AsIs {
    fn input<T: Elem>(&self, x: O::In<T>) -> O::In<T> {
        x
    }
    fn output<T: Elem>(&self, x: O::Out<T>) -> O::Out<T> {
        x
    }
}

/// Proof that a [`Kernel::check`] passed; only [`checked`] makes one.
pub struct Checked(());

/// `op`'s check, as the error every backend reports.
pub fn checked<O: Operands, K: Kernel<O>>(op: &K) -> crate::error::Result<Checked> {
    op.check()
        .map_err(|e| crate::error::Error::Device(format!("{}: {e}", K::OP.name())))?;
    Ok(Checked(()))
}

/// Errors unless operand `what` holds at least `n` elements.
pub fn need(what: &str, x: &impl Extent, n: usize) -> Result<(), String> {
    let have = x.extent();
    if have < n {
        return Err(format!("{what}: view of {have} elements, need {n}"));
    }
    Ok(())
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

/// An operation's argument struct and its `lower`, from one list of
/// fields, each of a kind: `input`/`output` (an operand of element type
/// T), `maybe_input`/`maybe_output` (an operand that may be left out),
/// `maybe_outputs2` (a pair of outputs that may be left out together) or
/// `value` (anything else, copied as it is). A new operation is one such
/// block here.
macro_rules! operation {
    (
        $(#[$doc:meta])*
        pub struct $name:ident<$($lt:lifetime,)? O $(, $g:ident)?> {
            $($(#[$fdoc:meta])* $kind:ident $field:ident: $ty:ty,)*
        }
    ) => {
        $(#[$doc])*
        pub struct $name<$($lt,)? O: Operands $(, $g: ?Sized)?> {
            $($(#[$fdoc])* pub $field: operation!(@type O $kind $ty),)*
        }

        impl<$($lt,)? A: Operands $(, $g: ?Sized)?> $name<$($lt,)? A $(, $g)?> {
            /// The same operation over operands of kind `Z`, each converted by `f`.
            pub fn lower<Z: Operands>(self, f: &impl Lower<A, Z>) -> $name<$($lt,)? Z $(, $g)?> {
                $name {
                    $($field: operation!(@lower f self.$field, $kind),)*
                }
            }
        }
    };
    (@type $o:ident input $t:ty) => { $o::In<$t> };
    (@type $o:ident output $t:ty) => { $o::Out<$t> };
    (@type $o:ident maybe_input $t:ty) => { Option<$o::In<$t>> };
    (@type $o:ident maybe_output $t:ty) => { Option<$o::Out<$t>> };
    (@type $o:ident maybe_outputs2 $t:ty) => { Option<($o::Out<$t>, $o::Out<$t>)> };
    (@type $o:ident value $t:ty) => { $t };
    (@lower $f:ident $x:expr, input) => { $f.input($x) };
    (@lower $f:ident $x:expr, output) => { $f.output($x) };
    (@lower $f:ident $x:expr, maybe_input) => { $x.map(|v| $f.input(v)) };
    (@lower $f:ident $x:expr, maybe_output) => { $x.map(|v| $f.output(v)) };
    (@lower $f:ident $x:expr, maybe_outputs2) => { $x.map(|(a, b)| ($f.output(a), $f.output(b))) };
    (@lower $f:ident $x:expr, value) => { $x };
}

pub(crate) mod encoder;
pub(crate) mod layernorm;
pub(crate) mod matmul;

/// The width of an activation's bias (0: none) over its `len` inputs, or
/// why its rows cannot hold them: the one rule every backend checks an
/// [`ActivationForward`]'s and an [`ActivationBackward`]'s bias by (where a
/// backward has both a bias and its gradient, `grad` is the gradient's
/// width, which must be the bias's).
pub fn activation_bias_width(
    len: usize,
    bias: Option<usize>,
    grad: Option<usize>,
) -> Result<usize, String> {
    let n = bias.or(grad).unwrap_or(0);
    if grad.is_some_and(|g| g != n) {
        return Err(format!(
            "an activation's bias of {n} and its gradient of {}",
            grad.unwrap_or(0)
        ));
    }
    if n > 0 && !len.is_multiple_of(n) {
        return Err(format!("activation of {len} elements in rows of {n}"));
    }
    Ok(n)
}

operation! {
    /// out = act(inp + bias), any shape; with `bias` (n), inp is (rows, n).
    /// The bias of the product that wrote inp, added in the activation's
    /// pass instead of one of its own, and never stored: the backward
    /// adds it again ([`ActivationBackward`]).
    pub struct ActivationForward<O> {
        output out: f32,
        input inp: f32,
        maybe_input bias: f32,
        value act: Activation,
    }
}

operation! {
    /// d *= act'(inp + bias), in place, any shape: a matmul's output
    /// gradient turned into its pre-activation's, the bias given as to the
    /// forward. With `dbias` (n), d and inp are (rows, n) and the bias
    /// gradient of the product that made inp is added in the same
    /// pass: dbias += colsum(d) after the multiply (in chunks of
    /// [`COLUMN_CHUNK_ROWS`](super::COLUMN_CHUNK_ROWS) rows, as `matmul_backward`
    /// sums a bias), instead of reading d again in the matmul's backward.
    pub struct ActivationBackward<O> {
        output d: f32,
        input inp: f32,
        maybe_input bias: f32,
        value act: Activation,
        maybe_output dbias: f32,
    }
}

operation! {
    /// qkv (B, T, 3C) -> out (B, T, C), lse (B, NH, T). Causal without `lens`;
    /// with them bidirectional with padding: every query of sequence b attends
    /// to its first `lens[b]` keys (1..=T).
    pub struct AttentionForward<O> {
        output out: f32,
        output lse: f32,
        input qkv: f32,
        maybe_input lens: u32,
        value shape: AttnShape,
    }
}

operation! {
    /// The gradient of [`AttentionForward`]: dqkv (B, T, 3C) overwritten.
    pub struct AttentionBackward<O> {
        output dqkv: f32,
        input dout: f32,
        input qkv: f32,
        input out: f32,
        input lse: f32,
        maybe_input lens: u32,
        value shape: AttnShape,
    }
}

operation! {
    /// losses (rows) from logits (rows, vp) whose first v columns are real; a
    /// row whose target is `data::IGNORE` has loss 0 (and gradient 0). rows is
    /// `targets.len()`.
    pub struct CrossEntropyForward<O> {
        output losses: f32,
        input logits: f32,
        input targets: u32,
        value v: usize,
        value vp: usize,
    }
}

operation! {
    /// logits (rows, vp) -> dloss * d(sum of losses)/d logits, in place.
    pub struct CrossEntropyBackward<O> {
        output logits: f32,
        input targets: u32,
        value v: usize,
        value vp: usize,
        value dloss: f32,
    }
}

operation! {
    /// One AdamW update of a parameter slice and its moments.
    pub struct AdamWUpdate<O> {
        output param: f32,
        input grad: f32,
        output m: f32,
        output v: f32,
        value step: super::AdamWStep,
        /// 0 for tensors that are not decayed (biases, layernorms).
        value weight_decay: f32,
    }
}

operation! {
    /// out (rows, n) = [out +] inp (rows, k) @ W + bias for few rows (one per
    /// sequence being decoded), W packed by `pack_decode_weight` (its layout
    /// and format are the packing's).
    pub struct MatmulDecode<'p, O, P> {
        output out: f32,
        input inp: f32,
        value w: &'p P,
        maybe_input bias: f32,
        /// (rows, k, n).
        value dims: (usize, usize, usize),
        value accumulate: bool,
    }
}

operation! {
    /// Decoding: qkv (b, 3c) queries against kcache, vcache (b, max_t, c) ->
    /// out (b, c).
    pub struct AttentionDecode<O> {
        output out: f32,
        input qkv: f32,
        input kcache: f32,
        input vcache: f32,
        value shape: DecodeShape,
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
}

/// `Kernels`' methods that take one operation struct, written once for every
/// backend: each passes `$run!` itself, its own name (the backend's function
/// of that name does the work), the profile's `Op`, the operation's
/// floating-point work (what MFU counts: only products) and the operation.
macro_rules! struct_kernels {
    ($run:ident) => {
        struct_kernels! { @each $run op;
            attention_forward(AttentionForward<On<'_, Self>>) AttentionForward
                profile::attention_flops(op.shape, false);
            attention_backward(AttentionBackward<On<'_, Self>>) AttentionBackward
                profile::attention_flops(op.shape, true);
            activation_forward(ActivationForward<On<'_, Self>>) ActivationForward 0.0;
            activation_backward(ActivationBackward<On<'_, Self>>) ActivationBackward 0.0;
            crossentropy_forward(CrossEntropyForward<On<'_, Self>>) CrossEntropyForward 0.0;
            crossentropy_backward(CrossEntropyBackward<On<'_, Self>>) CrossEntropyBackward 0.0;
            adamw(AdamWUpdate<On<'_, Self>>) AdamW 0.0;
        }
    };
    (@each $run:ident $op:ident; $($name:ident($ty:ty) $kind:ident $flops:expr;)*) => {$(
        fn $name(&self, $op: $ty) {
            let flops = $flops;
            $run!(self, $name, Op::$kind, flops, $op)
        }
    )*};
}
pub(crate) use struct_kernels;

#[cfg(test)]
mod tests {
    use super::activation_bias_width as width;

    #[test]
    fn an_activations_bias_must_tile_its_input_and_match_its_gradient() {
        assert_eq!(width(12, None, None), Ok(0));
        assert_eq!(width(12, Some(4), None), Ok(4));
        assert_eq!(width(12, None, Some(3)), Ok(3));
        assert_eq!(width(12, Some(6), Some(6)), Ok(6));
        assert_eq!(width(0, Some(5), None), Ok(5));
        let err = |r: Result<usize, String>| r.unwrap_err();
        assert_eq!(
            err(width(12, Some(5), None)),
            "activation of 12 elements in rows of 5"
        );
        assert_eq!(
            err(width(12, None, Some(5))),
            "activation of 12 elements in rows of 5"
        );
        assert!(err(width(12, Some(6), Some(4))).contains("bias of 6 and its gradient of 4"));
    }
}
