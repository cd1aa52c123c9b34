/* Strata GPU engine: engine/_strata_cuda.so, one translation unit built from the op families below
 * (strata_cuda.h is the C API; docs/engine.md maps the files). The forward pass mirrors forward.c
 * operation for operation (same 8-bit activation blocks, same router, same double-precision expert
 * sum), so the CPU path is the oracle for every result.
 *
 * Each family is a .cu with its kernels beside their launchers; a .cuh holds what several families
 * share. The order is the dependency order: later files call earlier ones. */
#include "common.cuh"       /* errors, type dispatch, launch_k, settings of the step, device helpers */
#include "quant.cuh"        /* the unpack of every weight type (sub-blocks) */
#include "quant.cu"         /* dequantisation, 8-bit activation blocks, the sub-block dot product */
#include "linear.cuh"       /* the linear kernels' arguments: groups of pairs, row segments */
#include "norm.cu"          /* RMSNorm, q / k / v post-processing and RoPE, embedding, combine, SWIGLU */
#include "model.cuh"        /* weights, scratch, graph cache, KV cache: the structs */
#include "mmv.cu"           /* dense matvec, float weights, the reference kernel */
#include "gemm.cu"          /* the tensor-core GEMM: plain, k-split, prefill form */
#include "routed.cu"        /* routed experts' decode forms and the routed split's combine */
#include "head.cu"          /* the output head at batch 1 and the greedy pick */
#include "router.cu"        /* router logits, top-k routing, grouping by expert */
#include "linear.cu"        /* the dispatcher: which kernel runs a linear layer */
#include "router_sigmoid.cu" /* routing by the descriptor's rule: sigmoid gating, score-correction bias, expert groups */
#include "attention.cuh"    /* attention's arguments */
#include "attention_decode.cu"  /* k_attention (decode, fused q / k / v prep), the reference */
#include "attention_mma.cu"     /* prefill attention on tensor cores */
#include "attention_prefill.cu" /* prefill query tiles, attention_setup */
#include "attention_split.cu"   /* split-KV decode: the grid, the combine */
#include "model.cu"         /* devices, settings, upload, scratch */
#include "kv.cu"            /* the KV cache: its tiers (VRAM, pinned host), moves between them, staging */
#include "gptoss.cu"        /* gpt-oss: its routing, clamped SwiGLU, expert and output biases, checks */
#include "host_sync.cu"     /* the device / host thread handshake per layer; kv_host_attn, the CPU attending the host tier */
#include "hybrid.cu"        /* hybrid placement: slotted resident experts, the CPU share of a layer, the profile */
#include "staging.cu"       /* hybrid placement: experts staged over PCIe into a ring of two device slots */
#include "layer.cu"         /* the attention and FFN blocks of one layer */
#include "mla.cu"           /* deepseek2's multi-head latent attention: the latent cache, absorbed queries */
#include "step.cu"          /* a step: graphs, launch / wait, stg_forward */
