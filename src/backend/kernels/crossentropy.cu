// Fused softmax + cross-entropy over a padded vocabulary: logits rows have vp
// columns of which the first v are real. One workgroup per row. A row whose
// target is CE_IGNORE (data::IGNORE) has loss 0 and gradient 0.

#define CE_IGNORE 0xffffffffu

// losses (rows) = -log softmax(logits row)[target].
KERNEL void crossentropy_forward(GLOBAL float* RESTRICT losses, unsigned losses_off,
                                 const GLOBAL float* RESTRICT logits, unsigned logits_off,
                                 const GLOBAL unsigned* RESTRICT targets, unsigned targets_off,
                                 unsigned v, unsigned vp) {
    SHARED float buf[BLOCK];
    unsigned row = GROUP_ID(0);
    int tid = LOCAL_ID(0);
    const GLOBAL float* x = logits + logits_off + (idx_t)row * vp;
    float m = NEG_INF;
    for (unsigned j = tid; j < v; j += BLOCK) m = fmaxf(m, x[j]);
    m = block_max(buf, m);
    float s = 0.0f;
    for (unsigned j = tid; j < v; j += BLOCK) s += expf(x[j] - m);
    s = block_sum(buf, s);
    unsigned target = targets[targets_off + row];
    if (tid == 0) losses[losses_off + row] = target == CE_IGNORE ? 0.0f : m + logf(s) - x[target];
}

// logits (rows, vp) become dloss * (softmax - onehot(target)), padding 0, in place.
KERNEL void crossentropy_backward_inplace(GLOBAL float* RESTRICT logits, unsigned logits_off,
                                          const GLOBAL unsigned* RESTRICT targets,
                                          unsigned targets_off, unsigned v, unsigned vp,
                                          float dloss) {
    SHARED float buf[BLOCK];
    unsigned row = GROUP_ID(0);
    int tid = LOCAL_ID(0);
    GLOBAL float* x = logits + logits_off + (idx_t)row * vp;
    float m = NEG_INF;
    for (unsigned j = tid; j < v; j += BLOCK) m = fmaxf(m, x[j]);
    m = block_max(buf, m);
    float s = 0.0f;
    for (unsigned j = tid; j < v; j += BLOCK) s += expf(x[j] - m);
    float inv = dloss / block_sum(buf, s);
    unsigned target = targets[targets_off + row];
    // Each thread rewrites only the columns it read, so in place is safe.
    for (unsigned j = tid; j < vp; j += BLOCK) {
        float g = j < v && target != CE_IGNORE ? expf(x[j] - m) * inv : 0.0f;
        x[j] = j == target ? g - dloss : g;
    }
}
