// LayerNorm over the last dimension; eps is the model's (GPT-2 1e-5, BERT 1e-12).

// One workgroup per row. inp, out (rows, c); w, b (c); mean, rstd (rows);
// out held as store_as holds it (bf16: rounded).
KERNEL void layernorm_forward(GLOBAL float* RESTRICT out, unsigned out_off,
                              GLOBAL float* RESTRICT mean, unsigned mean_off,
                              GLOBAL float* RESTRICT rstd, unsigned rstd_off,
                              const GLOBAL float* RESTRICT inp, unsigned inp_off,
                              const GLOBAL float* RESTRICT w, unsigned w_off,
                              const GLOBAL float* RESTRICT b, unsigned b_off,
                              unsigned c, float eps, unsigned bf16) {
    SHARED float buf[BLOCK];
    unsigned row = GROUP_ID(0);
    int tid = LOCAL_ID(0);
    const GLOBAL float* x = inp + inp_off + (idx_t)row * c;
    idx_t o = out_off + (idx_t)row * c;
    w += w_off;
    b += b_off;
    float s = 0.0f;
    for (unsigned j = tid; j < c; j += BLOCK) s += x[j];
    float mu = block_sum(buf, s) / (float)c;
    float ss = 0.0f;
    for (unsigned j = tid; j < c; j += BLOCK) {
        float d = x[j] - mu;
        ss += d * d;
    }
    float var = block_sum(buf, ss) / (float)c;
    float r = 1.0f / sqrtf(var + eps);
    for (unsigned j = tid; j < c; j += BLOCK) store_as(out, o + j, (x[j] - mu) * r * w[j] + b[j], bf16);
    if (tid == 0) {
        mean[mean_off + row] = mu;
        rstd[rstd_off + row] = r;
    }
}

// dinp (rows, c) += d loss / d inp (= without accumulate); one workgroup per row.
KERNEL void layernorm_backward_dinp(GLOBAL float* RESTRICT dinp, unsigned dinp_off,
                                    const GLOBAL float* RESTRICT dout, unsigned dout_off,
                                    const GLOBAL float* RESTRICT inp, unsigned inp_off,
                                    const GLOBAL float* RESTRICT w, unsigned w_off,
                                    const GLOBAL float* RESTRICT mean, unsigned mean_off,
                                    const GLOBAL float* RESTRICT rstd, unsigned rstd_off,
                                    unsigned c, unsigned accumulate) {
    SHARED float buf[BLOCK];
    unsigned row = GROUP_ID(0);
    int tid = LOCAL_ID(0);
    const GLOBAL float* x = inp + inp_off + (idx_t)row * c;
    const GLOBAL float* d = dout + dout_off + (idx_t)row * c;
    GLOBAL float* di = dinp + dinp_off + (idx_t)row * c;
    w += w_off;
    float mu = mean[mean_off + row], rs = rstd[rstd_off + row];
    float a = 0.0f, an = 0.0f;
    for (unsigned j = tid; j < c; j += BLOCK) {
        float dn = d[j] * w[j];
        a += dn;
        an += dn * (x[j] - mu);
    }
    float dnorm_mean = block_sum(buf, a) / (float)c;
    float dnorm_norm_mean = block_sum(buf, an) * rs / (float)c;
    for (unsigned j = tid; j < c; j += BLOCK) {
        float norm = (x[j] - mu) * rs;
        // dn as its own statement: not fused into the subtraction below,
        // whose rounding rs (up to 1/sqrt(eps)) would amplify.
        float dn = d[j] * w[j];
        float g = (dn - dnorm_mean - norm * dnorm_norm_mean) * rs;
        di[j] = accumulate ? di[j] + g : g;
    }
}

// partials (chunks, 2c) = [sum of dout * norm | sum of dout] over the rows
// chunk * chunk_rows .. of each chunk, rows in order; one thread per
// (chunk, channel). Reduced by layernorm_backward_params in chunk order: no
// atomics, a fixed order.
KERNEL void layernorm_backward_partials(GLOBAL float* RESTRICT partials, unsigned partials_off,
                                        const GLOBAL float* RESTRICT dout, unsigned dout_off,
                                        const GLOBAL float* RESTRICT inp, unsigned inp_off,
                                        const GLOBAL float* RESTRICT mean, unsigned mean_off,
                                        const GLOBAL float* RESTRICT rstd, unsigned rstd_off,
                                        unsigned rows, unsigned c, unsigned chunks,
                                        unsigned chunk_rows) {
    idx_t i = GLOBAL_ID(0);
    if (i >= (idx_t)chunks * c) return;
    unsigned chunk = (unsigned)(i / c), j = (unsigned)(i % c);
    unsigned end = rows - chunk * chunk_rows < chunk_rows ? rows : (chunk + 1) * chunk_rows;
    float pw = 0.0f, pb = 0.0f;
    for (unsigned row = chunk * chunk_rows; row < end; row++) {
        float d = dout[dout_off + (idx_t)row * c + j];
        float norm = (inp[inp_off + (idx_t)row * c + j] - mean[mean_off + row]) * rstd[rstd_off + row];
        pw += d * norm;
        pb += d;
    }
    GLOBAL float* p = partials + partials_off + (idx_t)chunk * 2 * c;
    p[j] = pw;
    p[c + j] = pb;
}

// dw, db (c) += the sum over chunks of partials (chunks, 2c); one thread per channel.
KERNEL void layernorm_backward_params(GLOBAL float* RESTRICT dw, unsigned dw_off,
                                      GLOBAL float* RESTRICT db, unsigned db_off,
                                      const GLOBAL float* RESTRICT partials, unsigned partials_off,
                                      unsigned chunks, unsigned c) {
    idx_t j = GLOBAL_ID(0);
    if (j >= c) return;
    const GLOBAL float* p = partials + partials_off;
    float aw = dw[dw_off + j], ab = db[db_off + j];
    for (unsigned g = 0; g < chunks; g++) {
        aw += p[(idx_t)g * 2 * c + j];
        ab += p[(idx_t)g * 2 * c + c + j];
    }
    dw[dw_off + j] = aw;
    db[db_off + j] = ab;
}
