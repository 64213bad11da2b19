"""Loading a ``save_pretrained`` directory as an ``HFDecoder`` (``load_hf_decoder``), with accelerate's
offload where asked (``max_memory``), and the guard that checks a loaded model's cached step against
transformers' own forward (``guard_against_transformers``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import weakref
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from gpt_shape_tracer.model.gpt import (
    BackgroundDigest,
    PendingIdentity,
)
from gpt_shape_tracer.model.sources._common import check_expert_counts
from gpt_shape_tracer.model.sources._hf_attention import ATTENTION, _register
from gpt_shape_tracer.model.sources._hf_decoder import HFDecoder
from gpt_shape_tracer.model.sources._hf_own_attention import unwatched
from gpt_shape_tracer.model.sources._hf_own_cache import takes_whole_text
from gpt_shape_tracer.model.sources._hf_probe import cache_keyword
from gpt_shape_tracer.model.sources._hf_refusals import HFDecoderError, refusal_by_config

if TYPE_CHECKING:  # transformers is imported where it is used: loading our own models never needs it
    pass
MaxMemory = int | str | dict[int | str, int | str]  # bytes, "4GiB", or accelerate's {device: amount}


def _max_memory(max_memory: MaxMemory) -> dict[int | str, int]:
    """accelerate's ``{device: bytes}`` from what a person writes: an amount alone is the CPU's share; an
    amount is bytes (an int, or a string of digits) or a size with its unit ("2GiB", "500MB")."""
    try:
        from accelerate.utils import convert_file_size_to_int
    except ModuleNotFoundError:
        raise HFDecoderError("max_memory needs Hugging Face accelerate, which is not installed: "
                             "pip install 'gpt-shape-tracer[offload]' (or pip install accelerate)") from None

    spec = max_memory if isinstance(max_memory, dict) else {"cpu": max_memory}
    sizes: dict[int | str, int] = {}
    for device, amount in spec.items():
        try:
            size = int(amount) if isinstance(amount, str) and amount.strip().isdigit() else amount
            sizes[device] = convert_file_size_to_int(size)
            if isinstance(size, bool) or sizes[device] <= 0:
                raise ValueError("not positive")
        except (ValueError, TypeError, AttributeError):
            raise HFDecoderError(f"max_memory for {device!r}: {amount!r} is not an amount of memory (bytes, or "
                                 "a size with its unit such as '2GiB' or '500MB')") from None
        has = _memory_of(device)
        if sizes[device] > has:  # accelerate would plan for memory that is not there, and the load fail late
            raise HFDecoderError(f"max_memory for {device!r}: {amount!r} is {sizes[device]:,} bytes, more than the "
                                 f"{has:,} bytes " + ("of this machine's memory" if device == "cpu" else
                                                      f"GPU {device} has"))
    return sizes


def _memory_of(device: int | str) -> int:
    """The bytes of memory ``device`` of max_memory has: "cpu" the machine's, an int a GPU's (refused when there
    is no such GPU or key)."""
    if device == "cpu":
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if isinstance(device, int) and not isinstance(device, bool):
        if not 0 <= device < torch.cuda.device_count():
            raise HFDecoderError(f"max_memory names GPU {device}, but this machine has "
                                 f"{torch.cuda.device_count()} GPU(s)")
        return torch.cuda.get_device_properties(device).total_memory
    raise HFDecoderError(f"max_memory's keys are GPU numbers (0, 1, …) and 'cpu', not {device!r}")


GUARD_PROMPT = 6  # tokens before the guard's decode step (more where a short sliding window must be passed)


@contextmanager
def _transformers_eager(hf: nn.Module):
    """transformers' own eager attention for the duration (the model's implementation again after: our function, or
    eager where its attention is the family's own code, read from its ops); if the model cannot switch, our function
    stays (it computes transformers' eager numbers by construction, with our hook points idle)."""
    before = getattr(getattr(hf, "config", None), "_attn_implementation", None)
    try:
        hf.set_attn_implementation("eager")  # type: ignore[operator]
    except (ValueError, KeyError, AttributeError, TypeError):
        yield
        return
    try:
        yield
    finally:
        hf.set_attn_implementation(before if isinstance(before, str) else ATTENTION)  # type: ignore[operator]


def _within(gap: float) -> str:
    """How closely the trace follows a reference, in words: "exactly" for no difference at all."""
    return "exactly" if gap == 0 else f"within {gap:.1g}"


def guard_against_transformers(model: HFDecoder) -> None:
    """No silent difference: one decode step with our cache, compared with transformers' own forward on the same
    tokens — without a cache (what the model computes) and with its own cache (what its generate() runs).

    Ours differs from both: refused with the numbers. Ours equals the uncached forward but transformers' own
    cached path differs (moshi past its sliding window): loaded, and ``model.reference_note`` says which one the
    trace follows and by how much the other differs."""
    from gpt_shape_tracer.model.sources._common import logit_tolerance

    hf = model.hf
    window = model.config.sliding_window
    n = window + 2 if window is not None and window + 2 <= 64 else GUARD_PROMPT
    n = min(n, model.config.n_ctx - 1)
    tokens = (torch.arange(n + 1, device=model.input_device) * 7 + 3)[None] % model.config.vocab_size  # [1, n+1]
    tolerance = logit_tolerance(next(hf.parameters()).dtype)
    if model.stacks is not None or model.prompt_positions:  # BLT, CPM-Ant: traced without a cache
        # (model/sources/_hf_stacks.py, model/sources/_hf_own_cache.py)
        model.reference_note = _uncached_guard(model, tokens, n, tolerance)
        return
    with torch.no_grad():
        if model.no_cache_reason is not None:  # OpenAI GPT: no cache, its every step a full forward (so is ours)
            ours = model(tokens)[0, -1].float()  # [V]
        else:
            cache = model.new_cache()
            model(tokens[:, :n], cache)
            ours = model(tokens[:, n:], cache)[0, -1].float()  # [V]
        with _transformers_eager(hf):
            uncached = hf(input_ids=tokens, use_cache=False).logits[0, -1].float()
            keyword = cache_keyword(hf)
            whole = takes_whole_text(keyword)  # XLM: its cache= filled and read with the whole text each time
            past = None if whole or model.no_cache_reason else getattr(
                hf(input_ids=tokens[:, :n], use_cache=True), keyword, None)
            if past is None and keyword in ("past_key_values", "cache") and not model.no_cache_reason:
                # RecurrentGemma, XLM: they return no cache object (RecurrentGemma's recurrent state stays in its
                # modules); given one, as generate() gives it, they fill its K and V
                from transformers import DynamicCache

                past = DynamicCache(config=hf.config)
                hf(input_ids=tokens[:, :n], **{keyword: past}, use_cache=True)
            cached = uncached if model.no_cache_reason else hf(
                input_ids=tokens if whole else tokens[:, n:], **{keyword: past}, use_cache=True).logits[0, -1].float()
            if model.bidirectional and keyword == "mems":  # XLNet's attn_type "bi", traced without a cache: what
                # its own cached path (its mems) gives, for the note
                mems = hf(input_ids=tokens[:, :n], use_mems=True).mems
                cached = hf(input_ids=tokens[:, n:], mems=mems, use_mems=True).logits[0, -1].float()
    to_uncached = float((ours - uncached).abs().max())
    to_cached = float((ours - cached).abs().max())
    name = model.architecture.model_type
    if to_uncached > tolerance and to_cached > tolerance:
        raise HFDecoderError(
            f"{name}: a decode step after {n} tokens differs from transformers' own forward on the same tokens by "
            f"{to_uncached:.3g} (without a cache) and {to_cached:.3g} (with its cache), beyond {tolerance:g}: the "
            "trace would not show what this model computes", reason="differs from transformers")
    generated = _generate_note(model, tokens, ours, tolerance)
    # XLNet's attn_type "bi": its cached path differs by construction (earlier positions cannot see a new token), by
    # however little one step on a small model shows
    apart = max(to_cached, to_uncached) > tolerance or (model.bidirectional and to_cached > 0)
    if generated is not None:
        follows = "uncached" if to_uncached <= tolerance else "cached"
        model.reference_note = generated if not apart else (
            f"{generated}; beside that, transformers' own cached and uncached forwards of {name} differ (by "
            f"{max(to_cached, to_uncached):.3g} in the logits of a decode step after {n} tokens) and the trace "
            f"follows the {follows} one ({_within(min(to_cached, to_uncached))})")
    elif to_cached > tolerance:
        model.reference_note = (
            f"transformers' own cached forward of {name} differs from its uncached forward (by {to_cached:.3g} in the "
            f"logits of a decode step after {n} tokens); the trace follows the uncached forward "
            f"({_within(to_uncached)}), what the model computes for the whole text")
    elif to_uncached > tolerance:
        model.reference_note = (
            f"transformers' own uncached forward of {name} differs from its cached forward (by {to_uncached:.3g} in "
            f"the logits of a decode step after {n} tokens); the trace follows the cached forward (within "
            f"{to_cached:.1g}), what its generate() runs")


def _generate_note(model: HFDecoder, tokens: torch.Tensor, ours: torch.Tensor, tolerance: float) -> str | None:
    """Where transformers' generate() hands the forward more than the text — its family's own
    ``prepare_inputs_for_generation``: XLNet appends a dummy token and predicts it through a query stream
    (``perm_mask``, ``target_mapping``: two-stream attention, Yang et al. 2019), XLM appends its mask token — the
    next-token logits generate() computes, against the trace's (the forward's logits at the text's last token).
    ``None`` where they agree, where the family prepares no inputs of its own, or where its preparation needs more
    than the text; else the sentence saying what generate() adds, by how much the logits differ and which token each
    picks greedily."""

    from transformers.generation.utils import GenerationMixin

    hf, name = model.hf, model.architecture.model_type
    own = getattr(type(hf), "prepare_inputs_for_generation", None)
    if own is None or own is GenerationMixin.prepare_inputs_for_generation:
        return None
    try:
        with torch.no_grad(), _transformers_eager(hf), unwatched():
            fed = {k: v for k, v in hf.prepare_inputs_for_generation(tokens, use_cache=False, use_mems=False).items()
                   if v is not None}
            theirs = hf(**fed).logits[0, -1].float()  # [V]
    except Exception:  # noqa: BLE001 (a preparation that needs a cache or more: nothing measured, nothing said)
        return None
    gap = float((theirs - ours).abs().max())
    if gap <= tolerance:
        return None
    ids = fed.get("input_ids")
    added = [int(i) for i in ids[0, tokens.shape[1]:]] if isinstance(ids, torch.Tensor) and ids.shape[1] > \
        tokens.shape[1] and torch.equal(ids[:, :tokens.shape[1]], tokens) else []
    mask_id = getattr(hf.config, "mask_token_id", None)
    what = []
    if added:
        which = " (the config's mask_token_id)" if mask_id is not None and added == [mask_id] else ""
        what.append(f"appends token {', '.join(map(str, added))}{which} to the text and reads the logits there")
    if "target_mapping" in fed:
        what.append("predicts that position through XLNet's query stream (perm_mask, target_mapping: the two-stream "
                    "attention of Yang et al. 2019), which the trace does not lay out")
    extra = sorted(set(fed) - {"input_ids", "perm_mask", "target_mapping", "use_cache", "use_mems", "attention_mask"})
    if extra:
        what.append(f"hands the forward {', '.join(extra)}")
    mine, its = int(ours.argmax()), int(theirs.argmax())
    picks = (f"both pick token {its} greedily" if mine == its else
             f"generate() picks token {its} greedily where the trace picks {mine}")
    return (f"transformers' generate() of {name} predicts each next token another way than its forward over the text "
            f"that the trace follows: it {'; it '.join(what) or 'prepares inputs of its own'}; on the "
            f"{tokens.shape[1]} tokens the load checks it with, its next-token logits differ from the trace's by "
            f"{gap:.3g} and {picks}")


def _uncached_guard(model: HFDecoder, tokens: torch.Tensor, n: int, tolerance: float) -> str:
    """The guard for a model traced without a cache: our forward of the whole text against transformers' uncached
    one (refused where they differ); returns what transformers' own cached forward does with it — fails, or differs
    from the model's forward of the whole text — for ``reference_note``."""
    hf, name = model.hf, model.architecture.model_type
    with torch.no_grad():
        ours = model(tokens)[0, -1].float()
        with _transformers_eager(hf):
            uncached = hf(input_ids=tokens, use_cache=False).logits[0, -1].float()
            try:
                past = hf(input_ids=tokens[:, :n], use_cache=True).past_key_values
                # CPM-Ant's forward slices the cached positions off the whole text itself (its generate() hands it
                # every id so far); any other is handed the new token only
                fed = tokens if model.prompt_positions else tokens[:, n:]
                cached: torch.Tensor | None = hf(input_ids=fed, past_key_values=past,
                                                 use_cache=True).logits[0, -1].float()
                failure = ""
            except Exception as e:  # noqa: BLE001 (transformers' own cached path failing is what the note says)
                cached, failure = None, f"{type(e).__name__}: {str(e)[:160]}"
    to_uncached = float((ours - uncached).abs().max())
    if to_uncached > tolerance:
        raise HFDecoderError(
            f"{name}: its forward of {n + 1} tokens differs from transformers' own uncached forward by "
            f"{to_uncached:.3g}, beyond {tolerance:g}: the trace would not show what this model computes",
            reason="differs from transformers")
    own = (f"transformers' own cached forward of {name} fails ({failure})" if cached is None else
           f"transformers' own cached forward of {name} differs from its uncached forward (by "
           f"{float((cached - uncached).abs().max()):.3g} in the logits of a decode step after {n} tokens)")
    return (f"{own}; the trace runs it without a cache, every step recomputing the whole text, and follows the "
            f"uncached forward ({_within(to_uncached)})")


def load_hf_decoder(path: str | os.PathLike, *, dtype: torch.dtype | str | None = None,
                    device: torch.device | str = "cpu", name: str | None = None,
                    max_memory: MaxMemory | None = None, offload_folder: str | os.PathLike | None = None) -> HFDecoder:
    """A local ``save_pretrained`` directory of any transformers causal LM, as an ``HFDecoder``.

    ``max_memory`` (bytes, "4GiB", or accelerate's ``{0: "20GiB", "cpu": "30GiB"}``) loads a model larger than
    the memory it is given: accelerate places each layer on a GPU, in CPU memory or on disk within those
    amounts (``device_map="auto"``) and moves its weights in for its forward only. Disk-offloaded weights go
    to ``offload_folder`` — by default a private temporary directory deleted with the model. The logits and
    every record are the same as with every weight in memory; each forward reads the offloaded weights again.

    Never downloads (``local_files_only``), never runs code from the directory (``trust_remote_code`` off)."""
    directory = Path(path)
    # the identity's hash of every file runs on a second thread while transformers is imported and loads,
    # and goes on after the load returns: the first traced step waits for what is left of it, if anything
    try:
        digest = BackgroundDigest(_digest_files(directory), by_name=True)
    except OSError as e:
        raise HFDecoderError(f"{directory}: cannot be read ({e})") from None
    try:
        model = _load_hf_decoder(directory, digest, dtype, device, name, max_memory, offload_folder)
    except BaseException:
        digest.abandon()  # a refused or failed load leaves no thread reading a large directory for nothing
        raise
    weakref.finalize(model, digest.abandon)  # nor does a model dropped before its hash is done
    return model


def _load_hf_decoder(directory: Path, digest: BackgroundDigest, dtype: torch.dtype | str | None,
                     device: torch.device | str, name: str | None, max_memory: MaxMemory | None,
                     offload_folder: str | os.PathLike | None) -> HFDecoder:
    from transformers import AutoConfig, AutoModelForCausalLM

    dtypes = {None: torch.float32, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    target = dtypes.get(dtype, dtype) if not isinstance(dtype, torch.dtype) else dtype
    try:
        hf_config = AutoConfig.from_pretrained(directory, local_files_only=True, trust_remote_code=False)
    except Exception as e:  # noqa: BLE001 - no code of the directory's runs: any error is a config it refuses
        # (huggingface_hub's StrictDataclassClassValidationError, for one, is no ValueError)
        raise HFDecoderError(f"{directory}: transformers cannot read its config ({type(e).__name__}: "
                             f"{str(e)[:500]})") from None
    model_type = getattr(hf_config, "model_type", "?")
    refusal = refusal_by_config(hf_config, model_type)
    if refusal is not None:
        raise HFDecoderError(f"{directory}: {refusal}", reason=refusal.reason)
    _check_config_against_weights(directory, hf_config)  # before anything is built
    placement: dict[str, Any] = {}
    folder = None
    if max_memory is not None:
        if torch.device(device).type != "cpu":
            raise HFDecoderError("with max_memory, accelerate places the model: name the GPUs in it "
                                 "({0: '20GiB', 'cpu': '30GiB'}) instead of passing device")
        amounts = _max_memory(max_memory)  # before the folder: a refused amount leaves nothing behind
        if offload_folder is None:
            folder = tempfile.mkdtemp(prefix="gpt-shape-tracer-offload-")  # 0700: only this user reads it
        placement = {"device_map": "auto", "max_memory": amounts, "offload_folder": str(offload_folder or folder)}
    _register()
    try:
        try:
            hf = AutoModelForCausalLM.from_pretrained(directory, local_files_only=True, trust_remote_code=False,
                                                      dtype=target, attn_implementation=ATTENTION, **placement)
        except (OSError, ValueError, KeyError, TypeError, RuntimeError, AttributeError, AssertionError,
                ImportError, IndexError) as e:  # transformers' own code failing on this directory: a refusal
            raise HFDecoderError(f"{directory}: transformers cannot load it as a causal LM "
                                 f"({type(e).__name__}: {str(e)[:500]})", reason="cannot load") from None
        if not placement:
            # transformers declares PreTrainedModel.to as functools.wraps(nn.Module.to), whose typeshed type
            # keeps the unbound method's self: mypy reads every call as one argument short
            hf = hf.to(device)  # type: ignore[arg-type]
        model = HFDecoder(hf)
        if model.input_device.type != "meta":
            guard_against_transformers(model)
    except BaseException:  # a failed load leaves no offload folder behind
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)
        raise
    if folder is not None:
        weakref.finalize(model, shutil.rmtree, folder, True)
    model.identity = PendingIdentity(digest, name=name or directory.name, source=str(directory),
                                     family=f"hf:{model_type}", config=model.config.to_dict())
    return model


_LAYER_KEY = re.compile(r"(?:^|\.)(?:layers|h|blocks|layer)\.(\d+)\.")


def _check_config_against_weights(directory: Path, hf_config: Any) -> None:
    """What transformers would build without complaint but should not: a config whose sizes the weights do not
    back (600 layers over weights holding 2: 598 layers of random numbers, built for a minute), no attention
    heads (a division by zero later), a boolean written as a string (``"false"`` is truthy and ties). The layer
    count is read from the safetensors headers' names only."""
    try:  # transformers has just read it
        raw = json.loads((directory / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        raw = {}
    raw = raw if isinstance(raw, dict) else {}
    for flag in ("tie_word_embeddings", "use_cache", "attention_bias", "mlp_bias"):
        if flag in raw and not isinstance(raw[flag], bool):
            raise HFDecoderError(f"{directory / 'config.json'}: {flag} must be true or false, got {raw[flag]!r}")
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    for name in ("num_attention_heads", "num_hidden_layers", "hidden_size", "vocab_size"):
        value = getattr(text, name, None)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise HFDecoderError(f"{directory / 'config.json'}: {name} must be a positive whole number, got "
                                 f"{value!r}")
    # as written (a family may map one name onto another and keep the other's value) and as transformers reads it
    sub = raw.get("text_config")
    for level in (raw, sub if isinstance(sub, dict) else {}):
        check_expert_counts(level.get, str(directory / "config.json"), HFDecoderError)
    check_expert_counts(lambda name: getattr(text, name, None), str(directory / "config.json"), HFDecoderError)
    heads = getattr(text, "num_attention_heads", None)
    kv_heads = getattr(text, "num_key_value_heads", None)
    if isinstance(kv_heads, int) and isinstance(heads, int) and (kv_heads < 1 or heads % kv_heads):
        raise HFDecoderError(f"{directory / 'config.json'}: num_key_value_heads = {kv_heads} does not divide "
                             f"num_attention_heads = {heads}")
    layer_types = getattr(text, "layer_types", None)
    n_layer = getattr(text, "num_hidden_layers", None)
    if isinstance(layer_types, (list, tuple)) and isinstance(n_layer, int) and len(layer_types) != n_layer:
        raise HFDecoderError(f"{directory / 'config.json'}: layer_types lists {len(layer_types)} layers, "
                             f"num_hidden_layers says {n_layer}")
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        return
    from safetensors import safe_open

    shapes: dict[str, tuple[str, tuple[int, ...]]] = {}  # name → (dtype, shape), from the headers only
    try:
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():  # noqa: SIM118 (a safe_open handle is no dict)
                    part = f.get_slice(key)
                    shapes[key] = (str(part.get_dtype()), tuple(part.get_shape()))
    except (OSError, ValueError, RuntimeError) as e:  # safetensors raises its own SafetensorError (a RuntimeError)
        raise HFDecoderError(f"{directory}: the weights' headers cannot be read ({e})") from None
    held = {int(m.group(1)) for key in shapes if (m := _LAYER_KEY.search(key))}
    if isinstance(n_layer, int) and held and n_layer > max(len(held), _MAX_UNBACKED_BUILD):
        # too many to build even on the meta device (a config class and the model do work per layer)
        raise HFDecoderError(f"{directory / 'config.json'}: num_hidden_layers = {n_layer:,}, but the weights hold "
                             f"{len(held)} layers: refused before building", reason="weights missing")
    # the model the config describes, on the meta device (no memory, no initialisation), compared with the headers
    # before anything is built for real: a vocabulary of 2²² over 1,024 rows of weights was built whole (2.4 GB)
    # and only then refused by transformers
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            built = AutoModelForCausalLM.from_config(hf_config)
    except Exception:  # noqa: BLE001 - transformers refusing the config is reported where the model is built
        return
    wanted = {name: tuple(t.shape) for name, t in built.state_dict().items()}
    for name, shape in wanted.items():
        header = shapes.get(name)
        # quantized checkpoints pack integers into other shapes; a floating tensor is stored as it is built
        if header is not None and header[1] != shape and header[0] in _FLOAT_DTYPES:
            raise HFDecoderError(f"{directory / 'config.json'}: the config builds {name} as {list(shape)}, but the "
                                 f"weights hold {list(header[1])}: refused before loading", reason="weights missing")
    if not isinstance(n_layer, int) or not held or n_layer <= len(held):
        return
    # the config claims more layers than the headers name: count the layers the config builds, named as the
    # weights are — a family whose layers sit in several lists (hrm_text's H and L stacks) is compared list for
    # list, not with num_hidden_layers
    expected = {int(m.group(1)) for key in wanted if (m := _LAYER_KEY.search(key))}
    if len(expected) > len(held):
        raise HFDecoderError(f"{directory / 'config.json'}: the config builds {len(expected)} layers "
                             f"(num_hidden_layers = {n_layer}), but the weights hold {len(held)} "
                             f"({min(held)} … {max(held)}): refused before loading (the rest would be random "
                             "numbers)", reason="weights missing")


_MAX_UNBACKED_BUILD = 1024  # layers a config may claim beyond the weights' and still be built on meta to count them
_FLOAT_DTYPES = {"F64", "F32", "F16", "BF16", "float64", "float32", "float16", "bfloat16"}


def weights_size(directory: str | os.PathLike, dtype: torch.dtype | str = "float32") -> tuple[int, int]:
    """``(parameters, bytes in dtype)`` of a directory's safetensors weights, read from their headers only:
    what loading will hold, stated before anything is loaded. (0, 0) when there are no safetensors files."""
    from safetensors import safe_open

    itemsize = torch.empty(0, dtype=getattr(torch, dtype) if isinstance(dtype, str) else dtype).element_size()
    count = 0
    for file in sorted(Path(directory).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open has keys(), not iteration)
                count += int(torch.Size(f.get_slice(key).get_shape()).numel())
    return count, count * itemsize


def _digest_files(directory: Path) -> list[Path]:
    """What the identity of a directory run by transformers hashes: its config and weight files, by name."""
    return [file for file in sorted(directory.iterdir())
            if (file.name == "config.json" or file.suffix in (".safetensors", ".bin")) and file.is_file()]


def is_hf_decoder_dir(directory: Path) -> bool:
    """Whether a directory's config.json names a transformers model type (any)."""
    try:
        raw = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError, RecursionError):
        return False
    return isinstance(raw, dict) and isinstance(raw.get("model_type"), str)


__all__ = ["GUARD_PROMPT", "MaxMemory", "guard_against_transformers", "is_hf_decoder_dir", "load_hf_decoder",
           "weights_size"]

