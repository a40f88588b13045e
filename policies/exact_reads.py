"""--debug's check that nobody outside the scheduler reads a sequence's owed fields (issue 23).

A member of a scheduler's running batch (policies/running_batch.py) keeps counters that are `owed`
decode steps behind the batch's clock: `num_computed`, `output_len` (and so `num_tokens`) and
`token_ids` are the scheduler's own while owed. Readers outside the scheduler use the exact
properties (`Sequence.exact_output_len`, ...) or read after the scheduler's `materialise()`.

`guard(seq)` (the running batch calls it for its members once `RunningBatch.guard_reads()` was
called, which the paged scheduler's debug check does) gives the sequence a class whose owed fields
check their reader: a read while the sequence owes steps, from code outside the scheduler's
modules (SCHEDULER_MODULES), raises StaleReadError naming the field, the sequence and the reader.
Reads of an exact sequence (owing nothing, or not a member) pass whoever reads, and writes are
never checked. It costs nothing unless called: a sequence keeps its own class otherwise.

The check swaps the instance's class to an interpreted subclass, which only an interpreted
`Sequence` takes (compiled code checks the exact class): with the compiled kernel (`make compiled`)
`guard` returns False and the running batch says once that reads are not checked
(PAGESIM_COMPILED=0 runs the sources).
"""

from __future__ import annotations

import sys
from types import FrameType
from typing import Any

from policies.request import Sequence

# the modules whose code may read a member's stored fields while owed: they know what is owed
SCHEDULER_MODULES = frozenset({
    "policies.request", "policies.running_batch", "policies.block_manager", "policies.scheduler",
    "policies.vllm_scheduler", "policies.step", __name__,
})
# the owed fields, and the stored properties computed from them (a frame of theirs is skipped)
OWED_FIELDS = ("num_computed", "output_len", "token_ids")
_DERIVED = {"num_tokens"}


class StaleReadError(ValueError):
    """Code outside the scheduler read a field a running-batch member owes (a plug-in that reads
    stale state is bad input: the command line reports it as one line)."""


def _reader(frame: FrameType | None, field: str) -> tuple[str, str, FrameType | None]:
    """(the field as read, the reader's module, its frame): frames of stored properties derived
    from `field` (Sequence.num_tokens) are walked past, naming that property instead."""
    while frame is not None and frame.f_globals.get("__name__") == "policies.request" \
            and frame.f_code.co_name in _DERIVED:
        field = frame.f_code.co_name
        frame = frame.f_back
    module = frame.f_globals.get("__name__", "?") if frame is not None else "?"
    return field, str(module), frame


def _check(seq: Sequence, field: str, frame: FrameType | None) -> None:
    field, module, f = _reader(frame, field)
    if module in SCHEDULER_MODULES:
        return
    where = (f"{module}.{f.f_code.co_qualname} ({f.f_code.co_filename}:{f.f_lineno})" if f is not None
             else module)
    batch = seq.batch
    clock = batch.clock if batch is not None else seq.anchor
    raise StaleReadError(
        f"{where} read Sequence.{field} of sequence {seq.seq_id} (request {seq.group.group_id}) while it owes "
        f"{clock - seq.anchor} decode steps to the running batch (stored at clock {seq.anchor}, now {clock}): "
        f"outside the scheduler read seq.exact_{field}, or call the scheduler's materialise() first "
        "(--debug checks every read of an owed field)")


def _guarded_field(name: str) -> property:
    raw: Any = Sequence.__dict__[name]  # the slot's own descriptor

    def get(seq: Sequence) -> Any:
        batch = seq.batch
        if batch is not None and batch.clock != seq.anchor:
            _check(seq, name, sys._getframe(1))
        return raw.__get__(seq, Sequence)

    def set_(seq: Sequence, value: Any) -> None:
        raw.__set__(seq, value)

    return property(get, set_, doc=f"Sequence.{name}, its reader checked while owed (--debug)")


def _guarded_class() -> type | None:
    """Sequence with its owed fields checked, or None when Sequence is compiled (its compiled
    callers take no subclass of it)."""
    source = getattr(sys.modules.get(Sequence.__module__), "__file__", None) or ""
    if not source.endswith(".py"):
        return None
    try:
        ns: dict[str, Any] = {name: _guarded_field(name) for name in OWED_FIELDS}
        ns["__slots__"] = ()
        ns["__module__"] = __name__
        ns["__doc__"] = "A Sequence whose owed fields check their reader (--debug; see policies.exact_reads)."
        return type("GuardedSequence", (Sequence,), ns)
    except (TypeError, KeyError):  # compiled: no interpreted subclass (nor, maybe, slot descriptors)
        return None


GUARDED = _guarded_class()


def guard(seq: Sequence) -> bool:
    """Check every later read of the sequence's owed fields (see module); False when this build
    cannot (the compiled kernel)."""
    if GUARDED is None:
        return False
    if type(seq) is not GUARDED:
        try:
            seq.__class__ = GUARDED
        except TypeError:
            return False
    return True
