"""`make bench`: every benchmark, one table each, ratios measured side by side in one run."""

from __future__ import annotations

import importlib
import sys
import time

BENCHMARKS = ("bench_policies", "bench_sim", "bench_ray", "bench_attention", "bench_live", "bench_validate")


def main() -> int:
    failed = []
    for name in BENCHMARKS:
        try:
            mod = importlib.import_module(f"benchmarks.{name}")
        except ModuleNotFoundError as exc:
            print(f"== {name}: skipped ({exc})\n")
            continue
        print(f"== {name}")
        t0 = time.perf_counter()
        try:
            mod.main([]) if mod.main.__code__.co_argcount else mod.main()
        except Exception as exc:  # report and go on: one broken benchmark should not hide the others
            failed.append(name)
            print(f"!! {name} failed: {exc!r}")
        print(f"   ({time.perf_counter() - t0:.0f} s)\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
