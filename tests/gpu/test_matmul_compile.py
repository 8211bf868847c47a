"""Every matmul variant (GEMV, scalar GEMM, cooperative-matrix GEMM × weight type) compiles and
passes spirv-val: the coopmat kernels cannot run on lavapipe, so this is their CI check."""

from __future__ import annotations

import pytest

from vkflash.gpu.compile_shaders import compile_variant, have_compiler
from vkflash.gpu.ops.matmul import KERNELS


@pytest.mark.skipif(not have_compiler(), reason="no shader compiler here (precompiled SPIR-V only)")
@pytest.mark.parametrize("k", KERNELS, ids=lambda k: k.name)
def test_compiles_and_validates(k):
    spv = compile_variant(k.shader, dict(k.defines), validate=True)
    assert spv[:4] == b"\x03\x02\x23\x07", "not a SPIR-V module"
