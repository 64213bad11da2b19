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
against the profiler's allocator events on the real run (tests/tracer/test_costs.py): within 1.5 % for our GPT, Llama,
Qwen3, Mixtral and DeepSeek-V3, prefill and decode (docs/benchmarks.md).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode, _pop_mode, _push_mode
from torch.utils.flop_counter import flop_registry, sdpa_flop_count

from gpt_shape_tracer.model.gpt import HookPoint
from gpt_shape_tracer.model.sources import MetaOpCache
from gpt_shape_tracer.tracer.costs._blocks import (
    Blocks,
    InBlock,
    Kind,
    ReplicationMismatch,
    Template,
    output_shapes,
    relative,
)


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


def _tensors(obj: Any, out: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """The tensors in an op's arguments or results: nested tuples (named ones too), lists and dicts, in
    ``tree_flatten``'s order (the first output is the first tensor). By hand: ``tree_flatten`` was a third of a
    costed dry run's time, asking each leaf's node type."""
    if out is None:
        out = []
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, (tuple, list)):
        for item in obj:
            if isinstance(item, torch.Tensor):
                out.append(item)
            elif isinstance(item, (tuple, list, dict)):
                _tensors(item, out)
    elif isinstance(obj, dict):
        for item in obj.values():
            _tensors(item, out)
    return out


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# the fused attention kernel a real CPU run dispatches ``F.scaled_dot_product_attention`` to; on the meta device
# PyTorch would decompose the call into the math formula instead (the n × t scores, a float32 softmax, K and V
# copied per query head), bytes and memory no real run's kernel moves: ``FusedOnMeta`` calls this op there
_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_SDPA = torch.nn.functional.scaled_dot_product_attention
_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


class FusedOnMeta(TorchFunctionMode):
    """While active, ``F.scaled_dot_product_attention`` on the meta device runs as the one fused kernel a real run
    calls (``_scaled_dot_product_flash_attention_for_cpu``: reads Q, K, V and the mask, writes O and each row's
    log-sum-exp), so a dry run counts what that kernel moves and holds; its multiply-adds are torch's own SDPA
    formula (``flop_counter.sdpa_flop_count``, grouped K and V heads included), the same as the math formula's two
    matrix products."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _SDPA:
            call = dict(zip(_SDPA_ARGS, args)) | kwargs
            q, v = call["query"], call["value"]
            # where a real CPU run takes that kernel: the same head size for Q and V (latent attention's differ, and
            # PyTorch runs its math formula there too); grouped K, V heads: the kernel broadcasts them
            if isinstance(q, torch.Tensor) and q.device.type == "meta" and q.size(-1) == v.size(-1):
                return _FLASH(q, call["key"], v, call.get("dropout_p", 0.0), call.get("is_causal", False),
                              attn_mask=call.get("attn_mask"), scale=call.get("scale"))[0]
        return func(*args, **kwargs)


def _flash_flops(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any, **kwargs: Any) -> int:
    return sdpa_flop_count(query.shape, key.shape, value.shape)


_GATHERS = (torch.ops.aten.index, torch.ops.aten.index_select)  # the ops that can copy expert matrices
_OWN_RESULTS: dict[Any, tuple[bool, ...]] = {}  # op overload → per result, whether it is new memory
_NAMES: dict[Any, str] = {}  # op overload packet → its name in the costs ("aten.mm")


class OpCounter(TorchDispatchMode):
    """Count every op's cost while active (module doc); ``with OpCounter(model, step) as c: model(x)``."""

    def __init__(self, model: nn.Module, step: int = 0, blocks: Blocks | None = None,
                 cache: MetaOpCache | None = None) -> None:
        super().__init__()
        self.step = step
        # identical blocks costed once (tracer/costs/_blocks.py): the blocks, each kind's template, the block in
        # progress; a replicated block's ops go past this mode to the meta-op cache (``cache``), which notes the
        # memory they make
        self._blocks = blocks if cache is not None else None
        self._cache = cache
        self._kinds: dict[tuple, Kind] = {}
        self._block: InBlock | None = None
        self._popped = False  # this mode is off the dispatch stack: a replicated block is running
        self.replicated: list[str] = []  # the blocks whose costs are their template's
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
            if self._blocks is not None and id(module) in self._blocks.where:
                self._handles.append(module.register_forward_pre_hook(self._enter_block(path), with_kwargs=True))
                self._handles.append(module.register_forward_hook(self._exit_block(path)))
                continue
            self._handles.append(module.register_forward_pre_hook(self._enter(path)))
            self._handles.append(module.register_forward_hook(self._exit(path)))

    def _enter_block(self, path: str):
        enter = self._enter(path)

        def pre(module, args, kwargs):
            enter(module, args)
            if self._block is not None or self._blocks is None:
                return  # a block inside a block (a block called twice in one call): counted with the outer one
            key = self._blocks.kind(module, args, kwargs)
            kind = self._kinds.setdefault(key, Kind()) if key is not None else None
            self._block = block = InBlock(path, len(self.ops), kind)
            if kind is not None and kind.verified and _get_current_dispatch_mode() is self:
                assert self._cache is not None
                block.replica = True  # its ops pass this mode by; the meta-op cache tells _replica_op of each
                self._cache.listener = self._replica_op
                _pop_mode()
                self._popped = True
        return pre

    def _exit_block(self, path: str):
        exit_ = self._exit(path)

        def post(module, args, output):
            exit_(module, args, output)
            block = self._block
            if block is None or block.path != path:
                return
            self._block = None
            if block.replica:
                self._restore()
                self._replicate(block, output)
                return
            if block.kind is not None:
                block.kind.add(Template([relative(op, path) for op in self.ops[block.start:]], output_shapes(output)))
        return post

    def _restore(self) -> None:
        """This mode back on the dispatch stack, above the meta-op cache, after a replicated block."""
        if self._popped:
            _push_mode(self)
            self._popped = False

    def _replica_op(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        """An op of a replicated block, told by the meta-op cache: counted, and the new memory it makes tracked
        as a counted op's is (``_written``), the copies of expert matrices left out as there (its costs are the
        template's)."""
        block = self._block
        assert block is not None
        block.ops += 1
        if func.overloadpacket in _GATHERS:
            inputs, outputs = _tensors(kwargs, _tensors(args)), _tensors(out)
            if self._copied_matrices(inputs, outputs):
                for t in inputs:
                    self._note_existing(t.untyped_storage())
                self._written(outputs, set(), False, True)
                return
        own = _OWN_RESULTS.get(func)
        if own is None:  # for each result, whether the schema says it is no argument's memory (a view's is)
            own = _OWN_RESULTS[func] = tuple(r.alias_info is None for r in func._schema.returns)
        for result, new in zip((out,) if len(own) == 1 else out, own):
            if new:
                for t in result if isinstance(result, (list, tuple)) else (result,):
                    if isinstance(t, torch.Tensor):
                        self._track(t.untyped_storage())

    def _replicate(self, block: InBlock, output: Any) -> None:
        """A replicated block's costs: its template's ops, at its path — once its op count and what it returned
        are the template's."""
        assert block.kind is not None and block.kind.template is not None and self._cache is not None
        self._cache.listener = None
        template = block.kind.template
        if block.ops != len(template.ops) or output_shapes(output) != template.outputs:
            raise ReplicationMismatch(
                f"{block.path}: it ran {block.ops} ops and returned {output_shapes(output)}, its template "
                f"{len(template.ops)} and {template.outputs}: a kind of block the replication did not tell apart; "
                "cost the dry run with replicate=False")
        self.ops.extend(OpCost(self.step, block.path + module if module is not None else outside, op, shape, *rest)
                        for module, op, shape, outside, *rest in template.ops)
        self.replicated.append(block.path)

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
            self._restore()  # a replicated block that raised: this mode is put back before it leaves the stack
            if self._cache is not None:
                self._cache.listener = None
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

    def _copied_matrices(self, inputs: list[torch.Tensor], outputs: list[torch.Tensor]) -> bool:
        """Whether the op copies whole weight matrices out of a parameter: ``gate_up_proj[expert_ids]``
        ``[E, 2·d_ff, d] → [S, 2·d_ff, d]``, the chosen experts' matrices, one per token and choice. The dry run's
        experts (transformers' ``batched_mm``, shapes fixed in advance: sources/_dry_run.py) make these copies;
        the kernels a real run uses (``grouped_mm``, the experts loop) read the matrices in place, so the copies are
        left out of the peak activation memory (their bytes stay in the op's weight bytes and bytes written). An
        embedding's rows (``[V, d] → [B, n, d]``: vectors, not matrices) are activations and stay in."""
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
        name = _NAMES.get(packet)
        if name is None:
            text = str(packet)
            name = _NAMES[packet] = text if text.startswith("aten.") else f"aten.{text}"
        inputs = _tensors(kwargs, _tensors(args)) if kwargs else _tensors(args)
        outputs = _tensors(out)
        in_storages = {id(t.untyped_storage()) for t in inputs}
        for t in inputs:  # memory that existed before the forward (the tokens, the KV cache's buffers): never new
            self._note_existing(t.untyped_storage())
        inplace = name.endswith("_") or "out" in kwargs  # add_, copy_, index_put_ …: they write their output
        copies = packet in _GATHERS and self._copied_matrices(inputs, outputs)
        flops = 0
        counter = flop_registry.get(packet)
        if counter is not None:
            flops = int(counter(*args, **kwargs, out_val=out))
        elif packet is _FLASH:
            flops = _flash_flops(*args, **kwargs)
        # a view (t, view, expand, slice, …): every output is an input's memory, so no kernel moves a byte
        view = bool(outputs) and not inplace and all(id(o.untyped_storage()) in in_storages for o in outputs)
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
        written = self._written(outputs, in_storages, inplace, copies)
        self.ops.append(OpCost(self.step, self._stack[-1], name, tuple(outputs[0].shape) if outputs else (),
                               flops // 2, weight, read, written, spread))
        return out

    def _written(self, outputs: list[torch.Tensor], in_storages: set[int], inplace: bool, copies: bool) -> int:
        """The bytes the op's outputs write; new storages tracked until freed, and the peak of their sum."""
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
            self._track(storage)
        return written

    def _track(self, storage: Any) -> None:
        """New memory, unless seen before: alive until its last tensor goes, and the peak of all that is."""
        key = id(storage)
        if key not in self._seen and key not in self._tracked:
            nbytes = storage.nbytes()
            self._tracked[key] = weakref.ref(storage, self._freed(nbytes, key))
            self.live_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def _uncopied(self, key: int):
        def callback(_ref):
            self._copies.pop(key, None)
        return callback
