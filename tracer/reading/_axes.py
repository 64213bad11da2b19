"""Symbolic axes for records: ``[1, 4, 1, 21]`` is ``[B, H, n, t]``, checked against the numbers.

The hook table (``model/gpt/_hook_table.py``) says what each hook point holds in
symbols; the model's config gives d, H, G, d_head, V, the MLP width; B, n and t
are bound by the first record of a step that uses them and must agree after.
A record whose sizes do not fit its row gets no axes rather than wrong ones.
"""

from __future__ import annotations

from gpt_shape_tracer.model.gpt import dims_of, resolve, spec_for

FREE = ("B", "n", "t")  # bound per step, by the records themselves


class AxisResolver:
    """Resolves the axes of one step's records in call order (B, n, t bound as they appear)."""

    def __init__(self, config) -> None:
        self._config = config
        self._dims: dict[str, int] = {}
        if config is not None:
            try:
                dims = dims_of(config, 0, 0, 0)
            except (AttributeError, TypeError, ValueError, KeyError):
                dims = {}
            self._dims = {k: v for k, v in dims.items() if k not in FREE and k != "B|1"}
        self._bound: dict[str, int] = {}

    def axes(self, name: str, shape: tuple[int, ...]) -> tuple[tuple[str, ...] | None, str]:
        """(axes, note) for a record; (None, "") when no table row fits."""
        if name.startswith("model:in[0]") or name.endswith("embed:in[0]"):
            symbols: tuple[str, ...] = ("B", "n")
            note = "token ids"
        else:
            spec = spec_for(name, self._config) if self._config is not None else None
            if spec is None or not self._dims:
                return None, ""
            symbols, note = spec.shape, getattr(spec, "note", "")
        if len(symbols) != len(shape):
            return None, ""
        out: list[str] = []
        bound = dict(self._bound)
        for symbol, size in zip(symbols, shape):
            if symbol == "B|1":
                batch = bound.get("B")
                out.append("1" if size == 1 and batch not in (None, 1) else "B")
                if batch is None and size != 1:
                    bound["B"] = size
                continue
            if symbol in FREE:
                if bound.setdefault(symbol, size) != size:
                    return None, ""
                out.append(symbol)
                continue
            try:
                expected = resolve(symbol, self._dims)
            except (KeyError, ValueError):
                return None, ""
            if expected != size:
                return None, ""
            out.append(self._display(symbol))
        self._bound = bound
        return tuple(out), note

    def _display(self, symbol: str) -> str:
        # with as many key/value heads as query heads (GPT-2), H is the name people know
        if symbol == "G" and self._dims.get("G") == self._dims.get("H"):
            return "H"
        return symbol
