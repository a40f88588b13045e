"""The optional compiled kernel's guard (policies/_compiled.py): a stale or partial build never loads.

The guard is exercised on a small package tree in a temporary folder: a copy of the guard, a module,
and a "compiled extension" beside it that is not a loadable library (so the module imports only if
the guard sent the import to the `.py`). Under `make test-compiled` (PAGESIM_COMPILED=1) the real
build is checked to be the one running.
"""

from __future__ import annotations

import importlib.machinery
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from policies import _compiled

SUFFIX = importlib.machinery.EXTENSION_SUFFIXES[0]


def _tree(root: Path, *, extension: bool = True, manifest: bool = True, edit: bool = False,
          shared: bool = True) -> Path:
    """A package `policies` under `root` whose __init__ runs the guard, with one kernel module `kern`."""
    pkg = root / "policies"
    pkg.mkdir(parents=True)
    shutil.copy(Path(_compiled.__file__), pkg / "_compiled.py")
    (pkg / "__init__.py").write_text("from policies import _compiled\n_compiled.guard()\n")
    (pkg / "kern.py").write_text("VALUE = 'interpreted'\n")
    (root / "sim").mkdir()
    if extension:
        (pkg / f"kern{SUFFIX}").write_bytes(b"not a shared library")
    if shared:
        (root / f"kernel__mypyc{SUFFIX}").write_bytes(b"not a shared library")
    if manifest:
        sources = {"policies.kern": _compiled.source_hash(pkg / "kern.py")}
        (root / _compiled.MANIFEST).write_text(json.dumps({"shared_lib": "kernel__mypyc", "sources": sources}))
    if edit:
        (pkg / "kern.py").write_text("VALUE = 'interpreted'  # edited after the build\n")
    return root


def _run(root: Path, env_value: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != _compiled.ENV}
    env["PYTHONPATH"] = str(root)
    if env_value is not None:
        env[_compiled.ENV] = env_value
    code = ("import policies.kern, policies, importlib\n"
            "importlib.import_module('policies.kern')\n"
            "print(policies.kern.VALUE, policies.kern.__file__.endswith('.py'), policies._compiled.guard())\n")
    return subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True,
                          timeout=60)


def test_nothing_built_is_silent(tmp_path: Path) -> None:
    root = _tree(tmp_path, extension=False, manifest=False, shared=False)
    assert _compiled.inspect(root) == _compiled.BuildState(False, (), "")
    out = _run(root)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["interpreted", "True", "interpreted"]
    assert out.stderr == ""


def test_fresh_build_is_recognised(tmp_path: Path) -> None:
    state = _compiled.inspect(_tree(tmp_path))
    assert state == _compiled.BuildState(True, ("policies.kern",), "", "kernel__mypyc")


@pytest.mark.parametrize(("kwargs", "why"), [
    ({"edit": True}, "policies/kern.py changed since the build"),
    ({"manifest": False}, f"kern{SUFFIX} has no {_compiled.MANIFEST} (built by hand?)"),
    ({"shared": False}, "the shared library kernel__mypyc is missing"),
])
def test_stale_build_runs_the_sources_and_says_so_once(tmp_path: Path, kwargs: dict[str, bool], why: str) -> None:
    root = _tree(tmp_path, **kwargs)
    assert _compiled.inspect(root).stale == why
    out = _run(root)
    assert out.returncode == 0, out.stderr
    # the garbage extension beside kern.py was not loaded: the source was
    assert out.stdout.split() == ["interpreted", "True", "stale"]
    lines = out.stderr.splitlines()
    assert len(lines) == 1 and why in lines[0] and "running interpreted" in lines[0], out.stderr


def test_missing_extension_with_a_manifest_is_stale(tmp_path: Path) -> None:
    root = _tree(tmp_path, extension=False)
    assert _compiled.inspect(root).stale == "the extension of policies.kern is missing"
    out = _run(root)
    assert out.stdout.split() == ["interpreted", "True", "stale"] and len(out.stderr.splitlines()) == 1


def test_forced_interpreted_ignores_a_fresh_build_silently(tmp_path: Path) -> None:
    out = _run(_tree(tmp_path), "0")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["interpreted", "True", "interpreted"] and out.stderr == ""


def test_required_compiled_refuses_a_stale_build(tmp_path: Path) -> None:
    out = _run(_tree(tmp_path, edit=True), "1")
    assert out.returncode != 0
    assert "PAGESIM_COMPILED=1 but the compiled build is policies/kern.py changed" in out.stderr


def test_bad_mode_is_named(tmp_path: Path) -> None:
    out = _run(_tree(tmp_path), "yes")
    assert out.returncode != 0 and "PAGESIM_COMPILED must be 0" in out.stderr and "'yes'" in out.stderr


@pytest.mark.skipif(os.environ.get(_compiled.ENV) != "1", reason="only under `make test-compiled`")
def test_the_real_build_is_running() -> None:
    import policies.block_manager
    import policies.request

    assert _compiled.guard() == "compiled"
    assert _compiled.running_compiled(policies.request) and _compiled.running_compiled(policies.block_manager)


@pytest.mark.skipif(os.environ.get(_compiled.ENV) != "1", reason="only under `make test-compiled`")
def test_the_real_build_runs_from_outside_the_repository(tmp_path: Path) -> None:
    """An entry point (`pagesim demo`) runs with neither the repository root on sys.path nor it as
    the working folder: the installed packages' compiled modules must still find the build's shared
    library, which lies at the root."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    code = ("import sys, policies.step, policies._compiled as c\n"
            "assert str(c.ROOT) not in sys.path and '' not in sys.path[1:]\n"
            "print(c.guard(), c.running_compiled(policies.step))\n")
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["compiled", "True"]
