"""`--debug`'s contract check: the same run simulated twice, stepping every iteration and skipping
ahead, compared request by request and iteration by iteration.

Skip-ahead applies iterations before the clock reaches them, trusting what a queue policy and a
router declare about when their answers may change (policies/queue_policy.py, policies/router.py).
The built-in ones keep their word, so skip-ahead equals stepping bit for bit. A plug-in that does
not (a key that reads the policy's own state under `reads = "request"`, a router that reads more
than its view) would give different numbers without a word; under --debug the first difference is
a ContractError naming the class and the decision that changed. Invariant: `check_contract`
returns the skip-ahead run's result only when both runs' request and iteration tables are equal.

A plug-in that reads a running sequence's stored fields while skip-ahead owes it decode steps is
stopped before any comparison: the debug run's invariant check guards those fields
(policies/exact_reads.py), and the read raises StaleReadError naming the field and the reader.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import pandas as pd

from policies.queue_policy import QueuePolicy


class ContractError(ValueError):
    """A policy or router whose answers changed while skip-ahead ran iterations ahead of the clock (a
    plug-in that breaks its contract is bad input: the command line reports it as one line)."""


@dataclass(frozen=True)
class Deciders:
    """Who decides in a run: the queue policy's class (None for a Scheduler of its own, named by
    `scheduler`) and the router's class name (None: one replica) with its declared view; whether
    each ships with pagesim (a difference under built-ins only is the simulator's bug)."""

    policy: type[QueuePolicy] | None
    scheduler: str
    router: str | None = None
    router_reads: str | None = None
    policy_builtin: bool = False
    router_builtin: bool = True


# per-request columns compared; the first three say when they happened (routing at arrival,
# admission, rejection), the others not (a preemption's time is not recorded)
_TIMED = ("replica", "status", "first_scheduled")
_UNTIMED = ("num_preemptions", "finish_time", "reject_reason")


@dataclass(frozen=True)
class Difference:
    """The earliest difference: request `request_id`'s `column`, stepping's value and skip-ahead's."""

    request_id: int
    column: str
    stepped: Any
    windowed: Any
    at: float  # the simulated time it shows
    replicas: tuple[Any, Any] = (None, None)  # the request's replica in each run (None: one replica)


def check_contract(cfg: Any, run: Callable[[Any], Any], deciders: Deciders) -> Any:
    """Run `run(cfg)` stepping (fast_forward off) and skipping ahead; the skip-ahead result when the
    two agree, else a ContractError describing the first difference."""
    stepped = run(replace(cfg, fast_forward=False))
    windowed = run(cfg)
    diff = first_request_difference(stepped.requests, windowed.requests,
                                    divergence(stepped.iterations, windowed.iterations))
    if diff is not None:
        raise ContractError(describe(diff, deciders, stepped.iterations, windowed.iterations))
    row = first_iteration_difference(stepped.iterations, windowed.iterations)
    if row is not None:
        raise ContractError(f"{_who(deciders)}the requests agree with stepping but the iteration log differs at "
                            f"{row}. {_advice(deciders)}")
    windowed.summary.setdefault("engine", {})["contract_checked"] = True
    return windowed


def _differs(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    if x.dtype.kind == "f" and y.dtype.kind == "f":
        return ~((x == y) | (np.isnan(x) & np.isnan(y)))
    return x != y


def divergence(stepped: pd.DataFrame, windowed: pd.DataFrame) -> float:
    """When the two iteration logs first differ: the end of the earliest differing iteration over
    all replicas (inf when they agree)."""
    if "replica" in stepped.columns:
        pairs = [(stepped[stepped.replica == r], windowed[windowed.replica == r]) for r in stepped.replica.unique()]
    else:
        pairs = [(stepped, windowed)]
    first = math.inf
    for a, b in pairs:
        n = min(len(a), len(b))
        rows = np.zeros(n, dtype=bool)
        for column in a.columns:
            rows |= _differs(a[column].to_numpy()[:n], b[column].to_numpy()[:n])
        i = int(np.argmax(rows)) if rows.any() else (n if len(a) != len(b) else -1)
        if i < 0:
            continue
        ends = [float(f.start.iloc[i] + f.duration.iloc[i]) for f in (a, b) if i < len(f)]
        first = min(first, *ends)
    return first


def first_request_difference(stepped: pd.DataFrame, windowed: pd.DataFrame,
                             diverged: float = math.inf) -> Difference | None:
    """The difference that caused the others, or None. A timed one (routing, admission, rejection)
    at or before `diverged` (when the iteration logs first differ), the earliest; else the earliest
    untimed one (preemptions, finishes), by the earlier finish."""
    a = stepped.set_index("request_id").sort_index()
    b = windowed.set_index("request_id").sort_index()
    if not a.index.equals(b.index):
        rid = a.index.symmetric_difference(b.index)[0]
        return Difference(int(rid), "request_id", rid in a.index, rid in b.index, 0.0)
    found: list[tuple[float, int, int, str]] = []
    for rank, column in enumerate(_TIMED + _UNTIMED):
        if column not in a.columns:
            continue
        for rid in a.index[_differs(a[column].to_numpy(), b[column].to_numpy())]:
            found.append((_shows_at(column, a.loc[rid], b.loc[rid]), rank, int(rid), column))
    if not found:
        return None
    timed = [f for f in found if f[3] in _TIMED and f[0] <= diverged]
    at, _, rid, column = min(timed or found)
    replicas = (_plain(a.loc[rid, "replica"]), _plain(b.loc[rid, "replica"])) if "replica" in a.columns else (None, None)
    return Difference(rid, column, _plain(a.loc[rid, column]), _plain(b.loc[rid, column]), at, replicas)


def _plain(value: Any) -> Any:
    """numpy's scalars as Python's (they print as np.int64(4) otherwise)."""
    return value.item() if isinstance(value, np.generic) else value


def _shows_at(column: str, a: pd.Series, b: pd.Series) -> float:
    """When a difference in `column` shows: routing at arrival, admission at the earlier one,
    anything else (a rejection among them) at the earlier finish or, without one, admission."""
    if column == "replica":
        return float(a["arrival"])
    keys = ("first_scheduled",) if column == "first_scheduled" else ("finish_time", "first_scheduled")
    for key in keys:
        times = [float(t) for t in (a[key], b[key]) if not math.isnan(float(t))]
        if times:
            return min(times)
    return float(a["arrival"])


def first_iteration_difference(stepped: pd.DataFrame, windowed: pd.DataFrame) -> str | None:
    """'iteration i[ of replica r]: column c is x when stepping, y with windows', or None."""
    if len(stepped) != len(windowed) or list(stepped.columns) != list(windowed.columns):
        return f"the logs' sizes ({len(stepped)} iterations stepping, {len(windowed)} with windows)"
    for column in stepped.columns:
        x, y = stepped[column].to_numpy(), windowed[column].to_numpy()
        differs = ~((x == y) | (pd.isna(x) & pd.isna(y))) if x.dtype.kind == "f" else x != y
        if differs.any():
            i = int(np.argmax(differs))
            where = f" of replica {stepped['replica'].iloc[i]}" if "replica" in stepped.columns else ""
            return f"iteration {i}{where}: {column} is {x[i]!r} when stepping, {y[i]!r} with windows"
    return None


def _iteration(iterations: pd.DataFrame, replica: Any, t: float) -> int:
    """The index, within its replica's log, of the iteration running at time t."""
    its = iterations if "replica" not in iterations.columns else iterations[iterations.replica == replica]
    return max(int(np.searchsorted(its.start.to_numpy(), t, side="right")) - 1, 0)


def _who(d: Deciders) -> str:
    """'' when a plug-in decides (the message names it), else the built-ins' preamble."""
    if not (d.policy_builtin and d.router_builtin):
        return ""
    names = [d.policy.__name__ if d.policy is not None else d.scheduler] + ([d.router] if d.router else [])
    return f"skip-ahead differs from stepping under the built-in {' and '.join(names)} (a simulator bug): "


def _decision(diff: Difference, d: Deciders) -> str:
    """The decision a first difference points at, as Class.method."""
    if diff.column == "replica" and d.router is not None:
        return f"{d.router}.route"
    p = d.policy
    if p is None:
        return f"{d.scheduler}.schedule"
    if diff.column in ("status", "reject_reason"):
        return f"{p.__name__}.admit"
    if diff.column == "num_preemptions" and p.victim is not QueuePolicy.victim:
        return f"{p.__name__}.victim"
    own_key, own_admit = p.key is not QueuePolicy.key, p.admit is not QueuePolicy.admit
    if own_admit and not own_key:
        return f"{p.__name__}.admit"
    return f"{p.__name__}.key" + (" or admit" if own_admit else "")


def _advice(d: Deciders) -> str:
    """What the plug-ins of the run must keep to, or where to report a built-in's difference."""
    if d.policy_builtin and d.router_builtin:
        return "please report it with the run's configuration"
    parts = []
    if d.policy is not None and not d.policy_builtin:
        parts.append(f"{d.policy.__name__} declares reads = {d.policy.reads!r}: key, admit and on_queued may read the "
                     "policy's own state only under 'state-when-queued' or 'state', and admit may change by itself "
                     "only at wake_time (policies/queue_policy.py)")
    elif d.policy is None and not d.policy_builtin:
        parts.append(f"{d.scheduler}'s plan_repeat must offer only iterations that stepping would run the same way")
    if d.router is not None and not d.router_builtin:
        parts.append(f"{d.router} must read only the view it declares, reads = {d.router_reads!r} (policies/router.py)")
    return "; ".join(parts)


def describe(diff: Difference, d: Deciders, stepped_its: pd.DataFrame, windowed_its: pd.DataFrame) -> str:
    """One message: the class and decision, the request and what differed, and what to declare."""
    rid, s, w = diff.request_id, diff.stepped, diff.windowed
    if diff.column == "replica":
        what = f"request {rid} went to replica {s} when stepping, {w} with windows"
    elif diff.column == "first_scheduled" and not (math.isnan(s) or math.isnan(w)):
        ra, rb = diff.replicas
        what = (f"request {rid} admitted at iteration {_iteration(stepped_its, ra, s)} (t={s:.6g} s) when "
                f"stepping, {_iteration(windowed_its, rb, w)} (t={w:.6g} s) with windows")
    else:
        what = f"request {rid}'s {diff.column} is {s!r} when stepping, {w!r} with windows"
    return (f"{_who(d)}{_decision(diff, d)} changed while a skip-ahead window ran: {what} "
            f"(--debug simulated the run with and without skip-ahead). {_advice(d)}")
