// Rows of one matrix into rows of another at other strides (ops/rows.rs).

// dst[r * dst_stride + j] = src[r * src_stride + j], or += with add != 0,
// for r < rows and j < w; one thread per element (rows never overlap).
KERNEL void rows_copy(GLOBAL float* RESTRICT dst, unsigned dst_off,
                      const GLOBAL float* RESTRICT src, unsigned src_off,
                      unsigned rows, unsigned w, unsigned dst_stride, unsigned src_stride,
                      unsigned add) {
    idx_t i = GLOBAL_ID(0);
    if (i >= (idx_t)rows * w) return;
    unsigned r = (unsigned)(i / w), j = (unsigned)(i % w);
    idx_t d = dst_off + (idx_t)r * dst_stride + j;
    float v = src[src_off + (idx_t)r * src_stride + j];
    dst[d] = add ? dst[d] + v : v;
}
