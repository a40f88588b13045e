"""The `pagesim` command line: composition root wiring traces, policies, sim, backend, analysis."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from analysis.parallel import add_executor_args
from analysis.report import replica_table, summary_table
from pagesim.argtypes import (
    fraction,
    non_negative_float,
    non_negative_int,
    out_dir,
    positive_float,
    positive_int,
    rate,
    seed,
)
from policies.metrics import write_run
from policies.registry import POLICIES
from policies.router import MATCH_ROUTERS, ROUTERS
from sim.specs import HARDWARE, MODELS
from traces.cli import add_trace_parser
from traces.loaders import KNOWN_FORMATS
from traces.synthetic import SYNTHETIC


def add_workload_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--trace", default="sharegpt-like",
                   help=f"a trace file, or a synthetic workload: {', '.join(SYNTHETIC)} (default: sharegpt-like)")
    g.add_argument("--trace-format", choices=KNOWN_FORMATS, help="file format (default: detect from columns)")
    g.add_argument("--num-requests", type=positive_int, help="use the first N requests (synthetic default: 1000)")
    g.add_argument("--rate", type=rate, help="mean arrival rate, req/s (Poisson; rescales a timestamped trace)")
    g.add_argument("--burstiness", type=non_negative_float,
                   help="inter-arrival coefficient of variation (Gamma arrivals; 1 = Poisson, 0 = constant, evenly "
                        "spaced at 1/rate)")
    g.add_argument("--n", type=positive_int, help="parallel samples per request (overrides the trace)")
    g.add_argument("--beam-width", type=positive_int, help="beam width per request (overrides the trace)")
    g.add_argument("--seed", type=seed, default=0, help="seed for every random choice (default 0)")


def add_policy_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("policy")
    g.add_argument("--policy", default="vllm", type=_policy_name,
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


def _policy_name(text: str) -> str:
    """A policy argument that resolves (registry name, module:Class, entry point), checked up front."""
    from policies.registry import resolve_policy
    try:
        resolve_policy(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _policy_options(args: argparse.Namespace) -> dict:
    from policies.registry import parse_policy_args
    return parse_policy_args(getattr(args, "policy_args", None))


def add_replica_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("replicas (simulation only)")
    g.add_argument("--replicas", type=positive_int, default=1, help="model replicas, each with its own KV cache (default 1)")
    g.add_argument("--router", default="round-robin", choices=list(ROUTERS),
                   help="how arrivals are spread over replicas (default round-robin)")
    g.add_argument("--replica-hardware", nargs="+", metavar="GPU",
                   help="each replica's GPU spec, e.g. a100-80gb a100-80gb h100-sxm (sets --replicas; roofline only)")
    g.add_argument("--disaggregate", type=positive_int, nargs=2, metavar=("PREFILL", "DECODE"),
                   help="disaggregated serving: PREFILL replicas compute prompts and first tokens, the KV moves to "
                        "DECODE replicas (policy vllm)")
    g.add_argument("--transfer-bandwidth", type=_gigabytes_per_s, metavar="GB/S",
                   help="with --disaggregate: the prefill -> decode KV link, GB/s (default: the NVLink bandwidth)")
    g.add_argument("--max-imbalance", type=non_negative_int,
                   help="prefix-affinity, cache-aware: the most outstanding requests a matched replica may hold "
                        "above the least loaded (default 8)")


def _gigabytes_per_s(text: str) -> float:
    """A bandwidth argument given in GB/s, as bytes/s."""
    try:
        return positive_float(text) * 1e9
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"must be > 0 GB/s, got {text}") from None


def _replica_count(args: argparse.Namespace) -> int:
    hw = getattr(args, "replica_hardware", None)
    n = getattr(args, "replicas", 1)
    if not hw:
        return n
    if n not in (1, len(hw)):
        raise ValueError(f"--replicas {n} but --replica-hardware names {len(hw)} GPUs")
    return len(hw)


def _router_options(args: argparse.Namespace) -> dict:
    if getattr(args, "max_imbalance", None) is None:
        return {}
    if args.router not in MATCH_ROUTERS:
        raise ValueError(f"--max-imbalance applies to --router {' or '.join(MATCH_ROUTERS)}, not {args.router}")
    return {"max_imbalance": args.max_imbalance}


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


def add_seeds_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seeds", type=positive_int, default=1,
                   help="repeat the study with seeds --seed, --seed+1, ...: each re-draws a synthetic workload and "
                        "generated arrivals; adds a seed column and a summary with 95%% CIs (default 1)")


def _study_costs(args: argparse.Namespace) -> dict:
    """SimConfig fields for a study's cost model and cache size."""
    return {"num_gpu_blocks": args.num_gpu_blocks, "profile": args.profile,
            "cost_model": "profiled" if args.profile else "roofline", "calibration": getattr(args, "calibration", None)}


def _study_title(args: argparse.Namespace) -> str:
    return f"{args.model}, profile {args.profile}" if args.profile else f"{args.model} on {args.hardware}"


def _check_workload_size(spec: str, num_requests: int | None) -> None:
    """Refuse a synthetic workload too large to simulate before generating it (sim.limits); a trace
    file's requests are counted when they become requests (sim.run.requests_from_trace)."""
    from sim.limits import REQUEST_BYTES, check_fits
    if spec in SYNTHETIC and num_requests:
        check_fits(f"--num-requests {num_requests:,}", [(num_requests, REQUEST_BYTES)])


def _study_trace(args: argparse.Namespace, seed: int | None = None):
    from traces import resolve_trace
    _check_workload_size(args.trace, args.num_requests)
    # the lengths are drawn once; each rate re-draws (or rescales) the arrivals
    return resolve_trace(args.trace, num_requests=args.num_requests, format=args.trace_format,
                         seed=args.seed if seed is None else seed, rate=args.rates[0])


def _study_workloads(args: argparse.Namespace, draw=None):
    """(the study's workload: one trace, or one per seed with --seeds > 1; the first trace)."""
    from analysis.seeds import seed_workloads
    workload = seed_workloads(draw or (lambda s: _study_trace(args, s)), args.seed, getattr(args, "seeds", 1))
    return workload, workload[0] if isinstance(workload, list) else workload


def _seeds_note(args: argparse.Namespace) -> str:
    return f"; 95% CI over {args.seeds} seeds" if args.seeds > 1 else ""


def _seed_cell(row: dict) -> str:
    return f" {row['seed']:>5}" if "seed" in row else ""


def _write_seed_summary(table, keys: list[str], path, metric: str) -> None:
    """With a seed column: the per-configuration means and 95% CIs to `path`, and `metric`'s printed."""
    from analysis.seeds import ci_table
    if "seed" not in table:
        return
    summary = ci_table(table, keys)
    summary.to_csv(path, index=False)
    print(f"\n{metric}, mean +- 95% CI over {int(summary.seeds.max())} seeds:")
    for r in summary.itertuples(index=False):
        d = r._asdict()
        print("  " + " ".join(f"{d[k]}" for k in keys) + f": {d[metric]:.4g} +- {d[metric + '_ci95']:.2g}")
    print(f"wrote {path}")


def add_output_args(p: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """Where a run writes (the same three files, simulated or live) and its goodput SLOs."""
    g = p.add_argument_group("output")
    g.add_argument("--slo-ttft", type=positive_float, help="TTFT SLO in seconds, for goodput")
    g.add_argument("--slo-tpot", type=positive_float, help="TPOT SLO in seconds, for goodput")
    g.add_argument("--out", type=out_dir, required=True, help="output directory")
    g.add_argument("--quiet", action="store_true", help="no progress bar")
    return g


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pagesim",
        description="LLM-serving policy workbench on paged KV-cache memory: simulate policies over "
                    "traces, run them live on a real model, and compare.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    sim = sub.add_parser("simulate", help="simulate a trace under a policy (SimPy, cost model)",
                         description="Simulate serving a trace; writes requests.csv, iterations.parquet "
                                     "and summary.json to --out.")
    add_workload_args(sim)
    add_policy_args(sim)
    h = sim.add_argument_group("model and hardware")
    h.add_argument("--model", default="opt-13b", help=f"model: {', '.join(MODELS)}, a HF config.json, a folder with "
                                                     "one, or a HF id found in --models-dir (default opt-13b)")
    h.add_argument("--hardware", default="a100-40gb", help=f"GPU spec: {', '.join(HARDWARE)}, or a hardware JSON file "
                                                          "(default a100-40gb)")
    h.add_argument("--tp", type=positive_int, default=1, help="tensor-parallel degree (default 1)")
    h.add_argument("--gpu-memory-utilization", type=fraction, default=0.9)
    h.add_argument("--num-gpu-blocks", type=positive_int, help="override the derived KV capacity (blocks)")
    h.add_argument("--num-cpu-blocks", type=non_negative_int, help="override the swap space (blocks; default 4 GiB)")
    h.add_argument("--cost-model", choices=("roofline", "profiled"), default="roofline",
                   help="roofline (analytic, from --model and --hardware) or profiled (fitted, needs --profile)")
    h.add_argument("--profile", help="a profile file from `pagesim profile`, or a shipped profile's name "
                                     "(implies --cost-model profiled)")
    h.add_argument("--calibration", help="price iterations with the calibrated roofline: a calibration file from "
                                         "`pagesim calibrate`, or a shipped one's name (vllm-v1-h100)")
    add_replica_args(sim)
    o = add_output_args(sim)
    o.add_argument("--no-skip-ahead", action="store_true", help="step every iteration (slower, same results)")
    o.add_argument("--debug", action="store_true", help="check block and request conservation every iteration")
    sim.set_defaults(func=cmd_simulate)

    demo = sub.add_parser("demo", help="a quick tour: vllm vs orca-oracle on a sharegpt-like trace")
    demo.add_argument("--num-requests", type=positive_int, default=600)
    demo.add_argument("--rate", type=rate, default=1.5)
    demo.add_argument("--out", type=out_dir, default="runs/demo")
    demo.set_defaults(func=cmd_demo)

    from pagesim.live import add_parser as add_live_parser  # the command lives there
    add_live_parser(sub)

    from pagesim.profiling import add_parser as add_profile_parser  # the command lives there
    add_profile_parser(sub)

    from analysis.validate import add_parser as add_validate_parser  # analysis sits on sim: imported late
    add_validate_parser(sub)

    from pagesim.generate import add_parser as add_generate_parser  # the command lives there
    add_generate_parser(sub)

    from pagesim.serve import add_serve_parser  # the server's parser and run function live there
    add_serve_parser(sub)

    from analysis.sweep import add_parser as add_sweep_parser  # the command lives there
    add_sweep_parser(sub)

    from analysis.sharing import add_parser as add_sharing_parser  # the command lives there
    add_sharing_parser(sub)

    from analysis.routing import add_parser as add_routing_parser  # the command lives there
    add_routing_parser(sub)

    from analysis.capacity import add_parser as add_capacity_parser  # the command lives there
    add_capacity_parser(sub)

    from analysis.disagg import add_parser as add_disagg_parser  # the command lives there
    add_disagg_parser(sub)

    from analysis.block_size import add_parser as add_block_size_parser  # the command lives there
    add_block_size_parser(sub)

    from analysis.preemption import add_parser as add_preemption_parser  # the command lives there
    add_preemption_parser(sub)

    from analysis.beams import add_parser as add_beams_parser  # the command lives there
    add_beams_parser(sub)

    from analysis.fidelity import add_parser as add_fidelity_parser  # analysis sits on sim: imported late
    add_fidelity_parser(sub)
    add_trace_parser(sub)
    from analysis.calibrate import add_parser as add_calibrate_parser  # analysis sits on sim: imported late
    add_calibrate_parser(sub)
    from analysis.policy_study import add_parser as add_policies_parser
    add_policies_parser(sub)
    for p in sub.choices.values():  # every command that takes --model can look up HF ids
        if "--model" in p._option_string_actions:
            p.add_argument("--models-dir", action="append", default=[], metavar="DIR",
                           help="a folder of HF configs (<name>.json or <name>/config.json) where a HF id given "
                                "as --model is looked up (repeatable)")
    return parser


def _resolve_specs(args: argparse.Namespace) -> None:
    """Load --model and --hardware before any work, so a bad one fails in one line; a HF id found in
    --models-dir (or beside the path given) becomes that config file's path."""
    from pathlib import Path

    from specs import find_config, load_hardware, load_model
    model = getattr(args, "model", None)
    if isinstance(model, str) and model:
        path = find_config(model, list(getattr(args, "models_dir", None) or []))
        load_model(str(path) if path else model)  # raises, naming the file and field or what was tried
        if path is not None and not Path(model).exists():
            args.model = str(path)
    hardware = getattr(args, "hardware", None)
    if isinstance(hardware, str) and hardware:
        load_hardware(hardware)


def _sim_config(args: argparse.Namespace, policy: str | None = None):
    from sim.run import SimConfig
    return SimConfig(model=args.model, hardware=args.hardware, tp=args.tp, policy=policy or args.policy,
                     policy_options=_policy_options(args) if policy is None else {},
                     block_size=args.block_size, preemption=args.preemption, max_num_seqs=args.max_num_seqs,
                     max_num_batched_tokens=args.max_num_batched_tokens, chunked_prefill=args.chunked_prefill,
                     prefix_caching=args.prefix_caching, gpu_memory_utilization=args.gpu_memory_utilization,
                     num_gpu_blocks=args.num_gpu_blocks, n=args.n, beam_width=args.beam_width, seed=args.seed,
                     slo_ttft=args.slo_ttft, slo_tpot=args.slo_tpot, fast_forward=not args.no_skip_ahead,
                     debug=args.debug, num_cpu_blocks=args.num_cpu_blocks,
                     cost_model="profiled" if args.profile else args.cost_model, profile=args.profile,
                     calibration=getattr(args, "calibration", None), replicas=_replica_count(args), router=getattr(args, "router", "round-robin"),
                     router_options=_router_options(args), replica_hardware=tuple(getattr(args, "replica_hardware", None) or ()),
                     disaggregate=tuple(getattr(args, "disaggregate", None) or ()),
                     transfer_bandwidth=getattr(args, "transfer_bandwidth", None))


def _load_workload(args: argparse.Namespace):
    from traces import resolve_trace
    _check_workload_size(args.trace, args.num_requests)
    return resolve_trace(args.trace, num_requests=args.num_requests, rate=args.rate,
                         burstiness=args.burstiness, seed=args.seed, format=args.trace_format)


def cmd_simulate(args: argparse.Namespace) -> int:
    from sim.run import run_simulation
    cfg = _sim_config(args)  # first: a bad setting fails before the trace is read
    trace = _load_workload(args)
    result = run_simulation(cfg, trace, progress=not args.quiet)
    out = write_run(args.out, result.requests, result.iterations, result.summary)
    print(summary_table({cfg.policy: result.summary}))
    if cfg.replicas > 1:
        print("\n" + replica_table(result.summary))
    if cfg.disaggregate:
        d = result.summary["disaggregated"]
        print(f"\ndisaggregated: {d['prefill_replicas']} prefill + {d['decode_replicas']} decode replicas, KV link "
              f"{d['transfer_bandwidth'] / 1e9:g} GB/s; {d['transfers']:,} transfers, mean {d['transfer_s']['mean'] * 1e3:.2f} ms "
              f"(max {d['transfer_s']['max'] * 1e3:.2f}); {d['decode_recomputed_tokens']:,} prompt tokens recomputed on "
              f"decode replicas")
    print(f"\nwrote {out}/requests.csv, iterations.parquet, summary.json")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from sim.run import SimConfig, run_simulation
    from traces import resolve_trace
    _check_workload_size("sharegpt-like", args.num_requests)
    trace = resolve_trace("sharegpt-like", num_requests=args.num_requests, rate=args.rate, seed=0)
    print(f"pagesim demo: {len(trace)} sharegpt-like requests (synthetic, fitted to the vLLM paper's "
          f"ShareGPT statistics), Poisson at {args.rate} req/s, OPT-13B on one A100-40GB\n")
    summaries = {}
    for policy in ("vllm", "orca-oracle"):
        result = run_simulation(SimConfig(policy=policy), trace, progress=True)
        write_run(f"{args.out}/{policy}", result.requests, result.iterations, result.summary)
        summaries[policy] = result.summary
    print(summary_table(summaries))
    print(f"\nper-request and per-iteration tables in {args.out}/<policy>/; try `pagesim simulate --help`")
    return 0


def _backend():
    try:
        import torch  # noqa: F401
    except ImportError as exc:
        raise ValueError("live execution needs the backend extra: pip install -e '.[backend]' "
                         "(or `make setup`)") from exc
    from backend import live
    return live


def live_options(args: argparse.Namespace):
    """The live replay options (backend.replay.LiveOptions) of `pagesim live`'s arguments."""
    from backend.replay import LiveOptions
    return LiveOptions(model=args.model, device=args.device, attention=args.attention,
                       num_gpu_blocks=args.num_gpu_blocks, num_cpu_blocks=args.num_cpu_blocks,
                       block_size=args.block_size, policy=args.policy, policy_options=_policy_options(args),
                       max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                       preemption=args.preemption, chunked_prefill=args.chunked_prefill,
                       prefix_caching=args.prefix_caching, seed=args.seed, slo_ttft=args.slo_ttft,
                       slo_tpot=args.slo_tpot)


def _spec_of(model: str) -> str:
    """The simulator's model spec for a live model argument: the same string (the simulator reads a
    config file or HF directory itself, specs.load_model)."""
    return model


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        _resolve_specs(args)
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError) as exc:
        print(f"pagesim {args.command}: error: {exc}", file=sys.stderr)  # as argparse words its errors
        return 2


if __name__ == "__main__":
    sys.exit(main())
