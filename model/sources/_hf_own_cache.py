"""Families whose forward does not take transformers' ``Cache`` as ``past_key_values``, traced as they really run.

* No cache at all (OpenAI GPT): its forward has no parameter for past keys and values, and transformers'
  ``generate()`` feeds it the whole text at every step. Traced so: ``HFDecoder.no_cache_reason`` says why,
  ``new_cache`` refuses, and a generation runs with the cache off — every step a full forward over every position,
  the mechanism a cache-off generation of any model uses (``TracedGeneration(use_cache=False)``).
* A cache under the family's own keyword that wants the whole text (XLM): its forward takes ``cache=`` and the
  token ids of every position so far, and slices off the positions its cache already holds (its "do not recompute
  cached elements"); its positions and hidden-state mask are read from the whole width too. ``whole_text`` widens
  what ``HFDecoder.forward`` passes: placeholder ids (never embedded: sliced off before the embedding) for the
  cached positions, and the mask and positions of every key.
* Learned prompt positions before the text (CPM-Ant): its forward puts ``prompt_length`` positions of its own before
  the tokens — ids past its vocabulary, embedded as tokens are — and its mask lets every position of a forward see
  every other. Its generate() runs it as a prefix LM (the prompt's positions see one another, each generated token
  those before it), so a cached step differs from a full forward of the same text, and its cache holds P + n rows.
  Traced without a cache, every step a full forward of the whole text as transformers' uncached forward computes it:
  every record over positions holds the P prompt positions first (P + n rows for n tokens; the logits are the n
  tokens' only), which ``GPTConfig.prompt_positions`` and ``GPTConfig.bidirectional`` tell the views.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from gpt_shape_tracer.model.sources._hf_own_attention import PROBE_TOKENS


def no_cache_reason(hf: nn.Module, model_type: str, keyword: str) -> str | None:
    """Why the model runs without a KV cache (None: it keeps one). ``keyword``: the name ``cache_keyword`` found,
    which is ``past_key_values`` by default even where the forward has no such parameter."""
    try:
        names = inspect.signature(hf.forward).parameters
    except (TypeError, ValueError):
        return None
    if keyword in names:
        return None
    return (f"this model's forward ({model_type}) takes no past keys and values, so it keeps no KV cache "
            "(transformers' generate() feeds it the whole text at every step)")


def takes_whole_text(keyword: str) -> bool:
    """Whether the forward takes the ids of every position with its cache (XLM's ``cache=``: it slices off the
    cached positions itself) rather than only the new ones."""
    return keyword == "cache"


def whole_text(tokens: torch.Tensor, past: int, attention_mask: torch.Tensor | None,
               position_ids: torch.Tensor | None) -> dict[str, Any]:
    """The inputs of a forward that takes the whole text: ids ``[B, past + n]`` whose first ``past`` columns are
    placeholders (the family slices them off before its embedding), the mask of every key (ones where nothing is
    padding) and positions ``[B, past + n]`` whose last n are the new tokens' (the family slices them alike)."""
    B, n = tokens.shape
    ids = torch.cat([tokens.new_zeros(B, past), tokens], dim=1)
    mask = attention_mask if attention_mask is not None else torch.ones_like(ids)
    if position_ids is not None:
        position_ids = torch.cat([position_ids.new_zeros(B, past), position_ids.expand(B, n)], dim=1)
    return {"input_ids": ids, "attention_mask": mask, "position_ids": position_ids}


def prompt_positions(call: Any) -> int:
    """Positions the model's attention ran over in the probe beyond the tokens the probe fed it — learned positions its
    forward puts before the text (CPM-Ant's prompt) — read from an attention computed in the family's own code (its
    query rows and key columns alike); 0 for every other attention. ``call``: the probe's ``_Call``, or None."""
    own = getattr(call, "own", None) if call is not None else None
    if own is None:
        return 0
    n, t = (int(x) for x in own.pattern.shape[-2:])
    return t - PROBE_TOKENS if n == t > PROBE_TOKENS else 0


def permutation_reason(model_type: str) -> str:
    """Why a permutation LM whose forward lets every position see every other (XLNet's attn_type "bi") is traced
    without a KV cache."""
    return (f"this model's forward ({model_type}) lets every position of the text see every other (XLNet's "
            "attn_type \"bi\", a permutation language model), so a cached step, whose earlier positions could not "
            "see the new token, would differ from a full forward of the same text: it is traced without a KV cache "
            "(every step a full forward of the whole text, as transformers' uncached forward computes it)")


def prompt_reason(model_type: str, prompt: int, bidirectional: bool) -> str:
    """Why a model that puts ``prompt`` learned positions before the text is traced without a KV cache."""
    sees = (" and lets every position of a forward see every other (bidirectional)" if bidirectional else "")
    return (f"this model's forward ({model_type}) puts {prompt} learned prompt positions before the text{sees}, and "
            "transformers' generate() runs it with a cache as a prefix LM whose steps differ from a full forward of "
            "the same text, so it is traced without a KV cache (every step a full forward of the whole text, as "
            "transformers' uncached forward computes it)")


def padding_refusal(model_type: str) -> str:
    """Why a padded batch of such a model is refused: its forward takes no attention mask."""
    return (f"{model_type}'s forward takes no attention mask: it reads token id 0 as padding and counts a sequence's "
            "real tokens from its ids, so a batch padded to one width would not run each sequence as it runs alone; "
            "generate from one prompt at a time (or from prompts of one length)")
