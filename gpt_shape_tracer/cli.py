"""``gpt-shape-tracer app [streamlit options]`` serves the page; ``gpt-shape-tracer trace …`` traces headless.

The app is the ``app.py`` installed beside this package (or, in a checkout, the one at its root), run by
Streamlit's own command line in this Python. The server settings are declared once, in ``server.toml``
beside this module (``.streamlit/config.toml`` in a checkout is a link to it, for ``streamlit run app.py``);
here they are passed as flags, so they hold from any working directory. Flags given after ``app`` come
later and win."""

from __future__ import annotations

import importlib.util
import os
import sys
import tomllib
from pathlib import Path

SERVER_SETTINGS = Path(__file__).with_name("server.toml")

USAGE = """usage: gpt-shape-tracer {app,trace} [options]

  app    serve the app in a browser (options after `app` go to `streamlit run`, e.g. --server.port 8600)
  trace  trace a generation headless and write the trace file (`gpt-shape-tracer trace --help`)"""


def app_script() -> Path:
    """Where ``app.py`` is: the installed top-level module ``app``, found without importing it (importing
    it would run the page outside Streamlit)."""
    spec = importlib.util.find_spec("app")
    if spec is None or spec.origin is None or not Path(spec.origin).is_file():
        raise FileNotFoundError("app.py is not installed beside gpt_shape_tracer: reinstall the package")
    return Path(spec.origin)


def server_flags(settings: Path = SERVER_SETTINGS) -> list[str]:
    """``server.toml`` as ``streamlit run`` flags: ``--server.address=127.0.0.1``, a list option once per item."""
    flags = []
    for section, options in tomllib.loads(settings.read_text()).items():
        for key, value in options.items():
            for item in value if isinstance(value, list) else [value]:
                text = str(item).lower() if isinstance(item, bool) else str(item)
                flags.append(f"--{section}.{key}={text}")
    return flags


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
        # the server replaces this process: Ctrl+C and a terminating parent reach Streamlit itself
        os.execv(sys.executable, [sys.executable, "-m", "streamlit", "run", str(script), *server_flags(), *rest])
    print(f"error: unknown command {command!r}\n{USAGE}", file=sys.stderr)
    return 2
