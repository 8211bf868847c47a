#version 450
// Routed-expert decode GEMV in row groups (T ≤ 8; MODEL.md §5.7 M4), one dispatch per pass over
// (row tile × slot): only the selected experts' rows are read. Workgroup (x, y): pair a = y =
// t·k + j (token t, slot j) with expert e = ids[t, j] (read here, no prepass); its WG/TPR teams
// (common/gemv_core.glsl) own M output rows each, team g rows r0 = (x·TEAMS + g)·M .. +M−1.
// With W_e[r, ·] = buffer row w_row0 + e·w_estride + r (w_row0b for the second weight of MODE 2)
// and acc = Σ W_e[r, ·]·x_row, the stores are shaders/mul_mat_id_vec.comp's (this kernel replaces
// it; VKFLASH_GEMV_TEAMS=0 goes back):
//   MODE 0 (gate):   x_row = x[t]; y[a, r] = silu(acc)
//   MODE 1 (up):     x_row = x[t]; y[a, r] = y[a, r] · acc
//   MODE 2 (fused):  x_row = x[t]; y[a, r] = silu(acc_gate) · acc_up   (a team decodes M gate, M up rows)
//   MODE 3 (down):   x_row = x[a]; y[a, r] = w[t, j] · acc
// Buffers: 0 W (raw GGML blocks), 1 x (f32, row at x_off + row·x_stride, multiples of 4),
// 2 ids (int32, row t at id_off + t·id_stride), 3 routing weights w (f32, row t at wt_off +
// t·wt_stride), 4 y (f32, row at y_off + row·y_stride).
// Q8X (define): x quantized to 8-bit blocks in shared memory and integer dots (KQ = constant_id 6 = K);
// accuracy as common/gemv_core.glsl states.
#extension GL_GOOGLE_include_directive : require
#include "common/base.glsl"
#extension GL_EXT_control_flow_attributes : require
#define QUANT_BINDING 0
#define QUANT_FAST_CVT
#include "common/quant.glsl"

layout(constant_id = 1) const uint MODE = 0;
layout(constant_id = 2) const uint TPR = 8;     // invocations per team
layout(constant_id = 3) const uint NR = 2;      // weight rows decoded per team (MODE 2: M gate + M up)
layout(constant_id = 4) const uint SG_MIN = 1;
layout(constant_id = 5) const uint DEQ = 1;     // f32 x: weights decoded once (common/gemv_core.glsl)
#ifdef Q8X
#define GEMV_Q8
layout(constant_id = 6) const uint KQ = 32;     // shared x capacity (elements): K
#endif

layout(std430, binding = 1) readonly buffer X { vec4 xv[]; };
layout(std430, binding = 2) readonly buffer Ids { int ids[]; };
layout(std430, binding = 3) readonly buffer Wt { float wts[]; };
layout(std430, binding = 4) buffer Y { float y[]; };
layout(push_constant) uniform P {
    uint K; uint n_out; uint E; uint k;
    uint w_row0; uint w_row0b; uint w_estride;
    uint x_off; uint x_stride; uint y_off; uint y_stride; uint id_off; uint id_stride; uint wt_off; uint wt_stride;
} p;

const uint NSTACK = MODE == 2u ? 2u : 1u;
const uint M = NR / NSTACK;  // output rows per team

const uint NCOL = 1u;  // one column (token or slot row) per workgroup
uint g_r0, g_wbase, g_wbase2, g_xb;  // the team's first output row; the expert's first gate (up) row; the x row

uint gemv_wrow(uint i) { return (i < M ? g_wbase : g_wbase2) + min(g_r0 + i % M, p.n_out - 1u); }
uint gemv_xrow(uint c) { return g_xb; }
vec4 gemv_xpre(vec4 v) { return v; }
#include "common/gemv_core.glsl"

void main() {
    gemv_setup();
    const uint a = gl_WorkGroupID.y, t = a / p.k, j = a % p.k;
    if (gl_WorkGroupID.x * TEAMS * M >= p.n_out) return;  // uniform per workgroup
    g_r0 = (gl_WorkGroupID.x * TEAMS + g_team) * M;
    const uint e = min(uint(ids[p.id_off + t * p.id_stride + j]), p.E - 1u);
    g_wbase = p.w_row0 + e * p.w_estride;
    g_wbase2 = p.w_row0b + e * p.w_estride;
    g_xb = (p.x_off + (MODE == 3u ? a : t) * p.x_stride) / 4u;
    gemv_pass(p.K);
    [[unroll]] for (uint i = 0u; i < M; ++i) {
        if (g_lane != i % TPR || g_r0 + i >= p.n_out) continue;
        const uint o = p.y_off + a * p.y_stride + g_r0 + i;
        precise float v = acc[i];
        if (MODE == 0u) v = silu(v);
        if (MODE == 1u) v = y[o] * v;
        if (MODE == 2u) v = silu(v) * acc[min(M + i, NR - 1u)];
        if (MODE == 3u) v = wts[p.wt_off + t * p.wt_stride + j] * v;
        y[o] = v;
    }
}
