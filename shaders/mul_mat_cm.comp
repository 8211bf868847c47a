#version 450
// Cooperative-matrix GEMM for prefill (GL_KHR_cooperative_matrix, f16 inputs, f32 accumulators):
// y[n, r] = epilogue(Σ_k W[r, k] x[n, k]) (interface and buffers: common/mm.glsl; W decoders:
// common/quant.glsl, QTYPE define).
// A workgroup owns a BM×BN tile (64 weight rows × 64 tokens; grid x = row tiles, y = token
// tiles). Per 64-wide k step the weight tile (64 rows × two 32-groups: one decode per invocation
// at 128 invocations) is decoded once to f16 in shared memory (A, row major) and the token tile
// converted to f16 (B = xᵀ, read column major). The tile is cut into TM×TN coopmat tiles (the
// device's shape: constant_id 2..4); subgroup s owns tiles s·PER_SG .. s·PER_SG + PER_SG − 1,
// numbered down columns so consecutive tiles share their B fragment (loaded once). PER_SG is
// sized from SG_MAX, the largest subgroup size the device may use. The f32 accumulators go
// through shared memory so the epilogue runs per element in f32 with bounds checks (ragged
// n_out / n_tok); when K % 64 == 32 the last step's second group is zero-filled.
// MoE: expert e of a stack {K, out, E} is w_row0 = e*out (push constant).
#extension GL_GOOGLE_include_directive : require
#include "common/base.glsl"
#extension GL_KHR_cooperative_matrix : require
#extension GL_KHR_memory_scope_semantics : require
#define QUANT_BINDING 0
#include "common/quant.glsl"
#include "common/mm.glsl"

layout(constant_id = 2) const uint TM = 16;
layout(constant_id = 3) const uint TN = 16;
layout(constant_id = 4) const uint TK = 16;
layout(constant_id = 5) const uint SG_MAX = 32;

const uint BM = 64u, BN = 64u, BK = 64u, GK = BK / 32u, SA = BK + 8u;
const uint CM = BM / TM;                 // coopmat tiles per column of the workgroup tile
const uint NT = CM * (BN / TN);          // coopmat tiles per workgroup tile
const uint NSG_MIN = gl_WorkGroupSize.x / SG_MAX;
const uint PER_SG = (NT + NSG_MIN - 1u) / NSG_MIN;

shared float16_t As[BM * SA];
shared float16_t Bs[BN * SA];
shared float Cs[BN * BM];

void main() {
    const uint tid = gl_LocalInvocationID.x;
    const uint sg = gl_SubgroupID;
    const uint r0 = gl_WorkGroupID.x * BM, n0 = gl_WorkGroupID.y * BN;
    const uint gpr = p.K / 32u;

    coopmat<float, gl_ScopeSubgroup, TM, TN, gl_MatrixUseAccumulator> acc[PER_SG];
    for (uint q = 0u; q < PER_SG; ++q) acc[q] = coopmat<float, gl_ScopeSubgroup, TM, TN, gl_MatrixUseAccumulator>(0.0);

    for (uint u0 = 0u; u0 < gpr; u0 += GK) {
        for (uint e = tid; e < BM * GK; e += gl_WorkGroupSize.x) {
            uint row = e / GK, gq = e % GK;
            vec4 w[8];
            if (u0 + gq < gpr) dequant_group((p.w_row0 + min(r0 + row, p.n_out - 1u)) * gpr + u0 + gq, w);
            else for (uint q = 0u; q < 8u; ++q) w[q] = vec4(0.0);  // K % 64 == 32: zero tail
            for (uint q = 0u; q < 8u; ++q)
                for (uint c = 0u; c < 4u; ++c) As[row * SA + 32u * gq + 4u * q + c] = float16_t(w[q][c]);
        }
        for (uint e = tid; e < BN * 8u * GK; e += gl_WorkGroupSize.x) {
            uint n = e / (8u * GK), q = e % (8u * GK);
            vec4 xx = u0 * 8u + q < gpr * 8u
                ? xv[(p.x_off + min(n0 + n, p.n_tok - 1u) * p.x_stride) / 4u + u0 * 8u + q] : vec4(0.0);
            for (uint c = 0u; c < 4u; ++c) Bs[n * SA + 4u * q + c] = float16_t(xx[c]);
        }
        barrier();
        for (uint kk = 0u; kk < BK; kk += TK) {
            coopmat<float16_t, gl_ScopeSubgroup, TK, TN, gl_MatrixUseB> b;
            uint b_tn = 0xFFFFFFFFu;
            for (uint q = 0u; q < PER_SG; ++q) {
                uint t = sg * PER_SG + q;
                if (t < NT) {
                    uint tm = t % CM, tn = t / CM;
                    if (tn != b_tn) {
                        coopMatLoad(b, Bs, tn * TN * SA + kk, SA, gl_CooperativeMatrixLayoutColumnMajor);
                        b_tn = tn;
                    }
                    coopmat<float16_t, gl_ScopeSubgroup, TM, TK, gl_MatrixUseA> a;
                    coopMatLoad(a, As, tm * TM * SA + kk, SA, gl_CooperativeMatrixLayoutRowMajor);
                    acc[q] = coopMatMulAdd(a, b, acc[q]);
                }
            }
        }
        barrier();
    }

    for (uint q = 0u; q < PER_SG; ++q) {
        uint t = sg * PER_SG + q;
        if (t < NT) {
            uint tm = t % CM, tn = t / CM;
            coopMatStore(acc[q], Cs, tn * TN * BM + tm * TM, BM, gl_CooperativeMatrixLayoutColumnMajor);
        }
    }
    barrier();
    for (uint e = tid; e < BM * BN; e += gl_WorkGroupSize.x) {
        uint r = r0 + e % BM, n = n0 + e / BM;
        if (r < p.n_out && n < p.n_tok) store_out(Cs[e], r, n);
    }
}
