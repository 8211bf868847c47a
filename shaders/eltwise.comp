#version 450
// Elementwise ops on 2-D f32 row views, one op per specialization constant.
//   y[y_off + r*y_stride + c] = f(a[a_off + r*a_stride + c], b[b_off + r*b_stride + c])
// for r < n_rows, c < n_cols. b_stride = 0 broadcasts one row of b over all rows. Binary ops:
// ADD a+b, MUL a*b (op 2 unused). Unary ops (b unused): SCALE alpha*a, SILU a*sigma(a),
// SIGMOID 1/(1+e^-a), SOFTPLUS ln(1+e^a) (a when a > 20). In place (y aliasing a or b, same view)
// is allowed: each element is read and written by the same invocation.
// Buffers: 0 a (f32), 1 b (f32), 2 y (f32). Offsets/strides in elements.
#extension GL_GOOGLE_include_directive : require
#include "common/base.glsl"

layout(constant_id = 1) const uint OP = 0;
const uint OP_ADD = 0, OP_MUL = 1, OP_SCALE = 3, OP_SILU = 4, OP_SIGMOID = 5,
           OP_SOFTPLUS = 6;

layout(std430, binding = 0) buffer A { float a[]; };
layout(std430, binding = 1) buffer B { float b[]; };
layout(std430, binding = 2) buffer Y { float y[]; };
layout(push_constant) uniform P {
    uint n_cols; uint n_rows;
    uint a_off; uint a_stride; uint b_off; uint b_stride; uint y_off; uint y_stride;
    float alpha;
} p;

void main() {
    uint n = p.n_cols * p.n_rows;
    uint step = gl_NumWorkGroups.x * gl_WorkGroupSize.x;
    for (uint i = gl_GlobalInvocationID.x; i < n; i += step) {
        uint r = i / p.n_cols, c = i - r * p.n_cols;
        float x = a[p.a_off + r * p.a_stride + c];
        float v;
        if (OP == OP_ADD) v = x + b[p.b_off + r * p.b_stride + c];
        else if (OP == OP_MUL) v = x * b[p.b_off + r * p.b_stride + c];
        else if (OP == OP_SCALE) v = p.alpha * x;
        else if (OP == OP_SILU) v = silu(x);
        else if (OP == OP_SIGMOID) v = sigmoid(x);
        else v = softplus(x);  // OP_SOFTPLUS
        y[p.y_off + r * p.y_stride + c] = v;
    }
}
