#version 450
// Numerically stable softmax over rows, one workgroup per row (grid-stride over rows):
//   m = max_i x_i;  y_i = exp(x_i - m) / sum_j exp(x_j - m)
// Row r is x[x_off + r*x_stride + i], i < n. Buffers: 0 x (f32), 1 y (f32; may alias x, same view).
#extension GL_GOOGLE_include_directive : require
#include "common/base.glsl"
#include "common/reduce.glsl"

layout(std430, binding = 0) buffer X { float x[]; };
layout(std430, binding = 1) buffer Y { float y[]; };
layout(push_constant) uniform P { uint n; uint n_rows; uint x_off; uint x_stride; uint y_off; uint y_stride; } p;

void main() {
    for (uint r = gl_WorkGroupID.x; r < p.n_rows; r += gl_NumWorkGroups.x) {
        uint xb = p.x_off + r * p.x_stride, yb = p.y_off + r * p.y_stride;
        float m = -1.0 / 0.0;  // -inf
        for (uint i = gl_LocalInvocationID.x; i < p.n; i += gl_WorkGroupSize.x) m = max(m, x[xb + i]);
        m = wg_max(m);
        float s = 0.0;
        for (uint i = gl_LocalInvocationID.x; i < p.n; i += gl_WorkGroupSize.x) s += exp(x[xb + i] - m);
        float inv = 1.0 / wg_sum(s);
        for (uint i = gl_LocalInvocationID.x; i < p.n; i += gl_WorkGroupSize.x) y[yb + i] = exp(x[xb + i] - m) * inv;
    }
}
