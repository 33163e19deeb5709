//! Pointwise activations (GELU tanh and erf, tanh), forward and backward,
//! with a product's bias fused in and its gradient summed in the same pass,
//! as kernels (`kernels/elementwise.cu` and `kernels/bias.cu` on a GPU).

use super::{
    need, via_fp32, widened, Checked, Extent, Host, Kernel, Lower, Operands, Queued, Stored,
};
use crate::backend::cpu::elementwise::CHUNK;
use crate::backend::cpu::math::{
    column_sums, gelu, gelu_erf, gelu_erf_grad, gelu_grad, tanh_exp, widest, Scratch,
};
use crate::backend::gpu::{
    act_code, groups, stored_view, u32s, ActivationPass, Arg, GpuError, Queue, Raw, Runtime, View,
};
use crate::backend::{Activation, Bf16, COLUMN_CHUNK_ROWS};
use rayon::prelude::*;

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
    /// adds it again ([`ActivationBackward`]). Under `--precision bf16`
    /// GPT-2's `inp` (the fc product) and `out` are stored in bf16: each
    /// input value widened, each output value rounded.
    pub struct ActivationForward<O> {
        stored_output out: f32,
        stored_input inp: f32,
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
    /// [`COLUMN_CHUNK_ROWS`] rows, as `matmul_backward`
    /// sums a bias), instead of reading d again in the matmul's backward.
    /// With `rounded` (len d), the result goes there rounded to bf16 and d
    /// is only read: GPT-2's fc product's gradient under `--precision
    /// bf16`, which the product's backward would round anyway.
    pub struct ActivationBackward<O> {
        output d: f32,
        stored_input inp: f32,
        maybe_input bias: f32,
        value act: Activation,
        maybe_output dbias: f32,
        maybe_output rounded: Bf16,
    }
}

impl<O: Operands> Kernel<O> for ActivationForward<O> {
    const NAME: &'static str = "activation_forward";

    fn check(&self) -> Result<(), String> {
        let n = self.inp.extent();
        need("out", &self.out, n)?;
        activation_bias_width(n, self.bias.as_ref().map(Extent::extent), None).map(|_| ())
    }

    fn cpu<'a>(self, host: &impl Lower<O, Host<'a>>) {
        forward(self.lower(host))
    }

    fn gpu<R: Runtime>(self, q: &Queue<R>, raw: &impl Lower<O, Raw>, _: Checked) -> Queued {
        let op = self.lower(raw);
        let (out, out_bf16) = stored_view(op.out);
        let mut args = kernel_args(out, op.inp, op.bias, op.act)?;
        args.push(Arg::U32(out_bf16));
        q.launch("activation_forward", groups(op.inp.extent()), &args)
    }
}

impl<O: Operands> Kernel<O> for ActivationBackward<O> {
    const NAME: &'static str = "activation_backward";

    fn check(&self) -> Result<(), String> {
        let n = self.inp.extent();
        need("d", &self.d, n)?;
        if let Some(r) = &self.rounded {
            need("rounded", r, n)?;
        }
        let grad = self.dbias.as_ref().map(Extent::extent).filter(|&g| g > 0);
        activation_bias_width(n, self.bias.as_ref().map(Extent::extent), grad).map(|_| ())
    }

    fn cpu<'a>(self, host: &impl Lower<O, Host<'a>>) {
        backward(self.lower(host))
    }

    /// With `dbias`, the bias-gradient kernel, which scales d in the same
    /// pass.
    fn gpu<R: Runtime>(self, q: &Queue<R>, raw: &impl Lower<O, Raw>, _: Checked) -> Queued {
        let op = self.lower(raw);
        if let Some(db) = op.dbias.filter(|db| db.len > 0) {
            let (cols, rows) = (db.len, op.inp.extent() / db.len);
            let pass = ActivationPass {
                inp: op.inp,
                bias: op.bias,
                act: op.act,
                rounded: op.rounded,
            };
            return q.bias_backward(db, Stored::F32(op.d), Some(pass), (rows, cols));
        }
        let mut args = kernel_args(op.d, op.inp, op.bias, op.act)?;
        // without `rounded`, any view: the kernel does not write it
        args.push(Arg::View(op.rounded.unwrap_or(op.d)));
        args.push(Arg::U32(op.rounded.is_some().into()));
        q.launch("activation_backward", groups(op.inp.extent()), &args)
    }
}

/// An activation kernel's first arguments: (out or d, inp, bias), n =
/// inp's length, the bias's width, the activation, and whether inp is
/// stored in bf16.
fn kernel_args(
    first: View,
    inp: Stored<View, View>,
    bias: Option<View>,
    act: Activation,
) -> Result<Vec<Arg>, GpuError> {
    let (inp, inp_bf16) = stored_view(inp);
    Ok(vec![
        Arg::View(first),
        Arg::View(inp),
        // without a bias, any view: the kernel does not read it
        Arg::View(bias.unwrap_or(inp)),
        u32s("n", inp.len)?,
        u32s("bias", bias.map_or(0, |b| b.len))?,
        Arg::U32(act_code(Some(act))),
        Arg::U32(inp_bf16),
    ])
}

widest! {
    /// out = act(inp) over one chunk; where `b` is not empty (n wide), the
    /// chunk is rows of n and out = act(inp + b).
    fn activate(out: &mut [f32], inp: &[f32], b: &[f32], act: Activation) {
        #[inline(always)]
        fn by(out: &mut [f32], inp: &[f32], b: &[f32], f: impl Fn(f32) -> f32) {
            if b.is_empty() {
                return out.iter_mut().zip(inp).for_each(|(o, &x)| *o = f(x));
            }
            for (o, x) in out.chunks_exact_mut(b.len()).zip(inp.chunks_exact(b.len())) {
                for ((o, &x), &b) in o.iter_mut().zip(x).zip(b) {
                    *o = f(x + b);
                }
            }
        }
        match act {
            Activation::GeluTanh => by(out, inp, b, gelu),
            Activation::GeluErf => by(out, inp, b, gelu_erf),
            Activation::Tanh => by(out, inp, b, tanh_exp),
        }
    }
}

widest! {
    /// d *= act'(x) over one chunk; where `b` is not empty (n wide), the
    /// chunk is rows of n and d *= act'(x + b), and where `p` is not empty
    /// too (n wide), the rows' sums after the multiply are added to p.
    fn scale_chunk(d: &mut [f32], x: &[f32], b: &[f32], p: &mut [f32], act: Activation) {
        #[inline(always)]
        fn by(d: &mut [f32], x: &[f32], b: &[f32], p: &mut [f32], f: impl Fn(f32) -> f32) {
            if b.is_empty() {
                return d.iter_mut().zip(x).for_each(|(d, &x)| *d *= f(x));
            }
            for (d, x) in d.chunks_exact_mut(b.len()).zip(x.chunks_exact(b.len())) {
                if p.is_empty() {
                    d.iter_mut().zip(x).zip(b).for_each(|((d, &x), &b)| *d *= f(x + b));
                    continue;
                }
                for (((d, &x), &b), p) in d.iter_mut().zip(x).zip(b).zip(p.iter_mut()) {
                    *d *= f(x + b);
                    *p += *d;
                }
            }
        }
        match act {
            Activation::GeluTanh => by(d, x, b, p, gelu_grad),
            Activation::GeluErf => by(d, x, b, p, gelu_erf_grad),
            Activation::Tanh => by(d, x, b, p, |x| {
                let t = tanh_exp(x);
                1.0 - t * t
            }),
        }
    }
}

/// [`activation_bias_width`], which the kernel's check passed.
fn bias_width(len: usize, bias: Option<&[f32]>, grad: Option<usize>) -> usize {
    activation_bias_width(len, bias.map(<[f32]>::len), grad).unwrap_or_else(|e| panic!("{e}"))
}

/// The elements a task takes: about [`CHUNK`], in whole rows of a bias n
/// wide (n = 0: none).
fn span(n: usize) -> usize {
    match n {
        0 => CHUNK,
        n => n * CHUNK.div_ceil(n),
    }
}

/// out = act(inp + bias), any shape; with a bias (n), inp is (rows, n)
/// ([`ActivationForward`]). A chunk stored in bf16 is widened, or stored
/// rounded, through its thread's scratch.
fn forward(op: ActivationForward<Host<'_>>) {
    let ActivationForward {
        out,
        inp,
        bias,
        act,
    } = op;
    let len = inp.extent();
    let span = span(bias_width(len, bias, None));
    let b = bias.unwrap_or_default();
    let x = |i: usize| inp.part(i * span..len.min((i + 1) * span));
    match out {
        Stored::F32(out) => out[..len]
            .par_chunks_mut(span)
            .enumerate()
            .for_each(|(i, o)| widened(&WIDENED, x(i), false, |x| activate(o, x, b, act))),
        Stored::Bf16(out) => out[..len]
            .par_chunks_mut(span)
            .enumerate()
            .for_each(|(i, o)| {
                widened(&WIDENED, x(i), false, |x| {
                    via_fp32(&ACTIVATED, o, false, false, |wide| {
                        activate(wide, x, b, act)
                    })
                })
            }),
    }
}

thread_local! {
    /// A chunk of a bf16-stored [`forward`]'s values in fp32.
    static ACTIVATED: Scratch<f32> = const { Scratch::new(Vec::new()) };
    /// A chunk of a bf16-stored input in fp32.
    static WIDENED: Scratch<f32> = const { Scratch::new(Vec::new()) };
    /// A chunk of a [`backward`]'s results before they are rounded.
    static SCALED: Scratch<f32> = const { Scratch::new(Vec::new()) };
}

/// d *= act'(inp + bias): turns d loss / d act(inp + bias) into d loss /
/// d inp, in place; with `dbias` (n), d is (rows, n) and the bias gradient
/// of the product that made inp (d's column sums after the multiply) is
/// added to dbias in the same pass ([`column_sums`]' chunks).
fn backward(op: ActivationBackward<Host<'_>>) {
    let ActivationBackward {
        d,
        inp,
        bias,
        act,
        dbias,
        rounded,
    } = op;
    let len = inp.extent();
    let d = &mut d[..len];
    // one chunk: d *= act' in place, or with `rounded` into a copy that
    // goes there rounded (d only read)
    let chunk = |d: &mut [f32], r: Option<&mut [Bf16]>, x: &[f32], b: &[f32], p: &mut [f32]| match r
    {
        None => scale_chunk(d, x, b, p, act),
        Some(r) => via_fp32(&SCALED, r, false, false, |v| {
            v.copy_from_slice(d);
            scale_chunk(v, x, b, p, act);
        }),
    };
    let Some(db) = dbias.filter(|db| !db.is_empty()) else {
        let span = span(bias_width(len, bias, None));
        let b = bias.unwrap_or_default();
        let mut parts = rounded_parts(rounded, len, span);
        let chunks = d.par_chunks_mut(span).zip(parts.par_iter_mut()).enumerate();
        chunks.for_each(|(i, (d, r))| {
            let x = inp.part(i * span..len.min((i + 1) * span));
            widened(&WIDENED, x, false, |x| chunk(d, r.take(), x, b, &mut []))
        });
        return;
    };
    // a bias of zeros where none is given: x + 0 only turns -0 into +0,
    // where every act' has the same value
    let zeros;
    let b = match bias {
        Some(b) => b,
        None => {
            zeros = vec![0.0; db.len()];
            &zeros
        }
    };
    let n = bias_width(len, Some(b), Some(db.len()));
    let span = COLUMN_CHUNK_ROWS * n;
    let mut parts = rounded_parts(rounded, len, span);
    let chunks = d.par_chunks_mut(span).zip(parts.par_iter_mut()).enumerate();
    column_sums(&mut [db], chunks, |(i, (d, r)), p| {
        let x = inp.part(i * span..len.min((i + 1) * span));
        widened(&WIDENED, x, false, |x| chunk(d, r.take(), x, b, p))
    });
}

/// `rounded`'s first `len` elements in chunks of `span` (none where it is
/// not given), one for each of d's.
fn rounded_parts(
    rounded: Option<&mut [Bf16]>,
    len: usize,
    span: usize,
) -> Vec<Option<&mut [Bf16]>> {
    match rounded {
        Some(r) => r[..len].chunks_mut(span).map(Some).collect(),
        None => (0..len.div_ceil(span)).map(|_| None).collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::check::*;
    use crate::backend::cpu::math::on_each_width;
    use crate::rng::Rng;

    /// A backward given `rounded` writes there the in-place result rounded,
    /// bit for bit, leaves d as it was, and sums the same bias gradient:
    /// with and without a bias and its gradient, over more than one task's
    /// chunk (of either pass).
    #[test]
    fn a_rounded_backward_is_the_in_place_one_rounded_and_leaves_d() {
        let mut rng = Rng::new(23);
        let (rows, n) = (2 * CHUNK.max(COLUMN_CHUNK_ROWS * 96) / 96 + 3, 96);
        let (x, b) = (randn(&mut rng, rows * n, 2.0), randn(&mut rng, n, 1.0));
        let d0 = randn(&mut rng, rows * n, 1.0);
        for bias in [None, Some(&b[..])] {
            for grad in [false, true] {
                let run = |d: &mut [f32], db: &mut [f32], rounded| {
                    backward(ActivationBackward {
                        d,
                        inp: Stored::F32(&x),
                        bias,
                        act: Activation::GeluTanh,
                        dbias: grad.then_some(db),
                        rounded,
                    })
                };
                let (mut want, mut want_db) = (d0.clone(), vec![0.5; n]);
                run(&mut want, &mut want_db, None);
                let (mut d, mut db) = (d0.clone(), vec![0.5; n]);
                let mut held = vec![Bf16::from_f32(-9.0); rows * n + 1];
                run(&mut d, &mut db, Some(&mut held));
                let what = format!("bias {} grad {grad}", bias.is_some());
                assert!(d == d0, "{what}: d was written");
                let rounded: Vec<Bf16> = want.iter().map(|&v| Bf16::from_f32(v)).collect();
                assert!(held[..rows * n] == rounded[..], "{what}: rounded");
                assert_eq!(held[rows * n], Bf16::from_f32(-9.0), "{what}: past its end");
                assert!(db == want_db, "{what}: the bias gradient");
            }
        }
    }

    /// An output stored in bf16 is the fp32 output rounded, bit for bit,
    /// with and without a bias, over more than one task's chunk.
    #[test]
    fn a_bf16_output_is_the_fp32_output_rounded() {
        let mut rng = Rng::new(21);
        let (rows, n) = (2 * CHUNK / 96 + 3, 96);
        let (x, b) = (randn(&mut rng, rows * n, 2.0), randn(&mut rng, n, 1.0));
        for act in [Activation::GeluTanh, Activation::GeluErf, Activation::Tanh] {
            for bias in [None, Some(&b[..])] {
                let mut fp32 = vec![f32::NAN; rows * n];
                let inp = Stored::F32(&x[..]);
                forward(ActivationForward {
                    out: Stored::F32(&mut fp32),
                    inp,
                    bias,
                    act,
                });
                let mut held = vec![Bf16::default(); rows * n];
                forward(ActivationForward {
                    out: Stored::Bf16(&mut held),
                    inp,
                    bias,
                    act,
                });
                let rounded: Vec<Bf16> = fp32.iter().map(|&v| Bf16::from_f32(v)).collect();
                assert!(held == rounded, "{act:?}, bias {}", bias.is_some());
            }
        }
    }

    /// An input stored in bf16 gives what its values held in fp32 give,
    /// bit for bit: forward into fp32 and bf16 outputs, and the backward
    /// with and without a bias and its gradient, over more than one
    /// task's chunk.
    #[test]
    fn a_bf16_input_is_its_fp32_values() {
        let mut rng = Rng::new(22);
        let (rows, n) = (2 * CHUNK / 96 + 3, 96);
        let held: Vec<Bf16> = randn(&mut rng, rows * n, 2.0)
            .into_iter()
            .map(Bf16::from_f32)
            .collect();
        let wide: Vec<f32> = held.iter().map(|x| x.to_f32()).collect();
        let (b, probe) = (randn(&mut rng, n, 1.0), randn(&mut rng, rows * n, 1.0));
        let inputs = [Stored::F32(&wide[..]), Stored::Bf16(&held[..])];
        for act in [Activation::GeluTanh, Activation::GeluErf, Activation::Tanh] {
            for (bias, with_db) in [(None, false), (Some(&b[..]), false), (Some(&b[..]), true)] {
                let runs = inputs.map(|inp| {
                    let (mut fp32, mut bf16) =
                        (vec![0.0; rows * n], vec![Bf16::default(); rows * n]);
                    for out in [Stored::F32(&mut fp32[..]), Stored::Bf16(&mut bf16[..])] {
                        forward(ActivationForward {
                            out,
                            inp,
                            bias,
                            act,
                        });
                    }
                    let (mut d, mut db) = (probe.clone(), vec![0.5f32; n]);
                    backward(ActivationBackward {
                        d: &mut d,
                        inp,
                        bias,
                        act,
                        dbias: with_db.then_some(&mut db[..]),
                        rounded: None,
                    });
                    (fp32, bf16, d, db)
                });
                let what = format!("{act:?}, bias {}, dbias {with_db}", bias.is_some());
                assert!(runs[0].0 == runs[1].0, "{what}: forward");
                assert!(runs[0].1 == runs[1].1, "{what}: forward into bf16");
                assert!(runs[0].2 == runs[1].2, "{what}: backward");
                assert!(runs[0].3 == runs[1].3, "{what}: bias gradient");
            }
        }
    }

    #[test]
    fn an_activations_bias_must_tile_its_input_and_match_its_gradient() {
        assert_eq!(activation_bias_width(12, None, None), Ok(0));
        assert_eq!(activation_bias_width(12, Some(4), None), Ok(4));
        assert_eq!(activation_bias_width(12, None, Some(3)), Ok(3));
        assert_eq!(activation_bias_width(12, Some(6), Some(6)), Ok(6));
        assert_eq!(activation_bias_width(0, Some(5), None), Ok(5));
        let err = |r: Result<usize, String>| r.unwrap_err();
        assert_eq!(
            err(activation_bias_width(12, Some(5), None)),
            "activation of 12 elements in rows of 5"
        );
        assert_eq!(
            err(activation_bias_width(12, None, Some(5))),
            "activation of 12 elements in rows of 5"
        );
        assert!(err(activation_bias_width(12, Some(6), Some(4)))
            .contains("bias of 6 and its gradient of 4"));
    }

    fn gelu64(x: f64) -> f64 {
        let u = (2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x.powi(3));
        0.5 * x * (1.0 + u.tanh())
    }

    /// erf in f64: its Maclaurin series below |x| = 2.5, 1 - erfc by
    /// erfc's continued fraction above (each accurate to ~1e-14 there).
    fn erf64(x: f64) -> f64 {
        let a = x.abs();
        if a < 2.5 {
            let (mut term, mut sum) = (x, x);
            for n in 1..200 {
                term *= -x * x / n as f64;
                sum += term / (2 * n + 1) as f64;
            }
            return sum * 2.0 / std::f64::consts::PI.sqrt();
        }
        let mut cf = a;
        for k in (1..200).rev() {
            cf = a + k as f64 / 2.0 / cf;
        }
        let erfc = (-a * a).exp() / (std::f64::consts::PI.sqrt() * cf);
        (1.0 - erfc).copysign(x)
    }

    fn gelu_erf64(x: f64) -> f64 {
        0.5 * x * (1.0 + erf64(x / 2f64.sqrt()))
    }

    type Reference = fn(f64) -> f64;

    /// Each activation with its f64 reference.
    fn references() -> [(Activation, Reference); 3] {
        [
            (Activation::GeluTanh, gelu64),
            (Activation::GeluErf, gelu_erf64),
            (Activation::Tanh, f64::tanh),
        ]
    }

    /// Each activation's kernels give, bit for bit, what its scalar
    /// formulas give element by element in the kernel's order (x + b
    /// first where there is a bias; the bias gradient summed a chunk of
    /// rows at a time, the chunks then in order), on every instruction set
    /// this CPU runs them on (`widest!`: AVX-512's copy where it has it,
    /// and the build's own).
    #[test]
    fn activations_give_their_scalar_formulas_bits_on_every_instruction_set() {
        let (rows, n) = (2 * COLUMN_CHUNK_ROWS + 3, 37);
        type Scalar = fn(f32) -> f32;
        let formulas: [(Activation, Scalar, Scalar); 3] = [
            (Activation::GeluTanh, gelu, gelu_grad),
            (Activation::GeluErf, gelu_erf, gelu_erf_grad),
            (Activation::Tanh, tanh_exp, |x| {
                1.0 - tanh_exp(x) * tanh_exp(x)
            }),
        ];
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        let col_sums = |d: &[f32]| {
            let mut sums = vec![0.5f32; n];
            for chunk in d.chunks(COLUMN_CHUNK_ROWS * n) {
                let mut part = vec![0.0f32; n];
                for row in chunk.chunks(n) {
                    part.iter_mut().zip(row).for_each(|(p, &v)| *p += v);
                }
                sums.iter_mut().zip(&part).for_each(|(s, &p)| *s += p);
            }
            sums
        };
        for (act, f, df) in formulas {
            let mut rng = Rng::new(9);
            // past one CHUNK, so the parallel chunks are exercised too
            let x = randn(&mut rng, CHUNK + rows * n, 4.0);
            let probe = randn(&mut rng, x.len(), 1.0);
            let b = randn(&mut rng, n, 1.0);
            let z: Vec<f32> = (0..rows * n).map(|i| x[i] + b[i % n]).collect();
            let want_out: Vec<f32> = x.iter().map(|&x| f(x)).collect();
            let want_out_b: Vec<f32> = z.iter().map(|&z| f(z)).collect();
            let want: Vec<f32> = x.iter().zip(&probe).map(|(&x, &p)| p * df(x)).collect();
            let want_b: Vec<f32> = z.iter().zip(&probe).map(|(&z, &p)| p * df(z)).collect();
            let (want_db, want_db_b) = (col_sums(&want[..rows * n]), col_sums(&want_b));
            let runs = on_each_width(|| {
                let (x, probe) = (&x[..], &probe[..]);
                let forward = |len, bias| {
                    let mut out = vec![0.0; len];
                    let inp = Stored::F32(&x[..len]);
                    forward(ActivationForward {
                        out: Stored::F32(&mut out),
                        inp,
                        bias,
                        act,
                    });
                    out
                };
                let backward = |len, bias, with_db: bool| {
                    let (mut d, mut db) = (probe[..len].to_vec(), vec![0.5f32; n]);
                    backward(ActivationBackward {
                        d: &mut d,
                        inp: Stored::F32(&x[..len]),
                        bias,
                        act,
                        dbias: with_db.then_some(&mut db[..]),
                        rounded: None,
                    });
                    [d, db]
                };
                let [d_b, db_b] = backward(rows * n, Some(&b[..]), true);
                let [d_rows, db] = backward(rows * n, None, true);
                [
                    forward(x.len(), None),
                    forward(rows * n, Some(&b[..])),
                    backward(x.len(), None, false)[0].clone(),
                    backward(rows * n, Some(&b[..]), false)[0].clone(),
                    d_b,
                    db_b,
                    d_rows,
                    db,
                ]
            });
            for (width, [out, out_b, d, d_b_only, d_b, db_b, d_rows, db]) in
                runs.into_iter().enumerate()
            {
                let at = format!("{act:?}, instruction set {width}");
                assert_eq!(bits(&out), bits(&want_out), "{at}: forward");
                assert_eq!(bits(&out_b), bits(&want_out_b), "{at}: forward, a bias");
                assert_eq!(bits(&d), bits(&want), "{at}: backward");
                assert_eq!(bits(&d_b_only), bits(&want_b), "{at}: backward, a bias");
                assert_eq!(
                    bits(&d_b),
                    bits(&want_b),
                    "{at}: backward, a bias and its gradient"
                );
                assert_eq!(bits(&db_b), bits(&want_db_b), "{at}: the bias's gradient");
                assert_eq!(
                    bits(&d_rows),
                    bits(&want[..rows * n]),
                    "{at}: bias gradient only"
                );
                assert_eq!(bits(&db), bits(&want_db), "{at}: a gradient without a bias");
            }
        }
    }

    #[test]
    fn activation_backwards_match_finite_differences() {
        for (act, f) in references() {
            let mut rng = Rng::new(6);
            let x = randn(&mut rng, 257, 3.0);
            let probe = randn(&mut rng, 257, 1.0);
            let mut out = vec![0.0; 257];
            forward(ActivationForward {
                out: Stored::F32(&mut out),
                inp: Stored::F32(&x),
                bias: None,
                act,
            });
            let want: Vec<f64> = to64(&x).into_iter().map(f).collect();
            assert_close(&format!("{act:?} out"), &out, &want, 1e-6);
            let mut d = probe.clone();
            backward(ActivationBackward {
                d: &mut d,
                inp: Stored::F32(&x),
                bias: None,
                act,
                dbias: None,
                rounded: None,
            });
            let fd = finite_diff(&x, |v| {
                let o: Vec<f64> = v.iter().map(|&x| f(x)).collect();
                probe_dot(&o, &probe)
            });
            assert_close(&format!("{act:?} dx"), &d, &fd, 1e-5);
        }
    }

    /// The fused bias: for z = x + b (b broadcast over rows of n), act(z)
    /// against f64, and for loss = probe . act(z) the gradients of x and b
    /// by finite differences, over rows that span three chunks (the last
    /// short), dbias added onto one that was not zero; d the same with
    /// and without dbias.
    #[test]
    fn a_fused_bias_matches_f64_and_finite_differences() {
        let (rows, n) = (2 * COLUMN_CHUNK_ROWS + 5, 7);
        for (act, f) in references() {
            let mut rng = Rng::new(8);
            let x = randn(&mut rng, rows * n, 1.5);
            let b = randn(&mut rng, n, 0.5);
            let probe = randn(&mut rng, rows * n, 1.0);
            let start = randn(&mut rng, n, 1.0);
            let mut out = vec![0.0; rows * n];
            forward(ActivationForward {
                out: Stored::F32(&mut out),
                inp: Stored::F32(&x),
                bias: Some(&b),
                act,
            });
            let want: Vec<f64> = (0..rows * n)
                .map(|i| f(x[i] as f64 + b[i % n] as f64))
                .collect();
            assert_close(&format!("{act:?} out with a bias"), &out, &want, 1e-6);
            let (mut d, mut db) = (probe.clone(), start.clone());
            backward(ActivationBackward {
                d: &mut d,
                inp: Stored::F32(&x),
                bias: Some(&b),
                act,
                dbias: Some(&mut db),
                rounded: None,
            });
            let loss = |x: &[f64], b: &[f64]| {
                let o: Vec<f64> = (0..rows * n).map(|i| f(x[i] + b[i % n])).collect();
                probe_dot(&o, &probe)
            };
            let fd_b = finite_diff(&b, |bv| loss(&to64(&x), bv));
            let want: Vec<f64> = fd_b
                .iter()
                .zip(&start)
                .map(|(g, &s)| g + s as f64)
                .collect();
            assert_close(&format!("{act:?} dbias"), &db, &want, 1e-4);
            let fd_x = finite_diff(&x, |xv| loss(xv, &to64(&b)));
            assert_close(&format!("{act:?} dx"), &d, &fd_x, 1e-4);
            let mut plain = probe.clone();
            backward(ActivationBackward {
                d: &mut plain,
                inp: Stored::F32(&x),
                bias: Some(&b),
                act,
                dbias: None,
                rounded: None,
            });
            assert_eq!(d, plain, "{act:?}: d differs without dbias");
        }
    }
}
