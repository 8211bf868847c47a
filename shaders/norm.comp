#version 450
// Row norms, one workgroup per normalised group (grid-stride over groups):
//   MODE 0 RMS:  y = x / sqrt(mean(x^2) + eps) * post (* gamma)
//   MODE 1 L2:   y = x / sqrt(sum(x^2) + eps) * post (* gamma)
// A row r of n_groups*n values is n_groups groups of n, each normalised on its own (grouped
// RMSNorm of a wide HC vector, MODEL.md §2); group c of row r starts at x_off + r*x_stride + c*n.
// gamma (if HAS_GAMMA) spans the whole row: element c*n + i uses gamma[gamma_off + c*n + i].
// COMBINE (HC, MODEL.md H6 then H1): first x[r, c*n + i] += 2σ(iota[r, c] · inv_groups) ·
// b[r, i] in place (hc.comp COMBINE's formula; inv_groups = 1/n_groups rounded to f32, pushed),
// then the norm of the updated group; one dispatch for a Combine and the next Mix's grouped
// RMSNorm. Each x element is updated and re-read by one invocation (both loops walk i the same way).
// ROPE (attention q/k, MODEL.md A2 then A3): the normalised row (a head vector; n_groups = 1) is
// rotated by NeoX partial RoPE exactly as shaders/rope.comp (row r = t*n_heads + h at position
// pos[pos_off + t]); outputs go through shared memory first, so y may alias x. Dh ≤ MAX_DH.
// INJECT (HC H5): also ι[r, c'] = Σ_j w_inj[c', j] · y[r, j] (c' < n_groups ≤ MAX_HC; w_inj f32,
// n_groups rows of the whole row) from the values written, so the Mix's inject projection needs no
// GEMV of its own. The workgroup of group c stores its partial sums P[r, c, c'] = Σ_{j in c} …;
// the last of row r's workgroups to finish (counted in cnt[r]) adds them in group order into ι
// and resets cnt[r] to 0 for the next replay. Buffer 8: cnt[n_rows] then P (uint bits), zeroed
// once at allocation.
// Groups of up to PER·workgroup elements are read once into registers, all loads issued before
// the first store, so a group's workgroup waits on a few memory round trips, not one per element;
// longer groups (and ROPE) take the plain loops. Both sum in the same order.
// Buffers: 0 x (f32), 1 gamma (f32; any buffer when unused), 2 y (f32; may alias x, same view,
// except with COMBINE), 3 iota, 4 b (f32; any buffer when not COMBINE), 5 pos (int32; any
// buffer when not ROPE), 6 w_inj from w_inj_off, 7 ι out at iota_out_off + r*iota_out_stride,
// 8 cnt and P (6-8: any buffer when not INJECT).
#extension GL_GOOGLE_include_directive : require
#include "common/base.glsl"
#include "common/reduce.glsl"
#extension GL_EXT_control_flow_attributes : require

layout(constant_id = 1) const uint MODE = 0;
layout(constant_id = 2) const bool HAS_GAMMA = false;
layout(constant_id = 3) const bool COMBINE = false;
layout(constant_id = 4) const bool ROPE = false;
layout(constant_id = 5) const bool INJECT = false;
const uint MAX_DH = 512u, MAX_HC = 8u, PER = 16u;

layout(std430, binding = 0) buffer X { float x[]; };
layout(std430, binding = 1) restrict readonly buffer G { float gamma[]; };
layout(std430, binding = 2) buffer Y { float y[]; };
layout(std430, binding = 3) restrict readonly buffer Iota { float iota[]; };
layout(std430, binding = 4) restrict readonly buffer Bv { float bv[]; };
layout(std430, binding = 5) restrict readonly buffer Pos { int pos[]; };
layout(std430, binding = 6) restrict readonly buffer Wi { float w_inj[]; };
layout(std430, binding = 7) writeonly buffer Io { float iota_out[]; };
layout(std430, binding = 8) coherent buffer Part { uint part[]; };
layout(push_constant) uniform P {
    uint n; uint n_groups; uint n_rows;
    uint x_off; uint x_stride; uint y_off; uint y_stride; uint gamma_off;
    float eps; float post;
    uint iota_off; uint iota_stride; uint b_off; uint b_stride;
    uint n_heads; uint n_rot; uint pos_off; float theta;
    uint w_inj_off; uint iota_out_off; uint iota_out_stride; float inv_groups;
} p;

shared float rotated[ROPE ? MAX_DH : 1u];

// Element i of the normalised group at xb (scale s, gamma from g0).
float normed(uint xb, uint g0, uint i, float s) {
    float v = x[xb + i] * s;
    if (HAS_GAMMA) v *= gamma[g0 + i];
    return v;
}

// COMBINE's stream weight 2σ(ι[r, c]·(1/n_groups)).
float combine_weight(uint r, uint c) {
    precise float s = 2.0 * sigmoid(iota[p.iota_off + r * p.iota_stride + c] * p.inv_groups);
    return s;
}

// The factor that normalises a group whose squares sum (over the workgroup) to ss.
float norm_factor(float ss) {
    return p.post / sqrt((MODE == 0 ? ss / float(p.n) : ss) + p.eps);
}

// inj[o] += w_inj[o, col] · v for each of the row's n_groups inject rows (unrolled: inj stays in registers).
void add_inject(inout float inj[MAX_HC], uint col, float v) {
    [[unroll]] for (uint o = 0u; o < MAX_HC; ++o) {
        if (o < p.n_groups) inj[o] += w_inj[p.w_inj_off + o * p.n_groups * p.n + col] * v;
    }
}

// norm_group for a group of n ≤ PER·workgroup elements without RoPE: element tid + k·WG is v[k].
void norm_group_cached(uint r, uint c, inout float inj[MAX_HC]) {
    const uint tid = gl_LocalInvocationID.x, wgs = gl_WorkGroupSize.x;
    uint xb = p.x_off + r * p.x_stride + c * p.n, yb = p.y_off + r * p.y_stride + c * p.n;
    uint bb = p.b_off + r * p.b_stride, g0 = p.gamma_off + c * p.n;
    float v[PER], bk[PER], gk[PER];
    [[unroll]] for (uint k = 0u; k < PER; ++k) {  // every load first
        uint i = min(tid + k * wgs, p.n - 1u);
        v[k] = x[xb + i];
        if (COMBINE) bk[k] = bv[bb + i];
        if (HAS_GAMMA) gk[k] = gamma[g0 + i];
    }
    if (COMBINE) {
        const float s = combine_weight(r, c);
        [[unroll]] for (uint k = 0u; k < PER; ++k) {
            precise float t = s * bk[k];
            v[k] += t;
            if (tid + k * wgs < p.n) x[xb + tid + k * wgs] = v[k];
        }
    }
    float ss = 0.0;
    [[unroll]] for (uint k = 0u; k < PER; ++k) {
        if (tid + k * wgs < p.n) ss += v[k] * v[k];
    }
    const float s = norm_factor(wg_sum(ss));
    [[unroll]] for (uint k = 0u; k < PER; ++k) {
        uint i = tid + k * wgs;
        if (i < p.n) {
            float o = v[k] * s;
            if (HAS_GAMMA) o *= gk[k];
            y[yb + i] = o;
            if (INJECT) add_inject(inj, c * p.n + i, o);
        }
    }
}

// Group c of row r: the optional Combine, the norm, the optional RoPE; with INJECT, each written
// value also feeds the inject partial sums inj[c'].
void norm_group(uint r, uint c, inout float inj[MAX_HC]) {
    if (!ROPE && p.n <= PER * gl_WorkGroupSize.x) {
        norm_group_cached(r, c, inj);
        return;
    }
    uint xb = p.x_off + r * p.x_stride + c * p.n, yb = p.y_off + r * p.y_stride + c * p.n;
    float ss = 0.0;
    if (COMBINE) {
        const float s = combine_weight(r, c);
        uint bb = p.b_off + r * p.b_stride;
        for (uint i = gl_LocalInvocationID.x; i < p.n; i += gl_WorkGroupSize.x) {
            precise float v = s * bv[bb + i];
            x[xb + i] += v;
        }
    }
    for (uint i = gl_LocalInvocationID.x; i < p.n; i += gl_WorkGroupSize.x) ss += x[xb + i] * x[xb + i];
    const float s = norm_factor(wg_sum(ss));
    uint g0 = p.gamma_off + c * p.n;
    if (ROPE) {
        uint half_rot = p.n_rot / 2u;
        float pt = float(pos[p.pos_off + r / p.n_heads]);
        for (uint i = gl_LocalInvocationID.x; i < p.n; i += gl_WorkGroupSize.x) {
            float v = normed(xb, g0, i, s);
            if (i < p.n_rot) {
                uint j = i % half_rot;
                float phi = pt * pow(p.theta, -2.0 * float(j) / float(p.n_rot));
                float cs = cos(phi), sn = sin(phi);
                float x0 = i < half_rot ? v : normed(xb, g0, j, s);
                float x1 = i < half_rot ? normed(xb, g0, j + half_rot, s) : v;
                v = i < half_rot ? x0 * cs - x1 * sn : x1 * cs + x0 * sn;
            }
            rotated[i] = v;
        }
        barrier();
        for (uint i = gl_LocalInvocationID.x; i < p.n; i += gl_WorkGroupSize.x) y[yb + i] = rotated[i];
        barrier();  // rotated is reused by the next group
    } else {
        for (uint i = gl_LocalInvocationID.x; i < p.n; i += gl_WorkGroupSize.x) {
            float v = normed(xb, g0, i, s);
            y[yb + i] = v;
            if (INJECT) add_inject(inj, c * p.n + i, v);
        }
    }
}

shared bool last_of_row;

// INJECT: group c's partial sums of ι, then, in the row's last workgroup, ι itself.
void inject_partials(uint r, uint c, float inj[MAX_HC]) {
    const uint tid = gl_LocalInvocationID.x, ng = p.n_groups;
    const uint pb = p.n_rows + r * ng * ng;  // P[r, ·, ·] after the counters
    [[unroll]] for (uint o = 0u; o < MAX_HC; ++o) {
        if (o < ng) {  // uniform
            float t = wg_sum(inj[o]);
            if (tid == 0u) part[pb + c * ng + o] = floatBitsToUint(t);
        }
    }
    if (tid == 0u) {
        memoryBarrierBuffer();  // P visible before the count says so
        last_of_row = atomicAdd(part[r], 1u) == ng - 1u;
    }
    barrier();
    if (last_of_row) {  // uniform
        memoryBarrierBuffer();
        if (tid < ng) {
            float s = 0.0;
            for (uint c2 = 0u; c2 < ng; ++c2) s += uintBitsToFloat(part[pb + c2 * ng + tid]);
            iota_out[p.iota_out_off + r * p.iota_out_stride + tid] = s;
        }
        if (tid == 0u) part[r] = 0u;
    }
    barrier();  // last_of_row is reused by the next group
}

void main() {
    uint total = p.n_rows * p.n_groups;
    for (uint k = gl_WorkGroupID.x; k < total; k += gl_NumWorkGroups.x) {
        uint r = k / p.n_groups, c = k - r * p.n_groups;
        float inj[MAX_HC];
        [[unroll]] for (uint o = 0u; o < MAX_HC; ++o) inj[o] = 0.0;
        norm_group(r, c, inj);
        if (INJECT) inject_partials(r, c, inj);
    }
}
