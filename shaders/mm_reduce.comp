#version 450
// Split-K reduce of the tiled GEMMs (mul_mat.comp, mul_mat_cm.comp with grid z = n_split > 1):
// y[n, r] = epilogue(Σ_{s < n_split} part[s, n, r]), the partials summed in the fixed order s = 0, 1, …
// (deterministic: no atomics), then common/mm.glsl's store (the same epilogue as an unsplit GEMM).
// Buffers: 0 the f32 partials, part[s, n, r] = part[(s·n_tok + n)·n_out + r]; 1 unused (the
// partials again); 2–5 as common/mm.glsl (bias, mul, res, y). One invocation per output element
// (r fastest: coalesced reads of every partial plane), workgroup id = x + y·groups_x.
#extension GL_GOOGLE_include_directive : require
#include "common/base.glsl"
#define MM_PUSH_MORE uint n_split;
#include "common/mm.glsl"

layout(std430, binding = 0) readonly buffer Part { float part[]; };

void main() {
    const uint i = (gl_WorkGroupID.y * gl_NumWorkGroups.x + gl_WorkGroupID.x) * gl_WorkGroupSize.x + gl_LocalInvocationID.x;
    const uint plane = p.n_tok * p.n_out;
    if (i >= plane) return;
    float acc = part[i];
    for (uint s = 1u; s < p.n_split; ++s) acc += part[s * plane + i];
    store_out(acc, i % p.n_out, i / p.n_out);
}
