"""Suite-wide test setup: hypothesis's profiles.

`make test` draws deterministically (the "pagesim" profile: derandomized, no example database, no
deadline on a loaded machine), so a run's examples are the same on every machine and every run.
`make test-deep` selects the "deep" profile with `--hypothesis-profile deep --hypothesis-seed N`: the
tests that do not fix their own stream draw a seeded random one, and PAGESIM_FUZZ_EXAMPLES
(tests/fuzz_budget.py) raises the long fuzz's example counts."""

from __future__ import annotations

from hypothesis import settings

settings.register_profile("pagesim", derandomize=True, database=None, deadline=None, print_blob=True)
settings.register_profile("deep", derandomize=False, database=None, deadline=None, print_blob=True)
settings.load_profile("pagesim")  # --hypothesis-profile, applied after this file is read, overrides it
