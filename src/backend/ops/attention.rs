//! Self-attention, forward and backward, as kernels: the flash-style
//! tiles of `cpu::attention` on the CPU and of `kernels/attention.cu` on a
//! GPU (the row log-sum-exp kept for the backward, no (T x T) buffer, no
//! atomics), causal or with a padding mask (each sequence's key count in
//! `lens`).

use super::{need, Checked, Host, Kernel, Lower, Operands, Queued};
use crate::backend::cpu::attention::{backward_masked, forward_masked, Mask, Saved};
use crate::backend::gpu::{head_dim, mask_args, u32s, Arg, Queue, Raw, Runtime, View, ATT_ROWS};
use crate::backend::profile::attention_flops;
use crate::backend::AttnShape;

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

/// Why `shape` and `lens` cannot be attended over, if they cannot: whole
/// heads, and each sequence's key count in 1..=T.
fn check_shape<O: Operands>(shape: AttnShape, lens: &Option<O::In<u32>>) -> Result<(), String> {
    let AttnShape { b, c, nh, .. } = shape;
    if nh == 0 || !c.is_multiple_of(nh) {
        return Err(format!("c = {c} is not whole heads of nh = {nh}"));
    }
    match lens {
        Some(l) => need("lens", l, b),
        None => Ok(()),
    }
}

/// The CPU's mask: causal without `lens`.
fn host_mask(lens: Option<&[u32]>) -> Mask<'_> {
    lens.map_or(Mask::Causal, Mask::Lengths)
}

impl<O: Operands> Kernel<O> for AttentionForward<O> {
    const NAME: &'static str = "attention_forward";

    fn check(&self) -> Result<(), String> {
        let AttnShape { b, t, c, nh } = self.shape;
        check_shape::<O>(self.shape, &self.lens)?;
        need("out", &self.out, b * t * c)?;
        need("lse", &self.lse, b * nh * t)?;
        need("qkv", &self.qkv, b * t * 3 * c)
    }

    fn flops(&self) -> f64 {
        attention_flops(self.shape, false)
    }

    fn cpu<'a>(self, host: &impl Lower<O, Host<'a>>) {
        let op = self.lower(host);
        forward_masked(op.out, op.lse, op.qkv, op.shape, host_mask(op.lens))
    }

    fn gpu<R: Runtime>(self, q: &Queue<R>, raw: &impl Lower<O, Raw>, _: Checked) -> Queued {
        let op = self.lower(raw);
        let views = [op.out, op.lse, op.qkv];
        launch(q, &["attention_forward"], &views, op.shape, op.lens, op.qkv)
    }
}

impl<O: Operands> Kernel<O> for AttentionBackward<O> {
    const NAME: &'static str = "attention_backward";

    fn check(&self) -> Result<(), String> {
        let AttnShape { b, t, c, nh } = self.shape;
        check_shape::<O>(self.shape, &self.lens)?;
        need("dqkv", &self.dqkv, b * t * 3 * c)?;
        need("dout", &self.dout, b * t * c)?;
        need("qkv", &self.qkv, b * t * 3 * c)?;
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
        backward_masked(op.dqkv, saved, op.shape, host_mask(op.lens))
    }

    /// Two passes writing disjoint parts of dqkv: workgroups owning keys
    /// (dk, dv), then workgroups owning queries (dq).
    fn gpu<R: Runtime>(self, q: &Queue<R>, raw: &impl Lower<O, Raw>, _: Checked) -> Queued {
        let op = self.lower(raw);
        let views = [op.dqkv, op.dout, op.qkv, op.out, op.lse];
        let passes = ["attention_backward_dkdv", "attention_backward_dq"];
        launch(q, &passes, &views, op.shape, op.lens, op.qkv)
    }
}

/// The attention kernels `passes`, in turn, each over `views`, the shape
/// and the mask (`lens`, or causal; `qkv` stands in for no lens): a
/// workgroup per `ATT_ROWS` queries of a head.
fn launch<R: Runtime>(
    q: &Queue<R>,
    passes: &[&str],
    views: &[View],
    shape: AttnShape,
    lens: Option<View>,
    qkv: View,
) -> Queued {
    let AttnShape { b, t, c, nh } = shape;
    head_dim(c, nh)?;
    let mut args: Vec<Arg> = views.iter().map(|&v| Arg::View(v)).collect();
    args.extend([u32s("t", t)?, u32s("c", c)?, u32s("nh", nh)?]);
    args.extend(mask_args(lens, qkv));
    for pass in passes {
        q.launch(pass, t.div_ceil(ATT_ROWS) * b * nh, &args)?;
    }
    Ok(())
}
