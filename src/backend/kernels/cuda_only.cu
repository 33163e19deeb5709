// CUDA-only kernels: built into the cuda runtime's program, not OpenCL's
// (OpenCL has no counterpart to call them from). Compile-checked by NVRTC
// and ptxas here; run by scripts/gpu_check.sh.

// dst (n bfloat16 values) = src's floats rounded to bfloat16 (ties to
// even, as round_bf16): the operands cuBLAS's bf16 GEMM reads.
KERNEL void to_bf16(GLOBAL unsigned short* RESTRICT dst, unsigned dst_off,
                    const GLOBAL float* RESTRICT src, unsigned src_off, unsigned n) {
    idx_t i = GLOBAL_ID(0);
    if (i >= n) return;
    dst[dst_off + i] = (unsigned short)(bf16_round_bits(src[src_off + i]) >> 16);
}
