"""What a forward pass costs, counted from shapes: multiply-adds and bytes read.

These are the numbers that say what the KV cache saves, whatever else the
machine is doing: a decode step with the cache computes one query row per
sequence over t cached keys; a full recompute computes all t rows again. Wall
time on a shared machine is an estimate; these counts are exact for our model.

Counted (per forward, batch B, n new positions, t key positions):

* per block: X·W_QKV  B·n·d·(H + 2G)·d_head; QKᵀ  B·H·n·t·d_head; A·V  B·H·n·t·d_head;
  ·W_O  B·n·H·d_head·d; MLP  B·n·d·d_ff times 2 (GELU: W₁, W₂) or 3 (SwiGLU: gate, up, down);
* the unembedding: B·n·d·V (our model computes logits for every new position).

Layer norms, softmax, the mask, RoPE and the residual additions are O(B·n·d)
or O(B·H·n·t) element-wise work without multiply-adds of weights; they are
left out, and said to be. In a hybrid model only the layers with attention
count the attention terms and hold K and V; the other layers' mixers (Gated
DeltaNet, Mamba, convolutions) are left out too: their cost is the mixer's own,
which the config does not describe.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ForwardCost:
    macs: int  # multiply-adds of the counted matrix products
    weight_bytes: int  # bytes of weight matrices one forward reads (every block, the unembedding)
    kv_cache_bytes: int  # bytes of cached keys and values read (0 without a cache)


def _dims(config) -> tuple[int, int, int, int, int, int, int, int]:
    n_head = config.n_head
    n_kv = getattr(config, "n_kv_heads", None) or getattr(config, "n_kv_head", None) or n_head
    d_head = config.d_head
    gated = getattr(config, "mlp", "gelu") == "swiglu"
    return config.d_model, n_head, n_kv, d_head, config.d_ff, config.vocab_size, config.n_layer, 3 if gated else 2


def _attending(config) -> int:
    """How many layers compute attention: all of them but a hybrid model's state layers."""
    layers = getattr(config, "attention_layers", None)
    return len(layers) if layers is not None else config.n_layer


def forward_cost(config, batch: int, new: int, keys: int, cached: int = 0, itemsize: int = 4) -> ForwardCost:
    """The cost of one forward of ``new`` positions attending over ``keys`` positions, ``cached`` of which
    come from a KV cache."""
    d, H, G, dh, d_ff, V, L, mlp_mats = _dims(config)
    La = _attending(config)
    attention = (batch * new * d * (H + 2 * G) * dh  # X·W_QKV
                 + 2 * batch * H * new * keys * dh  # QKᵀ and A·V
                 + batch * new * H * dh * d)  # ·W_O
    macs = La * attention + L * mlp_mats * batch * new * d * d_ff + batch * new * d * V
    weight_bytes = (La * (d * (H + 2 * G) * dh + H * dh * d) + L * mlp_mats * d * d_ff + d * V) * itemsize
    kv_bytes = 2 * La * batch * G * cached * dh * itemsize
    return ForwardCost(macs=macs, weight_bytes=weight_bytes, kv_cache_bytes=kv_bytes)


PARTS = ("X·W_QKV", "QKᵀ and A·V", "·W_O", "MLP", "unembedding")  # what forward_parts counts, in order


def forward_parts(config, batch: int, new: int, keys: int) -> dict[str, int]:
    """The multiply-adds of ``forward_cost`` part by part (all layers; they add up to its ``macs``): what grows
    with n·d² (the projections, the MLP, the unembedding) and what grows with n·t·d (attention's two products)."""
    d, H, G, dh, d_ff, V, L, mlp_mats = _dims(config)
    La = _attending(config)
    return {"X·W_QKV": La * batch * new * d * (H + 2 * G) * dh,
            "QKᵀ and A·V": La * 2 * batch * H * new * keys * dh,
            "·W_O": La * batch * new * H * dh * d,
            "MLP": L * mlp_mats * batch * new * d * d_ff,
            "unembedding": batch * new * d * V}


def attention_overtakes_mlp(config) -> float:
    """The context length n from which a full forward's attention products (2·H·n²·d_head per layer) cost more
    multiply-adds than its MLP (mlp_mats·n·d·d_ff per layer): n* = mlp_mats·d·d_ff / (2·H·d_head)."""
    d, H, _, dh, d_ff, _, _, mlp_mats = _dims(config)
    return mlp_mats * d * d_ff / (2 * H * dh)
