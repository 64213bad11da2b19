"""The families whose attention class transformers picks by name from a table of their own (GPT-J, GPT-Neo,
Falcon, GIT), given an entry under our name, ``"shape_tracer"``, so that they load with our attention.

Why this way, and not by loading them with ``sdpa`` and recording their ``scaled_dot_product_attention`` calls
(as model/sources/_own_module.py does for a user's module): GPT-J and GPT-Neo have no SDPA path at all (their
tables hold ``eager`` and ``flash_attention_2`` only), and GPT-Neo's eager attention is not SDPA's contract
(no 1/√d_head scale; its local layers add their own window to the mask). Each entry here is the family's own
eager class with the one step that does QKᵀ → softmax → A·V handed to ``traced_attention`` — the same function
every interface family goes through, with the scale and mask the family's eager code uses — so the logits are
the eager class's, the hook points are the same as every other family's, and the KV cache is ours.

GIT's text self-attention is its own eager code too (the same three steps). DBRX needs no
entry (it calls the interface); it was refused by the probe, which now finds attention by what it calls.
Falcon with ALiBi (``alibi=True``) adds a per-head bias to the scores, which the traced attention does not
model: it is refused (model/sources/_hf_decoder.py)."""

from __future__ import annotations

import copy
import math
import threading
from collections.abc import Callable
from typing import Any

import torch

_done = False
_falcon = threading.local()  # .module: the Falcon attention whose forward runs on this thread


def _falcon_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None = None,
                 dropout_p: float = 0.0, is_causal: bool = False, **kwargs: Any) -> torch.Tensor:
    """SDPA as Falcon's forward calls it, to traced_attention while a Falcon attention runs on this thread (and
    to whatever SDPA was installed before otherwise). ``is_causal`` comes only with no mask: traced_attention
    then builds the causal mask itself, aligned to the last key as transformers' is."""
    module = getattr(_falcon, "module", None)
    if module is None:
        return _falcon_sdpa.previous(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,  # type: ignore[attr-defined]
                                     is_causal=is_causal, **kwargs)
    _falcon.module = None  # traced_attention's own fused path calls SDPA too: that call is not Falcon's
    try:
        z, _ = _traced_attention(module, query, key, value, attn_mask, dropout=dropout_p,
                                scaling=1.0 / math.sqrt(module.head_dim))
    finally:
        _falcon.module = module
    return _head_first(z)


def _install_router() -> None:
    """Put _falcon_sdpa in front of F.scaled_dot_product_attention (again, if something replaced it since)."""
    current = torch.nn.functional.scaled_dot_product_attention
    if current is not _falcon_sdpa:
        _falcon_sdpa.previous = current  # type: ignore[attr-defined]
        torch.nn.functional.scaled_dot_product_attention = _falcon_sdpa  # type: ignore[assignment]


def _eager(module: Any) -> bool:
    """Whether the module runs as transformers' own eager code (the guard's reference forward sets ``eager``)."""
    ours = _NAME[0]
    return getattr(getattr(module, "config", None), "_attn_implementation", ours) != ours


def _head_first(output: torch.Tensor) -> torch.Tensor:
    return output.transpose(1, 2)  # traced_attention's [B,n,H,d_head] -> the families' [B,H,n,d_head]


_FUNCTION: list[Callable[..., Any]] = []  # the traced attention function, given by register_families
_NAME: list[str] = []  # the name it is registered under


def _traced_attention(*args: Any, **kwargs: Any) -> Any:
    """``model.sources._hf_attention.traced_attention``, handed over by ``register_families`` (this module does not
    import the decoder module, which imports it)."""
    return _FUNCTION[0](*args, **kwargs)


def register_families(name: str, traced: Callable[..., Any]) -> None:
    """Add ``name`` (our attention, ``traced``) to the attention tables of GPT-J, GPT-Neo, Falcon and GIT (once
    per process)."""
    global _done
    if _done:
        return
    _FUNCTION[:], _NAME[:] = [traced], [name]
    from transformers.models.falcon import modeling_falcon
    from transformers.models.git import modeling_git
    from transformers.models.gpt_neo import modeling_gpt_neo
    from transformers.models.gptj import modeling_gptj

    class TracedGPTJAttention(modeling_gptj.GPTJAttention):
        """GPT-J's eager attention: softmax(QKᵀ / √d_head + M)·V in float32, through traced_attention."""

        def _attn(self, query, key, value, attention_mask=None):  # [B,H,n,d_head], [B,H,t,d_head] ×2
            if _eager(self):
                return super()._attn(query, key, value, attention_mask)
            z, weights = _traced_attention(self, query.to(torch.float32), key.to(torch.float32), value, attention_mask,
                                          scaling=1.0 / float(self.scale_attn))
            return _head_first(z).to(value.dtype), weights

    class TracedGPTNeoSelfAttention(modeling_gpt_neo.GPTNeoSelfAttention):
        """GPT-Neo's eager attention: softmax(QKᵀ + M)·V — no scaling — where M also hides keys outside a local
        layer's window (its ``bias`` buffer, [1,1,n_ctx,n_ctx], True where a query may see a key)."""

        def _attn(self, query, key, value, attention_mask=None):
            if _eager(self):
                return super()._attn(query, key, value, attention_mask)
            n, t = query.shape[-2], key.shape[-2]
            allowed = self.bias[:, :, t - n:t, :t]  # [1,1,n,t]
            mask = torch.zeros(allowed.shape, dtype=torch.float32, device=query.device).masked_fill(
                ~allowed, float("-inf"))
            if attention_mask is not None:
                mask = mask + attention_mask[:, :, :, :t]  # [B|1,1,n,t]
            # the local window described too (not only written into the mask): a fused path builds its mask from
            # the description, and must hide what the ``bias`` buffer hides
            local = self.config.window_size if self.attention_type == "local" else None
            z, weights = _traced_attention(self, query.to(torch.float32), key.to(torch.float32), value, mask,
                                          scaling=1.0, sliding_window=local)
            return _head_first(z).to(value.dtype), weights

    class TracedFalconAttention(modeling_falcon.FalconAttention):
        """Falcon's attention without ALiBi: softmax(QKᵀ / √d_head + M)·V. Its forward chooses between its own
        eager code and SDPA by the config's name; this module keeps a copy of the config naming ``sdpa``, and
        the SDPA call it then makes goes, on this thread only, to traced_attention (its eager code's numbers)."""

        def __init__(self, config, layer_idx=None):
            super().__init__(config, layer_idx)
            self._traced_config = config
            self._sdpa_config = copy.copy(config)
            self._sdpa_config._attn_implementation = "sdpa"

        def forward(self, *args, **kwargs):
            if _eager(self._traced_config):
                self.config = self._traced_config
                return super().forward(*args, **kwargs)
            _install_router()
            self.config, _falcon.module = self._sdpa_config, self
            try:
                return super().forward(*args, **kwargs)
            finally:
                self.config, _falcon.module = self._traced_config, None

    class TracedGitSelfAttention(modeling_git.GitSelfAttention):
        """GIT's text self-attention: softmax(QKᵀ / √d_head + M)·V (its eager forward, the product handed to
        traced_attention)."""

        def forward(self, hidden_states, attention_mask=None, past_key_values=None, **kwargs):
            if _eager(self._traced_config):
                return super().forward(hidden_states, attention_mask, past_key_values, **kwargs)
            hidden_shape = (*hidden_states.shape[:-1], -1, self.attention_head_size)
            query = self.query(hidden_states).view(hidden_shape).transpose(1, 2)  # [B,H,n,d_head]
            key = self.key(hidden_states).view(hidden_shape).transpose(1, 2)
            value = self.value(hidden_states).view(hidden_shape).transpose(1, 2)
            if past_key_values is not None:
                key, value = past_key_values.update(key, value, self.layer_idx)  # [B,H,t,d_head]
            z, weights = _traced_attention(self, query, key, value, attention_mask,
                                          scaling=1.0 / math.sqrt(self.attention_head_size))
            return z.reshape(*hidden_states.shape[:-1], self.all_head_size), weights  # [B,n,H·d_head]

        def __init__(self, config, layer_idx=None):
            super().__init__(config, layer_idx=layer_idx)
            self._traced_config = config

    modeling_gptj.GPTJ_ATTENTION_CLASSES[name] = TracedGPTJAttention
    modeling_gpt_neo.GPT_NEO_ATTENTION_CLASSES[name] = TracedGPTNeoSelfAttention
    modeling_falcon.FALCON_ATTENTION_CLASSES[name] = TracedFalconAttention
    modeling_git.GIT_SELF_ATTENTION_CLASSES[name] = TracedGitSelfAttention
    _done = True
