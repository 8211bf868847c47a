#version 450
// Decode / MTP-verify GEMV in row groups: y[n, r] = epilogue(Σ_k W[r, k] x[n, k]) for n_tok ≤ 8
// token columns (interface and buffers: common/mm.glsl and shaders/mul_mat_vec.comp, whose
// normal mode and fused modes this kernel replaces; VKFLASH_GEMV_TEAMS=0 goes back to it).
// The workgroup's WG/TPR teams (common/gemv_core.glsl) each own M output rows: team t of
// workgroup w (id = x + y*groups_x) owns rows (w·TEAMS + t)·M .. +M−1 and decodes NR = NSTACK·M
// weight rows, row i being block i / M, output row r0 + i % M of the stacked weight (a ragged
// tail repeats the last row, whose results are not stored). The NPLAIN = n_tok columns are taken
// NCOL at a time (constant_id 9; passes in a rolled loop): within a pass every loaded weight slice
// is dotted with all NCOL columns (common/gemv_core.glsl); NCOL = 1 is the per-column loop
// (VKFLASH_GEMV_COLS=0), with the same sums bit for bit.
// Q8X (define): the integer-dot variant (the pass's x columns quantized to 8-bit blocks in shared
// memory by the workgroup; KQ = constant_id 11 = K); its accuracy bound is common/gemv_core.glsl's.
// MODE (constant_id 6, common/mv_store.glsl): 0 plain (EPILOGUE), 1 GLU, 2 HC mix (x = ℓ_pre,
// each element becomes ℓ = silu(ℓ_pre · (1/hc)) before the dots or the quantization, as
// mul_mat_vec.comp / hc.comp PRE), 3 MoE output. Buffers: 0 W, 1 x, 2 bias, 3 mul, 4 res, 5 y,
// 6 streams, 7 ys, 8 gate (as mul_mat_vec.comp).
#extension GL_GOOGLE_include_directive : require
#include "common/base.glsl"
#extension GL_EXT_control_flow_attributes : require
#define QUANT_BINDING 0
#define QUANT_FAST_CVT
#include "common/quant.glsl"
#define MM_PUSH_MORE uint streams_off; uint streams_stride; float inv_hc; uint ys_off; uint gate_off; uint gate_stride;
#include "common/mm.glsl"

layout(std430, binding = 6) readonly buffer Streams { float streams[]; };
layout(std430, binding = 7) readonly buffer Ys { float ys[]; };
layout(std430, binding = 8) readonly buffer Gate { float gate[]; };

layout(constant_id = 2) const uint TPR = 8;     // invocations per team (power of two ≤ WG)
layout(constant_id = 3) const uint NR = 2;      // weight rows decoded per team
layout(constant_id = 4) const uint NPLAIN = 1;  // x columns (tokens)
layout(constant_id = 5) const uint SG_MIN = 1;
layout(constant_id = 6) const uint MODE = 0;
layout(constant_id = 7) const uint HC = 1;      // MODE 2: hc streams stacked in W_up
layout(constant_id = 8) const uint TOPK = 1;    // MODE 3: routed slots per token
layout(constant_id = 9) const uint NCOL = 1;    // columns per pass (≤ NPLAIN)
layout(constant_id = 10) const uint DEQ = 1;    // f32 x: weights decoded once for all columns (common/gemv_core.glsl)
#ifdef Q8X
#define GEMV_Q8
layout(constant_id = 11) const uint KQ = 32;    // shared x capacity (elements per column): K
#endif
const uint NSTACK = MODE == 1u ? 2u : (MODE == 2u ? HC : 1u);  // weight blocks per output row
const uint M = NR / NSTACK;                                     // output rows per team

uint g_r0;   // the team's first output row
uint g_j0;   // the pass's first column
uint g_col;  // the column being stored (MV_SUM)

uint gemv_wrow(uint i) { return p.w_row0 + (i / M) * p.n_out + min(g_r0 + i % M, p.n_out - 1u); }
// x row of the pass's column c (a ragged last pass repeats the last column, not stored)
uint gemv_xrow(uint c) { return (p.x_off + min(g_j0 + c, p.n_tok - 1u) * p.x_stride) / 4u; }
vec4 gemv_xpre(vec4 v) {
    if (MODE == 2u) {
        for (uint e = 0u; e < 4u; ++e) {
            const float a = v[e] * p.inv_hc;  // ℓ = silu(ℓ_pre · (1/hc))
            v[e] = a * sigmoid(a);
        }
    }
    return v;
}
#include "common/gemv_core.glsl"

#define MV_SUM(c) acc[g_col * NR + (c) * M + i]  // block c of output row i, column g_col
#include "common/mv_store.glsl"

void main() {
    gemv_setup();
    const uint wg = gl_WorkGroupID.y * gl_NumWorkGroups.x + gl_WorkGroupID.x;
    if (wg * TEAMS * M >= p.n_out) return;  // uniform per workgroup
    g_r0 = (wg * TEAMS + g_team) * M;
    [[dont_unroll]] for (uint j0 = 0u; j0 < NPLAIN; j0 += NCOL) {
        g_j0 = j0;
        gemv_pass(p.K);
        [[unroll]] for (uint c = 0u; c < NCOL; ++c) {
            g_col = c;
            [[unroll]] for (uint i = 0u; i < M; ++i)  // every lane holds the sums: spread the stores
                if (g_lane == (c * M + i) % TPR && g_r0 + i < p.n_out && j0 + c < p.n_tok) store(i, g_r0 + i, j0 + c);
        }
    }
}
