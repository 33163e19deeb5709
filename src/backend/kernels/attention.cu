// Multi-head self-attention, flash-style, with the semantics of
// cpu/attention.rs: qkv (B, T, 3C) = [q | k | v] per token, out (B, T, C),
// lse (B, NH, T) the log-sum-exp of each row of scaled, masked scores. The
// mask is causal (causal = 1: query i sees keys 0..i) or a padding mask
// (causal = 0: every query of sequence b sees keys 0..lens[b]).
// A workgroup owns ATT_ROWS rows of one (batch, head) and streams tiles of
// ATT_TILE rows through local memory, so no (T x T) buffer ever exists.
// ATT_TPR threads share a row; lane l of a row takes the tile columns and the
// head dims congruent to l mod ATT_TPR. Row statistics (max, sum) are read
// back from local memory by every lane of the row, so lanes agree exactly
// without a reduction. Nothing is accumulated across workgroups: results are
// deterministic.

#define ATT_HD_MAX 64                       // largest head dim supported
#define ATT_ROWS 32                         // rows a workgroup owns
#define ATT_TILE 32                         // rows of each streamed tile (forward)
#define ATT_BTILE 16                        // the backward's: its four tiles and two
                                            // row blocks fit OpenCL's 32 KiB minimum
#define ATT_TPR (BLOCK / ATT_ROWS)          // threads per row
#define ATT_PER_LANE (ATT_HD_MAX / ATT_TPR) // head dims a thread accumulates
#define ATT_CPL (ATT_TILE / ATT_TPR)        // tile rows a thread scores (forward)
#define ATT_BCPL (ATT_BTILE / ATT_TPR)      // and in the backward
#define ATT_DECODE_PARTS (BLOCK / ATT_HD_MAX) // key partitions in decode
#define ATT_PAD (ATT_HD_MAX + 4)            // local row stride: 16-byte rows, 4 banks apart
#define ATT_NEG (-1e30f)                    // masked score; exp(ATT_NEG - x) == 0

#if BLOCK % ATT_ROWS != 0 || ATT_HD_MAX % (4 * ATT_TPR) != 0 || BLOCK % ATT_HD_MAX != 0 || \
    ATT_TILE % ATT_TPR != 0 || ATT_BTILE % ATT_TPR != 0 || ATT_BTILE > ATT_TILE
#error "attention.cu: BLOCK must split evenly into rows, and head dims and tiles into lanes"
#endif

// A tile of `rows` head rows in local memory, each ATT_PAD floats, declared
// as float4 so every row starts 16-byte aligned (SHARED_LOAD4 reads them).
#define ATT_TILE_OF(name, rows)                       \
    SHARED float4 name##_4[(rows) * ATT_PAD / 4];     \
    SHARED_PTR float* name = (SHARED_PTR float*)name##_4

// dst (rows, hd) in local memory <- rows [t0, t0 + rows) of src (stride floats
// apart, head columns at src), zeros past row t_end.
DEVICE void att_load_n(SHARED_PTR float* dst, const GLOBAL float* src, unsigned stride,
                       unsigned t0, unsigned rows, unsigned t_end, unsigned hd) {
    for (unsigned e = LOCAL_ID(0); e < rows * hd; e += BLOCK) {
        unsigned r = e / hd, d = e - r * hd;
        dst[r * ATT_PAD + d] = t0 + r < t_end ? src[(idx_t)(t0 + r) * stride + d] : 0.0f;
    }
}

// att_load_n, with a literal hd where it is ATT_HD_MAX: a shift, not a division.
DEVICE void att_load(SHARED_PTR float* dst, const GLOBAL float* src, unsigned stride,
                     unsigned t0, unsigned rows, unsigned t_end, unsigned hd) {
    if (hd == ATT_HD_MAX) {
        att_load_n(dst, src, stride, t0, rows, t_end, ATT_HD_MAX);
    } else {
        att_load_n(dst, src, stride, t0, rows, t_end, hd);
    }
}

// Keys of sequence b that any query may see: T when causal, else lens[b].
DEVICE unsigned att_keys(const GLOBAL unsigned* lens, unsigned lens_off, unsigned causal,
                         unsigned b, unsigned T) {
    return causal ? T : lens[lens_off + b];
}

// Whether query qi sees key kj (kl: att_keys).
DEVICE int att_sees(unsigned causal, unsigned kj, unsigned qi, unsigned kl) {
    return (causal ? kj <= qi : 1) && kj < kl;
}

// The k-th head dim of a lane's accumulators: runs of 4 consecutive dims,
// the lanes of a row side by side (a row's lanes read 4 x ATT_TPR
// consecutive floats of a tile row at once, on distinct banks).
DEVICE unsigned att_dim(unsigned lane, unsigned k) {
    return (k / 4) * (4 * ATT_TPR) + lane * 4 + k % 4;
}

// s[m] = dot(a, b row lane + ATT_TPR m) over hd dims, m < cpl: each a[d]
// read once for cpl products. Each dot sums d in order. Called with a
// literal cpl, so the compiler unrolls that loop.
DEVICE void att_scores(float* s, const SHARED_PTR float* a, const SHARED_PTR float* b,
                       unsigned lane, unsigned hd, unsigned cpl) {
    for (unsigned m = 0; m < cpl; m++) {
        s[m] = 0.0f;
    }
    for (unsigned d = 0; d < hd; d++) {
        float x = a[d];
        for (unsigned m = 0; m < cpl; m++) {
            s[m] += x * b[(lane + ATT_TPR * m) * ATT_PAD + d];
        }
    }
}

// acc[k] += sum over tile rows j < tile in order of w[j] * src row j, dim
// att_dim(lane, k).
DEVICE void att_accumulate(float* acc, const SHARED_PTR float* w, const SHARED_PTR float* src,
                           unsigned lane, unsigned hd, unsigned tile) {
    for (unsigned j = 0; j < tile; j++) {
        float x = w[j];
        for (unsigned k = 0; k < ATT_PER_LANE; k++) {
            unsigned d = att_dim(lane, k);
            if (d < hd) {
                acc[k] += x * src[j * ATT_PAD + d];
            }
        }
    }
}

// att_scores at hd = ATT_HD_MAX, four dims per local load (tile rows are
// 16-byte aligned: ATT_PAD % 4 == 0, tiles declared by ATT_TILE_OF). The
// same products in the same order.
DEVICE void att_scores4(float* s, const SHARED_PTR float* a, const SHARED_PTR float* b,
                        unsigned lane, unsigned cpl) {
    for (unsigned m = 0; m < cpl; m++) {
        s[m] = 0.0f;
    }
    for (unsigned d = 0; d < ATT_HD_MAX; d += 4) {
        float4 x = SHARED_LOAD4(a + d);
        for (unsigned m = 0; m < cpl; m++) {
            float4 y = SHARED_LOAD4(b + (lane + ATT_TPR * m) * ATT_PAD + d);
            s[m] += x.x * y.x;
            s[m] += x.y * y.y;
            s[m] += x.z * y.z;
            s[m] += x.w * y.w;
        }
    }
}

// att_accumulate at hd = ATT_HD_MAX, four dims per local load.
DEVICE void att_accumulate4(float* acc, const SHARED_PTR float* w, const SHARED_PTR float* src,
                            unsigned lane, unsigned tile) {
    for (unsigned j = 0; j < tile; j++) {
        float x = w[j];
        for (unsigned c = 0; c < ATT_PER_LANE / 4; c++) {
            float4 y = SHARED_LOAD4(src + j * ATT_PAD + att_dim(lane, 4 * c));
            acc[4 * c] += x * y.x;
            acc[4 * c + 1] += x * y.y;
            acc[4 * c + 2] += x * y.z;
            acc[4 * c + 3] += x * y.w;
        }
    }
}

// att_scores / att_accumulate, four dims per load where hd is the largest.
DEVICE void att_scores_hd(float* s, const SHARED_PTR float* a, const SHARED_PTR float* b,
                          unsigned lane, unsigned hd, unsigned cpl) {
    if (hd == ATT_HD_MAX) {
        att_scores4(s, a, b, lane, cpl);
    } else {
        att_scores(s, a, b, lane, hd, cpl);
    }
}

DEVICE void att_accumulate_hd(float* acc, const SHARED_PTR float* w, const SHARED_PTR float* src,
                              unsigned lane, unsigned hd, unsigned tile) {
    if (hd == ATT_HD_MAX) {
        att_accumulate4(acc, w, src, lane, tile);
    } else {
        att_accumulate(acc, w, src, lane, hd, tile);
    }
}

// Writes a lane's accumulators to dst (dims < hd).
DEVICE void att_store(GLOBAL float* dst, const float* acc, float div, unsigned lane, unsigned hd) {
    for (unsigned k = 0; k < ATT_PER_LANE; k++) {
        unsigned d = att_dim(lane, k);
        if (d < hd) {
            dst[d] = acc[k] / div;
        }
    }
}

// Grid: ceil(T / ATT_ROWS) * B * NH workgroups of BLOCK.
// out (B, T, C), lse (B, NH, T) <- qkv (B, T, 3C); lens (B) read when !causal.
// Per tile: each lane scores ATT_CPL keys of its row; every lane of the row
// reads the row's scores for the running max; each lane turns its own scores
// into probabilities; every lane adds the row's probabilities to l in key
// order and accumulates its head dims.
KERNEL void attention_forward(GLOBAL float* RESTRICT out, unsigned out_off,
                              GLOBAL float* RESTRICT lse, unsigned lse_off,
                              const GLOBAL float* RESTRICT qkv, unsigned qkv_off,
                              unsigned T, unsigned C, unsigned NH,
                              const GLOBAL unsigned* RESTRICT lens, unsigned lens_off,
                              unsigned causal) {
    ATT_TILE_OF(qs, ATT_ROWS);
    ATT_TILE_OF(ks, ATT_TILE);
    ATT_TILE_OF(vs, ATT_TILE);
    SHARED float ss[ATT_ROWS * (ATT_TILE + 1)];
    unsigned hd = C / NH, blocks = (T + ATT_ROWS - 1) / ATT_ROWS;
    unsigned bh = GROUP_ID(0) / blocks, q0 = (GROUP_ID(0) % blocks) * ATT_ROWS;
    unsigned b = bh / NH, h = bh % NH;
    unsigned row = LOCAL_ID(0) / ATT_TPR, lane = LOCAL_ID(0) % ATT_TPR, qi = q0 + row;
    float scale = 1.0f / sqrtf((float)hd);
    const GLOBAL float* q = qkv + qkv_off + (idx_t)b * T * 3 * C + h * hd;
    att_load(qs, q, 3 * C, q0, ATT_ROWS, T, hd);

    float m = ATT_NEG, l = 0.0f, acc[ATT_PER_LANE];
    for (unsigned k = 0; k < ATT_PER_LANE; k++) {
        acc[k] = 0.0f;
    }
    unsigned kl = att_keys(lens, lens_off, causal, b, T);
    unsigned k_end = causal ? min(T, q0 + ATT_ROWS) : kl;
    SHARED_PTR float* srow = ss + row * (ATT_TILE + 1);
    for (unsigned k0 = 0; k0 < k_end; k0 += ATT_TILE) {
        BARRIER(); // qs written; the previous tile's ks, vs, ss all read
        att_load(ks, q + C, 3 * C, k0, ATT_TILE, k_end, hd);
        att_load(vs, q + 2 * C, 3 * C, k0, ATT_TILE, k_end, hd);
        BARRIER();
        float s[ATT_CPL];
        att_scores_hd(s, qs + row * ATT_PAD, ks, lane, hd, ATT_CPL);
        for (unsigned c = 0; c < ATT_CPL; c++) {
            unsigned j = lane + ATT_TPR * c;
            s[c] = att_sees(causal, k0 + j, qi, kl) ? s[c] * scale : ATT_NEG;
            srow[j] = s[c];
        }
        BARRIER();
        float m_new = m;
        for (unsigned j = 0; j < ATT_TILE; j++) {
            m_new = fmaxf(m_new, srow[j]);
        }
        BARRIER(); // every lane has the row's max before the scores turn
        for (unsigned c = 0; c < ATT_CPL; c++) {
            srow[lane + ATT_TPR * c] = expf(s[c] - m_new);
        }
        BARRIER();
        float alpha = expf(m - m_new);
        l *= alpha;
        for (unsigned k = 0; k < ATT_PER_LANE; k++) {
            acc[k] *= alpha;
        }
        for (unsigned j = 0; j < ATT_TILE; j++) {
            l += srow[j];
        }
        att_accumulate_hd(acc, srow, vs, lane, hd, ATT_TILE);
        m = m_new;
    }
    if (qi < T) {
        att_store(out + out_off + ((idx_t)b * T + qi) * C + h * hd, acc, l, lane, hd);
        if (lane == 0) {
            lse[lse_off + (idx_t)bh * T + qi] = m + logf(l);
        }
    }
}

// Loads lse and D = dot(dout, out) of rows [t0, t0 + rows) of head (b, h)
// into ls, ds (zeros past T).
DEVICE void att_row_stats(SHARED_PTR float* ls, SHARED_PTR float* ds, const GLOBAL float* lse,
                          const GLOBAL float* dout, const GLOBAL float* out, unsigned t0,
                          unsigned rows, unsigned T, unsigned C, unsigned hd) {
    for (unsigned r = LOCAL_ID(0); r < rows; r += BLOCK) {
        float l = 0.0f, d = 0.0f;
        if (t0 + r < T) {
            l = lse[t0 + r];
            for (unsigned e = 0; e < hd; e++) {
                d += dout[(idx_t)(t0 + r) * C + e] * out[(idx_t)(t0 + r) * C + e];
            }
        }
        ls[r] = l;
        ds[r] = d;
    }
}

// Grid: ceil(T / ATT_ROWS) * B * NH workgroups of BLOCK, each owning
// ATT_ROWS key rows and visiting every query row that sees them.
// dk, dv parts of dqkv (B, T, 3C) overwritten, from dout, out (B, T, C),
// qkv (B, T, 3C), lse (B, NH, T).
KERNEL void attention_backward_dkdv(GLOBAL float* RESTRICT dqkv, unsigned dqkv_off,
                                    const GLOBAL float* RESTRICT dout, unsigned dout_off,
                                    const GLOBAL float* RESTRICT qkv, unsigned qkv_off,
                                    const GLOBAL float* RESTRICT out, unsigned out_off,
                                    const GLOBAL float* RESTRICT lse, unsigned lse_off,
                                    unsigned T, unsigned C, unsigned NH,
                                    const GLOBAL unsigned* RESTRICT lens, unsigned lens_off,
                                    unsigned causal) {
    ATT_TILE_OF(ks, ATT_ROWS);
    ATT_TILE_OF(vs, ATT_ROWS);
    ATT_TILE_OF(qs, ATT_BTILE);
    ATT_TILE_OF(dos, ATT_BTILE);
    SHARED float ps[ATT_ROWS * (ATT_BTILE + 1)];
    SHARED float dss[ATT_ROWS * (ATT_BTILE + 1)];
    SHARED float ls[ATT_BTILE];
    SHARED float ds[ATT_BTILE];
    unsigned hd = C / NH, blocks = (T + ATT_ROWS - 1) / ATT_ROWS;
    unsigned bh = GROUP_ID(0) / blocks, k0 = (GROUP_ID(0) % blocks) * ATT_ROWS;
    unsigned b = bh / NH, h = bh % NH;
    unsigned row = LOCAL_ID(0) / ATT_TPR, lane = LOCAL_ID(0) % ATT_TPR, kj = k0 + row;
    float scale = 1.0f / sqrtf((float)hd);
    const GLOBAL float* q = qkv + qkv_off + (idx_t)b * T * 3 * C + h * hd;
    const GLOBAL float* d_o = dout + dout_off + (idx_t)b * T * C + h * hd;
    const GLOBAL float* o = out + out_off + (idx_t)b * T * C + h * hd;
    att_load(ks, q + C, 3 * C, k0, ATT_ROWS, T, hd);
    att_load(vs, q + 2 * C, 3 * C, k0, ATT_ROWS, T, hd);

    float dk[ATT_PER_LANE], dv[ATT_PER_LANE];
    for (unsigned k = 0; k < ATT_PER_LANE; k++) {
        dk[k] = 0.0f;
        dv[k] = 0.0f;
    }
    unsigned kl = att_keys(lens, lens_off, causal, b, T);
    SHARED_PTR float* prow = ps + row * (ATT_BTILE + 1);
    SHARED_PTR float* dsrow = dss + row * (ATT_BTILE + 1);
    for (unsigned q0 = causal ? k0 : 0; q0 < T; q0 += ATT_BTILE) {
        BARRIER(); // ks, vs written; the previous tile's qs, dos, ps, dss all read
        att_load(qs, q, 3 * C, q0, ATT_BTILE, T, hd);
        att_load(dos, d_o, C, q0, ATT_BTILE, T, hd);
        att_row_stats(ls, ds, lse + lse_off + (idx_t)bh * T, d_o, o, q0, ATT_BTILE, T, C, hd);
        BARRIER();
        float s[ATT_BCPL], dp[ATT_BCPL];
        att_scores_hd(s, ks + row * ATT_PAD, qs, lane, hd, ATT_BCPL);
        att_scores_hd(dp, vs + row * ATT_PAD, dos, lane, hd, ATT_BCPL);
        for (unsigned c = 0; c < ATT_BCPL; c++) {
            unsigned i = lane + ATT_TPR * c, qi = q0 + i;
            float p = 0.0f, dsc = 0.0f;
            if (att_sees(causal, kj, qi, kl) && qi < T) {
                p = expf(s[c] * scale - ls[i]);
                dsc = p * (dp[c] - ds[i]) * scale;
            }
            prow[i] = p;
            dsrow[i] = dsc;
        }
        BARRIER();
        att_accumulate_hd(dv, prow, dos, lane, hd, ATT_BTILE);
        att_accumulate_hd(dk, dsrow, qs, lane, hd, ATT_BTILE);
    }
    if (kj < T) {
        GLOBAL float* g = dqkv + dqkv_off + ((idx_t)b * T + kj) * 3 * C + h * hd;
        att_store(g + C, dk, 1.0f, lane, hd);
        att_store(g + 2 * C, dv, 1.0f, lane, hd);
    }
}

// Grid: ceil(T / ATT_ROWS) * B * NH workgroups of BLOCK, each owning
// ATT_ROWS query rows and visiting every key row they see.
// dq part of dqkv (B, T, 3C) overwritten; arguments as attention_backward_dkdv.
KERNEL void attention_backward_dq(GLOBAL float* RESTRICT dqkv, unsigned dqkv_off,
                                  const GLOBAL float* RESTRICT dout, unsigned dout_off,
                                  const GLOBAL float* RESTRICT qkv, unsigned qkv_off,
                                  const GLOBAL float* RESTRICT out, unsigned out_off,
                                  const GLOBAL float* RESTRICT lse, unsigned lse_off,
                                  unsigned T, unsigned C, unsigned NH,
                                  const GLOBAL unsigned* RESTRICT lens, unsigned lens_off,
                                  unsigned causal) {
    ATT_TILE_OF(qs, ATT_ROWS);
    ATT_TILE_OF(dos, ATT_ROWS);
    ATT_TILE_OF(ks, ATT_BTILE);
    ATT_TILE_OF(vs, ATT_BTILE);
    SHARED float dss[ATT_ROWS * (ATT_BTILE + 1)];
    SHARED float ls[ATT_ROWS];
    SHARED float ds[ATT_ROWS];
    unsigned hd = C / NH, blocks = (T + ATT_ROWS - 1) / ATT_ROWS;
    unsigned bh = GROUP_ID(0) / blocks, q0 = (GROUP_ID(0) % blocks) * ATT_ROWS;
    unsigned b = bh / NH, h = bh % NH;
    unsigned row = LOCAL_ID(0) / ATT_TPR, lane = LOCAL_ID(0) % ATT_TPR, qi = q0 + row;
    float scale = 1.0f / sqrtf((float)hd);
    const GLOBAL float* q = qkv + qkv_off + (idx_t)b * T * 3 * C + h * hd;
    const GLOBAL float* d_o = dout + dout_off + (idx_t)b * T * C + h * hd;
    const GLOBAL float* o = out + out_off + (idx_t)b * T * C + h * hd;
    att_load(qs, q, 3 * C, q0, ATT_ROWS, T, hd);
    att_load(dos, d_o, C, q0, ATT_ROWS, T, hd);
    att_row_stats(ls, ds, lse + lse_off + (idx_t)bh * T, d_o, o, q0, ATT_ROWS, T, C, hd);

    float dq[ATT_PER_LANE];
    for (unsigned k = 0; k < ATT_PER_LANE; k++) {
        dq[k] = 0.0f;
    }
    unsigned kl = att_keys(lens, lens_off, causal, b, T);
    unsigned k_end = causal ? min(T, q0 + ATT_ROWS) : kl;
    SHARED_PTR float* dsrow = dss + row * (ATT_BTILE + 1);
    for (unsigned k0 = 0; k0 < k_end; k0 += ATT_BTILE) {
        BARRIER(); // qs, dos, ls, ds written; the previous tile's ks, dss all read
        att_load(ks, q + C, 3 * C, k0, ATT_BTILE, k_end, hd);
        att_load(vs, q + 2 * C, 3 * C, k0, ATT_BTILE, k_end, hd);
        BARRIER();
        float s[ATT_BCPL], dp[ATT_BCPL];
        att_scores_hd(s, qs + row * ATT_PAD, ks, lane, hd, ATT_BCPL);
        att_scores_hd(dp, dos + row * ATT_PAD, vs, lane, hd, ATT_BCPL);
        for (unsigned c = 0; c < ATT_BCPL; c++) {
            unsigned j = lane + ATT_TPR * c;
            float dsc = 0.0f;
            if (att_sees(causal, k0 + j, qi, kl) && qi < T) {
                float p = expf(s[c] * scale - ls[row]);
                dsc = p * (dp[c] - ds[row]) * scale;
            }
            dsrow[j] = dsc;
        }
        BARRIER();
        att_accumulate_hd(dq, dsrow, ks, lane, hd, ATT_BTILE);
    }
    if (qi < T) {
        att_store(dqkv + dqkv_off + ((idx_t)b * T + qi) * 3 * C + h * hd, dq, 1.0f, lane, hd);
    }
}

// Grid: b * NH workgroups of BLOCK, one per (row, head). Thread j scores key
// j of each tile of BLOCK keys and turns it into a probability; then part
// p = tid / ATT_HD_MAX sums the tile's keys congruent to p mod
// ATT_DECODE_PARTS into head dim tid % ATT_HD_MAX; the parts are added in a
// fixed order at the end.
// out (b, C) <- qkv (b, 3C) queries against kcache, vcache (b, max_t, C) at
// positions [0, len).
KERNEL void attention_decode(GLOBAL float* RESTRICT out, unsigned out_off,
                             const GLOBAL float* RESTRICT qkv, unsigned qkv_off,
                             const GLOBAL float* RESTRICT kcache, unsigned kcache_off,
                             const GLOBAL float* RESTRICT vcache, unsigned vcache_off,
                             unsigned len, unsigned C, unsigned NH, unsigned max_t) {
    SHARED float qs[ATT_HD_MAX];
    SHARED float ss[BLOCK];
    unsigned hd = C / NH, r = GROUP_ID(0) / NH, h = GROUP_ID(0) % NH, tid = LOCAL_ID(0);
    unsigned d = tid % ATT_HD_MAX, part = tid / ATT_HD_MAX;
    float scale = 1.0f / sqrtf((float)hd);
    const GLOBAL float* kc = kcache + kcache_off + (idx_t)r * max_t * C + h * hd;
    const GLOBAL float* vc = vcache + vcache_off + (idx_t)r * max_t * C + h * hd;
    if (tid < hd) {
        qs[tid] = qkv[qkv_off + (idx_t)r * 3 * C + h * hd + tid];
    }
    float m = ATT_NEG, l = 0.0f, acc = 0.0f;
    for (unsigned k0 = 0; k0 < len; k0 += BLOCK) {
        BARRIER(); // qs written; the previous tile's ss all read
        float s = ATT_NEG;
        if (k0 + tid < len) {
            s = 0.0f;
            for (unsigned e = 0; e < hd; e++) {
                s += qs[e] * kc[(idx_t)(k0 + tid) * C + e];
            }
            s *= scale;
        }
        ss[tid] = s;
        BARRIER();
        unsigned n = min(len - k0, (unsigned)BLOCK);
        float m_new = m;
        for (unsigned j = 0; j < n; j++) {
            m_new = fmaxf(m_new, ss[j]);
        }
        BARRIER(); // every thread has its m_new before ss becomes probabilities
        ss[tid] = expf(s - m_new);
        BARRIER();
        float alpha = expf(m - m_new);
        l *= alpha;
        acc *= alpha;
        for (unsigned j = 0; j < n; j++) {
            l += ss[j];
        }
        if (d < hd) {
            for (unsigned j = part; j < n; j += ATT_DECODE_PARTS) {
                acc += ss[j] * vc[(idx_t)(k0 + j) * C + d];
            }
        }
        m = m_new;
    }
    BARRIER(); // the last tile's ss all read
    ss[tid] = acc;
    BARRIER();
    if (tid < hd) {
        float o = 0.0f;
        for (unsigned p = 0; p < ATT_DECODE_PARTS; p++) {
            o += ss[p * ATT_HD_MAX + tid];
        }
        // An empty cache attends to nothing: zeros, as on the CPU.
        out[out_off + (idx_t)r * C + h * hd + tid] = len > 0 ? o / l : 0.0f;
    }
}
