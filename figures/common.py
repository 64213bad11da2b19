"""Helpers every view shares: the generation's facts, token labels per step, shapes as text, safe text."""

from __future__ import annotations

import html
import re
from pathlib import PurePath
from typing import cast

import torch

from gpt_shape_tracer.model.gpt import act_name
from gpt_shape_tracer.tracer import GenerationFacts, GenerationStep, SamplingRecord, TensorRecord, Trace

INERT = set("\\`*_{}[]()#+-.!|~<>:&\"'$\n\r")  # what markdown, HTML or Streamlit's math could act on
# GitHub-flavoured markdown links bare "http://", "www." and e-mail addresses after character references are
# decoded, so those three get an invisible word joiner (U+2060) where the pattern would match.
AUTOLINK = re.compile(r"(?i)(https?:)(?=//)|(www)(?=\.)|(@)")
WORD_JOINER = "\u2060"


def inert(text: str | Exception | PurePath) -> str:
    """Text the app did not write (token labels, file names, paths, messages quoting them) for a markdown
    string or an HTML block shown with ``st.markdown``: every character that markdown, HTML or ``$…$`` math
    could act on — line breaks included, since a blank line ends an HTML block — becomes a character
    reference, which renders as the character itself. Bare URLs and e-mail addresses are broken with an
    invisible word joiner so that they are not turned into links either. An exception or a path is taken as
    ``str`` writes it."""
    unlinked = AUTOLINK.sub(lambda m: m.group(0) + WORD_JOINER, str(text))
    return "".join(f"&#{ord(c)};" if c in INERT else c for c in unlinked)


def strong(text: str) -> str:
    """``text`` in bold for markdown, made inert, its edge spaces written as character references: markdown
    does not open or close bold beside a space, so a token like " Lily" would show as ``** Lily**``."""
    body = inert(text)
    stripped = body.strip(" ")
    lead, trail = len(body) - len(body.lstrip(" ")), len(body) - len(body.rstrip(" "))
    if not stripped:
        return "**" + "&#32;" * len(body) + "**" if body else ""
    return "**" + "&#32;" * lead + stripped + "&#32;" * trail + "**"


def safe_text(label: str) -> str:
    """User-controlled text (token strings) made inert for HTML and for plotly's pseudo-HTML.

    Only <, > and & are escaped: with no tag able to open, quotes are harmless in element text, and
    plotly shows ``&quot;`` literally. Never put the result inside an attribute value."""
    return html.escape(label, quote=False)


def facts_of(trace: Trace) -> GenerationFacts:
    """The generation a trace records, for the views that show one: its tokens, its steps, its KV cache, what
    it chose. (The attention views, the mask and the shapes need only the records: ``positions``.)"""
    facts = trace.generation
    if facts is None:
        raise ValueError("this view shows a generation (its tokens, steps, KV cache or chosen tokens), and this trace "
                         "records none: it was made by a plain Tracer. TracedGeneration records one; the attention "
                         "stages, all heads, O = A·V, the pitfalls and the mask work on any trace")
    return facts


def no_attention(trace: Trace, layer: int) -> str | None:
    """What ``layer`` is when it computes no attention — a hybrid model's Gated DeltaNet, Mamba or convolution layer
    ("layer 0 has no softmax attention: it is a Gated DeltaNet layer whose state does not grow with t …", from the
    model's config) — or None when it attends (every layer of every other model)."""
    config = trace.config
    if config is None or not 0 <= layer < config.n_layer:
        return None
    return config.no_attention_sentence(layer)


def attention_layers(trace: Trace) -> list[int]:
    """The layers that compute attention (all of them but in a hybrid model)."""
    config = trace.config
    return list(config.attention_layers) if config is not None else [0]


def gen_step(trace: Trace, step: int) -> GenerationStep:
    return facts_of(trace).step(step)


def choice_at(trace: Trace, step: int) -> SamplingRecord:
    """What ``step`` chose (a step whose logits were not finite chose no token, and has no such view)."""
    choice = gen_step(trace, step).sampling
    if choice is None:
        raise ValueError(f"no token was chosen at step {step}: its logits were not finite")
    return choice


def is_greedy(trace: Trace) -> bool:
    """Whether the trace's tokens were chosen by argmax (τ = 0) rather than sampled."""
    return facts_of(trace).info.sampling.greedy


def prompt_positions(trace: Trace) -> int:
    """P, the learned positions the model puts before the text in every forward (CPM-Ant's prompt): every record over
    positions holds them first, P + n rows for n tokens, the logits only the tokens'; 0 for every other model."""
    return int(getattr(trace.config, "prompt_positions", 0) or 0)


def bidirectional(trace: Trace) -> bool:
    """Whether the model's mask lets every position of a forward see every other (CPM-Ant), not query i keys 0 … i."""
    return bool(getattr(trace.config, "bidirectional", False))


def size_names(trace: Trace, step: int) -> tuple[str, str]:
    """The header's names for n and t at ``step``: "new positions n" where the step's n positions are new; with
    learned prompt positions (CPM-Ant) "positions P + n" and "key positions P + t", as the Shapes takeaway writes
    them; after the prefill without a cache "positions n, all fed again" (only the newest of them is new)."""
    if prompt_positions(trace):
        return "positions P + n", "key positions P + t"
    if fed_again(trace, step):
        return "positions n, all fed again", "key positions t"
    return "new positions n", "key positions t"


def fed_again(trace: Trace, step: int) -> bool:
    """Whether ``step`` fed earlier positions again beside the new one: a step after the prefill without a cache."""
    facts = trace.generation
    return step > 0 and facts is not None and not facts.info.use_cache and facts.step(step).forward.n > 1


# the mask tab's names: what M is for the model on view (one tab; the name follows the model)
MASK_TAB_NAMES = ("Causal mask", "Attention mask")


def mask_tab_name(sees_ahead: bool) -> str:
    """"Causal mask" where query i sees keys 0 … i at most; "Attention mask" where the model's mask lets every
    position of a forward see every other (CPM-Ant, XLNet's attn_type "bi"): there it is no causal mask."""
    return MASK_TAB_NAMES[1] if sees_ahead else MASK_TAB_NAMES[0]


def prompt_sentence(trace: Trace, step: int) -> str | None:
    """What the rows and columns of a model with learned prompt positions are (None for any other model)."""
    P = prompt_positions(trace)
    if not P:
        return None
    n = positions(trace, step)[0] - P
    sees = (" Its mask lets every position of a forward see every other (bidirectional): there is no causal mask, "
            "so a token's row depends on the tokens after it too." if bidirectional(trace) else "")
    return (f"This model puts {P} learned prompt positions before the text in every forward: its attention and "
            f"residual stream run over P + n = {P} + {n} = {P + n} positions, rows and columns 0 … {P - 1} the prompt "
            f"positions (⟨prompt⟩) and {P} … {P + n - 1} the text's tokens; the logits are the tokens' only.{sees}")


def positions(trace: Trace, step: int) -> tuple[int, int]:
    """(n, t) of ``step``: the new (query) positions and the key positions. From the generation — with the model's
    learned prompt positions before them (CPM-Ant: ``prompt_positions``), over which its attention runs too; for a
    plain Tracer's trace, from the attention pattern it recorded (``[…, n, t]``)."""
    facts = trace.generation
    if facts is not None:
        forward = facts.step(step).forward
        P = prompt_positions(trace)
        return forward.n + P, forward.t + P
    pattern = next((r for r in trace.filter(step=step) if r.name.endswith("attn.hook_pattern")), None)
    if pattern is None:
        raise ValueError(f"step {step} of this trace recorded no attention pattern (hook_pattern), so it has no "
                         "query and key positions to show")
    return pattern.shape[-2], pattern.shape[-1]


def layer_label(trace: Trace, layer: int) -> str:
    """How the layer pickers name block ``layer``: its number, and — where the model's attention runs in several
    lists of layers (BLT) — the path of the layer it is, which names its list ("4 · global_transformer.layers.0")."""
    paths = getattr(trace.config, "block_paths", ()) if trace.config is not None else ()
    return f"{layer} · {paths[layer]}" if paths and 0 <= layer < len(paths) else str(layer)


def layer_labels(trace: Trace, n_layer: int) -> dict[int, str]:
    """``layer_label`` of blocks 0 … n_layer − 1, for a picker's format function: strings only, so that a widget
    Streamlit keeps between reruns holds no reference to the trace (Reset must let it go)."""
    return {layer: layer_label(trace, layer) for layer in range(n_layer)}


def own_stream(trace: Trace, step: int, layer: int) -> tuple[int, int] | None:
    """(n, t) of block ``layer``'s own queries and keys where they are not the step's text positions — a model whose
    attention runs in several lists of layers (BLT, ``GPTConfig.block_paths``): a cross-attention (queries from one
    stream, keys and values from another) or a list over another stream (BLT's global transformer over patches);
    None where they are the text's."""
    config = trace.config
    if config is None or not getattr(config, "block_paths", ()):
        return None
    name = act_name("pattern", layer) if trace.has(act_name("pattern", layer), step) else act_name("mask", layer)
    if not trace.has(name, step):
        return None
    n, t = trace.record(name, step).shape[-2:]
    if layer in config.cross_blocks or (n, t) != positions(trace, step):
        return n, t
    return None


def stream_sentence(trace: Trace, step: int, layer: int) -> str | None:
    """What block ``layer``'s rows and columns are where they are not the text's positions (``own_stream``)."""
    own = own_stream(trace, step, layer)
    config = trace.config
    if own is None or config is None:
        return None
    n, t = own
    text = positions(trace, step)[1]
    what = cast(str, config.stack_sentence(layer))
    if layer in config.cross_blocks:
        return (f"{what[0].upper()}{what[1:]}. Its {n} query rows and {t} key columns come from two different "
                f"streams (the text has {text} tokens), so they are numbered, not labelled with tokens.")
    return (f"{what[0].upper()}{what[1:]}. Its {n} positions are those of its own stream, not the text's {text} "
            "tokens, so they are numbered, not labelled with tokens.")


def key_labels(trace: Trace, step: int, row: int = 0, layer: int | None = None) -> list[str]:
    """The t key positions of ``step``: ``"3 · the"`` (just ``"3"`` in a plain Tracer's trace: it keeps no tokens);
    for a block whose keys are not the text's positions (``own_stream``), ``"k3"``."""
    own = own_stream(trace, step, layer) if layer is not None else None
    if own is not None:
        return [f"k{j}" for j in range(own[1])]
    facts = trace.generation
    if facts is None:
        return [str(j) for j in range(positions(trace, step)[1])]
    labels = position_labels(trace, row, step)
    t = positions(trace, step)[1]
    return [f"{j} · {labels[j]}" if j < len(labels) else str(j) for j in range(t)]


PROMPT_LABEL = "⟨prompt⟩"  # a learned prompt position (CPM-Ant's), which no token of the text is


def position_labels(trace: Trace, row: int, step: int) -> tuple[str, ...]:
    """The labels of the positions ``step``'s forward ran over for sequence ``row``: the model's learned prompt
    positions (⟨prompt⟩) first where it has them, then the text's columns (padding ⟨pad⟩)."""
    return (PROMPT_LABEL,) * prompt_positions(trace) + facts_of(trace).labels(row, step)


def position_is_token(trace: Trace, row: int, step: int) -> tuple[bool, ...]:
    """Which of those positions are not padding: the learned prompt positions are not (the model sees them as it
    sees its tokens), then the text's columns as the generation padded them."""
    return (True,) * prompt_positions(trace) + facts_of(trace).is_token(row, step)


def query_labels(trace: Trace, step: int, row: int = 0, layer: int | None = None) -> list[str]:
    """The n query positions of ``step`` (the last n key positions); for a block whose queries are not the text's
    positions (``own_stream``), ``"q2"``."""
    own = own_stream(trace, step, layer) if layer is not None else None
    if own is not None:
        return [f"q{i}" for i in range(own[0])]
    keys = key_labels(trace, step, row)
    return keys[len(keys) - positions(trace, step)[0]:]


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """``n`` and its noun in the number it takes: "1 layer", "2 layers", "0 layers"."""
    return f"{n:,} {noun if n == 1 else plural or noun + 's'}"


def shape_text(shape: tuple[int, ...]) -> str:
    return "[" + ", ".join(str(s) for s in shape) + "]"


def axes_text(rec: TensorRecord) -> str:
    return "[" + ", ".join(rec.axes) + "]" if rec.axes else ""


def shape_with_axes(rec: TensorRecord) -> str:
    """``[1, 5, 128] = [B, n, d]`` (or just the numbers when no symbol fits)."""
    return f"{shape_text(rec.shape)} = {axes_text(rec)}" if rec.axes else shape_text(rec.shape)


def score_scale(trace: Trace, d_k: int) -> float:
    """The scale the model multiplies QKᵀ by: its own where its config sets one (Gemma's query_pre_attn_scalar,
    Granite's attention_multiplier), else 1/√d_k."""
    scale = getattr(trace.config, "attn_scale", None)
    return float(scale) if scale is not None else d_k**-0.5


def scores_formula(trace: Trace, d_k: int) -> str:
    """The scores as this model computes them before the mask: ``QKᵀ/√d_k``, ``s·QKᵀ`` for a model with its own
    scale, wrapped in the soft-cap ``c·tanh(·/c)`` where it has one."""
    import math

    formula = "QKᵀ/√d_k" if math.isclose(score_scale(trace, d_k), d_k**-0.5, rel_tol=1e-6) else "s·QKᵀ"
    return f"c·tanh({formula}/c)" if getattr(trace.config, "attn_softcap", None) else formula


def kv_head(trace: Trace, layer: int, head: int, step: int) -> int:
    """The key/value head query head ``head`` reads (h // (H/G); itself when G = H)."""
    H = trace.record(act_name("q", layer), step).shape[1]
    G = trace.record(act_name("k_all", layer), step).shape[1]
    return head // (H // G)


def real_query_rows(trace: Trace, step: int, batch: int, n: int, layer: int | None = None) -> torch.Tensor:
    """[n] which of the step's query rows hold a token of sequence ``batch`` (not padding: no one reads a padding
    row's output). Every row of a plain Tracer's trace (it records no padding), and of a block whose queries are
    not the text's positions (``own_stream``: padding is the model's own mask's business there)."""
    facts = trace.generation
    if facts is None or (layer is not None and own_stream(trace, step, layer) is not None):
        return torch.ones(n, dtype=torch.bool)
    return torch.tensor(position_is_token(trace, batch, step)[-n:], dtype=torch.bool)
