"""Which model a trace was made with: a name, where it came from, its config and a weights digest.

A trace saved to a file carries this, so a view of a loaded trace is labelled
with the model that made it, never with whatever model happens to be selected.
Two checkpoints with one config but different weights (a re-trained model, a
bf16 copy) differ in ``weights_digest``: the loaders hash the weight files'
bytes while they read them (``model/loading.py``), so the files are read once.
"""

from __future__ import annotations

import hashlib
import weakref
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class ModelIdentity:
    name: str  # what a person calls it: "story-gpt", a directory's name, "unnamed"
    source: str  # where the weights came from: a directory, "built in code"
    family: str  # "gpt2", "llama", "mistral", "qwen2"
    config: dict  # the model's config as plain JSON values
    weights_digest: str  # "sha256:<hex>" of the weight files as read (or of the parameters)

    def describe(self) -> str:
        """One line for the UI, ending with the first 12 hex digits of the digest."""
        c = self.config
        heads = f"{c.get('n_head')} heads"
        kv = c.get("n_kv_head")
        if kv and kv != c.get("n_head"):
            heads += f" sharing {kv} key/value heads"
        return (f"{self.name} ({self.family}) — {c.get('n_layer')} layers × {heads}, d = {c.get('d_model')}, "
                f"V = {c.get('vocab_size')}, n_ctx = {c.get('n_ctx')} · {self.weights_digest[:19]}")


def parameters_digest(model: nn.Module, tensors: Iterable[tuple[str, torch.Tensor]] | None = None) -> str:
    """sha256 over every parameter and buffer, in state-dict order (for models built in code); ``tensors``
    gives them instead of ``model.state_dict()`` (an offloaded model's, read back one at a time)."""
    h = hashlib.sha256()
    for name, tensor in (model.state_dict().items() if tensors is None else tensors):
        h.update(name.encode())
        t = tensor.detach().to("cpu").contiguous()
        h.update(str(t.dtype).encode() + str(tuple(t.shape)).encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return "sha256:" + h.hexdigest()


def config_dict(config) -> dict:
    """A config dataclass as plain JSON values (nested dataclasses included)."""
    raw = asdict(config)
    return {k: v for k, v in raw.items() if not k.startswith("_")}


# A model built in code has no file to hash: its digest is computed from its tensors, once per set of weights.
# The key is every parameter's and buffer's storage, dtype, shape and version counter, which any in-place
# change through the tensor itself bumps (an optimizer step, ``copy_``, ``p[i] += …`` under no_grad). A write
# through ``p.data`` bypasses the counter, as it bypasses autograd: such a model keeps its old digest until a
# tracked change (``refresh=True`` recomputes it).
_COMPUTED: weakref.WeakKeyDictionary[nn.Module, tuple[tuple, ModelIdentity]] = weakref.WeakKeyDictionary()


def _weights_key(weights: nn.Module, config: dict) -> tuple:
    tensors = [*weights.named_parameters(remove_duplicate=False), *weights.named_buffers(remove_duplicate=False)]
    return (repr(config), *((name, t.data_ptr(), t._version, t.dtype, tuple(t.shape)) for name, t in tensors))


def computed_identity(model: nn.Module, family: str, config: dict, weights: nn.Module | None = None, *,
                      name: str = "unnamed", source: str = "built in code", refresh: bool = False,
                      digest: Callable[[], str] | None = None) -> ModelIdentity:
    """The identity of a model no loader hashed the files of (by default "unnamed", "built in code"), its
    digest over the tensors of ``weights`` (the model itself by default), computed once per set of weights,
    not per call: a Tracer asks on every entry. ``digest`` computes it where the tensors are not all in
    memory (``parameters_digest(weights)`` otherwise)."""
    weights = model if weights is None else weights
    key = (name, source, *_weights_key(weights, config))
    cached = _COMPUTED.get(model)
    if cached is not None and cached[0] == key and not refresh:
        return cached[1]
    identity = ModelIdentity(name=name, source=source, family=family, config=config,
                             weights_digest=digest() if digest is not None else parameters_digest(weights))
    _COMPUTED[model] = (key, identity)
    return identity


def identity_of(model: nn.Module) -> ModelIdentity:
    """``model.identity`` when the model has one (set by a loader, or computed by our models); otherwise one
    made from the model itself."""
    known = getattr(model, "identity", None)
    if isinstance(known, ModelIdentity):
        return known
    config = getattr(model, "config", None)
    return computed_identity(model, getattr(config, "family", "gpt2"),
                             config_dict(config) if config is not None else {})
