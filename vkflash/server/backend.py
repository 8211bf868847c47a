"""Load what the server serves: the GGUF (MODEL, or the default qwen2 model), its tokenizer and
chat template, and a Forward for it with the context CTX (0: the model's full context)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from vkflash.engine.api import EngineInfo, Forward
from vkflash.engine.reference_backend import ReferenceForward
from vkflash.errors import ConfigError, ModelError
from vkflash.model.chat import QWEN3_THINKING_TEMPLATE
from vkflash.model.default_model import resolve_model
from vkflash.model.tokenizer import Tokenizer, read_tokenizer_meta
from vkflash.model.hparams import HParams, hparams_from_gguf
from vkflash.model.weights import load_model
from vkflash.settings import Settings

if TYPE_CHECKING:
    from vkflash.engine.speculate import Speculator

# knobs that steer the GPU forward only (BLKTOPK and GP reach the reference's QSA options); the
# reference backend says so instead of ignoring them silently
REFERENCE_IGNORES = ("KV", "DRAFT", "VKFLASH_MM_TILE_EPILOG", "VKFLASH_MMID_COMPACT", "VKFLASH_HC_FUSE")


@dataclass
class Loaded:
    """A ready model: its forward, tokenizer and the facts /props and /v1/models report."""

    fwd: Forward
    tokenizer: Tokenizer
    info: EngineInfo


def _forward(settings: Settings, path: Path, hp: HParams, n_ctx: int) -> tuple[Forward, str]:
    """The GPU forward when VKFLASH_BACKEND allows and the arch has step graphs, else the reference
    (only then are the weights dequantized on the host)."""
    from vkflash.engine import graphs

    choice = settings["VKFLASH_BACKEND"]
    if choice == "gpu" or (choice == "auto" and hp.arch in graphs.ARCHS):
        from vkflash.engine.gpu_forward import GpuForward

        if settings["MTP"]:
            return open_speculator(path, settings["MODEL_DRAFT"] or None, ctx=n_ctx), "vulkan+mtp"
        return GpuForward(path, ctx=n_ctx), "vulkan"
    if settings["MTP"]:
        raise ConfigError("MTP=1 needs the GPU forward (VKFLASH_BACKEND=gpu or auto with a qwen4exp model)")
    fwd = ReferenceForward(load_model(path), n_ctx, qsa_mode="block" if settings["BLKTOPK"] else "cell",
                           gathered=bool(settings["GP"]))
    unused = [k for k in REFERENCE_IGNORES if settings.sources.get(k, "default") != "default"]
    if unused:
        print(f"note: {', '.join(unused)} set but without effect on the NumPy reference backend", flush=True)
    return fwd, "numpy-reference"


def open_speculator(path: Path, draft: str | None, **forward: object) -> "Speculator":
    """The MTP speculator of a model (its own MTP block, or the MTP-only GGUF `draft`); says so."""
    from vkflash.engine.speculate import Speculator
    from vkflash.model.default_model import resolve_model

    sp = Speculator.open(path, resolve_model(draft, "MODEL_DRAFT") if draft else None, **forward)
    print(sp.describe(), flush=True)
    return sp


def model_path(settings: Settings) -> Path:
    """MODEL if set (it must exist), else the embedded default model (fetched once, cached)."""
    return resolve_model(settings["MODEL"] or None, "MODEL")


def load(settings: Settings) -> Loaded:
    """Read the model named by the settings and build its forward (Vulkan or the NumPy reference)."""
    path = model_path(settings)
    hp = hparams_from_gguf(path)
    n_ctx = settings["CTX"] or hp.n_ctx_train
    if n_ctx > hp.n_ctx_train:
        raise ConfigError(f"CTX={n_ctx} exceeds the model's context of {hp.n_ctx_train} tokens")
    meta = read_tokenizer_meta(path)
    tok = Tokenizer.from_fields(meta)
    if tok.vocab_size > hp.V:
        raise ModelError(f"{path.name}: the tokenizer has {tok.vocab_size} tokens but the model only {hp.V}")
    template = str(meta.get("tokenizer.chat_template") or QWEN3_THINKING_TEMPLATE)
    fwd, name = _forward(settings, path, hp, n_ctx)
    info = EngineInfo(model_id=path.stem, model_path=str(path), arch=hp.arch, backend=name,
                      n_ctx=n_ctx, n_ctx_train=hp.n_ctx_train, n_vocab=hp.V, chat_template=template,
                      ubatch=settings["UB"])
    return Loaded(fwd, tok, info)
