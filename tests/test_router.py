"""Routers (policies/router.py) and the multi-replica simulation they drive."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagesim.cli import main as cli_main
from policies.least_loaded import LeastLoaded, least_loaded
from policies.registry import make_scheduler
from policies.request import Request, SamplingParams
from policies.router import (
    CacheAwareRouter,
    LeastLoadedRouter,
    PrefixAffinityRouter,
    RandomRouter,
    RoundRobinRouter,
    Router,
    make_router,
    outstanding,
    prefix_keys,
)
from sim.run import SimConfig, run_simulation
from traces import apply_arrivals, resolve_trace
from traces.synthetic import shared_prefix


def replicas_with_loads(loads: list[int]):
    """Schedulers holding `loads[i]` waiting requests each."""
    out = []
    rid = 0
    for n in loads:
        s = make_scheduler("vllm", 64, 16)
        for _ in range(n):
            s.add_request(Request(rid, 0.0, 8, SamplingParams(max_tokens=4)))
            rid += 1
        out.append(s)
    return out


def req(rid: int, hashes: tuple[int, ...] | None = None, ids: list[int] | None = None) -> Request:
    plen = len(ids) if ids is not None else 16 * max(len(hashes or ()), 1)
    return Request(rid, 0.0, plen, SamplingParams(max_tokens=4), prompt_token_ids=ids, prefix_hashes=hashes)


def test_round_robin_cycles():
    reps = replicas_with_loads([5, 0, 9])
    r = RoundRobinRouter()
    assert [r.route(req(i), reps) for i in range(7)] == [0, 1, 2, 0, 1, 2, 0]


def test_random_is_seeded_and_in_range():
    reps = replicas_with_loads([0] * 5)
    r1, r2, r3 = RandomRouter(seed=3), RandomRouter(seed=3), RandomRouter(seed=4)
    picks = [r1.route(req(i), reps) for i in range(200)]
    assert picks == [r2.route(req(i), reps) for i in range(200)]
    assert picks != [r3.route(req(i), reps) for i in range(200)]
    assert set(picks) == set(range(5))


@settings(max_examples=60, deadline=None, derandomize=True)
@given(loads=st.lists(st.integers(0, 6), min_size=1, max_size=6), calls=st.integers(1, 5))
def test_least_loaded_picks_a_least_loaded_replica(loads, calls):
    reps = replicas_with_loads(loads)
    router = LeastLoadedRouter()
    for i in range(calls):
        pick = router.route(req(1000 + i), reps)
        assert outstanding(reps[pick]) == min(outstanding(s) for s in reps)
        reps[pick].add_request(req(1000 + i))


def test_least_loaded_fills_an_idle_cluster_in_turn():
    reps = replicas_with_loads([0, 0, 0])
    router = LeastLoadedRouter()
    picks = []
    for i in range(6):  # nothing is ever added: every replica stays tied
        picks.append(router.route(req(i), reps))
    assert picks == [0, 1, 2, 0, 1, 2]


def test_prefix_keys_from_hashes_or_token_ids():
    assert prefix_keys(req(0, hashes=(7, 8, 9)), 16) == (7, 8, 9)
    a = prefix_keys(req(0, ids=list(range(40))), 16)
    b = prefix_keys(req(1, ids=list(range(32)) + [99] * 8), 16)
    c = prefix_keys(req(2, ids=[5] + list(range(1, 40))), 16)
    assert len(a) == 2 and a == b  # full blocks only; equal leading content, equal keys
    assert c[0] != a[0] and c[1] != a[1]  # chained: a different first block changes every key
    assert prefix_keys(req(3), 16) == ()


def test_prefix_affinity_follows_the_prefix_and_falls_back_to_least_loaded():
    reps = replicas_with_loads([0, 0, 0])
    router = PrefixAffinityRouter(max_imbalance=2)
    first = router.route(req(0, hashes=(1, 2, 3)), reps)
    reps[first].add_request(req(0))
    other = router.route(req(1, hashes=(50, 51)), reps)  # unseen: the least loaded, not `first`
    assert other != first
    reps[other].add_request(req(1))
    # a longer match beats a shorter one; a shared first block alone still counts
    assert router.route(req(2, hashes=(1, 2, 4)), reps) == first
    assert router.route(req(3, hashes=(50, 99)), reps) == other
    assert router.affinity_hits == 2
    # the matched replica grows 3 busier than the least loaded: the cap sends elsewhere
    for j in range(3):
        reps[first].add_request(req(10 + j))
    assert router.route(req(4, hashes=(1, 2, 3)), reps) != first


@settings(max_examples=60, deadline=None, derandomize=True)
@given(prefixes=st.lists(st.integers(0, 5), min_size=1, max_size=40), cap=st.integers(0, 4),
       n=st.integers(1, 4))
def test_prefix_affinity_never_exceeds_its_imbalance_cap(prefixes, cap, n):
    reps = replicas_with_loads([0] * n)
    router = PrefixAffinityRouter(max_imbalance=cap)
    for i, p in enumerate(prefixes):
        r = req(i, hashes=(p, 100 + p))
        least = min(outstanding(s) for s in reps)
        pick = router.route(r, reps)
        assert outstanding(reps[pick]) <= least + cap
        reps[pick].add_request(r)
    assert sum(outstanding(s) for s in reps) == len(prefixes)


def test_prefix_affinity_memory_is_bounded():
    reps = replicas_with_loads([0, 0])
    router = PrefixAffinityRouter(memory_blocks=3)
    router.route(req(0, hashes=(1, 2, 3, 4, 5)), reps)
    assert max(len(s) for s in router._seen) == 3


def test_cached_prefix_tokens_is_a_pure_query_of_the_cache():
    s = make_scheduler("vllm", 64, 16, prefix_caching=True)
    first = req(0, ids=list(range(40)))
    assert s.cached_prefix_tokens(first) == 0
    s.add_request(first)
    s.schedule(0.0)  # the prefill allocates and registers the two full blocks
    same = req(1, ids=list(range(32)) + [7] * 20)
    hits, queries = s.bm.prefix_hits, s.bm.prefix_queries
    assert s.cached_prefix_tokens(same) == 32
    assert s.cached_prefix_tokens(req(2, ids=[9] + list(range(1, 40)))) == 0
    assert (s.bm.prefix_hits, s.bm.prefix_queries) == (hits, queries)  # nothing counted or taken
    s.bm.check_invariants()
    assert make_scheduler("vllm", 64, 16).cached_prefix_tokens(same) == 0  # prefix caching off
    assert make_scheduler("orca-max", 64, 16).cached_prefix_tokens(same) == 0


def test_cache_aware_goes_where_the_cache_holds_the_prefix():
    reps = [make_scheduler("vllm", 64, 16, prefix_caching=True) for _ in range(3)]
    warm = req(0, ids=list(range(48)))
    reps[2].add_request(warm)
    reps[2].schedule(0.0)
    router = CacheAwareRouter(max_imbalance=1)
    assert router.route(req(1, ids=list(range(48)) + [5]), reps) == 2   # 1 outstanding, cap 1: fits
    assert router.route(req(2, ids=[3] * 40), reps) in (0, 1)          # no hits anywhere: least loaded
    reps[2].add_request(req(3, ids=[1] * 20))                           # now 2 above the others
    assert router.route(req(4, ids=list(range(48)) + [5]), reps) != 2
    assert router.affinity_hits == 1


def test_make_router_errors_name_the_problem():
    with pytest.raises(ValueError, match=r"unknown router 'nope'.*round-robin"):
        make_router("nope")
    with pytest.raises(ValueError, match="unknown parameter 'max_imbalance' for router 'round-robin'"):
        make_router("round-robin", max_imbalance=3)
    with pytest.raises(ValueError, match="max_imbalance must be >= 0"):
        make_router("prefix-affinity", max_imbalance=-1)
    assert isinstance(make_router("least-loaded", seed=4), LeastLoadedRouter)  # seed only where taken
    # --router-arg values of the wrong kind: was "'<' not supported between 'str' and 'int'", a float
    # max_imbalance accepted, and numpy's "expected non-negative integer" for a negative seed
    with pytest.raises(ValueError, match="router 'prefix-affinity': option max_imbalance='abc' must be int"):
        make_router("prefix-affinity", max_imbalance="abc")
    with pytest.raises(ValueError, match=r"option max_imbalance=2\.5 must be int"):
        make_router("prefix-affinity", max_imbalance=2.5)
    with pytest.raises(ValueError, match="random router: seed must be >= 0, got -1"):
        make_router("random", seed=-1)


# ---------------------------------------------------------------- the multi-replica simulation

@pytest.mark.parametrize("router", ["round-robin", "random", "least-loaded", "prefix-affinity", "cache-aware"])
@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_multi_replica_skip_ahead_equals_stepping(router, preemption):
    # a small cache per replica and a high rate: windows, preemptions and arrivals interleave; the
    # shared prefixes give the cache-reading routers something to read
    tr = apply_arrivals(shared_prefix(160, seed=5, num_prefixes=6, prefix_len=256, suffix_len=100, output_len=120),
                        rate=80.0, seed=5)
    cfg = SimConfig(num_gpu_blocks=120, replicas=3, router=router, preemption=preemption, prefix_caching=True,
                    debug=True)
    a = run_simulation(cfg, tr)
    b = run_simulation(SimConfig(**{**cfg.to_dict(), "fast_forward": False}), tr)
    pd.testing.assert_frame_equal(a.requests, b.requests, check_exact=True)
    pd.testing.assert_frame_equal(a.iterations, b.iterations, check_exact=True)
    assert a.summary["num_preemptions"] > 0 and a.summary["engine"]["skipped_iterations"] > 0
    assert a.summary["num_finished"] == 160


@settings(max_examples=15, deadline=None, derandomize=True)
@given(router=st.sampled_from(["round-robin", "random", "least-loaded", "prefix-affinity", "cache-aware"]),
       replicas=st.integers(2, 4), rate=st.sampled_from([2.0, 40.0, 200.0]), blocks=st.integers(60, 300),
       chunked=st.booleans(), seed=st.integers(0, 2**16))
def test_multi_replica_skip_ahead_equals_stepping_property(router, replicas, rate, blocks, chunked, seed):
    tr = apply_arrivals(shared_prefix(40, seed=seed, num_prefixes=3, prefix_len=200, suffix_len=60, output_len=90),
                        rate=rate, seed=seed)
    cfg = SimConfig(num_gpu_blocks=blocks, replicas=replicas, router=router, prefix_caching=True,
                    chunked_prefill=chunked, max_num_batched_tokens=256 if chunked else 4096, seed=seed)
    a = run_simulation(cfg, tr)
    b = run_simulation(SimConfig(**{**cfg.to_dict(), "fast_forward": False}), tr)
    pd.testing.assert_frame_equal(a.requests, b.requests, check_exact=True)
    pd.testing.assert_frame_equal(a.iterations, b.iterations, check_exact=True)
    assert len(a.requests) == 40 and sum(r["requests"] for r in a.summary["router"]["replicas"]) == 40


def test_round_robin_spreads_requests_in_turn_and_accounts_for_all():
    tr = resolve_trace("sharegpt-like", num_requests=90, rate=20.0, seed=2)
    res = run_simulation(SimConfig(num_gpu_blocks=400, replicas=3), tr)
    r = res.requests
    assert r.request_id.tolist() == list(range(90))
    order = np.argsort(tr.arrival, kind="stable")
    assert r.replica.to_numpy()[order].tolist() == [i % 3 for i in range(90)]
    assert sorted(res.iterations.replica.unique().tolist()) == [0, 1, 2]
    rows = res.summary["router"]["replicas"]
    assert [x["requests"] for x in rows] == [30, 30, 30] and res.summary["router"]["imbalance"] == 1.0


def test_routed_tables_are_each_replicas_tables_joined():
    """The run's tables are every replica's own tables with a `replica` column: requests in id
    order, iterations replica by replica (as concatenating the per-replica frames gives them)."""
    from policies.request_rows import request_frame
    from sim import run as sim_run

    seen = {}
    tables = sim_run._tables

    def spy(replicas):  # the replicas' own frames, taken before `_tables` consumes the logs
        seen["requests"] = [request_frame(r.scheduler.done).assign(replica=r.index) for r in replicas]
        seen["iterations"] = [r.log.frame().assign(replica=r.index) for r in replicas]
        return tables(replicas)

    tr = resolve_trace("multi-client", num_requests=300, rate=30.0, seed=4)
    tr.prompt_len[7] = 9000  # one rejected request among them
    try:
        sim_run._tables = spy
        res = run_simulation(SimConfig(num_gpu_blocks=300, replicas=3, router="least-loaded"), tr)
    finally:
        sim_run._tables = tables
    requests = pd.concat(seen["requests"], ignore_index=True)
    requests = requests.sort_values("request_id", kind="stable", ignore_index=True)
    iterations = pd.concat(seen["iterations"], ignore_index=True)
    pd.testing.assert_frame_equal(res.requests, requests, check_exact=True)
    pd.testing.assert_frame_equal(res.iterations, iterations, check_exact=True)
    assert (res.requests.status == "rejected").sum() == 1


def test_one_replica_is_the_single_engine_run():
    tr = resolve_trace("sharegpt-like", num_requests=60, rate=10.0, seed=1)
    one = run_simulation(SimConfig(num_gpu_blocks=300, replicas=1, router="random"), tr)
    assert "replica" not in one.requests and "router" not in one.summary
    # two replicas at twice the rate each see about the load of one: latency in the same range
    two = run_simulation(SimConfig(num_gpu_blocks=300, replicas=2), apply_arrivals(tr, rate=20.0, seed=1))
    assert two.summary["num_finished"] == 60


def test_rejected_requests_appear_with_their_replica():
    tr = resolve_trace("sharegpt-like", num_requests=20, rate=5.0, seed=0)
    tr.prompt_len[3] = 5000  # more than the cache of 100 blocks of 16 holds
    res = run_simulation(SimConfig(num_gpu_blocks=100, replicas=2, router="least-loaded"), tr)
    row = res.requests.set_index("request_id").loc[3]
    assert row.status == "rejected" and row.replica in (0, 1)
    assert res.summary["num_finished"] == 19


def test_prefix_affinity_raises_prefix_hits_when_one_cache_cannot_hold_every_prefix():
    # 24 prefixes of 1,024 tokens; each replica's cache holds about 6 of them: round robin makes
    # every replica cycle through all 24 (evicting), affinity gives each replica its own few
    tr = apply_arrivals(shared_prefix(600, seed=0, num_prefixes=24, prefix_len=1024, suffix_len=32, output_len=16),
                        rate=30.0, seed=0)
    base = SimConfig(model="llama-3-8b", hardware="a100-80gb", num_gpu_blocks=400, replicas=4, prefix_caching=True)
    runs = {r: run_simulation(SimConfig(**{**base.to_dict(), "router": r}), tr).summary
            for r in ("round-robin", "least-loaded", "prefix-affinity", "cache-aware")}
    hits = {r: s["prefix_hit_tokens"] for r, s in runs.items()}
    for r in ("prefix-affinity", "cache-aware"):
        assert hits[r] > 1.5 * max(hits["round-robin"], hits["least-loaded"])
        assert runs[r]["ttft"]["mean"] < runs["round-robin"]["ttft"]["mean"]
        assert runs[r]["router"]["affinity_routed"] > 400


def test_bad_replica_count_and_router_are_clear_errors():
    tr = resolve_trace("sharegpt-like", num_requests=5, rate=1.0, seed=0)
    with pytest.raises(ValueError, match="replicas must be >= 1"):
        run_simulation(SimConfig(num_gpu_blocks=100, replicas=0), tr)
    with pytest.raises(ValueError, match="unknown router 'fastest'"):
        run_simulation(SimConfig(num_gpu_blocks=100, replicas=2, router="fastest"), tr)


def test_cli_simulate_with_replicas(tmp_path, capsys):
    out = tmp_path / "run"
    rc = cli_main(["simulate", "--trace", "sharegpt-like", "--num-requests", "40", "--rate", "8",
                   "--replicas", "2", "--router", "least-loaded", "--num-gpu-blocks", "300", "--out", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "least-loaded" in text and "replica" in text
    reqs = pd.read_csv(out / "requests.csv")
    assert len(reqs) == 40 and set(reqs.replica) == {0, 1}


def test_cli_routing_writes_table_and_plot(tmp_path, capsys):
    out = tmp_path / "rt"
    rc = cli_main(["routing", "--num-requests", "80", "--rates", "10", "--num-prefixes", "20", "--prefix-len", "256",
                   "--output-len", "16", "--replicas", "2", "--max-imbalance", "4", "--out", str(out)])
    assert rc == 0
    table = pd.read_csv(out / "routing.csv")
    assert table.router.tolist() == ["round-robin", "least-loaded", "prefix-affinity", "cache-aware"]
    assert (table.prefix_hit_fraction >= 0).all() and (table.prefix_hit_fraction <= 1).all()
    assert (out / "routing.png").stat().st_size > 0
    assert "prefix-affinity" in capsys.readouterr().out


def test_router_study_needs_two_replicas():
    from analysis.routing import router_sweep
    tr = resolve_trace("sharegpt-like", num_requests=5, rate=1.0, seed=0)
    with pytest.raises(ValueError, match="replicas >= 2"):
        router_sweep(tr, SimConfig(num_gpu_blocks=100), ["round-robin"], [1.0])


@pytest.mark.parametrize("policy", ["vllm", "orca-max", "orca-pow2", "orca-oracle", "static"])
def test_every_policy_runs_behind_every_router(policy):
    tr = resolve_trace("sharegpt-like", num_requests=40, rate=10.0, seed=3)
    for router in ("round-robin", "random", "least-loaded", "prefix-affinity", "cache-aware"):
        res = run_simulation(SimConfig(policy=policy, num_gpu_blocks=300, replicas=3, router=router, debug=True,
                                       n=2 if policy == "vllm" else None), tr)
        assert len(res.requests) == 40 and res.summary["num_finished"] + res.summary["num_rejected"] == 40
        assert sum(r["requests"] for r in res.summary["router"]["replicas"]) == 40


def test_replicas_on_different_hardware():
    tr = resolve_trace("sharegpt-like", num_requests=300, rate=12.0, seed=4)
    hw = ("a100-40gb", "h100-sxm")
    runs = {r: run_simulation(SimConfig(model="llama-3-8b", replicas=2, replica_hardware=hw, router=r, debug=True), tr)
            for r in ("round-robin", "least-loaded")}
    rows = {r: res.summary["router"]["replicas"] for r, res in runs.items()}
    assert [x["hardware"] for x in rows["round-robin"]] == list(hw)
    assert rows["round-robin"][1]["num_gpu_blocks"] > rows["round-robin"][0]["num_gpu_blocks"]  # 80 GB vs 40 GB
    assert [x["requests"] for x in rows["round-robin"]] == [150, 150]
    # the faster replica drains its queue sooner, so least loaded sends it more
    assert rows["least-loaded"][1]["requests"] > rows["least-loaded"][0]["requests"]
    assert runs["least-loaded"].summary["mean_normalized_latency"] < runs["round-robin"].summary["mean_normalized_latency"]
    with pytest.raises(ValueError, match="names 2 GPUs for 3 replicas"):
        run_simulation(SimConfig(replicas=3, replica_hardware=hw), tr)
    with pytest.raises(ValueError, match="unknown hardware 'tpu'"):
        run_simulation(SimConfig(replicas=2, replica_hardware=("a100-40gb", "tpu")), tr)
    with pytest.raises(ValueError, match="roofline"):
        run_simulation(SimConfig(model="smollm2-135m", replicas=2, replica_hardware=hw, cost_model="profiled",
                                 profile="smollm2-135m-cpu", num_gpu_blocks=64), tr)


def test_cli_replica_hardware(tmp_path, capsys):
    rc = cli_main(["simulate", "--num-requests", "30", "--rate", "5", "--model", "llama-3-8b",
                   "--replica-hardware", "a100-80gb", "h100-sxm", "h100-sxm", "--router", "least-loaded",
                   "--out", str(tmp_path / "h"), "--quiet"])
    assert rc == 0
    assert "h100-sxm" in capsys.readouterr().out
    assert set(pd.read_csv(tmp_path / "h" / "requests.csv").replica) <= {0, 1, 2}
    rc = cli_main(["simulate", "--num-requests", "5", "--rate", "5", "--replicas", "2", "--replica-hardware",
                   "a100-80gb", "h100-sxm", "h200", "--out", str(tmp_path / "x"), "--quiet"])
    assert rc == 2 and "--replica-hardware names 3 GPUs" in capsys.readouterr().err


class EveryOther(RoundRobinRouter):
    """Round robin over every `stride`-th replica (a plug-in router with an option)."""

    name = "every-other"
    reads = "counts"

    def __init__(self, stride: int = 2) -> None:
        super().__init__()
        self.stride = stride

    def route(self, request: Request, replicas) -> int:
        return super().route(request, replicas[::self.stride]) * self.stride


def test_a_router_by_import_path_runs_with_its_options(tmp_path):
    tr = resolve_trace("sharegpt-like", num_requests=60, rate=40.0, seed=0)
    cfg = SimConfig(replicas=4, router="tests.test_router:EveryOther", router_options={"stride": 2})
    res = run_simulation(cfg, tr)
    assert sorted(res.requests.replica.unique()) == [0, 2] and len(res.requests) == 60
    assert (res.requests.status == "finished").all()
    out = tmp_path / "run"
    assert cli_main(["simulate", "--replicas", "3", "--router", "tests.test_router:EveryOther", "--router-arg",
                     "stride=3", "--trace", "sharegpt-like", "--num-requests", "20", "--rate", "5",
                     "--out", str(out), "--quiet"]) == 0
    assert set(pd.read_csv(out / "requests.csv").replica) == {0}


@pytest.mark.parametrize("spec,options,word", [
    ("no_such_module:X", {}, "cannot import module 'no_such_module'"),
    ("policies.router:Nope", {}, "has no attribute 'Nope'"),
    ("policies.request:Request", {}, "is not a concrete Router"),
    ("policies.router:Router", {}, "is not a concrete Router"),  # abstract
    ("fastest", {}, "unknown router 'fastest'; known: round-robin"),
    ("tests.test_router:EveryOther", {"strides": 2}, "unknown parameter 'strides' for router"),
    ("least-loaded", {"max_imbalance": 2}, "unknown parameter 'max_imbalance'"),
])
def test_bad_router_specs_are_named_before_simulating(spec, options, word):
    with pytest.raises(ValueError, match=word):
        SimConfig(replicas=2, router=spec, router_options=options)


def test_router_arg_needs_key_value(tmp_path, capsys):
    assert cli_main(["simulate", "--replicas", "2", "--router-arg", "stride", "--num-requests", "5", "--rate", "1",
                     "--out", str(tmp_path / "run")]) != 0
    assert "--router-arg 'stride': expected key=value" in capsys.readouterr().err


class Answers(Router):
    """Answers whatever it is given (a misbehaving plug-in)."""

    name = "answers"

    def __init__(self, answer=0) -> None:
        self.answer = answer

    def route(self, request: Request, replicas) -> int:
        return self.answer


@pytest.mark.parametrize("answer,word", [(5, "picked replica 5 of 2"), (-1, "picked replica -1 of 2"),
                                         (1.0, "answered 1.0 \\(float\\)"), (None, "answered None"),
                                         (True, "answered True \\(bool\\)")])
def test_a_router_answering_no_replica_index_is_named(answer, word):
    tr = resolve_trace("sharegpt-like", num_requests=5, rate=5.0, seed=0)
    cfg = SimConfig(replicas=2, router="tests.test_router:Answers", router_options={"answer": answer})
    with pytest.raises(RuntimeError, match=word):
        run_simulation(cfg, tr)


def test_a_router_may_answer_a_numpy_integer():
    tr = resolve_trace("sharegpt-like", num_requests=5, rate=5.0, seed=0)
    cfg = SimConfig(replicas=2, router="tests.test_router:Answers", router_options={"answer": np.int64(1)})
    assert set(run_simulation(cfg, tr).requests.replica) == {1}


@settings(max_examples=200, deadline=None, derandomize=True)
@given(loads=st.lists(st.integers(0, 4), min_size=1, max_size=20), last=st.integers(-1, 25))
def test_least_loaded_pick_is_the_first_least_loaded_after_the_last_pick(loads, last):
    n = len(loads)
    order = [(last + 1 + k) % n for k in range(n)]  # from the one after the last pick, wrapping round
    assert least_loaded(loads, last) == next(i for i in order if loads[i] == min(loads))


@settings(max_examples=200, deadline=None, derandomize=True)
@given(loads=st.lists(st.integers(0, 4), min_size=1, max_size=20), last=st.integers(-1, 25), data=st.data())
def test_least_loaded_picker_among_candidates_is_the_old_min_over_them(loads, last, data):
    """LeastLoaded.pick_among: the least loaded candidate, ties to the first after `last` (the
    min by (load, distance after last) that _pick took before), and `pick` remembers its pick."""
    n = len(loads)
    candidates = data.draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=n, unique=True))
    picker = LeastLoaded()
    picker.last = last
    expected = min(candidates, key=lambda i: (loads[i], (i - last - 1) % n))
    assert picker.pick_among(loads, candidates) == expected and picker.last == last
    assert picker.pick(loads) == least_loaded(loads, last) == picker.last
