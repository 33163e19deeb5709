//! `--precision bf16` on a bf16 product (distgpt's own AVX512-BF16 kernel
//! where the CPU has it, MKL's `cblas_gemm_bf16bf16f32` where it opens):
//! the CPU backend's matmuls round their operands to bfloat16 and sum exact
//! products in fp32, and training on it follows training in fp32 arithmetic
//! on the same rounded operands. Runs where a bf16 product is here (CI
//! fetches MKL's wheel and sets `DISTGPT_EXPECT_BF16`); the choice of
//! library is the process's, so this file is a process of its own and its
//! tests take turns.

#[allow(dead_code)] // the equivalence tests' helpers; this file needs the bf16 ones
mod common;

use distgpt::backend::cpu::blas::{self, MatmulChoice, MatmulLib};
use distgpt::backend::cpu::{round_to_bf16, Cpu};
use distgpt::backend::{
    AttentionBackward, AttentionForward, AttnShape, Bf16, Category, Device, Kernels,
    MatmulBackward, MatmulForward, MatmulShape, Stored, WeightLayout,
};
use distgpt::data::{Dataset, TokenizerKind};
use distgpt::model::Precision;
use distgpt::parallel::{ParallelConfig, StrategyKind};
use distgpt::rng::Rng;
use distgpt::train::{train_lm, TrainSummary};
use std::sync::Mutex;
use std::time::Duration as Wait;

/// The tests force the process's choice in turn.
static TURN: Mutex<()> = Mutex::new(());

/// The libraries here with a bf16 product (the built-in one by the CPU,
/// which ones CI installed the blas unit tests check): none is an error
/// where CI expects one.
fn with_bf16() -> Vec<MatmulLib> {
    let here: Vec<MatmulLib> = MatmulLib::ALL
        .into_iter()
        .filter(|l| l.has_bf16())
        .collect();
    let expected = std::env::var_os("DISTGPT_EXPECT_BF16").is_some();
    assert!(
        !(here.is_empty() && expected),
        "DISTGPT_EXPECT_BF16 is set, and no library with a bf16 product opens here"
    );
    if here.is_empty() {
        eprintln!(
            "no bf16 product here (no AVX512-BF16 for the built-in kernel; MKL's libmkl_rt on LD_LIBRARY_PATH)"
        );
    }
    for lib in &here {
        eprintln!("bf16 products on {}", lib.bf16_name());
    }
    here
}

fn on_bf16(lib: Option<MatmulLib>) {
    blas::force_choice(MatmulChoice {
        bf16: lib,
        ..blas::choice()
    });
}

/// Row-major (rows, k) @ (k, n) in f64, W in `layout`.
fn product(a: &[f32], w: &[f32], (rows, k, n): (usize, usize, usize), t: bool) -> Vec<f64> {
    let mut out = vec![0.0f64; rows * n];
    for r in 0..rows {
        for j in 0..n {
            out[r * n + j] = (0..k)
                .map(|i| a[r * k + i] as f64 * w[if t { j * k + i } else { i * n + j }] as f64)
                .sum();
        }
    }
    out
}

fn transpose(x: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    (0..cols * rows)
        .map(|i| x[(i % rows) * cols + i / rows])
        .collect()
}

/// Largest |got - want| over the largest |want|.
fn gap(got: &[f32], want: &[f64]) -> f64 {
    let scale = want.iter().fold(1e-30f64, |m, x| m.max(x.abs()));
    got.iter()
        .zip(want)
        .fold(0.0f64, |m, (&g, &w)| m.max((g as f64 - w).abs()))
        / scale
}

/// The product, both gradients, and where they must be: within 1e-5 of
/// f64 on the rounded operands, and at least 1e-4 from f64 on the operands
/// as given (which fp32 arithmetic would be within 1e-6 of), so a product
/// that skipped the bf16 route fails. An fp32 shape's, whatever runs bf16
/// products, the other way round, and none on a bf16 product.
#[test]
fn a_bf16_matmul_rounds_its_operands_and_sums_exact_products() {
    let _turn = TURN.lock().unwrap_or_else(|e| e.into_inner());
    // fp32 arithmetic too: the CPU's matmuls round a bf16 shape's operands
    // on every route (the model passes them unrounded)
    let routes = std::iter::once(None).chain(with_bf16().into_iter().map(Some));
    for lib in routes {
        on_bf16(lib);
        let be = Cpu::default();
        let mut rng = Rng::new(3);
        let shapes = [(7, 5, 9), (300, 200, 150), (1000, 130, 384)];
        for ((rows, k, n), bf16) in shapes.into_iter().flat_map(|s| [(s, true), (s, false)]) {
            for layout in [WeightLayout::InOut, WeightLayout::OutIn] {
                let on = lib.map_or("fp32 arithmetic", |l| l.bf16_name());
                let what = format!("{on} {rows}x{k}x{n} {layout:?} bf16 {bf16}");
                let before = blas::bf16_products();
                let mut randn =
                    |len: usize| -> Vec<f32> { (0..len).map(|_| rng.normal() as f32).collect() };
                let (inp, w, dout) = (randn(rows * k), randn(k * n), randn(rows * n));
                let round =
                    |x: &[f32]| -> Vec<f32> { x.iter().map(|&v| round_to_bf16(v)).collect() };
                let (inp_r, w_r, dout_r) = (round(&inp), round(&w), round(&dout));
                let t = layout == WeightLayout::OutIn;
                let buf = |x: &[f32]| {
                    let mut b = be.alloc(x.len(), Category::Activations).unwrap();
                    be.upload(b.d(), x).unwrap();
                    b
                };
                let (inp_b, w_b, dout_b) = (buf(&inp), buf(&w), buf(&dout));
                let mut out = be.alloc(rows * n, Category::Activations).unwrap();
                let mut dinp = be.alloc(rows * k, Category::Activations).unwrap();
                let mut dw = buf(&vec![0.0; k * n]);
                let shape = MatmulShape {
                    bf16,
                    ..MatmulShape::new((rows, k, n), layout)
                };
                be.run(MatmulForward {
                    out: out.d().into(),
                    inp: Stored::F32(inp_b.s()),
                    w: w_b.s().into(),
                    bias: None,
                    residual: None,
                    shape,
                    accumulate: false,
                })
                .unwrap();
                be.run(MatmulBackward {
                    dinp: Some(dinp.d()),
                    dw: Some(dw.d()),
                    dbias: None,
                    dout: dout_b.s().into(),
                    inp: Stored::F32(inp_b.s()),
                    w: w_b.s().into(),
                    shape,
                })
                .unwrap();
                // out = inp @ W; dinp = dout @ W^T; dW = inp^T @ dout (in W's layout)
                let w_t = |w: &[f32]| match t {
                    true => w.to_vec(),
                    false => transpose(w, k, n),
                };
                let dw_of = |inp: &[f32], dout: &[f32]| {
                    let d = product(&transpose(inp, rows, k), dout, (k, rows, n), false);
                    match t {
                        true => (0..n * k).map(|i| d[(i % k) * n + i / k]).collect(),
                        false => d,
                    }
                };
                let results = [
                    (
                        "out",
                        be.to_host(out.s()).unwrap(),
                        [
                            product(&inp_r, &w_r, (rows, k, n), t),
                            product(&inp, &w, (rows, k, n), t),
                        ],
                    ),
                    (
                        "dinp",
                        be.to_host(dinp.s()).unwrap(),
                        [
                            product(&dout_r, &w_t(&w_r), (rows, n, k), false),
                            product(&dout, &w_t(&w), (rows, n, k), false),
                        ],
                    ),
                    (
                        "dw",
                        be.to_host(dw.s()).unwrap(),
                        [dw_of(&inp_r, &dout_r), dw_of(&inp, &dout)],
                    ),
                ];
                for (name, got, [rounded, given]) in &results {
                    let (want, other) = match bf16 {
                        true => (rounded, given),
                        false => (given, rounded),
                    };
                    let (near, far) = (gap(got, want), gap(got, other));
                    assert!(near <= 1e-5, "{what} {name}: {near:e} from its product");
                    assert!(
                        far >= 1e-4,
                        "{what} {name}: only {far:e} from the other arithmetic's product"
                    );
                }
                if !bf16 {
                    assert_eq!(blas::bf16_products(), before, "{what}: on a bf16 product");
                }
            }
        }
    }
}

/// A product stored in bf16 is the fp32 product rounded, and an output
/// gradient stored in bf16 gives what its values held in fp32 give, bit
/// for bit, on every route bf16 products take here: the built-in kernel
/// reading and writing bf16 as it is, a library's (or fp32 arithmetic)
/// staged through fp32.
#[test]
fn bf16_storage_is_its_fp32_values_on_every_route() {
    let _turn = TURN.lock().unwrap_or_else(|e| e.into_inner());
    let routes = std::iter::once(None).chain(with_bf16().into_iter().map(Some));
    for lib in routes {
        on_bf16(lib);
        let be = Cpu::default();
        let mut rng = Rng::new(4);
        for (rows, k, n) in [(7, 5, 9), (30, 800, 70), (300, 200, 150)] {
            for layout in [WeightLayout::InOut, WeightLayout::OutIn] {
                let on = lib.map_or("fp32 arithmetic", |l| l.bf16_name());
                let what = format!("{on} {rows}x{k}x{n} {layout:?}");
                let mut randn =
                    |len: usize| -> Vec<f32> { (0..len).map(|_| rng.normal() as f32).collect() };
                let (inp, w, dw0) = (randn(rows * k), randn(k * n), randn(k * n));
                let held: Vec<Bf16> = randn(rows * n).into_iter().map(Bf16::from_f32).collect();
                let wide: Vec<f32> = held.iter().map(|x| x.to_f32()).collect();
                let buf = |x: &[f32]| {
                    let mut b = be.alloc(x.len(), Category::Activations).unwrap();
                    be.upload(b.d(), x).unwrap();
                    b
                };
                let (inp_b, w_b, wide_b) = (buf(&inp), buf(&w), buf(&wide));
                let mut held_b = be
                    .alloc_typed::<Bf16>(rows * n, Category::Activations)
                    .unwrap();
                be.upload(held_b.d(), &held).unwrap();
                let shape = MatmulShape {
                    bf16: true,
                    ..MatmulShape::new((rows, k, n), layout)
                };
                let mut fp32 = be.alloc(rows * n, Category::Activations).unwrap();
                let mut out = be
                    .alloc_typed::<Bf16>(rows * n, Category::Activations)
                    .unwrap();
                for out in [Stored::F32(fp32.d()), Stored::Bf16(out.d())] {
                    let (inp, w) = (inp_b.s(), w_b.s());
                    let (bias, accumulate) = (None, false);
                    be.run(MatmulForward {
                        out,
                        inp: Stored::F32(inp),
                        w: w.into(),
                        bias,
                        residual: None,
                        shape,
                        accumulate,
                    })
                    .unwrap();
                }
                let rounded: Vec<Bf16> = be
                    .to_host(fp32.s())
                    .unwrap()
                    .into_iter()
                    .map(Bf16::from_f32)
                    .collect();
                assert!(
                    be.to_host(out.s()).unwrap() == rounded,
                    "{what}: not the fp32 product rounded"
                );
                let backward = |dout| {
                    let (mut dinp, mut dw) = (buf(&vec![f32::NAN; rows * k]), buf(&dw0));
                    let (inp, w, dbias) = (inp_b.s(), w_b.s(), None);
                    let (dinp_d, dw_d) = (Some(dinp.d()), Some(dw.d()));
                    be.run(MatmulBackward {
                        dinp: dinp_d,
                        dw: dw_d,
                        dbias,
                        dout,
                        inp: Stored::F32(inp),
                        w: w.into(),
                        shape,
                    })
                    .unwrap();
                    (be.to_host(dinp.s()).unwrap(), be.to_host(dw.s()).unwrap())
                };
                assert!(
                    backward(Stored::Bf16(held_b.s())) == backward(Stored::F32(wide_b.s())),
                    "{what}: a bf16 gradient is not its fp32 values"
                );
                // an input stored in bf16 (GPT-2's GELU output): its fp32
                // values' product (with a bias, added to) and dw
                let inp_held: Vec<Bf16> = inp.iter().map(|&v| Bf16::from_f32(v)).collect();
                let inp_wide = buf(&inp_held.iter().map(|x| x.to_f32()).collect::<Vec<_>>());
                let mut ih = be
                    .alloc_typed::<Bf16>(rows * k, Category::Activations)
                    .unwrap();
                be.upload(ih.d(), &inp_held).unwrap();
                let (bias, out0) = (buf(&dw0[..n]), wide.clone());
                let with_input = |inp: Stored<_, _>, dout| {
                    let (mut out, mut dw) = (buf(&out0), buf(&dw0));
                    let (w, bias) = (w_b.s(), Some(bias.s()));
                    let (out_d, dw_d) = (Stored::F32(out.d()), Some(dw.d()));
                    let op = MatmulForward {
                        out: out_d,
                        inp,
                        w: w.into(),
                        bias,
                        residual: None,
                        shape,
                        accumulate: true,
                    };
                    be.run(op).unwrap();
                    let op = MatmulBackward {
                        dinp: None,
                        dw: dw_d,
                        dbias: None,
                        dout,
                        inp,
                        w: w.into(),
                        shape,
                    };
                    be.run(op).unwrap();
                    (be.to_host(out.s()).unwrap(), be.to_host(dw.s()).unwrap())
                };
                for (dout, name) in [
                    (Stored::F32(wide_b.s()), "fp32"),
                    (Stored::Bf16(held_b.s()), "bf16"),
                ] {
                    assert!(
                        with_input(Stored::Bf16(ih.s()), dout)
                            == with_input(Stored::F32(inp_wide.s()), dout),
                        "{what}: a bf16 input is not its fp32 values (dout in {name})"
                    );
                }
            }
        }
    }
}

fn dataset() -> Dataset {
    Dataset::load(None, TokenizerKind::Char).unwrap()
}

fn train_bf16(tag: &str) -> TrainSummary {
    let ds = dataset();
    let model = common::tiny_model(&ds);
    let cfg = common::five_steps(&format!("bf16-products-{tag}"), 1);
    let par = ParallelConfig {
        strategy: StrategyKind::Ddp,
        world_size: 2,
        tp: 1,
        recompute: false,
        precision: Precision::Bf16,
        pipeline: Default::default(),
        offload: Default::default(),
        offload_serial: false,
    };
    train_lm(Cpu::new, model, &ds, &cfg, par, 2, Wait::from_secs(60))
        .unwrap_or_else(|e| panic!("{tag}: {e}"))
}

/// Five steps of ddp x2 in bf16 on the library's bf16 product against the
/// same in fp32 arithmetic: the two sum the same exact products in another
/// order, within the tolerance the strategies keep against single in bf16.
#[test]
fn training_on_a_bf16_product_follows_fp32_arithmetic_on_the_rounded_operands() {
    let _turn = TURN.lock().unwrap_or_else(|e| e.into_inner());
    for lib in with_bf16() {
        on_bf16(None);
        let before = blas::bf16_products();
        let fp32 = train_bf16("fp32");
        assert_eq!(blas::bf16_products(), before, "fp32 ran products in bf16");
        on_bf16(Some(lib));
        let native = train_bf16(lib.key());
        assert_eq!(blas::choice().bf16, Some(lib));
        // the layer products of five steps on two ranks, at the least (the
        // same bits as fp32 are possible: short sums in the same order)
        let ran = blas::bf16_products() - before;
        assert!(
            ran >= 5 * 2 * 6,
            "{ran} products on {}'s bf16 product",
            lib.name()
        );
        common::assert_follows_within(
            &fp32,
            &native,
            &format!("bf16 on {}", lib.name()),
            common::BF16_TOL,
        );
    }
}

/// Attention's bf16 products take the bf16 units (`vdpbf16ps`) only where
/// the matmuls' bf16 products run in bf16 arithmetic (the measured choice,
/// or a pin): an Emerald Rapids Xeon without AMX does half as many bf16
/// products a cycle as fp32 FMAs, and its bf16 attention ran at half its
/// fp32 speed on them. The units sum a pair of products before adding it,
/// FMAs one at a time, so the bits tell the two apart: every route whose
/// matmuls run in fp32 gives one set, every route on a bf16 product
/// (where this CPU has AVX512-BF16) the other, each within twice the bound
/// the FMAs' attention keeps to an f64 reference in `cpu::attention`'s tests. A CPU without the units has one set for every route.
#[test]
fn attention_takes_the_bf16_units_where_the_matmuls_run_in_bf16() {
    let _turn = TURN.lock().unwrap_or_else(|e| e.into_inner());
    let be = Cpu::default();
    let s = AttnShape::new((2, 70, 64, 2), true);
    let n = s.b * s.t * s.c;
    let mut rng = Rng::new(9);
    let mut randn = |len: usize| -> Vec<f32> { (0..len).map(|_| rng.normal() as f32).collect() };
    let (qkv, dout) = (randn(3 * n), randn(n));
    let buf = |x: &[f32]| {
        let mut b = be.alloc(x.len(), Category::Activations).unwrap();
        be.upload(b.d(), x).unwrap();
        b
    };
    let (qkv_b, dout_b) = (buf(&qkv), buf(&dout));
    // out, then dqkv, for the process's choice now
    let attend = || -> Vec<f32> {
        let mut out = be.alloc(n, Category::Activations).unwrap();
        let mut lse = be.alloc(s.b * s.nh * s.t, Category::Activations).unwrap();
        let mut dqkv = be.alloc(3 * n, Category::Activations).unwrap();
        be.run(AttentionForward {
            out: Stored::F32(out.d()),
            lse: lse.d(),
            qkv: Stored::F32(qkv_b.s()),
            lens: None,
            shape: s,
        })
        .unwrap();
        be.run(AttentionBackward {
            dqkv: Stored::F32(dqkv.d()),
            dout: dout_b.s(),
            qkv: Stored::F32(qkv_b.s()),
            out: Stored::F32(out.s()),
            lse: lse.s(),
            lens: None,
            shape: s,
        })
        .unwrap();
        [be.to_host(out.s()).unwrap(), be.to_host(dqkv.s()).unwrap()].concat()
    };
    let mut seen: Vec<(bool, Vec<f32>)> = Vec::new();
    let routes = std::iter::once(None).chain(with_bf16().into_iter().map(Some));
    for lib in routes {
        on_bf16(lib);
        let units = lib.is_some() && blas::native_bf16();
        let got = attend();
        let on = lib.map_or("fp32 arithmetic", |l| l.bf16_name());
        for (was_units, was) in &seen {
            let same = got.iter().zip(was).all(|(a, b)| a.to_bits() == b.to_bits());
            assert_eq!(
                same,
                units == *was_units,
                "{on}: attention's products on the bf16 units {units}, a route's before {was_units}"
            );
            // each route is within the bound cpu::attention's unit test
            // holds the FMAs' to against an f64 reference (no more than 1%
            // of elements past 1e-5, relative, none past 2^-7): apart, twice it
            let errs: Vec<f64> = (got.iter().zip(was))
                .map(|(&a, &b)| (a as f64 - b as f64).abs() / (b.abs() as f64).max(1.0))
                .collect();
            let off = errs.iter().filter(|&&e| e > 1e-5).count() as f64 / errs.len() as f64;
            let worst = errs.iter().fold(0.0f64, |m, &e| m.max(e));
            assert!(
                off <= 0.02 && worst <= 2.0 / 128.0,
                "{on}: {off:.4} of elements apart, worst {worst:.2e}"
            );
        }
        seen.push((units, got));
    }
    on_bf16(None);
}
