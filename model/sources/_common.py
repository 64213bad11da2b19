"""Reading a small JSON object file (a config) with a size limit, every failure as the caller's error type."""

from __future__ import annotations

import json
from pathlib import Path


def read_json_object(path: Path, max_bytes: int, what: str, error: type[Exception]) -> dict:
    """``path``'s JSON object; ``error`` naming the file when it is larger than ``max_bytes``, unreadable,
    not JSON, or not an object (checked before anything is parsed where the size allows)."""
    try:
        size = path.stat().st_size
        if size > max_bytes:
            raise error(f"{path}: {size:,} bytes is far too large for {what}")
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise error(f"{path}: not valid JSON ({e})") from None
    except OSError as e:
        raise error(f"{path}: cannot be read ({e})") from None
    if not isinstance(raw, dict):
        raise error(f"{path}: expected a JSON object, got {type(raw).__name__}")
    return raw
