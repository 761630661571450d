"""Writing a benchmark's JSON results (shared by the scripts in ``benchmarks/``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_results(path: str | Path, result: Any) -> None:
    """``result`` as indented JSON at ``path`` (folders created; what JSON cannot hold as its
    ``str``), and a line saying where."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, default=str))
    print(f"wrote {out}")
