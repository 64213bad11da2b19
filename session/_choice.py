"""What to load: one frozen value, ``ModelChoice``, that the sidebar, the command line and a saved run all build,
checked when it is made; one ``load`` that every front end calls; one ``describe``; one serialisation for
``run.json`` (which also reads the coded strings ``"<device>|dir:<dtype>@<GiB>:<path>"`` of runs saved before).

The devices a choice may name are here too: what a person may ask for (``check_device``) and what this machine
offers (``available_devices``, ``compute_dtypes``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Literal, cast, get_args

import torch

from gpt_shape_tracer.model import (
    BUNDLED_MODELS,
    Decoder,
    IdentityUnavailable,
    ModelLoadError,
    TextTokenizer,
    load_bundled,
    load_model,
    load_tokenizer,
)
from gpt_shape_tracer.model.gpt import identity_of
from gpt_shape_tracer.model.sources import load_factory
from gpt_shape_tracer.session._errors import SettingsError

# -- devices ------------------------------------------------------------------------------------------
HOST = "cpu"
DEVICE_NAME = re.compile(r"cpu|mps|cuda(:\d+)?")  # what a person may ask for (the sidebar, the address, the CLI)


def available_devices() -> tuple[str, ...]:
    """The devices this machine offers, as PyTorch sees them: the CPU always, each CUDA device, Apple's MPS."""
    cuda = tuple(f"cuda:{i}" for i in range(torch.cuda.device_count())) if torch.cuda.is_available() else ()
    mps = ("mps",) if torch.backends.mps.is_available() else ()
    return (HOST, *cuda, *mps)


def check_device(raw: object) -> str:
    """The device ``raw`` names, as ``available_devices`` writes it ("cuda" is "cuda:0"), or a ``SettingsError``
    saying what this machine offers instead."""
    name = device_name(raw)
    offered = available_devices()
    if name in offered:
        return name
    if name.startswith("cuda") and not torch.cuda.is_available():
        build = ", a CPU-only build" if torch.version.cuda is None else ""
        why = f"PyTorch sees no CUDA device on this machine (torch {torch.__version__}{build})"
    elif name.startswith("cuda"):
        why = f"PyTorch sees {torch.cuda.device_count()} CUDA device(s), cuda:0 … cuda:{torch.cuda.device_count() - 1}"
    else:
        why = "PyTorch sees no MPS device (Apple silicon with macOS 12.3 or later) on this machine"
    raise SettingsError(f"device {name}: {why}; this machine offers {', '.join(offered)}")


def device_name(raw: object) -> str:
    """``raw`` as a device's name ("cuda" is "cuda:0"), whether or not this machine has it; a ``SettingsError``
    when it names no device at all."""
    name = str(raw).strip()
    if not DEVICE_NAME.fullmatch(name):
        raise SettingsError(f"device {name!r}: give cpu, cuda, cuda:N or mps")
    return "cuda:0" if name == "cuda" else name


def compute_dtypes(device: str) -> tuple[tuple[str, ...], str]:
    """The compute dtypes a model may be loaded in on ``device``, and why a half-precision one is not offered
    ("" when both are)."""
    if device.startswith("cuda"):
        with torch.cuda.device(device):  # is_bf16_supported asks of the current device
            bf16 = torch.cuda.is_bf16_supported(including_emulation=False)
        if bf16:
            return ("float32", "bfloat16", "float16"), ""
        major, minor = torch.cuda.get_device_capability(device)
        return ("float32", "float16"), (f"bfloat16 is not offered: {torch.cuda.get_device_name(device)} (compute "
                                        f"capability {major}.{minor}) has no bfloat16 arithmetic (it needs 8.0)")
    if device == "mps":
        if torch.backends.mps.is_macos_or_newer(14, 0):
            return ("float32", "bfloat16", "float16"), ""
        return ("float32", "float16"), "bfloat16 is not offered: MPS computes in bfloat16 from macOS 14 on"
    return ("float32", "bfloat16", "float16"), ""


# -- directories ----------------------------------------------------------------------------------------
MAX_WEIGHTS_GIB = 4096.0  # "memory for the weights": any amount a machine has


def _check_directory_text(raw: str) -> None:
    if not raw or not raw.strip():
        raise SettingsError("Type the directory of a checkpoint first.")
    if "\x00" in raw:
        raise SettingsError("That directory name holds a NUL character; the previous model stays loaded.")


def checkpoint_path(raw: str) -> str:
    """The directory a person typed, resolved, or a ``SettingsError`` saying why it cannot be one (before
    anything is read, so the previous model stays loaded)."""
    _check_directory_text(raw)
    try:
        return str(Path(raw.strip()).expanduser())
    except RuntimeError as e:  # "~nosuchuser/x": no such user's home to expand
        raise SettingsError(f"{raw.strip()!r}: {e}; the previous model stays loaded.") from None


AMOUNT = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*([kmgt]i?b)", re.IGNORECASE)
UNITS = {"k": 1, "m": 2, "g": 3, "t": 4}


def gib_of(amount: str, what: str = "max_memory") -> float:
    """An amount of memory as a person writes it — bytes ("2147483648"), or a size with its unit ("2GiB",
    "500MB"; a unit ending in a lowercase b counts bits, as accelerate reads it) — in GiB; a ``SettingsError``
    naming ``what`` when it is not a positive amount."""
    text = amount.strip()
    unit = AMOUNT.fullmatch(text)
    if text.isdigit():
        size = int(text)
    elif unit is not None:
        number, name = unit.groups()
        scale = 2 ** (10 * UNITS[name[0].lower()]) if name[1] in "iI" else 10 ** (3 * UNITS[name[0].lower()])
        size = int(float(number) * scale) // (8 if name[-1] == "b" and name[1] not in "iI" else 1)
    else:
        size = 0
    if size <= 0:
        raise SettingsError(f"{what} {amount!r} is not an amount of memory (bytes, or a size with its unit such as "
                            "'2GiB' or '500MB')")
    return size / 2**30


# -- the choice ---------------------------------------------------------------------------------------
Kind = Literal["bundled", "directory", "factory"]
KINDS: tuple[str, ...] = get_args(Kind)
DTYPES = ("float32", "bfloat16", "float16")
MAX_RANKS = 1024


@dataclass(frozen=True)
class ModelChoice:
    """What to load, and where: checked when it is made (a ``SettingsError`` saying what is wrong), loaded by
    ``load``, read by people as ``describe()``, kept in ``run.json`` as ``to_json()``.

    ``kind``: "bundled" (a model shipped with the app, ``where`` its name), "directory" (``where`` what
    ``model.load_model`` resolves: a Hugging Face directory, a cache folder, a repo id in the local cache, a
    nanoGPT ckpt.pt; for a dry run also a config.json or ``shapes:NAME``) or "factory" (your own module,
    ``where`` its ``package.module:function``). A directory is loaded in ``dtype`` (float32 unless given; a dry
    run keeps its config's when none is given), its weights given ``memory_gib`` GiB of memory (0: all of it;
    the rest offloaded by accelerate, on the CPU only), with the ``tokenizer`` file or directory given in place
    of its own (""). ``device``: where a bundled model or a directory loads ("cuda" is "cuda:0"); whether this
    machine has it is asked when it loads, so that a run saved on another machine still reads. ``dry_run``: a
    directory's config alone, built on the meta device, as one rank of ``tensor_parallel``."""

    kind: Kind = "bundled"
    where: str = "story-gpt"
    dtype: str | None = None
    memory_gib: float = 0.0
    device: str = HOST
    tokenizer: str = ""
    dry_run: bool = False
    tensor_parallel: int = 1

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise SettingsError(f"a model is bundled, a directory or a factory, not {self.kind!r}")
        if not isinstance(self.where, str) or not isinstance(self.tokenizer, str) or "\x00" in self.tokenizer:
            raise SettingsError("a model's name, path or tokenizer is text without NUL characters")
        directory = self.kind == "directory"
        if self.kind == "bundled" and self.where not in BUNDLED_MODELS:
            raise SettingsError(f"no bundled model is called {self.where!r}; bundled: {', '.join(BUNDLED_MODELS)}")
        if self.kind == "factory" and (not self.where.strip() or "\x00" in self.where):
            raise SettingsError(f"{self.where!r}: give the factory as package.module:function")
        if directory:
            _check_directory_text(self.where)
        object.__setattr__(self, "device", device_name(self.device))
        self._check_load(directory)
        if self.dry_run and not directory:
            raise SettingsError("a dry run builds a model from its config: it goes with a directory, a config.json "
                                "or shapes:NAME")
        if isinstance(self.tensor_parallel, bool) or not isinstance(self.tensor_parallel, int) or \
                not 1 <= self.tensor_parallel <= MAX_RANKS:
            raise SettingsError(f"tensor-parallel takes 1 … {MAX_RANKS} ranks, got {self.tensor_parallel!r}")
        if self.tensor_parallel != 1 and not self.dry_run:
            raise SettingsError("tensor-parallel ranks go with a dry run (one rank's shapes and costs, from the "
                                "config)")

    def _check_load(self, directory: bool) -> None:
        """How it loads — dtype, memory, device and tokenizer — each checked where it means something; a directory
        given no dtype is given float32, what ``model.load_model`` loads in then."""
        if self.dtype is not None and not directory:
            raise SettingsError("a dtype goes with a directory (a bundled model and your own module load in their "
                                "own)")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise SettingsError(f"dtype {self.dtype!r}: give {', '.join(DTYPES)}")
        if directory and self.dtype is None and not self.dry_run:
            object.__setattr__(self, "dtype", "float32")
        gib = self.memory_gib
        if isinstance(gib, bool) or not isinstance(gib, (int, float)) or not 0 <= gib <= MAX_WEIGHTS_GIB:
            raise SettingsError(f"memory for the weights takes 0 (all in memory) to {MAX_WEIGHTS_GIB:g} GiB, "
                                f"got {gib!r}")  # (also NaN)
        object.__setattr__(self, "memory_gib", float(gib))
        if gib and not directory:
            raise SettingsError("memory for the weights goes with a directory (accelerate offloads a Hugging Face "
                                "model)")
        if gib and self.dry_run:
            raise SettingsError("a dry run builds the model on the meta device: no memory for the weights to "
                                "place it in")
        if gib and self.device != HOST:
            raise SettingsError("“Memory for the weights” lets accelerate place the layers (in memory and on disk): "
                                f"it loads on the cpu device only. Set it to 0 to load on {self.device}; the "
                                "previous model stays loaded.")
        if self.device != HOST and self.kind == "factory":
            raise SettingsError(f"device {self.device}: your own factory places its module; choose it on the cpu")
        if self.device != HOST and self.dry_run:
            raise SettingsError(f"device {self.device}: a dry run builds the model on the meta device; choose it on "
                                "the cpu")
        if self.tokenizer and self.kind == "bundled":
            raise SettingsError("a bundled model has its own tokenizer")

    @property
    def max_memory(self) -> str | None:
        """``memory_gib`` as ``model.load_model``'s ``max_memory``: "1.5GiB", or the bytes when a short
        number does not write it exactly; None for all in memory."""
        if not self.memory_gib:
            return None
        short = f"{self.memory_gib:g}"
        return f"{short}GiB" if float(short) == self.memory_gib else str(round(self.memory_gib * 2**30))

    def describe(self) -> str:
        """The choice as a person reads it: what they chose in the sidebar."""
        on = "" if self.device == HOST else f" on {self.device}"
        if self.kind == "bundled":
            return f"the bundled {self.where}{on}"
        if self.kind == "factory":
            return f"your module {self.where}"
        if self.dry_run:
            ranks = f", one rank of {self.tensor_parallel}" if self.tensor_parallel != 1 else ""
            return f"the config of {self.where} (no weights{ranks})"
        how = self.dtype if not self.memory_gib else f"{self.dtype}, weights beyond {self.memory_gib:g} GiB on disk"
        return f"the directory {self.where} ({how}){on}"

    # -- run.json ---------------------------------------------------------------------------------------
    def to_json(self) -> dict[str, str | float | int | bool | None]:
        """The choice as ``run.json`` holds it: a JSON object of its fields (``from_json`` reads it back)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_json(cls, raw: object) -> ModelChoice:
        """The choice ``to_json`` wrote, every field checked, or — from a run saved before there was a
        ``ModelChoice`` — its model key: ``bundled:<name>``, ``factory:<package.module:function>`` or
        ``dir:<dtype>[@<GiB>]:<path>`` (the path last: it may hold colons), after ``<device>|`` for another device
        than the CPU. A ``SettingsError`` saying what is wrong."""
        if isinstance(raw, str):
            return cls._from_key(raw)
        if not isinstance(raw, dict):
            raise SettingsError("a model choice is an object of its fields")
        kinds: dict[str, type | tuple[type, ...]] = {
            "kind": str, "where": str, "dtype": (str, type(None)), "memory_gib": (int, float), "device": str,
            "tokenizer": str, "dry_run": bool, "tensor_parallel": int}
        for name, value in raw.items():
            if name not in kinds:
                raise SettingsError(f"a model choice has no field {str(name)[:64]!r}")
            if not isinstance(value, kinds[name]) or (isinstance(value, bool) and kinds[name] is not bool):
                raise SettingsError(f"the model choice's field {name!r} is of the wrong type")
        if "kind" not in raw or "where" not in raw:
            raise SettingsError("a model choice names its kind and where it is")
        return cls(**raw)

    @classmethod
    def _from_key(cls, key: str) -> ModelChoice:
        """A model key of a run saved before (``from_json``)."""
        device, bar, rest = key.partition("|")
        if bar and DEVICE_NAME.fullmatch(device):
            key = rest
        else:
            device = HOST
        kind, colon, rest = key.partition(":")
        if kind == "bundled" and colon:
            return cls("bundled", rest, device=device)
        if kind == "factory" and colon:
            return cls("factory", rest, device=device)
        how, colon, path = rest.partition(":")
        if kind != "dir" or not colon:
            raise SettingsError(f"{key[:200]!r} is not a model key (bundled:…, dir:…:… or factory:…)")
        dtype, _, gib = how.partition("@")
        try:
            memory = float(gib) if gib else 0.0
        except ValueError:
            raise SettingsError(f"{key[:200]!r}: {gib!r} is not an amount of GiB") from None
        return cls("directory", path, dtype=dtype, memory_gib=memory, device=device)


DEFAULT_MODEL = ModelChoice()  # the bundled GPT-2-style story model, on the CPU


def load(choice: ModelChoice) -> tuple[Decoder, TextTokenizer | None]:
    """``(model, tokenizer)`` of ``choice`` — the one loader of the app, the command line and a saved run's
    restore. The tokenizer is None where the files carry none (a directory without one, your factory returning
    none, a dry run of a bare config): each front end says so in its own words. A device this machine lacks (a
    run saved on another machine), a directory whose files cannot be hashed for its identity: a
    ``ModelLoadError``, as every other model that cannot be loaded."""
    if choice.device != HOST:
        try:
            check_device(choice.device)
        except SettingsError as e:
            raise ModelLoadError(str(e)) from None
    if choice.kind == "bundled":
        bundled, its_own = load_bundled(choice.where)
        return (bundled if choice.device == HOST else bundled.to(choice.device)), its_own
    if choice.kind == "factory":
        made, returned = load_factory(choice.where)
        model = cast(Decoder, made)  # load_factory returns GPT, HFDecoder or OwnDecoder; it is typed nn.Module
        if choice.tokenizer or isinstance(returned, (str, Path)):  # a tokenizer file, read as --tokenizer is
            returned = load_tokenizer(choice.tokenizer or returned, model.config.vocab_size)
        return model, returned
    tokenizer = choice.tokenizer or None
    if choice.dry_run:
        return load_model(choice.where, dtype=choice.dtype, tokenizer=tokenizer, weights=False,
                          tensor_parallel=choice.tensor_parallel)
    loaded, tok = load_model(choice.where, dtype=choice.dtype, tokenizer=tokenizer, max_memory=choice.max_memory,
                             device=choice.device)
    try:  # a model is named by its identity at once: files that cannot be hashed are a failed load, said as one
        identity_of(loaded)  # (model.identity waits for the loader's hash)
    except IdentityUnavailable as e:
        raise ModelLoadError(str(e)) from None
    return loaded, tok
