// The bias parts of the matmul (the GEMMs themselves are CLBlast's / cuBLAS's).

// out (rows, n) = bias, or out += bias when accumulate != 0; one thread
// per element. out held as store_as holds it (bf16: the bias rounded, and
// never accumulated onto).
KERNEL void bias_forward(GLOBAL float* RESTRICT out, unsigned out_off,
                         const GLOBAL float* RESTRICT bias, unsigned bias_off,
                         unsigned rows, unsigned n, unsigned accumulate, unsigned out_bf16) {
    idx_t i = GLOBAL_ID(0);
    if (i >= (idx_t)rows * n) return;
    float b = bias[bias_off + i % n];
    store_as(out, out_off + i, accumulate ? out[out_off + i] + b : b, out_bf16);
}

// partials (chunks, n) = column sums of d (rows, n) over the rows
// chunk * chunk_rows .. of each chunk, rows in order; one thread per
// (chunk, column). With an activation (act, prelude.h) each element is
// first turned into its pre-activation's gradient, d *= act'(inp [+ bias]
// where has_bias; inp held as load_as reads it), and written back (with
// has_rounded, rounded to bf16 into rounded, d only read): the activation's
// backward and the bias gradient in one pass; with ACT_NONE d is only read
// (and inp, bias and rounded not at all; then d may be held in bf16,
// d_bf16, as load_as reads it). Reduced by
// bias_backward_sum in chunk order: no atomics, a fixed order (the CPU's),
// and chunks * n threads where one per column left the GPU idle (a
// 768-wide bias over 8192 rows: 3 workgroups).
KERNEL void bias_backward_partials(GLOBAL float* RESTRICT partials, unsigned partials_off,
                                   GLOBAL float* d, unsigned d_off,
                                   const GLOBAL float* inp, unsigned inp_off,
                                   const GLOBAL float* bias, unsigned bias_off,
                                   unsigned has_bias, unsigned rows, unsigned n,
                                   unsigned chunks, unsigned chunk_rows, unsigned act,
                                   unsigned inp_bf16, GLOBAL float* rounded,
                                   unsigned rounded_off, unsigned has_rounded, unsigned d_bf16) {
    idx_t i = GLOBAL_ID(0);
    if (i >= (idx_t)chunks * n) return;
    unsigned chunk = (unsigned)(i / n), j = (unsigned)(i % n);
    unsigned end = rows - chunk * chunk_rows < chunk_rows ? rows : (chunk + 1) * chunk_rows;
    float acc = 0.0f;
    for (unsigned r = chunk * chunk_rows; r < end; r++) {
        idx_t at = (idx_t)r * n + j;
        float v = load_as(d, d_off + at, d_bf16);
        if (act != ACT_NONE) {
            float x = load_as(inp, inp_off + at, inp_bf16);
            if (has_bias) x += bias[bias_off + j];
            v *= activation_grad(act, x);
            if (has_rounded) {
                store_as(rounded, rounded_off + at, v, 1);
            } else {
                d[d_off + at] = v;
            }
        }
        acc += v;
    }
    partials[partials_off + i] = acc;
}

// dbias (n) += the sum over chunks of partials (chunks, n); one thread per column.
KERNEL void bias_backward_sum(GLOBAL float* RESTRICT dbias, unsigned dbias_off,
                              const GLOBAL float* RESTRICT partials, unsigned partials_off,
                              unsigned chunks, unsigned n) {
    idx_t j = GLOBAL_ID(0);
    if (j >= n) return;
    float acc = dbias[dbias_off + j];
    for (unsigned g = 0; g < chunks; g++) acc += partials[partials_off + (idx_t)g * n + j];
    dbias[dbias_off + j] = acc;
}
