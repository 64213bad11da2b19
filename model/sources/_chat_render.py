"""A chat template rendered in a separate process, bounded in time, memory and output.

A chat template is code from a model's author. jinja2's immutable sandbox (below) keeps it from Python's
internals, but not from work: a 60-byte template can ask for ``'x' * 5*10**9``, ``tojson(indent=10**9)`` or two
nested ``range(100000)`` loops (10¹⁰ iterations). So ``render_chat_template`` runs the render in a child Python
(``python -I`` running this file by its path: no package of ours, no torch, only jinja2), which first caps its own
address space (``RENDER_MEMORY_BYTES``) and CPU time; the parent kills it after ``RENDER_SECONDS`` and the child
stops once the text passes ``RENDER_MAX_CHARS``. Any of these is a ``ChatTemplateError`` that says which bound.

The cost is one small process per render (a chat prompt is rendered once per generation, not per step): measured
in docs/benchmarks.md (bench/bench_chat_render.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import datetime
from functools import lru_cache
from typing import Any

RENDER_SECONDS = 10.0  # wall clock, start-up included (a real template renders in milliseconds)
RENDER_MEMORY_BYTES = 1 << 30  # the child's address space: Python + jinja2 use ~60 MiB of it
RENDER_MAX_CHARS = 16 << 20  # a rendered chat of a million-token context is a few MB of text


class ChatTemplateError(ValueError):
    """A chat template that failed, or ran past a bound: the message says which."""


def render_chat_template(source: str, **variables: Any) -> str:
    """``source`` rendered with ``variables`` (plain JSON values), in a bounded child process."""
    payload = json.dumps({"source": source, "variables": variables, "max_chars": RENDER_MAX_CHARS,
                          "memory": RENDER_MEMORY_BYTES, "seconds": RENDER_SECONDS}).encode("utf-8")
    return _rendered(payload)


@lru_cache(maxsize=64)  # the same chat rendered again (an app rerun) costs no process; failures are not kept
def _rendered(payload: bytes) -> str:
    try:
        done = subprocess.run([sys.executable, "-I", os.path.abspath(__file__)], input=payload, capture_output=True,
                              timeout=RENDER_SECONDS, check=False)
    except subprocess.TimeoutExpired:
        raise ChatTemplateError(f"the render did not finish within {RENDER_SECONDS:g} s (stopped)") from None
    try:
        answer = json.loads(done.stdout.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        tail = done.stderr.decode("utf-8", "replace").strip().splitlines()[-1:] or [f"exit status {done.returncode}"]
        raise ChatTemplateError(f"the render stopped without an answer ({tail[0][:300]})") from None
    if "error" in answer:
        raise ChatTemplateError(answer["error"])
    return answer["text"]


def _child() -> None:
    """The child: bound itself, render, answer one JSON object on stdout."""
    request = json.loads(sys.stdin.buffer.read().decode("utf-8"))
    try:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (request["memory"], request["memory"]))
        cpu = int(request["seconds"]) + 1
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    except (ImportError, ValueError, OSError):  # no resource module (Windows): the parent's timeout still holds
        pass
    answer: dict[str, str]
    try:
        import jinja2

        parts: list[str] = []
        size = 0
        for chunk in _compiled_template(request["source"]).generate(**request["variables"]):
            parts.append(chunk)
            size += len(chunk)
            if size > request["max_chars"]:
                raise ChatTemplateError(f"the rendered text passed {request['max_chars']} characters (stopped)")
        answer = {"text": "".join(parts)}
    except MemoryError:
        answer = {"error": f"the render needed more than {request['memory'] >> 20} MiB of memory (stopped)"}
    except ChatTemplateError as e:
        answer = {"error": str(e)}
    except jinja2.TemplateError as e:
        answer = {"error": str(e)}
    except (TypeError, ValueError, ArithmeticError, LookupError, RecursionError) as e:
        answer = {"error": f"{type(e).__name__}: {e}"}
    sys.stdout.write(json.dumps(answer))


@lru_cache(maxsize=8)
def _compiled_template(source: str):
    """The template compiled in an ``ImmutableSandboxedEnvironment`` set up as transformers sets up its own
    (trim_blocks, lstrip_blocks, loop controls, a ``{% generation %}`` tag that only renders its body)."""
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

        def _render(self, caller):
            return caller()

    def refuse_private(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a chat template may not set {name!r} on a namespace")

    class Namespace(jinja2.utils.Namespace):
        """``namespace()`` that refuses underscore-prefixed names, the way into CPython internals."""

        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                refuse_private(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            refuse_private(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

    class TemplateDict:
        """``dict(…)`` in a template, without the class itself (no attribute access to type internals)."""

        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationTag, "jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals["dict"] = TemplateDict()
    env.globals["namespace"] = Namespace
    return env.from_string(source)


if __name__ == "__main__":
    _child()


def compile_chat_template(source: str):
    """The template compiled in this process's own sandbox, unbounded (for measuring what the bound costs)."""
    return _compiled_template(source)


def forget_rendered_chats() -> None:
    """Empty the cache of rendered chats (for measuring a render from scratch)."""
    _rendered.cache_clear()
