#version 450
// Quantized GEMV for decode / MTP verify: y[n, r] = epilogue(Σ_k W[r, k] x[n, k]) for a few
// token columns n (interface and buffers: common/mm.glsl; W decoders: common/quant.glsl, QTYPE
// define). f32 accumulation.
// Normal mode: a workgroup owns NDEC consecutive weight rows (workgroup id = x + y*groups_x; in
// the fused modes below, M rows of each stacked block) and all NPLAIN = n_tok (1..8) columns.
// Transposed mode (tiny output, n_out <= 8, e.g. the HC inject W_inj ∈ R^{4×10240}): a workgroup
// owns NPLAIN tokens and all NDEC = n_out weight rows.
// Columns are taken NCOL at a time (constant_id 9; the passes a rolled loop): every invocation
// walks 32-element slices u = tid, tid + WG, ... of the rows (common/quant.glsl
// slice_fetch/slice_dot: for K-quants one 16-byte chunk of quants, so a subgroup reads contiguous
// bytes), issues the loads of all NDEC rows' slices once, then for each of the pass's columns
// loads its matching 32 x elements (and their run sums, for the per-run scales and mins) and dots
// each row with them (x is read from L2 once per NDEC rows: with one row per x load, x traffic
// rather than the weights bounded the GEMV; the weights once per NCOL columns, decoded again by each
// column's slice_dot, where gemv.comp decodes each piece once for all columns). NCOL = 1 (VKFLASH_GEMV_COLS=0, and the
// transposed mode) fetches the rows again per column; each column's sum is formed in the same order
// either way. Partial sums are reduced with subgroupAdd, then one shared slot per subgroup
// (SG_MIN = the device's smallest subgroup size bounds the slot count; gl_SubgroupSize is never
// assumed).
// MoE: an expert stack {K, out, E} is addressed by w_row0 = e*out (push constant); a routed
// variant can derive it from an expert-ids buffer with the same decoders and loop.
// Fused modes (constant_id 6 MODE; normal GEMV only, EPILOGUE = 0): the weight is a stack of
// NSTACK blocks of n_out rows (output row r of block c is weight row w_row0 + c*n_out + r) and a
// workgroup owns M = NDEC / NSTACK output rows, decoding those rows of every block (all NDEC loads
// in flight together); the block sums are combined in the store, with the `precise` ops in the
// order of the plain multi-dispatch path, so both round alike.
//   MODE 0 (plain): NSTACK = 1, y = epilogue(acc) (common/mm.glsl store_out).
//   MODE 1 (GLU, NSTACK = 2): y[n, r] = silu(acc_gate) · acc_up, gate rows [0, F), up rows
//     [F, 2F) of a stacked W (F = n_out); = matmul(gate, silu epilogue) then matmul(up, ⊙ y).
//   MODE 2 (hyper-connection up + mix, NSTACK = HC = hc, constant_id 7): x = ℓ_pre, each loaded
//     element becomes ℓ = silu(ℓ_pre · (1/hc)) (hc.comp PRE) before the dots, s_c = W_up[c·d + r]·ℓ
//     (d = n_out), u[n, r] = (Σ_c σ(s_c) · X[n, c·d + r]) · (1/hc) (hc.comp MIX, streams in order);
//     1/hc is the f32-rounded reciprocal in p.inv_hc, as in hc.comp, so the two agree bit for bit.
//     The streams X are buffer 6 at X[n, j] = streams[streams_off + n*streams_stride + j].
//   MODE 3 (MoE output, NSTACK = 1, TOPK = k at constant_id 8): W is the shared expert's down
//     projection and the store is moe_combine.comp's (M4): y[n, r] = Σ_{j<k} ys[n·k + j, r] (slot
//     order) + σ(g[n])·acc, with ys buffer 7 at ys_off + row·y_stride (y's row stride) and the
//     shared gate logits g buffer 8 at gate_off + n·gate_stride.
// Buffers beyond common/mm.glsl's: 6 streams (MODE 2), 7 ys, 8 gate (MODE 3) (f32; any buffer in
// the other modes). The fused modes use none of the epilogue's (bias, mul, res, scale).
#extension GL_GOOGLE_include_directive : require
#include "common/base.glsl"
#extension GL_EXT_control_flow_attributes : require
#define QUANT_BINDING 0
#include "common/quant.glsl"
#define MM_PUSH_MORE uint streams_off; uint streams_stride; float inv_hc; uint ys_off; uint gate_off; uint gate_stride;
#include "common/mm.glsl"

layout(std430, binding = 6) readonly buffer Streams { float streams[]; };
layout(std430, binding = 7) readonly buffer Ys { float ys[]; };
layout(std430, binding = 8) readonly buffer Gate { float gate[]; };

layout(constant_id = 2) const uint NDEC = 1;    // weight rows decoded by a workgroup
layout(constant_id = 3) const uint NPLAIN = 1;  // x columns dotted with each decoded row
layout(constant_id = 4) const bool TRANSPOSED = false;
layout(constant_id = 5) const uint SG_MIN = 1;
layout(constant_id = 6) const uint MODE = 0;
layout(constant_id = 7) const uint HC = 1;      // MODE 2: hc streams stacked in W_up
layout(constant_id = 8) const uint TOPK = 1;    // MODE 3: routed slots per token
layout(constant_id = 9) const uint NCOL = 1;    // columns per pass (≤ NPLAIN)
const uint NSTACK = MODE == 1u ? 2u : (MODE == 2u ? HC : 1u);  // weight blocks per output row (GLU: 2, HC: hc)
const uint M = NDEC / NSTACK;                   // output rows of a workgroup (normal mode)

const uint NACC = NCOL * NDEC;  // sums of a pass: column c, decoded row i at c·NDEC + i
shared float red[NACC * (gl_WorkGroupSize.x / SG_MIN)];
uint g_col;  // the column being stored (MV_SUM)

// Σ over the subgroups' partial sums of sum a (column c, row i: a = c·NDEC + i).
float row_sum(uint a) {
    float s = 0.0;
    for (uint sg = 0u; sg < gl_NumSubgroups; ++sg) s += red[sg * NACC + a];
    return s;
}

#define MV_SUM(c) row_sum(g_col * NDEC + (c) * M + i)  // block c of output row i, column g_col
#include "common/mv_store.glsl"

void main() {
    const uint tid = gl_LocalInvocationID.x;
    const uint wg = gl_WorkGroupID.y * gl_NumWorkGroups.x + gl_WorkGroupID.x;
    const uint gpr = p.K / 32u;  // slices (32 elements) per row
    const uint r0 = TRANSPOSED ? 0u : wg * M;
    const uint t0 = TRANSPOSED ? wg * NPLAIN : 0u;
    if (TRANSPOSED ? t0 >= p.n_tok : r0 >= p.n_out) return;  // uniform per workgroup

    [[dont_unroll]] for (uint j0 = 0u; j0 < NPLAIN; j0 += NCOL) {
        float acc[NACC];
        [[unroll]] for (uint a = 0u; a < NACC; ++a) acc[a] = 0.0;
        for (uint u = tid; u < gpr; u += gl_WorkGroupSize.x) {
            Slice w[NDEC];  // all rows' loads first, so they are in flight together
            for (uint i = 0u; i < NDEC; ++i)  // block i / M, output row r0 + i % M (a ragged tail repeats the last)
                w[i] = slice_fetch((p.w_row0 + (i / M) * p.n_out + min(r0 + i % M, p.n_out - 1u)) * gpr + u);
            const uvec2 runs = slice_runs(u) / 4u;
            [[unroll]] for (uint c = 0u; c < NCOL; ++c) {  // a ragged pass repeats the last column
                const uint xb = (p.x_off + min(t0 + j0 + c, p.n_tok - 1u) * p.x_stride) / 4u;
                vec4 xg[8];
                for (uint q = 0u; q < 4u; ++q) {
                    xg[q] = xv[xb + runs.x + q];
                    xg[q + 4u] = xv[xb + runs.y + q];
                }
                if (MODE == MODE_HC) {
                    for (uint q = 0u; q < 8u; ++q) {
                        for (uint e = 0u; e < 4u; ++e) {
                            const float a = xg[q][e] * p.inv_hc;  // ℓ = silu(ℓ_pre · (1/hc))
                            xg[q][e] = a * sigmoid(a);
                        }
                    }
                }
                const vec4 one = vec4(1.0);
                const vec2 xs = vec2(dot(xg[0] + xg[1] + xg[2] + xg[3], one), dot(xg[4] + xg[5] + xg[6] + xg[7], one));
                [[unroll]] for (uint i = 0u; i < NDEC; ++i) acc[c * NDEC + i] += slice_dot(w[i], xg, xs);
            }
        }
        [[unroll]] for (uint a = 0u; a < NACC; ++a) {
            float s = subgroupAdd(acc[a]);
            if (subgroupElect()) red[gl_SubgroupID * NACC + a] = s;
        }
        barrier();
        for (uint a = tid; a < NCOL * M; a += gl_WorkGroupSize.x) {
            const uint c = a / M, i = a - c * M;
            g_col = c;
            if (r0 + i < p.n_out && t0 + j0 + c < p.n_tok) store(i, r0 + i, t0 + j0 + c);
        }
        barrier();  // red is reused by the next pass
    }
}
