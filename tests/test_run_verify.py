"""`vkflash run` and `vkflash verify` on tiny random qwen2 models (lavapipe): streamed text and rates,
a clean stop at the context end (prompt and chat), verify passing on a correct model and naming
the first diverging op when a weight buffer is corrupted after upload."""

from __future__ import annotations

import io
from dataclasses import replace
import re
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from rich.console import Console
from typer.testing import CliRunner

from engine.qwen2_tiny import Geometry, write_qwen2
from vkflash import cli, verify
from vkflash.engine.api import SamplingParams
from vkflash.formats.gguf_file import GGUFFile
from vkflash.formats.gguf_write import RawTensor, write_gguf
from vkflash.model.chat import QWEN3_THINKING_TEMPLATE
from vkflash.model.vocab_build import tiny_vocab
from vkflash.run import chat_loop, open_session, run_prompt

pytestmark = pytest.mark.gpu

VOCAB = tiny_vocab(512)
# fixed ragged geometry (lavapipe's shader cache keeps repeated pipelines fast); weights are fresh
GEO = Geometry(d=64, H=2, H_kv=1, Dh=32, F=96, V=len(VOCAB.tokens), L=2)
N_TOKENS = 12  # verify's token count: one size, so the step pipelines are compiled once per run
ANSI = re.compile(rb"\x1b\[[0-9;?]*[A-Za-z]")  # rich's colours and cursor moves on a terminal
RATES = re.compile(r"prefill (\d+) tokens at ([\d.]+) tok/s, decode (\d+) tokens at ([\d.]+) tok/s")


def with_tokenizer(src: Path, dst: Path) -> Path:
    """Copy a tokenizer-less qwen2 GGUF, adding the tiny BPE vocabulary and the chat template."""
    f = GGUFFile(src)
    meta = {k: v for k, v in f.metadata.items() if k != "general.architecture"}
    meta.update({
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": VOCAB.pre, "tokenizer.ggml.tokens": VOCAB.tokens,
        "tokenizer.ggml.token_type": np.asarray(VOCAB.token_types, np.int32),
        "tokenizer.ggml.merges": VOCAB.merges, "tokenizer.ggml.bos_token_id": VOCAB.bos_id,
        "tokenizer.ggml.eos_token_id": VOCAB.eos_id, "tokenizer.ggml.add_bos_token": False,
        "tokenizer.chat_template": QWEN3_THINKING_TEMPLATE,
    })
    write_gguf(dst, f.arch, meta, {n: RawTensor(t.data.tobytes(), t.ggml_type, t.ne) for n, t in f.tensors.items()})
    return dst


@pytest.fixture
def chat_model(tmp_path: Path, rng: np.random.Generator) -> Path:
    """A tiny Q8_0 qwen2 with a tokenizer and a 4096-token training context."""
    bare = tmp_path / "bare.gguf"
    write_qwen2(bare, rng, GEO, Q.Q8_0)
    return with_tokenizer(bare, tmp_path / "chat.gguf")


def _console() -> tuple[Console, io.StringIO]:
    buf = io.StringIO()
    return Console(file=buf, width=200), buf


def test_run_streams_text_and_rates(gpu, chat_model):
    """A prompt through the chat template: the streamed text is the detokenized output, the rates
    line counts the prompt and the generated tokens (max_tokens caps it, no context message)."""
    err, log = _console()
    session = open_session(chat_model, err, ctx=256, ub=16)
    out = io.StringIO()
    n = 12
    fin = run_prompt(session, "def fibonacci(n):", SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True),
                     out, err)
    assert fin.reason == "length" and fin.completion_tokens == n
    m = RATES.search(log.getvalue())
    assert m, log.getvalue()
    assert int(m.group(1)) == fin.prompt_tokens > 5 and int(m.group(3)) == n
    assert float(m.group(2)) > 0 and float(m.group(4)) > 0
    assert "context end" not in log.getvalue()
    assert "loading" not in out.getvalue() and out.getvalue().endswith("\n")
    # the streamed text is exactly what the greedy tokens decode to (rerun step by step)
    session.fwd.reset()
    greedy = [session.fwd.prefill_argmax(session.tokenizer.encode(_template_of(session, "def fibonacci(n):")))]
    for _ in range(n - 1):
        greedy.append(session.fwd.decode_argmax(greedy[-1]))
    assert out.getvalue() == session.tokenizer.decode(greedy) + "\n"


def _template_of(session, user: str) -> str:
    from vkflash.model.chat import render_chat

    return render_chat(session.template, [{"role": "user", "content": user}])


def test_run_stops_at_context_end(gpu, chat_model):
    """With no max_tokens and EOS ignored, output fills the context exactly and stops with a message."""
    err, log = _console()
    ctx = 40
    session = open_session(chat_model, err, ctx=ctx, ub=16)
    fin = run_prompt(session, "hi", SamplingParams(temperature=0.0, ignore_eos=True), io.StringIO(), err, raw=True)
    assert fin.reason == "length" and fin.prompt_tokens + fin.completion_tokens == ctx
    assert f"context end reached ({ctx} tokens)" in log.getvalue()


def test_chat_fills_context_then_asks_for_reset(gpu, chat_model):
    """Chat turns keep the history; when a reply fills the context, or the history no longer fits,
    chat says so instead of failing, and /reset starts over."""
    err, log = _console()
    session = open_session(chat_model, err, ctx=64, ub=16)
    lines = iter(["hello", "what is 2 + 2?", "again", "/reset", "hi", "/exit", "never read"])
    out = io.StringIO()
    chat_loop(session, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True), lambda: next(lines, None),
              out, err)
    text = log.getvalue()
    assert "context end reached" in text and "/reset" in text and "conversation cleared" in text
    assert len(RATES.findall(text)) >= 2  # at least the first turn and the turn after /reset
    assert next(lines) == "never read"


def test_cli_run_prompt(gpu, chat_model):
    """`vkflash run MODEL -p …`: exit 0, text on stdout, rates on stderr."""
    r = CliRunner().invoke(cli.app, ["run", str(chat_model), "-p", "hello", "-n", "5", "--ctx", "128", "--ub", "16"])
    assert r.exit_code == 0, r.stderr
    assert RATES.search(r.stderr), r.stderr
    assert r.stdout.endswith("\n") and "prefill" not in r.stdout


@pytest.mark.timeout(180)
@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_cli_run_prompt_stopped_by_a_signal(gpu, chat_model, sig):
    """`vkflash run -p` stopped mid-stream by Ctrl-C or SIGTERM: the text so far ends in a newline, the
    rates say (stop: cancelled), no traceback, and the exit status is the shell's 128 + signal."""
    import signal
    import subprocess
    import sys

    p = subprocess.Popen([sys.executable, "-m", "vkflash.cli", "run", str(chat_model), "-p", "hello", "-n", "100000",
                          "--ignore-eos", "--ctx", "4096", "--ub", "16"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, start_new_session=True)
    assert p.stdout is not None
    got = p.stdout.read(8)  # some of the reply is out: generation runs
    signum = getattr(signal, sig)
    p.send_signal(signum)
    out, err = p.communicate(timeout=120)
    text, errs = (got + out).decode(errors="replace"), err.decode(errors="replace")
    assert p.returncode == 128 + signum, errs
    assert text.endswith("\n") and "Traceback" not in errs, errs
    assert re.search(r"\(stop:\s+cancelled\)", errs), errs


@pytest.mark.parametrize("bad", [np.nan, np.inf])
@pytest.mark.parametrize("temp", ["0", "0.7"])
def test_cli_run_on_non_finite_logits(gpu, chat_model, rng, bad, temp):
    """A model whose logits come out NaN or infinite (one output_norm weight set so, as damaged data
    can) is one error line from `vkflash run`, greedy (device argmax) or sampled (host logits)."""
    t = GGUFFile(chat_model).tensors["output_norm.weight"]
    b = bytearray(chat_model.read_bytes())
    at = t.offset + 4 * int(rng.integers(0, t.ne[0]))
    b[at:at + 4] = np.float32(bad).tobytes()
    chat_model.write_bytes(b)
    r = CliRunner().invoke(cli.app, ["run", str(chat_model), "-p", "hello", "-n", "3", "--temp", temp,
                                     "--ctx", "128", "--ub", "16"])
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.exit_code != 0, r.stderr
    assert lines and lines[-1].startswith("error: the model produced NaN or infinite logits"), r.stderr
    assert "Traceback" not in r.stderr and r.stdout.strip() == ""


def test_shapes_beyond_the_kernels_are_one_line(gpu, tmp_path, rng):
    """A valid file whose head dim (48) the attention kernels do not run: `inspect` calls it valid,
    `run`, `verify` and `plan` stop with one error line naming the shape, no traceback."""
    bare = tmp_path / "bare.gguf"
    write_qwen2(bare, rng, Geometry(d=64, H=2, H_kv=1, Dh=48, F=96, V=len(VOCAB.tokens), L=2), Q.F32)
    path = str(with_tokenizer(bare, tmp_path / "dh48.gguf"))
    assert CliRunner().invoke(cli.app, ["inspect", path]).exit_code == 0
    for args in (["run", path, "-p", "hi", "-n", "2", "--ctx", "64"], ["verify", path], ["plan", path]):
        r = CliRunner().invoke(cli.app, args)
        lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
        assert r.exit_code != 0 and "Traceback" not in r.stderr, (args, r.stderr)
        assert lines[-1].startswith("error: this model's shapes are beyond what vkflash's kernels run here"), args
        assert "head dim 48 is not a multiple of 32" in lines[-1], (args, lines[-1])


def test_verify_one_token_vocabulary(gpu, tmp_path, rng):
    """A one-token vocabulary (no top two logits to call a near-tie) verifies and passes."""
    path = tmp_path / "v1.gguf"
    write_qwen2(path, rng, replace(GEO, V=1), Q.F32)
    r = CliRunner().invoke(cli.app, ["verify", str(path)])
    assert r.exit_code == 0 and "PASS" in r.stdout, r.stdout + r.stderr


def test_cli_run_mtp(gpu, tmp_path, rng):
    """`vkflash run --mtp`: the MTP line at startup, the drafted/accepted counts with the rates, and
    the same greedy text as without, also with --draft-small (named in the MTP line); a model
    without an MTP block is one error line."""
    from vkflash.model.make_model import make_model

    seed = int(rng.integers(1 << 31))
    path = make_model("qwen4exp", "tiny", "F32", seed, tmp_path / "m.gguf", mtp_block=True)[0]
    args = ["run", str(path), "-p", "hello", "-n", "8", "--ctx", "96", "--ub", "16", "--temp", "0"]
    plain = CliRunner().invoke(cli.app, args)
    r = CliRunner().invoke(cli.app, [*args, "--mtp"])
    assert r.exit_code == 0, r.stderr
    err = " ".join(r.stderr.split())  # the console wraps lines
    assert "MTP: drafting up to 6 (temperature 0) or 4 (sampling) tokens a round" in err
    assert re.search(r"\d+ of \d+ drafted tokens accepted", err), err
    assert r.stdout == plain.stdout
    small = make_model("qwen4exp", "tiny", "Q8_0", seed, tmp_path / "q.gguf", mtp_separate=True)[1]
    r = CliRunner().invoke(cli.app, [*args, "--mtp", "--draft-small", str(small)])
    assert r.exit_code == 0, r.stderr
    assert f"({small.name} when the deep-context guard needs its memory)" in " ".join(r.stderr.split())
    assert r.stdout == plain.stdout
    bare = make_model("qwen4exp", "tiny", "F32", seed, tmp_path / "b.gguf")[0]
    bad = CliRunner().invoke(cli.app, ["run", str(bare), "-p", "hi", "-n", "2", "--ctx", "64", "--mtp"])
    assert bad.exit_code == 1 and "no MTP block" in bad.stderr


# --- verify ---------------------------------------------------------------------------------

@pytest.fixture
def f32_model(tmp_path: Path, rng: np.random.Generator) -> Path:
    path = tmp_path / "f32.gguf"
    write_qwen2(path, rng, GEO, Q.F32)
    return path


def test_verify_passes_on_a_correct_model(gpu, f32_model, rng):
    """Every layer's output, the logits and the greedy token agree in both steps; exit code 0."""
    toks = rng.integers(0, GEO.V, N_TOKENS)
    rep = verify.verify(f32_model, toks)
    assert rep.passed, rep.first_bad
    names = {(r.phase, r.name) for r in rep.rows}
    for phase in ("prefill", "decode"):
        assert {(phase, f"blk.{i}.l_out") for i in range(GEO.L)} <= names
        assert (phase, "result_output") in names
    r = CliRunner().invoke(cli.app, ["verify", str(f32_model), "--tokens", str(N_TOKENS)])
    assert r.exit_code == 0, r.output
    assert "PASS" in r.output and "blk.1" in r.output


# tensor corrupted → the first reference-named op it feeds (Qcur is roped in place with Kcur on the
# GPU, so a bad W_q first shows in the attention output)
FIRST_OP = {"attn_norm.weight": "attn_norm", "attn_v.weight": "Vcur", "attn_q.weight": "kqv_out",
            "attn_output.weight": "attn_residual", "ffn_norm.weight": "ffn_norm", "ffn_gate.weight": "l_out",
            "ffn_down.weight": "l_out"}


@pytest.mark.parametrize("tensor", sorted(FIRST_OP))
def test_verify_names_a_corrupted_weight(gpu, f32_model, rng, tensor):
    """A finite perturbation (5% relative noise) of one layer's weight buffer after upload fails
    verify at the first op that reads it, in that layer."""
    toks = rng.integers(0, GEO.V, N_TOKENS)
    layer = int(rng.integers(0, GEO.L))
    fwd = verify.open_forward(f32_model, len(toks), 512)
    buf = fwd.model.weights[f"blk.{layer}.{tensor}"].buf
    w = buf.read(np.float32)
    buf.write((w * (1 + 0.05 * rng.standard_normal(w.size))).astype(np.float32))
    rep = verify.verify(f32_model, toks, fwd)
    assert not rep.passed
    bad = rep.first_bad
    assert bad is not None and (bad.phase, bad.name) == ("prefill", f"blk.{layer}.{FIRST_OP[tensor]}")
    assert all(r.ok for r in rep.rows[:rep.rows.index(bad)])


def test_cli_verify_fails_on_a_corrupted_weight(gpu, f32_model, monkeypatch, rng):
    """The command exits 1 and names the op (the forward it opens gets a corrupted LM head)."""
    real = verify.open_forward

    def corrupted(*args, **kwargs):
        fwd = real(*args, **kwargs)
        buf = fwd.model.weights["output.weight"].buf
        buf.write(rng.standard_normal(buf.nbytes // 4).astype(np.float32))
        return fwd

    monkeypatch.setattr(verify, "open_forward", corrupted)
    r = CliRunner().invoke(cli.app, ["verify", str(f32_model), "--tokens", str(N_TOKENS)])
    assert r.exit_code == 1
    assert "FAIL" in r.output and "result_output" in r.output


@pytest.mark.parametrize("arch", ["qwen3next", "qwen4exp"])
def test_verify_hybrid_archs(gpu, tmp_path, rng, arch):
    """verify passes on both tiny hybrid archs (bounds at least 4× the worst error of the float32
    reference's runs: qwen3next-tiny's GDN layers amplify f32 rounding past 1e-4) with every compared
    op in bounds, and a 5% perturbation of one GDN layer's output projection fails at that layer."""
    from vkflash.model.make_model import make_model

    path = make_model(arch, "tiny", "F32", int(rng.integers(1 << 31)), tmp_path / f"{arch}.gguf")[0]
    toks = rng.integers(0, 512, N_TOKENS)
    rep = verify.verify(path, toks)
    assert rep.passed, rep.first_failed_check
    assert all(r.ok for r in rep.rows), [r for r in rep.rows if not r.ok]  # every tap laid out as the reference
    fwd = verify.open_forward(path, len(toks), 512)
    buf = fwd.model.weights["blk.1.ssm_out.weight"].buf
    w = buf.read(np.float32)
    buf.write((w * (1 + 0.05 * rng.standard_normal(w.size))).astype(np.float32))
    bad = verify.verify(path, toks, fwd).first_failed_check
    assert bad is not None and bad.layer == 1, bad


def test_f32_draws_round_differently(tmp_path, rng):
    """The float32 reference runs that size verify's f32 floor are F32_DRAWS different roundings:
    every op's output differs between runs by float32 rounding only (the float64 reference apart)."""
    from vkflash.model.make_model import make_model
    from vkflash.model.weights import load_model

    path = make_model("qwen3next", "tiny", "F32", int(rng.integers(1 << 31)), tmp_path / "m.gguf")[0]
    toks = rng.integers(0, 512, N_TOKENS)
    steps = [toks[:-1], toks[-1:]]
    runs = verify.f32_draws(load_model(path, np.float32), steps)
    ref = verify.reference_steps(load_model(path, np.float64), steps)
    assert len(runs) == verify.F32_DRAWS
    for s, names in enumerate(ref):
        for name in ("blk.0.attn_norm", "blk.4.gdn_gated", "blk.7.l_out", "result_output"):
            outs = [run[s][name] for run in runs]
            assert all(x.dtype == np.float32 for x in outs)
            assert all(not np.array_equal(x, outs[0]) for x in outs[1:]), name
            assert max(verify.relative_error(name, x, names[name]) for x in outs) < 1e-2, name


def test_verify_follows_cell_mode(gpu, tmp_path, rng, monkeypatch):
    """BLKTOPK=0: verify builds its reference with the selection mode and tie rule the GPU runs
    (`cell`, lower index first), so a correct GPU passes past the dense → sparse boundary (t ≥ W = 35)."""
    from vkflash import settings
    from vkflash.model.make_model import make_model

    path = make_model("qwen4exp", "tiny", "F32", int(rng.integers(1 << 31)), tmp_path / "q4.gguf")[0]
    monkeypatch.setattr(settings, "_current", settings.load(env={"BLKTOPK": "0"}))
    rep = verify.verify(path, rng.integers(0, 512, 70))
    assert rep.passed, rep.first_failed_check


def test_greedy_near_tie_is_reported_not_failed():
    """Greedy tokens that differ fail verify unless the reference's top two logits are a near-tie
    (within twice the logits bound), which the report names instead."""
    rows = [verify.OpError("decode", verify.LOGITS, 1e-5, 1e-3)]
    tie, clear = verify.Greedy(7, 9, near=True), verify.Greedy(7, 9, near=False)
    assert verify.Report(2, rows, {"decode": tie}).passed and not verify.Report(2, rows, {"decode": clear}).passed
    console, buf = _console()
    verify.print_report(verify.Report(2, rows, {"decode": tie}), console)
    assert "a near-tie (reported)" in buf.getvalue() and "PASS" in buf.getvalue()


def test_verify_needs_two_tokens(gpu, f32_model):
    r = CliRunner().invoke(cli.app, ["verify", str(f32_model), "--tokens", "1"])
    assert r.exit_code == 1 and "at least 2 tokens" in r.stderr


@pytest.mark.slow
def test_verify_real_default_model(gpu):
    """The default Qwen2.5-Coder-0.5B (quantized weights, a float32 reference, so bounds × 8, the
    residual stream's at least 1e-2, and at least 8× the f32 runs' spread: the reference carries f32
    error of its own) passes verify on a text prompt and on random tokens. ~2 min on lavapipe (2 cores)."""
    from vkflash.model.default_model import FILE_NAME, cache_dir

    path = cache_dir() / FILE_NAME
    if not path.is_file():
        pytest.skip("default qwen2 model not in the cache (vkflash fetches it on first run)")
    rng = np.random.default_rng()
    for toks in (verify.prompt_tokens(path, "def fibonacci(n):", 0, rng), verify.prompt_tokens(path, None, 16, rng)):
        rep = verify.verify(path, toks, ctx=64)
        assert rep.passed, f"{rep.first_bad} on tokens {list(map(int, toks))}"  # a failing draw, to replay



def _read_until(fd: int, seen: bytearray, done, timeout: float) -> bool:
    """Read the pty into `seen` until done(new bytes) holds, the child closes it, or the time is up."""
    import os
    import select
    import time

    start, end = len(seen), time.monotonic() + timeout
    while not done(bytes(seen[start:])) and time.monotonic() < end:
        if select.select([fd], [], [], 0.2)[0]:
            try:
                chunk = os.read(fd, 65536)
            except OSError:  # the child closed the terminal
                break
            if not chunk:
                break
            seen += chunk
    return done(bytes(seen[start:]))


@pytest.mark.timeout(180)
@pytest.mark.parametrize("parent", ["default", "ignored", "blocked"])
def test_chat_ctrl_c_stops_the_reply_then_leaves(gpu, chat_model, parent):
    """`vkflash run` chat on a terminal: Ctrl-C while a reply streams stops it (stop: cancelled) and
    the prompt comes back; Ctrl-C at the prompt ends the session with exit 0, no traceback; also when
    the process starts with SIGINT ignored or blocked (exec keeps both, e.g. under `nohup`). The
    reply ignores the end token (--ignore-eos): a random model may end it before the Ctrl-C arrives."""
    import os
    import pty
    import signal
    import sys
    import time

    pid, fd = pty.fork()
    if pid == 0:  # the child: vkflash run in chat mode on the pty
        if parent == "ignored":
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        elif parent == "blocked":
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        os.execv(sys.executable, [sys.executable, "-m", "vkflash.cli", "run", str(chat_model), "--ctx", "4096",
                                  "--ub", "16", "--ignore-eos"])
    seen, status = bytearray(), None
    try:
        assert _read_until(fd, seen, lambda b: b"> " in b, 120), seen.decode(errors="replace")
        os.write(fd, b"hello\n")
        assert _read_until(fd, seen, lambda b: b"hello\r\n" in b, 10)
        # some of the reply on the screen, then Ctrl-C
        assert _read_until(fd, seen, lambda b: len(b) >= 8, 60), seen.decode(errors="replace")
        os.write(fd, b"\x03")
        back = re.compile(rb"\(stop:\s+cancelled\)\s*> ")  # the reply stopped, then the prompt again
        assert _read_until(fd, seen, lambda b: back.search(ANSI.sub(b"", b)) is not None, 30), \
            seen.decode(errors="replace")
        # Ctrl-C at the prompt, as a person would: not within readline's prompt redisplay (it blocks
        # SIGINT there, and a Ctrl-C then lands on another thread, which cannot wake input()), and
        # once more if a loaded machine redrew the prompt late and the first fell into it
        for _ in range(4):
            _read_until(fd, seen, lambda b: False, 0.5)
            os.write(fd, b"\x03")
            end = time.monotonic() + 10
            while status is None and time.monotonic() < end:
                _read_until(fd, seen, lambda b: False, 0.2)  # until it closes the terminal
                done, st = os.waitpid(pid, os.WNOHANG)
                status = st if done else None
            if status is not None:
                break
    finally:
        if status is None:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
        os.close(fd)
    text = ANSI.sub(b"", seen).decode(errors="replace")
    assert status is not None, f"still running after Ctrl-C at the prompt:\n{text}"
    assert os.waitstatus_to_exitcode(status) == 0, text
    assert "Traceback" not in text and "KeyboardInterrupt" not in text


def test_chat_prompt_keeps_its_state_before_the_generation_prompt(chat_model):
    """`vkflash run`'s chat keeps the state where the generation prompt begins (the next turn's history
    need not repeat it), and the prompt's end when the template cannot render without one."""
    from vkflash.model.chat import render_chat
    from vkflash.model.tokenizer import Tokenizer
    from vkflash.run import Session, prompt_ids

    tok = Tokenizer.from_gguf(chat_model)
    msgs = [{"role": "user", "content": "hi there"}]
    kw = tok.template_tokens()
    ids, keep = prompt_ids(Session(chat_model, None, tok, QWEN3_THINKING_TEMPLATE, 16), msgs, None)
    history = render_chat(QWEN3_THINKING_TEMPLATE, msgs, add_generation_prompt=False, **kw)
    assert keep == len(tok.encode(history)) and 0 < keep < len(ids)
    strict = QWEN3_THINKING_TEMPLATE + "{% if not add_generation_prompt %}{{ raise_exception('no') }}{% endif %}"
    ids2, keep2 = prompt_ids(Session(chat_model, None, tok, strict, 16), msgs, None)
    assert ids2 == ids and keep2 is None
