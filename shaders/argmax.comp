#version 450
// Row argmax in two passes (first maximum wins on ties, like numpy; -inf is a value). A row with a
// NaN or +inf anywhere yields NO_INDEX (0xFFFFFFFF): no logit can be its argmax, and the host,
// reading an index >= n, reports a numeric fault instead of a token.
//   STAGE 0: workgroup (g, r) scans x[x_off + r*x_stride + i] for i = g*WG + lane, stepping by
//            n_parts*WG, and writes its best (value bits, index) to part[2*(r*n_parts + g) + {0,1}].
//   STAGE 1: workgroup r reduces the n_parts pairs of row r and writes the index to out[out_off + r].
// Buffers: 0 x (f32), 1 part (uint pairs, 2*n_rows*n_parts words), 2 out (uint).
#extension GL_GOOGLE_include_directive : require
#include "common/base.glsl"
#include "common/reduce.glsl"

layout(constant_id = 1) const uint STAGE = 0;

layout(std430, binding = 0) readonly buffer X { float x[]; };
layout(std430, binding = 1) buffer Part { uint part[]; };
layout(std430, binding = 2) buffer Out { uint outv[]; };
layout(push_constant) uniform P { uint n; uint n_rows; uint n_parts; uint x_off; uint x_stride; uint out_off; } p;

const float NEG_INF = -1.0 / 0.0;
const float POS_INF = 1.0 / 0.0;
const uint NO_INDEX = 0xFFFFFFFFu;

// NaN or +inf, by bits (immune to any fast-math folding of isnan).
bool not_a_logit(float v) {
    uint b = floatBitsToUint(v);
    return (b & 0x7FFFFFFFu) > 0x7F800000u || b == 0x7F800000u;
}

void main() {
    uint lane = gl_LocalInvocationID.x;
    for (uint r = gl_WorkGroupID.y; r < p.n_rows; r += gl_NumWorkGroups.y) {
        float bv = NEG_INF;
        uint bi = NO_INDEX;
        if (STAGE == 0) {
            uint xb = p.x_off + r * p.x_stride;
            bool seen = false;
            for (uint i = gl_WorkGroupID.x * gl_WorkGroupSize.x + lane; i < p.n; i += p.n_parts * gl_WorkGroupSize.x) {
                float v = x[xb + i];
                uint j = i;
                if (not_a_logit(v)) { v = POS_INF; j = NO_INDEX; }  // beats every logit, wins only as NO_INDEX
                if (!seen || argmax_better(v, j, bv, bi)) { bv = v; bi = j; seen = true; }
            }
            bv = wg_argmax(bv, bi);
            if (lane == 0u) {
                uint k = 2u * (r * p.n_parts + gl_WorkGroupID.x);
                part[k] = floatBitsToUint(bv);
                part[k + 1u] = bi;
            }
        } else {
            for (uint g = lane; g < p.n_parts; g += gl_WorkGroupSize.x) {
                uint k = 2u * (r * p.n_parts + g);
                float v = uintBitsToFloat(part[k]);
                uint i = part[k + 1u];
                if (argmax_better(v, i, bv, bi)) { bv = v; bi = i; }
            }
            bv = wg_argmax(bv, bi);
            if (lane == 0u) outv[p.out_off + r] = bi;
        }
    }
}
