#version 450
// GDN gated RMSNorm (MODEL.md §5.4 G9), one workgroup per (token t, v-head j), grid-stride:
//   y[t, j*S + i] = o[t, j*S + i] / sqrt(mean_i(o^2) + eps) * w[i] * act(z[t, j*S + i])
// act = sigmoid (ACT 0, qwen4exp) or silu (ACT 1, qwen3next). w (ssm_norm, S values) is shared by
// every head and used as stored (not folded: no +1). y may alias o (same view): each element is
// read (twice) and written by the same invocation, after the workgroup's reduction.
// Buffers (f32): 0 o [T rows, stride o_stride, n_v*S used], 1 z [T rows, stride z_stride],
// 2 w [S] from w_off, 3 y [T rows, stride y_stride]. Offsets and strides in elements.
#extension GL_GOOGLE_include_directive : require
#include "common/base.glsl"
#include "common/reduce.glsl"

layout(constant_id = 1) const uint ACT = 0;

layout(std430, binding = 0) buffer O { float o[]; };
layout(std430, binding = 1) readonly buffer Z { float z[]; };
layout(std430, binding = 2) readonly buffer Wn { float w[]; };
layout(std430, binding = 3) buffer Y { float y[]; };
layout(push_constant) uniform P {
    uint S; uint n_v; uint T;
    uint o_off; uint o_stride; uint z_off; uint z_stride; uint w_off; uint y_off; uint y_stride;
    float eps;
} p;

void main() {
    for (uint k = gl_WorkGroupID.x; k < p.T * p.n_v; k += gl_NumWorkGroups.x) {
        uint t = k / p.n_v, j = k - t * p.n_v;
        uint ob = p.o_off + t * p.o_stride + j * p.S, zb = p.z_off + t * p.z_stride + j * p.S;
        uint yb = p.y_off + t * p.y_stride + j * p.S;
        float ss = 0.0;
        for (uint i = gl_LocalInvocationID.x; i < p.S; i += gl_WorkGroupSize.x) ss += o[ob + i] * o[ob + i];
        float r = 1.0 / sqrt(wg_sum(ss) / float(p.S) + p.eps);
        for (uint i = gl_LocalInvocationID.x; i < p.S; i += gl_WorkGroupSize.x) {
            float zi = z[zb + i];
            float gate = sigmoid(zi);
            if (ACT == 1) gate *= zi;
            y[yb + i] = o[ob + i] * r * w[p.w_off + i] * gate;
        }
    }
}
