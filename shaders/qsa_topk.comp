#version 450
// QSA selection (MODEL.md Q6-Q8) for each query t of the ubatch, at position t_pos = p0 + t
// (p0 = params[param_off]): if t_pos + 1 <= W the query is dense (cells 0..t_pos); else it keeps
// the tail cells [nb*r, t_pos] (nb = floor((t_pos+1)/r), tau = t_pos + 1 - nb*r of them) and
//   CELL=0 (`block`, Q8): the cells of the kb best visible blocks by (score desc, block asc);
//   CELL=1 (`cell`, Q7, tie rule `index`): the top-W cells by (c desc, cell asc) with c = the
//     block score and +inf on the tail, i.e. the kb best blocks whole plus the first r-1-tau
//     cells of the (kb+1)-th best block (it always exists: t_pos + 1 > W gives nb > kb).
// Scores come from scores[s_off + t*s_row + b], b < nb. The top-k of blocks (k = kb, or kb + 1 in
// cell mode) is an exact radix select (8 passes of 8 bits) on the unique 64-bit key
// (score bits, ~b), so any kb and any nb work (no 1024 limit) and ties go to the lower block
// index. Scores are >= 0 (sums of relu); a -0.0 counts as 0.
// Output, by spec LIST:
//   LIST=1: the sorted cell list cell_list[list_off + t*list_row + i] (selected blocks' cells in ascending
//           block order, then the tail) and gp[gp_off + 2t] = t_pos, gp[gp_off + 2t + 1] = count,
//           ready as the params and CellList of a gathered attn_flash (decode).
//   LIST=0: bit rows for a masked attn_flash: bit j of bit_rows[bits_off + t*bits_row + j/32] =
//           (j selected), for the words j < t_pos + 1 covers (the attention never looks further).
// One workgroup per query. Buffers: 0 params (int32), 1 scores (f32), 2 gp (int32), 3 cell_list
// (uint), 4 bit_rows (uint); 2 and 3 are unused when LIST=0, 4 when LIST=1.
// Spec: 1 LIST, 2 CELL.
#extension GL_GOOGLE_include_directive : require
#include "common/base.glsl"

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

shared uint hist[256];
shared uint sh_sel[2];      // selected key so far (hi, lo) while selecting
shared uint sh_rem;         // how many of the kb are still to be placed in the current prefix
shared uint sub_tot[gl_WorkGroupSize.x];
shared uint sh_base;

uint key_hi(uint b, uint t) {
    const float s = scores[p.s_off + t * p.s_row + b];
    return s > 0.0 ? floatBitsToUint(s) : 0u;
}

void set_cell(uint j, uint t) {
    if (LIST == 0u) atomicOr(bit_rows[p.bits_off + t * p.bits_row + (j >> 5)], 1u << (j & 31u));
}

void main() {
    const uint tid = gl_LocalInvocationID.x, WG = gl_WorkGroupSize.x, t = gl_WorkGroupID.x;
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
    const uint k_sel = CELL != 0u ? p.kb + 1u : p.kb;        // blocks the radix select ranks
    const uint part = CELL != 0u ? p.r - 1u - tail : p.r;   // cells kept of the k_sel-th block
    const uint n_blk_cells = (k_sel - 1u) * p.r + part;     // selected cells outside the tail
    // Radix select of the k_sel-th largest key (hi = score bits, lo = ~b), most significant byte first.
    uint khi = 0u, klo = 0u, mhi = 0u, mlo = 0u;
    if (tid == 0u) sh_rem = k_sel;
    for (uint pass = 0u; pass < 8u; ++pass) {
        for (uint i = tid; i < 256u; i += WG) hist[i] = 0u;
        barrier();
        const uint shift = 8u * (3u - (pass & 3u));
        for (uint b = tid; b < nb; b += WG) {
            const uint hi = key_hi(b, t), lo = ~b;
            if ((hi & mhi) == khi && (lo & mlo) == klo) atomicAdd(hist[((pass < 4u ? hi : lo) >> shift) & 255u], 1u);
        }
        barrier();
        if (tid == 0u) {
            uint above = 0u, d = 255u;
            while (d > 0u && above + hist[d] < sh_rem) { above += hist[d]; --d; }
            sh_rem -= above;
            sh_sel[0] = d;
        }
        barrier();
        const uint d = sh_sel[0];
        if (pass < 4u) { khi |= d << shift; mhi |= 255u << shift; }
        else { klo |= d << shift; mlo |= 255u << shift; }
        barrier();
    }
    // Emit the selected blocks in ascending order: r cells of each key above the k_sel-th key
    // (k_sel - 1 of them) and `part` cells of the block holding that key.
    if (tid == 0u) sh_base = 0u;
    barrier();
    for (uint c0 = 0u; c0 < nb; c0 += WG) {
        const uint b = c0 + tid;
        uint f = 0u;
        if (b < nb) {
            const uint hi = key_hi(b, t), lo = ~b;
            f = (hi > khi || (hi == khi && lo > klo)) ? p.r : (hi == khi && lo == klo) ? part : 0u;
        }
        if (LIST == 0u) {
            for (uint i = 0u; i < f; ++i) set_cell(b * p.r + i, t);
            continue;
        }
        const uint incl = subgroupInclusiveAdd(f);
        if (gl_SubgroupInvocationID == gl_SubgroupSize - 1u) sub_tot[gl_SubgroupID] = incl;
        barrier();
        if (tid == 0u) {
            uint run = sh_base;
            for (uint s = 0u; s < gl_NumSubgroups; ++s) { const uint x = sub_tot[s]; sub_tot[s] = run; run += x; }
            sh_base = run;
        }
        barrier();
        const uint first = sub_tot[gl_SubgroupID] + incl - f;  // cells before block b
        for (uint i = 0u; i < f; ++i) cell_list[row + first + i] = b * p.r + i;
        barrier();
    }
    for (uint i = tid; i < tail; i += WG) {
        if (LIST != 0u) cell_list[row + n_blk_cells + i] = nb * p.r + i; else set_cell(nb * p.r + i, t);
    }
    if (LIST != 0u && tid == 0u) {
        gp[p.gp_off + 2u * t] = int(t_pos);
        gp[p.gp_off + 2u * t + 1u] = int(n_blk_cells + tail);
    }
}
