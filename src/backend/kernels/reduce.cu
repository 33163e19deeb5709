// Whole-buffer reductions in two stages: each workgroup writes one partial
// and the host adds the partials in f64. The partition depends only on n and
// the number of groups, so results are reproducible run to run.

// partials (groups) = per-group sums of x (or of x^2 when square != 0) over
// x (n), grid-strided.
KERNEL void reduce_partial(GLOBAL float* RESTRICT partials, unsigned partials_off,
                           const GLOBAL float* RESTRICT x, unsigned x_off, unsigned n,
                           unsigned square) {
    SHARED float buf[BLOCK];
    idx_t stride = (idx_t)NUM_GROUPS(0) * BLOCK;
    float acc = 0.0f;
    for (idx_t i = GLOBAL_ID(0); i < n; i += stride) {
        float xi = x[x_off + i];
        acc += square ? xi * xi : xi;
    }
    acc = block_sum(buf, acc);
    if (LOCAL_ID(0) == 0) partials[partials_off + GROUP_ID(0)] = acc;
}
