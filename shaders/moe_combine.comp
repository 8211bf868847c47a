#version 450
// MoE combine (MODEL.md §5.7 M4): f[t, c] = Σ_{j<k} ys[t·k + j, c] (summed in slot order: deterministic)
//                                           + σ(g[t])·s[t, c]   (SHARED: the gated shared expert).
// ys holds the routed experts' weighted outputs, one row per (token, slot) pair; s the shared
// expert's output; g the shared gate's logit w_sg·u. Rows: ys at ys_off + row·ys_stride, s at
// s_off + t·s_stride, g[t] at g_off + t·g_stride, f at f_off + t·f_stride. One invocation per
// element, grid-stride. Buffers: 0 ys, 1 s, 2 g, 3 f (all f32; without SHARED, 1 and 2 are unused).
#extension GL_GOOGLE_include_directive : require
#include "common/base.glsl"

layout(constant_id = 1) const bool SHARED = true;

layout(std430, binding = 0) readonly buffer Ys { float ys[]; };
layout(std430, binding = 1) readonly buffer S { float sh[]; };
layout(std430, binding = 2) readonly buffer G { float gl[]; };
layout(std430, binding = 3) writeonly buffer F { float f[]; };
layout(push_constant) uniform P {
    uint T; uint d; uint k; uint ys_off; uint ys_stride; uint s_off; uint s_stride; uint g_off; uint g_stride;
    uint f_off; uint f_stride;
} p;

void main() {
    for (uint i = gl_GlobalInvocationID.x; i < p.T * p.d; i += gl_NumWorkGroups.x * gl_WorkGroupSize.x) {
        uint t = i / p.d, c = i % p.d;
        precise float v = 0.0;
        for (uint j = 0u; j < p.k; ++j) v += ys[p.ys_off + (t * p.k + j) * p.ys_stride + c];
        if (SHARED) v += sigmoid(gl[p.g_off + t * p.g_stride]) * sh[p.s_off + t * p.s_stride + c];
        f[p.f_off + t * p.f_stride + c] = v;
    }
}
