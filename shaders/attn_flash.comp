#version 450
// Flash attention over a KV cache (MODEL.md A5-A7, Q9, S3), for prefill and decode alike.
// Rows are the (token t, head h) pairs of one kv head g, flattened R = t*G + (h - g*G) with
// G = H/H_kv (GQA: q head h reads kv head floor(h/G)), so each K/V tile loaded into shared
// memory serves every q head of its group. Workgroup (x, y, z) = (tile of BR rows, g, split).
// Query t sits at position p0 + t; it sees key j iff j <= p0 + t (causal), j < kv_rows, and,
// when MASKED, bit i of its mask row (i = iteration index: the position, or the list slot when
// GATHER). Scores s = (q.k)*scale; softmax in f32 with a running max m and sum l per row
// (online rescaling by alpha = e^(m_old - m_new)); o = sum_j e^(s_j - m) v_j / l.
// The iteration space i in [0, n_iter) is the cache positions (dense; n_iter = min(n_kv,
// p0 + t_last + 1)) or slots of the cell list (GATHER: key j = cells[cell_off + i]); split z
// covers the z-th of n_split equal chunks of it, so no length is baked in anywhere: p0 = params
// [param_off], n_kv = params[param_off + 1] are read per replay (n_kv = list length for GATHER).
// SPLIT: write the unnormalised partial (o_0..o_{DH-1}, m, l) of row (t, h) of split z at
// partial[((z*T + t)*H + h)*(DH + 2)] for attn_combine; else write o (times sigma(gate) if GATED)
// to out[o_off + t*o_row + h*o_head + d]. A row with no visible key yields 0.
// Buffers: 0 params (int32), 1 q (f32: q_off + t*q_row + h*q_head + d), 2 gate (f32, same
// addressing with gate_*), 3 K cache, 4 V cache ([kv_rows, H_kv, DH] of the KV type), 5 mask
// (uint bit rows), 6 cells (uint), 7 out (unused with SPLIT), 8 partial (SPLIT only). Unused
// buffers may be any buffer.
// Spec: 1 DH, 2 BR, 3 BC, 4 FLAGS (1 GATED, 2 MASKED, 4 GATHER, 8 SPLIT).
#extension GL_GOOGLE_include_directive : require
#extension GL_EXT_control_flow_attributes : require
#include "common/base.glsl"
#include "common/kv_cache.glsl"

layout(constant_id = 1) const uint DH = 128;
layout(constant_id = 2) const uint BR = 16;
layout(constant_id = 3) const uint BC = 32;
layout(constant_id = 4) const uint FLAGS = 0;
const bool GATED = (FLAGS & 1u) != 0u;
const bool MASKED = (FLAGS & 2u) != 0u;
const bool GATHER = (FLAGS & 4u) != 0u;
const bool SPLIT = (FLAGS & 8u) != 0u;

layout(std430, binding = 0) readonly buffer Params { int params[]; };
layout(std430, binding = 1) readonly buffer Q { float q[]; };
layout(std430, binding = 2) readonly buffer Gate { float gate[]; };
KV_BUFFER(3, kc, readonly)
KV_BUFFER(4, vc, readonly)
layout(std430, binding = 5) readonly buffer Mask { uint mask[]; };
layout(std430, binding = 6) readonly buffer Cells { uint cells[]; };
layout(std430, binding = 7) writeonly buffer Out { float outp[]; };
layout(std430, binding = 8) writeonly buffer Partial { float partial[]; };

layout(push_constant) uniform P {
    uint T; uint G; uint H_kv; uint kv_rows;
    uint q_off; uint q_row; uint q_head;
    uint gate_off; uint gate_row; uint gate_head;
    uint o_off; uint o_row; uint o_head;
    uint param_off; uint mask_off; uint mask_stride; uint cell_off;
    uint n_split; float scale;
} p;

const float NEG = -1.0e30;  // score of a masked key (finite: no reliance on inf arithmetic)
const uint WG = gl_WorkGroupSize.x;
const uint KS = DH + 1u;  // padded row stride of the K/V tile: score reads hit distinct banks
const uint NACC = (BR * DH + WG - 1u) / WG;

shared float sQ[BR * DH];   // scaled q rows
shared float sKV[BC * KS];  // the K tile, then the V tile
shared float sS[BR * BC];   // scores, then probabilities
shared float sM[BR];        // running max
shared float sL[BR];        // running sum
shared float sA[BR];        // this tile's rescale factor

// Cache position of iteration slot i.
uint key_of(uint i) { return GATHER ? cells[p.cell_off + i] : i; }

void load_tile(bool is_v, uint i0, uint i_end, uint g, uint tid) {
    for (uint e = tid; e < BC * DH; e += WG) {
        const uint c = e / DH, d = e % DH, i = i0 + c;
        float x = 0.0;
        if (i < i_end) {
            const uint j = key_of(i);
            if (j < p.kv_rows) {
                const uint idx = (j * p.H_kv + g) * DH + d;
                x = is_v ? KV_LOAD(vc, idx) : KV_LOAD(kc, idx);
            }
        }
        sKV[c * KS + d] = x;
    }
}

void main() {
    const uint tid = gl_LocalInvocationID.x;
    const uint g = gl_WorkGroupID.y, split = gl_WorkGroupID.z;
    const uint G = p.G, H = p.G * p.H_kv, rows = p.T * p.G;
    const uint r0 = gl_WorkGroupID.x * BR;
    const uint p0 = uint(params[p.param_off]);
    const uint n_kv = uint(params[p.param_off + 1u]);

    const uint t_last = (min(r0 + BR, rows) - 1u) / G;
    const uint n_iter = GATHER ? n_kv : min(min(n_kv, p0 + t_last + 1u), p.kv_rows);
    const uint chunk = (n_iter + p.n_split - 1u) / p.n_split;
    const uint i_begin = min(split * chunk, n_iter);
    const uint i_end = min(i_begin + chunk, n_iter);

    for (uint e = tid; e < BR * DH; e += WG) {
        const uint r = e / DH, d = e % DH, R = r0 + r;
        float x = 0.0;
        if (R < rows) {
            const uint t = R / G, h = g * G + R % G;
            x = q[p.q_off + t * p.q_row + h * p.q_head + d] * p.scale;
        }
        sQ[e] = x;
    }
    if (tid < BR) {
        sM[tid] = NEG;
        sL[tid] = 0.0;
    }
    float acc[NACC];
    for (uint k = 0; k < NACC; ++k) acc[k] = 0.0;
    barrier();

    for (uint i0 = i_begin; i0 < i_end; i0 += BC) {
        load_tile(false, i0, i_end, g, tid);
        barrier();
        for (uint e = tid; e < BR * BC; e += WG) {
            const uint r = e / BC, c = e % BC, R = r0 + r, i = i0 + c;
            float s = NEG;
            if (R < rows && i < i_end) {
                const uint t = R / G, j = key_of(i);
                bool vis = j <= p0 + t && j < p.kv_rows;
                if (MASKED) vis = vis && ((mask[p.mask_off + t * p.mask_stride + (i >> 5)] >> (i & 31u)) & 1u) != 0u;
                if (vis) {
                    float dot = 0.0;
                    [[dont_unroll]] for (uint d = 0; d < DH; ++d) dot += sQ[r * DH + d] * sKV[c * KS + d];
                    s = dot;
                }
            }
            sS[e] = s;
        }
        barrier();
        if (tid < BR) {  // online softmax of row tid over this tile
            const float m_old = sM[tid];
            float mx = m_old;
            [[dont_unroll]] for (uint c = 0; c < BC; ++c) mx = max(mx, sS[tid * BC + c]);
            float alpha = 1.0, sum = 0.0;
            if (mx > NEG) {
                alpha = m_old > NEG ? exp(m_old - mx) : 0.0;
                [[dont_unroll]] for (uint c = 0; c < BC; ++c) {
                    const float s = sS[tid * BC + c];
                    const float pc = s > NEG ? exp(s - mx) : 0.0;
                    sS[tid * BC + c] = pc;
                    sum += pc;
                }
                sM[tid] = mx;
                sL[tid] = sL[tid] * alpha + sum;
            } else {
                [[dont_unroll]] for (uint c = 0; c < BC; ++c) sS[tid * BC + c] = 0.0;
            }
            sA[tid] = alpha;
        }
        load_tile(true, i0, i_end, g, tid);
        barrier();
        for (uint k = 0; k < NACC; ++k) {
            const uint e = tid + k * WG;
            if (e < BR * DH) {
                const uint r = e / DH, d = e % DH;
                float a = acc[k] * sA[r];
                [[dont_unroll]] for (uint c = 0; c < BC; ++c) a += sS[r * BC + c] * sKV[c * KS + d];
                acc[k] = a;
            }
        }
        barrier();
    }

    for (uint k = 0; k < NACC; ++k) {
        const uint e = tid + k * WG;
        if (e >= BR * DH) continue;
        const uint r = e / DH, d = e % DH, R = r0 + r;
        if (R >= rows) continue;
        const uint t = R / G, h = g * G + R % G;
        if (SPLIT) {
            const uint base = ((split * p.T + t) * H + h) * (DH + 2u);
            partial[base + d] = acc[k];
            if (d == 0u) {
                partial[base + DH] = sM[r];
                partial[base + DH + 1u] = sL[r];
            }
        } else {
            const float l = sL[r];
            float o = l > 0.0 ? acc[k] / l : 0.0;
            if (GATED) o *= sigmoid(gate[p.gate_off + t * p.gate_row + h * p.gate_head + d]);
            outp[p.o_off + t * p.o_row + h * p.o_head + d] = o;
        }
    }
}
