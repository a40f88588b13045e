"""Recompute or swap? The vLLM paper's Figure 19, from the roofline model and the simulator.

Microbenchmark (its 19a): the time to swap a sequence's KV out and back in over PCIe against the
time to recompute it (a prefill of the same tokens), per block size. Swapping moves the same bytes
at any block size, but vLLM copies each block with one call per layer for keys and one for values,
so small blocks pay many call latencies; recomputing does not depend on the block size.

End to end (its 19b): the same trace simulated with preemption by swapping and by recomputation at
each block size, mean normalized latency (s/token) for each.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from analysis.cli_args import check_workload_size, sim_config
from analysis.report import Columns
from pagesim.argtypes import non_negative_int, out_dir, positive_int, rate, seed
from policies.metrics import headline_mean_normalized_latency
from policies.plan import StepComposition
from sim.cost_model import RooflineCostModel
from sim.run import SimConfig, run_simulation
from traces.trace import Trace

BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
COLORS = {"swap": "#dd8452", "recompute": "#4c72b0"}


def microbenchmark(model: RooflineCostModel, block_sizes: Sequence[int] = BLOCK_SIZES,
                   tokens: int = 1024) -> pd.DataFrame:
    """Per block size: milliseconds to swap `tokens` tokens out, in, and both; to recompute them
    (the prefill work alone: linears, attention and LM head, not the fixed per-iteration overhead,
    which the iteration pays either way); and which is cheaper."""
    if tokens < 1:
        raise ValueError(f"tokens: must be >= 1, got {tokens}")
    work = model.breakdown(StepComposition(num_prefill_seqs=1, prefill_tokens=tokens,
                                           prefill_attn_pairs=tokens * (tokens + 1) // 2))
    recompute = sum(v for k, v in work.items() if k != "overhead") * 1e3
    rows = []
    for bs in block_sizes:
        if bs < 1:
            raise ValueError(f"block sizes must be >= 1, got {bs}")
        one_way = model.swap_time(-(-tokens // bs), bs) * 1e3
        rows.append({"block_size": bs, "swap_out_ms": one_way, "swap_in_ms": one_way, "swap_ms": 2 * one_way,
                     "recompute_ms": recompute, "cheaper": "swap" if 2 * one_way < recompute else "recompute"})
    return pd.DataFrame(rows)


def end_to_end(trace: Trace, base: SimConfig, block_sizes: Sequence[int] = BLOCK_SIZES,
               on_row: Callable[[dict], None] | None = None) -> pd.DataFrame:
    """Simulate `trace` under vllm with preemption by swap and by recompute at each block size."""
    rows = []
    for bs in block_sizes:
        for mode in ("recompute", "swap"):
            cfg = dataclasses.replace(base, policy="vllm", block_size=bs, preemption=mode)
            s = run_simulation(cfg, trace).summary
            row = {"block_size": bs, "preemption": mode, "mean_normalized_latency": headline_mean_normalized_latency(s),
                   "preemptions": s["num_preemptions"], "throughput": s["request_throughput"],
                   "finished": s["num_finished"], "rejected": s["num_rejected"]}
            rows.append(row)
            if on_row is not None:
                on_row(row)
    return pd.DataFrame(rows)


def crossover(micro: pd.DataFrame) -> int | None:
    """The smallest block size from which swapping is cheaper than recomputing at every larger one."""
    cheaper = micro.sort_values("block_size")
    best = None
    for bs, c in zip(cheaper.block_size[::-1], cheaper.cheaper[::-1]):
        if c != "swap":
            break
        best = int(bs)
    return best


def preemption_plot(micro: pd.DataFrame, e2e: pd.DataFrame | None, path: str | Path, title: str = "") -> Path:
    """Left: swap and recompute time against block size; right (when simulated): mean normalized
    latency with each preemption mode against block size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = 2 if e2e is not None and len(e2e) else 1
    fig, axes = plt.subplots(1, panels, figsize=(5.5 * panels, 4), squeeze=False)
    ax = axes[0][0]
    ax.plot(micro.block_size, micro.swap_ms, marker="o", color=COLORS["swap"], label="swap out + in")
    ax.plot(micro.block_size, micro.recompute_ms, marker="s", color=COLORS["recompute"], label="recompute")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("block size (tokens)")
    ax.set_ylabel("time (ms)")
    ax.set_title("microbenchmark", fontsize=10)
    ax.legend()
    ax.grid(alpha=0.3, which="both")
    if panels == 2:
        ax = axes[0][1]
        for mode, g in e2e.groupby("preemption", sort=False):
            ax.plot(g.block_size, g.mean_normalized_latency, marker="o", color=COLORS[mode], label=mode)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("block size (tokens)")
        ax.set_ylabel("mean normalized latency (s/token)")
        ax.set_title("end to end (simulated)", fontsize=10)
        ax.legend()
        ax.grid(alpha=0.3)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)


# ---- the command: `pagesim preemption` ----

def add_parser(sub: argparse._SubParsersAction) -> None:
    from traces.loaders import KNOWN_FORMATS
    pre = sub.add_parser("preemption", help="recompute or swap: cost per block size, and end to end (simulated)",
                         description="The vLLM paper's Figure 19: swap vs recompute time per block size from the "
                                     "roofline model, then one trace simulated with each preemption mode at each "
                                     "block size. Writes preemption_micro.csv, preemption_e2e.csv and "
                                     "preemption.png to --out.")
    pre.add_argument("--model", default="opt-13b")
    pre.add_argument("--hardware", default="a100-40gb")
    pre.add_argument("--block-sizes", type=positive_int, nargs="+", default=list(BLOCK_SIZES))
    pre.add_argument("--tokens", type=positive_int, default=1024, help="tokens swapped or recomputed (default 1024)")
    pre.add_argument("--trace", default="sharegpt-like")
    pre.add_argument("--trace-format", choices=KNOWN_FORMATS)
    pre.add_argument("--num-requests", type=non_negative_int, default=1000, help="requests simulated (0: microbenchmark only)")
    pre.add_argument("--rate", type=rate, default=2.0, help="request rate, req/s (default 2)")
    pre.add_argument("--seed", type=seed, default=0)
    pre.add_argument("--out", type=out_dir, required=True)
    pre.set_defaults(func=command)


@dataclass
class PreemptionTables:
    micro: pd.DataFrame               # swap vs recompute time per block size (roofline)
    e2e: pd.DataFrame | None = None   # the trace under each mode at each block size (None: --num-requests 0)
    trace: Trace | None = None


def run(args: argparse.Namespace, on_micro: Callable[[pd.DataFrame], None] | None = None,
        on_trace: Callable[[Trace], None] | None = None,
        on_row: Callable[[dict], None] | None = None) -> PreemptionTables:
    """The microbenchmark, then (with --num-requests) the end-to-end table. `on_micro(table)` when
    the microbenchmark is done, `on_trace(trace)` before the simulations, `on_row(row)` after each."""
    from sim.specs import get_hardware, get_model

    check_workload_size(args.trace, args.num_requests)  # before the microbenchmark writes anything
    micro = microbenchmark(RooflineCostModel(get_model(args.model), get_hardware(args.hardware)), args.block_sizes,
                           args.tokens)
    if on_micro is not None:
        on_micro(micro)
    if not args.num_requests:
        return PreemptionTables(micro)
    from traces import resolve_trace
    trace = resolve_trace(args.trace, num_requests=args.num_requests, rate=args.rate, seed=args.seed,
                          format=args.trace_format)
    if on_trace is not None:
        on_trace(trace)
    return PreemptionTables(micro, end_to_end(trace, sim_config(args), args.block_sizes, on_row=on_row), trace)


def command(args: argparse.Namespace) -> int:
    write_report(args, run(args, on_micro=lambda micro: write_micro(args, micro),
                           on_trace=lambda trace: print_e2e_header(args, trace), on_row=print_row))
    return 0


def write_micro(args: argparse.Namespace, micro: pd.DataFrame) -> None:
    """preemption_micro.csv (written before the simulations start) and its printed table."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    micro.to_csv(out / "preemption_micro.csv", index=False)
    print(f"swap out + in vs recompute of {args.tokens} tokens, {args.model} on {args.hardware} (roofline)")
    print(f"{'block size':>10} {'swap ms':>9} {'recompute ms':>13} {'cheaper':>10}")
    for r in micro.itertuples():
        print(f"{r.block_size:>10} {r.swap_ms:>9.2f} {r.recompute_ms:>13.2f} {r.cheaper:>10}")
    cross = crossover(micro)
    print(f"swapping is cheaper from block size {cross}" if cross else "recomputing is cheaper at every block size")


def print_e2e_header(args: argparse.Namespace, trace: Trace) -> None:
    print(f"\nend to end: {len(trace)} requests of {trace.name} at {args.rate:g} req/s, vllm")
    print(COLUMNS.header())


COLUMNS = Columns(("block size", "block_size", ">10"), ("preemption", "preemption", ">11"),
                  ("norm lat", "mean_normalized_latency", ">9.4f"), ("preempted", "preemptions", ">10"))


def print_row(r: dict) -> None:
    print(COLUMNS.row(r), flush=True)


def write_report(args: argparse.Namespace, result: PreemptionTables) -> None:
    """preemption_e2e.csv (with --num-requests), preemption.png, and the closing line."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if result.e2e is not None:
        result.e2e.to_csv(out / "preemption_e2e.csv", index=False)
    preemption_plot(result.micro, result.e2e, out / "preemption.png", f"{args.model} on {args.hardware}")
    print(f"wrote {out}/preemption_micro.csv" + (", preemption_e2e.csv" if result.e2e is not None else "")
          + ", preemption.png")
