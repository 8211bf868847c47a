#version 450
// QSA selection (MODEL.md Q6-Q8), the same interface and result as shaders/qsa_topk.comp (which
// VKFLASH_TOPK_WIDE=0 keeps): per query t at t_pos = p0 + t, dense cells 0..t_pos when t_pos + 1 <= W,
// else the tail cells [nb*r, t_pos] and the blocks of the k_sel best keys (score desc, block asc):
// all r cells of each but the k_sel-th, `part` cells of that one (CELL=0 `block`: k_sel = kb, part
// = r; CELL=1 `cell`: k_sel = kb + 1, part = r - 1 - tau). Output by LIST: the sorted cell list +
// gather params, or bit rows (see qsa_topk.comp).
// How it runs, one wide workgroup per query (the device's largest up to 1024 invocations), with
// few passes and no serial loops:
//  1. radix select of the k_sel-th largest score bits u (scores >= 0, -0.0 as 0, so the f32 bits
//     order like the values) in 3 passes of 11/11/10 bits over a 2048-bin shared histogram; the bin
//     holding the k_sel-th key is found by a workgroup suffix scan (each invocation owns a run of
//     bins, highest first), not by one invocation walking 256 bins;
//  2. u* = that key and need = how many blocks with u = u* are taken: the lowest-indexed ones (ties
//     to the lower block); the k_sel-th key is the last of them (its rank among equals = need - 1);
//  3. each invocation owns a contiguous run of blocks: one workgroup scan of the u = u* counts gives
//     every block's rank among equals, a second one of the cells each block emits gives every
//     block's place in the ascending list (LIST=1); bit rows are set directly (LIST=0).
// Buffers: 0 params (int32), 1 scores (f32), 2 gp (int32), 3 cell_list (uint), 4 bit_rows (uint).
// Spec: 1 LIST, 2 CELL.
#extension GL_GOOGLE_include_directive : require
#include "common/base.glsl"
#extension GL_KHR_shader_subgroup_shuffle : require

layout(constant_id = 1) const uint LIST = 1;
layout(constant_id = 2) const uint CELL = 0;

layout(std430, binding = 0) readonly buffer Params { int params[]; };
layout(std430, binding = 1) readonly buffer Scores { float scores[]; };
layout(std430, binding = 2) writeonly buffer GP { int gp[]; };
layout(std430, binding = 3) writeonly buffer List { uint cell_list[]; };
layout(std430, binding = 4) coherent buffer Bits { uint bit_rows[]; };

layout(push_constant) uniform P {
    uint param_off; uint r; uint kb; uint W; uint s_off; uint s_row; uint list_off; uint list_row; uint gp_off;
    uint bits_off; uint bits_row;
} p;

const uint WG = gl_WorkGroupSize.x;
const uint NBINS = 2048u;
const uint BPT = (NBINS + WG - 1u) / WG;  // bins per invocation (descending: invocation i owns the i-th highest run)

shared uint hist[NBINS];
shared uint scan_sg[WG];  // per-subgroup totals of a workgroup scan
shared uint sh_digit, sh_rem;

uint key(uint b, uint t) {
    const float s = scores[p.s_off + t * p.s_row + b];
    return s > 0.0 ? floatBitsToUint(s) : 0u;
}

void set_cell(uint j, uint t) {
    if (LIST == 0u) atomicOr(bit_rows[p.bits_off + t * p.bits_row + (j >> 5)], 1u << (j & 31u));
}

// Exclusive prefix sum of v over the invocations in local index order, and the total. Call from
// uniform control flow.
uint wg_exclusive_add(uint v, out uint total) {
    const uint incl = subgroupInclusiveAdd(v);
    if (gl_SubgroupInvocationID == gl_SubgroupSize - 1u) scan_sg[gl_SubgroupID] = incl;
    barrier();
    uint base = 0u;
    total = 0u;
    if (gl_NumSubgroups <= gl_SubgroupSize) {  // one subgroup-wide scan of the totals (GPUs: 32 of 32)
        const uint x = gl_SubgroupInvocationID < gl_NumSubgroups ? scan_sg[gl_SubgroupInvocationID] : 0u;
        base = subgroupShuffle(subgroupExclusiveAdd(x), gl_SubgroupID);
        total = subgroupAdd(x);
    } else {
        for (uint s = 0u; s < gl_NumSubgroups; ++s) {
            const uint x = scan_sg[s];
            base += s < gl_SubgroupID ? x : 0u;
            total += x;
        }
    }
    barrier();  // scan_sg is reused by the next scan
    return base + incl - v;
}

void main() {
    const uint tid = gl_SubgroupID * gl_SubgroupSize + gl_SubgroupInvocationID;  // scans follow the subgroups
    const uint t = gl_WorkGroupID.x;
    const uint t_pos = uint(params[p.param_off]) + t;
    const uint n_cells = t_pos + 1u;
    const uint row = p.list_off + t * p.list_row;
    if (LIST == 0u) {
        for (uint w = tid; w < (n_cells + 31u) / 32u; w += WG) bit_rows[p.bits_off + t * p.bits_row + w] = 0u;
        memoryBarrierBuffer();
        barrier();
    }
    if (n_cells <= p.W) {  // (Q6) exactly dense
        for (uint j = tid; j < n_cells; j += WG) {
            if (LIST != 0u) cell_list[row + j] = j; else set_cell(j, t);
        }
        if (LIST != 0u && tid == 0u) {
            gp[p.gp_off + 2u * t] = int(t_pos);
            gp[p.gp_off + 2u * t + 1u] = int(n_cells);
        }
        return;
    }
    const uint nb = n_cells / p.r, tail = n_cells - nb * p.r;
    const uint k_sel = CELL != 0u ? p.kb + 1u : p.kb;
    const uint part = CELL != 0u ? p.r - 1u - tail : p.r;
    const uint n_blk_cells = (k_sel - 1u) * p.r + part;

    // 1. radix select of the k_sel-th largest u: digits of bits 21..31, 10..20, 0..9
    uint prefix = 0u, pmask = 0u, rem = k_sel;
    for (uint pass = 0u; pass < 3u; ++pass) {
        const uint shift = pass == 0u ? 21u : (pass == 1u ? 10u : 0u);
        const uint dmask = pass == 2u ? 1023u : 2047u;
        for (uint i = tid; i < NBINS; i += WG) hist[i] = 0u;
        barrier();
        for (uint b = tid; b < nb; b += WG) {
            const uint u = key(b, t);
            if ((u & pmask) == prefix) atomicAdd(hist[(u >> shift) & dmask], 1u);
        }
        barrier();
        uint own = 0u;
        for (uint i = 0u; i < BPT; ++i) {
            const uint bin = NBINS - 1u - (tid * BPT + i);
            own += bin < NBINS ? hist[bin] : 0u;  // bin wraps past 0 when BPT·WG > NBINS
        }
        uint total;
        uint above = wg_exclusive_add(own, total);  // keys in higher bins than this invocation's run
        for (uint i = 0u; i < BPT; ++i) {
            const uint bin = NBINS - 1u - (tid * BPT + i);
            if (bin >= NBINS) break;
            const uint c = hist[bin];
            if (above < rem && rem <= above + c) { sh_digit = bin; sh_rem = rem - above; }
            above += c;
        }
        barrier();
        prefix |= sh_digit << shift;
        pmask |= dmask << shift;
        rem = sh_rem;
        barrier();  // sh_digit, sh_rem and hist are rewritten by the next pass
    }
    const uint ustar = prefix, need = rem;  // the k_sel-th key: the need-th block (by index) with u = u*

    // 2./3. contiguous runs of blocks: rank among equals, then places in the list
    const uint per = (nb + WG - 1u) / WG, b0 = min(tid * per, nb), b1 = min(b0 + per, nb);
    uint eq = 0u;
    for (uint b = b0; b < b1; ++b) eq += key(b, t) == ustar ? 1u : 0u;
    uint unused;
    const uint eq0 = wg_exclusive_add(eq, unused);
    uint cells = 0u;
    {
        uint e = eq0;
        for (uint b = b0; b < b1; ++b) {
            const uint u = key(b, t);
            const uint f = u > ustar ? p.r : (u == ustar && e < need ? (e == need - 1u ? part : p.r) : 0u);
            e += u == ustar ? 1u : 0u;
            cells += f;
            if (LIST == 0u) for (uint i = 0u; i < f; ++i) set_cell(b * p.r + i, t);
        }
    }
    if (LIST != 0u) {
        uint first = wg_exclusive_add(cells, unused);  // cells before this run
        uint e = eq0;
        for (uint b = b0; b < b1; ++b) {
            const uint u = key(b, t);
            const uint f = u > ustar ? p.r : (u == ustar && e < need ? (e == need - 1u ? part : p.r) : 0u);
            e += u == ustar ? 1u : 0u;
            for (uint i = 0u; i < f; ++i) cell_list[row + first + i] = b * p.r + i;
            first += f;
        }
    }
    for (uint i = tid; i < tail; i += WG) {
        if (LIST != 0u) cell_list[row + n_blk_cells + i] = nb * p.r + i; else set_cell(nb * p.r + i, t);
    }
    if (LIST != 0u && tid == 0u) {
        gp[p.gp_off + 2u * t] = int(t_pos);
        gp[p.gp_off + 2u * t + 1u] = int(n_blk_cells + tail);
    }
}
