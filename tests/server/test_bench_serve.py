"""`vkflash bench serve --quick` on a tiny generated model (NumPy reference backend, so it is fast
on any machine): both prompts reported, every figure present and plausible (no speeds asserted),
each a median inside its min–max over --reps runs, the agent exchange's turn 2 reusing turn 1's
prompt, and the table form fits 80 columns."""

from __future__ import annotations

import json
import math
import subprocess
import sys

from harness import ROOT


def _bench(model, *extra: str, columns: int = 200) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, "-m", "vkflash.cli", "bench", "serve", "--quick", "--model", str(model), *extra],
                       cwd=ROOT, capture_output=True, text=True, timeout=240,
                       env={"PATH": "/usr/bin:/bin", "COLUMNS": str(columns), "VKFLASH_BACKEND": "reference"})
    assert r.returncode == 0, r.stdout + r.stderr
    return r


def test_bench_serve_quick_json(tiny_model):
    from vkflash.bench.serve import QUICK

    res = json.loads(_bench(tiny_model, "--json", "--reps", "2").stdout)
    assert res["reps"] == 2
    assert res["model"] == tiny_model.name and res["backend"] == res["server_backend"] == "numpy-reference"
    rows = {r["prompt"]: r for r in res["rows"]}
    assert set(rows) == {"short", "long"}
    assert rows["short"]["prompt_tokens"] == QUICK.short and rows["long"]["prompt_tokens"] == QUICK.long
    assert res["ctx"] >= QUICK.long + QUICK.gen
    for r in rows.values():
        assert r["gen_tokens"] == QUICK.gen  # ignore_eos: exactly the asked number
        for k in ("ttft_ms_engine", "ttft_ms_http", "tok_s_engine", "tok_s_http"):
            assert 0 < r[k] < 1e6, (k, r)
        for k in ("ttft_overhead_pct", "per_token_overhead_pct"):
            assert math.isfinite(r[k]) and r[k] > -100, (k, r)
        for k in ("ttft_ms_engine", "ttft_ms_http", "tok_s_engine", "tok_s_http"):
            lo, hi = r["spread"][k]
            assert 0 < lo <= r[k] <= hi, (k, r)
        # the overheads are the medians' own ratios
        assert math.isclose(r["ttft_overhead_pct"], 100 * (r["ttft_ms_http"] / r["ttft_ms_engine"] - 1), rel_tol=1e-6)
        assert math.isclose(r["per_token_overhead_pct"], 100 * (r["tok_s_engine"] / r["tok_s_http"] - 1),
                            rel_tol=1e-6)
    # the agent exchange: turn 2 restarts from the checkpoint at turn 1's end (a recurrent model)
    a = res["agent"]
    assert a["prefix_tokens"] == QUICK.long and a["new_tokens"] == QUICK.short and a["cache_n"] == QUICK.long
    assert a["ttft_ms_reuse"] > 0 and a["ttft_ms_cold"] > 0
    assert math.isclose(a["speedup"], a["ttft_ms_cold"] / a["ttft_ms_reuse"], rel_tol=1e-6)


def test_bench_serve_table_fits_80_columns(tiny_model):
    out = _bench(tiny_model, columns=80).stdout
    assert "bench serve" in out and "short" in out and "long" in out and "per token" in out and "min–max" in out
    assert "agent exchange" in out and "reused" in out
    assert max(len(ln) for ln in out.splitlines()) <= 80 and "…" not in out, out


def test_sse_reader_skips_keepalive_comments(rng):
    """The bench's SSE reader takes the server's keep-alive comments (a long prefill on lavapipe
    sends them) as no event, not as a JSON event."""
    import socket
    import threading

    from vkflash.bench.serve import sse_completion
    from vkflash.server.openai_api import KEEPALIVE, sse

    events = [{"i": int(i)} for i in rng.integers(0, 1000, int(rng.integers(1, 5)))]
    body = "".join(KEEPALIVE + sse(e) for e in events) + KEEPALIVE + sse("[DONE]")
    srv = socket.create_server(("127.0.0.1", 0))

    def answer() -> None:
        conn, _ = srv.accept()
        with conn:
            conn.recv(65536)
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n"
                         + body.encode())

    t = threading.Thread(target=answer, daemon=True)
    t.start()
    try:
        got = [ev for _, ev in sse_completion(srv.getsockname()[1], {"prompt": [1]})]
    finally:
        t.join(10)
        srv.close()
    assert got == events
