#version 450
// Quantized GEMV for decode / MTP verify: y[n, r] = epilogue(Σ_k W[r, k] x[n, k]) for a few
// token columns n (interface and buffers: common/mm.glsl; W decoders: common/quant.glsl, QTYPE
// define). f32 accumulation.
// Normal mode: a workgroup owns NDEC consecutive weight rows (workgroup id = x + y*groups_x) and
// all NPLAIN = n_tok (1..8) columns. Transposed mode (tiny output, n_out <= 8, e.g. the HC
// inject W_inj ∈ R^{4×10240}): a workgroup owns NPLAIN tokens and all NDEC = n_out weight rows.
// Either way each invocation walks 32-element slices u = tid, tid + WG, ... of its rows
// (common/quant.glsl dequant_slice: for K-quants one 16-byte chunk of quants, so a subgroup reads
// contiguous bytes); per slice it loads each x column's matching 32 elements once and dots them
// with the decoded slice of every row (x is read from L2 once per NDEC rows: with one row per x
// load, x traffic rather than the weights bounded the GEMV). Partial sums are reduced with subgroupAdd, then one shared slot per subgroup
// (SG_MIN = the device's smallest subgroup size bounds the slot count; gl_SubgroupSize is never
// assumed). The row loop is unrolled (the decodes' loads overlap); the column loop is kept
// rolled: unrolled NDEC×NPLAIN times, lavapipe's LLVM takes seconds per pipeline. For NPLAIN > 1
// a group is decoded once per column (ALU, not memory: the block is in L1 after the first).
// MoE: an expert stack {K, out, E} is addressed by w_row0 = e*out (push constant); a routed
// variant can derive it from an expert-ids buffer with the same decoders and loop.
#extension GL_GOOGLE_include_directive : require
#include "common/base.glsl"
#extension GL_EXT_control_flow_attributes : require
#define QUANT_BINDING 0
#include "common/quant.glsl"
#include "common/mm.glsl"

layout(constant_id = 2) const uint NDEC = 1;    // weight rows decoded by a workgroup
layout(constant_id = 3) const uint NPLAIN = 1;  // x columns dotted with each decoded row
layout(constant_id = 4) const bool TRANSPOSED = false;
layout(constant_id = 5) const uint SG_MIN = 1;

const uint NACC = NDEC * NPLAIN;
shared float red[NACC * (gl_WorkGroupSize.x / SG_MIN)];

void main() {
    const uint tid = gl_LocalInvocationID.x;
    const uint wg = gl_WorkGroupID.y * gl_NumWorkGroups.x + gl_WorkGroupID.x;
    const uint gpr = p.K / 32u;  // groups per row
    const uint r0 = TRANSPOSED ? 0u : wg * NDEC;
    const uint t0 = TRANSPOSED ? wg * NPLAIN : 0u;
    if (TRANSPOSED ? t0 >= p.n_tok : r0 >= p.n_out) return;  // uniform per workgroup

    float acc[NACC];
    for (uint a = 0u; a < NACC; ++a) acc[a] = 0.0;

    for (uint u = tid; u < gpr; u += gl_WorkGroupSize.x) {
        const uvec2 runs = slice_runs(u) / 4u;
        [[dont_unroll]] for (uint j = 0u; j < NPLAIN; ++j) {
            uint xb = (p.x_off + min(t0 + j, p.n_tok - 1u) * p.x_stride) / 4u;
            vec4 xg[8];
            for (uint q = 0u; q < 4u; ++q) {
                xg[q] = xv[xb + runs.x + q];
                xg[q + 4u] = xv[xb + runs.y + q];
            }
            for (uint i = 0u; i < NDEC; ++i) {
                vec4 w[8];
                dequant_slice((p.w_row0 + min(r0 + i, p.n_out - 1u)) * gpr + u, w);
                float s = 0.0;
                for (uint q = 0u; q < 8u; ++q) s += dot(w[q], xg[q]);
                acc[i * NPLAIN + j] += s;
            }
        }
    }

    for (uint a = 0u; a < NACC; ++a) {
        float s = subgroupAdd(acc[a]);
        if (subgroupElect()) red[gl_SubgroupID * NACC + a] = s;
    }
    barrier();
    for (uint a = tid; a < NACC; a += gl_WorkGroupSize.x) {
        float s = 0.0;
        for (uint sg = 0u; sg < gl_NumSubgroups; ++sg) s += red[sg * NACC + a];
        uint r = r0 + a / NPLAIN, n = t0 + a % NPLAIN;
        if (r < p.n_out && n < p.n_tok) store_out(s, r, n);
    }
}
