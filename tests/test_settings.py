"""The knob table: precedence, validation, aliases, and the README kept in sync with it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from vkflash import settings
from vkflash.errors import ConfigError

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_table_is_generated_from_knobs():
    text = README.read_text()
    m = re.search(r"<!-- knobs:begin -->\n(.*)\n<!-- knobs:end -->", text, re.S)
    assert m, "README lost its knob table markers"
    assert m.group(1) == settings.markdown_table(), "README knob table is stale: run `vkflash knobs --markdown`"


def test_knob_table_rows_have_four_cells():
    """A `|` in a cell (`0 | 1`, `|Δy|`) is escaped, else markdown splits the row and drops the help."""
    rows = settings.markdown_table().splitlines()[2:]
    assert len(rows) == len(settings.KNOBS)
    for knob, row in zip(settings.KNOBS, rows):
        cells = [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", row)[1:-1]]
        assert len(cells) == 4, row
        assert cells[2] == knob.accepts and cells[3] == knob.help


def test_choice_names_the_empty_option():
    assert settings.BY_NAME["REASONING"].accepts.startswith("(empty) | none")


def test_precedence_default_env_flag():
    s = settings.load(env={}, flags={})
    assert s["UB"] == 2048 and s.sources["UB"] == "default"
    s = settings.load(env={"UB": "512"}, flags={})
    assert s["UB"] == 512 and s.sources["UB"] == "env UB"
    s = settings.load(env={"UB": "512"}, flags={"UB": "256"})
    assert s["UB"] == 256 and s.sources["UB"] == "flag"


def test_ggml_alias():
    s = settings.load(env={"GGML_VK_VISIBLE_DEVICES": "3"})
    assert s["VKFLASH_DEVICE"] == 3 and s.sources["VKFLASH_DEVICE"] == "env GGML_VK_VISIBLE_DEVICES"
    # llama.cpp's list form: one device runs the model, the first listed
    assert settings.load(env={"GGML_VK_VISIBLE_DEVICES": "1,2"})["VKFLASH_DEVICE"] == 1
    with pytest.raises(ConfigError, match="'64,1'"):
        settings.load(env={"GGML_VK_VISIBLE_DEVICES": "64,1"})
    s = settings.load(env={"GGML_VK_PERF_LOGGER": "1"})
    assert s["VKFLASH_PERF_LOGGER"] is True


@pytest.mark.parametrize("name,value", [("UB", "0"), ("UB", "lots"), ("KV", "q4_0"), ("MTP", "maybe"),
                                        ("PORT", "70000"), ("TEMP", "-1"), ("VKFLASH_MEM_BUDGET", "12X")])
def test_bad_value_names_knob_value_and_accepted(name, value):
    with pytest.raises(ConfigError) as e:
        settings.load(env={name: value})
    msg = str(e.value)
    assert name in msg and repr(value) in msg and "accepted:" in msg


def test_unknown_flag_rejected():
    with pytest.raises(ConfigError):
        settings.load(env={}, flags={"NOPE": "1"})


def test_lines_say_where_each_value_came_from():
    s = settings.load(env={"CTX": "4096"}, flags={"PORT": "9000"})
    lines = s.lines(only_changed=True)
    assert "CTX=4096 (env CTX)" in lines and "PORT=9000 (flag)" in lines and len(lines) == 2


def test_mem_budget_suffixes():
    assert settings.load(env={"VKFLASH_MEM_BUDGET": "96G"})["VKFLASH_MEM_BUDGET"] == 96 << 30
    assert settings.load(env={"VKFLASH_MEM_BUDGET": "512M"})["VKFLASH_MEM_BUDGET"] == 512 << 20


def test_guard_step_knobs():
    """GUARD_<STEP>: auto, off, or a depth (k = ×1024); anything else stops startup."""
    s = settings.load(env={"GUARD_KV": "128k", "GUARD_UB": "off", "GUARD_DRAFT": "98304"})
    assert (s["GUARD_KV"], s["GUARD_UB"], s["GUARD_DRAFT"]) == (131072, "off", 98304)
    assert settings.load(env={})["GUARD_KV"] == "auto" and settings.load(env={})["DEEPGUARD"] is True
    for bad in ("soon", "-5", "12q"):
        with pytest.raises(ConfigError, match="GUARD_KV"):
            settings.load(env={"GUARD_KV": bad})
