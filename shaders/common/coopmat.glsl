// 16x16x16 matrix tiles for attn_flash_cm.comp: GL_KHR_cooperative_matrix (A, B: f16; accumulator:
// f32; subgroup scope), or with CM_EMULATE the same interface in plain GLSL, so that lavapipe (no
// cooperative matrix) can check the kernel's logic with the same shared-memory footprint.
//   CM_A, CM_B, CM_ACC                 the matrix types (16x16 A and B of f16, 16x16 f32 accumulator)
//   CM_ZERO(c)                         c = 0 (an accumulator)
//   CM_MULADD(c, a, b)                 c = a*b + c
//   CM_LOAD_H4(m, ARR, off, stride, L) load from a f16vec4[] (off, stride in f16vec4), in layout L:
//                                      CM_ROW (row major) or CM_COL (column major)
//   CM_LOAD_H(m, ARR, off, stride)     load (row major) from a float16_t[]
//   CM_LOAD_F(m, ARR, off, stride)     load (row major) from a float[]
//   CM_STORE_F(m, ARR, off, stride)    store (row major) to a float[]
//   CM_LEN(m), CM_EL(m, i)             the components this invocation holds; which (row, col) each is
//                                      is unspecified (the kernel finds out by loading known values)
//   CM_LOOP                            loop attribute for loops over matrices: unrolled for real ones,
//                                      rolled for emulated ones (lavapipe compiles them ~10x faster)
// Real matrices follow the KHR rules: every invocation of the subgroup runs each call with the same
// arguments, and offsets and strides are 16-byte aligned. An emulated matrix is held whole by every
// invocation, but each owns (computes, stores, exposes as components) only a scrambled share of the
// subgroup's: component i of lane l is element (37*(l + i*S) + 11) mod 256, S = subgroup size, so a
// kernel that assumed some component layout fails on lavapipe too.
#if defined(CM_EMULATE)
struct CmMat { float v[256]; };  // element (r, c) at v[16r + c]
#define CM_A CmMat
#define CM_B CmMat
#define CM_ACC CmMat
#define CM_LEN(m) int(256u / gl_SubgroupSize)
#define CM_EL(m, i) (m).v[cm_elem(uint(i))]
#define CM_ROW false
#define CM_COL true
#define CM_LOOP [[dont_unroll]]

// The element (16r + c) this invocation owns as its component i.
uint cm_elem(uint i) { return ((gl_SubgroupInvocationID + i * gl_SubgroupSize) * 37u + 11u) & 255u; }
// Offset of element e of a matrix at `off` with `stride` (in elements), row or column major.
uint cm_at(uint e, uint off, uint stride, bool col) { return off + (col ? (e & 15u) * stride + (e >> 4) : (e >> 4) * stride + (e & 15u)); }

#define CM_LOAD_H4(m, ARR, off, stride, L) \
    [[dont_unroll]] for (uint e_ = 0u; e_ < 256u; ++e_) { \
        const uint f_ = cm_at(e_, 4u * (off), 4u * (stride), L); \
        (m).v[e_] = float(ARR[f_ >> 2][f_ & 3u]); \
    }
#define CM_LOAD_H(m, ARR, off, stride) \
    [[dont_unroll]] for (uint e_ = 0u; e_ < 256u; ++e_) (m).v[e_] = float(ARR[cm_at(e_, off, stride, false)]);
#define CM_LOAD_F(m, ARR, off, stride) \
    [[dont_unroll]] for (uint e_ = 0u; e_ < 256u; ++e_) (m).v[e_] = ARR[cm_at(e_, off, stride, false)];
#define CM_STORE_F(m, ARR, off, stride) \
    [[dont_unroll]] for (uint i_ = 0u; i_ < 256u / gl_SubgroupSize; ++i_) ARR[cm_at(cm_elem(i_), off, stride, false)] = (m).v[cm_elem(i_)];

#define CM_ZERO(m) [[dont_unroll]] for (uint e_ = 0u; e_ < 256u; ++e_) (m).v[e_] = 0.0;
// Only the owned elements of the result are formed (the others keep c's): the kernel takes A and B
// from loads only, and reads a result only through its owned elements.
#define CM_MULADD(c, a, b) \
    [[dont_unroll]] for (uint i_ = 0u; i_ < 256u / gl_SubgroupSize; ++i_) { \
        const uint e_ = cm_elem(i_), r_ = e_ >> 4, c_ = e_ & 15u; \
        float s_ = (c).v[e_]; \
        [[dont_unroll]] for (uint k_ = 0u; k_ < 16u; ++k_) s_ += (a).v[16u * r_ + k_] * (b).v[16u * k_ + c_]; \
        (c).v[e_] = s_; \
    }
#else
#extension GL_KHR_cooperative_matrix : require
#extension GL_KHR_memory_scope_semantics : require
#define CM_A coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseA>
#define CM_B coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseB>
#define CM_ACC coopmat<float, gl_ScopeSubgroup, 16, 16, gl_MatrixUseAccumulator>
#define CM_LEN(m) (m).length()
#define CM_EL(m, i) (m)[i]
#define CM_LOOP [[unroll]]
#define CM_ROW gl_CooperativeMatrixLayoutRowMajor
#define CM_COL gl_CooperativeMatrixLayoutColumnMajor
#define CM_LOAD_H4(m, ARR, off, stride, L) coopMatLoad(m, ARR, off, stride, L);
#define CM_LOAD_H(m, ARR, off, stride) coopMatLoad(m, ARR, off, stride, gl_CooperativeMatrixLayoutRowMajor);
#define CM_LOAD_F(m, ARR, off, stride) coopMatLoad(m, ARR, off, stride, gl_CooperativeMatrixLayoutRowMajor);
#define CM_STORE_F(m, ARR, off, stride) coopMatStore(m, ARR, off, stride, gl_CooperativeMatrixLayoutRowMajor);

#define CM_ZERO(m) m = CM_ACC(0.0);
#define CM_MULADD(c, a, b) c = coopMatMulAdd(a, b, c);
#endif
