"""Fuzzing the checked GGUF loader (model_file.open_model, what `vkflash inspect` runs).

Damaged copies of a tiny qwen2 with a tokenizer and of a make-model hybrid (qwen3next or qwen4exp
in F32, F16, Q8_0 or the mix, drawn per run): truncations, byte flips and bytes set to 0xF5 / 0xFF
/ 0x00 in the header, metadata and tensor table, length / count / dim / offset fields set huge,
type fields set to nonsense, and a few flips in tensor data. Each must be refused with the project's own one-line
error, or load in full (tokenizer and every tensor, through the reference's loader); a sample goes
through the real `vkflash inspect` and `vkflash run` in subprocesses: one `error:` line or a
verdict that agrees, never a traceback. Every failure names its mutation (offsets and bytes).
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from engine.qwen2_tiny import write_qwen2
from test_run_verify import GEO, with_tokenizer
from vkflash.errors import VkflashError
from vkflash.model.make_model import TINY_QUANTS, make_model
from vkflash.model.model_file import open_model
from vkflash.model.weights import load_model

QWEN2_MUTATIONS, HYBRID_MUTATIONS = 1000, 250
IN_PROCESS_BUDGET_S = 40.0  # stop early past this (slow machines): fewer files, never a timeout
CLI_QWEN2, CLI_HYBRID = 14, 4  # files through the real CLI (inspect and run each)
SPECIAL_BYTES = (0xF5, 0xFF, 0x00)
DATA_FLIP = "tensor data flip"  # the one mutation that leaves a valid file
_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


# ---- where things are in a GGUF --------------------------------------------------------------

@dataclass(frozen=True)
class Span:
    """One field of a GGUF's header, metadata or tensor table: offset, size, what it is."""

    offset: int
    size: int
    what: str
    kind: str  # "length" (of a string, an array, dims), "type", "offset", "value", "bytes", "head"


@dataclass
class Layout:
    """The spans of a valid GGUF, up to the start of its tensor data."""

    spans: list[Span]
    data_start: int

    def at(self, offset: int) -> str:
        """The field holding byte `offset`, for failure messages."""
        for s in self.spans:
            if s.offset <= offset < s.offset + s.size:
                return f"{s.what} +{offset - s.offset}"
        return "tensor data" if offset >= self.data_start else "padding"


def layout_of(b: bytes) -> Layout:
    """Walk a valid GGUF v3 (independently of the reader under test) and list its fields."""
    spans: list[Span] = []
    pos = 0

    def take(n: int, what: str, kind: str) -> int:
        nonlocal pos
        spans.append(Span(pos, n, what, kind))
        pos += n
        return int.from_bytes(b[pos - n:pos], "little")

    def string(what: str) -> str:
        nonlocal pos
        n = take(8, f"{what} length", "length")
        text = b[pos:pos + n].decode()
        take(n, f"{what} bytes", "bytes")
        return text

    def value(t: int, what: str) -> None:
        nonlocal pos
        if t == 8:
            string(what)
        elif t == 9:
            item = take(4, f"{what} item type", "type")
            count = take(8, f"{what} count", "length")
            if item in _SCALAR_SIZES:  # numbers: one span for all (one per token would be too many)
                take(count * _SCALAR_SIZES[item], f"{what} items", "bytes")
            for i in range(count if item not in _SCALAR_SIZES else 0):
                value(item, f"{what}[{i}]")
        else:
            take(_SCALAR_SIZES[t], f"{what} value", "value")

    take(8, "magic and version", "head")
    n_tensors, n_kv = take(8, "tensor count", "length"), take(8, "kv count", "length")
    for _ in range(n_kv):
        key = string("key")
        value(take(4, f"{key} type", "type"), key)
    for _ in range(n_tensors):
        name = string("tensor name")
        for i in range(take(4, f"{name} n_dims", "length")):
            take(8, f"{name} ne{i}", "length")
        take(4, f"{name} type", "type")
        take(8, f"{name} offset", "offset")
    return Layout(spans, pos)


# ---- mutations --------------------------------------------------------------------------------

@dataclass(frozen=True)
class Mutation:
    """Bytes written at offsets and/or a cut length; `describe` says exactly which, to replay it."""

    edits: tuple[tuple[int, bytes], ...] = ()
    cut: int | None = None
    why: str = ""

    def apply(self, data: bytes) -> bytes:
        out = bytearray(data if self.cut is None else data[:self.cut])
        for off, new in self.edits:
            out[off:off + len(new)] = new
        return bytes(out)

    def patch(self, path: Path, data: bytes, undo: bool = False) -> None:
        """Write the edits into `path` (a copy of data) in place, or put the original bytes back."""
        with path.open("r+b") as f:
            for off, new in self.edits:
                f.seek(off)
                f.write(data[off:off + len(new)] if undo else new)

    def describe(self, original: bytes, layout: Layout) -> str:
        parts = [f"cut to {self.cut} bytes ({layout.at(self.cut)})"] if self.cut is not None else []
        parts += [f"byte {off}: {original[off:off + len(new)].hex()} -> {new.hex()} ({layout.at(off)})"
                  for off, new in self.edits]
        return f"{self.why}: " + "; ".join(parts)


def _huge(rng: np.random.Generator, size: int, file_size: int, old: int) -> int:
    """A value for a length/offset field that points far past anything real."""
    top = (1 << (8 * size)) - 1
    choices = [top, 1 << (8 * size - 1), min(top, file_size), min(top, file_size + int(rng.integers(1, 4096))),
               min(top, old + int(rng.integers(1, 64))), int(rng.integers(0, top, endpoint=True, dtype=np.uint64))]
    if size == 8:
        choices.append(1 << 32)
    return int(choices[int(rng.integers(len(choices)))])


def mutations(rng: np.random.Generator, data: bytes, layout: Layout) -> Iterator[Mutation]:
    """An endless stream of random mutations, weighted toward header, metadata and tensor table."""
    head = layout.data_start
    numeric = [s for s in layout.spans if s.kind in ("length", "offset")]
    typed = [s for s in layout.spans if s.kind == "type"]
    values = [s for s in layout.spans if s.kind == "value"]

    def other(old: bytes) -> int:
        """One of SPECIAL_BYTES that changes `old` (filled with it)."""
        return int(rng.choice([b for b in SPECIAL_BYTES if bytes([b]) * len(old) != old]))

    def some_offsets() -> list[int]:
        return [int(o) for o in rng.integers(0, head, int(rng.integers(1, 4)))]

    while True:
        kind = int(rng.integers(8))
        if kind == 0:  # truncation anywhere, half of them inside the header
            top = head if rng.random() < 0.5 else len(data)
            yield Mutation(cut=int(rng.integers(0, top)), why="truncated")
        elif kind == 1:
            yield Mutation(tuple((o, bytes([data[o] ^ int(rng.integers(1, 256))])) for o in some_offsets()),
                           why="random byte flips")
        elif kind in (2, 3):
            yield Mutation(tuple((o, bytes([other(data[o:o + 1])])) for o in some_offsets()),
                           why="bytes set to 0xF5/0xFF/0x00")
        elif kind == 4:
            s = numeric[int(rng.integers(len(numeric)))]
            old = int.from_bytes(data[s.offset:s.offset + s.size], "little")
            new = _huge(rng, s.size, len(data), old)
            yield Mutation(((s.offset, new.to_bytes(s.size, "little")),), why="length field set huge")
        elif kind == 5:
            s = typed[int(rng.integers(len(typed)))]
            new = int(rng.choice([int(rng.integers(0, 45)), 0xF5F5F5F5, 0xFFFFFFFF]))
            yield Mutation(((s.offset, new.to_bytes(4, "little")),), why="type field changed")
        elif kind == 6:
            s = values[int(rng.integers(len(values)))]
            fill = bytes([other(data[s.offset:s.offset + s.size])]) * s.size
            yield Mutation(((s.offset, fill),), why="scalar value overwritten")
        else:  # tensor data: the file stays valid and must load
            o = int(rng.integers(head, len(data)))
            yield Mutation(((o, bytes([data[o] ^ int(rng.integers(1, 256))])),), why=DATA_FLIP)


# ---- the checked path, in process -------------------------------------------------------------

@dataclass
class Outcome:
    """What the checked loader said about one damaged copy of `source`."""

    source: Path
    mutation: Mutation
    what: str  # the mutation, described
    error: str | None  # the one-line message; None: valid (and it loaded)

    def write(self, path: Path) -> Path:
        """The damaged file, written again (only the CLI sample needs it on disk after the check)."""
        path.write_bytes(self.mutation.apply(self.source.read_bytes()))
        return path


@dataclass
class Fuzz:
    """Outcomes of one fuzz run and the failures: foreign exceptions, multi-line errors, false valids."""

    outcomes: list[Outcome] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)


def check_in_process(path: Path) -> str | None:
    """None when the checked loader accepts `path` and it then loads in full; the error text if refused.
    Anything else (a foreign exception, a valid file that does not load) raises."""
    try:
        m = open_model(path)
    except VkflashError as e:
        return str(e)
    try:
        tok = m.require_tokenizer()
        tok.decode(tok.encode("hi, def f(x): return x ✨ <|im_end|>"), special=True)
        with np.errstate(invalid="ignore", over="ignore"):  # a flipped scale byte may decode to inf / NaN
            load_model(m.file)  # every tensor dequantized and laid out as the reference forward reads it
    except Exception as e:
        raise AssertionError(f"valid per open_model, but loading failed: {type(e).__name__}: {e}") from e
    return None


def fuzz(rng: np.random.Generator, source: Path, n: int, scratch: Path, deadline: float) -> Fuzz:
    """n damaged copies of source through check_in_process (fewer if the deadline passes)."""
    data = source.read_bytes()
    layout = layout_of(data)
    result = Fuzz()
    patched, cut = scratch.with_suffix(".patched.gguf"), scratch.with_suffix(".cut.gguf")
    patched.write_bytes(data)  # edits go in place and are undone: no 20 MB copy per file
    for _, mut in zip(range(n), mutations(rng, data, layout)):
        if time.monotonic() > deadline:
            break
        if mut.cut is None:
            mut.patch(patched, data)
        else:
            cut.write_bytes(memoryview(data)[:mut.cut])
        what = mut.describe(data, layout)
        try:
            error = check_in_process(patched if mut.cut is None else cut)
        except Exception as e:  # the point: anything but a VkflashError is a finding
            result.failures.append(f"{source.name}, {what}: {type(e).__name__}: {e}")
            continue
        finally:
            if mut.cut is None:
                mut.patch(patched, data, undo=True)
        if error is not None and ("\n" in error or not error.strip()):
            result.failures.append(f"{source.name}, {what}: not one line: {error!r}")
        if error is not None and mut.why == DATA_FLIP:
            result.failures.append(f"{source.name}, {what}: a flipped weight byte is refused: {error}")
        result.outcomes.append(Outcome(source, mut, what, error))
    return result


def qwen2_model(rng: np.random.Generator, tmp_path: Path) -> Path:
    """A tiny Q8_0 qwen2 (test_run_verify's geometry) with the tiny BPE and a chat template."""
    bare = tmp_path / "bare.gguf"
    write_qwen2(bare, rng, GEO, Q.Q8_0)
    return with_tokenizer(bare, tmp_path / "qwen2.gguf")


def hybrid_model(rng: np.random.Generator, tmp_path: Path) -> Path:
    """A make-model tiny qwen3next or qwen4exp in one of its quants (all drawn), fresh seed."""
    arch, quant = str(rng.choice(["qwen3next", "qwen4exp"])), str(rng.choice(TINY_QUANTS))
    return make_model(arch, "tiny", quant, int(rng.integers(1 << 30)), tmp_path / f"{arch}-{quant}.gguf")[0]


def run_fuzz(rng: np.random.Generator, tmp_path: Path, n_qwen2: int, n_hybrid: int) -> tuple[Fuzz, Fuzz]:
    """Both models fuzzed within IN_PROCESS_BUDGET_S: (qwen2, hybrid)."""
    deadline = time.monotonic() + IN_PROCESS_BUDGET_S
    scratch = tmp_path / "damaged"
    q = fuzz(rng, qwen2_model(rng, tmp_path), n_qwen2, scratch, deadline)
    return q, fuzz(rng, hybrid_model(rng, tmp_path), n_hybrid, scratch, deadline)


def test_damaged_files_are_refused_in_one_line_or_load(rng, tmp_path):
    """≥ 1000 damaged files: each a VkflashError of one line, or valid and loadable in full."""
    t0 = time.monotonic()
    q, h = run_fuzz(rng, tmp_path, QWEN2_MUTATIONS, HYBRID_MUTATIONS)
    failures = q.failures + h.failures
    n = len(q.outcomes + h.outcomes) + len(failures)
    assert not failures, f"{len(failures)} of {n} damaged files:\n" + "\n".join(failures[:40])
    refused = sum(o.error is not None for o in q.outcomes + h.outcomes)
    print(f"{n} damaged files in {time.monotonic() - t0:.1f} s: {refused} refused, {n - refused} valid and loaded")
    assert refused > n // 2  # the mutations mostly hit what the loader checks


# ---- the real CLI on a sample -------------------------------------------------------------------

def vkflash(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "vkflash.cli", *args], capture_output=True, text=True, timeout=300)


def sample(rng: np.random.Generator, outcomes: list[Outcome], n: int) -> list[Outcome]:
    """n outcomes: one per distinct kind of refusal first (the message's first words), then valid
    ones (at most a quarter: they run the GPU forward), then any."""
    def kind(o: Outcome) -> str:
        return "valid" if o.error is None else " ".join(o.error.split(": ", 1)[-1].split()[:3])

    order = [outcomes[int(i)] for i in rng.permutation(len(outcomes))]
    picked: dict[int, Outcome] = {}
    seen: set[str] = set()
    for o in order:
        if o.error is not None and kind(o) not in seen and len(picked) < n - n // 4:
            seen.add(kind(o))
            picked[id(o)] = o
    for o in [o for o in order if o.error is None][: n // 4]:
        picked[id(o)] = o
    for o in order:
        if len(picked) >= n:
            break
        picked.setdefault(id(o), o)
    return list(picked.values())[:n]


def cli_problems(o: Outcome, path: Path, run_it: bool) -> list[str]:
    """What is wrong with `vkflash inspect` (and `vkflash run … -p hi --max-tokens 1`) on one damaged file."""
    problems: list[str] = []
    o.write(path)
    commands: list[tuple[str, ...]] = [("inspect", str(path))]
    if run_it:
        commands.append(("run", str(path), "-p", "hi", "--max-tokens", "1"))
    for args in commands:
        r = vkflash(*args)
        lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
        said = f"`vkflash {args[0]}` ({o.source.name}, {o.what}): exit {r.returncode}, stderr {r.stderr[-2000:]!r}"
        if "Traceback" in r.stderr or "Traceback" in r.stdout:
            problems.append(f"traceback from {said}")
        elif args[0] == "inspect":
            if (r.returncode == 0) != (o.error is None):
                problems.append(f"inspect disagrees with the checked loader ({o.error!r}): {said}")
            elif r.returncode == 0 and "valid" not in r.stdout:
                problems.append(f"inspect exit 0 without 'valid': {said}")
            elif r.returncode != 0 and (len(lines) != 1 or not lines[0].startswith("error: ")):
                problems.append(f"inspect error not one line: {said}")
        elif o.error is not None and (r.returncode == 0 or len(lines) != 1 or not lines[0].startswith("error: ")):
            problems.append(f"run on a refused file is not one error line: {said}")
        elif o.error is None and r.returncode != 0 and not (lines and lines[-1].startswith("error: ")):
            problems.append(f"run on a valid file failed without an error line: {said}")
    return problems


@pytest.mark.gpu
def test_cli_on_damaged_files(rng, tmp_path):
    """A sample of damaged files through the real CLI in subprocesses (two at a time): inspect agrees
    with the checked loader in one line; run never prints a traceback (valid qwen2 files run on the
    device; hybrid ones only through inspect and run's refusal, their pipelines are slow on lavapipe)."""
    q, h = run_fuzz(rng, tmp_path, 150, 60)
    jobs = [(o, True) for o in sample(rng, q.outcomes, CLI_QWEN2)]
    jobs += [(o, o.error is not None) for o in sample(rng, h.outcomes, CLI_HYBRID)]
    with ThreadPoolExecutor(2) as pool:
        found = pool.map(lambda i: cli_problems(jobs[i][0], tmp_path / f"cli-{i}.gguf", jobs[i][1]), range(len(jobs)))
        problems = [p for ps in found for p in ps]
    assert not problems, "\n".join(problems)
