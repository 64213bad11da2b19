"""A GPT-2 whose every intermediate passes through a named hook point.

Read bottom-up, as in nanoGPT: config → hook point → projection → layer norm →
``attention`` (the seeds' formula, also used on its own by tests and the app) →
multi-head attention → MLP → block → GPT.

Shape legend, used in every comment below and everywhere in the project:

    B  batch size                     H       attention heads
    n  new positions in this forward  d_head  width of one head, d // H
    t  key positions incl. the cache  V       vocabulary size
    d  d_model, width of the residual stream

The math follows the seed documents (../shared/seeds): row vectors, matrices
multiply on the right (``X·W``), the combined ``W_QKV`` is ``[d, 3d]``, and heads
are laid out ``[B, H, n, d_head]`` (TransformerLens uses ``[B, n, H, d_head]``;
see model/README.md for the full hook table and that difference).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as _torch_module

from model.cache import KVCache


@dataclass(frozen=True)
class GPTConfig:
    """Hyper-parameters of a GPT-2-architecture model (defaults: GPT-2 small, 124M)."""

    vocab_size: int = 50257  # V: how many token ids the embedding (and tied unembedding) knows
    n_ctx: int = 1024  # longest sequence, cache included: rows of the positional-embedding table
    d_model: int = 768  # d: width of the residual stream and of every embedding
    n_layer: int = 12  # number of transformer blocks
    n_head: int = 12  # H: attention heads per block; each head has d_head = d_model // n_head
    d_mlp: int | None = None  # MLP hidden width; None means the usual 4·d_model
    layer_norm_eps: float = 1e-5  # ε in LayerNorm's √(σ² + ε), GPT-2's value

    def __post_init__(self) -> None:
        for field in ("vocab_size", "n_ctx", "d_model", "n_layer", "n_head"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"GPTConfig.{field} must be a positive integer, got {value!r}")
        if self.d_model % self.n_head:
            raise ValueError(
                f"d_model ({self.d_model}) must be divisible by n_head ({self.n_head}) "
                "so that every head gets d_head = d_model // n_head dimensions"
            )
        if self.d_mlp is not None and (not isinstance(self.d_mlp, int) or self.d_mlp < 1):
            raise ValueError(f"GPTConfig.d_mlp must be a positive integer or None, got {self.d_mlp!r}")

    @property
    def d_head(self) -> int:
        return self.d_model // self.n_head

    @property
    def d_ff(self) -> int:
        return self.d_mlp if self.d_mlp is not None else 4 * self.d_model


def _global_module_hooks() -> bool:
    """Whether hooks registered for every module (the public ``register_module_forward_hook``) exist.

    torch keeps them in private module globals; reading those lets a hook point with no hooks of any
    kind skip ``nn.Module.__call__`` (``bench/bench_model.py`` prints what that saves per forward).
    If a torch release renames them, ``getattr`` answers True and every call takes the full, correct
    path; ``tests/test_model_hooks.py`` pins that a global hook still sees every hook point."""
    return bool(getattr(_torch_module, "_global_forward_hooks", True)
                or getattr(_torch_module, "_global_forward_pre_hooks", True))


class TapHandle:
    """Returned by ``HookPoint.add_tap``; ``remove()`` takes the tap off again (idempotent)."""

    __slots__ = ("_point", "_tap")

    def __init__(self, point: HookPoint, tap) -> None:
        self._point, self._tap = point, tap

    def remove(self) -> None:
        self._point.remove_tap(self._tap)


class HookPoint(nn.Module):
    """Identity module. It exists so that a plain forward hook on it sees the
    tensor under a stable name: the module path, e.g. ``blocks.0.attn.hook_q``.

    A *tap* (``add_tap(fn)``) is a read-only listener: ``fn(tensor)`` is called
    with the value the model goes on to use, after every forward hook on this
    module has run — an ablation or a patch made by a hook included. It cannot
    change the value, and it is cheaper than a forward hook (PyTorch's hook
    dispatch costs about a microsecond per module call, and a GPT-2 small
    forward passes 268 hook points); a tracer reads the model through taps."""

    def __init__(self) -> None:
        super().__init__()
        self._taps: tuple = ()

    def add_tap(self, tap) -> TapHandle:
        """Call ``tap(tensor)`` on every value passing this point, until the handle is removed."""
        self._taps = (*self._taps, tap)
        return TapHandle(self, tap)

    def remove_tap(self, tap) -> None:
        self._taps = tuple(t for t in self._taps if t is not tap)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._forward_hooks or self._forward_pre_hooks or _global_module_hooks():
            x = super().__call__(x)  # identity, then the forward hooks, which may replace x
        for tap in self._taps:
            tap(x)
        return x


class Projection(nn.Module):
    """``y = x·W + b`` with ``W`` stored ``[d_in, d_out]``.

    That is the seeds' row-vector convention and the layout of Hugging Face
    GPT-2's ``Conv1D``, so checkpoints load without transposes and the same
    ``addmm`` runs in both models."""

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.d_in, self.d_out = d_in, d_out
        self.weight = nn.Parameter(torch.empty(d_in, d_out))
        self.bias = nn.Parameter(torch.zeros(d_out))
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out_shape = x.shape[:-1] + (self.d_out,)
        flat = x.reshape(-1, self.d_in)  # [..., d_in] -> [B·n, d_in]
        return torch.addmm(self.bias, flat, self.weight).view(out_shape)  # -> [..., d_out]

    def extra_repr(self) -> str:
        return f"W: [{self.d_in}, {self.d_out}]"


class LayerNorm(nn.Module):
    """LayerNorm(x) = γ ⊙ (x − μ) / √(σ² + ε) + β over the last dimension (seed eq. 19)."""

    def __init__(self, d: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))  # γ
        self.bias = nn.Parameter(torch.zeros(d))  # β
        self.hook_normalized = HookPoint()  # [B, n, d]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.hook_normalized(F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps))


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    hooks: nn.Module | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scaled dot-product attention, ``softmax(QKᵀ/√d_k + M)·V``, step by step.

    ``q``: ``[..., n, d_k]``, ``k``: ``[..., t, d_k]``, ``v``: ``[..., t, d_v]``;
    ``mask`` is additive (0 where allowed, −∞ where not) and broadcasts to
    ``[..., n, t]``. Returns ``(output [..., n, d_v], weights [..., n, t])``.

    The seed writes the causal form as ``softmax((QKᵀ + M)/√d_k)``; with
    M ∈ {0, −∞} that is the same matrix, and scaling first keeps the stages
    the app shows (QKᵀ, ÷√d_k, + M, softmax) each a real tensor.

    ``hooks``, when given, is a module with the hook points ``hook_qk``,
    ``hook_attn_scores``, ``hook_mask``, ``hook_masked_scores`` and
    ``hook_pattern``; the model passes its attention module here so that this
    one function is what both the model and the tests run.
    """
    d_k = q.size(-1)
    qk = q @ k.transpose(-2, -1)  # [B,H,n,d_head] @ [B,H,d_head,t] -> [B,H,n,t]
    if hooks is not None:
        qk = hooks.hook_qk(qk)
    scores = qk / math.sqrt(d_k)  # [B,H,n,t]
    if hooks is not None:
        scores = hooks.hook_attn_scores(scores)
    if mask is not None:
        if hooks is not None:
            mask = hooks.hook_mask(mask)
        scores = scores + mask  # [B,H,n,t] + [B|1,1,n,t] -> [B,H,n,t]
        if hooks is not None:
            scores = hooks.hook_masked_scores(scores)
    weights = torch.softmax(scores, dim=-1)  # rows sum to 1 over the t keys
    if hooks is not None:
        weights = hooks.hook_pattern(weights)
    return weights @ v, weights  # [B,H,n,t] @ [B,H,t,d_head] -> [B,H,n,d_head]


class MultiHeadAttention(nn.Module):
    """X·W_QKV → split → view [B,n,H,d_head] → transpose [B,H,n,d_head] →
    attention → merge heads [B,n,d] → ·W_O."""

    def __init__(self, config: GPTConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.n_head, self.d_head, self.d_model = config.n_head, config.d_head, config.d_model
        self.c_attn = Projection(config.d_model, 3 * config.d_model)  # W_QKV: [d, 3d]
        self.c_proj = Projection(config.d_model, config.d_model)  # W_O: [d, d]
        self.hook_qkv = HookPoint()  # [B, n, 3d]
        self.hook_q = HookPoint()  # [B, H, n, d_head]
        self.hook_k = HookPoint()  # [B, H, n, d_head], new positions only
        self.hook_v = HookPoint()  # [B, H, n, d_head], new positions only
        self.hook_k_all = HookPoint()  # [B, H, t, d_head], cache + new
        self.hook_v_all = HookPoint()  # [B, H, t, d_head], cache + new
        self.hook_qk = HookPoint()  # [B, H, n, t], QKᵀ
        self.hook_attn_scores = HookPoint()  # [B, H, n, t], QKᵀ/√d_k
        self.hook_mask = HookPoint()  # [B|1, 1, n, t], additive 0 / −∞
        self.hook_masked_scores = HookPoint()  # [B, H, n, t], QKᵀ/√d_k + M
        self.hook_pattern = HookPoint()  # [B, H, n, t], softmax: the attention weights A
        self.hook_z = HookPoint()  # [B, H, n, d_head], A·V per head
        self.hook_merged = HookPoint()  # [B, n, d], heads concatenated, before W_O

    def forward(self, x: torch.Tensor, mask: torch.Tensor, cache: KVCache | None) -> torch.Tensor:
        B, n, d = x.shape
        H, d_head = self.n_head, self.d_head
        qkv = self.hook_qkv(self.c_attn(x))  # [B,n,d] @ [d,3d] -> [B,n,3d]
        q, k, v = qkv.split(d, dim=2)  # 3 × [B,n,d]
        q = self.hook_q(q.view(B, n, H, d_head).transpose(1, 2))  # [B,n,d] -> [B,n,H,d_head] -> [B,H,n,d_head]
        k = self.hook_k(k.view(B, n, H, d_head).transpose(1, 2))  # [B,H,n,d_head]
        v = self.hook_v(v.view(B, n, H, d_head).transpose(1, 2))  # [B,H,n,d_head]
        if cache is not None:
            k, v = cache.append(self.layer, k, v)  # [B,H,t−n,d_head] ++ [B,H,n,d_head] -> [B,H,t,d_head]
        k = self.hook_k_all(k)
        v = self.hook_v_all(v)
        z, _ = attention(q, k, v, mask, hooks=self)  # [B,H,n,d_head]
        z = self.hook_z(z)
        z = z.transpose(1, 2).contiguous()  # [B,H,n,d_head] -> [B,n,H,d_head]
        merged = self.hook_merged(z.view(B, n, d))  # [B,n,H,d_head] -> [B,n,d]: heads side by side
        return self.c_proj(merged)  # [B,n,d] @ [d,d] -> [B,n,d]


class MLP(nn.Module):
    """FFN(x) = GELU(x·W_1 + b_1)·W_2 + b_2 (seed eq. 36), GELU in GPT-2's tanh form."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = Projection(config.d_model, config.d_ff)  # W_1: [d, 4d]
        self.act = nn.GELU(approximate="tanh")
        self.c_proj = Projection(config.d_ff, config.d_model)  # W_2: [4d, d]
        self.hook_pre = HookPoint()  # [B, n, 4d], before GELU
        self.hook_post = HookPoint()  # [B, n, 4d], after GELU

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pre = self.hook_pre(self.c_fc(x))  # [B,n,d] -> [B,n,4d]
        post = self.hook_post(self.act(pre))
        return self.c_proj(post)  # [B,n,4d] -> [B,n,d]


class Block(nn.Module):
    """Pre-LayerNorm block (seed eqs. 32–35): x + Attn(LN(x)), then + FFN(LN(·))."""

    def __init__(self, config: GPTConfig, layer: int) -> None:
        super().__init__()
        self.ln1 = LayerNorm(config.d_model, config.layer_norm_eps)
        self.attn = MultiHeadAttention(config, layer)
        self.ln2 = LayerNorm(config.d_model, config.layer_norm_eps)
        self.mlp = MLP(config)
        self.hook_resid_pre = HookPoint()  # [B, n, d]
        self.hook_attn_out = HookPoint()  # [B, n, d]
        self.hook_resid_mid = HookPoint()  # [B, n, d]
        self.hook_mlp_out = HookPoint()  # [B, n, d]
        self.hook_resid_post = HookPoint()  # [B, n, d]

    def forward(self, x: torch.Tensor, mask: torch.Tensor, cache: KVCache | None) -> torch.Tensor:
        x = self.hook_resid_pre(x)
        attn_out = self.hook_attn_out(self.attn(self.ln1(x), mask, cache))
        x = self.hook_resid_mid(x + attn_out)
        mlp_out = self.hook_mlp_out(self.mlp(self.ln2(x)))
        return self.hook_resid_post(x + mlp_out)


def additive_mask(
    n: int, past: int, key_is_token: torch.Tensor | None, device: torch.device, dtype: torch.dtype
) -> torch.Tensor:
    """The additive mask M for queries at positions past … past+n−1 over t = past+n keys.

    M[i, j] = 0 where key j may be seen (j ≤ past + i, and j is not padding),
    −∞ otherwise. Without padding it is ``[1, 1, n, t]``; with ``key_is_token``
    ``[B, t]`` (False = padding) it is ``[B, 1, n, t]``. A padding query row
    would see nothing at all, so it is allowed to see itself: its output is
    never used, and the softmax stays finite."""
    t = past + n
    query_pos = torch.arange(past, t, device=device)[:, None]  # [n, 1]
    key_pos = torch.arange(t, device=device)[None, :]  # [1, t]
    allowed = key_pos <= query_pos  # [n, t], lower-triangular when past = 0
    if key_is_token is not None:
        allowed = allowed[None] & key_is_token[:, None, :]  # [B, n, t]
        is_diagonal = (key_pos == query_pos)[None]  # [1, n, t]
        allowed = allowed | (is_diagonal & ~key_is_token[:, past:, None])
    else:
        allowed = allowed[None]  # [1, n, t]
    mask = torch.zeros(allowed.shape, device=device, dtype=dtype)
    return mask.masked_fill(~allowed, float("-inf")).unsqueeze(1)  # [B|1, 1, n, t]


class GPT(nn.Module):
    """GPT-2: learned token and position embeddings, pre-LN blocks, tied unembedding."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.d_model)  # W_E: [V, d]
        self.pos_embed = nn.Embedding(config.n_ctx, config.d_model)  # W_pos: [n_ctx, d]
        nn.init.normal_(self.embed.weight, std=0.02)
        nn.init.normal_(self.pos_embed.weight, std=0.01)
        self.blocks = nn.ModuleList(Block(config, layer) for layer in range(config.n_layer))
        self.ln_final = LayerNorm(config.d_model, config.layer_norm_eps)
        self.hook_embed = HookPoint()  # [B, n, d], token embeddings W_E[tokens]
        self.hook_pos_embed = HookPoint()  # [B, n, d], position embeddings W_pos[positions]
        self.hook_logits = HookPoint()  # [B, n, V]

    def new_cache(self, batch_size: int = 1) -> KVCache:
        """An empty KV cache for ``batch_size`` sequences, to pass to ``forward``."""
        return KVCache(self.config.n_layer, batch_size)

    def forward(
        self,
        tokens: torch.Tensor,
        cache: KVCache | None = None,
        *,
        padding_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits ``[B, n, V]`` for token ids ``[B, n]``.

        With ``cache``, its keys/values are reused, the new ones appended, and
        positions continue from the cache. ``padding_mask`` ``[B, n]`` (True =
        real token, False = padding) marks padding among the new tokens; the
        cache remembers it, and positions count real tokens only, as Hugging
        Face's GPT-2 does with ``position_ids = attention_mask.cumsum(-1) − 1``.
        """
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
        if t > self.config.n_ctx:
            raise ValueError(
                f"sequence too long: {past} cached + {n} new = {t} positions, but this model's "
                f"n_ctx is {self.config.n_ctx} (its positional table has no row {t - 1})"
            )
        if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= self.config.vocab_size):
            raise ValueError(
                f"token ids must lie in [0, {self.config.vocab_size}); got min {int(tokens.min())}, "
                f"max {int(tokens.max())}"
            )
        if padding_mask is not None:
            if padding_mask.shape != tokens.shape:
                raise ValueError(
                    f"padding_mask must have the shape of tokens {list(tokens.shape)}, "
                    f"got {list(padding_mask.shape)}"
                )
            padding_mask = padding_mask.to(device=tokens.device, dtype=torch.bool)

        positions, key_is_token = self._positions(B, n, past, padding_mask, cache, tokens.device)
        tok = self.hook_embed(self.embed(tokens))  # [B,n] -> [B,n,d]
        pos = self.hook_pos_embed(self.pos_embed(positions).expand(B, n, -1))  # [B|1,n] -> [B,n,d]
        x = tok + pos
        mask = additive_mask(n, past, key_is_token, tokens.device, x.dtype)  # [B|1,1,n,t]
        try:
            for block in self.blocks:
                x = block(x, mask, cache)
            x = self.ln_final(x)
            logits = self.hook_logits(F.linear(x, self.embed.weight))  # [B,n,d] @ W_Eᵀ [d,V] -> [B,n,V]
        except BaseException:
            if cache is not None:
                cache.rollback()
            raise
        if cache is not None:
            cache.commit(n, key_is_token, positions)
        return logits

    def _positions(
        self,
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

    @property
    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())
