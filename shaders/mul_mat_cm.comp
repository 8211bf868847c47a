#version 450
// Cooperative-matrix GEMM for prefill (GL_KHR_cooperative_matrix, f16 inputs, f32 accumulators):
// y[n, r] = epilogue(Σ_k W[r, k] x[n, k]) (interface, buffers and epilogue: common/mm.glsl; W
// decoders: common/quant.glsl, QTYPE define; tiles, pipeline and staging: common/mm_cm.glsl).
// A workgroup owns BM weight rows × BN tokens (grid x = row tiles, y = token tiles); the tile and
// warp-tile sizes, the coopmat shape and the subgroup bound are specialization constants chosen in
// vkflash/gpu/ops/matmul.py from the device's capabilities. Ragged n_out / n_tok: the fetches clamp
// rows and tokens into range and the store skips elements outside the output.
// MoE: expert e of a stack {K, out, E} is w_row0 = e*out (push constant).
// Split-K (grid z = S > 1, vkflash/gpu/ops/matmul.py split_k): workgroup z sums the 32-groups
// z·k_chunk .. min((z+1)·k_chunk, K/32) - 1 only and stores its raw partial tile (the host passes
// EPILOGUE = 0 and y = the f32 partials, n_out wide) as token rows z·n_tok + n; mm_reduce.comp then
// sums the S partials in order and applies the epilogue. S = 1: k_chunk = K/32, the whole row.
#extension GL_GOOGLE_include_directive : require
#include "common/base.glsl"
#define QUANT_BINDING 0
#include "common/quant.glsl"
#define MM_PUSH_MORE uint k_chunk;
#include "common/mm.glsl"
const uint NB = 1u;
#include "common/mm_cm.glsl"

uint cm_r0, cm_n0;

uint cm_w_row(uint b, uint row) { return p.w_row0 + min(cm_r0 + row, p.n_out - 1u); }
uint cm_x_base(uint n) { return (p.x_off + min(cm_n0 + n, p.n_tok - 1u) * p.x_stride) / 4u; }
void cm_store(float v, uint r, uint n) {
    r += cm_r0;
    n += cm_n0;
    if (r < p.n_out && n < p.n_tok) store_out(v, r, n + gl_WorkGroupID.z * p.n_tok);
}

void main() {
    cm_r0 = gl_WorkGroupID.x * BM;
    cm_n0 = gl_WorkGroupID.y * BN;
    const uint gpr = p.K / 32u, u0 = gl_WorkGroupID.z * p.k_chunk;
    cm_gemm(gpr, u0, min(p.k_chunk, gpr - u0));
}
