//! Multi-head self-attention, flash-style, one (batch, head) a task. The
//! forward works through blocks of query rows and, within each, tiles of
//! keys with an online softmax, so its scratch is a (BLOCK x
//! [`forward_keys`]) tile and a (BLOCK x head width) accumulator whatever
//! T is (under bf16 one tile of every key, [`tile_keys`]); it keeps only
//! the row log-sum-exp for the backward. The backward goes key tile by key
//! tile over the query rows that see it (in runs of at most [`ROWS`]),
//! recomputing the probabilities from the log-sum-exp: its scratch is two
//! (ROWS x KEYS) tiles, and under bf16 the head's rounded q, k, v and dO.
//! Every row's dO . O is computed first (B x NH x T floats). No (B, NH, T,
//! T) tensor ever exists. The mask is causal (GPT-2) or a padding mask:
//! every query of sequence b attends to its first `lens[b]` keys (an
//! encoder's bidirectional attention, BERT's).

use super::math::{dot, exp, exp_shifted_sum, gemm, row_max, widest, Mat, SendPtr};
use super::{round_to_bf16, Element};
use crate::backend::ops::{AttentionDecode, Extent, Held, Host, Stored};
use crate::backend::Bf16;
use rayon::prelude::*;
use std::ops::Range;

/// Query rows per block.
pub(super) const BLOCK: usize = 64;
/// Key columns a tile holds.
pub(super) const KEYS: usize = 64;
/// Key columns a forward tile of a head `hd` wide holds: a head narrower
/// than 64 takes tiles twice as wide, so each row's softmax and the P V
/// product run over more keys at a time (BERT-MiniLM's heads of 32 at T
/// 128: the forward 10-12% faster than in tiles of 64 inside a step;
/// GPT-2's heads of 64 were no faster in wider ones).
fn forward_keys(hd: usize) -> usize {
    if hd < 64 {
        2 * KEYS
    } else {
        KEYS
    }
}

/// The forward's key tile for `s`: under bf16 one tile takes every key, so
/// the probabilities are whole (normalized) before they are rounded for
/// P V, as a GPU's GEMM takes them.
fn tile_keys(s: AttnShape) -> usize {
    if s.bf16 {
        s.t
    } else {
        forward_keys(s.head_dim())
    }
}
/// Multiply-adds an `attention_decode` task gets at least: about a
/// microsecond, below which handing it to another thread costs more.
const DECODE_GRAIN: usize = 1 << 15;

/// A head's columns: `hd` of them in rows `stride` apart (3C in qkv), its
/// scores scaled by `scale` (1 / sqrt(hd)).
#[derive(Clone, Copy)]
struct HeadCols {
    hd: usize,
    stride: usize,
    scale: f32,
    bf16: bool,
}

impl HeadCols {
    fn of(s: AttnShape) -> Self {
        let hd = s.head_dim();
        HeadCols {
            hd,
            stride: 3 * s.c,
            scale: 1.0 / (hd as f32).sqrt(),
            bf16: s.bf16,
        }
    }
}

/// p (rows x cols) = scale * Q (rows x hd) K (cols x hd)^T, of head `h`.
///
/// # Safety
/// q and k must address `rows` and `cols` rows of `h.hd` floats at
/// `h.stride`; p must hold rows * cols floats.
unsafe fn scores(p: *mut f32, q: *const f32, k: *const f32, rows: usize, cols: usize, h: HeadCols) {
    product(
        h.bf16,
        (rows, cols, h.hd),
        Mat::new(p, cols, 1),
        Mat::new(q, h.stride, 1),
        Mat::new(k, h.stride, 1).t(),
        false,
        h.scale,
    );
}

/// `dst = [dst +] scale * lhs @ rhs`, one task's product (no threads of
/// its own): on the bf16 units (`vdpbf16ps`) where `bf16` and bf16
/// products run on them here ([`super::blas::bf16_units`]), its operands'
/// values already bf16 ones; fp32 FMAs otherwise.
///
/// # Safety
/// As `math::gemm`.
#[inline(always)]
unsafe fn product(
    bf16: bool,
    (m, n, k): (usize, usize, usize),
    dst: Mat<*mut f32>,
    lhs: Mat<*const f32>,
    rhs: Mat<*const f32>,
    accumulate: bool,
    scale: f32,
) {
    let dims = super::math::Dims { m, n, k };
    let units = bf16 && k > 0 && super::blas::bf16_units();
    if units && super::dpbf16::gemm(dims, dst, lhs, rhs, accumulate.into(), scale, 1) {
        return;
    }
    gemm(false, (m, n, k), dst, lhs, rhs, accumulate, scale, 1)
}

/// An attention's shape and arithmetic: `bf16` when its products take
/// their operands rounded to bfloat16 (q, k, v, dout, and the normalized
/// probabilities and the scores' gradient), accumulated in fp32, as a
/// GPU's tensor cores take them; every softmax, sum and lse stays fp32.
#[derive(Clone, Copy, Debug)]
pub struct AttnShape {
    pub b: usize,
    pub t: usize,
    pub c: usize,
    pub nh: usize,
    pub bf16: bool,
}

impl AttnShape {
    /// An attention of `(b, t, c, nh)`, its products in bf16 where `bf16`.
    pub fn new((b, t, c, nh): (usize, usize, usize, usize), bf16: bool) -> Self {
        AttnShape { b, t, c, nh, bf16 }
    }

    fn head_dim(&self) -> usize {
        self.c / self.nh
    }
}

/// Which keys a query sees.
#[derive(Clone, Copy, Debug)]
pub enum Mask<'a> {
    /// Query i sees keys 0..=i.
    Causal,
    /// Every query of sequence b sees keys `0..lens[b]` (`1 <= lens[b] <= T`).
    Lengths(&'a [u32]),
}

impl Mask<'_> {
    /// Keys scored for the query block of sequence bi that ends at row r1.
    fn cols(self, bi: usize, r1: usize) -> usize {
        match self {
            Mask::Causal => r1,
            Mask::Lengths(lens) => lens[bi] as usize,
        }
    }

    /// Keys query row `row` of sequence bi sees.
    fn valid(self, bi: usize, row: usize) -> usize {
        match self {
            Mask::Causal => row + 1,
            Mask::Lengths(lens) => lens[bi] as usize,
        }
    }

    /// The first query row that sees key `key` (every later one does too).
    fn first_query(self, key: usize) -> usize {
        match self {
            Mask::Causal => key,
            Mask::Lengths(_) => 0,
        }
    }

    fn check(self, b: usize, t: usize) {
        if let Mask::Lengths(lens) = self {
            assert!(
                lens.len() >= b && lens[..b].iter().all(|&l| l >= 1 && l as usize <= t),
                "each of {b} sequences attends over 1 to {t} keys: {:?}",
                &lens[..b.min(lens.len())]
            );
        }
    }
}

/// The attention forward under `mask` (qkv is (B, T, 3C) = [q | k | v]
/// per token; out is (B, T, C); lse is (B, NH, T)): for each block of query rows, the
/// keys in tiles of [`forward_keys`] with an online softmax (a running max
/// and sum per row; the output so far rescaled when a tile raises the max).
/// An `out` held in bf16 takes each value rounded; a `qkv` held in bf16
/// (bf16 products only) is read as it is.
pub(crate) fn forward_masked(
    out: Stored<&mut [f32], &mut [Bf16]>,
    lse: &mut [f32],
    qkv: Held<'_>,
    s: AttnShape,
    mask: Mask<'_>,
) {
    let AttnShape { b, t, c, nh, .. } = s;
    let hd = s.head_dim();
    assert!(qkv.extent() >= b * t * 3 * c && out.extent() >= b * t * c && lse.len() >= b * nh * t);
    assert!(s.bf16 || !qkv.is_bf16());
    mask.check(b, t);
    let out_ptr = out.map(|o| SendPtr(o.as_mut_ptr()), |o| SendPtr(o.as_mut_ptr()));
    lse[..b * nh * t]
        .par_chunks_mut(t)
        .enumerate()
        .for_each_init(
            || Tiles::new(hd, tile_keys(s)),
            |tiles, (bh, lse_row)| forward_task(tiles, bh, lse_row, qkv, out_ptr, s, mask),
        );
}

/// Head columns as the products read them: `hd` columns of `parts` parts
/// `part` values apart (q, k, v in qkv; dout's one part), rows `stride`
/// apart, from `src` on; fp32 values, or qkv's bf16 ones.
#[derive(Clone, Copy)]
struct Cols<T = f32> {
    src: *const T,
    stride: usize,
    part: usize,
    parts: usize,
}

impl Cols {
    /// These columns where the products read them: in place, or under
    /// bf16 rounded into `buf` ([`Cols::rounded`]).
    ///
    /// # Safety
    /// `src` addresses `t` rows of the parts' columns.
    #[inline(always)]
    unsafe fn for_products(self, buf: &mut Vec<f32>, t: usize, hd: usize, bf16: bool) -> Cols {
        match bf16 {
            true => self.rounded(buf, t, hd),
            false => self,
        }
    }

    /// A head's q, k, v from element `at` of `qkv` (B, T, 3C) where the
    /// products read them (`buf` as for [`Cols::for_products`]; a qkv
    /// held in bf16 is read only by bf16 products).
    ///
    /// # Safety
    /// `qkv` holds the batch's T rows from `at` on.
    #[inline(always)]
    unsafe fn qkv(qkv: Held, at: usize, buf: &mut Vec<f32>, s: AttnShape) -> Cols {
        let (c, hd) = (s.c, s.head_dim());
        match qkv {
            Stored::F32(x) => Cols::in_qkv(&x[at..], c).for_products(buf, s.t, hd, s.bf16),
            Stored::Bf16(x) => Cols::in_qkv(&x[at..], c).rounded(buf, s.t, hd),
        }
    }
}

impl<T: Element> Cols<T> {
    /// A head's q, k, v columns in qkv (B, T, 3C), from `x` on.
    fn in_qkv(x: &[T], c: usize) -> Self {
        Cols {
            src: x.as_ptr(),
            stride: 3 * c,
            part: c,
            parts: 3,
        }
    }

    /// These columns' values as bf16 products take them, into `buf` (rows
    /// of the parts side by side).
    ///
    /// # Safety
    /// As [`Cols::for_products`].
    #[inline(always)]
    unsafe fn rounded(self, buf: &mut Vec<f32>, t: usize, hd: usize) -> Cols {
        buf.resize(t * self.parts * hd, 0.0);
        for (r, row) in buf.chunks_exact_mut(self.parts * hd).enumerate() {
            for (p, dst) in row.chunks_exact_mut(hd).enumerate() {
                let src =
                    std::slice::from_raw_parts(self.src.add(r * self.stride + p * self.part), hd);
                for (d, &x) in dst.iter_mut().zip(src) {
                    *d = x.product_value();
                }
            }
        }
        Cols {
            src: buf.as_ptr(),
            stride: self.parts * hd,
            part: hd,
            parts: self.parts,
        }
    }
}

/// Rounds `x` to bf16 in place (a task's tile: no threads of its own).
#[inline(always)]
fn round_tile(x: &mut [f32]) {
    x.iter_mut().for_each(|v| *v = round_to_bf16(*v));
}

widest! {
    /// One task of [`forward_masked`]: (batch, head) `bh`'s output and its
    /// row of log-sum-exps.
    fn forward_task(
        tiles: &mut Tiles,
        bh: usize,
        lse_row: &mut [f32],
        qkv: Held<'_>,
        out_ptr: Stored<SendPtr, SendPtr<Bf16>>,
        s: AttnShape,
        mask: Mask<'_>,
    ) {
        let AttnShape { t, c, nh, .. } = s;
        let (bi, h) = (bh / nh, bh % nh);
        let keys = tile_keys(s);
        let Tiles {
            p,
            acc,
            max,
            sum,
            ops,
        } = tiles;
        // SAFETY: q, k, v address rows of this batch inside qkv; the output
        // region (batch bi, head h) belongs to this task alone.
        unsafe {
            let mut head = HeadCols::of(s);
            let hd = head.hd;
            let at = Cols::qkv(qkv, bi * t * 3 * c + h * hd, ops, s);
            head.stride = at.stride;
            let (q, k, v) = (at.src, at.src.add(at.part), at.src.add(2 * at.part));
            let o = bi * t * c + h * hd;
            for r0 in (0..t).step_by(BLOCK) {
                let r1 = (r0 + BLOCK).min(t);
                let (rows, cols) = (r1 - r0, mask.cols(bi, r1));
                max[..rows].fill(f32::NEG_INFINITY);
                sum[..rows].fill(0.0);
                acc[..rows * hd].fill(0.0);
                for c0 in (0..cols).step_by(keys) {
                    let kw = keys.min(cols - c0);
                    let pp = p.as_mut_ptr();
                    let sr = head.stride;
                    scores(pp, q.add(r0 * sr), k.add(c0 * sr), rows, kw, head);
                    for i in 0..rows {
                        let row = &mut p[i * kw..(i + 1) * kw];
                        let seen = mask.valid(bi, r0 + i).saturating_sub(c0).min(kw);
                        row[seen..].fill(0.0);
                        if seen == 0 {
                            continue;
                        }
                        let new_max = max[i].max(row_max(&row[..seen]));
                        let part = exp_shifted_sum(&mut row[..seen], new_max);
                        if max[i] != f32::NEG_INFINITY && new_max != max[i] {
                            let shrink = exp(max[i] - new_max);
                            sum[i] *= shrink;
                            acc[i * hd..(i + 1) * hd]
                                .iter_mut()
                                .for_each(|x| *x *= shrink);
                        }
                        sum[i] += part;
                        max[i] = new_max;
                        if s.bf16 {
                            // the only tile: the row's max and sum are whole
                            row[..seen].iter_mut().for_each(|x| *x /= sum[i]);
                            round_tile(&mut row[..seen]);
                        }
                    }
                    product(
                        s.bf16,
                        (rows, hd, kw),
                        Mat::new(acc.as_mut_ptr(), hd, 1),
                        Mat::new(pp as *const f32, kw, 1),
                        Mat::new(v.add(c0 * sr), sr, 1),
                        true,
                        1.0,
                    );
                }
                for i in 0..rows {
                    lse_row[r0 + i] = max[i] + sum[i].ln();
                    let inv = if s.bf16 { 1.0 } else { 1.0 / sum[i] };
                    let row = acc[i * hd..(i + 1) * hd].iter().map(|&a| a * inv);
                    let at = o + (r0 + i) * c;
                    match out_ptr {
                        Stored::F32(o) => o.slice(at, hd).iter_mut().zip(row).for_each(|(d, a)| *d = a),
                        Stored::Bf16(o) => o.slice(at, hd).iter_mut().zip(row).for_each(|(d, a)| *d = Bf16::from_f32(a)),
                    }
                }
            }
        }
    }
}

/// A forward task's scratch: a (BLOCK x [`tile_keys`]) tile of
/// probabilities, the (BLOCK x hd) output accumulator and its rows' running
/// max and sum; under bf16 the head's q, k, v rounded (`Cols`).
struct Tiles {
    p: Vec<f32>,
    acc: Vec<f32>,
    max: Vec<f32>,
    sum: Vec<f32>,
    ops: Vec<f32>,
}

impl Tiles {
    fn new(hd: usize, keys: usize) -> Self {
        Tiles {
            p: vec![0.0; BLOCK * keys],
            acc: vec![0.0; BLOCK * hd],
            max: vec![0.0; BLOCK],
            sum: vec![0.0; BLOCK],
            ops: Vec::new(),
        }
    }
}

/// Query rows a backward product spans at most (for longer sequences a key
/// tile's rows go in runs of this many): the probabilities and their
/// gradient for a tile stay (ROWS x KEYS) whatever T is.
pub(super) const ROWS: usize = 256;

/// What the attention backward reads: dout (B, T, C), and the forward's
/// qkv (B, T, 3C; fp32, or bf16 under bf16 products), out (B, T, C; fp32
/// or bf16) and lse (B, NH, T).
#[derive(Clone, Copy)]
pub(crate) struct Saved<'a> {
    pub dout: &'a [f32],
    pub qkv: Held<'a>,
    pub out: Held<'a>,
    pub lse: &'a [f32],
}

/// The attention backward under `mask`: dqkv (B, T, 3C) overwritten.
pub(crate) fn backward_masked(dqkv: &mut [f32], saved: Saved<'_>, s: AttnShape, mask: Mask<'_>) {
    backward_in_runs(dqkv, saved, s, mask, ROWS)
}

/// [`backward_masked`] with a key tile's query rows in runs of `run`: for
/// each tile of keys, every query row that sees it (a run at a time) gets
/// its probabilities again from the kept log-sum-exp, then dP, dS and its
/// share of dQ; the tile's dV and dK are products over all those rows, so
/// each is written once, by a product as deep as the rows that see it.
fn backward_in_runs(dqkv: &mut [f32], saved: Saved<'_>, s: AttnShape, mask: Mask<'_>, run: usize) {
    let AttnShape { b, t, c, nh, .. } = s;
    let Saved { dout, out, .. } = saved;
    assert!(dqkv.len() >= b * t * 3 * c && dout.len() >= b * t * c && out.extent() >= b * t * c);
    assert!(saved.qkv.extent() >= b * t * 3 * c && saved.lse.len() >= b * nh * t);
    assert!(s.bf16 || !saved.qkv.is_bf16());
    assert!(run > 0);
    mask.check(b, t);
    let hd = s.head_dim();
    // dO . O of every row of every head (b, h, t), from the fp32 values
    // (a bf16 row widened into the task's scratch)
    let dsum: Vec<f32> = (0..b * nh * t)
        .into_par_iter()
        .map_init(
            || vec![0.0; hd],
            |wide, i| {
                let (bi, h, tt) = (i / (nh * t), i / t % nh, i % t);
                let at = (bi * t + tt) * c + h * hd;
                let o = match out.part(at..at + hd) {
                    Stored::F32(o) => o,
                    Stored::Bf16(o) => {
                        wide.iter_mut().zip(o).for_each(|(w, x)| *w = x.to_f32());
                        wide
                    }
                };
                dot(&dout[at..at + hd], o)
            },
        )
        .collect();
    let inputs = Inputs {
        qkv: saved.qkv,
        dout,
        lse: saved.lse,
        dsum: &dsum,
    };
    let dqkv_ptr = SendPtr(dqkv.as_mut_ptr());
    let tile = run.min(t) * KEYS;
    (0..b * nh).into_par_iter().for_each_init(
        || Scratch {
            p: vec![0.0; tile],
            dp: vec![0.0; tile],
            ops: Vec::new(),
            dops: Vec::new(),
        },
        |scratch, bh| backward_task(scratch, bh, run, dqkv_ptr, inputs, s, mask),
    );
}

/// What the backward tasks read: qkv (B, T, 3C), dO (B, T, C), and every
/// row's lse and dO . O (B, NH, T).
#[derive(Clone, Copy)]
struct Inputs<'a> {
    qkv: Held<'a>,
    dout: &'a [f32],
    lse: &'a [f32],
    dsum: &'a [f32],
}

/// A backward task's scratch: a run's probabilities and their gradient
/// (`run` x KEYS); under bf16 the head's q, k, v and dO rounded (`Cols`).
struct Scratch {
    p: Vec<f32>,
    dp: Vec<f32>,
    ops: Vec<f32>,
    dops: Vec<f32>,
}

widest! {
    /// One task of [`backward_in_runs`]: (batch, head) `bh`'s share of
    /// dqkv, its query rows in runs of `run`.
    fn backward_task(
        scratch: &mut Scratch,
        bh: usize,
        run: usize,
        dqkv_ptr: SendPtr,
        inputs: Inputs<'_>,
        s: AttnShape,
        mask: Mask<'_>,
    ) {
        let AttnShape { t, c, nh, .. } = s;
        let mut cols = HeadCols::of(s);
        let (bi, h, hd) = (bh / nh, bh % nh, cols.hd);
        let Scratch { p, dp, ops, dops } = scratch;
        // SAFETY: all pointers address batch bi inside their buffers; the
        // gradient region (batch bi, head h) belongs to this task alone.
        unsafe {
            let qkv = Cols::qkv(inputs.qkv, bi * t * 3 * c + h * hd, ops, s);
            let d_o = Cols {
                src: inputs.dout.as_ptr().add(bi * t * c + h * hd),
                stride: c,
                part: 0,
                parts: 1,
            };
            cols.stride = qkv.stride;
            let head = Head {
                qkv,
                d_o: d_o.for_products(dops, t, hd, s.bf16),
                dq: dqkv_ptr.get().add(bi * t * 3 * c + h * hd),
                c,
                cols,
                lse: &inputs.lse[bh * t..(bh + 1) * t],
                dsum: &inputs.dsum[bh * t..(bh + 1) * t],
                bf16: s.bf16,
            };
            // the keys the sequence's last query block scores: every
            // key some query sees
            let keys = mask.cols(bi, t);
            for c0 in (0..keys).step_by(KEYS) {
                let tile = c0..keys.min(c0 + KEYS);
                let first = mask.first_query(c0);
                for r0 in (first..t).step_by(run) {
                    let rows = r0..t.min(r0 + run);
                    let seen = |r| mask.valid(bi, r).saturating_sub(c0).min(tile.len());
                    head.probabilities(p, tile.clone(), rows.clone(), seen);
                    head.gradients(p, dp, tile.clone(), rows, r0 > first);
                }
            }
            // keys no query saw (past a sequence's length)
            for tt in keys..t {
                std::ptr::write_bytes(head.dq.add(c + tt * 3 * c), 0, hd);
                std::ptr::write_bytes(head.dq.add(2 * c + tt * 3 * c), 0, hd);
            }
        }
    }
}

/// A backward task's (batch, head): its q, k, v and dO where the products
/// read them (`cols.stride` is qkv's), where its rows start in dqkv (parts
/// `c` apart, rows 3c), and the rows' log-sum-exps and dO . O.
struct Head<'a> {
    qkv: Cols,
    d_o: Cols,
    dq: *mut f32,
    c: usize,
    cols: HeadCols,
    lse: &'a [f32],
    dsum: &'a [f32],
    /// Whether the products take P and dS rounded to bf16.
    bf16: bool,
}

impl Head<'_> {
    /// p (rows x tile) = the probabilities of query `rows` over key `tile`,
    /// again from the kept log-sum-exps; a row's keys past the `seen(row)`
    /// first of the tile are 0.
    ///
    /// # Safety
    /// The head's pointers address T rows; p holds rows x tile floats.
    #[inline(always)]
    unsafe fn probabilities(
        &self,
        p: &mut [f32],
        tile: Range<usize>,
        rows: Range<usize>,
        seen: impl Fn(usize) -> usize,
    ) {
        let (kw, stride, q) = (tile.len(), self.cols.stride, self.qkv.src);
        let (q_run, k_tile) = (
            q.add(rows.start * stride),
            q.add(self.qkv.part + tile.start * stride),
        );
        scores(p.as_mut_ptr(), q_run, k_tile, rows.len(), kw, self.cols);
        for (i, r) in rows.enumerate() {
            let row = &mut p[i * kw..(i + 1) * kw];
            let (seen, l) = (seen(r), self.lse[r]);
            row[..seen].iter_mut().for_each(|x| *x = exp(*x - l));
            row[seen..].fill(0.0);
        }
    }

    /// From the probabilities `p` of query `rows` over key `tile`: dP and
    /// dS in `dp`, the tile's dV and dK (set, or added `onto` what earlier
    /// runs wrote), and the rows' share of dQ. Under bf16 P and dS are
    /// rounded (in place) once dS is made, before the products take them.
    ///
    /// # Safety
    /// As [`Head::probabilities`]; no other task writes this head's rows of
    /// dqkv.
    #[inline(always)]
    unsafe fn gradients(
        &self,
        p: &mut [f32],
        dp: &mut [f32],
        tile: Range<usize>,
        rows: Range<usize>,
        onto: bool,
    ) {
        let (c, hd, rs, scale) = (self.c, self.cols.hd, self.cols.stride, self.cols.scale);
        let (kw, n, c0, r0) = (tile.len(), rows.len(), tile.start, rows.start);
        let (q, part, ws, dos) = (self.qkv.src, self.qkv.part, 3 * c, self.d_o.stride);
        let (k_tile, v_tile) = (q.add(part + c0 * rs), q.add(2 * part + c0 * rs));
        let (q_run, d_o_run) = (q.add(r0 * rs), self.d_o.src.add(r0 * dos));
        // dP = dO[run] V[tile]^T
        product(
            self.bf16,
            (n, kw, hd),
            Mat::new(dp.as_mut_ptr(), kw, 1),
            Mat::new(d_o_run, dos, 1),
            Mat::new(v_tile, rs, 1).t(),
            false,
            1.0,
        );
        for i in 0..n {
            let d = self.dsum[r0 + i];
            let prow = &p[i * kw..(i + 1) * kw];
            let drow = &mut dp[i * kw..(i + 1) * kw];
            for (ds, &pp) in drow.iter_mut().zip(prow) {
                *ds = pp * (*ds - d) * scale;
            }
        }
        if self.bf16 {
            round_tile(&mut p[..n * kw]);
            round_tile(&mut dp[..n * kw]);
        }
        let (pp, ds) = (p.as_ptr(), dp.as_ptr());
        // dV[tile] (+)= P^T dO[run]
        product(
            self.bf16,
            (kw, hd, n),
            Mat::new(self.dq.add(2 * c + c0 * ws), ws, 1),
            Mat::new(pp, kw, 1).t(),
            Mat::new(d_o_run, dos, 1),
            onto,
            1.0,
        );
        // dQ[run] += dS K[tile]; the first tile sets it (every query sees
        // key 0)
        product(
            self.bf16,
            (n, hd, kw),
            Mat::new(self.dq.add(r0 * ws), ws, 1),
            Mat::new(ds, kw, 1),
            Mat::new(k_tile, rs, 1),
            c0 > 0,
            1.0,
        );
        // dK[tile] (+)= dS^T Q[run]
        product(
            self.bf16,
            (kw, hd, n),
            Mat::new(self.dq.add(c + c0 * ws), ws, 1),
            Mat::new(ds, kw, 1).t(),
            Mat::new(q_run, rs, 1),
            onto,
            1.0,
        );
    }
}

/// Shape of one decoding step: `b` rows, each attending over `len` cached
/// positions of a (b, max_t, c) key/value cache.
#[derive(Clone, Copy, Debug)]
pub struct DecodeShape {
    pub b: usize,
    pub len: usize,
    pub c: usize,
    pub nh: usize,
    pub max_t: usize,
}

/// A decoding task's cached keys and values: positions 0..len.
#[derive(Clone, Copy)]
struct Cache<'a> {
    k: &'a [f32],
    v: &'a [f32],
    len: usize,
}

/// How a decoding task computes one head: with AVX2 + FMA where the build
/// has them and the head's width is whole vectors, in plain Rust otherwise.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum HeadKernel {
    Portable,
    #[cfg(avx2_fma)]
    Avx2,
}

impl HeadKernel {
    /// Every kernel this build can run for heads of `hd` values, fastest first.
    fn available(hd: usize) -> Vec<HeadKernel> {
        let mut out = Vec::new();
        #[cfg(avx2_fma)]
        if hd.is_multiple_of(8) {
            out.push(HeadKernel::Avx2);
        }
        let _ = hd;
        out.push(HeadKernel::Portable);
        out
    }

    /// For each of `heads` heads of `hd` values side by side: o = softmax(scale
    /// q . k(t), t < len) weighted sum of v(t), with position t's keys and
    /// values `stride` floats after position t - 1's (`cols`, `cache`);
    /// `scores` is heads x len floats of scratch.
    fn heads(self, o: &mut [f32], q: &[f32], cache: Cache<'_>, cols: HeadCols, scores: &mut [f32]) {
        let HeadCols {
            hd, stride, scale, ..
        } = cols;
        let Cache { k, v, len } = cache;
        let width = o.len();
        assert!(len > 0 && q.len() == width && width.is_multiple_of(hd));
        let used = (len - 1) * stride + width;
        let (k, v, scores) = (&k[..used], &v[..used], &mut scores[..width / hd * len]);
        match self {
            HeadKernel::Portable => {
                for (h, scores) in scores.chunks_exact_mut(len).enumerate() {
                    let q = &q[h * hd..][..hd];
                    for (t, s) in scores.iter_mut().enumerate() {
                        *s = dot(q, &k[t * stride + h * hd..][..hd]) * scale;
                    }
                }
            }
            // SAFETY: the build has AVX2 and FMA; hd is whole vectors
            // (`available`) and k holds len positions (sliced above).
            #[cfg(avx2_fma)]
            HeadKernel::Avx2 => unsafe { x86::scores(scores, q, k, hd, stride, scale) },
        }
        for (h, (o, p)) in o
            .chunks_exact_mut(hd)
            .zip(scores.chunks_exact_mut(len))
            .enumerate()
        {
            let total = exp_shifted_sum(p, row_max(p));
            let v = &v[h * hd..];
            match self {
                HeadKernel::Portable => {
                    o.fill(0.0);
                    for (t, &p) in p.iter().enumerate() {
                        let v = &v[t * stride..][..hd];
                        o.iter_mut().zip(v).for_each(|(o, &v)| *o += p * v);
                    }
                }
                // SAFETY: as above, v holding len positions.
                #[cfg(avx2_fma)]
                HeadKernel::Avx2 => unsafe { x86::weighted(o, p, v, stride) },
            }
            let inv = 1.0 / total;
            o.iter_mut().for_each(|o| *o *= inv);
        }
    }
}

/// One query per row against the KV cache: qkv (b, 3c) supplies the
/// queries; kcache, vcache are (b, max_t, c); out is (b, c). A task takes a
/// row and a run of its heads ([`HeadKernel::heads`]).
pub fn attention_decode(op: AttentionDecode<Host<'_>>) {
    let AttentionDecode {
        out,
        qkv,
        kcache,
        vcache,
        shape,
    } = op;
    let kernel = HeadKernel::available(shape.c / shape.nh)[0];
    attention_decode_by(kernel, out, qkv, kcache, vcache, shape);
}

/// [`attention_decode`] by `kernel`.
fn attention_decode_by(
    kernel: HeadKernel,
    out: &mut [f32],
    qkv: &[f32],
    kcache: &[f32],
    vcache: &[f32],
    s: DecodeShape,
) {
    let DecodeShape {
        b,
        len,
        c,
        nh,
        max_t,
    } = s;
    let hd = c / nh;
    // position t's keys and values are a row of the cache, c wide
    let cols = HeadCols {
        hd,
        stride: c,
        scale: 1.0 / (hd as f32).sqrt(),
        bf16: false,
    };
    assert!(len <= max_t && kcache.len() >= b * max_t * c && out.len() >= b * c);
    assert!(vcache.len() >= b * max_t * c && qkv.len() >= b * 3 * c);
    if len == 0 {
        // nothing to attend to
        out[..b * c].fill(0.0);
        return;
    }
    // Enough tasks for every thread: split a row's heads only when rows are few.
    let want = 2 * rayon::current_num_threads();
    let split = (1..=nh)
        .find(|&d| nh % d == 0 && b * d >= want)
        .unwrap_or(nh);
    let heads = nh / split;
    // a task's multiply-adds (scores and the weighted sum of values)
    let work = 2 * heads * hd * len;
    out[..b * c]
        .par_chunks_mut(heads * hd)
        .enumerate()
        .with_min_len(DECODE_GRAIN.div_ceil(work))
        .for_each_init(
            || vec![0.0f32; heads * len],
            |scores, (task, o)| {
                let (r, h0) = (task / split, (task % split) * heads);
                let q = &qkv[r * 3 * c + h0 * hd..][..heads * hd];
                let at = r * max_t * c + h0 * hd;
                let cache = Cache {
                    k: &kcache[at..],
                    v: &vcache[at..],
                    len,
                };
                kernel.heads(o, q, cache, cols, scores);
            },
        );
}

#[cfg(avx2_fma)]
mod x86 {
    use std::arch::x86_64::*;

    /// Lane j: the sum of `a[j]`'s lanes.
    #[inline(always)]
    unsafe fn sums(a: [__m256; 8]) -> __m256 {
        let (h01, h23) = (_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
        let (h45, h67) = (_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
        // lanes: 0-3 the low halves' sums of a[0..4], 4-7 their high halves'
        let (h03, h47) = (_mm256_hadd_ps(h01, h23), _mm256_hadd_ps(h45, h67));
        let low = _mm256_permute2f128_ps::<0x20>(h03, h47);
        let high = _mm256_permute2f128_ps::<0x31>(h03, h47);
        _mm256_add_ps(low, high)
    }

    /// scores[h len + t] = scale x q(h) . k(t, h) for each head h of q's
    /// hd-value heads, eight positions at a time, all heads of a block of
    /// positions before the next (a few KiB of keys read in order); each
    /// score summed in one vector of lanes (hd a multiple of 8).
    ///
    /// # Safety
    /// The CPU must have AVX2 and FMA; k holds len = scores.len() / heads
    /// positions of q.len() values `stride` apart.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn scores(
        scores: &mut [f32],
        q: &[f32],
        k: &[f32],
        hd: usize,
        stride: usize,
        scale: f32,
    ) {
        let heads = q.len() / hd;
        let len = scores.len() / heads;
        debug_assert!(hd.is_multiple_of(8) && k.len() >= (len - 1) * stride + q.len());
        let (qp, kp) = (q.as_ptr(), k.as_ptr());
        let scale = _mm256_set1_ps(scale);
        for t0 in (0..len).step_by(8) {
            let n = (len - t0).min(8);
            // a last block of fewer positions repeats its last one
            let rows: [*const f32; 8] =
                std::array::from_fn(|j| kp.add((t0 + j.min(n - 1)) * stride));
            for h in 0..heads {
                let mut acc = [_mm256_setzero_ps(); 8];
                for d in (h * hd..(h + 1) * hd).step_by(8) {
                    let qv = _mm256_loadu_ps(qp.add(d));
                    for (acc, row) in acc.iter_mut().zip(rows) {
                        *acc = _mm256_fmadd_ps(qv, _mm256_loadu_ps(row.add(d)), *acc);
                    }
                }
                let s = _mm256_mul_ps(sums(acc), scale);
                let out = &mut scores[h * len + t0..][..n];
                if n == 8 {
                    _mm256_storeu_ps(out.as_mut_ptr(), s);
                } else {
                    let mut lanes = [0.0f32; 8];
                    _mm256_storeu_ps(lanes.as_mut_ptr(), s);
                    out.copy_from_slice(&lanes[..n]);
                }
            }
        }
    }

    /// o = the sum of `p[t]` v(t), up to 32 of o's values at a time held in
    /// registers over every position (o's width a multiple of 8).
    ///
    /// # Safety
    /// As [`scores`], v holding p.len() positions of o.len() values.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn weighted(o: &mut [f32], p: &[f32], v: &[f32], stride: usize) {
        let hd = o.len();
        debug_assert!(hd.is_multiple_of(8) && v.len() >= (p.len() - 1) * stride + hd);
        for d0 in (0..hd).step_by(32) {
            let (o, v) = (o.as_mut_ptr().add(d0), v.as_ptr().add(d0));
            match (hd - d0).min(32) / 8 {
                1 => columns::<1>(o, p, v, stride),
                2 => columns::<2>(o, p, v, stride),
                3 => columns::<3>(o, p, v, stride),
                _ => columns::<4>(o, p, v, stride),
            }
        }
    }

    /// [`weighted`] for W vectors of o's values at o: even and odd
    /// positions in two sets of sums, so that at least eight chains of
    /// multiply-adds are in flight (an FMA waits 4 cycles for its sum, and
    /// two issue a cycle).
    #[inline(always)]
    unsafe fn columns<const W: usize>(o: *mut f32, p: &[f32], v: *const f32, stride: usize) {
        let mut even = [_mm256_setzero_ps(); W];
        let mut odd = [_mm256_setzero_ps(); W];
        let add = |acc: &mut [__m256; W], p: f32, row: *const f32| {
            let pv = _mm256_set1_ps(p);
            for (i, acc) in acc.iter_mut().enumerate() {
                *acc = _mm256_fmadd_ps(pv, _mm256_loadu_ps(row.add(8 * i)), *acc);
            }
        };
        let pairs = p.chunks_exact(2);
        if let [last] = pairs.remainder() {
            add(&mut even, *last, v.add((p.len() - 1) * stride));
        }
        for (t, pair) in pairs.enumerate() {
            add(&mut even, pair[0], v.add(2 * t * stride));
            add(&mut odd, pair[1], v.add((2 * t + 1) * stride));
        }
        for (i, (e, d)) in even.iter().zip(&odd).enumerate() {
            _mm256_storeu_ps(o.add(8 * i), _mm256_add_ps(*e, *d));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::check::*;
    use super::super::math::on_each_width;
    use super::*;
    use crate::rng::Rng;

    fn reference(qkv: &[f64], s: AttnShape) -> Vec<f64> {
        reference_masked(qkv, s, Mask::Causal)
    }

    /// Attention in f64 with every score materialised.
    fn reference_masked(qkv: &[f64], s: AttnShape, mask: Mask<'_>) -> Vec<f64> {
        let AttnShape { b, t, c, nh, .. } = s;
        let hd = c / nh;
        let mut out = vec![0.0; b * t * c];
        for bi in 0..b {
            for h in 0..nh {
                let at = |tt: usize, part: usize, d: usize| {
                    qkv[(bi * t + tt) * 3 * c + part * c + h * hd + d]
                };
                for tq in 0..t {
                    let keys = mask.valid(bi, tq);
                    let scores: Vec<f64> = (0..keys)
                        .map(|tk| {
                            (0..hd).map(|d| at(tq, 0, d) * at(tk, 1, d)).sum::<f64>()
                                / (hd as f64).sqrt()
                        })
                        .collect();
                    let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let e: Vec<f64> = scores.iter().map(|x| (x - max).exp()).collect();
                    let z: f64 = e.iter().sum();
                    for d in 0..hd {
                        out[(bi * t + tq) * c + h * hd + d] =
                            (0..keys).map(|tk| e[tk] / z * at(tk, 2, d)).sum();
                    }
                }
            }
        }
        out
    }

    /// `x` as a bf16 product takes it, in f64.
    fn bf(x: f64) -> f64 {
        super::super::round_to_bf16(x as f32) as f64
    }

    /// The bf16 attention's forward out and backward dqkv in f64, the
    /// products' operands rounded where `AttnShape::bf16` says (q, k, v,
    /// dout, the normalized P, dS), everything else exact.
    fn reference_bf16(qkv: &[f32], dout: &[f32], s: AttnShape, mask: Mask<'_>) -> [Vec<f64>; 2] {
        let AttnShape { b, t, c, nh, .. } = s;
        let (hd, scale) = (c / nh, 1.0 / ((c / nh) as f64).sqrt());
        let (mut out, mut dqkv) = (vec![0.0; b * t * c], vec![0.0; b * t * 3 * c]);
        for bi in 0..b {
            for h in 0..nh {
                let x = |tt: usize, part: usize, d: usize| {
                    bf(qkv[(bi * t + tt) * 3 * c + part * c + h * hd + d] as f64)
                };
                let o_at = |tt: usize, d: usize| (bi * t + tt) * c + h * hd + d;
                let g = |tt: usize, part: usize, d: usize| {
                    (bi * t + tt) * 3 * c + part * c + h * hd + d
                };
                let mut p = vec![vec![0.0; t]; t];
                for i in 0..t {
                    let n = mask.valid(bi, i);
                    let sc: Vec<f64> = (0..n)
                        .map(|j| (0..hd).map(|d| x(i, 0, d) * x(j, 1, d)).sum::<f64>() * scale)
                        .collect();
                    let m = sc.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let z: f64 = sc.iter().map(|v| (v - m).exp()).sum();
                    for j in 0..n {
                        p[i][j] = (sc[j] - m).exp() / z;
                    }
                    for d in 0..hd {
                        out[o_at(i, d)] = (0..n).map(|j| bf(p[i][j]) * x(j, 2, d)).sum();
                    }
                }
                for i in 0..t {
                    let n = mask.valid(bi, i);
                    let dd: f64 = (0..hd)
                        .map(|d| dout[o_at(i, d)] as f64 * out[o_at(i, d)])
                        .sum();
                    for j in 0..n {
                        let dp: f64 = (0..hd)
                            .map(|d| bf(dout[o_at(i, d)] as f64) * x(j, 2, d))
                            .sum();
                        let ds = bf(p[i][j] * (dp - dd) * scale);
                        let pr = bf(p[i][j]);
                        for d in 0..hd {
                            dqkv[g(j, 2, d)] += pr * bf(dout[o_at(i, d)] as f64);
                            dqkv[g(i, 0, d)] += ds * x(j, 1, d);
                            dqkv[g(j, 1, d)] += ds * x(i, 0, d);
                        }
                    }
                }
            }
        }
        [out, dqkv]
    }

    /// The share of elements off `want` by more than 1e-5 (relative, and
    /// absolute under 1), and the largest error in the same measure.
    fn spread_of(got: &[f32], want: &[f64]) -> (f64, f64) {
        let errs: Vec<f64> = got
            .iter()
            .zip(want)
            .map(|(&g, &w)| (g as f64 - w).abs() / w.abs().max(1.0))
            .collect();
        let off = errs.iter().filter(|&&e| e > 1e-5).count() as f64 / errs.len() as f64;
        (off, errs.iter().cloned().fold(0.0, f64::max))
    }

    /// Under bf16 the CPU's attention is the reference's: every element
    /// within fp32's rounding but the few where P or dS sat on a bf16
    /// rounding boundary (a different summation order rounds them the
    /// other way: one bf16 step, 2^-8 of the term); and far off fp32's
    /// attention, so the rounding is really there.
    #[test]
    fn bf16_attention_rounds_its_products_operands() {
        let lens = [70u32, 23];
        for mask in [Mask::Causal, Mask::Lengths(&lens)] {
            let s = AttnShape::new((2, 70, 64, 2), true);
            let n = s.b * s.t * s.c;
            let mut rng = Rng::new(31);
            let qkv = randn(&mut rng, 3 * n, 1.0);
            let dout = randn(&mut rng, n, 1.0);
            let [want_out, want_dqkv] = reference_bf16(&qkv, &dout, s, mask);
            for bf16 in [true, false] {
                let s = AttnShape { bf16, ..s };
                let (mut out, mut lse) = (vec![0.0; n], vec![0.0; s.b * s.nh * s.t]);
                forward_masked(Stored::F32(&mut out), &mut lse, Stored::F32(&qkv), s, mask);
                let mut dqkv = vec![0.0; 3 * n];
                let saved = Saved {
                    dout: &dout,
                    qkv: Stored::F32(&qkv),
                    out: Stored::F32(&out),
                    lse: &lse,
                };
                backward_masked(&mut dqkv, saved, s, mask);
                for (what, got, want) in [("out", &out, &want_out), ("dqkv", &dqkv, &want_dqkv)] {
                    let (off, worst) = spread_of(got, want);
                    eprintln!("{mask:?} bf16 {bf16} {what}: {off:.4} off, worst {worst:.2e}");
                    if bf16 {
                        assert!(off < 0.01 && worst < 1.0 / 128.0, "{mask:?} {what}");
                    } else {
                        assert!(off > 0.5, "{mask:?} fp32 {what} is the bf16 reference's");
                    }
                }
            }
        }
    }

    /// An output stored in bf16 is the fp32 output rounded, bit for bit,
    /// and the backward reading it gives what its values held in fp32
    /// give: causal and padded, more than one row block, products in bf16
    /// and in fp32.
    #[test]
    fn a_bf16_output_is_the_fp32_output_rounded() {
        let lens = [130u32, 23];
        for mask in [Mask::Causal, Mask::Lengths(&lens)] {
            for bf16 in [true, false] {
                let s = AttnShape::new((2, 130, 64, 2), bf16);
                let n = s.b * s.t * s.c;
                let mut rng = Rng::new(32);
                let (qkv, dout) = (randn(&mut rng, 3 * n, 1.0), randn(&mut rng, n, 1.0));
                let mut lse = vec![0.0; s.b * s.nh * s.t];
                let mut out = vec![0.0; n];
                forward_masked(Stored::F32(&mut out), &mut lse, Stored::F32(&qkv), s, mask);
                let mut held = vec![Bf16::default(); n];
                let mut lse2 = vec![0.0; s.b * s.nh * s.t];
                forward_masked(
                    Stored::Bf16(&mut held),
                    &mut lse2,
                    Stored::F32(&qkv),
                    s,
                    mask,
                );
                let rounded: Vec<Bf16> = out.iter().map(|&v| Bf16::from_f32(v)).collect();
                assert!(held == rounded, "{mask:?} bf16 {bf16}: out");
                assert!(lse == lse2, "{mask:?} bf16 {bf16}: lse");
                let wide: Vec<f32> = held.iter().map(|x| x.to_f32()).collect();
                let grads = [Stored::F32(&wide[..]), Stored::Bf16(&held[..])].map(|out| {
                    let mut dqkv = vec![0.0; 3 * n];
                    let (dout, lse) = (&dout[..], &lse[..]);
                    let saved = Saved {
                        dout,
                        qkv: Stored::F32(&qkv),
                        out,
                        lse,
                    };
                    backward_masked(&mut dqkv, saved, s, mask);
                    dqkv
                });
                assert!(grads[0] == grads[1], "{mask:?} bf16 {bf16}: dqkv");
            }
        }
    }

    /// A qkv held in bf16 (the qkv product's output under `--precision
    /// bf16`) gives the bits its values held in fp32 give, forward and
    /// backward: bf16 products read the same values either way.
    #[test]
    fn a_bf16_qkv_gives_what_its_values_in_fp32_give() {
        let lens = [130u32, 23];
        for mask in [Mask::Causal, Mask::Lengths(&lens)] {
            let s = AttnShape::new((2, 130, 64, 2), true);
            let n = s.b * s.t * s.c;
            let mut rng = Rng::new(33);
            let dout = randn(&mut rng, n, 1.0);
            let held: Vec<Bf16> = randn(&mut rng, 3 * n, 1.0)
                .into_iter()
                .map(Bf16::from_f32)
                .collect();
            let wide: Vec<f32> = held.iter().map(|x| x.to_f32()).collect();
            let [a, b] = [Stored::F32(&wide[..]), Stored::Bf16(&held[..])].map(|qkv| {
                let (mut out, mut lse) = (vec![0.0; n], vec![0.0; s.b * s.nh * s.t]);
                forward_masked(Stored::F32(&mut out), &mut lse, qkv, s, mask);
                let mut dqkv = vec![0.0; 3 * n];
                let saved = Saved {
                    dout: &dout,
                    qkv,
                    out: Stored::F32(&out),
                    lse: &lse,
                };
                backward_masked(&mut dqkv, saved, s, mask);
                [out, lse, dqkv]
            });
            for (what, i) in [("out", 0), ("lse", 1), ("dqkv", 2)] {
                assert!(a[i] == b[i], "{mask:?}: {what}");
            }
        }
    }

    /// The attention's tasks give the same bits on every instruction set
    /// this CPU runs them on (`widest!`): forward and backward, causal and
    /// padded, over several row blocks and key tiles with ragged edges.
    #[test]
    fn attention_gives_the_same_bits_on_every_instruction_set() {
        let s = AttnShape::new((2, 150, 64, 2), false);
        let (n, lens) = (s.b * s.t * s.c, [150u32, 71]);
        let mut rng = Rng::new(12);
        let qkv = randn(&mut rng, 3 * n, 2.0);
        let dout = randn(&mut rng, n, 1.0);
        for mask in [Mask::Causal, Mask::Lengths(&lens)] {
            let bits = on_each_width(|| {
                let (mut out, mut lse) = (vec![0.0; n], vec![0.0; s.b * s.nh * s.t]);
                forward_masked(Stored::F32(&mut out), &mut lse, Stored::F32(&qkv), s, mask);
                let mut dqkv = vec![0.0; 3 * n];
                let saved = Saved {
                    dout: &dout,
                    qkv: Stored::F32(&qkv),
                    out: Stored::F32(&out),
                    lse: &lse,
                };
                backward_in_runs(&mut dqkv, saved, s, mask, 64);
                [out, lse, dqkv]
                    .concat()
                    .iter()
                    .map(|x| x.to_bits())
                    .collect::<Vec<_>>()
            });
            assert!(bits.windows(2).all(|w| w[0] == w[1]), "{mask:?}");
        }
    }

    fn check(s: AttnShape, seed: u64) {
        check_masked(s, seed, Mask::Causal)
    }

    fn check_masked(s: AttnShape, seed: u64, mask: Mask<'_>) {
        check_spread(s, seed, mask, 1.0)
    }

    /// [`check_masked`] with inputs of standard deviation `spread`: the
    /// larger, the further apart the scores, and the more often a later
    /// key tile raises a row's running max.
    fn check_spread(s: AttnShape, seed: u64, mask: Mask<'_>, spread: f64) {
        let AttnShape { b, t, c, nh, .. } = s;
        let mut rng = Rng::new(seed);
        let qkv = randn(&mut rng, b * t * 3 * c, spread);
        let probe = randn(&mut rng, b * t * c, 1.0);
        let mut out = vec![0.0; b * t * c];
        let mut lse = vec![0.0; b * nh * t];
        forward_masked(Stored::F32(&mut out), &mut lse, Stored::F32(&qkv), s, mask);
        assert_close("out", &out, &reference_masked(&to64(&qkv), s, mask), 1e-5);
        let fd = finite_diff(&qkv, |x| probe_dot(&reference_masked(x, s, mask), &probe));
        // whole tiles of rows, and runs of 3 rows: a tile's dK and dV set by
        // its first run and added to by the others
        for run in [ROWS, 3] {
            let mut dqkv = vec![f32::NAN; b * t * 3 * c];
            let saved = Saved {
                dout: &probe,
                qkv: Stored::F32(&qkv),
                out: Stored::F32(&out),
                lse: &lse,
            };
            backward_in_runs(&mut dqkv, saved, s, mask, run);
            assert_close(&format!("dqkv, runs of {run}"), &dqkv, &fd, 1e-4);
        }
    }

    #[test]
    fn padded_bidirectional_attention_matches_finite_differences() {
        let s = AttnShape::new((3, 5, 8, 2), false);
        check_masked(s, 6, Mask::Lengths(&[5, 2, 1]));
        // across several query blocks, the keys of a padded sequence end mid-block
        let s = AttnShape::new((2, BLOCK + 9, 4, 2), false);
        check_masked(s, 7, Mask::Lengths(&[BLOCK as u32 + 9, 40]));
    }

    #[test]
    fn decoding_against_a_cache_matches_full_causal_attention() {
        // Heads of 4 values (plain Rust only) and of whole vectors of 8 (16,
        // 24, 40 and 64 values: the weighted sum's runs of 8 to 32 values),
        // 19 positions (two blocks of 8 and a short one), over 1..5 rows: a
        // task takes a row's heads one, two, four or eight at a time; the
        // cache holds two positions more than used.
        let t = 19;
        let max_t = t + 2;
        let mut rng = Rng::new(9);
        for (c, nh) in [(32, 8), (64, 4), (48, 2), (80, 2), (128, 2)] {
            let kernels = HeadKernel::available(c / nh);
            if c / nh % 8 == 0 {
                let simd = cfg!(all(target_feature = "avx2", target_feature = "fma"));
                assert_eq!(kernels.len(), simd as usize + 1);
            }
            for b in [1, 2, 3, 5] {
                let qkv = randn(&mut rng, b * t * 3 * c, 1.0);
                let want = reference(&to64(&qkv), AttnShape::new((b, t, c, nh), false));
                let (mut kc, mut vc) = (vec![0.0; b * max_t * c], vec![0.0; b * max_t * c]);
                for pos in 0..t {
                    let mut rows = vec![0.0; b * 3 * c];
                    for r in 0..b {
                        let row = &qkv[(r * t + pos) * 3 * c..][..3 * c];
                        rows[r * 3 * c..][..3 * c].copy_from_slice(row);
                        let at = (r * max_t + pos) * c;
                        kc[at..at + c].copy_from_slice(&row[c..2 * c]);
                        vc[at..at + c].copy_from_slice(&row[2 * c..]);
                    }
                    let len = pos + 1;
                    let shape = DecodeShape {
                        b,
                        len,
                        c,
                        nh,
                        max_t,
                    };
                    for &kernel in &kernels {
                        let mut out = vec![0.0; b * c];
                        attention_decode_by(kernel, &mut out, &rows, &kc, &vc, shape);
                        for r in 0..b {
                            let got = &out[r * c..(r + 1) * c];
                            let what = format!(
                                "{kernel:?} decode: {b} rows of {nh} x {}, row {r}, position {pos}",
                                c / nh
                            );
                            assert_close(&what, got, &want[(r * t + pos) * c..][..c], 1e-5);
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn attention_backward_matches_finite_differences() {
        check(AttnShape::new((2, 5, 8, 2), false), 4);
    }

    /// The forward's tiles as measured fastest: 128 keys for heads
    /// narrower than 64 (BERT-MiniLM's 32), 64 for GPT-2's heads of 64 and
    /// wider ones. Any width gives the same answers, so only this sees it.
    #[test]
    fn heads_narrower_than_64_take_forward_tiles_of_128_keys() {
        for (hd, keys) in [(1, 128), (32, 128), (63, 128), (64, 64), (128, 64)] {
            assert_eq!(forward_keys(hd), keys, "head width {hd}");
        }
    }

    #[test]
    fn attention_over_several_key_tiles_matches_finite_differences() {
        // three forward key tiles (and five of the backward's), the last
        // short; scores far apart, so later tiles raise the running max and
        // the sum and output so far are rescaled
        let keys = forward_keys(1);
        let s = AttnShape::new((2, 2 * keys + 7, 2, 2), false);
        check_spread(s, 8, Mask::Causal, 3.0);
        // padded sequences whose keys end inside a second tile, others
        // whose keys end on a tile's edge: the forward's, the backward's
        for k in [keys, KEYS] {
            check_spread(s, 9, Mask::Lengths(&[k as u32 + 3, k as u32]), 3.0);
        }
    }

    #[test]
    fn attention_spanning_several_row_blocks_matches_reference() {
        check(AttnShape::new((1, BLOCK + 9, 4, 2), false), 5);
    }

    #[test]
    fn attention_on_the_tile_kernels_matches_finite_differences() {
        // heads 32 wide and tiles of 48 keys: products on distgpt's tile
        // kernels (math::gemm_on), the AVX-512 one where it runs for the
        // heads' width and the AVX2 one for the tiles'
        let s = AttnShape::new((1, 48, 32, 1), false);
        check_spread(s, 21, Mask::Causal, 2.0);
        check_spread(s, 22, Mask::Lengths(&[33]), 2.0);
    }

    #[test]
    fn attention_at_every_tile_edge_matches_finite_differences() {
        // sequences one short of, at and one past a tile's edge (the
        // backward's and the forward's; past two: the test above); one and
        // three values a head; causal, and padded
        // to lengths drawn at random (the draws printed on failure)
        let mut rng = Rng::new(77);
        let keys = forward_keys(1);
        for t in [1, KEYS - 1, KEYS, KEYS + 1, keys - 1, keys, keys + 1] {
            for (c, nh) in [(2, 2), (3, 1)] {
                let lens: Vec<u32> = (0..2).map(|_| 1 + rng.below(t) as u32).collect();
                for mask in [Mask::Causal, Mask::Lengths(&lens)] {
                    let what = format!("t {t}, c {c}, nh {nh}, {mask:?}");
                    eprintln!("{what}");
                    check_spread(
                        AttnShape::new((2, t, c, nh), false),
                        10 + t as u64,
                        mask,
                        3.0,
                    );
                }
            }
        }
    }
}
