#version 450
// Flash-attention prefill on cooperative matrices (MODEL.md A5-A7, Q9, S1-S3): the same rows, key
// slots, masks, query tiles, tile skipping, outputs and buffers as attn_flash.comp (common/attn.glsl),
// with S = Q*K^T and O += P*V as 16x16x16 f16 matrix products accumulated in f32 (common/coopmat.glsl).
// Inputs are rounded to f16 for the products: q*scale, the K and V tiles (decoded from the cache
// type), and the probabilities P; the running max m, the sums l and the rescaling are f32.
// A workgroup of WG invocations owns BR rows (RB = BR/16 row blocks) and walks the key tiles of BC
// slots. Workers w < NW (subgroups; NW = RB*PARTS) own row block w % RB and the d-range part w / RB
// (DQ = DH/16/PARTS blocks of 16 dims): they hold those blocks of Q (scaled, f16) and of the output
// accumulator O in registers for the whole walk. Per key tile:
//   1. the K tile (BC keys x DH, f16, row stride KS) is stored to shared memory from registers, and
//      the next non-skipped tile's K is fetched from global memory into those registers (prefetch);
//   2. worker (rb, part) forms its part's partial S for all BC keys -> sS copy `part` (f32);
//   3. the V tile goes to shared memory (next V fetched into registers); WG/BR invocations per row
//      add the parts, apply visibility (range, causality, mask bits: slot_bits, and for GATHER the
//      cell positions sJ), and do the online softmax: m' = max(m, max_c s), alpha = e^(m - m'),
//      P = f16(e^(s - m')) -> sP, l = alpha*l + sum of the rounded P, alpha -> sA;
//   4. workers scale O's rows by alpha and add P*V.
// The rows of the accumulator components are found once by loading the matrix (r*16 + c) of known
// values (the component layout is implementation-defined); so row scaling and the output stage work
// per component, from registers. Output: o = O/l (times sigma(gate) if GATED), or with SPLIT the
// partial (O, m, l) for attn_combine; a row with no visible key yields 0.
// Shared memory: sKV BC*KS f16 (the K or V tile; Q rows while loading Q), sS PARTS*BR*SS f32, sP
// BR*PS f16, sJ, sA, sL, sM, sWin.
// Spec: 0 WG, 1 DH (multiple of 16; of 32 for q8_0), 2 BR (16*RB), 3 BC (16 or 32), 4 FLAGS (1 GATED,
// 2 MASKED, 4 GATHER, 8 SPLIT), 5 NW (RB times PARTS, at most the number of subgroups; PARTS must
// divide DH/16). Defines: KV_F32 | KV_F16 | KV_Q8_0 (common/attn_kv.glsl); CM_EMULATE for the software
// matrices.
#extension GL_GOOGLE_include_directive : require
#extension GL_KHR_shader_subgroup_shuffle : require
#extension GL_EXT_control_flow_attributes : require
#include "common/base.glsl"

layout(constant_id = 1) const uint DH = 256;
layout(constant_id = 2) const uint BR = 64;
layout(constant_id = 3) const uint BC = 32;
layout(constant_id = 4) const uint FLAGS = 0;
layout(constant_id = 5) const uint NW = 8;
const bool GATED = (FLAGS & 1u) != 0u;
const bool MASKED = (FLAGS & 2u) != 0u;
const bool GATHER = (FLAGS & 4u) != 0u;
const bool SPLIT = (FLAGS & 8u) != 0u;
const uint WG = gl_WorkGroupSize.x;

#include "common/coopmat.glsl"
#include "common/attn.glsl"
#include "common/attn_kv.glsl"

const uint RB = BR / 16u, CB = BC / 16u, PARTS = NW / RB, DQ = DH / 16u / PARTS;
const uint KS = DH + 8u, KS4 = KS / 4u;  // K/V (and Q staging) row stride: f16, then f16vec4
const uint SS = BC + 4u;                 // S row stride (f32)
const uint PS = BC + 8u;                 // P row stride (f16)
const uint TPR = WG / BR;                // invocations per row in the softmax
const uint CPT = BC / TPR;               // columns per invocation in the softmax
const uint CPK = DH / 32u;               // 32-element chunks per key row
const uint NCH = (BC * CPK + WG - 1u) / WG;  // chunks each invocation fetches per tile

shared f16vec4 sKV[BC * KS4];
shared float sS[PARTS * BR * SS];
shared float16_t sP[BR * PS];
shared uint sJ[BC];
shared float sA[BR];
shared float sL[BR];
shared float sM[BR];

uvec4 regK[NCH * 4u];  // the next K tile's chunks, f16, fetched ahead
uvec4 regV[NCH * 4u];

// Eight packed f16 as two f16vec4 at sKV[at], sKV[at + 1] (bits unchanged).
void put8(uint at, uvec4 x) {
    sKV[at] = f16vec4(unpackFloat2x16(x.x), unpackFloat2x16(x.y));
    sKV[at + 1u] = f16vec4(unpackFloat2x16(x.z), unpackFloat2x16(x.w));
}

// Key tile q's K (or V) chunks into regK (regV); zeros for slots past the range or the cache.
void fetch(bool is_v, uint q) {
    const uint i0 = aw.i_begin + q * BC;
    for (uint n = 0u; n < NCH; ++n) {
        const uint e = gl_LocalInvocationID.x + n * WG;  // chunk: key c = e / CPK, dims 32*(e % CPK)
        uvec4 x[4] = uvec4[4](uvec4(0u), uvec4(0u), uvec4(0u), uvec4(0u));
        if (e < BC * CPK && i0 + e / CPK < aw.i_end) {
            const uint j = key_of(i0 + e / CPK);
            if (j < p.kv_rows) load_chunk(is_v, (j * p.H_kv + aw.g) * DH + 32u * (e % CPK), x);
        }
        for (uint w = 0u; w < 4u; ++w) {
            if (is_v) regV[4u * n + w] = x[w]; else regK[4u * n + w] = x[w];
        }
    }
}

// The fetched K (or V) tile into sKV.
void store_tile(bool is_v) {
    for (uint n = 0u; n < NCH; ++n) {
        const uint e = gl_LocalInvocationID.x + n * WG;
        if (e >= BC * CPK) continue;
        const uint at = (e / CPK) * KS4 + 8u * (e % CPK);
        for (uint w = 0u; w < 4u; ++w) put8(at + 2u * w, is_v ? regV[4u * n + w] : regK[4u * n + w]);
    }
}

void main() {
    if (!attn_setup()) return;
    const uint tid = gl_LocalInvocationID.x, sg = gl_SubgroupID;
    const bool worker = sg < NW;
    const uint rb = sg % RB, part = sg / RB;
    const uint G = p.G, H = p.G * p.H_kv;

    // Row (r*16 + c) of each accumulator component: load a matrix holding exactly those values.
    for (uint e = tid; e < 256u; e += WG) sS[e] = float(e);
    barrier();
    CM_ACC idx;
    if (worker) { CM_LOAD_F(idx, sS, 0u, 16u) }
    barrier();

    // Q rows, scaled and rounded to f16, staged through sKV BC rows at a time into the workers'
    // registers (row block rb, dims of their part).
    CM_A qf[DQ];
    for (uint s0 = 0u; s0 < BR; s0 += BC) {
        for (uint e = tid; e < BC * DH / 8u; e += WG) {
            const uint rr = e / (DH / 8u), d8 = e % (DH / 8u), R = aw.r0 + s0 + rr;
            uvec4 x = uvec4(0u);
            if (R < aw.rows) {
                const uint t = aw.t0 + R / G, h = aw.g * G + R % G;
                const uint at = p.q_off + t * p.q_row + h * p.q_head + 8u * d8;
                for (uint w = 0u; w < 4u; ++w) x[w] = pack2(q[at + 2u * w] * p.scale, q[at + 2u * w + 1u] * p.scale);
            }
            put8(rr * KS4 + 2u * d8, x);
        }
        barrier();
        if (worker && rb * 16u >= s0 && rb * 16u < s0 + BC) {
            CM_LOOP for (uint dq = 0u; dq < DQ; ++dq) {
                CM_LOAD_H4(qf[dq], sKV, (rb * 16u - s0) * KS4 + 4u * (part * DQ + dq), KS4, CM_ROW)
            }
        }
        barrier();
    }

    CM_ACC of[DQ];
    CM_LOOP for (uint f = 0u; f < DQ; ++f) { CM_ZERO(of[f]) }
    // softmax ownership: row r, columns sub + TPR*c; running max / sum kept by the row's invocations,
    // numbered by subgroup so that a row's TPR invocations are neighbours in one subgroup
    const uint lin = sg * gl_SubgroupSize + gl_SubgroupInvocationID;
    const uint r = lin / TPR, sub = lin % TPR, R = aw.r0 + r, tl = R / G;
    const bool row_ok = R < aw.rows;
    float m_run = NEG, l_run = 0.0;

    uint kt = next_tile(0u);
    if (kt < aw.n_kt) {
        fetch(false, kt);
        fetch(true, kt);
    }
    while (kt < aw.n_kt) {
        const uint i0 = aw.i_begin + kt * BC;
        barrier();  // the previous tile's P*V is done with sKV, sP and sA
        store_tile(false);
        if (GATHER && tid < BC) sJ[tid] = i0 + tid < aw.i_end ? cells[aw.cell_off + i0 + tid] : 0xFFFFFFFFu;
        const uint kn = next_tile(kt + 1u);
        if (kn < aw.n_kt) fetch(false, kn);
        barrier();

        if (worker) {  // partial S of this part's dims
            CM_ACC s[CB];
            CM_LOOP for (uint cb = 0u; cb < CB; ++cb) { CM_ZERO(s[cb]) }
            CM_LOOP for (uint dq = 0u; dq < DQ; ++dq) {
                CM_LOOP for (uint cb = 0u; cb < CB; ++cb) {
                    CM_B kt_;  // K^T block: column c = key cb*16 + c, rows = 16 dims
                    CM_LOAD_H4(kt_, sKV, cb * 16u * KS4 + 4u * (part * DQ + dq), KS4, CM_COL)
                    CM_MULADD(s[cb], qf[dq], kt_)
                }
            }
            CM_LOOP for (uint cb = 0u; cb < CB; ++cb) { CM_STORE_F(s[cb], sS, (part * BR + rb * 16u) * SS + cb * 16u, SS) }
        }
        barrier();

        store_tile(true);
        if (kn < aw.n_kt) fetch(true, kn);
        {  // online softmax of row r over this tile
            const uint bits = row_ok ? slot_bits(tl, i0) : 0u;
            float sv[CPT];
            float mx = NEG;
            for (uint c = 0u; c < CPT; ++c) {
                const uint col = sub + TPR * c;
                bool vis = ((bits >> col) & 1u) != 0u;
                if (GATHER) vis = vis && sJ[col] <= aw.p0 + tl && sJ[col] < p.kv_rows;
                float s = NEG;
                if (vis) {
                    s = 0.0;
                    for (uint pt = 0u; pt < PARTS; ++pt) s += sS[(pt * BR + r) * SS + col];
                }
                sv[c] = s;
                mx = max(mx, s);
            }
            for (uint o = TPR / 2u; o > 0u; o >>= 1) mx = max(mx, subgroupShuffleXor(mx, o));
            const float m_new = max(m_run, mx);
            float psum = 0.0;
            for (uint c = 0u; c < CPT; ++c) {
                const float16_t ph = float16_t(sv[c] > NEG ? exp(sv[c] - m_new) : 0.0);
                psum += float(ph);
                sP[r * PS + sub + TPR * c] = ph;
            }
            for (uint o = TPR / 2u; o > 0u; o >>= 1) psum += subgroupShuffleXor(psum, o);
            const float alpha = m_new > NEG ? exp(m_run - m_new) : 1.0;
            l_run = l_run * alpha + psum;
            m_run = m_new;
            if (sub == 0u) sA[r] = alpha;
        }
        barrier();

        if (worker) {  // O = diag(alpha) O + P V for this worker's rows and dims
            for (int i = 0; i < CM_LEN(idx); ++i) {
                const float a = sA[rb * 16u + (uint(CM_EL(idx, i)) >> 4)];
                CM_LOOP for (uint f = 0u; f < DQ; ++f) CM_EL(of[f], i) *= a;
            }
            CM_A pa[CB];
            CM_LOOP for (uint cb = 0u; cb < CB; ++cb) { CM_LOAD_H(pa[cb], sP, rb * 16u * PS + cb * 16u, PS) }
            CM_LOOP for (uint f = 0u; f < DQ; ++f) {
                CM_LOOP for (uint cb = 0u; cb < CB; ++cb) {
                    CM_B v_;  // rows = 16 keys, columns = 16 dims
                    CM_LOAD_H4(v_, sKV, cb * 16u * KS4 + 4u * (part * DQ + f), KS4, CM_ROW)
                    CM_MULADD(of[f], pa[cb], v_)
                }
            }
        }
        kt = kn;
    }

    if (sub == 0u) {
        sL[r] = l_run;
        sM[r] = m_run;
    }
    barrier();
    if (!worker) return;
    for (int i = 0; i < CM_LEN(idx); ++i) {
        const uint e = uint(CM_EL(idx, i)), row = rb * 16u + (e >> 4), Rw = aw.r0 + row;
        if (Rw >= aw.rows) continue;
        const uint t = aw.t0 + Rw / G, h = aw.g * G + Rw % G;
        const float l = sL[row];
        CM_LOOP for (uint f = 0u; f < DQ; ++f) {
            const uint d = (part * DQ + f) * 16u + (e & 15u);
            const float acc = CM_EL(of[f], i);
            if (SPLIT) {
                const uint base = ((aw.split * p.T + t) * H + h) * (DH + 2u);
                partial[base + d] = acc;
                if (d == 0u) {
                    partial[base + DH] = sM[row];
                    partial[base + DH + 1u] = l;
                }
            } else {
                float o = l > 0.0 ? acc / l : 0.0;
                if (GATED) o *= sigmoid(gate[p.gate_off + t * p.gate_row + h * p.gate_head + d]);
                outp[p.o_off + t * p.o_row + h * p.o_head + d] = o;
            }
        }
    }
}
