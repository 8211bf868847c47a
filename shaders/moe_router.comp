#version 450
// MoE router (MODEL.md §5.7 M1–M3), one workgroup per token (grid-stride over tokens):
//   p = softmax(z) over all E experts (max subtracted, e_i / Σe);
//   I = top-k(p), in descending p, ties to the lower expert index;
//   w_i = p_{I_i} / max(Σ_{i'} p_{I_{i'}}, 2^-14)   (selected p summed in rank order).
// z row t is z[z_off + t*z_stride + e], e < E. Buffers: 0 z (f32), 1 ids (int32, T × k),
// 2 w (f32, T × k). E ≤ MAX_E (constant_id 1) experts are held in shared memory.
// Selection (constant_id 2 RANK): true: one pass, every expert's rank = #{e' : p_e' > p_e, or
// p_e' = p_e and e' < e} counted against all E (no rounds, three barriers: the ranks < k are the
// top-k in order, ties to the lower index; VKFLASH_ROUTER_RANK=1); false (default): k rounds of a
// workgroup argmax, each taking the best remaining expert. Both give the same ids and weights.
// A row whose z holds a NaN or +inf (Σe not finite) is not ranked: ids 0..k-1 (always valid
// expert indices for the kernels that gather by them) and NaN weights, which carry the fault on
// to the logits, where the engine reports it.
#extension GL_GOOGLE_include_directive : require
#include "common/base.glsl"
#include "common/reduce.glsl"
#extension GL_EXT_control_flow_attributes : require

layout(constant_id = 1) const uint MAX_E = 512;
layout(constant_id = 2) const bool RANK = true;
const float DENOM_CLAMP = 6.103515625e-5;  // 2^-14

layout(std430, binding = 0) readonly buffer Z { float z[]; };
layout(std430, binding = 1) buffer Ids { int ids[]; };
layout(std430, binding = 2) buffer W { float w[]; };
layout(push_constant) uniform P {
    uint E; uint k; uint n_rows;
    uint z_off; uint z_stride; uint id_off; uint id_stride; uint w_off; uint w_stride;
} p;

shared float prob[MAX_E];
shared uint sel_id[RANK ? MAX_E : 1u];    // RANK: expert of each rank < k
shared float sel_p[RANK ? MAX_E : 1u];    // and its probability

void main() {
    uint lid = gl_LocalInvocationID.x, wg = gl_WorkGroupSize.x;
    for (uint t = gl_WorkGroupID.x; t < p.n_rows; t += gl_NumWorkGroups.x) {
        uint zr = p.z_off + t * p.z_stride, ir = p.id_off + t * p.id_stride, wr = p.w_off + t * p.w_stride;
        float m = -1.0 / 0.0;  // -inf
        for (uint e = lid; e < p.E; e += wg) m = max(m, z[zr + e]);
        m = wg_max(m);
        float s = 0.0;
        for (uint e = lid; e < p.E; e += wg) {
            float x = exp(z[zr + e] - m);
            prob[e] = x;
            s += x;
        }
        s = wg_sum(s);  // ends with a barrier: every prob[e] is written
        if ((floatBitsToUint(s) & 0x7F800000u) == 0x7F800000u) {  // NaN or inf: the same in every lane
            for (uint j = lid; j < p.k; j += wg) {
                ids[ir + j] = int(j);
                w[wr + j] = uintBitsToFloat(0x7FC00000u);
            }
            continue;
        }
        for (uint e = lid; e < p.E; e += wg) prob[e] = prob[e] / s;
        barrier();
        if (RANK) {
            for (uint e0 = lid; e0 < p.E; e0 += 2u * wg) {  // up to 2 experts per invocation per pass (E 512: all)
                float pe[2];
                uint rank[2];
                [[unroll]] for (uint j = 0u; j < 2u; ++j) {
                    pe[j] = e0 + j * wg < p.E ? prob[e0 + j * wg] : 2.0;  // 2: beaten by none, ranks unused
                    rank[j] = 0u;
                }
                for (uint f = 0u; f < p.E; ++f) {
                    const float pf = prob[f];  // the same f in every lane: a broadcast read for 2 compares
                    [[unroll]] for (uint j = 0u; j < 2u; ++j)
                        rank[j] += (pf > pe[j] || (pf == pe[j] && f < e0 + j * wg)) ? 1u : 0u;
                }
                [[unroll]] for (uint j = 0u; j < 2u; ++j) {
                    if (e0 + j * wg < p.E && rank[j] < p.k) { sel_id[rank[j]] = e0 + j * wg; sel_p[rank[j]] = pe[j]; }
                }
            }
            barrier();
            if (lid == 0) {
                precise float sum = 0.0;
                for (uint j = 0; j < p.k; ++j) sum += sel_p[j];  // in rank order, as the rounds below
                const float denom = max(sum, DENOM_CLAMP);
                for (uint j = 0; j < p.k; ++j) {
                    ids[ir + j] = int(sel_id[j]);
                    w[wr + j] = sel_p[j] / denom;
                }
            }
            barrier();  // prob, sel_* are reused by the next token
            continue;
        }
        precise float sel = 0.0;
        for (uint j = 0; j < p.k; ++j) {
            float bv = -1.0;  // below every probability: taken experts are set to it
            uint bi = 0xFFFFFFFFu;
            for (uint e = lid; e < p.E; e += wg) {
                if (argmax_better(prob[e], e, bv, bi)) { bv = prob[e]; bi = e; }
            }
            bv = wg_argmax(bv, bi);  // ends with a barrier: all lanes have read prob
            sel += bv;
            if (lid == 0) {
                ids[ir + j] = int(bi);
                w[wr + j] = bv;
                prob[bi] = -1.0;
            }
            barrier();
        }
        if (lid == 0) {
            float denom = max(sel, DENOM_CLAMP);
            for (uint j = 0; j < p.k; ++j) w[wr + j] = w[wr + j] / denom;
        }
    }
}
