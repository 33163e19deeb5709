//! Self-attention, forward and backward, as kernels, causal or with a
//! padding mask (each sequence's key count in `lens`), the row log-sum-exp
//! kept for the backward. On the CPU the flash-style tiles of
//! `cpu::attention` (no (T x T) buffer). On a GPU every head's products are
//! strided-batched GEMMs on the runtime's BLAS (the tensor cores' path) over
//! q, k, v permuted heads-first, with the (T x T) scores of a pass of heads
//! in the queue's scratch and a row-wise kernel between the GEMMs
//! (`kernels/attention.cu`); the backward recomputes the scores from lse.
//! Under bf16 on a GPU with tensor cores (`Runtime::tensor_cores`), heads
//! of 16 to 128 run instead on fused FlashAttention-2-style kernels
//! (`kernels/flash.cu`: mma.sync tiles, no scores in memory, tiles past the
//! mask skipped). No atomics: deterministic everywhere.

use super::{need, via_fp32, Checked, Host, Kernel, Lower, Operands, Queued, Stored};
use crate::backend::cpu::attention::{backward_masked, forward_masked, Mask, Saved};
use crate::backend::cpu::math::Scratch;
use crate::backend::gpu::{
    groups, operand, stored_view, u32s, Arg, Batch, Gemm, GpuError, Operand, Queue, Raw, Runtime,
    View,
};
use crate::backend::profile::attention_flops;
use crate::backend::{AttnShape, Bf16};

thread_local! {
    /// A dqkv held in bf16, computed in fp32 first on the CPU.
    static WIDE_DQKV: Scratch<f32> = const { Scratch::new(Vec::new()) };
}

operation! {
    /// qkv (B, T, 3C) -> out (B, T, C), lse (B, NH, T). Causal without `lens`;
    /// with them bidirectional with padding: every query of sequence b attends
    /// to its first `lens[b]` keys (1..=T). An `out` stored in bf16 (GPT-2's
    /// under `--precision bf16`) takes each value rounded; a `qkv` stored in
    /// bf16 (GPT-2's too) is read as it is, by bf16 products only.
    pub struct AttentionForward<O> {
        stored_output out: f32,
        output lse: f32,
        stored_input qkv: f32,
        maybe_input lens: u32,
        value shape: AttnShape,
    }
}

operation! {
    /// The gradient of [`AttentionForward`]: dqkv (B, T, 3C) overwritten
    /// (stored in bf16, GPT-2's under `--precision bf16`: each value
    /// rounded); `qkv` and `out` as the forward stored them.
    pub struct AttentionBackward<O> {
        stored_output dqkv: f32,
        input dout: f32,
        stored_input qkv: f32,
        stored_input out: f32,
        input lse: f32,
        maybe_input lens: u32,
        value shape: AttnShape,
    }
}

/// Why `shape`, `qkv` and `lens` cannot be attended over, if they cannot:
/// whole heads, a qkv in bf16 only under bf16 products, and a key count
/// a sequence (whose values, 1..=T, may live on the device: the batch's
/// builder checks them, the CPU asserts them and the device clamps them).
fn check_shape<O: Operands>(
    shape: AttnShape,
    qkv: &Stored<O::In<f32>, O::In<Bf16>>,
    lens: &Option<O::In<u32>>,
) -> Result<(), String> {
    let AttnShape { b, t, c, nh, .. } = shape;
    if nh == 0 || !c.is_multiple_of(nh) {
        return Err(format!("c = {c} is not whole heads of nh = {nh}"));
    }
    if qkv.is_bf16() && !shape.bf16 {
        return Err("a qkv stored in bf16 needs bf16 products".into());
    }
    need("qkv", qkv, b * t * 3 * c)?;
    lens.as_ref().map_or(Ok(()), |l| need("lens", l, b))
}

/// The CPU's mask: causal without `lens`.
fn host_mask(lens: Option<&[u32]>) -> Mask<'_> {
    lens.map_or(Mask::Causal, Mask::Lengths)
}

impl<O: Operands> Kernel<O> for AttentionForward<O> {
    const NAME: &'static str = "attention_forward";

    fn check(&self) -> Result<(), String> {
        let AttnShape { b, t, c, nh, .. } = self.shape;
        check_shape::<O>(self.shape, &self.qkv, &self.lens)?;
        need("out", &self.out, b * t * c)?;
        need("lse", &self.lse, b * nh * t)
    }

    fn flops(&self) -> f64 {
        attention_flops(self.shape, false)
    }

    fn cpu<'a>(self, host: &impl Lower<O, Host<'a>>) {
        let op = self.lower(host);
        forward_masked(op.out, op.lse, op.qkv, op.shape, host_mask(op.lens))
    }

    /// Per pass of heads: scores S = q k^T, their softmax in place (and
    /// lse), out = P v.
    fn gpu<R: Runtime>(self, q: &Queue<R>, raw: &impl Lower<O, Raw>, _: Checked) -> Queued {
        let op = self.lower(raw);
        if q.tensor_cores() && flash_fits(op.shape) {
            return flash_forward(q, op);
        }
        let h = Heads::new(op.shape, op.lens, op.qkv);
        q.with_scratch([3 * h.elems, h.elems, h.scores], |[qkvp, outp, s]| {
            h.permute(q, Stored::F32(qkvp), op.qkv, 3, true)?;
            for z0 in (0..h.z).step_by(h.pass) {
                let [qz, kz, vz] = [0, 1, 2].map(|p| h.block(qkvp, p, z0));
                let (t, hd, n) = (h.t, h.hd, h.pass.min(h.z - z0));
                q.gemm(h.per_head(t, hd, [h.op(kz, true), h.op(qz, false)], s, n))?;
                let args = [Arg::View(s), Arg::View(op.lse.tail(z0 * t))];
                q.launch(
                    "attention_softmax_forward",
                    n * t,
                    &h.args(&args, Some(z0))?,
                )?;
                let o = h.block(outp, 0, z0);
                q.gemm(h.per_head(hd, t, [h.op(vz, false), h.scores_op(s, false)], o, n))?;
            }
            h.permute(q, op.out, Stored::F32(outp), 1, false)
        })
    }
}

impl<O: Operands> Kernel<O> for AttentionBackward<O> {
    const NAME: &'static str = "attention_backward";

    fn check(&self) -> Result<(), String> {
        let AttnShape { b, t, c, nh, .. } = self.shape;
        check_shape::<O>(self.shape, &self.qkv, &self.lens)?;
        if self.dqkv.is_bf16() && !self.shape.bf16 {
            return Err("a dqkv stored in bf16 needs bf16 products".into());
        }
        need("dqkv", &self.dqkv, b * t * 3 * c)?;
        need("dout", &self.dout, b * t * c)?;
        need("out", &self.out, b * t * c)?;
        need("lse", &self.lse, b * nh * t)
    }

    fn flops(&self) -> f64 {
        attention_flops(self.shape, true)
    }

    fn cpu<'a>(self, host: &impl Lower<O, Host<'a>>) {
        let op = self.lower(host);
        let saved = Saved {
            dout: op.dout,
            qkv: op.qkv,
            out: op.out,
            lse: op.lse,
        };
        let (mask, n) = (host_mask(op.lens), 3 * op.shape.b * op.shape.t * op.shape.c);
        match op.dqkv {
            Stored::F32(dqkv) => backward_masked(dqkv, saved, op.shape, mask),
            // computed in fp32, then rounded
            Stored::Bf16(dqkv) => via_fp32(&WIDE_DQKV, &mut dqkv[..n], false, true, |wide| {
                backward_masked(wide, saved, op.shape, mask)
            }),
        }
    }

    /// Per pass of heads: the scores again (S = q k^T) and dP = dout v^T;
    /// a row-wise kernel turns them into P and dS; then dv = P^T dout,
    /// dq = dS k and dk = dS^T q, each a GEMM writing its own part.
    fn gpu<R: Runtime>(self, q: &Queue<R>, raw: &impl Lower<O, Raw>, _: Checked) -> Queued {
        let op = self.lower(raw);
        if q.tensor_cores() && flash_fits(op.shape) {
            return flash_backward(q, op);
        }
        let h = Heads::new(op.shape, op.lens, op.qkv);
        let lens = [3 * h.elems, h.elems, h.scores, h.scores, 3 * h.elems];
        q.with_scratch(lens, |[qkvp, doutp, p, ds, dqkvp]| {
            h.permute(q, Stored::F32(qkvp), op.qkv, 3, true)?;
            h.permute(q, Stored::F32(doutp), Stored::F32(op.dout), 1, true)?;
            for z0 in (0..h.z).step_by(h.pass) {
                let [qz, kz, vz] = [0, 1, 2].map(|i| h.block(qkvp, i, z0));
                let [dqz, dkz, dvz] = [0, 1, 2].map(|i| h.block(dqkvp, i, z0));
                let doz = h.block(doutp, 0, z0);
                let (t, hd, n) = (h.t, h.hd, h.pass.min(h.z - z0));
                q.gemm(h.per_head(t, hd, [h.op(kz, true), h.op(qz, false)], p, n))?;
                q.gemm(h.per_head(t, hd, [h.op(vz, true), h.op(doz, false)], ds, n))?;
                let (out, out_bf16) = stored_view(op.out);
                let views = [p, ds, op.lse.tail(z0 * t), op.dout, out];
                let mut args = views.map(Arg::View).to_vec();
                args.push(Arg::U32(out_bf16));
                q.launch(
                    "attention_softmax_backward",
                    n * t,
                    &h.args(&args, Some(z0))?,
                )?;
                q.gemm(h.per_head(hd, t, [h.op(doz, false), h.scores_op(p, true)], dvz, n))?;
                q.gemm(h.per_head(hd, t, [h.op(kz, false), h.scores_op(ds, false)], dqz, n))?;
                q.gemm(h.per_head(hd, t, [h.op(qz, false), h.scores_op(ds, true)], dkz, n))?;
            }
            h.permute(q, op.dqkv, Stored::F32(dqkvp), 3, false)
        })
    }
}

/// The largest head dim flash.cu takes (`FA_HD_MAX`), in whole 16-wide
/// steps of its products.
pub(crate) const FLASH_HD_MAX: usize = 128;
/// The largest head dim of flash.cu's narrow kernels (`FA_NARROW_HD`);
/// wider heads run on its wide ones (`attention_flash_wide_*`).
pub(crate) const FLASH_NARROW_HD: usize = 64;
/// The queries (dq, the forward) or keys (dk, dv) of a flash.cu
/// workgroup (`FA_ROWS`).
pub(crate) const FLASH_ROWS: usize = 128;

/// Whether `shape` runs on flash.cu where the device has tensor cores:
/// products in bf16 (fp32 attention stays on the fp32 GEMMs), head dims a
/// multiple of 16 up to [`FLASH_HD_MAX`].
pub(crate) fn flash_fits(shape: AttnShape) -> bool {
    let hd = shape.c / shape.nh;
    shape.bf16 && hd.is_multiple_of(16) && (16..=FLASH_HD_MAX).contains(&hd)
}

/// flash.cu's kernel `part` (forward, dq, dkdv) for heads of `hd`, and
/// its workgroups to a tile of rows: the narrow kernel and one to
/// [`FLASH_NARROW_HD`], else the wide one and `wide_parts`. (No kernel's
/// name begins another's: Oclgrind counts the shared memory of every
/// kernel whose name begins with the launched one's.)
pub(crate) fn flash_kernel(part: &str, hd: usize, wide_parts: usize) -> (String, usize) {
    match hd <= FLASH_NARROW_HD {
        true => (format!("attention_flash_{part}"), 1),
        false => (format!("attention_flash_wide_{part}"), wide_parts),
    }
}

/// [`AttentionForward`] on flash.cu (checked, and `flash_fits`): a
/// workgroup per [`FLASH_ROWS`] queries of a head.
pub(crate) fn flash_forward<R: Runtime>(q: &Queue<R>, op: AttentionForward<Raw>) -> Queued {
    let h = Heads::new(op.shape, op.lens, op.qkv);
    let [(out, out_bf16), (qkv, qkv_bf16)] = [op.out, op.qkv].map(stored_view);
    let views = [out, op.lse, qkv].map(Arg::View);
    let mut args = h.args(&views, None)?;
    args.extend([out_bf16, qkv_bf16].map(Arg::U32));
    h.flash(q, "forward", &args, 1)
}

/// [`AttentionBackward`] on flash.cu (checked, and `flash_fits`): each
/// row's D = dout . out into scratch, then dq a workgroup per
/// [`FLASH_ROWS`] queries and dk, dv one per as many keys.
pub(crate) fn flash_backward<R: Runtime>(q: &Queue<R>, op: AttentionBackward<Raw>) -> Queued {
    let h = Heads::new(op.shape, op.lens, op.qkv);
    let rows = h.z * h.t;
    q.with_scratch([rows], |[dd]| {
        let (out, out_bf16) = stored_view(op.out);
        let rowdot = [
            Arg::View(dd),
            Arg::View(op.dout),
            Arg::View(out),
            Arg::U32(out_bf16),
            u32s("b", h.shape.b)?,
            u32s("t", h.t)?,
            u32s("nh", h.shape.nh)?,
            u32s("hd", h.hd)?,
        ];
        q.launch("attention_flash_rowdot", groups(rows), &rowdot)?;
        let [(dqkv, dqkv_bf16), (qkv, qkv_bf16)] = [op.dqkv, op.qkv].map(stored_view);
        let views = [dqkv, op.dout, qkv, op.lse, dd].map(Arg::View);
        let mut args = h.args(&views, None)?;
        args.extend([qkv_bf16, dqkv_bf16].map(Arg::U32));
        h.flash(q, "dq", &args, 1)?;
        // the wide kernel takes a head's dk and dv in two halves of hd
        h.flash(q, "dkdv", &args, 2)
    })
}

/// Most scores one pass of heads holds (256 MiB of floats): the heads of
/// a pass are as many as fit, at least one.
#[cfg(not(test))]
const PASS_SCORES: usize = 1 << 26;
/// The unit tests' passes: a head or a few (tests/ run the one above).
#[cfg(test)]
const PASS_SCORES: usize = 1 << 12;

/// The GPU's attention geometry: `z` heads (B x NH, head z = b NH + h),
/// each a (T x hd) block of `elems / z` in the heads-first layout, taken
/// `pass` at a time with their (T x T) scores in `scores` elements.
struct Heads {
    shape: AttnShape,
    t: usize,
    hd: usize,
    z: usize,
    pass: usize,
    elems: usize,
    scores: usize,
    /// The mask's kernel arguments: lens (any view when causal) and the
    /// causal flag.
    mask: [Arg; 2],
}

impl Heads {
    /// `shape` passed `check_shape`: whole heads.
    fn new(shape: AttnShape, lens: Option<View>, any: Stored<View, View>) -> Heads {
        let (any, _) = stored_view(any);
        let AttnShape { b, t, c, nh, .. } = shape;
        let pass = (PASS_SCORES / (t * t).max(1)).clamp(1, b * nh);
        Heads {
            shape,
            t,
            hd: c / nh,
            z: b * nh,
            pass,
            elems: b * t * c,
            scores: pass * t * t,
            mask: match lens {
                Some(l) => [Arg::View(l), Arg::U32(0)],
                None => [Arg::View(any), Arg::U32(1)],
            },
        }
    }

    /// Part `p` (q, k, v; or the one part) of heads-first `v` from head `z0` on.
    fn block(&self, v: View, p: usize, z0: usize) -> View {
        v.tail((p * self.z + z0) * self.t * self.hd)
    }

    /// A head's (T x hd) block as a GEMM operand (column-major, ld hd:
    /// the block transposed), used `transpose`d or not.
    fn op(&self, v: View, transpose: bool) -> Operand {
        operand(v, transpose, self.hd)
    }

    /// A head's (T x T) scores as a GEMM operand, rows the queries.
    fn scores_op(&self, v: View, transpose: bool) -> Operand {
        operand(v, transpose, self.t)
    }

    /// c = op(a) (m x k) @ op(b) (k x T), column-major with ld m, for each
    /// of `n` heads: every operand's block is T times its ld apart.
    fn per_head(&self, m: usize, k: usize, [a, b]: [Operand; 2], c: View, n: usize) -> Gemm {
        let t = self.t;
        Gemm {
            batch: Batch::of(n, [a.ld * t, b.ld * t, m * t]),
            ..Gemm::new([m, t, k], [a, b], c, m, self.shape.bf16)
        }
    }

    /// A kernel's arguments: `views`, the shape, a row-wise kernel's first
    /// head of the pass `z0` (none for flash.cu's), and the mask.
    fn args(&self, views: &[Arg], z0: Option<usize>) -> Result<Vec<Arg>, GpuError> {
        let mut args = views.to_vec();
        args.extend([
            u32s("t", self.t)?,
            u32s("nh", self.shape.nh)?,
            u32s("hd", self.hd)?,
        ]);
        if let Some(z0) = z0 {
            args.push(u32s("z0", z0)?);
        }
        args.extend(self.mask);
        Ok(args)
    }

    /// flash.cu's kernel `part` (forward, dq, dkdv) over every head's rows
    /// in tiles of [`FLASH_ROWS`] ([`flash_kernel`]).
    fn flash<R: Runtime>(
        &self,
        q: &Queue<R>,
        part: &str,
        args: &[Arg],
        wide_parts: usize,
    ) -> Queued {
        let (name, parts) = flash_kernel(part, self.hd, wide_parts);
        q.launch(&name, self.z * self.t.div_ceil(FLASH_ROWS) * parts, args)
    }

    /// dst = src's `parts` between token-major (qkv's layout) and
    /// heads-first, `to_heads` or back; each stored in fp32 or bf16.
    fn permute<R: Runtime>(
        &self,
        q: &Queue<R>,
        dst: Stored<View, View>,
        src: Stored<View, View>,
        parts: usize,
        to_heads: bool,
    ) -> Result<(), GpuError> {
        let AttnShape { b, t, nh, .. } = self.shape;
        let [(dst, dst_bf16), (src, src_bf16)] = [dst, src].map(stored_view);
        let args = [
            Arg::View(dst),
            Arg::View(src),
            u32s("b", b)?,
            u32s("t", t)?,
            u32s("nh", nh)?,
            u32s("hd", self.hd)?,
            u32s("parts", parts)?,
            Arg::U32(to_heads as u32),
            Arg::U32(dst_bf16),
            Arg::U32(src_bf16),
        ];
        q.launch("attention_permute", groups(parts * self.elems), &args)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::check::randn;
    use crate::backend::ops::tests::AsIs;
    use crate::rng::Rng;

    /// A dqkv stored in bf16 is the fp32 one rounded, bit for bit, causal
    /// and padded; and it needs bf16 products, as a bf16 qkv does.
    #[test]
    fn a_bf16_dqkv_is_the_fp32_one_rounded() {
        let s = AttnShape::new((2, 40, 32, 2), true);
        let n = s.b * s.t * s.c;
        let mut rng = Rng::new(21);
        let (qkv, dout) = (randn(&mut rng, 3 * n, 1.0), randn(&mut rng, n, 1.0));
        let lens = [40u32, 17];
        for lens in [None, Some(&lens[..])] {
            let (mut out, mut lse) = (vec![0.0; n], vec![0.0; s.b * s.nh * s.t]);
            (AttentionForward::<Host> {
                out: Stored::F32(&mut out),
                lse: &mut lse,
                qkv: Stored::F32(&qkv),
                lens,
                shape: s,
            })
            .cpu(&AsIs);
            let (mut wide, mut held) = (vec![0.0; 3 * n], vec![Bf16::default(); 3 * n]);
            for dqkv in [Stored::F32(&mut wide[..]), Stored::Bf16(&mut held[..])] {
                let op = AttentionBackward::<Host> {
                    dqkv,
                    dout: &dout,
                    qkv: Stored::F32(&qkv),
                    out: Stored::F32(&out),
                    lse: &lse,
                    lens,
                    shape: s,
                };
                op.check().unwrap();
                op.cpu(&AsIs);
            }
            let rounded: Vec<Bf16> = wide.iter().map(|&x| Bf16::from_f32(x)).collect();
            assert!(held == rounded, "{lens:?}: not the fp32 dqkv rounded");
        }
        let fp32 = AttnShape { bf16: false, ..s };
        let mut held = vec![Bf16::default(); 3 * n];
        let (out, lse) = (vec![0.0; n], vec![0.0; s.b * s.nh * s.t]);
        let err = AttentionBackward::<Host> {
            dqkv: Stored::Bf16(&mut held),
            dout: &dout,
            qkv: Stored::F32(&qkv),
            out: Stored::F32(&out),
            lse: &lse,
            lens: None,
            shape: fp32,
        }
        .check()
        .unwrap_err();
        assert!(err.contains("needs bf16 products"), "{err}");
    }
}
