#version 450
// NeoX partial RoPE (MODEL.md §5.5 A3) on rows of head vectors of Dh values, row r = t*n_heads + h:
//   phi_i = p_t * theta^(-2i/n_rot) (f32, pow), for pair i < n_rot/2:
//   y_i = x_i cos phi_i - x_{i+n_rot/2} sin phi_i;  y_{i+n_rot/2} = x_{i+n_rot/2} cos phi_i + x_i sin phi_i
//   y_j = x_j for n_rot <= j < Dh.
// Positions p_t are int32 read from pos[pos_off + t] (per-step values live in buffers).
// Buffers: 0 pos (int32), 1 x (f32), 2 y (f32; may alias x, same view).
#extension GL_GOOGLE_include_directive : require
#include "common/base.glsl"

layout(std430, binding = 0) readonly buffer Pos { int pos[]; };
layout(std430, binding = 1) buffer X { float x[]; };
layout(std430, binding = 2) buffer Y { float y[]; };
layout(push_constant) uniform P {
    uint n_rows; uint n_heads; uint dh; uint n_rot;
    uint x_off; uint x_stride; uint y_off; uint y_stride; uint pos_off; float theta;
} p;

void main() {
    uint half_rot = p.n_rot / 2u;
    uint per_row = half_rot + (p.dh - p.n_rot);  // pairs, then pass-through dims
    uint n = p.n_rows * per_row;
    uint step = gl_NumWorkGroups.x * gl_WorkGroupSize.x;
    for (uint w = gl_GlobalInvocationID.x; w < n; w += step) {
        uint r = w / per_row, i = w - r * per_row;
        uint xb = p.x_off + r * p.x_stride, yb = p.y_off + r * p.y_stride;
        if (i < half_rot) {
            float phi = float(pos[p.pos_off + r / p.n_heads]) * pow(p.theta, -2.0 * float(i) / float(p.n_rot));
            float c = cos(phi), s = sin(phi);
            float x0 = x[xb + i], x1 = x[xb + i + half_rot];
            y[yb + i] = x0 * c - x1 * s;
            y[yb + i + half_rot] = x1 * c + x0 * s;
        } else {
            uint j = i + half_rot;  // = n_rot + (i - half_rot)
            y[yb + j] = x[xb + j];
        }
    }
}
