#version 450
// QSA block scores (MODEL.md Q5): s[t, b] = sum_{h < n_I} relu(qI_{t,h} . kappa_b), heads added in
// order, for each query t of the ubatch (position p0 + t, p0 = params[param_off]) and each of its
// visible complete blocks b < floor((p0 + t + 1)/r); other entries are left alone.
// Workgroup (x, t): x strides over blocks (grid-stride, so any depth fits one recording); the
// query's n_I*DH values are staged in shared memory.
// Buffers: 0 params (int32), 1 qI (f32: q_off + t*q_row + h*DH + d), 2 summary (f32 [n_blocks, DH]),
// 3 scores (f32: s_off + t*s_row + b). Spec: 1 DH, 2 N_I.
#extension GL_GOOGLE_include_directive : require
#extension GL_EXT_control_flow_attributes : require
#include "common/base.glsl"

layout(constant_id = 1) const uint DH = 128;
layout(constant_id = 2) const uint N_I = 4;

layout(std430, binding = 0) readonly buffer Params { int params[]; };
layout(std430, binding = 1) readonly buffer QI { float qi[]; };
layout(std430, binding = 2) readonly buffer Summary { float summary[]; };
layout(std430, binding = 3) writeonly buffer Scores { float scores[]; };

layout(push_constant) uniform P {
    uint param_off; uint r; uint n_blocks; uint q_off; uint q_row; uint s_off; uint s_row;
} p;

shared float sq[N_I * DH];

void main() {
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
