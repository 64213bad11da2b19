"""The one-pass statistics kernel (``fused_stats.c``), built on first use with the machine's C compiler.

``tracer.storage._stats`` takes a record's statistics with PyTorch reductions: three passes over a clean tensor
(min and max together, Σx, Σx²) and up to seven over one holding a mask's −∞. A 984-token GPT-2-small prefill
evicts 44 attention tensors of 46 MB, and those passes were a third of the traced step. The kernel takes
everything in one pass — min, max, Σx, Σx² of the finite values and the NaN, +∞ and −∞ counts — split over
the threads PyTorch uses (ctypes lets go of the GIL during the call).

Built once per machine into a cache directory (``$XDG_CACHE_HOME/gpt-shape-tracer`` or
``~/.cache/gpt-shape-tracer``), named by a hash of the source, the compiler, the CPU's name and instruction-set
flags, and what ``-march=native`` resolves to for that compiler, so a rebuilt source, another machine, or the
same CPU model exposing other extensions (a virtual machine) never loads a stale library. No compiler, a failed
build, or a platform without one: ``available()`` is False, ``status()`` says why, and the statistics take the
PyTorch path — the same numbers, slower. Nothing is downloaded.

Loading a library runs its code, so only a file this process can trust is loaded:

- the cache directory is made with mode 0700 whatever the umask (missing parents too), and before anything
  in it is used it must be, by ``lstat``, a real directory (not a symbolic link) owned by this user and not
  writable by group or others. One that is not (another user's, a world-writable one, a symbolic link) is
  not used: the kernel is built into a fresh ``tempfile.mkdtemp()`` directory for this process instead,
  removed once loaded, and ``status()`` says so;
- the library is compiled into a private temporary directory inside it, made mode 0500, and its sha256 is
  written beside it (``fused_stats-<key>.sha256``, mode 0400); both are then renamed into place;
- a cached library is loaded only if it and its ``.sha256`` are regular files (a symbolic link is not
  followed) owned by this user and not writable by group or others, and the library's bytes hash to the
  recorded sha256. Any doubt — a missing or different hash, a symbolic link, another owner — and it is
  rebuilt (``status()`` says why) rather than loaded.

The file is opened once, checked and hashed through that descriptor, and loaded through it too
(``/proc/self/fd/N`` where there is a ``/proc``), so what is loaded is what was checked. A platform without
``os.getuid`` or ``O_NOFOLLOW`` takes the PyTorch path.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import platform
import shutil
import stat
import subprocess
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("fused_stats.c")
FLAGS = ("-O3", "-march=native", "-shared", "-fPIC")  # no -ffast-math: NaN and ±∞ compare as IEEE says
SPLIT_NUMEL = 1 << 20  # from 4 MB of float32, the work is split over PyTorch's threads
ALIGN = 32  # elements per split boundary: the kernel's stride (8 lanes × 4 ways)


class _Result(ctypes.Structure):
    _fields_ = [("sum", ctypes.c_double), ("sum_sq", ctypes.c_double), ("min", ctypes.c_float),
                ("max", ctypes.c_float), ("finite", ctypes.c_int64), ("nan", ctypes.c_int64),
                ("pos_inf", ctypes.c_int64), ("neg_inf", ctypes.c_int64)]


@dataclass(frozen=True)
class Moments:
    """What one pass over a float32 tensor gives: over its finite values, the count, min, max, Σx and Σx²
    (min/max ±∞ when there are none); and how many values are NaN, +∞ and −∞."""

    finite: int
    min: float
    max: float
    sum: float
    sum_sq: float
    nan: int
    pos_inf: int
    neg_inf: int


_lock = threading.Lock()
_kernel = None
_status = "not built yet"
_pool: ThreadPoolExecutor | None = None
_pool_size = 0


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "gpt-shape-tracer"


def _cpu(cpuinfo: str | None = None) -> str:
    """The processor's name and its instruction-set flags (the first CPU's lines of ``/proc/cpuinfo``): two
    machines, or two virtual machines on one model, that expose different extensions are different CPUs to a
    ``-march=native`` build."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return platform.processor()
    found: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        field = line.split(":", 1)[0].strip()
        if field in ("model name", "flags", "Features") and field not in found:  # Features: an ARM's flags
            found[field] = line
    return "\n".join(found.values()) or platform.processor()


def _target(compiler: str) -> str:
    """What ``-march=native`` stands for to this compiler on this machine: the target options its driver hands
    the compiler proper (gcc: ``-march=znver3 -mavx2 -mno-avx512f …``; clang: ``-target-cpu``/``-target-feature``),
    read from ``-###`` without compiling anything. "" when the driver does not say (the CPU's flags still key)."""
    try:
        said = subprocess.run([compiler, *FLAGS, "-###", "-x", "c", os.devnull, "-o", os.devnull],
                              capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return ""
    words = [w.strip('"') for w in (said.stderr + said.stdout).split()]
    kept = [w for i, w in enumerate(words)
            if (w.startswith("-m") and not w.startswith("-mllvm")) or (i and words[i - 1] in ("-target-cpu",
                                                                                              "-target-feature"))]
    return " ".join(dict.fromkeys(kept))  # the order the driver gave, each once (temporary file names left out)


def _cache_key(compiler: str, version: str, cpu: str, target: str) -> str:
    """The name of a built library: the source, the compiler, its flags and what they resolve to on this CPU."""
    return hashlib.sha256("\0".join([SOURCE.read_text(), compiler, version, " ".join(FLAGS), cpu, target,
                                     platform.machine()]).encode()).hexdigest()[:16]


class _Doubt(Exception):
    """A file or directory that is not certainly ours alone: its message says why."""


class _BuildFailed(Exception):
    """The compiler failed: its message is the end of what the compiler said."""


_DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
_FILE_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0)


def _doubt(st: os.stat_result, directory: bool) -> str | None:
    """None when ``st`` (an ``lstat``) is a real directory or regular file owned by this user that group and
    others cannot write; else what is wrong with it."""
    if stat.S_ISLNK(st.st_mode):
        return "is a symbolic link (not followed)"
    if directory and not stat.S_ISDIR(st.st_mode):
        return "is not a directory"
    if not directory and not stat.S_ISREG(st.st_mode):
        return "is not a regular file"
    if st.st_uid != os.getuid():
        return f"is owned by uid {st.st_uid}, not by this user (uid {os.getuid()})"
    if st.st_mode & 0o022:
        return f"is writable by group or others (mode {stat.S_IMODE(st.st_mode):#o})"
    return None


def _make_private_dirs(path: Path) -> None:
    """Make ``path`` and any missing parent with mode 0700 whatever the umask (``fchmod`` through a descriptor
    opened without following links, so a link swapped in after ``mkdir`` is not what gets the mode)."""
    missing = []
    while not os.path.lexists(path) and path.parent != path:
        missing.append(path)
        path = path.parent
    for made in reversed(missing):
        try:
            os.mkdir(made, 0o700)
        except FileExistsError:  # another process made it at the same time: checked like any existing one
            continue
        fd = os.open(made, _DIR_FLAGS)
        try:
            os.fchmod(fd, 0o700)
        finally:
            os.close(fd)


def _open_private_dir(path: Path) -> int:
    """A descriptor of the directory ``path`` once ``lstat`` shows it is ours alone; ``_Doubt`` if it is not."""
    st = os.lstat(path)
    doubt = _doubt(st, directory=True)
    if doubt:
        raise _Doubt(f"{path} {doubt}")
    fd = os.open(path, _DIR_FLAGS)
    opened = os.fstat(fd)
    if (opened.st_dev, opened.st_ino) != (st.st_dev, st.st_ino):
        os.close(fd)
        raise _Doubt(f"{path} was replaced while it was checked")
    return fd


def _open_checked(dfd: int, name: str) -> int:
    """A descriptor of the file ``name`` in the directory ``dfd`` once ``lstat`` shows it is a regular file of
    ours that group and others cannot write (``FileNotFoundError`` when there is none, ``_Doubt`` otherwise)."""
    st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
    doubt = _doubt(st, directory=False)
    if doubt:
        raise _Doubt(f"{name} {doubt}")
    fd = os.open(name, _FILE_FLAGS, dir_fd=dfd)
    opened = os.fstat(fd)
    if (opened.st_dev, opened.st_ino) != (st.st_dev, st.st_ino):
        os.close(fd)
        raise _Doubt(f"{name} was replaced while it was checked")
    return fd


def _read_all(fd: int) -> bytes:
    chunks = []
    while chunk := os.read(fd, 1 << 20):
        chunks.append(chunk)
    return b"".join(chunks)


def _sidecar(name: str) -> str:
    return name.removesuffix(".so") + ".sha256"


def _open_verified(dfd: int, name: str) -> int:
    """A descriptor of the cached library ``name`` once it and its sidecar pass ``_open_checked`` and its bytes
    hash to the sha256 recorded when it was built (``FileNotFoundError`` when there is no library)."""
    fd = _open_checked(dfd, name)
    try:
        digest = hashlib.sha256(_read_all(fd)).hexdigest()
        try:
            side = _open_checked(dfd, _sidecar(name))
        except FileNotFoundError:
            raise _Doubt(f"{name} has no recorded sha256 ({_sidecar(name)})") from None
        try:
            recorded = _read_all(side).decode(errors="replace").strip()
        finally:
            os.close(side)
        if digest != recorded:
            raise _Doubt(f"the bytes of {name} do not match the sha256 recorded when it was built")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _compile(compiler: str, directory: Path, dfd: int, name: str) -> int:
    """Build into a private temporary directory inside ``directory``, make the library 0500 and its sha256
    sidecar 0400, and rename both into place; a descriptor of the library just built (the one hashed)."""
    with tempfile.TemporaryDirectory(dir=directory, prefix=".build-") as tmp:
        built = Path(tmp) / name
        done = subprocess.run([compiler, *FLAGS, "-o", str(built), str(SOURCE), "-lm"],
                              capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise _BuildFailed(done.stderr.strip()[-500:])
        fd = os.open(built, _FILE_FLAGS)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
                raise _Doubt(f"what {compiler} wrote is not a regular file of this user's")
            os.fchmod(fd, 0o500)  # the umask cannot leave it writable by anyone
            digest = hashlib.sha256(_read_all(fd)).hexdigest()
            side = Path(tmp) / _sidecar(name)
            sfd = os.open(side, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o400)
            try:
                os.write(sfd, f"{digest}\n".encode())
                os.fchmod(sfd, 0o400)
            finally:
                os.close(sfd)
            # atomic: another process loading at once sees a whole file (and, between the two renames, a
            # hash that does not match, so it builds too rather than loading)
            os.replace(built, name, dst_dir_fd=dfd)
            os.replace(side, _sidecar(name), dst_dir_fd=dfd)
        except BaseException:
            os.close(fd)
            raise
    return fd


def _load_or_build(compiler: str, directory: Path, name: str, tidy: bool) -> tuple[object | None, str]:
    """Load the library ``name`` from ``directory`` if it passes ``_open_verified``, else build it there first.
    ``tidy``: remove the builds of other sources or compilers beside it."""
    target = directory / name
    try:
        dfd = _open_private_dir(directory)
    except (OSError, _Doubt) as e:
        return None, f"the kernel's directory {e}: statistics take the PyTorch path"
    rebuilt = ""
    try:
        try:
            fd = _open_verified(dfd, name)
        except FileNotFoundError:
            fd = None
        except (OSError, _Doubt) as e:  # OSError: a link swapped in after the lstat (ELOOP), a directory...
            fd, rebuilt = None, f" (rebuilt: {e}; it was not loaded)"
        if fd is None:
            try:
                fd = _compile(compiler, directory, dfd, name)
            except (_BuildFailed, OSError, subprocess.SubprocessError, _Doubt) as e:
                return None, f"building {SOURCE.name} failed: {e}"
            if tidy:
                for old in os.listdir(dfd):  # builds of earlier sources or compilers
                    if old.startswith("fused_stats-") and old not in (name, _sidecar(name)):
                        with contextlib.suppress(OSError):
                            os.unlink(old, dir_fd=dfd)
        # through the descriptor that was checked and hashed, not the name, where the platform allows
        through = f"/proc/self/fd/{fd}" if os.path.isdir("/proc/self/fd") else str(target)
        try:
            library = ctypes.CDLL(through)
        except OSError as e:
            return None, f"loading {target} failed: {e}"
        finally:
            os.close(fd)
    finally:
        os.close(dfd)
    try:
        kernel = library.fused_stats_f32
    except AttributeError:  # an odd $CC, or a file that is not our build: the PyTorch reductions instead
        return None, f"{target} has no fused_stats_f32 symbol: the PyTorch reductions are used instead"
    kernel.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.POINTER(_Result)]
    kernel.restype = None
    return kernel, f"built with {compiler} into {target}{rebuilt}"


def _build() -> tuple[object | None, str]:
    if not hasattr(os, "getuid") or not hasattr(os, "O_NOFOLLOW"):
        return None, ("no file-ownership checks on this platform, so no library is loaded: statistics take "
                      "the PyTorch path")
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if compiler is None:
        return None, "no C compiler (cc, gcc or clang) on PATH: statistics take the PyTorch path"
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"the C compiler {compiler} did not run ({e}): statistics take the PyTorch path"
    key = _cache_key(compiler, version, _cpu(), _target(compiler))
    name = f"fused_stats-{key}.so"
    cache = _cache_dir()
    try:
        _make_private_dirs(cache)
        os.close(_open_private_dir(cache))
    except _Doubt as e:
        why = f"the cache directory {e}"
    except OSError as e:
        why = f"the cache directory {cache} could not be made or opened ({e})"
    else:
        return _load_or_build(compiler, cache, name, tidy=True)
    why += " and is not used (make it a directory of yours with mode 700, or remove it, to cache the kernel)"
    try:
        private = Path(tempfile.mkdtemp(prefix="gpt-shape-tracer-"))  # 0700, ours, for this process alone
    except OSError as e:
        return None, f"{why}; no private directory could be made either ({e}): statistics take the PyTorch path"
    try:
        kernel, how = _load_or_build(compiler, private, name, tidy=False)
    finally:
        shutil.rmtree(private, ignore_errors=True)  # the library stays mapped
    if kernel is None:
        return None, f"{why}; {how}"
    return kernel, f"{why}; {how}, a private directory for this process (removed once loaded)"


def _get_kernel():
    global _kernel, _status
    if _status == "not built yet":
        with _lock:
            if _status == "not built yet":
                _kernel, _status = _build()
    return _kernel


def available() -> bool:
    """Whether the kernel is built and loaded (building it on the first call)."""
    return _get_kernel() is not None


def status() -> str:
    """How the kernel was built, or why the statistics take the PyTorch path."""
    _get_kernel()
    return _status


def moments(t: torch.Tensor) -> Moments | None:
    """One pass over a contiguous float32 CPU tensor; None when the kernel is not available or ``t`` is not
    such a tensor."""
    kernel = _get_kernel()
    if kernel is None or t.dtype != torch.float32 or not t.is_cpu or not t.is_contiguous():
        return None
    n = t.numel()
    address = t.data_ptr()
    parts = max(1, min(torch.get_num_threads(), n // SPLIT_NUMEL))
    step = -(-n // parts // ALIGN) * ALIGN
    spans = [(start, min(step, n - start)) for start in range(0, n, step)] if n else [(0, 0)]
    results = [_Result() for _ in spans]
    if len(spans) == 1:
        kernel(address, n, ctypes.byref(results[0]))
    else:
        pool = _workers(len(spans))
        waits = [pool.submit(kernel, address + 4 * start, size, ctypes.byref(r))
                 for (start, size), r in zip(spans, results)]
        for w in waits:
            w.result()
    return Moments(finite=sum(r.finite for r in results), min=min(r.min for r in results),
                   max=max(r.max for r in results), sum=sum(r.sum for r in results),
                   sum_sq=sum(r.sum_sq for r in results), nan=sum(r.nan for r in results),
                   pos_inf=sum(r.pos_inf for r in results), neg_inf=sum(r.neg_inf for r in results))


def _workers(n: int) -> ThreadPoolExecutor:
    global _pool, _pool_size
    with _lock:
        if _pool is None or _pool_size < n:
            if _pool is not None:
                _pool.shutdown(wait=False)
            _pool, _pool_size = ThreadPoolExecutor(max_workers=n, thread_name_prefix="fused-stats"), n
        return _pool
