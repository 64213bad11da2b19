"""Why a Hugging Face model is not traced: the categories (``RefusalReason``), the error that names one
(``HFDecoderError``), and what a config alone already says (``refusal_by_config``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:  # transformers is imported where it is used: loading our own models never needs it
    pass
RefusalReason = Literal[
    "encoder-decoder",  # a separate encoder feeds the decoder through cross-attention
    "encoder",  # bidirectional self-attention: position i sees positions after it
    "no softmax attention",  # state-space, recurrent or linear-attention layers only
    "attention outside the interface",  # attention in the family's own code that its ops do not show as one softmax
    # attention; one that does is traced (_hf_own_attention: XLNet's relative attention, Reformer's too)
    "state layers",  # state in a family's own cache class the trace cannot stand in for (MiniMax's is traced)
    "latent attention",  # value head size ≠ query/key head size (multi-head latent attention)
    "attention sinks",  # a learned sink logit in every softmax row
    "several attentions per layer",  # a layer calls attention more than once per forward (recurrent depth, …)
    "several stacks",  # attention in more than one list of layers not as one call per element of each, or lists
    # attending with different heads or widths (BLT, one call per element and equal heads, is traced: _hf_stacks.py)
    "alibi",  # a per-head linear bias added to the scores
    "score bias",  # another bias the attention function receives and adds to the scores (a learned position bias)
    "indexed attention",  # a learned indexer picks each query's keys and keeps its own key cache (DeepSeek DSA)
    "compressed attention",  # the family's own cache layers keep compressed keys/values (DeepSeek-V4)
    "differs from transformers",  # the guard: our cached step is not transformers' own forward
    "cannot load",  # transformers itself cannot build or run it from this directory
    "drafter",  # no layer computes keys or values: it attends over another model's (Gemma 4's MTP assistant)
    "weights missing",  # the config builds more layers than the weights hold
]
REFUSAL_REASONS: tuple[str, ...] = RefusalReason.__args__  # type: ignore[attr-defined]
REFUSED: dict[str, tuple[RefusalReason, str]] = {}  # by model_type, before anything runs (none at present)
# BERT-family types: transformers maps them to a causal LM (…ForCausalLM / LMHeadModel), which is causal only when
# the config says is_decoder = true; otherwise every position attends to every other
ENCODERS = ("bert", "roberta", "xlm-roberta", "xlm-roberta-xl", "camembert", "electra", "ernie", "data2vec-text",
            "bert-generation", "rembert", "roc_bert", "megatron-bert", "xmod", "big_bird", "roformer",
            "roberta-prelayernorm")


class HFDecoderError(ValueError):
    """A Hugging Face model that cannot be traced: the message says what, why and what would work;
    ``reason`` names the category (None for a problem with the request rather than with the model)."""

    def __init__(self, message: str, reason: RefusalReason | None = None) -> None:
        super().__init__(message)
        self.reason = reason



def refusal_by_config(config: Any, model_type: str) -> HFDecoderError | None:
    """What the config alone says cannot be traced (before anything is loaded)."""
    if model_type in REFUSED:
        reason, why = REFUSED[model_type]
        return HFDecoderError(f"model_type {model_type!r} is {why}", reason=reason)
    if getattr(config, "is_encoder_decoder", False):
        return HFDecoderError(f"{model_type} is an encoder-decoder (its decoder reads a separate encoder through "
                              "cross-attention); only decoder-only causal LMs are traced", reason="encoder-decoder")
    # add_cross_attention alone refuses nothing: a causal LM built with it (ProphetNetForCausalLM, a BERT decoder)
    # cross-attends only when handed an encoder's output, which a causal LM's forward is never given; the probe then
    # sees what its layers really call (ProphetNet: attention in its own n-gram code, refused for that)
    if model_type in ENCODERS and not getattr(config, "is_decoder", False):
        return HFDecoderError(f"{model_type} is configured as an encoder (is_decoder = false): every position "
                              "attends to every other; configured with is_decoder = true it is a causal decoder",
                              reason="encoder")
    if getattr(config, "causal", None) is False:  # XLM's masked LM; XLMConfig(causal=True) is its causal LM
        return HFDecoderError(f"{model_type} is configured as a masked LM (causal = false): every position attends to "
                              "every other; configured with causal = true it is a causal decoder", reason="encoder")
    if getattr(config, "alibi", False):
        return HFDecoderError(f"{model_type} adds ALiBi position biases to the attention scores, which the traced "
                              "attention does not model", reason="alibi")
    drafter = _drafter_layers(config)
    if drafter:
        return HFDecoderError(
            f"{model_type} is a draft model for another model's speculative decoding (multi-token prediction): none of "
            f"its {drafter} layers computes keys or values — each attends over the keys and values the main model "
            "hands it (shared_kv_states), and its input is the main model's hidden state beside a token's embedding — "
            "so transformers runs it only as the assistant of that model's generate(), never on token ids alone; "
            "load the model it drafts for, whose own layers compute those keys and values", reason="drafter")
    _, own = _special_cache_layers(config)  # indexed layers are traced: their indexer keys live in KVCache
    if own:
        return HFDecoderError(
            f"{model_type}: its layers keep a cache of the family's own kind ({', '.join(own[:4])}: compressed keys "
            "and values), not the K and V per position the traced KV cache keeps", reason="compressed attention")
    return None


def _drafter_layers(config: Any) -> int:
    """The number of layers of a model whose every layer reads the keys and values another model computed (its
    config's ``num_kv_shared_layers`` covering all of them: Gemma 4's assistant); 0 for any other model."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    layers, shared = getattr(text, "num_hidden_layers", None), getattr(text, "num_kv_shared_layers", None)
    ok = all(isinstance(v, int) and not isinstance(v, bool) for v in (layers, shared))
    return int(layers) if ok and layers and shared >= layers else 0


def _special_cache_layers(config: Any) -> tuple[list[int], list[str]]:
    """From the ``DynamicCache`` transformers builds for the config: the layers whose cache holds an indexer's key
    cache (DeepSeek-V3.2's sparse attention, GLM-5, ...), and the names of cache layer classes a family defines
    for itself other than state-space / linear-attention state and DeepSeek-V4's compressed K/V (traced)."""
    from gpt_shape_tracer.model.sources._hf_compressed import compresses

    try:
        from transformers.cache_utils import DynamicCache, DynamicIndexedLayer, LinearAttentionCacheLayerMixin

        layers = DynamicCache(config=config).layers
    except Exception:  # noqa: BLE001 (a config whose cache transformers cannot describe: none known)
        return [], []
    indexed = [i for i, layer in enumerate(layers) if isinstance(layer, DynamicIndexedLayer)]
    # compressed K/V as DeepSeek-V4's layers keep it is traced (model/sources/_hf_compressed.py keeps those layers)
    own = sorted({type(layer).__name__ for layer in layers if type(layer).__module__ != "transformers.cache_utils"
                  and not isinstance(layer, LinearAttentionCacheLayerMixin) and not compresses(layer)})
    return indexed, own

