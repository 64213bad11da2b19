"""Attention variants the traced attention function stages beyond the plain softmax: a learned score bias handed to
the attention function beside the mask (Inkling's relative position bias, ``position_bias``), and sink logits that
vary per query (Inkling 2's ``sinks``, one logit per head and position projected from the hidden state); and layers
run several times per forward (HRM's recurrent stacks: ``reentered_layers``, ``Reentry``), one block per run.

``_hf_attention.traced_attention`` calls ``attention_with_extras`` where a call passes sinks or ``position_bias``; the
stages go through the layer's hook points (``_AttentionHooks``): the scores, then the bias (``hook_score_bias``),
the mask, their sum (``hook_masked_scores`` = scores + bias + M), the sink column where there is one
(``hook_sink_logits`` / ``hook_sink_weight``, as gpt-oss's), the pattern and A·V.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

# no import of _hf_attention or _hf_probe, which import this module: what is needed of them comes as arguments (the
# hook points as any module with them, the probe's calls as objects with its _Call's fields)
_Call = Any


def sink_column(sinks: torch.Tensor, B: int, H: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    """The sink logits as one column beside the scores, ``[B, H, n, 1]``: from one learned logit per head (gpt-oss's
    ``s_aux [H]``) or from one per head and query (Inkling 2's ``sinks [B, H, n, 1]``, projected from each
    position's hidden state)."""
    if sinks.dim() == 1:
        sinks = sinks.reshape(1, H, 1, 1)
    return sinks.to(dtype).expand(B, H, n, 1)


def attention_with_extras(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                          hooks: nn.Module | None, scale: float, bias: torch.Tensor | None = None,
                          sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention with what transformers' eager functions add beside the mask, stage by stage as they compute it:
    scores = QKᵀ·scale, + a score bias ``[B|1, H, n, t]`` where given (Inkling, ``hook_score_bias``), + M; softmax in
    float32 over the t keys — and, where ``sinks`` is given (gpt-oss's ``s_aux [H]``, Inkling 2's ``[B, H, n, 1]``),
    over one more column holding the sink logit, dropped after the softmax, so that A's rows sum to less than 1
    (``hook_sink_weight``: what the sink took). ``query [B,H,n,d]``, ``key``/``value`` ``[B,G,t,d]``; returns
    ``z [B,H,n,d_v]``."""
    def through(name: str, x: torch.Tensor) -> torch.Tensor:
        point = getattr(hooks, name, None) if hooks is not None else None
        return point(x) if point is not None else x

    B, H, n, _ = query.shape
    group = H // key.shape[1]  # query head h reads key/value head h // (H/G), as transformers' repeat_kv
    keys, values = key.repeat_interleave(group, dim=1), value.repeat_interleave(group, dim=1)  # [B,H,t,d]
    qk = through("hook_qk", query @ keys.transpose(-2, -1))  # [B,H,n,d] @ [B,H,d,t] -> [B,H,n,t]
    logits = through("hook_attn_scores", qk * scale)
    if bias is not None:
        logits = logits + through("hook_score_bias", bias.to(logits.dtype))  # the order of Inkling's eager function
    if mask is not None:
        logits = logits + through("hook_mask", mask)  # + [B|1,1,n,t]
    if bias is not None or mask is not None:
        logits = through("hook_masked_scores", logits)  # scores (+ bias) + M
    if sinks is None:
        pattern = through("hook_pattern", torch.softmax(logits, dim=-1, dtype=torch.float32).to(query.dtype))
        return pattern @ values  # [B,H,n,t] @ [B,H,t,d_v]
    sink = through("hook_sink_logits", sink_column(sinks, B, H, n, logits.dtype))
    probs = torch.softmax(torch.cat([logits, sink], dim=-1), dim=-1, dtype=torch.float32).to(query.dtype)
    pattern = through("hook_pattern", probs[..., :-1])  # [B,H,n,t]: the keys' share, rows sum to < 1
    through("hook_sink_weight", probs[..., -1:])  # [B,H,n,1]
    return pattern @ values


# -- layers entered several times per forward, or running several attentions -----------------------------------
def call_blocks(hf: nn.Module, calls: Sequence[_Call], lists: dict[int, nn.ModuleList], device: torch.device,
                keyword: str) -> nn.ModuleList | None:
    """One block per attention call, in the order of the calls, where a forward calls attention more than once per
    layer in one of two ways, each call with a cache slot of its own:

    * a layer run several times per forward (HRM, Wang et al. 2025, "Hierarchical Reasoning Model": a low-level and
      a high-level stack of layers, the low one run ``L_cycles`` times per high-level cycle, the whole ``H_cycles``
      times; each run keeps its own K and V, in slot ``layer_idx + cycle_offset``) — one call per run;
    * a layer running several attention modules in one run (LongCat-Flash: two sublayers per layer, each with its
      own attention, norms and MLP, in slots 2·L and 2·L + 1) — ``split_layers`` finds each sublayer's modules.

    Returns, per block, the layer module whose run it is (repeated where a layer holds several blocks); None where
    the calls are not so: every call inside a layer, every run of a layer making the same calls of attention modules
    of its own (none shared with another layer, none called twice in one run — DiffLlama's differential attention
    is that), a layer re-entered or running several attentions but not both, and the calls' order the order of the
    cache slots they write (one cached forward checks it)."""
    if not calls or any(c.layer is None for c in calls):
        return None
    runs: dict[int, list[_Call]] = {}
    for c in calls:
        runs.setdefault(c.entry, []).append(c)
    made: dict[tuple[int, int], list[tuple[int, ...]]] = {}  # per layer, the modules each of its runs called
    for run in runs.values():
        modules = tuple(id(c.module) for c in run)
        if len(set(modules)) < len(modules) or len({c.layer for c in run}) != 1:
            return None
        made.setdefault(cast(tuple[int, int], run[0].layer), []).append(modules)
    owners: dict[int, tuple[int, int]] = {}
    for layer, each in made.items():
        if any(m != each[0] for m in each) or (len(each) > 1 and len(each[0]) > 1):
            return None  # a run calls other modules than the first, or a layer both re-entered and split
        for module in each[0]:
            if owners.setdefault(module, layer) != layer:
                return None  # one attention module in several layers (Zamba's shared block)
    if all(len(each) == 1 and len(each[0]) == 1 for each in made.values()):
        return None  # one call per layer: the ordinary case
    first = calls[0].mask
    if first is not None and first.device.type != "meta" and first.shape[-1] >= 2 and first.shape[-2] >= 2:
        hidden = first[0, 0] <= torch.finfo(first.dtype).min / 2 if first.is_floating_point() else ~first[0, 0]
        if not bool(hidden[0, 1]):  # position 0 sees position 1: an encoder, refused as any (_find_attention)
            return None
    if cache_slots(hf, device, keyword) != list(range(len(calls))):
        return None
    return nn.ModuleList([lists[c.layer[0]][c.layer[1]] for c in calls if c.layer is not None])


_NAMES_ATTENTION_NORM = ("input_layernorm", "ln_1", "attention_norm")  # the norm in front of a sublayer's attention
_NAMES_SUB_MLP = ("mlps", "mlp", "feed_forward")  # a sublayer's MLP (LongCat-Flash: mlps[i]; its mlp is the shortcut)
_NAMES_SUB_MLP_NORM = ("post_attention_layernorm", "ffn_norm")


@dataclass(frozen=True)
class Sublayer:
    """The modules of one of a layer's several attention sublayers (LongCat-Flash), each the i-th element of a
    ModuleList child of the layer as long as the layer's attentions: their hooks stand for the layer's own."""

    layer: nn.Module
    attention_norm: nn.Module | None  # its input: the residual stream entering the sublayer (hook_resid_pre)
    mlp_norm: nn.Module | None  # its input: x + attention output (hook_resid_mid)
    mlp: nn.Module | None  # its output: hook_mlp_out
    next_norm: nn.Module | None  # the next sublayer's attention norm, whose input is this one's output; None: the
    # last sublayer, whose output is the layer's (hook_resid_post)


def split_layers(layers: Sequence[nn.Module], attns: Sequence[nn.Module | None]) -> dict[int, Sublayer]:
    """Per block that is one of several attentions a layer runs in one forward (``call_blocks``), its sublayer."""
    by_layer: dict[int, list[int]] = {}
    for block, layer in enumerate(layers):
        by_layer.setdefault(id(layer), []).append(block)
    out: dict[int, Sublayer] = {}
    for blocks in by_layer.values():
        mods = [attns[b] for b in blocks]
        if len(blocks) < 2 or any(m is None for m in mods) or len({id(m) for m in mods}) < len(mods):
            continue  # one block, or a re-entered layer (Reentry)
        layer = layers[blocks[0]]
        lists = {name: child for name, child in layer.named_children()
                 if isinstance(child, nn.ModuleList) and len(child) == len(blocks)}

        def element(names: tuple[str, ...], i: int, lists: dict[str, nn.ModuleList] = lists) -> nn.Module | None:
            found = next((lists[n] for n in names if n in lists), None)
            return found[i] if found is not None and i < len(found) else None

        for i, block in enumerate(blocks):
            out[block] = Sublayer(layer, element(_NAMES_ATTENTION_NORM, i), element(_NAMES_SUB_MLP_NORM, i),
                                  element(_NAMES_SUB_MLP, i), element(_NAMES_ATTENTION_NORM, i + 1))
    return out


def _through_input(point: Any) -> Callable[..., Any]:
    def pre(module: nn.Module, args: tuple) -> tuple | None:
        return (point(args[0]), *args[1:]) if args else None
    return pre


def install_sublayer(sub: Sublayer, hooks: Any) -> list[Any]:
    """A sublayer block's residual hooks (``_BlockHooks``), on its own modules (the attention's are HFDecoder's)."""
    handles = []
    if sub.attention_norm is not None:
        handles.append(sub.attention_norm.register_forward_pre_hook(_through_input(hooks.hook_resid_pre)))
    if sub.mlp_norm is not None and hasattr(hooks, "hook_resid_mid"):
        handles.append(sub.mlp_norm.register_forward_pre_hook(_through_input(hooks.hook_resid_mid)))
    if sub.mlp is not None:
        handles.append(sub.mlp.register_forward_hook(
            lambda m, a, out: hooks.hook_mlp_out(out) if isinstance(out, torch.Tensor) else None))
    if sub.next_norm is not None:
        handles.append(sub.next_norm.register_forward_pre_hook(_through_input(hooks.hook_resid_post)))
    else:
        handles.append(sub.layer.register_forward_hook(
            lambda m, a, out: hooks.hook_resid_post(out) if isinstance(out, torch.Tensor) else None))
    return handles


def cache_slots(hf: nn.Module, device: torch.device, keyword: str) -> list[int]:
    """The cache slot (``layer_idx``) of each ``update`` of transformers' own cache, in order, in one cached forward of
    two tokens on ``device`` (its cache handed over as ``keyword``); empty where that forward fails."""
    import contextlib

    from transformers.cache_utils import DynamicCache

    from gpt_shape_tracer.model.sources._meta_ops import meta_op_cache

    try:
        cache = DynamicCache(config=getattr(hf, "config", None))
    except Exception:  # noqa: BLE001 (a cache transformers cannot build for this config: no slots known)
        return []
    slots: list[int] = []
    update = cache.update

    def recorded(key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any):
        slots.append(int(layer_idx))
        return update(key_states, value_states, layer_idx, *args, **kwargs)

    cache.update = recorded  # type: ignore[method-assign]  # on this instance only
    tokens = torch.zeros(1, 1 if device.type == "meta" else 2, dtype=torch.long, device=device)
    try:
        with torch.no_grad(), meta_op_cache() if device.type == "meta" else contextlib.nullcontext():
            hf(input_ids=tokens, attention_mask=torch.ones_like(tokens), **{keyword: cache}, use_cache=True)
    except Exception:  # noqa: BLE001 (its cached forward fails: no slots known)
        return []
    return slots


class Reentry:
    """Which block each run of a re-entered layer is (``reentered_layers``): the k-th run of a layer module in a
    forward is the k-th block it appears in. A forward pre-hook on the whole model starts the count again; one on each
    such layer, registered before the blocks' own hooks, advances it and points the layer's attention at that block's
    hook points (``_HOOKS``); ``gate`` lets a block's hooks on a shared module act only in that block's run."""

    def __init__(self, layers: Iterable[nn.Module], attns: Sequence[nn.Module | None]) -> None:
        self.blocks_of: dict[int, list[int]] = {}
        for block, layer in enumerate(layers):
            self.blocks_of.setdefault(id(layer), []).append(block)
        for key in [k for k, blocks in self.blocks_of.items() if len({id(attns[b]) for b in blocks}) > 1]:
            del self.blocks_of[key]  # several attentions in one run (split_layers), not runs of one
        self.runs: dict[int, int] = {}  # runs of each layer module in this forward
        self.current: dict[int, int] = {}  # the block of each layer module's current run

    @property
    def active(self) -> bool:
        return any(len(blocks) > 1 for blocks in self.blocks_of.values())

    def install(self, hf: nn.Module, layers: Iterable[nn.Module], attns: Sequence[nn.Module | None],
                hooks: MutableMapping[nn.Module, Any], attention_hooks: Sequence[Any]) -> list[Any]:
        """The hooks that keep the count (their handles, for removal)."""
        handles = [hf.register_forward_pre_hook(lambda m, a: self.reset())]
        done: set[int] = set()
        for layer in layers:
            if id(layer) in done or id(layer) not in self.blocks_of:
                continue
            done.add(id(layer))
            handles.append(layer.register_forward_pre_hook(
                lambda m, a: self.enter(m, attns, hooks, attention_hooks)))
        return handles

    def reset(self) -> None:
        self.runs.clear()
        self.current.clear()

    def enter(self, layer: nn.Module, attns: Sequence[nn.Module | None], hooks: MutableMapping[nn.Module, Any],
              attention_hooks: Sequence[Any]) -> None:
        blocks = self.blocks_of[id(layer)]
        run = self.runs.get(id(layer), 0)
        self.runs[id(layer)] = run + 1
        block = self.current[id(layer)] = blocks[run % len(blocks)]
        attn = attns[block]
        if attn is not None:
            hooks[attn] = attention_hooks[block]

    def gate(self, layer: nn.Module, block: int) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """A hook function of ``block`` on ``layer`` or a module inside it, made to act only in that block's run
        (returning None, which leaves the module's input or output as it is, in the others)."""
        def wrap(function: Callable[..., Any]) -> Callable[..., Any]:
            if len(self.blocks_of.get(id(layer), ())) < 2:
                return function
            return lambda *args, **kwargs: function(*args, **kwargs) if self.current.get(id(layer)) == block \
                else None
        return wrap


# -- state kept outside transformers' Cache ---------------------------------------------------------------------
class HeldState:
    """State a model keeps from one step to the next outside transformers' ``Cache`` — in attributes of its own
    modules (RecurrentGemma) or in a cache object of its family's own (xLSTM) — held in our ``StateCache`` as its
    ``carried`` tensors (flat, in a fixed order), so that the cache keeps a copy after every committed step, rolls a
    failed forward back and ``copy(length)`` starts from the state at ``length``. Before each forward the state goes
    from the cache to where the model reads it (``passed``), after it back into the cache (``kept``): the model's
    own copy is never trusted between forwards (transformers' own forwards, another cache's, overwrite it)."""

    layers: tuple[int, ...] = ()  # the layers that keep some

    def passed(self, cache: Any, view: Any) -> Any:
        """What the forward receives under its cache keyword (``view``: our cache as transformers' ``Cache``)."""
        raise NotImplementedError

    def kept(self, cache: Any, out: Any) -> None:
        raise NotImplementedError

    def per_layer(self, cache: Any) -> dict[int, list[tuple[str, torch.Tensor]]]:
        """The held tensors of each layer, with their names, as the cache holds them now."""
        raise NotImplementedError

    def record(self, cache: Any, blocks: nn.ModuleList) -> None:
        """Each layer's state after the forward through ``hook_conv_state`` (a convolution's window, where the
        layer keeps one) and ``hook_ssm_state`` (the rest, flattened per head where the tensors share [B, H], else
        per sequence, and concatenated: xLSTM's C, n and m): copies, as the cache holds them."""
        for layer, named in self.per_layer(cache).items():
            block = blocks[layer]
            conv = [x for name, x in named if "conv" in name.lower()]
            rest = [x for name, x in named if "conv" not in name.lower()]
            conv_point, ssm_point = getattr(block, "hook_conv_state", None), getattr(block, "hook_ssm_state", None)
            if conv and isinstance(conv_point, nn.Module):
                conv_point(join_states(conv))
            if rest and isinstance(ssm_point, nn.Module):
                ssm_point(join_states(rest))


def join_states(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Several state tensors of one layer as one record: itself for one; joined along the channels (dim 1) where they
    differ in that only (Inkling's four short convolutions, [B, C_i, k] each); else ``_flat``."""
    if len(tensors) == 1:
        return tensors[0].clone()
    first = tensors[0]
    if all(x.dim() == first.dim() >= 2 and x.shape[:1] + x.shape[2:] == first.shape[:1] + first.shape[2:]
           for x in tensors):
        return torch.cat(tensors, dim=1)
    return _flat(tensors)


def _flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    lead = 2 if len({tuple(x.shape[:2]) for x in tensors}) == 1 and all(x.dim() >= 2 for x in tensors) else 1
    return torch.cat([x.flatten(lead) for x in tensors], dim=-1)


class ModuleState(HeldState):
    """RecurrentGemma: its recurrent blocks keep their state in attributes of their own modules (the convolution's
    last inputs, ``conv1d_state``; the RG-LRU's hidden state, ``rg_lru.recurrent_states``), which its forward reads and
    replaces and returns no cache object for. Before each forward they are set from the cache (None for an empty
    cache, from which the model starts its state at zero), after it read back."""

    def __init__(self, slots: dict[int, list[tuple[nn.Module, str, str]]]) -> None:
        self.slots = slots  # per layer: (module, attribute, its path inside the layer)
        self.layers = tuple(sorted(slots))
        self.order = [(layer, module, attr, path) for layer in self.layers for module, attr, path in slots[layer]]

    def passed(self, cache: Any, view: Any) -> Any:
        held = cache.carried
        for i, (_, module, attr, _) in enumerate(self.order):
            setattr(module, attr, held[i].clone() if held else None)
        return view

    def kept(self, cache: Any, out: Any) -> None:
        values = [getattr(module, attr) for _, module, attr, _ in self.order]
        if all(isinstance(v, torch.Tensor) for v in values):
            cache.carried = list(values)

    def per_layer(self, cache: Any) -> dict[int, list[tuple[str, torch.Tensor]]]:
        out: dict[int, list[tuple[str, torch.Tensor]]] = {}
        for (layer, _, _, path), x in zip(self.order, cache.carried or ()):
            out.setdefault(layer, []).append((path, x))
        return out


def module_state(hf: nn.Module, layers: nn.ModuleList, stateless: Sequence[int],
                 device: torch.device) -> ModuleState | None:
    """The tensors layers ``stateless`` (without attention, writing nothing into transformers' cache) keep in plain
    attributes of their modules — found by what one cached forward of two tokens leaves there that was not there
    before: RecurrentGemma's ``conv1d_state`` and ``recurrent_states``. None where no layer keeps any (or on the meta
    device, where no forward shows anything)."""
    if not stateless or device.type == "meta":
        return None

    def attributes() -> dict[tuple[int, int, str], torch.Tensor]:
        return {(L, id(m), name): value for L in stateless for m in layers[L].modules()
                for name, value in vars(m).items() if isinstance(value, torch.Tensor) and not name.startswith("_")}

    before = attributes()
    tokens = torch.zeros(1, 2, dtype=torch.long, device=device)
    try:
        with torch.no_grad():
            hf(input_ids=tokens, attention_mask=torch.ones_like(tokens), use_cache=True)
    except Exception:  # noqa: BLE001 (its cached forward fails: nothing known)
        return None
    after = attributes()
    paths = {id(m): name for L in stateless for name, m in layers[L].named_modules()}
    slots: dict[int, list[tuple[nn.Module, str, str]]] = {}
    for L in stateless:
        for m in layers[L].modules():
            for attr in vars(m):
                key = (L, id(m), attr)
                if key in after and before.get(key) is not after[key]:
                    slots.setdefault(L, []).append((m, attr, f"{paths[id(m)]}.{attr}".lstrip(".")))
    return ModuleState(slots) if slots else None


class OwnCacheState(HeldState):
    """xLSTM: its forward takes and returns a cache object of its family's own (``xLSTMCache``, not transformers'
    ``Cache``) holding, per layer, a tuple of state tensors (the mLSTM's matrix memory C, normaliser n and stabiliser
    m), updated in place. Each forward gets a copy of the object found at load whose per-layer state is the cache's
    (None for an empty cache: the model builds its own, from zeros); the tensors are read back after it."""

    def __init__(self, template: Any, field: str, layers: int) -> None:
        self.template, self.field = template, field
        self.layers = tuple(range(layers))
        self.widths = [len(getattr(template, field)[L]) for L in self.layers]

    def passed(self, cache: Any, view: Any) -> Any:
        import copy

        if not cache.carried:
            return None
        own = copy.copy(self.template)
        for name, value in vars(self.template).items():  # its counters, updated in place: its own
            if isinstance(value, torch.Tensor):
                setattr(own, name, value.clone())
        held, state, i = cache.carried, {}, 0
        for L, width in zip(self.layers, self.widths):
            state[L] = tuple(x.clone() for x in held[i:i + width])
            i += width
        setattr(own, self.field, state)
        return own

    def kept(self, cache: Any, out: Any) -> None:
        own = getattr(out, "cache_params", None)
        state = getattr(own, self.field, None) if own is not None else None
        if isinstance(state, dict):
            cache.carried = [x for L in self.layers for x in state[L]]

    def per_layer(self, cache: Any) -> dict[int, list[tuple[str, torch.Tensor]]]:
        out, i = {}, 0
        for L, width in zip(self.layers, self.widths):
            out[L] = [(f"{self.field}[{L}][{j}]", x) for j, x in enumerate((cache.carried or [])[i:i + width])]
            i += width
        return out


def own_cache_state(hf: nn.Module, lists: dict[int, nn.ModuleList], device: torch.device,
                    keyword: str) -> tuple[nn.ModuleList, OwnCacheState] | None:
    """A model without attention whose forward hands back, under its cache keyword, an object of its family's own that
    is not transformers' ``Cache`` and holds one tuple of state tensors per layer (a dict keyed 0 … n−1) — n the length
    of exactly one outermost list of layers: that list and the state's keeper; None otherwise."""
    from transformers.cache_utils import Cache

    if keyword == "state" or device.type == "meta":
        return None
    tokens = torch.zeros(1, 2, dtype=torch.long, device=device)
    try:
        with torch.no_grad():
            own = getattr(hf(input_ids=tokens, use_cache=True), keyword, None)
    except Exception:  # noqa: BLE001 (its forward failing is reported by the refusal that follows)
        return None
    if own is None or isinstance(own, Cache) or not hasattr(own, "__dict__"):  # XLNet's mems: a tuple of tensors
        return None
    fields = [(name, value) for name, value in vars(own).items() if isinstance(value, dict) and value
              and set(value) == set(range(len(value))) and all(
                  isinstance(v, (tuple, list)) and v and all(isinstance(x, torch.Tensor) for x in v)
                  for v in value.values())]
    if len(fields) != 1:
        return None
    name, state = fields[0]
    inner = {id(m) for outer in lists.values() for element in outer for m in element.modules()
             if isinstance(m, nn.ModuleList)}
    stacks = [m for key, m in lists.items() if key not in inner and len(m) == len(state)]
    return (stacks[0], OwnCacheState(own, name, len(state))) if len(stacks) == 1 else None


def block_origins(hf: nn.Module, layers: Iterable[nn.Module],
                  attns: Sequence[nn.Module | None]) -> tuple[str | None, ...]:
    """Per block, what it is where a layer holds several blocks (``call_blocks``), as a sentence: which run of a
    re-entered layer (HRM), or which of a layer's attention sublayers (LongCat-Flash), with the layer's path in the
    model; None for a block that is its layer's only one."""
    paths = {id(m): name for name, m in hf.named_modules()}
    layers = list(layers)
    per_layer: dict[int, list[int]] = {}
    for block, layer in enumerate(layers):
        per_layer.setdefault(id(layer), []).append(block)
    out: list[str | None] = []
    for block, layer in enumerate(layers):
        blocks = per_layer[id(layer)]
        if len(blocks) == 1:
            out.append(None)
            continue
        k, count, path = blocks.index(block) + 1, len(blocks), paths.get(id(layer), "?")
        if len({id(attns[b]) for b in blocks}) == 1:  # one attention module: the layer run again
            out.append(f"Block {block} is run {k} of {count} of the layer {path}: the model runs that layer {count} "
                       "times per forward, with the same weights, each run attending over K and V of its own")
        else:
            attn = paths.get(id(attns[block]), "?")
            out.append(f"Block {block} is attention {k} of {count} of the layer {path} ({attn}): a sublayer with its "
                       "own attention, norms and MLP, attending over K and V of its own")
    return tuple(out)
