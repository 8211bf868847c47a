#version 450
// PLE per-stream gate (MODEL.md §5.3 P7-P8): for token t and stream c < hc,
//   s = (Kt[t, c, :] . Qt[t, c, :]) / sqrt(d),  lam = sigmoid(sign(s) * sqrt(max(|s|, 1e-6)))
// (sign(0) = 0), then V[t, c, i] = lam * vp[t, i] for i < d. One workgroup per (t, c), grid-stride.
// Buffers: 0 Kt, 1 Qt (f32, rows of hc*d), 2 vp (f32, rows of d), 3 lam (f32, rows of hc),
// 4 V (f32, rows of hc*d). Push: d, hc, n_rows, then off/stride (elements) of Kt, Qt, vp, lam, V.
#extension GL_GOOGLE_include_directive : require
#include "common/base.glsl"
#include "common/reduce.glsl"

layout(std430, binding = 0) readonly buffer K { float kt[]; };
layout(std430, binding = 1) readonly buffer Q { float qt[]; };
layout(std430, binding = 2) readonly buffer VP { float vp[]; };
layout(std430, binding = 3) writeonly buffer L { float lam[]; };
layout(std430, binding = 4) writeonly buffer V { float v[]; };
layout(push_constant) uniform P {
    uint d; uint hc; uint n_rows;
    uint k_off; uint k_stride; uint q_off; uint q_stride; uint vp_off; uint vp_stride;
    uint lam_off; uint lam_stride; uint v_off; uint v_stride;
} p;

void main() {
    const uint total = p.n_rows * p.hc;
    for (uint w = gl_WorkGroupID.x; w < total; w += gl_NumWorkGroups.x) {
        const uint t = w / p.hc, c = w - t * p.hc;
        const uint kb = p.k_off + t * p.k_stride + c * p.d, qb = p.q_off + t * p.q_stride + c * p.d;
        float acc = 0.0;
        for (uint i = gl_LocalInvocationID.x; i < p.d; i += gl_WorkGroupSize.x) acc += kt[kb + i] * qt[qb + i];
        const float s = wg_sum(acc) / sqrt(float(p.d));
        const float g = sigmoid(sign(s) * sqrt(max(abs(s), 1e-6)));
        if (gl_LocalInvocationID.x == 0u) lam[p.lam_off + t * p.lam_stride + c] = g;
        const uint vb = p.v_off + t * p.v_stride + c * p.d, pb = p.vp_off + t * p.vp_stride;
        for (uint i = gl_LocalInvocationID.x; i < p.d; i += gl_WorkGroupSize.x) v[vb + i] = g * vp[pb + i];
    }
}
