// The row-group core of the decode GEMVs (gemv.comp, gemv_id.comp): a workgroup of WG
// invocations is cut into WG/TPR row groups ("teams") of TPR consecutive invocations; a team
// owns NR weight rows and walks their slices u = lane, lane + TPR, ... (the loads of all NR rows'
// slices first, so they are in flight together; x is read once per slice for the NR rows), then
// sums its lanes: shuffle-xor butterfly when the team fits in a subgroup (no shared memory, no
// barrier; every lane ends with the same sums), else subgroupAdd and one shared slot per
// subgroup, summed in subgroup order. TPR (a power of two) is chosen per GEMV from K and the row
// count (matmul.gemv_plan), so short rows (K = 320: 10 slices) do not idle most of a 128-wide
// workgroup and long ones still spread over enough invocations.
// Columns: a pass accumulates NCOL token columns at once (llama.cpp's NUM_COLS): each slice's
// weights are loaded once and dotted with every column's x, into acc[c·NR + i]; on f32 x each
// 4-code piece of a slice is decoded once (slice_codes) and used for every column:
//   DEQ = 1 (VKFLASH_GEMV_DEQ): turned into weights once, a·code + b with the run's (a, b)
//     (slice_affine), then dotted with each column: a column costs one FMA per weight and holds
//     only its NR sums (H200, 7 columns: Q4_K 2560×12288 95 → 44 µs; one column 18.1 → 19.8 µs);
//   DEQ = 0: dotted as codes per column and run, then scaled per column (slice_sum: slice_dot's
//     sums), one FMA per weight fewer, but 2·NR run sums and two x sums live per column.
// Each column's sum is formed in the same order as with NCOL = 1 (one column per pass, the
// per-column loop that VKFLASH_GEMV_COLS=0 keeps), so both give the same bits, and an MTP verify's
// rows those of decode steps.
//
// Two inner loops, by GEMV_Q8:
//   f32 x (default): common/quant.glsl's slices (32 elements; K-quants one 16-byte quant chunk),
//     x read from the buffer (L1) as f32, the codes decoded in the integer domain 4 per word and
//     turned to f32 without int→float instructions (QUANT_FAST_CVT).
//   GEMV_Q8: the pass's NCOL rows of x are first quantized by the workgroup into shared memory
//     (KQ·NCOL + KQ·NCOL/4 bytes: matmul.gemv_cols fits NCOL to the device), blocks of 32
//     as in llama.cpp (d = amax/127, x_q = roundf(x/d) with x·(1/d), half away from zero), then
//     common/quant_q8.glsl's integer-dot slices. Result: Σ W_deq·(d·x_q), so
//     |y − y_f32| ≤ Σ_k |W[r, k]|·d_{b(k)}/2 (+ f32 rounding): the activation quantization is
//     the accuracy trade llama.cpp's MMVQ makes (~1e-2 relative at worst, far less typically).
//
// The includer defines, before including: TPR, NR, NCOL, SG_MIN, DEQ (constants), GEMV_Q8 and KQ (the
// shared x capacity in elements per column) for the integer path, the f32 x buffer xv (vec4), and
//   uint gemv_wrow(uint i)   global weight row of the team's decoded row i (i < NR)
//   uint gemv_xrow(uint c)   vec4 index of the x row of the pass's column c (c < NCOL)
//   vec4 gemv_xpre(vec4 v)   a transform of each loaded x element (identity, or HC's ℓ)
// and calls gemv_setup() once, then gemv_pass(K) (every invocation of the workgroup must call it:
// it holds barriers) for each pass; the team's sums are in acc[].

#extension GL_KHR_shader_subgroup_shuffle : require

const uint WG = gl_WorkGroupSize.x;
const uint TEAMS = WG / TPR;  // row groups per workgroup

const uint NACC = NCOL * NR;
float acc[NACC];  // the team's sums, column c row i at c·NR + i (after gemv_pass: the team's, in every lane)
uint g_team;     // team index in the workgroup
uint g_lane;     // invocation index within the team

shared float gred[(WG / SG_MIN) * NACC];  // subgroup partials of teams wider than a subgroup

#ifdef GEMV_Q8
shared uvec4 xq4[NCOL * (KQ / 16u)];    // column c's blocks from c·KQ/16
shared uvec2 xmeta[NCOL * (KQ / 32u)];  // and c·KQ/32
#include "common/quant_q8.glsl"
#endif

void gemv_setup() {
    const uint li = gl_SubgroupID * gl_SubgroupSize + gl_SubgroupInvocationID;  // teams follow the subgroups
    g_team = li / TPR;
    g_lane = li % TPR;
}

#ifdef GEMV_Q8
// roundf: half away from zero, exactly (gguf-py's np_roundf): frac ≥ 0.5 rounds the magnitude up.
float roundf_(float v) {
    precise float a = abs(v);
    precise float f = floor(a);
    precise float b = f + floor(2.0 * (a - f));
    return v < 0.0 ? -b : b;
}

// The pass's NCOL x rows (K elements each, gemv_xrow) → xq4 / xmeta: each invocation quantizes 16
// elements, the two halves of a block are neighbouring invocations (the block max and the half
// sums are exchanged by shuffle-xor 1; K/16 is even, so a pair never straddles two columns).
// Ends with a barrier.
void quantize_x(uint K) {
    barrier();  // the previous pass's readers are done with xq4 / xmeta
    const uint li = gl_SubgroupID * gl_SubgroupSize + gl_SubgroupInvocationID;
    const uint vpc = K / 16u;  // 16-element pieces per column
    for (uint n = li; n < NCOL * vpc; n += WG) {
        const uint col = n / vpc, v = n - col * vpc, xb = gemv_xrow(col);
        vec4 a[4];
        float m = 0.0;
        [[unroll]] for (uint q = 0u; q < 4u; ++q) {
            a[q] = gemv_xpre(xv[xb + 4u * v + q]);
            m = max(m, max(max(abs(a[q].x), abs(a[q].y)), max(abs(a[q].z), abs(a[q].w))));
        }
        m = max(m, subgroupShuffleXor(m, 1u));
        precise float d = m / 127.0;
        const float id = d != 0.0 ? 1.0 / d : 0.0;
        uvec4 packed;
        int s = 0;
        [[unroll]] for (uint q = 0u; q < 4u; ++q) {
            precise vec4 t = a[q] * id;
            const ivec4 c = ivec4(roundf_(t.x), roundf_(t.y), roundf_(t.z), roundf_(t.w));
            s += c.x + c.y + c.z + c.w;
            packed[q] = (uint(c.x) & 0xFFu) | ((uint(c.y) & 0xFFu) << 8) | ((uint(c.z) & 0xFFu) << 16) | (uint(c.w) << 24);
        }
        const int so = subgroupShuffleXor(s, 1u);
        xq4[col * (KQ / 16u) + v] = packed;
        if ((v & 1u) == 0u)
            xmeta[col * (KQ / 32u) + (v >> 1)] = uvec2(floatBitsToUint(d), (uint(s) & 0xFFFFu) | (uint(so) << 16));
    }
    barrier();
}
#endif

// Sum the team's lanes: every lane ends with the team's sums in acc[].
void gemv_reduce() {
    if (TPR <= gl_SubgroupSize) {
        [[unroll]] for (uint m = TPR / 2u; m > 0u; m >>= 1u)
            [[unroll]] for (uint i = 0u; i < NACC; ++i) acc[i] += subgroupShuffleXor(acc[i], m);
    } else {
        [[unroll]] for (uint i = 0u; i < NACC; ++i) {
            const float s = subgroupAdd(acc[i]);
            if (subgroupElect()) gred[gl_SubgroupID * NACC + i] = s;
        }
        barrier();
        const uint per = TPR / gl_SubgroupSize, sg0 = g_team * per;
        [[unroll]] for (uint i = 0u; i < NACC; ++i) {
            float s = 0.0;
            for (uint k = 0u; k < per; ++k) s += gred[(sg0 + k) * NACC + i];
            acc[i] = s;
        }
        barrier();  // gred is reused by the next pass
    }
}

// The team's NR row sums Σ_k W[gemv_wrow(i), k]·x_c[k] for the pass's NCOL columns c (x_c at vec4
// index gemv_xrow(c)): acc[c·NR + i].
void gemv_pass(uint K) {
    [[unroll]] for (uint i = 0u; i < NACC; ++i) acc[i] = 0.0;
#ifdef GEMV_Q8
    const uint qpr = K / QE;  // slices per row
    QSlice w[NR];  // all rows' loads first; the first slice's are issued before the quantization's
    if (g_lane < qpr)  // barriers, so their latency overlaps it
        [[unroll]] for (uint i = 0u; i < NR; ++i) w[i] = qslice_fetch(gemv_wrow(i) * qpr + g_lane);
    quantize_x(K);
    for (uint u = g_lane; u < qpr; u += TPR) {
        if (u != g_lane)
            [[unroll]] for (uint i = 0u; i < NR; ++i) w[i] = qslice_fetch(gemv_wrow(i) * qpr + u);
        [[unroll]] for (uint c = 0u; c < NCOL; ++c)
            [[unroll]] for (uint i = 0u; i < NR; ++i) acc[c * NR + i] += qslice_dot(w[i], u, c * (KQ / 16u));
    }
#else
    const uint gpr = K / 32u;
    for (uint u = g_lane; u < gpr; u += TPR) {
        Slice w[NR];  // all rows' loads first, once for every column
        [[unroll]] for (uint i = 0u; i < NR; ++i) w[i] = slice_fetch(gemv_wrow(i) * gpr + u);
        const uvec2 runs = slice_runs(u) / 4u;
        if (DEQ != 0u) {
            vec4 ab[NR];  // each run's weights, a·code + b
            [[unroll]] for (uint i = 0u; i < NR; ++i) ab[i] = slice_affine(w[i]);
            [[unroll]] for (uint q = 0u; q < 4u; ++q) {
                vec4 v0[NR], v1[NR];  // the rows' weights at x[runs.x + q] and x[runs.y + q], for every column
                [[unroll]] for (uint i = 0u; i < NR; ++i) {
                    v0[i] = fma(slice_codes(w[i], q), vec4(ab[i].x), vec4(ab[i].y));
                    v1[i] = fma(slice_codes(w[i], q + 4u), vec4(ab[i].z), vec4(ab[i].w));
                }
                [[unroll]] for (uint c = 0u; c < NCOL; ++c) {
                    const uint xb = gemv_xrow(c);
                    const vec4 x0 = gemv_xpre(xv[xb + runs.x + q]), x1 = gemv_xpre(xv[xb + runs.y + q]);
                    [[unroll]] for (uint i = 0u; i < NR; ++i) acc[c * NR + i] += dot(v0[i], x0) + dot(v1[i], x1);
                }
            }
            continue;
        }
        // slice_dot's sums for every (column, row), each code vec4 decoded once for all columns
        float s0[NACC], s1[NACC];
        // the runs' running x sums: xs = dot(((x0 + x1) + x2) + x3, 1), as slice_dot's callers form it
        vec4 xr0[NCOL], xr1[NCOL];
        [[unroll]] for (uint j = 0u; j < NACC; ++j) { s0[j] = 0.0; s1[j] = 0.0; }
        [[unroll]] for (uint q = 0u; q < 4u; ++q) {
            vec4 c0[NR], c1[NR];
            [[unroll]] for (uint i = 0u; i < NR; ++i) {
                c0[i] = slice_codes(w[i], q);
                c1[i] = slice_codes(w[i], q + 4u);
            }
            [[unroll]] for (uint c = 0u; c < NCOL; ++c) {
                const uint xb = gemv_xrow(c);
                const vec4 x0 = gemv_xpre(xv[xb + runs.x + q]), x1 = gemv_xpre(xv[xb + runs.y + q]);
                xr0[c] = q == 0u ? x0 : xr0[c] + x0;
                xr1[c] = q == 0u ? x1 : xr1[c] + x1;
                [[unroll]] for (uint i = 0u; i < NR; ++i) {
                    s0[c * NR + i] += dot(c0[i], x0);
                    s1[c * NR + i] += dot(c1[i], x1);
                }
            }
        }
        const vec4 one = vec4(1.0);
        [[unroll]] for (uint c = 0u; c < NCOL; ++c) {
            const vec2 xs = vec2(dot(xr0[c], one), dot(xr1[c], one));
            [[unroll]] for (uint i = 0u; i < NR; ++i)
                acc[c * NR + i] += slice_sum(w[i], s0[c * NR + i], s1[c * NR + i], xs);
        }
    }
#endif
    gemv_reduce();
}
