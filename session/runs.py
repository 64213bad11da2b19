"""The app's runs folder: each browser session's generation, kept on disk under an unguessable run id so that a
reload, a dropped connection or a server restart loses nothing.

A run is a folder ``<runs dir>/<run id>/`` holding ``run.json`` (what to start again: the model chosen, the
sidebar's settings as their widgets hold them, how many steps ran, the step and the view on screen) and
``trace.zip`` (the generation's trace in the project's file format, ``tracer.save_trace``; read back with
``tracer.load_trace``, which checks every field: nothing in the folder is ever unpickled). The run id is
``secrets.token_urlsafe(16)`` (128 random bits) and is checked against its alphabet before it names a path.

An Engine tab's run (continuous batching, ``session.engine``) is a run of the same folder, of kind ``"engine"``:
its ``run.json`` holds the engine form's values, the engine step and the picks on screen and each request's
generated text, and ``engine.zip`` holds the run (``tracer.save_engine_run``; read back with
``tracer.load_engine_run``, which checks every field and the run against itself, within bounded sizes).

The folder is private: created owner-only (0700), every file written owner-only (0600) to a temporary name
and moved into place, so a reader never sees half a file. It is bounded: the newest ``keep`` runs are kept
and at most ``budget`` bytes of them (the oldest go first); a trace larger than the whole budget is not
written (``run.json`` is, and the run is started again from its settings).

Settings, read from the environment each time (``gpt-shape-tracer app --runs-dir … --keep-runs …`` sets them):

- ``GPT_SHAPE_TRACER_RUNS_DIR``: the folder; default ``$XDG_DATA_HOME/gpt-shape-tracer/runs``
  (``~/.local/share/gpt-shape-tracer/runs``). Never inside the checkout (refused): a run holds the prompts.
- ``GPT_SHAPE_TRACER_KEEP_RUNS``: runs kept; default 20.
- ``GPT_SHAPE_TRACER_RUNS_MB``: MiB of runs kept together; default 2048.
- ``GPT_SHAPE_TRACER_LIST_ALL_RUNS``: ``1`` lists every run of the folder in each page's "Recent runs" (a
  single-user local server); default ``0``: a page lists only the runs made under its own owner token.

Whose runs: every run records the owner tag (``owner_tag``: a SHA-256 of the owner token, which lives only in
the page's address as ``?owner=…``), and a page's list holds only the runs whose tag is its own; a run id still
opens its run for anyone who has it (the id is the capability).

Pure Python, no Streamlit; ``tracer`` is imported only when a trace is written or read (``gpt-shape-tracer
--help`` imports this module for its flags without torch).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import secrets
import shutil
import stat
import tempfile
import threading
import time
import weakref
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

from gpt_shape_tracer.session import ModelChoice, SettingsError
from gpt_shape_tracer.session.server_limits import whole_from_env

if TYPE_CHECKING:  # the tracer (and torch) is imported only when a trace is written or read
    from gpt_shape_tracer.tracer import TraceWritten

RUNS_DIR_ENV = "GPT_SHAPE_TRACER_RUNS_DIR"
KEEP_RUNS_ENV = "GPT_SHAPE_TRACER_KEEP_RUNS"
RUNS_MB_ENV = "GPT_SHAPE_TRACER_RUNS_MB"
LIST_ALL_RUNS_ENV = "GPT_SHAPE_TRACER_LIST_ALL_RUNS"
DEFAULT_KEEP_RUNS = 20
DEFAULT_RUNS_MB = 2048
MiB = 2**20
CHECKOUT = Path(__file__).resolve().parent.parent  # the folder holding app.py: runs never go in here
RUN_FILE = "run.json"
TRACE_FILE = "trace.zip"
# the steps a run's trace gained after trace.zip was written, one part per write (tracer.files.save_trace_part):
# trace-from-000005.zip holds step 5 on
TRACE_PART = re.compile(r"trace-from-(\d{6})\.zip")
MAX_TRACE_PARTS = 16  # then the whole trace is written again (each part read back costs ~20 ms on a restore)
ENGINE_FILE = "engine.zip"  # an engine run's (kind "engine")
KINDS = ("generation", "engine")
RUN_ID = re.compile(r"[A-Za-z0-9_-]{22}")  # secrets.token_urlsafe(16): 16 bytes as 22 base64url characters
OWNER_TAG = re.compile(r"[0-9a-f]{64}")  # owner_tag: a SHA-256 in hex
MAX_RUN_FILE_BYTES = 256 * 1024  # run.json holds settings and a prompt: anything larger is not one of ours
MAX_TEXT = 64 * 1024  # one setting's text (the prompt box) at most
MAX_TEXTS = 64  # an engine run's texts: one per request (tracer.engine.MAX_REQUESTS)
WRITING_S = 600  # a folder without a record that changed this recently is a run being written: prune leaves it


class RunError(ValueError):
    """A run id, a runs folder or a run file that cannot be used; the message says why."""


def new_run_id() -> str:
    return secrets.token_urlsafe(16)


def checked_run_id(raw: object) -> str:
    """``raw`` when it has the form of a run id (so it names no other path), else a ``RunError``."""
    if not isinstance(raw, str) or not RUN_ID.fullmatch(raw):
        raise RunError("that is not a run id of this app (22 letters, digits, - or _)")
    return raw


def new_owner_token() -> str:
    """A browser's owner token: as unguessable as a run id (it names the runs a page lists)."""
    return secrets.token_urlsafe(16)


def checked_owner_token(raw: object) -> str | None:
    """``raw`` when it has the form of an owner token, else None (the page then makes itself a new one)."""
    return raw if isinstance(raw, str) and RUN_ID.fullmatch(raw) else None


def owner_tag(token: str) -> str:
    """What a run records of its owner: a hash, so that the folder (and a run file read by mistake) never holds
    the token that lists the owner's runs."""
    return hashlib.sha256(token.encode("ascii")).hexdigest()


def flag_from_env(env: Mapping[str, str], name: str, default: bool) -> bool:
    """The yes/no the variable ``name`` holds (1/0, true/false, yes/no, on/off; ``default`` when unset or blank),
    else a ``RunError`` naming it."""
    raw = env.get(name, "").strip().lower()
    if not raw:
        return default
    if raw in ("1", "true", "yes", "on"):
        return True
    if raw in ("0", "false", "no", "off"):
        return False
    raise RunError(f"{name}={env.get(name)!r}: expected 1 or 0 (true/false, yes/no, on/off)")


def default_runs_dir(env: Mapping[str, str]) -> Path:
    data = env.get("XDG_DATA_HOME", "").strip()
    base = Path(data) if data and Path(data).is_absolute() else Path.home() / ".local" / "share"
    return base / "gpt-shape-tracer" / "runs"


@dataclass(frozen=True)
class RunsSettings:
    directory: Path
    keep: int  # runs kept
    budget_bytes: int  # their files together
    list_all: bool = False  # every page lists every run (a single-user server), not only its own

    @classmethod
    def from_environment(cls, env: Mapping[str, str] | None = None) -> RunsSettings:
        """The settings the environment gives, the defaults elsewhere; a ``RunError`` naming a bad one."""
        env = os.environ if env is None else env
        raw = env.get(RUNS_DIR_ENV, "").strip()
        directory = Path(raw).expanduser() if raw else default_runs_dir(env)
        if not directory.is_absolute():
            raise RunError(f"{RUNS_DIR_ENV}={raw!r}: give an absolute path")
        resolved = directory.resolve()
        if resolved == CHECKOUT or resolved.is_relative_to(CHECKOUT):
            raise RunError(f"{RUNS_DIR_ENV}={raw!r} is inside the app's own folder {CHECKOUT}: runs hold your "
                           "prompts and traces; choose a folder outside it")
        return cls(resolved, whole_from_env(env, KEEP_RUNS_ENV, DEFAULT_KEEP_RUNS, RunError),
                   whole_from_env(env, RUNS_MB_ENV, DEFAULT_RUNS_MB, RunError) * MiB,
                   flag_from_env(env, LIST_ALL_RUNS_ENV, False))


Scalar = str | int | float | bool


@dataclass(frozen=True)
class RunRecord:
    """``run.json``: what a run is and where its person was looking."""

    run_id: str
    model: ModelChoice  # session.AppState.model (run.json: its to_json; a run saved before: its model key)
    widgets: dict[str, Scalar]  # the sidebar's settings by widget key (session.SETTING_KEYS)
    n_steps: int  # steps the generation had when it was last written
    step: int  # the step on screen
    view: str  # the tab on screen
    updated: float  # time.time() of the last write
    trace_saved: bool = True  # False: the trace (an engine run: its attention values) was over the folder's budget
    owner: str = ""  # owner_tag of the page that made it ("": written before runs had owners)
    # "generation": the sidebar's generation (widgets: the sidebar's settings; steps: its steps; view: the tab);
    # "engine": the Engine tab's run (widgets: its form and picks; steps: engine steps; view: "Engine")
    kind: str = "generation"
    texts: dict[str, str] = field(default_factory=dict)  # an engine run's generated text by request id

    @property
    def title(self) -> str:
        """The run as a list shows it: the prompt's (an engine run: its first request's) first line, shortened."""
        prompt = str(self.widgets.get("prompt" if self.kind == "generation" else "engine_requests", ""))
        prompt = prompt.strip().split("\n")[0]
        return prompt if len(prompt) <= 48 else prompt[:47] + "…"

    @property
    def requests(self) -> int:
        """An engine run's requests: the lines of its form's request box (one prompt per line)."""
        return sum(1 for line in str(self.widgets.get("engine_requests", "")).split("\n") if line.strip())

    def listed_as(self) -> str:
        """What the run is, as Recent runs lists it: its title, its size and its model."""
        model = self.model.where.rsplit("/", 1)[-1]
        if self.kind == "engine":
            return (f"Engine: {self.title} · {self.requests} request{'s' if self.requests != 1 else ''} · "
                    f"{self.n_steps} engine step{'s' if self.n_steps != 1 else ''} · {model}")
        return f"{self.title} · {self.n_steps} step{'s' if self.n_steps != 1 else ''} · {model}"

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "model": self.model.to_json()}, ensure_ascii=False, allow_nan=False)

    @classmethod
    def from_json(cls, text: str | bytes, run_id: str) -> RunRecord:
        """The record in ``text``, every field checked; a ``RunError`` saying which is wrong."""
        try:
            raw = json.loads(text)
        except (ValueError, UnicodeDecodeError) as e:
            raise RunError(f"run {run_id}: {RUN_FILE} is not JSON ({e})") from None
        except RecursionError:  # nested deeper than Python's recursion limit
            raise RunError(f"run {run_id}: {RUN_FILE} is nested too deeply to be one of ours") from None
        if not isinstance(raw, dict):
            raise RunError(f"run {run_id}: {RUN_FILE} is not an object")

        def get(name: str, kind: type | tuple[type, ...]) -> Any:
            value = raw.get(name)
            if not isinstance(value, kind) or (isinstance(value, bool) and bool not in _as_tuple(kind)):
                raise RunError(f"run {run_id}: {RUN_FILE} field {name!r} is missing or of the wrong type")
            return value

        record = cls(
            run_id=get("run_id", str), model=_model(raw, run_id), widgets=_scalars(get("widgets", dict), run_id),
            n_steps=get("n_steps", int), step=get("step", int), view=get("view", str),
            updated=float(get("updated", (int, float))), trace_saved=get("trace_saved", bool),
            owner=get("owner", str) if "owner" in raw else "",
            kind=get("kind", str) if "kind" in raw else "generation",
            texts=_texts(raw.get("texts", {}), run_id),
        )
        if record.kind not in KINDS:
            raise RunError(f"run {run_id}: {RUN_FILE} field 'kind' is not one of {', '.join(KINDS)}")
        if record.owner and not OWNER_TAG.fullmatch(record.owner):
            raise RunError(f"run {run_id}: {RUN_FILE} field 'owner' is not an owner tag")
        if record.run_id != run_id:
            raise RunError(f"run {run_id}: {RUN_FILE} names another run")
        if not 0 <= record.step < max(1, record.n_steps) or record.n_steps < 0 or not math.isfinite(record.updated):
            raise RunError(f"run {run_id}: {RUN_FILE} holds a step outside its steps")
        if len(record.model.where) > MAX_TEXT or len(record.model.tokenizer) > MAX_TEXT or len(record.view) > 200:
            raise RunError(f"run {run_id}: {RUN_FILE} holds a name too long")
        return record


def _model(raw: dict, run_id: str) -> ModelChoice:
    """The record's model: ``"model"`` as ``ModelChoice.to_json`` wrote it, or the ``"model_key"`` string of a run
    saved before there was one (``ModelChoice.from_json`` reads both)."""
    written: object = raw["model"] if "model" in raw else raw.get("model_key")
    if not isinstance(written, dict) and not (isinstance(written, str) and "model" not in raw):
        raise RunError(f"run {run_id}: {RUN_FILE} field 'model' is missing or of the wrong type")
    try:
        return ModelChoice.from_json(written)
    except SettingsError as e:
        raise RunError(f"run {run_id}: {RUN_FILE} field 'model' is not a model choice ({e})") from None


def _as_tuple(kind: type | tuple[type, ...]) -> tuple[type, ...]:
    return kind if isinstance(kind, tuple) else (kind,)


def _texts(raw: object, run_id: str) -> dict[str, str]:
    """An engine run's texts: at most ``MAX_TEXTS`` of them, each a request id and a text within ``MAX_TEXT``."""
    if not isinstance(raw, dict) or len(raw) > MAX_TEXTS:
        raise RunError(f"run {run_id}: {RUN_FILE} field 'texts' is not an object of at most {MAX_TEXTS} texts")
    for key, value in raw.items():
        if len(key) > 64 or not isinstance(value, str) or len(value) > MAX_TEXT:
            raise RunError(f"run {run_id}: {RUN_FILE} text {key[:64]!r} is not a request's text")
    return dict(raw)


def _scalars(raw: object, run_id: str) -> dict[str, Scalar]:
    if not isinstance(raw, dict):
        raise RunError(f"run {run_id}: {RUN_FILE} holds settings that are not an object")
    out: dict[str, Scalar] = {}
    for key, value in raw.items():
        ok = isinstance(value, (str, int, float, bool)) and (not isinstance(value, float) or math.isfinite(value))
        if not ok or len(key) > 64 or (isinstance(value, str) and len(value) > MAX_TEXT):
            raise RunError(f"run {run_id}: {RUN_FILE} setting {key[:64]!r} is not a plain value")
        out[key] = value
    return out


class RunStore:
    """The runs folder (``RunsSettings``): write, read, list and bound the runs."""

    def __init__(self, settings: RunsSettings) -> None:
        self.settings = settings

    @property
    def directory(self) -> Path:
        return self.settings.directory

    def _folder(self) -> Path:
        """The runs folder, created owner-only; refused when another user owns it."""
        d = self.directory
        d.mkdir(parents=True, exist_ok=True, mode=0o700)
        info = d.stat()
        if info.st_uid != os.getuid():
            raise RunError(f"the runs folder {d} belongs to another user: choose your own ({RUNS_DIR_ENV})")
        if info.st_mode & 0o077:
            d.chmod(0o700)  # ours, but readable by others (made by hand): make it private
        return d

    def run_dir(self, run_id: str) -> Path:
        return self.directory / checked_run_id(run_id)

    def _write_private(self, folder: Path, name: str, write) -> None:
        """``write(path)`` into a temporary owner-only file in ``folder``, then moved to ``name`` in one step."""
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".writing-", suffix=Path(name).suffix)
        os.close(fd)
        try:
            write(Path(tmp))
            os.chmod(tmp, 0o600)
            os.replace(tmp, folder / name)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def save(self, record: RunRecord, trace=None, engine=None) -> list[str]:
        """Write ``record`` (and ``trace``, the generation's, when given and within the budget; or ``engine``, an
        engine run's ``EngineRun``: whole when its values fit the budget, else without them), then bound the
        folder. The record goes last: a run is listed only once its files are all in place. Returns the ids of
        the runs removed to keep within its bounds."""
        from gpt_shape_tracer.tracer import save_engine_run

        folder = self.run_dir(record.run_id)
        self._folder()
        folder.mkdir(exist_ok=True, mode=0o700)
        if trace is not None:
            with _run_lock(str(folder)):
                record, _ = self._write_whole(folder, record, trace)
        if engine is not None:
            if engine.bytes_kept > self.settings.budget_bytes:
                engine = without_values(engine, self.settings.budget_bytes)
                record = replace(record, trace_saved=False)
            self._write_private(folder, ENGINE_FILE, lambda p: save_engine_run(engine, p))
        self._write_private(folder, RUN_FILE, lambda p: p.write_text(record.to_json(), encoding="utf-8"))
        return self.prune(keep=record.run_id)

    def save_steps(self, record: RunRecord, trace):
        """Write a generation's run after a step: the steps its trace gained since this store last wrote the same
        trace under this run id, as a part beside ``trace.zip`` (``tracer.save_trace_part``), while the files on
        disk are those writes and still hold the trace's beginning, within ``MAX_TRACE_PARTS`` and the budget;
        else the whole trace, every part removed first (so that no part is ever read after a first file it does
        not continue). Then the record, then the folder bounded. What was written last is kept per run under the
        run's lock, with the trace's log (weakly), so two pages stepping one run write one at a time and each
        continues only its own files. Returns what the run's trace files hold now (None: the trace was over the
        whole budget and is not written)."""
        from gpt_shape_tracer.tracer import save_trace_part

        folder = self.run_dir(record.run_id)
        self._folder()
        folder.mkdir(exist_ok=True, mode=0o700)
        log = trace.log
        chain = str(folder)
        with _run_lock(chain):
            for folder_name, (held, _) in list(_chains.items()):  # runs whose generation is gone: nothing to continue
                if held() is None:
                    _chains.pop(folder_name, None)
            last = _chains.pop(chain, None)
            after = last[1] if last is not None and last[0]() is log else None
            written: TraceWritten | None
            if (after is not None and after.continued_by(trace) and after.parts == 1 + len(self._parts(record.run_id))
                    and after.parts < MAX_TRACE_PARTS and (folder / TRACE_FILE).is_file()
                    and after.value_bytes + log.bytes_kept <= self.settings.budget_bytes):
                answer: list = []  # what save_trace_part says the files hold
                if not after.holds_all_of(trace):
                    name = f"trace-from-{after.steps:06d}.zip"
                    self._write_private(folder, name, lambda p: answer.append(save_trace_part(trace, p, after)))
                written = answer[0] if answer else after
                _chains[chain] = (weakref.ref(log), written)
            else:
                record, written = self._write_whole(folder, record, trace)
            self._write_private(folder, RUN_FILE, lambda p: p.write_text(record.to_json(), encoding="utf-8"))
        self.prune(keep=record.run_id)
        return written

    def _write_whole(self, folder: Path, record: RunRecord, trace) -> tuple[RunRecord, TraceWritten | None]:
        """The whole trace as ``trace.zip`` (the caller holds the run's lock), every part removed first, the last
        first, so that a write stopped half-way leaves a chain that reads; over the folder's whole budget, none
        (the record says so). What the files hold is kept for ``save_steps`` to continue. Returns the record and
        what the files hold (None: nothing written)."""
        from gpt_shape_tracer.tracer import save_trace_part

        chain = str(folder)
        _chains.pop(chain, None)
        for _, name in reversed(self._parts(record.run_id)):
            (folder / name).unlink(missing_ok=True)
        if trace.log.bytes_kept > self.settings.budget_bytes:
            (folder / TRACE_FILE).unlink(missing_ok=True)
            return replace(record, trace_saved=False), None
        answer: list = []  # what save_trace_part says the file holds
        self._write_private(folder, TRACE_FILE, lambda p: answer.append(save_trace_part(trace, p)))
        _chains[chain] = (weakref.ref(trace.log), answer[0])
        return record, answer[0]

    def _parts(self, run_id: str) -> list[tuple[int, str]]:
        """The run's trace parts on disk, (first step, file name), in order of their first step."""
        folder = self._own_folder(run_id)
        if not folder.is_dir():
            return []
        found = [(int(m.group(1)), p.name) for p in folder.iterdir() if (m := TRACE_PART.fullmatch(p.name))]
        return sorted(found)

    def update_view(self, run_id: str, step: int, view: str, widgets: Mapping[str, Scalar] | None = None) -> bool:
        """Rewrite where the person is looking (a small file: the sliders, the pickers and the tabs call this),
        and the ``widgets`` given (an engine run's picks). False when the run has no record (yet: an engine run's
        is written in the background) or is not one of ours."""
        record = self.record(run_id)
        if record is None:
            return False
        merged = {**record.widgets, **(widgets or {})}
        if (record.step, record.view, record.widgets) == (step, view, merged):
            return True
        updated = replace(record, step=step, view=view, widgets=_scalars(merged, run_id), updated=time.time())
        self._write_private(self.run_dir(run_id), RUN_FILE, lambda p: p.write_text(updated.to_json(),
                                                                                    encoding="utf-8"))
        return True

    def _own_folder(self, run_id: str) -> Path:
        """The run's folder; a ``RunError`` when it is a symbolic link (this app never makes one: it would lead out
        of the runs folder, to whatever it names)."""
        folder = self.run_dir(run_id)
        if folder.is_symlink():
            raise RunError(f"run {run_id}: its folder is a symbolic link, which is not followed")
        return folder

    def _open_regular(self, run_id: str, name: str) -> BinaryIO | None:
        """The run's file ``name`` opened for reading, None when there is none; a ``RunError`` when it is not a
        regular file. Opened without following a link and without waiting: a FIFO named run.json would block an
        open() until something writes to it, and Recent runs opens every run's file on every new page."""
        path = self._own_folder(run_id) / name
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
        except FileNotFoundError:
            return None
        except OSError as e:  # ELOOP: a symbolic link
            raise RunError(f"run {run_id}: {name} cannot be opened ({e.strerror}); a link is not followed") from None
        f = os.fdopen(fd, "rb")
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            f.close()
            raise RunError(f"run {run_id}: {name} is not a regular file")
        return f

    def record(self, run_id: str) -> RunRecord | None:
        """The run's record, None when there is no such run; a ``RunError`` when its file is not one of ours."""
        try:
            f = self._open_regular(run_id, RUN_FILE)
            if f is None:
                return None
            with f:
                data = f.read(MAX_RUN_FILE_BYTES + 1)
        except OSError as e:
            raise RunError(f"run {run_id}: {e.strerror}") from None
        if len(data) > MAX_RUN_FILE_BYTES:
            raise RunError(f"run {run_id}: {RUN_FILE} is larger than {MAX_RUN_FILE_BYTES // 1024} KiB")
        return RunRecord.from_json(data, run_id)

    def trace(self, run_id: str):
        """The run's trace — ``trace.zip`` and the parts written after it (``tracer.files.load_trace_parts``:
        every field checked, each part continuing the files before it) — or None when none was written; a
        ``RunError`` when a file is not a regular file, a ``TraceFileError`` when one is damaged."""
        from gpt_shape_tracer.tracer import TraceFileError, load_trace_parts

        parts = self._parts(run_id)
        if len(parts) >= MAX_TRACE_PARTS:  # this store writes the whole trace again before that many
            raise TraceFileError(f"{len(parts)} trace parts beside {TRACE_FILE}; this app writes at most "
                                 f"{MAX_TRACE_PARTS - 1}: not read")
        names = []
        for name in [TRACE_FILE] + [name for _, name in parts]:
            f = self._open_regular(run_id, name)  # a link or a FIFO in a part's place is refused here
            if f is None:
                if name == TRACE_FILE:
                    return None
                continue  # removed since it was listed: the chain then reads short, and says so
            f.close()
            names.append(name)
        return load_trace_parts([self._own_folder(run_id) / name for name in names])

    def engine(self, run_id: str):
        """The engine run's ``EngineRun`` (``tracer.load_engine_run``: every field and the run's own consistency
        checked, sizes bounded), or None when none was written."""
        from gpt_shape_tracer.tracer import load_engine_run

        path = self.run_dir(run_id) / ENGINE_FILE
        return load_engine_run(path) if path.is_file() else None

    def recent(self, limit: int | None = None, owner: str | None = None) -> list[RunRecord]:
        """The runs whose record reads, newest first: those of the owner tag ``owner`` only, unless it is None or
        the folder's settings list every run."""
        mine = None if owner is None or self.settings.list_all else owner
        records = []
        for run_id in self._ids():
            try:
                record = self.record(run_id)
            except RunError:
                continue
            if record is not None and (mine is None or record.owner == mine):
                records.append(record)
        records.sort(key=lambda r: r.updated, reverse=True)
        return records[:limit] if limit is not None else records

    def _ids(self) -> list[str]:
        if not self.directory.is_dir():
            return []
        # a symbolic link is not one of ours (see _own_folder)
        return [p.name for p in self.directory.iterdir()
                if RUN_ID.fullmatch(p.name) and not p.is_symlink() and p.is_dir()]

    def size(self, run_id: str) -> int:
        folder = self.run_dir(run_id)
        return sum(p.stat().st_size for p in folder.iterdir() if p.is_file()) if folder.is_dir() else 0

    def prune(self, keep: str | None = None) -> list[str]:
        """Remove the oldest runs beyond the newest ``settings.keep`` and beyond ``settings.budget_bytes``
        together (``keep``, the run just written, is never removed). A folder without a readable record is
        removed first: it is not a run this app can open — unless a file in it changed in the last
        ``WRITING_S`` seconds: a run being written (an engine run's file takes seconds, in a thread of its own,
        and its record goes last), which another page's save must not take away."""
        by_age: list[tuple[float, str]] = []
        for run_id in self._ids():
            try:
                record = self.record(run_id)
            except RunError:
                record = None
            if record is None and run_id != keep and self._being_written(run_id):
                continue
            by_age.append((record.updated if record is not None else -math.inf, run_id))
        by_age.sort(reverse=True)  # newest first
        removed, total, kept = [], 0, 0
        for _, run_id in by_age:
            size = self.size(run_id)
            if run_id == keep or (kept < self.settings.keep and total + size <= self.settings.budget_bytes):
                kept, total = kept + 1, total + size
                continue
            self.delete(run_id)
            removed.append(run_id)
        return removed

    def _being_written(self, run_id: str) -> bool:
        """Whether the run's folder or a file in it changed within the last ``WRITING_S`` seconds."""
        folder = self.run_dir(run_id)
        try:
            changed = max([folder.stat().st_mtime, *(p.stat().st_mtime for p in folder.iterdir())])
        except OSError:
            return False
        return changed > time.time() - WRITING_S

    def delete(self, run_id: str) -> None:
        _chains.pop(str(self.run_dir(run_id)), None)
        shutil.rmtree(self.run_dir(run_id), ignore_errors=True)


_run_locks: dict[str, threading.Lock] = {}  # a run's folder → the lock its writes take (this process's)
_run_locks_lock = threading.Lock()
# a run's folder → (the log of the trace save_steps wrote last there, weakly; what the files hold of it)
_chains: dict[str, tuple[weakref.ref, TraceWritten]] = {}


def _run_lock(folder: str) -> threading.Lock:
    with _run_locks_lock:
        return _run_locks.setdefault(folder, threading.Lock())


def without_values(run, budget_bytes: int):
    """``run`` (an ``EngineRun``) without its attention values, a note saying why: what the runs folder writes of a
    run whose values are larger than its whole budget (its pool, requests and steps are small)."""
    from gpt_shape_tracer.tracer import EngineRun

    note = (f"Its attention values ({run.bytes_kept:,} B) were larger than the runs folder's budget "
            f"({budget_bytes:,} B) and were not written: the attention view is empty.")
    return EngineRun(run.pool, run.requests, run.steps, {}, run.budget_bytes, (*run.notes, note))
