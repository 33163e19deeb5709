//! Every OpenCL kernel against its CPU twin on random inputs, awkward shapes
//! and non-zero view offsets. Error metric: max over elements of
//! |got - want| / max(1, |want|), at most 1e-5.
//!
//! Without an OpenCL device the tests print a notice and pass, unless
//! DISTGPT_REQUIRE_OPENCL=1. DISTGPT_OPENCL_DEVICE picks the device index;
//! DISTGPT_OCL_TINY=1 shrinks the shapes for Oclgrind
//! (scripts/oclgrind-check.sh).

use super::{
    kernel_names, program_source, DeviceMem, GpuError, Queue, Raw, Runtime, View, BLOCK,
    SCRATCH_GUARD,
};
use crate::backend::cpu::check::randn;
use crate::backend::cpu::elementwise;
use crate::backend::opencl::ClRuntime;
use crate::backend::ops::layernorm;
use crate::backend::ops::tests::AsIs;
use crate::backend::ops::{checked, Host, Kernel, Stored};
use crate::backend::Elem;
use crate::backend::{Activation, AdamWStep, Bf16, WeightLayout};
use crate::backend::{
    ActivationBackward, ActivationForward, AdamWUpdate, CopyRows, CrossEntropyBackward,
    CrossEntropyForward, EncoderBackward, EncoderForward, LayerNormBackward, LayerNormForward,
    MatmulBackward, MatmulForward, MatmulShape,
};
use crate::rng::Rng;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::OnceLock;

impl<R: Runtime> Queue<R> {
    /// Any [`Kernel`] over raw views: checked, then queued.
    pub(crate) fn run<K: Kernel<Raw>>(&self, op: K) -> Result<(), GpuError> {
        let checked = checked(&op).map_err(|e| GpuError(e.to_string()))?;
        op.gpu(self, &AsIs, checked)
    }
}

pub(super) const TOL: f64 = 1e-5;

fn env_is(name: &str, value: &str) -> bool {
    std::env::var(name).is_ok_and(|v| v == value)
}

/// A runtime the kernel tests run on, with its shared test device.
pub(super) trait TestRuntime: Runtime {
    /// The device, or None (with a notice) when there is none.
    fn device() -> Option<&'static Queue<Self>>;
}

/// Opens device `DISTGPT_{KIND}_DEVICE` (default 0) of `R`; without one the
/// tests print a notice and pass, unless `DISTGPT_REQUIRE_{KIND}=1`.
fn open_test_device<R: Runtime>() -> Option<Queue<R>> {
    let kind = R::KIND.to_uppercase();
    let index = std::env::var(format!("DISTGPT_{kind}_DEVICE"))
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    match Queue::<R>::open(index) {
        Ok(d) => {
            eprintln!("{} kernel tests on {}", R::KIND, d.name());
            Some(d)
        }
        Err(e) if env_is(&format!("DISTGPT_REQUIRE_{kind}"), "1") => {
            panic!("DISTGPT_REQUIRE_{kind}=1 but no {} device: {e}", R::KIND)
        }
        Err(e) => {
            eprintln!("skipping {} kernel tests: {e}", R::KIND);
            None
        }
    }
}

impl TestRuntime for ClRuntime {
    fn device() -> Option<&'static Queue<Self>> {
        static DEVICE: OnceLock<Option<Queue<ClRuntime>>> = OnceLock::new();
        DEVICE.get_or_init(open_test_device).as_ref()
    }
}

#[cfg(feature = "cuda")]
impl TestRuntime for crate::backend::cuda::CudaRuntime {
    fn device() -> Option<&'static Queue<Self>> {
        static DEVICE: OnceLock<Option<Queue<crate::backend::cuda::CudaRuntime>>> = OnceLock::new();
        DEVICE.get_or_init(open_test_device).as_ref()
    }
}

/// Runs `$check::<R>(device)` on each runtime's test device there is:
/// OpenCL, and CUDA in a build with the `cuda` feature.
macro_rules! on_gpus {
    ($check:ident) => {{
        use $crate::backend::gpu::tests::TestRuntime;
        if let Some(dev) = $crate::backend::opencl::ClRuntime::device() {
            $check(dev);
        }
        #[cfg(feature = "cuda")]
        if let Some(dev) = $crate::backend::cuda::CudaRuntime::device() {
            $check(dev);
        }
    }};
}
pub(super) use on_gpus;

/// Tiny shapes for Oclgrind, or the full set.
pub(super) fn tiny() -> bool {
    env_is("DISTGPT_OCL_TINY", "1")
}

/// A device buffer holding `data` at a non-zero offset after guard elements;
/// guards follow too when the length is even. A kernel writing outside its
/// view changes a guard (each tensor has its own guard value, so a stray copy
/// from another tensor shows); one reading or writing past the buffer's end
/// is what Oclgrind reports.
pub(super) struct Tensor<R: Runtime, T: Elem> {
    mem: R::Mem<T>,
    off: usize,
    len: usize,
    guard: T,
}

impl<R: Runtime, T: Elem> Tensor<R, T> {
    pub(super) fn view(&self) -> View {
        self.mem.view_range(self.off..self.off + self.len)
    }
}

/// A fresh guard value per tensor.
fn next_guard() -> u32 {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

pub(super) fn put<R: Runtime, T: Elem>(dev: &Queue<R>, data: &[T], guard: T) -> Tensor<R, T> {
    put_at(dev, data, guard, 3 + data.len() % 5)
}

/// A bf16 tensor 256 bytes into its buffer, aligned as the queue's scratch
/// is: where a test asks two routes into cuBLAS for the same bits (a bf16
/// operand as it is held, or fp32 values rounded into the scratch), both
/// present the same alignment, from which cuBLAS may choose its kernel
/// and so its order of summation.
pub(super) fn put_aligned<R: Runtime>(dev: &Queue<R>, data: &[Bf16]) -> Tensor<R, Bf16> {
    put_at(dev, data, Bf16::from_f32(-999.0 - next_guard() as f32), 128)
}

/// Where two runs' values differ: how many, and the largest difference.
pub(super) fn differ(a: &[f32], b: &[f32]) -> String {
    let apart = a.iter().zip(b).filter(|(x, y)| x.to_bits() != y.to_bits());
    let (n, most) = apart.fold((0, 0f32), |(n, m), (x, y)| (n + 1, m.max((x - y).abs())));
    format!("{n} of {} differ, by up to {most:e}", a.len())
}

fn put_at<R: Runtime, T: Elem>(dev: &Queue<R>, data: &[T], guard: T, off: usize) -> Tensor<R, T> {
    let tail = if data.len().is_multiple_of(2) { 4 } else { 0 };
    let mut host = vec![guard; off + data.len() + tail];
    host[off..off + data.len()].copy_from_slice(data);
    let mem = dev.alloc::<T>(host.len()).unwrap();
    dev.write(mem.view(), &host).unwrap();
    Tensor {
        mem,
        off,
        len: data.len(),
        guard,
    }
}

pub(super) fn putf<R: Runtime>(dev: &Queue<R>, data: &[f32]) -> Tensor<R, f32> {
    put(dev, data, -1000.0 - next_guard() as f32 * 0.25)
}

pub(super) fn putu<R: Runtime>(dev: &Queue<R>, data: &[u32]) -> Tensor<R, u32> {
    put(dev, data, u32::MAX - next_guard())
}

/// The tensor's contents; panics if anything outside its view changed.
pub(super) fn get<R: Runtime, T: Elem + PartialEq>(dev: &Queue<R>, t: &Tensor<R, T>) -> Vec<T> {
    let mut host = vec![T::default(); t.mem.len()];
    dev.read(t.mem.view(), &mut host).unwrap();
    let (before, rest) = host.split_at(t.off);
    let (data, after) = rest.split_at(t.len);
    assert!(
        before.iter().chain(after).all(|&g| g == t.guard),
        "a kernel wrote outside its view"
    );
    data.to_vec()
}

pub(super) fn max_rel_err(got: &[f32], want: &[f32]) -> f64 {
    assert_eq!(got.len(), want.len());
    got.iter()
        .zip(want)
        .map(|(&g, &w)| {
            let e = (g as f64 - w as f64).abs() / (w as f64).abs().max(1.0);
            if e.is_nan() {
                f64::INFINITY
            } else {
                e
            }
        })
        .fold(0.0, f64::max)
}

pub(super) fn assert_close(what: &str, got: &[f32], want: &[f32]) {
    let e = max_rel_err(got, want);
    eprintln!("{what}: max rel err {e:.2e}");
    assert!(e <= TOL, "{what}: max rel err {e:.3e} > {TOL:e}");
}

/// [`assert_close`], or, element by element, within the rounding a sum of
/// `terms` values whose magnitudes add up to `mag` carries in two summation
/// orders (the CPU's, and the device's own order and FMA contraction):
/// 2 x 2 sqrt(terms) u mag, u = 2^-24, the probabilistic bound on a float
/// sum's error (Higham & Mary, 2019). Those orders differ on CUDA (NVRTC
/// contracts to FMA; cuBLAS splits its sums), where sums of a few hundred
/// terms, or a difference rstd amplifies, end 1e-5 apart.
pub(super) fn assert_close_sums(what: &str, got: &[f32], want: &[f32], mag: &[f32], terms: usize) {
    assert_eq!((got.len(), want.len()), (mag.len(), mag.len()), "{what}");
    let gamma = 4.0 * (terms as f64).sqrt() * f64::from(f32::EPSILON) / 2.0;
    let mut worst = (0.0f64, 0usize);
    for (i, ((&g, &w), &m)) in got.iter().zip(want).zip(mag).enumerate() {
        let e = (g as f64 - w as f64).abs();
        let allowed = (TOL * (w as f64).abs().max(1.0)).max(gamma * m as f64);
        let r = if e.is_nan() {
            f64::INFINITY
        } else {
            e / allowed
        };
        if r > worst.0 {
            worst = (r, i);
        }
    }
    let i = worst.1;
    eprintln!(
        "{what}: worst error {:.2} of the allowed (element {i})",
        worst.0
    );
    assert!(
        worst.0 <= 1.0,
        "{what}: element {i} is {} against {}, beyond both {TOL:e} and a {terms}-term sum's \
         rounding of magnitude {}",
        got[i],
        want[i],
        mag[i]
    );
}

pub(super) fn tokens(rng: &mut Rng, n: usize, vocab: usize) -> Vec<u32> {
    (0..n).map(|_| rng.below(vocab) as u32).collect()
}

#[test]
fn prelude_block_matches_host_block() {
    assert!(program_source().contains(&format!("#define BLOCK {BLOCK}\n")));
}

#[test]
fn open_out_of_range_lists_devices() {
    on_gpus!(open_out_of_range_lists_devices_on);
}

fn open_out_of_range_lists_devices_on<R: Runtime>(dev: &Queue<R>) {
    let err = Queue::<R>::open(usize::MAX).err().unwrap().to_string();
    // The model's name: what follows it in brackets (CUDA's free memory) moves.
    let name = dev.name();
    let model = name.split(" (").next().unwrap();
    assert!(err.contains("out of range") && err.contains(model), "{err}");
}

/// A part of a view is counted from the view's start, as long as its
/// range; one past the view's end is refused.
#[test]
fn a_part_of_a_view_is_its_range_within_it() {
    let v = View {
        mem: 7,
        off: 3,
        len: 10,
    };
    let p = v.part(2..5);
    assert_eq!((p.mem, p.off, p.len), (7, 5, 3));
    let t = p.tail(1);
    assert_eq!((t.off, t.len), (6, 2));
    assert!(std::panic::catch_unwind(|| v.part(4..11)).is_err());
    let reversed = std::ops::Range { start: 5, end: 4 };
    assert!(std::panic::catch_unwind(|| v.part(reversed)).is_err());
}

#[test]
fn views_too_short_are_errors() {
    on_gpus!(views_too_short_are_errors_on);
}

fn views_too_short_are_errors_on<R: Runtime>(dev: &Queue<R>) {
    let a = dev.alloc::<f32>(10).unwrap();
    let err = dev
        .pointwise("copy", a.view_range(0..4), a.view_range(4..10))
        .unwrap_err();
    assert!(err.to_string().contains("need 6"), "{err}");
    let mut host = [0.0f32; 3];
    assert!(dev.read(a.view(), &mut host).is_err());
    // a kernel's own check, the one the CPU runs: rows 2 of c 3 need 6
    let err = dev
        .run(LayerNormForward::<Raw> {
            out: Stored::F32(a.view_range(0..5)),
            mean: a.view_range(0..2),
            rstd: a.view_range(2..4),
            inp: a.view(),
            w: a.view(),
            b: a.view(),
            c: 3,
            eps: 1e-5,
        })
        .unwrap_err();
    assert!(
        err.to_string()
            .contains("layernorm_forward: out: view of 5 elements, need 6"),
        "{err}"
    );
}

/// A copy started on the copy queue lands what the kernels queued before
/// it wrote, all of them, however long they run; into pinned memory where
/// the runtime pins.
#[test]
fn a_copy_on_the_copy_queue_waits_for_the_kernels_before_it() {
    on_gpus!(a_copy_on_the_copy_queue_waits_for_the_kernels_before_it_on);
}

fn a_copy_on_the_copy_queue_waits_for_the_kernels_before_it_on<R: Runtime>(dev: &Queue<R>) {
    let (n, rounds) = if tiny() { (1000, 3) } else { (1 << 20, 40) };
    let acc = putf(dev, &vec![0.0; n]);
    let one = putf(dev, &vec![1.0; n]);
    let mut got = vec![-1.0f32; n];
    // SAFETY: `got` outlives the guard, dropped at the end.
    let _pinned = unsafe { dev.rt.pin(&mut got) }.unwrap();
    for round in 1..=rounds {
        for _ in 0..round {
            dev.pointwise("add_inplace", acc.view(), one.view())
                .unwrap();
        }
        // SAFETY: `got` is neither read nor written until the copy is waited.
        let wait = unsafe { dev.read_start(acc.view(), &mut got) }.unwrap();
        wait().unwrap();
        let want = (round * (round + 1) / 2) as f32;
        let bad = got.iter().position(|&x| x != want);
        assert!(
            bad.is_none(),
            "round {round}: element {bad:?} is {}; the adds queued before the copy leave {want}",
            got[bad.unwrap_or(0)]
        );
    }
    assert_eq!(get(dev, &acc)[n - 1], (rounds * (rounds + 1) / 2) as f32);
}

/// (rows per sequence t, sequences b, channels c, vocab)
fn encoder_shapes() -> Vec<(usize, usize, usize, usize)> {
    if tiny() {
        vec![(3, 2, 3, 5), (5, 1, 1, 2)]
    } else {
        vec![
            (37, 3, 67, 11),
            (5, 2, 1, 3),
            (64, 4, 2, 50),
            (9, 1, 300, 7),
        ]
    }
}

#[test]
fn encoder_forward_matches_cpu() {
    on_gpus!(encoder_forward_matches_cpu_on);
}

fn encoder_forward_matches_cpu_on<R: Runtime>(dev: &Queue<R>) {
    let mut rng = Rng::new(1);
    for (t, b, c, vocab) in encoder_shapes() {
        let toks = tokens(&mut rng, b * t, vocab);
        let wte = randn(&mut rng, vocab * c, 1.0);
        let wpe = randn(&mut rng, t * c, 1.0);
        let mut want = vec![0.0; b * t * c];
        (EncoderForward::<Host> {
            out: &mut want,
            tokens: &toks,
            wte: &wte,
            wpe: &wpe,
            t,
            c,
        })
        .cpu(&AsIs);
        let out = putf(dev, &vec![7.0; b * t * c]);
        let (tk, e, p) = (putu(dev, &toks), putf(dev, &wte), putf(dev, &wpe));
        dev.run(EncoderForward {
            out: out.view(),
            tokens: tk.view(),
            wte: e.view(),
            wpe: p.view(),
            t,
            c,
        })
        .unwrap();
        assert_close(
            &format!("encoder_forward t={t} b={b} c={c}"),
            &get(dev, &out),
            &want,
        );
    }
}

#[test]
fn copy_rows_matches_cpu() {
    on_gpus!(copy_rows_matches_cpu_on);
}

/// BERT's gather of each sequence's first row and scatter back (strides t x
/// w and w), plus a wide row, copied and added, bit for bit.
fn copy_rows_matches_cpu_on<R: Runtime>(dev: &Queue<R>) {
    let mut rng = Rng::new(4);
    for (rows, w, dst_stride, src_stride) in [(3, 5, 5, 20), (3, 5, 20, 5), (2, 300, 301, 307)] {
        let (dn, sn) = ((rows - 1) * dst_stride + w, (rows - 1) * src_stride + w);
        let (init, src) = (randn(&mut rng, dn, 1.0), randn(&mut rng, sn, 1.0));
        for add in [false, true] {
            let mut want = init.clone();
            (CopyRows::<Host> {
                dst: &mut want,
                src: &src,
                rows,
                w,
                dst_stride,
                src_stride,
                add,
            })
            .cpu(&AsIs);
            let (d, s) = (putf(dev, &init), putf(dev, &src));
            let op = CopyRows {
                dst: d.view(),
                src: s.view(),
                rows,
                w,
                dst_stride,
                src_stride,
                add,
            };
            dev.run(op).unwrap();
            let what =
                format!("copy_rows {rows} x {w} at {dst_stride} from {src_stride}, add {add}");
            assert_eq!(get(dev, &d), want, "{what}");
        }
    }
}

#[test]
fn encoder_backward_matches_cpu_and_is_deterministic() {
    on_gpus!(encoder_backward_matches_cpu_and_is_deterministic_on);
}

fn encoder_backward_matches_cpu_and_is_deterministic_on<R: Runtime>(dev: &Queue<R>) {
    let mut rng = Rng::new(2);
    for (t, b, c, vocab) in encoder_shapes() {
        let toks = tokens(&mut rng, b * t, vocab);
        let dout = randn(&mut rng, b * t * c, 1.0);
        let dwte0 = randn(&mut rng, vocab * c, 1.0);
        let dwpe0 = randn(&mut rng, t * c, 1.0);
        let (mut dwte, mut dwpe) = (dwte0.clone(), dwpe0.clone());
        (EncoderBackward::<Host> {
            dwte: &mut dwte,
            dwpe: &mut dwpe,
            dout: &dout,
            tokens: &toks,
            host_tokens: &toks,
            t,
            c,
        })
        .cpu(&AsIs);
        let mut runs = Vec::new();
        for _ in 0..2 {
            let (e, p, d) = (putf(dev, &dwte0), putf(dev, &dwpe0), putf(dev, &dout));
            let tokens = putu(dev, &toks);
            dev.run(EncoderBackward {
                dwte: e.view(),
                dwpe: p.view(),
                dout: d.view(),
                tokens: tokens.view(),
                host_tokens: &toks,
                t,
                c,
            })
            .unwrap();
            runs.push((get(dev, &e), get(dev, &p)));
        }
        let what = format!("encoder_backward t={t} b={b} c={c}");
        assert_close(&format!("{what} dwte"), &runs[0].0, &dwte);
        assert_close(&format!("{what} dwpe"), &runs[0].1, &dwpe);
        assert_eq!(runs[0], runs[1], "{what}: two runs differ");
    }
}

/// (rows, c)
fn layernorm_shapes() -> Vec<(usize, usize)> {
    if tiny() {
        vec![(3, 5), (2, 1), (70, 3)]
    } else {
        vec![(1, 1), (5, 2), (3, 3), (300, 37), (67, 768), (130, 1)]
    }
}

#[test]
fn layernorm_forward_matches_cpu() {
    on_gpus!(layernorm_forward_matches_cpu_on);
}

fn layernorm_forward_matches_cpu_on<R: Runtime>(dev: &Queue<R>) {
    let mut rng = Rng::new(3);
    for (rows, c) in layernorm_shapes() {
        let x = randn(&mut rng, rows * c, 2.0);
        let w = randn(&mut rng, c, 1.0);
        let b = randn(&mut rng, c, 1.0);
        // GPT-2's eps, or BERT's on odd widths
        let eps = if c % 2 == 0 { 1e-5 } else { 1e-12 };
        let (out, mean, rstd) = layernorm::tests::forward_into_new(&x, (&w, &b), c, eps);
        let (o, m, r) = (
            putf(dev, &vec![0.0; rows * c]),
            putf(dev, &vec![0.0; rows]),
            putf(dev, &vec![0.0; rows]),
        );
        let (xd, wd, bd) = (putf(dev, &x), putf(dev, &w), putf(dev, &b));
        dev.run(LayerNormForward {
            out: Stored::F32(o.view()),
            mean: m.view(),
            rstd: r.view(),
            inp: xd.view(),
            w: wd.view(),
            b: bd.view(),
            c,
            eps,
        })
        .unwrap();
        let what = format!("layernorm_forward rows={rows} c={c} eps={eps}");
        assert_close(&format!("{what} out"), &get(dev, &o), &out);
        assert_close(&format!("{what} mean"), &get(dev, &m), &mean);
        // rstd is ~1/sigma; relative to itself, as the others are to max(1, |x|).
        let (got, want) = (get(dev, &r), rstd);
        let rel: Vec<f32> = got.iter().zip(&want).map(|(g, w)| g / w).collect();
        assert_close(&format!("{what} rstd/rstd_cpu"), &rel, &vec![1.0; rows]);
    }
}

#[test]
fn layernorm_backward_matches_cpu_and_is_deterministic() {
    on_gpus!(layernorm_backward_matches_cpu_and_is_deterministic_on);
}

fn layernorm_backward_matches_cpu_and_is_deterministic_on<R: Runtime>(dev: &Queue<R>) {
    let mut rng = Rng::new(4);
    let shapes = layernorm_shapes().into_iter();
    // dinp added to, and dinp overwritten (its old values never read)
    for ((rows, c), accumulate) in shapes.flat_map(|s| [(s, true), (s, false)]) {
        let x = randn(&mut rng, rows * c, 2.0);
        let w = randn(&mut rng, c, 1.0);
        let b = randn(&mut rng, c, 1.0);
        let dout = randn(&mut rng, rows * c, 1.0);
        let (dinp0, dw0, db0) = (
            randn(&mut rng, rows * c, 1.0),
            randn(&mut rng, c, 1.0),
            randn(&mut rng, c, 1.0),
        );
        let (_, mean, rstd) = layernorm::tests::forward_into_new(&x, (&w, &b), c, 1e-5);
        let (mut dinp, mut dw, mut db) = (dinp0.clone(), dw0.clone(), db0.clone());
        (LayerNormBackward::<Host> {
            dinp: Some(&mut dinp),
            dwb: Some((&mut dw, &mut db)),
            dout: &dout,
            inp: &x,
            w: &w,
            mean: &mean,
            rstd: &rstd,
            c,
            accumulate,
        })
        .cpu(&AsIs);
        let mut runs = Vec::new();
        for _ in 0..2 {
            let (di, dwd, dbd) = (putf(dev, &dinp0), putf(dev, &dw0), putf(dev, &db0));
            let (dd, xd, wd) = (putf(dev, &dout), putf(dev, &x), putf(dev, &w));
            let (md, rd) = (putf(dev, &mean), putf(dev, &rstd));
            dev.run(LayerNormBackward {
                dinp: Some(di.view()),
                dwb: Some((dwd.view(), dbd.view())),
                dout: dd.view(),
                inp: xd.view(),
                w: wd.view(),
                mean: md.view(),
                rstd: rd.view(),
                c,
                accumulate,
            })
            .unwrap();
            runs.push((get(dev, &di), get(dev, &dwd), get(dev, &dbd)));
        }
        // dinp = rstd (g - mean g - xhat mean(g xhat)) + dinp0, g = w dout.
        let mut mag = vec![0.0f32; rows * c];
        for r in 0..rows {
            let row = r * c..(r + 1) * c;
            let xhat = |i: usize| (x[r * c + i] - mean[r]) * rstd[r];
            let g = |i: usize| (w[i] * dout[r * c + i]).abs();
            let mean_g = (0..c).map(g).sum::<f32>() / c as f32;
            let mean_gx = (0..c).map(|i| g(i) * xhat(i).abs()).sum::<f32>() / c as f32;
            for (i, m) in mag[row].iter_mut().enumerate() {
                *m = rstd[r] * (g(i) + mean_g + xhat(i).abs() * mean_gx) + dinp0[r * c + i].abs();
            }
        }
        let what = format!("layernorm_backward rows={rows} c={c} accumulate={accumulate}");
        assert_close_sums(&format!("{what} dinp"), &runs[0].0, &dinp, &mag, c + 1);
        assert_close(&format!("{what} dw"), &runs[0].1, &dw);
        assert_close(&format!("{what} db"), &runs[0].2, &db);
        assert_eq!(runs[0], runs[1], "{what}: two runs differ");
    }
}

/// (rows, k, n)
fn matmul_shapes() -> Vec<(usize, usize, usize)> {
    if tiny() {
        vec![(3, 5, 7), (1, 1, 2)]
    } else {
        vec![
            (1, 1, 1),
            (5, 7, 9),
            (67, 33, 129),
            (300, 64, 3),
            (2, 257, 31),
        ]
    }
}

const LAYOUTS: [WeightLayout; 2] = [WeightLayout::InOut, WeightLayout::OutIn];

#[test]
fn matmul_forward_matches_cpu() {
    on_gpus!(matmul_forward_matches_cpu_on);
}

fn matmul_forward_matches_cpu_on<R: Runtime>(dev: &Queue<R>) {
    let mut rng = Rng::new(5);
    for (rows, k, n) in matmul_shapes() {
        for layout in LAYOUTS {
            // bf16: the products round the operands, on the CPU and the device
            // alike (inputs far from bf16 values, so a device that does not
            // round them is off by bf16's rounding, far over TOL).
            // A bias 4 floats into its buffer is 16-byte aligned, as cuBLASLt's
            // epilogue takes it on CUDA; 5 floats in, the pass before the
            // GEMM adds it (on OpenCL, both). A residual (3 floats into its
            // buffer) is cuBLASLt's C where it takes the bias, else copied
            // into out first: against the device's own copy and
            // accumulation (which the cases before it hold to the CPU's).
            for (with_bias, accumulate, bf16, bias_at, residual) in [
                (true, false, false, 4, false),
                (true, false, false, 5, false),
                (false, false, true, 4, false),
                (true, true, true, 4, false),
                (true, true, true, 5, false),
                (false, true, false, 4, false),
                (true, false, false, 4, true),
                (true, false, true, 4, true),
                (true, false, true, 5, true),
                (false, false, false, 4, true),
            ] {
                let (inp, w) = (randn(&mut rng, rows * k, 1.0), randn(&mut rng, k * n, 1.0));
                let bias = randn(&mut rng, n, 1.0);
                let out0 = randn(&mut rng, rows * n, 1.0);
                let mut want = out0.clone();
                let b = with_bias.then_some(&bias[..]);
                let shape = MatmulShape::new((rows, k, n), layout).with_bf16(bf16);
                (MatmulForward::<Host> {
                    out: Stored::F32(&mut want),
                    inp: Stored::F32(&inp),
                    w: Stored::F32(&w),
                    bias: b,
                    residual: None,
                    shape,
                    accumulate,
                })
                .cpu(&AsIs);
                let (o, i, wd, bd) = (
                    putf(dev, &out0),
                    putf(dev, &inp),
                    putf(dev, &w),
                    put_at(dev, &bias, -1000.0, bias_at),
                );
                let res = put_at(dev, &out0[..], -1000.0, 3);
                let bv = with_bias.then(|| bd.view());
                let op = |out, residual, accumulate| MatmulForward {
                    out: Stored::F32(out),
                    inp: Stored::F32(i.view()),
                    w: Stored::F32(wd.view()),
                    bias: bv,
                    residual,
                    shape,
                    accumulate,
                };
                if residual {
                    // o's values never read: the product onto the residual
                    // (out0 too) into garbage
                    let onto = putf(dev, &vec![f32::NAN; rows * n]);
                    dev.run(op(onto.view(), Some(res.view()), false)).unwrap();
                    dev.run(op(o.view(), None, true)).unwrap();
                    want = get(dev, &o);
                    dev.pointwise("copy", o.view(), onto.view()).unwrap();
                } else {
                    dev.run(op(o.view(), None, accumulate)).unwrap();
                }
                let what = format!(
                    "matmul_forward {layout:?} rows={rows} k={k} n={n} bias={with_bias} at \
                     {bias_at} acc={accumulate} bf16={bf16} residual={residual}"
                );
                assert_close(&what, &get(dev, &o), &want);
            }
        }
    }
}

/// A product into bf16 with a bias (q|k|v's under `--precision bf16`):
/// each sum plus the bias rounded to bf16, rounded once, as the CPU's
/// (the order of the sums apart: within a bf16 ulp, or 1e-4 near 0); a bias 4 and 5
/// floats into its buffer (on CUDA cuBLASLt's epilogue takes either,
/// rounded into its scratch first; elsewhere the pass). Its name begins as
/// `matmul_forward_matches_cpu`'s: gpu_check.sh's step 1 turns the later
/// steps to the pass where either fails.
#[test]
fn matmul_forward_into_bf16_with_a_bias_matches_cpu() {
    on_gpus!(matmul_forward_into_bf16_with_a_bias_matches_cpu_on);
}

fn matmul_forward_into_bf16_with_a_bias_matches_cpu_on<R: Runtime>(dev: &Queue<R>) {
    let mut rng = Rng::new(13);
    for (rows, k, n) in matmul_shapes() {
        for layout in LAYOUTS {
            let shape = MatmulShape::new((rows, k, n), layout).with_bf16(true);
            let (inp, w) = (randn(&mut rng, rows * k, 1.0), randn(&mut rng, k * n, 1.0));
            let bias = randn(&mut rng, n, 1.0);
            let mut want = vec![Bf16::default(); rows * n];
            (MatmulForward::<Host> {
                out: Stored::Bf16(&mut want),
                inp: Stored::F32(&inp),
                w: Stored::F32(&w),
                bias: Some(&bias),
                residual: None,
                shape,
                accumulate: false,
            })
            .cpu(&AsIs);
            let (i, wd) = (putf(dev, &inp), putf(dev, &w));
            let held = put_aligned(dev, &vec![Bf16::default(); rows * n]);
            for at in [4, 5] {
                let bd = put_at(dev, &bias, -1000.0, at);
                dev.run(MatmulForward {
                    out: Stored::Bf16(held.view()),
                    inp: Stored::F32(i.view()),
                    w: Stored::F32(wd.view()),
                    bias: Some(bd.view()),
                    residual: None,
                    shape,
                    accumulate: false,
                })
                .unwrap();
                let got = get(dev, &held);
                // a bf16 ulp, and the sums' fp32 rounding near 0
                let apart = got.iter().zip(&want).filter(|(g, w)| {
                    let (g, w) = (g.to_f32(), w.to_f32());
                    (g - w).abs() > g.abs().max(w.abs()) / 128.0 + 1e-4
                });
                let what = format!("{layout:?} rows={rows} k={k} n={n}, a bias {at} in");
                assert_eq!(apart.count(), 0, "{what}: beyond a bf16 ulp of the CPU's");
            }
        }
    }
}

#[test]
fn matmul_backward_matches_cpu() {
    on_gpus!(matmul_backward_matches_cpu_on);
}

fn matmul_backward_matches_cpu_on<R: Runtime>(dev: &Queue<R>) {
    let mut rng = Rng::new(6);
    for (rows, k, n) in matmul_shapes() {
        for layout in LAYOUTS {
            for (with_bias, bf16) in [(true, false), (false, false), (true, true)] {
                // bf16 as in matmul_forward_matches_cpu; the bias gradient, a
                // sum, from the fp32 output gradient
                let inp = randn(&mut rng, rows * k, 1.0);
                let w = randn(&mut rng, k * n, 1.0);
                let dout = randn(&mut rng, rows * n, 1.0);
                let dw0 = randn(&mut rng, k * n, 1.0);
                let db0 = randn(&mut rng, n, 1.0);
                // dinp is overwritten: start from something else.
                let (mut dinp, mut dw, mut db) = (vec![0.0; rows * k], dw0.clone(), db0.clone());
                let dbias = with_bias.then_some(&mut db[..]);
                (MatmulBackward::<Host> {
                    dinp: Some(&mut dinp),
                    dw: Some(&mut dw),
                    dbias,
                    dout: Stored::F32(&dout),
                    inp: Stored::F32(&inp),
                    w: Stored::F32(&w),
                    shape: MatmulShape::new((rows, k, n), layout).with_bf16(bf16),
                })
                .cpu(&AsIs);
                // The sums' magnitudes: the same products of absolute values.
                let abs = |v: &[f32]| v.iter().map(|x| x.abs()).collect::<Vec<f32>>();
                let (mut mag_di, mut mag_dw, mut mag_db) =
                    (vec![0.0; rows * k], abs(&dw0), abs(&db0));
                (MatmulBackward::<Host> {
                    dinp: Some(&mut mag_di),
                    dw: Some(&mut mag_dw),
                    dbias: Some(&mut mag_db),
                    dout: Stored::F32(&abs(&dout)),
                    inp: Stored::F32(&abs(&inp)),
                    w: Stored::F32(&abs(&w)),
                    shape: MatmulShape::new((rows, k, n), layout),
                })
                .cpu(&AsIs);
                let terms = rows.max(k).max(n) + 1;
                let di = putf(dev, &vec![9.0; rows * k]);
                // dout's view longer than rows x n, as a slice of a larger
                // buffer: only its first rows x n are read (NaN past them)
                let dout_longer = [&dout[..], &[f32::NAN; 3]].concat();
                let (dwd, dbd, dd) = (putf(dev, &dw0), putf(dev, &db0), putf(dev, &dout_longer));
                let (i, wd) = (putf(dev, &inp), putf(dev, &w));
                let bv = with_bias.then(|| dbd.view());
                dev.run(MatmulBackward {
                    dinp: Some(di.view()),
                    dw: Some(dwd.view()),
                    dbias: bv,
                    dout: Stored::F32(dd.view()),
                    inp: Stored::F32(i.view()),
                    w: Stored::F32(wd.view()),
                    shape: MatmulShape::new((rows, k, n), layout).with_bf16(bf16),
                })
                .unwrap();
                let what = format!(
                    "matmul_backward {layout:?} rows={rows} k={k} n={n} bias={with_bias} bf16={bf16}"
                );
                let sums = |part: &str, got: &[f32], want: &[f32], mag: &[f32]| {
                    assert_close_sums(&format!("{what} {part}"), got, want, mag, terms);
                };
                sums("dinp", &get(dev, &di), &dinp, &mag_di);
                sums("dw", &get(dev, &dwd), &dw, &mag_dw);
                sums("dbias", &get(dev, &dbd), &db, &mag_db);
            }
        }
    }
}

#[test]
fn fused_bias_gradients_match_cpu() {
    on_gpus!(fused_bias_gradients_match_cpu_on);
}

/// An activation's backward with the bias gradient in the same pass (with
/// and without the bias itself, added to the input first): d as the CPU
/// leaves it, and dbias (added onto a start) within the rounding of its
/// sums, over rows that end inside a chunk and on a chunk's edge.
fn fused_bias_gradients_match_cpu_on<R: Runtime>(dev: &Queue<R>) {
    let mut rng = Rng::new(9);
    let chunk = crate::backend::COLUMN_CHUNK_ROWS;
    for (rows, n) in [(1, 1), (3, 5), (chunk, 3), (2 * chunk + 5, 7)] {
        for (act, biased) in [Activation::GeluTanh, Activation::GeluErf, Activation::Tanh]
            .into_iter()
            .flat_map(|a| [(a, false), (a, true)])
        {
            let x = randn(&mut rng, rows * n, 2.0);
            let d0 = randn(&mut rng, rows * n, 1.0);
            let db0 = randn(&mut rng, n, 1.0);
            let bias = randn(&mut rng, n, 1.0);
            let b = biased.then_some(&bias[..]);
            let (mut want, mut want_db) = (d0.clone(), db0.clone());
            (ActivationBackward::<Host> {
                d: &mut want,
                inp: Stored::F32(&x),
                bias: b,
                act,
                dbias: Some(&mut want_db),
                rounded: None,
            })
            .cpu(&AsIs);
            let (d, xd, db) = (putf(dev, &d0), putf(dev, &x), putf(dev, &db0));
            let bd = putf(dev, &bias);
            dev.run(ActivationBackward {
                d: d.view(),
                inp: Stored::F32(xd.view()),
                bias: biased.then(|| bd.view()),
                act,
                dbias: Some(db.view()),
                rounded: None,
            })
            .unwrap();
            let what = format!("{act:?} rows={rows} n={n} bias={biased}");
            assert_close(&format!("{what} d"), &get(dev, &d), &want);
            let mut mag: Vec<f32> = db0.iter().map(|v| v.abs()).collect();
            for row in want.chunks_exact(n) {
                mag.iter_mut().zip(row).for_each(|(m, v)| *m += v.abs());
            }
            assert_close_sums(
                &format!("{what} dbias"),
                &get(dev, &db),
                &want_db,
                &mag,
                rows + 1,
            );
        }
    }
}

fn pointwise_sizes() -> Vec<usize> {
    if tiny() {
        vec![1, 300]
    } else {
        vec![1, 2, 3, 1000, 4099]
    }
}

/// A backward given `rounded` writes there, bit for bit, the device's own
/// in-place result rounded, leaves d as it was and sums the same bias
/// gradient: the elementwise kernel (no gradient) and the bias pass's.
#[test]
fn a_rounded_activation_backward_is_the_in_place_one_rounded_on_the_device() {
    on_gpus!(a_rounded_activation_backward_is_the_in_place_one_rounded_on);
}

fn a_rounded_activation_backward_is_the_in_place_one_rounded_on<R: Runtime>(dev: &Queue<R>) {
    let mut rng = Rng::new(29);
    let (rows, n) = if tiny() {
        (3, 5)
    } else {
        (2 * crate::backend::COLUMN_CHUNK_ROWS + 3, 96)
    };
    let (x, b) = (randn(&mut rng, rows * n, 2.0), randn(&mut rng, n, 1.0));
    let d0 = randn(&mut rng, rows * n, 1.0);
    let (xd, bd) = (putf(dev, &x), putf(dev, &b));
    for grad in [false, true] {
        let run = |rounded: bool| {
            let (d, db) = (putf(dev, &d0), putf(dev, &vec![0.5; n]));
            let held = put(dev, &vec![Bf16::default(); rows * n], Bf16::from_f32(-9.0));
            dev.run(ActivationBackward {
                d: d.view(),
                inp: Stored::F32(xd.view()),
                bias: Some(bd.view()),
                act: Activation::GeluTanh,
                dbias: grad.then(|| db.view()),
                rounded: rounded.then(|| held.view()),
            })
            .unwrap();
            (get(dev, &d), get(dev, &db), get(dev, &held))
        };
        let (want, want_db, _) = run(false);
        let (d, db, held) = run(true);
        let rounded: Vec<Bf16> = want.iter().map(|&v| Bf16::from_f32(v)).collect();
        assert!(d == d0, "grad {grad}: d was written");
        assert!(held == rounded, "grad {grad}: rounded");
        assert!(db == want_db, "grad {grad}: the bias gradient");
    }
}

#[test]
fn pointwise_kernels_match_cpu() {
    on_gpus!(pointwise_kernels_match_cpu_on);
}

fn pointwise_kernels_match_cpu_on<R: Runtime>(dev: &Queue<R>) {
    let mut rng = Rng::new(7);
    for n in pointwise_sizes() {
        let x = randn(&mut rng, n, 3.0);
        let d0 = randn(&mut rng, n, 1.0);
        let xd = putf(dev, &x);
        // a bias: rows of a width that divides n (1 where n is prime)
        let cols = (2..=7).rev().find(|c| n % c == 0).unwrap_or(1);
        let bias = randn(&mut rng, cols, 1.0);
        let bd = putf(dev, &bias);
        for act in [Activation::GeluTanh, Activation::GeluErf, Activation::Tanh] {
            for (b, bv) in [(None, None), (Some(&bias[..]), Some(bd.view()))] {
                let at = format!("{act:?} n={n} bias={:?}", b.map(<[f32]>::len));
                let mut want = vec![0.0; n];
                (ActivationForward::<Host> {
                    out: Stored::F32(&mut want),
                    inp: Stored::F32(&x),
                    bias: b,
                    act,
                })
                .cpu(&AsIs);
                let o = putf(dev, &vec![0.0; n]);
                dev.run(ActivationForward {
                    out: Stored::F32(o.view()),
                    inp: Stored::F32(xd.view()),
                    bias: bv,
                    act,
                })
                .unwrap();
                assert_close(&format!("{at} forward"), &get(dev, &o), &want);

                let mut want = d0.clone();
                (ActivationBackward::<Host> {
                    d: &mut want,
                    inp: Stored::F32(&x),
                    bias: b,
                    act,
                    dbias: None,
                    rounded: None,
                })
                .cpu(&AsIs);
                // an empty bias gradient is none
                let empty = bd.view().part(0..0);
                for dbias in [None, Some(empty)] {
                    let d = putf(dev, &d0);
                    dev.run(ActivationBackward {
                        d: d.view(),
                        inp: Stored::F32(xd.view()),
                        bias: bv,
                        act,
                        dbias,
                        rounded: None,
                    })
                    .unwrap();
                    let at = format!("{at} backward, dbias {:?}", dbias.map(|v| v.len));
                    assert_close(&at, &get(dev, &d), &want);
                }
            }
        }
        if n > 1 {
            activation_refusals_on(dev, n, &xd, &bd);
        }

        let c = putf(dev, &vec![0.0; n]);
        dev.pointwise("copy", c.view(), xd.view()).unwrap();
        assert_eq!(get(dev, &c), x, "copy n={n}");

        dev.fill(c.view(), -2.5).unwrap();
        assert_eq!(get(dev, &c), vec![-2.5; n], "fill n={n}");

        let a = putf(dev, &d0);
        dev.pointwise("add_inplace", a.view(), xd.view()).unwrap();
        let want: Vec<f32> = d0.iter().zip(&x).map(|(a, b)| a + b).collect();
        assert_eq!(get(dev, &a), want, "add_inplace n={n}");
    }
}

/// The activation kernels refuse a bias whose rows cannot hold the `n`
/// elements of `x` and a bias gradient of another width than `bias`.
fn activation_refusals_on<R: Runtime>(
    dev: &Queue<R>,
    n: usize,
    x: &Tensor<R, f32>,
    bias: &Tensor<R, f32>,
) {
    // a bias whose rows cannot hold the n elements
    let wide = putf(dev, &vec![0.0; n + 1]);
    let op = |bias| ActivationForward {
        out: Stored::F32(x.view()),
        inp: Stored::F32(x.view()),
        bias: Some(bias),
        act: Activation::Tanh,
    };
    let err = dev.run(op(wide.view())).unwrap_err();
    assert!(err.0.contains("in rows of"), "n={n}: {err:?}");
    // a bias gradient of another width than the bias
    let err = dev
        .run(ActivationBackward {
            d: x.view(),
            inp: Stored::F32(x.view()),
            bias: Some(bias.view()),
            act: Activation::Tanh,
            dbias: Some(View {
                len: bias.view().len + 1,
                ..wide.view()
            }),
            rounded: None,
        })
        .unwrap_err();
    assert!(err.0.contains("and its gradient"), "n={n}: {err:?}");
}

/// `round_bf16` gives the CPU's bits: ties (to even, both ways), a carry
/// into the exponent, the largest finite values, infinities, NaN,
/// subnormals and zeros, then random values; in place and into another
/// buffer at offsets.
#[test]
fn round_bf16_matches_cpu_bit_for_bit() {
    on_gpus!(round_bf16_matches_cpu_bit_for_bit_on);
}

fn round_bf16_matches_cpu_bit_for_bit_on<R: Runtime>(dev: &Queue<R>) {
    let mut rng = Rng::new(7);
    let mut x = vec![
        f32::from_bits(0x3f80_8000),
        f32::from_bits(0x3f81_8000),
        f32::from_bits(0x3fff_ffff),
        f32::MAX,
        -f32::MAX,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::from_bits(0x0000_8001),
        -0.0,
        0.0,
    ];
    x.extend(randn(&mut rng, 1000, 50.0));
    let mut want = x.clone();
    elementwise::round_bf16(&mut want);
    assert_eq!(
        want[..3],
        [1.0, f32::from_bits(0x3f82_0000), 2.0],
        "ties to even, carry"
    );
    let t = putf(dev, &x);
    dev.pointwise("round_bf16", t.view(), t.view()).unwrap();
    let got = get(dev, &t);
    assert!(
        got.iter().zip(&x).any(|(g, x)| g != x),
        "rounding changed nothing"
    );
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&got), bits(&want), "round_bf16 in place, bit for bit");
    // into another buffer, at offsets, its source left as it was
    let (src, dst) = (
        putf(dev, &[&[7.0], &x[..]].concat()),
        putf(dev, &vec![0.0; x.len() + 2]),
    );
    let at = |v: View, off: usize| v.part(off..off + x.len());
    let (from, to) = (at(src.view(), 1), at(dst.view(), 2));
    dev.pointwise("round_bf16", to, from).unwrap();
    assert_eq!(
        bits(&get(dev, &dst)[2..]),
        bits(&want),
        "round_bf16 into dst, bit for bit"
    );
    assert_eq!(
        bits(&get(dev, &src)[1..]),
        bits(&x),
        "round_bf16 left its source"
    );
    let n = putf(dev, &[f32::NAN]);
    dev.pointwise("round_bf16", n.view(), n.view()).unwrap();
    assert!(get(dev, &n)[0].is_nan(), "NaN stays NaN");
}

/// (rows, v, vp)
fn crossentropy_shapes() -> Vec<(usize, usize, usize)> {
    if tiny() {
        vec![(3, 11, 16), (2, 300, 320)]
    } else {
        vec![
            (5, 50257, 50304),
            (3, 11, 16),
            (2, 1, 1),
            (7, 1000, 1000),
            (4, 257, 300),
        ]
    }
}

#[test]
fn crossentropy_matches_cpu() {
    on_gpus!(crossentropy_matches_cpu_on);
}

fn crossentropy_matches_cpu_on<R: Runtime>(dev: &Queue<R>) {
    let mut rng = Rng::new(8);
    for (rows, v, vp) in crossentropy_shapes() {
        let logits = randn(&mut rng, rows * vp, 3.0);
        let mut targets = tokens(&mut rng, rows, v);
        targets[0] = (v - 1) as u32; // the last real column
        if rows > 2 {
            targets[rows / 2] = crate::data::IGNORE; // no loss, no gradient
        }
        let mut losses = vec![0.0; rows];
        (CrossEntropyForward::<Host> {
            losses: &mut losses,
            logits: Stored::F32(&logits),
            targets: &targets,
            v,
            vp,
        })
        .cpu(&AsIs);
        let (l, lg, tg) = (
            putf(dev, &vec![0.0; rows]),
            putf(dev, &logits),
            putu(dev, &targets),
        );
        dev.run(CrossEntropyForward {
            losses: l.view(),
            logits: Stored::F32(lg.view()),
            targets: tg.view(),
            v,
            vp,
        })
        .unwrap();
        let what = format!("crossentropy rows={rows} v={v} vp={vp}");
        assert_close(&format!("{what} losses"), &get(dev, &l), &losses);

        let dloss = 1.0 / rows as f32;
        let mut want = logits.clone();
        (CrossEntropyBackward::<Host> {
            logits: Stored::F32(&mut want),
            targets: &targets,
            v,
            vp,
            dloss,
        })
        .cpu(&AsIs);
        dev.run(CrossEntropyBackward {
            logits: Stored::F32(lg.view()),
            targets: tg.view(),
            v,
            vp,
            dloss,
        })
        .unwrap();
        let got = get(dev, &lg);
        assert_close(&format!("{what} dlogits"), &got, &want);
        assert!(got.chunks(vp).all(|r| r[v..].iter().all(|&x| x == 0.0)));
    }
}

/// Tensors held in bf16 (the LM head's logits and their gradient under
/// `--precision bf16`) on the device: a GEMM's bf16 output is its fp32
/// output rounded, a bf16 output gradient gives what its values held in
/// fp32 give, and cross-entropy reads bf16 logits as their fp32 values and
/// stores its gradient rounded, each bit for bit (the kernels' own fp32
/// results match the CPU's in the tests above).
#[test]
fn bf16_storage_is_its_fp32_values_on_the_device() {
    on_gpus!(bf16_storage_is_its_fp32_values_on);
}

fn bf16_storage_is_its_fp32_values_on<R: Runtime>(dev: &Queue<R>) {
    let mut rng = Rng::new(12);
    let putb = |x: &[Bf16]| put_aligned(dev, x);
    let shapes = if tiny() {
        vec![(3, 8, 11, 16)]
    } else {
        vec![(3, 8, 11, 16), (9, 64, 1000, 1024)]
    };
    for (rows, k, v, vp) in shapes {
        let what = format!("rows={rows} k={k} vp={vp}");
        let shape = MatmulShape::new((rows, k, vp), WeightLayout::OutIn).with_bf16(true);
        let (i, w) = (
            putf(dev, &randn(&mut rng, rows * k, 1.0)),
            putf(dev, &randn(&mut rng, vp * k, 1.0)),
        );
        let (fp32, held) = (
            putf(dev, &vec![0.0; rows * vp]),
            putb(&vec![Bf16::default(); rows * vp]),
        );
        for out in [Stored::F32(fp32.view()), Stored::Bf16(held.view())] {
            dev.run(MatmulForward {
                out,
                inp: Stored::F32(i.view()),
                w: Stored::F32(w.view()),
                bias: None,
                residual: None,
                shape,
                accumulate: false,
            })
            .unwrap();
        }
        let logits = get(dev, &held);
        let rounded: Vec<Bf16> = get(dev, &fp32).into_iter().map(Bf16::from_f32).collect();
        assert!(
            logits == rounded,
            "{what}: the bf16 product is not the fp32 one rounded"
        );

        let dlogits = bf16_logits_on(dev, &what, &logits, &mut rng, v, vp);
        let wide: Vec<f32> = dlogits.iter().map(|x| x.to_f32()).collect();
        // the fp32 one a row longer than the products read: its tail unread
        let long: Vec<f32> = wide.iter().copied().chain(vec![7.0; vp]).collect();
        let (df, db) = (putf(dev, &long), putb(&dlogits));
        let (dw0, dbias0) = (randn(&mut rng, vp * k, 1.0), randn(&mut rng, vp, 1.0));
        let mut grads = Vec::new();
        for dout in [Stored::F32(df.view()), Stored::Bf16(db.view())] {
            let (di, dw) = (putf(dev, &vec![9.0; rows * k]), putf(dev, &dw0));
            let dbias = putf(dev, &dbias0);
            let op = MatmulBackward {
                dinp: Some(di.view()),
                dw: Some(dw.view()),
                dbias: Some(dbias.view()),
                dout,
                inp: Stored::F32(i.view()),
                w: Stored::F32(w.view()),
                shape,
            };
            dev.run(op).unwrap();
            grads.push([get(dev, &di), get(dev, &dw), get(dev, &dbias)]);
        }
        assert!(grads[0][2] != dbias0, "{what}: no bias gradient");
        for (i, grad) in ["dinp", "dw", "dbias"].iter().enumerate() {
            let (a, b) = (&grads[0][i], &grads[1][i]);
            assert!(
                a == b,
                "{what}: {grad} of a bf16 output gradient: {}",
                differ(a, b)
            );
        }
    }
}

/// The cross-entropy over `logits` (rows, vp) held in bf16 against the same
/// values in fp32: the same losses, and a gradient that is the fp32 one
/// rounded, which it returns.
fn bf16_logits_on<R: Runtime>(
    dev: &Queue<R>,
    what: &str,
    logits: &[Bf16],
    rng: &mut Rng,
    v: usize,
    vp: usize,
) -> Vec<Bf16> {
    let putb = |x: &[Bf16]| put(dev, x, Bf16::from_f32(-999.0 - next_guard() as f32));
    let rows = logits.len() / vp;
    let wide: Vec<f32> = logits.iter().map(|x| x.to_f32()).collect();
    let mut targets = tokens(rng, rows, v);
    targets[1] = crate::data::IGNORE;
    let tg = putu(dev, &targets);
    let (lf, lb) = (putf(dev, &vec![0.0; rows]), putf(dev, &vec![0.0; rows]));
    let (wf, hb) = (putf(dev, &wide), putb(logits));
    for (losses, logits) in [
        (&lf, Stored::F32(wf.view())),
        (&lb, Stored::Bf16(hb.view())),
    ] {
        let op = CrossEntropyForward {
            losses: losses.view(),
            logits,
            targets: tg.view(),
            v,
            vp,
        };
        dev.run(op).unwrap();
    }
    assert!(
        get(dev, &lf) == get(dev, &lb),
        "{what}: losses of bf16 logits"
    );
    for logits in [Stored::F32(wf.view()), Stored::Bf16(hb.view())] {
        let op = CrossEntropyBackward {
            logits,
            targets: tg.view(),
            v,
            vp,
            dloss: 0.25,
        };
        dev.run(op).unwrap();
    }
    let dlogits = get(dev, &hb);
    let rounded: Vec<Bf16> = get(dev, &wf).into_iter().map(Bf16::from_f32).collect();
    assert!(
        dlogits == rounded,
        "{what}: the bf16 gradient is not the fp32 one rounded"
    );

    dlogits
}

/// An activation stored in bf16 (GPT-2's GELU output under `--precision
/// bf16`) on the device: the fp32 activation rounded, and a product reading
/// it as its input gives, forward (with a bias, added to) and as dw's
/// input, what its values held in fp32 give, each bit for bit.
#[test]
fn a_bf16_activation_and_the_product_reading_it_on_the_device() {
    on_gpus!(a_bf16_activation_and_the_product_reading_it_on);
}

fn a_bf16_activation_and_the_product_reading_it_on<R: Runtime>(dev: &Queue<R>) {
    let mut rng = Rng::new(14);
    let putb = |x: &[Bf16]| put_aligned(dev, x);
    for (rows, k, n) in [(3, 8, 5), (9, 96, 40)] {
        let what = format!("rows={rows} k={k} n={n}");
        let (x, b) = (
            putf(dev, &randn(&mut rng, rows * k, 2.0)),
            putf(dev, &randn(&mut rng, k, 1.0)),
        );
        let (fp32, held) = (
            putf(dev, &vec![0.0; rows * k]),
            putb(&vec![Bf16::default(); rows * k]),
        );
        for out in [Stored::F32(fp32.view()), Stored::Bf16(held.view())] {
            let op = ActivationForward {
                out,
                inp: Stored::F32(x.view()),
                bias: Some(b.view()),
                act: Activation::GeluTanh,
            };
            dev.run(op).unwrap();
        }
        let gelu = get(dev, &held);
        let rounded: Vec<Bf16> = get(dev, &fp32).into_iter().map(Bf16::from_f32).collect();
        assert!(
            gelu == rounded,
            "{what}: the bf16 activation is not the fp32 one rounded"
        );

        let wide = putf(dev, &gelu.iter().map(|x| x.to_f32()).collect::<Vec<_>>());
        let shape = MatmulShape::new((rows, k, n), WeightLayout::InOut).with_bf16(true);
        let (w, bias) = (
            putf(dev, &randn(&mut rng, k * n, 1.0)),
            putf(dev, &randn(&mut rng, n, 1.0)),
        );
        let (out0, dout) = (
            randn(&mut rng, rows * n, 1.0),
            putf(dev, &randn(&mut rng, rows * n, 1.0)),
        );
        let dw0 = randn(&mut rng, k * n, 1.0);
        let mut runs = Vec::new();
        // a bf16 input takes bf16 products even where the shape asks fp32's
        let inputs = [
            (Stored::F32(wide.view()), shape),
            (Stored::Bf16(held.view()), shape),
            (Stored::Bf16(held.view()), shape.with_bf16(false)),
        ];
        for (inp, shape) in inputs {
            let out = putf(dev, &out0);
            let (bias, w) = (Some(bias.view()), w.view());
            let op = MatmulForward {
                out: Stored::F32(out.view()),
                inp,
                w: Stored::F32(w),
                bias,
                residual: None,
                shape,
                accumulate: true,
            };
            dev.run(op).unwrap();
            let dw = putf(dev, &dw0);
            let op = MatmulBackward {
                dinp: None,
                dw: Some(dw.view()),
                dbias: None,
                dout: Stored::F32(dout.view()),
                inp,
                w: Stored::F32(w),
                shape,
            };
            dev.run(op).unwrap();
            runs.push((get(dev, &out), get(dev, &dw)));
        }
        for (i, run) in runs.iter().enumerate().skip(1) {
            let (out, dw) = (differ(&runs[0].0, &run.0), differ(&runs[0].1, &run.1));
            assert!(
                runs[0].0 == run.0,
                "{what}: a bf16 input's product ({i}): {out}"
            );
            assert!(runs[0].1 == run.1, "{what}: a bf16 input's dw ({i}): {dw}");
        }
    }
}

/// An activation's input stored in bf16 gives what its values held in
/// fp32 give, bit for bit: forward into fp32 and bf16, the backward alone
/// and with the bias gradient in its pass (guard cells around each buffer).
#[test]
fn a_bf16_activation_input_is_its_fp32_values_on_the_device() {
    on_gpus!(a_bf16_activation_input_is_its_fp32_values_on);
}

fn a_bf16_activation_input_is_its_fp32_values_on<R: Runtime>(dev: &Queue<R>) {
    let mut rng = Rng::new(16);
    let (rows, n) = (7, 40);
    let held: Vec<Bf16> = randn(&mut rng, rows * n, 2.0)
        .into_iter()
        .map(Bf16::from_f32)
        .collect();
    let wide: Vec<f32> = held.iter().map(|x| x.to_f32()).collect();
    let (xb, xf) = (put(dev, &held, Bf16::from_f32(-999.0)), putf(dev, &wide));
    let (b, d0) = (
        putf(dev, &randn(&mut rng, n, 1.0)),
        randn(&mut rng, rows * n, 1.0),
    );
    for with_db in [false, true] {
        let runs = [Stored::F32(xf.view()), Stored::Bf16(xb.view())].map(|inp| {
            let fp32 = putf(dev, &vec![0.0; rows * n]);
            let bf16 = put(dev, &vec![Bf16::default(); rows * n], Bf16::from_f32(-7.0));
            for out in [Stored::F32(fp32.view()), Stored::Bf16(bf16.view())] {
                let act = Activation::GeluTanh;
                let bias = Some(b.view());
                dev.run(ActivationForward {
                    out,
                    inp,
                    bias,
                    act,
                })
                .unwrap();
            }
            let (d, db) = (putf(dev, &d0), putf(dev, &vec![0.5; n]));
            dev.run(ActivationBackward {
                d: d.view(),
                inp,
                bias: Some(b.view()),
                act: Activation::GeluTanh,
                dbias: with_db.then(|| db.view()),
                rounded: None,
            })
            .unwrap();
            (
                get(dev, &fp32),
                get(dev, &bf16),
                get(dev, &d),
                get(dev, &db),
            )
        });
        // the backward acted (and the bias gradient was summed where asked)
        assert!(runs[0].2 != d0, "backward left d as it was");
        assert!(
            runs[0].3.iter().all(|&g| g != 0.5) == with_db,
            "bias gradient, dbias {with_db}"
        );
        assert!(runs[0].0 == runs[1].0, "forward");
        assert!(runs[0].1 == runs[1].1, "forward into bf16");
        assert!(runs[0].2 == runs[1].2, "backward, dbias {with_db}");
        assert!(runs[0].3 == runs[1].3, "bias gradient, dbias {with_db}");
    }
}

/// A LayerNorm stored in bf16 is the fp32 one rounded, its statistics
/// the same, on rows of even and odd widths at odd offsets (guard cells
/// around each buffer).
#[test]
fn a_bf16_norm_is_its_fp32_norm_rounded_on_the_device() {
    on_gpus!(a_bf16_norm_is_its_fp32_norm_rounded_on);
}

fn a_bf16_norm_is_its_fp32_norm_rounded_on<R: Runtime>(dev: &Queue<R>) {
    let mut rng = Rng::new(15);
    for (rows, c) in [(3, 96), (5, 37), (2, 768)] {
        let x = putf(dev, &randn(&mut rng, rows * c, 2.0));
        let (w, b) = (
            putf(dev, &randn(&mut rng, c, 1.0)),
            putf(dev, &randn(&mut rng, c, 1.0)),
        );
        let fp32 = putf(dev, &vec![0.0; rows * c]);
        let held = put(
            dev,
            &vec![Bf16::default(); rows * c],
            Bf16::from_f32(-999.0),
        );
        let mut stats = Vec::new();
        for out in [Stored::F32(fp32.view()), Stored::Bf16(held.view())] {
            let (mean, rstd) = (putf(dev, &vec![0.0; rows]), putf(dev, &vec![0.0; rows]));
            let op = LayerNormForward {
                out,
                mean: mean.view(),
                rstd: rstd.view(),
                inp: x.view(),
                w: w.view(),
                b: b.view(),
                c,
                eps: 1e-5,
            };
            dev.run(op).unwrap();
            stats.push((get(dev, &mean), get(dev, &rstd)));
        }
        let rounded: Vec<Bf16> = get(dev, &fp32).into_iter().map(Bf16::from_f32).collect();
        assert!(get(dev, &held) == rounded, "rows={rows} c={c}: bf16 norm");
        assert!(stats[0] == stats[1], "rows={rows} c={c}: statistics");
    }
}

/// A batch of products stored in bf16 (two 2 x 3 outputs 8 apart): each
/// the fp32 batch's sums rounded, the elements between them untouched.
#[test]
fn a_batch_of_bf16_products_is_its_fp32_batch_rounded() {
    on_gpus!(a_batch_of_bf16_products_is_its_fp32_batch_rounded_on);
}

fn a_batch_of_bf16_products_is_its_fp32_batch_rounded_on<R: Runtime>(dev: &Queue<R>) {
    let mut rng = Rng::new(13);
    let (a, b) = (randn(&mut rng, 2 * 8, 1.0), randn(&mut rng, 2 * 12, 1.0));
    let (a, b) = (putf(dev, &a), putf(dev, &b));
    let guard = Bf16::from_f32(-7.0);
    let (fp32, held) = (
        putf(dev, &[0.0; 16]),
        put(dev, &[guard; 16], Bf16::from_f32(-9.0)),
    );
    for (c, c_bf16) in [(fp32.view(), false), (held.view(), true)] {
        let ab = [
            super::operand(a.view(), false, 2),
            super::operand(b.view(), false, 4),
        ];
        dev.gemm(super::Gemm {
            c_bf16,
            batch: super::Batch::of(2, [8, 12, 8]),
            ..super::Gemm::new([2, 3, 4], ab, c, 2, true)
        })
        .unwrap();
    }
    let (want, got) = (get(dev, &fp32), get(dev, &held));
    for (i, (&w, &g)) in want.iter().zip(&got).enumerate() {
        let expect = if i % 8 < 6 { Bf16::from_f32(w) } else { guard };
        assert_eq!(g, expect, "element {i}");
    }
}

/// A GEMM's bias: with no products (k = 0) c is beta c + bias, by the
/// pass on every device (cuBLASLt is never asked for an empty product);
/// across a batch, or into a c with rows between its columns, refused.
#[test]
fn a_gemm_bias_without_products_is_added_and_across_a_batch_refused() {
    on_gpus!(a_gemm_bias_without_products_is_added_and_across_a_batch_refused_on);
}

fn a_gemm_bias_without_products_is_added_and_across_a_batch_refused_on<R: Runtime>(dev: &Queue<R>) {
    let (x, bias) = (putf(dev, &[1.0; 16]), put_at(dev, &[0.5, -2.0], -1000.0, 4));
    let ab = |k: usize| [2, k.max(1)].map(|ld| super::operand(x.view(), false, ld));
    let c0 = [3.0, 4.0, 5.0, 6.0, 7.0, 8.0];
    let gemm = |c: View, k, beta, ldc, count| super::Gemm {
        beta,
        bias: Some(bias.view()),
        batch: super::Batch::of(count, [0, 0, 6]),
        ..super::Gemm::new([2, 3, k], ab(k), c, ldc, false)
    };
    for (beta, want) in [
        (0.0, [0.5, -2.0, 0.5, -2.0, 0.5, -2.0]),
        (1.0, [3.5, 2.0, 5.5, 4.0, 7.5, 6.0]),
    ] {
        let c = putf(dev, &c0);
        dev.gemm(gemm(c.view(), 0, beta, 2, 1)).unwrap();
        assert_eq!(get(dev, &c), want, "beta {beta}");
    }
    let c = putf(dev, &[0.0; 16]);
    for (ldc, count) in [(2, 2), (3, 1)] {
        let err = dev.gemm(gemm(c.view(), 4, 0.0, ldc, count)).unwrap_err().0;
        assert!(err.contains("bias needs one product"), "{err}");
    }
    assert_eq!(get(dev, &c), [0.0; 16], "a refused GEMM wrote");
}

/// A GEMM's residual: with no products (k = 0) c is the residual (its
/// first m x n values, into c's first m x n); across a
/// batch, into a c with rows between its columns, onto a bf16 c, with beta
/// 1, or shorter than m x n, refused before any launch.
#[test]
fn a_gemm_residual_needs_one_product_into_a_whole_fp32_c() {
    on_gpus!(a_gemm_residual_needs_one_product_into_a_whole_fp32_c_on);
}

fn a_gemm_residual_needs_one_product_into_a_whole_fp32_c_on<R: Runtime>(dev: &Queue<R>) {
    let r = [3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0];
    let (x, r) = (putf(dev, &[1.0; 16]), putf(dev, &r));
    let ab = |k: usize| [2, k.max(1)].map(|ld| super::operand(x.view(), false, ld));
    let gemm = |c: View, k, residual: View| super::Gemm {
        residual: Some(residual),
        ..super::Gemm::new([2, 3, k], ab(k), c, 2, false)
    };
    // c and the residual longer than m x n: their first m x n copied
    let c = putf(dev, &[0.0; 8]);
    dev.gemm(gemm(c.view(), 0, r.view())).unwrap();
    let want = [3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 0.0, 0.0];
    assert_eq!(get(dev, &c), want, "no products: the residual");
    let c = putf(dev, &[0.0; 16]);
    let g = gemm(c.view(), 4, r.view());
    let batch = super::Batch::of(2, [0, 0, 6]);
    let short = View { len: 5, ..r.view() };
    for (what, g) in [
        ("a batch", super::Gemm { batch, ..g }),
        ("rows between columns", super::Gemm { ldc: 3, ..g }),
        (
            "a bf16 c",
            super::Gemm {
                c_bf16: true,
                bf16: true,
                ..g
            },
        ),
        ("beta 1", super::Gemm { beta: 1.0, ..g }),
        ("a short residual", gemm(c.view(), 4, short)),
    ] {
        let err = dev.gemm(g).unwrap_err().0;
        assert!(err.contains("residual"), "{what}: {err}");
    }
    assert_eq!(get(dev, &c), [0.0; 16], "a refused GEMM wrote");
}

/// bf16 storage that the products would read or write as fp32, and a
/// bf16 output a product would add onto or fill with zeros (k = 0, where
/// the fill writes floats), are refused before any launch.
#[test]
fn a_gemm_over_bf16_storage_needs_bf16_products_and_beta_0() {
    on_gpus!(a_gemm_over_bf16_storage_needs_bf16_products_and_beta_0_on);
}

fn a_gemm_over_bf16_storage_needs_bf16_products_and_beta_0_on<R: Runtime>(dev: &Queue<R>) {
    let x = putf(dev, &[1.0; 16]);
    let f = super::operand(x.view(), false, 2);
    let h = super::Operand { bf16: true, ..f };
    let gemm = |a, b, c_bf16, bf16, beta| super::Gemm {
        beta,
        c_bf16,
        ..super::Gemm::new([2, 2, 2], [a, b], x.view(), 2, bf16)
    };
    for g in [
        gemm(h, f, false, false, 0.0),
        gemm(f, h, false, false, 0.0),
        gemm(f, f, true, false, 0.0),
        gemm(f, f, true, true, 1.0),
        super::Gemm {
            k: 0,
            ..gemm(h, h, true, true, 0.0)
        },
    ] {
        let err = dev.gemm(g).unwrap_err().to_string();
        assert!(err.contains("bf16 storage"), "{err}");
    }
    dev.gemm(gemm(h, h, true, true, 0.0)).unwrap();
}

#[test]
fn adamw_matches_cpu() {
    on_gpus!(adamw_matches_cpu_on);
}

fn adamw_matches_cpu_on<R: Runtime>(dev: &Queue<R>) {
    let mut rng = Rng::new(9);
    let n = if tiny() { 300 } else { 4099 };
    let step = AdamWStep {
        lr: 1e-3,
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        step: 3,
        grad_scale: 0.7,
    };
    let p0 = randn(&mut rng, n, 1.0);
    let g = randn(&mut rng, n, 1.0);
    let m0 = randn(&mut rng, n, 0.1);
    let v0: Vec<f32> = randn(&mut rng, n, 0.1).iter().map(|x| x * x).collect();
    // on the CPU without and with the bf16 copy: the same update, and the
    // copy its new values rounded
    let mut cpu = Vec::new();
    for with_copy in [false, true] {
        let (mut p, mut m, mut v) = (p0.clone(), m0.clone(), v0.clone());
        let mut copy = vec![Bf16::default(); n];
        (AdamWUpdate::<Host> {
            param: &mut p,
            grad: &g,
            m: &mut m,
            v: &mut v,
            copy: with_copy.then_some(&mut copy[..]),
            step,
            weight_decay: 0.1,
        })
        .cpu(&AsIs);
        if with_copy {
            let rounded: Vec<Bf16> = p.iter().map(|&x| Bf16::from_f32(x)).collect();
            assert!(copy == rounded, "adamw's copy on the CPU");
        }
        cpu.push((p, m, v));
    }
    assert!(cpu[0] == cpu[1], "the copy changed the CPU's update");
    let (p, m, v) = &cpu[0];
    for with_copy in [false, true] {
        let (pd, gd, md, vd) = (
            putf(dev, &p0),
            putf(dev, &g),
            putf(dev, &m0),
            putf(dev, &v0),
        );
        let copy = put(dev, &vec![Bf16::default(); n], Bf16::from_f32(-3.0));
        dev.run(AdamWUpdate {
            param: pd.view(),
            grad: gd.view(),
            m: md.view(),
            v: vd.view(),
            copy: with_copy.then(|| copy.view()),
            step,
            weight_decay: 0.1,
        })
        .unwrap();
        let got = get(dev, &pd);
        assert_close("adamw param", &got, p);
        assert_close("adamw m", &get(dev, &md), m);
        assert_close("adamw v", &get(dev, &vd), v);
        let want: Vec<Bf16> = match with_copy {
            true => got.iter().map(|&x| Bf16::from_f32(x)).collect(),
            false => vec![Bf16::default(); n],
        };
        assert!(
            get(dev, &copy) == want,
            "adamw's copy, with_copy {with_copy}"
        );
    }
}

#[test]
fn sums_match_f64_and_are_deterministic() {
    on_gpus!(sums_match_f64_and_are_deterministic_on);
}

fn sums_match_f64_and_are_deterministic_on<R: Runtime>(dev: &Queue<R>) {
    let mut rng = Rng::new(10);
    let sizes = if tiny() {
        vec![1, 600]
    } else {
        vec![1, 3, 1000, 300_001]
    };
    let (mut held, mut alone) = (Vec::new(), Vec::new());
    for n in sizes {
        let x = randn(&mut rng, n, 1.0);
        let xd = putf(dev, &x);
        let sq = dev.sum_squares(&[xd.view()]).unwrap()[0];
        let want_sq = elementwise::sum_squares(&x);
        // Relative to the sum of magnitudes, the scale of rounding in any order.
        let abs: f64 = x.iter().map(|&v| v.abs() as f64).sum();
        let err_sq = (sq - want_sq).abs() / want_sq.max(1.0);
        let s = dev.sum(xd.view()).unwrap();
        let want_s: f64 = x.iter().map(|&v| v as f64).sum();
        let err_s = (s - want_s).abs() / abs.max(1.0);
        eprintln!("sums n={n}: sum_squares rel err {err_sq:.2e}, sum rel err {err_s:.2e}");
        assert!(
            err_sq <= TOL && err_s <= TOL,
            "n={n}: {sq} vs {want_sq}, {s} vs {want_s}"
        );
        assert_eq!(dev.sum(xd.view()).unwrap(), s);
        // and from its second element on, an offset view
        let tail = dev.sum_squares(&[xd.view().tail(1)]).unwrap()[0];
        let want_tail = elementwise::sum_squares(&x[1..]);
        assert!(
            (tail - want_tail).abs() <= TOL * want_tail.max(1.0),
            "n={n}: the tail's"
        );
        alone.extend([sq, tail]);
        held.push(xd);
    }
    // every view reduced in one call: each its sum alone, bit for bit
    let views: Vec<View> = held
        .iter()
        .flat_map(|x| [x.view(), x.view().tail(1)])
        .collect();
    assert_eq!(dev.sum_squares(&views).unwrap(), alone);
    assert_eq!(dev.sum_squares(&[]).unwrap(), Vec::<f64>::new());
}

#[test]
fn every_kernel_of_the_program_is_named() {
    let src = program_source();
    let names = kernel_names(src);
    for k in [
        "encoder_forward",
        "attention_softmax_forward",
        "adamw",
        "crossentropy_forward",
    ] {
        assert!(names.contains(&k), "{k} not in {names:?}");
    }
    let kernels = src.lines().filter(|l| l.starts_with("KERNEL ")).count();
    assert_eq!(names.len(), kernels);
    assert!(names
        .iter()
        .all(|n| n.chars().all(|c| c.is_alphanumeric() || c == '_')));
    // Oclgrind counts a kernel's shared memory with that of every kernel
    // whose name begins with its own (flash.cu's narrow and wide kernels
    // overflowed its 32 KiB so)
    for a in &names {
        for b in names.iter().filter(|b| b != &a) {
            assert!(
                !b.starts_with(a),
                "kernel {b} begins with kernel {a}'s name"
            );
        }
    }
}

#[test]
fn a_batch_of_empty_products_sets_each_output_to_beta_times_itself() {
    on_gpus!(a_batch_of_empty_products_sets_each_output_to_beta_times_itself_on);
}

fn a_batch_of_empty_products_sets_each_output_to_beta_times_itself_on<R: Runtime>(dev: &Queue<R>) {
    // two (2 x 3) outputs 8 apart, k = 0: no products, c = beta c
    for (beta, want) in [(0.0, 0.0), (1.0, 7.0)] {
        let c = putf(dev, &[7.0; 16]);
        let a = super::operand(c.view(), false, 2);
        dev.gemm(super::Gemm {
            beta,
            batch: super::Batch::of(2, [0, 0, 8]),
            ..super::Gemm::new([2, 3, 0], [a, a], c.view(), 2, false)
        })
        .unwrap();
        let got = get(dev, &c);
        let outputs = [&got[0..6], &got[8..14]];
        assert!(
            outputs.iter().all(|o| o.iter().all(|&x| x == want)),
            "{got:?}"
        );
        assert!([got[6], got[7], got[14], got[15]] == [7.0; 4], "{got:?}");
    }
}

/// The weights' bf16 copy: `to_bf16` rounds as the CPU does, bit for bit,
/// and a weight stored in bf16 gives what its fp32 values give in bf16
/// products (it takes them even where the shape asks fp32's): the product
/// with a bias and into bf16, and the backward's three gradients, both
/// layouts, guard cells around every buffer.
#[test]
fn a_bf16_weight_is_its_rounded_values_on_the_device() {
    on_gpus!(a_bf16_weight_is_its_rounded_values_on);
}

fn a_bf16_weight_is_its_rounded_values_on<R: Runtime>(dev: &Queue<R>) {
    let mut rng = Rng::new(17);
    for (rows, k, n, layout) in [
        (7, 40, 24, WeightLayout::InOut),
        (9, 33, 70, WeightLayout::OutIn),
    ] {
        let what = format!("rows={rows} k={k} n={n} {layout:?}");
        let values = randn(&mut rng, k * n, 1.0);
        let w = putf(dev, &values);
        let copy = put_aligned(dev, &vec![Bf16::default(); k * n]);
        dev.pointwise("to_bf16", copy.view(), w.view()).unwrap();
        let rounded: Vec<Bf16> = values.iter().map(|&x| Bf16::from_f32(x)).collect();
        assert!(
            get(dev, &copy) == rounded,
            "{what}: to_bf16 is not the CPU's rounding"
        );
        let (x, bias, dout) = (
            putf(dev, &randn(&mut rng, rows * k, 1.0)),
            putf(dev, &randn(&mut rng, n, 1.0)),
            putf(dev, &randn(&mut rng, rows * n, 1.0)),
        );
        let shape = MatmulShape::new((rows, k, n), layout);
        let bf16 = shape.with_bf16(true);
        let mut runs = Vec::new();
        for (w, shape) in [
            (Stored::F32(w.view()), bf16),
            (Stored::Bf16(copy.view()), shape),
        ] {
            let out = putf(dev, &vec![0.0; rows * n]);
            let held = put(dev, &vec![Bf16::default(); rows * n], Bf16::from_f32(-7.0));
            let inp = Stored::F32(x.view());
            let op = MatmulForward {
                out: Stored::F32(out.view()),
                inp,
                w,
                bias: Some(bias.view()),
                residual: None,
                shape,
                accumulate: false,
            };
            dev.run(op).unwrap();
            let op = MatmulForward {
                out: Stored::Bf16(held.view()),
                inp,
                w,
                bias: None,
                residual: None,
                shape,
                accumulate: false,
            };
            dev.run(op).unwrap();
            let (dinp, dw, db) = (
                putf(dev, &vec![f32::NAN; rows * k]),
                putf(dev, &vec![0.5; k * n]),
                putf(dev, &vec![0.25; n]),
            );
            let op = MatmulBackward {
                dinp: Some(dinp.view()),
                dw: Some(dw.view()),
                dbias: Some(db.view()),
                dout: Stored::F32(dout.view()),
                inp,
                w,
                shape,
            };
            dev.run(op).unwrap();
            let f = |t| get(dev, t);
            runs.push(([f(&out), f(&dinp), f(&dw), f(&db)], get(dev, &held)));
        }
        assert!(runs[0].1 == runs[1].1, "{what}: the product into bf16");
        for (i, out) in ["the product", "dinp", "dw", "dbias"].iter().enumerate() {
            let (a, b) = (&runs[0].0[i], &runs[1].0[i]);
            assert!(a == b, "{what}: {out}: {}", differ(a, b));
        }
    }
}

/// What the scratch guards hold.
const SENTINEL: f32 = -7.25e30;

impl<R: Runtime> Queue<R> {
    /// Writes [`SCRATCH_GUARD`] sentinels past each of `lens` elements of
    /// `kept`, or (`check`) errs where a kernel has changed one.
    pub(super) fn scratch_guards(
        &self,
        kept: &[R::Mem<f32>],
        lens: &[usize],
        check: bool,
    ) -> Result<(), GpuError> {
        for (mem, &len) in kept.iter().zip(lens) {
            let guard = mem.view_range(len..len + SCRATCH_GUARD);
            if !check {
                self.write(guard, &[SENTINEL; SCRATCH_GUARD])?;
                continue;
            }
            let mut seen = [0.0; SCRATCH_GUARD];
            self.read(guard, &mut seen)?;
            if seen.iter().any(|x| x.to_bits() != SENTINEL.to_bits()) {
                return Err(GpuError(format!(
                    "a kernel wrote past its scratch of {len} elements"
                )));
            }
        }
        Ok(())
    }
}
