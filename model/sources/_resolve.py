"""Finding a model from what a person types, on this machine only: never the network.

``resolve_model_path`` accepts

* a local directory (a ``save_pretrained`` folder, a nanoGPT ``out_dir``) or a nanoGPT ``.pt`` file;
* a Hugging Face cache snapshot, ``…/models--org--name/snapshots/<hash>`` (a directory like any other);
* a Hugging Face cache repository folder, ``…/models--org--name``: the snapshot its ``refs/main`` names, else
  its only or most recently written snapshot;
* a repo id, ``org/name`` (or a bare ``name`` such as ``gpt2``), looked up as ``models--org--name`` in the
  local cache: ``HF_HUB_CACHE``, else ``HUGGINGFACE_HUB_CACHE``, else ``HF_HOME/hub``, else
  ``$XDG_CACHE_HOME/huggingface/hub``, else ``~/.cache/huggingface/hub`` — the folder huggingface_hub itself uses.

A spec that matches nothing is refused with a ``ModelLoadError`` saying every place it looked.
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

from gpt_shape_tracer.model.sources._common import ModelLoadError

REPO_PREFIX = "models--"  # huggingface_hub's folder for a model repo: models--{org}--{name}
# a Hub repo id: one optional namespace and a name, of letters, digits, '-', '_', '.' (no '--' or '..' anywhere)
_REPO_ID = re.compile(r"^(?:[A-Za-z0-9][\w.-]{0,95}/)?[A-Za-z0-9][\w.-]{0,95}$")
_SNAPSHOT = re.compile(r"^[0-9a-fA-F]{7,64}$")  # a commit hash, as refs/main holds it


def hub_cache_dir() -> Path:
    """The local Hugging Face hub cache, chosen by the environment variables huggingface_hub reads."""
    for variable in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(variable):
            return Path(os.environ[variable]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    cache = Path(os.environ["XDG_CACHE_HOME"]).expanduser() if os.environ.get("XDG_CACHE_HOME") else (
        Path.home() / ".cache")
    return cache / "huggingface" / "hub"


def is_repo_folder(path: Path) -> bool:
    """Whether ``path`` is a cache repository folder, ``models--org--name`` holding ``snapshots/``."""
    return path.name.startswith(REPO_PREFIX) and (path / "snapshots").is_dir()


def snapshot_of(repo: Path) -> Path:
    """The snapshot of a cache repository folder to load: the one ``refs/main`` names, else the only one, else
    the most recently written (a repository downloaded at several revisions without a ``main`` ref)."""
    snapshots = repo / "snapshots"
    ref = repo / "refs" / "main"
    if os.path.lexists(ref):
        commit = _read_ref(ref)
        if _SNAPSHOT.fullmatch(commit) and (snapshots / commit).is_dir():
            return snapshots / commit
    candidates = [d for d in snapshots.iterdir() if d.is_dir()]
    if not candidates:
        raise ModelLoadError(f"{repo}: the cache folder holds no snapshot in snapshots/ (an interrupted download?)")
    return max(candidates, key=lambda d: (d.stat().st_mtime, d.name))


_REF_BYTES = 256  # a ref holds one commit hash (40 or 64 hex digits) and a newline


def _read_ref(ref: Path) -> str:
    """The commit a ``refs/main`` names: read from a regular file only (a FIFO would block, /dev/zero never
    ends), and at most ``_REF_BYTES`` of it (a sparse 2 GiB file is not read whole)."""
    try:
        fd = os.open(ref, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))  # opening a FIFO must not wait for a writer
    except OSError as e:
        raise ModelLoadError(f"{ref}: cannot be read ({e.strerror})") from None
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(f.fileno())  # of what was opened, not of a name that could change meanwhile
        if not stat.S_ISREG(info.st_mode):
            raise ModelLoadError(f"{ref} is not a regular file ({stat.filemode(info.st_mode)}): a ref holds one "
                                 "commit hash")
        if info.st_size > _REF_BYTES:
            raise ModelLoadError(f"{ref} holds {info.st_size} bytes; a ref holds one commit hash (at most "
                                 f"{_REF_BYTES} bytes): refused without reading it")
        data = f.read(_REF_BYTES + 1)
    try:
        return data.decode("utf-8").strip()
    except UnicodeDecodeError as e:
        raise ModelLoadError(f"{ref}: cannot be read ({e})") from None


def resolve_model_path(spec: str | os.PathLike) -> Path:
    """The local path a model spec names: a directory or a file, an HF cache folder's snapshot, or a repo id's
    snapshot in the local cache. Raises ``ModelLoadError`` listing where it looked when nothing matches."""
    if not isinstance(spec, (str, os.PathLike)):
        raise ModelLoadError(f"{spec!r}: a model is named by a path or a repo id, not a {type(spec).__name__}")
    raw = os.fspath(spec)
    if not raw.strip():
        raise ModelLoadError("no model named: give a directory, a nanoGPT ckpt.pt, or a repo id such as org/name")
    if "\x00" in raw:
        raise ModelLoadError(f"{raw!r}: not a usable path (it holds a NUL byte)")
    try:
        path = Path(raw).expanduser()
    except RuntimeError as e:  # "~nosuchuser/x"
        raise ModelLoadError(f"{raw!r}: cannot expand the home directory ({e})") from None
    if path.exists():
        return snapshot_of(path) if path.is_dir() and is_repo_folder(path) else path
    if path.is_symlink():  # it is there, but where it leads is not: a loop, or a link to nothing
        raise ModelLoadError(f"{path}: a symbolic link that cannot resolve to a file or directory (a loop, or "
                             "its target is gone)")
    looked = [f"{path} (no such directory or file)"]
    if _REPO_ID.fullmatch(raw) and "--" not in raw and ".." not in raw:
        cache = hub_cache_dir()
        repo = cache / (REPO_PREFIX + raw.replace("/", "--"))
        if is_repo_folder(repo):
            return snapshot_of(repo)
        looked.append(f"{repo} (the local Hugging Face cache; HF_HUB_CACHE or HF_HOME choose another)")
    raise ModelLoadError(
        f"{raw!r}: no model found — looked at " + "; ".join(looked)
        + ". Nothing is downloaded: give a local directory, a nanoGPT ckpt.pt, or the id of a repo already in "
        "the cache")
