"""``Decoder``: the models the tracer, the sampler and the experiments run, as one type.

Our ``GPT`` (model/gpt/), a transformers model behind ``HFDecoder`` (model/sources/_hf_decoder.py) and a
user's own module behind ``OwnDecoder`` (model/sources/_own_module.py). Each is an ``nn.Module`` called as
``model(tokens, cache, padding_mask=…)``, with a ``GPTConfig`` (``.config``), an ``identity``, ``new_cache``
and its hook points under ``blocks.{L}.attn``. A function that needs only a module's hooks takes any
``nn.Module``; one that reads ``.config`` or makes a cache takes a ``Decoder``.
"""

from __future__ import annotations

from typing import TypeAlias

import torch
from torch import nn

from gpt_shape_tracer.model.gpt import GPT
from gpt_shape_tracer.model.sources._hf_decoder import HFDecoder
from gpt_shape_tracer.model.sources._own_module import OwnDecoder

Decoder: TypeAlias = GPT | HFDecoder | OwnDecoder


def input_device_of(model: nn.Module) -> torch.device:
    """Where ``model`` reads its inputs (token ids, a residual to unembed): its own ``input_device`` where it has
    one (a model run by transformers, whose offloaded weights are ``meta`` placeholders that accelerate fills at
    each forward), else its first parameter not on the meta device; the CPU for a model without any."""
    where = getattr(model, "input_device", None)
    if isinstance(where, torch.device):
        return where
    return next((p.device for p in model.parameters() if not p.is_meta), torch.device("cpu"))


__all__ = ["Decoder", "input_device_of"]
