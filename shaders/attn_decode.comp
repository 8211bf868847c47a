#version 450
// Decode attention (MODEL.md A5-A7, Q9, S3) for T <= 8 queries (decode, MTP verify) over a KV cache:
// the same result as attn_flash.comp, organised for bandwidth instead of q-row tiles.
// Rows are the (token t, q head h) pairs of kv head g, R = t*G + (h - g*G), G = H/H_kv. Workgroup
// (x, y, z) = (chunk of RC rows, g, split z of n_split): every K/V row the workgroup reads serves
// all RC rows (the whole GQA group and all T tokens when T*G <= 16). Query t sits at position
// p0 + t and sees key j iff j <= p0 + t, j < kv_rows and, when MASKED, bit i of its mask row
// (i = iteration slot). Iteration slots i in [0, n_iter): cache positions (dense; n_iter =
// min(n_kv, p0 + t_last + 1, kv_rows)) or list slots (GATHER: j = cells[cell_off + i]); p0 =
// params[param_off], n_kv = params[param_off + 1] are read per replay, nothing is baked in.
// Slots are cut into tiles of BC; split z takes tiles z, z + n_split, ... (grid-stride: any
// length fits, no ceiling). Scores s = (q*scale).k; online softmax in f32 (running max m, sum l,
// rescale alpha = e^(m_old - m_new) per tile), o = sum_j e^(s_j - m) v_j.
// Per tile (WG invocations, three barriers):
//   load   K rows (then V rows) as raw bytes into shared memory with 128-bit loads: a row's 16-byte
//          span [start & ~15, end) (q8_0 rows of 34-byte blocks need not be 16-byte aligned; f16
//          and f32 rows are). The V rows' loads are issued before the scores are computed and the
//          next tile's K rows' before the V rows are used, so loads stay in flight during compute.
//   scores D consecutive invocations of one subgroup per key, each dotting 8-element chunks
//          dg, dg + D, ... of the key with all RC scaled q rows (q in shared memory), P keys per
//          invocation; the D lanes' partial sums are added by a reduce-scatter over
//          subgroupShuffleXor (log2 D exchanges of halves; each lane ends with P*RC/D scores).
//          Element values as kv_cache.glsl's KV_LOAD (q8_0: float(code) * float(d)).
//   softmax one subgroup per row (rows strided over subgroups): tile max, p = e^(s - m), sums.
//   values teams of DH/4 invocations (NT = WG*4/DH teams) take keys c = team, team + NT, ...;
//          each invocation accumulates 4 dims of all RC rows in registers. Teams share m, so at the
//          end their sums are added in team order.
// ROW_LISTS (push cell_stride > 0, with GATHER; prefill's per-query QSA selection): every token has
// its own list and params, so a workgroup serves one token's G rows (RC >= G; x = token t): its
// params at param_off + 2t (the token's own position p_t, n_kv), its list at cell_off + t*cell_stride,
// and it sees key j iff j <= p_t.
// Output: SPLIT (n_split > 1): the unnormalised partial (o_0..o_{DH-1}, m, l) of row (t, h) of split
// z at partial[((z*T + t)*H + h)*(DH + 2)], attn_combine.comp's layout, merged by
// attn_decode_combine.comp; else o/l (times sigma(gate) if GATED) to
// out[o_off + t*o_row + h*o_head + d]. A row with no visible key yields 0 (empty split: m = -1e30).
// Buffers: 0 params (int32), 1 q (f32: q_off + t*q_row + h*q_head + d), 2 gate (f32, same
// addressing with gate_*), 3 K cache, 4 V cache ([kv_rows, H_kv, DH] of the KV type, bound whole),
// 5 mask (uint bit rows), 6 cells (uint), 7 out (f32), 8 partial (f32). Unused buffers may be any
// buffer.
// Spec: 1 DH (multiple of 32, DH/4 divides WG), 2 RC rows per workgroup (a multiple of 4), 3 BC
// keys per tile (a multiple of WG/D), 4 D (power of two <= the smallest subgroup size, divides
// DH/8; P*RC a multiple of D with P = BC*D/WG). Push constant `flags`: 1 GATED, 2 MASKED,
// 4 GATHER, 8 SPLIT (runtime, not specialization: one pipeline per shape serves every mode).
// Defines: KV_F32 | KV_F16 | KV_Q8_0.
#extension GL_GOOGLE_include_directive : require
#extension GL_EXT_control_flow_attributes : require
#extension GL_KHR_shader_subgroup_shuffle : require
#include "common/base.glsl"

layout(constant_id = 1) const uint DH = 128;
layout(constant_id = 2) const uint RC = 16;
layout(constant_id = 3) const uint BC = 32;
layout(constant_id = 4) const uint D = 8;

#if defined(KV_Q8_0)
const uint RB = DH / 32u * 34u;  // bytes of one cache row (one kv head at one position)
#elif defined(KV_F16)
const uint RB = DH * 2u;
#elif defined(KV_F32)
const uint RB = DH * 4u;
#else
#error "define one of KV_F32, KV_F16, KV_Q8_0"
#endif
const uint WG = gl_WorkGroupSize.x;
const uint NVS = RB % 16u == 0u ? RB / 16u : RB / 16u + 2u;  // 16-byte vectors of a row's span
const uint NW = 4u * NVS;              // words of a row slot in shared memory
const uint U = (BC * NVS + WG - 1u) / WG;  // vectors each invocation loads per tile
const uint NCH = DH / 8u;              // 8-element chunks of a row
const uint PP = WG / D;                // keys scored at once by the workgroup
const uint P = BC / PP;                // keys per invocation in the score phase
const uint N = P * RC;                 // partial scores per invocation before the reduction
const uint TV = DH / 4u;               // invocations of a value team (4 dims each)
const uint NT = WG / TV;               // value teams

layout(std430, binding = 0) readonly buffer Params { int params[]; };
layout(std430, binding = 1) readonly buffer Q { float q[]; };
layout(std430, binding = 2) readonly buffer Gate { float gate[]; };
layout(std430, binding = 3) readonly buffer K4 { uvec4 k4[]; };
layout(std430, binding = 3) readonly buffer K1 { uint k1[]; };
layout(std430, binding = 4) readonly buffer V4 { uvec4 v4[]; };
layout(std430, binding = 4) readonly buffer V1 { uint v1[]; };
layout(std430, binding = 5) readonly buffer Mask { uint mask[]; };
layout(std430, binding = 6) readonly buffer Cells { uint cells[]; };
layout(std430, binding = 7) writeonly buffer Out { float outp[]; };
layout(std430, binding = 8) writeonly buffer Partial { float partial[]; };

layout(push_constant) uniform Push {
    uint T; uint G; uint H_kv; uint kv_rows;
    uint q_off; uint q_row; uint q_head;
    uint gate_off; uint gate_row; uint gate_head;
    uint o_off; uint o_row; uint o_head;
    uint param_off; uint mask_off; uint mask_stride; uint cell_off;
    uint n_split; float scale; uint flags; uint cell_stride;
} p;
const uint GATED = 1u, MASKED = 2u, GATHER = 4u, SPLIT = 8u;
bool has(uint f) { return (p.flags & f) != 0u; }

const float NEG = -1.0e30;  // score of a masked key (finite: no reliance on inf arithmetic)
const uint NONE = 0xFFFFFFFFu;

shared vec4 sQ[RC * DH / 4u];  // scaled q rows; at the end the teams' summed o rows
shared uvec4 sT[BC * NVS + 1u];  // raw K (then V) rows of the tile, one NVS-vector slot per key
shared vec4 sS[BC * RC / 4u];    // scores, then probabilities, [key][row]
shared float sM[RC];           // running max
shared float sL[RC];           // running sum
shared float sA[RC];           // this tile's rescale factor
shared uint sKey[BC];          // cache position of each key of the tile (NONE: no key)

uvec4 pf[U];  // this invocation's share of the rows being loaded
uint g_cell_off;  // the workgroup's list (ROW_LISTS: its token's)

// Cache position of iteration slot i.
uint key_of(uint i) { return has(GATHER) ? cells[g_cell_off + i] : i; }

// First byte of key j's row of kv head g.
uint row_start(uint j, uint g) { return (j * p.H_kv + g) * RB; }

// Issue the loads of the spans of keys i0 .. i0 + nv - 1 (kv head g) into pf; zeros elsewhere.
// The last vector of a row that does not end on a 16-byte boundary (q8_0) is read word by word,
// up to the row's last word, so no load passes the end of the buffer.
void fetch(bool is_v, uint i0, uint nv, uint g, uint tid) {
    [[unroll]] for (uint u = 0u; u < U; ++u) {
        const uint e = tid + u * WG, c = e / NVS, v = e % NVS;
        pf[u] = uvec4(0);
        if (e < BC * NVS && c < nv) {
            const uint j = key_of(i0 + c);
            if (j < p.kv_rows) {
                const uint s = row_start(j, g), vi = (s >> 4) + v, end = s + RB;
                if (RB % 16u != 0u && 16u * vi + 16u > end) {
                    if (16u * vi < end) {
                        const uint w0 = 4u * vi, w_end = (end + 3u) >> 2;
                        pf[u] = uvec4(is_v ? v1[w0] : k1[w0], 0u, 0u, 0u);
                        if (w0 + 1u < w_end) pf[u].y = is_v ? v1[w0 + 1u] : k1[w0 + 1u];
                        if (w0 + 2u < w_end) pf[u].z = is_v ? v1[w0 + 2u] : k1[w0 + 2u];
                        if (w0 + 3u < w_end) pf[u].w = is_v ? v1[w0 + 3u] : k1[w0 + 3u];
                    }
                } else {
                    pf[u] = is_v ? v4[vi] : k4[vi];
                }
            }
        }
    }
}

// Store pf into the row slots of sT (slot c holds vectors c*NVS ..).
void stash(uint tid) {
    [[unroll]] for (uint u = 0u; u < U; ++u) {
        const uint e = tid + u * WG;
        if (e < BC * NVS) sT[e] = pf[u];
    }
}

uint word(uint w) { return sT[w >> 2][w & 3u]; }  // word w of the tile
float score(uint i) { return sS[i >> 2][i & 3u]; }

#if defined(KV_Q8_0)
// Byte offset of the row within slot c (its span starts at the 16-byte boundary below the row).
uint slot_shift(uint c, uint g) { return RB % 16u == 0u || sKey[c] == NONE ? 0u : row_start(sKey[c], g) & 15u; }
// 4 bytes at an even byte offset of sT.
uint word_at(uint b) {
    const uint w = b >> 2;
    return (b & 2u) == 0u ? word(w) : (word(w) >> 16) | (word(w + 1u) << 16);
}
float scale_at(uint b) { return unpackHalf2x16(word(b >> 2) >> ((b & 2u) * 8u)).x; }
vec4 codes(uint x) {
    return vec4(bitfieldExtract(int(x), 0, 8), bitfieldExtract(int(x), 8, 8), bitfieldExtract(int(x), 16, 8),
                bitfieldExtract(int(x), 24, 8));
}
#endif

// Elements 8*ch .. 8*ch + 7 of the row in slot c, as two vec4 (values x = float(code) * float(d) for
// q8_0, as kv_cache.glsl's KV_LOAD).
void chunk8(uint c, uint ch, uint g, out vec4 a, out vec4 b) {
#if defined(KV_Q8_0)
    const uint blk = c * NW * 4u + slot_shift(c, g) + (ch >> 2) * 34u;
    const float d = scale_at(blk);
    const uint at = blk + 2u + 8u * (ch & 3u);
    a = codes(word_at(at)) * d;
    b = codes(word_at(at + 4u)) * d;
#elif defined(KV_F16)
    const uvec4 x = sT[c * NVS + ch];
    a = vec4(unpackHalf2x16(x.x), unpackHalf2x16(x.y));
    b = vec4(unpackHalf2x16(x.z), unpackHalf2x16(x.w));
#else
    a = uintBitsToFloat(sT[c * NVS + 2u * ch]);
    b = uintBitsToFloat(sT[c * NVS + 2u * ch + 1u]);
#endif
}

// Elements 4*jd .. 4*jd + 3 of the row in slot c.
vec4 quad(uint c, uint jd, uint g) {
#if defined(KV_Q8_0)
    const uint blk = c * NW * 4u + slot_shift(c, g) + (jd >> 3) * 34u;
    return codes(word_at(blk + 2u + 4u * (jd & 7u))) * scale_at(blk);
#elif defined(KV_F16)
    const uint w = c * NW + 2u * jd;
    return vec4(unpackHalf2x16(word(w)), unpackHalf2x16(word(w + 1u)));
#else
    return uintBitsToFloat(sT[c * NVS + jd]);
#endif
}

void main() {
    const uint tid = gl_LocalInvocationIndex;
    // score-phase lane order: the D lanes of a key are consecutive in one subgroup
    const uint lid = gl_SubgroupID * gl_SubgroupSize + gl_SubgroupInvocationID;
    const uint g = gl_WorkGroupID.y, z = gl_WorkGroupID.z;
    const uint G = p.G, H = p.G * p.H_kv, rows = p.T * p.G;
    const bool row_lists = p.cell_stride != 0u;
    const uint r0 = row_lists ? gl_WorkGroupID.x * G : gl_WorkGroupID.x * RC;
    const uint r_end = row_lists ? r0 + G : min(r0 + RC, rows);  // the workgroup's rows: r0 .. r_end - 1
    const uint param_off = row_lists ? p.param_off + 2u * gl_WorkGroupID.x : p.param_off;
    g_cell_off = row_lists ? p.cell_off + gl_WorkGroupID.x * p.cell_stride : p.cell_off;
    const uint p0 = uint(params[param_off]);
    const uint n_kv = uint(params[param_off + 1u]);
    const uint t_last = (r_end - 1u) / G;
    const uint n_iter = has(GATHER) ? n_kv : min(min(n_kv, p0 + t_last + 1u), p.kv_rows);
    const uint n_tiles = (n_iter + BC - 1u) / BC;

    for (uint e = tid; e < RC * DH; e += WG) {
        const uint r = e / DH, d = e % DH, R = r0 + r;
        float x = 0.0;
        if (R < r_end) x = q[p.q_off + (R / G) * p.q_row + (g * G + R % G) * p.q_head + d] * p.scale;
        sQ[e >> 2][e & 3u] = x;
    }
    if (tid < RC) {
        sM[tid] = NEG;
        sL[tid] = 0.0;
    }
    vec4 acc[RC];
    [[unroll]] for (uint r = 0u; r < RC; ++r) acc[r] = vec4(0.0);
    const uint team = tid / TV, jd = tid % TV;
    const uint dg = lid % D, cl = lid / D;

    if (z < n_tiles) fetch(false, z * BC, min(BC, n_iter - z * BC), g, tid);
    for (uint tile = z; tile < n_tiles; tile += p.n_split) {
        const uint i0 = tile * BC, nv = min(BC, n_iter - i0);
        barrier();  // the previous tile's values phase is done with sT, sS and sKey
        if (tid < BC) sKey[tid] = tid < nv ? key_of(i0 + tid) : NONE;
        stash(tid);
        barrier();
        fetch(true, i0, nv, g, tid);

        // scores: P keys x RC rows per lane over its chunks, then the reduce-scatter over D lanes
        float dots[N];
        [[unroll]] for (uint n = 0u; n < N; ++n) dots[n] = 0.0;
        [[dont_unroll]] for (uint m = 0u; m < NCH / D; ++m) {
            const uint ch = dg + D * m;
            vec4 ka[P], kb[P];
            [[unroll]] for (uint k = 0u; k < P; ++k) chunk8(cl + PP * k, ch, g, ka[k], kb[k]);
            [[unroll]] for (uint r = 0u; r < RC; ++r) {
                const vec4 qa = sQ[(r * DH >> 2) + 2u * ch], qb = sQ[(r * DH >> 2) + 2u * ch + 1u];
                [[unroll]] for (uint k = 0u; k < P; ++k) {
                    float s = dots[k * RC + r];
                    s += qa.x * ka[k].x; s += qa.y * ka[k].y; s += qa.z * ka[k].z; s += qa.w * ka[k].w;
                    s += qb.x * kb[k].x; s += qb.y * kb[k].y; s += qb.z * kb[k].z; s += qb.w * kb[k].w;
                    dots[k * RC + r] = s;
                }
            }
        }
        // halve the live values per level: the lane with bit m set keeps the upper half, adds its
        // partner's; at the end lane dg holds values dg*N/D .. of the N (index k*RC + r)
        [[unroll]] for (uint m = D >> 1, n = N; m > 0u; m >>= 1, n >>= 1) {
            const bool hi = (dg & m) != 0u;
            [[unroll]] for (uint i = 0u; i < n / 2u; ++i) {
                const float keep = hi ? dots[i + n / 2u] : dots[i];
                const float give = hi ? dots[i] : dots[i + n / 2u];
                dots[i] = keep + subgroupShuffleXor(give, m);
            }
        }
        [[unroll]] for (uint i = 0u; i < N / D; ++i) {
            const uint v = dg * (N / D) + i, k = v / RC, r = v % RC, c = cl + PP * k, R = r0 + r;
            const uint j = sKey[c], t = R / G;
            bool vis = R < r_end && j != NONE && j < p.kv_rows && j <= (row_lists ? p0 : p0 + t);
            if (has(MASKED) && vis) {
                const uint slot = i0 + c;
                vis = ((mask[p.mask_off + t * p.mask_stride + (slot >> 5)] >> (slot & 31u)) & 1u) != 0u;
            }
            sS[(c * RC + r) >> 2][r & 3u] = vis ? dots[i] : NEG;
        }
        barrier();  // scores complete, K rows no longer needed

        stash(tid);  // V rows
        for (uint r = gl_SubgroupID; r < RC; r += gl_NumSubgroups) {  // online softmax of row r
            float mx = NEG;
            for (uint c = gl_SubgroupInvocationID; c < BC; c += gl_SubgroupSize) mx = max(mx, score(c * RC + r));
            const float m_old = sM[r];
            mx = max(subgroupMax(mx), m_old);
            float alpha = 1.0, sum = 0.0;
            if (mx > NEG) {
                alpha = m_old > NEG ? exp(m_old - mx) : 0.0;
                for (uint c = gl_SubgroupInvocationID; c < BC; c += gl_SubgroupSize) {
                    const float s = score(c * RC + r);
                    const float pc = s > NEG ? exp(s - mx) : 0.0;
                    sS[(c * RC + r) >> 2][r & 3u] = pc;
                    sum += pc;
                }
                sum = subgroupAdd(sum);
            } else {
                for (uint c = gl_SubgroupInvocationID; c < BC; c += gl_SubgroupSize) sS[(c * RC + r) >> 2][r & 3u] = 0.0;
            }
            if (subgroupElect()) {
                sM[r] = mx;
                sL[r] = sL[r] * alpha + sum;
                sA[r] = alpha;
            }
        }
        barrier();

        if (tile + p.n_split < n_tiles) {
            const uint i1 = (tile + p.n_split) * BC;
            fetch(false, i1, min(BC, n_iter - i1), g, tid);
        }
        [[unroll]] for (uint r = 0u; r < RC; ++r) acc[r] *= sA[r];
        for (uint c = team; c < nv; c += NT) {
            const vec4 x = quad(c, jd, g);
            [[unroll]] for (uint r4 = 0u; r4 < RC / 4u; ++r4) {
                const vec4 pr = sS[c * (RC / 4u) + r4];
                acc[4u * r4] += pr.x * x;
                acc[4u * r4 + 1u] += pr.y * x;
                acc[4u * r4 + 2u] += pr.z * x;
                acc[4u * r4 + 3u] += pr.w * x;
            }
        }
    }

    // teams' sums into sQ (q is no longer needed), in team order
    barrier();
    for (uint tm = 0u; tm < NT; ++tm) {
        if (team == tm) {
            [[unroll]] for (uint r = 0u; r < RC; ++r) {
                const uint w = (r * DH >> 2) + jd;
                sQ[w] = tm == 0u ? acc[r] : sQ[w] + acc[r];
            }
        }
        barrier();
    }
    for (uint e = tid; e < RC * DH; e += WG) {
        const uint r = e / DH, d = e % DH, R = r0 + r;
        if (R >= r_end) continue;
        const uint t = R / G, h = g * G + R % G;
        const float o = sQ[e >> 2][e & 3u];
        if (has(SPLIT)) {
            const uint base = ((z * p.T + t) * H + h) * (DH + 2u);
            partial[base + d] = o;
            if (d == 0u) {
                partial[base + DH] = sM[r];
                partial[base + DH + 1u] = sL[r];
            }
        } else {
            const float l = sL[r];
            float y = l > 0.0 ? o / l : 0.0;
            if (has(GATED)) y *= sigmoid(gate[p.gate_off + t * p.gate_row + h * p.gate_head + d]);
            outp[p.o_off + t * p.o_row + h * p.o_head + d] = y;
        }
    }
}
