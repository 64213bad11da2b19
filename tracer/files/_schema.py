"""One declared schema for what a trace file's manifest may hold, checked before anything is built.

Every value read from a file passes through one of these checkers: a wrong
type, a number out of range or a list longer than its bound is refused with a
``TraceFileError`` that names the field (``generation.steps[3].forward.t``),
never an AttributeError or a multi-gigabyte allocation. Numbers that size
things are bounded here, and checked again against what the file actually
contains by ``tracer.files._load``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


class TraceFileError(ValueError):
    """A trace file that is malformed, inconsistent, too large, or of an unknown version."""

    def __init__(self, message: str, field: str = "") -> None:
        super().__init__(f"{field}: {message}" if field else message)
        self.field = field


class Check:
    def __call__(self, value: Any, where: str) -> Any:
        raise NotImplementedError


def _name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


@dataclass(frozen=True)
class Number(Check):
    """A JSON number in [lo, hi]: whole (``Int``) or not (``Float``), finite unless ``finite=False`` (then the
    strings "nan", "inf" and "-inf" stand for what JSON cannot write)."""

    lo: float = 0
    hi: float = 2**53
    whole: bool = True
    finite: bool = True

    def __call__(self, value: Any, where: str) -> int | float:
        if not self.finite and value in ("nan", "inf", "-inf"):
            value = float(value)
        ok = (isinstance(value, int) if self.whole else isinstance(value, (int, float)))
        if isinstance(value, bool) or not ok:
            kind = "a whole number" if self.whole else "a number"
            raise TraceFileError(f"expected {kind}, got {_name(value)} {str(value)[:40]!r}", where)
        if not self.whole:
            value = float(value)
            if self.finite and not math.isfinite(value):
                raise TraceFileError(f"expected a finite number, got {value}", where)
        if not (isinstance(value, float) and math.isnan(value)) and not self.lo <= value <= self.hi:
            raise TraceFileError(f"{value} is outside [{self.lo}, {self.hi}]", where)
        return value


def Int(lo: int = 0, hi: int = 2**53) -> Number:  # noqa: N802 - reads like the other checks
    return Number(lo, hi, whole=True)


def Float(lo: float = -math.inf, hi: float = math.inf, finite: bool = True) -> Number:  # noqa: N802
    return Number(lo, hi, whole=False, finite=finite)


@dataclass(frozen=True)
class Str(Check):
    max_len: int = 10_000

    def __call__(self, value: Any, where: str) -> str:
        if not isinstance(value, str):
            raise TraceFileError(f"expected text, got {_name(value)}", where)
        if len(value) > self.max_len:
            raise TraceFileError(f"text of {len(value)} characters, over the limit of {self.max_len}", where)
        return value


@dataclass(frozen=True)
class Bool(Check):
    def __call__(self, value: Any, where: str) -> bool:
        if not isinstance(value, bool):
            raise TraceFileError(f"expected true or false, got {_name(value)}", where)
        return value


@dataclass(frozen=True)
class OneOf(Check):
    values: tuple

    def __call__(self, value: Any, where: str) -> Any:
        if value not in self.values or isinstance(value, bool) != isinstance(self.values[0], bool):
            raise TraceFileError(f"{str(value)[:40]!r} is not one of {', '.join(map(repr, self.values))}", where)
        return value


@dataclass(frozen=True)
class Maybe(Check):
    inner: Check

    def __call__(self, value: Any, where: str) -> Any:
        return None if value is None else self.inner(value, where)


@dataclass(frozen=True)
class ListOf(Check):
    item: Check
    max_len: int

    def __call__(self, value: Any, where: str) -> tuple:
        if not isinstance(value, list):
            raise TraceFileError(f"expected a list, got {_name(value)}", where)
        if len(value) > self.max_len:
            raise TraceFileError(f"{len(value)} entries, over the limit of {self.max_len} by "
                                 f"{len(value) - self.max_len}", where)
        return tuple(self.item(v, f"{where}[{i}]") for i, v in enumerate(value))


@dataclass(frozen=True)
class TupleOf(Check):
    items: tuple[Check, ...]

    def __call__(self, value: Any, where: str) -> tuple:
        if not isinstance(value, list) or len(value) != len(self.items):
            raise TraceFileError(f"expected a list of {len(self.items)} entries, got {_name(value)}"
                                 + (f" of {len(value)}" if isinstance(value, list) else ""), where)
        return tuple(check(v, f"{where}[{i}]") for i, (check, v) in enumerate(zip(self.items, value)))


@dataclass(frozen=True)
class Obj(Check):
    fields: dict[str, Check]
    optional: frozenset[str] = frozenset()
    open: bool = False  # whether other keys are allowed (passed on unchecked: the caller checks them)

    def __call__(self, value: Any, where: str) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise TraceFileError(f"expected an object, got {_name(value)}", where)
        if not self.open:
            extra = sorted(set(value) - set(self.fields))
            if extra:
                raise TraceFileError(f"unexpected field(s) {', '.join(map(str, extra[:5]))}", where)
        out = {}
        for key, check in self.fields.items():
            sub = f"{where}.{key}" if where else key
            if key not in value:
                if key in self.optional:
                    continue
                raise TraceFileError("missing", sub)
            out[key] = check(value[key], sub)
        if self.open:
            out.update({k: v for k, v in value.items() if k not in self.fields})
        return out


@dataclass(frozen=True)
class Then(Check):
    """A check, then a conversion of its result (to a dataclass, say)."""

    check: Check
    convert: Callable[[Any], Any]

    def __call__(self, value: Any, where: str) -> Any:
        checked = self.check(value, where)
        try:
            return self.convert(checked)
        except (TypeError, ValueError) as e:
            raise TraceFileError(str(e), where) from None
