"""Build (or remove) the optional compiled kernel: the modules in MODULES compiled with mypyc, in place.

    python build_compiled.py          # `make compiled`: extensions beside the .py files + compiled_manifest.json
    python build_compiled.py --clean  # `make clean-compiled`: remove them

MODULES is the one list of what is compiled (recompile after changing it or any of them). The
interpreted sources stay the reference: policies/_compiled.py loads them instead of a build that
is older than they are. Each module must type-check under mypy (mypyc compiles the annotations
into runtime checks); plug-in base classes stay subclassable from interpreted code
(`mypyc_attr(allow_interpreted_subclasses=True)`) or stay out of the list. Floating point: the C
code is compiled with -ffp-contract=off so that no multiply-add is fused (prices stay bit for bit
those of the interpreter).
"""

from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import json
import os
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent


def _load_guard() -> ModuleType:
    """policies/_compiled.py (stdlib only) by its path: importing the `policies` package would load
    the very modules this script builds or removes."""
    spec = importlib.util.spec_from_file_location("_pagesim_compiled", ROOT / "policies" / "_compiled.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


_guard = _load_guard()
MANIFEST, PACKAGES, module_path, source_hash = _guard.MANIFEST, _guard.PACKAGES, _guard.module_path, _guard.source_hash

MODULES: tuple[str, ...] = (
    "policies.request",
    "policies.least_loaded",
    "policies.memory",
    "policies.block_manager",
    "policies.plan",
    "policies.running_batch",
    "policies.scheduler",
    "policies.vllm_scheduler",
    "policies.step",
    "policies.iteration_log",
    "policies.request_rows",
    "policies.metrics",
    "policies.per_client",
    "policies.keyed_queue",
    "sim.cost_model",
    "sim.executor",
    "sim.engine",
)
GROUP = "pagesim_kernel"  # the shared library's name: pagesim_kernel__mypyc.<ext suffix>, at the root
C_FLAGS = ["-ffp-contract=off", "-fno-fast-math"]


def build(verbose: bool = False) -> None:
    from mypyc.build import mypycify
    from setuptools import setup

    os.chdir(ROOT)
    clean()
    paths = [str(module_path(m, Path("."))) for m in MODULES]
    # the modules it imports but does not compile are read for their types, their own errors not reported
    options = ["--follow-imports=silent", "--ignore-missing-imports"]
    ext_modules = mypycify([*options, *paths], opt_level="3", group_name=GROUP, target_dir="build/mypyc", verbose=verbose)
    for ext in ext_modules:
        ext.extra_compile_args = [*ext.extra_compile_args, *C_FLAGS]
    setup(name="pagesim-kernel", ext_modules=ext_modules, py_modules=[],
          script_args=["-q", "build_ext", "--inplace", "--build-temp", "build/mypyc-temp"])
    manifest = {"shared_lib": f"{GROUP}__mypyc", "c_flags": C_FLAGS,
                "sources": {m: source_hash(module_path(m)) for m in MODULES}}
    (ROOT / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    print(f"compiled {len(MODULES)} modules: {', '.join(MODULES)}")


def clean() -> None:
    """Remove every extension file in the kernel's packages, the shared library and the manifest."""
    removed = 0
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        for folder in (ROOT, *(ROOT / p for p in PACKAGES)):
            for f in folder.glob(f"*{suffix}"):
                f.unlink()
                removed += 1
    (ROOT / MANIFEST).unlink(missing_ok=True)
    if removed:
        print(f"removed {removed} compiled files")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clean", action="store_true", help="remove the compiled files instead")
    ap.add_argument("--verbose", action="store_true")
    args = ap.parse_args()
    if args.clean:
        clean()
    else:
        build(args.verbose)


if __name__ == "__main__":
    main()
