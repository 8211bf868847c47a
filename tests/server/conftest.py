"""Server test fixtures: a tiny generated model and its tokenizer, in-process server cleanup."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from harness import InProcess, stop_in_process  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """A tiny random qwen4exp GGUF with the Qwen chat template (fresh seed each session)."""
    from vkflash.model.make_model import make_model

    seed = int(np.random.default_rng().integers(0, 2**31))
    out = tmp_path_factory.mktemp("model") / f"tiny-{seed}.gguf"
    return make_model("qwen4exp", "tiny", None, seed, out)[0]


@pytest.fixture(scope="session")
def tokenizer(tiny_model):
    from vkflash.model.tokenizer import Tokenizer

    return Tokenizer.from_gguf(tiny_model)


@pytest.fixture
def in_process() -> Iterator[list[InProcess]]:
    """Collects in-process servers and stops them after the test."""
    started: list[InProcess] = []
    yield started
    for p in started:
        stop_in_process(p)
