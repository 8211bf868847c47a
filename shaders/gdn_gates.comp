#version 450
// GDN gates (MODEL.md §5.4 G2, G3) for T tokens x n_v heads, one invocation per element:
//   beta[t, j] = sigmoid(b[t, j]);  g[t, j] = softplus(a[t, j] + dt_bias[j]) * ssm_a[j]
// softplus(x) = ln(1 + e^x), or x when x > 20; ssm_a is already negative (-exp(A_log)): used as is.
// Buffers (f32): 0 b [T rows, stride b_stride], 1 a [T rows, stride a_stride], 2 dt_bias [n_v]
// from dt_off, 3 ssm_a [n_v] from sa_off, 4 beta [T rows, stride beta_stride], 5 g [T rows,
// stride g_stride]. Every row holds n_v values; offsets and strides in elements.
#extension GL_GOOGLE_include_directive : require
#include "common/base.glsl"

layout(std430, binding = 0) readonly buffer Bb { float b[]; };
layout(std430, binding = 1) readonly buffer Ab { float a[]; };
layout(std430, binding = 2) readonly buffer Dt { float dt_bias[]; };
layout(std430, binding = 3) readonly buffer Sa { float ssm_a[]; };
layout(std430, binding = 4) writeonly buffer Beta { float beta[]; };
layout(std430, binding = 5) writeonly buffer G { float g[]; };
layout(push_constant) uniform P {
    uint n_v; uint T;
    uint b_off; uint b_stride; uint a_off; uint a_stride; uint dt_off; uint sa_off;
    uint beta_off; uint beta_stride; uint g_off; uint g_stride;
} p;

void main() {
    uint stride = gl_NumWorkGroups.x * gl_WorkGroupSize.x;
    for (uint i = gl_GlobalInvocationID.x; i < p.n_v * p.T; i += stride) {
        uint t = i / p.n_v, j = i - t * p.n_v;
        beta[p.beta_off + t * p.beta_stride + j] = sigmoid(b[p.b_off + t * p.b_stride + j]);
        float x = a[p.a_off + t * p.a_stride + j] + dt_bias[p.dt_off + j];
        g[p.g_off + t * p.g_stride + j] = softplus(x) * ssm_a[p.sa_off + j];
    }
}
