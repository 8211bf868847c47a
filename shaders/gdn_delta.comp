#version 450
// GDN gated delta rule (MODEL.md §5.4 G6–G8, GC1–GC6) over T tokens, all in f32.
// One workgroup per (v-head j, slice of BW value columns b0..b0+BW): the columns of the state
// S_j (row = key index a, column = value index b) evolve independently, so slices never talk.
// Per token: k̂ = k/√(Σk²+ε), q̂ = q/√(Σq²+ε)/√S of key head π(j) (G6) — π(j) = j mod n_k (tiled,
// GROUPED 0) or ⌊j/(n_v/n_k)⌋ (grouped, GROUPED 1) (G7) — then, with α = e^g:
//   MODE 0 (step; decode and short verify batches), token by token (G8) using
//     r1 = Sᵀk̂, r2 = Sᵀq̂ of the undecayed S:  δ = β(v − α r1);  o = α r2 + δ (k̂·q̂);  S ← αS + k̂δᵀ.
//   MODE 1 (chunked prefill, scalar), chunks of n ≤ CH tokens (GC1–GC6), with V' solved directly as
//     V' = A⁻¹ diag(β)(V − diag(e^γ) K̂ S₀)  (= U − Wk S₀ of GC3–GC4, without forming Wk).
//   MODE 2 (chunked prefill, matrix form; the default, VKFLASH_GDN_MATRIX=0 reverts to MODE 1):
//     chunks of CH tokens (CH a multiple of DB = 16; a short last chunk is padded with zero rows and
//     β = g = 0, which GC1–GC6 leave inert), with A⁻¹ as block forward substitution and every other
//     step a small GEMM on 4×4 register tiles (chunks are 16-row blocks, as coopmat tiles would be):
//       r_k = 1/√(Σk²+ε), r_q = 1/√(Σq²+ε)/√S per row (G6), folded into the products: K, Q stay raw
//       γ = cumsum g (GC1);  A = strictlower(diag(β) K̂K̂ᵀ ⊙ Γ) (GC2);  P = Q̂K̂ᵀ ⊙ Γ, diagonal incl.
//       R = diag(β)(V − diag(e^γ) K̂S₀);  O₀ = diag(e^γ) Q̂S₀           — one pass over the S keys
//       T_kk = (I + A_kk)⁻¹ of each DB×DB diagonal block (forward substitution, a column each)
//       V'_k = T_kk (R_k − A_{k,<k} V'_{<k}) block row by block row  (V' = (I+A)⁻¹R = U − Wk S₀,
//              GC3–GC4 with Wk·S₀ folded into R: T·(βV) − T·(βe^γK̂)·S₀ without all of T, or Wk)
//       O = O₀ + P V' (GC5);  S₁ = e^{γ_{CH−1}} S₀ + K̂ᵀ diag(e^{γ_{CH−1}−γ}) V' (GC6)
//   MODES 3 + 4 (chunked prefill, split matrix form; VKFLASH_GDN_SPLIT=1 instead of MODE 2):
//     MODE 3 computes, per (head, chunk), what does not depend on S₀ — the row vectors, P and all
//     of T = (I + A)⁻¹ — once per head instead of once per value slice, all chunks in parallel;
//     MODE 4 then scans the chunks of each slice with V' = T R in one product.
// The state lives in n_planes planes of [n_v, S, S] (engine/state.py); the live one is plane
// q = idx[idx_off] mod n_planes (plane 0 when n_planes = 1, idx unread). Without RING the final
// state goes back into plane q; with ring ≠ 0 (MODE 0 only, a verify step, T < n_planes) plane q is
// left as it was and plane (q+1+t) mod n_planes gets the state after token t.
// Buffers: 0 c (f32) [T rows, stride c_stride: q (n_k·S) | k (n_k·S) | v (n_v·S)], 1 beta and
// 2 g (f32) [T rows × n_v], 3 planes (f32) [n_planes, n_v, S, S] from st_off (read, then
// written), 4 o (f32) [T rows × n_v·S], 5 idx (uint), 10 the MODE 3 → 4 blocks (f32, a buffer
// of their own; another buffer, unread, in MODES 0–2). Offsets and strides in elements.
// RAW_GATES: β = σ(b), g = softplus(a + dt_bias[j])·ssm_a[j] (G2, G3, as shaders/gdn_gates.comp)
// are computed where read from the raw projections 8 b and 9 a [T rows × n_v] (b_off, b_stride,
// a_off, a_stride), 6 dt_bias [n_v] from dt_off and 7 ssm_a [n_v] from sa_off; buffers 1 and 2
// are then unused, as 6-9 are otherwise (any buffers).
// Shared memory is one array of SH floats (host-computed per mode), carved into regions below.
#extension GL_GOOGLE_include_directive : require
#extension GL_EXT_control_flow_attributes : require
#include "common/base.glsl"

layout(constant_id = 1) const uint MODE = 0;
layout(constant_id = 2) const uint S = 32;
layout(constant_id = 3) const uint GROUPED = 0;
layout(constant_id = 4) const uint BW = 32;   // value columns per workgroup; divides S
layout(constant_id = 5) const uint CH = 64;   // chunk size (MODES 1, 2)
layout(constant_id = 6) const uint ROWS = 4;  // state rows per invocation (MODE 0): S·BW/WG; key ranges (MODE 4)
layout(constant_id = 7) const uint SH = 1;    // shared floats
layout(constant_id = 8) const bool RAW_GATES = false;

layout(std430, binding = 0) readonly buffer Cb { float c[]; };
layout(std430, binding = 1) readonly buffer Bb { float beta[]; };
layout(std430, binding = 2) readonly buffer Gb { float gg[]; };
layout(std430, binding = 3) buffer St { float st[]; };
layout(std430, binding = 4) buffer Ob { float o[]; };
layout(std430, binding = 5) readonly buffer Idx { uint idx[]; };
layout(std430, binding = 6) readonly buffer Dt { float dt_bias[]; };
layout(std430, binding = 7) readonly buffer Sa { float ssm_a[]; };
layout(std430, binding = 8) readonly buffer Braw { float b_raw[]; };
layout(std430, binding = 9) readonly buffer Araw { float a_raw[]; };
layout(std430, binding = 10) buffer Pr { float pr[]; };
layout(push_constant) uniform P {
    uint n_k; uint n_v; uint T;
    uint c_off; uint c_stride; uint beta_off; uint beta_stride; uint g_off; uint g_stride;
    uint st_off; uint o_off; uint o_stride; uint n_planes; uint idx_off; uint ring; float eps;
    uint dt_off; uint sa_off; uint b_off; uint b_stride; uint a_off; uint a_stride;
} p;

shared float sh[SH];

uint j, b0, kh;  // v-head, first value column, key head π(j)
uint live;  // the live plane

uint q_col(uint a) { return p.c_off + kh * S + a; }
uint k_col(uint a) { return p.c_off + (p.n_k + kh) * S + a; }
uint v_col(uint b) { return p.c_off + 2 * p.n_k * S + j * S + b0 + b; }
// Element (key row a, value column b0 + b) of head j in plane q.
uint st_idx(uint q, uint a, uint b) { return p.st_off + ((q * p.n_v + j) * S + a) * S + b0 + b; }

// β and g of token t for head j: as stored, or from the raw projections (RAW_GATES).
float beta_at(uint t) {
    if (RAW_GATES) return sigmoid(b_raw[p.b_off + t * p.b_stride + j]);
    return beta[p.beta_off + t * p.beta_stride + j];
}
float g_at(uint t) {
    if (!RAW_GATES) return gg[p.g_off + t * p.g_stride + j];
    float x = a_raw[p.a_off + t * p.a_stride + j] + dt_bias[p.dt_off + j];
    return softplus(x) * ssm_a[p.sa_off + j];
}

// MODE 0. Invocation (pp, b) of P = WG/BW owns rows a = pp + P·r (r < ROWS) of column b.
// Shared: ks [S] | qs [S] | part1 [WG] | part2 [WG] | 3 sums per subgroup [3·WG].
void step_mode() {
    const uint WG = gl_WorkGroupSize.x, NP = WG / BW;
    uint tid = gl_LocalInvocationID.x, b = tid % BW, pp = tid / BW;
    const uint KS = 0, QS = S, P1 = 2 * S, P2 = 2 * S + WG, RD = 2 * S + 2 * WG;
    float s[ROWS];
    for (uint r = 0; r < ROWS; ++r) s[r] = st[st_idx(live, pp + NP * r, b)];
    for (uint t = 0; t < p.T; ++t) {
        uint row = t * p.c_stride;
        float kk = 0.0, qq = 0.0, kq = 0.0;
        for (uint a = tid; a < S; a += WG) {
            float kv = c[k_col(a) + row], qv = c[q_col(a) + row];
            sh[KS + a] = kv;
            sh[QS + a] = qv;
            kk += kv * kv;
            qq += qv * qv;
            kq += kv * qv;
        }
        // Σk², Σq², Σkq over the workgroup: subgroup sums, then per-subgroup slots summed in order
        // by every invocation (the barrier also publishes ks, qs)
        kk = subgroupAdd(kk);
        qq = subgroupAdd(qq);
        kq = subgroupAdd(kq);
        if (subgroupElect()) {
            sh[RD + 3 * gl_SubgroupID] = kk;
            sh[RD + 3 * gl_SubgroupID + 1] = qq;
            sh[RD + 3 * gl_SubgroupID + 2] = kq;
        }
        barrier();
        kk = 0.0;
        qq = 0.0;
        kq = 0.0;
        for (uint i = 0; i < gl_NumSubgroups; ++i) {
            kk += sh[RD + 3 * i];
            qq += sh[RD + 3 * i + 1];
            kq += sh[RD + 3 * i + 2];
        }
        float rk = 1.0 / sqrt(kk + p.eps);
        float rq = 1.0 / sqrt(qq + p.eps) / sqrt(float(S));
        float kq_hat = kq * rk * rq;
        float r1 = 0.0, r2 = 0.0;
        for (uint r = 0; r < ROWS; ++r) {
            uint a = pp + NP * r;
            r1 += s[r] * sh[KS + a];
            r2 += s[r] * sh[QS + a];
        }
        sh[P1 + tid] = r1 * rk;
        sh[P2 + tid] = r2 * rq;
        barrier();
        r1 = 0.0;
        r2 = 0.0;
        for (uint i = 0; i < NP; ++i) {
            r1 += sh[P1 + i * BW + b];
            r2 += sh[P2 + i * BW + b];
        }
        float alpha = exp(g_at(t));
        float delta = beta_at(t) * (c[v_col(b) + row] - alpha * r1);
        if (pp == 0) o[p.o_off + t * p.o_stride + j * S + b0 + b] = alpha * r2 + delta * kq_hat;
        for (uint r = 0; r < ROWS; ++r) s[r] = alpha * s[r] + sh[KS + pp + NP * r] * rk * delta;
        if (p.ring != 0) {
            uint q = (live + 1 + t) % p.n_planes;
            for (uint r = 0; r < ROWS; ++r) st[st_idx(q, pp + NP * r, b)] = s[r];
        }
        barrier();  // ks, qs, part1, part2 are rewritten by the next token
    }
    if (p.ring == 0) {
        for (uint r = 0; r < ROWS; ++r) st[st_idx(live, pp + NP * r, b)] = s[r];
    }
}

// MODE 1. Shared: K̂ [CH, S] | Q̂ [CH, S] | Att [CH, CH] | S₀ slice [S, BW] | V' [CH, BW] | γ [CH]
// | β [CH]. Att holds A's strict lower part (i > l) and (Q̂K̂ᵀ ⊙ Γ)ᵀ on and above the diagonal.
void chunk_mode() {
    const uint WG = gl_WorkGroupSize.x;
    const uint KR = 0, QR = CH * S, AT = 2 * CH * S, SR = AT + CH * CH, VR = SR + S * BW;
    const uint GR = VR + CH * BW, BR = GR + CH;
    uint tid = gl_LocalInvocationID.x;
    for (uint e = tid; e < S * BW; e += WG) sh[SR + e] = st[st_idx(live, e / BW, e % BW)];
    for (uint t0 = 0; t0 < p.T; t0 += CH) {
        uint n = min(CH, p.T - t0);
        // load raw K, Q, the V slice, β and g of the chunk
        for (uint e = tid; e < n * S; e += WG) {
            uint row = (t0 + e / S) * p.c_stride, a = e % S;
            sh[KR + e] = c[k_col(a) + row];
            sh[QR + e] = c[q_col(a) + row];
        }
        for (uint e = tid; e < n * BW; e += WG) sh[VR + e] = c[v_col(e % BW) + (t0 + e / BW) * p.c_stride];
        for (uint i = tid; i < n; i += WG) {
            sh[GR + i] = g_at(t0 + i);
            sh[BR + i] = beta_at(t0 + i);
        }
        barrier();
        // (G6) row norms: invocation i < n scales K row i, n ≤ i < 2n scales Q row i-n; the
        // last invocation turns g into γ (GC1)
        if (tid < 2 * n) {
            uint base = tid < n ? KR + tid * S : QR + (tid - n) * S;
            float ss = 0.0;
            for (uint a = 0; a < S; ++a) ss += sh[base + a] * sh[base + a];
            float r = 1.0 / sqrt(ss + p.eps);
            if (tid >= n) r /= sqrt(float(S));
            for (uint a = 0; a < S; ++a) sh[base + a] *= r;
        }
        if (tid == WG - 1) {
            for (uint i = 1; i < n; ++i) sh[GR + i] += sh[GR + i - 1];
        }
        barrier();
        // (GC2) A strict lower; (GC5) Q̂K̂ᵀ ⊙ Γ transposed into the upper part incl. diagonal
        for (uint e = tid; e < n * n; e += WG) {
            uint i = e / n, l = e % n;
            uint x = l < i ? KR + i * S : QR + l * S, y = KR + (l < i ? l : i) * S;
            float d = 0.0;
            for (uint a = 0; a < S; ++a) d += sh[x + a] * sh[y + a];
            sh[AT + i * CH + l] = l < i ? sh[BR + i] * exp(sh[GR + i] - sh[GR + l]) * d
                                        : exp(sh[GR + l] - sh[GR + i]) * d;
        }
        // R = diag(β)(V − diag(e^γ) K̂S₀) into V'; first term of O, e^γ Q̂S₀, straight to o
        for (uint e = tid; e < n * BW; e += WG) {
            uint i = e / BW, b = e % BW;
            float ks = 0.0, qs = 0.0;
            for (uint a = 0; a < S; ++a) {
                float s0 = sh[SR + a * BW + b];
                ks += sh[KR + i * S + a] * s0;
                qs += sh[QR + i * S + a] * s0;
            }
            float eg = exp(sh[GR + i]);
            sh[VR + e] = sh[BR + i] * (sh[VR + e] - eg * ks);
            o[p.o_off + (t0 + i) * p.o_stride + j * S + b0 + b] = eg * qs;
        }
        barrier();
        // (GC3–GC4) V' = A⁻¹ R by forward substitution, one invocation per column; β, no
        // longer needed, is replaced by the GC6 decays e^{γ_{n-1} − γ_i}
        float last = sh[GR + n - 1];
        for (uint i = tid; i < n; i += WG) sh[BR + i] = exp(last - sh[GR + i]);
        for (uint b = tid; b < BW; b += WG) {
            for (uint i = 1; i < n; ++i) {
                float acc = sh[VR + i * BW + b];
                for (uint l = 0; l < i; ++l) acc -= sh[AT + i * CH + l] * sh[VR + l * BW + b];
                sh[VR + i * BW + b] = acc;
            }
        }
        barrier();
        // (GC5) O += (Q̂K̂ᵀ ⊙ Γ) V' (same (i, b) → invocation map as above: o is its own)
        for (uint e = tid; e < n * BW; e += WG) {
            uint i = e / BW, b = e % BW;
            float acc = 0.0;
            for (uint l = 0; l <= i; ++l) acc += sh[AT + l * CH + i] * sh[VR + l * BW + b];
            o[p.o_off + (t0 + i) * p.o_stride + j * S + b0 + b] += acc;
        }
        // (GC6) S₁ = e^{γ_{n-1}} S₀ + (K̂ ⊙ e^{γ_{n-1} − γ})ᵀ V'
        for (uint e = tid; e < S * BW; e += WG) {
            uint a = e / BW, b = e % BW;
            float acc = exp(last) * sh[SR + e];
            for (uint i = 0; i < n; ++i) acc += sh[KR + i * S + a] * sh[BR + i] * sh[VR + i * BW + b];
            sh[SR + e] = acc;
        }
        barrier();  // the next chunk reloads K̂, Q̂, V' and reads S₀
    }
    for (uint e = tid; e < S * BW; e += WG) st[st_idx(live, e / BW, e % BW)] = sh[SR + e];
}

// MODES 2–4 share one shared-memory layout, rows padded by one float so rows 4 apart fall in
// different banks:
//   K [CH, S+1] | Q [CH, S+1] raw rows | S₀ slice [S, BW] | Att [CH, CH+1] | V [CH, BW] (→ R → V')
//   | γ [CH] | β [CH] | r_k [CH] | r_q [CH] | g [CH] (→ w = r_k e^{γ_{CH−1}−γ}) | (MODE 3) T [CH, CH].
// Att holds A (strict lower; MODE 2 turns its diagonal blocks into T_kk, MODE 3 holds all of T =
// (I + A)⁻¹ apart) and Pᵀ (upper incl. diagonal); it first holds the row norms' partial sums.
// Phase A's items are TL×TL tiles of Q̂S₀ (item e < NO: invocation e keeps it in registers, oacc,
// and later owns the same tile of O), K̂S₀, and (MODE 2) the lower triangles of K̂K̂ᵀ and Q̂K̂ᵀ; the
// last phase's are O's tiles and the state's.
// MODE 3 (split, first pass): one workgroup per (v-head j, chunk) computes what does not depend on
// S₀ — γ, β, r_k, r_q, w, and Att with T's strict lower part in place of A — into buffer 10 at
// element (j·n_chunks + chunk)·PW: Att [CH, CH] (unpadded), then the 5 vectors [CH] each.
// MODE 4 (split, second pass): MODE 2 with that block read instead of computed (the S₀-free work
// once per head, not once per value slice), phase A's S₀ products split into ROWS key ranges
// (partials summed through the Q rows' space) and V' = T R in one product.
const uint TL = 4;   // register tile edge
const uint DB = 16;  // diagonal block of MODE 2's solve
const uint KST = S + 1, AST = CH + 1;
const uint KR = 0, QR = CH * KST, SR = 2 * CH * KST, AT = SR + S * BW, VR = AT + CH * AST;
const uint GR = VR + CH * BW, BR = GR + CH, RK = BR + CH, RQ = RK + CH, WR = RQ + CH, TI = WR + CH;
const uint NB = BW / TL, NO = (CH / TL) * NB, NTRI = (CH / TL) * (CH / TL + 1) / 2;
const uint PW = CH * CH + 5 * CH;  // floats per (head, chunk) block of buffer 10
uint block(uint ci) { return (j * ((p.T + CH - 1) / CH) + ci) * PW; }  // head j's chunk ci in buffer 10
float oacc[TL][TL];  // the O tile this invocation owns: O₀, then O
float acc[TL][TL];   // the tile being summed

// Row of item t in a lower triangle of tiles enumerated row by row: t = ti(ti+1)/2 + tj, tj ≤ ti.
uint tri_row(uint t) {
    uint ti = uint((sqrt(8.0 * float(t) + 1.0) - 1.0) * 0.5);
    if ((ti + 1) * (ti + 2) / 2 <= t) ++ti;
    if (ti * (ti + 1) / 2 > t) --ti;
    return ti;
}

// Raw K, Q rows (and the V slice) of the chunk at t0, zero on padding rows i ≥ n: every load
// first (rows clamped into the batch, so none waits on a branch), then every store.
void load_rows(uint t0, uint n, bool with_v) {
    const uint WG = gl_WorkGroupSize.x;
    const uint LK = (CH * S + WG - 1) / WG, LV = (CH * BW + WG - 1) / WG;  // loads per invocation
    uint tid = gl_LocalInvocationID.x;
    float kv[LK], qv[LK], vv[LV];
    [[unroll]] for (uint s = 0; s < LK; ++s) {
        uint e = min(tid + s * WG, CH * S - 1), row = min(t0 + e / S, p.T - 1) * p.c_stride;
        kv[s] = c[k_col(e % S) + row];
        qv[s] = c[q_col(e % S) + row];
    }
    if (with_v) {
        [[unroll]] for (uint s = 0; s < LV; ++s) {
            uint e = min(tid + s * WG, CH * BW - 1);
            vv[s] = c[v_col(e % BW) + min(t0 + e / BW, p.T - 1) * p.c_stride];
        }
    }
    [[unroll]] for (uint s = 0; s < LK; ++s) {
        uint e = tid + s * WG, i = e / S;
        if (e < CH * S) {
            sh[KR + i * KST + e % S] = i < n ? kv[s] : 0.0;
            sh[QR + i * KST + e % S] = i < n ? qv[s] : 0.0;
        }
    }
    if (with_v) {
        [[unroll]] for (uint s = 0; s < LV; ++s) {
            uint e = tid + s * WG;
            if (e < CH * BW) sh[VR + e] = e / BW < n ? vv[s] : 0.0;
        }
    }
}

// After load_rows, g and β (0 on padding rows) of the chunk, then (between barriers) the row
// vectors: (G6) r_k, r_q from partial sums of squares, part-major in Att (a warp reads 32 rows at
// one column: 32 banks); (GC1) γ_i = Σ_{l≤i} g_l; g replaced by the GC6 row weights w.
void row_vectors(uint t0, uint n) {
    const uint WG = gl_WorkGroupSize.x, NPART = 4;  // NPART invocations per row norm
    uint tid = gl_LocalInvocationID.x;
    for (uint i = tid; i < CH; i += WG) {
        float gv = 0.0, bv = 0.0;
        if (i < n) {
            gv = g_at(t0 + i);
            bv = beta_at(t0 + i);
        }
        sh[WR + i] = gv;
        sh[BR + i] = bv;
    }
    barrier();
    for (uint e = tid; e < 2 * CH * NPART; e += WG) {
        uint r = e % (2 * CH);
        uint base = (r < CH ? KR + r * KST : QR + (r - CH) * KST) + (e / (2 * CH)) * (S / NPART);
        float ss = 0.0;
        for (uint a = 0; a < S / NPART; ++a) ss += sh[base + a] * sh[base + a];
        sh[AT + e] = ss;
    }
    for (uint i = tid; i < CH; i += WG) {
        float gam = 0.0;
        for (uint l = 0; l <= i; ++l) gam += sh[WR + l];
        sh[GR + i] = gam;
    }
    barrier();
    for (uint r = tid; r < 2 * CH; r += WG) {
        float ss = 0.0;
        for (uint part = 0; part < NPART; ++part) ss += sh[AT + part * 2 * CH + r];
        float x = 1.0 / sqrt(ss + p.eps);
        if (r < CH) {
            x = r < n ? x : 0.0;
            sh[RK + r] = x;
            sh[WR + r] = x * exp(sh[GR + CH - 1] - sh[GR + r]);
        } else {
            sh[RQ + r - CH] = r - CH < n ? x / sqrt(float(S)) : 0.0;
        }
    }
    barrier();
}

// acc = tile e of Q̂S₀ (e < NO) or K̂S₀ (raw rows times the S₀ slice) over the keys a0..a1−1.
void s0_tile(uint e, uint a0, uint a1) {
    uint t = e % NO, i0 = (t / NB) * TL, bc = (t % NB) * TL;
    uint xb = (e < NO ? QR : KR) + i0 * KST;
    [[unroll]] for (uint r = 0; r < TL; ++r) {
        [[unroll]] for (uint q = 0; q < TL; ++q) acc[r][q] = 0.0;
    }
    for (uint a = a0; a < a1; ++a) {
        float x[TL], y[TL];
        [[unroll]] for (uint r = 0; r < TL; ++r) x[r] = sh[xb + r * KST + a];
        [[unroll]] for (uint q = 0; q < TL; ++q) y[q] = sh[SR + a * BW + bc + q];
        [[unroll]] for (uint r = 0; r < TL; ++r) {
            [[unroll]] for (uint q = 0; q < TL; ++q) acc[r][q] = fma(x[r], y[q], acc[r][q]);
        }
    }
}

// Tile e's product in place: O₀ = e^γ r_q Q S₀ kept in oacc (e < NO), or R = β(V − e^γ r_k K S₀)
// in place of V.
void s0_epilogue(uint e) {
    uint t = e % NO, i0 = (t / NB) * TL, bc = (t % NB) * TL;
    [[unroll]] for (uint r = 0; r < TL; ++r) {
        uint i = i0 + r;
        float eg = exp(sh[GR + i]);
        if (e < NO) {
            [[unroll]] for (uint q = 0; q < TL; ++q) oacc[r][q] = eg * sh[RQ + i] * acc[r][q];
        } else {
            [[unroll]] for (uint q = 0; q < TL; ++q) {
                uint x = VR + i * BW + bc + q;
                sh[x] = sh[BR + i] * (sh[x] - eg * sh[RK + i] * acc[r][q]);
            }
        }
    }
}

// Triangle tile t < 2·NTRI: K̂K̂ᵀ (strict lower → A) or, from NTRI on, Q̂K̂ᵀ (lower incl. the
// diagonal → Pᵀ above it), with the decays and row scales, into Att.
void kq_tile(uint t) {
    bool qk = t >= NTRI;
    if (qk) t -= NTRI;
    uint ti = tri_row(t), i0 = ti * TL, l0 = (t - ti * (ti + 1) / 2) * TL;
    uint xb = (qk ? QR : KR) + i0 * KST, yb = KR + l0 * KST;
    [[unroll]] for (uint r = 0; r < TL; ++r) {
        [[unroll]] for (uint q = 0; q < TL; ++q) acc[r][q] = 0.0;
    }
    for (uint a = 0; a < S; ++a) {
        float x[TL], y[TL];
        [[unroll]] for (uint r = 0; r < TL; ++r) x[r] = sh[xb + r * KST + a];
        [[unroll]] for (uint q = 0; q < TL; ++q) y[q] = sh[yb + q * KST + a];
        [[unroll]] for (uint r = 0; r < TL; ++r) {
            [[unroll]] for (uint q = 0; q < TL; ++q) acc[r][q] = fma(x[r], y[q], acc[r][q]);
        }
    }
    [[unroll]] for (uint r = 0; r < TL; ++r) {
        [[unroll]] for (uint q = 0; q < TL; ++q) {
            uint i = i0 + r, l = l0 + q;
            float d = exp(sh[GR + i] - sh[GR + l]) * sh[RK + l] * acc[r][q];
            if (qk && l <= i) sh[AT + l * AST + i] = sh[RQ + i] * d;
            if (!qk && l < i) sh[AT + i * AST + l] = sh[BR + i] * sh[RK + i] * d;
        }
    }
}

// (GC5) O = O₀ + P V' (item e < NO: invocation e, whose registers hold O₀), (GC6) S₁ =
// e^{γ_{CH−1}} S₀ + Kᵀ diag(w) V' in place, each tile by its own invocation.
void last_phase(uint t0, uint n) {
    const uint WG = gl_WorkGroupSize.x, NS = (S / TL) * NB;
    float decay = exp(sh[GR + CH - 1]);
    for (uint e = gl_LocalInvocationID.x; e < NO + NS; e += WG) {
        if (e < NO) {
            uint i0 = (e / NB) * TL, bc = (e % NB) * TL;
            for (uint l = 0; l < i0 + TL; ++l) {
                float x[TL], y[TL];
                [[unroll]] for (uint r = 0; r < TL; ++r) x[r] = l <= i0 + r ? sh[AT + l * AST + i0 + r] : 0.0;
                [[unroll]] for (uint q = 0; q < TL; ++q) y[q] = sh[VR + l * BW + bc + q];
                [[unroll]] for (uint r = 0; r < TL; ++r) {
                    [[unroll]] for (uint q = 0; q < TL; ++q) oacc[r][q] = fma(x[r], y[q], oacc[r][q]);
                }
            }
            [[unroll]] for (uint r = 0; r < TL; ++r) {
                if (i0 + r < n) {
                    uint ob = p.o_off + (t0 + i0 + r) * p.o_stride + j * S + b0 + bc;
                    [[unroll]] for (uint q = 0; q < TL; ++q) o[ob + q] = oacc[r][q];
                }
            }
        } else {
            uint t = e - NO, a0 = (t / NB) * TL, bc = (t % NB) * TL;
            [[unroll]] for (uint r = 0; r < TL; ++r) {
                [[unroll]] for (uint q = 0; q < TL; ++q) acc[r][q] = decay * sh[SR + (a0 + r) * BW + bc + q];
            }
            for (uint i = 0; i < n; ++i) {
                float x[TL], y[TL];
                [[unroll]] for (uint r = 0; r < TL; ++r) x[r] = sh[KR + i * KST + a0 + r];
                [[unroll]] for (uint q = 0; q < TL; ++q) y[q] = sh[WR + i] * sh[VR + i * BW + bc + q];
                [[unroll]] for (uint r = 0; r < TL; ++r) {
                    [[unroll]] for (uint q = 0; q < TL; ++q) acc[r][q] = fma(x[r], y[q], acc[r][q]);
                }
            }
            [[unroll]] for (uint r = 0; r < TL; ++r) {
                [[unroll]] for (uint q = 0; q < TL; ++q) sh[SR + (a0 + r) * BW + bc + q] = acc[r][q];
            }
        }
    }
}

// MODE 2: everything of a chunk in this workgroup, for its value slice.
void matrix_mode() {
    const uint WG = gl_WorkGroupSize.x;
    const uint NA = 2 * NO + 2 * NTRI, YI = (DB * BW + WG - 1) / WG;
    uint tid = gl_LocalInvocationID.x;
    for (uint e = tid; e < S * BW; e += WG) sh[SR + e] = st[st_idx(live, e / BW, e % BW)];
    for (uint t0 = 0; t0 < p.T; t0 += CH) {
        uint n = min(CH, p.T - t0);
        load_rows(t0, n, true);
        row_vectors(t0, n);
        // Phase A: every product contracted over the S keys, one TL×TL tile per item
        for (uint e = tid; e < NA; e += WG) {
            if (e < 2 * NO) {
                s0_tile(e, 0, S);
                s0_epilogue(e);
            } else {
                kq_tile(e - 2 * NO);
            }
        }
        barrier();
        // T_kk = (I + A_kk)⁻¹: invocation (k, cc) solves column cc of block k in registers (the
        // zeros above the diagonal keep every index constant), written over A_kk once all have read
        uint blk = tid / DB, cc = tid % DB, dbase = AT + blk * DB * (AST + 1);
        float tcol[DB];
        if (tid < CH) {
            [[unroll]] for (uint i = 0; i < DB; ++i) {
                float x = i == cc ? 1.0 : 0.0;
                [[unroll]] for (uint m = 0; m < i; ++m) x = fma(-sh[dbase + i * AST + m], tcol[m], x);
                tcol[i] = x;
            }
        }
        barrier();
        if (tid < CH) {
            [[unroll]] for (uint i = 0; i < DB; ++i) {
                if (i > cc) sh[dbase + i * AST + cc] = tcol[i];
            }
        }
        barrier();
        // V' = (I + A)⁻¹ R block row by block row, in place of R
        for (uint k = 0; k < CH / DB; ++k) {
            uint r0 = k * DB;
            if (k > 0) {  // R_k −= A_{k,<k} V'_{<k}
                for (uint e = tid; e < DB * BW; e += WG) {
                    uint x = VR + (r0 + e / BW) * BW + e % BW, arow = AT + (r0 + e / BW) * AST;
                    float v = sh[x];
                    for (uint m = 0; m < r0; ++m) v = fma(-sh[arow + m], sh[VR + m * BW + e % BW], v);
                    sh[x] = v;
                }
                barrier();
            }
            float y[YI];  // V'_k = T_kk R_k (unit diagonal), stored once every invocation has read R_k
            for (uint s = 0; s < YI; ++s) {
                uint e = tid + s * WG, il = e / BW, b = e % BW;
                if (e < DB * BW) {
                    float v = sh[VR + (r0 + il) * BW + b];
                    for (uint m = 0; m < il; ++m) {
                        v = fma(sh[AT + (r0 + il) * AST + r0 + m], sh[VR + (r0 + m) * BW + b], v);
                    }
                    y[s] = v;
                }
            }
            barrier();
            for (uint s = 0; s < YI; ++s) {
                uint e = tid + s * WG;
                if (e < DB * BW) sh[VR + (r0 + e / BW) * BW + e % BW] = y[s];
            }
            barrier();
        }
        last_phase(t0, n);
        barrier();  // the next chunk reloads K, Q, V and the vectors and reads S₁
    }
    for (uint e = tid; e < S * BW; e += WG) st[st_idx(live, e / BW, e % BW)] = sh[SR + e];
}

// MODE 3: chunk gl_WorkGroupID.y of head j: T = (I + A)⁻¹ by forward substitution, invocation cc
// solving column cc (rows above cc are 0), and the chunk's S₀-free block out to buffer 10.
void prep_mode() {
    const uint WG = gl_WorkGroupSize.x;
    uint tid = gl_LocalInvocationID.x, ci = gl_WorkGroupID.y, t0 = ci * CH, n = min(CH, p.T - t0);
    load_rows(t0, n, false);
    row_vectors(t0, n);
    for (uint e = tid; e < 2 * NTRI; e += WG) kq_tile(e);
    barrier();
    if (tid < CH) {
        for (uint i = 0; i < CH; ++i) {
            float x = i == tid ? 1.0 : 0.0;
            for (uint m = tid; m < i; ++m) x = fma(-sh[AT + i * AST + m], sh[TI + m * CH + tid], x);
            sh[TI + i * CH + tid] = x;
        }
    }
    barrier();
    uint base = block(ci);
    for (uint e = tid; e < CH * CH; e += WG) {
        uint r = e / CH, l = e % CH;
        pr[base + e] = l < r ? sh[TI + e] : sh[AT + r * AST + l];
    }
    for (uint e = tid; e < 5 * CH; e += WG) pr[base + CH * CH + e] = sh[GR + e];
}

// MODE 4: the chunks of one value slice in order, each chunk's block read from buffer 10.
void scan_mode() {
    const uint WG = gl_WorkGroupSize.x, NI = 2 * NO, SP = S / ROWS, YI = (CH * BW + WG - 1) / WG;
    uint tid = gl_LocalInvocationID.x, item = tid % NI, part = tid / NI;
    for (uint e = tid; e < S * BW; e += WG) sh[SR + e] = st[st_idx(live, e / BW, e % BW)];
    for (uint t0 = 0, ci = 0; t0 < p.T; t0 += CH, ++ci) {
        uint n = min(CH, p.T - t0), base = block(ci);
        load_rows(t0, n, true);
        for (uint e = tid; e < CH * CH; e += WG) sh[AT + (e / CH) * AST + e % CH] = pr[base + e];
        for (uint e = tid; e < 5 * CH; e += WG) sh[GR + e] = pr[base + CH * CH + e];
        barrier();
        // phase A: item's tile over key range `part`; parts > 0 leave their sums where the Q rows
        // were, once every Q row has been read, for part 0 to add (element-major: neighbouring
        // items in neighbouring banks)
        if (part < ROWS) s0_tile(item, part * SP, part * SP + SP);
        barrier();
        if (part > 0 && part < ROWS) {
            uint x = QR + (part - 1) * TL * TL * NI + item;
            [[unroll]] for (uint r = 0; r < TL; ++r) {
                [[unroll]] for (uint q = 0; q < TL; ++q) sh[x + (r * TL + q) * NI] = acc[r][q];
            }
        }
        barrier();
        if (part == 0) {
            for (uint pp = 1; pp < ROWS; ++pp) {
                uint x = QR + (pp - 1) * TL * TL * NI + item;
                [[unroll]] for (uint r = 0; r < TL; ++r) {
                    [[unroll]] for (uint q = 0; q < TL; ++q) acc[r][q] += sh[x + (r * TL + q) * NI];
                }
            }
            s0_epilogue(item);
        }
        barrier();
        // V' = T R (T unit lower triangular), stored once every invocation has read R
        float y[YI];
        for (uint s = 0; s < YI; ++s) {
            uint e = tid + s * WG, i = e / BW, b = e % BW;
            if (e < CH * BW) {
                float v = sh[VR + i * BW + b];
                for (uint l = 0; l < i; ++l) v = fma(sh[AT + i * AST + l], sh[VR + l * BW + b], v);
                y[s] = v;
            }
        }
        barrier();
        for (uint s = 0; s < YI; ++s) {
            uint e = tid + s * WG;
            if (e < CH * BW) sh[VR + e] = y[s];
        }
        barrier();
        last_phase(t0, n);
        barrier();  // the next chunk reloads K, Q, V, the block and reads S₁
    }
    for (uint e = tid; e < S * BW; e += WG) st[st_idx(live, e / BW, e % BW)] = sh[SR + e];
}

void main() {
    uint slices = MODE == 3 ? 1 : S / BW;
    j = gl_WorkGroupID.x / slices;
    b0 = (gl_WorkGroupID.x % slices) * BW;
    kh = GROUPED == 1 ? j / (p.n_v / p.n_k) : j % p.n_k;
    live = p.n_planes > 1 ? idx[p.idx_off] % p.n_planes : 0;
    if (MODE == 0) step_mode();
    else if (MODE == 1) chunk_mode();
    else if (MODE == 2) matrix_mode();
    else if (MODE == 3) prep_mode();
    else scan_mode();
}
