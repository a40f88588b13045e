"""Which block size? The vLLM paper's Figure 18b: one trace simulated at each block size, the KV
cache's capacity in tokens held fixed.

Two costs pull apart. Small blocks: each decode step reads more blocks, which a profile measured at
several block sizes prices (its decode_blocks term, `pagesim profile --block-sizes`); the roofline
model has no such term, so there small blocks cost nothing extra. Large blocks: a sequence's last
block is partly empty (internal fragmentation), so fewer sequences fit, batches shrink and
preemptions grow.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from analysis.cli_args import add_study_args, sim_config, study_title, study_trace
from analysis.parallel import executor_options, run_tasks
from analysis.report import Columns
from pagesim.argtypes import out_dir, positive_int
from policies.metrics import headline_latency, headline_mean_normalized_latency
from sim.run import SimConfig, build_cost_model, num_blocks_for, run_simulation
from traces import apply_arrivals
from traces.trace import Trace

BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
REFERENCE_DECODE = (16, 512)  # a decode step of 16 sequences of 512 tokens: the cost model's price per block size


def block_size_sweep(trace: Trace, base: SimConfig, block_sizes: Sequence[int] = BLOCK_SIZES,
                     rates: Sequence[float] = (1.0,), kv_tokens: int | None = None,
                     on_row: Callable[[dict], None] | None = None, jobs: int = 1, executor: str = "process",
                     address: str | None = None) -> pd.DataFrame:
    """Simulate `trace` (vllm) at each block size and rate. The cache holds `kv_tokens` tokens at
    every block size (kv_tokens // block_size blocks); without it, what base's model and hardware
    leave for the cache (the same token count at every block size, up to rounding). `jobs` worker
    processes run the simulations, or `executor` "ray" on the Ray cluster at `address` (the same
    table either way)."""
    if kv_tokens is not None and kv_tokens < max(block_sizes):
        raise ValueError(f"kv_tokens: {kv_tokens} holds not one block of {max(block_sizes)} tokens")
    if min(block_sizes) < 1:
        raise ValueError(f"block sizes must be >= 1, got {min(block_sizes)}")
    tasks = []
    for rate in rates:
        timed = apply_arrivals(trace, rate=rate, seed=base.seed)
        tasks += [(dataclasses.replace(base, policy="vllm", block_size=bs,
                                       num_gpu_blocks=kv_tokens // bs if kv_tokens else None), timed, rate)
                  for bs in block_sizes]
    rows = run_tasks(_block_size_run, tasks, jobs, None if on_row is None else (lambda i, r: on_row(r)),
                     executor, address)
    return pd.DataFrame(rows)


def _block_size_run(cfg: SimConfig, timed: Trace, rate: float) -> dict:
    cost = build_cost_model(cfg)
    res = run_simulation(cfg, timed, cost_model=cost)
    s, it = res.summary, res.iterations
    busy = it.duration.sum()
    allocated = it[["kv_token_states", "kv_internal_frag"]].sum(axis=1).clip(lower=1)
    seqs, ctx = REFERENCE_DECODE
    return {"rate": rate, "block_size": cfg.block_size, "num_gpu_blocks": num_blocks_for(cfg)[0],
            "mean_normalized_latency": headline_mean_normalized_latency(s), "ttft_mean": headline_latency(s, "ttft")["mean"],
            "throughput": s["request_throughput"], "preemptions": s["num_preemptions"],
            "rejected": s["num_rejected"], "mean_batched_seqs": s["mean_batched_seqs"],
            # time-averaged share of allocated slots left empty in partly filled blocks
            "internal_frag": float((it.kv_internal_frag / allocated * it.duration).sum() / busy) if busy else 0.0,
            "reference_decode_ms": cost.decode_step_time(seqs, seqs * ctx) * 1e3}


def best_block_sizes(table: pd.DataFrame, tolerance: float = 0.01) -> dict[float, list[int]]:
    """Per rate, the block sizes whose mean normalized latency is within `tolerance` (relative) of
    the lowest: differences smaller than that are not worth naming a winner for."""
    out = {}
    for rate, g in table.groupby("rate", sort=False):
        best = g.mean_normalized_latency.min()
        out[float(rate)] = [int(b) for b in g.block_size[g.mean_normalized_latency <= best * (1 + tolerance)]]
    return out


def block_size_plot(table: pd.DataFrame, path: str | Path, title: str = "") -> Path:
    """Left: mean normalized latency against block size, one line per rate; right: what moves it,
    internal fragmentation and the cost model's price of a reference decode step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for rate, g in table.groupby("rate", sort=False):
        best = g.mean_normalized_latency.min()
        ax.plot(g.block_size, g.mean_normalized_latency / best, marker="o",
                label=f"{rate:g} req/s (best {best:.3g} s/token)")
    ax.set_xlabel("block size (tokens)")
    ax.set_ylabel("mean normalized latency / the best block size's")
    ax.grid(alpha=0.3)
    ax.legend()
    first = table[table.rate == table.rate.iloc[0]]
    ax2.plot(first.block_size, 100 * first.internal_frag, marker="o", color="#c44e52", label="internal fragmentation")
    sizes = sorted(table.block_size.unique())
    for a in (ax, ax2):
        a.set_xscale("log", base=2)
        a.set_xticks(sizes, [str(b) for b in sizes])
    ax2.set_xlabel("block size (tokens)")
    ax2.set_ylabel("allocated KV slots empty (%)", color="#c44e52")
    ax3 = ax2.twinx()
    ax3.plot(first.block_size, first.reference_decode_ms, marker="s", color="#4c72b0")
    ax3.set_ylabel(f"decode step, {REFERENCE_DECODE[0]} seqs x {REFERENCE_DECODE[1]} tokens (ms)", color="#4c72b0")
    ax2.set_title(f"at {first.rate.iloc[0]:g} req/s")
    ax2.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)


# ---- the command: `pagesim block-size` ----

def add_parser(sub: argparse._SubParsersAction) -> None:
    bsz = sub.add_parser("block-size", help="one trace at each block size, the KV capacity held fixed (simulated)",
                         description="The vLLM paper's Figure 18b: mean normalized latency against block size at "
                                     "one or more rates, with what moves it (internal fragmentation, decode time per "
                                     "sequence). Writes block_size.csv and block_size.png to --out. Small blocks cost "
                                     "more only under a profile measured at several block sizes "
                                     "(`pagesim profile --block-sizes`).")
    add_study_args(bsz, "sharegpt-like", [2.0])
    bsz.add_argument("--block-sizes", type=positive_int, nargs="+", default=list(BLOCK_SIZES))
    bsz.add_argument("--kv-tokens", type=positive_int, help="KV cache capacity in tokens at every block size (needed with "
                                                   "--profile; default: what --model leaves on --hardware)")
    bsz.add_argument("--preemption", choices=("recompute", "swap"), default="recompute")
    bsz.add_argument("--out", type=out_dir, required=True)
    bsz.set_defaults(func=command)


@dataclass
class BlockSizeStudy:
    """A block-size study as its arguments define it: the trace and the configuration every run
    starts from (each run sets its own block size and the cache's blocks)."""

    trace: Trace
    base: SimConfig


@dataclass
class BlockSizeTables:
    study: BlockSizeStudy
    table: pd.DataFrame  # one row per (rate, block size)


def prepare(args: argparse.Namespace) -> BlockSizeStudy:
    if args.num_gpu_blocks is not None:
        raise ValueError("--num-gpu-blocks: a block-size study holds the capacity in tokens; use --kv-tokens")
    if args.profile and not args.kv_tokens:
        raise ValueError("--kv-tokens: a profiled study needs the KV capacity in tokens (a profile does not say it)")
    trace = study_trace(args)
    return BlockSizeStudy(trace, sim_config(args))


def run(args: argparse.Namespace, study: BlockSizeStudy | None = None,
        on_row: Callable[[dict], None] | None = None) -> BlockSizeTables:
    """The block-size table; `on_row(row)` as each run finishes."""
    study = study or prepare(args)
    table = block_size_sweep(study.trace, study.base, args.block_sizes, args.rates, args.kv_tokens, on_row=on_row,
                             jobs=args.jobs, **executor_options(args))
    return BlockSizeTables(study, table)


def command(args: argparse.Namespace) -> int:
    study = prepare(args)
    print_header(args, study)
    write_report(args, run(args, study, on_row=print_row))
    return 0


def print_header(args: argparse.Namespace, study: BlockSizeStudy) -> None:
    print(f"block size: {len(study.trace)} requests of {study.trace.name}, {study_title(args)}, "
          + (f"{args.kv_tokens:,} KV tokens" if args.kv_tokens else "KV capacity from the hardware spec"))
    print(COLUMNS.header())


COLUMNS = Columns(("rate", "rate", ">6g"), ("block", "block_size", ">6"), ("blocks", "num_gpu_blocks", ">8,"),
                  ("norm lat", "mean_normalized_latency", ">9.4f"), ("req/s", "throughput", ">7.3f"),
                  ("preempt", "preemptions", ">8"), ("batch", "mean_batched_seqs", ">6.1f"),
                  ("frag", "internal_frag", ">6.1%"), ("ref ms", "reference_decode_ms", ">7.2f"))


def print_row(r: dict) -> None:
    print(COLUMNS.row(r), flush=True)


def write_report(args: argparse.Namespace, result: BlockSizeTables) -> None:
    """block_size.csv, block_size.png, and the best block sizes per rate."""
    table = result.table
    print("ref ms: the cost model's decode step of 16 sequences of 512 tokens at that block size")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    table.to_csv(out / "block_size.csv", index=False)
    block_size_plot(table, out / "block_size.png", f"{result.study.trace.name}, {study_title(args)}")
    print("within 1% of the lowest mean normalized latency: "
          + "; ".join(f"{r:g} req/s: block size {', '.join(map(str, bs))}" for r, bs in best_block_sizes(table).items()))
    print(f"wrote {out}/block_size.csv, block_size.png")
