"""Finding a transformers model's parts by what they do: which module calls the attention function inside
which layer (``_probe_calls``, ``_find_attention``) — or, where none does, which module computes a softmax whose
output multiplies V in its own code (``_hf_own_attention.probe``) —, which layers keep state instead
(``_state_writers``), what the mixers are called, and which keyword its forward takes the cache under.
"""

from __future__ import annotations

import contextlib
import inspect
import re
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from gpt_shape_tracer.model.sources._hf_attention import _probing, differential_lambda
from gpt_shape_tracer.model.sources._hf_own_attention import Found
from gpt_shape_tracer.model.sources._hf_own_attention import probe as own_attention_probe
from gpt_shape_tracer.model.sources._hf_own_cache import prompt_positions
from gpt_shape_tracer.model.sources._hf_refusals import HFDecoderError
from gpt_shape_tracer.model.sources._hf_stacks import stack_blocks
from gpt_shape_tracer.model.sources._hf_variants import call_blocks, own_cache_state
from gpt_shape_tracer.model.sources._meta_ops import meta_op_cache

if TYPE_CHECKING:  # transformers is imported where it is used: loading our own models never needs it
    pass
_NAMES_OUT = ("o_proj", "dense", "out_proj", "c_proj", "wo")  # the attention's output projection W_O
_NAMES_FINAL_NORM = ("norm", "ln_f", "final_layer_norm", "final_layernorm", "norm_f")
_NAMES_MLP = ("mlp", "feed_forward", "block_sparse_moe", "ffn", "fc2")  # fc2: OPT's MLP has no module of its own
_NAMES_MLP_NORM = ("pre_feedforward_layernorm", "post_attention_layernorm", "ln_2", "ffn_norm", "final_layer_norm")
PARALLEL_BLOCKS = ("gptj", "phi", "cohere", "cohere2")  # attention and MLP read the same stream (also: a
# config's use_parallel_residual, Falcon's parallel_attn)

# -- finding the parts ----------------------------------------------------------------------------------
def _child(module: nn.Module, names: tuple[str, ...]) -> nn.Module | None:
    for name in names:
        found = getattr(module, name, None)
        if isinstance(found, nn.Module):
            return found
    return None


def mlp_of(layer: nn.Module) -> nn.Module | None:
    """The layer's MLP: its child under an MLP name — or, where that child is a sublayer block of its own holding only
    the norm in front of the MLP, the MLP under an MLP name and a dropout (CPM-Ant's ``CpmAntFFNBlock``, which adds the
    MLP's output to its input itself), that inner MLP, whose output is what the block adds to the stream."""
    mlp = _child(layer, _NAMES_MLP)
    inner = _child(mlp, _NAMES_MLP[:-1]) if mlp is not None else None  # not fc2: a linear layer is no MLP block
    if mlp is None or inner is None:
        return mlp
    kinds = ["norm" if "norm" in type(m).__name__.lower() else "dropout" if isinstance(m, nn.Dropout) else
             "mlp" if m is inner else "other" for m in mlp.children()]
    return inner if "norm" in kinds and "other" not in kinds else mlp


def mlp_norm_of(layer: nn.Module) -> nn.Module | None:
    """The norm in front of the layer's MLP, whose input is the stream between attention and MLP (``hook_resid_mid``):
    the layer's child under a norm name, or the norm inside the layer's MLP block (``mlp_of``: CPM-Ant's)."""
    norm = _child(layer, _NAMES_MLP_NORM)
    block = _child(layer, _NAMES_MLP)
    if norm is not None or block is None or mlp_of(layer) is block:
        return norm
    return next((m for m in block.children() if "norm" in type(m).__name__.lower()), None)


@dataclass(frozen=True)
class _Call:
    """One call of the attention function during the probe."""

    layer: tuple[int, int] | None  # (id of the outermost ModuleList running, index in it); None: outside any
    module: nn.Module
    heads: int  # H, the query heads
    kv_heads: int  # G, the key/value heads
    q_head: int  # d_head of the queries/keys
    v_head: int  # d_head of the values
    sinks: bool
    mask: torch.Tensor | None  # [B|1,1,n,t] as the attention received it
    unmodelled: tuple[str, ...] = ()  # arguments given that change the scores and that traced_attention ignores
    key: torch.Tensor | None = field(default=None, compare=False, repr=False)  # K as received: another layer's K
    # object itself where the layer reads that layer's K and V (KV sharing)
    query: torch.Tensor | None = field(default=None, compare=False, repr=False)  # Q as received
    differential: bool = False  # the layer's two calls share Q and K: differential attention (DiffLlama)
    score_bias: bool = False  # a position_bias beside the mask (Inkling), staged by _hf_variants.py
    entry: int = field(default=-1, compare=False)  # which entry into an outermost layer it came in (counted from 0):
    # a layer entered several times per forward (HRM's recurrent stacks) makes one call per entry
    own: Any = field(default=None, compare=False, repr=False)  # the Reading of an attention computed in the
    # family's own code (model/sources/_hf_own_attention.py), None for a call of the attention function


# arguments of the attention interface that change the scores or the softmax and that traced_attention does not
# model (it stages sinks as s_aux, gpt-oss's name, or sinks, Inkling 2's, and Inkling's position_bias): a family
# passing one of them is refused, not traced wrong
_UNMODELLED = {"score_mod": "a score modification function", "attention_bias": "a bias added to the scores"}


# words of state-space / recurrent mixers' class names: only to say why a model that makes no attention call at all is
# refused (no softmax attention, or attention in its own code); a hybrid's state layers are found by what they keep
# (``_state_writers``, ``_state_layers``)
_STATE_WORDS = ("mamba", "ssm", "conv", "rwkv", "recurrent", "lstm", "linear_attn", "linearattention", "mixer",
                "retention", "deltanet", "gated_delta", "lightning", "hyena", "short_conv")


def _module_words(hf: nn.Module) -> set[str]:
    return {type(m).__name__.lower() for m in hf.modules()}


def _accelerate_hooks(module: nn.Module) -> list[Any]:
    """The accelerate hooks on a module (``dispatch_model`` attaches one, or a ``SequentialHook`` of several)."""
    hook = getattr(module, "_hf_hook", None)
    return [] if hook is None else list(getattr(hook, "hooks", None) or [hook])


def _token_device(hf: nn.Module) -> torch.device:
    """Where token ids go: the device of the embedding, or accelerate's execution device when the embedding is
    offloaded (its weight is then a ``meta`` placeholder)."""
    embed = hf.get_input_embeddings()  # type: ignore[operator]
    weight = embed.weight
    if weight.device.type != "meta":
        return weight.device
    hooks = _accelerate_hooks(embed)
    for hook in hooks:
        if getattr(hook, "execution_device", None) is not None:
            return torch.device(hook.execution_device)
    return torch.device("cpu") if hooks else weight.device  # no hook: a dry run, wholly on meta


def _probe_calls(hf: nn.Module) -> tuple[list[_Call], dict[int, nn.ModuleList]]:
    """Two tokens through the model, recording every call of the attention function and which element of which
    ModuleList was running (the outermost one) when it came — the layers are found by what they call, not by
    their class names or where they sit: a vision tower that is not run is never mistaken for the text stack."""
    frames: list[tuple[int, int]] = []
    entries = [-1]  # entries into an outermost layer so far
    calls: list[_Call] = []
    lists = {id(m): m for m in hf.modules() if isinstance(m, nn.ModuleList)}
    handles = []

    def leave(module: nn.Module, args: Any, output: Any) -> None:  # returns None: the output stays as it is
        if frames:
            frames.pop()

    def enter(key: int, i: int) -> None:
        if not frames:
            entries[0] += 1
        frames.append((key, i))

    for key, modules in lists.items():
        for i, layer in enumerate(modules):
            handles.append(layer.register_forward_pre_hook(lambda m, a, k=key, i=i: enter(k, i)))
            handles.append(layer.register_forward_hook(leave))

    def record(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               mask: torch.Tensor | None, kwargs: dict) -> None:
        calls.append(_Call(frames[0] if frames else None, module, int(query.shape[-3]), int(key.shape[-3]),
                           int(query.shape[-1]), int(value.shape[-1]),
                           kwargs.get("s_aux") is not None or kwargs.get("sinks") is not None, mask,
                           tuple(k for k in _UNMODELLED if kwargs.get(k) is not None), key, query,
                           score_bias=kwargs.get("position_bias") is not None, entry=entries[0]))

    device = _token_device(hf)
    # two tokens, so that the first's mask row shows whether it sees the second (causal or not); on the meta
    # device one (no mask value can be read there, and a state-space mixer asks padding questions of two)
    tokens = torch.zeros(1, 1 if device.type == "meta" else 2, dtype=torch.long, device=device)
    _probing.record = record
    try:
        # on the meta device each op's output is computed once per distinct input (its layers are alike)
        with torch.no_grad(), meta_op_cache() if device.type == "meta" else contextlib.nullcontext():
            hf(input_ids=tokens, attention_mask=torch.ones_like(tokens), use_cache=False)
    except HFDecoderError:
        pass  # raised by traced_attention (sinks): the calls recorded so far say what the model is
    except Exception as e:  # noqa: BLE001 (transformers' own forward failing is a refusal, never a crash)
        raise HFDecoderError(f"transformers' own forward of this model fails on a two-token input "
                             f"({type(e).__name__}: {str(e)[:300]})", reason="cannot load") from None
    finally:
        _probing.record = None
        for handle in handles:
            handle.remove()
    return calls, lists


def _own_call(found: Found) -> _Call:
    """A softmax attention read from a family's own ops (``_hf_own_attention.probe``) as a call of the attention
    function would have been recorded; without a mask, one that hides nothing (every key seen: not causal)."""
    r = found.reading
    mask = r.mask if r.mask is not None else torch.zeros(1, 1, *r.pattern.shape[-2:], dtype=r.pattern.dtype,
                                                        device=r.pattern.device)
    return _Call(found.layer, found.module, int(r.query.shape[1]), int(r.key.shape[1]), int(r.query.shape[-1]),
                 int(r.value.shape[-1]), False, mask, key=r.key, query=r.query, own=r)


def _state_layers(hf: nn.Module) -> list[int]:
    """The layers whose cache holds convolution / state-space / linear-attention state (transformers' own cache
    for this config says so), which our KV cache does not keep."""
    try:
        from transformers.cache_utils import DynamicCache, LinearAttentionCacheLayerMixin

        config: Any = getattr(hf, "config", None)
        layers = DynamicCache(config=config).layers
    except Exception:  # noqa: BLE001 (a config whose cache transformers cannot describe: no state layers known)
        return []
    return [i for i, layer in enumerate(layers) if isinstance(layer, LinearAttentionCacheLayerMixin)]


# the methods through which a layer writes the state it keeps between steps into transformers' cache: the shared
# cache's conv / recurrent state (Qwen3-Next, Kimi Linear, Jamba, LFM2 …) and MiniMax's own linear-attention cache
_STATE_WRITES = ("update_conv_state", "update_recurrent_state", "set_linear_cache")


def _state_writers(hf: nn.Module, layers: nn.ModuleList) -> dict[int, nn.Module]:
    """Per decoder layer that writes state into transformers' cache, the module that writes it — the outermost
    module inside the layer running when the cache's ``update_conv_state`` / ``update_recurrent_state`` (or MiniMax's
    ``set_linear_cache``) is called during one cached forward. What a layer keeps between steps, found by what it
    does, not by its class name: Kimi Linear's ``KimiLinearDeltaAttention`` is such a mixer as much as Qwen3-Next's
    ``GatedDeltaNet``. Empty where that forward cannot run (the layers' cache kinds then come from
    ``_state_layers``)."""
    from transformers.cache_utils import DynamicCache

    own = _own_cache_class(hf)
    try:
        config: Any = getattr(hf, "config", None)
        cache = own() if own is not None and _keeps_linear_state(own) else DynamicCache(config=config)
    except Exception:  # noqa: BLE001 (a cache transformers cannot build for this config: nothing recorded)
        return {}
    running: list[tuple[int, nn.Module]] = []
    writers: dict[int, nn.Module] = {}
    handles = []

    def leave(module: nn.Module, args: Any, output: Any) -> None:  # returns None: the output stays as it is
        if running:
            running.pop()

    for L, layer in enumerate(layers):
        for child in layer.children():
            handles.append(child.register_forward_pre_hook(lambda m, a, L=L: running.append((L, m))))
            handles.append(child.register_forward_hook(leave))

    def recording(name: str):
        original = getattr(cache, name)

        def write(*args: Any, **kwargs: Any) -> Any:
            if running:
                writers.setdefault(*running[-1])
            return original(*args, **kwargs)

        return write

    for name in _STATE_WRITES:
        if callable(getattr(cache, name, None)):
            setattr(cache, name, recording(name))  # on this instance only
    device = _token_device(hf)
    tokens = torch.zeros(1, 1 if device.type == "meta" else 2, dtype=torch.long, device=device)
    try:
        with torch.no_grad(), meta_op_cache() if device.type == "meta" else contextlib.nullcontext():
            hf(input_ids=tokens, attention_mask=torch.ones_like(tokens), **{cache_keyword(hf): cache}, use_cache=True)
    except Exception:  # noqa: BLE001 (its cached forward fails: no layer's writes are known)
        return {}
    finally:
        for handle in handles:
            handle.remove()
    return writers


def _state_stack(hf: nn.Module, lists: dict[int, nn.ModuleList]) -> tuple[nn.ModuleList, dict[int, nn.Module]] | None:
    """A model that makes no attention call: the list of layers every one of which writes state into transformers'
    cache in a cached forward (Mamba, Mamba-2, Falcon-Mamba: every layer a state-space mixer), with each layer's
    writer (``_state_writers``) — found by what the layers do; None where no list's every layer keeps state. Only
    outermost lists are tried (a list inside another's element is part of a layer), longest first."""
    inner = {id(m) for outer in lists.values() for element in outer for m in element.modules()
             if isinstance(m, nn.ModuleList)}
    for layers in sorted((m for key, m in lists.items() if key not in inner and len(m)), key=len, reverse=True):
        writers = _state_writers(hf, layers)
        if len(writers) == len(layers):
            return layers, writers
    return None


def _carried_stack(hf: nn.Module, lists: dict[int, nn.ModuleList]) -> nn.ModuleList | None:
    """A model that makes no attention call and writes nothing into transformers' cache, but whose forward hands back
    its state (``state``: RWKV) as tensors with one slice per layer in their last axis: the outermost list of layers
    as long as that axis, every layer then a state layer (the state sliced at its index); None otherwise."""
    if cache_keyword(hf) != "state":
        return None
    device = _token_device(hf)
    if device.type == "meta":
        return None
    tokens = torch.zeros(1, 2, dtype=torch.long, device=device)
    try:
        with torch.no_grad():
            carried = getattr(hf(input_ids=tokens, use_cache=True), "state", None)
    except Exception:  # noqa: BLE001 (its forward failing is reported by the refusal that follows)
        return None
    if not isinstance(carried, (list, tuple)) or not carried or not all(
            isinstance(x, torch.Tensor) and x.dim() >= 2 for x in carried):
        return None
    depth = {int(x.shape[-1]) for x in carried}
    inner = {id(m) for outer in lists.values() for element in outer for m in element.modules()
             if isinstance(m, nn.ModuleList)}
    stacks = [m for key, m in lists.items() if key not in inner and len(depth) == 1 and len(m) in depth]
    return stacks[0] if len(stacks) == 1 else None


def _find_attention(hf: nn.Module, model_type: str) -> tuple[nn.ModuleList, list[_Call | None], dict[int, nn.Module]]:
    """The decoder layers and each one's call of the attention function in the probe — its ``module`` the
    layer's self-attention — found by which module calls the attention function inside which layer (None for a
    hybrid model's layer that mixes its positions with a state-space, convolution or linear-attention mixer
    instead), and, for those layers, the module that writes the state they keep (``_state_writers``); refuses, with
    the true reason, a model that does not fit at most one call per layer."""
    calls, lists = _probe_calls(hf)
    words = _module_words(hf)
    stateful = _state_stack(hf, lists) if not calls else None
    if stateful is not None:  # every layer a state layer (Mamba): traced as mixers, no attention anywhere
        layers, writers = stateful
        return layers, [None] * len(layers), writers
    carried = _carried_stack(hf, lists) if not calls else None
    if carried is not None:  # RWKV: every layer keeps its slice of the state the forward hands back
        return carried, [None] * len(carried), {}
    own = own_cache_state(hf, lists, _token_device(hf), cache_keyword(hf)) if not calls else None
    if own is not None:  # xLSTM: every layer keeps its state in a cache object of the family's own
        return own[0], [None] * len(own[0]), {}
    if not calls:  # no call of the attention function: a softmax attention in the family's own code, read from its ops
        calls = [_own_call(found) for found in own_attention_probe(hf, lists, model_type, _token_device(hf))]
    if not calls:
        attention_named = [w for w in words if ("attention" in w or "attn" in w) and "norm" not in w]
        state = [w for w in words if any(s in w for s in _STATE_WORDS)]
        if attention_named and not (state and all(any(s in w for s in _STATE_WORDS) for w in attention_named)):
            raise HFDecoderError(
                f"{model_type}: its attention ({', '.join(sorted(attention_named)[:3])}) is computed by the family's "
                "own code, and no softmax in it has an output that multiplies the values (its weights are made "
                "another way, without a softmax op), so its Q, K, V and pattern cannot be recorded",
                reason="attention outside the interface")
        raise HFDecoderError(f"{model_type}: no layer computes softmax attention (its mixers: "
                             f"{', '.join(sorted(state)[:3]) or 'none named'}): there is no attention pattern to "
                             "trace", reason="no softmax attention")
    unmodelled = sorted({k for c in calls for k in c.unmodelled})
    if unmodelled:
        given = "; ".join(f"{_UNMODELLED[k]} ({k})" for k in unmodelled)
        raise HFDecoderError(f"{model_type}: its attention passes {given} to transformers' attention function, which "
                             "the traced attention does not compute: its pattern would not be the one the model uses",
                             reason="score bias")
    counts: dict[int, int] = {}
    for c in calls:
        if c.layer is not None:
            counts[c.layer[0]] = counts.get(c.layer[0], 0) + 1
    if not counts:
        raise HFDecoderError(f"{model_type}: its attention runs outside any list of layers",
                             reason="attention outside the interface")
    layers = lists[max(counts, key=lambda k: counts[k])]
    per_layer: list[list[_Call]] = [[] for _ in layers]
    for c in calls:
        if c.layer is not None and c.layer[0] == id(layers):
            per_layer[c.layer[1]].append(c)
    elsewhere = [c for c in calls if c.layer is None or c.layer[0] != id(layers)]
    blocks = call_blocks(hf, calls, lists, _token_device(hf), cache_keyword(hf))
    if blocks is not None:  # HRM: layers run several times per forward; LongCat-Flash: two attentions per layer
        return blocks, list(calls), {}  # one block per call, each call its own cache slot
    for L, cs in enumerate(per_layer):  # differential attention: one module's two calls with the same Q and K
        if len(cs) == 2 and cs[0].module is cs[1].module and cs[0].query is cs[1].query and cs[0].key is cs[1].key \
                and cs[0].heads % 2 == 0 and differential_lambda(cs[0].module) is not None:
            per_layer[L] = [replace(cs[0], differential=True)]
    repeated = [L for L, cs in enumerate(per_layer) if len(cs) > 1]
    stacks = {c.layer[0] for c in calls if c.layer is not None}
    if not repeated and len(stacks) > 1:  # BLT: byte-level stacks around a global transformer over patches
        several = stack_blocks(calls, lists)  # one block per call, each named by its path (_hf_stacks.py)
        if several is not None:
            return several, list(calls), {}
        path = {id(m): name for name, m in hf.named_modules() if isinstance(m, nn.ModuleList)}
        named = sorted(path.get(key, "?") for key in stacks)
        raise HFDecoderError(
            f"{model_type}: its attention runs in {len(stacks)} lists of layers ({', '.join(named[:6])}), not each "
            "element of each list calling one attention module of its own once per forward (or a module that is not "
            "causal reading no second stream): the trace holds one block per call", reason="several stacks")
    if repeated or elsewhere:
        where = (f"layer(s) {', '.join(map(str, repeated[:8]))} call attention more than once per forward"
                 if repeated else f"{len(elsewhere)} attention call(s) come from outside its list of layers")
        raise HFDecoderError(f"{model_type}: {where} (several attentions, or layers run more than once); the trace "
                             "holds one attention per layer", reason="several attentions per layer")
    missing = [L for L, cs in enumerate(per_layer) if not cs]
    writers = _state_writers(hf, layers) if missing else {}
    # a layer keeps state where transformers' own cache gives it a state layer, or where it writes state into the
    # cache in a cached forward (what it does, not what its classes are called)
    state_layers = set(_state_layers(hf)) | set(writers)
    for L in missing:
        if L in state_layers:
            continue  # its mixer is whatever writes its state (Kimi Linear's delta attention among them)
        # a layer without attention and without state that holds an attention module: that attention never called
        # the interface
        silent = sorted({type(m).__name__ for m in layers[L].modules() if m is not layers[L]
                         and any(w in type(m).__name__.lower() for w in ("attention", "attn"))
                         and "norm" not in type(m).__name__.lower()})
        if silent or not state_layers:  # nothing of it mixes positions in a way the trace can hold
            raise HFDecoderError(
                f"{model_type}: layer(s) {L} " + (f"hold attention ({', '.join(silent[:3])}) that " if silent else
                                                  "make no attention call and keep no state; their attention ")
                + "does not go through transformers' attention interface, so its Q, K, V and pattern cannot be "
                "recorded", reason="attention outside the interface")
    # a layer without attention (a hybrid's state layer: Gated DeltaNet, Mamba …) is traced as its mixer's input
    # and output, its state kept by transformers' own cache layer inside StateCache
    shared = {id(cs[0].module) for cs in per_layer if cs}
    if len(shared) < sum(1 for cs in per_layer if cs):  # one attention module run inside several layers (Zamba)
        raise HFDecoderError(f"{model_type}: one attention module is shared by several layers (a shared block); the "
                             "trace holds one attention module per layer", reason="several attentions per layer")
    first = next(cs for cs in per_layer if cs)[0]
    # CPM-Ant, whose forward puts learned prompt positions before the text and lets every position see every other, is
    # traced whole, every step a full forward (model/sources/_hf_own_cache.py); any other bidirectional model is an
    # encoder
    # XLNet's attn_type "bi" (its checkpoints'): a permutation LM whose forward over the text lets every position
    # see every other; traced like CPM-Ant, every step a full forward (HFDecoder.bidirectional)
    if sees_ahead(first.mask) and not prompt_positions(first) and not permutation_lm(hf):
        raise HFDecoderError(f"{model_type}: its attention mask lets position 0 see position 1 (bidirectional, an "
                             "encoder): only causal decoders, whose position i sees positions ≤ i, are traced",
                             reason="encoder")
    return layers, [cs[0] if cs else None for cs in per_layer], writers


def permutation_lm(hf: nn.Module) -> bool:
    """Whether the forward is a permutation language model's (XLNet: it takes ``perm_mask`` and ``target_mapping``,
    the two-stream attention of Yang et al. 2019), whose forward over a text may let every position see every
    other (attn_type "bi")."""
    try:
        names = inspect.signature(hf.forward).parameters
    except (TypeError, ValueError):
        return False
    return "target_mapping" in names and "perm_mask" in names


def sees_ahead(mask: torch.Tensor | None) -> bool:
    """Whether a probe's mask ``[B|1, 1, n, t]`` (additive, or boolean: True where seen) lets its first position see
    the second: attention that is not causal (False where there are no values or fewer than two positions)."""
    if mask is None or mask.device.type == "meta" or mask.shape[-1] < 2 or mask.shape[-2] < 2:
        return False
    hidden = mask[0, 0] <= torch.finfo(mask.dtype).min / 2 if mask.is_floating_point() else ~mask[0, 0].bool()
    return not bool(hidden[0, 1])


def _kv_shared(probed: list[_Call | None]) -> tuple[tuple[int, int], ...]:
    """(layer, source) for each layer whose attention receives, as its keys, the very tensor an earlier layer's
    attention received (KV sharing, Gemma 3n and Gemma 4: the last layers compute no K, V and attend over those of
    the last earlier layer of their kind) — found by what the layers hand the attention function, not by config
    names. Such a layer appends nothing to the cache."""
    pairs: list[tuple[int, int]] = []
    for L, call in enumerate(probed):
        if call is None or call.key is None:
            continue
        source = next((P for P in range(L) if probed[P] is not None and cast(_Call, probed[P]).key is call.key), None)
        if source is not None:
            pairs.append((L, dict(pairs).get(source, source)))
    return tuple(pairs)


def cache_keyword(hf: nn.Module) -> str:
    """The name under which the model's forward takes its cache (and its output returns it): ``past_key_values``,
    ``cache_params`` (Mamba, Mamba-2, Falcon-Mamba), ``mems`` (XLNet), ``past_buckets_states`` (Reformer), ``cache``
    (XLM, which returns none) or ``state`` (RWKV: a list of tensors with one slice per layer, which the forward
    updates in place and hands back)."""
    import inspect

    try:
        names = inspect.signature(hf.forward).parameters
    except (TypeError, ValueError):
        return "past_key_values"
    if "past_key_values" in names:
        return "past_key_values"
    if "cache_params" in names:
        return "cache_params"
    if "mems" in names:  # XLNet: the hidden states each layer read, handed in and back (its cache)
        return "mems"
    if "past_buckets_states" in names:  # Reformer: its own cache object (hidden states and LSH buckets)
        return "past_buckets_states"
    if "cache" in names:  # XLM: its own keyword, for a Cache it fills with the whole text (_hf_own_cache.py)
        return "cache"
    return "state" if "state" in names else "past_key_values"  # RWKV: its state list, handed in and back


def _own_cache_class(hf: nn.Module) -> type | None:
    """A cache class the model's own modeling file defines (MiniMax's ``MiniMaxCache``: its forward accepts no
    other), None where the family uses transformers' shared cache."""
    import sys

    from transformers.cache_utils import Cache

    module = sys.modules.get(type(hf).__module__)
    for value in vars(module or object()).values():
        if isinstance(value, type) and issubclass(value, Cache) and value.__module__ == type(hf).__module__:
            return value
    return None


def _keeps_linear_state(own: type) -> bool:
    """Whether a family's own cache class is MiniMax's kind: a ``DynamicCache`` for the softmax layers' K and V
    plus one state tensor per linear-attention layer, read and written through ``get_linear_cache`` /
    ``set_linear_cache`` — which the traced cache's view can stand in for (``_cache_view``)."""
    from transformers.cache_utils import DynamicCache

    return issubclass(own, DynamicCache) and all(callable(getattr(own, name, None)) for name in
                                                 ("get_linear_cache", "set_linear_cache"))


def mixer_of(layer: nn.Module, writer: nn.Module | None = None) -> nn.Module:
    """The module that mixes a layer's positions when the layer has no attention: the one that writes the layer's
    state into the cache (``writer``, from ``_state_writers``: Qwen3-Next's GatedDeltaNet, Kimi Linear's delta
    attention, Jamba's MambaMixer, LFM2's ShortConv …); else the one child that is not a norm or an MLP
    (Nemotron-H's MoE-only blocks)."""
    if writer is not None:
        return writer
    mlp = _child(layer, _NAMES_MLP)  # the whole MLP block: none of it is the mixer
    skipped = {id(m) for m in mlp.modules()} if mlp is not None else set()
    children = [m for m in layer.children() if id(m) not in skipped
                and not any(w in type(m).__name__.lower() for w in ("norm", "dropout"))]
    if not children:
        raise HFDecoderError(f"{type(layer).__name__}: a layer without attention whose mixer was not found")
    return children[0]


# words the camel-case split would tear apart
_JOINED = {"Delta Net": "DeltaNet", "Mo E": "MoE", "Lo RA": "LoRA", "x LSTM": "xLSTM"}
# a name left with one of these only keeps its family: "Mixer", or RWKV's time mixing ("RwkvSelfAttention", which
# has no softmax) read as "Self Attention" would name nothing of its own
_GENERIC = ("Mixer", "Layer", "Block", "Module", "SelfAttention", "Attention")


def mixer_name(mixer: nn.Module, family_prefix: str) -> str:
    """A mixer's class name as words, without the family's prefix: ``Qwen3NextGatedDeltaNet`` → "Gated DeltaNet",
    ``NemotronHMamba2Mixer`` → "Mamba2 Mixer"; a name left with one generic word keeps its family ("Bamba Mixer")."""
    name = type(mixer).__name__
    own = name[len(family_prefix):] if family_prefix and name.startswith(family_prefix) else name
    if not own or own in _GENERIC:
        own = name
    words = re.sub(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", " ", own)
    for torn, joined in _JOINED.items():
        words = words.replace(torn, joined)
    return words




def _text_config(hf_config: Any) -> Any:
    return getattr(hf_config, "text_config", None) or hf_config


@dataclass(frozen=True)
class Architecture:
    """What a Hugging Face config says about the pieces (the view's labels come from here)."""

    model_type: str
    positions: str  # "rope" | "learned"
    norm: str  # "rmsnorm" | "layernorm"
    mlp: str  # "swiglu" (a gated MLP) | "gelu" (any two-matrix MLP) | "moe"
    parallel_block: bool  # attention and MLP read the same stream
    softcap: float | None  # attention logit soft-capping
    scale: float  # the attention's scale (1/√d_head unless the config says otherwise)


def _guess_architecture(hf: nn.Module, layer: nn.Module, attn: nn.Module | None, model_type: str) -> Architecture:
    cfg = _text_config(hf.config)
    has_rope = any("rotary" in type(m).__name__.lower() for m in hf.modules())
    norms = [type(m).__name__.lower() for m in layer.modules() if "norm" in type(m).__name__.lower()]
    rms = any("rms" in n for n in norms) or (bool(norms) and not any("layernorm" in n and "rms" not in n
                                                                     for n in norms))
    mlp = mlp_of(layer)
    if mlp is not None and any(k in type(mlp).__name__.lower() for k in ("moe", "sparse", "expert")):
        mlp_kind = "moe"
    elif mlp is not None and (hasattr(mlp, "gate_proj") or hasattr(mlp, "gate_up_proj") or any(
            "gated" in type(m).__name__.lower() and "norm" not in type(m).__name__.lower() for m in mlp.modules())):
        mlp_kind = "swiglu"  # a gated MLP, three matrices (CPM-Ant's CpmAntDenseGatedACT: GELU(x·W_0) ⊙ x·W_1)
    else:
        mlp_kind = "gelu"
    parallel = (model_type in PARALLEL_BLOCKS or bool(getattr(cfg, "use_parallel_residual", False))
                or (model_type == "falcon" and bool(getattr(cfg, "parallel_attn", True)
                                                    or getattr(cfg, "new_decoder_architecture", False))))
    softcap = getattr(cfg, "attn_logit_softcapping", None)
    scaling = getattr(attn, "scaling", None)
    heads = getattr(cfg, "num_attention_heads", None)
    d_head = getattr(attn, "head_dim", None) or (cfg.hidden_size // heads if isinstance(heads, int) and heads else
                                                 cfg.hidden_size)
    return Architecture(model_type=model_type, positions="rope" if has_rope else "learned",
                        norm="rmsnorm" if rms else "layernorm", mlp=mlp_kind, parallel_block=parallel,
                        softcap=float(softcap) if softcap else None,
                        scale=float(scaling) if isinstance(scaling, (int, float)) else d_head**-0.5)


def _indexer_key_dim(cfg: Any) -> int | None:
    """d_I, the width of the keys an indexed model's indexer caches (DSA: ``index_head_dim``; QSA:
    ``indexer_head_dim``)."""
    for name in ("index_head_dim", "indexer_head_dim"):
        value = getattr(cfg, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None
