#version 450
// Buffer copy by compute shader (vkCmdCopyBuffer is ~5x slower on the H200).
// dst[dst_off + i] = src[src_off + i] for i < n, in 32-bit words, grid-stride so any n fits.
#extension GL_GOOGLE_include_directive : require
#include "common/base.glsl"
layout(std430, binding = 0) readonly buffer Src { uint src[]; };
layout(std430, binding = 1) writeonly buffer Dst { uint dst[]; };
layout(push_constant) uniform P { uint src_off; uint dst_off; uint n; } p;
void main() {
    uint stride = gl_NumWorkGroups.x * gl_WorkGroupSize.x;
    for (uint i = gl_GlobalInvocationID.x; i < p.n; i += stride) {
        dst[p.dst_off + i] = src[p.src_off + i];
    }
}
