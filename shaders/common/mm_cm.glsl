// Cooperative-matrix GEMM core (GL_KHR_cooperative_matrix; f16 inputs, f32 accumulators), shared by
// mul_mat_cm.comp (dense) and mul_mat_id_cm.comp (routed experts). Include after common/quant.glsl
// (QTYPE decoders at binding 0) and after declaring `xv` (vec4 activations) and NB (weight blocks:
// 1, or 2 = gate and up rows of one output tile). The includer defines the hooks declared below and
// calls cm_gemm(K / 32, u0, steps) from uniform control flow once it knows its tile: the K loop
// covers 32-groups u0 .. u0 + steps - 1 of each row (the whole row: 0, K / 32; split-K: one chunk).
//
// Tile: a workgroup owns BM output rows × BN tokens (NB·BM weight rows). It is cut into warp tiles
// of WM × WN, each a grid of CM × CN coopmat tiles of TM × TN (the device's f16×f16→f32 shape;
// TK its depth). Warp tile t is row block t % (BM/WM), column block t / (BM/WM); subgroup s of n
// owns tiles n-1-s, 2n-1-s, … (cm_tile_of) so any subgroup size works (PER_SG, the accumulator
// count per subgroup, is sized for the fewest subgroups, WG / SG_MAX). With NB = 2 a warp tile
// holds the gate and the up accumulators of the same (row, token) elements, combined
// component-wise at the end.
//
// K loop: 32-wide steps (one quant group per weight row; every K is a multiple of 32, so no tail),
// two shared-memory stages. Step u's tiles sit in stage u & 1 as f16, rows of 32 + 8 pad halves
// (80 B: coopMatLoad rows hit distinct 16-B bank groups); A is row major (weight row, k), B is
// token-major (token, k), read as a column-major K×N matrix. Per step, after one barrier:
//   1. the first half of the workgroup fetches step u+1's weights (raw f16 / bf16 words, 8 per
//      item, 4 lanes to a row; or one 32-group per row: dequant_group of common/quant.glsl rounded
//      to f16) and the second half its activations (8 floats per item, raw f32) into registers;
//   2. every subgroup runs its MMAs on stage u & 1;
//   3. the registers are converted and stored into stage (u+1) & 1.
// So one barrier per step, and the activation (and f16 weight) loads are in flight during the MMAs.
// HALF (spec constant 12 where the includer defines CM_HALF_SPEC; with FAST, for the types whose
// decoders read half groups: CM_GROUP_HALF): every invocation fetches and decodes half a group (16 k
// of a row) and the first BN·4 also an activation item, so a step's decode, which with few tokens per
// tile sets its pace, is spread over the whole workgroup instead of its first half.
// FAST (spec constant 11 where the includer defines CM_FAST_SPEC and has cm_group_load, the expert
// GEMM): groups come from common/quant_group.glsl's wide loads (the same values as dequant_group);
// step 1 only loads their raw words, step 3 decodes them, so the loads are in flight during the
// MMAs. A fetch lane decodes a group of its own weight row (rows 1–2 KB apart), so each narrow
// load of a warp touches as many cache lines as it has lanes: with few tokens per tile (little MMA
// work per step) those load instructions, not DRAM, set the pace.
// Epilogue: KHR leaves the accumulator's element layout opaque and y's stride and offset need not
// meet coopMatStore's 16-B alignment, so each subgroup stages its warp tile through shared memory,
// WM × TN f32 at a time (its own region of the now idle pipeline memory), and its lanes call
// cm_store(v, row, token) per element in f32: consecutive lanes write consecutive rows of a token.

#extension GL_EXT_control_flow_attributes : require
#ifndef CM_EMULATE
#extension GL_KHR_cooperative_matrix : require
#extension GL_KHR_memory_scope_semantics : require
#define CM_UNROLL [[unroll]]
#else
#define CM_UNROLL [[dont_unroll]]  // emulation: loops stay loops (lavapipe's LLVM compile time)
#endif

layout(constant_id = 2) const uint TM = 16;
layout(constant_id = 3) const uint TN = 16;
layout(constant_id = 4) const uint TK = 16;
layout(constant_id = 5) const uint SG_MAX = 32;  // the largest subgroup size the device may use
layout(constant_id = 6) const uint BM = 128;     // output rows per workgroup tile (per weight block)
layout(constant_id = 7) const uint BN = 128;     // tokens per workgroup tile
layout(constant_id = 8) const uint WM = 64;      // warp tile rows
layout(constant_id = 9) const uint WN = 32;      // warp tile tokens

#ifdef CM_FAST_SPEC
layout(constant_id = 11) const bool FAST = false;  // groups by cm_group_load / _decode (wide loads)
#else
const bool FAST = false;
#endif
const uint BK = 32u;                 // k per step: one 32-group per weight row
const uint SA4 = 5u;                 // shared row pitch in uvec4 (40 halves = 32 + 8 pad; 80 B)
const uint WG = gl_WorkGroupSize.x;
#ifdef CM_HALF_SPEC
layout(constant_id = 12) const bool HALF = false;  // FAST groups fetched and decoded in halves (below)
#else
const bool HALF = false;
#endif
#ifdef CM_GROUP_HALF
const bool HALVES = HALF && FAST;
#else
const bool HALVES = false;  // types without half-group decoders fetch whole groups
#endif
const uint WG_A = HALVES ? WG : WG / 2u;  // weight fetchers: invocations 0 .. WG_A - 1
const uint B0 = HALVES ? 0u : WG_A;       // activation fetchers: invocations B0 .. WG - 1
const uint WG_B = WG - B0;
const uint WARPS_M = BM / WM, NWT = WARPS_M * (BN / WN), CM = WM / TM, CN = WN / TN;
const uint NSG_MIN = WG / SG_MAX;
const uint PER_SG = (NWT + NSG_MIN - 1u) / NSG_MIN;
const uint A_ROWS = NB * BM;
#if QTYPE == GGML_TYPE_F16 || QTYPE == GGML_TYPE_BF16
#define CM_RAW
const uint A_IPR = 4u, A_U4 = 1u;  // raw weights: 4 items of 8 halves per row (4 lanes read a row's 64 B)
#else
const uint A_IPR = HALVES ? 2u : 1u, A_U4 = 4u;  // decoded weights: an item = a row's 32-group (HALVES: half)
#endif
const uint A_ITEMS = A_ROWS * A_IPR;
const uint A_PER = (A_ITEMS + WG_A - 1u) / WG_A;   // weight items per fetcher and step
const uint B_PER = (BN * 4u + WG_B - 1u) / WG_B;   // 8-float activation items per fetcher and step
const uint A_SZ = A_ROWS * SA4, B_SZ = BN * SA4, ST_SZ = A_SZ + B_SZ;
const uint STAGE = NWT * WM * TN / 4u;             // epilogue staging (uvec4), after the K loop
const uint SMEM = 2u * ST_SZ > STAGE ? 2u * ST_SZ : STAGE;
shared uvec4 cm_sh[SMEM];

// ---- hooks (defined by the includer) ----
uint cm_w_row(uint b, uint row);   // buffer row of weight block b's tile row `row` (< BM), clamped in range
uint cm_x_base(uint n);            // vec4 index of element 0 of the tile's token row n (< BN), clamped in range
void cm_store(float v, uint r, uint n);  // epilogue of tile element (row r < BM, token n < BN); bounds its own
#ifdef CM_COMBINE
float cm_combine(float g, float u);  // NB = 2: the value stored for gate g and up u
#endif

uvec4 cm_ra[A_PER * A_U4];  // fetched weights: 8 halves per uvec4 (F16/BF16: the raw words)
#ifdef CM_GROUP_FAST
CmRaw cm_rw[A_PER];         // FAST: fetched raw groups, decoded when stored
#endif
vec4 cm_rx[B_PER * 2u];     // fetched activations: 8 f32 per item
uint cm_wb[A_PER];          // weight group index of k-group 0 per item
uint cm_xb[B_PER];        // activation vec4 index per item (at k = 0)

uvec4 cm_h8(vec4 a, vec4 b) {  // 8 floats → 8 halves
    return uvec4(packFloat2x16(f16vec2(a.xy)), packFloat2x16(f16vec2(a.zw)),
                 packFloat2x16(f16vec2(b.xy)), packFloat2x16(f16vec2(b.zw)));
}

void cm_fetch(uint u) {
    const uint tid = gl_LocalInvocationID.x;
    if (tid < WG_A) {
        CM_UNROLL for (uint j = 0u; j < A_PER; ++j) {
            uint i = tid + j * WG_A;
            if (i < A_ITEMS) {
                uint G = cm_wb[j] + u;
#ifdef CM_RAW
                cm_ra[j] = qw[4u * G + i % 4u];
#else
#ifdef CM_GROUP_FAST
                if (FAST) {  // decoded by cm_put, after this step's products
#ifdef CM_GROUP_HALF
                    if (HALVES) {
                        cm_rw[j] = cm_group_load_half(G, i % 2u);
                        continue;
                    }
#endif
                    cm_rw[j] = cm_group_load(G);
                    continue;
                }
#endif
                vec4 w[8];
                dequant_group(G, w);
                CM_UNROLL for (uint c = 0u; c < 4u; ++c) cm_ra[4u * j + c] = cm_h8(w[2u * c], w[2u * c + 1u]);
#endif
            }
        }
    }
    if (tid >= B0) {
        CM_UNROLL for (uint j = 0u; j < B_PER; ++j) {
            uint i = tid - B0 + j * WG_B;
            if (i < BN * 4u) {
                uint v = cm_xb[j] + 8u * u + 2u * (i % 4u);
                cm_rx[2u * j] = xv[v];
                cm_rx[2u * j + 1u] = xv[v + 1u];
            }
        }
    }
}

void cm_put(uint s) {
    const uint tid = gl_LocalInvocationID.x;
    if (tid < WG_A) {
        CM_UNROLL for (uint j = 0u; j < A_PER; ++j) {
            uint i = tid + j * WG_A;
            if (i < A_ITEMS) {
#ifdef CM_RAW
                uvec4 h = cm_ra[j];
#if QTYPE == GGML_TYPE_BF16
                h = cm_h8(vec4(uintBitsToFloat(h.x << 16), uintBitsToFloat(h.x & 0xFFFF0000u),
                               uintBitsToFloat(h.y << 16), uintBitsToFloat(h.y & 0xFFFF0000u)),
                          vec4(uintBitsToFloat(h.z << 16), uintBitsToFloat(h.z & 0xFFFF0000u),
                               uintBitsToFloat(h.w << 16), uintBitsToFloat(h.w & 0xFFFF0000u)));
#endif
                cm_sh[s * ST_SZ + (i / 4u) * SA4 + i % 4u] = h;
#else
#ifdef CM_GROUP_FAST
                if (FAST) {
                    const uint at = s * ST_SZ + (i / A_IPR) * SA4 + (i % A_IPR) * (4u / A_IPR);
#ifdef CM_GROUP_HALF
                    if (HALVES) {  // half h = i % 2: the row's k 16h .. 16h + 15, uvec4s 2h and 2h + 1
                        vec4 w[4];
                        cm_group_decode_half(cm_rw[j], w);
                        CM_UNROLL for (uint c = 0u; c < 2u; ++c) cm_sh[at + c] = cm_h8(w[2u * c], w[2u * c + 1u]);
                        continue;
                    }
#endif
                    vec4 w[8];
                    cm_group_decode(cm_rw[j], w);
                    CM_UNROLL for (uint c = 0u; c < 4u; ++c) cm_sh[at + c] = cm_h8(w[2u * c], w[2u * c + 1u]);
                    continue;
                }
#endif
                CM_UNROLL for (uint c = 0u; c < 4u; ++c) cm_sh[s * ST_SZ + i * SA4 + c] = cm_ra[4u * j + c];
#endif
            }
        }
    }
    if (tid >= B0) {
        CM_UNROLL for (uint j = 0u; j < B_PER; ++j) {
            uint i = tid - B0 + j * WG_B;
            if (i < BN * 4u) cm_sh[s * ST_SZ + A_SZ + (i / 4u) * SA4 + i % 4u] = cm_h8(cm_rx[2u * j], cm_rx[2u * j + 1u]);
        }
    }
}

// The coopmat primitives, accumulators addressed by index i < NACC. CM_EMULATE (tests on devices
// without coopmat, e.g. lavapipe) replaces them by plain subgroup code with the same memory
// semantics: an A / B operand is its shared-memory offset (uvec4 units; rows / columns SA4 apart,
// as the loads below), an accumulator a row-major spread of its TM·TN elements over the lanes
// (element e on lane e % lanes) in one flat private array; the K loop, the fetches, the staging
// and the hooks are the same code either way.
const uint NACC = PER_SG * NB * CM * CN;
#ifndef CM_EMULATE
#define CM_ACC_DECL coopmat<float, gl_ScopeSubgroup, TM, TN, gl_MatrixUseAccumulator> cm_acc[NACC]  // local to cm_gemm
#define CM_A coopmat<float16_t, gl_ScopeSubgroup, TM, TK, gl_MatrixUseA>
#define CM_B coopmat<float16_t, gl_ScopeSubgroup, TK, TN, gl_MatrixUseB>
#define CM_ZERO(i) cm_acc[i] = coopmat<float, gl_ScopeSubgroup, TM, TN, gl_MatrixUseAccumulator>(0.0)
#define CM_LOAD_A(m, off) coopMatLoad(m, cm_sh, off, SA4, gl_CooperativeMatrixLayoutRowMajor)
#define CM_LOAD_B(m, off) coopMatLoad(m, cm_sh, off, SA4, gl_CooperativeMatrixLayoutColumnMajor)
#define CM_MMA(i, a, b) cm_acc[i] = coopMatMulAdd(a, b, cm_acc[i])
#define CM_STORE(i, off, stride) coopMatStore(cm_acc[i], cm_sh, off, stride, gl_CooperativeMatrixLayoutColumnMajor)
#define CM_LEN(i) cm_acc[i].length()
#define CM_EL(i, e) cm_acc[i][e]
#else
const uint CM_N = (TM * TN + SG_MAX - 1u) / SG_MAX;  // elements per lane (lanes = SG_MAX here)
float cm_acc[NACC * CM_N];
#define CM_ACC_DECL
#define CM_A uint
#define CM_B uint
#define CM_LEN(i) int(CM_N)
#define CM_EL(i, e) cm_acc[(i) * CM_N + uint(e)]
#define CM_ZERO(i) for (uint e_ = 0u; e_ < CM_N; ++e_) cm_acc[(i) * CM_N + e_] = 0.0
#define CM_LOAD_A(m, off) m = (off)
#define CM_LOAD_B(m, off) m = (off)
float cm_half(uint row, uint k) {  // k-th half of the shared row starting at uvec4 `row`
    return unpackHalf2x16(cm_sh[row + k / 8u][(k % 8u) / 2u])[k % 2u];
}
void cm_mma(uint c, uint a, uint b) {
    [[dont_unroll]] for (uint i = 0u; i < CM_N; ++i) {
        uint e = gl_SubgroupInvocationID + i * gl_SubgroupSize, r = e / TN, n = e % TN;
        if (e < TM * TN) {
            float s = cm_acc[c * CM_N + i];
            [[dont_unroll]] for (uint k = 0u; k < TK; ++k) s += cm_half(a + r * SA4, k) * cm_half(b + n * SA4, k);
            cm_acc[c * CM_N + i] = s;
        }
    }
}
#define CM_MMA(i, a, b) cm_mma(i, a, b)
void cm_store_acc(uint c, uint off, uint stride) {  // column major: (r, n) at float 4·(off + n·stride) + r
    [[dont_unroll]] for (uint i = 0u; i < CM_N; ++i) {
        uint e = gl_SubgroupInvocationID + i * gl_SubgroupSize, r = e / TN, n = e % TN, f = 4u * (off + n * stride) + r;
        if (e < TM * TN) cm_sh[f >> 2][f & 3u] = floatBitsToUint(cm_acc[c * CM_N + i]);
    }
}
#define CM_STORE(i, off, stride) cm_store_acc(i, off, stride)
#endif

// Warp tile q of subgroup sg (of nsg), counted from the last subgroup: where a tile has fewer warp
// tiles than subgroups, the products run on the subgroups of the activation fetchers (the second half
// of the workgroup, idle but for BN·4 items) while the first half waits on its weight loads.
uint cm_tile_of(uint sg, uint nsg, uint q) { return nsg - 1u - sg + q * nsg; }

void cm_gemm(uint gpr, uint u0, uint steps) {
    const uint tid = gl_LocalInvocationID.x, sg = gl_SubgroupID, nsg = gl_NumSubgroups;
    if (tid < WG_A) {
        CM_UNROLL for (uint j = 0u; j < A_PER; ++j) {
            uint row = min(tid + j * WG_A, A_ITEMS - 1u) / A_IPR;
            cm_wb[j] = cm_w_row(row / BM, row % BM) * gpr + u0;
        }
    }
    if (tid >= B0) {
        CM_UNROLL for (uint j = 0u; j < B_PER; ++j)
            cm_xb[j] = cm_x_base(min((tid - B0 + j * WG_B) / 4u, BN - 1u)) + 8u * u0;
    }

    CM_ACC_DECL;
    CM_UNROLL for (uint i = 0u; i < NACC; ++i) CM_ZERO(i);

    cm_fetch(0u);
    cm_put(0u);
    for (uint u = 0u; u < steps; ++u) {
        const uint s = u & 1u;
        barrier();  // stage s is complete; every subgroup is done reading stage s ^ 1
        if (u + 1u < steps) cm_fetch(u + 1u);
        CM_UNROLL for (uint q = 0u; q < PER_SG; ++q) {
            const uint t = cm_tile_of(sg, nsg, q);
            if (t < NWT) {
                const uint wm = t % WARPS_M, wn = t / WARPS_M;
                CM_UNROLL for (uint kk = 0u; kk < BK / TK; ++kk) {
                    CM_B bf[CN];
                    CM_UNROLL for (uint cn = 0u; cn < CN; ++cn)
                        CM_LOAD_B(bf[cn], s * ST_SZ + A_SZ + (wn * WN + cn * TN) * SA4 + kk * TK / 8u);
                    CM_UNROLL for (uint b = 0u; b < NB; ++b) {
                        CM_UNROLL for (uint cm = 0u; cm < CM; ++cm) {
                            CM_A af;
                            CM_LOAD_A(af, s * ST_SZ + (b * BM + wm * WM + cm * TM) * SA4 + kk * TK / 8u);
                            CM_UNROLL for (uint cn = 0u; cn < CN; ++cn) {
                                const uint a = ((q * NB + b) * CM + cm) * CN + cn;
                                CM_MMA(a, af, bf[cn]);
                            }
                        }
                    }
                }
            }
        }
        if (u + 1u < steps) cm_put(s ^ 1u);
    }
    barrier();  // the pipeline stages become the epilogue staging area

    // The subgroup barriers sit outside the `owns a tile` branches (every invocation meets each one,
    // whichever tiles its subgroup owns): lavapipe runs subgroupBarrier as a workgroup barrier and
    // stops meeting them once some subgroups have skipped one.
    const uint lane = gl_SubgroupInvocationID, lanes = gl_SubgroupSize;
    CM_UNROLL for (uint q = 0u; q < PER_SG; ++q) {
        const uint t = cm_tile_of(sg, nsg, q);
        const bool own = t < NWT;  // uniform in the subgroup
        const uint wm = t % WARPS_M, wn = t / WARPS_M, reg = t * (WM * TN / 4u);
#ifdef CM_COMBINE
        if (NB == 2u && own) {
            CM_UNROLL for (uint i = 0u; i < CM * CN; ++i) {
                const uint ag = q * NB * CM * CN + i, au = ag + CM * CN;
                for (int e = 0; e < CM_LEN(ag); ++e) CM_EL(ag, e) = cm_combine(CM_EL(ag, e), CM_EL(au, e));
            }
        }
#endif
        CM_UNROLL for (uint cn = 0u; cn < CN; ++cn) {
            if (own) {
                CM_UNROLL for (uint cm = 0u; cm < CM; ++cm)
                    CM_STORE((q * NB * CM + cm) * CN + cn, reg + cm * TM / 4u, WM / 4u);
            }
            subgroupMemoryBarrierShared();
            subgroupBarrier();
            if (own) {
                for (uint e = lane; e < WM * TN; e += lanes) {
                    uint f = 4u * reg + e;  // element (row e % WM, token e / WM) of the staged WM × TN block
                    cm_store(uintBitsToFloat(cm_sh[f >> 2][f & 3u]), wm * WM + e % WM, wn * WN + cn * TN + e / WM);
                }
            }
            subgroupMemoryBarrierShared();
            subgroupBarrier();  // every lane has read the block before the next one overwrites it
        }
    }
}
