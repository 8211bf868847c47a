// Integer-dot GEMV slices (llama.cpp's MMVQ idea): W's codes against an activation row quantized
// to 8-bit blocks, 4 products per packed dot instruction (SPIR-V OpSDot, 4×8-bit packed; reached
// through GL_EXT_spirv_intrinsics, which the PyPI glslang compiles).
// Include after common/quant.glsl (QTYPE, QUANT_BINDING, QUANT_FAST_CVT: the block arrays qw / qw4
// and the word loads raw16 … of 2-byte-aligned blocks) once the
// includer has declared the activation blocks of the row being multiplied:
//   shared uvec4 xq4[];    xq4[xq + v] = x_q[16v .. 16v+15] as int8, 4 per word (element 16v+4i+b in byte b of word i)
//   shared uvec2 xmeta[];  xmeta[xq/2 + b] = (d_b as f32 bits, Σ x_q over elements 32b..32b+15
//                          | Σ over 32b+16..32b+31 << 16, as int16)
// x ≈ d_b·x_q on block b (32 elements) of the row starting at xq4[xq] (xq even: one token column of
// several; common/gemv_core.glsl quantize_x writes both arrays).
//   QSlice qslice_fetch(uint S)                 loads slice S of the whole weight buffer (QE elements)
//   float qslice_dot(QSlice w, uint u, uint xq) Σ W·(d·x_q) over the slice, u = its index within the row
// QE = 64 for the K-quants (a sub-block pair: Q4_K/Q5_K quants bytes 32s..32s+31 of the
// super-block, sub-blocks 2s and 2s+1; Q6_K positions l0..l0+15 of half n, all four quarters),
// 32 for Q8_0 / Q4_0 / Q5_0 (one block). Codes are assembled 4 per word in the integer domain
// (non-negative, < 128, so the signed dot takes them as they are); the offsets (−8, −16, −32) and
// the K-quant mins use the blocks' Σ x_q, so the result is exactly Σ W_deq·(d·x_q) up to f32
// rounding of the few scale products per slice.
#extension GL_EXT_spirv_intrinsics : require

spirv_instruction(extensions = ["SPV_KHR_integer_dot_product"], capabilities = [6019, 6018], id = 4450)
int sdot_packed(int a, int b, spirv_literal int fmt);  // OpSDot, PackedVectorFormat4x8Bit = 0
int sdot4(uint a, uint b) { return sdot_packed(int(a), int(b), 0); }

// block b of the row whose blocks start at xq4[xq]: its d, its two half sums, their sum
float xq_d(uint xq, uint b) { return uintBitsToFloat(xmeta[xq / 2u + b].x); }
ivec2 xq_halves(uint xq, uint b) { uint w = xmeta[xq / 2u + b].y; return ivec2(int(w << 16) >> 16, int(w) >> 16); }
int xq_sum(uint xq, uint b) { ivec2 h = xq_halves(xq, b); return h.x + h.y; }

#if QTYPE == GGML_TYPE_Q4_K || QTYPE == GGML_TYPE_Q5_K
#define QE 64u
// header [dm, scales], the two 16-byte quant chunks, (Q5_K) the 32 qh bytes, the pair index
struct QSlice { uvec4 hdr; uvec4 q0; uvec4 q1; uvec4 h0; uvec4 h1; uint s; };
QSlice qslice_fetch(uint S) {
    QSlice r;
    const uint b = (S >> 2) * KQ_VEC4;
    r.s = S & 3u;
    r.hdr = qw4[b];
    r.q0 = qw4[b + KQ_QS + 2u * r.s];
    r.q1 = qw4[b + KQ_QS + 2u * r.s + 1u];
#if QTYPE == GGML_TYPE_Q5_K
    r.h0 = qw4[b + 1u];
    r.h1 = qw4[b + 2u];
#else
    r.h0 = uvec4(0u);
    r.h1 = uvec4(0u);
#endif
    return r;
}
float qslice_dot(QSlice r, uint u, uint xq) {
    const uint g0 = 2u * r.s, b0 = 2u * u;  // sub-blocks g0, g0+1 = the row's x blocks b0, b0+1
    int s0 = 0, s1 = 0;
    [[unroll]] for (uint k = 0u; k < 4u; ++k) {
        uint lo = r.q0[k] & 0x0F0F0F0Fu, hi = (r.q0[k] >> 4) & 0x0F0F0F0Fu;
        uint lo2 = r.q1[k] & 0x0F0F0F0Fu, hi2 = (r.q1[k] >> 4) & 0x0F0F0F0Fu;
#if QTYPE == GGML_TYPE_Q5_K
        lo |= ((r.h0[k] >> g0) & 0x01010101u) << 4;
        hi |= ((r.h0[k] >> (g0 + 1u)) & 0x01010101u) << 4;
        lo2 |= ((r.h1[k] >> g0) & 0x01010101u) << 4;
        hi2 |= ((r.h1[k] >> (g0 + 1u)) & 0x01010101u) << 4;
#endif
        s0 += sdot4(lo, xq4[xq + 2u * b0][k]) + sdot4(lo2, xq4[xq + 2u * b0 + 1u][k]);
        s1 += sdot4(hi, xq4[xq + 2u * b0 + 2u][k]) + sdot4(hi2, xq4[xq + 2u * b0 + 3u][k]);
    }
    const vec2 dm = unpackHalf2x16(r.hdr.x);
    const vec2 sm0 = k_scale_min(r.hdr.yzw, g0), sm1 = k_scale_min(r.hdr.yzw, g0 + 1u);
    const float d0 = xq_d(xq, b0), d1 = xq_d(xq, b0 + 1u);
    return dm.x * (sm0.x * d0 * float(s0) + sm1.x * d1 * float(s1))
         - dm.y * (sm0.y * d0 * float(xq_sum(xq, b0)) + sm1.y * d1 * float(xq_sum(xq, b0 + 1u)));
}

#elif QTYPE == GGML_TYPE_Q6_K
#define QE 64u
// Slice s of a block: half n = s/2, positions l0 = 16(s%2) .. +15 of each quarter j (elements
// 128n + 32j + l): ql bytes 64n + l (quarters 0, 2: low, high nibble) and 64n + 32 + l (quarters
// 1, 3), qh bytes 32n + l (bits 2j, 2j+1), scales 8n + 2j + s%2, d.
struct QSlice { uint la[4]; uint lb[4]; uint h[4]; ivec4 sc; float d; uint s; };
QSlice qslice_fetch(uint S) {  // 32-bit loads (common/quant.glsl raw16: the block is 2-byte aligned)
    QSlice r;
    const uint s = S & 3u, n = s >> 1, l0 = 16u * (s & 1u);
    const uint B = (S >> 2) * 210u;  // ql 0..127, qh 128..191, scales 192..207, d 208
    r.s = s;
    const uvec4 la = raw16(B + 64u * n + l0), lb = raw16(B + 64u * n + 32u + l0), h = raw16(B + 128u + 32u * n + l0);
    const uvec2 sw = raw8(B + 192u + 8u * n);  // scales 8n + 2k + s%2, k < 4
    [[unroll]] for (uint k = 0u; k < 4u; ++k) {
        r.la[k] = la[k];
        r.lb[k] = lb[k];
        r.h[k] = h[k];
        r.sc[k] = int(sw[k >> 1] << (24u - 8u * (2u * (k & 1u) + (s & 1u)))) >> 24;
    }
    r.d = unpackHalf2x16(raw_u16(B + 208u)).x;
    return r;
}
float qslice_dot(QSlice r, uint u, uint xq) {
    const uint half_ = r.s & 1u, b = 8u * (u >> 2) + 4u * (r.s >> 1);  // the row's x block of quarter 0
    float acc = 0.0;
    [[unroll]] for (uint j = 0u; j < 4u; ++j) {
        const uvec4 xw = xq4[xq + 2u * (b + j) + half_];
        int s = 0;
        [[unroll]] for (uint k = 0u; k < 4u; ++k) {
            const uint l = (j & 1u) == 0u ? r.la[k] : r.lb[k];
            const uint q = ((l >> (4u * (j >> 1))) & 0x0F0F0F0Fu) | (((r.h[k] >> (2u * j)) & 0x03030303u) << 4);
            s += sdot4(q, xw[k]);
        }
        s -= 32 * xq_halves(xq, b + j)[half_];
        acc += float(r.sc[j]) * xq_d(xq, b + j) * float(s);
    }
    return r.d * acc;
}

#elif QTYPE == GGML_TYPE_Q8_0
#define QE 32u
#define QSlice Slice  // common/quant.glsl's fast fetch: d and the 32 codes as 8 words
QSlice qslice_fetch(uint S) { return slice_fetch(S); }
float qslice_dot(QSlice r, uint u, uint xq) {
    int s = 0;
    [[unroll]] for (uint k = 0u; k < 4u; ++k)
        s += sdot4(r.q[k], xq4[xq + 2u * u][k]) + sdot4(r.q[k + 4u], xq4[xq + 2u * u + 1u][k]);
    return r.d * xq_d(xq, u) * float(s);
}

#elif QTYPE == GGML_TYPE_Q4_0 || QTYPE == GGML_TYPE_Q5_0
#define QE 32u
// low nibbles: elements 0..15 (bit j of qh the 5th bit of element j), high: 16..31 (bit 16 + j)
#define QSlice Slice  // common/quant.glsl's fast fetch: d, qh and the 16 nibble bytes as 4 words
QSlice qslice_fetch(uint S) { return slice_fetch(S); }
float qslice_dot(QSlice r, uint u, uint xq) {
    int s = 0;
    [[unroll]] for (uint k = 0u; k < 4u; ++k) {
        uint lo = r.q[k] & 0x0F0F0F0Fu, hi = (r.q[k] >> 4) & 0x0F0F0F0Fu;
#if QTYPE == GGML_TYPE_Q5_0
        lo |= (((r.qh >> (4u * k)) & 15u) * 0x00204081u & 0x01010101u) << 4;  // bit j of the nibble → bit 8j
        hi |= (((r.qh >> (16u + 4u * k)) & 15u) * 0x00204081u & 0x01010101u) << 4;
#endif
        s += sdot4(lo, xq4[xq + 2u * u][k]) + sdot4(hi, xq4[xq + 2u * u + 1u][k]);
    }
#if QTYPE == GGML_TYPE_Q5_0
    s -= 16 * xq_sum(xq, u);
#else
    s -= 8 * xq_sum(xq, u);
#endif
    return r.d * xq_d(xq, u) * float(s);
}
#endif
