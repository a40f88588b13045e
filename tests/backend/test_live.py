"""The live executor runs the policies' schedulers unchanged on SmolLM2: outputs do not depend on
preemption (recompute or swap), prefix caching or the policy; beam search matches HF."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from backend.live_executor import build_live_replica
from backend.model_runner import ModelRunner
from backend.replay import replay_prompt_ids, serve, synthetic_prompt_ids
from policies import Request, SamplingParams
from policies.replica_config import ReplicaConfig

PROMPTS = [
    [1, 504, 3575, 282, 4649, 314],                       # short
    [1, 2683, 13756, 30, 411, 28, 5248, 253, 1535, 28, 314, 3417, 327, 3726, 8223, 30, 1202, 29, 2151],
    [504, 2421, 5365, 314, 253, 1476, 28, 3314, 5429],
]


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    from backend.tokenizer import GGUFTokenizer
    return GGUFTokenizer.from_gguf(smollm2_path)


def run(smollm2, prompts, policy="vllm", num_blocks=64, block_size=16, num_cpu=0, max_tokens=12,
        sampling=None, **kw):
    config, weights = smollm2
    runner = ModelRunner(config, weights, "cpu", dtype=torch.float32, num_gpu_blocks=num_blocks,
                         num_cpu_blocks=num_cpu, block_size=block_size)
    replica = build_live_replica(ReplicaConfig(num_blocks, block_size, policy, num_cpu_blocks=num_cpu, **kw), runner,
                                 [config.eos_token_id])
    sp = sampling or SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    reqs = [Request(i, 0.0, len(p), sp, prompt_token_ids=list(p)) for i, p in enumerate(prompts)]
    result = serve(replica, reqs, realtime=False)
    outs = {g.group_id: [s.token_ids[g.request.prompt_len:] for s in g.finished_seqs] for g in result.groups}
    return outs, replica.scheduler, result


@pytest.fixture(scope="module")
def baseline(smollm2):
    outs, sched, _ = run(smollm2, PROMPTS)
    assert sched.num_preemptions == 0
    return outs


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_does_not_change_greedy_outputs(smollm2, baseline, mode):
    outs, sched, _ = run(smollm2, PROMPTS, num_blocks=5, block_size=8, num_cpu=16, preemption=mode)
    assert sched.num_preemptions > 0, "the tiny cache should force preemption"
    assert outs == baseline


def test_prefix_caching_and_chunked_prefill_do_not_change_outputs(smollm2, baseline):
    shared = PROMPTS + [PROMPTS[1][:16] + [7, 8, 9]]
    ref, _, _ = run(smollm2, shared)
    outs, sched, _ = run(smollm2, shared, prefix_caching=True, chunked_prefill=True, max_num_batched_tokens=16)
    assert sched.bm.prefix_hits > 0
    assert outs == ref
    assert {k: ref[k] for k in baseline} == baseline


@pytest.mark.parametrize("policy", ["orca-max", "static"])
def test_contiguous_policies_give_the_same_outputs(smollm2, baseline, policy):
    outs, _, _ = run(smollm2, PROMPTS, policy=policy, num_blocks=128)
    assert outs == baseline


def test_request_larger_than_cache_is_rejected_others_run(smollm2, baseline):
    big = [list(range(300, 300 + 200))]
    outs, _sched, result = run(smollm2, PROMPTS + big, num_blocks=12)
    rejected = [g for g in result.groups if g.rejected]
    assert [g.group_id for g in rejected] == [3]
    assert {k: outs[k] for k in baseline} == baseline


def test_beam_search_through_the_scheduler_matches_hf(smollm2, hf_smollm2):
    prompt = PROMPTS[0]
    sp = SamplingParams(max_tokens=6, beam_width=3)
    _, _, result = run(smollm2, [prompt], sampling=sp, num_blocks=32, block_size=4)
    ours = result.beam_results[0][0][0]
    hf = hf_smollm2.generate(torch.tensor([prompt]), num_beams=3, max_new_tokens=6, do_sample=False,
                             early_stopping=False, length_penalty=1.0, num_return_sequences=1)
    assert ours == hf[0, len(prompt):].tolist()


def test_parallel_sampling_is_seeded_and_shares_the_prompt(smollm2):
    sp = SamplingParams(max_tokens=5, n=3, temperature=1.0, ignore_eos=True)
    a, _sched, _ = run(smollm2, [PROMPTS[1]], sampling=sp)
    b, _, _ = run(smollm2, [PROMPTS[1]], sampling=sp)
    assert a == b and len(a[0]) == 3 and all(len(o) == 5 for o in a[0])


def test_parallel_samples_with_a_one_token_limit_stop_at_one(smollm2):
    sp = SamplingParams(max_tokens=1, n=3, temperature=1.0, ignore_eos=True)
    outs, sched, _ = run(smollm2, [PROMPTS[0]], sampling=sp)
    assert len(outs[0]) == 3 and all(len(o) == 1 for o in outs[0])
    sched.bm.assert_empty()


def test_synthetic_prompt_ids_follow_prefix_hashes():
    a = Request(0, 0.0, 40, prefix_hashes=(11, 12, 13), hash_block_size=16)
    b = Request(1, 0.0, 40, prefix_hashes=(11, 12, 99), hash_block_size=16)
    ia, ib = synthetic_prompt_ids(a, 1000), synthetic_prompt_ids(b, 1000)
    assert len(ia) == 40 and ia[:32] == ib[:32] and ia[32:] != ib[32:]


def test_a_trace_with_token_ids_replays_its_own_ids_within_the_vocabulary():
    # was: live replay replaced a trace's own ids with synthetic ones (and so never saw a bad one)
    assert replay_prompt_ids(Request(0, 0.0, 3, prompt_token_ids=[5, 6, 7]), 1000) == [5, 6, 7]
    assert len(replay_prompt_ids(Request(1, 0.0, 3), 1000)) == 3  # length only: synthetic
    with pytest.raises(ValueError, match=r"request 2: prompt token id 1000 is outside the model's vocabulary"):
        replay_prompt_ids(Request(2, 0.0, 2, prompt_token_ids=[1, 1000]), 1000)
