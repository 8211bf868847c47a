"""`vkflash bench cluster URL`: what a team of agents gets from one server or a cluster of them.

N agents run at once, each one conversation of T turns (a system prompt all of them share, its own
task, then a short user message per turn), sending each turn when the last one is answered, as a
coding agent does. Every request is a non-streamed chat completion of exactly M tokens (greedy,
ignore_eos), so the work per request does not depend on the model's text. Reported: requests and
generated tokens per second over the whole run (wall clock), the share of prompt tokens that came
from a replica's prompt cache (timings.cache_n over usage.prompt_tokens), and which replica answered
how many (the X-Vkflash-Replica header HAProxy adds; "direct" without one). Against one server and
against a cluster of the same servers, the ratio of the rates is the gain from the replicas; the
cached share says whether affinity kept conversations where their prefixes are.
"""

from __future__ import annotations

import json
import random
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import asdict, dataclass, field

from rich.console import Console
from rich.table import Table

from vkflash.errors import ConfigError

WORDS = ("the agent reads a file then edits the function and runs the tests again before it answers with a patch "
         "for the parser and a note on what changed").split()


@dataclass
class Result:
    """One run: what was sent, how long it took, what was cached, who answered."""

    url: str
    agents: int
    turns: int
    max_tokens: int
    requests: int = 0
    seconds: float = 0.0
    completion_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    replicas: dict[str, int] = field(default_factory=dict)

    @property
    def requests_per_s(self) -> float:
        return self.requests / self.seconds

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.seconds

    @property
    def cached_share(self) -> float:
        return self.cached_tokens / max(self.prompt_tokens, 1)


def _chat(url: str, model: str, messages: list[dict], max_tokens: int, timeout: float) -> tuple[dict, str]:
    """One non-streamed chat completion: the answer and the replica that gave it."""
    body = json.dumps({"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
                       "ignore_eos": True}).encode()
    req = urllib.request.Request(url + "/v1/chat/completions", body, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.load(r), r.headers.get("x-vkflash-replica", "direct")
    except urllib.error.HTTPError as e:
        raise ConfigError(f"{url} answered {e.code}: {e.read().decode(errors='replace')[:200]}") from None
    except (urllib.error.URLError, OSError) as e:
        raise ConfigError(f"cannot reach {url}: {getattr(e, 'reason', e)}") from None


def run(url: str, agents: int, turns: int, max_tokens: int, timeout: float = 1800) -> Result:
    """Drive `agents` conversations of `turns` turns each through `url`, all at once."""
    url = url.rstrip("/")
    try:
        with urllib.request.urlopen(url + "/v1/models", timeout=30) as r:
            model = json.load(r)["data"][0]["id"]
    except (urllib.error.URLError, OSError, KeyError, IndexError, ValueError) as e:
        raise ConfigError(f"no model listed at {url}/v1/models: {getattr(e, 'reason', e)}") from None
    pick = random.Random()  # fresh text every run: no prompt is cached from an earlier run

    def say(n: int) -> str:
        return " ".join(pick.choice(WORDS) for _ in range(n))

    system = say(24)
    tasks = [[say(8)] + [say(6) for _ in range(turns)] for _ in range(agents)]
    res = Result(url, agents, turns, max_tokens)
    lock, errors = threading.Lock(), []
    served: Counter[str] = Counter()

    def agent(lines: list[str]) -> None:
        messages = [{"role": "system", "content": system}, {"role": "user", "content": lines[0]}]
        try:
            for t in range(turns):
                r, replica = _chat(url, model, messages, max_tokens, timeout)
                with lock:
                    res.requests += 1
                    res.completion_tokens += r["usage"]["completion_tokens"]
                    res.prompt_tokens += r["usage"]["prompt_tokens"]
                    res.cached_tokens += r["timings"]["cache_n"]
                    served[replica] += 1
                messages += [{"role": "assistant", "content": r["choices"][0]["message"]["content"]},
                             {"role": "user", "content": lines[t + 1]}]
        except ConfigError as e:
            errors.append(e)

    threads = [threading.Thread(target=agent, args=(lines,), daemon=True) for lines in tasks]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    res.seconds = time.monotonic() - t0
    if errors:
        raise errors[0]
    res.replicas = dict(sorted(served.items()))
    return res


def report(res: Result, console: Console, as_json: bool) -> None:
    """The run as a table, or one JSON object."""
    if as_json:
        console.print_json(json.dumps(dict(asdict(res), requests_per_s=res.requests_per_s,
                                           tokens_per_s=res.tokens_per_s, cached_share=res.cached_share)))
        return
    t = Table(title=f"{res.agents} agents × {res.turns} turns × {res.max_tokens} tokens through {res.url}")
    for col in ("requests", "seconds", "req/s", "gen tok/s", "prompt tokens", "cached", "replicas"):
        t.add_column(col)
    t.add_row(str(res.requests), f"{res.seconds:.1f}", f"{res.requests_per_s:.2f}", f"{res.tokens_per_s:.1f}",
              str(res.prompt_tokens), f"{100 * res.cached_share:.0f}%",
              ", ".join(f"{k}: {v}" for k, v in res.replicas.items()))
    console.print(t)
