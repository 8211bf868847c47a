#version 450
// Split-KV combine for attn_flash (flash-decode): row (t, h) has n_split partials
// (O_z[0..DH), m_z, l_z) at part[((z*T + t)*H + h)*(DH + 2)], O_z = sum_j e^(s_j - m_z) v_j over
// split z's keys. With M = max_z m_z and w_z = e^(m_z - M) (0 for an empty split, m_z = -1e30):
// o = sum_z w_z O_z / sum_z w_z l_z, then o *= sigma(gate) if GATED, stored at
// out[o_off + t*o_row + h*o_head + d]; a row with no visible key yields 0.
// Workgroup (h, t); threads stride over d. Buffers: 0 part, 1 gate (f32), 2 out. Spec: 1 DH, 2 GATED.
#extension GL_GOOGLE_include_directive : require
#include "common/base.glsl"

layout(constant_id = 1) const uint DH = 128;
layout(constant_id = 2) const uint GATED = 0;

layout(std430, binding = 0) readonly buffer Part { float part[]; };
layout(std430, binding = 1) readonly buffer Gate { float gate[]; };
layout(std430, binding = 2) writeonly buffer Out { float outp[]; };

layout(push_constant) uniform P {
    uint T; uint H; uint n_split;
    uint gate_off; uint gate_row; uint gate_head;
    uint o_off; uint o_row; uint o_head;
} p;

const float NEG = -1.0e30;

void main() {
    const uint h = gl_WorkGroupID.x, t = gl_WorkGroupID.y;
    const uint stride = p.T * p.H * (DH + 2u);
    const uint base = (t * p.H + h) * (DH + 2u);
    float M = NEG;
    for (uint z = 0; z < p.n_split; ++z) M = max(M, part[z * stride + base + DH]);
    float L = 0.0;
    for (uint z = 0; z < p.n_split; ++z) {
        const float m = part[z * stride + base + DH];
        if (m > NEG) L += exp(m - M) * part[z * stride + base + DH + 1u];
    }
    for (uint d = gl_LocalInvocationID.x; d < DH; d += gl_WorkGroupSize.x) {
        float o = 0.0;
        for (uint z = 0; z < p.n_split; ++z) {
            const float m = part[z * stride + base + DH];
            if (m > NEG) o += exp(m - M) * part[z * stride + base + d];
        }
        o = L > 0.0 ? o / L : 0.0;
        if (GATED != 0u) o *= sigmoid(gate[p.gate_off + t * p.gate_row + h * p.gate_head + d]);
        outp[p.o_off + t * p.o_row + h * p.o_head + d] = o;
    }
}
