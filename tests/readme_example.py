"""The complete policy example of docs/policies.md, written to a module that tests import (the page is
the source: a test fails if the example stops working)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

POLICIES_PAGE = Path(__file__).resolve().parents[1] / "docs" / "policies.md"


def install_readme_policy(folder: Path) -> str:
    """Write docs/policies.md's `my_policies.py` example into `folder`, put it on sys.path, and return the
    `module:Class` spec of its policy class."""
    text = POLICIES_PAGE.read_text()
    m = re.search(r"<!-- example: my_policies.py -->\s*```python\n(.*?)```", text, re.S)
    if m is None:
        raise AssertionError("docs/policies.md lost its my_policies.py example")
    code = m.group(1)
    if len(code.strip().splitlines()) > 25:
        raise AssertionError("the policy example of docs/policies.md should stay within 25 lines")
    (folder / "my_policies.py").write_text(code)
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
    sys.modules.pop("my_policies", None)
    cls = re.search(r"^class (\w+)\(QueuePolicy\)", code, re.M).group(1)
    return f"my_policies:{cls}"
