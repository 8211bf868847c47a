#version 450
// KV / indexer-key cache append (MODEL.md A4, Q1): for each token t < T of an ubatch, write its
// rows src[src_off + t*src_row + g*DH + d] (g < n_heads, d < DH, f32) into the cache at position
// p_t = pos[pos_off + t] (int32, from the step-params buffer): cache[(p_t*n_heads + g)*DH + d],
// rounded to the cache type at write (f32 copy, f16 round-to-nearest-even, q8_0 per 32-block:
// d = f16(max|x|/127), q = clamp(roundEven(x/d), -127, 127), as kv_q8_0 in tests/gpu/attention_ref.py).
// Tokens whose position is outside [0, n_ctx) are skipped (bounds check, never a stray write).
// One invocation per 32-element block, grid-stride so any T fits.
// PAIR: a second source/cache pair (K and V of one layer) in the same dispatch: blocks past the
// first pair's go from src2 (rows at src2_off + t*src2_row) to cache2.
// Buffers: 0 pos (int32), 1 src (f32), 2 cache (KV type), 3 src2, 4 cache2 (any buffers when not
// PAIR). Spec: 1 DH, 2 PAIR. Defines: KV_F32|KV_F16|KV_Q8_0.
#extension GL_GOOGLE_include_directive : require
#include "common/base.glsl"
#include "common/kv_cache.glsl"

layout(constant_id = 1) const uint DH = 128;
layout(constant_id = 2) const bool PAIR = false;

layout(std430, binding = 0) readonly buffer Pos { int pos[]; };
layout(std430, binding = 1) readonly buffer Src { float src[]; };
KV_BUFFER(2, cache, writeonly)
layout(std430, binding = 3) readonly buffer Src2 { float src2[]; };
KV_BUFFER(4, cache2, writeonly)

layout(push_constant) uniform P {
    uint T; uint n_heads; uint src_off; uint src_row; uint pos_off; uint n_ctx; uint src2_off; uint src2_row;
} p;

// Round the 32 source values S[S0 ..] into the cache C at element E0 (one block).
#if defined(KV_Q8_0)
#define STORE_BLOCK(S, S0, C, E0) Q8_STORE_BLOCK(S, S0, C, E0)
#elif defined(KV_F16)
#define STORE_BLOCK(S, S0, C, E0) { for (uint i = 0; i < 32u; ++i) C[E0 + i] = float16_t(S[S0 + i]); }
#else
#define STORE_BLOCK(S, S0, C, E0) { for (uint i = 0; i < 32u; ++i) C[E0 + i] = S[S0 + i]; }
#endif

void main() {
    const uint nb = DH / 32u;  // blocks per head row
    const uint per_pair = p.T * p.n_heads * nb;
    const uint total = PAIR ? 2u * per_pair : per_pair;
    const uint stride = gl_NumWorkGroups.x * gl_WorkGroupSize.x;
    for (uint w = gl_GlobalInvocationID.x; w < total; w += stride) {
        const bool second = w >= per_pair;
        const uint b = second ? w - per_pair : w;
        const uint t = b / (p.n_heads * nb);
        const uint g = (b / nb) % p.n_heads;
        const uint c = b % nb;
        const int pt = pos[p.pos_off + t];
        if (pt < 0 || uint(pt) >= p.n_ctx) continue;
        const uint e0 = (uint(pt) * p.n_heads + g) * DH + c * 32u;
        if (second) {
            const uint s0 = p.src2_off + t * p.src2_row + g * DH + c * 32u;
            STORE_BLOCK(src2, s0, cache2, e0)
        } else {
            const uint s0 = p.src_off + t * p.src_row + g * DH + c * 32u;
            STORE_BLOCK(src, s0, cache, e0)
        }
    }
}
