"""``gpt-shape-tracer app [streamlit options]`` serves the page; ``gpt-shape-tracer trace …`` traces headless.

The app is this package's ``app.py`` (in a checkout, a link to the ``app.py`` at its root), run by Streamlit's
own command line in this Python. The server settings are declared once, in ``server.toml``
beside this module (``.streamlit/config.toml`` in a checkout is a link to it, for ``streamlit run app.py``);
here they are passed as flags, so they hold from any working directory. Flags given after ``app`` come
later and win."""

from __future__ import annotations

import os
import sys
import tomllib
from pathlib import Path

from gpt_shape_tracer.session.runs import (
    KEEP_RUNS_ENV,
    LIST_ALL_RUNS_ENV,
    RUNS_DIR_ENV,
    RUNS_MB_ENV,
    RunError,
    RunsSettings,
)
from gpt_shape_tracer.session.server_limits import BUDGET_ENV, SESSIONS_ENV, ServerLimits

SERVER_SETTINGS = Path(__file__).with_name("server.toml")

USAGE = """usage: gpt-shape-tracer {app,trace} [options]

  app    serve the app in a browser (options after `app` go to `streamlit run`, e.g. --server.port 8600);
         --server-budget-mb N: MiB of traces for all sessions together (default: half the machine's memory)
         --max-sessions N: sessions served at once (default 8)
         --runs-dir DIR: where each session's run is kept, owner-only, for a reload or a restart
                (default ~/.local/share/gpt-shape-tracer/runs); --keep-runs N (default 20) and
                --runs-mb N (default 2048) bound it, the oldest runs going first
         --list-all-runs: every page's "Recent runs" lists every run of the server (for a server one
                person uses; by default a page lists only the runs made under its own address)
         --dev: watch the source files and offer a rerun when they change (off by default: an idle
                server then costs nothing)
  trace  trace a generation headless and write the trace file (`gpt-shape-tracer trace --help`)"""


def app_script() -> Path:
    """Where the page is: ``app.py`` in this package, found as a file, never imported (importing it would run
    the page outside Streamlit)."""
    script = Path(__file__).with_name("app.py")
    if not script.is_file():
        raise FileNotFoundError(f"{script} is missing: reinstall gpt-shape-tracer")
    return script


def server_flags(settings: Path = SERVER_SETTINGS) -> list[str]:
    """``server.toml`` as ``streamlit run`` flags: ``--server.address=127.0.0.1``, a list option once per item."""
    flags = []
    for section, options in tomllib.loads(settings.read_text()).items():
        for key, value in options.items():
            for item in value if isinstance(value, list) else [value]:
                text = str(item).lower() if isinstance(item, bool) else str(item)
                flags.append(f"--{section}.{key}={text}")
    return flags


SWITCH_FLAGS = {"--list-all-runs": LIST_ALL_RUNS_ENV}  # flags without a value: present means on
LIMIT_FLAGS = {"--server-budget-mb": BUDGET_ENV, "--max-sessions": SESSIONS_ENV, "--runs-dir": RUNS_DIR_ENV,
               "--keep-runs": KEEP_RUNS_ENV, "--runs-mb": RUNS_MB_ENV}


def server_limit_flags(args: list[str]) -> list[str]:
    """Take ``--server-budget-mb N`` / ``--max-sessions N`` / the runs folder's flags (or ``--flag=N``; and the
    switch ``--list-all-runs``) out of
    ``args`` into the environment (session/server_limits.py and runs.py read them there); the rest go to
    Streamlit."""
    rest: list[str] = []
    settings: dict[str, str] = {}
    values = iter(args)
    for arg in values:
        flag, _, inline = arg.partition("=")
        if arg in SWITCH_FLAGS:
            settings[SWITCH_FLAGS[arg]] = "1"
            continue
        if flag not in LIMIT_FLAGS:
            rest.append(arg)
            continue
        # the value: after "=", else the next argument; none (the flag last, or followed by another flag) is
        # refused rather than read as "the default"
        value = inline if "=" in arg else next(values, "")
        if not value.strip() or (value.startswith("--") and "=" not in arg):
            raise ValueError(f"{flag} needs a value ({flag} N or {flag}=N)")
        settings[LIMIT_FLAGS[flag]] = value
    ServerLimits.from_environment({**os.environ, **settings})  # a bad value is refused here, not in the browser
    try:
        RunsSettings.from_environment({**os.environ, **settings})
    except RunError as e:
        raise ValueError(str(e)) from None
    os.environ.update(settings)
    return rest


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if args else 2
    command, rest = args[0], args[1:]
    if command == "trace":
        from gpt_shape_tracer.trace_command import main as trace

        return trace(rest)
    if command == "app":
        try:
            script = app_script()
        except FileNotFoundError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        try:
            rest = server_limit_flags(rest)  # into the environment the server reads them from
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        watch = ["--server.fileWatcherType=auto"] if "--dev" in rest else []
        rest = [arg for arg in rest if arg != "--dev"]
        # the server replaces this process: Ctrl+C and a terminating parent reach Streamlit itself
        server = [sys.executable, "-m", "streamlit", "run", str(script), *server_flags(), *watch, *rest]
        os.execv(sys.executable, server)
    print(f"error: unknown command {command!r}\n{USAGE}", file=sys.stderr)
    return 2
