// Interface shared by the flash-attention kernels attn_flash.comp (scalar) and attn_flash_cm.comp
// (cooperative matrix), MODEL.md A5-A7, Q9, S1-S3: push constants, the buffers other than K/V, which
// rows and key slots a workgroup owns, which slots a query sees, and which key tiles to skip.
// The including kernel defines WG, BR, BC (a divisor of 32, key tiles of BC slots), GATHER, MASKED.
//
// Query tiles: queries come in tiles of TQ (one tile of all T for plain attention; qsa_union's tiles
// for gathered prefill through unions; tiles of one query for per-query cell lists). Tile k holds
// queries [k*TQ, min(T, k*TQ + TQ)); its params are p0 = params[param_off + k*p_stride] (position of
// its first query) and n_kv = params[... + 1], and its cell list starts at cells[cell_off +
// k*c_stride]. Within a tile, rows are (query, q head of kv head g) pairs R = t*G + (h - g*G),
// G = H/H_kv (GQA: q head h reads kv head floor(h/G)), so every key tile serves the whole group.
// Workgroup (x, y, z) = (k*RBK + row block of BR rows, g, split), RBK = ceil(TQ*G/BR).
// Served positions: a dispatch computes (and writes) only the queries at positions in [pos_lo,
// pos_hi); another dispatch serves the rest (QSA prefill: the dense head before W, the lists after).
// Key slots: i in [0, n_iter) is the cache position (dense: n_iter = min(n_kv, p0 + t_last + 1,
// kv_rows), t_last the workgroup's last query) or a slot of the cell list (GATHER: key j =
// cells[...+i], n_iter = n_kv). Split z covers [z*chunk, min(n_iter, (z+1)*chunk)) with chunk =
// ceil(n_iter/n_split) rounded up to BC, so key tiles start at multiples of BC. Query t (index in its
// tile) at position p0 + t sees slot i iff j <= p0 + t, j < kv_rows and, when MASKED, bit i of its
// mask row (row index t + k*TQ, the query's index in the ubatch).
// Tile skipping (MASKED): a key tile in which no query of the workgroup has a mask bit is skipped (no
// loads, no math): it would add exactly zero and leave the running max unchanged.
// Buffers: 0 params (int32), 1 q (f32: q_off + t*q_row + h*q_head + d), 2 gate (f32, same addressing
// with gate_*), 3 K cache, 4 V cache ([kv_rows, H_kv, DH] of the KV type), 5 mask (uint bit rows),
// 6 cells (uint), 7 out (f32; unused with SPLIT), 8 partial (f32; SPLIT only). Unused buffers may be
// any buffer.

layout(std430, binding = 0) readonly buffer Params { int params[]; };
layout(std430, binding = 1) readonly buffer Q { float q[]; };
layout(std430, binding = 2) readonly buffer Gate { float gate[]; };
layout(std430, binding = 5) readonly buffer Mask { uint mask[]; };
layout(std430, binding = 6) readonly buffer Cells { uint cells[]; };
layout(std430, binding = 7) writeonly buffer Out { float outp[]; };
layout(std430, binding = 8) writeonly buffer Partial { float partial[]; };

layout(push_constant) uniform P {
    uint T; uint G; uint H_kv; uint kv_rows;
    uint q_off; uint q_row; uint q_head;
    uint gate_off; uint gate_row; uint gate_head;
    uint o_off; uint o_row; uint o_head;
    uint param_off; uint mask_off; uint mask_stride; uint cell_off;
    uint n_split; float scale;
    uint TQ; uint p_stride; uint c_stride;
    uint pos_lo; uint pos_hi;
} p;

const float NEG = -1.0e30;  // score of a masked key (finite: no reliance on inf arithmetic)
const uint NWIN = 32u;      // words of the tile-skip bitset: 1024 key tiles per window

// What one workgroup computes: rows [r0, min(r0 + BR, rows)) of query tile k (t0 = its first query
// in the ubatch, p0 its first position, rows = its queries x G), kv head g, slots [i_begin, i_end),
// n_kt key tiles of BC slots; tl0..tl1 = the tile-local queries of its rows.
struct AttnWork {
    uint k; uint t0; uint p0; uint rows; uint r0; uint g; uint split;
    uint tl0; uint tl1; uint cell_off; uint i_begin; uint i_end; uint n_kt;
};
AttnWork aw;

// Fills aw for this workgroup; false when its row block lies past the tile's last row served.
bool attn_setup() {
    const uint rbk = (p.TQ * p.G + BR - 1u) / BR;
    aw.k = gl_WorkGroupID.x / rbk;
    aw.r0 = (gl_WorkGroupID.x % rbk) * BR;
    aw.g = gl_WorkGroupID.y;
    aw.split = gl_WorkGroupID.z;
    aw.t0 = aw.k * p.TQ;
    const uint po = p.param_off + aw.k * p.p_stride;
    aw.p0 = uint(params[po]);
    // only queries at positions in [pos_lo, pos_hi): a tile from before pos_lo is skipped whole (a
    // caller with pos_lo > 0 has tiles of one query), rows from pos_hi on are cut
    if (aw.p0 < p.pos_lo || aw.p0 >= p.pos_hi) return false;
    aw.rows = min(min(p.TQ, p.T - aw.t0), p.pos_hi - aw.p0) * p.G;
    if (aw.r0 >= aw.rows) return false;
    const uint n_kv = uint(params[po + 1u]);
    aw.cell_off = p.cell_off + aw.k * p.c_stride;
    aw.tl0 = aw.r0 / p.G;
    aw.tl1 = (min(aw.r0 + BR, aw.rows) - 1u) / p.G;
    const uint n_iter = GATHER ? n_kv : min(min(n_kv, aw.p0 + aw.tl1 + 1u), p.kv_rows);
    const uint chunk = ((n_iter + p.n_split - 1u) / p.n_split + BC - 1u) / BC * BC;
    aw.i_begin = min(aw.split * chunk, n_iter);
    aw.i_end = min(aw.i_begin + chunk, n_iter);
    aw.n_kt = (aw.i_end - aw.i_begin + BC - 1u) / BC;
    return true;
}

// Cache position of slot i.
uint key_of(uint i) { return GATHER ? cells[aw.cell_off + i] : i; }

// Bit c (c < BC) set iff slot i0 + c (i0 a key tile start) is in range and, as far as the slot index
// tells (dense: causality; MASKED: the mask bit), visible to tile-local query tl. Gathered slots still
// need the position check j <= p0 + tl, j < kv_rows.
uint slot_bits(uint tl, uint i0) {
    const uint n = min(BC, aw.i_end - i0);
    uint bits = n >= 32u ? 0xFFFFFFFFu : (1u << n) - 1u;
    if (!GATHER) {
        const uint pos = aw.p0 + tl;
        if (pos < i0) return 0u;
        if (pos - i0 < 31u) bits &= (2u << (pos - i0)) - 1u;
    }
    if (MASKED) bits &= mask[p.mask_off + (aw.t0 + tl) * p.mask_stride + (i0 >> 5)] >> (i0 & 31u);
    return bits;
}

shared uint sWin[NWIN];
uint win_base = 0xFFFFFFFFu;  // first key tile of the window sWin describes

// Bit q of sWin: key tile win_base + q has a slot bit for some query of the workgroup.
void build_window(uint wb) {
    const uint tid = gl_LocalInvocationID.x;
    barrier();  // every invocation is done scanning the previous window
    for (uint w = tid; w < NWIN; w += WG) sWin[w] = 0u;
    barrier();
    for (uint q = tid; q < 32u * NWIN && wb + q < aw.n_kt; q += WG) {
        const uint i0 = aw.i_begin + (wb + q) * BC;
        uint any = 0u;
        for (uint tl = aw.tl0; tl <= aw.tl1; ++tl) any |= slot_bits(tl, i0);
        if (any != 0u) atomicOr(sWin[q >> 5], 1u << (q & 31u));
    }
    barrier();
    win_base = wb;
}

// The first key tile >= q that is not skipped (aw.n_kt when none). Workgroup-uniform: call it from
// uniform control flow (it may rebuild the window, with barriers).
uint next_tile(uint q) {
    if (!MASKED) return q;
    while (q < aw.n_kt) {
        const uint wb = q / (32u * NWIN) * (32u * NWIN);
        if (wb != win_base) build_window(wb);
        uint w = (q - wb) >> 5;
        uint bits = sWin[w] & (0xFFFFFFFFu << ((q - wb) & 31u));
        while (bits == 0u && ++w < NWIN) bits = sWin[w];
        if (bits != 0u) return min(wb + 32u * w + uint(findLSB(bits)), aw.n_kt);
        q = wb + 32u * NWIN;
    }
    return aw.n_kt;
}
