#version 450
// Flash-attention prefill on cooperative matrices with subgroup-owned rows (FA2 style; MODEL.md A5-A7,
// Q9, S1-S3): the same rows, key slots, masks, query tiles, tile skipping, outputs and buffers as
// attn_flash.comp and attn_flash_cm.comp (common/attn.glsl), and the same rounding as
// attn_flash_cm.comp: q*scale, the K and V tiles and the probabilities P are f16 for the 16x16x16
// products (common/coopmat.glsl), accumulated in f32; the running max m, the sums l and the
// rescaling are f32.
// A workgroup owns BR rows; worker subgroup w < BR/16 owns rows [16w, 16w + 16) over the whole head
// dim: it holds those rows of Q (scaled, f16: DH/16 A blocks) and of the output accumulator O (DH/16
// f32 blocks) in registers for the whole walk, so S = Q*K^T of its rows is complete in its own
// accumulators and nothing is summed or synchronized across subgroups but the K/V tiles. Per key
// tile of BC slots:
//   1. (workgroup) the K and V tiles (BC keys x DH, f16, row stride KS) go to shared memory from
//      registers; with PREFETCH the next non-skipped tile's K and V are fetched into those registers
//      now (in flight during the tile's math), else this tile's are fetched just before; barrier;
//   2. (each worker; subgroup barriers only, which every subgroup passes) S = Q*K^T -> its 16 rows of
//      sS (f32); its lanes, TPR per row, apply visibility (range, causality, mask bits: slot_bits,
//      and for GATHER the cell positions sJ) and the online softmax: m' = max(m, max_c s), alpha = e^(m - m'),
//      P = f16(e^(s - m')) -> sP, l = alpha*l + sum of the rounded P, with m, l, alpha in sM, sL, sA;
//      then O's rows are scaled by alpha (skipped when every alpha of the subgroup is 1) and O += P*V;
//   3. barrier before the next tile overwrites sK, sV.
// The rows of the accumulator components are found once by loading the matrix (r*16 + c) of known
// values (the component layout is implementation-defined), so row scaling and the output stage work
// per component, from registers. Output: o = O/l (times sigma(gate) if GATED), or with SPLIT the
// partial (O, m, l) for attn_combine; a row with no visible key yields 0.
// Shared memory: sK, sV BC*KS f16 each (sK also stages Q rows), sS BR*SS f32, sP BR*PS f16, sJ, sA,
// sL, sM, sWin.
// Spec: 0 WG (at least BR/16 subgroups of any size the device may use, a power of two), 1 DH
// (multiple of 16; of 32 for q8_0), 2 BR (16 * worker subgroups), 3 BC (16 or 32), 4 FLAGS (1 GATED,
// 2 MASKED, 4 GATHER, 8 SPLIT), 5 PREFETCH. Defines: KV_F32 | KV_F16 | KV_Q8_0
// (common/attn_kv.glsl); CM_EMULATE for the software matrices.
#extension GL_GOOGLE_include_directive : require
#extension GL_KHR_shader_subgroup_shuffle : require
#extension GL_KHR_shader_subgroup_vote : require
#extension GL_EXT_control_flow_attributes : require
#include "common/base.glsl"

layout(constant_id = 1) const uint DH = 256;
layout(constant_id = 2) const uint BR = 64;
layout(constant_id = 3) const uint BC = 32;
layout(constant_id = 4) const uint FLAGS = 0;
layout(constant_id = 5) const bool PREFETCH = false;
const bool GATED = (FLAGS & 1u) != 0u;
const bool MASKED = (FLAGS & 2u) != 0u;
const bool GATHER = (FLAGS & 4u) != 0u;
const bool SPLIT = (FLAGS & 8u) != 0u;
const uint WG = gl_WorkGroupSize.x;

#include "common/coopmat.glsl"
#include "common/attn.glsl"
#include "common/attn_kv.glsl"

const uint NSG = BR / 16u, CB = BC / 16u, DB = DH / 16u;
const uint KS = DH + 8u, KS4 = KS / 4u;  // K/V (and Q staging) row stride: f16, then f16vec4
const uint SS = BC + 4u;                 // S row stride (f32)
const uint PS = BC + 8u;                 // P row stride (f16)
const uint CPK = DH / 32u;               // 32-element chunks per key row
const uint NCH = (BC * CPK + WG - 1u) / WG;  // chunks each invocation loads per tile

shared f16vec4 sK[BC * KS4];
shared f16vec4 sV[BC * KS4];
shared float sS[BR * SS];
shared float16_t sP[BR * PS];
shared uint sJ[BC];
shared float sA[BR];
shared float sL[BR];
shared float sM[BR];

// Eight packed f16 as two f16vec4 at sK[at], sK[at + 1] (or sV's; bits unchanged).
void put8(bool is_v, uint at, uvec4 x) {
    const f16vec4 a = f16vec4(unpackFloat2x16(x.x), unpackFloat2x16(x.y));
    const f16vec4 b = f16vec4(unpackFloat2x16(x.z), unpackFloat2x16(x.w));
    if (is_v) {
        sV[at] = a;
        sV[at + 1u] = b;
    } else {
        sK[at] = a;
        sK[at + 1u] = b;
    }
}

uvec4 rK[NCH * 4u];  // a key tile's K and V chunks, f16 (with PREFETCH: the next tile's, fetched ahead)
uvec4 rV[NCH * 4u];

// Key tile q's K and V chunks into rK, rV; zeros for slots past the range or the cache.
void fetch_tile(uint q) {
    const uint i0 = aw.i_begin + q * BC;
    for (uint n = 0u; n < NCH; ++n) {
        const uint e = gl_LocalInvocationID.x + n * WG;  // chunk: key c = e / CPK, dims 32*(e % CPK)
        uvec4 xk[4] = uvec4[4](uvec4(0u), uvec4(0u), uvec4(0u), uvec4(0u));
        uvec4 xv[4] = xk;
        if (e < BC * CPK && i0 + e / CPK < aw.i_end) {
            const uint j = key_of(i0 + e / CPK);
            if (j < p.kv_rows) {
                const uint el = (j * p.H_kv + aw.g) * DH + 32u * (e % CPK);
                load_chunk(false, el, xk);
                load_chunk(true, el, xv);
            }
        }
        for (uint w = 0u; w < 4u; ++w) {
            rK[4u * n + w] = xk[w];
            rV[4u * n + w] = xv[w];
        }
    }
}

// The fetched K and V chunks into sK, sV.
void store_tile() {
    for (uint n = 0u; n < NCH; ++n) {
        const uint e = gl_LocalInvocationID.x + n * WG;
        if (e >= BC * CPK) continue;
        const uint at = (e / CPK) * KS4 + 8u * (e % CPK);
        for (uint w = 0u; w < 4u; ++w) {
            put8(false, at + 2u * w, rK[4u * n + w]);
            put8(true, at + 2u * w, rV[4u * n + w]);
        }
    }
}

void main() {
    if (!attn_setup()) return;
    const uint tid = gl_LocalInvocationID.x, sg = gl_SubgroupID, lane = gl_SubgroupInvocationID;
    const bool worker = sg < NSG;
    const uint G = p.G, H = p.G * p.H_kv;
    // softmax lanes: TPR per row, 16/RSTEP rows each (TPR = 2, one row each for subgroups of 32)
    const uint TPR = max(gl_SubgroupSize / 16u, 1u), RSTEP = gl_SubgroupSize / TPR, sub = lane % TPR;

    // Row (r*16 + c) of each accumulator component: load a matrix holding exactly those values.
    for (uint e = tid; e < 256u; e += WG) sS[e] = float(e);
    for (uint r = tid; r < BR; r += WG) {
        sM[r] = NEG;
        sL[r] = 0.0;
    }
    barrier();
    CM_ACC idx;
    if (worker) { CM_LOAD_F(idx, sS, 0u, 16u) }
    barrier();

    // Q rows, scaled and rounded to f16, staged through sK BC rows at a time into the workers'
    // registers (their 16 rows, every dim).
    CM_A qf[DB];
    for (uint s0 = 0u; s0 < BR; s0 += BC) {
        for (uint e = tid; e < BC * DH / 8u; e += WG) {
            const uint rr = e / (DH / 8u), d8 = e % (DH / 8u), R = aw.r0 + s0 + rr;
            uvec4 x = uvec4(0u);
            if (R < aw.rows) {
                const uint t = aw.t0 + R / G, h = aw.g * G + R % G;
                const uint at = p.q_off + t * p.q_row + h * p.q_head + 8u * d8;
                for (uint w = 0u; w < 4u; ++w) x[w] = pack2(q[at + 2u * w] * p.scale, q[at + 2u * w + 1u] * p.scale);
            }
            put8(false, rr * KS4 + 2u * d8, x);
        }
        barrier();
        if (worker && sg * 16u >= s0 && sg * 16u < s0 + BC) {
            CM_LOOP for (uint d = 0u; d < DB; ++d) { CM_LOAD_H4(qf[d], sK, (sg * 16u - s0) * KS4 + 4u * d, KS4, CM_ROW) }
        }
        barrier();
    }

    CM_ACC of[DB];
    CM_LOOP for (uint f = 0u; f < DB; ++f) { CM_ZERO(of[f]) }
    const uint r_base = sg * 16u;

    uint kt = next_tile(0u);
    if (PREFETCH && kt < aw.n_kt) fetch_tile(kt);
    while (kt < aw.n_kt) {
        const uint i0 = aw.i_begin + kt * BC;
        if (!PREFETCH) fetch_tile(kt);
        store_tile();
        if (GATHER && tid < BC) sJ[tid] = i0 + tid < aw.i_end ? cells[aw.cell_off + i0 + tid] : 0xFFFFFFFFu;
        const uint kn = next_tile(kt + 1u);
        if (PREFETCH && kn < aw.n_kt) fetch_tile(kn);  // in flight while this tile is worked on
        barrier();

        if (worker) {
            CM_ACC s[CB];
            CM_LOOP for (uint cb = 0u; cb < CB; ++cb) { CM_ZERO(s[cb]) }
            CM_LOOP for (uint d = 0u; d < DB; ++d) {
                CM_LOOP for (uint cb = 0u; cb < CB; ++cb) {
                    CM_B kt_;  // K^T block: column c = key cb*16 + c, rows = 16 dims
                    CM_LOAD_H4(kt_, sK, cb * 16u * KS4 + 4u * d, KS4, CM_COL)
                    CM_MULADD(s[cb], qf[d], kt_)
                }
            }
            CM_LOOP for (uint cb = 0u; cb < CB; ++cb) { CM_STORE_F(s[cb], sS, r_base * SS + cb * 16u, SS) }
        }
        // (every subgroup passes the subgroup barriers, workers or not: llvmpipe runs them as
        // workgroup barriers, which must be met in uniform control flow)
        subgroupMemoryBarrierShared();
        subgroupBarrier();

        bool unit = true;  // every alpha this lane set is 1
        if (worker) {
            for (uint r = lane / TPR; r < 16u; r += RSTEP) {  // online softmax of row r_base + r
                const uint row = r_base + r, R = aw.r0 + row, tl = R / G;
                uint bits = R < aw.rows ? slot_bits(tl, i0) : 0u;
                if (GATHER) {
                    for (uint c = sub; c < BC; c += TPR) {
                        if (!(sJ[c] <= aw.p0 + tl && sJ[c] < p.kv_rows)) bits &= ~(1u << c);
                    }
                }
                float mx = NEG;
                for (uint c = sub; c < BC; c += TPR) {
                    if (((bits >> c) & 1u) != 0u) mx = max(mx, sS[row * SS + c]);
                }
                for (uint o = TPR / 2u; o > 0u; o >>= 1) mx = max(mx, subgroupShuffleXor(mx, o));
                // (every lane of the row has read sM[row] before its psum reaches the write below)
                const float m_old = sM[row], m_new = max(m_old, mx);
                float psum = 0.0;
                for (uint c = sub; c < BC; c += TPR) {
                    const float16_t ph = float16_t(((bits >> c) & 1u) != 0u ? exp(sS[row * SS + c] - m_new) : 0.0);
                    psum += float(ph);
                    sP[row * PS + c] = ph;
                }
                for (uint o = TPR / 2u; o > 0u; o >>= 1) psum += subgroupShuffleXor(psum, o);
                const float alpha = m_new > NEG ? exp(m_old - m_new) : 1.0;
                unit = unit && alpha == 1.0;
                if (sub == 0u) {
                    sA[row] = alpha;
                    sM[row] = m_new;
                    sL[row] = sL[row] * alpha + psum;
                }
            }
        }
        subgroupMemoryBarrierShared();
        subgroupBarrier();

        if (worker) {
            if (!subgroupAll(unit)) {  // O = diag(alpha) O
                for (int i = 0; i < CM_LEN(idx); ++i) {
                    const float a = sA[r_base + (uint(CM_EL(idx, i)) >> 4)];
                    CM_LOOP for (uint f = 0u; f < DB; ++f) CM_EL(of[f], i) *= a;
                }
            }
            CM_A pa[CB];
            CM_LOOP for (uint cb = 0u; cb < CB; ++cb) { CM_LOAD_H(pa[cb], sP, r_base * PS + cb * 16u, PS) }
            CM_LOOP for (uint f = 0u; f < DB; ++f) {
                CM_LOOP for (uint cb = 0u; cb < CB; ++cb) {
                    CM_B v_;  // rows = 16 keys, columns = 16 dims
                    CM_LOAD_H4(v_, sV, cb * 16u * KS4 + 4u * f, KS4, CM_ROW)
                    CM_MULADD(of[f], pa[cb], v_)
                }
            }
        }
        barrier();  // every worker is done with sK, sV, sJ
        kt = kn;
    }

    if (!worker) return;
    for (int i = 0; i < CM_LEN(idx); ++i) {
        const uint e = uint(CM_EL(idx, i)), row = r_base + (e >> 4), Rw = aw.r0 + row;
        if (Rw >= aw.rows) continue;
        const uint t = aw.t0 + Rw / G, h = aw.g * G + Rw % G;
        const float l = sL[row];
        CM_LOOP for (uint f = 0u; f < DB; ++f) {
            const uint d = f * 16u + (e & 15u);
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
