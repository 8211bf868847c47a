"""`vkflash run`: one prompt or an interactive chat on the GPU forward, from the terminal.

The model loads behind a progress bar; text streams to stdout token by token through the engine's
generation loop (`engine.generate`, the same one the server uses); prefill and decode rates go to
stderr at the end. A conversation that reaches the context end stops with a message instead of
failing: the last reply ends there, and chat says to start over (/reset). In chat, Ctrl-C stops the
reply being written (within a token, or an ubatch of prefill) and returns to the prompt; Ctrl-C
or Ctrl-D at the prompt leaves.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from vkflash.engine.api import Finish, Forward, InvalidRequest, SamplingParams, TokenEvent
from vkflash.engine.generate import generate
from vkflash.errors import ConfigError
from vkflash.model.tokenizer import Tokenizer

if TYPE_CHECKING:
    from rich.console import Console

EXIT_WORDS = ("/exit", "/quit")
RESET_WORD = "/reset"


@dataclass
class Session:
    """A loaded model ready to generate: forward, tokenizer, chat template, prefill ubatch."""

    path: Path
    fwd: Forward
    tokenizer: Tokenizer
    template: str
    ubatch: int


def open_session(path: Path, console: "Console", ctx: int | None = None, ub: int | None = None,
                 kv: str | None = None, mtp: bool = False, draft: Path | None = None,
                 draft_small: Path | None = None) -> Session:
    """Check the file (model_file.open_model: what `inspect` checks, tokenizer and template included),
    then upload the weights behind a progress bar; `mtp`: decode
    by MTP speculation (the model's own MTP block, or the MTP-only GGUF `draft`; `draft_small`: its
    smaller quant for the deep-context guard)."""
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

    from vkflash.engine.gpu_forward import GpuForward
    from vkflash.engine.speculate import Speculator
    from vkflash.model.chat import QWEN3_THINKING_TEMPLATE
    from vkflash.model.model_file import open_model

    checked = open_model(path)
    tok = checked.require_tokenizer()
    template = checked.chat_template or QWEN3_THINKING_TEMPLATE
    with Progress(TextColumn(f"loading {path.name}"), BarColumn(), DownloadColumn(), TimeRemainingColumn(),
                  console=console, transient=True) as bar:
        task = bar.add_task("load", total=None)
        progress = lambda done, total: bar.update(task, completed=done, total=total)  # noqa: E731
        sp = Speculator.open(path, draft, draft_small, ctx=ctx, ub=ub, kv=kv, progress=progress) if mtp else None
        fwd = sp.fwd if sp is not None else GpuForward(path, ctx=ctx, ub=ub, kv=kv, progress=progress)
    console.print(f"{path.name}: {fwd.hp.arch}, context {fwd.n_ctx} tokens, ubatch {fwd.ub}, on {fwd.gpu.caps.name}")
    if sp is not None:
        console.print(sp.describe())
    return Session(path, sp or fwd, tok, template, fwd.ub)


@dataclass
class Turn:
    """What one generation produced: the text and how it ended."""

    text: str
    finish: Finish


def stream(session: Session, ids: list[int], params: SamplingParams, out: TextIO,
           cancel: threading.Event | None = None, checkpoint_at: int | None = None) -> Turn:
    """Generate from ids, writing each piece of text to `out` as it is released; the whole turn."""
    pieces: list[str] = []
    events: Iterator[TokenEvent | Finish] = generate(session.fwd, session.tokenizer, ids, params, cancel,
                                                     session.ubatch, checkpoint_at=checkpoint_at)
    for ev in events:
        if ev.text:
            out.write(ev.text)
            out.flush()
            pieces.append(ev.text)
        if isinstance(ev, Finish):
            if ev.reason == "error" and ev.error is not None:
                raise ev.error
            return Turn("".join(pieces), ev)
    raise RuntimeError("generation ended without a Finish")  # generate always yields one


def context_full(fin: Finish, n_ctx: int) -> bool:
    """The generation stopped because prompt + output filled the context."""
    return fin.reason == "length" and fin.prompt_tokens + fin.completion_tokens >= n_ctx


def report(fin: Finish, n_ctx: int, console: "Console") -> None:
    """Prefill and decode rates of one generation, and why it stopped when that was the context end."""
    t = fin.timings.to_json()
    drafts = ""
    if "draft_n" in t:
        rate = t["draft_n_accepted"] / t["draft_n"] if t["draft_n"] else 0.0
        drafts = f", {t['draft_n_accepted']} of {t['draft_n']} drafted tokens accepted ({rate:.0%})"
    reused = f", {t['cache_n']} prompt tokens reused" if t["cache_n"] else ""
    console.print(f"prefill {t['prompt_n']} tokens at {t['prompt_per_second']:.1f} tok/s, "
                  f"decode {t['predicted_n']} tokens at {t['predicted_per_second']:.1f} tok/s{drafts}{reused} "
                  f"(stop: {fin.reason})")
    if context_full(fin, n_ctx):
        console.print(f"[yellow]context end reached ({n_ctx} tokens): generation stopped[/yellow]")


def prompt_ids(session: Session, messages: list[dict[str, str]] | None,
               raw: str | None) -> tuple[list[int], int | None]:
    """Token ids of a raw text prompt, or of the messages through the chat template, and where the
    prompt's state is kept for the next turn (a chat: before its generation prompt; None: its end)."""
    from vkflash.model.chat import render_chat, reply_start

    if messages is None:
        assert raw is not None
        return session.tokenizer.encode(raw, add_special=True), None
    kw = session.tokenizer.template_tokens()
    text = render_chat(session.template, messages, **kw)
    ids = session.tokenizer.encode(text, add_special=False)
    try:
        history = render_chat(session.template, messages, add_generation_prompt=False, **kw)
    except ConfigError:  # the template cannot end without a generation prompt: keep the prompt's end
        return ids, None
    return ids, reply_start(text, history, ids, lambda s: session.tokenizer.encode(s, add_special=False))


def run_prompt(session: Session, prompt: str, params: SamplingParams, out: TextIO, console: "Console",
               raw: bool = False, system: str | None = None) -> Finish:
    """One prompt (as a user message through the chat template unless raw), streamed, then the rates;
    Ctrl-C or SIGTERM stops it between steps, still with the rates, then exits with 128 + the signal."""
    msgs = None if raw else ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": prompt}]
    cancel = threading.Event()
    with interrupt_sets(cancel, (signal.SIGINT, signal.SIGTERM)) as heard:  # stop between steps, then report
        ids, _ = prompt_ids(session, msgs, prompt if raw else None)  # one prompt: no next turn to keep a state for
        turn = stream(session, ids, params, out, cancel)
    out.write("\n")
    out.flush()
    report(turn.finish, session.fwd.n_ctx, console)
    if heard:  # the shell's status of a process that a signal stopped
        raise SystemExit(128 + heard[0])
    return turn.finish


@dataclass
class Chat:
    """An interactive conversation: the messages so far (each turn re-renders the whole history)."""

    session: Session
    params: SamplingParams
    system: str | None = None
    messages: list[dict[str, str]] = field(default_factory=list)

    def reset(self) -> None:
        self.messages = [{"role": "system", "content": self.system}] if self.system else []

    def turn(self, user: str, out: TextIO, console: "Console") -> bool:
        """Answer one user message (Ctrl-C stops the answer there; what was written stays in the
        conversation); False when the context is full (the conversation must restart)."""
        self.messages.append({"role": "user", "content": user})
        cancel = threading.Event()
        try:
            with interrupt_sets(cancel):  # from the start: a Ctrl-C while the prompt renders stops it as well
                ids, keep = prompt_ids(self.session, self.messages, None)
                reply = stream(self.session, ids, self.params, out, cancel, keep)
        except InvalidRequest as e:  # the history alone no longer leaves room for an answer
            self.messages.pop()
            console.print(f"[yellow]context end reached: {e}; type {RESET_WORD} to start over[/yellow]")
            return False
        out.write("\n")
        out.flush()
        self.messages.append({"role": "assistant", "content": reply.text})
        report(reply.finish, self.session.fwd.n_ctx, console)
        if context_full(reply.finish, self.session.fwd.n_ctx):
            console.print(f"[yellow]type {RESET_WORD} to start a new conversation[/yellow]")
            return False
        return True


@contextmanager
def interrupt_sets(event: threading.Event, signals: tuple[int, ...] = (signal.SIGINT,)) -> Iterator[list[int]]:
    """Inside: Ctrl-C (SIGINT; or each of `signals`) sets `event`, so generation stops between steps
    (the GPU is never left mid-submission), instead of raising KeyboardInterrupt or ending the
    process; yields the signals heard, in order. Outside of the main thread, nothing."""
    heard: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield heard
        return

    def stop(sig: int, _frame: object) -> None:
        heard.append(sig)
        event.set()
    previous = {sig: signal.signal(sig, stop) for sig in signals}
    try:
        yield heard
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def chat_loop(session: Session, params: SamplingParams, read: Callable[[], str | None], out: TextIO,
              console: "Console", system: str | None = None) -> None:
    """Read a line, answer it, repeat; /reset clears the history, /exit or end of input stops."""
    chat = Chat(session, params, system)
    chat.reset()
    console.print(f"chat: {EXIT_WORDS[0]} or Ctrl-D to leave, {RESET_WORD} to start over, Ctrl-C stops a reply")
    while (line := read()) is not None:
        text = line.strip()
        if text in EXIT_WORDS:
            return
        if text == RESET_WORD:
            chat.reset()
            console.print("conversation cleared")
            continue
        if text:
            chat.turn(text, out, console)


def hear_ctrl_c() -> None:
    """Make Ctrl-C raise KeyboardInterrupt in the main thread even if the process was started with
    SIGINT ignored (which exec passes on: a parent's `nohup`, a supervisor) or blocked: the chat
    prompt would not hear it then, while a reply still stops (interrupt_sets installs its own handler)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def read_stdin() -> Callable[[], str | None]:
    """A line reader for chat: input() with a "> " prompt, None at end of input (Ctrl-D) or on Ctrl-C
    (hear_ctrl_c: whatever SIGINT disposition the process started with)."""
    hear_ctrl_c()

    def read() -> str | None:
        try:
            return input("> ")
        except (EOFError, KeyboardInterrupt):
            print()
            return None
    return read


def sampling(temperature: float, top_k: int, top_p: float, min_p: float, seed: int | None,
             max_tokens: int | None, ignore_eos: bool = False) -> SamplingParams:
    """SamplingParams from CLI options (InvalidRequest names a bad one)."""
    return SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed,
                          max_tokens=max_tokens, ignore_eos=ignore_eos)

