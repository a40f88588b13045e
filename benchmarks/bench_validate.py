"""Simulator vs live: the calibration loop's last step, measured (`pagesim validate` per scenario).

SmolLM2-135M on this machine's CPU, vllm policy; the simulator prices iterations with a profiled
cost model (default: the shipped `smollm2-135m-cpu` profile, or --profile PATH from `pagesim
profile` on this machine). Each scenario replays one trace live in real time and in simulation:
32 requests with the project's ShareGPT-fitted lengths at a quarter size (to fit a CPU), Poisson
arrivals. Scenarios: light load, heavy load (queueing), heavy load with a small KV cache
(preemption by recompute). Error = (sim - live) / live on mean and P90 of TTFT, TPOT and
end-to-end latency, and on throughput. With --repeat, each trace is served live a second time and
the two live runs are compared the same way: the run-to-run spread of live measurements on this
machine, the floor under any simulator's error. "speed-adjusted" simulates again with every step
scaled by the machine speed measured around the live run (the factor is printed beside it): a
sensitivity check, not a correction, as the speed can move during the run.

Each scenario runs `pagesim validate` as a user would: it measures this machine's speed against the
profile first and, when more than --reprofile-threshold (0.1) away, re-times the profile's grid here,
re-fits it and simulates with that (--no-reprofile: the profile as given). The rows "given profile"
show the error the given profile would have had, "re-profile" the measured speed and the seconds it
took. With --profile-first, the model is profiled on this machine right before the scenarios (about
2 minutes) and that profile is used.

    python -m benchmarks.bench_validate [--profile NAME|PATH | --profile-first] [--requests 32] [--repeat]
                                        [--no-reprofile | --reprofile-threshold F] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np
import pandas as pd

SCENARIOS = (  # (name, rate req/s, KV blocks)
    ("light", 0.5, 512),
    ("heavy", 3.0, 512),
    ("preempting", 3.0, 64),
)


def write_trace(path: Path, n: int, rate: float, seed: int = 0) -> Path:
    """sharegpt-like lengths / 4 (at least 4 tokens), Poisson arrivals at `rate`, as a CSV trace."""
    from traces import resolve_trace

    t = resolve_trace("sharegpt-like", num_requests=n, rate=rate, seed=seed)
    df = pd.DataFrame({"arrived_at": np.round(t.arrival, 6), "num_prefill_tokens": np.maximum(t.prompt_len // 4, 4),
                       "num_decode_tokens": np.maximum(t.output_len // 4, 4)})
    df.to_csv(path, index=False)
    return path


def run_scenario(name: str, rate: float, blocks: int, n: int, profile: str, out: Path, repeat: bool = False,
                 model: str = "smollm2-135m", device: str = "cpu", reprofile: tuple[str, ...] = ()) -> dict:
    from analysis.validate import compare_runs, validation_summary
    from pagesim.cli import main as cli_main

    out.mkdir(parents=True, exist_ok=True)
    trace = write_trace(out / "trace.csv", n, rate)
    where = ["--model", model, "--device", device, "--num-gpu-blocks", str(blocks)]
    code = cli_main(["validate", "--profile", profile, "--trace", str(trace), *where, *reprofile, "--out", str(out),
                     "--quiet"])
    if code != 0:
        raise RuntimeError(f"pagesim validate failed for scenario {name}")
    table = pd.read_csv(out / "validation.csv")
    live = json.loads((out / "live" / "summary.json").read_text())
    sim = json.loads((out / "sim" / "summary.json").read_text())
    result = {"scenario": name, "rate": rate, "blocks": blocks, "table": table,
              "summary": json.loads((out / "validation.json").read_text()),
              "preemptions": (live["num_preemptions"], sim["num_preemptions"]),
              "iterations": (live["num_iterations"], sim["num_iterations"])}
    if repeat:
        if cli_main(["live", "--trace", str(trace), *where, "--out", str(out / "live2"), "--quiet"]) != 0:
            raise RuntimeError(f"the repeated live run failed for scenario {name}")
        again = compare_runs(pd.read_csv(out / "live" / "requests.csv"), pd.read_csv(out / "live2" / "requests.csv"))
        result["repeat"] = validation_summary(again)
    return result


def print_results(results: list[dict]) -> None:
    rows = results[0]["table"][["metric", "statistic"]].itertuples(index=False)
    keys = [f"{m} {s}" if s != "value" else m for m, s in rows]
    head = f"{'metric':<28}" + "".join(f"{r['scenario'] + ' live':>16}{'sim':>10}{'err':>8}" for r in results)
    print(head)
    for i, key in enumerate(keys):
        line = f"{key:<28}"
        for r in results:
            row = r["table"].iloc[i]
            line += f"{row.live:>16.3f}{row.sim:>10.3f}{row.error:>+8.1%}"
        print(line)
    for label, field in (("preemptions", "preemptions"), ("iterations", "iterations")):
        print(f"{label:<28}" + "".join(f"{r[field][0]:>16}{r[field][1]:>10}{'':>8}" for r in results))
    print(f"{'mean |error|':<28}" + "".join(f"{'':>16}{'':>10}{r['summary']['mape']:>8.1%}" for r in results))
    print(f"{'max |error|':<28}" + "".join(f"{'':>16}{'':>10}{r['summary']['max_abs_error']:>8.1%}" for r in results))
    if all("step_time" in r["summary"] for r in results):
        print(f"{'step time |error|, decode':<28}"
              + "".join(f"{'':>16}{'':>10}{r['summary']['step_time']['decode_mape']:>8.1%}" for r in results))
        print(f"{'step time |error|, prompt':<28}"
              + "".join(f"{'':>16}{'':>10}{r['summary']['step_time']['prompt_mape']:>8.1%}" for r in results))
    if all(r["summary"].get("machine_speed") for r in results):
        print(f"{'machine speed before/after':<28}" + "".join(
            f"{'':>16}{r['summary']['machine_speed']['before']:>10.2f}{r['summary']['machine_speed']['after']:>8.2f}"
            for r in results))
    if all(r["summary"].get("speed_adjusted") for r in results):
        print(f"{'speed-adjusted mean |error|':<28}" + "".join(
            f"{'':>16}{r['summary']['speed_adjusted']['factor']:>10.3f}{r['summary']['speed_adjusted']['mape']:>8.1%}"
            for r in results))
    if any(r["summary"].get("given_profile_validation") for r in results):
        print(f"{'given profile: mean |error|':<28}" + "".join(
            f"{'':>16}{'':>10}" + (f"{g['mape']:>8.1%}" if (g := r["summary"].get("given_profile_validation"))
                                  else f"{'-':>8}") for r in results))
    if all(r["summary"].get("reprofile") for r in results):
        print(f"{'re-profile: speed, seconds':<28}" + "".join(
            f"{'':>16}{_number(r['summary']['reprofile']['speed'], '.2f'):>10}"
            f"{_number(r['summary']['reprofile']['seconds'] if r['summary']['reprofile']['reprofiled'] else None, '.0f'):>8}"
            for r in results))
    if all("repeat" in r for r in results):
        print(f"{'live repeat: mean |error|':<28}"
              + "".join(f"{'':>16}{'':>10}{r['repeat']['mape']:>8.1%}" for r in results))
        print(f"{'live repeat: max |error|':<28}"
              + "".join(f"{'':>16}{'':>10}{r['repeat']['max_abs_error']:>8.1%}" for r in results))


def _number(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default="smollm2-135m-cpu")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--model", default="smollm2-135m",
                    help="smollm2-135m (real weights), or a config.json named after a simulator model spec "
                         "(random weights; e.g. smollm2-135m.json)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--scenarios", nargs="+", default=[s[0] for s in SCENARIOS])
    ap.add_argument("--profile-first", action="store_true", help="profile the model here first and use that")
    ap.add_argument("--repeat", action="store_true", help="serve each trace live twice and compare the two")
    ap.add_argument("--no-reprofile", action="store_true", help="validate with the profile as given")
    ap.add_argument("--reprofile-threshold", type=float, default=0.1,
                    help="re-profile when the machine runs more than this far from the profile (default 0.1)")
    ap.add_argument("--out", help="keep the runs here (default: a temporary directory)")
    args = ap.parse_args(argv)
    reprofile = ("--no-reprofile",) if args.no_reprofile else ("--reprofile-threshold", str(args.reprofile_threshold))
    if args.model == "smollm2-135m":
        try:
            from backend.weights import smollm2_gguf_path
            smollm2_gguf_path()
        except (ImportError, FileNotFoundError) as exc:
            print(f"skipped: SmolLM2 is not available ({exc})")
            return []
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.out or tmp)
        if args.profile_first:
            from pagesim.cli import main as cli_main
            args.profile = str(root / "profile.json")
            if cli_main(["profile", "--model", args.model, "--device", args.device, "--out", args.profile,
                         "--quiet"]) != 0:
                raise RuntimeError("pagesim profile failed")
        for name, rate, blocks in SCENARIOS:
            if name in args.scenarios:
                results.append(run_scenario(name, rate, blocks, args.requests, args.profile, root / name,
                                            args.repeat, args.model, args.device, reprofile))
    print(f"\nsimulated vs live, {args.model} on {args.device}, {args.requests} requests (sharegpt-like / 4), "
          f"vllm, profile {args.profile}; err = (sim - live) / live")
    print_results(results)
    return results


if __name__ == "__main__":
    main()
