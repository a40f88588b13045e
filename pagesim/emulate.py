"""`pagesim serve --emulate`: the OpenAI-compatible server with no model behind it (wiring only).

Each replica is the server of `pagesim serve` (backend.async_engine.AsyncEngine + backend.http_api)
over the simulator's pieces: the policy's scheduler on a KV cache sized as `pagesim simulate` sizes
it (sim.run.SimConfig.replica; built by policies.replica_config.build_replica), an EmulatedExecutor pricing every iteration with the calibrated (or
profiled) cost model, and a PacedClock that releases each iteration's tokens when the wall clock
reaches its planned end, `--time-scale` times faster than real time (sim/emulated.py says how).
What a client sees beyond the engine is emulated from the calibration's client terms (sim/calibrated.py),
as `pagesim simulate` adds them to its latencies: each call waits --frontend-delay (default the
calibration's client_ttft_s: vLLM's HTTP, tokenization and first chunk) before it reaches the engine,
and each iteration's tokens go out --output-lag-steps iterations later (default its
client_output_lag_steps, e.g. 1.28: the end of the next iteration plus 0.28 of the one after, as
`pagesim simulate` applies it; vLLM V1 sends a step's outputs while the next one runs). This
server's own HTTP cost comes on top (about a millisecond on loopback). With a profile both are 0.
Prompts are tokenized by --tokenizer (a HF folder or GGUF file) or the documented approximation of
backend/text_tokens.py; answers are words of its fixed output vocabulary.

/metrics adds to vLLM's names the emulator's own: `pagesim:token_release_lag_seconds` (how late each
iteration's tokens went out against its plan, wall seconds), `pagesim:emulator_late_releases_total`,
`pagesim:emulator_behind` (1 while releases in the last BEHIND_WINDOW_S seconds were late) and
`pagesim:emulator_time_scale`; falling behind is also logged, at most once per BEHIND_WINDOW_S.

`--replicas N` runs N independent engines in this process, one per port from --port-base (default
--port), bound before anything starts. This module builds them; pagesim/serve.py serves them as it
serves the live engine (backend/http_server.py: read timeouts, and on SIGTERM / SIGINT a drain (or
abort) bounded by --shutdown-timeout), then writes each one's tables to --out (one replica) or
--out/replica-<i>.
"""

from __future__ import annotations

import argparse
import socket
import sys
import time
from dataclasses import dataclass, field

import numpy as np

from backend.text_tokens import ByteChunkTokenizer, load_tokenizer, output_vocabulary
from pagesim.argtypes import fraction, non_negative_float, non_negative_int, positive_float, positive_int
from pagesim.cli_args import sim_config
from policies.client_latency import ClientTerms
from policies.replica_config import build_replica
from sim.cost_model import CostModel
from sim.emulated import EmulatedExecutor, OutputLengthModel, PacedClock
from sim.run import build_cost_model, num_blocks_for
from sim.specs import get_model

BEHIND_WINDOW_S = 10.0
SWITCH_INTERVAL_S = 5e-4
LAG_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
# (dest, flag, live default): settings of the emulated engine only, refused without --emulate
_EMULATION_ONLY = (("hardware", "--hardware", None), ("tp", "--tp", 1), ("calibration", "--calibration", None),
                   ("profile", "--profile", None), ("gpu_memory_utilization", "--gpu-memory-utilization", 0.9),
                   ("time_scale", "--time-scale", 1.0), ("replicas", "--replicas", 1),
                   ("port_base", "--port-base", None), ("tokenizer", "--tokenizer", None),
                   ("output_len_mean", "--output-len-mean", 128.0), ("frontend_delay", "--frontend-delay", None),
                   ("output_lag_steps", "--output-lag-steps", None), ("kv_events", "--kv-events", False),
                   ("kv_events_zmq", "--kv-events-zmq", None), ("kv_events_replay", "--kv-events-replay", None),
                   ("kv_events_topic", "--kv-events-topic", ""))


def add_emulate_args(p: argparse.ArgumentParser) -> None:
    e = p.add_argument_group("emulation (--emulate: no weights, no model; a cost model times every iteration)")
    e.add_argument("--emulate", action="store_true",
                   help="serve --model as emulated on --hardware: the real scheduler and KV cache, each iteration "
                        "priced by --calibration or --profile, tokens released in real time")
    e.add_argument("--hardware", help="the GPU emulated (a hardware spec name or JSON file; default a100-40gb)")
    e.add_argument("--tp", type=positive_int, default=1, help="tensor-parallel degree emulated (default 1)")
    e.add_argument("--gpu-memory-utilization", type=fraction, default=0.9,
                   help="the KV cache is what this share of the GPUs' memory leaves after the weights (default 0.9; "
                        "--num-gpu-blocks overrides)")
    e.add_argument("--calibration", help="price iterations with this calibration (file, or a shipped name: "
                                         "vllm-v1-h100)")
    e.add_argument("--profile", help="price iterations with this profile (file or shipped name; needs --num-gpu-blocks)")
    e.add_argument("--time-scale", type=positive_float, default=1.0,
                   help="run this many times faster than real time (default 1; tables keep emulated seconds)")
    e.add_argument("--replicas", type=positive_int, default=1,
                   help="independent emulated engines, on consecutive ports from --port-base (default 1)")
    e.add_argument("--port-base", type=non_negative_int, help="the first replica's port (default --port)")
    e.add_argument("--tokenizer", help="a HF tokenizer folder or a GGUF file (default: ~4 bytes per token, "
                                       "hashed ids; see backend/text_tokens.py)")
    e.add_argument("--output-len-mean", type=positive_float, default=128.0,
                   help="mean output length of requests without ignore_eos (geometric, seeded; capped by max_tokens; "
                        "default 128)")
    e.add_argument("--frontend-delay", type=non_negative_float, metavar="SECONDS",
                   help="emulated seconds each call waits before it reaches the engine (default: the calibration's "
                        "client_ttft_s; 0 with --profile)")
    e.add_argument("--output-lag-steps", type=non_negative_float, metavar="K",
                   help="iterations after its own that a step's tokens go out, a fraction of the last one "
                        "included (default: the calibration's client_output_lag_steps; 0 with --profile)")
    k = p.add_argument_group("KV-cache events (--emulate, with --prefix-caching: vLLM's KV events for cache-aware "
                             "routers; backend/kv_events.py)")
    k.add_argument("--kv-events", action="store_true",
                   help="serve GET /v1/kv_events on every replica's port: server-sent events, one JSON batch per "
                        "iteration (BlockStored / BlockRemoved / AllBlocksCleared with block hashes), ?since=N replays")
    k.add_argument("--kv-events-zmq", metavar="ENDPOINT",
                   help="also publish vLLM's ZeroMQ + msgpack wire format on this PUB endpoint (e.g. tcp://*:5557; "
                        "replica i binds port + i; needs pyzmq and msgpack)")
    k.add_argument("--kv-events-replay", metavar="ENDPOINT",
                   help="vLLM's replay ROUTER endpoint for --kv-events-zmq (e.g. tcp://*:5567; replica i: port + i)")
    k.add_argument("--kv-events-topic", default="", help="the ZeroMQ topic of every message (default empty)")
    # under --emulate the KV cache is sized from --hardware unless given; the live default stays 512
    p.set_defaults(num_gpu_blocks=None, num_cpu_blocks=None)


def check_live_args(args: argparse.Namespace) -> None:
    """Without --emulate: refuse the emulation-only flags (they would be ignored)."""
    for dest, flag, default in _EMULATION_ONLY:
        if getattr(args, dest) != default:
            raise ValueError(f"{flag} applies with --emulate only")


# ---- one emulated replica -------------------------------------------------------------------------
@dataclass
class Replica:
    index: int
    engine: object     # backend.async_engine.AsyncEngine
    api: object        # backend.http_api.OpenAIServer
    metrics: object    # backend.serve_metrics.ServeMetrics
    clock: object      # sim.emulated.PacedClock
    kv_blocks: int
    closers: list = field(default_factory=list)  # what to close once it has stopped (a KV-event publisher)

    def close(self) -> None:
        for close in self.closers:
            close()
        self.closers.clear()


class LagMetrics:
    """The emulator's own metrics (module docstring), on the server's registry; `observe` is the
    PacedClock's on_lag. Logs when releases fall behind, at most once per BEHIND_WINDOW_S."""

    def __init__(self, registry, model_name: str, time_scale: float, label: str = "") -> None:
        from prometheus_client import Counter, Gauge, Histogram

        lab = ["model_name"]
        self.lag = Histogram("pagesim:token_release_lag_seconds", "How late an iteration's tokens were released "
                             "against its planned end (wall seconds)", lab, buckets=LAG_BUCKETS,
                             registry=registry).labels(model_name)
        self.late = Counter("pagesim:emulator_late_releases", "Releases later than 5 ms or 10% of their iteration",
                            lab, registry=registry).labels(model_name)
        self.behind = Gauge("pagesim:emulator_behind", "1 while the emulator cannot keep up with its plan",
                            lab, registry=registry).labels(model_name)
        Gauge("pagesim:emulator_time_scale", "Emulated seconds per wall second", lab,
              registry=registry).labels(model_name).set(time_scale)
        self.label = label
        self._last_late = -1e9
        self._last_log = -1e9
        self._late_since_log = 0

    def observe(self, lag: float, step_wall: float, behind: bool) -> None:
        self.lag.observe(lag)
        now = time.monotonic()
        if behind:
            self.late.inc()
            self._last_late = now
            self._late_since_log += 1
            if now - self._last_log >= BEHIND_WINDOW_S:
                print(f"pagesim serve{self.label}: emulator behind: tokens released {lag * 1e3:.1f} ms late "
                      f"(iteration {step_wall * 1e3:.2f} ms; {self._late_since_log} late releases since the last "
                      "report); the timeline is late, not stretched", file=sys.stderr, flush=True)
                self._last_log, self._late_since_log = now, 0
        self.behind.set(1.0 if now - self._last_late < BEHIND_WINDOW_S else 0.0)


def build_replicas(args: argparse.Namespace) -> list[Replica]:
    """Every replica of the arguments; ValueError naming the flag for what cannot be emulated."""
    try:  # deferred: the HTTP server is an optional extra (and backend.async_engine imports torch)
        from backend.async_engine import AsyncEngine
        from backend.http_api import OpenAIServer, ServeOptions
        from backend.serve_metrics import ServeMetrics
    except ImportError as exc:
        raise ValueError(f"pagesim serve needs the serve extra: pip install -e '.[serve]' ({exc})") from exc

    if not (args.calibration or args.profile):
        raise ValueError("--emulate needs --calibration or --profile: what prices each iteration")
    if args.device != "cpu" or args.attention:
        raise ValueError(f"--{'device' if args.device != 'cpu' else 'attention'} does not apply with --emulate "
                         "(no model runs)")
    cfg = sim_config(args, replicas=1, hardware=args.hardware or "a100-40gb")
    try:
        cost = build_cost_model(cfg)
    except FileNotFoundError as e:
        raise ValueError(f"--{'profile' if args.profile else 'calibration'}: {e}") from None
    model = get_model(cfg.model)
    try:
        num_blocks_for(cfg)  # a model too large for the hardware, said as the model's
    except ValueError as e:
        raise ValueError(f"--model {args.model}: {e}") from None
    config = cfg.replica()  # the KV cache pagesim simulate sizes, the model's context as the longest request
    gpu = config.num_gpu_blocks
    tokenizer = _tokenizer(args, model.vocab_size)
    vocab = output_vocabulary(tokenizer)
    lengths = OutputLengthModel(args.output_len_mean)
    frontend, lag_steps = _client_terms(args, cost)
    replicas = []
    for i in range(args.replicas):
        executor = EmulatedExecutor(cost, vocab, seed=_replica_seed(cfg.seed, i), lengths=lengths)
        replica = build_replica(config, executor)
        max_len = min(model.max_position, replica.scheduler.capacity_tokens or gpu * cfg.block_size)
        metrics = ServeMetrics(args.model)
        label = f" replica {i}" if args.replicas > 1 else ""
        lag = LagMetrics(metrics.registry, args.model, args.time_scale, label)
        clock = PacedClock(args.time_scale, on_lag=lag.observe)
        engine = AsyncEngine(replica, tokenizer, observer=metrics, debug=args.debug, clock=clock,
                             output_lag_steps=lag_steps)
        api = OpenAIServer(engine, tokenizer, metrics, ServeOptions(
            args.model, max_len, args.max_pending, int(time.time()), body_timeout=args.body_timeout,
            frontend_delay_s=frontend / args.time_scale, frontend_delay_engine_s=frontend))
        r = Replica(i, engine, api, metrics, clock, gpu)
        replicas.append(r)
        if args.kv_events or args.kv_events_zmq:
            try:
                _kv_events(args, r, replica.scheduler, lag.observe)
            except ValueError:
                for done in replicas:
                    done.close()
                raise
    return replicas


def _kv_events(args: argparse.Namespace, r: Replica, scheduler, observe_lag) -> None:
    """Replica `r`'s KV-event log on its scheduler's block pool, sealed at every release of tokens,
    behind GET /v1/kv_events (--kv-events) and vLLM's ZeroMQ publisher (--kv-events-zmq), and
    vLLM's POST /reset_prefix_cache (an AllBlocksCleared)."""
    from starlette.routing import Route

    from backend.kv_events import KvEventLog, ZmqPublisher, kv_events_route, reset_prefix_cache_route
    from policies.block_manager import PagedBlockManager

    flag = "--kv-events" if args.kv_events else "--kv-events-zmq"
    if args.kv_events_replay and not args.kv_events_zmq:
        raise ValueError("--kv-events-replay applies with --kv-events-zmq only")
    if not args.prefix_caching:
        raise ValueError(f"{flag} needs --prefix-caching (without it no block is named by a hash)")
    bm = getattr(scheduler, "bm", None)
    if not isinstance(bm, PagedBlockManager):
        raise ValueError(f"{flag}: policy {args.policy!r} has no paged block manager to report on")
    log = KvEventLog(bm, scheduler.seqs)
    log.attach()
    clock = r.clock

    def on_release(lag: float, step_wall: float, behind: bool) -> None:
        observe_lag(lag, step_wall, behind)
        log.seal(clock.now())

    clock.on_lag = on_release
    api = r.api
    api.extra_routes.append(Route("/reset_prefix_cache", reset_prefix_cache_route(api.engine, bm.pool, log, clock),
                                  methods=["POST"]))
    if args.kv_events:
        api.extra_routes.append(Route("/v1/kv_events", kv_events_route(log, lambda: not api.engine.alive or api.cut),
                                      methods=["GET"]))
    if args.kv_events_zmq:
        zmq = ZmqPublisher(log, _offset_port(args.kv_events_zmq, r.index, "--kv-events-zmq"),
                           _offset_port(args.kv_events_replay, r.index, "--kv-events-replay")
                           if args.kv_events_replay else None, topic=args.kv_events_topic)
        r.closers.append(zmq.close)


def _offset_port(endpoint: str, i: int, flag: str) -> str:
    """`endpoint` with its port raised by `i` (replica i's, as vLLM offsets by data-parallel rank)."""
    head, sep, port = endpoint.rpartition(":")
    if not (sep and endpoint.startswith("tcp://") and port.isdigit()):
        raise ValueError(f"{flag}: expected tcp://HOST:PORT (e.g. tcp://*:5557), got {endpoint!r}")
    return f"{head}:{int(port) + i}"


def _client_terms(args: argparse.Namespace, cost: CostModel) -> tuple[float, float]:
    """(--frontend-delay in emulated seconds, --output-lag-steps): given, or the cost model's client
    terms (a calibration's; none for a profile: 0 and 0)."""
    terms = cost.client_terms() or ClientTerms()
    frontend = terms.ttft_s if args.frontend_delay is None else args.frontend_delay
    lag = terms.output_lag_steps if args.output_lag_steps is None else args.output_lag_steps
    args.frontend_delay, args.output_lag_steps = frontend, lag  # as run: the summary's config says so
    return frontend, lag


def _replica_seed(seed: int, i: int) -> int:
    """Replica 0 keeps the run's seed (one replica is the single-engine run), others derive theirs."""
    return seed if i == 0 else int(np.random.SeedSequence([seed, i]).generate_state(1)[0])


def _tokenizer(args: argparse.Namespace, vocab_size: int):
    if args.tokenizer:
        return load_tokenizer(args.tokenizer)
    return ByteChunkTokenizer(vocab_size)


# ---- serving ---------------------------------------------------------------------------------------
def bind_ports(host: str, ports: list[int], flag: str) -> list[socket.socket]:
    """Listening sockets on `ports`, bound before anything starts; a taken port is a ValueError
    naming `flag`."""
    socks: list[socket.socket] = []
    try:
        for port in ports:
            try:
                family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
                sock = socket.socket(family, socket.SOCK_STREAM)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                # accepted connections inherit it: a token's small write goes out at once, not after
                # the client's delayed ACK of the one before (40 ms on Linux)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                sock.bind((host, port))
            except OSError as e:
                raise ValueError(f"{flag}: cannot listen on {host}:{port} ({e.strerror or e})") from None
            socks.append(sock)
    except ValueError:
        for s in socks:
            s.close()
        raise
    return socks


def describe(args: argparse.Namespace, first: Replica) -> str:
    """What `pagesim serve --emulate` says it serves, in its ready line."""
    return (f"{args.model} on {args.tp} x {args.hardware or 'a100-40gb'} ({args.calibration or args.profile}), "
            f"policy {args.policy}, {first.kv_blocks} KV blocks of {args.block_size}, time scale {args.time_scale:g}")


def replica_out(args: argparse.Namespace, r: Replica, count: int) -> str:
    """Where replica `r` of `count` writes its tables: --out, or --out/replica-<i> for several."""
    return args.out if count == 1 else f"{args.out}/replica-{r.index}"


def replica_facts(args: argparse.Namespace, r: Replica, count: int) -> dict:
    """What the summary says of an emulated replica, once it has stopped (its release lag so far)."""
    facts = {"mode": "emulate", "hardware": args.hardware or "a100-40gb", "tp": args.tp,
             "cost": args.calibration or args.profile, "time_scale": args.time_scale,
             "frontend_delay_s": args.frontend_delay, "output_lag_steps": args.output_lag_steps,
             "num_gpu_blocks": r.kv_blocks, "kv_capacity_tokens": r.kv_blocks * args.block_size,
             "release_lag": r.clock.stats.to_dict()}
    if count > 1:
        facts["replica"] = r.index
    return facts
