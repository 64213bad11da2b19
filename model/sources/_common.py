"""What every source shares, below them all: the typed load error, the checks of a checkpoint directory and of
its links, the dtype and device a caller asks for, and reading a small JSON file safely."""

from __future__ import annotations

import json
import os
import pickle
from collections.abc import Callable
from pathlib import Path

import torch

MAX_CONFIG_BYTES = 1 << 20
READ_CHUNK = 16 << 20
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Tolerance on |Δ logits| between two computations of the same model in a dtype (ours vs Hugging Face,
# cached vs recompute). float32: 1e-4, the project's parity bar (measured ≈1e-6 on small models). bf16 keeps 8
# significant bits (a step of 2^-8 ≈ 0.4% relative, 0.125 at a logit of 20) and float16 11 bits, and a different
# but equally valid order of operations (fused QKV, a cached decode) rounds differently at every layer. Measured
# on the bundled story-gpt (logits up to 22) against Hugging Face in the same dtype: 0.5 in bf16, 0.07 in fp16;
# the values below keep a 2× margin (tests/model/test_model_families.py checks them on that model).
LOGIT_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 1.0, torch.float16: 0.15}
MODEL_FILE_SUFFIXES = (".json", ".safetensors", ".bin", ".txt", ".jinja", ".model", ".pt")  # what a loader reads


class ModelLoadError(ValueError):
    """A checkpoint directory or file that cannot be loaded; the message names the file and the problem.
    ``reason``: for a model the tracer refuses, the category (``model.sources._hf_refusals.RefusalReason``)."""

    def __init__(self, message: str, reason: str | None = None) -> None:
        super().__init__(message)
        self.reason = reason


def logit_tolerance(dtype: torch.dtype | str) -> float:
    """How far two logits of the same model in ``dtype`` may differ and still count as equal."""
    return LOGIT_TOLERANCE[parse_dtype(dtype)]


def parse_dtype(dtype: torch.dtype | str | None) -> torch.dtype:
    if dtype is None:
        return torch.float32
    if isinstance(dtype, str):
        if dtype.removeprefix("torch.") not in DTYPES:
            raise ModelLoadError(f"dtype {dtype!r} is not supported: use one of {', '.join(DTYPES)}")
        return DTYPES[dtype.removeprefix("torch.")]
    if dtype not in LOGIT_TOLERANCE:
        raise ModelLoadError(f"dtype {dtype!r} is not supported: use torch.float32, torch.bfloat16 or torch.float16")
    return dtype


def parse_device(device: torch.device | str) -> torch.device:
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ModelLoadError(f"device {device!r} is not a device name ({e})") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError(f"device {str(device)!r} was asked for, but torch.cuda.is_available() is False here")
    if dev.type not in ("cpu", "cuda"):
        raise ModelLoadError(f"device {str(device)!r} is not supported: use 'cpu' or 'cuda'")
    return dev



def read_json_object(path: Path, max_bytes: int, what: str, error: type[Exception]) -> dict:
    """``path``'s JSON object; ``error`` naming the file when it is larger than ``max_bytes``, unreadable,
    not JSON, or not an object (checked before anything is parsed where the size allows)."""
    try:
        size = path.stat().st_size
        if size > max_bytes:
            raise error(f"{path}: {size:,} bytes is far too large for {what}")
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise error(f"{path}: not valid JSON ({e})") from None
    except RecursionError:  # arrays or objects nested deeper than Python's recursion limit (200,000 "[")
        raise error(f"{path}: its JSON is nested too deeply to be {what}") from None
    except OSError as e:
        raise error(f"{path}: cannot be read ({e})") from None
    if not isinstance(raw, dict):
        raise error(f"{path}: expected a JSON object, got {type(raw).__name__}")
    return raw


# how many experts a mixture-of-experts config builds and routes to, under the names families give them: a
# negative count builds no experts at all (``range(-3)`` is empty) and the model loaded as if it had none
EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts", "num_experts_per_tok", "n_shared_experts",
                 "moe_num_experts", "moe_k", "moe_topk")


def check_expert_counts(get: Callable[[str], object], where: str, error: type[Exception]) -> None:
    """``error`` naming the field when an expert count ``get(name)`` gives is not a whole number ≥ 0 (None: not
    given)."""
    for name in EXPERT_COUNTS:
        value = get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise error(f"{where}: {name} must be a whole number ≥ 0, got {value!r}")


def check_dir(path: str | os.PathLike) -> Path:
    if not isinstance(path, (str, os.PathLike)):
        raise ModelLoadError(f"{path!r}: a checkpoint path must be a string or a path, not {type(path).__name__}")
    if "\x00" in os.fspath(path):
        raise ModelLoadError(f"{os.fspath(path)!r}: not a usable path (it holds a NUL byte)")
    try:
        p = Path(path).expanduser()
    except RuntimeError as e:  # "~nosuchuser/x": no such user, so no home directory to expand
        raise ModelLoadError(f"{os.fspath(path)!r}: cannot expand the home directory ({e})") from None
    try:
        resolved = p.resolve(strict=True)
    except FileNotFoundError:
        raise ModelLoadError(f"{p}: no such directory") from None
    except ValueError as e:  # an embedded NUL byte
        raise ModelLoadError(f"{os.fspath(path)!r}: not a usable path ({e})") from None
    except (RuntimeError, OSError) as e:  # a symlink loop lands here
        raise ModelLoadError(f"{p}: cannot resolve the path ({e})") from None
    if not resolved.is_dir():
        raise ModelLoadError(f"{p}: is a file, not a directory; give the directory holding config.json")
    for entry in resolved.iterdir():
        if entry.suffix in MODEL_FILE_SUFFIXES:
            check_link(resolved, entry)
    return resolved


def read_json(path: Path, what: str) -> dict:
    return read_json_object(path, MAX_CONFIG_BYTES, what, ModelLoadError)



def _link_roots(directory: Path) -> tuple[Path, ...]:
    """Where the files of ``directory`` (resolved) may really lie: in it, and for a Hugging Face cache snapshot
    (``models--org--name/snapshots/<hash>``) also in that repository's own ``blobs/``."""
    repo = directory.parent.parent
    if directory.parent.name == "snapshots" and repo.name.startswith("models--"):
        return directory, repo / "blobs"
    return (directory,)


def check_link(directory: Path, file: Path) -> None:
    """Refuse ``file`` when it is (or passes through) a symlink that leads out of ``directory`` (resolved) —
    except into the Hugging Face cache's ``../../blobs/`` of the same repository, where every snapshot file
    points. A directory whose ``model.safetensors`` links to ``~/.ssh/id_rsa`` is refused, not read."""
    try:
        target = file.resolve()
    except (RuntimeError, OSError) as e:  # a symlink loop
        raise ModelLoadError(f"{file}: cannot resolve the path ({e})") from None
    if target == file or any(target.is_relative_to(root) for root in _link_roots(directory)):
        return
    where = " or its Hugging Face cache blobs/" if len(_link_roots(directory)) > 1 else ""
    raise ModelLoadError(
        f"{file}: a symlink to {target}, outside the checkpoint directory{where}: refused (copy the file in, "
        "or give the directory it lives in)")



def display_name_of(directory: Path) -> str:
    """``org/name`` for a Hugging Face cache snapshot (``models--org--name/snapshots/<hash>``), else the folder."""
    if directory.parent.name == "snapshots" and directory.parent.parent.name.startswith("models--"):
        return directory.parent.parent.name.removeprefix("models--").replace("--", "/")
    return directory.name


def check_tensors_fit(state: dict[str, torch.Tensor], file: Path) -> None:
    """Refuse a tensor that declares more than its storage holds — a stride-0 (expanded) view of a few bytes can
    declare a 16 GiB embedding, and copying it would allocate all of it — or that reaches past its storage's end.
    Checked on the unpickled views, before anything is copied or compared."""
    for name, t in state.items():
        if t.layout != torch.strided:
            raise ModelLoadError(f"{file}: {name} is a {t.layout} tensor; weights are dense")
        storage = t.untyped_storage().nbytes()
        declared = t.numel() * t.element_size()
        span = (t.storage_offset() + sum((s - 1) * st for s, st in zip(t.shape, t.stride())) + 1) \
            * t.element_size() if t.numel() else 0
        if declared > storage or span > storage or any(st < 0 for st in t.stride()):
            raise ModelLoadError(
                f"{file}: {name} declares shape {list(t.shape)} ({declared} bytes) over {storage} bytes of storage "
                f"(strides {list(t.stride())}): a view that claims more than the file holds is refused before "
                "anything is allocated")


def unpickling_error(file: Path, error: Exception, what: str) -> ModelLoadError:
    """The load error for ``torch.load(file, weights_only=True)`` that raised ``error``, ``file`` being a ``what``
    ("PyTorch checkpoint"): a pickle that names a class or function is refused before anything in it runs, and
    one the weights-only unpickler cannot read is not readable; any other error is a malformed file (weights_only runs
    no code of the file's, but a crafted pickle can call an allowed rebuild function with wrong arguments:
    TypeError, IndexError, …)."""
    if isinstance(error, pickle.UnpicklingError):
        reason = _unpickler_reason(str(error))
        if "global" not in reason.lower():  # no class or function named: bytes it cannot read as tensors
            return ModelLoadError(f"{file}: not a readable {what} — the weights-only unpickler refused it "
                                  f"({reason}), so nothing in it ran")
        return ModelLoadError(
            f"{file}: refused — the pickle names Python classes or functions, not only tensors, numbers, strings "
            f"and containers, and it is only loaded with torch.load(weights_only=True), so nothing in it ran "
            f"({reason})"
        )
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return ModelLoadError(f"{file}: not a readable {what} ({type(error).__name__}: {first})")


def _unpickler_reason(message: str) -> str:
    """The one line of torch's weights-only refusal that says what was refused ("Unsupported global: GLOBAL
    __main__.X was not an allowed global by default"), without its advice to load with weights_only=False."""
    text = message.split("WeightsUnpickler error:", 1)[-1].split("Check the documentation", 1)[0]
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[0].split(". Please use")[0] if lines else "the unpickler refused it"
