// Group decoders on wide loads for the coopmat expert GEMM's weight fetch (common/mm_cm.glsl FAST):
// cm_group_decode(cm_group_load(G), v) gives exactly common/quant.glsl's dequant_group(G, v) — the
// same expressions on the same raw values — in two parts, so that the loads of a K step can be in
// flight while the previous step's products run and be decoded after them. It reads the group's
// bytes with 16-byte loads (Q4_K, Q5_K: 4-byte aligned blocks) or whole 32-bit words realigned in
// registers (Q4_0, Q5_0, Q8_0: 2-byte aligned blocks), instead of one 16- or 32-bit load per 2–4
// bytes. A fetch lane decodes one group of a weight row; with rows 1–2 KB apart every narrow load
// of a warp touches as many cache lines as it has lanes, so the number of load instructions, not
// DRAM, sets the GEMM's pace when its tile has few tokens. Include after common/quant.glsl with
// QUANT_FAST_CVT defined (its qwu word view); defines CM_GROUP_FAST where QTYPE has one (the other
// types keep dequant_group). For Q4_K and Q5_K (CM_GROUP_HALF), cm_group_decode_half(cm_group_load_half(
// G, h), v) gives the half h (values 16h .. 16h + 15) of the same from a third fewer loads (the
// header and the half's own code run): v[i] is cm_group_decode's v[4h + i], by the same expressions.
// (The other types' halves would each load the whole block: measured no faster on the H200.)

#if QTYPE == GGML_TYPE_Q4_K || QTYPE == GGML_TYPE_Q5_K
#define CM_GROUP_FAST
struct CmRaw {  // a group's raw words: header (dm, scales), its two 16-byte code runs (and high bits)
    uvec4 hdr, q0, q1;
#if QTYPE == GGML_TYPE_Q5_K
    uvec4 h0, h1;
#endif
    uint g;
};
CmRaw cm_group_load(uint G) {
    const uint ib = G >> 3, g = G & 7u, b = ib * KQ_VEC4;
    CmRaw r;
    r.hdr = qw4[b];
    r.q0 = qw4[b + KQ_QS + 2u * (g >> 1)];
    r.q1 = qw4[b + KQ_QS + 2u * (g >> 1) + 1u];
#if QTYPE == GGML_TYPE_Q5_K
    r.h0 = qw4[b + 1u];
    r.h1 = qw4[b + 2u];
#endif
    r.g = g;
    return r;
}
#define CM_GROUP_HALF
CmRaw cm_group_load_half(uint G, uint h) {  // the header and half h's code (and high-bit) run only
    const uint ib = G >> 3, g = G & 7u, b = ib * KQ_VEC4;
    CmRaw r;
    r.hdr = qw4[b];
    r.q0 = qw4[b + KQ_QS + 2u * (g >> 1) + h];
    r.q1 = uvec4(0u);
#if QTYPE == GGML_TYPE_Q5_K
    r.h0 = qw4[b + 1u + h];
    r.h1 = uvec4(0u);
#endif
    r.g = g;
    return r;
}
// High-bit word i of code run `run` (Q5_K; Q4_K has none).
uint cm_high(CmRaw r, uint run, uint i) {
#if QTYPE == GGML_TYPE_Q5_K
    return run == 0u ? r.h0[i] : r.h1[i];
#else
    return 0u;
#endif
}
// Values of one code word q (4 nibbles from bit s) plus, Q5_K, their high bits (bit g of each byte
// of hb; Q4_K has none): d·code − mn.
vec4 cm_vals4(uint q, uint hb, uint s, uint g, float d, float mn) {
    vec4 a = nib4(q, s);
#if QTYPE == GGML_TYPE_Q5_K
    const uint ha = hb >> g;
    a += 16.0 * vec4(ha & 1u, (ha >> 8) & 1u, (ha >> 16) & 1u, (ha >> 24) & 1u);
#endif
    return d * a - mn;
}
void cm_group_decode_half(CmRaw r, out vec4 v[4]) {  // r from cm_group_load_half(G, h)
    const vec2 dm = unpackHalf2x16(r.hdr.x), sm = k_scale_min(r.hdr.yzw, r.g);
    const float d = dm.x * sm.x, mn = dm.y * sm.y;
    for (uint i = 0u; i < 4u; ++i) v[i] = cm_vals4(r.q0[i], cm_high(r, 0u, i), 4u * (r.g & 1u), r.g, d, mn);
}
void cm_group_decode(CmRaw r, out vec4 v[8]) {
    const vec2 dm = unpackHalf2x16(r.hdr.x), sm = k_scale_min(r.hdr.yzw, r.g);
    const float d = dm.x * sm.x, mn = dm.y * sm.y;
    for (uint i = 0u; i < 4u; ++i) {
        v[i] = cm_vals4(r.q0[i], cm_high(r, 0u, i), 4u * (r.g & 1u), r.g, d, mn);
        v[i + 4u] = cm_vals4(r.q1[i], cm_high(r, 1u, i), 4u * (r.g & 1u), r.g, d, mn);
    }
}

#elif QTYPE == GGML_TYPE_Q4_0 || QTYPE == GGML_TYPE_Q5_0 || QTYPE == GGML_TYPE_Q8_0
#define CM_GROUP_FAST
#if QTYPE == GGML_TYPE_Q4_0
const uint CG_BYTES = 18u, CG_WORDS = 5u;
#elif QTYPE == GGML_TYPE_Q5_0
const uint CG_BYTES = 22u, CG_WORDS = 6u;
#else
const uint CG_BYTES = 34u, CG_WORDS = 9u;
#endif
struct CmRaw {  // the CG_WORDS aligned words holding a block, and whether it starts 2 bytes into the first
    uint a[CG_WORDS];
    bool odd;
};
CmRaw cm_group_load(uint G) {
    const uint B = G * CG_BYTES, w = B >> 2;
    CmRaw r;
    for (uint i = 0u; i < CG_WORDS; ++i) r.a[i] = qwu[w + i];
    r.odd = (B & 2u) != 0u;
    return r;
}
// The block's bytes as words b[0..] (byte j is byte j % 4 of b[j / 4]): the loaded words, shifted
// down by 2 bytes where the block starts 2 mod 4.
void cm_block_words(CmRaw r, out uint b[CG_WORDS]) {
    for (uint i = 0u; i + 1u < CG_WORDS; ++i) b[i] = r.odd ? (r.a[i] >> 16) | (r.a[i + 1u] << 16) : r.a[i];
    b[CG_WORDS - 1u] = r.odd ? r.a[CG_WORDS - 1u] >> 16 : r.a[CG_WORDS - 1u];
}
uint cm_u32_at2(uint b[CG_WORDS], uint i) { return (b[i] >> 16) | (b[i + 1u] << 16); }  // bytes 4i+2 .. 4i+5

void cm_group_decode(CmRaw r, out vec4 v[8]) {
    uint b[CG_WORDS];
    cm_block_words(r, b);
    const float d = unpackHalf2x16(b[0]).x;
#if QTYPE == GGML_TYPE_Q8_0
    for (uint i = 0u; i < 8u; ++i) {
        const uint q = cm_u32_at2(b, i);  // qs bytes 4i .. 4i+3
        v[i] = d * vec4(sbyte_lo(q & 0xFFFFu), sbyte_hi(q & 0xFFFFu), sbyte_lo(q >> 16), sbyte_hi(q >> 16));
    }
#elif QTYPE == GGML_TYPE_Q4_0
    for (uint i = 0u; i < 4u; ++i) {
        const uint w = cm_u32_at2(b, i);
        v[i] = d * (nib4(w, 0u) - 8.0);
        v[i + 4u] = d * (nib4(w, 4u) - 8.0);
    }
#else
    const uint qh = cm_u32_at2(b, 0u);
    for (uint i = 0u; i < 4u; ++i) {
        const uint w = cm_u32_at2(b, i + 1u);  // qs bytes 4i .. 4i+3 (block bytes 6 + 4i ..)
        const uint hl = qh >> (4u * i), hh = qh >> (4u * i + 16u);
        vec4 lo = nib4(w, 0u) + 16.0 * vec4(hl & 1u, (hl >> 1) & 1u, (hl >> 2) & 1u, (hl >> 3) & 1u);
        vec4 hi = nib4(w, 4u) + 16.0 * vec4(hh & 1u, (hh >> 1) & 1u, (hh >> 2) & 1u, (hh >> 3) & 1u);
        v[i] = d * (lo - 16.0);
        v[i + 4u] = d * (hi - 16.0);
    }
#endif
}
#endif
