// The bias parts of the matmul (the GEMMs themselves are CLBlast's / cuBLAS's).

// out (rows, n) = bias, or out += bias when accumulate != 0; one thread per element.
KERNEL void bias_forward(GLOBAL float* RESTRICT out, unsigned out_off,
                         const GLOBAL float* RESTRICT bias, unsigned bias_off,
                         unsigned rows, unsigned n, unsigned accumulate) {
    idx_t i = GLOBAL_ID(0);
    if (i >= (idx_t)rows * n) return;
    float b = bias[bias_off + i % n];
    out[out_off + i] = accumulate ? out[out_off + i] + b : b;
}

// dbias (n) += column sums of dout (rows, n), rows in order; one thread per column.
KERNEL void bias_backward(GLOBAL float* RESTRICT dbias, unsigned dbias_off,
                          const GLOBAL float* RESTRICT dout, unsigned dout_off,
                          unsigned rows, unsigned n) {
    idx_t j = GLOBAL_ID(0);
    if (j >= n) return;
    float acc = dbias[dbias_off + j];
    for (unsigned r = 0; r < rows; r++) acc += dout[dout_off + (idx_t)r * n + j];
    dbias[dbias_off + j] = acc;
}
