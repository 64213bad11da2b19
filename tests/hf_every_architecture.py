"""Every causal-LM ``model_type`` the installed transformers maps (``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``), built
as a tiny random-weight directory from its own config class with the sizes shrunk generically, loaded with
``load_hf`` and compared with transformers' own forward on the same weights.

Nothing is hand-picked: the list is transformers' own, and the shrinking knows size names, not families.
``python -m tests.hf_every_architecture [TYPE ...]`` prints one line per type and the counts."""

from __future__ import annotations

import os
import sys
import tempfile
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

# the sizes every config is shrunk to, by the names transformers' config classes give them
_WIDTH = 64
_SIZES: dict[str, int] = {
    "vocab_size": 256,
    # widths
    "hidden_size": _WIDTH, "n_embd": _WIDTH, "d_model": _WIDTH, "embed_dim": _WIDTH, "dim": _WIDTH, "n_embed": _WIDTH,
    "word_embed_proj_dim": _WIDTH, "embedding_size": _WIDTH, "d_embed": _WIDTH,
    # MLP widths
    "intermediate_size": 128, "n_inner": 128, "ffn_dim": 128, "d_ff": 128, "ffn_hidden_size": 128, "d_inner": 128,
    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "expert_intermediate_size": 32,
    "ffn_config_hidden": 128, "decoder_ffn_dim": 128, "encoder_ffn_dim": 128,
    # depth
    "num_hidden_layers": 2, "n_layer": 2, "num_layers": 2, "n_layers": 2, "decoder_layers": 2, "encoder_layers": 2,
    # heads
    "num_attention_heads": 4, "n_head": 4, "num_heads": 4, "n_heads": 4, "decoder_attention_heads": 4,
    "encoder_attention_heads": 4, "num_key_value_heads": 2, "n_kv_heads": 2, "num_kv_heads": 2,
    "head_dim": 16, "kv_channels": 16, "rotary_dim": 8,
    # latent attention (DeepSeek-V2/V3 and descendants)
    "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16, "kv_lora_rank": 32, "q_lora_rank": 32,
    "num_kv_shared_layers": 0,
    # experts
    "num_experts": 4, "n_routed_experts": 4, "num_local_experts": 4, "moe_num_experts": 4, "num_experts_per_tok": 2,
    "moe_k": 2, "moe_topk": 2, "n_group": 1, "topk_group": 1,
    # positions
    "max_position_embeddings": 128, "n_positions": 128, "n_ctx": 128, "max_seq_len": 128, "seq_length": 128,
}
_WINDOW_NAMES = ("sliding_window", "attention_window_size", "window_size")
WINDOW = 4  # shorter than the prompt, so that sliding-window layers really slide in the check
PROMPT = 8  # tokens in the prefill; then DECODE_STEPS cached steps of one token
DECODE_STEPS = 3
TOLERANCE = 1e-4  # float32, the project's parity bar

# "follows uncached": traced, equal to transformers' uncached forward at every step, where transformers' own cached
# path differs from it (the model says so in reference_note)
Outcome = Literal["traced", "follows uncached", "refused", "crash", "differs", "not built"]


def causal_lm_types() -> list[str]:
    """Every model_type the installed transformers maps to a causal-LM class."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _shrunk(values: dict[str, Any], layers_before: int | None) -> dict[str, Any]:
    """A config's own values with every size named in _SIZES made small (nested sub-configs too), and every list
    with one entry per layer cut to the new depth."""
    out: dict[str, Any] = {}
    depth = next((values[k] for k in ("num_hidden_layers", "n_layer", "num_layers", "n_layers") if
                  isinstance(values.get(k), int)), layers_before)
    vocab = min(values.get("vocab_size") or _SIZES["vocab_size"], _SIZES["vocab_size"])
    for key, value in values.items():
        if isinstance(value, dict) and key.endswith("config"):
            inner = _shrunk(value, depth)
            if inner:  # a sub-config left at its defaults is left out, as the config class's default builds it
                out[key] = {**value, **inner}
        elif key.endswith(("_token_id", "_token_index")) and isinstance(value, int) and value >= vocab:
            out[key] = value % vocab  # special tokens inside the shrunk vocabulary
        elif key == "head_dim" and value is not None and value == values.get("qk_rope_head_dim"):
            out[key] = _SIZES["qk_rope_head_dim"]  # the head size the rotary embedding is built for
        elif key in _SIZES and isinstance(value, int) and not isinstance(value, bool) and value > 0:
            out[key] = min(value, _SIZES[key])
        elif "vocab" in key and isinstance(value, int) and not isinstance(value, bool) and value > vocab:
            out[key] = vocab  # any other table indexed by ids (BLT's hash n-gram vocabularies: 500 002 rows)
        elif key in _WINDOW_NAMES and isinstance(value, int) and not isinstance(value, bool) and value > 0:
            out[key] = WINDOW
        elif isinstance(value, (list, str)) and depth and len(value) == depth and depth > 2 and key not in (
                "architectures", "model_type"):
            out[key] = _two_layers(value)
    return out


def _two_layers(per_layer: list | str) -> list | str:
    """Two entries of a per-layer list (or pattern string) that keep its kinds apart where it has several:
    the first occurrence of each of the first two kinds (a hybrid keeps an attention and a state layer)."""
    firsts: list[int] = []
    for i, kind in enumerate(per_layer):
        if all(per_layer[j] != kind for j in firsts):
            firsts.append(i)
    picked = sorted(firsts[:2] if len(firsts) >= 2 else [0, 1])
    return per_layer[picked[0]] + per_layer[picked[1]] if isinstance(per_layer, str) else [per_layer[i] for i in picked]


def tiny_config(model_type: str) -> Any:
    """The config class's defaults with the sizes shrunk (raises whatever the config class raises)."""
    from transformers import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    defaults = cls().to_dict()
    values = _shrunk(defaults, None)
    if "is_decoder" in defaults and not defaults.get("is_encoder_decoder"):
        values["is_decoder"] = True  # a causal LM class: the configuration transformers asks for to use it as one
    config = cls(**values)
    for name in ("head_dim", "num_key_value_heads"):  # left None by a config whose model reads them
        if hasattr(config, name) and getattr(config, name) is None:
            setattr(config, name, _SIZES[name])
    return config


def build(model_type: str, directory: Path, seed: int = 0) -> Path:
    """Save a random-weight causal LM of ``model_type`` into ``directory``."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(model_type)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # norms and biases away from 1 and 0, so every term shows in the logits
        for p in model.parameters():
            if p.dim() == 1 and p.is_floating_point():
                p.add_(torch.randn_like(p) * 0.1)
        model(input_ids=torch.arange(PROMPT)[None] % 200)  # transformers' own forward runs on this config
    model.save_pretrained(directory)
    return directory


@dataclass
class Result:
    model_type: str
    outcome: Outcome
    reason: str = ""  # the refusal's category (HFDecoderError.reason), or what failed
    message: str = ""
    deltas: list[float] = field(default_factory=list)  # max |Δ logits| at the prefill and each decode step
    uncached: list[float] = field(default_factory=list)  # the same against transformers' uncached forward
    note: str | None = None  # the model's reference_note


def _reference_logits(directory: Path, tokens: torch.Tensor) -> list[torch.Tensor]:
    """transformers' own eager forward: the prefill, then DECODE_STEPS steps with its own cache."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(directory, local_files_only=True, dtype=torch.float32,
                                              attn_implementation="eager").eval()
    out = []
    with torch.no_grad():
        result = hf(input_ids=tokens[:, :PROMPT], use_cache=True)
        out.append(result.logits)
        past = result.past_key_values
        for i in range(PROMPT, PROMPT + DECODE_STEPS):
            result = hf(input_ids=tokens[:, i:i + 1], past_key_values=past, use_cache=True)
            past = result.past_key_values
            out.append(result.logits)
    return out


def _uncached_logits(directory: Path, tokens: torch.Tensor) -> list[torch.Tensor]:
    """transformers' own eager forward without a cache: the whole text again at every step (its last row)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(directory, local_files_only=True, dtype=torch.float32,
                                              attn_implementation="eager").eval()
    with torch.no_grad():
        out = [hf(input_ids=tokens[:, :PROMPT], use_cache=False).logits]
        out += [hf(input_ids=tokens[:, :i + 1], use_cache=False).logits[:, -1:]
                for i in range(PROMPT, PROMPT + DECODE_STEPS)]
    return out


def check(model_type: str, directory: Path) -> Result:
    """Load ``directory`` with ``load_hf``; traced: compare with transformers at the prefill and each cached step."""
    from model.sources import ModelLoadError, load_hf

    try:
        model, _ = load_hf(directory)
    except ModelLoadError as e:
        return Result(model_type, "refused", str(getattr(e, "reason", "") or ""), str(e))
    tokens = torch.randint(0, 200, (1, PROMPT + DECODE_STEPS), generator=torch.Generator().manual_seed(1))
    cache = model.new_cache()
    ours = []
    with torch.no_grad():
        ours.append(model(tokens[:, :PROMPT], cache))
        for i in range(PROMPT, PROMPT + DECODE_STEPS):
            ours.append(model(tokens[:, i:i + 1], cache))
    theirs = _reference_logits(directory, tokens)
    deltas = [float((a.float() - b.float()).abs().max()) for a, b in zip(ours, theirs)]
    note = getattr(model, "reference_note", None)
    if max(deltas) <= TOLERANCE:
        return Result(model_type, "traced", deltas=deltas, note=note)
    uncached = [float((a.float() - b.float()).abs().max()) for a, b in zip(ours, _uncached_logits(directory, tokens))]
    outcome: Outcome = "follows uncached" if max(uncached) <= TOLERANCE and note else "differs"
    return Result(model_type, outcome, deltas=deltas, uncached=uncached, note=note)


def run(model_type: str) -> Result:
    """Build and check one type; any exception is a crash (or 'not built' when building it failed)."""
    with tempfile.TemporaryDirectory() as tmp:
        try:
            build(model_type, Path(tmp))
        except Exception as e:  # noqa: BLE001 (the sweep reports, it does not stop)
            return Result(model_type, "not built", type(e).__name__, str(e)[:300])
        try:
            return check(model_type, Path(tmp))
        except Exception as e:  # noqa: BLE001
            return Result(model_type, "crash", type(e).__name__,
                          f"{str(e)[:300]} | {traceback.format_exc().splitlines()[-3][:200]}")


_OUTCOME_WORDS = {
    "traced": "traced, logits equal to transformers'",
    "follows uncached": "traced, equal to transformers' uncached forward (its own cached path differs)",
    "refused": "refused",
    "crash": "CRASH",
    "differs": "DIFFERS",
    "not built": "not built offline by the generic tiny config",
}


def markdown(results: list[Result], machine: str, seconds: float) -> str:
    """docs/architectures.md: one row per type, from the sweep's own results."""
    import transformers

    counts: dict[str, int] = {}
    for r in results:
        counts[r.outcome] = counts.get(r.outcome, 0) + 1
    lines = [
        "# Every causal LM of the installed transformers",
        "",
        f"Generated by `python -m tests.hf_every_architecture --markdown docs/architectures.md` with transformers "
        f"{transformers.__version__}: every `model_type` in `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES` ({len(results)}), "
        "built "
        "as a tiny random-weight directory from its own config class (sizes shrunk by name: "
        "tests/hf_every_architecture.py), loaded with `load_hf`, and compared with transformers' eager forward on "
        f"the same weights at the prefill ({PROMPT} tokens) and {DECODE_STEPS} cached decode steps (≤ {TOLERANCE:g}, "
        "float32). The same sweep is the test `pytest -m every_architecture tests/test_every_architecture.py`, "
        "which also checks each refusal's reason independently.",
        "",
        "| outcome | types |",
        "|---|---|",
        *[f"| {_OUTCOME_WORDS[k]} | {v} |" for k, v in sorted(counts.items())],
        "",
        f"Run on {machine}: {seconds:.0f} s.",
        "",
        "Reasons (`HFDecoderError.reason`, `ModelLoadError.reason`): *attention outside the interface* — the family "
        "computes softmax attention in its own code, so its Q, K, V and pattern cannot be recorded; *no softmax "
        "attention* — state-space or recurrent layers only; *state layers* — layers without attention keep their "
        "state in a cache class of the family's own (MiniMax), not in transformers' shared cache layers; *latent "
        "attention* — value heads narrower or wider than query/key heads; *attention sinks* — a learned sink logit "
        "in every softmax row; *several "
        "attentions per layer* — a layer calls attention more than once per forward; *encoder-decoder*, *encoder* — "
        "not a causal decoder; *cannot load* — transformers itself fails on the directory or its forward.",
        "",
        r"| model_type | outcome | reason | max \|Δ logits\| (prefill, 3 decode steps) or message |",
        "|---|---|---|---|",
    ]
    for r in results:
        detail = " ".join(f"{d:.1e}" for d in r.deltas) if r.deltas else r.message.split(": ", 1)[-1][:220]
        if r.note:
            detail += f" — {r.note}"
        detail = detail.replace("|", "\\|").replace("\n", " ")
        lines.append(f"| {r.model_type} | {_OUTCOME_WORDS[r.outcome]} | {r.reason if r.outcome != 'traced' else ''} "
                     f"| {detail} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    from transformers.utils import logging

    logging.set_verbosity_error()
    import platform
    import time

    out = None
    if argv[:1] == ["--markdown"]:
        out, argv = Path(argv[1]), argv[2:]
    types = argv or causal_lm_types()
    counts: dict[str, int] = {}
    results = []
    start = time.perf_counter()
    for model_type in types:
        result = run(model_type)
        results.append(result)
        counts[result.outcome] = counts.get(result.outcome, 0) + 1
        detail = " ".join(f"{d:.1e}" for d in result.deltas) if result.deltas else result.message[:400]
        if result.uncached:
            detail += " | uncached: " + " ".join(f"{d:.1e}" for d in result.uncached) + f" | {result.note}"
        print(f"{model_type:28s} {result.outcome:9s} {result.reason:24s} {detail}", flush=True)
    print(counts)
    if out is not None:
        machine = f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}"
        out.write_text(markdown(results, machine, time.perf_counter() - start))


if __name__ == "__main__":
    main(sys.argv[1:])
