"""Disaggregated serving (Splitwise, DistServe): prefill replicas compute each prompt and its first
token, the prompt's KV moves over a link to a decode replica, which generates the rest.

    arrivals ──> router ──> prefill replica (max_tokens 1) ──> link (bytes / bandwidth) ──>
        least-loaded decode replica: the KV lands in its prefix cache ──> decode the remaining tokens

Each prefill replica has one outgoing link, a SimPy resource that carries one transfer at a time
at `transfer_bandwidth` (default: the hardware's NVLink bandwidth: prefill and decode GPUs in one
NVLink domain). On arrival the KV is held in the decode replica's cache as idle cached blocks
(`PagedBlockManager.inject_prefix`), so admission finds them as a prefix hit; only the last
partial block and the first generated token are computed there. If the cache must evict them
before the request is admitted, it recomputes them, as a real engine would.

A request's row joins its two halves: arrival, first token and TTFT from the prefill replica;
finish, TPOT and end-to-end latency over both. Every replica steps every iteration (no skipping
ahead: a decode replica's arrivals are not known in advance). Parallel sampling and beam search
are not modelled here.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import numpy as np
import pandas as pd
import simpy

from policies.client_latency import ClientTerms, client_columns, client_timestamps, sent_known
from policies.metrics import summarize
from policies.replica_config import ReplicaConfig
from policies.request import Request, SamplingParams, SequenceGroup
from policies.request_rows import request_frame
from policies.router import LeastLoadedRouter, Router, replica_views
from policies.trace_requests import requests_from_trace
from sim.cluster import gc_paused, run_replicas, sim_replica
from sim.cost_model import CostModel
from sim.engine import ArrivalFeed, Replica
from sim.specs import get_hardware, get_model
from traces.trace import Trace

_NO_ARRIVALS = float("inf")


class _TransferFeed:
    """What a decode replica's engine asks of its arrivals: none are known in advance."""

    exhausted = False

    @staticmethod
    def next_arrival() -> float:
        return _NO_ARRIVALS


def run_disaggregated(cfg: Any, trace: Trace, replica: ReplicaConfig, cost: CostModel, router: Router | None,
                      started: float) -> tuple[pd.DataFrame, pd.DataFrame, dict[str, Any]]:
    """Simulate `trace` on cfg.disaggregate = (prefill replicas, decode replicas) (cfg: a
    sim.run.SimConfig; policy vllm), each replica configured as `replica` (the decode ones with
    prefix caching on: the KV they are sent lands in it) and priced by `cost`, arrivals spread over
    the prefill replicas by `router`; `started`: when the run began (time.perf_counter), for its
    wall time. Returns (requests, iterations, summary), the request table joining each request's
    halves."""
    num_prefill, num_decode = _check(cfg)
    model, hw = get_model(cfg.model), get_hardware(cfg.hardware)
    bandwidth = cfg.transfer_bandwidth or hw.interconnect_bandwidth
    bytes_per_token = model.kv_bytes_per_token
    env = simpy.Environment()

    def make(config: ReplicaConfig, stream: int, **engine: Any) -> Replica:
        seed = np.random.SeedSequence([cfg.seed, stream])  # prefill replicas first, then decode ones
        return sim_replica(env, config, cost, seed, cfg.beam_rank_decay, fast_forward=False, debug=cfg.debug, **engine)

    with gc_paused():
        originals = {r.request_id: r for r in requests_from_trace(trace, replica.max_model_len)}
        feed = ArrivalFeed([_prefill_half(r) for r in originals.values()])
        transfers: dict[int, dict] = {}
        decode = [make(dataclasses.replace(replica, prefix_caching=True), num_prefill + j, index=j)
                  for j in range(num_decode)]
        decode_router: Router = LeastLoadedRouter()
        decode_scheds = replica_views(decode_router, [r.scheduler for r in decode])

        def transfer(group: SequenceGroup, link: simpy.Resource, source: int):
            original = originals[group.group_id]
            start = env.now
            with link.request() as turn:
                yield turn
                yield env.timeout(group.request.prompt_len * bytes_per_token / bandwidth)
            j = decode_router.route(original, decode_scheds)
            second = _decode_half(original, group, env.now)
            decode[j].scheduler.inject_prefix(group.request)  # the prompt's KV, now on replica j
            transfers[original.request_id] = {"prefill_replica": source, "decode_replica": j,
                                              "transfer_s": env.now - start}
            decode[j].deliver(second)

        def finished(source: int, link: simpy.Resource):
            def on_finish(groups: list[SequenceGroup]) -> None:
                for g in groups:
                    if originals[g.group_id].max_output > 1:
                        env.process(transfer(g, link, source))
            return on_finish

        prefill = [make(replica, i, index=i, on_finish=finished(i, simpy.Resource(env, capacity=1)))
                   for i in range(num_prefill)]
        run_replicas(env, feed, prefill, router, [(r, _TransferFeed()) for r in decode])
        requests = _join(prefill, decode, transfers)
        if len(requests) != len(originals):
            raise AssertionError(f"{len(originals)} requests in, {len(requests)} out")
        iterations = pd.concat([r.log.frame().assign(pool="prefill", replica=r.index) for r in prefill]
                               + [r.log.frame().assign(pool="decode", replica=r.index) for r in decode],
                               ignore_index=True)
        requests = _client_view(requests, iterations, prefill, cost.client_terms())
        summary = summarize(requests, iterations, cfg.slo_ttft, cfg.slo_tpot)
    moved = requests.transfer_s.dropna()
    summary.update(num_gpu_blocks=replica.num_gpu_blocks, num_cpu_blocks=replica.num_cpu_blocks,
                   kv_capacity_tokens=replica.num_gpu_blocks * replica.block_size,
                   wall_time_s=time.perf_counter() - started, trace=trace.name, config=cfg.to_dict())
    summary["disaggregated"] = {
        "prefill_replicas": num_prefill, "decode_replicas": num_decode, "transfer_bandwidth": bandwidth,
        "transfers": len(moved), "transfer_s": {"mean": float(moved.mean()) if len(moved) else float("nan"),
                                                "max": float(moved.max()) if len(moved) else float("nan")},
        "decode_recomputed_tokens": int(requests.decode_recomputed_tokens.sum()),
    }
    return requests, iterations, summary


def _client_view(requests: pd.DataFrame, iterations: pd.DataFrame, prefill: list[Replica],
                 terms: ClientTerms | None) -> pd.DataFrame:
    """The client's latencies: the first token sent after the iterations of the prefill replica that
    made it, the last after the decode replica's (a single output token: the prefill replica's)."""
    if terms is None:
        return requests
    first, last = client_timestamps(requests, None, 0.0)
    if terms.output_lag_steps > 0:
        lag, empty = terms.output_lag_steps, iterations.iloc[:0]
        pools = dict(tuple(iterations.groupby("pool")))
        origin = {g.request.request_id: r.index for r in prefill for g in r.scheduler.done}
        made_on = requests.request_id.map(origin).to_numpy()
        decoded = requests.decode_replica.notna().to_numpy()
        first = sent_known(first, pools.get("prefill", empty), lag, made_on)
        last = np.where(decoded, sent_known(last, pools.get("decode", empty), lag, requests.decode_replica.to_numpy()),
                        sent_known(last, pools.get("prefill", empty), lag, made_on))
    return client_columns(requests, first, last, terms)


def _check(cfg: Any) -> tuple[int, int]:
    num_prefill, num_decode = cfg.disaggregate
    if num_prefill < 1 or num_decode < 1:
        raise ValueError(f"disaggregate: needs at least one prefill and one decode replica, got {cfg.disaggregate}")
    if cfg.policy != "vllm":
        raise ValueError(f"disaggregate: the paged 'vllm' policy only (KV moves block by block), not {cfg.policy!r}")
    if cfg.replicas != 1 or cfg.replica_hardware:
        raise ValueError("disaggregate: give the replica counts there, not with replicas / replica_hardware")
    if (cfg.n or 1) > 1 or (cfg.beam_width or 1) > 1:
        raise ValueError("disaggregate: parallel sampling and beam search are not modelled disaggregated")
    if cfg.transfer_bandwidth is not None and cfg.transfer_bandwidth <= 0:
        raise ValueError(f"transfer_bandwidth: must be > 0 bytes/s, got {cfg.transfer_bandwidth}")
    return num_prefill, num_decode


def _prefill_half(r: Request) -> Request:
    # the request's own fields (priority, client, SLO class, a reject reason, its prompt's content:
    # a prompt known by its length only is named by its request id, which the decode half keeps, so
    # the decode replica finds the KV it was sent) carry over
    return dataclasses.replace(r, sampling=SamplingParams(max_tokens=1, ignore_eos=True), output_len=1)


def _decode_half(r: Request, first: SequenceGroup, now: float) -> Request:
    """The rest of the request: its prompt and first token, the remaining output."""
    # the first token's content is unknown here: a placeholder no other request's can equal
    ids = None if r.prompt_token_ids is None else list(r.prompt_token_ids) + [-2 - r.request_id]
    rest = r.max_output - 1
    return Request(r.request_id, now, r.prompt_len + 1, SamplingParams(max_tokens=rest, ignore_eos=True), rest,
                   ids, r.prefix_hashes, r.hash_block_size, r.priority)


def _join(prefill: list[Replica], decode: list[Replica], transfers: dict[int, dict]) -> pd.DataFrame:
    """One row per request: the prefill half's arrival and first token, the decode half's finish."""
    first = request_frame([g for r in prefill for g in r.scheduler.done]).set_index("request_id")
    second = request_frame([g for r in decode for g in r.scheduler.done]).set_index("request_id")
    out = first.copy()
    has = out.index.isin(second.index) & (out.status == "finished")
    s = second.reindex(out.index)
    out["output_len"] = np.where(has, 1 + s.output_len.fillna(0), out.output_len).astype(np.int64)
    out["finish_time"] = np.where(has, s.finish_time, out.finish_time)
    out["num_preemptions"] = (out.num_preemptions + s.num_preemptions.fillna(0)).astype(np.int64)
    # the decode half's prompt, less what it found cached, is what it had to recompute
    out["decode_recomputed_tokens"] = np.where(has, s.prompt_len - s.prefix_hit_tokens, 0).astype(np.int64)
    failed = has & (s.status == "rejected")
    out.loc[failed, "status"] = "rejected"
    if failed.any():  # (with no decode half at all, s's columns are all-NaN floats)
        out.loc[failed, "reject_reason"] = "decode replica: " + s.reject_reason[failed].astype(str)
    done = out.status == "finished"
    out["e2e_latency"] = np.where(done, out.finish_time - out.arrival, np.nan)
    out["tpot"] = np.where(done & (out.output_len > 1), (out.finish_time - out.first_token_time) / (out.output_len - 1),
                           np.nan)
    out["normalized_latency"] = np.where(done, out.e2e_latency / out.output_len, np.nan)
    t = pd.DataFrame.from_dict(transfers, orient="index")
    for col in ("prefill_replica", "decode_replica", "transfer_s"):
        out[col] = t[col].reindex(out.index) if len(t) else np.nan
    return out.reset_index()

