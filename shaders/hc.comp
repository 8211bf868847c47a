#version 450
// Hyper-connection elementwise tails (MODEL.md §5.2), one mode per specialization constant
// (constant_id 1); hc streams of d elements per token, all f32, grid-stride over the output.
//   PRE     (H2)  y[t, j]      = silu(a[t, j] / hc)                              j < n (= lr)
//   MIX     (H3+H4) y[t, i]    = (Σ_{c=0}^{hc−1} σ(a[t, c·d+i]) · b[t, c·d+i]) / hc   i < n (= d)
//           a = g_pre = W_up ℓ, b = X; streams summed in order c = 0, 1, …, then ÷ hc.
//   COMBINE (H6)  y[t, c·d+i] += 2σ(a[t, c] / hc) · b[t, i]                     i < n (= d)
//           a = ι = W_inj X, b = block output, y = the un-normalised residual R (in place).
//   ROW_AXPY      y[t, c·d+i] += a[t, c] · b[t, i]   (the unfused combine's last step: a = gate)
//   BROADCAST (H0) y[t, c·d+i] = b[t, i] for every stream c   (a unused)
// Buffers: 0 a, 1 b, 2 y (f32). Push: n, n_rows, hc, then off/stride (elements) of a, b, y, then
// inv_hc = 1/hc rounded to f32: every ÷hc above is a product with it (as in mul_mat_vec.comp
// MODE 2 and norm.comp COMBINE), so the fused paths agree bit for bit on any driver.
// In COMBINE/ROW_AXPY each y element is read and written by one invocation; PRE may be in place.
#extension GL_GOOGLE_include_directive : require
#include "common/base.glsl"

layout(constant_id = 1) const uint MODE = 0;
const uint MODE_PRE = 0, MODE_MIX = 1, MODE_COMBINE = 2, MODE_ROW_AXPY = 3, MODE_BROADCAST = 4;

layout(std430, binding = 0) buffer A { float a[]; };
layout(std430, binding = 1) buffer B { float b[]; };
layout(std430, binding = 2) buffer Y { float y[]; };
layout(push_constant) uniform P {
    uint n; uint n_rows; uint hc;
    uint a_off; uint a_stride; uint b_off; uint b_stride; uint y_off; uint y_stride; float inv_hc;
} p;


void main() {
    uint total = p.n * p.n_rows;
    uint step = gl_NumWorkGroups.x * gl_WorkGroupSize.x;
    for (uint k = gl_GlobalInvocationID.x; k < total; k += step) {
        uint t = k / p.n, i = k - t * p.n;
        uint ar = p.a_off + t * p.a_stride, br = p.b_off + t * p.b_stride, yr = p.y_off + t * p.y_stride;
        if (MODE == MODE_PRE) {
            float x = a[ar + i] * p.inv_hc;  // 1/hc before the silu
            y[yr + i] = x * sigmoid(x);
        } else if (MODE == MODE_MIX) {
            precise float u = 0.0;
            for (uint c = 0; c < p.hc; ++c) {
                precise float gx = sigmoid(a[ar + c * p.n + i]) * b[br + c * p.n + i];
                u = c == 0 ? gx : u + gx;
            }
            y[yr + i] = u * p.inv_hc;  // mean, not sum
        } else if (MODE == MODE_BROADCAST) {
            float bi = b[br + i];
            for (uint c = 0; c < p.hc; ++c) y[yr + c * p.n + i] = bi;
        } else {
            float bi = b[br + i];
            for (uint c = 0; c < p.hc; ++c) {
                precise float s = MODE == MODE_COMBINE ? 2.0 * sigmoid(a[ar + c] * p.inv_hc) : a[ar + c];
                precise float v = s * bi;
                y[yr + c * p.n + i] += v;
            }
        }
    }
}
