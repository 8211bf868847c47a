#version 450
// Cache re-quantization to q8_0 (the deep-context guard, engine/guard.py): the 32-element blocks
// [0, n) of an f16 (SRC_F16) or f32 (SRC_F32) K/V or indexer-key cache, written as the same
// blocks of a q8_0 cache of the same geometry, rounded exactly as kv_append rounds at write
// (Q8_STORE_BLOCK: d = f16(max|x|/127), q = clamp(roundEven(x/d), -127, 127)), so a
// re-quantized row equals a q8_0 append of the values the f16/f32 row holds. Blocks from n on
// are not touched. One invocation per block, grid-stride so any n fits.
// Buffers: 0 src (f16 | f32 elements), 1 dst (q8_0 blocks). Push: n.
#extension GL_GOOGLE_include_directive : require
#include "common/base.glsl"
#define KV_Q8_0 1
#include "common/kv_cache.glsl"

#if defined(SRC_F16)
layout(std430, binding = 0) readonly buffer Src { float16_t src[]; };
#elif defined(SRC_F32)
layout(std430, binding = 0) readonly buffer Src { float src[]; };
#else
#error "define SRC_F16 or SRC_F32"
#endif
KV_BUFFER(1, dst, writeonly)

layout(push_constant) uniform P { uint n; } p;

void main() {
    const uint stride = gl_NumWorkGroups.x * gl_WorkGroupSize.x;
    for (uint w = gl_GlobalInvocationID.x; w < p.n; w += stride) {
        const uint e0 = w * 32u;
        Q8_STORE_BLOCK(src, e0, dst, e0)
    }
}
