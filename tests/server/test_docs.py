"""The README's and docs/SERVING.md's examples work as written: every curl command and every
Python block, taken from the fenced code blocks, run against a live server on a tiny model (only
the port differs)."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from harness import ROOT, start_server, stop_server

DOCS = (ROOT / "docs" / "SERVING.md", ROOT / "README.md")
DOC_BASE = "http://127.0.0.1:8080"


def _blocks(lang: str) -> list[str]:
    return [b for doc in DOCS for b in re.findall(rf"^```{lang}\n(.*?)^```", doc.read_text(), flags=re.S | re.M)]


CURLS = [b for b in _blocks("sh") if b.startswith("curl ")]
PYTHON = _blocks("python")


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    s = start_server(tmp_path_factory.mktemp("docs"), {"MODEL": str(tiny_model), "CTX": "512"})
    yield s
    stop_server(s)


def test_the_doc_has_examples():
    assert len(CURLS) >= 3 and len(PYTHON) >= 3  # the README has one of each
    assert all(DOC_BASE in b for b in CURLS + PYTHON)


def test_python_clients_wait_long_enough_and_never_retry():
    """A first answer on a CPU-only machine can outlast the openai client's 600 s default, and its
    silent retries compute the request again: every example client sets a long timeout and no retries."""
    clients = re.findall(r"OpenAI\((.*?)\)", "\n".join(PYTHON))
    assert clients
    for args in clients:
        timeout = re.search(r"timeout=(\d+)", args)
        assert timeout and int(timeout[1]) >= 1800 and "max_retries=0" in args, args


@pytest.mark.parametrize("i", range(len(CURLS)))
def test_curl_examples(server, i):
    cmd = CURLS[i].replace(DOC_BASE, server.base)
    r = subprocess.run(["bash", "-euo", "pipefail", "-c", cmd], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    if '"stream": true' in cmd:
        events = [line.removeprefix("data: ") for line in r.stdout.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and events[0] != "[DONE]"
        assert json.loads(events[-2])["choices"][0]["finish_reason"] in ("stop", "length")
    else:
        body = json.loads(r.stdout)
        assert body["object"] == "chat.completion" and body["choices"][0]["finish_reason"] in ("stop", "length")


@pytest.mark.parametrize("i", range(len(PYTHON)))
def test_python_examples(server, i):
    code = PYTHON[i].replace(DOC_BASE, server.base)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
