#version 450
// GDN gated delta rule (MODEL.md §5.4 G6–G8, GC1–GC6) over T tokens, all in f32.
// One workgroup per (v-head j, slice of BW value columns b0..b0+BW): the columns of the state
// S_j (row = key index a, column = value index b) evolve independently, so slices never talk.
// Per token: k̂ = k/√(Σk²+ε), q̂ = q/√(Σq²+ε)/√S of key head π(j) (G6) — π(j) = j mod n_k (tiled,
// GROUPED 0) or ⌊j/(n_v/n_k)⌋ (grouped, GROUPED 1) (G7) — then, with α = e^g:
//   MODE 0 (step; decode and short verify batches), token by token (G8) using
//     r1 = Sᵀk̂, r2 = Sᵀq̂ of the undecayed S:  δ = β(v − α r1);  o = α r2 + δ (k̂·q̂);  S ← αS + k̂δᵀ.
//   MODE 1 (chunked prefill), chunks of n ≤ CH tokens (GC1–GC6), with V' solved directly as
//     V' = A⁻¹ diag(β)(V − diag(e^γ) K̂ S₀)  (= U − Wk S₀ of GC3–GC4, without forming Wk).
// The state lives in n_planes planes of [n_v, S, S] (engine/state.py); the live one is plane
// q = idx[idx_off] mod n_planes (plane 0 when n_planes = 1, idx unread). Without RING the final
// state goes back into plane q; with RING (MODE 0 only, a verify step, T < n_planes) plane q is
// left as it was and plane (q+1+t) mod n_planes gets the state after token t.
// Buffers: 0 c (f32) [T rows, stride c_stride: q (n_k·S) | k (n_k·S) | v (n_v·S)], 1 beta and
// 2 g (f32) [T rows × n_v], 3 planes (f32) [n_planes, n_v, S, S] from st_off (read, then
// written), 4 o (f32) [T rows × n_v·S], 5 idx (uint). Offsets and strides in elements.
// RAW_GATES: buffers 1 and 2 hold the raw projections b, a instead, and β = σ(b), g =
// softplus(a + dt_bias[j])·ssm_a[j] (G2, G3, as shaders/gdn_gates.comp) are computed where read,
// with 6 dt_bias [n_v] from dt_off and 7 ssm_a [n_v] from sa_off (any buffers otherwise).
// Shared memory is one array of SH floats (host-computed per mode), carved into regions below.
#extension GL_GOOGLE_include_directive : require
#include "common/base.glsl"

layout(constant_id = 1) const uint MODE = 0;
layout(constant_id = 2) const uint S = 32;
layout(constant_id = 3) const uint GROUPED = 0;
layout(constant_id = 4) const uint BW = 32;   // value columns per workgroup; divides S
layout(constant_id = 5) const uint CH = 64;   // chunk size (MODE 1)
layout(constant_id = 6) const uint ROWS = 4;  // state rows per invocation (MODE 0): S·BW/WG
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
layout(push_constant) uniform P {
    uint n_k; uint n_v; uint T;
    uint c_off; uint c_stride; uint beta_off; uint beta_stride; uint g_off; uint g_stride;
    uint st_off; uint o_off; uint o_stride; uint n_planes; uint idx_off; uint ring; uint eps_bits;
    uint dt_off; uint sa_off;
} p;

shared float sh[SH];

uint j, b0, kh;  // v-head, first value column, key head π(j)
uint live;  // the live plane
float eps;

uint q_col(uint a) { return p.c_off + kh * S + a; }
uint k_col(uint a) { return p.c_off + (p.n_k + kh) * S + a; }
uint v_col(uint b) { return p.c_off + 2 * p.n_k * S + j * S + b0 + b; }
// Element (key row a, value column b0 + b) of head j in plane q.
uint st_idx(uint q, uint a, uint b) { return p.st_off + ((q * p.n_v + j) * S + a) * S + b0 + b; }

// β and g of token t for head j: as stored, or from the raw projections (RAW_GATES).
float beta_at(uint t) {
    float v = beta[p.beta_off + t * p.beta_stride + j];
    return RAW_GATES ? sigmoid(v) : v;
}
float g_at(uint t) {
    float v = gg[p.g_off + t * p.g_stride + j];
    if (!RAW_GATES) return v;
    float x = v + dt_bias[p.dt_off + j];
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
        float rk = 1.0 / sqrt(kk + eps);
        float rq = 1.0 / sqrt(qq + eps) / sqrt(float(S));
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
            float r = 1.0 / sqrt(ss + eps);
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

void main() {
    uint slices = S / BW;
    j = gl_WorkGroupID.x / slices;
    b0 = (gl_WorkGroupID.x % slices) * BW;
    kh = GROUPED == 1 ? j / (p.n_v / p.n_k) : j % p.n_k;
    eps = uintBitsToFloat(p.eps_bits);
    live = p.n_planes > 1 ? idx[p.idx_off] % p.n_planes : 0;
    if (MODE == 0) step_mode();
    else chunk_mode();
}
