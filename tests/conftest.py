from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import settings

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may download at test time
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Under mutation testing (mutmut forks a child per mutant from a parent that already ran torch) one thread:
# OpenMP's thread pool does not survive fork, and the children would hang.
# Under pytest-xdist (two workers, pyproject.toml) one thread each: two workers of two threads on 2 cores spin
# against each other.
torch.set_num_threads(1 if "MUTANT_UNDER_TEST" in os.environ or "PYTEST_XDIST_WORKER" in os.environ else 2)

# CI runs the same examples every time (a red run must be reproducible); to draw new ones, run
# `pytest --hypothesis-profile=explore tests/tracer/test_bad_input.py` and turn what it finds into @example lines.
settings.register_profile("ci", derandomize=True, print_blob=True)
settings.register_profile("explore", derandomize=False)  # fresh random examples each run
settings.load_profile("ci")


@pytest.fixture(scope="session", autouse=True)
def temporary_files_under_pytests_own_directory(tmp_path_factory):
    """Every ``tempfile.mkdtemp`` of the tests (model directories built once per module) and of the code they
    run (offload folders, spill files) goes under pytest's temporary directory, which pytest prunes to its
    last three runs: in /tmp, each full run left some 150 directories behind."""
    import tempfile

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(tempfile, "tempdir", str(tmp_path_factory.mktemp("tempfile")))
        yield


@pytest.fixture(scope="session", autouse=True)
def runs_under_pytests_own_directory(tmp_path_factory):
    """The app keeps every generation in a runs folder (gpt_shape_tracer/runs.py), by default in the user's data
    directory: the tests' runs (AppTest's and the servers' they start, which inherit the environment) go under
    pytest's temporary directory instead."""
    from gpt_shape_tracer.session.runs import RUNS_DIR_ENV

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(RUNS_DIR_ENV, str(tmp_path_factory.mktemp("runs")))
        yield


@pytest.fixture(scope="session", autouse=True)
def apptest_does_once_what_a_server_does_once():
    """A server compiles app.py once and scans the installed packages for Streamlit components once. AppTest
    does both for every AppTest (the scan) and every run (the compile, through a new script cache each time):
    27% of the AppTest tests' time under py-spy. Here both happen once per test session; what runs is the
    same. The compile is under a lock: two AppTests on two threads would compile at once, and CPython
    3.11.7's ast.parse is not thread-safe ("AST constructor recursion depth mismatch", fixed in 3.11.8)."""
    import functools
    import threading

    from streamlit.components.v2 import manifest_scanner
    from streamlit.runtime.scriptrunner.script_cache import ScriptCache

    compiled: dict[str, object] = {}
    lock = threading.Lock()
    original = ScriptCache.get_bytecode

    def get_bytecode(self, script_path: str):
        with lock:
            if script_path not in compiled:
                compiled[script_path] = original(self, script_path)
            return compiled[script_path]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ScriptCache, "get_bytecode", get_bytecode)
        patch.setattr(manifest_scanner, "scan_component_manifests",
                      functools.cache(manifest_scanner.scan_component_manifests))
        yield


@pytest.fixture(scope="session")
def bundled():
    from gpt_shape_tracer.model import load_bundled

    return load_bundled()


@pytest.fixture(scope="session")
def hf_pair():
    """A random small Hugging Face GPT-2 and our GPT loaded from its save_pretrained directory."""
    import tempfile

    from transformers import GPT2Config, GPT2LMHeadModel

    from gpt_shape_tracer.model import load_hf_gpt2

    torch.manual_seed(1234)
    cfg = GPT2Config(
        n_layer=3, n_head=4, n_embd=64, vocab_size=211, n_positions=48, bos_token_id=0, eos_token_id=0,
        attn_pdrop=0.0, embd_pdrop=0.0, resid_pdrop=0.0,
    )
    hf = GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():  # non-trivial biases and LayerNorm parameters, so every term is exercised
        for name, p in hf.named_parameters():
            if name.endswith("bias") or ".ln_" in name:
                p.add_(torch.randn_like(p) * 0.05)
    directory = Path(tempfile.mkdtemp(prefix="hf-gpt2-"))
    hf.save_pretrained(directory)
    ours, tok = load_hf_gpt2(directory)
    return hf, ours, directory


@pytest.fixture(scope="session")
def hf_dir_with_tokenizer(bundled):
    """A small random Hugging Face GPT-2 whose vocabulary fits the bundled tokenizer, saved with it."""
    import tempfile

    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(99)
    cfg = GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=1024, n_positions=64, bos_token_id=0, eos_token_id=0)
    directory = Path(tempfile.mkdtemp(prefix="hf-gpt2-tok-"))
    GPT2LMHeadModel(cfg).eval().save_pretrained(directory)
    bundled[1].save(directory / "tokenizer.json")
    return directory


# -- traced generations shared by the figure, FlashAttention and cache tests (one per module that asks) -------
FIGURES_PROMPT = "Once upon a time, there was a little girl named Lily."


@pytest.fixture(scope="module")
def batch_gen(bundled):
    """Two left-padded sequences, one holding HTML, greedy, three steps."""
    from gpt_shape_tracer.tracer import TracedGeneration

    model, tok = bundled
    g = TracedGeneration(model, tok, [FIGURES_PROMPT, "Tom said, <script>alert(1)</script>"], temperature=0)
    g.run(3)
    return g


@pytest.fixture(scope="module")
def llama_gen(bundled):
    """A small grouped-query Llama-style model (6 query heads sharing 2 key/value heads), random weights."""
    import torch

    from gpt_shape_tracer.model import GPT, GPTConfig
    from gpt_shape_tracer.tracer import TracedGeneration

    _, tok = bundled
    torch.manual_seed(5)
    config = GPTConfig.for_family("llama", vocab_size=tok.vocab_size, n_ctx=64, d_model=48, n_layer=2, n_head=6,
                                  n_kv_head=2, d_mlp=64, rope_theta=500.0)
    g = TracedGeneration(GPT(config).eval(), tok, "Mia had a small blue boat.", temperature=0)
    g.run(3)
    return g


@pytest.fixture(scope="module")
def one_torch_thread():
    """For a module of tiny models (``pytestmark = pytest.mark.usefixtures("one_torch_thread")``): a 64-wide model
    gains nothing from a second thread, and on a loaded machine two spin against each other."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
