#version 450
// Cooperative-matrix GEMM for prefill (GL_KHR_cooperative_matrix, f16 inputs, f32 accumulators):
// y[n, r] = epilogue(Σ_k W[r, k] x[n, k]) (interface and buffers: common/mm.glsl; W decoders:
// common/quant.glsl, QTYPE define).
// A workgroup owns a BM×BN tile (64 weight rows × 64 tokens; grid x = row tiles, y = token
// tiles). Per 32-wide k step the weight tile is decoded once to f16 in shared memory (A, row
// major) and the token tile converted to f16 (B = xᵀ, read column major); the tile is cut into
// TM×TN coopmat tiles (the device's shape: constant_id 2..4), dealt round-robin to the
// subgroups (at most PER_SG each, sized from SG_MAX, the largest subgroup size the device may
// use). The f32 accumulators go through shared memory so the epilogue runs per element in f32
// with bounds checks (ragged n_out / n_tok).
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

const uint BM = 64u, BN = 64u, BK = 32u, SA = BK + 8u;
const uint CN = BN / TN;                 // coopmat tiles per row of the workgroup tile
const uint NT = (BM / TM) * CN;          // coopmat tiles per workgroup tile
const uint NSG_MIN = gl_WorkGroupSize.x / SG_MAX;
const uint PER_SG = (NT + NSG_MIN - 1u) / NSG_MIN;

shared float16_t As[BM * SA];
shared float16_t Bs[BN * SA];
shared float Cs[BN * BM];

void main() {
    const uint tid = gl_LocalInvocationID.x;
    const uint sg = gl_SubgroupID, nsg = gl_NumSubgroups;
    const uint r0 = gl_WorkGroupID.x * BM, n0 = gl_WorkGroupID.y * BN;
    const uint gpr = p.K / 32u;

    coopmat<float, gl_ScopeSubgroup, TM, TN, gl_MatrixUseAccumulator> acc[PER_SG];
    for (uint q = 0u; q < PER_SG; ++q) acc[q] = coopmat<float, gl_ScopeSubgroup, TM, TN, gl_MatrixUseAccumulator>(0.0);

    for (uint u = 0u; u < gpr; ++u) {
        for (uint row = tid; row < BM; row += gl_WorkGroupSize.x) {
            vec4 w[8];
            dequant_group((p.w_row0 + min(r0 + row, p.n_out - 1u)) * gpr + u, w);
            for (uint q = 0u; q < 8u; ++q)
                for (uint c = 0u; c < 4u; ++c) As[row * SA + 4u * q + c] = float16_t(w[q][c]);
        }
        for (uint e = tid; e < BN * 8u; e += gl_WorkGroupSize.x) {
            uint n = e / 8u, q = e % 8u;
            vec4 xx = xv[(p.x_off + min(n0 + n, p.n_tok - 1u) * p.x_stride) / 4u + u * 8u + q];
            for (uint c = 0u; c < 4u; ++c) Bs[n * SA + 4u * q + c] = float16_t(xx[c]);
        }
        barrier();
        for (uint kk = 0u; kk < BK; kk += TK) {
            for (uint q = 0u; q < PER_SG; ++q) {
                uint t = sg + nsg * q;
                if (t < NT) {
                    uint tm = t / CN, tn = t % CN;
                    coopmat<float16_t, gl_ScopeSubgroup, TM, TK, gl_MatrixUseA> a;
                    coopmat<float16_t, gl_ScopeSubgroup, TK, TN, gl_MatrixUseB> b;
                    coopMatLoad(a, As, tm * TM * SA + kk, SA, gl_CooperativeMatrixLayoutRowMajor);
                    coopMatLoad(b, Bs, tn * TN * SA + kk, SA, gl_CooperativeMatrixLayoutColumnMajor);
                    acc[q] = coopMatMulAdd(a, b, acc[q]);
                }
            }
        }
        barrier();
    }

    for (uint q = 0u; q < PER_SG; ++q) {
        uint t = sg + nsg * q;
        if (t < NT) {
            uint tm = t / CN, tn = t % CN;
            coopMatStore(acc[q], Cs, tn * TN * BM + tm * TM, BM, gl_CooperativeMatrixLayoutColumnMajor);
        }
    }
    barrier();
    for (uint e = tid; e < BM * BN; e += gl_WorkGroupSize.x) {
        uint r = r0 + e % BM, n = n0 + e / BM;
        if (r < p.n_out && n < p.n_tok) store_out(Cs[e], r, n);
    }
}
