// Shared interface of the matmul family (mul_mat_vec, mul_mat, mul_mat_cm):
//   y[n, r] = epilogue(Σ_k W[r, k] · x[n, k], r, n)   for r < n_out weight rows, n < n_tok tokens.
// Buffers: 0 W (raw GGML blocks, declared by common/quant.glsl), 1 x (f32), 2 bias (f32),
// 3 mul (f32), 4 res (f32), 5 y (f32). Unused epilogue buffers are bound to any buffer (x).
// A kernel with more push constants defines MM_PUSH_MORE (members appended after `scale`).
// Addresses (elements): W row r is weight row w_row0 + r (an expert stack {K, out, E} addresses
// expert e with w_row0 = e*out; a MoE kernel may instead compute it from an ids buffer);
// x[n, k] = x[x_off + n*x_stride + k] (x_off, x_stride multiples of 4); y[n, r] = y[y_off +
// n*y_stride + r]; mul and res use y's stride with their own offsets; bias[r] = bias[bias_off + r].
// Epilogue (constant_id 1, bit flags, applied in f32 on the accumulator, in this order):
//   v = acc; v *= scale (1); v += bias[r] (2); v = σ(v) (4) or silu(v) (8); v *= mul[n, r] (16);
//   v += res[n, r] (32). res may be y itself (in-place residual add: each element is read then
//   written by the same invocation).

layout(constant_id = 1) const uint EPILOGUE = 0;
#define EP_SCALE 1u
#define EP_BIAS 2u
#define EP_SIGMOID 4u
#define EP_SILU 8u
#define EP_MUL 16u
#define EP_RES 32u

layout(std430, binding = 1) readonly buffer X { vec4 xv[]; };
layout(std430, binding = 2) readonly buffer Bias { float bias[]; };
layout(std430, binding = 3) readonly buffer Mul { float mulv[]; };
layout(std430, binding = 4) readonly buffer Res { float res[]; };
layout(std430, binding = 5) writeonly buffer Y { float y[]; };

#ifndef MM_PUSH_MORE
#define MM_PUSH_MORE
#endif
layout(push_constant) uniform P {
    uint K; uint n_out; uint n_tok; uint w_row0;
    uint x_off; uint x_stride; uint y_off; uint y_stride;
    uint bias_off; uint mul_off; uint res_off; float scale;
    MM_PUSH_MORE
} p;

// Store output (n, r) after the fused epilogue. `precise` keeps each step separately rounded (no fma contraction), so the
// fused store equals the plain path of separate eltwise dispatches bit for bit (same formulas as shaders/eltwise.comp).
void store_out(float acc, uint r, uint n) {
    uint o = n * p.y_stride + r;
    precise float v = acc;
    if ((EPILOGUE & EP_SCALE) != 0u) v = p.scale * v;
    if ((EPILOGUE & EP_BIAS) != 0u) v += bias[p.bias_off + r];
    if ((EPILOGUE & EP_SIGMOID) != 0u) v = sigmoid(v);
    if ((EPILOGUE & EP_SILU) != 0u) v = silu(v);
    if ((EPILOGUE & EP_MUL) != 0u) v *= mulv[p.mul_off + o];
    if ((EPILOGUE & EP_RES) != 0u) v += res[p.res_off + o];
    y[p.y_off + o] = v;
}
