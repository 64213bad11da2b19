"""What one app server lets its browser sessions hold together: a memory budget for all their traces and a
cap on how many sessions it serves at once.

Each session sets its own trace budget (Budget (MB) in the sidebar, at most 8 GiB); nothing else stops three
heavy sessions from holding more than the machine has. So the server keeps one ledger: a session reserves its
generation's budget (plus the values of a trace file it opened) before it starts, and is refused, with the
numbers, when that would take the server past its total. A session that ends — its tab closed and Streamlit's
cleanup done (``server.disconnectedSessionTTL`` in the server settings) — is forgotten, and the memory its
trace freed is handed back to the system (``memory.return_freed_memory``).

Settings, read from the environment each time they are used (``gpt-shape-tracer app --server-budget-mb …
--max-sessions …`` sets them):

- ``GPT_SHAPE_TRACER_SERVER_BUDGET_MB``: MiB of traces for all sessions together; default half of the
  machine's physical memory (the model, Python and the browser need the rest);
- ``GPT_SHAPE_TRACER_MAX_SESSIONS``: sessions served at once; default 8 (on a 2-core machine, 8 sessions
  already made each Step take seconds in a load test).

Pure Python, no Streamlit: ``gui/server.py`` wires it to the server's sessions.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

BUDGET_ENV = "GPT_SHAPE_TRACER_SERVER_BUDGET_MB"
SESSIONS_ENV = "GPT_SHAPE_TRACER_MAX_SESSIONS"
DEFAULT_MAX_SESSIONS = 8
FALLBACK_BUDGET_MB = 8192  # where the machine's memory cannot be read
MiB = 2**20


def machine_memory_bytes() -> int | None:
    """Physical memory of this machine, or None where the system does not say."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, ValueError, OSError):
        return None


@dataclass(frozen=True)
class ServerLimits:
    budget_bytes: int  # traces of all sessions together
    max_sessions: int

    @classmethod
    def from_environment(cls, env: Mapping[str, str] | None = None) -> ServerLimits:
        """The limits the environment sets, the defaults elsewhere; ``ValueError`` naming a bad setting."""
        env = os.environ if env is None else env
        memory = machine_memory_bytes()
        default_mb = memory // 2 // MiB if memory else FALLBACK_BUDGET_MB
        return cls(budget_bytes=whole_from_env(env, BUDGET_ENV, default_mb) * MiB,
                   max_sessions=whole_from_env(env, SESSIONS_ENV, DEFAULT_MAX_SESSIONS))


def whole_from_env(env: Mapping[str, str], name: str, default: int,
                   error: type[ValueError] = ValueError) -> int:
    """The positive whole number the variable ``name`` holds (``default`` when unset or blank), else ``error``
    naming the variable and what it holds (the server's limits and the runs folder read theirs alike)."""
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise error(f"{name}={raw!r}: expected a whole number") from None
    if value < 1:
        raise error(f"{name}={raw!r}: must be at least 1")
    return value


def _advice(free: int, fixed: int, budget_times: int) -> str:
    """What would fit: the largest Budget (MB) whose ``budget_times`` shares, beside the ``fixed`` bytes that do
    not follow the budget (an opened file, a gradients trace already recorded), fit in ``free``."""
    wait = "wait for another session to reset or close."
    if budget_times < 1 or fixed >= free:
        return wait[0].upper() + wait[1:]
    largest = (free - fixed) // budget_times // MiB
    if budget_times > 1:  # a running generation's budget changes only with a Reset
        return (f"Reset with Budget (MB) in the sidebar at most {largest:,} (it is counted {budget_times} times here: "
                f"the generation's values and its gradients'), or {wait}")
    return f"Lower Budget (MB) in the sidebar to at most {largest:,}, or {wait}"


class SessionLedger:
    """Which sessions the server serves and what each has reserved, under one lock (sessions run in threads
    of their own)."""

    def __init__(self, limits=ServerLimits.from_environment) -> None:
        self._limits = limits  # called on every check: the settings may change while the server runs
        self._lock = threading.Lock()
        self._reserved: dict[str, int] = {}  # session id → bytes

    @property
    def limits(self) -> ServerLimits:
        return self._limits()

    def admit(self, session: str) -> str:
        """"" when ``session`` is (or now becomes) one of the sessions served; else why not."""
        limits = self._limits()
        with self._lock:
            if session in self._reserved:
                return ""
            if len(self._reserved) >= limits.max_sessions:
                return (f"This server already serves {len(self._reserved)} session(s), its limit "
                        f"({SESSIONS_ENV}={limits.max_sessions}): every session shares its cores and memory. "
                        "Try again when one closes (a closed tab is released within a minute).")
            self._reserved[session] = 0
            return ""

    def reserve(self, session: str, nbytes: int, budget_times: int = 1, fixed: int = 0) -> str:
        """Set ``session``'s reservation to ``nbytes``: "" when the server's total allows it (then it is
        held), else why not, with the numbers (and the session keeps what it held). ``nbytes`` is ``budget_times``
        times the sidebar's Budget (MB) (a generation: once; a generation and the gradients trace being recorded:
        twice) plus ``fixed`` bytes that do not follow it, so that the budget advised is one that fits."""
        limits = self._limits()
        with self._lock:
            others = sum(held for s, held in self._reserved.items() if s != session)
            if others + nbytes > limits.budget_bytes:
                free = max(0, limits.budget_bytes - others)
                busy = sum(1 for s, held in self._reserved.items() if s != session and held)
                return (f"This server keeps at most {limits.budget_bytes // MiB:,} MiB of traces for all its sessions "
                        f"together ({BUDGET_ENV}); {busy} other session(s) hold {others // MiB:,} MiB, so this one "
                        f"can have {free // MiB:,} MiB, not {nbytes // MiB:,}. "
                        + _advice(free, fixed, budget_times))
            self._reserved[session] = nbytes
            return ""

    def held(self) -> int:
        with self._lock:
            return sum(self._reserved.values())

    def sessions(self) -> list[str]:
        with self._lock:
            return list(self._reserved)

    def forget_all_but(self, alive: Iterable[str]) -> list[str]:
        """Forget every session not in ``alive`` (the server's own list); returns those forgotten."""
        keep = set(alive)
        with self._lock:
            gone = [s for s in self._reserved if s not in keep]
            for s in gone:
                del self._reserved[s]
        return gone
