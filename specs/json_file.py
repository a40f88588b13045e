"""A spec file read as JSON, its failures as one line naming the file (and the line)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_json(path: Path) -> Any:
    """The JSON at `path`; a ValueError "<path>: cannot read: ..." or "<path>: line N: not valid JSON: ..."."""
    try:
        return json.loads(path.read_text(encoding="utf-8-sig"))  # past a byte-order mark, as traces
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: cannot read: {e}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: line {e.lineno}: not valid JSON: {e.msg}") from None
