"""The `vkflash` command line (typer): serve, run, plan, verify, inspect, bench, knobs, make-model, info.

Every user-caused error prints one `error: …` line and exits 1; `--debug` shows the traceback.
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from vkflash import settings
from vkflash.errors import ConfigError, VkflashError

app = typer.Typer(add_completion=False, no_args_is_help=True, help="vkflash: Vulkan inference for Qwen3.8-Flash-Next")
bench_app = typer.Typer(no_args_is_help=True,
                        help="Measure kernels, a model, the server and a cluster: rates against measured ceilings.")
app.add_typer(bench_app, name="bench")
console = Console()
_debug = False


def _version(value: bool) -> None:
    """--version: the package version, at once (no device, no model)."""
    if value:
        from vkflash import __version__

        typer.echo(f"vkflash {__version__}")
        raise typer.Exit()


@app.callback()
def _main(debug: bool = typer.Option(False, "--debug", help="show tracebacks"),
          version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                       help="print the version and exit")) -> None:
    global _debug
    _debug = debug


@app.command()
def inspect(path: Path = typer.Argument(..., help="GGUF file")) -> None:
    """Check a GGUF against the model contract: header, metadata, hyper-parameters, every tensor's
    shape, type and place in the file, the tokenizer and the chat template (what run and serve load)."""
    try:
        from vkflash.model.model_file import open_model

        m = open_model(path, draft=True)
    except VkflashError as e:
        _fail(e)
        return
    typer.echo(f"{path}: {m.describe()}, valid")


def _fail(e: BaseException) -> None:
    if _debug:
        traceback.print_exception(e)
    typer.echo(f"error: {e}", err=True)
    raise typer.Exit(1)


@app.command()
def info(as_json: bool = typer.Option(False, "--json", help="machine-readable output")) -> None:
    """Print the Vulkan device's capabilities and the kernel variants vkflash will use."""
    try:
        from vkflash.gpu.device import probe
        from vkflash.gpu.registry import table

        s = settings.current()
        caps = probe(s["VKFLASH_DEVICE"])
        kernels = {k.name: ("yes" if k.usable(caps) else "no: needs " + ",".join(sorted(k.needs)))
                   for k in table().values()}
    except VkflashError as e:
        _fail(e)
        return
    if as_json:
        typer.echo(json.dumps({"device": caps.to_json(), "kernels": kernels}, indent=1))
        return
    t = Table(title=f"device {caps.index}: {caps.name}", show_header=False)
    rows = [
        ("driver", f"{caps.driver} ({caps.driver_info})"), ("Vulkan API", caps.api_version),
        ("type", f"{caps.device_type}, UMA={caps.uma}"),
        ("compute units", str(caps.compute_units or "not reported")),
        ("memory heaps", "; ".join(f"{h.size / 2**30:.1f} GiB{' device-local' if h.device_local else ''}"
                                   f", budget {h.budget / 2**30:.1f} GiB" for h in caps.heaps)),
        ("subgroup", f"{caps.subgroup_size} (min {caps.subgroup_min}, max {caps.subgroup_max}, "
                     f"size control {caps.subgroup_size_control})"),
        ("shared memory", f"{caps.shared_memory // 1024} KiB, {caps.max_invocations} invocations"),
        ("storage range", f"{caps.max_storage_range / 2**20:.0f} MiB, max alloc {caps.max_allocation / 2**30:.1f} GiB"),
        ("fp16 / int8 / bf16 / int-dot", f"{caps.fp16} / {caps.int8} / {caps.bf16} / {caps.int_dot}"),
        ("coopmat", ", ".join(str(c) for c in caps.coopmat) or "none"),
        ("timestamp period", f"{caps.timestamp_period_ns} ns"),
    ]
    for k, v in rows:
        t.add_row(k, v)
    console.print(t)
    kt = Table(title="kernel variants")
    kt.add_column("kernel")
    kt.add_column("used")
    for name, used in kernels.items():
        kt.add_row(name, used)
    console.print(kt)


@app.command()
def serve(
    model: Optional[str] = typer.Option(None, "--model", "-m", help="GGUF file (knob MODEL; default: the "
                                                                    "default model)"),
    host: Optional[str] = typer.Option(None, "--host", help="bind address (knob HOST)"),
    port: Optional[str] = typer.Option(None, "--port", help="port (knob PORT)"),
    ctx: Optional[str] = typer.Option(None, "--ctx", "-c", help="context tokens (knob CTX)"),
    ub: Optional[str] = typer.Option(None, "--ub", help="prefill ubatch (knob UB)"),
    kv: Optional[str] = typer.Option(None, "--kv", help="KV cache type (knob KV)"),
    queue: Optional[str] = typer.Option(None, "--queue", help="requests that may wait (knob QUEUE)"),
    api_key: Optional[str] = typer.Option(None, "--api-key", help="bearer token (knob API_KEY)"),
    mtp: Optional[bool] = typer.Option(None, "--mtp/--no-mtp", help="MTP speculative decoding (knob MTP)"),
    draft: Optional[str] = typer.Option(None, "--draft", help="MTP-only GGUF of the draft head (knob MODEL_DRAFT)"),
    draft_small: Optional[str] = typer.Option(None, "--draft-small",
                                              help="the draft head in a smaller quant, for the deep-context guard "
                                                   "(knob MODEL_DRAFT_SMALL)"),
) -> None:
    """Serve a model over the OpenAI-compatible HTTP API (flags override the env knobs)."""
    try:
        from vkflash.server.app import serve as run_server
        from vkflash.server.state import ServerOptions

        s = settings.load(flags={"MODEL": model, "HOST": host, "PORT": port, "CTX": ctx, "UB": ub, "KV": kv,
                                 "QUEUE": queue, "API_KEY": api_key, "MTP": mtp, "MODEL_DRAFT": draft,
                                 "MODEL_DRAFT_SMALL": draft_small})
        if s["MODEL"]:  # a named file is checked before the port opens (the default model loads behind /health)
            from vkflash.model.default_model import resolve_model
            from vkflash.model.model_file import open_model

            open_model(resolve_model(s["MODEL"], "MODEL"))
        run_server(s, ServerOptions(queue_depth=s["QUEUE"]))  # backend.load: the checked loader
    except VkflashError as e:
        _fail(e)


@app.command("plan")
def plan_cmd(
    model: Path = typer.Argument(..., help="GGUF file"),
    ctx: Optional[str] = typer.Option(None, "--ctx", "-c", help="context tokens (knob CTX; 0: the model's)"),
    mem: Optional[str] = typer.Option(None, "--mem", help="memory budget, e.g. 128G (knob VKFLASH_MEM_BUDGET; "
                                                          "default: the device's)"),
    ub: Optional[str] = typer.Option(None, "--ub", help="prefill ubatch (knob UB)"),
    kv: Optional[str] = typer.Option(None, "--kv", help="KV cache type (knob KV)"),
    mtp: bool = typer.Option(False, "--mtp", help="plan MTP speculation: the model's own MTP block, or --draft / "
                                                  "MODEL_DRAFT"),
    draft: Optional[str] = typer.Option(None, "--draft", help="the draft's GGUF (knob MODEL_DRAFT)"),
    draft_small: Optional[str] = typer.Option(None, "--draft-small", help="its smaller quant, for the guard "
                                                                          "(knob MODEL_DRAFT_SMALL)"),
    uma: Optional[bool] = typer.Option(None, "--uma/--discrete", help="plan for a UMA device (Strix Halo) or a "
                                                                      "discrete GPU (default: this device's kind)"),
    as_json: bool = typer.Option(False, "--json", help="machine-readable output"),
) -> None:
    """Memory per part at depths 0 … full, the guard's steps, boot-fit and fill-fit, what makes it fit."""
    try:
        from vkflash.engine.guard import GuardConfig
        from vkflash.engine.plan import DraftFiles, make_plan
        from vkflash.gpu.budget import Budget
        from vkflash.model.model_file import open_model

        open_model(model)
        s = settings.load(flags={"CTX": ctx, "VKFLASH_MEM_BUDGET": mem, "UB": ub, "KV": kv, "MODEL_DRAFT": draft,
                                 "MODEL_DRAFT_SMALL": draft_small})
        src = s.sources["VKFLASH_MEM_BUDGET"]
        budget = Budget(s["VKFLASH_MEM_BUDGET"], "--mem" if src == "flag" else src) if s["VKFLASH_MEM_BUDGET"] else None
        p = make_plan(model, ctx=s["CTX"], ub=s["UB"], kv=s["KV"], budget=budget, guard=GuardConfig.from_settings(s),
                      draft=DraftFiles.from_settings(s) if mtp else None, uma=uma)
    except VkflashError as e:
        _fail(e)
        return
    if as_json:
        typer.echo(json.dumps(p.to_json(), indent=1))
        return
    show_plan(p)


def show_plan(p) -> None:
    """The plan as a rich table (bytes in one unit), then boot-fit, fill-fit, what makes it fit and
    the summary line."""
    from vkflash.engine.plan import Part
    from vkflash.gpu.memory import fmt_bytes

    parts = [q for q in Part if any(r.usage.parts[q] for r in p.rows)]
    top = max([r.usage.total for r in p.rows] + [p.budget.nbytes])
    unit, scale = next((u, x) for u, x in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10), ("B", 1))
                       if top >= 10 * x or x == 1)

    def num(n: int) -> str:
        return f"{n / scale:.2f}" if scale > 1 else str(n)

    def depth(d: int) -> str:
        return f"{d // 1024}k" if d >= 1024 and d % 1024 == 0 else str(d)

    t = Table(title=f"memory plan: {Path(p.model).name} ({p.arch}, {'UMA' if p.uma else 'discrete'}), "
                    f"{p.n_ctx} positions, budget {p.budget}; bytes in {unit}")
    for c in ["depth", "KV", "UB", "tier"] + [q.value for q in parts] + ["total", "headroom", "guard step"]:
        t.add_column(c, justify="left" if c in ("KV", "guard step") else "right")
    for r in p.rows:
        t.add_row(depth(r.depth), r.kv, str(r.ub), str(r.tier), *[num(r.usage.parts[q]) for q in parts],
                  num(r.usage.total), num(r.headroom(p.budget.nbytes)) if p.budget.nbytes else "-", r.event)
    Console(width=max(console.width, 150)).print(t)
    console.print(f"boot-fit: {'yes' if p.boot_fits else 'NO'}: {fmt_bytes(p.boot.usage.total)} at start "
                  f"(weights, states, compute, the first cache chunk)")
    if not p.boot_fits:
        fill = "not reached (the model does not boot)"
    elif p.fails_at is not None:
        fill = f"NO: {p.error}"
    elif p.events:
        fill = f"yes, with the guard's steps: {p.thresholds()}"
    else:
        fill = "yes, the guard has nothing to do"
    console.print(f"fill-fit: {fill}")
    if p.makes_it_fit:
        console.print(f"makes it fit: {p.makes_it_fit}")
    def by_type(types: dict[str, int]) -> str:
        return ", ".join(f"{k} {fmt_bytes(v)}" for k, v in sorted(types.items(), key=lambda kv: -kv[1]))

    where = "host-visible (UMA: no staging copy)" if p.uma else "device-local"
    console.print(f"weights: {fmt_bytes(sum(p.weight_types.values()))} {where}: {by_type(p.weight_types)}")
    if p.mmapped:
        console.print(f"mmapped: {fmt_bytes(p.mmapped)} of host-gathered tables ({by_type(p.mmap_types)}; file pages, "
                      f"evictable: not counted)")
    if p.boot.usage.host:
        console.print(f"host memory beside the budget: {fmt_bytes(p.boot.usage.host)} (staging, step params)")
    console.print(p.summary())


@app.command()
def knobs(markdown: bool = typer.Option(False, "--markdown", help="the README table")) -> None:
    """List every knob, its value and where it came from."""
    try:
        s = settings.current()
    except VkflashError as e:
        _fail(e)
        return
    if markdown:
        typer.echo(settings.markdown_table())
        return
    for line in s.lines():
        typer.echo(line)


@app.command("make-model")
def make_model_cmd(
    arch: str = typer.Option(..., "--arch", help="qwen4exp | qwen3next"),
    config: str = typer.Option("tiny", "--config", help="tiny | shape-8L | shape-48L"),
    quant: Optional[str] = typer.Option(None, "--quant", help="tiny: F32 | F16 | Q8_0 | mix; shape: Q4_K_M | Q8_0"),
    mtp_separate: bool = typer.Option(False, "--mtp-separate", help="write the MTP block to <out>-mtp.gguf"),
    mtp_block: bool = typer.Option(False, "--mtp", help="write the MTP block into the model file (vkflash only)"),
    variant: Optional[str] = typer.Option(None, "--variant",
                                          help="comma-separated layout variants: tied, f_array, hc_norm_2d, "
                                               "ple_conv_f16, dense, tie_stress, ssm_in"),
    seed: int = typer.Option(0, "--seed", help="seed of the random weights"),
    sparse: bool = typer.Option(False, "--sparse", help="header and tensor table only, the data a hole (for "
                                                       "`vkflash plan`)"),
    out: Path = typer.Option(..., "--out", help="output GGUF path"),
) -> None:
    """Write a synthetic GGUF with random weights (MODEL.md §9 configs) for tests and benchmarks."""
    try:
        from vkflash.model.make_model import make_model

        for p in make_model(arch, config, quant, seed, out, mtp_separate=mtp_separate, variant=variant,
                            sparse=sparse, mtp_block=mtp_block):
            typer.echo(f"wrote {p} ({p.stat().st_size / 2**20:.1f} MiB)")
    except VkflashError as e:
        _fail(e)


@app.command("run")
def run_cmd(
    model: Optional[str] = typer.Argument(None, help="GGUF file (default: the default model, fetched once and "
                                                     "cached)"),
    prompt: Optional[str] = typer.Option(None, "--prompt", "-p", help="answer this and exit; without it: chat"),
    raw: bool = typer.Option(False, "--raw", help="feed the prompt as is, without the chat template"),
    system: Optional[str] = typer.Option(None, "--system", help="system message"),
    max_tokens: Optional[int] = typer.Option(None, "--max-tokens", "-n", help="stop after this many tokens"),
    ignore_eos: bool = typer.Option(False, "--ignore-eos", help="go on past the end-of-generation token (as llama-cli)"),
    temperature: float = typer.Option(0.0, "--temp", help="0: greedy"),
    top_k: int = typer.Option(0, "--top-k", help="draw from the k most likely tokens (0: all)"),
    top_p: float = typer.Option(1.0, "--top-p", help="draw from the most likely tokens up to this mass"),
    min_p: float = typer.Option(0.0, "--min-p", help="drop tokens below this × the top probability"),
    seed: Optional[int] = typer.Option(None, "--seed", help="sampling seed (default: a fresh one)"),
    ctx: Optional[str] = typer.Option(None, "--ctx", "-c", help="context tokens (knob CTX; 0: the model's)"),
    ub: Optional[str] = typer.Option(None, "--ub", help="prefill ubatch (knob UB)"),
    kv: Optional[str] = typer.Option(None, "--kv", help="KV cache type (knob KV)"),
    mtp: Optional[bool] = typer.Option(None, "--mtp/--no-mtp", help="MTP speculative decoding (knob MTP)"),
    draft: Optional[str] = typer.Option(None, "--draft", help="MTP-only GGUF of the draft head (knob MODEL_DRAFT)"),
    draft_small: Optional[str] = typer.Option(None, "--draft-small",
                                              help="the draft head in a smaller quant, for the deep-context guard "
                                                   "(knob MODEL_DRAFT_SMALL)"),
) -> None:
    """Run one prompt (-p) or chat interactively: streamed text, then prefill and decode tok/s."""
    try:
        from vkflash import run as runner
        from vkflash.model.default_model import resolve_model

        s = settings.load(flags={"CTX": ctx, "UB": ub, "KV": kv, "MTP": mtp, "MODEL_DRAFT": draft,
                                 "MODEL_DRAFT_SMALL": draft_small})  # checked like serve's flags
        settings.install(s)
        err = Console(stderr=True)
        params = runner.sampling(temperature, top_k, top_p, min_p, seed, max_tokens, ignore_eos)
        drafts = [resolve_model(s[k], k) if s[k] else None for k in ("MODEL_DRAFT", "MODEL_DRAFT_SMALL")]
        session = runner.open_session(resolve_model(model), err, s["CTX"], s["UB"], s["KV"], s["MTP"], *drafts)
        if prompt is not None:
            runner.run_prompt(session, prompt, params, sys.stdout, err, raw=raw, system=system)
        else:
            runner.chat_loop(session, params, runner.read_stdin(), sys.stdout, err, system=system)
    except VkflashError as e:
        _fail(e)


@app.command("verify")
def verify_cmd(
    model: Path = typer.Argument(..., help="GGUF file"),
    prompt: Optional[str] = typer.Option(None, "--prompt", help="text to verify on (default: random token ids)"),
    tokens: int = typer.Option(17, "--tokens", help="random token ids when no prompt is given"),
    ctx: int = typer.Option(512, "--ctx", help="context of the GPU caches (f32 K/V; raised to the tokens verified)"),
    dump: bool = typer.Option(False, "--dump", help="a row for every compared intermediate"),
) -> None:
    """Run the GPU forward and the NumPy reference on the same tokens; exit 1 above tolerance."""
    try:
        import numpy as np

        from vkflash import verify as ver
        from vkflash.model.model_file import open_model

        if ctx < 1:
            raise ConfigError(f"--ctx {ctx}: the context must hold at least one token")
        open_model(model)
        toks = ver.prompt_tokens(model, prompt, tokens, np.random.default_rng())
        report = ver.verify(model, toks, ctx=ctx)
    except VkflashError as e:
        _fail(e)
        return
    ver.print_report(report, console, every_op=dump)
    if not report.passed:
        raise typer.Exit(1)


@bench_app.command("kernels")
def bench_kernels(as_json: bool = typer.Option(False, "--json", help="machine-readable output"),
                  quick: bool = typer.Option(False, "--quick", help="small sizes (CI, lavapipe)"),
                  only: Optional[str] = typer.Option(None, "--only", help="comma-separated families, e.g. "
                                                     "gemv,moe_gemv,select (default: all, with replay cost)"),
                  sweep: bool = typer.Option(False, "--sweep",
                                             help="also every GEMV team width × rows per team")) -> None:
    """Copy bandwidth, each kernel's GB/s against it (and its target rate, where one is set), and graph
    replay cost."""
    try:
        from vkflash.bench.kernels import run

        fams = tuple(f.strip() for f in only.split(",") if f.strip()) if only else ()
        run(quick=quick, as_json=as_json, console=console, only=fams, sweep=sweep)
    except VkflashError as e:
        _fail(e)


@bench_app.command("serve")
def bench_serve(model: Optional[str] = typer.Option(None, "--model", "-m",
                                                   help="GGUF file (default: knob MODEL, else the default "
                                                        "model)"),
                as_json: bool = typer.Option(False, "--json", help="machine-readable output"),
                quick: bool = typer.Option(False, "--quick", help="short prompts, few tokens (CI; the default on a "
                                           "CPU device or the NumPy reference)"),
                reps: Optional[int] = typer.Option(None, "--reps", min=1,
                                                   help="timed runs per figure (default 3; 1 at the small sizes)")) -> None:
    """TTFT and decode tok/s through the HTTP server vs the same engine in process (HTTP overhead %),
    each the median of --reps runs with its min–max, and the agent exchange with and without reuse."""
    try:
        from vkflash.bench.serve import run
        from vkflash.model.default_model import resolve_model
        from vkflash.model.model_file import open_model

        open_model(resolve_model(model or settings.current()["MODEL"] or None, "--model" if model else "MODEL"))
        run(model=model, quick=quick, as_json=as_json, console=console, reps=reps)
    except VkflashError as e:
        _fail(e)


@bench_app.command("cluster")
def bench_cluster(url: str = typer.Argument(..., help="a vkflash serve, or a cluster (vkflash-launch cluster)"),
                  agents: int = typer.Option(4, "--agents", min=1, help="conversations at once"),
                  turns: int = typer.Option(8, "--turns", min=1, help="requests per conversation"),
                  max_tokens: int = typer.Option(16, "--max-tokens", min=1, help="tokens generated per request"),
                  as_json: bool = typer.Option(False, "--json", help="machine-readable output")) -> None:
    """Agents at once, each a conversation of turns, through URL: req/s and generated tok/s over
    the run, the share of prompt tokens from a prompt cache, requests per replica (docs/SCALING.md)."""
    try:
        from vkflash.bench.cluster import report, run

        report(run(url, agents, turns, max_tokens), console, as_json)
    except VkflashError as e:
        _fail(e)


@bench_app.command("model")
def bench_model(
    model: Optional[str] = typer.Argument(None, help="GGUF file (default: the default model, fetched once and "
                                                     "cached)"),
    depth: Optional[str] = typer.Option(None, "--depth", help="comma-separated depths, e.g. 0,8192,32768"),
    ub: Optional[str] = typer.Option(None, "--ub", help="prefill ubatch (knob UB)"),
    kv: Optional[str] = typer.Option(None, "--kv", help="KV cache type (knob KV)"),
    as_json: bool = typer.Option(False, "--json", help="machine-readable output"),
    quick: bool = typer.Option(False, "--quick", help="small sizes, every row (CI, lavapipe)"),
    profile: bool = typer.Option(False, "--profile", help="also the GPU time per op of the decode step and of "
                                 "one prefill step (the first pp row, and the window at the deepest depth)"),
    reps: Optional[int] = typer.Option(None, "--reps", min=1, help="timings of each depth-0 row (default 3)"),
    mtp: bool = typer.Option(False, "--mtp", help="greedy MTP speculation vs plain decode (default depths 0,32768)"),
    draft: Optional[str] = typer.Option(None, "--draft", help="--mtp: MTP-only GGUF (knob MODEL_DRAFT)"),
    accept: Optional[str] = typer.Option(None, "--accept",
                                         help="--mtp: draft agreement probabilities, default 0,0.5,0.87,1"),
) -> None:
    """pp512/pp2048/tg128, windows and rates at depths, dispatches and host µs per decode token, roofline;
    with --mtp: decode rates of MTP speculation whose drafts agree with probability P, next to plain decode."""
    try:
        from vkflash.bench.model import run as run_bench
        from vkflash.bench.model import run_mtp
        from vkflash.model.default_model import resolve_model
        from vkflash.model.model_file import open_model

        flags = settings.load(flags={"UB": ub, "KV": kv})  # checked like every other entry point's knobs
        ub_n, kv_type = (flags["UB"] if ub is not None else None), (flags["KV"] if kv is not None else None)
        path = resolve_model(model)
        open_model(path)
        depths = _numbers(depth, "--depth", int)
        if depths is not None and any(d < 0 for d in depths):
            raise ConfigError(f"--depth {depth!r}: depths must be ≥ 0")
        if mtp:
            accepts = _numbers(accept, "--accept", float)
            if accepts is not None and any(not 0 <= p <= 1 for p in accepts):
                raise ConfigError(f"--accept {accept!r}: probabilities must be in 0..1")
            draft = draft or settings.current()["MODEL_DRAFT"] or None
            run_mtp(path, resolve_model(draft, "--draft") if draft else None, quick, depths, accepts, as_json, console,
                    ub_n, kv_type)
            return
        run_bench(path, quick, depths, as_json, console, ub_n, kv_type, profile, reps)
    except VkflashError as e:
        _fail(e)


def _numbers(text: Optional[str], flag: str, kind: type) -> Optional[list]:
    """A comma-separated list of `kind` values from an option, None when not given."""
    if text is None:
        return None
    try:
        return [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"{flag} {text!r}: expected comma-separated {kind.__name__} values") from None


def main() -> None:
    try:
        app()
    except VkflashError as e:  # raised outside a command's own handler
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
