#version 450
// Split-KV combine for attn_decode.comp, parallel over the splits (attn_combine.comp walks them
// serially, which is slow at the hundreds of splits a big GPU needs). Row (t, h) has n_split
// partials (O_z[0..DH), m_z, l_z) at part[((z*T + t)*H + h)*(DH + 2)]. With M = max_z m_z and
// w_z = e^(m_z - M) (0 for an empty split, m_z = -1e30): o = sum_z w_z O_z / sum_z w_z l_z, then
// o *= sigma(gate) if GATED, stored at out[o_off + t*o_row + h*o_head + d]; a row with no visible
// key yields 0.
// Workgroup (h, t, dims block b) owns dims [b*DC, (b+1)*DC): invocation (zg, d) sums splits
// z = zg, zg + WG/DC, ... of dim d, the WG/DC group sums are then added in zg order. M and the
// denominator are reduced over the whole workgroup (common/reduce.glsl).
// Buffers: 0 part, 1 gate (f32), 2 out. Spec: 1 DH, 2 GATED, 3 DC (divides DH and WG).
#extension GL_GOOGLE_include_directive : require
#include "common/base.glsl"
#include "common/reduce.glsl"

layout(constant_id = 1) const uint DH = 128;
layout(constant_id = 2) const uint GATED = 0;
layout(constant_id = 3) const uint DC = 64;

layout(std430, binding = 0) readonly buffer Part { float part[]; };
layout(std430, binding = 1) readonly buffer Gate { float gate[]; };
layout(std430, binding = 2) writeonly buffer Out { float outp[]; };

layout(push_constant) uniform P {
    uint T; uint H; uint n_split;
    uint gate_off; uint gate_row; uint gate_head;
    uint o_off; uint o_row; uint o_head;
} p;

const float NEG = -1.0e30;
const uint WG = gl_WorkGroupSize.x;
const uint ZG = WG / DC;  // split groups

shared float sO[WG];

void main() {
    const uint tid = gl_LocalInvocationIndex;
    const uint h = gl_WorkGroupID.x, t = gl_WorkGroupID.y;
    const uint stride = p.T * p.H * (DH + 2u);
    const uint base = (t * p.H + h) * (DH + 2u);
    float mx = NEG;
    for (uint z = tid; z < p.n_split; z += WG) mx = max(mx, part[z * stride + base + DH]);
    const float M = wg_max(mx);
    float l = 0.0;
    for (uint z = tid; z < p.n_split; z += WG) {
        const float m = part[z * stride + base + DH];
        if (m > NEG) l += exp(m - M) * part[z * stride + base + DH + 1u];
    }
    const float L = wg_sum(l);

    const uint zg = tid / DC, d = gl_WorkGroupID.z * DC + tid % DC;
    float o = 0.0;
    for (uint z = zg; z < p.n_split; z += ZG) {
        const float m = part[z * stride + base + DH];
        if (m > NEG) o += exp(m - M) * part[z * stride + base + d];
    }
    sO[tid] = o;
    barrier();
    if (zg == 0u) {
        for (uint k = 1u; k < ZG; ++k) o += sO[k * DC + tid];
        o = L > 0.0 ? o / L : 0.0;
        if (GATED != 0u) o *= sigmoid(gate[p.gate_off + t * p.gate_row + h * p.gate_head + d]);
        outp[p.o_off + t * p.o_row + h * p.o_head + d] = o;
    }
}
