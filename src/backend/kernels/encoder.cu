// Token + position embedding. Every buffer comes with an element offset.

// out (rows, c) = wte[tokens[row]] + wpe[row % t]; one thread per element.
KERNEL void encoder_forward(GLOBAL float* RESTRICT out, unsigned out_off,
                            const GLOBAL unsigned* RESTRICT tokens, unsigned tokens_off,
                            const GLOBAL float* RESTRICT wte, unsigned wte_off,
                            const GLOBAL float* RESTRICT wpe, unsigned wpe_off,
                            unsigned rows, unsigned t, unsigned c) {
    idx_t i = GLOBAL_ID(0);
    if (i >= (idx_t)rows * c) return;
    unsigned row = (unsigned)(i / c), j = (unsigned)(i % c);
    unsigned tok = tokens[tokens_off + row];
    out[out_off + i] = wte[wte_off + (idx_t)tok * c + j] + wpe[wpe_off + (idx_t)(row % t) * c + j];
}

// dwte[toks[d]] += sum of the dout rows order[starts[d] .. starts[d + 1]], for
// each of the n_tok distinct tokens d (rows grouped by token on the host,
// ascending within a token): one thread per (token, channel) owns its
// output, so repeated tokens need no atomics and the sum order is fixed.
// dout (rows, c); order (rows); starts (n_tok + 1); toks (n_tok).
KERNEL void encoder_backward_wte(GLOBAL float* RESTRICT dwte, unsigned dwte_off,
                                 const GLOBAL float* RESTRICT dout, unsigned dout_off,
                                 const GLOBAL unsigned* RESTRICT order, unsigned order_off,
                                 const GLOBAL unsigned* RESTRICT starts, unsigned starts_off,
                                 const GLOBAL unsigned* RESTRICT toks, unsigned toks_off,
                                 unsigned n_tok, unsigned c) {
    idx_t i = GLOBAL_ID(0);
    if (i >= (idx_t)n_tok * c) return;
    unsigned d = (unsigned)(i / c), j = (unsigned)(i % c);
    idx_t dst = dwte_off + (idx_t)toks[toks_off + d] * c + j;
    float acc = dwte[dst];
    unsigned end = starts[starts_off + d + 1];
    for (unsigned s = starts[starts_off + d]; s < end; s++) {
        acc += dout[dout_off + (idx_t)order[order_off + s] * c + j];
    }
    dwte[dst] = acc;
}

// dwpe[p] += sum of dout rows p, p + t, ...; one thread per (position, channel).
// dwpe (t, c), dout (rows, c).
KERNEL void encoder_backward_wpe(GLOBAL float* RESTRICT dwpe, unsigned dwpe_off,
                                 const GLOBAL float* RESTRICT dout, unsigned dout_off,
                                 unsigned rows, unsigned t, unsigned c) {
    idx_t i = GLOBAL_ID(0);
    if (i >= (idx_t)t * c) return;
    unsigned p = (unsigned)(i / c), j = (unsigned)(i % c);
    float acc = dwpe[dwpe_off + i];
    for (unsigned row = p; row < rows; row += t) {
        acc += dout[dout_off + (idx_t)row * c + j];
    }
    dwpe[dwpe_off + i] = acc;
}
