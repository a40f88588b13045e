"""The command-line arguments the `pagesim` commands share, and what they build: the one SimConfig,
the workload, the live replay options.

Every command module (pagesim/commands/*.py and pagesim/*.py) adds its arguments with these
groups, so a flag means the same thing, with the same default and help, wherever it appears. The
studies below (analysis/) never see an argparse namespace: a command turns its arguments into the
study's configuration here or in its own module.

`sim_config(args)` is the only place a SimConfig is built from arguments: each SimConfig field a
command has an argument of the same name for takes that argument's value, so a command's
configuration is what its flags say, and a study fixes its own choices as keyword overrides.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from analysis.bench_settings import server_options
from analysis.measurement_formats import read_settings
from analysis.parallel import EXECUTORS, Workers
from analysis.seeds import seed_workloads
from pagesim.argtypes import (
    non_negative_float,
    non_negative_int,
    out_dir,
    positive_float,
    positive_int,
    rate,
    seed,
)
from policies.limits import REQUEST_BYTES, check_fits
from policies.registry import POLICIES, parse_policy_args, resolve_policy
from policies.replica_config import ReplicaConfig
from policies.router import MATCH_ROUTERS, ROUTERS, resolve_router
from sim.run import SimConfig
from traces import resolve_trace
from traces.loaders import KNOWN_FORMATS
from traces.trace import Trace
from traces.workloads import SYNTHETIC


def add_workload_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--trace", default="sharegpt-like",
                   help=f"a trace file, or a synthetic workload: {', '.join(SYNTHETIC)} (default: sharegpt-like)")
    g.add_argument("--trace-format", choices=KNOWN_FORMATS, help="file format (default: detect from columns)")
    g.add_argument("--num-requests", type=positive_int, help="use the first N requests (synthetic default: 1000)")
    g.add_argument("--rate", type=rate, help="mean arrival rate, req/s (Poisson; rescales a timestamped trace; "
                                             "a synthetic workload without it: 1)")
    g.add_argument("--burstiness", type=non_negative_float,
                   help="inter-arrival coefficient of variation (Gamma arrivals; 1 = Poisson, 0 = constant, evenly "
                        "spaced at 1/rate)")
    g.add_argument("--n", type=positive_int, help="parallel samples per request (overrides the trace)")
    g.add_argument("--beam-width", type=positive_int, help="beam width per request (overrides the trace)")
    g.add_argument("--seed", type=seed, default=0, help="seed for every random choice (default 0)")


def add_policy_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("policy")
    g.add_argument("--policy", default="vllm", type=policy_name,
                   help=f"scheduling policy: {', '.join(POLICIES)}, a class as package.module:Class (a "
                        "policies.queue_policy.QueuePolicy or a Scheduler), or a 'pagesim.policies' entry point "
                        "(default vllm)")
    g.add_argument("--policy-arg", action="append", metavar="KEY=VALUE", dest="policy_args",
                   help="a keyword option of the policy class (repeatable), e.g. --policy sjf --policy-arg aging=2")
    g.add_argument("--block-size", type=positive_int, default=16, help="KV block size in tokens (default 16)")
    g.add_argument("--preemption", choices=("recompute", "swap"), default="recompute")
    g.add_argument("--max-num-seqs", type=positive_int, default=256)
    g.add_argument("--max-num-batched-tokens", type=positive_int, default=4096)
    g.add_argument("--chunked-prefill", action="store_true")
    g.add_argument("--prefix-caching", action="store_true")


def policy_name(text: str) -> str:
    """A policy argument that resolves (registry name, module:Class, entry point), checked up front."""
    return _resolving(resolve_policy, text)


def policy_options(args: argparse.Namespace) -> dict:
    """The policy class's keyword options from --policy-arg KEY=VALUE."""
    return parse_policy_args(getattr(args, "policy_args", None))


def router_name(text: str) -> str:
    """A --router value: a registry name, package.module:Class, or a 'pagesim.routers' entry point
    that resolves to a Router class (checked at parse time, before any simulation)."""
    return _resolving(resolve_router, text)


def _resolving(resolve: Callable[[str], object], text: str) -> str:
    """`text` when `resolve(text)` accepts it, else its ValueError as argparse's one-line error."""
    try:
        resolve(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def add_replica_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("replicas (simulation only)")
    g.add_argument("--replicas", type=positive_int, default=1, help="model replicas, each with its own KV cache (default 1)")
    g.add_argument("--router", default="round-robin", metavar="ROUTER", type=router_name,
                   help=f"how arrivals are spread over replicas: {', '.join(ROUTERS)} (default round-robin), "
                        "or one's own Router subclass as package.module:Class or a 'pagesim.routers' entry point")
    g.add_argument("--router-arg", action="append", metavar="KEY=VALUE", dest="router_args",
                   help="a keyword option of the router class (repeatable), e.g. --router-arg max_imbalance=4")
    g.add_argument("--replica-hardware", nargs="+", metavar="GPU",
                   help="each replica's GPU spec, e.g. a100-80gb a100-80gb h100-sxm (sets --replicas; roofline only)")
    g.add_argument("--dp", type=positive_int, default=1, metavar="N",
                   help="vLLM data parallelism (--data-parallel-size): N ranks of one server, each with its own "
                        "requests and KV cache, fed by vLLM's balancer (fewest waiting*4 + running); an MoE model's "
                        "ranks step in lockstep, its MoE layers shared over all ranks (default 1)")
    g.add_argument("--ep", action="store_true",
                   help="expert parallelism (--enable-expert-parallel): an MoE model's experts spread whole over "
                        "dp x tp GPUs (without it, each expert is sharded over them)")
    g.add_argument("--disaggregate", type=positive_int, nargs=2, metavar=("PREFILL", "DECODE"),
                   help="disaggregated serving: PREFILL replicas compute prompts and first tokens, the KV moves to "
                        "DECODE replicas (policy vllm)")
    g.add_argument("--transfer-bandwidth", type=gigabytes_per_s, metavar="GB/S",
                   help="with --disaggregate: the prefill -> decode KV link, GB/s (default: the NVLink bandwidth)")
    g.add_argument("--max-imbalance", type=non_negative_int,
                   help="prefix-affinity, cache-aware: the most outstanding requests a matched replica may hold "
                        "above the least loaded (default 8)")


def gigabytes_per_s(text: str) -> float:
    """A bandwidth argument given in GB/s, as bytes/s."""
    try:
        return positive_float(text) * 1e9
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"must be > 0 GB/s, got {text}") from None


def add_device_args(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--attention", help="attention backend: torch-compiled (the CPU default: decode compiled by "
                                      "torch.compile), torch (eager), triton (the CUDA default); also "
                                      "PAGESIM_ATTENTION")


def add_live_model_args(p: argparse.ArgumentParser) -> None:
    m = p.add_argument_group("model")
    m.add_argument("--model", default="smollm2-135m",
                   help="smollm2-135m (real weights), a HF directory, a config.json, a catalogue name or a HF id in "
                        "--models-dir (random weights)")
    add_device_args(m)
    m.add_argument("--num-gpu-blocks", type=positive_int, default=512, help="KV cache size in blocks (default 512)")
    m.add_argument("--num-cpu-blocks", type=non_negative_int, default=512, help="CPU swap space in blocks (default 512)")


def add_study_args(p: argparse.ArgumentParser, trace: str, rates: list[float]) -> None:
    """The workload, model and hardware of a study that simulates one trace at several rates."""
    p.add_argument("--trace", default=trace, help=f"a trace file or a synthetic kind (default {trace})")
    p.add_argument("--trace-format", choices=KNOWN_FORMATS)
    p.add_argument("--num-requests", type=positive_int, default=1000)
    p.add_argument("--rates", type=rate, nargs="+", default=rates,
                   help=f"request rates, req/s (default {' '.join(f'{r:g}' for r in rates)})")
    p.add_argument("--model", default="opt-13b")
    p.add_argument("--hardware", default="a100-40gb")
    p.add_argument("--block-size", type=positive_int, default=16)
    p.add_argument("--seed", type=seed, default=0)
    p.add_argument("--profile", help="price iterations with this profile (file or shipped name) instead of the "
                                     "roofline model; needs --num-gpu-blocks")
    p.add_argument("--calibration", help="price iterations with the calibrated roofline: a calibration file from "
                                         "`pagesim calibrate`, or a shipped one's name (vllm-v1-h100)")
    p.add_argument("--num-gpu-blocks", type=positive_int, help="override the derived KV capacity (blocks)")
    p.add_argument("--jobs", type=positive_int, default=1,
                   help="simulations run at once in worker processes (default 1; the results are the same)")
    add_executor_args(p)


def add_executor_args(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """--executor and --ray-address, beside a study's --jobs."""
    p.add_argument("--executor", choices=EXECUTORS, default="process",
                   help="process: --jobs worker processes on this machine (default); ray: each simulation a Ray "
                        "task (pip install 'pagesim[cluster]'), on the cluster at --ray-address or a local Ray")
    p.add_argument("--ray-address", metavar="ADDR",
                   help="with --executor ray: a running cluster's head, e.g. HEAD:6379 (default: a local Ray)")


def workers(args: argparse.Namespace) -> Workers:
    """Where a study's simulations run, from --jobs, --executor and --ray-address."""
    return Workers(args.jobs, getattr(args, "executor", "process"), getattr(args, "ray_address", None))


def add_server_args(p: argparse.ArgumentParser) -> None:
    """The server settings `vllm bench serve` result files do not record (analysis/bench_settings.py)."""
    g = p.add_argument_group("server settings of `vllm bench serve` result files (they record none; also read from "
                             "<result>.server.json beside each file)")
    g.add_argument("--server-settings", metavar="FILE", help="a JSON object of vLLM argument names: "
                   "tensor_parallel_size, max_num_seqs, max_num_batched_tokens, enable_prefix_caching, "
                   "max_model_len, gpu_memory_utilization, block_size, hardware")
    g.add_argument("--tp", type=positive_int, help="the server's tensor_parallel_size")
    g.add_argument("--max-num-seqs", type=positive_int)
    g.add_argument("--max-num-batched-tokens", type=positive_int)
    g.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=None)
    g.add_argument("--max-model-len", type=positive_int)


def server_settings(args: argparse.Namespace) -> dict[str, Any]:
    file = read_settings(Path(args.server_settings)) if args.server_settings else None
    return server_options(args.tp, args.max_num_seqs, args.max_num_batched_tokens, args.prefix_caching,
                          args.max_model_len, file)


def add_seeds_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seeds", type=positive_int, default=1,
                   help="repeat the study with seeds --seed, --seed+1, ...: each re-draws a synthetic workload and "
                        "generated arrivals; adds a seed column and a summary with 95%% CIs (default 1)")


def add_output_args(p: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """Where a run writes (the same three files, simulated or live) and its goodput SLOs."""
    g = p.add_argument_group("output")
    g.add_argument("--slo-ttft", type=positive_float, help="TTFT SLO in seconds, for goodput")
    g.add_argument("--slo-tpot", type=positive_float, help="TPOT SLO in seconds, for goodput")
    g.add_argument("--out", type=out_dir, required=True, help="output directory")
    g.add_argument("--quiet", action="store_true", help="no progress bar")
    return g


# ---- what the arguments build ----

def sim_config(args: argparse.Namespace, **overrides: Any) -> SimConfig:
    """The SimConfig of a command's arguments. Each SimConfig field the command has an argument of
    the same name for takes its value; the fields several arguments decide are derived where the
    command has those arguments (policy_options from --policy-arg, replicas from --replicas and
    --replica-hardware, router_options from --max-imbalance, cost_model from --profile and
    --cost-model, fast_forward from --no-skip-ahead); `overrides` come last (a study's own choices,
    and the fields whose same-named argument means something else there, e.g. a list of widths).
    Building it checks the values (SimConfig refuses what no run could use)."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(SimConfig) if hasattr(args, f.name)}
    for name in ("replica_hardware", "disaggregate"):  # nargs lists, or None when not given
        if name in values:
            values[name] = tuple(values[name] or ())
    derived = {  # field: (the arguments it needs, how it follows from them)
        "policy_options": (("policy_args",), policy_options),
        "replicas": (("replica_hardware",), replica_count),
        "router_options": (("max_imbalance", "router"), router_options),
        "cost_model": (("profile",), lambda a: "profiled" if a.profile else getattr(a, "cost_model", "roofline")),
        "fast_forward": (("no_skip_ahead",), lambda a: not a.no_skip_ahead),
    }
    for name, (needs, value) in derived.items():
        if name not in overrides and all(hasattr(args, n) for n in needs):
            values[name] = value(args)
    return SimConfig(**{**values, **overrides})


def replica_count(args: argparse.Namespace) -> int:
    """--replicas, or the number of GPUs --replica-hardware names (both given: they must agree)."""
    hw = getattr(args, "replica_hardware", None)
    n = getattr(args, "replicas", 1)
    if not hw:
        return n
    if n not in (1, len(hw)):
        raise ValueError(f"--replicas {n} but --replica-hardware names {len(hw)} GPUs")
    return len(hw)


def router_options(args: argparse.Namespace) -> dict:
    """The router class's keyword options: --router-arg KEY=VALUE, and --max-imbalance."""
    options = parse_policy_args(getattr(args, "router_args", None), "--router-arg")
    if getattr(args, "max_imbalance", None) is None:
        return options
    if args.router not in MATCH_ROUTERS:
        raise ValueError(f"--max-imbalance applies to --router {' or '.join(MATCH_ROUTERS)}, not {args.router}")
    return {**options, "max_imbalance": args.max_imbalance}


def check_workload_size(spec: str, num_requests: int | None) -> None:
    """Refuse a synthetic workload too large to simulate before generating it (policies.limits); a trace
    file's requests are counted when they become requests (policies.trace_requests)."""
    if spec in SYNTHETIC and num_requests:
        check_fits(f"--num-requests {num_requests:,}", [(num_requests, REQUEST_BYTES)])


def load_workload(args: argparse.Namespace) -> Trace:
    """The trace of the workload arguments (add_workload_args), with its arrivals."""
    check_workload_size(args.trace, args.num_requests)
    return _checked_for_prefix_caching(args, resolve_trace(args.trace, num_requests=args.num_requests, rate=args.rate,
                                                           burstiness=args.burstiness, seed=args.seed,
                                                           format=args.trace_format))


def study_trace(args: argparse.Namespace, seed: int | None = None) -> Trace:
    """The trace of a study's arguments (add_study_args), drawn with `seed` (default --seed)."""
    check_workload_size(args.trace, args.num_requests)
    # the lengths are drawn once; each rate re-draws (or rescales) the arrivals
    return _checked_for_prefix_caching(args, resolve_trace(args.trace, num_requests=args.num_requests,
                                                           format=args.trace_format,
                                                           seed=args.seed if seed is None else seed,
                                                           rate=args.rates[0]))


def _checked_for_prefix_caching(args: argparse.Namespace, trace: Trace) -> Trace:
    """The trace, after a warning when --prefix-caching is on but the trace carries only lengths:
    with no prompt token ids or prefix hashes, no two prompts can share a cached block."""
    if getattr(args, "prefix_caching", False) and trace.prompt_token_ids is None and trace.prefix_hashes is None:
        warnings.warn(f"--prefix-caching: {trace.name or args.trace} carries only lengths (no prompt token ids or "
                      "prefix hashes), so no prompt can share a cached block: expect 0 prefix hits", stacklevel=2)
    return trace


def study_workloads(args: argparse.Namespace, draw: Callable[[int], Trace] | None = None) -> Trace | list[Trace]:
    """The study's workload: one trace, or one per seed with --seeds > 1. `draw(seed)` makes one
    (default: study_trace)."""
    return seed_workloads(draw or (lambda s: study_trace(args, s)), args.seed, getattr(args, "seeds", 1))


def study_title(args: argparse.Namespace) -> str:
    """What a study's cost model prices, for its header and figure titles (files by their names, not
    their paths); a calibration's client terms make every latency and SLO figure the client's
    (policies/client_latency.py), which it says."""
    model = shown_name(args.model)
    if getattr(args, "profile", None):
        return f"{model}, profile {shown_name(args.profile)}"
    calibration = getattr(args, "calibration", None)
    where = f"{model} on {shown_name(args.hardware)}"
    return f"{where}, calibration {shown_name(calibration)} (client-side latencies)" if calibration else where


def shown_name(spec: str) -> str:
    """A model, hardware, profile or calibration as a title shows it: a file by its name (a HF config
    by its folder's), never the path it was read from."""
    path = Path(spec)
    if len(path.parts) < 2 and path.suffix != ".json":
        return spec  # a shipped name
    return path.parent.name if path.name == "config.json" and path.parent.name else path.stem


BUSY_LOAD = 1.5  # run-queue length per CPU above which live step times stop describing the machine


def machine_load() -> dict[str, float]:
    """This machine's CPUs, 1-minute load average and torch's intra-op threads (when torch is
    imported), as a live run's summary records them."""
    cpus = os.cpu_count() or 1
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    torch = sys.modules.get("torch")
    return {"cpus": cpus, "load_1min": load, "torch_threads": torch.get_num_threads() if torch else None}


def warn_if_busy(what: str) -> dict[str, float]:
    """Warn before a live run when the machine is busy (a load average over BUSY_LOAD per CPU) or
    torch is set to more threads than there are CPUs: measured step times would then describe the
    contention, not the model (a loaded 2-core VM gave 28 s iterations and a -95% validation error
    with no hint). Returns machine_load()."""
    m = machine_load()
    if m["load_1min"] > BUSY_LOAD * m["cpus"]:
        warnings.warn(f"{what}: this machine is busy (load average {m['load_1min']:.1f} on {m['cpus']} CPUs): "
                      "measured step times will describe the contention, not the model", stacklevel=2)
    if m["torch_threads"] and m["torch_threads"] > m["cpus"]:
        warnings.warn(f"{what}: torch uses {m['torch_threads']} threads on {m['cpus']} CPUs (oversubscribed); "
                      "set OMP_NUM_THREADS or torch.set_num_threads to at most the CPUs", stacklevel=2)
    return m


def require_backend():
    """backend.live_executor, or a one-line error saying how to install the backend extra (torch is
    imported here, when a live command runs, never when the command line is parsed)."""
    try:
        import torch  # noqa: F401
    except ImportError as exc:
        raise ValueError("live execution needs the backend extra: pip install -e '.[backend]' "
                         "(or `make setup`)") from exc
    from backend import live_executor  # deferred: the backend imports torch
    return live_executor


def replica_config(args: argparse.Namespace, **overrides: Any) -> ReplicaConfig:
    """The ReplicaConfig (policies.replica_config) of a live command's arguments: each field the
    command has an argument of the same name for takes its value, policy_options come from
    --policy-arg; `overrides` last. Building it checks the values."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(ReplicaConfig) if hasattr(args, f.name)}
    values["policy_options"] = policy_options(args)
    return ReplicaConfig(**{**values, **overrides})


def live_options(args: argparse.Namespace):
    """The live replay options (backend.replay.LiveOptions) of `pagesim live`'s arguments."""
    from backend.replay import LiveOptions  # deferred: the backend imports torch
    return LiveOptions(model=args.model, device=args.device, attention=args.attention, replica=replica_config(args),
                       seed=args.seed)
