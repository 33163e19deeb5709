// Pointwise kernels over n elements, one thread per element.

// out = act(inp) (prelude.h's numbers); with cols > 0, inp is (n / cols,
// cols) and out = act(inp + bias): a product's bias added in the
// activation's pass; inp and out held as load_as and store_as hold them
// (bf16: widened, rounded).
KERNEL void activation_forward(GLOBAL float* RESTRICT out, unsigned out_off,
                               const GLOBAL float* RESTRICT inp, unsigned inp_off,
                               const GLOBAL float* RESTRICT bias, unsigned bias_off,
                               unsigned n, unsigned cols, unsigned act, unsigned inp_bf16,
                               unsigned bf16) {
    idx_t i = GLOBAL_ID(0);
    if (i >= n) return;
    float x = load_as(inp, inp_off + i, inp_bf16);
    if (cols > 0) x += bias[bias_off + i % cols];
    store_as(out, out_off + i, activation(act, x), bf16);
}

// d *= act'(inp), in place; with cols > 0, d *= act'(inp + bias) (inp as
// above). With has_rounded the result goes to rounded (bf16) and d is only read.
KERNEL void activation_backward(GLOBAL float* d, unsigned d_off,
                                const GLOBAL float* RESTRICT inp, unsigned inp_off,
                                const GLOBAL float* RESTRICT bias, unsigned bias_off,
                                unsigned n, unsigned cols, unsigned act, unsigned inp_bf16,
                                GLOBAL float* rounded, unsigned rounded_off, unsigned has_rounded) {
    idx_t i = GLOBAL_ID(0);
    if (i >= n) return;
    float x = load_as(inp, inp_off + i, inp_bf16);
    if (cols > 0) x += bias[bias_off + i % cols];
    float v = d[d_off + i] * activation_grad(act, x);
    if (has_rounded) {
        store_as(rounded, rounded_off + i, v, 1);
    } else {
        d[d_off + i] = v;
    }
}

// dst = src.
KERNEL void copy(GLOBAL float* RESTRICT dst, unsigned dst_off,
                 const GLOBAL float* RESTRICT src, unsigned src_off, unsigned n) {
    idx_t i = GLOBAL_ID(0);
    if (i >= n) return;
    dst[dst_off + i] = src[src_off + i];
}

// dst = value.
KERNEL void fill(GLOBAL float* RESTRICT dst, unsigned dst_off, unsigned n, float value) {
    idx_t i = GLOBAL_ID(0);
    if (i >= n) return;
    dst[dst_off + i] = value;
}

// dst += src.
KERNEL void add_inplace(GLOBAL float* RESTRICT dst, unsigned dst_off,
                        const GLOBAL float* RESTRICT src, unsigned src_off, unsigned n) {
    idx_t i = GLOBAL_ID(0);
    if (i >= n) return;
    dst[dst_off + i] += src[src_off + i];
}

// x rounded to the nearest bfloat16 (ties to even), in place and kept as
// float: a bf16 matmul operand (--precision bf16). NaN stays NaN.
// dst and src may be the same view (rounding in place): no RESTRICT.
KERNEL void round_bf16(GLOBAL float* dst, unsigned dst_off,
                       const GLOBAL float* src, unsigned src_off, unsigned n) {
    idx_t i = GLOBAL_ID(0);
    if (i >= n) return;
    dst[dst_off + i] = UINT_AS_FLOAT(bf16_round_bits(src[src_off + i]));
}

// dst (n bfloat16 values) = src's floats rounded to bfloat16 (ties to even,
// as round_bf16): the operands a bf16 GEMM reads on cuBLAS, and a product
// stored in bf16.
KERNEL void to_bf16(GLOBAL unsigned short* RESTRICT dst, unsigned dst_off,
                    const GLOBAL float* RESTRICT src, unsigned src_off, unsigned n) {
    idx_t i = GLOBAL_ID(0);
    if (i >= n) return;
    dst[dst_off + i] = (unsigned short)(bf16_round_bits(src[src_off + i]) >> 16);
}

// dst (n floats) = src's bfloat16 values, exactly: a bf16 operand for a
// runtime whose GEMM takes floats only (CLBlast).
KERNEL void from_bf16(GLOBAL float* RESTRICT dst, unsigned dst_off,
                      const GLOBAL unsigned short* RESTRICT src, unsigned src_off, unsigned n) {
    idx_t i = GLOBAL_ID(0);
    if (i >= n) return;
    dst[dst_off + i] = UINT_AS_FLOAT((unsigned)src[src_off + i] << 16);
}
