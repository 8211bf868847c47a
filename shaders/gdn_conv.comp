#version 450
// GDN causal depthwise conv1d + silu with state (MODEL.md §5.4 G4), batched over T tokens.
// X = [state (K-1 raw columns); m_0..m_{T-1}], X_i = state[i] for i < K-1, else m[i-K+1];
//   c[t, ch] = silu(sum_k w[ch, k] * X[t+k, ch]);  new state rows r = X[T+r] (r < K-1), so older
//   state rows survive when T < K-1; checkpoint slot s (s < n_slots <= T) rows r = X[T-s+r],
//   the state s tokens before the batch end (slot 0 = the new state).
// Invocation (ch, y) computes tokens [y*TC, min(T, (y+1)*TC)) of channel ch with a sliding window.
// Only y = 0 reads the old state and writes the new state and slots (TC >= K-1, so no other
// invocation touches state rows): the update is in place without races.
// Buffers (f32): 0 m [T rows, stride m_stride, C used], 1 w [C, K] from w_off, 2 state [K-1, C]
// from st_off (read + written), 3 c [T rows, stride c_stride], 4 slots [n_slots*(K-1), C] from sl_off.
#extension GL_GOOGLE_include_directive : require
#include "common/base.glsl"

layout(constant_id = 1) const uint K = 4;    // conv kernel taps K_c
layout(constant_id = 2) const uint TC = 32;  // tokens per invocation, >= K-1

layout(std430, binding = 0) readonly buffer M { float m[]; };
layout(std430, binding = 1) readonly buffer W { float w[]; };
layout(std430, binding = 2) buffer St { float st[]; };
layout(std430, binding = 3) writeonly buffer Cb { float c[]; };
layout(std430, binding = 4) writeonly buffer Sl { float sl[]; };
layout(push_constant) uniform P {
    uint C; uint T;
    uint m_off; uint m_stride; uint w_off; uint st_off; uint c_off; uint c_stride; uint sl_off; uint n_slots;
} p;

float old_state[K];  // K-1 used; sized K so that K = 1 still declares a valid array

// X_i of channel ch (old state rows come from old_state, which only y = 0 fills).
float X(uint i, uint ch) {
    return i < K - 1 ? old_state[i] : m[p.m_off + (i - (K - 1)) * p.m_stride + ch];
}

void main() {
    uint ch = gl_GlobalInvocationID.x;
    uint t0 = gl_WorkGroupID.y * TC;
    if (ch >= p.C || t0 >= p.T) return;
    uint t1 = min(p.T, t0 + TC);
    if (t0 == 0) {
        for (uint r = 0; r < K - 1; ++r) old_state[r] = st[p.st_off + r * p.C + ch];
    }
    float wk[K];
    for (uint k = 0; k < K; ++k) wk[k] = w[p.w_off + ch * K + k];
    float win[K];  // win[k] = X[t + k] for the current t
    for (uint k = 0; k + 1 < K; ++k) win[k] = X(t0 + k, ch);
    for (uint t = t0; t < t1; ++t) {
        win[K - 1] = X(t + K - 1, ch);
        float acc = 0.0;
        for (uint k = 0; k < K; ++k) acc += wk[k] * win[k];
        c[p.c_off + t * p.c_stride + ch] = silu(acc);
        for (uint k = 0; k + 1 < K; ++k) win[k] = win[k + 1];
    }
    if (t0 == 0) {
        for (uint s = 0; s < p.n_slots; ++s) {
            for (uint r = 0; r < K - 1; ++r) sl[p.sl_off + (s * (K - 1) + r) * p.C + ch] = X(p.T - s + r, ch);
        }
        for (uint r = 0; r < K - 1; ++r) st[p.st_off + r * p.C + ch] = X(p.T + r, ch);
    }
}
