// Workgroup reductions: subgroup operation first, then one shared-memory slot per subgroup,
// combined by every invocation in subgroup order (deterministic, same result in all lanes).
// Call from uniform control flow (every invocation of the workgroup must reach it).
// Works for any subgroup size (gl_SubgroupSize is read, never assumed).

shared float red_f32[gl_WorkGroupSize.x];
shared uint red_u32[gl_WorkGroupSize.x];

// Sum of v over the workgroup.
float wg_sum(float v) {
    v = subgroupAdd(v);
    if (subgroupElect()) red_f32[gl_SubgroupID] = v;
    barrier();
    float s = 0.0;
    for (uint i = 0u; i < gl_NumSubgroups; ++i) s += red_f32[i];
    barrier();  // the slots may be reused by the next reduction
    return s;
}

// Maximum of v over the workgroup.
float wg_max(float v) {
    v = subgroupMax(v);
    if (subgroupElect()) red_f32[gl_SubgroupID] = v;
    barrier();
    float m = red_f32[0];
    for (uint i = 1u; i < gl_NumSubgroups; ++i) m = max(m, red_f32[i]);
    barrier();
    return m;
}

// (v, idx) pairs ordered by larger v, then smaller idx (the first maximum, like numpy argmax).
bool argmax_better(float v, uint idx, float bv, uint bidx) {
    return v > bv || (v == bv && idx < bidx);
}

// The best (v, idx) pair of the workgroup; the result's idx is returned through `idx`.
float wg_argmax(float v, inout uint idx) {
    float m = subgroupMax(v);
    uint i = subgroupMin(v == m ? idx : 0xFFFFFFFFu);
    if (subgroupElect()) { red_f32[gl_SubgroupID] = m; red_u32[gl_SubgroupID] = i; }
    barrier();
    float bv = red_f32[0];
    uint bi = red_u32[0];
    for (uint s = 1u; s < gl_NumSubgroups; ++s) {
        if (argmax_better(red_f32[s], red_u32[s], bv, bi)) { bv = red_f32[s]; bi = red_u32[s]; }
    }
    barrier();
    idx = bi;
    return bv;
}
