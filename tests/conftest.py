"""Shared fixtures: one Gpu per test session, and the refusal to test on a loop-truncating Mesa."""

from __future__ import annotations

import gc
import re

import pytest


def _mesa_too_old(driver_info: str) -> bool:
    """Debian 12's own Mesa (22.x) silently stops shader loops at 65535 iterations."""
    m = re.search(r"Mesa (\d+)\.", driver_info)
    return bool(m) and int(m.group(1)) < 24


_SESSION_GPUS: list = []  # the session's Gpu once made, for _arena_per_module


@pytest.fixture(autouse=True, scope="module")
def _arena_per_module():
    """After each test module, free the session Gpu's arena: its slots only grow (each to the largest
    intermediate any graph placed there), so over the one-process suite the slot-wise maxima of
    unrelated modules' graphs added up; and collect the module's cyclic garbage now, not at the
    collector's leisure: forwards made without the session Gpu (verify, the CLI, servers) hold a
    device of their own with its weights, caches and arena until then. (A fresh-clone run once
    segfaulted in kp allocating a buffer at 96%; what ran out is not known.)"""
    yield
    for g in _SESSION_GPUS:
        g.arena.clear()
    gc.collect()


@pytest.fixture(scope="session")
def gpu():
    """The device, with scalar f32 GEMMs, f32-activation GEMVs and the scalar flash kernel: the reference
    tests hold MODEL.md's f32 bounds, which the coopmat kernels' f16 inputs and the integer-dot GEMVs'
    8-bit activations (VKFLASH_GEMV_Q8) do not; their own tests turn them on (Gpu.with_options, or an
    explicit kernel choice)."""
    from dataclasses import replace

    from vkflash.gpu.context import Gpu
    from vkflash.gpu.options import GpuOptions

    g = Gpu(options=replace(GpuOptions.from_settings(), coopmat=False, fa_coopmat=False, gemv_q8=False))
    if g.caps.driver == "llvmpipe" and _mesa_too_old(g.caps.driver_info):
        pytest.exit(f"lavapipe from {g.caps.driver_info} truncates shader loops at 65535 iterations and would "
                    "give wrong results; install Mesa from bookworm-backports (launcher/setup does)", returncode=2)
    _SESSION_GPUS.append(g)
    return g


@pytest.fixture
def rng():
    """A fresh, unseeded generator: every run draws new inputs."""
    import numpy as np

    return np.random.default_rng()
