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
* **bytes read** (``read_bytes``): the bytes of its inputs, as a real run's kernel moves them — a view (``t``,
  ``view``, ``expand``, ``slice``: outputs that are inputs' memory) moves nothing, so it reads nothing; a gather
  from a parameter reads what it gathers, not the whole parameter;
* the **module** it ran in (the innermost non-hook-point module on the stack).

It also keeps the bytes of every storage that is alive — created by an op of the forward, freed when its last
tensor goes — and the peak of that sum: the activation memory the forward needs at once, as PyTorch's own
allocator would see it without its caching (parameters and the KV cache buffers made before the step are not
counted; the cache's new buffers are). A storage an op reads before any op of the forward made it existed before
(the tokens, the cache's buffers): an in-place write into it (the cache's ``copy_``) adds nothing. The copies of
whole expert matrices that the dry run's ``batched_mm`` experts make are left out (``_copied_matrices``), and so
are their bytes: a real run's kernels (``grouped_mm``, the experts loop) read each routed expert's matrices in place,
once per step when any token picks it, and copy none. Which experts the router picks a dry run cannot know, so the
copy is counted as reading the k experts of one token (every token on the same k experts: ``weight_bytes``), and
``spread_bytes`` more when the step's S = tokens·k choices hit min(E, S) different experts (the most they can).
Checked
against the profiler's allocator events on the real run (tests/tracer/test_costs.py): within 1.2 % for our GPT, Llama,
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
    spread_bytes: int = 0  # bytes more it reads if the tokens' expert choices hit as many experts as they can
    # (a dry run's copy of the chosen experts' matrices: which experts were chosen, it cannot know)

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
        self._copies: dict[int, Any] = {}  # id(storage) → weakref: the dry run's copies of expert matrices
        self._routing: dict[str, int] = {}  # an experts module's path → k, the experts each token picks
        for path, module in model.named_modules():
            if isinstance(module, HookPoint) or not path:
                continue
            self._handles.append(module.register_forward_pre_hook(self._enter(path)))
            self._handles.append(module.register_forward_hook(self._exit(path)))

    def _enter(self, path: str):
        def pre(module, args):
            self._stack.append(path)
            # transformers' experts modules are called (hidden_states [S, d], top_k_index [S, k], top_k_weights)
            if hasattr(module, "num_experts") and len(args) >= 2 and isinstance(args[1], torch.Tensor) \
                    and args[1].dim() == 2 and not args[1].is_floating_point():
                self._routing[path] = int(args[1].shape[-1])
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

    def _expert_reads(self, inputs: list[torch.Tensor], outputs: list[torch.Tensor]) -> tuple[int, int]:
        """(bytes, spread): what a real run reads for a dry-run copy of the chosen experts' matrices ``[S, a, b]``
        of an ``[E, a, b]`` parameter — k experts' matrices when every token picks the same k, min(E, S) experts'
        when they pick as many as they can (module doc); k from the experts module's call, or S when unknown."""
        param = next(t for t in inputs if t.dim() >= 3 and id(t.untyped_storage()) in self._param_storages)
        chosen = outputs[0].shape[0]  # S = tokens · k
        k = min(self._routing.get(self._stack[-1], chosen), chosen)
        one = _nbytes(param) // max(param.shape[0], 1)
        low, high = k * one, min(param.shape[0], chosen) * one
        return low, high - low

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
        inplace = str(packet).endswith("_") or "out" in kwargs  # add_, copy_, index_put_ …: they write their output
        # a view (t, view, expand, slice, …): every output is an input's memory, so no kernel moves a byte
        view = bool(outputs) and not inplace and all(id(o.untyped_storage()) in in_storages for o in outputs)
        copies = self._copied_matrices(packet, inputs, outputs)
        weight = read = spread = 0
        if copies:  # the dry run's copy of expert matrices: a real run reads the experts in place, copies nothing
            weight, spread = self._expert_reads(inputs, outputs)
            read = weight + sum(_nbytes(t) for t in inputs if id(t.untyped_storage()) not in self._param_storages)
        elif not view:
            gathers = packet in (torch.ops.aten.index, torch.ops.aten.embedding, torch.ops.aten.index_select)
            for t in inputs:
                key = id(t.untyped_storage())
                if key in self._copies:
                    continue  # a dry-run copy of expert matrices: its bytes were counted where it was made
                held = self._param_storages.get(key)
                if held is None:
                    read += _nbytes(t)
                    continue
                part = min(held, sum(_nbytes(o) for o in outputs)) if gathers else min(held, _nbytes(t))
                weight += part
                read += part  # a gather reads the rows it gathers, not the whole parameter
        written = 0
        for o in outputs:
            storage = o.untyped_storage()
            key = id(storage)
            if key in in_storages and not inplace:
                continue  # a view of an input: nothing written
            if copies:
                self._note_existing(storage)  # weights, not activations (_copied_matrices)
                if key not in self._copies:
                    self._copies[key] = weakref.ref(storage, self._uncopied(key))
                continue  # a real run makes no such copy: nothing written
            written += _nbytes(o)
            if key not in self._seen and key not in self._tracked:  # new memory: alive until its last tensor goes
                nbytes = storage.nbytes()
                self._tracked[key] = weakref.ref(storage, self._freed(nbytes, key))
                self.live_bytes += nbytes
                self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        name = str(packet)
        self.ops.append(OpCost(self.step, self._stack[-1], name if name.startswith("aten.") else f"aten.{name}",
                               tuple(outputs[0].shape) if outputs else (), flops // 2, weight, read, written,
                               spread))
        return out

    def _uncopied(self, key: int):
        def callback(_ref):
            self._copies.pop(key, None)
        return callback
