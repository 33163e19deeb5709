// Fused softmax + cross-entropy over a padded vocabulary: logits rows have vp
// columns of which the first v are real. One workgroup per row. A row whose
// target is CE_IGNORE (data::IGNORE) has loss 0 and gradient 0. The logits
// are floats, or bfloat16 values where bf16 (load_as): fp32 arithmetic
// either way, a bf16 gradient rounded as it is stored.

#define CE_IGNORE 0xffffffffu

// The max m of x's first v values and the sum s of exp(x - m), to every
// thread, in one read of the row: each thread keeps its own running max and
// sum (rescaled when its max rises), then the workgroup's max and the
// threads' sums rescaled to it, each in a fixed order.
DEVICE void ce_max_sum(SHARED_PTR float* buf, const GLOBAL float* x, idx_t x0, unsigned bf16,
                       unsigned v, float* m, float* s) {
    float tm = NEG_INF, ts = 0.0f;
    for (unsigned j = LOCAL_ID(0); j < v; j += BLOCK) {
        float xj = load_as(x, x0 + j, bf16);
        if (xj > tm) {
            ts = ts * expf(tm - xj) + 1.0f;
            tm = xj;
        } else {
            ts += expf(xj - tm);
        }
    }
    *m = block_max(buf, tm);
    *s = block_sum(buf, ts == 0.0f ? 0.0f : ts * expf(tm - *m));
}

// losses (rows) = -log softmax(logits row)[target].
KERNEL void crossentropy_forward(GLOBAL float* RESTRICT losses, unsigned losses_off,
                                 const GLOBAL float* RESTRICT logits, unsigned logits_off,
                                 const GLOBAL unsigned* RESTRICT targets, unsigned targets_off,
                                 unsigned v, unsigned vp, unsigned bf16) {
    SHARED float buf[BLOCK];
    unsigned row = GROUP_ID(0);
    int tid = LOCAL_ID(0);
    idx_t x0 = logits_off + (idx_t)row * vp;
    float m, s;
    ce_max_sum(buf, logits, x0, bf16, v, &m, &s);
    unsigned target = targets[targets_off + row];
    if (tid == 0) {
        losses[losses_off + row] =
            target == CE_IGNORE ? 0.0f : m + logf(s) - load_as(logits, x0 + target, bf16);
    }
}

// logits (rows, vp) become dloss * (softmax - onehot(target)), padding 0, in place.
KERNEL void crossentropy_backward_inplace(GLOBAL float* RESTRICT logits, unsigned logits_off,
                                          const GLOBAL unsigned* RESTRICT targets,
                                          unsigned targets_off, unsigned v, unsigned vp,
                                          float dloss, unsigned bf16) {
    SHARED float buf[BLOCK];
    unsigned row = GROUP_ID(0);
    int tid = LOCAL_ID(0);
    idx_t x0 = logits_off + (idx_t)row * vp;
    float m, s;
    ce_max_sum(buf, logits, x0, bf16, v, &m, &s);
    float inv = dloss / s;
    unsigned target = targets[targets_off + row];
    // Each thread rewrites only the columns it read, so in place is safe.
    for (unsigned j = tid; j < vp; j += BLOCK) {
        float g = j < v && target != CE_IGNORE ? expf(load_as(logits, x0 + j, bf16) - m) * inv : 0.0f;
        store_as(logits, x0 + j, j == target ? g - dloss : g, bf16);
    }
}
