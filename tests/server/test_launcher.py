"""launcher/vkflash-launch (presets fill only unset knobs, everything passes through, the command
is printed, vkflash serve is exec'd) and containers/Containerfile (installs only via launcher/setup)."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LAUNCH = ROOT / "launcher" / "vkflash-launch"
WATCHED = ("TEMP", "REASONING", "SPEC_STOCH", "MTP", "CTX", "MODEL", "VKFLASH_JOB_LOG")


@pytest.fixture
def fake_venv(tmp_path: Path) -> Path:
    """A venv whose `vkflash` prints its argv and the watched knobs as JSON."""
    b = tmp_path / "venv" / "bin"
    b.mkdir(parents=True)
    names = " ".join(WATCHED)
    (b / "vkflash").write_text(
        "#!/usr/bin/env bash\n"
        "printf 'STUB '; { printf '{\"argv\": ['; sep=''; for a in \"$@\"; do printf '%s\"%s\"' \"$sep\" \"$a\"; sep=,; done;"
        f" printf '], \"env\": {{'; sep=''; for n in {names}; do"
        " if [ -n \"${!n+x}\" ]; then printf '%s\"%s\": \"%s\"' \"$sep\" \"$n\" \"${!n}\"; sep=,; fi; done; printf '}}\\n'; }\n")
    (b / "vkflash").chmod(0o755)
    return tmp_path / "venv"


def _launch(venv: Path, args: list[str], env: dict[str, str]) -> tuple[dict, str]:
    r = subprocess.run([str(LAUNCH), *args], capture_output=True, text=True, timeout=30,
                       env={"PATH": "/usr/bin:/bin", "VKFLASH_VENV": str(venv), **env})
    assert r.returncode == 0, r.stderr
    stub = next(line for line in r.stdout.splitlines() if line.startswith("STUB "))
    return json.loads(stub[5:]), r.stdout


def test_code_preset(fake_venv):
    got, out = _launch(fake_venv, ["code", "--flag", "x y"], {"CTX": "4096"})
    assert got["argv"] == ["serve", "--flag", "x y"]
    assert got["env"]["TEMP"] == "0" and got["env"]["REASONING"] == "none" and got["env"]["CTX"] == "4096"
    assert "exec TEMP=0 REASONING=none " in out and out.index("vkflash-launch: exec") < out.index("STUB")


def test_presets_never_override_the_environment(fake_venv, rng):
    temp = f"{rng.uniform(0.1, 2.0):.3f}"
    got, out = _launch(fake_venv, ["code"], {"TEMP": temp, "VKFLASH_JOB_LOG": "1"})
    assert got["env"]["TEMP"] == temp and got["env"]["REASONING"] == "none" and got["env"]["VKFLASH_JOB_LOG"] == "1"
    assert "TEMP=0" not in out


@pytest.mark.parametrize("mtp", ["0", "1"])
def test_chat_preset_speculates_stochastically_with_mtp(fake_venv, mtp):
    got, _ = _launch(fake_venv, ["chat"], {"MTP": mtp})
    assert got["env"]["TEMP"] == "1"
    assert got["env"].get("SPEC_STOCH") == ("1" if mtp == "1" else None)


def test_no_preset_passes_everything_through(fake_venv):
    got, out = _launch(fake_venv, ["--port", "9"], {"MODEL": "/m.gguf"})
    assert got["argv"] == ["serve", "--port", "9"] and got["env"] == {"MODEL": "/m.gguf"}
    assert "preset none" in out


def test_missing_vkflash_is_a_clear_error(tmp_path):
    r = subprocess.run([str(LAUNCH)], capture_output=True, text=True, timeout=30,
                       env={"PATH": "/usr/bin:/bin", "VKFLASH_VENV": str(tmp_path)})
    assert r.returncode == 1 and "launcher/setup" in r.stderr


def test_launcher_execs_the_real_server(tmp_path):
    """End to end: the launcher's exec reaches `vkflash serve`."""
    r = subprocess.run([str(LAUNCH), "code", "--help"], capture_output=True, text=True, timeout=60,
                       env={"PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr


# ---------------------------------------------------------------- containers/Containerfile

def _run_lines(containerfile: str) -> list[str]:
    """The RUN instructions, with line continuations joined."""
    joined = re.sub(r"\\\n", " ", containerfile)
    return [line.strip()[4:].strip() for line in joined.splitlines() if line.strip().upper().startswith("RUN ")]


INSTALLERS = re.compile(r"\b(?:dnf|microdnf|yum|apt-get|apt|rpm|pip3?|python3? -m pip)\s+(?:-\S+\s+)*install\b(.*)")


def _installed(cmd: str) -> list[str]:
    """Package names a shell command line installs with a package manager."""
    names = []
    for part in re.split(r"&&|;|\|\|", cmd):
        m = INSTALLERS.search(part)
        if m:
            names += [w for w in shlex.split(m.group(1)) if not w.startswith("-")]
    return names


def _setup_packages() -> set[str]:
    """Every package launcher/setup installs with dnf or apt."""
    text = (ROOT / "launcher" / "setup").read_text()
    pkgs = set(re.search(r'APT_PKGS="([^"]*)"', text).group(1).split())
    joined = re.sub(r"\\\n", " ", text)
    for line in joined.splitlines():
        pkgs |= set(_installed(line.replace('"', "")))
    return {p for p in pkgs if not p.startswith("$")}


def test_containerfile_installs_only_through_setup():
    text = (ROOT / "containers" / "Containerfile").read_text()
    assert re.search(r"^FROM\s+\S*fedora", text, re.M | re.I), "a Fedora (toolbox) base"
    runs = _run_lines(text)
    assert any(re.search(r"(^|\s|/)launcher/setup\b", r) for r in runs), "the image is built by launcher/setup"
    extra = [p for r in runs for p in _installed(r) if p not in _setup_packages()]
    assert not extra, f"installed outside launcher/setup: {extra}"
    copied = re.findall(r"^COPY\s+(\S+)", text, re.M)
    for src in copied:
        assert (ROOT / src).exists(), f"COPY of a path the repo lacks: {src}"


def test_install_parser_sees_installs(rng):
    """The check above would catch an extra package (guards the parser, with a random name)."""
    name = "pkg" + "".join(rng.choice(list("abcdefgh"), size=6))
    for cmd in (f"dnf install -y {name}", f"dnf -y install --setopt=x=1 {name} && true", f"pip install {name}==1",
                f"true; python3 -m pip install -q {name}", f"apt-get install -y --no-install-recommends {name}"):
        assert any(p.startswith(name) for p in _installed(cmd)), cmd
    assert {"vulkan-loader", "libvulkan1", "mesa-vulkan-drivers", "cmake"} <= _setup_packages()


def _unit_env(commented: bool) -> dict[str, str]:
    """The knobs the example systemd unit sets (or, commented, suggests)."""
    pat = r"^# Environment=(\w+)=(.*)$" if commented else r"^Environment=(\w+)=(.*)$"
    return dict(re.findall(pat, (ROOT / "launcher" / "vkflash.service").read_text(), flags=re.M))


@pytest.mark.parametrize("commented", [False, True])
def test_systemd_unit_sets_only_valid_knobs(commented):
    """Every Environment= of launcher/vkflash.service is a knob with a valid value."""
    from vkflash import settings

    env = _unit_env(commented)
    names = {n for k in settings.KNOBS for n in (k.name, *k.aliases)}
    assert env and set(env) <= names, set(env) - names
    settings.load(env=env)  # a bad value would raise ConfigError


def test_systemd_unit_enables_nothing_that_does_nothing():
    """MTP=1 speculates only with a draft head; a stock-converted model has none in its file, so the
    example enables it only together with MODEL_DRAFT (or not at all)."""
    env = _unit_env(False)
    assert env.get("MTP", "0") == "0" or env.get("MODEL_DRAFT"), env
