#version 450
// Buffer copy by compute shader (vkCmdCopyBuffer is ~5x slower on the H200).
// dst[dst_off + i] = src[src_off + i] for i < n, in 32-bit words, grid-stride so any n fits.
// When both offsets are multiples of 4 words (push constant wide = 1) the bulk moves as uvec4
// (16-byte loads and stores) and the last n % 4 words one by one.
#extension GL_GOOGLE_include_directive : require
#include "common/base.glsl"
layout(std430, binding = 0) readonly buffer Src { uint src[]; };
layout(std430, binding = 0) readonly buffer Src4 { uvec4 src4[]; };
layout(std430, binding = 1) writeonly buffer Dst { uint dst[]; };
layout(std430, binding = 1) writeonly buffer Dst4 { uvec4 dst4[]; };
layout(push_constant) uniform P { uint src_off; uint dst_off; uint n; uint wide; } p;
void main() {
    uint stride = gl_NumWorkGroups.x * gl_WorkGroupSize.x;
    uint start = 0;
    if (p.wide != 0) {
        uint n4 = p.n / 4, s4 = p.src_off / 4, d4 = p.dst_off / 4;
        for (uint i = gl_GlobalInvocationID.x; i < n4; i += stride) {
            dst4[d4 + i] = src4[s4 + i];
        }
        start = n4 * 4;
    }
    for (uint i = start + gl_GlobalInvocationID.x; i < p.n; i += stride) {
        dst[p.dst_off + i] = src[p.src_off + i];
    }
}
