// K/V cache reads of the cooperative-matrix flash kernels (attn_flash_cm.comp, attn_flash_sg.comp):
// bindings 3 (K) and 4 (V) as the fetch reads them, and load_chunk, which decodes 32 consecutive
// elements of either cache to packed f16 (f16 as stored, f32 rounded, q8_0 blocks of 17 16-bit
// words dequantized then rounded). Defines: KV_F32 | KV_F16 | KV_Q8_0.
#if defined(KV_F16)
layout(std430, binding = 3) readonly buffer KB { uvec4 kb[]; };
layout(std430, binding = 4) readonly buffer VB { uvec4 vb[]; };
#elif defined(KV_F32)
layout(std430, binding = 3) readonly buffer KB { vec4 kb[]; };
layout(std430, binding = 4) readonly buffer VB { vec4 vb[]; };
#elif defined(KV_Q8_0)
layout(std430, binding = 3) readonly buffer KB { uint16_t kb[]; };
layout(std430, binding = 4) readonly buffer VB { uint16_t vb[]; };
#else
#error "define one of KV_F32, KV_F16, KV_Q8_0"
#endif

// Two f16 of x (rounded), packed.
uint pack2(float a, float b) { return packHalf2x16(vec2(a, b)); }

// 32 consecutive elements of cache element index el (a multiple of 32) as f16, into x[0..3].
void load_chunk(bool is_v, uint el, out uvec4 x[4]) {
#if defined(KV_F16)
    for (uint w = 0u; w < 4u; ++w) x[w] = is_v ? vb[el / 8u + w] : kb[el / 8u + w];
#elif defined(KV_F32)
    for (uint w = 0u; w < 4u; ++w) {
        const vec4 a = is_v ? vb[el / 4u + 2u * w] : kb[el / 4u + 2u * w];
        const vec4 b = is_v ? vb[el / 4u + 2u * w + 1u] : kb[el / 4u + 2u * w + 1u];
        x[w] = uvec4(pack2(a.x, a.y), pack2(a.z, a.w), pack2(b.x, b.y), pack2(b.z, b.w));
    }
#else
    const uint b0 = el / 32u * 17u;
    const float d = float(uint16BitsToFloat16(is_v ? vb[b0] : kb[b0]));
    for (uint w = 0u; w < 4u; ++w) {
        uint u[4];
        for (uint h = 0u; h < 4u; ++h) {
            const int c = int(uint(is_v ? vb[b0 + 1u + 4u * w + h] : kb[b0 + 1u + 4u * w + h]));
            u[h] = pack2(float(bitfieldExtract(c, 0, 8)) * d, float(bitfieldExtract(c, 8, 8)) * d);
        }
        x[w] = uvec4(u[0], u[1], u[2], u[3]);
    }
#endif
}
