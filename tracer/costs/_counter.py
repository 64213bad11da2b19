"""What every op of a forward costs, counted while it runs — on the meta device too, where nothing is computed.

``OpCounter`` is a ``TorchDispatchMode``: it sees every aten op (after autograd and composite ops are decomposed:
``F.linear`` arrives as ``t`` + ``addmm``) and records, per op:

* **multiply-adds**: half the FLOPs ``torch.utils.flop_counter`` assigns the op (its ``flop_registry``, the table
  ``FlopCounterMode`` counts with; 2 FLOPs per multiply-add for matrix products, attention and convolutions; ops
  without an entry — element-wise work, norms, softmax — count 0, as they do there);
* **weight bytes read**: the bytes of the inputs that are the model's parameters (or views of them). An op that
  gathers from a parameter (``index``: an MoE's chosen experts, an embedding's rows) is counted for what it
  gathers, at most the parameter's size;
* **bytes written**: the bytes of each output that is new memory (a view writes nothing; an in-place op writes its
  output);
* the **module** it ran in (the innermost non-hook-point module on the stack).

It also keeps the bytes of every storage that is alive — created by an op of the forward, freed when its last
tensor goes — and the peak of that sum: the activation memory the forward needs at once, as PyTorch's own
allocator would see it without its caching (parameters and the KV cache buffers made before the step are not
counted; the cache's new buffers are). A storage an op reads before any op of the forward made it existed before
(the tokens, the cache's buffers): an in-place write into it (the cache's ``copy_``) adds nothing. The copies of
whole expert matrices that the dry run's ``batched_mm`` experts make are left out (``_copied_matrices``). Checked
against the profiler's allocator events on the real run (tests/test_costs.py): within 1.2 % for our GPT, Llama,
Qwen3, Mixtral and DeepSeek-V3, prefill and decode (docs/benchmarks.md).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

from gpt_shape_tracer.model.gpt import HookPoint


@dataclass(frozen=True, slots=True)
class OpCost:
    """One aten op of one step."""

    step: int
    module: str  # the innermost module it ran in ("" for the model itself)
    op: str  # "aten.mm", "aten.addmm", …
    output_shape: tuple[int, ...]  # of its first tensor output
    macs: int  # multiply-adds (FLOPs / 2, flop_counter's count)
    weight_bytes: int  # bytes of parameters read
    read_bytes: int  # bytes of every input, parameters included
    written_bytes: int  # bytes of new memory written

    @property
    def flops(self) -> int:
        return 2 * self.macs


def _tensors(obj: Any) -> list[torch.Tensor]:
    return [x for x in tree_flatten(obj)[0] if isinstance(x, torch.Tensor)]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class OpCounter(TorchDispatchMode):
    """Count every op's cost while active (module doc); ``with OpCounter(model, step) as c: model(x)``."""

    def __init__(self, model: nn.Module, step: int = 0) -> None:
        super().__init__()
        self.step = step
        self.ops: list[OpCost] = []
        self.live_bytes = 0
        self.peak_bytes = 0
        self._stack: list[str] = [""]
        self._handles: list[Any] = []
        self._param_storages: dict[int, int] = {}  # id(storage) → its bytes
        for p in model.parameters():
            storage = p.untyped_storage()
            self._param_storages[id(storage)] = storage.nbytes()
        self._tracked: dict[int, Any] = {}  # id(storage) → weakref with a callback that frees its bytes
        self._seen = {id(s) for s in self._param_storages}
        self._existing: dict[int, Any] = {}  # id(storage) → weakref: memory made before the forward (_note_existing)
        for path, module in model.named_modules():
            if isinstance(module, HookPoint) or not path:
                continue
            self._handles.append(module.register_forward_pre_hook(self._enter(path)))
            self._handles.append(module.register_forward_hook(self._exit(path)))

    def _enter(self, path: str):
        def pre(module, args):
            self._stack.append(path)
        return pre

    def _exit(self, path: str):
        def post(module, args, output):
            if self._stack[-1] == path:
                self._stack.pop()
        return post

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            for h in self._handles:
                h.remove()
            self._handles.clear()

    def _freed(self, nbytes: int, key: int):
        def callback(_ref):
            self.live_bytes -= nbytes
            self._tracked.pop(key, None)
        return callback

    def _note_existing(self, storage: Any) -> None:
        """A storage an op reads that no op of this forward made: it existed before (the tokens, the KV cache's
        buffers, which an in-place write would otherwise count as new), so it is never counted. Held by a weak
        reference that forgets it when it is freed, so that a new storage given the same id is counted."""
        key = id(storage)
        if key in self._seen or key in self._tracked:
            return
        self._seen.add(key)
        self._existing[key] = weakref.ref(storage, self._forget(key))

    def _forget(self, key: int):
        def callback(_ref):
            self._seen.discard(key)
            self._existing.pop(key, None)
        return callback

    def _copied_matrices(self, packet: Any, inputs: list[torch.Tensor], outputs: list[torch.Tensor]) -> bool:
        """Whether the op copies whole weight matrices out of a parameter: ``gate_up_proj[expert_ids]``
        ``[E, 2·d_ff, d] → [S, 2·d_ff, d]``, the chosen experts' matrices, one per token and choice. The dry run's
        experts (transformers' ``batched_mm``, shapes fixed in advance: sources/_dry_run.py) make these copies;
        the kernels a real run uses (``grouped_mm``, the experts loop) read the matrices in place, so the copies are
        left out of the peak activation memory (their bytes stay in the op's weight bytes and bytes written). An
        embedding's rows (``[V, d] → [B, n, d]``: vectors, not matrices) are activations and stay in."""
        if packet not in (torch.ops.aten.index, torch.ops.aten.index_select):
            return False
        params = [t for t in inputs if t.dim() >= 3 and id(t.untyped_storage()) in self._param_storages]
        return any(o.dim() == p.dim() and o.shape[1:] == p.shape[1:] for p in params for o in outputs)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet = func.overloadpacket
        inputs = _tensors((args, kwargs))
        outputs = _tensors(out)
        flops = 0
        counter = flop_registry.get(packet)
        if counter is not None:
            flops = int(counter(*args, **kwargs, out_val=out))
        in_storages = {id(t.untyped_storage()) for t in inputs}
        for t in inputs:  # memory that existed before the forward (the tokens, the KV cache's buffers): never new
            self._note_existing(t.untyped_storage())
        weight = 0
        for t in inputs:
            held = self._param_storages.get(id(t.untyped_storage()))
            if held is not None:
                gathers = packet in (torch.ops.aten.index, torch.ops.aten.embedding, torch.ops.aten.index_select)
                weight += min(held, sum(_nbytes(o) for o in outputs)) if gathers else min(held, _nbytes(t))
        written = 0
        inplace = str(packet).endswith("_") or "out" in kwargs  # add_, copy_, index_put_ …: they write their output
        copies = self._copied_matrices(packet, inputs, outputs)
        for o in outputs:
            storage = o.untyped_storage()
            key = id(storage)
            if key in in_storages and not inplace:
                continue  # a view of an input: nothing written
            written += _nbytes(o)
            if copies:
                self._note_existing(storage)  # weights, not activations (_copied_matrices)
            if key not in self._seen and key not in self._tracked:  # new memory: alive until its last tensor goes
                nbytes = storage.nbytes()
                self._tracked[key] = weakref.ref(storage, self._freed(nbytes, key))
                self.live_bytes += nbytes
                self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        name = str(packet)
        self.ops.append(OpCost(self.step, self._stack[-1], name if name.startswith("aten.") else f"aten.{name}",
                               tuple(outputs[0].shape) if outputs else (), flops // 2, weight,
                               sum(_nbytes(t) for t in inputs), written))
        return out
