//! The kernels, one struct an operation, written once for every level that
//! runs it: [`Kernels::run`](super::Kernels::run) takes them over views of
//! a backend's buffers ([`On`]), the CPU's bodies over host slices
//! ([`Host`]), a GPU runtime's launches over raw device views. A struct is
//! generic over its [`Operands`], and `lower` converts one kind into
//! another, operand by operand ([`Lower`]); both come from one list of
//! fields in an `operation!` block.
//!
//! Each training kernel is a [`Kernel`] in one file here (`layernorm.rs`,
//! `matmul.rs`, `attention.rs`, ...) beside its source in `kernels/`: its
//! structs, the one shape check every backend runs, the work MFU counts,
//! the CPU's body and the GPU's launch. The decoding operations
//! ([`MatmulDecode`], [`AttentionDecode`]) are [`Decode`](super::Decode)'s.
//!
//! A backward's halves (zb-h1's input and weight halves) are which outputs
//! are given; bf16 arithmetic is a field of the matmul.

use super::gpu::{GpuError, Queue, Raw, Runtime};
use super::memory::{Buf, Dst, Src};
use super::{Bf16, DecodeShape, Device, Elem};
use crate::backend::cpu::math::{with_scratch, Scratch};
use rayon::prelude::*;
use std::marker::PhantomData;
use std::ops::Range;

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

/// A tensor operand stored in fp32 or, under `--precision bf16` where the
/// model keeps it so, in bf16 (`F` and `H`: the operand as each).
#[derive(Clone, Copy, Debug)]
pub enum Stored<F, H> {
    F32(F),
    Bf16(H),
}

impl<F, H> Stored<F, H> {
    /// Whether it is held in bf16.
    pub fn is_bf16(&self) -> bool {
        matches!(self, Stored::Bf16(_))
    }

    /// The operand where it is held in fp32.
    pub fn fp32(self) -> Option<F> {
        match self {
            Stored::F32(x) => Some(x),
            Stored::Bf16(_) => None,
        }
    }

    /// The operand where it is held in bf16.
    pub fn bf16(self) -> Option<H> {
        match self {
            Stored::F32(_) => None,
            Stored::Bf16(x) => Some(x),
        }
    }

    /// The same operand converted by `f` (as fp32) or `h` (as bf16).
    pub fn map<G, I>(self, f: impl FnOnce(F) -> G, h: impl FnOnce(H) -> I) -> Stored<G, I> {
        match self {
            Stored::F32(x) => Stored::F32(f(x)),
            Stored::Bf16(x) => Stored::Bf16(h(x)),
        }
    }
}

impl<F: Extent, H: Extent> Extent for Stored<F, H> {
    fn extent(&self) -> usize {
        match self {
            Stored::F32(x) => x.extent(),
            Stored::Bf16(x) => x.extent(),
        }
    }
}

impl<'a, B> From<Src<'a, B>> for Stored<Src<'a, B>, Src<'a, B, Bf16>> {
    fn from(x: Src<'a, B>) -> Self {
        Stored::F32(x)
    }
}

impl<'a, B> From<Dst<'a, B>> for Stored<Dst<'a, B>, Dst<'a, B, Bf16>> {
    fn from(x: Dst<'a, B>) -> Self {
        Stored::F32(x)
    }
}

impl<'a, B: Device> Stored<Src<'a, B>, Src<'a, B, Bf16>> {
    /// The first `n` elements.
    pub fn first(self, n: usize) -> Self {
        self.map(|x| x.first(n), |x| x.first(n))
    }

    /// A host copy, as fp32 (bf16 values widened exactly).
    pub fn to_host(self, be: &B) -> crate::error::Result<Vec<f32>> {
        match self {
            Stored::F32(x) => be.to_host(x),
            Stored::Bf16(x) => Ok(be.to_host(x)?.into_iter().map(Bf16::to_f32).collect()),
        }
    }
}

/// A tensor on the host, held in fp32 or bf16 (a CPU kernel's stored input).
pub(crate) type Held<'a> = Stored<&'a [f32], &'a [Bf16]>;

impl<'a> Held<'a> {
    /// Elements `r`.
    pub(crate) fn part(self, r: Range<usize>) -> Self {
        match self {
            Stored::F32(x) => Stored::F32(&x[r]),
            Stored::Bf16(x) => Stored::Bf16(&x[r]),
        }
    }
}

/// `f` on `x` in fp32: as it is, or its bf16 values widened into this
/// thread's `scratch` (in parallel where `par`).
#[inline]
pub(crate) fn widened<R>(
    scratch: &'static std::thread::LocalKey<Scratch<f32>>,
    x: Held,
    par: bool,
    f: impl FnOnce(&[f32]) -> R,
) -> R {
    match x {
        Stored::F32(x) => f(x),
        Stored::Bf16(x) => with_scratch(scratch, x.len(), |wide| {
            convert(wide, x, par, Bf16::to_f32);
            f(wide)
        }),
    }
}

/// `f` on this thread's `scratch` as the bf16 `dst` in fp32 (`dst`'s values
/// widened into it where `widen`, else `f` writes every one), then `dst` =
/// them rounded (in parallel where `par`).
#[inline]
pub(crate) fn via_fp32<R>(
    scratch: &'static std::thread::LocalKey<Scratch<f32>>,
    dst: &mut [Bf16],
    widen: bool,
    par: bool,
    f: impl FnOnce(&mut [f32]) -> R,
) -> R {
    with_scratch(scratch, dst.len(), |wide| {
        if widen {
            convert(wide, dst, par, Bf16::to_f32);
        }
        let out = f(wide);
        convert(dst, wide, par, Bf16::from_f32);
        out
    })
}

/// dst = `op` of each of src (in parallel where `par`): a bf16 widening or
/// rounding.
#[inline]
pub(crate) fn convert<S: Copy + Sync, D: Send>(
    dst: &mut [D],
    src: &[S],
    par: bool,
    op: impl Fn(S) -> D + Sync + Send,
) {
    match par {
        true => dst.par_iter_mut().zip(src).for_each(|(d, &s)| *d = op(s)),
        false => dst.iter_mut().zip(src).for_each(|(d, &s)| *d = op(s)),
    }
}

/// A buffer of a tensor held in fp32 or bf16.
pub type StoredBuf<B> = Stored<Buf<B>, Buf<B, Bf16>>;

/// A view of a tensor held in fp32 or bf16, read.
pub type StoredSrc<'a, B> = Stored<Src<'a, B>, Src<'a, B, Bf16>>;

/// A view of a tensor held in fp32 or bf16, written.
pub type StoredDst<'a, B> = Stored<Dst<'a, B>, Dst<'a, B, Bf16>>;

impl<B: Device> StoredBuf<B> {
    /// Elements `r`, read.
    pub fn slice(&self, r: Range<usize>) -> Stored<Src<'_, B>, Src<'_, B, Bf16>> {
        match self {
            Stored::F32(x) => Stored::F32(x.slice(r)),
            Stored::Bf16(x) => Stored::Bf16(x.slice(r)),
        }
    }

    /// Elements `r`, written.
    pub fn slice_mut(&mut self, r: Range<usize>) -> Stored<Dst<'_, B>, Dst<'_, B, Bf16>> {
        match self {
            Stored::F32(x) => Stored::F32(x.slice_mut(r)),
            Stored::Bf16(x) => Stored::Bf16(x.slice_mut(r)),
        }
    }
}

impl<'a, B> Stored<Dst<'a, B>, Dst<'a, B, Bf16>> {
    /// A shorter-lived handle on the same elements.
    pub fn rb(&mut self) -> Stored<Dst<'_, B>, Dst<'_, B, Bf16>> {
        match self {
            Stored::F32(x) => Stored::F32(x.rb()),
            Stored::Bf16(x) => Stored::Bf16(x.rb()),
        }
    }

    /// The same elements, read.
    pub fn into_src(self) -> Stored<Src<'a, B>, Src<'a, B, Bf16>> {
        self.map(Dst::into_src, Dst::into_src)
    }

    /// The same elements, read while this handle lives.
    pub fn src(&self) -> Stored<Src<'_, B>, Src<'_, B, Bf16>> {
        match self {
            Stored::F32(x) => Stored::F32(x.src()),
            Stored::Bf16(x) => Stored::Bf16(x.src()),
        }
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
/// file in `ops/` with its impls and its `mod` line below, and its source
/// in `kernels/` (which `build.rs` gathers).
pub trait Kernel<O: Operands>: Sized {
    /// The name errors and the profile give it.
    const NAME: &'static str;
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
    ) -> Queued;
}

/// What a GPU launch returns: whether it was queued.
pub type Queued = Result<(), GpuError>;

/// Proof that a [`Kernel::check`] passed; only [`checked`] makes one.
pub struct Checked(());

/// `op`'s check, as the error every backend reports.
pub fn checked<O: Operands, K: Kernel<O>>(op: &K) -> crate::error::Result<Checked> {
    op.check()
        .map_err(|e| crate::error::Error::Device(format!("{}: {e}", K::NAME)))?;
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
/// `stored_input`/`stored_output` (a tensor held in fp32 or bf16,
/// [`Stored`]) or `value` (anything else, copied as it is). A new
/// operation is one such block here.
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
    (@type $o:ident stored_input $t:ty) => { Stored<$o::In<f32>, $o::In<$crate::backend::Bf16>> };
    (@type $o:ident stored_output $t:ty) => { Stored<$o::Out<f32>, $o::Out<$crate::backend::Bf16>> };
    (@type $o:ident value $t:ty) => { $t };
    (@lower $f:ident $x:expr, input) => { $f.input($x) };
    (@lower $f:ident $x:expr, output) => { $f.output($x) };
    (@lower $f:ident $x:expr, maybe_input) => { $x.map(|v| $f.input(v)) };
    (@lower $f:ident $x:expr, maybe_output) => { $x.map(|v| $f.output(v)) };
    (@lower $f:ident $x:expr, maybe_outputs2) => { $x.map(|(a, b)| ($f.output(a), $f.output(b))) };
    (@lower $f:ident $x:expr, stored_input) => { $x.map(|v| $f.input(v), |v| $f.input(v)) };
    (@lower $f:ident $x:expr, stored_output) => { $x.map(|v| $f.output(v), |v| $f.output(v)) };
    (@lower $f:ident $x:expr, value) => { $x };
}

pub(crate) mod activation;
pub(crate) mod adamw;
pub(crate) mod attention;
pub(crate) mod crossentropy;
pub(crate) mod encoder;
pub(crate) mod layernorm;
pub(crate) mod matmul;
pub(crate) mod rows;

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

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
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
    use crate::backend::cpu::Cpu;
    use crate::backend::{
        AdamWStep, AdamWUpdate, Category, Kernels, MatmulForward, MatmulShape, WeightLayout,
    };

    /// Every backend runs a kernel's one check first: a view too short for
    /// the shape is an error naming the kernel and the operand, where the
    /// CPU's body would have panicked (or, in AdamW, updated only the
    /// elements every operand has) and a GPU's launch would have read past
    /// it.
    #[test]
    fn a_view_too_short_for_the_shape_is_an_error_naming_kernel_and_operand() {
        let be = Cpu::new();
        let buf = |n| be.alloc(n, Category::Other).unwrap();
        let (mut out, inp, mut w) = (buf(6), buf(6), buf(5));
        let err = be
            .run(MatmulForward {
                out: out.d().into(),
                inp: Stored::F32(inp.s()),
                w: w.s().into(),
                bias: None,
                residual: None,
                shape: MatmulShape::new((2, 3, 3), WeightLayout::InOut),
                accumulate: false,
            })
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("matmul_forward: w: view of 5 elements, need 9"),
            "{err}"
        );
        let (mut stats, mut m) = (buf(2), buf(6));
        let mut copy = be.alloc_typed::<Bf16>(5, Category::Other).unwrap();
        let step = AdamWStep {
            lr: 0.1,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            step: 1,
            grad_scale: 1.0,
        };
        let err = be
            .run(AdamWUpdate {
                param: m.d(),
                grad: inp.s(),
                m: w.d(),
                v: stats.d(),
                copy: None,
                step,
                weight_decay: 0.0,
            })
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("adamw: m: view of 5 elements, need 6"),
            "{err}"
        );
        let (p, mut g) = (buf(5), buf(5));
        let err = be
            .run(AdamWUpdate {
                param: g.d(),
                grad: p.s(),
                m: m.slice_mut(0..5),
                v: w.d(),
                copy: Some(copy.slice_mut(0..4)),
                step,
                weight_decay: 0.0,
            })
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("adamw: copy: view of 4 elements, need 5"),
            "{err}"
        );
    }
}
