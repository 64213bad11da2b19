"""``Decoder``: the models the tracer, the sampler and the experiments run, as one type.

Our ``GPT`` (model/gpt/), a transformers model behind ``HFDecoder`` (model/sources/_hf_decoder.py) and a
user's own module behind ``OwnDecoder`` (model/sources/_own_module.py). Each is an ``nn.Module`` called as
``model(tokens, cache, padding_mask=…)``, with a ``GPTConfig`` (``.config``), an ``identity``, ``new_cache``
and its hook points under ``blocks.{L}.attn``. A function that needs only a module's hooks takes any
``nn.Module``; one that reads ``.config`` or makes a cache takes a ``Decoder``.
"""

from __future__ import annotations

from typing import TypeAlias

from model.gpt import GPT
from model.sources._hf_decoder import HFDecoder
from model.sources._own_module import OwnDecoder

Decoder: TypeAlias = GPT | HFDecoder | OwnDecoder

__all__ = ["Decoder"]
