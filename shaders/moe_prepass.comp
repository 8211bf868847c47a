#version 450
// MoE routing prepass (MODEL.md §5.7 M4): from the router's expert ids (T × k) build, on the GPU,
// the plan the expert matmuls read (no host round-trip). One workgroup.
// Plan buffer (uint32), with E experts, tile width BN and LIVE_CAP = the grid bound:
//   [0]                      n_live: number of live (expert, row-tile) pairs
//   [1 + e]                  c_e: rows (token, slot) routed to expert e
//   [1 + E + e]              o_e = Σ_{e' < e} c_e': first position of expert e's rows
//   [1 + 2E + s], s < n_live live pair s = e | tile << 16, in expert order then tile order
//   [1 + 2E + LIVE_CAP + q]  row q (q < T·k): the pair index t·k + j of the q-th row, where rows
//                            o_e .. o_e + c_e − 1 are expert e's, in increasing token order
// Each token's k ids are distinct experts, so a row's rank within its expert is the number of
// earlier tokens that chose that expert: tokens go in chunks of 32·NW, each expert keeps an NW-word
// bit mask of the chunk's tokens that chose it, and a row's rank is the running count plus the
// set bits below its token (deterministic, unlike an atomic cursor).
// Buffers: 0 ids (int32; id row t at id_off + t*id_stride), 1 plan (uint32, written).
#extension GL_GOOGLE_include_directive : require
#include "common/base.glsl"

layout(constant_id = 1) const uint MAX_E = 512;
const uint NW = 4u, CHUNK = 32u * NW;  // tokens per chunk of the rank pass

layout(std430, binding = 0) readonly buffer Ids { int ids[]; };
layout(std430, binding = 1) writeonly buffer Plan { uint plan[]; };
layout(push_constant) uniform P { uint E; uint k; uint T; uint id_off; uint id_stride; uint BN; uint live_cap; } p;

shared uint cnt[MAX_E];
shared uint cur[MAX_E];  // rank pass: rows of expert e placed so far
shared uint mask[MAX_E * NW];
shared uvec2 part[2u * gl_WorkGroupSize.x];  // scan partials (rows, tiles), double-buffered

uint expert_of(uint t, uint j) { return uint(ids[p.id_off + t * p.id_stride + j]); }

void main() {
    const uint lid = gl_LocalInvocationID.x, wg = gl_WorkGroupSize.x;
    const uint L0 = 1u + 2u * p.E, P0 = L0 + p.live_cap;
    for (uint e = lid; e < p.E; e += wg) {
        cnt[e] = 0u;
        cur[e] = 0u;
        for (uint w = 0u; w < NW; ++w) mask[e * NW + w] = 0u;
    }
    barrier();
    for (uint i = lid; i < p.T * p.k; i += wg) {
        uint e = expert_of(i / p.k, i % p.k);
        if (e < p.E) atomicAdd(cnt[e], 1u);
    }
    barrier();

    // Exclusive scans of (c_e, ⌈c_e/BN⌉): invocation lid owns experts [lid·per, lid·per + per).
    const uint per = (p.E + wg - 1u) / wg, e0 = min(lid * per, p.E), e1 = min(e0 + per, p.E);
    uvec2 s = uvec2(0u);
    for (uint e = e0; e < e1; ++e) s += uvec2(cnt[e], (cnt[e] + p.BN - 1u) / p.BN);
    part[lid] = s;
    barrier();
    uint src = 0u;
    for (uint d = 1u; d < wg; d <<= 1) {  // Hillis–Steele inclusive scan
        uvec2 v = part[src * wg + lid];
        if (lid >= d) v += part[src * wg + lid - d];
        part[(1u - src) * wg + lid] = v;
        src = 1u - src;
        barrier();
    }
    uvec2 run = part[src * wg + lid] - s;  // exclusive prefix of this invocation's experts
    if (lid == wg - 1u) plan[0] = run.y + s.y;
    for (uint e = e0; e < e1; ++e) {
        uint c = cnt[e], tiles = (c + p.BN - 1u) / p.BN;
        plan[1u + e] = c;
        plan[1u + p.E + e] = run.x;
        for (uint tl = 0u; tl < tiles; ++tl) plan[L0 + run.y + tl] = e | (tl << 16);
        cnt[e] = run.x;  // cnt now holds o_e
        run += uvec2(c, tiles);
    }
    barrier();

    for (uint t0 = 0u; t0 < p.T; t0 += CHUNK) {
        const uint n = min(CHUNK, p.T - t0) * p.k;
        for (uint i = lid; i < n; i += wg) {
            uint tl = i / p.k, e = expert_of(t0 + tl, i % p.k);
            if (e < p.E) atomicOr(mask[e * NW + tl / 32u], 1u << (tl % 32u));
        }
        barrier();
        for (uint i = lid; i < n; i += wg) {
            uint tl = i / p.k, e = expert_of(t0 + tl, i % p.k);
            if (e >= p.E) continue;
            uint r = cur[e] + bitCount(mask[e * NW + tl / 32u] & ((1u << (tl % 32u)) - 1u));
            for (uint w = 0u; w < tl / 32u; ++w) r += bitCount(mask[e * NW + w]);
            plan[P0 + cnt[e] + r] = t0 * p.k + i;
        }
        barrier();
        for (uint e = lid; e < p.E; e += wg) {
            for (uint w = 0u; w < NW; ++w) {
                cur[e] += bitCount(mask[e * NW + w]);
                mask[e * NW + w] = 0u;
            }
        }
        barrier();
    }
}
