"""PLE per-stream gate (MODEL.md §5.3 P7–P8) in one dispatch: the score s_c of the normalised key
and query streams, the signed-sqrt sigmoid gate λ_c, and V_c = λ_c·v_p for every stream."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from vkflash.gpu.interface import PushConstants, SpecConstants, u32
from vkflash.gpu.ops.views import F32, Rows, grid
from vkflash.gpu.registry import Kernel

if TYPE_CHECKING:
    from vkflash.gpu.graph import Graph


@dataclass(frozen=True)
class PleGatePush(PushConstants):
    """ple_gate.comp's push constants: d, hc, tokens, then each view's offset and row stride."""

    d: u32
    hc: u32
    n_rows: u32
    k_off: u32
    k_stride: u32
    q_off: u32
    q_stride: u32
    vp_off: u32
    vp_stride: u32
    lam_off: u32
    lam_stride: u32
    v_off: u32
    v_stride: u32


KERNELS = [Kernel("ple_gate", "ple_gate.comp", 5, local_size=64, push=PleGatePush, spec=SpecConstants)]
MAX_GROUPS = 65535  # one workgroup per (token, stream); more loop


def ple_gate(g: "Graph", Kt: Rows, Qt: Rows, vp: Rows, lam: Rows, V: Rows, hc: int, name: str = "ple_gate") -> None:
    """λ_c = σ(sign(s_c)·√max(|s_c|, 1e-6)) with s_c = (K̃_c·Q̃_c)/√d, and V_c = λ_c·v_p:
    K̃, Q̃, V are T × hc·d, v_p T × d, λ T × hc."""
    T, d = vp.n_rows, vp.n_cols
    for label, v, cols in (("Kt", Kt, hc * d), ("Qt", Qt, hc * d), ("lam", lam, hc), ("V", V, hc * d)):
        if (v.n_rows, v.n_cols) != (T, cols):
            raise ValueError(f"{name}: {label} is {v.n_rows}x{v.n_cols}, needs {T}x{cols}")
    for out in (lam, V):
        for x in (Kt, Qt, vp):
            if out.overlaps(x):
                raise ValueError(f"{name}: an output overlaps an input")
    if lam.overlaps(V):
        raise ValueError(f"{name}: λ and V overlap")
    g.dispatch("ple_gate", [Kt.buf, Qt.buf, vp.buf, lam.buf, V.buf], [grid(T * hc, 1, MAX_GROUPS)],
               push=PleGatePush(d, hc, T, Kt.off, Kt.stride, Qt.off, Qt.stride, vp.off, vp.stride,
                                lam.off, lam.stride, V.off, V.stride),
               writes=[3, 4], name=name, desc=f"T={T} hc={hc} d={d}", nbytes=F32 * T * (3 * hc * d + d + hc))
