"""Whether the simulator's kernel runs compiled (mypyc extensions beside the sources) or interpreted.

`make compiled` (build_compiled.py) compiles a fixed list of modules with mypyc IN PLACE: each
module gets an extension file beside its `.py`, plus one shared library at the repository root,
and a manifest (`compiled_manifest.json`, at the root too) records the SHA-256 of every source
it was built from. Python prefers an extension module to the `.py` in the same folder, so a
build older than its sources would silently win; `guard()` (run by `policies/__init__.py` before
any kernel module is imported) prevents that:

- no extension file and no manifest (never built, as in CI): nothing happens, silently;
- a manifest whose sources, extension files and shared library all match: the compiled modules load;
- anything else (a source edited since the build, an extension or the shared library missing, an
  extension that no manifest accounts for): every module of the build is loaded from its `.py`
  (a finder put first on `sys.meta_path`), and one line on stderr says so.

`PAGESIM_COMPILED=0` loads the sources even from a fresh build (silently); `PAGESIM_COMPILED=1`
requires a fresh build (ImportError naming what is stale otherwise): `make test-compiled` sets it.
The build is all or nothing: compiled modules call each other natively, so a mix of compiled and
interpreted copies of one module would hold two different classes under one name.
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent  # the repository root (the packages' parent)
MANIFEST = "compiled_manifest.json"
ENV = "PAGESIM_COMPILED"
PACKAGES = ("policies", "sim")  # where build_compiled.py's modules live


@dataclass(frozen=True)
class BuildState:
    """What `inspect` found. `modules`: the dotted names the build covers (its manifest's, plus any
    module with a stray extension file); `stale`: why it may not be used ('' when fresh, or when
    nothing was built: `built` False)."""

    built: bool
    modules: tuple[str, ...]
    stale: str
    shared: str = ""  # the shared library's module name (a fresh build's)


def source_hash(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def module_path(module: str, root: Path = ROOT) -> Path:
    return root.joinpath(*module.split(".")).with_suffix(".py")


def _extension_files(root: Path) -> dict[str, Path]:
    """Extension modules in the kernel's packages for this interpreter, by dotted module name."""
    found: dict[str, Path] = {}
    for pkg in PACKAGES:
        for f in sorted((root / pkg).iterdir()):
            # the first suffix that matches is the longest ('.cpython-311-x86_64-linux-gnu.so' before '.so')
            suffix = next((s for s in importlib.machinery.EXTENSION_SUFFIXES if f.name.endswith(s)), None)
            if suffix is not None:
                found[f"{pkg}.{f.name[:-len(suffix)]}"] = f
    return found


def _find_extension(root: Path, name: str) -> Path | None:
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        f = root.joinpath(*name.split(".")).with_name(name.split(".")[-1] + suffix)
        if f.exists():
            return f
    return None


def inspect(root: Path = ROOT) -> BuildState:
    """The state of the in-place build under `root` (reads the manifest, hashes the sources)."""
    extensions = _extension_files(root)
    manifest_file = root / MANIFEST
    if not manifest_file.exists():
        if not extensions:
            return BuildState(False, (), "")
        names = tuple(sorted(extensions))
        return BuildState(True, names, f"{extensions[names[0]].name} has no {MANIFEST} (built by hand?)")
    try:
        manifest = json.loads(manifest_file.read_text())
        sources: dict[str, str] = manifest["sources"]
        shared: str = manifest["shared_lib"]
    except (ValueError, KeyError, TypeError) as e:
        return BuildState(True, tuple(sorted(extensions)), f"{MANIFEST} is unreadable ({e})")
    names = tuple(sorted(set(sources) | set(extensions)))
    for name in names:
        if name not in sources:
            return BuildState(True, names, f"{extensions[name].name} is not in {MANIFEST}")
        py = module_path(name, root)
        if not py.exists() or source_hash(py) != sources[name]:
            return BuildState(True, names, f"{py.relative_to(root)} changed since the build")
        if name not in extensions:
            return BuildState(True, names, f"the extension of {name} is missing")
    if _find_extension(root, shared) is None:
        return BuildState(True, names, f"the shared library {shared} is missing")
    return BuildState(True, names, "", shared)


def _load_shared(name: str, root: Path = ROOT) -> None:
    """Import the build's shared library from the repository root, where it lies, under its own
    name: the compiled modules import it by that name, and the root is not on sys.path when a
    command runs from an installed entry point (the editable install maps the packages only)."""
    if name in sys.modules or importlib.util.find_spec(name) is not None:
        return
    path = _find_extension(root, name)
    spec = importlib.util.spec_from_file_location(name, path) if path is not None else None
    if spec is None or spec.loader is None:
        raise ImportError(f"the compiled build's shared library {name} is not loadable from {root}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)


class _SourceFinder(importlib.abc.MetaPathFinder):
    """Loads the listed modules from their `.py`, whatever extension file lies beside it."""

    def __init__(self, modules: tuple[str, ...], root: Path) -> None:
        self.modules = frozenset(modules)
        self.root = root

    def find_spec(self, fullname: str, path: object = None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in self.modules:
            return None
        return importlib.util.spec_from_file_location(fullname, module_path(fullname, self.root))


@cache
def guard() -> str:
    """Decide once per process, before any kernel module is imported: 'compiled', 'interpreted'
    (nothing built, or PAGESIM_COMPILED=0) or 'stale' (the sources run, and stderr said why)."""
    mode = os.environ.get(ENV, "")
    if mode not in ("", "0", "1"):
        raise ValueError(f"{ENV} must be 0 (interpreted), 1 (require the compiled build) or unset; got {mode!r}")
    state = inspect()
    if mode == "1" and (not state.built or state.stale):
        raise ImportError(f"{ENV}=1 but the compiled build is "
                          f"{state.stale or 'missing'}: run `make compiled`")
    if not state.built:
        return "interpreted"
    if mode == "0" or state.stale:
        sys.meta_path.insert(0, _SourceFinder(state.modules, ROOT))
        if mode == "0":
            return "interpreted"
        print(f"pagesim: the compiled build is stale ({state.stale}); running interpreted "
              "(`make compiled` rebuilds it)", file=sys.stderr)
        return "stale"
    _load_shared(state.shared)
    return "compiled"


def running_compiled(module: ModuleType) -> bool:
    """Whether `module` was loaded from an extension (not from its `.py`)."""
    return not (module.__file__ or "").endswith(".py")
