#version 450
// QSA pooled-key summary rows (MODEL.md Q2-Q3) for the blocks b in [b0, floor(n/r)), n =
// params[param_off + 1] (cache length after the ubatch), b0 = floor(p0/r) with p0 = params[param_off]
// (the blocks this ubatch completes: the lazy summary cache), or b0 = 0 when push `repool` is set
// (re-pool every complete block each step: POOLED=0). P_b = (sum_{i<r} rho_{br+i}) * (1/r), summed
// in f32 in slot order over the stored (rounded) raw indexer keys; kappa_b = RoPE_{br}(rms(P_b) *
// gain) with NeoX pairs (d, d + n_rot/2), phi_d = br * theta^(-2d/n_rot), dims >= n_rot unrotated.
// Workgroup k handles blocks b0 + k, b0 + k + #groups, ... (grid-stride: any depth, same
// arithmetic per row either way, so both modes give the same bits).
// Buffers: 0 params (int32), 1 keys ([n_ctx, DH] of the KV type), 2 gain (f32 DH),
// 3 summary (f32 [n_blocks, DH]). Spec: 1 DH. Defines: KV_F32|KV_F16|KV_Q8_0.
#extension GL_GOOGLE_include_directive : require
#include "common/base.glsl"
#include "common/kv_cache.glsl"

layout(constant_id = 1) const uint DH = 128;

layout(std430, binding = 0) readonly buffer Params { int params[]; };
KV_BUFFER(1, keys, readonly)
layout(std430, binding = 2) readonly buffer Gain { float gain[]; };
layout(std430, binding = 3) writeonly buffer Summary { float summary[]; };

layout(push_constant) uniform P {
    uint param_off; uint r; uint n_blocks; uint n_rot; float eps; float theta; uint repool;
} p;

shared float sP[DH];
shared float sSum[gl_WorkGroupSize.x];

// Row b of the summary; every invocation of the workgroup calls it.
void pool_row(uint b, uint tid, uint WG) {
    const float inv_r = 1.0 / float(p.r);
    float ss = 0.0;
    for (uint d = tid; d < DH; d += WG) {
        float s = 0.0;
        for (uint i = 0; i < p.r; ++i) s += KV_LOAD(keys, (b * p.r + i) * DH + d);
        s *= inv_r;
        sP[d] = s;
        ss += s * s;
    }
    sSum[tid] = ss;
    barrier();
    for (uint w = WG / 2u; w > 0u; w >>= 1) {
        if (tid < w) sSum[tid] += sSum[tid + w];
        barrier();
    }
    const float inv_rms = 1.0 / sqrt(sSum[0] / float(DH) + p.eps);
    for (uint d = tid; d < DH; d += WG) sP[d] = sP[d] * inv_rms * gain[d];
    barrier();
    const uint half_rot = p.n_rot / 2u;
    for (uint d = tid; d < DH; d += WG) {
        float y = sP[d];
        if (d < p.n_rot) {
            const uint i = d % half_rot;
            const float phi = float(b * p.r) * pow(p.theta, -2.0 * float(i) / float(p.n_rot));
            const float c = cos(phi), s = sin(phi);
            y = d < half_rot ? sP[d] * c - sP[d + half_rot] * s : sP[d] * c + sP[d - half_rot] * s;
        }
        summary[b * DH + d] = y;
    }
}

void main() {
    const uint tid = gl_LocalInvocationID.x, WG = gl_WorkGroupSize.x;
    const uint p0 = uint(params[p.param_off]), n = uint(params[p.param_off + 1u]);
    const uint b_end = min(n / p.r, p.n_blocks);
    for (uint b = (p.repool != 0u ? 0u : p0 / p.r) + gl_WorkGroupID.x; b < b_end; b += gl_NumWorkGroups.x) {
        pool_row(b, tid, WG);  // the loop bounds are uniform per workgroup
        barrier();
    }
}
