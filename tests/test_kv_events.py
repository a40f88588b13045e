"""KV-cache events (backend/kv_events.py) from the real block manager behind an emulated engine:
what the stream says the cache holds is what the block pool's prefix cache holds, hash for hash;
stored blocks carry their token ids and parent hash as the block manager chains them; evictions
and clears are reported in order; late subscribers get a consistent snapshot or a replay."""

from __future__ import annotations

import time

import numpy as np
import pytest

from backend.kv_events import MASK64, KvEventLog, apply_events
from policies.block_manager import BlockPool
from policies.replica_config import build_replica
from policies.request import Request, SamplingParams
from sim.emulated import EmulatedExecutor, PacedClock
from sim.run import SimConfig, build_cost_model

pytest.importorskip("starlette")
CFG = SimConfig(model="llama-7b", hardware="h100-sxm", calibration="vllm-v1-h100", max_num_seqs=8,
                max_num_batched_tokens=512, num_gpu_blocks=40, prefix_caching=True)
BS = CFG.block_size


def _run(prompts: list[list[int]], max_tokens: int = 5):
    """The prompts through an emulated engine (one after another) with a KV-event log attached."""
    from backend.async_engine import AsyncEngine, EngineRequest

    executor = EmulatedExecutor(build_cost_model(CFG), list(range(500, 600)), seed=0)
    replica = build_replica(CFG.replica(), executor)
    sched = replica.scheduler
    log = KvEventLog(sched.bm, sched.seqs)
    log.attach()
    clock = PacedClock(500.0)
    clock.on_lag = lambda *_: log.seal(clock.now())
    batches = []
    first, _ = log.subscribe(batches.append, since=0)
    batches.extend(first)
    engine = AsyncEngine(replica, clock=clock)
    engine.start()
    done: list[int] = []
    for i, ids in enumerate(prompts):  # one after another: each finds the cache its predecessors left
        engine.submit(EngineRequest(Request(i, 0.0, len(ids), SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                                            prompt_token_ids=ids), lambda o: done.append(o.finished)))
        while sum(done) <= i:
            assert engine.alive, engine.error
            time.sleep(0.002)
    engine.stop(drain=True, timeout=30)
    assert engine.error is None
    return sched, log, sorted(batches, key=lambda b: b.seq)


def _replay(batches) -> set[int]:
    held: set[int] = set()
    for b in batches:
        apply_events(held, b.events)
    return held


def _chain(tokens: list[int], parent: int = 0) -> list[int]:
    """The block manager's documented hashes of a token-id prompt's full blocks."""
    out = []
    for j in range(len(tokens) // BS):
        parent = hash((parent, tuple(tokens[j * BS:(j + 1) * BS])))
        out.append(parent)
    return out


def test_stored_blocks_are_the_prefix_caches_with_tokens_and_parents():
    rng = np.random.default_rng(5)
    prompt = rng.integers(100, 30000, 3 * BS + 5).tolist()
    sched, log, batches = _run([prompt])
    assert [b.seq for b in batches] == list(range(len(batches)))  # numbered, none missing
    assert batches[0].events == [("AllBlocksCleared",)]
    held = _replay(batches)
    assert held == {h & MASK64 for h in sched.bm.pool.cached} == log.held
    stored = [e for b in batches for e in b.events if e[0] == "BlockStored"]
    first = stored[0]  # the prompt's full blocks, in one event, chained from no parent
    assert first[1] == [h & MASK64 for h in _chain(prompt)] and first[2] is None
    assert first[3] == prompt[:3 * BS]
    for e in stored[1:]:  # blocks filled later (prompt tail + output) continue the chain
        assert len(e[3]) == BS * len(e[1]) and e[2] in held


def test_evictions_are_reported_and_the_stream_stays_in_step():
    """Distinct prompts through a 40-block cache: older cached blocks are evicted (BlockRemoved),
    and replaying the batches gives exactly the pool's cached hashes at the end."""
    rng = np.random.default_rng(6)
    prompts = [rng.integers(100, 30000, 8 * BS).tolist() for _ in range(8)]
    sched, log, batches = _run(prompts)
    removed = [h for b in batches for e in b.events if e[0] == "BlockRemoved" for h in e[1]]
    assert sched.bm.pool.evictions > 0 and len(removed) == sched.bm.pool.evictions
    held: set[int] = set()
    for e in (e for b in batches for e in b.events):  # each removal is of a hash stored before and held
        if e[0] == "BlockStored":
            held.update(e[1])
        elif e[0] == "BlockRemoved":
            assert set(e[1]) <= held
            held.difference_update(e[1])
    assert (_chain(prompts[0])[0] & MASK64) in removed  # the least recently used prompt's blocks went
    assert _replay(batches) == {h & MASK64 for h in sched.bm.pool.cached}
    # a subscriber joining now: a snapshot that says the same, numbered as the last batch
    late, _ = log.subscribe(lambda b: None)
    assert late[0].snapshot and late[0].seq == batches[-1].seq and _replay(late) == log.held
    again, _ = log.subscribe(lambda b: None, since=3)  # still buffered: a replay from 3
    assert [b.seq for b in again] == list(range(3, batches[-1].seq + 1))


def test_clear_cache_only_when_idle_and_reported():
    pool = BlockPool(4)
    seen = []

    class Listener:
        def stored(self, block, h):
            seen.append(("stored", block.block_id, h))

        def removed(self, h):
            seen.append(("removed", h))

        def cleared(self):
            seen.append(("cleared",))

    pool.listener = Listener()
    (b,) = pool.take_ids(1)
    pool.register(pool.blocks[b], 77)
    assert not pool.clear_cache() and pool.cached == {77: b}  # a block in use: refused, nothing changes
    pool.release_ids([b])
    for _ in range(4):  # takes the never-cached blocks first, then evicts the cached one
        pool.take_ids(1)
    assert seen == [("stored", b, 77), ("removed", 77)]
    pool.release_ids(list(range(4)))
    (c,) = pool.take_ids(1)
    pool.register(pool.blocks[c], 5)
    pool.release_ids([c])  # idle and cached
    assert pool.clear_cache() and pool.cached == {} and seen[-1] == ("cleared",)
    assert sorted(pool.free) == [0, 1, 2, 3] and all(bl.hash is None for bl in pool.blocks)
