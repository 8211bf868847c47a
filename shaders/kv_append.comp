#version 450
// KV / indexer-key cache append (MODEL.md A4, Q1): for each token t < T of an ubatch, write its
// rows src[src_off + t*src_row + g*DH + d] (g < n_heads, d < DH, f32) into the cache at position
// p_t = pos[pos_off + t] (int32, from the step-params buffer): cache[(p_t*n_heads + g)*DH + d],
// rounded to the cache type at write (f32 copy, f16 round-to-nearest-even, q8_0 per 32-block:
// d = f16(max|x|/127), q = clamp(roundEven(x/d), -127, 127) as in vkflash.formats q_q8_0).
// Tokens whose position is outside [0, n_ctx) are skipped (bounds check, never a stray write).
// One invocation per 32-element block, grid-stride so any T fits.
// Buffers: 0 pos (int32), 1 src (f32), 2 cache (KV type). Spec: 1 DH. Defines: KV_F32|KV_F16|KV_Q8_0.
#extension GL_GOOGLE_include_directive : require
#include "common/base.glsl"
#include "common/kv_cache.glsl"

layout(constant_id = 1) const uint DH = 128;

layout(std430, binding = 0) readonly buffer Pos { int pos[]; };
layout(std430, binding = 1) readonly buffer Src { float src[]; };
KV_BUFFER(2, cache, writeonly)

layout(push_constant) uniform P {
    uint T; uint n_heads; uint src_off; uint src_row; uint pos_off; uint n_ctx;
} p;

void main() {
    const uint nb = DH / 32u;  // blocks per head row
    const uint total = p.T * p.n_heads * nb;
    const uint stride = gl_NumWorkGroups.x * gl_WorkGroupSize.x;
    for (uint b = gl_GlobalInvocationID.x; b < total; b += stride) {
        const uint t = b / (p.n_heads * nb);
        const uint g = (b / nb) % p.n_heads;
        const uint c = b % nb;
        const int pt = pos[p.pos_off + t];
        if (pt < 0 || uint(pt) >= p.n_ctx) continue;
        const uint s0 = p.src_off + t * p.src_row + g * DH + c * 32u;
        const uint e0 = (uint(pt) * p.n_heads + g) * DH + c * 32u;
#if defined(KV_Q8_0)
        float amax = 0.0;
        for (uint i = 0; i < 32u; ++i) amax = max(amax, abs(src[s0 + i]));
        const float df = round_f16(amax / 127.0);
        const float id = df != 0.0 ? 1.0 / df : 0.0;
        const uint blk = e0 >> 5;
        cache[blk].d = float16_t(df);
        for (uint i = 0; i < 32u; ++i) {
            const int code = clamp(int(roundEven(src[s0 + i] * id)), -127, 127);
            cache[blk].qs[i] = int8_t(code);
        }
#elif defined(KV_F16)
        for (uint i = 0; i < 32u; ++i) cache[e0 + i] = float16_t(src[s0 + i]);
#else
        for (uint i = 0; i < 32u; ++i) cache[e0 + i] = src[s0 + i];
#endif
    }
}
