// Attention on the tensor cores, FlashAttention-2's way: under bf16,
// training's attention with the semantics of cpu/attention.rs (the
// products take q, k, v, dout, the normalized probabilities and dS rounded
// to bf16; every softmax, sum and lse stays fp32) as fused kernels over
// tiles in shared memory, no (T x T) scores in memory, tiles past the
// causal diagonal or a sequence's length skipped:
//   attention_flash_forward  a head's 128 queries a workgroup: the rows'
//                            max and sum over the key tiles (lse), then
//                            out = P v with P = exp(s - lse) normalized;
//   attention_flash_rowdot   D = dot(dout, out) of every row (fp32);
//   attention_flash_dq       a head's 128 queries: dq = dS k over the key tiles;
//   attention_flash_dkdv     a head's 128 keys: dv = P^T dout, dk = dS^T q
//                            over the query tiles.
// dq and dk/dv are separate kernels, so nothing is accumulated across
// workgroups: deterministic, as the rest. Each comes in two sizes, one
// body each (fa_forward, fa_dq, fa_dkdv) called with constant sizes
// (FaSize): the narrow kernels above take heads of 16 to 64 (GPT-2's 64,
// MiniLM's 32) in tiles of 64; attention_flash_wide_* take 80 to 128 in
// tiles of 32 keys, and the wide dk/dv kernel runs two workgroups to a tile
// of keys, each holding half the head's dk and dv: 216 registers by
// ptxas 12.8's -v, where a whole head's takes all 255 (and spills 272 bytes
// with tiles of 64), a compiler version away from spilling.
//
// Every product is a warp's mma.sync m16n8k16 (bf16 in, fp32 accumulated),
// in the fragment layouts of the PTX ISA. Lane l of a warp is in group
// g = l / 4 at t = l % 4. A (16 x 16, row-major) in four registers of two
// bf16 each, the lower element in the low half: rows g, g + 8, g, g + 8 at
// columns 2t, 2t + 1 (+ 8 for the last two). B (16 x 8) in two: rows 2t,
// 2t + 1 (+ 8 for the second) of column g. C (16 x 8 fp32) in four: rows
// g, g, g + 8, g + 8 at columns 2t, 2t + 1. A C fragment of scores is so
// already half of an A fragment of probabilities: P v needs no shuffle.
// On CUDA (compute capability 8.0 on, which the host checks) the mma and
// the quad reductions are inline PTX; on OpenCL a twin emulates each through
// local memory from the same layouts (each lane's registers written out, the
// warp's product read back), so PoCL checks the tiling, masking, softmax and
// fragment bookkeeping the GPU runs; only the tensor cores' summation order
// differs.

#define FA_HD_MAX 128                 // largest head dim (a multiple of 16)
#define FA_NARROW_HD 64               // the narrow kernels' largest (the unsuffixed names)
#define FA_WARPS (BLOCK / 32)
#define FA_ROWS 128                   // a workgroup's queries (or keys): 16 a warp
#define FA_PAD 4                      // words padding a shared row: no bank conflicts
#define FA_KS_MAX (FA_HD_MAX / 16)    // k16 steps over the widest head
#define FA_NT_MAX (FA_HD_MAX / 8)     // n8 tiles of the widest output a warp holds
#define FA_COLS_MAX 64                // the widest tile of the other side
#define FA_ST_MAX (FA_COLS_MAX / 8)   // n8 tiles over the widest tile of scores
// A tile's words in shared memory, enough for each size (fa_size): 64 rows
// of 64 / 2 + FA_PAD (narrow), 32 rows of 128 / 2 + FA_PAD (wide).
#define FA_TILE (FA_COLS_MAX * (FA_NARROW_HD / 2 + FA_PAD))
#define FA_NEG (-1e30f)               // a max before any key: exp(FA_NEG - x) == 0

#if FA_ROWS != FA_WARPS * 16
#error "flash.cu: a workgroup's rows are 16 a warp"
#endif
#if 32 * (FA_HD_MAX / 2 + FA_PAD) > FA_TILE
#error "flash.cu: a wide tile outgrows FA_TILE"
#endif

#ifdef __OPENCL_VERSION__
#define FA_FN static inline
// Loops over fragments stay loops: the emulated mma holds barriers, and
// PoCL's compile time grows with every copy of one.
#define FA_UNROLL _Pragma("nounroll")
// The emulation's local memory: a warp's registers (4 of A, 2 of B a lane)
// and one float a work-item for the quad reductions.
#define FA_EMU_DECL                         \
    SHARED unsigned fa_em[FA_WARPS * 192];  \
    SHARED float fa_red[BLOCK];
#define FA_EM fa_em
#define FA_RED fa_red
#else
#define FA_FN __device__ __forceinline__
// Unrolled, so every fragment index is constant: registers, not local memory.
#define FA_UNROLL _Pragma("unroll")
#define FA_EMU_DECL
#define FA_EM 0
#define FA_RED 0
#endif

// lo and hi rounded to bf16 (as round_bf16), packed lo in the low half.
FA_FN unsigned fa_pack(float lo, float hi) {
    return (bf16_round_bits(hi) & 0xffff0000u) | (bf16_round_bits(lo) >> 16);
}

// c (a C fragment) += a (an A fragment) b (b0, b1: a B fragment).
FA_FN void fa_mma(float* c, const unsigned* a, unsigned b0, unsigned b1,
                  SHARED_PTR unsigned* em) {
#ifdef __OPENCL_VERSION__
    int lane = LOCAL_ID(0) & 31;
    SHARED_PTR unsigned* w = em + (LOCAL_ID(0) >> 5) * 192;
    for (int i = 0; i < 4; i++) {
        w[lane * 6 + i] = a[i];
    }
    w[lane * 6 + 4] = b0;
    w[lane * 6 + 5] = b1;
    BARRIER();
    int g = lane >> 2, t = lane & 3;
    for (int i = 0; i < 4; i++) {
        int row = g + 8 * (i >> 1), col = 2 * t + (i & 1);
        float s = 0.0f;
        for (int k = 0; k < 16; k++) {
            // A[row][k]: lane (row % 8) 4 + (k % 8) / 2, register row / 8 + 2 (k / 8);
            // B[k][col]: lane 4 col + (k % 8) / 2, register k / 8; half k % 2 of each.
            unsigned ar = w[((row & 7) * 4 + ((k & 7) >> 1)) * 6 + (row >> 3) + 2 * (k >> 3)];
            unsigned br = w[(col * 4 + ((k & 7) >> 1)) * 6 + 4 + (k >> 3)];
            float x = UINT_AS_FLOAT((k & 1) ? ar & 0xffff0000u : ar << 16);
            float y = UINT_AS_FLOAT((k & 1) ? br & 0xffff0000u : br << 16);
            s += x * y;
        }
        c[i] += s;
    }
    BARRIER();
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
    __trap();  // no bf16 mma before sm_80: the host never launches these there
#else
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

// The max (`max`) or the sum (v0 + v1) + (v2 + v3) of v over a quad (the
// four lanes of a group, which hold one row of a C fragment), to each.
FA_FN float fa_quad(float v, SHARED_PTR float* red, int max) {
#ifdef __OPENCL_VERSION__
    int tid = LOCAL_ID(0), q = tid & ~3;
    red[tid] = v;
    BARRIER();
    float r = combine(combine(red[q], red[q + 1], max), combine(red[q + 2], red[q + 3], max), max);
    BARRIER();
    return r;
#else
    v = combine(v, __shfl_xor_sync(0xffffffffu, v, 1), max);
    return combine(v, __shfl_xor_sync(0xffffffffu, v, 2), max);
#endif
}

// A size of the kernels, constant where a kernel calls a body with it (so
// CUDA unrolls every fragment loop and holds the fragments in registers):
// ks k16 steps over the head dim (scores), ld a shared tile's row in words,
// cols rows a tile of the other side, nt n8 tiles of the output a warp
// holds, from output dim d0 = nt 8 chunk of the workgroup (`chunks` a head's tile).
typedef struct {
    int ks, ld, cols, nt, chunks;
} FaSize;

FA_FN FaSize fa_size(int hd_max, int cols, int nt, int chunks) {
    FaSize z;
    z.ks = hd_max / 16;
    z.ld = hd_max / 2 + FA_PAD;
    z.cols = cols;
    z.nt = nt;
    z.chunks = chunks;
    return z;
}

// The narrow kernels' size (heads to FA_NARROW_HD, the whole output a warp),
// and the wide kernels' (to FA_HD_MAX, in tiles of 32 keys; `nt` of it).
#define FA_NARROW fa_size(FA_NARROW_HD, FA_COLS_MAX, FA_NARROW_HD / 8, 1)
#define FA_WIDE(nt) fa_size(FA_HD_MAX, 32, nt, FA_HD_MAX / 8 / (nt))

// Rows of a tensor the kernels read: row r's hd values from element at +
// r ld of x on, held as load_as reads them (q, k or v of a head in qkv,
// or its rows of dout).
typedef struct {
    const GLOBAL float* x;
    idx_t at;
    unsigned ld, bf16;
} FaRows;

FA_FN FaRows fa_in(const GLOBAL float* x, idx_t at, unsigned ld, unsigned bf16) {
    FaRows r;
    r.x = x;
    r.at = at;
    r.ld = ld;
    r.bf16 = bf16;
    return r;
}

// Element d of row r of x.
FA_FN float fa_load(FaRows x, unsigned r, unsigned d) {
    return load_as(x.x, x.at + (idx_t)r * x.ld + d, x.bf16);
}

// a = the A fragments of the warp's 16 rows row0.. of x (rows at or past
// n zeros), one per k16 step of the head dim.
FA_FN void fa_rows(unsigned* a, FaRows x, unsigned row0, unsigned n, unsigned hd, FaSize z) {
    unsigned lane = LOCAL_ID(0) & 31, g = lane >> 2, t = lane & 3;
FA_UNROLL
    for (int kk = 0; kk < z.ks; kk++) {
FA_UNROLL
        for (int i = 0; i < 4; i++) {
            unsigned r = row0 + g + 8 * (i & 1), d = 16 * kk + 2 * t + 8 * (i >> 1);
            float lo = 0.0f, hi = 0.0f;
            if (r < n && d < hd) {
                lo = fa_load(x, r, d);
                hi = fa_load(x, r, d + 1);
            }
            a[4 * kk + i] = fa_pack(lo, hi);
        }
    }
}

// tile[r z.ld + d / 2] = rows r0.. r0 + z.cols - 1 of x as bf16 pairs
// along the head dim (rows at or past n zeros): B fragments of column r.
FA_FN void fa_tile(SHARED_PTR unsigned* tile, FaRows x, unsigned r0, unsigned n,
                   unsigned hd, FaSize z) {
    unsigned pairs = hd / 2;
    for (unsigned e = LOCAL_ID(0); e < z.cols * pairs; e += BLOCK) {
        unsigned r = e / pairs, j = e % pairs;
        float lo = 0.0f, hi = 0.0f;
        if (r0 + r < n) {
            lo = fa_load(x, r0 + r, 2 * j);
            hi = fa_load(x, r0 + r, 2 * j + 1);
        }
        tile[r * z.ld + j] = fa_pack(lo, hi);
    }
}

// The B register of column d, rows r and r + 1, of tile (fa_tile, rows of
// ld words): a pair along the rows, from the two rows' halves (no
// transposed copy in shared memory; a warp's 32 reads fall in distinct banks).
FA_FN unsigned fa_col_pair(SHARED_PTR const unsigned* tile, unsigned r, unsigned d, int ld) {
    unsigned shift = 16 * (d & 1);
    unsigned lo = (tile[r * ld + d / 2] >> shift) & 0xffffu;
    unsigned hi = (tile[(r + 1) * ld + d / 2] >> shift) & 0xffffu;
    return lo | (hi << 16);
}

// s (z.cols / 8 C fragments: the warp's 16 rows against the tile's z.cols)
// = a (the rows' A fragments) against tile's rows (fa_tile), over hd.
FA_FN void fa_scores(float* s, const unsigned* a, SHARED_PTR const unsigned* tile,
                     unsigned hd, SHARED_PTR unsigned* em, FaSize z) {
    unsigned lane = LOCAL_ID(0) & 31, g = lane >> 2, t = lane & 3;
FA_UNROLL
    for (int nt = 0; nt < z.cols / 8; nt++) {
        s[4 * nt] = s[4 * nt + 1] = s[4 * nt + 2] = s[4 * nt + 3] = 0.0f;
FA_UNROLL
        for (int kk = 0; kk < z.ks; kk++) {
            if (16 * kk < (int)hd) {
                SHARED_PTR const unsigned* bp = tile + (8 * nt + g) * z.ld + 8 * kk + t;
                fa_mma(s + 4 * nt, a + 4 * kk, bp[0], bp[4], em);
            }
        }
    }
}

// acc (z.nt C fragments: 16 rows by output dims d0..) += p (z.cols / 8 C
// fragments of 16 rows by z.cols, rounded to bf16 as A fragments) times
// tile (fa_tile: z.cols rows of hd).
FA_FN void fa_accumulate(float* acc, const float* p, SHARED_PTR const unsigned* tile,
                         unsigned hd, unsigned d0, SHARED_PTR unsigned* em, FaSize z) {
    unsigned lane = LOCAL_ID(0) & 31, g = lane >> 2, t = lane & 3;
FA_UNROLL
    for (int kk = 0; kk < z.cols / 16; kk++) {
        unsigned pa[4];
        pa[0] = fa_pack(p[8 * kk], p[8 * kk + 1]);
        pa[1] = fa_pack(p[8 * kk + 2], p[8 * kk + 3]);
        pa[2] = fa_pack(p[8 * kk + 4], p[8 * kk + 5]);
        pa[3] = fa_pack(p[8 * kk + 6], p[8 * kk + 7]);
FA_UNROLL
        for (int nt = 0; nt < z.nt; nt++) {
            if (d0 + 8 * nt < hd) {
                unsigned r = 16 * kk + 2 * t, d = d0 + 8 * nt + g;
                fa_mma(acc + 4 * nt, pa, fa_col_pair(tile, r, d, z.ld),
                       fa_col_pair(tile, r + 8, d, z.ld), em);
            }
        }
    }
}

// Writes acc (z.nt C fragments of output dims d0..) to the warp's rows
// row0.. below n of x (row r from element at + r ld), held as store_as
// holds it (bf16: rounded).
FA_FN void fa_store(GLOBAL float* x, idx_t at, unsigned ld, const float* acc, unsigned row0,
                    unsigned n, unsigned hd, unsigned d0, unsigned bf16, FaSize z) {
    unsigned lane = LOCAL_ID(0) & 31, g = lane >> 2, t = lane & 3;
FA_UNROLL
    for (int nt = 0; nt < z.nt; nt++) {
FA_UNROLL
        for (int i = 0; i < 4; i++) {
            unsigned r = row0 + g + 8 * (i >> 1), d = d0 + 8 * nt + 2 * t + (i & 1);
            if (r < n && d < hd) {
                store_as(x, at + (idx_t)r * ld + d, acc[4 * nt + i], bf16);
            }
        }
    }
}

// The geometry of a workgroup: head z = b NH + h of the grid's (B NH) x
// tiles x z.chunks, tile `tile` of FA_ROWS rows (queries, or keys for
// dk/dv), the warp's first row, the chunk's first output dim d0, the
// head's q, k and v in qkv (rows 3C apart), and the keys a query sees:
// `keys` for every query (the padding mask's length; T when causal), and
// with `causal` only those up to itself; `seen` those any query of the
// tile sees.
typedef struct {
    unsigned z, b, h, tile, row0, d0, C, keys, seen, causal;
    float scale;
    FaRows q, k, v;
} FaAt;

FA_FN FaAt fa_at(unsigned T, unsigned NH, unsigned hd, const GLOBAL float* qkv,
                 unsigned qkv_off, unsigned qkv_bf16, const GLOBAL unsigned* lens,
                 unsigned lens_off, unsigned causal, FaSize z) {
    FaAt at;
    unsigned tiles = (T + FA_ROWS - 1) / FA_ROWS, group = GROUP_ID(0) / z.chunks;
    at.z = group / tiles;
    at.tile = group % tiles;
    at.b = at.z / NH;
    at.h = at.z % NH;
    at.row0 = at.tile * FA_ROWS + (LOCAL_ID(0) >> 5) * 16;
    at.d0 = (GROUP_ID(0) % z.chunks) * 8 * z.nt;
    at.C = NH * hd;
    at.keys = causal ? T : min(lens[lens_off + at.b], T);
    at.seen = causal ? min(T, (at.tile + 1) * FA_ROWS) : at.keys;
    at.causal = causal;
    at.scale = 1.0f / sqrtf((float)hd);
    idx_t q = qkv_off + (idx_t)at.b * T * 3 * at.C + at.h * hd;
    at.q = fa_in(qkv, q, 3 * at.C, qkv_bf16);
    at.k = fa_in(qkv, q + at.C, 3 * at.C, qkv_bf16);
    at.v = fa_in(qkv, q + 2 * at.C, 3 * at.C, qkv_bf16);
    return at;
}

// Whether query `query` sees key `key` (both below T).
FA_FN int fa_sees(FaAt at, unsigned query, unsigned key) {
    return key < at.keys && (!at.causal || key <= query);
}

// The arguments of the forward's kernels.
#define FA_FORWARD_PARAMS                                                               \
    GLOBAL float *RESTRICT out, unsigned out_off, GLOBAL float *RESTRICT lse,           \
        unsigned lse_off, const GLOBAL float *RESTRICT qkv, unsigned qkv_off,           \
        unsigned T, unsigned NH, unsigned hd, const GLOBAL unsigned *RESTRICT lens,     \
        unsigned lens_off, unsigned causal, unsigned out_bf16, unsigned qkv_bf16
#define FA_FORWARD_ARGS                                                                 \
    out, out_off, lse, lse_off, qkv, qkv_off, T, NH, hd, lens, lens_off, causal, out_bf16, \
        qkv_bf16

// qkv (B, T, 3C; held as load_as reads it) -> out (B, T, C; held as
// store_as holds it), lse (B, NH, T); the mask as
// attention_softmax_forward's. kt, vt: FA_TILE words each.
FA_FN void fa_forward(FaSize z, SHARED_PTR unsigned* kt, SHARED_PTR unsigned* vt,
                      SHARED_PTR unsigned* em, SHARED_PTR float* red, FA_FORWARD_PARAMS) {
    FaAt at = fa_at(T, NH, hd, qkv, qkv_off, qkv_bf16, lens, lens_off, causal, z);
    unsigned lane = LOCAL_ID(0) & 31, g = lane >> 2, t = lane & 3, C = at.C, keys = at.seen;
    float scale = at.scale;
    unsigned qa[FA_KS_MAX * 4];
    fa_rows(qa, at.q, at.row0, T, hd, z);
    float s[FA_ST_MAX * 4], m[2] = {FA_NEG, FA_NEG}, l[2] = {0.0f, 0.0f};
    for (unsigned k0 = 0; k0 < keys; k0 += z.cols) {
        BARRIER();  // the last tile read by every warp
        fa_tile(kt, at.k, k0, keys, hd, z);
        BARRIER();
        fa_scores(s, qa, kt, hd, em, z);
FA_UNROLL
        for (int side = 0; side < 2; side++) {
            unsigned row = at.row0 + g + 8 * side;
            float mx = FA_NEG, sum = 0.0f;
FA_UNROLL
            for (int j = 0; j < z.cols / 4; j++) {
                unsigned key = k0 + 8 * (j >> 1) + 2 * t + (j & 1);
                if (fa_sees(at, row, key)) {
                    mx = fmaxf(mx, s[4 * (j >> 1) + 2 * side + (j & 1)] * scale);
                }
            }
            float mn = fmaxf(m[side], fa_quad(mx, red, 1));
FA_UNROLL
            for (int j = 0; j < z.cols / 4; j++) {
                unsigned key = k0 + 8 * (j >> 1) + 2 * t + (j & 1);
                if (fa_sees(at, row, key)) {
                    sum += expf(s[4 * (j >> 1) + 2 * side + (j & 1)] * scale - mn);
                }
            }
            l[side] = l[side] * expf(m[side] - mn) + fa_quad(sum, red, 0);
            m[side] = mn;
        }
    }
    float o[FA_NT_MAX * 4];
FA_UNROLL
    for (int i = 0; i < z.nt * 4; i++) {
        o[i] = 0.0f;
    }
    m[0] += logf(l[0]);
    m[1] += logf(l[1]);
    for (unsigned k0 = 0; k0 < keys; k0 += z.cols) {
        BARRIER();
        fa_tile(kt, at.k, k0, keys, hd, z);
        fa_tile(vt, at.v, k0, keys, hd, z);
        BARRIER();
        fa_scores(s, qa, kt, hd, em, z);
FA_UNROLL
        for (int i = 0; i < z.cols / 2; i++) {
            unsigned row = at.row0 + g + 8 * ((i >> 1) & 1);
            unsigned key = k0 + 8 * (i >> 2) + 2 * t + (i & 1);
            s[i] = fa_sees(at, row, key) ? expf(s[i] * scale - m[(i >> 1) & 1]) : 0.0f;
        }
        fa_accumulate(o, s, vt, hd, 0, em, z);
    }
    fa_store(out, out_off + (idx_t)at.b * T * C + at.h * hd, C, o, at.row0, T, hd, 0, out_bf16, z);
FA_UNROLL
    for (int side = 0; side < 2; side++) {
        unsigned row = at.row0 + g + 8 * side;
        if (t == 0 && row < T) {
            lse[lse_off + (idx_t)at.z * T + row] = m[side];
        }
    }
}

// Grid: B NH ceil(T / FA_ROWS) workgroups of BLOCK: fa_forward for heads
// of 16 to FA_NARROW_HD.
KERNEL void attention_flash_forward(FA_FORWARD_PARAMS) {
    SHARED unsigned kt[FA_TILE], vt[FA_TILE];
    FA_EMU_DECL
    fa_forward(FA_NARROW, kt, vt, FA_EM, FA_RED, FA_FORWARD_ARGS);
}

// As attention_flash_forward, for heads of 80 to FA_HD_MAX.
KERNEL void attention_flash_wide_forward(FA_FORWARD_PARAMS) {
    SHARED unsigned kt[FA_TILE], vt[FA_TILE];
    FA_EMU_DECL
    fa_forward(FA_WIDE(FA_NT_MAX), kt, vt, FA_EM, FA_RED, FA_FORWARD_ARGS);
}

// Grid: one thread per row of B NH T. dd (B, NH, T) = dot(dout, out) of
// each query's head, in fp32 (out held as load_as reads it).
KERNEL void attention_flash_rowdot(GLOBAL float* RESTRICT dd, unsigned dd_off,
                                   const GLOBAL float* RESTRICT dout, unsigned dout_off,
                                   const GLOBAL float* RESTRICT out, unsigned out_off,
                                   unsigned out_bf16, unsigned B, unsigned T, unsigned NH,
                                   unsigned hd) {
    idx_t e = GLOBAL_ID(0);
    if (e >= (idx_t)B * NH * T) {
        return;
    }
    unsigned z = e / T, row = e % T, b = z / NH, h = z % NH;
    idx_t at = ((idx_t)b * T + row) * NH * hd + h * hd;
    float d = 0.0f;
    for (unsigned i = 0; i < hd; i++) {
        d += dout[dout_off + at + i] * load_as(out, out_off + at + i, out_bf16);
    }
    dd[dd_off + e] = d;
}

// P (fp32) and dS = P (dP - D) scale of a C-fragment pair s (scores, made
// P) and dp (dP, made dS), whose row sees the key when `sees`.
FA_FN void fa_grad(float* s, float* dp, int sees, float scale, float lse, float d) {
    float p = sees ? expf(*s * scale - lse) : 0.0f;
    *dp = p * (*dp - d) * scale;
    *s = p;
}

// The arguments of the backward's two kernels.
#define FA_BACKWARD_PARAMS                                                              \
    GLOBAL float *RESTRICT dqkv, unsigned dqkv_off, const GLOBAL float *RESTRICT dout,  \
        unsigned dout_off, const GLOBAL float *RESTRICT qkv, unsigned qkv_off,          \
        const GLOBAL float *RESTRICT lse, unsigned lse_off,                             \
        const GLOBAL float *RESTRICT dd, unsigned dd_off, unsigned T, unsigned NH,      \
        unsigned hd, const GLOBAL unsigned *RESTRICT lens, unsigned lens_off,           \
        unsigned causal, unsigned qkv_bf16, unsigned dqkv_bf16
#define FA_BACKWARD_ARGS                                                                \
    dqkv, dqkv_off, dout, dout_off, qkv, qkv_off, lse, lse_off, dd, dd_off, T, NH, hd,  \
        lens, lens_off, causal, qkv_bf16, dqkv_bf16

// Part q of dqkv (B, T, 3C; held as store_as holds it) = dS k over the
// key tiles, dd from attention_flash_rowdot. kt, vt: FA_TILE words each.
FA_FN void fa_dq(FaSize z, SHARED_PTR unsigned* kt, SHARED_PTR unsigned* vt,
                 SHARED_PTR unsigned* em, FA_BACKWARD_PARAMS) {
    FaAt at = fa_at(T, NH, hd, qkv, qkv_off, qkv_bf16, lens, lens_off, causal, z);
    unsigned lane = LOCAL_ID(0) & 31, g = lane >> 2, t = lane & 3, C = at.C, keys = at.seen;
    float scale = at.scale, ls[2], ds[2];
FA_UNROLL
    for (int side = 0; side < 2; side++) {
        unsigned row = at.row0 + g + 8 * side;
        ls[side] = row < T ? lse[lse_off + (idx_t)at.z * T + row] : 0.0f;
        ds[side] = row < T ? dd[dd_off + (idx_t)at.z * T + row] : 0.0f;
    }
    unsigned qa[FA_KS_MAX * 4], da[FA_KS_MAX * 4];
    fa_rows(qa, at.q, at.row0, T, hd, z);
    fa_rows(da, fa_in(dout, dout_off + (idx_t)at.b * T * C + at.h * hd, C, 0), at.row0, T, hd, z);
    float s[FA_ST_MAX * 4], dp[FA_ST_MAX * 4], acc[FA_NT_MAX * 4];
FA_UNROLL
    for (int i = 0; i < z.nt * 4; i++) {
        acc[i] = 0.0f;
    }
    for (unsigned k0 = 0; k0 < keys; k0 += z.cols) {
        BARRIER();
        fa_tile(kt, at.k, k0, keys, hd, z);
        fa_tile(vt, at.v, k0, keys, hd, z);
        BARRIER();
        fa_scores(s, qa, kt, hd, em, z);
        fa_scores(dp, da, vt, hd, em, z);
FA_UNROLL
        for (int i = 0; i < z.cols / 2; i++) {
            int side = (i >> 1) & 1;
            unsigned row = at.row0 + g + 8 * side;
            unsigned key = k0 + 8 * (i >> 2) + 2 * t + (i & 1);
            fa_grad(&s[i], &dp[i], fa_sees(at, row, key), scale, ls[side], ds[side]);
        }
        fa_accumulate(acc, dp, kt, hd, at.d0, em, z);
    }
    idx_t dq_at = dqkv_off + (idx_t)at.b * T * 3 * C + at.h * hd;
    fa_store(dqkv, dq_at, 3 * C, acc, at.row0, T, hd, at.d0, dqkv_bf16, z);
}

// Parts k and v of dqkv (B, T, 3C; held as store_as holds it), a
// workgroup's rows keys: dk = dS^T q and dv = P^T dout over the query
// tiles that see them. qt, dos: FA_TILE words each; ls, ds: FA_COLS_MAX
// floats each.
FA_FN void fa_dkdv(FaSize z, SHARED_PTR unsigned* qt, SHARED_PTR unsigned* dos,
                   SHARED_PTR float* ls, SHARED_PTR float* ds, SHARED_PTR unsigned* em,
                   FA_BACKWARD_PARAMS) {
    FaAt at = fa_at(T, NH, hd, qkv, qkv_off, qkv_bf16, lens, lens_off, causal, z);
    unsigned lane = LOCAL_ID(0) & 31, g = lane >> 2, t = lane & 3, C = at.C;
    FaRows d_o = fa_in(dout, dout_off + (idx_t)at.b * T * C + at.h * hd, C, 0);
    float scale = at.scale;
    unsigned ka[FA_KS_MAX * 4], va[FA_KS_MAX * 4];
    fa_rows(ka, at.k, at.row0, T, hd, z);
    fa_rows(va, at.v, at.row0, T, hd, z);
    float st[FA_ST_MAX * 4], dpt[FA_ST_MAX * 4], dk[FA_NT_MAX * 4], dv[FA_NT_MAX * 4];
FA_UNROLL
    for (int i = 0; i < z.nt * 4; i++) {
        dk[i] = dv[i] = 0.0f;
    }
    // Under the causal mask the first query that sees the tile's keys is its first key.
    for (unsigned q0 = causal ? at.tile * FA_ROWS : 0; q0 < T; q0 += z.cols) {
        BARRIER();
        fa_tile(qt, at.q, q0, T, hd, z);
        fa_tile(dos, d_o, q0, T, hd, z);
        for (unsigned j = LOCAL_ID(0); j < (unsigned)z.cols; j += BLOCK) {
            ls[j] = q0 + j < T ? lse[lse_off + (idx_t)at.z * T + q0 + j] : 0.0f;
            ds[j] = q0 + j < T ? dd[dd_off + (idx_t)at.z * T + q0 + j] : 0.0f;
        }
        BARRIER();
        fa_scores(st, ka, qt, hd, em, z);
        fa_scores(dpt, va, dos, hd, em, z);
FA_UNROLL
        for (int i = 0; i < z.cols / 2; i++) {
            unsigned key = at.row0 + g + 8 * ((i >> 1) & 1);
            unsigned j = 8 * (i >> 2) + 2 * t + (i & 1), query = q0 + j;
            int sees = query < T && fa_sees(at, query, key);
            fa_grad(&st[i], &dpt[i], sees, scale, ls[j], ds[j]);
        }
        fa_accumulate(dv, st, dos, hd, at.d0, em, z);
        fa_accumulate(dk, dpt, qt, hd, at.d0, em, z);
    }
    idx_t dk_at = dqkv_off + (idx_t)at.b * T * 3 * C + at.h * hd + C;
    fa_store(dqkv, dk_at, 3 * C, dk, at.row0, T, hd, at.d0, dqkv_bf16, z);
    fa_store(dqkv, dk_at + C, 3 * C, dv, at.row0, T, hd, at.d0, dqkv_bf16, z);
}

// Grid: as attention_flash_forward: fa_dq for heads of 16 to FA_NARROW_HD.
KERNEL void attention_flash_dq(FA_BACKWARD_PARAMS) {
    SHARED unsigned kt[FA_TILE], vt[FA_TILE];
    FA_EMU_DECL
    fa_dq(FA_NARROW, kt, vt, FA_EM, FA_BACKWARD_ARGS);
}

// As attention_flash_dq, for heads of 80 to FA_HD_MAX.
KERNEL void attention_flash_wide_dq(FA_BACKWARD_PARAMS) {
    SHARED unsigned kt[FA_TILE], vt[FA_TILE];
    FA_EMU_DECL
    fa_dq(FA_WIDE(FA_NT_MAX), kt, vt, FA_EM, FA_BACKWARD_ARGS);
}

// Grid: as attention_flash_forward, a workgroup's rows keys: fa_dkdv for
// heads of 16 to FA_NARROW_HD.
KERNEL void attention_flash_dkdv(FA_BACKWARD_PARAMS) {
    SHARED unsigned qt[FA_TILE], dos[FA_TILE];
    SHARED float ls[FA_COLS_MAX], ds[FA_COLS_MAX];
    FA_EMU_DECL
    fa_dkdv(FA_NARROW, qt, dos, ls, ds, FA_EM, FA_BACKWARD_ARGS);
}

// As attention_flash_dkdv, for heads of 80 to FA_HD_MAX: two workgroups
// to a tile of keys, each with half the head's dk and dv (see the top).
KERNEL void attention_flash_wide_dkdv(FA_BACKWARD_PARAMS) {
    SHARED unsigned qt[FA_TILE], dos[FA_TILE];
    SHARED float ls[FA_COLS_MAX], ds[FA_COLS_MAX];
    FA_EMU_DECL
    fa_dkdv(FA_WIDE(FA_NT_MAX / 2), qt, dos, ls, ds, FA_EM, FA_BACKWARD_ARGS);
}
