"""Every built-in policy, and the own-policy example of docs/policies.md, running live on SmolLM2: the same
scheduler objects as in simulation, on the real model, with the policy's rule visible in the run."""

from __future__ import annotations

import pandas as pd
import pytest

torch = pytest.importorskip("torch")

from backend.live_executor import build_live_replica
from backend.model_runner import ModelRunner
from backend.replay import serve
from pagesim.cli import main as cli_main
from policies import Request, SamplingParams
from policies.replica_config import ReplicaConfig
from policies.request_rows import request_frame
from tests.readme_example import install_readme_policy

# (prompt ids, output tokens, client, priority): all four queue at once and run one at a time
# (max_num_seqs=1), so each policy's order shows in their first-scheduled times
WORK = [
    ([1, 504, 3575, 282, 4649, 314], 6, "a", 2),
    ([1, 2683, 13756, 30, 411, 28, 5248, 253, 1535, 28, 314], 8, "a", 2),
    ([504, 2421, 5365, 314, 253, 1476, 28, 3314, 5429], 2, "a", 0),
    ([1, 504, 3575, 282], 4, "b", 1),
]


@pytest.fixture(scope="module")
def runner(smollm2):
    """One runner for the module (eager attention: nothing to compile); each run's scheduler owns
    the block ids and overwrites what it uses."""
    config, weights = smollm2
    return ModelRunner(config, weights, "cpu", attention="torch", num_gpu_blocks=32, block_size=16)


def run_live(smollm2, runner, policy: str, **options):
    config, _ = smollm2
    replica = build_live_replica(ReplicaConfig(32, 16, policy, max_num_seqs=1, policy_options=options), runner,
                                 [config.eos_token_id])
    reqs = [Request(i, 0.0, len(p), SamplingParams(max_tokens=out, ignore_eos=True), out, list(p), client=c,
                    priority=pr) for i, (p, out, c, pr) in enumerate(WORK)]
    run = serve(replica, reqs, realtime=False)
    replica.scheduler.bm.assert_empty()  # every block back in the pool
    frame = request_frame(run.groups)
    assert len(frame) == len(WORK)
    return frame.set_index("request_id")


def order(frame: pd.DataFrame) -> list[int]:
    done = frame[frame.status == "finished"]
    return done.sort_values(["first_scheduled", "first_token_time"]).index.tolist()


@pytest.mark.parametrize("policy,options,expected", [
    ("vllm", {}, [0, 1, 2, 3]),
    ("priority", {}, [2, 3, 0, 1]),                 # by the priority column, then arrival
    ("sjf", {"predictor": "oracle"}, [2, 3, 0, 1]),  # by true output length
    ("srpt", {"predictor": "oracle"}, [2, 3, 0, 1]),
    ("vtc", {}, [0, 3, 1, 2]),                      # client b goes next: a was served first
])
def test_each_policy_orders_the_live_queue(smollm2, runner, policy, options, expected):
    frame = run_live(smollm2, runner, policy, **options)
    assert (frame.status == "finished").all()
    assert (frame.output_len == [w[1] for w in WORK]).all()
    assert order(frame) == expected


def test_edf_rejects_live_requests_whose_deadline_passed(smollm2, runner):
    frame = run_live(smollm2, runner, "edf", slo_ttft=1e-4)
    assert frame.status[0] == "finished"  # admitted at once, its deadline not yet passed
    assert (frame.status[1:] == "rejected").all()  # they waited behind it past theirs
    assert frame.reject_reason[1:].str.contains("deadline").all()


def test_the_readme_policy_example_runs_live(smollm2_path, tmp_path):
    spec = install_readme_policy(tmp_path)
    out = tmp_path / "live"
    trace = tmp_path / "tiny.csv"
    trace.write_text("arrival,prompt_len,output_len\n0.0,24,4\n0.0,8,3\n0.01,16,2\n")
    assert cli_main(["live", "--policy", spec, "--policy-arg", "max_wait=20", "--trace", str(trace),
                     "--no-realtime", "--model", "smollm2-135m", "--num-gpu-blocks", "128",
                     "--attention", "torch", "--out", str(out), "--quiet"]) == 0
    req = pd.read_csv(out / "requests.csv").set_index("request_id")
    assert len(req) == 3 and (req.status == "finished").all()
    assert req.first_scheduled[1] <= req.first_scheduled[0]  # the shorter prompt first
