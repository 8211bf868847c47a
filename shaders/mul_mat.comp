#version 450
// Scalar tiled GEMM for prefill: y[n, r] = epilogue(Σ_k W[r, k] x[n, k]) (interface and buffers:
// common/mm.glsl; W decoders: common/quant.glsl, QTYPE define). f32 throughout.
// A workgroup of 256 invocations (16×16) owns a BM×BN tile (BM = 64 weight rows × BN = 64 tokens;
// grid x = row tiles, y = token tiles). Per 32-wide k step, 64 invocations each decode one weight
// row's 32-element group into shared memory once and all 256 stage the token tile; the decoded
// tile is then reused by every token of the tile. Invocation (tx, ty) accumulates rows
// tx + 16i and tokens ty + 16j (i, j < 4): conflict-free shared reads, coalesced stores.
// MoE: expert e of a stack {K, out, E} is w_row0 = e*out (push constant).
// Split-K (grid z = S > 1): as mul_mat_cm.comp, workgroup z sums 32-groups z·k_chunk .. and stores
// raw partials as token rows z·n_tok + n for mm_reduce.comp.
#extension GL_GOOGLE_include_directive : require
#include "common/base.glsl"
#define QUANT_BINDING 0
#include "common/quant.glsl"
#define MM_PUSH_MORE uint k_chunk;
#include "common/mm.glsl"

const uint BM = 64u, BN = 64u, BK = 32u, SK = BK + 1u, TI = 4u, TJ = 4u;
shared float As[BM * SK];
shared float Bs[BN * SK];

void main() {
    const uint tid = gl_LocalInvocationID.x, tx = tid % 16u, ty = tid / 16u;
    const uint r0 = gl_WorkGroupID.x * BM, n0 = gl_WorkGroupID.y * BN;
    const uint gpr = p.K / 32u, u0 = gl_WorkGroupID.z * p.k_chunk, u1 = min(u0 + p.k_chunk, gpr);

    float acc[TI * TJ];
    for (uint a = 0u; a < TI * TJ; ++a) acc[a] = 0.0;

    for (uint u = u0; u < u1; ++u) {
        if (tid < BM) {
            vec4 w[8];
            dequant_group((p.w_row0 + min(r0 + tid, p.n_out - 1u)) * gpr + u, w);
            for (uint q = 0u; q < 8u; ++q)
                for (uint c = 0u; c < 4u; ++c) As[tid * SK + 4u * q + c] = w[q][c];
        }
        for (uint e = tid; e < BN * 8u; e += gl_WorkGroupSize.x) {
            uint n = e / 8u, q = e % 8u;
            vec4 xx = xv[(p.x_off + min(n0 + n, p.n_tok - 1u) * p.x_stride) / 4u + u * 8u + q];
            for (uint c = 0u; c < 4u; ++c) Bs[n * SK + 4u * q + c] = xx[c];
        }
        barrier();
        for (uint k = 0u; k < BK; ++k) {
            float a[TI], b[TJ];
            for (uint i = 0u; i < TI; ++i) a[i] = As[(tx + 16u * i) * SK + k];
            for (uint j = 0u; j < TJ; ++j) b[j] = Bs[(ty + 16u * j) * SK + k];
            for (uint i = 0u; i < TI; ++i)
                for (uint j = 0u; j < TJ; ++j) acc[i * TJ + j] = fma(a[i], b[j], acc[i * TJ + j]);
        }
        barrier();
    }

    for (uint i = 0u; i < TI; ++i) {
        for (uint j = 0u; j < TJ; ++j) {
            uint r = r0 + tx + 16u * i, n = n0 + ty + 16u * j;
            if (r < p.n_out && n < p.n_tok) store_out(acc[i * TJ + j], r, n + gl_WorkGroupID.z * p.n_tok);
        }
    }
}
