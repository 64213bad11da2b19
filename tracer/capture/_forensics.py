"""Where a traced forward failed: the module that raised, its inputs, the op, the source line.

The culprit is read from the exception's traceback, not only from the tracer's
own stack of entered modules: a forward hook that raises runs after the
tracer's hook on that module may already have closed it, and the stack alone
would then blame the parent.
"""

from __future__ import annotations

import traceback
from dataclasses import replace
from pathlib import Path
from types import TracebackType

from torch import nn

from gpt_shape_tracer.tracer.capture._nested import flatten_tensors
from gpt_shape_tracer.tracer.storage.records import ModuleInfo, TraceErrorInfo

_CALL_FRAMES = ("_call_impl", "_wrapped_call_impl")
_TORCH_MODULE_FILE = "torch/nn/modules/module.py"
# the tracer's own frames (op capture) are never the culprit; unresolved, as frames name the file
_OURS = str(Path(__file__).parent.parent)


def _raising_module(tb: TracebackType | None, paths: dict[int, str]) -> tuple[nn.Module | None, str]:
    """The innermost module of ours whose call was running when the exception was raised, and the name of
    the function it was in when that was not the module's own forward (a hook)."""
    culprit, inside, looking = None, "", False
    while tb is not None:
        frame = tb.tb_frame
        this = frame.f_locals.get("self")
        if frame.f_code.co_name in _CALL_FRAMES and isinstance(this, nn.Module) and id(this) in paths:
            culprit, inside, looking = this, "", True
        elif looking and not frame.f_code.co_filename.endswith(_TORCH_MODULE_FILE):
            # the first frame past torch's own call machinery: the module's forward, or a hook
            inside = "" if (frame.f_code.co_name == "forward" and this is culprit) else frame.f_code.co_name
            looking = False
        tb = tb.tb_next
    return culprit, inside


def _source_line(exc: BaseException, module: nn.Module | None) -> str:
    """``file:line: code`` of the innermost frame outside torch once ``module``'s call has begun: a line of
    its forward, of a function it called, or of a hook of the user's; else the innermost outside torch."""
    found, inside = "", False
    tb = exc.__traceback__
    while tb is not None and module is not None:
        this = tb.tb_frame.f_locals.get("self") is module
        inside = inside or this
        summary = traceback.extract_tb(tb, limit=1)[0]
        if this or (inside and "/torch/" not in summary.filename and not summary.filename.startswith(_OURS)):
            found = f"{summary.filename}:{summary.lineno}: {(summary.line or '').strip()}"
        tb = tb.tb_next
    if found:
        return found
    for summary in reversed(traceback.extract_tb(exc.__traceback__)):
        if "/torch/" not in summary.filename:
            return f"{summary.filename}:{summary.lineno}: {(summary.line or '').strip()}"
    return ""


def describe_failure(exc: BaseException, step: int, model: nn.Module, modules: tuple[ModuleInfo, ...],
                     stack: list[tuple], last_exited: tuple | None, failed_op: tuple | None) -> TraceErrorInfo:
    """``stack``: the tracer's entered modules, ``(module index, call, args, kwargs)``; ``last_exited``: the
    most recent one it closed; ``failed_op``: ``(name, input shapes, exception id)`` of an op that raised."""
    paths = {id(m): p for p, m in model.named_modules()}
    culprit, inside = _raising_module(exc.__traceback__, paths)
    entries = {modules[e[0]].path: e for e in stack}
    if last_exited is not None:
        entries.setdefault(modules[last_exited[0]].path, last_exited)
    if culprit is not None:
        path = paths[id(culprit)]
    elif stack:
        path = modules[stack[-1][0]].path
    else:
        path = None
    if path is None:
        error = TraceErrorInfo(step=step, exception_type=type(exc).__name__, message=str(exc), module="",
                               module_type="(outside any module)", module_stack=(), input_shapes=())
    else:
        info = next(m for m in modules if m.path == path)
        entry = entries.get(path)
        inputs: list[tuple[str, tuple[int, ...]]] = []
        if entry is not None:
            inputs = [(slot, tuple(t.shape)) for slot, t in flatten_tensors(entry[2])]
            inputs += [(slot, tuple(t.shape)) for slot, t in flatten_tensors(entry[3])]
        chain = [modules[e[0]].path or "model" for e in stack]
        if (path or "model") not in chain:
            chain.append(path or "model")
        module_type = info.type + (f", in its forward hook {inside}()" if inside else "")
        error = TraceErrorInfo(
            step=step, exception_type=type(exc).__name__, message=str(exc), module=path, module_type=module_type,
            module_stack=tuple(chain), input_shapes=tuple(inputs),
            source=_source_line(exc, culprit if culprit is not None else model),
        )
    if failed_op is not None and failed_op[2] == id(exc):
        error = replace(error, op=failed_op[0], op_input_shapes=tuple(failed_op[1]))
    return error
