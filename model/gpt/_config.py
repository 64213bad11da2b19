"""``GPTConfig``: what a model is, one frozen declaration with its checks — the sizes, the pieces (norm, positions,
MLP, biases, tying), and for the models we only describe (a transformers-run decoder, a user's own module) what
the views need to label them (latent, hybrid, indexed, shared K/V …). Shape legend: model/gpt/_gpt.py.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

FAMILIES = ("gpt2", "llama", "mistral", "qwen2")  # the families this file implements
HF_FAMILY = "hf"  # any other transformers decoder, run by transformers (model/sources/_hf_decoder.py): a description
MODULE_FAMILY = "module"  # a user's own module, run by its own code (model/sources/_own_module.py): a description
EXTERNAL_FAMILIES = (HF_FAMILY, MODULE_FAMILY)  # described by a GPTConfig, never built from one
NORMS = ("layernorm", "rmsnorm")
POSITIONS = ("learned", "rope")
MLPS = ("gelu", "swiglu")
ACTIVATIONS = ("gelu_tanh", "gelu")  # the GELU MLP's nonlinearity: GPT-2's tanh form, or exact (nanoGPT's nn.GELU())
ROPE_TYPES = ("linear", "llama3")  # the variants that only change inv_freq; "default" is rope_scaling=None
MAX_VOCAB = 2**24  # 16.7M ids: far above any real tokenizer, far below a size that cannot be allocated
MAX_POSITIONS = 2**24  # n_ctx, sliding_window
MAX_WIDTH = 2**18  # d_model, d_mlp, head_dim
MAX_LAYERS = 2**16  # large enough that an absurd n_layer is caught against the weights, with what they hold
MAX_HEADS = 2**14


@dataclass(frozen=True)
class RopeScaling:
    """A RoPE variant that rescales the inverse frequencies (Hugging Face ``rope_parameters``).

    ``linear``: every inv_freq divided by ``factor``. ``llama3``: wavelengths longer
    than ``original_max_position_embeddings / low_freq_factor`` are divided by
    ``factor``, shorter than ``… / high_freq_factor`` kept, and the band between
    interpolated smoothly (``model.gpt.rope_inv_freq``)."""

    rope_type: str  # "linear" | "llama3"
    factor: float
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only
    original_max_position_embeddings: int = 8192  # llama3 only: the context the frequencies were trained for

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"rope_scaling type {self.rope_type!r} is not implemented (only {', '.join(ROPE_TYPES)})")
        for name in ("factor", "low_freq_factor", "high_freq_factor"):
            _check_positive_float(f"rope_scaling.{name}", getattr(self, name))
        _check_positive_int("rope_scaling.original_max_position_embeddings", self.original_max_position_embeddings,
                            MAX_POSITIONS)
        if self.rope_type == "llama3" and not self.high_freq_factor > self.low_freq_factor:
            raise ValueError("rope_scaling: llama3 needs high_freq_factor > low_freq_factor "
                             f"(got {self.high_freq_factor} and {self.low_freq_factor})")


def _check_positive_int(name: str, value: object, maximum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"GPTConfig.{name} must be a positive integer, got {value!r}")
    if value > maximum:
        raise ValueError(f"GPTConfig.{name} = {value} is absurdly large (the limit is {maximum:,})")


def _check_positive_float(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"GPTConfig.{name} must be a finite number > 0, got {value!r}")


@dataclass(frozen=True)
class GPTConfig:
    """Hyper-parameters of one model (defaults: GPT-2 small, 124M).

    The architecture fields (``norm``, ``positions``, ``mlp``, biases, tying)
    choose the pieces; ``GPTConfig.for_family("llama", …)`` fills them in for a
    Llama-style family. ``family`` names the checkpoint family (and so the weight
    layout and the Hugging Face names it saves to)."""

    vocab_size: int = 50257  # V: how many token ids the embedding (and unembedding) knows
    n_ctx: int = 1024  # longest sequence, cache included (GPT-2: rows of the positional table)
    d_model: int = 768  # d: width of the residual stream and of every embedding
    n_layer: int = 12  # number of transformer blocks
    n_head: int = 12  # H: query heads per block
    d_mlp: int | None = None  # d_ff, the MLP hidden width; None means the usual 4·d_model
    layer_norm_eps: float = 1e-5  # ε in the norm's √(· + ε): LayerNorm for GPT-2 (1e-5), RMSNorm's rms_norm_eps
    family: str = "gpt2"  # "gpt2" | "llama" | "mistral" | "qwen2": the checkpoint family and weight layout
    n_kv_head: int | None = None  # G: key/value heads; None means G = H (MHA); 1 is MQA; must divide H
    head_dim: int | None = None  # d_head when a checkpoint sets it; None means d_model // n_head
    norm: str = "layernorm"  # "layernorm" (γ⊙(x−μ)/√(σ²+ε)+β) | "rmsnorm" (γ⊙x/√(mean(x²)+ε))
    positions: str = "learned"  # "learned" (a W_pos table added to the residual) | "rope" (q, k rotated)
    mlp: str = "gelu"  # "gelu": GELU(x·W_1+b_1)·W_2+b_2 | "swiglu": (SiLU(x·W_gate) ⊙ x·W_up)·W_down
    rope_theta: float = 10000.0  # RoPE base θ: pair i turns by position·θ^(−2i/d_head)
    rope_scaling: RopeScaling | None = None  # None is plain RoPE ("default"); else linear / llama3
    tie_embeddings: bool = True  # logits = x·W_Eᵀ (True) or x·W_U with its own W_U (Hugging Face's lm_head)
    qkv_bias: bool = True  # b_Q, b_K, b_V (GPT-2, Qwen2) or none (Llama, Mistral)
    attn_out_bias: bool = True  # b_O (GPT-2) or none
    mlp_bias: bool = True  # biases in the MLP (GPT-2) or none
    norm_bias: bool = True  # β in LayerNorm (GPT-2) or none (nanoGPT with bias=False); RMSNorm never has one
    activation: str = "gelu_tanh"  # the "gelu" MLP's GELU: "gelu_tanh" (GPT-2's gelu_new) | "gelu" (exact, erf)
    sliding_window: int | None = None  # a query sees at most this many key slots, itself included (Mistral)
    hf_model_type: str | None = None  # family "hf": transformers' model_type ("qwen3", …); "module": its class
    attn_scale: float | None = None  # the scores' scale; None is the usual 1/√d_head (Gemma, Granite set their own)
    attn_softcap: float | None = None  # family "hf": c in c·tanh(scores/c) before the mask (Gemma 2), else None
    v_head_dim: int | None = None  # family "hf": d_v where the values' head size differs from d_head (= d_qk)
    kv_latent_dim: int | None = None  # family "hf", latent attention: d_c, the compressed KV latent's width
    rope_key_dim: int | None = None  # family "hf", latent attention: d_R, the decoupled rotary key's width
    attn_sinks: bool = False  # family "hf": a learned sink logit per head joins every softmax row (gpt-oss)
    # family "hf", hybrid models: per layer "" where the layer computes softmax attention, else what mixes its
    # positions instead ("Gated DeltaNet", "Mamba2 Mixer", …, named from the module's class); None: every layer attends
    mixers: tuple[str, ...] | None = None
    state_layers: tuple[int, ...] = ()  # family "hf": layers whose mixer keeps a fixed-size state (not K, V rows)
    # family "hf", KV sharing (Gemma 3n, Gemma 4): (layer, source) for each layer that computes no K and V of its own
    # and attends over the K and V of layer ``source`` (its cache holds no rows)
    kv_shared: tuple[tuple[int, int], ...] = ()
    # family "hf", indexed (sparse) attention (DeepSeek-V3.2's DSA, GLM-5, Qwen4-Exp's QSA …): the layers whose queries
    # attend only to the keys a learned indexer chose (its own, or the layer before's: GLM-5 / HY-V4 "shared"), and
    # d_I, the width of the keys that indexer keeps in the cache beside K and V
    indexed_layers: tuple[int, ...] = ()
    indexer_key_dim: int | None = None
    # family "hf", attention in several lists of layers (BLT): per block, its layer's path in the model
    # ("local_encoder.layers.0", "global_transformer.layers.1" …; empty where every block is an element of one list),
    # and the blocks that are cross-attention (queries from one stream, keys and values from another)
    block_paths: tuple[str, ...] = ()
    cross_blocks: tuple[int, ...] = ()
    # family "hf": whether every block is a plain residual sum — the stream after attention (or a hybrid layer's
    # mixer) equal to the stream entering the block + hook_attn_out (hook_mixer_out), and the stream leaving it
    # equal to that + hook_mlp_out (a parallel block: x + both) — measured on the load's forward within float
    # rounding. False where some block mixes them its own way (MiniMax scales a *normed* x, Granite scales the
    # sublayer's output); None where nothing was measured (the meta device, a trace saved before). Our own GPT's
    # blocks are always plain sums, whatever this says (``residual_sums``).
    plain_residual: bool | None = None
    # family "hf", CPM-Ant: learned positions the model's forward puts before the text (ids past its vocabulary,
    # embedded as tokens are), in every forward: each record over positions holds them first, P + n rows for n tokens
    # (the logits only the n tokens'); 0 for every other model
    prompt_positions: int = 0
    # family "hf": the model's mask lets every position of a forward see every other (CPM-Ant), where a causal mask
    # lets query i see keys 0 … i only; read from the load's probe, so False on the meta device (a dry run), where
    # no mask has values
    bidirectional: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.rope_scaling, dict):  # from ModelIdentity.config / JSON
            try:
                object.__setattr__(self, "rope_scaling", RopeScaling(**self.rope_scaling))
            except TypeError as e:
                raise ValueError(f"GPTConfig.rope_scaling: {e}") from None
        _check_positive_int("vocab_size", self.vocab_size, MAX_VOCAB)
        _check_positive_int("n_ctx", self.n_ctx, MAX_POSITIONS)
        _check_positive_int("d_model", self.d_model, MAX_WIDTH)
        _check_positive_int("n_layer", self.n_layer, MAX_LAYERS)
        _check_positive_int("n_head", self.n_head, MAX_HEADS)
        if self.n_kv_head is not None:
            _check_positive_int("n_kv_head", self.n_kv_head, MAX_HEADS)
            if self.n_head % self.n_kv_head:
                raise ValueError(
                    f"head counts that do not divide: n_head = {self.n_head} query heads cannot share "
                    f"n_kv_head = {self.n_kv_head} key/value heads evenly (n_head must be a multiple of n_kv_head)"
                )
        if self.head_dim is not None:
            _check_positive_int("head_dim", self.head_dim, MAX_WIDTH)
        elif self.d_model % self.n_head:
            raise ValueError(
                f"d_model ({self.d_model}) must be divisible by n_head ({self.n_head}) "
                "so that every head gets d_head = d_model // n_head dimensions"
            )
        if self.d_mlp is not None:
            _check_positive_int("d_mlp", self.d_mlp, MAX_WIDTH)
        for name in ("v_head_dim", "kv_latent_dim", "rope_key_dim"):
            if getattr(self, name) is not None:
                _check_positive_int(name, getattr(self, name), MAX_WIDTH)
        _check_positive_float("layer_norm_eps", self.layer_norm_eps)
        _check_positive_float("rope_theta", self.rope_theta)
        for name, allowed in (("family", (*FAMILIES, *EXTERNAL_FAMILIES)), ("norm", NORMS), ("positions", POSITIONS),
                              ("mlp", MLPS), ("activation", ACTIVATIONS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"GPTConfig.{name} must be one of {', '.join(allowed)}; got {getattr(self, name)!r}")
        if self.plain_residual is not None and not isinstance(self.plain_residual, bool):
            raise ValueError(f"GPTConfig.plain_residual must be True, False or None, got {self.plain_residual!r}")
        if isinstance(self.prompt_positions, bool) or not isinstance(self.prompt_positions, int) or \
                not 0 <= self.prompt_positions <= MAX_POSITIONS:
            raise ValueError(f"GPTConfig.prompt_positions must be a whole number from 0 to {MAX_POSITIONS}, got "
                             f"{self.prompt_positions!r}")
        for name in ("tie_embeddings", "qkv_bias", "attn_out_bias", "mlp_bias", "norm_bias", "attn_sinks",
                     "bidirectional"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"GPTConfig.{name} must be True or False, got {getattr(self, name)!r}")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            raise ValueError(f"GPTConfig.rope_scaling must be a RopeScaling or None, got {self.rope_scaling!r}")
        if self.sliding_window is not None:
            _check_positive_int("sliding_window", self.sliding_window, MAX_POSITIONS)
        if self.positions == "rope" and self.d_head % 2:
            raise ValueError(f"RoPE rotates pairs of dimensions: d_head = {self.d_head} must be even")
        self._check_mixers()

    def _check_mixers(self) -> None:
        if isinstance(self.mixers, list):  # from ModelIdentity.config / JSON
            object.__setattr__(self, "mixers", tuple(self.mixers))
        if isinstance(self.state_layers, list):
            object.__setattr__(self, "state_layers", tuple(self.state_layers))
        if isinstance(self.indexed_layers, list):
            object.__setattr__(self, "indexed_layers", tuple(self.indexed_layers))
        if isinstance(self.kv_shared, list):
            object.__setattr__(self, "kv_shared", tuple(tuple(pair) for pair in self.kv_shared))
        mixers = self.mixers
        # every layer may be a mixer (a state-space model: Mamba), but then every one keeps state
        if mixers is not None and (len(mixers) != self.n_layer or not all(isinstance(m, str) for m in mixers)
                                   or (all(mixers) and set(self.state_layers) != set(range(self.n_layer)))):
            raise ValueError(f"GPTConfig.mixers must name one mixer per layer (n_layer = {self.n_layer}), \"\" for "
                             f"an attention layer (all named only where every layer keeps state); got {mixers!r}")
        for name in ("block_paths", "cross_blocks"):
            if isinstance(getattr(self, name), list):
                object.__setattr__(self, name, tuple(getattr(self, name)))
        if self.block_paths and (len(self.block_paths) != self.n_layer
                                 or not all(isinstance(p, str) and p for p in self.block_paths)):
            raise ValueError(f"GPTConfig.block_paths must name one layer path per block (n_layer = {self.n_layer}), "
                             f"got {self.block_paths!r}")
        for name in ("state_layers", "indexed_layers", "cross_blocks"):
            if not all(isinstance(L, int) and not isinstance(L, bool) and 0 <= L < self.n_layer
                       for L in getattr(self, name)):
                raise ValueError(f"GPTConfig.{name} must be layer numbers below {self.n_layer}, got "
                                 f"{getattr(self, name)!r}")
        pairs = self.kv_shared

        def layer_number(x: object) -> bool:
            return isinstance(x, int) and not isinstance(x, bool) and 0 <= x < self.n_layer

        well_formed = all(isinstance(pair, tuple) and len(pair) == 2 and all(map(layer_number, pair))
                          and pair[0] != pair[1] for pair in pairs)
        readers = [pair[0] for pair in pairs] if well_formed else []
        if not well_formed or len(set(readers)) != len(readers) or any(source in readers for _, source in pairs):
            raise ValueError(f"GPTConfig.kv_shared must be (layer, source) pairs of distinct layer numbers below "
                             f"{self.n_layer}, each layer once and no source itself a reader; got {pairs!r}")

    def has_attention(self, layer: int) -> bool:
        """Whether ``layer`` computes softmax attention (every layer but a hybrid model's state / convolution ones)."""
        return self.mixers is None or not self.mixers[layer]

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """The layers that compute softmax attention, in order."""
        return tuple(L for L in range(self.n_layer) if self.has_attention(L))

    def no_attention_sentence(self, layer: int) -> str | None:
        """What ``layer`` is when it has no softmax attention (None when it has): a hybrid model's state-space,
        convolution or linear-attention layer, whose state is overwritten each step instead of growing by a row per
        position. ("softmax": a linear attention, MiniMax's Lightning Attention or a Gated DeltaNet, attends too, but
        with no pattern over the keys.)"""
        if self.has_attention(layer):
            return None
        assert self.mixers is not None
        mixer = self.mixers[layer]
        if layer in self.state_layers:
            return (f"layer {layer} has no softmax attention: it is a {mixer} layer whose state does not grow with t "
                    "(a fixed-size state, overwritten at every step, instead of K and V rows)")
        return (f"layer {layer} has no softmax attention: it is a {mixer} layer, which keeps nothing from one step to "
                "the next")

    def stack_of(self, layer: int) -> str | None:
        """The list of layers block ``layer`` is an element of ("global_transformer.layers"), where the model's
        attention runs in several (BLT); None where every block is an element of one list."""
        return self.block_paths[layer].rpartition(".")[0] if self.block_paths else None

    def stack_sentence(self, layer: int) -> str | None:
        """Which list of layers block ``layer`` is in, and whether it is a cross-attention (None where every block is
        an element of one list)."""
        if not self.block_paths:
            return None
        path, stacks = self.block_paths[layer], sorted({p.rpartition(".")[0] for p in self.block_paths})
        where = (f"block {layer} is {path}: element {path.rpartition('.')[2]} of {path.rpartition('.')[0]}, one of "
                 f"the {len(stacks)} lists of layers this model's attention runs in")
        if layer in self.cross_blocks:
            return (where + ", a cross-attention: its queries come from one stream and its keys and values from "
                    "another, so query i and key i are not the same position")
        return where + ", a self-attention over that list's own stream"

    def kv_source(self, layer: int) -> int | None:
        """The layer whose K and V ``layer`` attends over when it computes none of its own (KV sharing: Gemma 3n's
        last layers read the cache of the last earlier layer of their kind), else None."""
        return dict(self.kv_shared).get(layer)

    def kv_shared_sentence(self, layer: int) -> str | None:
        """What a KV-sharing layer reads (None for a layer that computes its own K and V)."""
        source = self.kv_source(layer)
        if source is None:
            return None
        return (f"layer {layer} computes no K and V of its own: it attends over layer {source}'s (KV sharing), so its "
                "cache holds no rows; its queries are its own")

    @classmethod
    def for_family(cls, family: str, **fields) -> GPTConfig:
        """A config with ``family``'s architecture: ``for_family("llama", n_kv_head=2, …)``.

        Llama, Mistral and Qwen2 are RMSNorm + RoPE + SwiGLU without biases and
        with their own W_U; Qwen2 adds b_Q, b_K, b_V. Any field can be overridden."""
        arch: dict = {}
        if family != "gpt2":
            arch = dict(norm="rmsnorm", positions="rope", mlp="swiglu", tie_embeddings=False,
                        qkv_bias=family == "qwen2", attn_out_bias=False, mlp_bias=False, layer_norm_eps=1e-6)
        return cls(family=family, **{**arch, **fields})

    @property
    def n_kv_heads(self) -> int:
        """G, the number of key/value heads (= n_head unless the config shares them)."""
        return self.n_kv_head if self.n_kv_head is not None else self.n_head

    @property
    def d_head(self) -> int:
        return self.head_dim if self.head_dim is not None else self.d_model // self.n_head

    @property
    def d_v(self) -> int:
        """The values' head size: d_head unless the model's differs (latent attention)."""
        return self.v_head_dim if self.v_head_dim is not None else self.d_head

    @property
    def latent_attention(self) -> bool:
        """Whether the cache holds a compressed latent and a rotary key instead of K and V (DeepSeek-V2/V3)."""
        return self.kv_latent_dim is not None

    @property
    def cache_width(self) -> int:
        """Numbers one layer's KV cache holds per position of one sequence: G·(d_head + d_v) — 2·G·d_head for K
        and V of one width — or d_c + d_R, the latent and the rotary key, for latent attention."""
        if self.kv_latent_dim is not None:
            return self.kv_latent_dim + (self.rope_key_dim or 0)
        return self.n_kv_heads * (self.d_head + self.d_v)

    @property
    def d_ff(self) -> int:
        return self.d_mlp if self.d_mlp is not None else 4 * self.d_model

    @property
    def d_qkv(self) -> int:
        """Width of the combined projection X·W_QKV: (H + 2G)·d_head (3d for GPT-2)."""
        return (self.n_head + 2 * self.n_kv_heads) * self.d_head

    def to_dict(self) -> dict:
        """Plain JSON values (``GPTConfig(**config.to_dict())`` gives the config back): the per-layer tuples as
        lists, as a file written and read again holds them."""
        out = asdict(self)
        for name in ("mixers", "state_layers", "indexed_layers", "block_paths", "cross_blocks"):
            if isinstance(out[name], tuple):
                out[name] = list(out[name])
        out["kv_shared"] = [list(pair) for pair in out["kv_shared"]]
        return out
