"""Which model a trace was made with: a name, where it came from, its config and a weights digest.

A trace saved to a file carries this, so a view of a loaded trace is labelled
with the model that made it, never with whatever model happens to be selected.
Two checkpoints with one config but different weights (a re-trained model, a
bf16 copy) differ in ``weights_digest``: the loaders hash the weight files'
bytes while they read them (``model/loading.py``), so the files are read once.
"""

from __future__ import annotations

import hashlib
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


def parameters_digest(model: nn.Module) -> str:
    """sha256 over every parameter and buffer, in state-dict order (for models built in code)."""
    h = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        h.update(name.encode())
        t = tensor.detach().to("cpu").contiguous()
        h.update(str(t.dtype).encode() + str(tuple(t.shape)).encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return "sha256:" + h.hexdigest()


def config_dict(config) -> dict:
    """A config dataclass as plain JSON values (nested dataclasses included)."""
    raw = asdict(config)
    return {k: v for k, v in raw.items() if not k.startswith("_")}


def identity_of(model: nn.Module) -> ModelIdentity:
    """``model.identity`` when a loader set it; otherwise one made from the model itself."""
    known = getattr(model, "identity", None)
    if isinstance(known, ModelIdentity):
        return known
    config = getattr(model, "config", None)
    return ModelIdentity(
        name="unnamed", source="built in code", family=getattr(config, "family", "gpt2"),
        config=config_dict(config) if config is not None else {}, weights_digest=parameters_digest(model),
    )
