"""Load what the server serves: the GGUF (MODEL, or the default qwen2 model), its tokenizer and
chat template, and a Forward for it with the context CTX (0: the model's full context)."""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from vkflash.engine.api import EngineInfo, Forward
from vkflash.engine.qsa_config import QSAConfig
from vkflash.engine.reference_backend import ReferenceForward
from vkflash.errors import ConfigError, DoesNotFit, VkflashError
from vkflash.model.chat import QWEN3_THINKING_TEMPLATE
from vkflash.model.default_model import resolve_model
from vkflash.model.tokenizer import Tokenizer
from vkflash.model.hparams import HParams
from vkflash.model.model_file import open_model
from vkflash.model.weights import load_model
from vkflash.progress import Steps
from vkflash.settings import Settings

if TYPE_CHECKING:
    from vkflash.engine.speculate import Speculator

# knobs that steer the GPU forward only (BLKTOPK and GP reach the reference's QSA options); the
# reference backend says so instead of ignoring them silently
REFERENCE_IGNORES = ("KV", "DRAFT", "VKFLASH_MM_TILE_EPILOG", "VKFLASH_MMID_COMPACT", "VKFLASH_MMID_FAST_FETCH",
                     "VKFLASH_MMID_HALF", "VKFLASH_MM_SPLITK", "VKFLASH_PLE_RAW", "VKFLASH_QSA_SCORE_TILE",
                     "VKFLASH_MTP_CATCHUP_ASYNC", "VKFLASH_HC_FUSE", "VKFLASH_GDN_MATRIX", "VKFLASH_GDN_SPLIT",
                     "VKFLASH_ATTN_DECODE")


@dataclass
class Loaded:
    """A ready model: its forward, tokenizer and the facts /props and /v1/models report."""

    fwd: Forward
    tokenizer: Tokenizer
    info: EngineInfo


def _forward(settings: Settings, path: Path, hp: HParams, n_ctx: int, steps: Steps | None) -> tuple[Forward, str]:
    """The GPU forward when VKFLASH_BACKEND allows and the arch has step graphs, else the reference
    (only then are the weights dequantized on the host). `steps` reports the weight upload."""
    if uses_gpu(settings, hp.arch):
        from vkflash.engine.gpu_forward import GpuForward

        with steps.step("loading weights", "bytes") if steps else nullcontext(None) as progress:
            if settings["MTP"]:
                sp = open_speculator(path, settings["MODEL_DRAFT"] or None, settings["MODEL_DRAFT_SMALL"] or None,
                                     ctx=n_ctx, progress=progress)
                sp.fwd.reserve()  # the compute buffers of every step now, as the memory plan counts them
                return sp, "vulkan+mtp"
            fwd = GpuForward(path, ctx=n_ctx, progress=progress)
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


def preflight(settings: Settings, steps: Steps | None = None) -> str:
    """The memory plan's one-line summary for the model the settings name, with its MTP draft when
    MTP=1 (empty when it is not served by the GPU forward, or cannot be read: the load then says
    why); DoesNotFit, before any weight is loaded, when the configuration cannot even boot. The
    default model is fetched here when not cached (`steps` shows the download)."""
    from vkflash.engine.plan import DraftFiles, make_plan

    try:
        path = model_path(settings, steps)
        hp = open_model(path).hp  # the checked loader first: the plan builds on what it accepts
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


def model_path(settings: Settings, steps: Steps | None = None) -> Path:
    """MODEL if set (a local file), else the default model (fetched once, cached; `steps` shows the
    download)."""
    return resolve_model(settings["MODEL"] or None, "MODEL", steps)


def warm(fwd: Forward, steps: Steps | None) -> None:
    """Record every step graph the forward reserved (and the MTP rounds' graphs), so the pipelines
    are compiled now and not by the first request (minutes on lavapipe); `steps` shows how far."""
    from vkflash.engine.gpu_forward import GpuForward
    from vkflash.engine.speculate import Speculator

    sp = fwd if isinstance(fwd, Speculator) else None
    gpu_fwd = sp.fwd if sp is not None else fwd
    if not isinstance(gpu_fwd, GpuForward):
        return  # the NumPy reference compiles nothing
    todo = [g for g in gpu_fwd.graphs() if not g.submissions]
    with steps.step("compiling pipelines") if steps else nullcontext(None) as progress:
        for i, g in enumerate(todo):
            g.record()
            if progress:
                progress(i + 1, len(todo) + (sp is not None))
        gpu_fwd.compile_checkpoints()
        if sp is not None:
            sp.warm()
            if progress:
                progress(len(todo) + 1, len(todo) + 1)


def load(settings: Settings, steps: Steps | None = None) -> Loaded:
    """Read the model named by the settings through the checked loader (model_file.open_model: what
    `inspect` checks), build its forward (Vulkan or the NumPy reference) and compile its pipelines;
    `steps` reports each slow step (the serve log's progress)."""
    path = model_path(settings, steps)
    m = open_model(path)
    hp, tok = m.hp, m.require_tokenizer()
    n_ctx = settings["CTX"] or hp.n_ctx_train
    if n_ctx > hp.n_ctx_train:
        raise ConfigError(f"CTX={n_ctx} exceeds the model's context of {hp.n_ctx_train} tokens")
    template = m.chat_template or QWEN3_THINKING_TEMPLATE
    fwd, name = _forward(settings, path, hp, n_ctx, steps)
    warm(fwd, steps)
    info = EngineInfo(model_id=path.stem, model_path=str(path), arch=hp.arch, backend=name,
                      n_ctx=n_ctx, n_ctx_train=hp.n_ctx_train, n_vocab=hp.V, chat_template=template,
                      ubatch=settings["UB"])
    return Loaded(fwd, tok, info)
