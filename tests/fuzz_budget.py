"""How long the fuzzing property tests search: modest example counts in `make test`; the long fuzz
(`make test-deep`, for changes to the scheduler or skip-ahead windows) sets PAGESIM_FUZZ_EXAMPLES, and
PAGESIM_FUZZ_SEED picks another example stream."""

from __future__ import annotations

import os


def _env_int(name: str, default: int, minimum: int) -> int:
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{name}={text!r}: not an integer") from None
    if value < minimum:
        raise ValueError(f"{name}={value}: must be at least {minimum}")
    return value


def fuzz_examples(default: int) -> int:
    """PAGESIM_FUZZ_EXAMPLES when set (a positive integer), else `default` (the suite's count)."""
    return _env_int("PAGESIM_FUZZ_EXAMPLES", default, 1)


def fuzz_seed() -> int:
    """PAGESIM_FUZZ_SEED when set, else 0 (hypothesis's derandomized stream)."""
    return _env_int("PAGESIM_FUZZ_SEED", 0, 0)
