"""Step graphs per architecture: each arch module offers `attention_layers(hp)`, a `Scratch` with
`allocate(gpu, hp, ub, n_split)`, and `build(g, model, scratch, n, head)` listing its gpu ops.
Optional hooks: `weight_transforms(gf, hp)` (upload re-layouts), `weight_stacks(gf, hp)` (projections
uploaded as one buffer, VKFLASH_STACK_WEIGHTS), `extra_dim(hp)` (f32 per-token
params rows), `allocate_state(gpu, gf, hp, n_ctx, kv_type, ub)` → an object with reset(),
before_step(params, ids), stepped(ids) and truncate(back) -> bool (recurrent and QSA state)."""

from __future__ import annotations

from types import ModuleType

from vkflash.engine.graphs import qwen2, qwen3next, qwen4exp
from vkflash.errors import ModelError

ARCHS: dict[str, ModuleType] = {"qwen2": qwen2, "qwen3next": qwen3next, "qwen4exp": qwen4exp}


def for_arch(arch: str) -> ModuleType:
    """The step-graph module of `arch`; ModelError when the GPU forward does not have it yet."""
    try:
        return ARCHS[arch]
    except KeyError:
        raise ModelError(f"the GPU forward does not support arch {arch!r} yet (has: {', '.join(ARCHS)})") from None
