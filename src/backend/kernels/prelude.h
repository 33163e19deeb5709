// The prelude of every kernel source: the few constructs that differ between
// OpenCL C (PoCL, any OpenCL GPU) and CUDA C++ (NVRTC), as macros, so each
// .cu file below it is written once in a restricted dialect of both.
// Every kernel runs 1-D workgroups of BLOCK threads (the host's BLOCK too).

#define BLOCK 256

#ifdef __OPENCL_VERSION__
#define KERNEL __kernel
#define DEVICE
#define GLOBAL __global
#define SHARED __local
#define SHARED_PTR __local
#define RESTRICT restrict
#define BARRIER() barrier(CLK_LOCAL_MEM_FENCE)
typedef ulong idx_t;
#define LOCAL_ID(d) ((int)get_local_id(d))
#define GROUP_ID(d) ((unsigned)get_group_id(d))
#define LOCAL_SIZE(d) ((int)get_local_size(d))
#define NUM_GROUPS(d) ((unsigned)get_num_groups(d))
#define GLOBAL_ID(d) ((idx_t)get_global_id(d))
#define FLOAT_AS_UINT(x) as_uint(x)
#define UINT_AS_FLOAT(u) as_float(u)
#define expf(x) exp(x)
#define logf(x) log(x)
#define sqrtf(x) sqrt(x)
#define tanhf(x) tanh(x)
#define erff(x) erf(x)
#define fmaxf(a, b) fmax(a, b)
#define NEG_INF (-INFINITY)
// Four floats of local memory at p, which must be 16-byte aligned (as CUDA's).
#define SHARED_LOAD4(p) (*(const __local float4*)(p))
#else
#define KERNEL extern "C" __global__
#define DEVICE __device__
#define GLOBAL
#define SHARED __shared__
#define SHARED_PTR
#define RESTRICT __restrict__
#define BARRIER() __syncthreads()
#define SHARED_LOAD4(p) (*(const float4*)(p))
typedef unsigned long long idx_t;
#define DIM3(v, d) ((d) == 0 ? (v).x : (d) == 1 ? (v).y : (v).z)
#define LOCAL_ID(d) ((int)DIM3(threadIdx, d))
#define GROUP_ID(d) ((unsigned)DIM3(blockIdx, d))
#define LOCAL_SIZE(d) ((int)DIM3(blockDim, d))
#define NUM_GROUPS(d) ((unsigned)DIM3(gridDim, d))
#define GLOBAL_ID(d) ((idx_t)DIM3(blockIdx, d) * DIM3(blockDim, d) + DIM3(threadIdx, d))
#define FLOAT_AS_UINT(x) __float_as_uint(x)
#define UINT_AS_FLOAT(u) __uint_as_float(u)
#define NEG_INF (-__int_as_float(0x7f800000))
#endif

// a + b, or (`max`) the larger: what a reduction combines.
DEVICE float combine(float a, float b, int max) {
    return max ? fmaxf(a, b) : a + b;
}

#if !defined(__OPENCL_VERSION__) && defined(DISTGPT_CUDA_FAST)
// CUDA-only fast path (DISTGPT_CUDA_FAST=1 at run time): reductions through
// warp shuffles, one shared slot per warp. Still a fixed order, so still
// deterministic, but not the tree's order below: results differ from the
// portable path (and OpenCL) by float rounding. No OpenCL twin: compile-
// checked by NVRTC and ptxas (scripts/cuda-check), run by scripts/gpu_check.sh.
#define WARPS (BLOCK / 32)

DEVICE float warp_reduce(float v, int max) {
    for (int o = 16; o > 0; o >>= 1) v = combine(v, __shfl_xor_sync(0xffffffffu, v, o), max);
    return v;
}

// As the portable block_reduce below: every thread gets the result; buf
// holds BLOCK floats.
DEVICE float block_reduce(SHARED_PTR float* buf, float v, int max) {
    int tid = LOCAL_ID(0);
    v = warp_reduce(v, max);
    if ((tid & 31) == 0) buf[tid >> 5] = v;
    BARRIER();
    float r = warp_reduce((tid & 31) < WARPS ? buf[tid & 31] : max ? NEG_INF : 0.0f, max);
    BARRIER();  // buf may be reused right after
    return r;
}
#else
// The sum (or, `max`, the max) of v over the workgroup, returned to every
// thread; buf holds BLOCK floats. A fixed tree, so the result does not
// depend on scheduling. Every thread of the group must call it (it has
// barriers).
DEVICE float block_reduce(SHARED_PTR float* buf, float v, int max) {
    int tid = LOCAL_ID(0);
    buf[tid] = v;
    BARRIER();
    for (int s = BLOCK / 2; s > 0; s >>= 1) {
        if (tid < s) buf[tid] = combine(buf[tid], buf[tid + s], max);
        BARRIER();
    }
    float r = buf[0];
    BARRIER();  // buf may be reused right after
    return r;
}
#endif
#define block_sum(buf, v) block_reduce(buf, v, 0)
#define block_max(buf, v) block_reduce(buf, v, 1)

// v's bits rounded to the nearest bfloat16 (ties to even), still as a
// float's 32 bits (the low 16 zero); NaN stays a (quiet) NaN. The CPU's
// round_to_bf16, for round_bf16 and the GEMMs' bf16 operands alike.
DEVICE unsigned bf16_round_bits(float v) {
    unsigned bits = FLOAT_AS_UINT(v);
    return v != v ? 0x7fc00000u : ((bits + 0x7fffu + ((bits >> 16) & 1u)) & 0xffff0000u);
}

// Element i of a tensor held in floats or, where bf16, in bfloat16 values
// (the same buffer's 16-bit halves: a view's offset counts those).
DEVICE float load_as(const GLOBAL float* x, idx_t i, unsigned bf16) {
    return bf16 ? UINT_AS_FLOAT((unsigned)((const GLOBAL unsigned short*)x)[i] << 16) : x[i];
}

// Stores v as element i of a tensor held as load_as reads it (rounded
// to the nearest bfloat16 where bf16).
DEVICE void store_as(GLOBAL float* x, idx_t i, float v, unsigned bf16) {
    if (bf16) {
        ((GLOBAL unsigned short*)x)[i] = (unsigned short)(bf16_round_bits(v) >> 16);
    } else {
        x[i] = v;
    }
}

// Activations, shared by their pointwise kernels (elementwise.cu) and the bias
// gradient that runs an activation's backward in its pass (bias.cu).
#define GELU_SCALE 0.7978845608f  // sqrt(2 / pi)
#define GELU_CUBE 0.044715f

// tanh through exp (GELU's and the pooler's), as the CPU backend computes it: near |u| large, 1 - t^2
// below then keeps the relative precision of 1 - t, as on the CPU.
DEVICE float gelu_tanh(float u) {
    return 1.0f - 2.0f / (expf(2.0f * u) + 1.0f);
}

// Activations by number, as the host passes them: 1 GELU (tanh
// approximation), 2 GELU (exact), 3 tanh; 0 none.
#define ACT_NONE 0u
#define ACT_GELU_TANH 1u
#define ACT_GELU_ERF 2u
#define ACT_TANH 3u

// act(x); x for ACT_NONE.
DEVICE float activation(unsigned act, float x) {
    if (act == ACT_GELU_TANH) {
        return 0.5f * x * (1.0f + gelu_tanh(GELU_SCALE * (x + GELU_CUBE * x * x * x)));
    }
    if (act == ACT_GELU_ERF) {
        return 0.5f * x * (1.0f + erff(x * 0.7071067812f));
    }
    if (act == ACT_TANH) {
        return gelu_tanh(x);
    }
    return x;
}

// d act(x) / dx; 1 for ACT_NONE.
DEVICE float activation_grad(unsigned act, float x) {
    if (act == ACT_GELU_TANH) {
        float u = GELU_SCALE * (x + GELU_CUBE * x * x * x);
        float th = gelu_tanh(u);
        float du = GELU_SCALE * (1.0f + 3.0f * GELU_CUBE * x * x);
        return 0.5f * (1.0f + th) + 0.5f * x * (1.0f - th * th) * du;
    }
    if (act == ACT_GELU_ERF) {
        return 0.5f * (1.0f + erff(x * 0.7071067812f)) + x * 0.3989422804f * expf(-0.5f * x * x);
    }
    if (act == ACT_TANH) {
        float t = gelu_tanh(x);
        return 1.0f - t * t;
    }
    return 1.0f;
}
