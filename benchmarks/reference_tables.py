"""The tables of a fixed set of reference configurations, hashed: a change to the simulator core
must leave every hash equal (issue 23), and skip-ahead must equal stepping on each.

Each configuration runs `python -m pagesim simulate ... --out DIR` in its own process; its hashes
are the sha256 of requests.csv (bytes), of iterations.parquet's table as read (schema and rows, so
that how the rows are grouped in the file does not count) and of summary.json less the fields that
describe how the run went rather than what it simulated (`wall_time_s`; `engine`, the counts of
stepped and skipped iterations; `config.fast_forward`). With `--check-stepping` each configuration
also runs with `--no-skip-ahead`, whose hashes must be the same.

    python -m benchmarks.reference_tables [--check-stepping] [--only NAME ...] [--record]

Prints one line per configuration and exits 1 when a hash differs from RECORDED (or stepping
differs from skip-ahead). `--record` prints RECORDED's new text instead of comparing.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path

# name -> the simulate command's arguments (--out is added)
CONFIGS: dict[str, list[str]] = {
    "vllm": ["--num-requests", "1500", "--rate", "20"],
    "sjf": ["--num-requests", "1500", "--rate", "20", "--policy", "sjf"],
    "vtc": ["--trace", "multi-client", "--num-requests", "1500", "--rate", "20", "--policy", "vtc"],
    "swap": ["--num-requests", "1500", "--rate", "20", "--preemption", "swap"],
    "chunked-prefix": ["--trace", "shared-prefix", "--num-requests", "1500", "--rate", "20",
                       "--chunked-prefill", "--prefix-caching"],
    "least-loaded-4": ["--num-requests", "3000", "--rate", "80", "--replicas", "4", "--router", "least-loaded"],
    "least-loaded-16": ["--num-requests", "6000", "--rate", "320", "--replicas", "16", "--router", "least-loaded"],
    "cache-aware-4": ["--trace", "shared-prefix", "--num-requests", "2000", "--rate", "60", "--replicas", "4",
                      "--router", "cache-aware", "--prefix-caching"],
    "n3": ["--num-requests", "600", "--rate", "10", "--n", "3"],
    "beam3": ["--num-requests", "400", "--rate", "8", "--beam-width", "3"],
}

# name -> (requests.csv, iterations.parquet, summary.json) sha256 prefixes, recorded at 10f4587 and again on
# main before the frontdoor and core23 merges: requests.csv gained requested_output_len, and vtc's summary
# the fairness measured over competing clients; iterations are unchanged. Summaries recorded again after
# b82ab74 (goodput and slo_attainment null when no SLO applies: none of these runs has one), the same on
# main at 1eaeb15 and on frontdoor. chunked-prefix and cache-aware-4 (prefix caching, recompute preemption)
# recorded again for issue 26: output blocks are hashed, so a readmitted sequence hits its own output blocks
RECORDED: dict[str, tuple[str, str, str]] = {
    "vllm": ("dd2d7ddd61b6b483", "cadd20579c15c963", "981897696289f5ed"),
    "sjf": ("276431f7d650776b", "dcd708c546abe2de", "25ddbf3692908cb0"),
    "vtc": ("297921dfa104824c", "e638e02aeb2b646a", "dc0f6b8fe26f2617"),
    "swap": ("be6454ae7563f58e", "7fa052573ec16a21", "b389f7a610dc5d19"),
    "chunked-prefix": ("696540f29592778c", "f8bb4458b0599bc6", "ec0f4f79b1c01fea"),
    "least-loaded-4": ("9074e4b250226b93", "17e0fd9eff5d17c9", "db0729fa6def29a1"),
    "least-loaded-16": ("7630081738de15c7", "68e506ff5c990eec", "9cbc2376056fba0b"),
    "cache-aware-4": ("d33f6c1b00b1ebd9", "6884ebd2e6d0a89a", "3127cd3838e12944"),
    "n3": ("06c324ca121310b0", "01378f40c903ed3e", "6c6c2d8c97400633"),
    "beam3": ("187e6caab654d2da", "698a2daaec3eda11", "8e2c996383dfae96"),
}

RUN_FIELDS = ("wall_time_s", "engine")


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def table_hashes(out: Path) -> tuple[str, str, str]:
    """The run's three hashes (see the module docstring)."""
    import pyarrow.parquet as pq  # deferred: pyarrow is heavy and only this function reads parquet

    requests = _sha((out / "requests.csv").read_bytes())
    table = pq.read_table(out / "iterations.parquet")
    rows = table.to_pandas().to_csv(index=False, float_format=repr).encode()
    iterations = _sha(str(table.schema).encode() + b"\n" + rows)
    summary = json.loads((out / "summary.json").read_text())
    for field in RUN_FIELDS:
        summary.pop(field, None)
    summary.get("config", {}).pop("fast_forward", None)
    return requests, iterations, _sha(json.dumps(summary, sort_keys=True).encode())


def run_config(args: list[str], out: Path, skip_ahead: bool = True) -> tuple[str, str, str]:
    cmd = [sys.executable, "-m", "pagesim", "simulate", *args, "--out", str(out), "--quiet"]
    if not skip_ahead:
        cmd.append("--no-skip-ahead")
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return table_hashes(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check-stepping", action="store_true", help="also run each with --no-skip-ahead")
    ap.add_argument("--only", nargs="+", choices=sorted(CONFIGS), help="these configurations only")
    ap.add_argument("--record", action="store_true", help="print RECORDED's text instead of comparing")
    args = ap.parse_args(argv)
    failed = False
    recorded = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.only or CONFIGS:
            got = run_config(CONFIGS[name], Path(tmp) / name)
            verdict = "recorded" if args.record else "ok" if RECORDED.get(name) == got else "DIFFERS"
            if args.check_stepping:
                stepped = run_config(CONFIGS[name], Path(tmp) / f"{name}-step", skip_ahead=False)
                if stepped != got:
                    verdict += f", STEPPING DIFFERS {' '.join(stepped)}"
            failed |= "DIFFER" in verdict
            recorded.append(f'    "{name}": ("{got[0]}", "{got[1]}", "{got[2]}"),')
            print(f"{name:<16} {' '.join(got)}  {verdict}", flush=True)
    if args.record:
        print("\n".join(recorded))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
