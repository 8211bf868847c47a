// The stores of the decode GEMVs' modes (mul_mat_vec.comp, gemv.comp), one definition so both
// kernels round alike. The includer defines MODE, HC, TOPK, M (output rows per row group), the
// buffers ys / gate / streams and MV_SUM(c): block c's dot-product sum of output row i (the
// parameter of store), then includes this after common/mm.glsl.
//   MODE 0 (plain): y = epilogue(acc) (common/mm.glsl store_out).
//   MODE 1 (GLU): y = silu(acc_gate) · acc_up.
//   MODE 2 (HC mix): u = (Σ_c σ(s_c) · X[n, c·d + r]) · (1/hc), streams in order.
//   MODE 3 (MoE out): y = Σ_{j<k} ys[n·k + j, r] (slot order) + σ(g[n])·acc.
// `precise` keeps the plain multi-dispatch path's order and roundings (no contraction).
const uint MODE_PLAIN = 0u, MODE_GLU = 1u, MODE_HC = 2u, MODE_MOE = 3u;

// Output (n, r) of the group's output row i, per MODE.
void store(uint i, uint r, uint n) {
    if (MODE == MODE_PLAIN) {
        store_out(MV_SUM(0u), r, n);
    } else if (MODE == MODE_GLU) {
        precise float v = silu(MV_SUM(0u));
        v *= MV_SUM(1u);
        y[p.y_off + n * p.y_stride + r] = v;
    } else if (MODE == MODE_MOE) {
        precise float v = 0.0;
        for (uint j = 0u; j < TOPK; ++j) v += ys[p.ys_off + (n * TOPK + j) * p.y_stride + r];
        v += sigmoid(gate[p.gate_off + n * p.gate_stride]) * MV_SUM(0u);
        y[p.y_off + n * p.y_stride + r] = v;
    } else {
        const uint xr = p.streams_off + n * p.streams_stride + r;
        precise float u = 0.0;
        for (uint c = 0u; c < HC; ++c) {
            precise float gx = sigmoid(MV_SUM(c)) * streams[xr + c * p.n_out];
            u = c == 0u ? gx : u + gx;
        }
        y[p.y_off + n * p.y_stride + r] = u * p.inv_hc;  // mean, not sum
    }
}
