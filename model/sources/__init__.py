"""Where models come from, one module a source: a Hugging Face directory into our GPT (``_hf_ours.py``, with its
config mapping ``_hf_config.py`` and weight layout ``_hf_weights.py``), a decoder transformers runs
(``_hf_decoder.py``), a nanoGPT checkpoint (``_nanogpt.py``) and your own module (``_own_module.py``); beside
them, finding a model (``_resolve.py``), reading tokenizers (``_tokenizer.py``) and weight files
(``_safetensors.py``), and what every source shares (``_common.py``: the typed error, directory checks,
dtype/device). ``load_model`` (``_load.py``) resolves a spec once and hands it to exactly one source."""

from gpt_shape_tracer.model.sources._chat_render import (
    compile_chat_template,
    forget_rendered_chats,
    render_chat_template,
)
from gpt_shape_tracer.model.sources._common import (
    LOGIT_TOLERANCE,
    MODEL_FILE_SUFFIXES,
    ModelLoadError,
    check_link,
    logit_tolerance,
)
from gpt_shape_tracer.model.sources._decoders import Decoder, input_device_of
from gpt_shape_tracer.model.sources._dry_run import (
    MAX_DRY_LAYERS,
    MAX_DRY_RECORDS,
    NO_WEIGHTS,
    SHAPES_PREFIX,
    DryRunError,
    build_dry,
    dry_config,
    on_meta,
    parameters_by_dtype,
    shapes_available,
)
from gpt_shape_tracer.model.sources._hf_attention import ATTENTION, traced_attention
from gpt_shape_tracer.model.sources._hf_compressed import (
    COMPRESSED_FORWARD_RECORDS,
    COMPRESSED_HELD_RECORDS,
    CompressedCache,
    compressed_cache_bytes,
    uncompressed_cache_bytes,
)
from gpt_shape_tracer.model.sources._hf_config import SUPPORTED_MODEL_TYPES, config_from_hf, config_to_hf, read_config
from gpt_shape_tracer.model.sources._hf_decoder import HFDecoder
from gpt_shape_tracer.model.sources._hf_loading import MaxMemory, is_hf_decoder_dir, load_hf_decoder, weights_size
from gpt_shape_tracer.model.sources._hf_ours import load_hf_ours, save_hf, save_hf_gpt2
from gpt_shape_tracer.model.sources._hf_probe import Architecture
from gpt_shape_tracer.model.sources._hf_refusals import HFDecoderError
from gpt_shape_tracer.model.sources._hf_weights import check_weights, hf_shapes, hf_to_state, our_layout, state_to_hf
from gpt_shape_tracer.model.sources._load import (
    ASSETS,
    BUNDLED_DIR,
    BUNDLED_MODELS,
    IMPLEMENTATIONS,
    known_to_transformers,
    load_bundled,
    load_hf,
    load_hf_gpt2,
    load_model,
)
from gpt_shape_tracer.model.sources._meta_ops import MetaOpCache, meta_op_cache
from gpt_shape_tracer.model.sources._nanogpt import (
    CHECKPOINT_NAME,
    COMPILED_PREFIX,
    config_from_nanogpt,
    is_nanogpt_path,
    load_nanogpt,
    nanogpt_shapes,
    nanogpt_to_state,
)
from gpt_shape_tracer.model.sources._own_module import OwnDecoder, OwnModuleError, load_factory, traced_sdpa
from gpt_shape_tracer.model.sources._resolve import (
    REPO_PREFIX,
    hub_cache_dir,
    is_repo_folder,
    resolve_model_path,
    snapshot_of,
)
from gpt_shape_tracer.model.sources._safetensors import SafetensorsFile, safetensors_files
from gpt_shape_tracer.model.sources._tensor_parallel import ShardedModule, TensorParallelError, TensorParallelPlan
from gpt_shape_tracer.model.sources._tokenizer import END_OF_TEXT, TextTokenizer, TokenizerConfigError, load_tokenizer

__all__ = [
    "MAX_DRY_LAYERS", "MAX_DRY_RECORDS", "NO_WEIGHTS", "SHAPES_PREFIX", "DryRunError", "build_dry", "dry_config",
    "on_meta", "parameters_by_dtype", "shapes_available", "input_device_of",
    "ASSETS", "ATTENTION", "BUNDLED_DIR", "BUNDLED_MODELS", "CHECKPOINT_NAME", "COMPILED_PREFIX", "END_OF_TEXT",
    "IMPLEMENTATIONS", "LOGIT_TOLERANCE", "MODEL_FILE_SUFFIXES", "REPO_PREFIX", "SUPPORTED_MODEL_TYPES",
    "Architecture", "Decoder", "HFDecoder", "HFDecoderError", "MaxMemory", "ModelLoadError", "OwnDecoder",
    "OwnModuleError", "SafetensorsFile", "TextTokenizer", "TokenizerConfigError", "check_link", "check_weights",
    "config_from_hf", "config_from_nanogpt", "config_to_hf", "hf_shapes", "hf_to_state", "hub_cache_dir",
    "is_hf_decoder_dir", "is_nanogpt_path", "is_repo_folder", "known_to_transformers", "load_bundled",
    "load_factory", "load_hf", "load_hf_decoder", "load_hf_gpt2", "load_hf_ours", "load_model", "load_nanogpt",
    "load_tokenizer", "logit_tolerance", "nanogpt_shapes", "nanogpt_to_state", "our_layout", "read_config",
    "resolve_model_path", "safetensors_files", "save_hf", "save_hf_gpt2", "snapshot_of", "state_to_hf",
    "traced_attention", "traced_sdpa", "weights_size", "ShardedModule", "TensorParallelError", "TensorParallelPlan",
    "compile_chat_template", "forget_rendered_chats", "render_chat_template", "MetaOpCache", "meta_op_cache",
    "COMPRESSED_FORWARD_RECORDS", "COMPRESSED_HELD_RECORDS", "CompressedCache", "compressed_cache_bytes",
    "uncompressed_cache_bytes",
]
