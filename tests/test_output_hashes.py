"""Output blocks are hashed as vLLM V1 hashes them (issue 26): every full block of a sequence, output
included, so that a sequence preempted by recompute and readmitted finds its own prompt AND output
blocks that were not evicted meanwhile, never another request's output. Simulated tokens carry no
id: they are named by who generated them (Sequence.output_origins), forks inheriting the positions
before the fork point. The running batch names its members' filled blocks when they are
materialised; stepping (which names each block as it fills) must give the same tables.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from policies.block_manager import PagedBlockManager
from policies.request import Sequence
from sim.run import SimConfig, run_simulation
from tests.test_policies_unit import decode, fork, group, prefill
from traces.trace import Trace

BS = 4


def _prompt(kind: str, prompt_len: int, rid: int) -> dict:
    """A prompt of `prompt_len` tokens with content private to `rid`: token ids, or prefix hashes
    (one per block of BS tokens, the last one partial when BS does not divide the length)."""
    if kind == "ids":
        return {"ids": [rid * 1000 + j for j in range(prompt_len)]}
    return {"prefix_hashes": tuple(hash((rid, j)) for j in range(-(-prompt_len // BS))), "hash_block_size": BS}


def _preempt_and_readmit(bm: PagedBlockManager, seq: Sequence) -> int:
    """A recompute preemption of a decoder holding one sampled, uncomputed token, then its
    readmission: the tokens the prefix cache gives it back."""
    seq.append(None)
    bm.free(seq)
    seq.num_computed = 0
    return bm.allocate(seq)


@pytest.mark.parametrize("kind", ["ids", "hashes"])
@pytest.mark.parametrize("prompt_len", [8, 6])
def test_readmitted_sequence_hits_its_own_output_blocks(kind, prompt_len):
    """Prompt of 8 (2 full blocks) or 6 tokens (the second block holds 2 prompt and 2 output tokens),
    10 decoded tokens, then one sampled token uncomputed at the preemption: 16 + 1 or 17 + 1 tokens.
    vLLM never hits the last token: (num_tokens - 1) // BS = 4 blocks, i.e. 16 tokens, hit again;
    prompt-only hashing gave back 8 (prompt 8) or 4 (prompt 6)."""
    bm = PagedBlockManager(32, block_size=BS, enable_prefix_caching=True)
    seq = group(prompt_len, 20, rid=7, **_prompt(kind, prompt_len, 7)).seqs[0]
    prefill(bm, seq)
    for _ in range(10):
        decode(bm, seq)
    full_blocks = (seq.num_tokens + 1 - 1) // BS  # after the sampled token the preemption adds
    assert full_blocks == 4
    assert _preempt_and_readmit(bm, seq) == full_blocks * BS
    assert bm.prefix_hits == full_blocks
    bm.check_invariants()


@pytest.mark.parametrize("kind", ["ids", "hashes"])
def test_another_request_never_hits_an_output_block(kind):
    """Two requests with the same prompt and the same output length: the second finds the first's
    prompt blocks cached, none of its output blocks (their tokens are the first's own)."""
    bm = PagedBlockManager(32, block_size=BS, enable_prefix_caching=True)
    prompt = _prompt(kind, 8, 3)
    a = group(8, 20, rid=1, **prompt).seqs[0]
    prefill(bm, a)
    for _ in range(10):
        decode(bm, a)
    bm.free(a)  # finished: its 4 full blocks stay cached, idle
    assert len(bm.pool.cached) == 4
    b = group(8, 20, rid=2, **prompt).seqs[0]
    for _ in range(a.output_len + 1):  # as long as a was, as if b were readmitted
        b.append(None)
    assert bm.allocate(b) == 8  # the 2 prompt blocks only
    bm.check_invariants()


def test_fork_shares_hashes_before_the_fork_point_only():
    """Prompt 8, 6 decoded tokens, then a fork at position 14 and 6 more tokens each (20 tokens, 5
    full blocks): blocks 0-2 (positions 0-11) are the same content for parent and child, block 3
    (12-15) holds 2 shared and 2 own tokens, block 4 is each one's own. Each, readmitted, hits all 5
    of its blocks; a restart from the prompt names its new outputs anew."""
    bm = PagedBlockManager(32, block_size=BS, enable_prefix_caching=True)
    parent = group(8, 20, n=2, rid=5, **_prompt("hashes", 8, 5)).seqs[0]
    prefill(bm, parent)
    for _ in range(6):
        decode(bm, parent)
    child = fork(bm, parent)
    for _ in range(6):
        decode(bm, parent)
        decode(bm, child)
    ph, ch = parent.block_hashes, child.block_hashes
    assert len(ph) == len(ch) == 5
    assert ph[:3] == ch[:3] and ph[3] != ch[3] and ph[4] != ch[4]
    assert bm.block_table(parent.seq_id)[:3] == bm.block_table(child.seq_id)[:3]
    assert len(bm.pool.cached) == 3 + 2 + 2
    for s in (parent, child):
        assert _preempt_and_readmit(bm, s) == 5 * BS
    bm.check_invariants()
    # restart (a forked group preempted without swap space): the outputs are sampled again
    bm.free(parent)
    old = list(parent.block_hashes)
    parent.output_len = 0
    parent.num_computed = 0
    del parent.block_hashes[8 // BS:]
    parent.restart_origins(1)
    prefill(bm, parent)
    for _ in range(12):
        decode(bm, parent)
    assert parent.block_hashes[:2] == old[:2] and not set(parent.block_hashes[2:5]) & set(old)
    bm.check_invariants()


def _own_prompts_trace(n: int, seed: int) -> Trace:
    """Requests whose prompts share nothing (each its own prefix hashes), all arriving at once: a
    prefix hit can only be a request's own blocks, found again after a preemption."""
    rng = np.random.default_rng(seed)
    prompt = rng.integers(40, 200, n)
    hashes = [tuple(hash((i, j)) for j in range(-(-int(p) // 16))) for i, p in enumerate(prompt)]
    return Trace(arrival=np.sort(rng.uniform(0, 0.5, n)), prompt_len=prompt, output_len=rng.integers(40, 300, n),
                 prefix_hashes=hashes, hash_block_size=16, name="own-prompts")


@pytest.mark.parametrize("n", [1, 2])
def test_skip_ahead_equals_stepping_when_preempted_sequences_hit_their_outputs(n):
    """A cache small enough that decoders preempt one another, prompts that share nothing: stepping
    (each block named as it fills) and skip-ahead (a member's blocks named when it is materialised)
    give the same tables, every iteration checked (debug), with windows that preempt (n = 1);
    readmitted sequences find more than
    their prompts' full blocks, i.e. their own output blocks (n = 2: forks, restarted from the
    prompt when preempted)."""
    trace = _own_prompts_trace(40, seed=1)
    cfg = SimConfig(model="llama-7b", hardware="h100-sxm", num_gpu_blocks=160, prefix_caching=True,
                    max_num_seqs=24, n=n, debug=True)
    fast = run_simulation(cfg, trace)
    stepped = run_simulation(dataclasses.replace(cfg, fast_forward=False), trace)
    engine = fast.summary["engine"]
    assert engine["skip_windows"] > 0 and (n > 1 or engine["preempting_in_windows"] > 0)
    for col in fast.requests.columns:
        assert fast.requests[col].equals(stepped.requests[col]), col
    assert fast.iterations.equals(stepped.iterations)
    req = fast.requests
    prompt_blocks_bound = req.num_preemptions * ((req.prompt_len - 1) // 16 * 16)
    if n == 1:
        assert (req.prefix_hit_tokens > prompt_blocks_bound).any()
    else:  # restarts recompute from the prompt: only prompt blocks come back
        assert req.num_preemptions.sum() > 0 and (req.prefix_hit_tokens <= prompt_blocks_bound).all()


def test_simulate_and_emulated_engine_schedule_the_same_iterations():
    """tests/test_emulate's request set with seed 8 (ids prompts, a 40-block cache, preemptions under
    prefix caching): the emulated engine's tokens have real ids, hashed as vLLM does, and at
    f20764e it found one block of its own output more than `simulate` (whose outputs were not
    hashed), so the iterations' durations differed. Now both schedule and price the same."""
    emulate = pytest.importorskip("tests.test_emulate")
    trace = emulate._trace(seed=8)
    engine, _ = emulate._emulated_tables(trace, time_scale=20.0)
    req, its = engine.tables()
    sim = run_simulation(emulate.CFG, trace)
    assert its.num_seqs.tolist() == sim.iterations.num_seqs.tolist()
    np.testing.assert_allclose(its.duration, sim.iterations.duration, rtol=1e-12)
    s = sim.requests.set_index("request_id").loc[req.request_id]
    for col in ("prefix_hit_tokens", "num_preemptions", "first_token_time", "finish_time"):
        np.testing.assert_allclose(req[col].to_numpy(float), s[col].to_numpy(float), rtol=1e-9, atol=1e-9)
    assert req.num_preemptions.sum() > 0


def test_a_lengths_only_prompt_is_private_to_its_request():
    """A prompt known by its length only (no ids, no prefix hashes) is named by its request: readmitted
    after a recompute it finds its own prompt and output blocks, as vLLM finds a random prompt's; a
    second lengths-only request of the same length finds nothing of the first's."""
    bm = PagedBlockManager(32, block_size=BS, enable_prefix_caching=True)
    seq = group(8, 20, rid=7).seqs[0]
    prefill(bm, seq)
    for _ in range(10):
        decode(bm, seq)
    assert _preempt_and_readmit(bm, seq) == 4 * BS  # (8 + 10 + 1 - 1) // 4 full blocks, as with content
    other = group(8, 20, rid=8).seqs[0]
    assert bm.allocate(other) == 0
    assert bm.prefix_hits == 4
    bm.check_invariants()
