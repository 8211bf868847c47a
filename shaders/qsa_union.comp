#version 450
// Gathered sparse prefill (MODEL.md S1-S3): for query tile k (queries t in [k*TQ, min(T, k*TQ+TQ)),
// positions p0 + t, p0 = params[param_off]) take the per-query selections Sel_t as position bit
// rows (qsa_topk LIST=0: bit j of mask[m_off + t*m_row + j/32], valid for j <= p0 + t) and build
//   U_k = sorted union of Sel_t over the tile -> cells[k*cap + u], u < |U_k|, and
//   per-query slot rows: bit u of smask[s_off + t*s_row + u/32] = (U_k[u] in Sel_t),
// with gp[2k] = p0 + k*TQ, gp[2k + 1] = |U_k| as the params of a gathered, masked attn_flash over
// the tile (S3: the per-query mask is what makes the union exact). Fallback: when 2|U_k| > n_k =
// p0 + t_last + 1 (the tile's causal range) gathering saves little, so the list becomes the dense
// range 0..n_k-1 and the slot rows equal the position rows (masked dense attention).
// Two passes by spec PHASE: 0 builds list + gp with one workgroup per tile; 1 writes the slot rows
// with one workgroup per (tile, query of the tile), reading the count from gp.
// Buffers: 0 params (int32), 1 mask (uint), 2 gp (int32), 3 cells (uint), 4 smask (uint). Spec: 1 PHASE.
#extension GL_GOOGLE_include_directive : require
#include "common/base.glsl"

layout(constant_id = 1) const uint PHASE = 0;

layout(std430, binding = 0) readonly buffer Params { int params[]; };
layout(std430, binding = 1) readonly buffer Mask { uint mask[]; };
layout(std430, binding = 2) buffer GP { int gp[]; };
layout(std430, binding = 3) coherent buffer Cells { uint cells[]; };
layout(std430, binding = 4) writeonly buffer SMask { uint smask[]; };

layout(push_constant) uniform P {
    uint param_off; uint T; uint TQ; uint m_off; uint m_row; uint cap; uint s_off; uint s_row;
} p;

shared uint sub_tot[gl_WorkGroupSize.x];
shared uint sh_base;

bool selected(uint t, uint t_pos, uint j) {
    return j <= t_pos && ((mask[p.m_off + t * p.m_row + (j >> 5)] >> (j & 31u)) & 1u) != 0u;
}

// (S3) slot row of query t of tile k: bit u = (U_k[u] in Sel_t).
void slot_row(uint k, uint t, uint p0, uint tid, uint WG) {
    const uint list = k * p.cap, count = uint(gp[2u * k + 1u]), t_pos = p0 + t;
    for (uint ow = tid; ow < (count + 31u) / 32u; ow += WG) {
        uint word = 0u;
        for (uint b = 0u; b < 32u; ++b) {
            const uint u = ow * 32u + b;
            if (u < count && selected(t, t_pos, cells[list + u])) word |= 1u << b;
        }
        smask[p.s_off + t * p.s_row + ow] = word;
    }
}

void main() {
    const uint tid = gl_LocalInvocationID.x, WG = gl_WorkGroupSize.x, k = gl_WorkGroupID.x;
    const uint p0 = uint(params[p.param_off]);
    const uint t0 = k * p.TQ, t1 = min(p.T, t0 + p.TQ);
    if (PHASE == 1u) {
        if (t0 + gl_WorkGroupID.y < t1) slot_row(k, t0 + gl_WorkGroupID.y, p0, tid, WG);
        return;
    }
    const uint n_k = p0 + t1;  // positions 0 .. p0 + t1 - 1 are causally visible to the tile
    const uint n_words = (n_k + 31u) / 32u;
    const uint list = k * p.cap;

    // (S2) U_k word by word, compacted into the sorted list by a running prefix of popcounts.
    if (tid == 0u) sh_base = 0u;
    barrier();
    for (uint c0 = 0u; c0 < n_words; c0 += WG) {
        const uint w = c0 + tid;
        uint u = 0u;
        if (w < n_words) {
            for (uint t = t0; t < t1; ++t) {
                if (w < (p0 + t + 32u) / 32u) u |= mask[p.m_off + t * p.m_row + w];  // words query t wrote
            }
        }
        const uint f = bitCount(u);
        const uint incl = subgroupInclusiveAdd(f);
        if (gl_SubgroupInvocationID == gl_SubgroupSize - 1u) sub_tot[gl_SubgroupID] = incl;
        barrier();
        if (tid == 0u) {
            uint run = sh_base;
            for (uint s = 0u; s < gl_NumSubgroups; ++s) { const uint x = sub_tot[s]; sub_tot[s] = run; run += x; }
            sh_base = run;
        }
        barrier();
        uint at = sub_tot[gl_SubgroupID] + incl - f;
        while (u != 0u) {
            const int b = findLSB(u);
            cells[list + at++] = w * 32u + uint(b);
            u &= u - 1u;
        }
        barrier();
    }
    memoryBarrierBuffer();  // the list writes above land before the dense fallback overwrites them
    barrier();
    const bool dense = 2u * sh_base > n_k;
    const uint count = dense ? n_k : sh_base;
    if (dense) {
        for (uint i = tid; i < n_k; i += WG) cells[list + i] = i;
    }
    if (tid == 0u) {
        gp[2u * k] = int(p0 + t0);
        gp[2u * k + 1u] = int(count);
    }
}
