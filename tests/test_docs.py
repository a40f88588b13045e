"""The README and docs/ say what the code does: every `pagesim` command they show names a real
subcommand with flags spelled as its parser knows them, and every repository path they name exists."""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

import pytest

from pagesim.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FOLDERS = ("specs", "policies", "traces", "sim", "backend", "analysis", "pagesim", "tests", "benchmarks", "docs")


def shell_blocks(text: str) -> list[str]:
    """The fenced blocks of a page that hold shell commands (no language, or sh/bash/console)."""
    return [m.group(2) for m in re.finditer(r"```(\w*)\n(.*?)```", text, re.S) if m.group(1) in ("", "sh", "bash")]


def pagesim_commands(text: str) -> list[list[str]]:
    """Each `pagesim ...` command line of the page's shell blocks, continuation lines joined and any
    trailing comment dropped, as its argument list (after `pagesim`)."""
    commands = []
    for block in shell_blocks(text):
        joined = re.sub(r"\\\n\s*", " ", block)
        for line in joined.splitlines():
            if not re.match(r"\s*(\w+=\S*\s+)*pagesim\s", line):
                continue
            words = shlex.split(line, comments=True)
            while words and "=" in words[0] and not words[0].startswith("-"):
                words = words[1:]  # environment assignments such as PYTHONPATH=.
            if words[:1] == ["pagesim"]:
                commands.append(words[1:])
    return commands


def subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def check_command(parser: argparse.ArgumentParser, words: list[str], where: str) -> None:
    """The words name a (nested) subcommand whose parser knows each flag; its --help works."""
    chain = []
    while words and not words[0].startswith("-") and subparsers(parser):
        subs = subparsers(parser)
        assert words[0] in subs, f"{where}: `pagesim {' '.join(chain + words[:1])}` is no command; known: {sorted(subs)}"
        chain.append(words[0])
        parser, words = subs[words[0]], words[1:]
    known = {s for a in parser._actions for s in a.option_strings}
    for w in words:
        flag = w.split("=", 1)[0]
        if flag.startswith("--"):
            assert flag in known, f"{where}: `pagesim {' '.join(chain)}` has no flag {flag}"
    with pytest.raises(SystemExit) as done:
        build_parser().parse_args([*chain, "--help"])
    assert done.value.code == 0


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_command_shown_parses(page: Path, capsys: pytest.CaptureFixture) -> None:
    parser = build_parser()
    commands = pagesim_commands(page.read_text())
    for words in commands:
        check_command(parser, words, page.relative_to(ROOT).as_posix())
    capsys.readouterr()  # the --help texts


def named_paths(text: str) -> list[str]:
    """Repository paths a page names: in backticks or as link targets, starting at a top-level
    folder of the repository (or ../shared/), wildcards and placeholders left out."""
    found = re.findall(r"`([^`\s]+)`", text) + re.findall(r"\]\(([^)\s#]+)", text)
    out = []
    for p in found:
        if re.search(r"[<>*{}]|DIR|FILE|NAME", p) or "://" in p:
            continue
        if (p.split("/")[0] in FOLDERS and "/" in p) or p.startswith("../shared/"):
            out.append(p)
    return out


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_path_named_exists(page: Path) -> None:
    missing = []
    for p in named_paths(page.read_text()):
        if p.startswith("../shared/") and not (ROOT.parent / "shared").is_dir():
            continue  # the data beside the repository is absent here
        base = page.parent if not p.startswith(FOLDERS) and not p.startswith("../shared/") else ROOT
        # a link on a page in docs/ is relative to docs/; a path in backticks to the repository root
        if not ((base / p).exists() or (ROOT / p).exists() or (page.parent / p).exists()):
            missing.append(p)
    assert not missing, f"{page.relative_to(ROOT)} names paths that do not exist: {missing}"


def test_the_checks_catch_a_misspelt_flag_and_command() -> None:
    parser = build_parser()
    (words,) = pagesim_commands("```\npagesim simulate --trace x --rates 1 \\\n    --out y\n```\n")
    with pytest.raises(AssertionError, match="no flag --rates"):
        check_command(parser, words, "page")
    with pytest.raises(AssertionError, match="is no command"):
        check_command(parser, ["simulat"], "page")
    assert named_paths("see `sim/run.py` and [x](docs/none.md), not `runs/out`") == ["sim/run.py", "docs/none.md"]


def test_warnings_are_one_line_in_the_tools_voice(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from pagesim.cli import main
    (tmp_path / "acme-7b.json").write_text((ROOT / "specs" / "models" / "llama-7b.json").read_text())
    assert main(["simulate", "--model", "acme-7b-instruct", "--models-dir", str(tmp_path), "--hardware",
                 "a100-80gb", "--num-requests", "5", "--rate", "1", "--quiet", "--out", str(tmp_path / "run")]) == 0
    err = [line for line in capsys.readouterr().err.splitlines() if "warning" in line.lower()]
    assert err and all(line.startswith("pagesim simulate: warning: model 'acme-7b-instruct'") for line in err), err


def test_aliases_are_resolved_said_and_recorded(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    import json

    from pagesim.cli import main
    assert main(["simulate", "--model", "llama3-8b", "--hardware", "h100", "--num-requests", "5", "--rate", "1",
                 "--quiet", "--out", str(tmp_path)]) == 0
    err = capsys.readouterr().err
    assert "model 'llama3-8b' is llama-3-8b" in err and "hardware 'h100' is h100-sxm" in err
    config = json.loads((tmp_path / "summary.json").read_text())["config"]
    assert (config["model"], config["hardware"]) == ("llama-3-8b", "h100-sxm")


def test_a_live_run_on_a_busy_machine_is_warned_about(monkeypatch: pytest.MonkeyPatch) -> None:
    import os
    import sys

    from pagesim.cli_args import warn_if_busy
    monkeypatch.delitem(sys.modules, "torch", raising=False)  # its thread count is another check's
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.setattr(os, "getloadavg", lambda: (9.2, 8.0, 7.0))
    with pytest.warns(UserWarning, match=r"pagesim live: this machine is busy \(load average 9.2 on 2 CPUs\)"):
        assert warn_if_busy("pagesim live")["load_1min"] == 9.2
    monkeypatch.setattr(os, "getloadavg", lambda: (1.0, 1.0, 1.0))
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert warn_if_busy("pagesim live")["cpus"] == 2  # quiet: nothing said
