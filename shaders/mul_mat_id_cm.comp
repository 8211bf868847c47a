#version 450
// Routed-expert GEMM for prefill on cooperative matrices (f16 inputs, f32 accumulators; tiles,
// pipeline and staging: common/mm_cm.glsl) over the plan of moe_prepass.comp. Same interface,
// plan walk and stores as the scalar mul_mat_id.comp (its header defines MODE 0–3 and the
// buffers): a workgroup owns BM weight rows (grid x) of one (expert e, row tile) pair (grid
// y + z·gy), BN = the plan's tile width (16, 32, 48 or 64 rows), COMPACT as there.
// MODE 2 (fused gate/up): weight block 0 is the gate rows, block 1 the up rows of the same BM
// outputs; a warp tile holds both accumulators and stores silu(gate)·up (cm_combine, per element).
// MODE 3 (down): the routing weight w[t, j] multiplies each output in the store.
// FAST (spec constant 11): weight groups decoded from wide loads (common/quant_group.glsl's
// cm_group_load / cm_group_decode, the same values as dequant_group; VKFLASH_MMID_FAST_FETCH).
// HALF (spec constant 12, with FAST): every invocation fetches and decodes half groups, the same
// values into the same places (common/mm_cm.glsl; VKFLASH_MMID_HALF).
// Every store is rounded step by step (`precise`) exactly as mul_mat_id.comp rounds it.
#extension GL_GOOGLE_include_directive : require
#include "common/base.glsl"
#define QUANT_BINDING 0
#define QUANT_FAST_CVT  // the word view common/quant_group.glsl reads 2-byte aligned blocks through
#include "common/quant.glsl"
#include "common/quant_group.glsl"

layout(constant_id = 1) const uint MODE = 0;
layout(constant_id = 10) const bool COMPACT = true;

layout(std430, binding = 1) readonly buffer X { vec4 xv[]; };
layout(std430, binding = 2) readonly buffer Plan { uint plan[]; };
layout(std430, binding = 3) readonly buffer Wt { float wts[]; };
layout(std430, binding = 4) buffer Y { float y[]; };
layout(push_constant) uniform P {
    uint K; uint n_out; uint E; uint k; uint live_cap; uint max_tiles;
    uint w_row0; uint w_row0b; uint w_estride;
    uint x_off; uint x_stride; uint y_off; uint y_stride; uint wt_off; uint wt_stride;
} p;

const uint NB = MODE == 2u ? 2u : 1u;
#define CM_COMBINE
#define CM_FAST_SPEC  // FAST: spec constant 11 (VKFLASH_MMID_FAST_FETCH)
#define CM_HALF_SPEC  // HALF: spec constant 12 (VKFLASH_MMID_HALF)
#include "common/mm_cm.glsl"

shared uint xrow[BN];
shared uint orow[BN];
shared float wrow[BN];
uint cm_r0, cm_rows, cm_wbase, cm_wbase2;

uint cm_w_row(uint b, uint row) { return (b == 0u ? cm_wbase : cm_wbase2) + min(cm_r0 + row, p.n_out - 1u); }
uint cm_x_base(uint n) { return (p.x_off + xrow[n] * p.x_stride) / 4u; }
float cm_combine(float g, float u) {
    precise float v = g;
    v = silu(v) * u;
    return v;
}
void cm_store(float acc, uint r, uint n) {
    r += cm_r0;
    if (r >= p.n_out || n >= cm_rows) return;
    uint o = p.y_off + orow[n] * p.y_stride + r;
    precise float v = acc;
    if (MODE == 0u) v = silu(v);
    if (MODE == 1u) v = y[o] * v;
    if (MODE == 3u) v = wrow[n] * v;
    y[o] = v;  // MODE 2: cm_combine already applied
}

void main() {
    const uint tid = gl_LocalInvocationID.x;
    const uint slot = gl_WorkGroupID.z * gl_NumWorkGroups.y + gl_WorkGroupID.y;
    uint e, tile;
    if (COMPACT) {
        if (slot >= plan[0]) return;  // uniform: dead workgroups exit before any barrier
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
    cm_r0 = gl_WorkGroupID.x * BM;
    cm_rows = rows;
    cm_wbase = p.w_row0 + e * p.w_estride;
    cm_wbase2 = p.w_row0b + e * p.w_estride;
    cm_gemm(p.K / 32u, 0u, p.K / 32u);
}
