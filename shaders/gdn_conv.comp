#version 450
// GDN causal depthwise conv1d + silu with state (MODEL.md §5.4 G4), batched over T tokens.
// X = [state (K-1 raw columns); m_0..m_{T-1}], X_i = state[i] for i < K-1, else m[i-K+1];
//   c[t, ch] = silu(sum_k w[ch, k] * X[t+k, ch]).
// The state lives in n_planes planes of [K-1, C] (engine/state.py); the live one is plane
// q = idx[idx_off] mod n_planes (plane 0 when n_planes = 1, idx unread). Without RING the new
// state rows r = X[T+r] go back into plane q (older rows survive when T < K-1); with RING (a
// verify step, T < n_planes) plane q is left as it was and plane (q+1+t) mod n_planes gets the
// state after token t, rows r = X[t+1+r].
// Invocation (ch, y) computes tokens [y*TC, min(T, (y+1)*TC)) of channel ch with a sliding window.
// Only y = 0 reads the old state and writes the new state planes (TC >= K-1, so no other
// invocation touches state rows): the update is in place without races.
// Buffers: 0 m (f32) [T rows, stride m_stride, C used], 1 w (f32) [C, K] from w_off, 2 planes
// (f32) [n_planes, K-1, C] from st_off (read + written), 3 c (f32) [T rows, stride c_stride],
// 4 idx (uint).
#extension GL_GOOGLE_include_directive : require
#include "common/base.glsl"

layout(constant_id = 1) const uint K = 4;    // conv kernel taps K_c
layout(constant_id = 2) const uint TC = 32;  // tokens per invocation, >= K-1

layout(std430, binding = 0) readonly buffer M { float m[]; };
layout(std430, binding = 1) readonly buffer W { float w[]; };
layout(std430, binding = 2) buffer St { float st[]; };
layout(std430, binding = 3) writeonly buffer Cb { float c[]; };
layout(std430, binding = 4) readonly buffer Idx { uint idx[]; };
layout(push_constant) uniform P {
    uint C; uint T;
    uint m_off; uint m_stride; uint w_off; uint st_off; uint c_off; uint c_stride;
    uint n_planes; uint idx_off; uint ring;
} p;

float old_state[K];  // K-1 used; sized K so that K = 1 still declares a valid array

// X_i of channel ch (old state rows come from old_state, which only y = 0 fills).
float X(uint i, uint ch) {
    return i < K - 1 ? old_state[i] : m[p.m_off + (i - (K - 1)) * p.m_stride + ch];
}

// Element (row r, channel ch) of plane q.
uint at(uint q, uint r, uint ch) { return p.st_off + (q * (K - 1) + r) * p.C + ch; }

void main() {
    uint ch = gl_GlobalInvocationID.x;
    uint t0 = gl_WorkGroupID.y * TC;
    if (ch >= p.C || t0 >= p.T) return;
    uint t1 = min(p.T, t0 + TC);
    uint live = p.n_planes > 1 ? idx[p.idx_off] % p.n_planes : 0;
    if (t0 == 0) {
        for (uint r = 0; r < K - 1; ++r) old_state[r] = st[at(live, r, ch)];
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
        if (p.ring != 0) {
            for (uint t = 0; t < p.T; ++t) {
                uint q = (live + 1 + t) % p.n_planes;
                for (uint r = 0; r < K - 1; ++r) st[at(q, r, ch)] = X(t + 1 + r, ch);
            }
        } else {
            for (uint r = 0; r < K - 1; ++r) st[at(live, r, ch)] = X(p.T + r, ch);
        }
    }
}
