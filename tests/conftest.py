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
os.environ.setdefault("GPT_TRACER_VALIDATE_FIGURES", "1")  # plotly checks every property of every figure built
# Under mutation testing (mutmut forks a child per mutant from a parent that already ran torch) one thread:
# OpenMP's thread pool does not survive fork, and the children would hang.
torch.set_num_threads(1 if "MUTANT_UNDER_TEST" in os.environ else 2)

# CI runs the same examples every time (a red run must be reproducible); to draw new ones, run
# `pytest --hypothesis-profile=explore tests/test_bad_input.py` and turn what it finds into @example lines.
settings.register_profile("ci", derandomize=True, print_blob=True)
settings.register_profile("explore", derandomize=False)  # fresh random examples each run
settings.load_profile("ci")


@pytest.fixture(scope="session")
def bundled():
    from model import load_bundled

    return load_bundled()


@pytest.fixture(scope="session")
def hf_pair():
    """A random small Hugging Face GPT-2 and our GPT loaded from its save_pretrained directory."""
    import tempfile

    from transformers import GPT2Config, GPT2LMHeadModel

    from model import load_hf_gpt2

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
