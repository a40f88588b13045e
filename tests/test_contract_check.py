"""--debug's contract check (sim/contract_check.py): a plug-in policy or router that breaks its
contract is named, with the decision that changed; one that keeps it, and every built-in, is not."""

from __future__ import annotations

from collections.abc import Sequence

import pandas as pd
import pytest

from pagesim.cli import main as cli_main
from policies.queue_policy import QueuePolicy
from policies.request import Request, SequenceGroup
from policies.router import LeastLoadedRouter
from sim.contract_check import ContractError
from sim.run import SimConfig, run_simulation
from traces import resolve_trace


class LeastServedFirst(QueuePolicy):
    """The client served the fewest decode tokens first, counted as served: a key that reads the
    policy's own state while declaring that it reads the request only (breaks the contract)."""

    name = "least-served"
    reads = "request"

    def __init__(self) -> None:
        self.served: dict[str, int] = {}

    def key(self, group: SequenceGroup) -> tuple:
        return (self.served.get(group.request.client, 0), group.request.arrival, group.group_id)

    def on_served(self, group: SequenceGroup, prefill_tokens: int, decode_tokens: int) -> None:
        self.served[group.request.client] = self.served.get(group.request.client, 0) + decode_tokens


class DeclaredLeastServedFirst(LeastServedFirst):
    """The same order, declared: its key reads the policy's state at every read."""

    name = "least-served-declared"
    reads = "state"

    def key(self, group: SequenceGroup) -> tuple:
        return super().key(group)


class KvPeekingRouter(LeastLoadedRouter):
    """Least loaded, ties to the emptier cache, read behind its counts-only view's back (breaks the
    contract: blocks a window allocated ahead of the clock show early)."""

    name = "kv-peeking"

    def route(self, request: Request, replicas: Sequence) -> int:
        return min(range(len(replicas)),
                   key=lambda i: (replicas[i].outstanding, replicas[i]._scheduler.kv_usage(), i))


def _trace():
    return resolve_trace("multi-client", num_requests=200, rate=12.0, seed=2)


def _cfg(**kw) -> SimConfig:
    return SimConfig(debug=True, num_gpu_blocks=kw.pop("num_gpu_blocks", 600), **kw)


def test_a_key_reading_undeclared_state_is_named_with_the_decision():
    with pytest.raises(ContractError, match=r"^LeastServedFirst\.key changed while a skip-ahead "
                                            r"window ran: request \d+ admitted at iteration \d+ .* when stepping, "
                                            r"\d+ .* with windows.*reads = 'request'"):
        run_simulation(_cfg(policy=f"{__name__}:LeastServedFirst"), _trace())


def test_the_same_key_declared_runs_and_equals_stepping():
    cfg = _cfg(policy=f"{__name__}:DeclaredLeastServedFirst")
    checked = run_simulation(cfg, _trace())
    assert checked.summary["engine"]["contract_checked"]
    plain = run_simulation(SimConfig(**{**cfg.to_dict(), "debug": False}), _trace())
    pd.testing.assert_frame_equal(checked.requests, plain.requests, check_exact=True)


def test_a_router_reading_behind_its_view_is_named():
    with pytest.raises(ContractError, match=r"KvPeekingRouter\.route changed while a skip-ahead window ran: "
                                            r"request \d+ went to replica \d when stepping, \d with windows.*"
                                            r"reads = 'counts'"):
        run_simulation(_cfg(replicas=3, router=f"{__name__}:KvPeekingRouter"), _trace())


@pytest.mark.parametrize("kw", [{"policy": "vtc"}, {"policy": "sjf", "policy_options": {"predictor": "fitted"}},
                                {"replicas": 3, "router": "least-loaded"}])
def test_builtins_pass_the_check(kw):
    assert run_simulation(_cfg(**kw), _trace()).summary["engine"]["contract_checked"]


def test_simulate_debug_reports_a_broken_policy_in_one_line(tmp_path, capsys):
    rc = cli_main(["simulate", "--debug", "--policy", f"{__name__}:LeastServedFirst", "--trace", "multi-client",
                   "--num-requests", "200", "--rate", "12", "--seed", "2", "--num-gpu-blocks", "600",
                   "--out", str(tmp_path / "run"), "--quiet"])
    # the compiled kernel also says once that it cannot check stale reads (documented, not the error)
    err = [line for line in capsys.readouterr().err.strip().splitlines()
           if "not checked with the compiled kernel" not in line]
    assert rc == 2 and len(err) == 1
    assert "LeastServedFirst.key changed while a skip-ahead window ran" in err[0]


def test_a_difference_under_builtins_only_is_called_a_simulator_bug():
    from sim.contract_check import Deciders, Difference, describe

    its = pd.DataFrame({"start": [0.0, 1.0, 2.0], "duration": [1.0, 1.0, 1.0]})
    msg = describe(Difference(7, "first_scheduled", 1.0, 2.0, 1.0), Deciders(QueuePolicy, "VllmScheduler", None,
                   policy_builtin=True), its, its)
    assert msg.startswith("skip-ahead differs from stepping under the built-in QueuePolicy (a simulator bug): "
                          "QueuePolicy.key changed while a skip-ahead window ran: request 7 admitted at iteration 1 "
                          "(t=1 s) when stepping, 2 (t=2 s) with windows")
    assert msg.endswith("please report it with the run's configuration")
