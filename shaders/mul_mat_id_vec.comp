#version 450
// Routed-expert GEMV for decode (T ≤ 8; MODEL.md §5.7 M4): only the selected experts' rows are
// read. Workgroup (x, y): NDEC weight rows r0 = x·NDEC .. of pair a = y = t·k + j (token t,
// slot j), whose expert e = ids[t, j] is read here (no prepass). With W_e[r, ·] = buffer row
// w_row0 + e·w_estride + r (w_row0b for the second weight of MODE 2) and acc = Σ W_e[r, ·]·x_row:
//   MODE 0 (gate):   x_row = x[t]; y[a, r] = silu(acc)
//   MODE 1 (up):     x_row = x[t]; y[a, r] = y[a, r] · acc
//   MODE 2 (fused):  x_row = x[t]; y[a, r] = silu(acc_gate) · acc_up
//   MODE 3 (down):   x_row = x[a]; y[a, r] = w[t, j] · acc
// (the same stores as shaders/mul_mat_id.comp, with rows indexed by pair instead of plan row).
// Buffers: 0 W (raw GGML blocks), 1 x (f32, row at x_off + row·x_stride, multiples of 4),
// 2 ids (int32, row t at id_off + t·id_stride), 3 routing weights w (f32, row t at wt_off +
// t·wt_stride), 4 y (f32, row at y_off + row·y_stride).
// Each invocation walks 32-element slices of the rows (common/quant.glsl dot_slice, coalesced
// 16-byte chunks for K-quants), then subgroupAdd and one shared slot per subgroup (SG_MIN bounds
// the subgroup count; gl_SubgroupSize is never assumed), as shaders/mul_mat_vec.comp.
#extension GL_GOOGLE_include_directive : require
#include "common/base.glsl"
#define QUANT_BINDING 0
#include "common/quant.glsl"

layout(constant_id = 1) const uint MODE = 0;
layout(constant_id = 2) const uint NDEC = 8;
layout(constant_id = 3) const uint SG_MIN = 1;

layout(std430, binding = 1) readonly buffer X { vec4 xv[]; };
layout(std430, binding = 2) readonly buffer Ids { int ids[]; };
layout(std430, binding = 3) readonly buffer Wt { float wts[]; };
layout(std430, binding = 4) buffer Y { float y[]; };
layout(push_constant) uniform P {
    uint K; uint n_out; uint E; uint k;
    uint w_row0; uint w_row0b; uint w_estride;
    uint x_off; uint x_stride; uint y_off; uint y_stride; uint id_off; uint id_stride; uint wt_off; uint wt_stride;
} p;

const uint NB = MODE == 2u ? 2u : 1u;
shared float red[NB * NDEC * (gl_WorkGroupSize.x / SG_MIN)];


void main() {
    const uint tid = gl_LocalInvocationID.x;
    const uint a = gl_WorkGroupID.y, t = a / p.k, j = a % p.k, r0 = gl_WorkGroupID.x * NDEC;
    const uint e = min(uint(ids[p.id_off + t * p.id_stride + j]), p.E - 1u);
    const uint gpr = p.K / 32u;
    const uint xb = (p.x_off + (MODE == 3u ? a : t) * p.x_stride) / 4u;
    const uint wbase = p.w_row0 + e * p.w_estride, wbase2 = p.w_row0b + e * p.w_estride;

    float acc[NB * NDEC];
    for (uint i = 0u; i < NB * NDEC; ++i) acc[i] = 0.0;
    for (uint u = tid; u < gpr; u += gl_WorkGroupSize.x) {
        const uvec2 runs = slice_runs(u) / 4u;
        vec4 xg[8];
        for (uint q = 0u; q < 4u; ++q) {
            xg[q] = xv[xb + runs.x + q];
            xg[q + 4u] = xv[xb + runs.y + q];
        }
        const vec4 one = vec4(1.0);
        const vec2 xs = vec2(dot(xg[0] + xg[1] + xg[2] + xg[3], one), dot(xg[4] + xg[5] + xg[6] + xg[7], one));
        for (uint i = 0u; i < NDEC; ++i) {
            uint r = min(r0 + i, p.n_out - 1u);
            acc[i] += dot_slice((wbase + r) * gpr + u, xg, xs);
            if (MODE == 2u) acc[NDEC + i] += dot_slice((wbase2 + r) * gpr + u, xg, xs);
        }
    }
    for (uint i = 0u; i < NB * NDEC; ++i) {
        float s = subgroupAdd(acc[i]);
        if (subgroupElect()) red[gl_SubgroupID * NB * NDEC + i] = s;
    }
    barrier();
    for (uint i = tid; i < NDEC; i += gl_WorkGroupSize.x) {
        if (r0 + i >= p.n_out) continue;
        float s0 = 0.0, s1 = 0.0;
        for (uint sg = 0u; sg < gl_NumSubgroups; ++sg) {
            s0 += red[sg * NB * NDEC + i];
            if (MODE == 2u) s1 += red[sg * NB * NDEC + NDEC + i];
        }
        uint o = p.y_off + a * p.y_stride + r0 + i;
        precise float v = s0;
        if (MODE == 0u) v = silu(v);
        if (MODE == 1u) v = y[o] * v;
        if (MODE == 2u) v = silu(v) * s1;
        if (MODE == 3u) v = wts[p.wt_off + t * p.wt_stride + j] * v;
        y[o] = v;
    }
}
