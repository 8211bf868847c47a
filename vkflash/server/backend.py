"""Load what the server serves: the GGUF (MODEL, or the default qwen2 model), its tokenizer and
chat template, and a Forward for it with the context CTX (0: the model's full context)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from vkflash.engine.api import EngineInfo, Forward
from vkflash.engine.qsa_config import QSAConfig
from vkflash.engine.reference_backend import ReferenceForward
from vkflash.errors import ConfigError, DoesNotFit, ModelError, VkflashError
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
REFERENCE_IGNORES = ("KV", "DRAFT", "VKFLASH_MM_TILE_EPILOG", "VKFLASH_MMID_COMPACT", "VKFLASH_HC_FUSE",
                     "VKFLASH_GDN_MATRIX", "VKFLASH_ATTN_DECODE")


@dataclass
class Loaded:
    """A ready model: its forward, tokenizer and the facts /props and /v1/models report."""

    fwd: Forward
    tokenizer: Tokenizer
    info: EngineInfo


def _forward(settings: Settings, path: Path, hp: HParams, n_ctx: int) -> tuple[Forward, str]:
    """The GPU forward when VKFLASH_BACKEND allows and the arch has step graphs, else the reference
    (only then are the weights dequantized on the host)."""
    if uses_gpu(settings, hp.arch):
        from vkflash.engine.gpu_forward import GpuForward

        if settings["MTP"]:
            sp = open_speculator(path, settings["MODEL_DRAFT"] or None, settings["MODEL_DRAFT_SMALL"] or None,
                                 ctx=n_ctx)
            sp.fwd.reserve()  # the compute buffers of every step now, as the memory plan counts them
            return sp, "vulkan+mtp"
        fwd = GpuForward(path, ctx=n_ctx)
        fwd.reserve()
        return fwd, "vulkan"
    if settings["MTP"]:
        raise ConfigError("MTP=1 needs the GPU forward (VKFLASH_BACKEND=gpu or auto with a qwen4exp model)")
    qsa = QSAConfig.from_settings(settings)
    fwd = ReferenceForward(load_model(path), n_ctx, gathered=qsa.gathered, **qsa.reference_options())
    unused = [k for k in REFERENCE_IGNORES if settings.sources.get(k, "default") != "default"]
    if unused:
        print(f"note: {', '.join(unused)} set but without effect on the NumPy reference backend", flush=True)
    return fwd, "numpy-reference"


def uses_gpu(settings: Settings, arch: str) -> bool:
    """Whether VKFLASH_BACKEND picks the GPU forward for this arch."""
    from vkflash.engine import graphs

    choice = settings["VKFLASH_BACKEND"]
    return choice == "gpu" or (choice == "auto" and arch in graphs.ARCHS)


def preflight(settings: Settings) -> str:
    """The memory plan's one-line summary for the model the settings name, with its MTP draft when
    MTP=1 (empty when it is not served by the GPU forward, or cannot be read: the load then says
    why); DoesNotFit, before any weight is loaded, when the configuration cannot even boot."""
    from vkflash.engine.plan import DraftFiles, make_plan

    try:
        path = model_path(settings)
        hp = hparams_from_gguf(path)
        if not uses_gpu(settings, hp.arch) or settings["CTX"] > hp.n_ctx_train:
            return ""
        draft = DraftFiles.from_settings(settings) if settings["MTP"] else None
        plan = make_plan(path, ctx=settings["CTX"] or hp.n_ctx_train, draft=draft)
    except DoesNotFit:
        raise
    except VkflashError:
        return ""
    if not plan.boot_fits:
        raise DoesNotFit(plan.summary())
    return plan.summary()


def open_speculator(path: Path, draft: str | None, small: str | None = None, **forward: object) -> "Speculator":
    """The MTP speculator of a model (its own MTP block, or the MTP-only GGUF `draft`; `small`: its
    smaller quant for the deep-context guard); says so."""
    from vkflash.engine.speculate import Speculator

    sp = Speculator.open(path, resolve_model(draft, "MODEL_DRAFT") if draft else None,
                         resolve_model(small, "MODEL_DRAFT_SMALL") if small else None, **forward)
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
