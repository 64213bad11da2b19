"""One readable GPT, several families: GPT-2 and Llama-style (Llama, Mistral, Qwen2) decoders.

Every intermediate passes through a named hook point. Read bottom-up, as in nanoGPT:
config (``GPTConfig``, model/gpt/_config.py) → hook point (``HookPoint``, model/gpt/_hook_point.py) →
projections → LayerNorm / RMSNorm → rotary position embedding → ``attention`` (Vaswani et al. 2017's formula,
also used on its own by tests and the app; grouped-query aware) → multi-head attention → GELU MLP / SwiGLU MLP →
block → GPT. The config says which pieces a model uses (``norm``, ``positions``, ``mlp``, ``n_kv_head``, biases,
tying); there is one ``GPT`` class for all.

Shape legend, used in every comment below and everywhere in the project:

    B  batch size                     H       query heads (attention heads)
    n  new positions in this forward  G       key/value heads; G = H for GPT-2 (MHA), 1 is MQA
    t  key positions incl. the cache  d_head  width of one head (d // H unless the config sets head_dim)
    d  d_model, width of the residual V       vocabulary size
       stream                         d_ff    MLP hidden width (4d for GPT-2: "4d" in its hook table)

Latent attention (DeepSeek-V2/V3, run by transformers) adds: d_qk and d_v, the query/key and the value head
sizes where they differ (d_head is then d_qk), d_c the width of the compressed KV latent c_KV and d_R that of
the decoupled rotary key k_R, which are what its cache holds.

The math is written with row vectors, as GPT-2's code is: matrices
multiply on the right (``X·W``), the combined ``W_QKV`` is ``[d, (H+2G)·d_head]``
(``[d, 3d]`` for GPT-2), and heads are laid out ``[B, H, n, d_head]``
(TransformerLens uses ``[B, n, H, d_head]``; see model/README.md for the hook
table and that difference). Every projection stores ``W`` as ``[d_in, d_out]``,
the row-vector ``X·W`` (GPT-2's ``Conv1D`` layout; Llama-family ``nn.Linear``
weights are transposed once at load): a one-row decode step runs faster that
way on CPU (see ``Projection``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple, Protocol, cast

import torch
import torch.nn.functional as F
from torch import nn

from gpt_shape_tracer.model.gpt._cache import KVCache, transaction
from gpt_shape_tracer.model.gpt._config import EXTERNAL_FAMILIES, GPTConfig
from gpt_shape_tracer.model.gpt._hook_point import HookPoint, TappedModule, listened_each, tell_each
from gpt_shape_tracer.model.gpt._identity import ModelIdentity, PendingIdentity, computed_identity
from gpt_shape_tracer.model.gpt._long_attention import MaskSpec, choose_path, fused_attention


def init_normal(weight: torch.Tensor, std: float) -> None:
    """Draw ``weight`` from N(0, std²) in place — except on the meta device, where a loader builds the model only to
    assign the checkpoint's weights: there is nothing to draw, and PyTorch runs a meta tensor's ``normal_`` through
    its Python reference implementation, whose first call imports ``torch._dynamo`` (about 1 s of a bundled model's
    first load, and some 100,000 objects more for the garbage collector to walk)."""
    if not weight.is_meta:
        nn.init.normal_(weight, std=std)


class Embedding(TappedModule, nn.Embedding):
    """``nn.Embedding``, read by a tracer through taps (``TappedModule``)."""


class GELU(TappedModule, nn.GELU):
    """``nn.GELU``, read by a tracer through taps (``TappedModule``)."""


def embedding(rows: int, width: int, std: float) -> nn.Embedding:
    """An ``nn.Embedding`` drawn from N(0, std²) (``init_normal``: nothing drawn on the meta device)."""
    table = Embedding(rows, width, _weight=torch.empty(rows, width))  # _weight: torch's own N(0, 1) not drawn
    init_normal(table.weight, std)
    return table


class Projection(TappedModule):
    """``y = x·W + b`` with ``W`` stored ``[d_in, d_out]``, for every family.

    That is the row-vector convention above and the layout of Hugging Face
    GPT-2's ``Conv1D``. Llama-family checkpoints store ``nn.Linear`` weights
    transposed, ``[d_out, d_in]``; the loader transposes them once. The reason
    is speed: for a decode step (one row x) ``x·W`` with W ``[d_in, d_out]``
    ran about 1.8× faster than ``F.linear`` with ``[d_out, d_in]`` on an Intel
    Xeon (d = 576 → 3072), and 1.0× at GPT-2 small's sizes but 1.12–1.49× at a
    1.1B model's on an AMD EPYC (no gain at 128 rows); a decode step is almost
    all such products. The price is one transposing copy at load
    (docs/benchmarks.md, loading a 1.1B model)."""

    def __init__(self, d_in: int, d_out: int, bias: bool = True) -> None:
        super().__init__()
        self.d_in, self.d_out = d_in, d_out
        self.weight = nn.Parameter(torch.empty(d_in, d_out))
        self.bias = nn.Parameter(torch.zeros(d_out)) if bias else None
        init_normal(self.weight, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out_shape = x.shape[:-1] + (self.d_out,)
        flat = x.reshape(-1, self.d_in)  # [..., d_in] -> [B·n, d_in]
        if self.bias is None:
            return torch.mm(flat, self.weight).view(out_shape)  # -> [..., d_out]
        return torch.addmm(self.bias, flat, self.weight).view(out_shape)  # -> [..., d_out]

    def extra_repr(self) -> str:
        return f"W: [{self.d_in}, {self.d_out}]" + ("" if self.bias is not None else ", no bias")


class LayerNorm(TappedModule):
    """LayerNorm(x) = γ ⊙ (x − μ) / √(σ² + ε) + β over the last dimension (Ba et al. 2016, arXiv:1607.06450).

    ``bias=False`` drops β (nanoGPT's ``bias=False`` models): ``self.bias`` is then None."""

    def __init__(self, d: int, eps: float, bias: bool = True) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))  # γ
        self.bias = nn.Parameter(torch.zeros(d)) if bias else None  # β
        self.hook_normalized = HookPoint()  # [B, n, d]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.hook_normalized(F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps))

    def linearized(self, x: torch.Tensor) -> tuple[Callable[[torch.Tensor], torch.Tensor], torch.Tensor | None]:
        """LN with its scale frozen at ``x``'s: (a linear map c ↦ γ⊙(c − mean c)/σ(x), the constant β or None).
        Summed over the parts of x, the map plus the constant is LN(x) exactly — how a component of the
        residual stream adds to the logits (direct logit attribution)."""
        sigma = torch.sqrt(x.var(dim=-1, unbiased=False, keepdim=True) + self.eps)
        return (lambda c: self.weight * (c - c.mean(dim=-1, keepdim=True)) / sigma), self.bias


class RMSNorm(TappedModule):
    """RMSNorm(x) = γ ⊙ x / √(mean(x²) + ε) (Zhang & Sennrich 2019, arXiv:1910.07467): LayerNorm without the mean and β.

    The order of operations is Hugging Face's ``LlamaRMSNorm``, so a bf16 model
    rounds where theirs does: upcast to float32, mean of squares, rsqrt(var + ε),
    multiply, cast back to the input dtype, and only then multiply by γ."""

    def __init__(self, d: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))  # γ
        self.hook_normalized = HookPoint()  # [B, n, d]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.to(torch.float32)
        variance = h.pow(2).mean(-1, keepdim=True)  # [B,n,1]: mean(x²)
        h = h * torch.rsqrt(variance + self.eps)
        return self.hook_normalized(self.weight * h.to(dtype))

    def linearized(self, x: torch.Tensor) -> tuple[Callable[[torch.Tensor], torch.Tensor], torch.Tensor | None]:
        """RMSNorm with its scale frozen at ``x``'s: (c ↦ γ⊙c/rms(x), no constant); see ``LayerNorm.linearized``."""
        rms = torch.sqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps).to(x.dtype)
        return (lambda c: self.weight * c / rms), None


def norm(config: GPTConfig) -> LayerNorm | RMSNorm:
    if config.norm == "rmsnorm":
        return RMSNorm(config.d_model, config.layer_norm_eps)
    return LayerNorm(config.d_model, config.layer_norm_eps, bias=config.norm_bias)


# ---- rotary position embedding (RoFormer, Su et al. 2021, arXiv:2104.09864) -----------------------------------


def rope_inv_freq(config: GPTConfig) -> torch.Tensor:
    """``[d_head/2]`` float32: θ^(−2i/d_head) for i = 0 … d_head/2 − 1, rescaled by ``config.rope_scaling``.

    Computed exactly as Hugging Face's ``modeling_rope_utils`` does (same dtype,
    same order), so our angles are bit-for-bit theirs."""
    dim = config.d_head
    # on the host, as transformers computes its buffer (a GPU's pow could round differently); callers move it
    steps = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").to(torch.float32)
    inv_freq = 1.0 / (config.rope_theta ** (steps / dim))
    s = config.rope_scaling
    if s is None:
        return inv_freq
    if s.rope_type == "linear":
        return inv_freq / s.factor
    # llama3: long wavelengths (beyond the original context / low_freq_factor) are slowed down by `factor`,
    # short ones (below … / high_freq_factor) kept, and the band in between interpolated
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = ((s.original_max_position_embeddings / wavelen - s.low_freq_factor)
              / (s.high_freq_factor - s.low_freq_factor))
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_cos_sin(config: GPTConfig, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of every position's angles, each ``[B|1, n, d_head]`` float32, for ``positions`` ``[B|1, n]``.

    Angle i of position p is p·inv_freq[i]; the halves convention (below) uses
    angle i for dimensions i and i + d_head/2, so the d_head/2 angles are written twice."""
    inv_freq = rope_inv_freq(config).to(positions.device)
    angles = positions[..., None].to(torch.float32) * inv_freq  # [B|1,n,1] * [d_head/2] -> [B|1,n,d_head/2]
    doubled = torch.cat((angles, angles), dim=-1)  # [B|1,n,d_head]
    return doubled.cos(), doubled.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x₁, x₂) → (−x₂, x₁) for the two halves of the last dimension."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[B, heads, n, d_head]`` by its positions' angles (``cos``, ``sin`` from ``rope_cos_sin``).

    RoFormer's paper rotates *consecutive* pairs (x₀, x₁), (x₂, x₃), …; the
    Llama/Mistral/Qwen2 checkpoints instead pair dimension i with i + d_head/2
    (Hugging Face's ``rotate_half``): ``x·cos + rotate_half(x)·sin`` turns each
    pair (x_i, x_{i+d_head/2}) by angle p·θ^(−2i/d_head). The two conventions are
    the same rotation up to a fixed permutation of the dimensions, which the
    weights of W_Q and W_K absorb — so a checkpoint only works with the
    convention it was trained with, and these checkpoints use the halves."""
    cos = cos.unsqueeze(1).to(x.dtype)  # [B|1,n,d_head] -> [B|1,1,n,d_head], broadcast over heads
    sin = sin.unsqueeze(1).to(x.dtype)
    return x * cos + rotate_half(x) * sin


# ---- attention -------------------------------------------------------------------------------------------------


class AttentionHooks(Protocol):
    """What ``attention(hooks=…)`` calls: five hook points, each a tensor → tensor function (an attention
    module, or any stand-in that has them)."""

    @property
    def hook_qk(self) -> Callable[[torch.Tensor], torch.Tensor]: ...

    @property
    def hook_attn_scores(self) -> Callable[[torch.Tensor], torch.Tensor]: ...

    @property
    def hook_mask(self) -> Callable[[torch.Tensor], torch.Tensor]: ...

    @property
    def hook_masked_scores(self) -> Callable[[torch.Tensor], torch.Tensor]: ...

    @property
    def hook_pattern(self) -> Callable[[torch.Tensor], torch.Tensor]: ...


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    hooks: AttentionHooks | None = None,
    *,
    scale: float | None = None,
    softcap: float | None = None,
    dropout_p: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scaled dot-product attention, ``softmax(QKᵀ/√d_k + M)·V``, step by step.

    ``q``: ``[..., H, n, d_k]``, ``k``: ``[..., G, t, d_k]``, ``v``: ``[..., G, t, d_v]``
    with G dividing H (GQA, Ainslie et al. 2023, arXiv:2305.13245: G = H is multi-head
    attention, 1 is multi-query, in between grouped-query): each of the G key/value heads serves
    H/G query heads, query head h reading key/value head h // (H/G) — Hugging
    Face's ``repeat_kv`` order — without copying K or V: the queries are viewed
    as ``[..., G, (H/G)·n, d_k]`` and multiplied with each group's Kᵀ. ``mask``
    is additive (0 where allowed, −∞ where not) and broadcasts to ``[..., H, n, t]``.
    Returns ``(output [..., H, n, d_v], weights [..., H, n, t])``.

    The causal form is also written ``softmax((QKᵀ + M)/√d_k)``; with
    M ∈ {0, −∞} that is the same matrix, and scaling first keeps the stages
    the app shows (QKᵀ, ÷√d_k, + M, softmax) each a real tensor. In bf16/fp16
    the softmax runs in float32 and is cast back, as Hugging Face's eager path does.

    ``hooks``, when given, is a module with the hook points ``hook_qk``,
    ``hook_attn_scores``, ``hook_mask``, ``hook_masked_scores`` and
    ``hook_pattern`` (and ``hook_softcapped`` where there is a soft-cap); the
    model passes its attention module here so that this one function is what
    the model, the tests and the models we only observe (model/sources/_hf_decoder.py,
    model/sources/_own_module.py) run.

    For those: ``scale`` replaces 1/√d_k (a model's own, multiplied as
    transformers does), ``softcap`` c applies c·tanh(scores/c) before the mask
    (Gemma 2), ``dropout_p`` drops weights after the softmax (SDPA's contract).
    """
    d_k = q.size(-1)
    grouped = q.dim() >= 3 and k.dim() >= 3 and k.size(-3) != q.size(-3)
    if grouped:
        H, G, n, t = q.size(-3), k.size(-3), q.size(-2), k.size(-2)
        if H % G:
            raise ValueError(f"{H} query heads cannot share {G} key/value heads: G must divide H")
        lead = q.shape[:-3]
        q_grouped = q.reshape(*lead, G, (H // G) * n, d_k)  # [B,H,n,d_head] -> [B,G,(H/G)·n,d_head]
        qk = (q_grouped @ k.transpose(-2, -1)).view(*lead, H, n, t)  # @ [B,G,d_head,t] -> [B,G,(H/G)·n,t] -> [B,H,n,t]
    else:
        qk = q @ k.transpose(-2, -1)  # [B,H,n,d_head] @ [B,H,d_head,t] -> [B,H,n,t]
    if hooks is not None:
        qk = hooks.hook_qk(qk)
    scores = qk / math.sqrt(d_k) if scale is None else qk * scale  # [B,H,n,t]
    if hooks is not None:
        scores = hooks.hook_attn_scores(scores)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap  # every score inside (−c, c)
        if hooks is not None and hasattr(hooks, "hook_softcapped"):
            scores = hooks.hook_softcapped(scores)
    if mask is not None:
        if hooks is not None:
            mask = hooks.hook_mask(mask)
        scores = scores + mask  # [B,H,n,t] + [B|1,1,n,t] -> [B,H,n,t]
        if hooks is not None:
            scores = hooks.hook_masked_scores(scores)
    if scores.dtype in (torch.float16, torch.bfloat16):
        weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(scores.dtype)
    else:
        weights = torch.softmax(scores, dim=-1)  # rows sum to 1 over the t keys
    if dropout_p > 0.0:
        weights = F.dropout(weights, p=dropout_p)
    if hooks is not None:
        weights = hooks.hook_pattern(weights)
    if grouped:
        w_grouped = weights.reshape(*lead, G, (H // G) * n, t)  # [B,H,n,t] -> [B,G,(H/G)·n,t] (a view)
        out = w_grouped @ v  # [B,G,(H/G)·n,t] @ [B,G,t,d_head] -> [B,G,(H/G)·n,d_head]
        out = out.view(*lead, H, n, v.size(-1))  # -> [B,H,n,d_head]
        return out, weights
    return weights @ v, weights  # [B,H,n,t] @ [B,H,t,d_head] -> [B,H,n,d_head]


class DerivedAttention(NamedTuple):
    """What a fused attention tells an ``[B,H,n,t]`` hook point instead of a tensor: the record's stage, shape
    and dtype, and the mask description; its values are recomputed from the layer's Q and K records
    (``model.gpt.region``). A named tuple, not a frozen dataclass: a traced decode step makes one per stage and
    layer (72 in GPT-2 small), and a frozen dataclass's ``__init__`` cost 0.66 µs against 0.26 µs."""

    stage: str  # "qk" | "scores" | "softcapped" | "mask" | "masked_scores" | "pattern"
    shape: tuple[int, ...]
    dtype: torch.dtype
    spec: MaskSpec
    device: str = "cpu"  # Q's device: "meta" in a dry run, whose records say they have no values


@dataclass(frozen=True)
class PathNote:
    """Told to ``hook_pattern`` when a layer that the settings would run fused runs eager because a forward hook
    may write one of its n × t hook points: a tracer notes it on the pattern record."""

    text: str


def attention_points(hooks: nn.Module) -> list[tuple[str, HookPoint]]:
    """The ``[B,H,n,t]`` hook points of an attention module (the mask's ``[B|1,1,n,t]`` too), by stage. Found once per
    module and kept on it: a module's hook points are made with it, and a traced decode step asks every layer."""
    found = hooks.__dict__.get("_attention_points")
    if found is None:
        names = (("qk", "hook_qk"), ("scores", "hook_attn_scores"), ("softcapped", "hook_softcapped"),
                 ("mask", "hook_mask"), ("masked_scores", "hook_masked_scores"), ("pattern", "hook_pattern"))
        found = [(stage, point) for stage, name in names if isinstance(point := getattr(hooks, name, None), HookPoint)]
        hooks.__dict__["_attention_points"] = found
    return found


def run_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: MaskSpec,
                  hooks: nn.Module | None) -> torch.Tensor:
    """A layer's attention ``[B,H,n,d_v]``: eager through the hook points (``attention``) or fused
    (``model.gpt.fused_attention``), as ``choose_path`` decides from the settings, whether a forward
    hook may write an n × t hook point, and the size of ``[B,H,n,t]``. Fused, each n × t hook point is told a
    ``DerivedAttention`` instead of a tensor."""
    B, H, n, _ = q.shape
    points = attention_points(hooks) if hooks is not None else []
    written = [name for name, p in points if p.written]
    heard = listened_each([p for _, p in points])  # asked once, a tracer's taps once for all the points
    path = choose_path(bool(written), B * H * n * spec.t, any(heard))
    if path == "eager":
        mask = spec.full_additive(q.dtype, q.device)
        z, _ = attention(q, k, v, mask, cast(AttentionHooks | None, hooks), scale=spec.scale, softcap=spec.softcap)
        if written and choose_path(False, B * H * n * spec.t) == "fused":
            for stage, point in points:
                if stage == "pattern" and point.listened:
                    point.tell(PathNote(f"this layer ran eager, not fused: a hook may write its {', '.join(written)} "
                                        f"(an intervention on the {'/'.join(written)} needs the whole n × t tensor)"))
        return z
    z = fused_attention(q, k, v, spec)
    if any(heard):
        full, device = (B, H, n, spec.t), q.device.type  # as every record names its device: "cpu", "cuda", "meta"
        mask_shape, dtype, new = (spec.batch, 1, n, spec.t), q.dtype, tuple.__new__  # a named tuple's own __new__
        # is a Python function: tuple's, called directly, builds the same object without a Python call a stage
        tell_each([(point, new(DerivedAttention, (stage, mask_shape if stage == "mask" else full, dtype, spec, device)))
                   for (stage, point), listened in zip(points, heard) if listened])
    return z


class MultiHeadAttention(TappedModule):
    """X·W_QKV → split → view [B,n,H|G,d_head] → transpose [B,H|G,n,d_head] → (RoPE) →
    attention → merge heads [B,n,H·d_head] → ·W_O.

    ``c_attn`` is W_QKV ``[d, (H+2G)·d_head]``: W_Q, W_K, W_V side by side (for a
    Llama checkpoint, q_proj, k_proj and v_proj transposed and concatenated at load), so one
    matmul makes all three. ``c_proj`` is W_O ``[H·d_head, d]``."""

    def __init__(self, config: GPTConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.n_head, self.n_kv_head, self.d_head = config.n_head, config.n_kv_heads, config.d_head
        H, G, dh = self.n_head, self.n_kv_head, self.d_head
        self.c_attn = Projection(config.d_model, (H + 2 * G) * dh, config.qkv_bias)  # W_QKV
        self.c_proj = Projection(H * dh, config.d_model, config.attn_out_bias)  # W_O: [H·d_head, d]
        self.hook_qkv = HookPoint()  # [B, n, (H+2G)·d_head]
        self.hook_q = HookPoint()  # [B, H, n, d_head]
        self.hook_k = HookPoint()  # [B, G, n, d_head], new positions only
        self.hook_v = HookPoint()  # [B, G, n, d_head], new positions only
        if config.positions == "rope":
            self.hook_rot_q = HookPoint()  # [B, H, n, d_head], Q after the rotation
            self.hook_rot_k = HookPoint()  # [B, G, n, d_head], K after the rotation (what the cache keeps)
        self.hook_k_all = HookPoint()  # [B, G, t, d_head], cache + new
        self.hook_v_all = HookPoint()  # [B, G, t, d_head], cache + new
        self.hook_qk = HookPoint()  # [B, H, n, t], QKᵀ
        self.hook_attn_scores = HookPoint()  # [B, H, n, t], QKᵀ/√d_k
        self.hook_mask = HookPoint()  # [B|1, 1, n, t], additive 0 / −∞
        self.hook_masked_scores = HookPoint()  # [B, H, n, t], QKᵀ/√d_k + M
        self.hook_pattern = HookPoint()  # [B, H, n, t], softmax: the attention weights A
        self.hook_z = HookPoint()  # [B, H, n, d_head], A·V per head
        self.hook_merged = HookPoint()  # [B, n, H·d_head], heads concatenated, before W_O

    def forward(
        self,
        x: torch.Tensor,
        mask: MaskSpec,
        cache: KVCache | None,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        B, n, _ = x.shape
        H, G, dh = self.n_head, self.n_kv_head, self.d_head
        qkv = self.hook_qkv(self.c_attn(x))  # [B,n,d] @ [d,(H+2G)·d_head] -> [B,n,(H+2G)·d_head]
        q, k, v = qkv.split((H * dh, G * dh, G * dh), dim=2)  # [B,n,H·d_head], 2 × [B,n,G·d_head]
        q = self.hook_q(q.view(B, n, H, dh).transpose(1, 2))  # -> [B,n,H,d_head] -> [B,H,n,d_head]
        k = self.hook_k(k.view(B, n, G, dh).transpose(1, 2))  # -> [B,n,G,d_head] -> [B,G,n,d_head]
        v = self.hook_v(v.view(B, n, G, dh).transpose(1, 2))  # [B,G,n,d_head]
        if rope is not None:
            cos, sin = rope
            q = self.hook_rot_q(apply_rope(q, cos, sin))  # [B,H,n,d_head]
            k = self.hook_rot_k(apply_rope(k, cos, sin))  # [B,G,n,d_head]: cached rotated, as Hugging Face does
        if cache is not None:
            k, v = cache.append(self.layer, k, v)  # [B,G,t−n,d_head] ++ [B,G,n,d_head] -> [B,G,t,d_head]
        k = self.hook_k_all(k)
        v = self.hook_v_all(v)
        z = run_attention(q, k, v, mask, self)  # [B,H,n,d_head], eager or fused (run_attention)
        z = self.hook_z(z)
        z = z.transpose(1, 2).contiguous()  # [B,H,n,d_head] -> [B,n,H,d_head]
        merged = self.hook_merged(z.view(B, n, H * dh))  # [B,n,H,d_head] -> [B,n,H·d_head]: heads side by side
        return self.c_proj(merged)  # [B,n,H·d_head] @ [H·d_head,d] -> [B,n,d]

    def head_outputs(self, z: torch.Tensor) -> torch.Tensor:
        """Each head's share of the attention output, O_h·W_O^h ``[B,H,n,d]`` (W_O's bias left out): their
        sum over heads plus the bias is what ``forward`` returns."""
        H, dh = self.n_head, self.d_head
        w_o = self.c_proj.weight.reshape(H, dh, -1)  # W_O [H·d_head, d] -> [H, d_head, d]: the rows each head owns
        return torch.einsum("bhnk,hkd->bhnd", z, w_o)  # [B,H,n,d_head] @ [H,d_head,d] -> [B,H,n,d]


class MLP(TappedModule):
    """FFN(x) = GELU(x·W_1 + b_1)·W_2 + b_2 (Vaswani et al. 2017, eq. 2, with GPT-2's GELU for the ReLU).

    GELU in GPT-2's tanh form by default; ``config.activation = "gelu"`` is the exact (erf) form
    nanoGPT trains with — the two differ by up to ~1e-3 per unit, enough to move logits visibly."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = Projection(config.d_model, config.d_ff, config.mlp_bias)  # W_1: [d, 4d]
        self.act = GELU(approximate="tanh" if config.activation == "gelu_tanh" else "none")
        self.c_proj = Projection(config.d_ff, config.d_model, config.mlp_bias)  # W_2: [4d, d]
        self.hook_pre = HookPoint()  # [B, n, 4d], before GELU
        self.hook_post = HookPoint()  # [B, n, 4d], after GELU

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pre = self.hook_pre(self.c_fc(x))  # [B,n,d] -> [B,n,4d]
        post = self.hook_post(self.act(pre))
        return self.c_proj(post)  # [B,n,4d] -> [B,n,d]


class GatedMLP(TappedModule):
    """SwiGLU: FFN(x) = (SiLU(x·W_gate) ⊙ (x·W_up))·W_down (Llama, Mistral, Qwen2).

    ``c_fc`` holds W_gate and W_up side by side, ``[d, 2·d_ff]`` (gate_proj and
    up_proj concatenated at load), so one matmul makes both; ``c_proj`` is W_down."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.d_ff = config.d_ff
        self.c_fc = Projection(config.d_model, 2 * config.d_ff, config.mlp_bias)  # [W_gate | W_up]
        self.c_proj = Projection(config.d_ff, config.d_model, config.mlp_bias)  # W_down: [d_ff, d]
        self.hook_pre = HookPoint()  # [B, n, d_ff], x·W_gate (TransformerLens's name)
        self.hook_pre_linear = HookPoint()  # [B, n, d_ff], x·W_up
        self.hook_post = HookPoint()  # [B, n, d_ff], SiLU(x·W_gate) ⊙ x·W_up

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.c_fc(x).split(self.d_ff, dim=-1)  # [B,n,d] -> [B,n,2·d_ff] -> 2 × [B,n,d_ff]
        gate = self.hook_pre(gate)
        up = self.hook_pre_linear(up)
        post = self.hook_post(F.silu(gate) * up)  # [B,n,d_ff]
        return self.c_proj(post)  # [B,n,d_ff] -> [B,n,d]


class Block(TappedModule):
    """Pre-norm block (GPT-2's, Radford et al. 2019): x + Attn(norm(x)), then + FFN(norm(·))."""

    def __init__(self, config: GPTConfig, layer: int) -> None:
        super().__init__()
        self.ln1 = norm(config)
        self.attn = MultiHeadAttention(config, layer)
        self.ln2 = norm(config)
        self.mlp = GatedMLP(config) if config.mlp == "swiglu" else MLP(config)
        self.hook_resid_pre = HookPoint()  # [B, n, d]
        self.hook_attn_out = HookPoint()  # [B, n, d]
        self.hook_resid_mid = HookPoint()  # [B, n, d]
        self.hook_mlp_out = HookPoint()  # [B, n, d]
        self.hook_resid_post = HookPoint()  # [B, n, d]

    def forward(
        self,
        x: torch.Tensor,
        mask: MaskSpec,
        cache: KVCache | None,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        x = self.hook_resid_pre(x)
        attn_out = self.hook_attn_out(self.attn(self.ln1(x), mask, cache, rope))
        x = self.hook_resid_mid(x + attn_out)
        mlp_out = self.hook_mlp_out(self.mlp(self.ln2(x)))
        return self.hook_resid_post(x + mlp_out)


def additive_mask(
    n: int,
    past: int,
    key_is_token: torch.Tensor | None,
    device: torch.device,
    dtype: torch.dtype,
    window: int | None = None,
) -> torch.Tensor:
    """The additive mask M for queries at positions past … past+n−1 over t = past+n keys.

    M[i, j] = 0 where key j may be seen (j ≤ past + i, and j is not padding),
    −∞ otherwise. Without padding it is ``[1, 1, n, t]``; with ``key_is_token``
    ``[B, t]`` (False = padding) it is ``[B, 1, n, t]``. A padding query row
    would see nothing at all, so it is allowed to see itself: its output is
    never used, and the softmax stays finite.

    ``window`` (Mistral's ``sliding_window``) also hides keys more than
    ``window − 1`` slots back: query slot q sees key slots q − window + 1 … q,
    at most ``window`` keys including itself — Hugging Face's
    ``kv_idx > q_idx − sliding_window``. Slots, like Hugging Face's cache
    positions, count padding too."""
    t = past + n
    query_pos = torch.arange(past, t, device=device)[:, None]  # [n, 1]
    key_pos = torch.arange(t, device=device)[None, :]  # [1, t]
    allowed = key_pos <= query_pos  # [n, t], lower-triangular when past = 0
    if window is not None:
        allowed = allowed & (key_pos > query_pos - window)  # a band of width `window` below the diagonal
    if key_is_token is not None:
        allowed = allowed[None] & key_is_token[:, None, :]  # [B, n, t]
        is_diagonal = (key_pos == query_pos)[None]  # [1, n, t]
        allowed = allowed | (is_diagonal & ~key_is_token[:, past:, None])
    else:
        allowed = allowed[None]  # [1, n, t]
    mask = torch.zeros(allowed.shape, device=device, dtype=dtype)
    return mask.masked_fill(~allowed, float("-inf")).unsqueeze(1)  # [B|1, 1, n, t]


def check_tokens(config: GPTConfig, tokens: torch.Tensor, cache: KVCache | None, logits_to_keep: int = 0) -> None:
    """Refuse token ids the model cannot run: not ``[B, n]`` integers, none, past n_ctx, outside [0, V); and a
    ``logits_to_keep`` that is not a whole number ≥ 0."""
    if isinstance(logits_to_keep, bool) or not isinstance(logits_to_keep, int) or logits_to_keep < 0:
        raise ValueError(f"logits_to_keep must be a whole number ≥ 0 (0: every position), got {logits_to_keep!r}")
    if tokens.dim() != 2:
        raise ValueError(f"tokens must be [B, n] token ids, got shape {list(tokens.shape)}")
    if tokens.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"tokens must be an integer tensor, got {tokens.dtype}")
    B, n = tokens.shape
    if n == 0:
        raise ValueError("tokens has no positions (n = 0): give at least one token")
    past = 0
    if cache is not None:
        cache.check_batch(B)
        past = cache.length
    t = past + n
    if t > config.n_ctx:
        table = f"its positional table has no row {t - 1}" if config.positions == "learned" else (
            "max_position_embeddings")
        raise ValueError(
            f"sequence too long: {past} cached + {n} new = {t} positions, but this model's "
            f"n_ctx is {config.n_ctx} ({table})"
        )
    if tokens.numel() and not tokens.is_meta and (int(tokens.min()) < 0 or int(tokens.max()) >= config.vocab_size):
        raise ValueError(
            f"token ids must lie in [0, {config.vocab_size}); got min {int(tokens.min())}, "
            f"max {int(tokens.max())}"
        )


def positions_and_keys(
    B: int,
    n: int,
    past: int,
    padding_mask: torch.Tensor | None,
    cache: KVCache | None,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Position ids ``[B|1, n]`` and the key padding ``[B, t]`` (None when nothing is padding)."""
    past_is_token = cache.key_is_token if cache is not None else None
    if padding_mask is None and past_is_token is None:
        return torch.arange(past, past + n, device=device)[None], None
    new_is_token = padding_mask if padding_mask is not None else torch.ones(B, n, dtype=torch.bool, device=device)
    if past_is_token is None:
        past_is_token = torch.ones(B, past, dtype=torch.bool, device=device)
    key_is_token = torch.cat([past_is_token, new_is_token], dim=1)  # [B, t]
    seen = past_is_token.sum(dim=1, keepdim=True)  # real tokens already in the cache, [B, 1]
    positions = (seen + new_is_token.cumsum(dim=1) - 1).clamp(min=0)  # [B, n]
    return positions, key_is_token


class GPT(TappedModule):
    """A decoder-only transformer: token embeddings (+ learned positions, or RoPE inside attention),
    pre-norm blocks, a final norm and the unembedding (tied to W_E, or its own W_U).

    ``GPT(GPTConfig())`` is GPT-2; ``GPT(GPTConfig.for_family("llama", …))`` a Llama-style model."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        if config.family in EXTERNAL_FAMILIES:
            raise ValueError(f"family {config.family!r} describes a model run by its own code "
                             "(model.sources: HFDecoder, OwnDecoder); it cannot be built here")
        self.config = config
        self.embed = embedding(config.vocab_size, config.d_model, std=0.02)  # W_E: [V, d]
        if config.positions == "learned":
            self.pos_embed = embedding(config.n_ctx, config.d_model, std=0.01)  # W_pos: [n_ctx, d]
        self.blocks = nn.ModuleList(Block(config, layer) for layer in range(config.n_layer))
        self.ln_final = norm(config)
        if not config.tie_embeddings:
            self.unembed = Projection(config.d_model, config.vocab_size, bias=False)  # W_U: [d, V] (lm_head.weightᵀ)
        self.hook_embed = HookPoint()  # [B, n, d], token embeddings W_E[tokens]
        if config.positions == "learned":
            self.hook_pos_embed = HookPoint()  # [B, n, d], position embeddings W_pos[positions]
        self.hook_logits = HookPoint()  # [B, n, V]
        self._identity: ModelIdentity | PendingIdentity | None = None

    @property
    def identity(self) -> ModelIdentity:
        """Name, source and weights digest: set by the loaders (a ``PendingIdentity`` until the files' hash is
        done); for a model built in code, "unnamed", "built in code" and a digest of the parameters as they
        are now."""
        known = self._identity  # read once: another thread may resolve it meanwhile
        if isinstance(known, PendingIdentity):  # set by the loaders: the files' hash may still be going on
            known = self._identity = known.result()
        if known is not None:
            return known
        return computed_identity(self, self.config.family, self.config.to_dict())

    @identity.setter
    def identity(self, value: ModelIdentity | PendingIdentity) -> None:
        self._identity = value

    def new_cache(self, batch_size: int = 1, storage: str = "model") -> KVCache:
        """An empty KV cache for ``batch_size`` sequences, to pass to ``forward`` (``storage``: the precision
        its rows are rounded to as they are written, model/gpt/_cache.py)."""
        return KVCache(self.config.n_layer, batch_size, storage)

    def forward(
        self,
        tokens: torch.Tensor,
        cache: KVCache | None = None,
        *,
        padding_mask: torch.Tensor | None = None,
        logits_to_keep: int = 0,
    ) -> torch.Tensor:
        """Logits ``[B, n, V]`` for token ids ``[B, n]``.

        With ``cache``, its keys/values are reused, the new ones appended, and
        positions continue from the cache. ``padding_mask`` ``[B, n]`` (True =
        real token, False = padding) marks padding among the new tokens; the
        cache remembers it, and positions count real tokens only, as Hugging
        Face does with ``position_ids = attention_mask.cumsum(-1) − 1``.
        ``logits_to_keep`` k > 0: the last k positions only are unembedded,
        ``[B, k, V]`` (transformers' argument of that name: ``generate()`` reads the last position only).
        """
        check_tokens(self.config, tokens, cache, logits_to_keep)
        B, n = tokens.shape
        past = cache.length if cache is not None else 0
        if padding_mask is not None:
            if padding_mask.shape != tokens.shape:
                raise ValueError(
                    f"padding_mask must have the shape of tokens {list(tokens.shape)}, "
                    f"got {list(padding_mask.shape)}"
                )
            padding_mask = padding_mask.to(device=tokens.device, dtype=torch.bool)

        positions, key_is_token = positions_and_keys(B, n, past, padding_mask, cache, tokens.device)
        x = self.hook_embed(self.embed(tokens))  # [B,n] -> [B,n,d]
        rope = None
        if self.config.positions == "learned":
            x = x + self.hook_pos_embed(self.pos_embed(positions).expand(B, n, -1))  # [B|1,n] -> [B,n,d]
        else:
            rope = rope_cos_sin(self.config, positions)  # 2 × [B|1,n,d_head], shared by every layer
        # the mask described, not built: the eager path builds [B|1,1,n,t] once for all layers, the fused never
        mask = MaskSpec(n=n, t=past + n, scale=None, window=self.config.sliding_window,
                        key_is_token=key_is_token)
        with transaction(cache, n, key_is_token):
            for block in self.blocks:
                x = block(x, mask, cache, rope)
            x = self.ln_final(x)
            if logits_to_keep:
                x = x[:, -logits_to_keep:]  # [B,n,d] -> [B,k,d]: the positions whose logits are read
            logits = self.hook_logits(self.unembed_normed(x))  # [B,n|k,d] -> [B,n|k,V]
        return logits

    @property
    def w_u(self) -> torch.Tensor:
        """The unembedding as ``[V, d]`` (= W_Uᵀ): W_E itself when tied, a transposed view of W_U otherwise."""
        return self.embed.weight if self.config.tie_embeddings else self.unembed.weight.t()

    def unembed_residual(self, x: torch.Tensor) -> torch.Tensor:
        """Logits z = norm_f(x)·W_U for a residual stream ``[..., d]`` — how the forward ends, and what the
        logit lens applies to the residual stream after any block."""
        return self.unembed_normed(self.ln_final(x))

    def unembed_normed(self, x: torch.Tensor) -> torch.Tensor:
        """Logits z = x·W_U for the final norm's output ``[..., d]``."""
        if self.config.tie_embeddings:
            return F.linear(x, self.embed.weight)  # [..., d] @ W_Eᵀ [d, V] -> [..., V]
        return self.unembed(x)  # [..., d] @ W_U [d, V] -> [..., V]

    @property
    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


def block_attention(model: GPT, layer: int) -> MultiHeadAttention:
    """Block ``layer``'s attention module, ``model.blocks[layer].attn``."""
    # GPT.__init__ fills blocks with Block only; nn.ModuleList is not generic, so it types an item as nn.Module
    return cast(Block, model.blocks[layer]).attn
