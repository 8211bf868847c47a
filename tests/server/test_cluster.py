"""Several replicas behind the cluster layer (`launcher/vkflash-launch cluster`: HAProxy with
launcher/haproxy.cfg), all on loopback: two replicas of the tiny model (the NumPy reference), agents
whose conversations share one system prompt, through the official openai client.

Each conversation sticks to one replica and reuses its prefix there (cache_n > 0 on every repeat);
a replica killed (SIGKILL) in the middle of a request loses nothing (HAProxy sends the request again,
to the other replica), and every later request succeeds on the survivor; the replica restarted on its
port is checked back in and takes new conversations; stopped with SIGTERM (DRAIN) in the middle of a
request, it finishes that request and leaves. Also: the launcher's config and refusals."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from harness import ROOT, Server, call, free_port, start_server, stop_server
from vkflash.bench.serve import stop_process

LAUNCH = ROOT / "launcher" / "vkflash-launch"
WORDS = ["def", "return", "fibonacci", "for", "in", "range", "print", "hello", "value", "n", "agent", "tool"]
STEADY_TURNS = 10  # per agent, both replicas up
FAILOVER_TURNS = 10  # per agent after the kill (agent 0's first is the one in flight at the kill)
REJOIN_TURNS = 1  # per new agent, after its first turn


@dataclass
class Cluster:
    """The HAProxy process in front of the replicas, its URL and admin socket."""

    base: str
    proc: subprocess.Popen
    admin: Path
    log: Path

    def states(self) -> dict[str, int]:
        """Replica name → HAProxy's operational state (0 down, 2 up), from the admin socket."""
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(str(self.admin))
            s.sendall(b"show servers state replicas\n")
            text = b"".join(iter(lambda: s.recv(65536), b"")).decode()
        rows = [r for r in map(str.split, text.splitlines()) if len(r) > 5 and r[0].isdigit()]  # no "#" header
        return {r[3]: int(r[5]) for r in rows}

    def wait_state(self, name: str, want: int, timeout: float = 20) -> None:
        """Until HAProxy's health checks put replica `name` in state `want`."""
        end = time.monotonic() + timeout
        while self.states().get(name) != want:
            assert time.monotonic() < end, f"{name} never reached state {want}: {self.states()}"
            time.sleep(0.05)


def name_of(s: Server) -> str:
    return s.base.removeprefix("http://")


def start_cluster(tmp: Path, replicas: list[Server]) -> Cluster:
    """`vkflash-launch cluster` on a free port with fast health checks; returns once every replica is up."""
    port, admin, log = free_port(), tmp / "admin.sock", tmp / "haproxy.log"
    with open(log, "w") as f:
        proc = subprocess.Popen([str(LAUNCH), "cluster", "--listen", f"127.0.0.1:{port}", "--check-ms", "100",
                                 "--admin", str(admin), "--config-out", str(tmp / "cluster.cfg"),
                                 *map(name_of, replicas)], stdout=f, stderr=subprocess.STDOUT)
    c = Cluster(f"http://127.0.0.1:{port}", proc, admin, log)
    try:
        end = time.monotonic() + 20
        while not admin.exists() or any(c.states().get(name_of(r)) != 2 for r in replicas):
            assert proc.poll() is None and time.monotonic() < end, f"haproxy did not come up:\n{log.read_text()}"
            time.sleep(0.05)
    except BaseException:
        stop_cluster(c)  # no fixture teardown runs for a setup that failed
        raise
    return c


def stop_cluster(c: Cluster) -> None:
    """SIGTERM to HAProxy's master (it stops its worker), then wait (kill if it hangs)."""
    stop_process(c.proc, 10)


def signal_when_running(s: Server, sig: signal.Signals) -> None:
    """Send `sig` to a replica as soon as its slot runs a request (seen on /slots)."""
    end = time.monotonic() + 30
    while not call(s.base, "GET", "/slots", timeout=5).body[0]["is_processing"]:
        assert time.monotonic() < end, "the replica never ran the request"
        time.sleep(0.01)
    s.proc.send_signal(sig)


@dataclass
class Agent:
    """One conversation: a shared system prompt and its own task, then turns; records what answered."""

    client: Any
    model: str
    system: str
    task: str
    later: list[str]  # the user's next messages
    messages: list[dict] = field(default_factory=list)
    served: list[tuple[str, int]] = field(default_factory=list)  # (replica, cache_n) per turn

    def __post_init__(self) -> None:
        self.messages = [{"role": "system", "content": self.system}, {"role": "user", "content": self.task}]

    def turn(self, max_tokens: int = 3) -> None:
        """One request through the cluster; the reply and the next user message extend the conversation."""
        raw = self.client.chat.completions.with_raw_response.create(
            model=self.model, messages=self.messages, max_tokens=max_tokens, temperature=0,
            extra_body={"ignore_eos": True})
        r = raw.parse()
        assert r.usage.completion_tokens == max_tokens
        self.served.append((raw.headers["x-vkflash-replica"], r.model_extra["timings"]["cache_n"]))
        self.messages += [{"role": "assistant", "content": r.choices[0].message.content},
                          {"role": "user", "content": self.later[len(self.served) - 1]}]


def together(jobs: list[Callable[[], None]]) -> None:
    """Run the jobs in threads that start at once (a barrier); re-raise the first failure."""
    barrier, errors = threading.Barrier(len(jobs)), []

    def run(job: Callable[[], None]) -> None:
        barrier.wait()
        try:
            job()
        except BaseException as e:  # noqa: BLE001 — handed to the test thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(j,)) for j in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a client thread hung"
    if errors:
        raise errors[0]


@pytest.fixture
def replicas(tmp_path: Path, tiny_model: Path) -> Iterator[list[Server]]:
    """Two replicas of the tiny model (NumPy reference, DRAIN 30 s); the test may replace one."""
    started: list[Server] = []
    try:
        for _ in range(2):
            started.append(start_server(tmp_path, {"MODEL": str(tiny_model), "DRAIN": "30"}))
        yield started
    finally:
        for s in started:
            if s.proc.poll() is None:
                stop_server(s)


@pytest.fixture
def cluster(tmp_path: Path, replicas: list[Server]) -> Iterator[Cluster]:
    c = start_cluster(tmp_path, replicas)
    yield c
    stop_cluster(c)


def test_affinity_failover_and_rejoin(cluster: Cluster, replicas: list[Server], tmp_path: Path, tiny_model: Path,
                                      rng) -> None:
    import openai

    def say(n: int = 4) -> str:
        return " ".join(rng.choice(WORDS, size=n))

    client = openai.OpenAI(base_url=cluster.base + "/v1", api_key="x", max_retries=0, timeout=60)
    system = say(6)
    turns = STEADY_TURNS + FAILOVER_TURNS
    # each agent's first message names it: HAProxy's affinity key hashes the system prompt and that message
    a, b = (Agent(client, tiny_model.stem, system, f"{say()} {i}", [say() for _ in range(turns)]) for i in range(2))

    # steady: the two first requests arrive together, so leastconn gives each agent its own replica;
    # each conversation then stays there, and every repeat reuses its prefix
    together([lambda ag=ag: [ag.turn() for _ in range(STEADY_TURNS)] for ag in (a, b)])
    home = {ag.served[0][0] for ag in (a, b)}
    assert home == set(map(name_of, replicas)), (a.served, b.served)
    for ag in (a, b):
        assert {r for r, _ in ag.served} == {ag.served[0][0]}, ag.served
        assert all(c > 0 for _, c in ag.served[1:]), ag.served

    # a replica dies in the middle of agent a's request (a long one, seen running on /slots)
    victim = next(s for s in replicas if name_of(s) == a.served[0][0])
    survivor = next(s for s in replicas if s is not victim)

    together([lambda: a.turn(max_tokens=48), lambda: signal_when_running(victim, signal.SIGKILL)])
    assert a.served[-1][0] == name_of(survivor), a.served  # the request in flight was sent again
    cluster.wait_state(name_of(victim), 0)

    # every later request succeeds, on the survivor (a's key moved there with the retry), while the
    # victim restarts on its port and rejoins; a, then b: each repeat after the first reuses its prefix
    restarted: list[Server] = []

    def restart() -> None:
        port = int(name_of(victim).rsplit(":", 1)[1])
        restarted.append(start_server(tmp_path, {"MODEL": str(tiny_model), "DRAIN": "30"}, port=port))
        replicas[replicas.index(victim)] = restarted[0]
        cluster.wait_state(name_of(victim), 2)

    n_before = [len(a.served), len(b.served)]
    together([lambda: [a.turn() for _ in range(FAILOVER_TURNS - 1)] + [b.turn() for _ in range(FAILOVER_TURNS)],
              restart])
    after = a.served[n_before[0]:] + b.served[n_before[1]:]
    assert {r for r, _ in after} == {name_of(survivor)}, after
    assert all(n > 0 for _, n in after[:FAILOVER_TURNS - 1] + after[FAILOVER_TURNS:]), after
    assert len(a.served) + len(b.served) == 2 * turns

    # the restarted replica takes new conversations again (two arriving together: one each) and
    # reuses their prefixes
    c, d = (Agent(client, tiny_model.stem, system, f"{say()} {i}", [say() for _ in range(3 + REJOIN_TURNS)])
            for i in (2, 3))
    together([lambda ag=ag: [ag.turn() for _ in range(1 + REJOIN_TURNS)] for ag in (c, d)])
    assert {ag.served[0][0] for ag in (c, d)} == {name_of(victim), name_of(survivor)}, (c.served, d.served)
    for ag in (c, d):
        assert {r for r, _ in ag.served} == {ag.served[0][0]} and all(n > 0 for _, n in ag.served[1:]), ag.served

    # drain: SIGTERM to a replica (DRAIN > 0) in the middle of a request lets that request finish
    # there; the replica leaves, and the conversation's next request goes to the other one
    ag = next(ag for ag in (c, d) if ag.served[0][0] == name_of(victim))
    together([lambda: ag.turn(max_tokens=48), lambda: signal_when_running(restarted[0], signal.SIGTERM)])
    assert ag.served[-1][0] == name_of(victim), ag.served
    assert restarted[0].proc.wait(timeout=30) == 0, restarted[0].output()
    ag.turn()
    assert ag.served[-1][0] == name_of(survivor), ag.served
    log = cluster.log.read_text()
    assert "is DOWN" in log and "is UP" in log, log


@pytest.mark.parametrize("args, says", [
    ([], "name at least one replica"),
    (["nohost"], "is not HOST:PORT"),
    (["--listen", "x", "127.0.0.1:1"], "is not HOST:PORT"),
    (["--check-ms", "0", "127.0.0.1:1"], "--check-ms wants a positive integer"),
    (["--bogus", "127.0.0.1:1"], "unknown option --bogus"),
    (["127.0.0.1:1", "--admin"], "--admin needs a value"),
    (["--admin", "/tmp/a b&c", "127.0.0.1:1"], "--admin wants a plain path"),
])
def test_cluster_launcher_refuses_bad_arguments(args: list[str], says: str, tmp_path: Path) -> None:
    """One line and exit status 2, on a box without vkflash too (the router's needs only haproxy)."""
    r = subprocess.run([str(LAUNCH), "cluster", *args], capture_output=True, text=True, timeout=30,
                       env={"PATH": "/usr/bin:/bin", "VKFLASH_VENV": str(tmp_path / "none")})
    assert r.returncode == 2 and says in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_cluster_config_has_every_replica_once(tmp_path: Path, rng) -> None:
    """The written config: one server line per replica, the listen address, check interval and admin
    socket from the arguments; haproxy accepts it (`-c`) before the launcher runs it."""
    ports = sorted({int(p) for p in rng.integers(1024, 65536, size=int(rng.integers(1, 6)))})
    reps = [f"127.0.0.{i + 1}:{p}" for i, p in enumerate(ports)]
    out, admin, listen = tmp_path / "c.cfg", tmp_path / "a.sock", f"127.0.0.1:{free_port()}"
    check_ms = int(rng.integers(50, 5000))
    proc = subprocess.Popen([str(LAUNCH), "cluster", "--listen", listen, "--check-ms", str(check_ms), "--admin",
                             str(admin), "--config-out", str(out), *reps], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        said = []
        for line in proc.stdout:  # the launcher says what it runs, then haproxy runs
            said.append(line)
            if "exec " in line:
                break
        assert said and "exec " in said[-1], said
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    text = out.read_text()
    servers = [line.split()[1:3] for line in text.splitlines() if line.strip().startswith("server ")]
    assert servers == [[r, r] for r in reps]
    assert f"bind {listen} " in text and f"inter {check_ms}ms " in text and f"stats socket {admin} " in text


def test_affinity_key_rules(tmp_path: Path, rng) -> None:
    """launcher/haproxy.cfg's key rules, run by haproxy itself (a frontend that answers with the key):
    one key for every turn of a conversation, string or parts content alike; another task, another
    key; the header wins; completions keyed on their first 256 bytes; token ids: no key."""
    import json
    import urllib.request

    rules = [line for line in (ROOT / "launcher" / "haproxy.cfg").read_text().splitlines()
             if line.strip().startswith("http-request set-var")]
    port = free_port()
    cfg = tmp_path / "keys.cfg"
    cfg.write_text("\n".join(["global", "    tune.bufsize 1048576", "defaults", "    mode http", "    timeout client 5s",
                              "frontend keys", f"    bind 127.0.0.1:{port}", "    option http-buffer-request", *rules,
                              '    http-request return status 200 content-type text/plain lf-string "%[var(txn.key),hex]"',
                              ""]))
    proc = subprocess.Popen(["haproxy", "-db", "-f", str(cfg)], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                            env={"PATH": "/usr/sbin:/usr/local/sbin:/usr/bin:/bin"})

    def key(body: dict, headers: dict[str, str] | None = None) -> str:
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/x", json.dumps(body).encode(), headers or {})
        end = time.monotonic() + 10
        while True:
            try:
                with urllib.request.urlopen(req, timeout=5) as r:
                    return r.read().decode()
            except OSError:
                assert proc.poll() is None and time.monotonic() < end, "haproxy did not answer"
                time.sleep(0.05)

    def say(n: int = 5) -> str:
        return " ".join(rng.choice(WORDS, size=n))

    try:
        system, task, other = say(), say() + " one", say() + " two"
        turn1 = [{"role": "system", "content": system}, {"role": "user", "content": task}]
        later = turn1 + [{"role": "assistant", "content": say()}, {"role": "user", "content": say()}]
        parts = [{"role": m["role"], "content": [{"type": "text", "text": m["content"]}]} for m in turn1]
        k = key({"messages": turn1})
        assert len(k) == 40 and key({"messages": later, "max_tokens": 9}) == k == key({"messages": parts})
        assert key({"messages": [turn1[0], {"role": "user", "content": other}]}) != k
        user_only = key({"messages": turn1[1:]})
        assert user_only not in ("", k) and key({"messages": later[1:]}) == user_only
        h = {"X-Vkflash-Affinity": say()}
        assert key({"messages": turn1}, h) == key({"prompt": "x"}, h) not in ("", k)
        head = "".join(rng.choice(list("abcdef"), size=256))
        assert key({"prompt": head + say()}) == key({"prompt": head + say()}) != key({"prompt": say() + head})
        assert key({"prompt": [1, 2, 3]}) == ""
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_bench_cluster_against_one_server(tmp_path: Path, tiny_model: Path, rng) -> None:
    """`vkflash bench cluster` counts what it sent and what was cached (one agent: every repeat reuses
    its prefix), names no replica for a server without HAProxy, and says in one line when the URL is dead."""
    from vkflash.bench.cluster import run

    s = start_server(tmp_path, {"MODEL": str(tiny_model)})
    try:
        turns, m = int(rng.integers(2, 5)), int(rng.integers(1, 4))
        r = run(s.base, agents=1, turns=turns, max_tokens=m)
        assert (r.requests, r.completion_tokens, r.replicas) == (turns, turns * m, {"direct": turns})
        assert 0 < r.cached_tokens < r.prompt_tokens and r.seconds > 0
    finally:
        stop_server(s)
    dead = subprocess.run([sys.executable, "-m", "vkflash.cli", "bench", "cluster", f"http://127.0.0.1:{free_port()}"],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert dead.returncode == 1 and dead.stderr.startswith("error: no model listed at"), dead.stderr
    assert len(dead.stderr.strip().splitlines()) == 1, dead.stderr
