//! Self-attention's decode step on a GPU-style device (`kernels/attention.cu`);
//! training's forward and backward are kernels of `ops/attention.rs`.

use super::kernels::{need, u32s};
use super::{Arg, GpuError, Queue, Raw, Runtime};
use crate::backend::ops::AttentionDecode;
use crate::backend::DecodeShape;

/// Largest head dim decode supports: `ATT_HD_MAX` in attention.cu.
pub(crate) const HD_MAX: usize = 256;

/// The head dim of `nh` heads over `c` channels, if decode supports it.
fn head_dim(c: usize, nh: usize) -> Result<usize, GpuError> {
    if nh == 0 || !c.is_multiple_of(nh) || c / nh == 0 || c / nh > HD_MAX {
        return Err(GpuError(format!(
            "attention_decode: c = {c} over nh = {nh} heads must give a whole head dim \
             of 1 to {HD_MAX} for the device kernel"
        )));
    }
    Ok(c / nh)
}

impl<R: Runtime> Queue<R> {
    /// out (b, c) from one query per row of qkv (b, 3c) against positions
    /// [0, len) of kcache, vcache (b, max_t, c).
    pub fn attention_decode(&self, op: AttentionDecode<Raw>) -> Result<(), GpuError> {
        let AttentionDecode {
            out,
            qkv,
            kcache,
            vcache,
            shape,
        } = op;
        let DecodeShape {
            b,
            len,
            c,
            nh,
            max_t,
        } = shape;
        head_dim(c, nh)?;
        if len > max_t {
            return Err(GpuError(format!(
                "attention_decode: len = {len} exceeds the cache's max_t = {max_t}"
            )));
        }
        need("attention_decode out", out, b * c)?;
        need("attention_decode qkv", qkv, b * 3 * c)?;
        need("attention_decode kcache", kcache, b * max_t * c)?;
        need("attention_decode vcache", vcache, b * max_t * c)?;
        let args = [
            Arg::View(out),
            Arg::View(qkv),
            Arg::View(kcache),
            Arg::View(vcache),
            u32s("len", len)?,
            u32s("c", c)?,
            u32s("nh", nh)?,
            u32s("max_t", max_t)?,
        ];
        self.launch("attention_decode", b * nh, &args)
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{
        assert_close, get, max_rel_err, on_gpus, put, putf, putu, tiny, TOL,
    };
    use super::super::{program_source, DeviceMem};
    use super::*;
    use crate::backend::cpu::attention;
    use crate::backend::cpu::check::randn;
    use crate::backend::ops::attention::{
        flash_backward, flash_fits, flash_forward, flash_kernel, FLASH_HD_MAX, FLASH_NARROW_HD,
        FLASH_ROWS,
    };
    use crate::backend::ops::tests::AsIs;
    use crate::backend::ops::Stored;
    use crate::backend::ops::{Host, Kernel};
    use crate::backend::{AttentionBackward, AttentionForward};
    use crate::backend::{AttnShape, Bf16};
    use crate::rng::Rng;

    #[test]
    fn host_constants_match_the_kernels() {
        let src = program_source();
        assert!(src.contains(&format!("#define ATT_HD_MAX {HD_MAX} ")));
        assert!(src.contains(&format!("#define FA_HD_MAX {FLASH_HD_MAX} ")));
        assert!(src.contains(&format!("#define FA_NARROW_HD {FLASH_NARROW_HD} ")));
        assert!(src.contains(&format!("#define FA_ROWS {FLASH_ROWS} ")));
    }

    /// (b, t, c, nh): head dims 1 to 128 (32, 64 and 128 among them), some
    /// not powers of two; t of one row, and below and past BLOCK (the
    /// row-wise kernels' stride).
    fn shapes() -> Vec<AttnShape> {
        let list: &[(usize, usize, usize, usize)] = if tiny() {
            &[(1, 5, 6, 2), (2, 33, 5, 1)]
        } else {
            &[
                (2, 37, 6, 2),
                (1, 70, 10, 2),
                (3, 33, 48, 2),
                (1, 65, 128, 2),
                (2, 64, 64, 1),
                (1, 1, 64, 1),
                (4, 3, 1, 1),
                (2, 260, 256, 2),
                (2, 40, 64, 2),
                // three heads in passes of two (the unit tests' pass cap):
                // a last pass of one
                (3, 37, 12, 1),
            ]
        };
        fp32_shapes(list)
    }

    /// `list`'s (b, t, c, nh) as fp32 attention shapes.
    fn fp32_shapes(list: &[(usize, usize, usize, usize)]) -> Vec<AttnShape> {
        list.iter()
            .map(|&(b, t, c, nh)| AttnShape::new((b, t, c, nh), false))
            .collect()
    }

    fn name(s: AttnShape, lens: Option<&[u32]>) -> String {
        let mask = lens.map_or("causal".to_string(), |l| format!("lens {l:?}"));
        format!("b={} t={} c={} nh={} {mask}", s.b, s.t, s.c, s.nh)
    }

    /// Causal, then a padding mask: the first sequence whole, the others
    /// shorter (one key, and lengths ending inside a tile).
    fn masks(s: AttnShape) -> [Option<Vec<u32>>; 2] {
        let lens = (0..s.b)
            .map(|i| if i == 0 { s.t } else { (s.t / (i + 1)).max(1) } as u32)
            .collect();
        [None, Some(lens)]
    }

    /// out, lse and dqkv of the CPU's attention forward, then its backward
    /// from `dout`.
    fn on_cpu(s: AttnShape, lens: Option<&[u32]>, qkv: &[f32], dout: &[f32]) -> [Vec<f32>; 3] {
        let AttnShape { b, t, c, nh, .. } = s;
        let (mut out, mut lse) = (vec![0.0; b * t * c], vec![0.0; b * nh * t]);
        (AttentionForward::<Host> {
            out: Stored::F32(&mut out),
            lse: &mut lse,
            qkv: Stored::F32(qkv),
            lens,
            shape: s,
        })
        .cpu(&AsIs);
        let mut dqkv = vec![0.0; qkv.len()];
        (AttentionBackward::<Host> {
            dqkv: Stored::F32(&mut dqkv),
            dout,
            qkv: Stored::F32(qkv),
            out: Stored::F32(&out),
            lse: &lse,
            lens,
            shape: s,
        })
        .cpu(&AsIs);
        [out, lse, dqkv]
    }

    /// [`on_cpu`] on `dev`, every output filled with 7s first; on the
    /// tensor cores' kernels (flash.cu) where `flash`, whatever the device.
    fn on_dev<R: Runtime>(
        dev: &Queue<R>,
        s: AttnShape,
        lens: Option<&[u32]>,
        [qkv, dout]: [&[f32]; 2],
        flash: bool,
    ) -> [Vec<f32>; 3] {
        let AttnShape { b, t, c, nh, .. } = s;
        let (q, d) = (putf(dev, qkv), putf(dev, dout));
        let [o, l, g] = [b * t * c, b * nh * t, qkv.len()].map(|n| putf(dev, &vec![7.0; n]));
        let ld = lens.map(|x| putu(dev, x));
        let lv = ld.as_ref().map(|x| x.view());
        let forward = AttentionForward {
            out: Stored::F32(o.view()),
            lse: l.view(),
            qkv: Stored::F32(q.view()),
            lens: lv,
            shape: s,
        };
        let backward = AttentionBackward {
            dqkv: Stored::F32(g.view()),
            dout: d.view(),
            qkv: Stored::F32(q.view()),
            out: Stored::F32(o.view()),
            lse: l.view(),
            lens: lv,
            shape: s,
        };
        if flash {
            forward.check().unwrap();
            backward.check().unwrap();
            flash_forward(dev, forward).unwrap();
            flash_backward(dev, backward).unwrap();
        } else {
            dev.run(forward).unwrap();
            dev.run(backward).unwrap();
        }
        [o, l, g].map(|x| get(dev, &x))
    }

    #[test]
    fn attention_forward_matches_cpu() {
        on_gpus!(attention_forward_matches_cpu_on);
    }

    fn attention_forward_matches_cpu_on<R: Runtime>(dev: &Queue<R>) {
        let mut rng = Rng::new(11);
        for s in shapes() {
            for lens in masks(s) {
                let AttnShape { b, t, c, .. } = s;
                let qkv = randn(&mut rng, b * t * 3 * c, 1.0);
                let dout = vec![0.0; b * t * c];
                let [out, lse, _] = on_cpu(s, lens.as_deref(), &qkv, &dout);
                let [o, l, _] = on_dev(dev, s, lens.as_deref(), [&qkv, &dout], false);
                let what = name(s, lens.as_deref());
                assert_close(&format!("attention_forward {what} out"), &o, &out);
                assert_close(&format!("attention_forward {what} lse"), &l, &lse);
            }
        }
    }

    #[test]
    fn attention_backward_matches_cpu_and_is_deterministic() {
        on_gpus!(attention_backward_matches_cpu_and_is_deterministic_on);
    }

    fn attention_backward_matches_cpu_and_is_deterministic_on<R: Runtime>(dev: &Queue<R>) {
        let mut rng = Rng::new(12);
        for s in shapes() {
            for lens in masks(s) {
                let AttnShape { b, t, c, .. } = s;
                // Large scores make sharp rows, where a wrong lse or mask shows.
                let qkv = randn(&mut rng, b * t * 3 * c, 2.0);
                let dout = randn(&mut rng, b * t * c, 1.0);
                let [out, lse, want] = on_cpu(s, lens.as_deref(), &qkv, &dout);
                let (q, d, o, l) = (
                    putf(dev, &qkv),
                    putf(dev, &dout),
                    putf(dev, &out),
                    putf(dev, &lse),
                );
                let ld = lens.as_ref().map(|x| putu(dev, x));
                let lv = ld.as_ref().map(|x| x.view());
                let mut runs = Vec::new();
                for _ in 0..2 {
                    let g = putf(dev, &randn(&mut rng, qkv.len(), 1.0));
                    dev.run(AttentionBackward {
                        dqkv: Stored::F32(g.view()),
                        dout: d.view(),
                        qkv: Stored::F32(q.view()),
                        out: Stored::F32(o.view()),
                        lse: l.view(),
                        lens: lv,
                        shape: s,
                    })
                    .unwrap();
                    runs.push(get(dev, &g));
                }
                let what = name(s, lens.as_deref());
                assert_close(&format!("attention_backward {what}"), &runs[0], &want);
                assert!(runs[0] == runs[1], "attention_backward {what}: runs differ");
            }
        }
    }

    /// Under bf16 the device's attention is the CPU's: every element within
    /// fp32's rounding (TOL) but those where a probability or a score's
    /// gradient sat on a bf16 rounding boundary and the two summation orders
    /// round it apart (one bf16 step of one term: a head's row of out, of
    /// dq or of dk), at most a tenth of them, each under 2^-7 of the largest
    /// element. fp32's attention is off in 77-99% of the elements
    /// (`cpu::attention`'s bf16 test), so this sees the rounding. On a GPU
    /// with tensor cores the shapes flash.cu takes run there.
    #[test]
    fn bf16_attention_matches_cpu() {
        on_gpus!(bf16_attention_matches_cpu_on);
    }

    fn bf16_attention_matches_cpu_on<R: Runtime>(dev: &Queue<R>) {
        bf16_matches_cpu(dev, shapes(), false, 14);
    }

    /// flash.cu against the CPU's bf16 attention as above, on every
    /// device: OpenCL runs the kernels' emulation twin of the tensor
    /// cores' fragments, so the tiling, masks and fragment layouts are
    /// checked here without a GPU. Head dims of 16 to 64 (the narrow
    /// kernels) and 80 to 128 (the wide ones, dk and dv in two halves of
    /// the head: 96 leaves the second half part empty); t of one row,
    /// within a tile, and past a workgroup's 128 rows.
    #[test]
    fn flash_attention_matches_cpu() {
        on_gpus!(flash_attention_matches_cpu_on);
    }

    fn flash_attention_matches_cpu_on<R: Runtime>(dev: &Queue<R>) {
        // OpenCL trains on the GEMMs: its emulated fragments are a twin
        // to test flash.cu by, far slower than CLBlast.
        assert!(R::KIND == "cuda" || !dev.tensor_cores(), "{}", dev.name());
        if R::KIND == "cuda" && !dev.tensor_cores() {
            eprintln!(
                "flash.cu needs compute capability 8.0: {} has not",
                dev.name()
            );
            return;
        }
        let list: &[(usize, usize, usize, usize)] = if tiny() {
            &[(1, 5, 32, 2), (1, 9, 64, 1), (1, 9, 128, 1)]
        } else {
            &[
                (2, 37, 32, 2),
                (1, 130, 64, 2),
                (2, 65, 48, 1),
                (2, 64, 64, 1),
                (1, 1, 64, 1),
                (2, 200, 128, 2),
                (1, 130, 256, 2),
                (2, 37, 96, 1),
                (1, 1, 128, 1),
                (2, 70, 160, 2),
            ]
        };
        bf16_matches_cpu(dev, fp32_shapes(list), true, 15);
    }

    /// An output stored in bf16 is the fp32 output rounded, bit for bit,
    /// and the backward reading it gives what its values held in fp32 give,
    /// on the GEMMs and on flash.cu (its twin on OpenCL), causal and padded
    /// (guard cells around the bf16 buffer).
    #[test]
    fn a_bf16_output_is_the_fp32_output_rounded_on_the_device() {
        on_gpus!(a_bf16_output_is_the_fp32_output_rounded_on);
    }

    fn a_bf16_output_is_the_fp32_output_rounded_on<R: Runtime>(dev: &Queue<R>) {
        // flash.cu needs compute capability 8.0 (or runs as its OpenCL
        // twin); the GEMMs run everywhere (under DISTGPT_ATTENTION=gemm on
        // a GPU that has it, where `dev.run` would take flash.cu)
        let routes: &[bool] = match R::KIND != "cuda" || dev.tensor_cores() {
            true => &[false, true],
            false => &[false],
        };
        let s = AttnShape::new((2, 37, 64, 2), true);
        let mut rng = Rng::new(17);
        let n = s.b * s.t * s.c;
        let (qkv, dout) = (randn(&mut rng, 3 * n, 2.0), randn(&mut rng, n, 1.0));
        let (q, d) = (putf(dev, &qkv), putf(dev, &dout));
        for lens in masks(s) {
            let ld = lens.as_ref().map(|x| putu(dev, x));
            let lens = ld.as_ref().map(|x| x.view());
            for &flash in routes {
                let what = format!("{}, flash {flash}", name(s, None));
                let fp32 = putf(dev, &vec![7.0; n]);
                let held = put(dev, &vec![Bf16::default(); n], Bf16::from_f32(-9.0));
                let mut lses = Vec::new();
                for out in [Stored::F32(fp32.view()), Stored::Bf16(held.view())] {
                    let l = putf(dev, &vec![7.0; s.b * s.nh * s.t]);
                    let (lse, qkv, shape) = (l.view(), Stored::F32(q.view()), s);
                    let op = AttentionForward {
                        out,
                        lse,
                        qkv,
                        lens,
                        shape,
                    };
                    match flash {
                        true => flash_forward(dev, op.check().map(|_| op).unwrap()).unwrap(),
                        false => dev.run(op).unwrap(),
                    }
                    lses.push(l);
                }
                let bits = get(dev, &held);
                let rounded: Vec<Bf16> = get(dev, &fp32).into_iter().map(Bf16::from_f32).collect();
                assert!(bits == rounded, "{what}: out");
                assert!(get(dev, &lses[0]) == get(dev, &lses[1]), "{what}: lse");
                let wide = putf(dev, &bits.iter().map(|x| x.to_f32()).collect::<Vec<_>>());
                let grads = [Stored::F32(wide.view()), Stored::Bf16(held.view())].map(|out| {
                    let g = putf(dev, &vec![7.0; 3 * n]);
                    let (dqkv, dout, qkv, lse) =
                        (g.view(), d.view(), Stored::F32(q.view()), lses[1].view());
                    let op = AttentionBackward {
                        dqkv: Stored::F32(dqkv),
                        dout,
                        qkv,
                        out,
                        lse,
                        lens,
                        shape: s,
                    };
                    match flash {
                        true => flash_backward(dev, op.check().map(|_| op).unwrap()).unwrap(),
                        false => dev.run(op).unwrap(),
                    }
                    get(dev, &g)
                });
                assert!(grads[0] == grads[1], "{what}: dqkv");
            }
        }
    }

    /// A qkv stored in bf16 (GPT-2's under `--precision bf16`) gives what
    /// its values held in fp32 give, bit for bit, forward and backward, and
    /// a dqkv stored in bf16 is the fp32 one rounded: on
    /// the GEMMs (whose permute widens it) and on flash.cu's narrow and
    /// wide kernels (which load it as it is), causal and padded.
    #[test]
    fn a_bf16_qkv_is_its_fp32_values_on_the_device() {
        on_gpus!(a_bf16_qkv_is_its_fp32_values_on);
    }

    fn a_bf16_qkv_is_its_fp32_values_on<R: Runtime>(dev: &Queue<R>) {
        let routes: &[bool] = match R::KIND != "cuda" || dev.tensor_cores() {
            true => &[false, true],
            false => &[false],
        };
        let mut rng = Rng::new(19);
        for (b, t, c, nh) in [(2, 37, 64, 2), (1, 33, 128, 1)] {
            let s = AttnShape::new((b, t, c, nh), true);
            let n = b * t * c;
            let held: Vec<Bf16> = randn(&mut rng, 3 * n, 2.0)
                .into_iter()
                .map(Bf16::from_f32)
                .collect();
            let wide: Vec<f32> = held.iter().map(|x| x.to_f32()).collect();
            let dout = randn(&mut rng, n, 1.0);
            let (qh, qw) = (put(dev, &held, Bf16::from_f32(-9.0)), putf(dev, &wide));
            let d = putf(dev, &dout);
            for lens in masks(s) {
                let ld = lens.as_ref().map(|x| putu(dev, x));
                let lens = ld.as_ref().map(|x| x.view());
                for &flash in routes {
                    let what = format!("{}, flash {flash}", name(s, None));
                    let [x, y] = [Stored::F32(qw.view()), Stored::Bf16(qh.view())].map(|qkv| {
                        let [o, l, g] = [n, b * nh * t, 3 * n].map(|k| putf(dev, &vec![7.0; k]));
                        let forward = AttentionForward {
                            out: Stored::F32(o.view()),
                            lse: l.view(),
                            qkv,
                            lens,
                            shape: s,
                        };
                        let backward = AttentionBackward {
                            dqkv: Stored::F32(g.view()),
                            dout: d.view(),
                            qkv,
                            out: Stored::F32(o.view()),
                            lse: l.view(),
                            lens,
                            shape: s,
                        };
                        forward.check().unwrap();
                        backward.check().unwrap();
                        match flash {
                            true => flash_forward(dev, forward).unwrap(),
                            false => dev.run(forward).unwrap(),
                        }
                        match flash {
                            true => flash_backward(dev, backward).unwrap(),
                            false => dev.run(backward).unwrap(),
                        }
                        [o, l, g].map(|x| get(dev, &x))
                    });
                    for (i, part) in ["out", "lse", "dqkv"].iter().enumerate() {
                        assert!(x[i] == y[i], "{what}: {part}");
                    }
                    // dqkv stored in bf16: the fp32 one rounded, bit for bit
                    let (l, o) = (putf(dev, &x[1]), putf(dev, &x[0]));
                    let g = put(dev, &vec![Bf16::default(); 3 * n], Bf16::from_f32(-9.0));
                    let backward = AttentionBackward {
                        dqkv: Stored::Bf16(g.view()),
                        dout: d.view(),
                        qkv: Stored::Bf16(qh.view()),
                        out: Stored::F32(o.view()),
                        lse: l.view(),
                        lens,
                        shape: s,
                    };
                    backward.check().unwrap();
                    match flash {
                        true => flash_backward(dev, backward).unwrap(),
                        false => dev.run(backward).unwrap(),
                    }
                    let rounded: Vec<Bf16> = x[2].iter().map(|&v| Bf16::from_f32(v)).collect();
                    assert!(get(dev, &g) == rounded, "{what}: a bf16 dqkv");
                }
            }
        }
    }

    /// flash.cu takes bf16 heads of whole k16 steps to 128 (GPT-2's 64,
    /// MiniLM's 32, larger models' 128); fp32, and every other head dim,
    /// run as GEMMs.
    #[test]
    fn flash_takes_bf16_heads_of_whole_k16_steps_to_128() {
        for (c, nh, bf16, fits) in [
            (768, 12, true, true),
            (384, 12, true, true),
            (48, 1, true, true),
            (16, 1, true, true),
            (768, 12, false, false),
            (8, 1, true, false),
            (24, 1, true, false),
            (80, 1, true, true),
            (1536, 12, true, true),
            (136, 1, true, false),
            (144, 1, true, false),
            (1536, 12, false, false),
        ] {
            let s = AttnShape::new((1, 1, c, nh), bf16);
            assert_eq!(flash_fits(s), fits, "c {c} nh {nh} bf16 {bf16}");
        }
    }

    /// Heads to 64 take the narrow kernels, one workgroup to a tile; wider
    /// ones the wide kernels, the dk/dv one two; every name is a kernel of
    /// the program.
    #[test]
    fn flash_launches_the_narrow_kernels_to_64_and_the_wide_ones_past() {
        let kernels = super::super::kernel_names(program_source());
        for (part, hd, wide_parts, name, parts) in [
            ("forward", 16, 1, "attention_flash_forward", 1),
            ("dkdv", 64, 2, "attention_flash_dkdv", 1),
            ("dq", 64, 1, "attention_flash_dq", 1),
            ("forward", 80, 1, "attention_flash_wide_forward", 1),
            ("dq", 96, 1, "attention_flash_wide_dq", 1),
            ("dkdv", 128, 2, "attention_flash_wide_dkdv", 2),
        ] {
            assert_eq!(
                flash_kernel(part, hd, wide_parts),
                (name.to_string(), parts)
            );
            assert!(kernels.contains(&name), "{name} not in the program");
        }
    }

    /// Each of `shapes`, made bf16, under both masks on `dev` (on flash.cu where
    /// `flash`) against the CPU, as [`bf16_attention_matches_cpu`] states.
    fn bf16_matches_cpu<R: Runtime>(
        dev: &Queue<R>,
        shapes: Vec<AttnShape>,
        flash: bool,
        seed: u64,
    ) {
        let mut rng = Rng::new(seed);
        for s in shapes {
            for lens in masks(s) {
                let s = AttnShape { bf16: true, ..s };
                let AttnShape { b, t, c, .. } = s;
                let qkv = randn(&mut rng, b * t * 3 * c, 2.0);
                let dout = randn(&mut rng, b * t * c, 1.0);
                let [out, lse, dqkv] = on_cpu(s, lens.as_deref(), &qkv, &dout);
                let [o, l, g] = on_dev(dev, s, lens.as_deref(), [&qkv, &dout], flash);
                let what = format!(
                    "{}{}",
                    name(s, lens.as_deref()),
                    if flash { " flash" } else { "" }
                );
                for (part, got, want) in [("out", o, &out), ("lse", l, &lse), ("dqkv", g, &dqkv)] {
                    let off = got
                        .iter()
                        .zip(want)
                        .filter(|&(&g, &w)| max_rel_err(&[g], &[w]) > TOL)
                        .count();
                    let top = want.iter().fold(1.0f32, |m, w| m.max(w.abs()));
                    let worst = got
                        .iter()
                        .zip(want)
                        .fold(0.0f32, |m, (g, w)| m.max((g - w).abs()))
                        / top;
                    eprintln!(
                        "bf16 {what} {part}: {off} of {} off, worst {worst:.2e}",
                        got.len()
                    );
                    assert!(
                        off * 10 <= got.len() && worst < 1.0 / 128.0,
                        "bf16 attention {what} {part}: {off} of {} elements beyond {TOL:e}, \
                         worst {worst:.3e} of the largest",
                        got.len()
                    );
                }
            }
        }
    }

    /// (b, len, c, nh, max_t): an empty cache, one position, and more
    /// positions than a workgroup has threads.
    fn decode_shapes() -> Vec<DecodeShape> {
        let list: &[(usize, usize, usize, usize, usize)] = if tiny() {
            &[(2, 3, 6, 2, 4), (1, 0, 3, 1, 2)]
        } else {
            &[
                (3, 37, 10, 2, 40),
                (2, 300, 64, 1, 301),
                (1, 0, 6, 2, 4),
                (2, 1, 24, 8, 5),
                (5, 9, 128, 2, 9),
                // heads of 128 and 256 (decode's widest: one part a tile)
                (2, 300, 256, 2, 301),
                (1, 40, 256, 1, 40),
            ]
        };
        list.iter()
            .map(|&(b, len, c, nh, max_t)| DecodeShape {
                b,
                len,
                c,
                nh,
                max_t,
            })
            .collect()
    }

    #[test]
    fn attention_decode_matches_cpu() {
        on_gpus!(attention_decode_matches_cpu_on);
    }

    fn attention_decode_matches_cpu_on<R: Runtime>(dev: &Queue<R>) {
        let mut rng = Rng::new(13);
        for s in decode_shapes() {
            let DecodeShape { b, c, max_t, .. } = s;
            let qkv = randn(&mut rng, b * 3 * c, 2.0);
            let kc = randn(&mut rng, b * max_t * c, 1.0);
            let vc = randn(&mut rng, b * max_t * c, 1.0);
            let mut want = vec![0.0; b * c];
            attention::attention_decode(AttentionDecode {
                out: &mut want,
                qkv: &qkv,
                kcache: &kc,
                vcache: &vc,
                shape: s,
            });
            let o = putf(dev, &vec![7.0; want.len()]);
            let (q, k, v) = (putf(dev, &qkv), putf(dev, &kc), putf(dev, &vc));
            dev.attention_decode(AttentionDecode {
                out: o.view(),
                qkv: q.view(),
                kcache: k.view(),
                vcache: v.view(),
                shape: s,
            })
            .unwrap();
            let what = format!(
                "attention_decode b={b} len={} c={c} nh={} max_t={max_t}",
                s.len, s.nh
            );
            assert_close(&what, &get(dev, &o), &want);
        }
    }

    #[test]
    fn decode_refuses_head_dims_past_its_kernel() {
        on_gpus!(decode_refuses_head_dims_past_its_kernel_on);
    }

    fn decode_refuses_head_dims_past_its_kernel_on<R: Runtime>(dev: &Queue<R>) {
        let m = dev.alloc::<f32>(3 * 130).unwrap();
        let op = |c, nh| AttentionDecode {
            out: m.view(),
            qkv: m.view(),
            kcache: m.view(),
            vcache: m.view(),
            shape: DecodeShape {
                b: 1,
                len: 1,
                c,
                nh,
                max_t: 1,
            },
        };
        let err = dev.attention_decode(op(514, 2)).unwrap_err();
        assert!(err.to_string().contains("1 to 256"), "{err}");
        assert!(dev.attention_decode(op(7, 2)).is_err());
        assert!(dev.attention_decode(op(128, 2)).is_ok());
    }

    #[test]
    fn training_attention_refuses_broken_heads() {
        on_gpus!(training_attention_refuses_broken_heads_on);
    }

    fn training_attention_refuses_broken_heads_on<R: Runtime>(dev: &Queue<R>) {
        let m = dev.alloc::<f32>(3 * 7).unwrap();
        let shape = AttnShape::new((1, 1, 7, 2), false);
        let err = dev
            .run(AttentionForward {
                out: Stored::F32(m.view()),
                lse: m.view(),
                qkv: Stored::F32(m.view()),
                lens: None,
                shape,
            })
            .unwrap_err();
        assert!(err.to_string().contains("whole heads"), "{err}");
    }
}
