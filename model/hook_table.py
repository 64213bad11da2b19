"""The one table of hook points: name, symbolic shape, meaning.

model/README.md shows this table (a test checks the two agree, and another
that every hook point in ``GPT`` is here with exactly this shape). ``{L}`` is
the block index. Symbols follow the legend in ``model/gpt.py``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class HookSpec:
    name: str  # with {L} for the block index
    shape: tuple[str, ...]  # symbols: B n t d H d_head V, multiples like 3d, 4d, and literals
    meaning: str
    transformer_lens: str  # the TransformerLens name and layout, or "—"


HOOKS: tuple[HookSpec, ...] = (
    HookSpec("hook_embed", ("B", "n", "d"), "token embeddings W_E[tokens]", "hook_embed [batch, pos, d_model]"),
    HookSpec("hook_pos_embed", ("B", "n", "d"), "position embeddings W_pos[positions]", "hook_pos_embed, same"),
    HookSpec("blocks.{L}.hook_resid_pre", ("B", "n", "d"), "residual stream entering block L", "same"),
    HookSpec("blocks.{L}.ln1.hook_normalized", ("B", "n", "d"), "LN(x) = γ⊙(x−μ)/√(σ²+ε)+β", "same"),
    HookSpec("blocks.{L}.attn.hook_qkv", ("B", "n", "3d"), "X·W_QKV + b, the combined projection", "—"),
    HookSpec("blocks.{L}.attn.hook_q", ("B", "H", "n", "d_head"), "queries Q", "hook_q [batch, pos, head, d_head]"),
    HookSpec("blocks.{L}.attn.hook_k", ("B", "H", "n", "d_head"), "keys of the new positions", "hook_k [batch, pos, head, d_head]"),
    HookSpec("blocks.{L}.attn.hook_v", ("B", "H", "n", "d_head"), "values of the new positions", "hook_v [batch, pos, head, d_head]"),
    HookSpec("blocks.{L}.attn.hook_k_all", ("B", "H", "t", "d_head"), "all keys K: cache ++ new", "—"),
    HookSpec("blocks.{L}.attn.hook_v_all", ("B", "H", "t", "d_head"), "all values V: cache ++ new", "—"),
    HookSpec("blocks.{L}.attn.hook_qk", ("B", "H", "n", "t"), "QKᵀ", "—"),
    HookSpec("blocks.{L}.attn.hook_attn_scores", ("B", "H", "n", "t"), "QKᵀ/√d_k", "hook_attn_scores is scaled *and* masked"),
    HookSpec("blocks.{L}.attn.hook_mask", ("B|1", "1", "n", "t"), "additive mask M: 0 or −∞ (B rows only with padding)", "—"),
    HookSpec("blocks.{L}.attn.hook_masked_scores", ("B", "H", "n", "t"), "QKᵀ/√d_k + M", "≈ hook_attn_scores"),
    HookSpec("blocks.{L}.attn.hook_pattern", ("B", "H", "n", "t"), "A = softmax(QKᵀ/√d_k + M)", "hook_pattern, same layout"),
    HookSpec("blocks.{L}.attn.hook_z", ("B", "H", "n", "d_head"), "A·V per head", "hook_z [batch, pos, head, d_head]"),
    HookSpec("blocks.{L}.attn.hook_merged", ("B", "n", "d"), "heads concatenated, before W_O", "—"),
    HookSpec("blocks.{L}.hook_attn_out", ("B", "n", "d"), "attention output ·W_O + b", "same"),
    HookSpec("blocks.{L}.hook_resid_mid", ("B", "n", "d"), "x + attention output", "same"),
    HookSpec("blocks.{L}.ln2.hook_normalized", ("B", "n", "d"), "LN of the mid residual", "same"),
    HookSpec("blocks.{L}.mlp.hook_pre", ("B", "n", "4d"), "x·W_1 + b_1, before GELU", "hook_pre [batch, pos, d_mlp]"),
    HookSpec("blocks.{L}.mlp.hook_post", ("B", "n", "4d"), "GELU(x·W_1 + b_1)", "hook_post [batch, pos, d_mlp]"),
    HookSpec("blocks.{L}.hook_mlp_out", ("B", "n", "d"), "MLP output ·W_2 + b_2", "same"),
    HookSpec("blocks.{L}.hook_resid_post", ("B", "n", "d"), "residual stream leaving block L", "same"),
    HookSpec("ln_final.hook_normalized", ("B", "n", "d"), "final LayerNorm", "same"),
    HookSpec("hook_logits", ("B", "n", "V"), "logits x·W_Eᵀ (tied unembedding)", "— (TL returns logits)"),
)

_BLOCK = re.compile(r"^blocks\.(\d+)\.")


def spec_for(name: str) -> HookSpec | None:
    """The table row of a concrete hook name such as ``blocks.3.attn.hook_q``."""
    generic = _BLOCK.sub("blocks.{L}.", name)
    for spec in HOOKS:
        if spec.name == generic:
            return spec
    return None


# Short names for ``act_name``, in the spirit of TransformerLens's ``get_act_name``: the hook's own
# last word, with the layer norms and the MLP named by where they sit (their last words repeat).
_SHORT: dict[str, str] = {}
for _spec in HOOKS:
    _last = _spec.name.rsplit(".", 1)[-1].removeprefix("hook_")
    if _last == "normalized":
        _last = _spec.name.split(".")[-2] if _spec.name.startswith("blocks.") else "ln_final"
    elif ".mlp." in _spec.name:
        _last = "mlp_" + _last
    _SHORT[_last] = _spec.name
_SHORT["scores"] = _SHORT["attn_scores"]


def act_name(kind: str, layer: int | None = None) -> str:
    """The full hook name: ``act_name("pattern", 0)`` → ``"blocks.0.attn.hook_pattern"``,
    ``act_name("logits")`` → ``"hook_logits"``. ``kind`` is a short name (``q``, ``k_all``,
    ``pattern``, ``ln1``, ``mlp_post``, ``resid_pre``, …) or a hook's own name (``hook_q``)."""
    template = _SHORT.get(kind.removeprefix("hook_"))
    if template is None:
        import difflib

        close = difflib.get_close_matches(kind, sorted(_SHORT), n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise KeyError(f"no hook point is called {kind!r}{hint}")
    if "{L}" in template:
        if layer is None or isinstance(layer, bool) or not isinstance(layer, int) or layer < 0:
            raise ValueError(f"{kind!r} lives in every block: give its layer, a whole number ≥ 0 (got {layer!r})")
        return template.replace("{L}", str(layer))
    if layer is not None:
        raise ValueError(f"{kind!r} is not inside a block: it takes no layer (got {layer!r})")
    return template


def short_names() -> list[str]:
    """Every name ``act_name`` accepts."""
    return sorted(_SHORT)


def resolve(symbol: str, dims: dict[str, int]) -> int:
    """Evaluate a symbol like ``d``, ``3d``, ``d_head``, ``1`` with ``dims``.

    ``dims`` may name a multiple outright: ``"4d"`` is the MLP width, which
    equals 4·d unless a checkpoint sets ``n_inner``."""
    if symbol in dims:
        return dims[symbol]
    if symbol.isdigit():
        return int(symbol)
    m = re.fullmatch(r"(\d*)([A-Za-z_]+)", symbol)
    if not m:
        raise ValueError(f"unknown shape symbol {symbol!r}")
    factor = int(m.group(1) or 1)
    return factor * dims[m.group(2)]


def dims_of(config, batch: int, new: int, keys: int) -> dict[str, int]:
    """The value of every symbol for a model config and one forward."""
    return {
        "B": batch, "n": new, "t": keys, "d": config.d_model, "H": config.n_head,
        "d_head": config.d_head, "V": config.vocab_size, "4d": config.d_ff,
    }


def markdown_table() -> str:
    lines = [
        "| hook name | shape | what it holds | TransformerLens |",
        "|---|---|---|---|",
    ]
    for spec in HOOKS:
        lines.append(f"| `{spec.name}` | [{', '.join(spec.shape)}] | {spec.meaning} | {spec.transformer_lens} |")
    return "\n".join(lines)
