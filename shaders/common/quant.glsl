// GGML weight decoders (bytes exactly as in the GGUF, rows of ne0 elements, blocks back to back).
// Two interfaces, each compiled only when the includer asks for it:
//
// 1. Element decoders (define QUANT_WORD(i) = the i-th 32-bit word of the raw tensor buffer):
//      float dequant_f32(uint row, uint e), dequant_f16(uint row, uint e)   row = byte offset of the row
//      float dequant_q8_0 / dequant_q4_k / dequant_q6_k(uint blk, uint j)  blk = byte offset of the block,
//                                                                           j = element in the block
//    with <TYPE>_ELEMS / <TYPE>_BYTES per block. Any byte alignment of 2 works (gathers, embeddings).
//
// 2. Group decoders for the matmul family (define QTYPE = a GGML_TYPE_* id and QUANT_BINDING = the
//    binding of the raw weight buffer; this file then declares that buffer as block structs):
//      void dequant_group(uint G, out vec4 v[8])
//    decodes the G-th group of 32 consecutive elements of the whole buffer into f32 (v[i] =
//    elements 4i..4i+3 of the group). Every supported row length is a multiple of 32 and every
//    block holds a whole number of groups, so element e of the buffer lies in group e/32: row r of
//    a {K, out} weight is groups r*K/32 .. (r+1)*K/32 - 1, and row r of expert e of a stack
//    {K, out, E} is row e*out + r. Float types (F32/F16/BF16) need K % 32 == 0 here. Loads are
//    32-bit where the block is 4-byte aligned (Q4_K, Q5_K, IQ4_XS, floats as uvec4), 16-bit where
//    it is only 2-byte aligned (Q8_0, Q4_0, Q5_0, Q6_K).
//      Slice slice_fetch(uint S)   float slice_dot(Slice w, vec4 xg[8], vec2 xs)   uvec2 slice_runs(uint u)
//      vec4 slice_codes(Slice w, uint i)   float slice_sum(Slice w, float s0, float s1, vec2 xs)
//      vec4 slice_affine(Slice w)
//      float dot_slice(uint S, vec4 xg[8], vec2 xs) = slice_dot(slice_fetch(S), xg, xs)
//    are the GEMV's variant: slice S also holds 32 elements of the buffer's S/SPB-th block of
//    32·SPB elements, but as two runs of 16 at in-row element offsets slice_runs(u) (u = the
//    slice's index within its row). slice_fetch only loads (the raw words a slice needs), so a
//    caller can issue the loads of several rows before using any; slice_dot returns Σ W·x over
//    the slice given x's values there (xg[0..3] = run 0, xg[4..7] = run 1) and the runs' sums xs
//    (scales and mins are applied once per run, not per element). slice_dot is, for every type,
//    slice_sum(w, s0, s1, xs) with s0 = Σ_{i<4} dot(slice_codes(w, i), xg[i]) and s1 the same over
//    i = 4..7 (each summed in i order from 0): slice_codes(w, i) are the slice's 4 unscaled codes
//    against xg[i], so a GEMV over several x columns decodes each once (common/gemv_core.glsl);
//    slice_affine(w) = (a0, b0, a1, b1): run r's weights are a_r·code + b_r (the element decoders' values).
//    For K-quants (SPB = 8) a slice is one 16-byte chunk of the block's quants, so consecutive
//    invocations read consecutive 16 bytes (coalesced uvec4 / u16 loads); for the other types
//    (SPB = 1) a slice is the group itself.

#define GGML_TYPE_F32 0
#define GGML_TYPE_F16 1
#define GGML_TYPE_Q4_0 2
#define GGML_TYPE_Q5_0 6
#define GGML_TYPE_Q8_0 8
#define GGML_TYPE_Q4_K 12
#define GGML_TYPE_Q5_K 13
#define GGML_TYPE_Q6_K 14
#define GGML_TYPE_IQ4_XS 23
#define GGML_TYPE_BF16 30

#define Q8_0_ELEMS 32u
#define Q8_0_BYTES 34u
#define Q4_0_ELEMS 32u
#define Q4_0_BYTES 18u
#define Q5_0_ELEMS 32u
#define Q5_0_BYTES 22u
#define Q4_K_ELEMS 256u
#define Q4_K_BYTES 144u
#define Q6_K_ELEMS 256u
#define Q6_K_BYTES 210u

// Low/high signed byte of a 16-bit word, as int.
int sbyte_lo(uint w16) { return int(w16 << 24) >> 24; }
int sbyte_hi(uint w16) { return int(w16 << 16) >> 24; }

#ifdef QUANT_WORD
// ---- 1. element decoders over a word array --------------------------------------------------
uint quant_byte(uint b) { return (QUANT_WORD(b >> 2) >> (8u * (b & 3u))) & 0xFFu; }
uint quant_u16(uint b) { return (QUANT_WORD(b >> 2) >> (8u * (b & 2u))) & 0xFFFFu; }  // b even
float quant_f16(uint b) { return unpackHalf2x16(quant_u16(b)).x; }

float dequant_f32(uint row, uint e) { return uintBitsToFloat(QUANT_WORD((row >> 2) + e)); }
float dequant_f16(uint row, uint e) { return quant_f16(row + 2u * e); }

// Q8_0: f16 d; int8 qs[32]. x = d*q
float dequant_q8_0(uint blk, uint j) { return quant_f16(blk) * float(sbyte_lo(quant_byte(blk + 2u + j))); }

// Q4_0: f16 d; u8 qs[16]; element j is the low (j < 16) or high nibble of qs[j % 16]. x = d*(q - 8)
float dequant_q4_0(uint blk, uint j) {
    return quant_f16(blk) * float(int((quant_byte(blk + 2u + (j & 15u)) >> (4u * (j >> 4))) & 0xFu) - 8);
}

// Q5_0: f16 d; u32 qh (bit j: the fifth bit of element j); u8 qs[16] as Q4_0. x = d*(q - 16)
float dequant_q5_0(uint blk, uint j) {
    const uint hi = (quant_byte(blk + 2u + (j >> 3)) >> (j & 7u)) & 1u;
    const uint lo = (quant_byte(blk + 6u + (j & 15u)) >> (4u * (j >> 4))) & 0xFu;
    return quant_f16(blk) * float(int(lo | (hi << 4)) - 16);
}

// Q4_K: f16 d, dmin; u8 scales[12]; u8 qs[128]. Group g = j/32 has 6-bit scale/min g and the low
// (g even) or high (g odd) nibbles of qs[32*(g/2) + j%32]. x = d*sc*q - dmin*m
float dequant_q4_k(uint blk, uint j) {
    uint g = j >> 5, sc, m;
    uint sb = blk + 4u;
    if (g < 4u) {
        sc = quant_byte(sb + g) & 63u;
        m = quant_byte(sb + g + 4u) & 63u;
    } else {
        sc = (quant_byte(sb + g + 4u) & 0xFu) | ((quant_byte(sb + g - 4u) >> 6) << 4);
        m = (quant_byte(sb + g + 4u) >> 4) | ((quant_byte(sb + g) >> 6) << 4);
    }
    uint q = (quant_byte(blk + 16u + 32u * (g >> 1) + (j & 31u)) >> (4u * (g & 1u))) & 0xFu;
    return quant_f16(blk) * float(sc) * float(q) - quant_f16(blk + 2u) * float(m);
}

// Q6_K: u8 ql[128]; u8 qh[64]; i8 scales[16]; f16 d. Half n = j/128, quarter t = (j%128)/32,
// l = j%32: low 4 bits from ql[64n + 32(t&1) + l] (nibble t>>1), high 2 from qh[32n + l] >> 2t,
// scale scales[8n + 2t + l/16]. x = d*sc*(q-32)
float dequant_q6_k(uint blk, uint j) {
    uint n = j >> 7, t = (j >> 5) & 3u, l = j & 31u;
    uint lo = (quant_byte(blk + 64u * n + 32u * (t & 1u) + l) >> (4u * (t >> 1))) & 0xFu;
    uint hi = (quant_byte(blk + 128u + 32u * n + l) >> (2u * t)) & 3u;
    float sc = float(sbyte_lo(quant_byte(blk + 192u + 8u * n + 2u * t + (l >> 4))));
    return quant_f16(blk + 208u) * sc * (float(lo | (hi << 4)) - 32.0);
}
#endif

#ifdef QTYPE
// ---- 2. group decoders over typed block arrays (matmul family) ------------------------------
#ifndef QUANT_BINDING
#error "define QUANT_BINDING before including common/quant.glsl"
#endif

// Four 4-bit fields at bit offsets s, s+8, s+16, s+24 of w.
vec4 nib4(uint w, uint s) {
    return vec4(float((w >> s) & 0xFu), float((w >> (s + 8u)) & 0xFu),
                float((w >> (s + 16u)) & 0xFu), float((w >> (s + 24u)) & 0xFu));
}

#if QTYPE == GGML_TYPE_F32
layout(std430, binding = QUANT_BINDING) readonly buffer QW { vec4 qw[]; };
void dequant_group(uint G, out vec4 v[8]) {
    for (uint i = 0u; i < 8u; ++i) v[i] = qw[G * 8u + i];
}

#elif QTYPE == GGML_TYPE_F16
layout(std430, binding = QUANT_BINDING) readonly buffer QW { uvec4 qw[]; };
void dequant_group(uint G, out vec4 v[8]) {
    for (uint i = 0u; i < 4u; ++i) {
        uvec4 w = qw[G * 4u + i];
        v[2u * i] = vec4(unpackHalf2x16(w.x), unpackHalf2x16(w.y));
        v[2u * i + 1u] = vec4(unpackHalf2x16(w.z), unpackHalf2x16(w.w));
    }
}

#elif QTYPE == GGML_TYPE_BF16
layout(std430, binding = QUANT_BINDING) readonly buffer QW { uvec4 qw[]; };
vec2 bf16x2(uint w) { return vec2(uintBitsToFloat(w << 16), uintBitsToFloat(w & 0xFFFF0000u)); }
void dequant_group(uint G, out vec4 v[8]) {
    for (uint i = 0u; i < 4u; ++i) {
        uvec4 w = qw[G * 4u + i];
        v[2u * i] = vec4(bf16x2(w.x), bf16x2(w.y));
        v[2u * i + 1u] = vec4(bf16x2(w.z), bf16x2(w.w));
    }
}

#elif QTYPE == GGML_TYPE_Q8_0
// block: f16 d; int8 qs[32]  (34 bytes)   x = d * q
struct BlockQ8_0 { float16_t d; uint16_t qs[16]; };
layout(std430, binding = QUANT_BINDING) readonly buffer QW { BlockQ8_0 qw[]; };
void dequant_group(uint G, out vec4 v[8]) {
    float d = float(qw[G].d);
    for (uint i = 0u; i < 8u; ++i) {
        uint a = uint(qw[G].qs[2u * i]), b = uint(qw[G].qs[2u * i + 1u]);
        v[i] = d * vec4(sbyte_lo(a), sbyte_hi(a), sbyte_lo(b), sbyte_hi(b));
    }
}

#elif QTYPE == GGML_TYPE_Q4_0
// block: f16 d; u8 qs[16]  (18 bytes)   x[j] = d*((qs[j]&15)-8), x[j+16] = d*((qs[j]>>4)-8)
struct BlockQ4_0 { float16_t d; uint16_t qs[8]; };
layout(std430, binding = QUANT_BINDING) readonly buffer QW { BlockQ4_0 qw[]; };
void dequant_group(uint G, out vec4 v[8]) {
    float d = float(qw[G].d);
    for (uint i = 0u; i < 4u; ++i) {
        uint w = uint(qw[G].qs[2u * i]) | (uint(qw[G].qs[2u * i + 1u]) << 16);
        v[i] = d * (nib4(w, 0u) - 8.0);
        v[i + 4u] = d * (nib4(w, 4u) - 8.0);
    }
}

#elif QTYPE == GGML_TYPE_Q5_0
// block: f16 d; u8 qh[4]; u8 qs[16]  (22 bytes)   5th bit of element j is bit j of qh
struct BlockQ5_0 { float16_t d; uint16_t qh[2]; uint16_t qs[8]; };
layout(std430, binding = QUANT_BINDING) readonly buffer QW { BlockQ5_0 qw[]; };
void dequant_group(uint G, out vec4 v[8]) {
    float d = float(qw[G].d);
    uint qh = uint(qw[G].qh[0]) | (uint(qw[G].qh[1]) << 16);
    for (uint i = 0u; i < 4u; ++i) {
        uint w = uint(qw[G].qs[2u * i]) | (uint(qw[G].qs[2u * i + 1u]) << 16);
        uint hl = qh >> (4u * i), hh = qh >> (4u * i + 16u);
        vec4 lo = nib4(w, 0u) + 16.0 * vec4(hl & 1u, (hl >> 1) & 1u, (hl >> 2) & 1u, (hl >> 3) & 1u);
        vec4 hi = nib4(w, 4u) + 16.0 * vec4(hh & 1u, (hh >> 1) & 1u, (hh >> 2) & 1u, (hh >> 3) & 1u);
        v[i] = d * (lo - 16.0);
        v[i + 4u] = d * (hi - 16.0);
    }
}

#elif QTYPE == GGML_TYPE_Q4_K || QTYPE == GGML_TYPE_Q5_K
// Q4_K: f16 d, dmin; u8 scales[12]; u8 qs[128]             (144 bytes)
// Q5_K: f16 d, dmin; u8 scales[12]; u8 qh[32]; u8 qs[128]  (176 bytes)
// 8 groups of 32 per super-block; group g uses 6-bit scale/min g, the low (g even) or high
// (g odd) nibbles of qs[32*(g/2) ..], and for Q5_K bit g of qh[0..31]. x = d*sc*q - dmin*m.
#if QTYPE == GGML_TYPE_Q4_K
struct BlockQK { f16vec2 dm; uint scales[3]; uint qs[32]; };
#else
struct BlockQK { f16vec2 dm; uint scales[3]; uint qh[8]; uint qs[32]; };
#endif
layout(std430, binding = QUANT_BINDING) readonly buffer QW { BlockQK qw[]; };
uint kscale_byte(uint ib, uint j) { return (qw[ib].scales[j >> 2] >> (8u * (j & 3u))) & 0xFFu; }
void dequant_group(uint G, out vec4 v[8]) {
    uint ib = G >> 3, g = G & 7u;
    vec2 dm = vec2(qw[ib].dm);
    uint sc, m;
    if (g < 4u) {
        sc = kscale_byte(ib, g) & 63u;
        m = kscale_byte(ib, g + 4u) & 63u;
    } else {
        sc = (kscale_byte(ib, g + 4u) & 0xFu) | ((kscale_byte(ib, g - 4u) >> 6) << 4);
        m = (kscale_byte(ib, g + 4u) >> 4) | ((kscale_byte(ib, g) >> 6) << 4);
    }
    float d = dm.x * float(sc), mn = dm.y * float(m);
    uint base = 8u * (g >> 1), s = 4u * (g & 1u);
    for (uint i = 0u; i < 8u; ++i) {
        vec4 q = nib4(qw[ib].qs[base + i], s);
#if QTYPE == GGML_TYPE_Q5_K
        uint h = qw[ib].qh[i] >> g;
        q += 16.0 * vec4(h & 1u, (h >> 8) & 1u, (h >> 16) & 1u, (h >> 24) & 1u);
#endif
        v[i] = d * q - mn;
    }
}

// The same blocks as uvec4s: [dm, scales] then (Q5_K) 2 of qh, then 8 of qs.
layout(std430, binding = QUANT_BINDING) readonly buffer QW4 { uvec4 qw4[]; };
#if QTYPE == GGML_TYPE_Q4_K
const uint KQ_VEC4 = 9u, KQ_QS = 1u;
#else
const uint KQ_VEC4 = 11u, KQ_QS = 3u;
#endif
#define SPB 8u
// (scale, min) of sub-block g from the 12 scale bytes held in sb.
vec2 k_scale_min(uvec3 sb, uint g) {
    uint b0 = (sb[g >> 2] >> (8u * (g & 3u))) & 0xFFu;
    uint b4 = (sb[(g + 4u) >> 2] >> (8u * (g & 3u))) & 0xFFu;
    if (g < 4u) return vec2(b0 & 63u, b4 & 63u);
    uint bm4 = (sb[(g - 4u) >> 2] >> (8u * (g & 3u))) & 0xFFu;
    return vec2((b4 & 0xFu) | ((bm4 >> 6) << 4), (b4 >> 4) | ((b0 >> 6) << 4));
}
// Slice c = chunk c of qs (bytes 16c..16c+15): low nibbles are elements 64(c/2) + 16(c%2) + i
// (sub-block g0 = 2(c/2)), high nibbles the same + 32 (sub-block g0 + 1).
uvec2 slice_runs(uint u) {
    uint c = u & 7u, o = 256u * (u >> 3) + 64u * (c >> 1) + 16u * (c & 1u);
    return uvec2(o, o + 32u);
}

#elif QTYPE == GGML_TYPE_Q6_K
// block: u8 ql[128]; u8 qh[64]; i8 scales[16]; f16 d  (210 bytes)
// Half n = g/4 (128 elements), quarter j = g%4: low bits from ql[64n + 32(j&1) + l] (nibble
// j>>1), high 2 bits from qh[32n + l] >> 2j, scale scales[8n + 2j + l/16]; x = d*sc*(q-32).
struct BlockQ6_K { uint16_t ql[64]; uint16_t qh[32]; uint16_t scales[8]; float16_t d; };
layout(std430, binding = QUANT_BINDING) readonly buffer QW { BlockQ6_K qw[]; };
void dequant_group(uint G, out vec4 v[8]) {
    uint ib = G >> 3, g = G & 7u, n = g >> 2, j = g & 3u;
    float d = float(qw[ib].d);
    uint sw = uint(qw[ib].scales[4u * n + j]);
    float d0 = d * float(sbyte_lo(sw)), d1 = d * float(sbyte_hi(sw));
    uint lbase = 32u * n + 16u * (j & 1u), hbase = 16u * n, ls = 4u * (j >> 1), hs = 2u * j;
    for (uint i = 0u; i < 8u; ++i) {
        uint l = uint(qw[ib].ql[lbase + 2u * i]) | (uint(qw[ib].ql[lbase + 2u * i + 1u]) << 16);
        uint h = uint(qw[ib].qh[hbase + 2u * i]) | (uint(qw[ib].qh[hbase + 2u * i + 1u]) << 16);
        vec4 q = nib4(l, ls) + 16.0 * vec4((h >> hs) & 3u, (h >> (hs + 8u)) & 3u,
                                           (h >> (hs + 16u)) & 3u, (h >> (hs + 24u)) & 3u) - 32.0;
        v[i] = (i < 4u ? d0 : d1) * q;
    }
}
#define SPB 8u
// Slice c: half n = c/4, cc = c%4 covers ql bytes 64n + 16cc .. +15 (l = 16(cc%2) + i of quarter
// jlo = cc/2 in the low nibbles, quarter jlo + 2 in the high ones) and qh bytes 32n + l.
uvec2 slice_runs(uint u) {
    uint c = u & 7u, cc = c & 3u;
    uint o = 256u * (u >> 3) + 128u * (c >> 2) + 32u * (cc >> 1) + 16u * (cc & 1u);
    return uvec2(o, o + 64u);
}

#elif QTYPE == GGML_TYPE_IQ4_XS
// block: f16 d; u16 scales_h; u8 scales_l[4]; u8 qs[128]  (136 bytes)
// group g: 6-bit scale ls = scales_l nibble g | 2 bits g of scales_h << 4; x = d*(ls-32)*kv[q],
// q = low nibbles of qs[16g..16g+15] for elements 0..15, high nibbles for 16..31.
struct BlockIQ4_XS { float16_t d; uint16_t scales_h; uint scales_l; uint qs[32]; };
layout(std430, binding = QUANT_BINDING) readonly buffer QW { BlockIQ4_XS qw[]; };
// The 16 IQ4_NL levels as signed bytes, four to a word. A const array indexed by a run-time code
// lives in local memory (the IQ4_XS decode GEMV ran at 0.04 of copy bandwidth on the H200);
// two selects and a bit-field extract stay in registers.
const uint IQ4_LEVELS0 = 0xBFAD9881u, IQ4_LEVELS1 = 0xF6EADDCFu;  // -127 -104 -83 -65 | -49 -35 -22 -10
const uint IQ4_LEVELS2 = 0x26190D01u, IQ4_LEVELS3 = 0x71594535u;  //    1   13  25  38 |  53  69  89 113
float iq4_value(uint c) {
    uint w = (c & 8u) != 0u ? ((c & 4u) != 0u ? IQ4_LEVELS3 : IQ4_LEVELS2)
                            : ((c & 4u) != 0u ? IQ4_LEVELS1 : IQ4_LEVELS0);
    return float(bitfieldExtract(int(w), int((c & 3u) << 3), 8));
}
vec4 iq4_lookup(uint w, uint s) {
    return vec4(iq4_value(w >> s), iq4_value(w >> (s + 8u)), iq4_value(w >> (s + 16u)), iq4_value(w >> (s + 24u)));
}
void dequant_group(uint G, out vec4 v[8]) {
    uint ib = G >> 3, g = G & 7u;
    uint ls = ((qw[ib].scales_l >> (4u * g)) & 0xFu) | (((uint(qw[ib].scales_h) >> (2u * g)) & 3u) << 4);
    float dl = float(qw[ib].d) * (float(ls) - 32.0);
    for (uint i = 0u; i < 4u; ++i) {
        uint w = qw[ib].qs[4u * g + i];
        v[i] = dl * iq4_lookup(w, 0u);
        v[i + 4u] = dl * iq4_lookup(w, 4u);
    }
}

#else
#error "unsupported QTYPE"
#endif

#ifndef SPB
// Every other type: a slice is a 32-element group (runs at 32u and 32u + 16).
#define SPB 1u
uvec2 slice_runs(uint u) { return uvec2(32u * u, 32u * u + 16u); }
#endif

#ifdef QUANT_FAST_CVT
// The raw buffer as 32-bit words, for the block types that are only 2-byte aligned (Q8_0, Q4_0,
// Q5_0, Q6_K): a run of bytes at an even byte offset b is read with 32-bit loads (one more word and
// a 16-bit funnel shift where b is 2 mod 4) instead of one 16-bit load per 2 bytes: about half the
// load instructions, each touching as many cache sectors.
layout(std430, binding = QUANT_BINDING) readonly buffer QWU { uint qwu[]; };
uint raw_u16(uint b) { return (qwu[b >> 2] >> (8u * (b & 2u))) & 0xFFFFu; }
uint raw_u32(uint b) {  // b even
    const uint w = b >> 2, lo = qwu[w];
    return (b & 2u) == 0u ? lo : (lo >> 16) | (qwu[w + 1u] << 16);
}
uvec2 raw8(uint b) {  // 8 bytes at even b
    const uint w = b >> 2;
    const uvec2 lo = uvec2(qwu[w], qwu[w + 1u]);
    if ((b & 2u) == 0u) return lo;
    return uvec2((lo.x >> 16) | (lo.y << 16), (lo.y >> 16) | (qwu[w + 2u] << 16));
}
uvec4 raw16(uint b) {  // 16 bytes at even b
    const uint w = b >> 2;
    const uvec4 lo = uvec4(qwu[w], qwu[w + 1u], qwu[w + 2u], qwu[w + 3u]);
    if ((b & 2u) == 0u) return lo;
    return uvec4((lo.x >> 16) | (lo.y << 16), (lo.y >> 16) | (lo.z << 16), (lo.z >> 16) | (lo.w << 16),
                 (lo.w >> 16) | (qwu[w + 4u] << 16));
}
#endif

// ---- GEMV slices: raw words (slice_fetch), then Σ W·x (slice_dot) ----------------------------
vec4 bits4(uint w, uint s, uint mask) {  // fields of `mask` at bit offsets s, s+8, s+16, s+24
#ifdef QUANT_FAST_CVT
    // 2^23 + field as f32 bits, minus 2^23: exact, and no int→float conversion (a quarter-rate
    // instruction on NVIDIA; the GEMV decodes a few elements per byte read)
    return uintBitsToFloat(uvec4((w >> s) & mask, (w >> (s + 8u)) & mask, (w >> (s + 16u)) & mask,
                                 (w >> (s + 24u)) & mask) | 0x4B000000u) - 8388608.0;
#else
    return vec4((w >> s) & mask, (w >> (s + 8u)) & mask, (w >> (s + 16u)) & mask, (w >> (s + 24u)) & mask);
#endif
}
#if QTYPE == GGML_TYPE_F32
struct Slice { vec4 w[8]; };
Slice slice_fetch(uint S) { Slice r; for (uint i = 0u; i < 8u; ++i) r.w[i] = qw[S * 8u + i]; return r; }
vec4 slice_codes(Slice r, uint i) { return r.w[i]; }
float slice_sum(Slice r, float s0, float s1, vec2 xs) { return s0 + s1; }
vec4 slice_affine(Slice r) { return vec4(1.0, 0.0, 1.0, 0.0); }

#elif QTYPE == GGML_TYPE_F16 || QTYPE == GGML_TYPE_BF16
struct Slice { uvec4 h[4]; };
Slice slice_fetch(uint S) { Slice r; for (uint i = 0u; i < 4u; ++i) r.h[i] = qw[S * 4u + i]; return r; }
vec2 half2(uint w) {
#if QTYPE == GGML_TYPE_F16
    return unpackHalf2x16(w);
#else
    return vec2(uintBitsToFloat(w << 16), uintBitsToFloat(w & 0xFFFF0000u));
#endif
}
vec4 slice_codes(Slice r, uint i) {
    const uvec4 h = r.h[i >> 1];
    return (i & 1u) == 0u ? vec4(half2(h.x), half2(h.y)) : vec4(half2(h.z), half2(h.w));
}
float slice_sum(Slice r, float s0, float s1, vec2 xs) { return s0 + s1; }
vec4 slice_affine(Slice r) { return vec4(1.0, 0.0, 1.0, 0.0); }

#elif QTYPE == GGML_TYPE_Q8_0
struct Slice { float d; uint q[8]; };
Slice slice_fetch(uint S) {
    Slice r;
#ifdef QUANT_FAST_CVT
    const uint b = S * 34u;
    r.d = unpackHalf2x16(raw_u16(b)).x;
    const uvec4 a = raw16(b + 2u), c = raw16(b + 18u);
    for (uint i = 0u; i < 4u; ++i) { r.q[i] = a[i]; r.q[i + 4u] = c[i]; }
#else
    r.d = float(qw[S].d);
    for (uint i = 0u; i < 8u; ++i) r.q[i] = uint(qw[S].qs[2u * i]) | (uint(qw[S].qs[2u * i + 1u]) << 16);
#endif
    return r;
}
vec4 slice_codes(Slice r, uint i) {
#ifdef QUANT_FAST_CVT
    return bits4(r.q[i] ^ 0x80808080u, 0u, 0xFFu) - 128.0;  // q + 128 ≥ 0
#else
    return vec4(int(r.q[i] << 24) >> 24, int(r.q[i] << 16) >> 24, int(r.q[i] << 8) >> 24, int(r.q[i]) >> 24);
#endif
}
float slice_sum(Slice r, float s0, float s1, vec2 xs) { return r.d * (s0 + s1); }
vec4 slice_affine(Slice r) { return vec4(r.d, 0.0, r.d, 0.0); }

#elif QTYPE == GGML_TYPE_Q4_0 || QTYPE == GGML_TYPE_Q5_0
struct Slice { float d; uint qh; uint q[4]; };
Slice slice_fetch(uint S) {
    Slice r;
#ifdef QUANT_FAST_CVT
#if QTYPE == GGML_TYPE_Q5_0
    const uint b = S * 22u, qs = b + 6u;
    r.qh = raw_u32(b + 2u);
#else
    const uint b = S * 18u, qs = b + 2u;
    r.qh = 0u;
#endif
    r.d = unpackHalf2x16(raw_u16(b)).x;
    const uvec4 a = raw16(qs);
    for (uint i = 0u; i < 4u; ++i) r.q[i] = a[i];
#else
    r.d = float(qw[S].d);
#if QTYPE == GGML_TYPE_Q5_0
    r.qh = uint(qw[S].qh[0]) | (uint(qw[S].qh[1]) << 16);
#else
    r.qh = 0u;
#endif
    for (uint i = 0u; i < 4u; ++i) r.q[i] = uint(qw[S].qs[2u * i]) | (uint(qw[S].qs[2u * i + 1u]) << 16);
#endif
    return r;
}
vec4 slice_codes(Slice r, uint i) {  // i < 4: low nibbles of q[i], else the high ones of q[i − 4]
    const uint k = i & 3u, sh = 4u * (i >> 2), h = r.qh >> (4u * k + 4u * sh);  // qh bits 4k.. (lo), 16 + 4k.. (hi)
#if defined(QUANT_FAST_CVT)
    // 5-bit codes assembled in the integer domain, 4 per word: bit j of a nibble → bit 8j
    return bits4(((r.q[k] >> sh) & 0x0F0F0F0Fu) | (((h & 15u) * 0x00204081u & 0x01010101u) << 4), 0u, 0xFFu);
#else
    vec4 v = bits4(r.q[k], sh, 15u);
#if QTYPE == GGML_TYPE_Q5_0
    v += 16.0 * vec4(h & 1u, (h >> 1) & 1u, (h >> 2) & 1u, (h >> 3) & 1u);
#endif
    return v;
#endif
}
float slice_sum(Slice r, float s0, float s1, vec2 xs) {
#if QTYPE == GGML_TYPE_Q5_0
    return r.d * ((s0 + s1) - 16.0 * (xs.x + xs.y));
#else
    return r.d * ((s0 + s1) - 8.0 * (xs.x + xs.y));
#endif
}
vec4 slice_affine(Slice r) {
#if QTYPE == GGML_TYPE_Q5_0
    const float b = -16.0 * r.d;
#else
    const float b = -8.0 * r.d;
#endif
    return vec4(r.d, b, r.d, b);
}

#elif QTYPE == GGML_TYPE_Q4_K || QTYPE == GGML_TYPE_Q5_K
// header [dm, scales], quants chunk c, (Q5_K) the qh half of the chunk's 16 positions
struct Slice { uvec4 hdr; uvec4 q; uvec4 qh; uint c; };
Slice slice_fetch(uint S) {
    Slice r;
    uint ib = S >> 3;
    r.c = S & 7u;
    r.hdr = qw4[ib * KQ_VEC4];
    r.q = qw4[ib * KQ_VEC4 + KQ_QS + r.c];
#if QTYPE == GGML_TYPE_Q5_K
    r.qh = qw4[ib * KQ_VEC4 + 1u + (r.c & 1u)];
#else
    r.qh = uvec4(0u);
#endif
    return r;
}
vec4 slice_codes(Slice r, uint i) {  // i < 4: low nibbles of q[i] (group g0), else the high ones of q[i − 4]
    const uint k = i & 3u, hb = 2u * (r.c >> 1) + (i >> 2), sh = 4u * (i >> 2);
#if defined(QUANT_FAST_CVT) && QTYPE == GGML_TYPE_Q5_K
    return bits4(((r.q[k] >> sh) & 0x0F0F0F0Fu) | (((r.qh[k] >> hb) & 0x01010101u) << 4), 0u, 0xFFu);
#elif QTYPE == GGML_TYPE_Q5_K
    return bits4(r.q[k], sh, 15u) + 16.0 * bits4(r.qh[k], hb, 1u);
#else
    return bits4(r.q[k], sh, 15u);
#endif
}
float slice_sum(Slice r, float s0, float s1, vec2 xs) {
    const uint g0 = 2u * (r.c >> 1);
    const vec2 dm = unpackHalf2x16(r.hdr.x);
    const vec2 sm0 = k_scale_min(r.hdr.yzw, g0), sm1 = k_scale_min(r.hdr.yzw, g0 + 1u);
    return dm.x * (sm0.x * s0 + sm1.x * s1) - dm.y * (sm0.y * xs.x + sm1.y * xs.y);
}
vec4 slice_affine(Slice r) {
    const uint g0 = 2u * (r.c >> 1);
    const vec2 dm = unpackHalf2x16(r.hdr.x);
    const vec2 sm0 = k_scale_min(r.hdr.yzw, g0), sm1 = k_scale_min(r.hdr.yzw, g0 + 1u);
    return vec4(dm.x * sm0.x, -dm.y * sm0.y, dm.x * sm1.x, -dm.y * sm1.y);
}

#elif QTYPE == GGML_TYPE_Q6_K
// 16 bytes of ql, the 16 matching bytes of qh, the two runs' scales (signed), d, and the chunk
struct Slice { uint l[4]; uint h[4]; vec2 sc; float d; uint c; };
Slice slice_fetch(uint S) {
    Slice r;
    uint ib = S >> 3, c = S & 7u, n = c >> 2, cc = c & 3u;
    r.c = c;
    uint slo = 8u * n + 2u * (cc >> 1) + (cc & 1u), shi = slo + 4u;
#ifdef QUANT_FAST_CVT
    const uint B = ib * 210u;  // ql 0..127, qh 128..191, scales 192..207, d 208
    const uvec2 sw = raw8(B + 192u + 8u * n);  // scales 8n .. 8n+7: slo and shi = slo + 4 are in it
    const uint ol = slo - 8u * n;
    r.sc = vec2(int(sw[ol >> 2] << (24u - 8u * (ol & 3u))) >> 24, int(sw[1u] << (24u - 8u * (ol & 3u))) >> 24);
    r.d = unpackHalf2x16(raw_u16(B + 208u)).x;
    const uvec4 l = raw16(B + 64u * n + 16u * cc), h = raw16(B + 128u + 32u * n + 16u * (cc & 1u));
    for (uint k = 0u; k < 4u; ++k) { r.l[k] = l[k]; r.h[k] = h[k]; }
#else
    uint wlo = uint(qw[ib].scales[slo >> 1]), whi = uint(qw[ib].scales[shi >> 1]);
    r.sc = vec2((slo & 1u) == 0u ? sbyte_lo(wlo) : sbyte_hi(wlo), (shi & 1u) == 0u ? sbyte_lo(whi) : sbyte_hi(whi));
    r.d = float(qw[ib].d);
    uint lb = 32u * n + 8u * cc, hb = 16u * n + 8u * (cc & 1u);
    for (uint k = 0u; k < 4u; ++k) {
        r.l[k] = uint(qw[ib].ql[lb + 2u * k]) | (uint(qw[ib].ql[lb + 2u * k + 1u]) << 16);
        r.h[k] = uint(qw[ib].qh[hb + 2u * k]) | (uint(qw[ib].qh[hb + 2u * k + 1u]) << 16);
    }
#endif
    return r;
}
vec4 slice_codes(Slice r, uint i) {  // i < 4: low nibbles of l[i], else the high ones of l[i − 4]
    const uint k = i & 3u, sh = 4u * (i >> 2), hs = 2u * ((r.c & 3u) >> 1) + sh;
#ifdef QUANT_FAST_CVT
    return bits4(((r.l[k] >> sh) & 0x0F0F0F0Fu) | (((r.h[k] >> hs) & 0x03030303u) << 4), 0u, 0xFFu);
#else
    return bits4(r.l[k], sh, 15u) + 16.0 * bits4(r.h[k], hs, 3u);
#endif
}
float slice_sum(Slice r, float s0, float s1, vec2 xs) {
    return r.d * (r.sc.x * (s0 - 32.0 * xs.x) + r.sc.y * (s1 - 32.0 * xs.y));
}
vec4 slice_affine(Slice r) {
    const vec2 a = r.d * r.sc;
    return vec4(a.x, -32.0 * a.x, a.y, -32.0 * a.y);
}

#elif QTYPE == GGML_TYPE_IQ4_XS
struct Slice { float dl; uint q[4]; };
Slice slice_fetch(uint S) {
    Slice r;
    uint ib = S >> 3, g = S & 7u;
    uint ls = ((qw[ib].scales_l >> (4u * g)) & 0xFu) | (((uint(qw[ib].scales_h) >> (2u * g)) & 3u) << 4);
    r.dl = float(qw[ib].d) * (float(ls) - 32.0);
    for (uint i = 0u; i < 4u; ++i) r.q[i] = qw[ib].qs[4u * g + i];
    return r;
}
vec4 slice_codes(Slice r, uint i) { return iq4_lookup(r.q[i & 3u], 4u * (i >> 2)); }  // values, not codes
float slice_sum(Slice r, float s0, float s1, vec2 xs) { return r.dl * (s0 + s1); }
vec4 slice_affine(Slice r) { return vec4(r.dl, 0.0, r.dl, 0.0); }
#endif
// Σ W·x over the slice: its codes against x's two runs, then its scales.
// Written out, not looped: slice_codes indexes the slice's arrays by i, which must be a constant
// (a loop left rolled puts the Slice in local memory: Q6_K's decode GEMV ran 6.6× slower on the H200).
float slice_dot(Slice r, vec4 xg[8], vec2 xs) {
    float s0 = 0.0, s1 = 0.0;
    s0 += dot(slice_codes(r, 0u), xg[0]);
    s1 += dot(slice_codes(r, 4u), xg[4]);
    s0 += dot(slice_codes(r, 1u), xg[1]);
    s1 += dot(slice_codes(r, 5u), xg[5]);
    s0 += dot(slice_codes(r, 2u), xg[2]);
    s1 += dot(slice_codes(r, 6u), xg[6]);
    s0 += dot(slice_codes(r, 3u), xg[3]);
    s1 += dot(slice_codes(r, 7u), xg[7]);
    return slice_sum(r, s0, s1, xs);
}
// Σ W·x over slice S in one call (fetch and dot together).
float dot_slice(uint S, vec4 xg[8], vec2 xs) { return slice_dot(slice_fetch(S), xg, xs); }
#endif  // QTYPE
