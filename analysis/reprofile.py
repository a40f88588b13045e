"""Calibration where the user runs: a profile describes the machine it was measured on, so before a
live validation the machine's speed is measured against the profile (a few of its grid points timed
again, backend.profiler.drift) and, when it is more than `threshold` away, the profile's grid is
timed again here and the same cost model re-fitted (backend.profiler.retime, sim.profiled).

The re-fit is used only if it fitted and its own held-out error is no worse than the given
profile's error on this machine's timings (the same grid points, timed here: what each would get
wrong on this machine, not what the given one got wrong where it was measured); otherwise the given
profile is kept, and the decision says why. Timing and fitting are
parameters, so that the decision is tested without a model."""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from analysis.plots import profile_fit_plot
from sim.profiled import make_profile, prediction_error, save_profile

DEFAULT_THRESHOLD = 0.1
DEFAULT_REPS = 2


def needs_reprofile(speed: float | None, threshold: float | None) -> bool:
    """True when the measured speed (time now / time in the profile) is more than `threshold`
    away from 1; never without a speed or a threshold (None: re-profiling is off)."""
    return speed is not None and threshold is not None and abs(speed - 1) > threshold


@dataclass
class ReprofileDecision:
    """What the speed check decided. `profile` is the profile to simulate with, `path` where it is
    (the given one's source, or the re-fitted file)."""

    given: str                     # the profile the user gave (name or path)
    speed: float | None            # time now / time in the given profile; None: not measured
    threshold: float | None        # None: re-profiling off (--no-reprofile)
    profile: dict[str, Any]
    path: str
    reprofiled: bool = False       # the grid was timed again and re-fitted
    adopted: bool = False          # ... and that profile is the one used
    seconds: float = 0.0           # re-timing and fitting, wall time
    cv_mape: float | None = None   # the re-fit's held-out error
    given_cv_mape: float | None = None  # the given profile's held-out error where it was measured
    given_error_here: float | None = None  # the given profile's error on this machine's timings
    reason: str = ""               # why the given profile was kept after a re-fit

    def record(self) -> dict[str, Any]:
        """The decision for validation.json."""
        return {"given_profile": self.given, "speed": self.speed, "threshold": self.threshold,
                "reprofiled": self.reprofiled, "adopted": self.adopted, "profile": self.path,
                "seconds": round(self.seconds, 1), "cv_mape": self.cv_mape, "given_cv_mape": self.given_cv_mape,
                "given_error_here": self.given_error_here, "reason": self.reason or None}

    def message(self) -> str | None:
        """One line saying what was done and why; None when nothing was (no drift, or off)."""
        if not self.reprofiled:
            return None
        why = (f"this machine ran {self.speed:.2f}x the step times of profile {self.given} "
               f"(more than {self.threshold:.0%} away)")
        if self.adopted:
            here = "" if self.given_error_here is None else f"; {self.given} on the same timings: {self.given_error_here:.1%}"
            return (f"re-profiled: {why}; re-timed its grid and re-fitted in {self.seconds:.0f} s (held-out error "
                    f"{self.cv_mape:.1%}{here}); simulating with {self.path}")
        return f"re-profiled: {why}, in {self.seconds:.0f} s, but kept {self.given}: {self.reason}"


def decide(given: str, profile: dict[str, Any], speed: float | None, threshold: float | None,
           refit: Callable[[], dict[str, Any]], out_path: str | Path,
           save: Callable[[dict[str, Any], Path], Any] | None = None) -> ReprofileDecision:
    """Re-profile (`refit()` -> a new profile dict) when `needs_reprofile(speed, threshold)`; keep the
    new one, written to `out_path` by `save`, unless the re-fit raised or its held-out error
    (fit.cv_mape) is above the given profile's error on the re-fit's own measurements (this
    machine's timings)."""
    d = ReprofileDecision(given, speed, threshold, profile, str(profile.get("source", given)))
    if not needs_reprofile(speed, threshold):
        return d
    t0 = time.perf_counter()
    d.reprofiled = True
    d.given_cv_mape = profile["fit"].get("cv_mape")
    try:
        new = refit()
    except (ValueError, RuntimeError) as exc:
        d.seconds = time.perf_counter() - t0
        d.reason = f"the re-fit failed ({exc})"
        return d
    d.seconds = time.perf_counter() - t0
    d.cv_mape = new["fit"]["cv_mape"]
    d.given_error_here = prediction_error(profile["fit"]["coef"], new["measurements"], int(new["block_size"]))
    if d.cv_mape > d.given_error_here:
        d.reason = (f"the re-fit's held-out error {d.cv_mape:.1%} is worse than {given}'s error on this machine's "
                    f"timings, {d.given_error_here:.1%}")
        return d
    (save or _save)(new, Path(out_path))
    new["source"] = str(out_path)
    d.adopted, d.profile, d.path = True, new, str(out_path)
    return d


def _save(profile: dict[str, Any], path: Path) -> None:

    save_profile(profile, path)
    profile_fit_plot(profile, path.with_suffix(".png"))


def refit_on(runner: Any, profile: dict[str, Any], reps: int = DEFAULT_REPS, seed: int = 0) -> dict[str, Any]:
    """The profile measured again on `runner`'s machine (backend.profiler.retime) and re-fitted: a
    new profile dict naming where it was measured and what it re-measured."""
    from backend.profiler import environment, retime  # deferred: the backend imports torch

    bs = int(profile["block_size"])
    again = retime(runner, profile["measurements"], bs, reps=reps, seed=seed)
    meta = environment(runner, profile["model"]["name"])
    meta.update(created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                command=f"pagesim validate (re-profiled from {profile.get('source', '?')})",
                reprofiled_from=str(profile.get("source", "?")),
                retimed={"grid_points": again.retimed, "carried_scaled": again.carried,
                         "served_iterations": again.served, "reps": reps, "speed": again.speed,
                         "skipped": again.skipped})
    return make_profile(again.measurements, bs, meta)


def check_and_reprofile(runner: Any, given: str, profile: dict[str, Any], threshold: float | None, out_path: str | Path,
                        reps: int = DEFAULT_REPS, seed: int = 0) -> ReprofileDecision:
    """Measure this machine's speed against `profile` on `runner` (off when `threshold` is None)
    and re-profile when it is more than `threshold` away (`decide`)."""
    speed = None
    if threshold is not None:
        from backend.profiler import drift  # deferred: the backend imports torch
        # the first pass pays one-time costs (compiling the points' shapes: measured at 43x the
        # profile on a fresh runner against 4.7x just after); the second is the machine's speed
        drift(runner, profile["measurements"], reps=1, seed=seed)
        speed = drift(runner, profile["measurements"], seed=seed)
    return decide(given, profile, speed, threshold, lambda: refit_on(runner, profile, reps, seed), out_path)
