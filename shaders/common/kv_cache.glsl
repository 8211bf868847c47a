// Element access to an attention / indexer cache of one storage type, chosen by #define:
// KV_F32 (float), KV_F16 (float16_t) or KV_Q8_0 (blocks of 32: f16 scale d + 32 int8 codes q,
// x = d*q). Caches are flat arrays of elements in [n_ctx, heads, Dh] order; for q8_0 the
// element index i lives in block i/32 at code i%32 (Dh is a multiple of 32, so a block never
// straddles two head rows).
//   KV_BUFFER(binding, Name, qualifier) declares the buffer; KV_LOAD(Name, i) reads element i
//   as float; Q8_STORE_BLOCK(...) rounds 32 values into one q8_0 block (kv_append, kv_requant).
#if defined(KV_Q8_0)
struct BlockQ8_0 {
    float16_t d;
    int8_t qs[32];
};
#define KV_BUFFER(B, NAME, QUAL) layout(std430, binding = B) QUAL buffer NAME##_buf { BlockQ8_0 NAME[]; };
#define KV_LOAD(NAME, I) (float(NAME[(I) >> 5].qs[(I) & 31u]) * float(NAME[(I) >> 5].d))
// Round the 32 values S[S0 ..] (any float type) into the q8_0 block of element E0 of C:
// d = f16(max|x|/127), q = clamp(roundEven(x/d), -127, 127), as vkflash.formats q_q8_0.
#define Q8_STORE_BLOCK(S, S0, C, E0) {                                                  \
        float amax = 0.0;                                                               \
        for (uint i = 0; i < 32u; ++i) amax = max(amax, abs(float(S[S0 + i])));        \
        const float df = round_f16(amax / 127.0);                                       \
        const float id = df != 0.0 ? 1.0 / df : 0.0;                                    \
        const uint blk = (E0) >> 5;                                                     \
        C[blk].d = float16_t(df);                                                       \
        for (uint i = 0; i < 32u; ++i)                                                  \
            C[blk].qs[i] = int8_t(clamp(int(roundEven(float(S[S0 + i]) * id)), -127, 127)); \
    }
#elif defined(KV_F16)
#define KV_BUFFER(B, NAME, QUAL) layout(std430, binding = B) QUAL buffer NAME##_buf { float16_t NAME[]; };
#define KV_LOAD(NAME, I) float(NAME[I])
#elif defined(KV_F32)
#define KV_BUFFER(B, NAME, QUAL) layout(std430, binding = B) QUAL buffer NAME##_buf { float NAME[]; };
#define KV_LOAD(NAME, I) NAME[I]
#else
#error "define one of KV_F32, KV_F16, KV_Q8_0"
#endif

// x rounded to the nearest f16 value (ties to even), as a float. Done with integer ops because
// drivers may fold float(float16_t(x)) into x (lavapipe does), which would desynchronise the
// q8_0 codes from the stored scale. Normal f16 range: drop 13 mantissa bits; below 2^-14 the f16
// spacing is 2^-24 (scaling by powers of two is exact).
float round_f16(float x) {
    if (abs(x) < 6.103515625e-05) return roundEven(x * 16777216.0) * 5.9604644775390625e-08;
    uint u = floatBitsToUint(x);
    u = (u + 0x0FFFu + ((u >> 13) & 1u)) & ~0x1FFFu;
    return uintBitsToFloat(u);
}
