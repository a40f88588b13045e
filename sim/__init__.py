"""The SimPy simulator over the policies."""

import policies  # noqa: F401  # first: its guard keeps a stale compiled build of sim modules from loading
