#version 450
// Flash attention over a KV cache (MODEL.md A5-A7, Q9, S1-S3), scalar f32, for prefill and decode
// alike: rows, key slots, query tiles, masks, tile skipping and buffers as in common/attn.glsl.
// Per key tile of BC slots: the K tile goes to shared memory and each invocation forms the scores
// s = (q*scale).k over DH of one key (c = tid % BC) for SPT rows, reading each k_d once; one
// invocation per row does the online softmax (running max m and sum l, rescale alpha =
// e^(m_old - m_new)); the V tile replaces K and each invocation accumulates o = sum_j e^(s_j - m) v_j
// for its (row, dim) elements: when DH divides the workgroup size or is a multiple of it (DIMS_ODD = 0),
// DPT dims (tid % DW + DW*i) of RPT rows (tid / DW + RSTEP*i), reading each v once per key; else
// elements tid + WG*k of the flattened BR x DH block. Output o / l (times sigma(gate) if GATED) at
// out[o_off + t*o_row + h*o_head + d], or with SPLIT the unnormalised partial (o_0..o_{DH-1}, m, l)
// of row (t, h) of split z at partial[((z*T + t)*H + h)*(DH + 2)] for attn_combine (t, h: the query's
// index in the ubatch and its q head). A row with no visible key yields 0.
// Spec: 0 WG, 1 DH, 2 BR, 3 BC (a divisor of 32), 4 FLAGS (1 GATED, 2 MASKED, 4 GATHER, 8 SPLIT).
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

const uint WG = gl_WorkGroupSize.x;

KV_BUFFER(3, kc, readonly)
KV_BUFFER(4, vc, readonly)
#include "common/attn.glsl"

const uint KS = DH + 1u;  // padded row stride of the K/V tile: score reads hit distinct banks
const uint SPT = (BR * BC + WG - 1u) / WG;  // scores per invocation (key tid % BC, rows tid / BC + i*WG/BC)
const uint DIMS_ODD = (WG % DH) * (DH % WG);  // 0: DH divides WG or is a multiple of it
const uint DW = DH < WG ? DH : WG, DPT = DH / DW, RSTEP = WG / DW;  // P*V ownership, see the header
const uint RPT = (BR + RSTEP - 1u) / RSTEP;
const uint NACC = (BR * DH + WG - 1u) / WG;  // accumulators per invocation (= RPT * DPT when DIMS_ODD = 0)

shared float sQ[BR * DH];   // scaled q rows
shared float sKV[BC * KS];  // the K tile, then the V tile
shared float sS[BR * BC];   // scores, then probabilities
shared float sM[BR];        // running max
shared float sL[BR];        // running sum
shared float sA[BR];        // this tile's rescale factor

// Row and dim of accumulator k of invocation tid (a row >= BR: none).
uint acc_row(uint tid, uint k) { return DIMS_ODD == 0u ? tid / DW + RSTEP * (k / DPT) : (tid + WG * k) / DH; }
uint acc_dim(uint tid, uint k) { return DIMS_ODD == 0u ? tid % DW + DW * (k % DPT) : (tid + WG * k) % DH; }

// The K (or V) tile of slots [i0, i0 + BC) into sKV; zeros past the range or the cache.
void load_tile(bool is_v, uint i0, uint tid) {
    for (uint e = tid; e < BC * DH; e += WG) {
        const uint c = e / DH, d = e % DH, i = i0 + c;
        float x = 0.0;
        if (i < aw.i_end) {
            const uint j = key_of(i);
            if (j < p.kv_rows) {
                const uint idx = (j * p.H_kv + aw.g) * DH + d;
                x = is_v ? KV_LOAD(vc, idx) : KV_LOAD(kc, idx);
            }
        }
        sKV[c * KS + d] = x;
    }
}

void main() {
    if (!attn_setup()) return;
    const uint tid = gl_LocalInvocationID.x;
    const uint G = p.G, H = p.G * p.H_kv, r0 = aw.r0;

    for (uint e = tid; e < BR * DH; e += WG) {
        const uint r = e / DH, d = e % DH, R = r0 + r;
        float x = 0.0;
        if (R < aw.rows) {
            const uint t = aw.t0 + R / G, h = aw.g * G + R % G;
            x = q[p.q_off + t * p.q_row + h * p.q_head + d] * p.scale;
        }
        sQ[e] = x;
    }
    if (tid < BR) {
        sM[tid] = NEG;
        sL[tid] = 0.0;
    }
    float acc[NACC];  // acc[k]: row acc_row(tid, k), dim acc_dim(tid, k)
    for (uint k = 0; k < NACC; ++k) acc[k] = 0.0;
    barrier();

    for (uint kt = next_tile(0u); kt < aw.n_kt; kt = next_tile(kt + 1u)) {
        const uint i0 = aw.i_begin + kt * BC;
        load_tile(false, i0, tid);
        barrier();
        {  // scores of key c for rows tid / BC + i*WG/BC
            const uint c = tid % BC;
            float dot[SPT];
            bool vis[SPT];
            bool any = false;
            for (uint i = 0; i < SPT; ++i) {
                const uint r = tid / BC + i * (WG / BC), R = r0 + r;
                vis[i] = r < BR && R < aw.rows && ((slot_bits(R / G, i0) >> c) & 1u) != 0u;
                if (GATHER && vis[i]) {
                    const uint j = key_of(i0 + c);
                    vis[i] = j <= aw.p0 + R / G && j < p.kv_rows;
                }
                any = any || vis[i];
                dot[i] = 0.0;
            }
            if (any) {
                [[dont_unroll]] for (uint d = 0; d < DH; ++d) {
                    const float k = sKV[c * KS + d];
                    for (uint i = 0; i < SPT; ++i) dot[i] += sQ[min(tid / BC + i * (WG / BC), BR - 1u) * DH + d] * k;
                }
            }
            for (uint i = 0; i < SPT; ++i) {
                const uint r = tid / BC + i * (WG / BC);
                if (r < BR) sS[r * BC + c] = vis[i] ? dot[i] : NEG;
            }
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
        load_tile(true, i0, tid);
        barrier();
        for (uint k = 0; k < NACC; ++k) {
            const uint r = acc_row(tid, k);
            if (r < BR) acc[k] *= sA[r];
        }
        if (DIMS_ODD == 0u) {
            [[dont_unroll]] for (uint c = 0; c < BC; ++c) {
                float v[DPT];
                for (uint k = 0; k < DPT; ++k) v[k] = sKV[c * KS + tid % DW + DW * k];
                for (uint i = 0; i < RPT; ++i) {
                    const uint r = tid / DW + RSTEP * i;
                    if (r < BR) {
                        const float pc = sS[r * BC + c];
                        for (uint k = 0; k < DPT; ++k) acc[i * DPT + k] += pc * v[k];
                    }
                }
            }
        } else {
            for (uint k = 0; k < NACC; ++k) {
                const uint r = acc_row(tid, k), d = acc_dim(tid, k);
                if (r < BR) {
                    float a = acc[k];
                    [[dont_unroll]] for (uint c = 0; c < BC; ++c) a += sS[r * BC + c] * sKV[c * KS + d];
                    acc[k] = a;
                }
            }
        }
        barrier();
    }

    for (uint k = 0; k < NACC; ++k) {
        const uint r = acc_row(tid, k), d = acc_dim(tid, k), R = r0 + r;
        if (r >= BR || R >= aw.rows) continue;
        const uint t = aw.t0 + R / G, h = aw.g * G + R % G;
        if (SPLIT) {
            const uint base = ((aw.split * p.T + t) * H + h) * (DH + 2u);
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
