"""Which model a trace was made with: a name, where it came from, its config and a weights digest.

A trace saved to a file carries this, so a view of a loaded trace is labelled
with the model that made it, never with whatever model happens to be selected.
Two checkpoints with one config but different weights (a re-trained model, a
bf16 copy) differ in ``weights_digest``: the loaders hash the weight files on
a thread of their own while they load them (``BackgroundDigest``), so the hash
costs the load little time.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import copy
import hashlib
import os
import threading
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

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
        lists = len({str(p).rpartition(".")[0] for p in c.get("block_paths") or ()})  # BLT: its lists of layers
        layers = f"{c.get('n_layer')} attention blocks in {lists} lists of layers" if lists else \
            f"{c.get('n_layer')} layers"
        return (f"{self.name} ({self.family}) — {layers} × {heads}, d = {c.get('d_model')}, "
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


class DigestAbandoned(Exception):
    """The load a digest was for failed or was dropped: nothing more to read."""


def files_digest(files: Sequence[Path], *, by_name: bool, abandon: threading.Event | None = None) -> str:
    """"sha256:<hex>" over weight files, in the order given: the concatenation of their bytes (``by_name``
    False: our loader's digest, so shards hash as one file), or each file's name and own sha256 (True: the
    transformers path's, config included). Read through one 16 MiB buffer, the GIL released while it reads and
    hashes; it stops at the next buffer once ``abandon`` is set."""
    whole = hashlib.sha256()
    buffer = bytearray(16 << 20)
    view = memoryview(buffer)
    for file in files:
        one = hashlib.sha256() if by_name else whole
        with open(file, "rb", buffering=0) as f:
            while n := f.readinto(buffer):
                if abandon is not None and abandon.is_set():
                    raise DigestAbandoned
                one.update(view[:n])
        if by_name:
            whole.update(Path(file).name.encode())
            whole.update(one.digest())
    return "sha256:" + whole.hexdigest()


class BackgroundDigest:
    """``files_digest`` on a thread of its own while the caller loads the same files: a load takes about the
    longer of the two, not their sum (bench/bench_big_load.py). The thread runs at a lower priority (Linux:
    a thread's own nice value), so that the load's threads come first where cores are few. ``result()`` waits
    for it; ``abandon()`` stops it at its next 16 MiB (a failed load, a dropped model)."""

    def __init__(self, files: Sequence[Path], *, by_name: bool) -> None:
        self._stop = threading.Event()
        self._future: concurrent.futures.Future[str] = concurrent.futures.Future()
        # a daemon thread: a read that never returns (a stalled network disk) must not keep the process alive
        threading.Thread(target=self._run, args=(list(files), by_name), name="weights-digest", daemon=True).start()

    def _run(self, files: list[Path], by_name: bool) -> None:
        with contextlib.suppress(AttributeError, OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
        try:
            self._future.set_result(files_digest(files, by_name=by_name, abandon=self._stop))
        except BaseException as e:  # noqa: BLE001 - handed to whoever asks for the result
            self._future.set_exception(e)

    def result(self) -> str:
        return self._future.result()

    def abandon(self) -> None:
        self._stop.set()


class IdentityUnavailable(ValueError):
    """A loaded model's weight files could not be hashed for its identity (moved or changed after loading):
    a failed load, like the loaders' own errors (``ModelLoadError``, ``HFDecoderError``)."""


@dataclass
class PendingIdentity:
    """The identity of a model loaded while its files were still being hashed: the load returns without
    waiting, and the first reader of ``model.identity`` — in practice the first traced step — waits for
    whatever is left of the hash (bench/bench_big_load.py measures both points)."""

    digest: BackgroundDigest
    name: str
    source: str
    family: str
    config: dict

    def result(self) -> ModelIdentity:
        try:
            weights_digest = self.digest.result()
        except OSError as e:
            raise IdentityUnavailable(f"{self.source}: its weight files could not be read again for the model's "
                                      f"identity ({e}); were they moved or changed after loading?") from None
        return ModelIdentity(name=self.name, source=self.source, family=self.family, config=self.config,
                             weights_digest=weights_digest)

    # a copied or pickled model carries its identity, resolved (the hash's thread and lock cannot be copied)
    def __deepcopy__(self, memo: dict) -> ModelIdentity:
        return copy.deepcopy(self.result(), memo)

    def __reduce__(self):
        return copy.copy(self.result()).__reduce__()


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
