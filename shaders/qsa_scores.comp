#version 450
// QSA block scores (MODEL.md Q5): s[t, b] = sum_{h < n_I} relu(qI_{t,h} . kappa_b), heads added in
// order, for each query t of the ubatch (position p0 + t, p0 = params[param_off]) and each of its
// visible complete blocks b < floor((p0 + t + 1)/r); other entries are left alone. Every dot runs
// over d = 0..DH-1 in order, so both variants give the same bits.
// QT = 1 (decode, verify): workgroup (x, t); x strides over blocks (grid-stride, so any depth fits
// one recording), one block per invocation; the query's n_I*DH values are staged in shared memory.
// QT > 1 (prefill): workgroup (x, y) scores queries yQT.. yQT+QT-1 against tiles of WG blocks
// (x strides over them); the tile's summary rows and the queries are staged DC dims at a time
// (coalesced loads: every summary row is read once per QT queries, not once per query), each
// invocation keeping QT*n_I dots for its block in registers.
// Buffers: 0 params (int32), 1 qI (f32: q_off + t*q_row + h*DH + d), 2 summary (f32 [n_blocks, DH]),
// 3 scores (f32: s_off + t*s_row + b). Spec: 1 DH, 2 N_I, 3 QT (queries per workgroup).
#extension GL_GOOGLE_include_directive : require
#extension GL_EXT_control_flow_attributes : require
#include "common/base.glsl"

layout(constant_id = 1) const uint DH = 128;
layout(constant_id = 2) const uint N_I = 4;
layout(constant_id = 3) const uint QT = 1;
const uint DC = 32u;  // dims staged per pass (QT > 1; DH is a multiple of it)

layout(std430, binding = 0) readonly buffer Params { int params[]; };
layout(std430, binding = 1) readonly buffer QI { float qi[]; };
layout(std430, binding = 2) readonly buffer Summary { float summary[]; };
layout(std430, binding = 3) writeonly buffer Scores { float scores[]; };

layout(push_constant) uniform P {
    uint param_off; uint r; uint n_blocks; uint q_off; uint q_row; uint s_off; uint s_row; uint n_tok;
} p;

shared float sq[QT > 1u ? QT * N_I * DC : N_I * DH];
shared float sk[QT > 1u ? gl_WorkGroupSize.x * (DC + 1u) : 1u];  // the tile's summary rows (padded rows)

void tiled();

void main() {
    if (QT > 1u) {
        tiled();
        return;
    }
    const uint tid = gl_LocalInvocationID.x, WG = gl_WorkGroupSize.x, t = gl_WorkGroupID.y;
    const uint p0 = uint(params[p.param_off]);
    const uint nb = min((p0 + t + 1u) / p.r, p.n_blocks);
    for (uint e = tid; e < N_I * DH; e += WG) sq[e] = qi[p.q_off + t * p.q_row + e];
    barrier();
    for (uint b = gl_WorkGroupID.x * WG + tid; b < nb; b += gl_NumWorkGroups.x * WG) {
        float s = 0.0;
        for (uint h = 0; h < N_I; ++h) {
            float dot = 0.0;
            [[dont_unroll]] for (uint d = 0; d < DH; ++d) dot += sq[h * DH + d] * summary[b * DH + d];
            s += max(dot, 0.0);
        }
        scores[p.s_off + t * p.s_row + b] = s;
    }
}

void tiled() {
    const uint tid = gl_LocalInvocationID.x, WG = gl_WorkGroupSize.x, t0 = gl_WorkGroupID.y * QT;
    const uint p0 = uint(params[p.param_off]);
    const uint nq = min(QT, p.n_tok - t0);
    const uint nb = min((p0 + t0 + nq) / p.r, p.n_blocks);  // blocks the last query sees
    for (uint b0 = gl_WorkGroupID.x * WG; b0 < nb; b0 += gl_NumWorkGroups.x * WG) {
        const uint b = b0 + tid;
        float dot[QT * N_I];
        [[unroll]] for (uint i = 0u; i < QT * N_I; ++i) dot[i] = 0.0;
        for (uint d0 = 0u; d0 < DH; d0 += DC) {
            barrier();  // the previous pass is done with sq and sk
            for (uint e = tid; e < QT * N_I * DC; e += WG) {
                const uint q = e / (N_I * DC), hd = e % (N_I * DC), h = hd / DC, d = hd % DC;
                sq[e] = q < nq ? qi[p.q_off + (t0 + q) * p.q_row + h * DH + d0 + d] : 0.0;
            }
            for (uint e = tid; e < WG * DC; e += WG) {
                const uint row = b0 + e / DC;
                sk[(e / DC) * (DC + 1u) + e % DC] = row < nb ? summary[row * DH + d0 + e % DC] : 0.0;
            }
            barrier();
            [[dont_unroll]] for (uint d = 0u; d < DC; ++d) {
                const float k = sk[tid * (DC + 1u) + d];
                [[unroll]] for (uint i = 0u; i < QT * N_I; ++i) dot[i] += sq[i * DC + d] * k;
            }
        }
        for (uint q = 0u; q < nq; ++q) {
            if (b >= min((p0 + t0 + q + 1u) / p.r, p.n_blocks)) continue;
            float s = 0.0;
            [[unroll]] for (uint h = 0u; h < N_I; ++h) s += max(dot[q * N_I + h], 0.0);
            scores[p.s_off + (t0 + q) * p.s_row + b] = s;
        }
    }
}
