// Multi-head self-attention with the semantics of cpu/attention.rs: qkv
// (B, T, 3C) = [q | k | v] per token, out (B, T, C), lse (B, NH, T) the
// log-sum-exp of each row of scaled, masked scores. The mask is causal
// (causal = 1: query i sees keys 0..=i) or a padding mask (causal = 0: every
// query of sequence b sees keys 0..lens[b]).
// Training runs every product as a strided-batched GEMM over the heads
// (ops/attention.rs), q, k and v permuted heads-first so head z = b NH + h
// is one (T x hd) block: the kernels here are that permutation and the two
// row-wise passes between the GEMMs, a workgroup per row of (T) scores.
// Decode keeps its own kernel below. Nothing is accumulated across
// workgroups: results are deterministic.

#define ATT_HD_MAX 256                      // largest head dim decode supports
#define ATT_NEG (-1e30f)                    // masked score; exp(ATT_NEG - x) == 0

#if ATT_HD_MAX > BLOCK
#error "attention.cu: decode holds a head dim a thread"
#endif

// Grid: groups of one thread per element of B * T * parts * NH * hd.
// Between the token-major layout (B, T, parts, NH, hd) of qkv, out and their
// gradients and the heads-first one (parts, B, NH, T, hd) the GEMMs take:
// to_heads = 1 reads the first into the second, 0 the second into the first;
// dst held as store_as holds it, src as load_as reads it.
KERNEL void attention_permute(GLOBAL float* RESTRICT dst, unsigned dst_off,
                              const GLOBAL float* RESTRICT src, unsigned src_off,
                              unsigned B, unsigned T, unsigned NH, unsigned hd,
                              unsigned parts, unsigned to_heads, unsigned dst_bf16,
                              unsigned src_bf16) {
    idx_t e = GLOBAL_ID(0); // the element's index, heads-first
    if (e >= (idx_t)parts * B * NH * T * hd) {
        return;
    }
    unsigned d = e % hd, t = (e / hd) % T, z = (e / ((idx_t)hd * T)) % (B * NH);
    unsigned p = e / ((idx_t)hd * T * B * NH), b = z / NH, h = z % NH;
    idx_t f = (((idx_t)b * T + t) * parts + p) * NH * hd + h * hd + d;
    idx_t from = to_heads ? f : e, to = to_heads ? e : f;
    store_as(dst, dst_off + to, load_as(src, src_off + from, src_bf16), dst_bf16);
}

// Keys row r of a pass sees: query i = r % T of head z = z0 + r / T, in
// sequence z / NH. Never past T, whatever lens holds.
DEVICE unsigned att_seen(const GLOBAL unsigned* lens, unsigned lens_off, unsigned causal,
                         unsigned T, unsigned NH, unsigned z0, unsigned r) {
    return causal ? r % T + 1 : min(lens[lens_off + (z0 + r / T) / NH], T);
}

// Grid: one workgroup of BLOCK per row of a pass's scores, rows r of heads
// z0 + r / T (see att_seen). s (rows, T): the scores q k^T in, softmax(s /
// sqrt(hd)) over the keys the row sees out, zeros past them; lse (rows)
// the row's log-sum-exp of the scaled scores.
KERNEL void attention_softmax_forward(GLOBAL float* RESTRICT s, unsigned s_off,
                                      GLOBAL float* RESTRICT lse, unsigned lse_off,
                                      unsigned T, unsigned NH, unsigned hd, unsigned z0,
                                      const GLOBAL unsigned* RESTRICT lens, unsigned lens_off,
                                      unsigned causal) {
    SHARED float buf[BLOCK];
    unsigned r = GROUP_ID(0), tid = LOCAL_ID(0);
    unsigned n = att_seen(lens, lens_off, causal, T, NH, z0, r);
    GLOBAL float* row = s + s_off + (idx_t)r * T;
    float scale = 1.0f / sqrtf((float)hd), m = ATT_NEG, l = 0.0f;
    for (unsigned j = tid; j < n; j += BLOCK) {
        m = fmaxf(m, row[j] * scale);
    }
    m = block_max(buf, m);
    for (unsigned j = tid; j < n; j += BLOCK) {
        l += expf(row[j] * scale - m);
    }
    l = block_sum(buf, l);
    for (unsigned j = tid; j < T; j += BLOCK) {
        row[j] = j < n ? expf(row[j] * scale - m) / l : 0.0f;
    }
    if (tid == 0) {
        lse[lse_off + r] = m + logf(l);
    }
}

// Grid: as attention_softmax_forward. p (rows, T): the scores q k^T in, the
// probabilities exp(s / sqrt(hd) - lse) out; ds (rows, T): dout v^T in, the
// scores' gradient p (dp - D) / sqrt(hd) out, where D = dot(dout, out) of the
// row's query and head (token-major, held as the forward wrote out). Zeros
// past the keys the row sees.
KERNEL void attention_softmax_backward(GLOBAL float* RESTRICT p, unsigned p_off,
                                       GLOBAL float* RESTRICT ds, unsigned ds_off,
                                       const GLOBAL float* RESTRICT lse, unsigned lse_off,
                                       const GLOBAL float* RESTRICT dout, unsigned dout_off,
                                       const GLOBAL float* RESTRICT out, unsigned out_off,
                                       unsigned out_bf16, unsigned T, unsigned NH, unsigned hd,
                                       unsigned z0,
                                       const GLOBAL unsigned* RESTRICT lens, unsigned lens_off,
                                       unsigned causal) {
    SHARED float buf[BLOCK];
    unsigned r = GROUP_ID(0), tid = LOCAL_ID(0), z = z0 + r / T;
    unsigned n = att_seen(lens, lens_off, causal, T, NH, z0, r);
    // Query r % T of head z % NH in sequence z / NH, token-major.
    idx_t at = ((idx_t)(z / NH) * T + r % T) * NH * hd + (z % NH) * hd;
    float d = 0.0f;
    for (unsigned e = tid; e < hd; e += BLOCK) {
        d += dout[dout_off + at + e] * load_as(out, out_off + at + e, out_bf16);
    }
    d = block_sum(buf, d);
    GLOBAL float* prow = p + p_off + (idx_t)r * T;
    GLOBAL float* dsrow = ds + ds_off + (idx_t)r * T;
    float scale = 1.0f / sqrtf((float)hd), l = lse[lse_off + r];
    for (unsigned j = tid; j < T; j += BLOCK) {
        float pj = j < n ? expf(prow[j] * scale - l) : 0.0f;
        prow[j] = pj;
        dsrow[j] = pj * (dsrow[j] - d) * scale;
    }
}

// Grid: b * NH workgroups of BLOCK, one per (row, head). Thread j scores key
// j of each tile of BLOCK keys and turns it into a probability; then part
// p = tid / hd of the BLOCK / hd parts sums the tile's keys congruent to p
// mod their count into head dim tid % hd; the parts are added in a fixed
// order at the end.
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
    unsigned parts = BLOCK / hd, d = tid % hd, part = tid / hd;
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
        if (part < parts) {
            for (unsigned j = part; j < n; j += parts) {
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
        for (unsigned p = 0; p < parts; p++) {
            o += ss[p * hd + tid];
        }
        // An empty cache attends to nothing: zeros, as on the CPU.
        out[out_off + (idx_t)r * C + h * hd + tid] = len > 0 ? o / l : 0.0f;
    }
}
