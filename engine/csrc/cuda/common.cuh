/* What every family of the GPU engine shares: errors and the C API's status codes, the type
 * dispatch, the launch helper (programmatic dependent launch), the step's settings, and the device
 * helpers (warp reductions, PDL, asynchronous copies). Part of the unity build (strata_cuda.cu). */
#pragma once
#include <cuda_runtime.h>
#include <float.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <map>
#include <vector>

extern "C" {
#include "../strata.h"
#include "strata_cuda.h"
}
#include "quant.cuh"

/* ------------------------------------------------------------------ errors */

static thread_local char g_err[512];

extern "C" const char *stg_last_error(void) { return g_err; }

static stg_status fail(stg_status code, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static stg_status fail(stg_status code, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(g_err, sizeof g_err, fmt, ap);
    va_end(ap);
    return code;
}

static stg_status cuda_fail(cudaError_t e, const char *what) {
    const stg_status code = e == cudaErrorMemoryAllocation ? ST_ENOMEM : ST_EINVAL;
    return fail(code, "%s: CUDA error %d (%s)", what, (int)e, cudaGetErrorString(e));
}

#define CU(call, what)                                 \
    do {                                               \
        const cudaError_t e_ = (call);                 \
        if (e_ != cudaSuccess) return cuda_fail(e_, what); \
    } while (0)
#define CHECK(expr)                      \
    do {                                 \
        const stg_status rc_ = (expr);   \
        if (rc_ != ST_OK) return rc_;    \
    } while (0)
#define LAUNCHED(what) CU(cudaGetLastError(), what)

/* ------------------------------------------------------------------ type dispatch */

#define QUANT_CASES(F)                                                                        \
    F(STG_Q4_0) F(STG_Q4_1) F(STG_Q5_0) F(STG_Q5_1) F(STG_Q8_0) F(STG_Q4_K) F(STG_Q5_K) F(STG_Q6_K) \
    F(STG_Q2_K) F(STG_Q3_K) F(STG_IQ2_XXS) F(STG_IQ2_XS) F(STG_IQ2_S) F(STG_IQ3_XXS) F(STG_IQ3_S) F(STG_IQ4_NL)    \
    F(STG_IQ4_XS) F(STG_MXFP4)
#define FLOAT_CASES(F) F(STG_F32) F(STG_F16) F(STG_BF16)

/* ------------------------------------------------------------------ launches */

/* Kernels of a step are launched with programmatic dependent launch where the device has
 * it (sm_90; g_pdl set per step from stg_settings.pdl): each may
 * be scheduled while its predecessor finishes, prefetching weights, and waits
 * (griddepcontrol.wait) before touching activations. Every kernel of a step waits in at least
 * one block before it exits, so a kernel's completion implies its predecessors' (the hybrid
 * handshake's host side relies on that: hybrid.cu). Errors surface through cudaGetLastError
 * (LAUNCHED). */
static thread_local bool g_pdl = false;
/* The next launch on g_pdl_cut_st goes without the attribute (pdl_cut): it follows a copy or an
 * event wait queued there, not a kernel (the runtime serialises such a launch in any case; this
 * keeps it independent of that). Cleared by that launch and at every step's start. */
static thread_local bool g_pdl_cut = false;
static thread_local cudaStream_t g_pdl_cut_st = nullptr;
static void pdl_cut(cudaStream_t st) { g_pdl_cut = true, g_pdl_cut_st = st; }
template <typename... KArgs, typename... Args>
static void launch_k(void (*kern)(KArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t st, Args... args) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid, cfg.blockDim = block, cfg.dynamicSmemBytes = smem, cfg.stream = st;
    cudaLaunchAttribute at[1];
    unsigned n = 0;
    const bool cut = g_pdl_cut && g_pdl_cut_st == st;
    if (cut) g_pdl_cut = false;
    if (g_pdl && !cut) {
        at[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
        at[n++].val.programmaticStreamSerializationAllowed = 1;
    }
    cfg.attrs = at, cfg.numAttrs = n;
    (void)cudaLaunchKernelEx(&cfg, kern, static_cast<KArgs>(args)...);
}

/* The settings of the step being queued (stg_model's, or the harness's): copied in per step, read by the
 * launchers below; graphs are keyed by the fields that change what is captured (graph_entry). */
static thread_local stg_settings g_set = {};

/* The shared memory a block of `device` may opt in to (cudaDevAttrMaxSharedMemoryPerBlockOptin, static and dynamic
 * together: 227 KiB on sm_90, 99 KiB = 101,376 bytes on sm_89), which picks the forms of the kernels whose fast form
 * needs more (the prefill attention's rows, the 8-bit cache's split decode stages). The kernel harness may assume a
 * smaller limit (stg_test_assume_smem_optin: g_smem_optin_assumed > 0), so that one device runs every form; the
 * engine's library never sets it. */
static int g_smem_optin_assumed = 0;
static int device_smem_optin(int device) {
    if (g_smem_optin_assumed > 0) return g_smem_optin_assumed;
    int v = 0;
    if (cudaDeviceGetAttribute(&v, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) != cudaSuccess) {
        cudaGetLastError();
        v = 48 * 1024; /* every device's without opting in */
    }
    return v;
}

/* ------------------------------------------------------------------ device helpers */

#define WARP 32
#define LIN_WARPS 4 /* rows per block of the matvec kernel */

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
/* expf / cosf / sinf as the CPU's libm gives them (correctly rounded in practice): through
 * double, so the GPU does not add its own last-bit differences to the 8-bit activation
 * rounding that follows (a one-ulp change can move a value across a rounding boundary). */
__device__ __forceinline__ float exp_cr(float x) { return (float)exp((double)x); }
__device__ __forceinline__ float silu_f(float x) { return x / (1.0f + exp_cr(-x)); }

/* Programmatic dependent launch (sm_90): a kernel of the step lets the next one be scheduled
 * at once (launch_dependents) and waits for its predecessor's completion and memory before
 * touching anything the predecessor wrote or reads (wait). Before its wait a kernel may
 * only read weights. Without the launch attribute (or before sm_90) both are no-ops. */
__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void prefetch_l1(const void *p) { asm volatile("prefetch.global.L1 [%0];\n" ::"l"(p)); }
__device__ __forceinline__ void prefetch_l2_last(const void *p) {
    asm volatile("prefetch.global.L2::evict_last [%0];\n" ::"l"(p));
}

/* Asynchronous global -> shared copies (the attention kernels, the Q4_K GEMM's stages). */
__device__ __forceinline__ void cp_async16(void *smem, const void *gmem) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem) : "memory");
}
/* the same, copying the 16 bytes where full and writing 16 zero bytes otherwise (src-size 0: gmem is not read) */
__device__ __forceinline__ void cp_async16_or_zero(void *smem, const void *gmem, bool full) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(full ? 16u : 0u)
                 : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
__device__ __forceinline__ void cp_async4(void *smem, const void *gmem) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(s), "l"(gmem) : "memory");
}
__device__ __forceinline__ void cp_async8(void *smem, const void *gmem) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(s), "l"(gmem) : "memory");
}
template <int N> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
#define PDL_ENTER() \
    do {            \
        pdl_trigger(); \
        pdl_wait();    \
    } while (0)
