#version 450
// Routed-expert GEMM for prefill (MODEL.md §5.7 M4), scalar f32, over the plan of moe_prepass.comp.
// A workgroup owns BM = 64 weight rows (grid x) of one (expert e, row tile) pair (grid y + z·gy):
// the tile is plan rows q = o_e + tile·BN + n, n < min(BN, c_e − tile·BN), BN ∈ {16, 32, 48, 64}.
// COMPACT: the pair is live entry `slot` of the plan (slots ≥ n_live exit at once); else the
// grid covers every expert × max_tiles and dead pairs exit at once.
// Row q holds pair index a = t·k + j (token t, slot j). With W_e[r, ·] = buffer row
// w_row0 + e·w_estride + r (w_row0b for the second weight of MODE 2), and acc = Σ W_e[r, ·]·x_row:
//   MODE 0 (gate):   x_row = x[t]; y[q, r] = silu(acc)
//   MODE 1 (up):     x_row = x[t]; y[q, r] = y[q, r] · acc          (after MODE 0 into the same y)
//   MODE 2 (fused):  x_row = x[t]; y[q, r] = silu(acc_gate) · acc_up (both weights in one buffer)
//   MODE 3 (down):   x_row = x[q]; y[a, r] = w[t, j] · acc          (routing weight fused)
// so MODE 0+1 and MODE 2 give identical bits (each step rounded as written, `precise`).
// Buffers: 0 W (raw GGML blocks, common/quant.glsl), 1 x (f32, row n at x_off + n·x_stride,
// multiples of 4), 2 plan (uint32), 3 routing weights w (f32, row t at wt_off + t·wt_stride),
// 4 y (f32, row at y_off + row·y_stride).
// Invocation (tx, ty) of 16×16 accumulates rows tx + 16i (i < 4) and tile rows ty + 16j (j < BN/16),
// from 32-wide k steps decoded once into shared memory (as shaders/mul_mat.comp).
#extension GL_GOOGLE_include_directive : require
#include "common/base.glsl"
#define QUANT_BINDING 0
#include "common/quant.glsl"

layout(constant_id = 1) const uint MODE = 0;
layout(constant_id = 2) const uint BN = 64;
layout(constant_id = 3) const bool COMPACT = true;

layout(std430, binding = 1) readonly buffer X { vec4 xv[]; };
layout(std430, binding = 2) readonly buffer Plan { uint plan[]; };
layout(std430, binding = 3) readonly buffer Wt { float wts[]; };
layout(std430, binding = 4) buffer Y { float y[]; };
layout(push_constant) uniform P {
    uint K; uint n_out; uint E; uint k; uint live_cap; uint max_tiles;
    uint w_row0; uint w_row0b; uint w_estride;
    uint x_off; uint x_stride; uint y_off; uint y_stride; uint wt_off; uint wt_stride;
} p;

const uint BM = 64u, BK = 32u, SK = BK + 1u, TI = 4u, TJ = BN / 16u, NB = MODE == 2u ? 2u : 1u;
shared float As[NB * BM * SK];
shared float Bs[BN * SK];
shared uint xrow[BN];
shared uint orow[BN];
shared float wrow[BN];


void main() {
    const uint tid = gl_LocalInvocationID.x, tx = tid % 16u, ty = tid / 16u;
    const uint slot = gl_WorkGroupID.z * gl_NumWorkGroups.y + gl_WorkGroupID.y;
    uint e, tile;
    if (COMPACT) {
        if (slot >= plan[0]) return;  // uniform: dead workgroups exit at once
        uint v = plan[1u + 2u * p.E + slot];
        e = v & 0xFFFFu;
        tile = v >> 16;
    } else {
        e = slot / p.max_tiles;
        tile = slot % p.max_tiles;
        if (e >= p.E || tile * BN >= plan[1u + e]) return;
    }
    const uint q0 = plan[1u + p.E + e] + tile * BN, rows = min(BN, plan[1u + e] - tile * BN);
    const uint P0 = 1u + 2u * p.E + p.live_cap;
    for (uint n = tid; n < BN; n += gl_WorkGroupSize.x) {
        uint q = q0 + min(n, rows - 1u), a = plan[P0 + q], t = a / p.k;
        xrow[n] = MODE == 3u ? q : t;
        orow[n] = MODE == 3u ? a : q;
        wrow[n] = MODE == 3u ? wts[p.wt_off + t * p.wt_stride + a % p.k] : 0.0;
    }
    barrier();

    const uint r0 = gl_WorkGroupID.x * BM, gpr = p.K / 32u;
    const uint wbase = p.w_row0 + e * p.w_estride, wbase2 = p.w_row0b + e * p.w_estride;
    float acc[NB * TI * TJ];
    for (uint a = 0u; a < NB * TI * TJ; ++a) acc[a] = 0.0;

    for (uint u = 0u; u < gpr; ++u) {
        if (tid < NB * BM) {
            uint b = tid / BM, r = min(r0 + tid % BM, p.n_out - 1u);
            vec4 w[8];
            dequant_group(((b == 0u ? wbase : wbase2) + r) * gpr + u, w);
            for (uint q = 0u; q < 8u; ++q)
                for (uint c = 0u; c < 4u; ++c) As[tid * SK + 4u * q + c] = w[q][c];
        }
        for (uint i = tid; i < BN * 8u; i += gl_WorkGroupSize.x) {
            uint n = i / 8u, q = i % 8u;
            vec4 xx = xv[(p.x_off + xrow[n] * p.x_stride) / 4u + u * 8u + q];
            for (uint c = 0u; c < 4u; ++c) Bs[n * SK + 4u * q + c] = xx[c];
        }
        barrier();
        for (uint kk = 0u; kk < BK; ++kk) {
            float b[TJ];
            for (uint j = 0u; j < TJ; ++j) b[j] = Bs[(ty + 16u * j) * SK + kk];
            for (uint m = 0u; m < NB; ++m) {
                for (uint i = 0u; i < TI; ++i) {
                    float a = As[(m * BM + tx + 16u * i) * SK + kk];
                    for (uint j = 0u; j < TJ; ++j) acc[(m * TI + i) * TJ + j] = fma(a, b[j], acc[(m * TI + i) * TJ + j]);
                }
            }
        }
        barrier();
    }

    for (uint i = 0u; i < TI; ++i) {
        for (uint j = 0u; j < TJ; ++j) {
            uint r = r0 + tx + 16u * i, n = ty + 16u * j;
            if (r >= p.n_out || n >= rows) continue;
            uint o = p.y_off + orow[n] * p.y_stride + r;
            precise float v = acc[i * TJ + j];
            if (MODE == 0u) v = silu(v);
            if (MODE == 1u) v = y[o] * v;
            if (MODE == 2u) v = silu(v) * acc[(TI + i) * TJ + j];
            if (MODE == 3u) v = wrow[n] * v;
            y[o] = v;
        }
    }
}
