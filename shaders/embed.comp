#version 450
// Embedding row gather (MODEL.md §5.1 E1): y[y_off + t*y_stride + e] = table[ids[ids_off + t]][e]
// for t < n_tokens, e < d, decoding the table row on the fly (TABLE_TYPE = GGML type id: F32,
// F16, Q8_0, Q4_0, Q5_0, Q4_K, Q6_K; layouts in common/quant.glsl). The table starts at word
// table_off of its buffer, rows of row_bytes each. An id outside [0, n_vocab) yields a NaN row
// (never an out-of-bounds read). IDENTITY: row t is table row t (rows the host staged in order;
// the ids are not read).
// Buffers: 0 ids (int32), 1 table (raw bytes as uint), 2 y (f32).
// Grid: x strides over the d elements of a row, y over tokens.
#extension GL_GOOGLE_include_directive : require
#include "common/base.glsl"

layout(constant_id = 1) const uint TABLE_TYPE = 0;
layout(constant_id = 2) const bool IDENTITY = false;

layout(std430, binding = 0) readonly buffer Ids { int ids[]; };
layout(std430, binding = 1) readonly buffer T { uint table[]; };
layout(std430, binding = 2) writeonly buffer Y { float y[]; };
layout(push_constant) uniform P {
    uint d; uint n_tokens; uint n_vocab; uint row_bytes; uint table_off; uint ids_off; uint y_off; uint y_stride;
} p;

#define QUANT_WORD(i) table[i]
#include "common/quant.glsl"

float decode(uint row, uint e) {
    if (TABLE_TYPE == GGML_TYPE_F32) return dequant_f32(row, e);
    if (TABLE_TYPE == GGML_TYPE_F16) return dequant_f16(row, e);
    if (TABLE_TYPE == GGML_TYPE_Q8_0) return dequant_q8_0(row + (e / Q8_0_ELEMS) * Q8_0_BYTES, e % Q8_0_ELEMS);
    if (TABLE_TYPE == GGML_TYPE_Q4_0) return dequant_q4_0(row + (e / Q4_0_ELEMS) * Q4_0_BYTES, e % Q4_0_ELEMS);
    if (TABLE_TYPE == GGML_TYPE_Q5_0) return dequant_q5_0(row + (e / Q5_0_ELEMS) * Q5_0_BYTES, e % Q5_0_ELEMS);
    if (TABLE_TYPE == GGML_TYPE_Q4_K) return dequant_q4_k(row + (e / Q4_K_ELEMS) * Q4_K_BYTES, e % Q4_K_ELEMS);
    return dequant_q6_k(row + (e / Q6_K_ELEMS) * Q6_K_BYTES, e % Q6_K_ELEMS);  // GGML_TYPE_Q6_K
}

void main() {
    uint step = gl_NumWorkGroups.x * gl_WorkGroupSize.x;
    for (uint t = gl_WorkGroupID.y; t < p.n_tokens; t += gl_NumWorkGroups.y) {
        const int id = IDENTITY ? int(t) : ids[p.ids_off + t];
        bool ok = id >= 0 && uint(id) < p.n_vocab;
        uint row = 4u * p.table_off + uint(ok ? id : 0) * p.row_bytes;
        for (uint e = gl_GlobalInvocationID.x; e < p.d; e += step) {
            y[p.y_off + t * p.y_stride + e] = ok ? decode(row, e) : uintBitsToFloat(0x7FC00000u);
        }
    }
}
