"""Attention computed in a family's own code (Bloom, MPT, CodeGen, XGLM, the BERT-style decoders …), found by what it
does at the level of torch operations and recorded under the hook names every view reads.

Most transformers families hand Q, K, V and the mask to transformers' attention function, which ``HFDecoder``
replaces with ``traced_attention``. Some compute the softmax in their attention module's own forward instead. For
such a module, its forward runs under a ``torch.overrides.TorchFunctionMode`` (``_Watch``, entered by a forward
pre-hook on the module and left by its forward hook) that sees every torch function the forward calls and changes
nothing: each op runs as the family wrote it, and the mode keeps a note of it (``_Node``: the function, its arguments,
its result). The attention is the product whose left operand comes from a softmax over the last axis — through a
dropout (a no-op in eval), a dtype cast, a view or a zeroing ``masked_fill`` — and whose right operand is V
``[…, t, d_v]``; its result is z. Walking back from the softmax's input to the product that made the scores gives the
stages between: a scalar multiplication or division (the scale), the addition of a tensor whose values are 0 or
≤ −10⁴ (a mask; ``masked_fill`` and ``torch.where`` with a boolean are masks too, and so is a multiplication by a
tensor of 0 and 1), the addition of any other tensor (a bias: Bloom's and MPT's ALiBi, CPM-Ant's relative position
bias), and the scores' product itself — ``matmul``/``bmm``/a batched ``einsum`` (Q, Kᵀ), or ``baddbmm``, whose first
operand is a bias too (Bloom's ALiBi) and whose ``alpha`` a scale.

What is recorded, ``[B, H, …]`` as the hook table's legend (a family that flattens heads into the batch,
``[B·H, n, t]``, is read back as ``[B, H, n, t]``): ``hook_q`` (the left operand of the scores' product, as the family
computed it: XGLM's queries are already scaled), ``hook_k_all`` and ``hook_v_all`` (the operands the scores and z
used: the cache included, where the family keeps its keys in transformers' ``Cache`` and so in our cache view),
``hook_k``, ``hook_v`` (their last n rows), ``hook_qk`` (Q·Kᵀ), ``hook_attn_scores`` (× the scale found),
``hook_score_bias`` (the bias, only where the family adds one: a stage of its own, not in the hook table),
``hook_mask`` (the masks found, as one additive M: 0 or −∞), ``hook_masked_scores`` (the softmax's input, the family's
own tensor: scores + bias + M), ``hook_pattern`` (the left operand of the product with V, the family's own tensor),
``hook_z`` (that product). A forward hook that replaces ``hook_pattern`` or ``hook_z`` changes what the module goes on
to compute (the product is taken again with it, or its result replaced); one that replaces an earlier stage is refused
with an error (those stages are read after the family computed them).

Relative attention (XLNet) sums several query–key products before its scale: the one read at the key positions as
it comes is the scores' product (Q·Kᵀ, its Q the queries plus XLNet's r_w_bias), each other term — re-indexed from
query–key distances to key positions after its product (a slice, an index_select: XLNet's relative shift) — a bias
(``hook_score_bias``, × the scale applied after the sum). An einsum in another axis order (XLNet's ``ibnd,jbnd->bnij``)
is read as the matrix product it is, its operands permuted to ``[B, H, …]``.

Weights written out as exp(x − logsumexp x) over the last axis (Reformer's) are the softmax of x they are. A row
whose every key a torch.where fills with a constant keeps its weight on the one key filled highest (Reformer's LSH
self-mask, −10⁵ beside the causal mask's −10⁹, on the first query): M is 0 there (``_kept_by_fill``).

Refused, each with the reason the ops show: a sum with two terms read at the key positions as they come (XLNet's
segment term beside its content term), weights made without a softmax, several softmax–V products in one layer
(ProphetNet's n-gram stream), ops between the scores and the softmax the reader does not know.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from gpt_shape_tracer.model.sources._hf_refusals import HFDecoderError

_PRODUCTS = {"matmul", "__matmul__", "bmm", "einsum", "baddbmm"}
_SOFTMAX = {"softmax", "_softmax"}
# ops that carry a tensor's values on unchanged (or cast, or reshaped): between the softmax and its product with V,
# and between the scores' product and the softmax
_CARRY = {"view", "reshape", "contiguous", "float", "to", "type", "type_as", "half", "bfloat16", "double", "clone",
          "dropout", "flatten", "view_as", "reshape_as"}
_ADD = {"add", "__add__", "__radd__", "add_", "__iadd__"}
_SUB = {"sub", "__sub__", "sub_", "__isub__", "subtract"}
_MUL = {"mul", "__mul__", "__rmul__", "mul_", "__imul__"}
_DIV = {"div", "__truediv__", "true_divide", "div_", "__itruediv__"}
_MASK_FILL = {"masked_fill", "masked_fill_"}
_WHERE = {"where"}
# ops that re-index a term of summed scores after its product (XLNet's relative shift: a slice, an index_select)
_SHIFT = {"__getitem__", "index_select", "narrow", "gather", "take_along_dim"}
_FLOOR = {"max", "maximum", "clamp", "clamp_min", "fmax"}  # with a very negative second operand: a floor, not a stage
_HIDDEN = -1e4  # a mask value at or below this hides a key: exp(−10⁴) is 0 in float32 and float64
PROBE_TOKENS = 2  # the tokens the probe feeds: the attention's rows beyond them are positions the model adds itself


def _name(func: Any) -> str:
    return str(getattr(func, "__name__", "") or "")


@dataclass
class _Node:
    """One op the watched forward ran: its function's name, arguments and result, and the modules running."""

    name: str
    args: tuple
    kwargs: dict
    out: Any
    stack: tuple = ()


class _Unread(Exception):
    """The ops do not read as one softmax attention: the message says what they are instead."""

    def __init__(self, message: str, reason: str = "attention outside the interface") -> None:
        super().__init__(message)
        self.reason = reason


@dataclass
class Reading:
    """One softmax attention read from the ops, every tensor ``[B, H|G, …]``."""

    query: torch.Tensor  # [B, H, n, d_qk]
    key: torch.Tensor  # [B, G, t, d_qk]
    value: torch.Tensor  # [B, G, t, d_v]
    qk: torch.Tensor  # [B, H, n, t]
    scale: float
    bias: torch.Tensor | None  # [B, H, n, t], or None
    mask: torch.Tensor | None  # [B|1, 1|H, n, t] additive, 0 / −∞
    masked: torch.Tensor  # [B, H, n, t], the softmax's input
    pattern: torch.Tensor  # [B, H, n, t]
    z: torch.Tensor  # [B, H, n, d_v]
    where: tuple = field(default=(), repr=False)  # the modules running at the scores' product and at A·V
    # an einsum A·V in another axis order (XLNet's bnij,jbnd->ibnd): the permutations of pattern, V and z to
    # [batch…, n, t], [batch…, t, d_v], [batch…, n, d_v] (_matmul_layout); None for a plain product
    layout: tuple | None = field(default=None, repr=False)


def _operands(node: _Node) -> list[Any]:
    """The tensor operands of a product (an einsum's come after its equation, or in a list)."""
    if node.name == "einsum":
        rest = list(node.args[1:])
        return list(rest[0]) if len(rest) == 1 and isinstance(rest[0], (list, tuple)) else rest
    if node.name == "baddbmm":
        b1 = node.kwargs.get("batch1", node.args[1] if len(node.args) > 1 else None)
        b2 = node.kwargs.get("batch2", node.args[2] if len(node.args) > 2 else None)
        return [b1, b2]
    return list(node.args[:2])


def _batched_matmul(equation: str) -> bool:
    """Whether an einsum equation is a batched matrix product ``…ij,…jk->…ik`` (ProphetNet's ``bntc,bncs->bnts``)."""
    eq = equation.replace(" ", "")
    if "->" not in eq or eq.count(",") != 1 or "." in eq:
        return False
    lhs, out = eq.split("->")
    a, b = lhs.split(",")
    return (len(a) == len(b) == len(out) >= 2 and a[:-2] == b[:-2] == out[:-2] and a[-1] == b[-2]
            and out[-2] == a[-2] and out[-1] == b[-1] and len(set(a[-2:] + b[-1])) == 3)


Layout = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]


def _matmul_layout(equation: str) -> Layout | None:
    """For an einsum that is a batched matrix product in any axis order (XLNet's ``ibnd,jbnd->bnij`` and
    ``bnij,jbnd->ibnd``): the permutations that bring its operands and its result to ``[batch…, i, j]``,
    ``[batch…, j, k]`` and ``[batch…, i, k]`` (the batch axes in the result's order); None for any other einsum."""
    eq = equation.replace(" ", "")
    if "->" not in eq or eq.count(",") != 1 or "." in eq:
        return None
    lhs, out = eq.split("->")
    a, b = lhs.split(",")
    if any(len(set(x)) != len(x) for x in (a, b, out)):
        return None
    contracted = [c for c in a if c in b and c not in out]
    rows = [c for c in a if c not in b and c in out]
    cols = [c for c in b if c not in a and c in out]
    batch = [c for c in out if c in a and c in b]
    if len(contracted) != 1 or len(rows) != 1 or len(cols) != 1 or \
            len(batch) + 2 != len(a) or len(a) != len(b) or len(out) != len(a):
        return None
    i, j, k = rows[0], contracted[0], cols[0]
    return (tuple(a.index(c) for c in (*batch, i, j)), tuple(b.index(c) for c in (*batch, j, k)),
            tuple(out.index(c) for c in (*batch, i, k)))


def _inverse(perm: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(sorted(range(len(perm)), key=lambda i: perm[i]))


def _product(node: _Node) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Layout | None]:
    """A product's operands and result as a batched matrix product ``[…, i, j] · […, j, k] = […, i, k]`` (an einsum
    of another axis order permuted so, with the permutations), or raises why it is not one."""
    a, b = _operands(node)
    if node.name != "einsum" or _batched_matmul(str(node.args[0])):
        return a, b, node.out, None
    layout = _matmul_layout(str(node.args[0]))
    if layout is None:
        raise _Unread(f"its attention multiplies in an einsum that is not a matrix product ({node.args[0]})")
    return a.permute(layout[0]), b.permute(layout[1]), node.out.permute(layout[2]), layout


class _Watch(TorchFunctionMode):
    """Runs every torch function unchanged and keeps a note of it; at a product with a softmax's output it reads the
    attention (``read``, called back by ``on_attention``, which may return a replacement for the product's result)."""

    def __init__(self, on_attention: Any, stack: list | None = None, batch: int = 1) -> None:
        super().__init__()
        self.nodes: dict[int, _Node] = {}
        self.on_attention = on_attention
        self.stack = stack if stack is not None else []
        self.batch = batch

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = _name(func)
        if name.endswith("_") and not name.startswith("__") and args and isinstance(args[0], torch.Tensor) \
                and id(args[0]) in self.nodes:
            # in place (XLM's scores.masked_fill_): the value before it is kept for the record, under its own node
            before = args[0].clone()
            self.nodes[id(before)] = self.nodes[id(args[0])]
            out = func(*args, **kwargs)
            self.nodes[id(out)] = _Node(name.rstrip("_"), (before, *args[1:]), kwargs, out, tuple(self.stack))
            return out
        out = func(*args, **kwargs)
        if isinstance(out, torch.Tensor) and id(out) in self.nodes and any(out is a for a in args):
            return out  # a no-op that hands its input back (a cast to the same dtype, a dropout in eval)
        if isinstance(out, torch.Tensor):
            node = self._written_softmax(name, args, out) or _Node(name, args, kwargs, out, tuple(self.stack))
            if name in _PRODUCTS:
                replaced = self._maybe_attention(node)
                if replaced is not None:
                    out = node.out = replaced
            self.nodes[id(out)] = node
        return out

    def _written_softmax(self, name: str, args: tuple, out: torch.Tensor) -> _Node | None:
        """``exp(x − logsumexp(x))`` over the last axis (Reformer's weights) noted as the softmax of x it is."""
        if name != "exp" or not args or not isinstance(args[0], torch.Tensor):
            return None
        sub = self.nodes.get(id(args[0]))
        if sub is None or sub.name not in _SUB or len(sub.args) < 2 or sub.kwargs.get("alpha", 1) != 1:
            return None
        x, lse = sub.args[0], self.nodes.get(id(sub.args[1]))
        if lse is None or lse.name != "logsumexp" or lse.args[0] is not x:
            return None
        dim = lse.kwargs.get("dim", lse.args[1] if len(lse.args) > 1 else None)
        dim = dim[0] if isinstance(dim, (list, tuple)) and len(dim) == 1 else dim
        if not isinstance(dim, int) or dim not in (-1, x.dim() - 1):
            return None
        return _Node("softmax", (x,), {"dim": -1}, out, tuple(self.stack))

    def _maybe_attention(self, node: _Node) -> torch.Tensor | None:
        operands = _operands(node)
        if len(operands) != 2 or not all(isinstance(x, torch.Tensor) for x in operands):
            return None
        softmax = self._softmax_behind(operands[0])
        if softmax is None:
            return None
        return self.on_attention(self, node, softmax)

    def _softmax_behind(self, x: torch.Tensor) -> _Node | None:
        """The softmax over the last axis whose output ``x`` is (through casts, views, a dropout, a zeroing fill)."""
        for _ in range(12):
            node = self.nodes.get(id(x))
            if node is None:
                return None
            if node.name in _SOFTMAX:
                dim = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else None)
                src = node.args[0]
                return node if isinstance(dim, int) and dim in (-1, src.dim() - 1) else None
            if node.name in _CARRY or node.name in _MASK_FILL:
                x = node.args[0]
                continue
            return None
        return None

    # -- reading the stages -------------------------------------------------------------------------------------
    def _from_product(self, x: Any, budget: int = 40) -> bool:
        """Whether ``x`` was made, through any ops, from a product of two tensors of rank ≥ 3 (a scores' product)."""
        seen: set[int] = set()
        todo = [x]
        while todo and budget > 0:
            budget -= 1
            t = todo.pop()
            if not isinstance(t, torch.Tensor) or id(t) in seen:
                continue
            seen.add(id(t))
            node = self.nodes.get(id(t))
            if node is None:
                continue
            operands = _operands(node) if node.name in _PRODUCTS else []
            if len(operands) == 2 and all(isinstance(o, torch.Tensor) and o.dim() >= 3 for o in operands):
                return True
            todo.extend(a for a in (*node.args, *node.kwargs.values()) if isinstance(a, torch.Tensor))
        return False

    def read(self, av: _Node, softmax: _Node) -> Reading:
        """The attention whose A·V is ``av`` and whose softmax is ``softmax``, read back stage by stage."""
        left, value = _operands(av)
        x = softmax.args[0]
        masked = x
        scale = 1.0
        masks: list[tuple[torch.Tensor, torch.Tensor]] = []  # (additive mask, the tensor it applied to)
        fills: list[tuple[torch.Tensor, torch.Tensor, float | None]] = []  # torch.where's: (hidden, on, its value)
        biases: list[tuple[torch.Tensor, torch.Tensor]] = []
        scores_node: _Node | None = None
        for _ in range(40):
            node = self.nodes.get(id(x))
            if node is None:
                raise _Unread("its scores come from outside the attention module's forward")
            name = node.name
            if name in _PRODUCTS:
                scores_node = node
                break
            if name in _CARRY:
                x = node.args[0]
                continue
            if name in _FLOOR and len(node.args) >= 2 and _very_negative(node.args[1]):
                x = node.args[0]  # a floor at the dtype's lowest (XGLM): a hidden key stays hidden
                continue
            if name in _MASK_FILL:
                fill = node.args[2] if len(node.args) > 2 else node.kwargs.get("value")
                if not _very_negative(fill):
                    raise _Unread(f"its scores are filled with {fill!r} where a mask says so, not hidden")
                masks.append((_additive(node.args[1], node.args[0]), node.args[0]))
                x = node.args[0]
                continue
            if name in _WHERE:
                cond, a, b = (list(node.args) + [None, None, None])[:3]
                if isinstance(a, torch.Tensor) and self._from_product(a) and _very_negative(b):
                    masks.append((_additive(~cond, a), a))
                    fills.append((~cond, a, _scalar(b)))
                    x = a
                elif isinstance(b, torch.Tensor) and self._from_product(b) and _very_negative(a):
                    masks.append((_additive(cond, b), b))
                    fills.append((cond, b, _scalar(a)))
                    x = b
                else:
                    raise _Unread("its scores pass a torch.where that is not a mask")
                continue
            tensors = [a for a in node.args[:2]]
            chain = [isinstance(a, torch.Tensor) and self._from_product(a) for a in tensors]
            if name in _SUB and len(tensors) == 2 and chain[0] and isinstance(tensors[1], torch.Tensor) \
                    and not chain[1] and node.kwargs.get("alpha", 1) == 1:  # x − c·m (XLNet hides keys so)
                on, other = tensors
                if _is_mask(-other):
                    masks.append((_additive(-other <= _HIDDEN, on), on))
                else:
                    biases.append((-other, on))
                x = on
                continue
            if name in _ADD and len(tensors) == 2 and all(chain) and node.kwargs.get("alpha", 1) == 1:
                # relative attention (XLNet): a sum of query–key products — one read at the key positions as it
                # comes (the content term, the scores' product), the others re-indexed from relative distances to
                # key positions (position terms): each of those a bias on the scores, × the scale applied after
                content, shifted = self._terms(node)
                biases.extend((term * scale, term) for term in shifted)
                x = content
                continue
            if name in _ADD | _MUL | _DIV and len(tensors) == 2 and all(chain):
                raise _Unread(f"its scores combine two query–key products by {name}")
            if name in _ADD | _MUL | _DIV and len(tensors) == 2 and any(chain):
                on, other = (tensors[0], tensors[1]) if chain[0] else (tensors[1], tensors[0])
                factor = _scalar(other)
                if name in _MUL | _DIV and factor is not None:
                    scale = scale * factor if name in _MUL else scale / factor
                elif name in _ADD and _scalar(other) == 0.0:
                    pass  # + 0 (XLNet's segment term where there are no segments)
                elif name in _MUL and isinstance(other, torch.Tensor) and _zero_one(other):
                    masks.append((_additive(other == 0, on), on))
                elif name in _ADD and isinstance(other, torch.Tensor):
                    if node.kwargs.get("alpha", 1) != 1:
                        raise _Unread("its scores add a tensor times alpha")
                    if _is_mask(other):
                        masks.append((_additive(other <= _HIDDEN, on), on))
                    else:
                        biases.append((other, on))
                else:
                    raise _Unread(f"its scores pass an op the reader does not know ({name} by "
                                  f"{type(other).__name__})")
                x = on
                continue
            raise _Unread(f"its scores pass an op the reader does not know ({name})")
        if scores_node is None:
            raise _Unread("its scores' product was not found")
        left, value, av_out, layout = _product(av)
        query, key_t, scores_out, _ = _product(scores_node)
        if scores_node.name == "baddbmm":
            qk = torch.bmm(query, key_t)
            beta, alpha = scores_node.kwargs.get("beta", 1.0), scores_node.kwargs.get("alpha", 1.0)
            scale *= float(alpha)
            start = scores_node.args[0]
            made = self.nodes.get(id(start))
            if isinstance(start, torch.Tensor) and not (made is not None and made.name in ("zeros", "zeros_like")) \
                    and (start.device.type == "meta" or bool((start != 0).any())):  # GPT-NeoX-Japanese: zeros
                biases.append((start * beta, scores_node.out))
        else:
            qk = scores_out
        reading = self._shaped(query, key_t, value, qk, scale, biases, masks, masked, left, av_out,
                               (scores_node.stack, av.stack), fills)
        reading.layout = layout
        return reading

    def _terms(self, node: _Node) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The terms of a sum of query–key products: the one that is a product's result as it comes (through
        casts and views), and the others, each re-indexed after its product (a slice, an index_select: XLNet's
        relative shift) — or raises what the terms are instead."""
        direct: list[torch.Tensor] = []
        shifted: list[torch.Tensor] = []
        todo = list(node.args[:2])
        while todo:
            term = todo.pop(0)
            made = self.nodes.get(id(term))
            if made is not None and made.name in _ADD and all(
                    isinstance(a, torch.Tensor) and self._from_product(a) for a in made.args[:2]):
                todo[:0] = list(made.args[:2])  # (a + b) + c
                continue
            x, moved = term, False
            for _ in range(20):
                made = self.nodes.get(id(x))
                if made is None:
                    raise _Unread("a term of its scores comes from outside the attention module's forward")
                if made.name in _PRODUCTS:
                    break
                if made.name in _CARRY:
                    x = made.args[0]
                elif made.name in _SHIFT:
                    x, moved = made.args[0], True
                else:
                    raise _Unread(f"a term of its summed scores passes an op the reader does not know ({made.name})")
            else:
                raise _Unread("a term of its summed scores was not traced back to its product")
            (shifted if moved else direct).append(term)
        if len(direct) != 1:
            raise _Unread(f"its scores sum {len(direct)} query–key products read at the key positions as they come "
                          "(a segment term beside the content term): which one is Q·Kᵀ is not decided by the ops")
        return direct[0], shifted

    def _shaped(self, query: torch.Tensor, key_t: torch.Tensor, value: torch.Tensor, qk: torch.Tensor, scale: float,
                biases: list, masks: list, masked: torch.Tensor, left: torch.Tensor, av_out: torch.Tensor,
                where: tuple, fills: list | None = None) -> Reading:
        """Every stage as ``[B, H|G, …]`` (a family that flattens the heads into the batch is read back so: its
        batch is the module's input's, where a pattern of rank 4 says it itself)."""
        B = int(left.shape[0]) if left.dim() >= 4 else self.batch
        n, t = left.shape[-2], left.shape[-1]
        d, d_v = query.shape[-1], value.shape[-1]
        if key_t.shape[-2] != d or key_t.shape[-1] != t or value.shape[-2] != t or qk.shape[-2:] != (n, t):
            raise _Unread(f"its scores' product ({tuple(query.shape)} · {tuple(key_t.shape)}) and its product with "
                          f"the values ({tuple(left.shape)} · {tuple(value.shape)}) do not fit one attention")
        heads = left.numel() // max(B * n * t, 1)
        kv = key_t.numel() // max(B * t * d, 1)
        if heads * B * n * t != left.numel() or kv * B * t * d != key_t.numel() or kv == 0 or heads % kv or \
                query.numel() != B * heads * n * d or value.numel() != B * kv * t * d_v:
            raise _Unread("its query, key and value heads do not divide evenly")

        def heads_of(x: torch.Tensor, h: int, rows: int, cols: int) -> torch.Tensor:
            return x.reshape(B, h, rows, cols)

        def full(extra: torch.Tensor, on: torch.Tensor) -> torch.Tensor:  # as wide as the tensor it applied to
            return torch.broadcast_to(extra, on.shape).reshape(B, heads, n, t)

        mask = None
        for additive, on in masks:
            m = full(additive, on)
            mask = m if mask is None else mask + m
        if mask is not None and fills and mask.device.type != "meta":
            mask = _kept_by_fill(mask, [(full(hidden, on), value) for hidden, on, value in fills])
        if mask is not None and (all(a.dim() < 3 or a.shape[-3] == 1 for a, _ in masks) if mask.device.type == "meta"
                                 else bool((mask == mask[:, :1]).all())):
            mask = mask[:, :1]  # one mask for every head: [B, 1, n, t], as the hook table writes it
        if mask is not None and mask.device.type != "meta":  # a row that sees nothing (a padding query) keeps the
            # dtype's lowest, as transformers' eager mask writes it, so that its softmax stays finite
            empty = (mask == float("-inf")).all(dim=-1, keepdim=True)
            mask = mask.masked_fill(empty, torch.finfo(mask.dtype).min)
        bias = None
        for extra, on in biases:
            b = full(extra, on)
            bias = b if bias is None else bias + b
        return Reading(query=heads_of(query, heads, n, d), key=heads_of(key_t.transpose(-1, -2), kv, t, d),
                       value=heads_of(value, kv, t, d_v), qk=heads_of(qk, heads, n, t), scale=scale, bias=bias,
                       mask=mask, masked=heads_of(masked, heads, n, t), pattern=heads_of(left, heads, n, t),
                       z=heads_of(av_out, heads, n, d_v), where=where)


def _kept_by_fill(mask: torch.Tensor, fills: list[tuple[torch.Tensor, float | None]]) -> torch.Tensor:
    """In a row whose every key a ``torch.where`` fills with a constant, the softmax weighs the keys by those
    constants: where one key holds the row's highest fill (Reformer's LSH self-mask, −10⁵ against the causal mask's
    −10⁹, on the first query), all the weight is that key's, as it is with M = 0 there and −∞ elsewhere. ``fills``
    in the order the reader met them (the last op applied first)."""
    empty = (mask == float("-inf")).all(dim=-1, keepdim=True)
    if not bool(empty.any()) or any(value is None for _, value in fills):
        return mask
    level = torch.full_like(mask, float("-inf"))
    covered = torch.zeros_like(mask, dtype=torch.bool)
    for hidden, value in fills:  # the value an entry holds is the last fill applied to it
        level = level.masked_fill(hidden & ~covered, float(value))  # type: ignore[arg-type]
        covered |= hidden
    top = level.amax(dim=-1, keepdim=True)
    alone = (level == top).sum(dim=-1, keepdim=True) == 1
    return mask.masked_fill(empty & alone & (level == top) & torch.isfinite(top), 0.0)


def _scalar(x: Any) -> float | None:
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        return float(x)
    if isinstance(x, torch.Tensor) and x.numel() == 1 and x.is_floating_point() and x.device.type != "meta":
        return float(x)
    return None


def _very_negative(x: Any) -> bool:
    """A fill or floor value that hides a key; on the meta device (no values) any one-number tensor is read so."""
    if isinstance(x, torch.Tensor) and x.numel() == 1 and x.device.type == "meta":
        return True
    v = _scalar(x)
    return v is not None and v <= _HIDDEN


def _zero_one(x: torch.Tensor) -> bool:
    """A tensor of 0 and 1 (OpenAI GPT multiplies its scores by its causal mask); on the meta device, a boolean or
    one with a single head."""
    if x.device.type == "meta":
        return x.dtype == torch.bool or (x.dim() >= 3 and x.shape[-3] == 1)
    return bool(((x == 0) | (x == 1)).all())


def _is_mask(x: torch.Tensor) -> bool:
    """An additive tensor that hides or shows: every value 0 or at most −10⁴ (−∞ included)."""
    if x.dtype == torch.bool:
        return True
    if x.device.type == "meta":  # no values: a tensor with one head (or none) is read as a mask
        return x.dim() >= 3 and x.shape[-3] == 1
    return bool(((x == 0) | (x <= _HIDDEN)).all())


def _additive(hidden: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """0 where a key is seen, −∞ where ``hidden`` (a boolean) hides it, in ``like``'s dtype."""
    dtype = like.dtype if like.is_floating_point() else torch.float32
    return torch.zeros(hidden.shape, dtype=dtype, device=hidden.device).masked_fill(hidden.bool(), float("-inf"))


# -- the probe -------------------------------------------------------------------------------------------------
@dataclass
class Found:
    """One attention found in the probe: the layer it ran in, its module and its reading."""

    layer: tuple[int, int] | None
    module: nn.Module
    reading: Reading


def _deepest_common(stacks: tuple) -> nn.Module | None:
    common = None
    for a, b in zip(*stacks):
        if a is not b:
            break
        common = a
    return common


def probe(hf: nn.Module, lists: dict[int, nn.ModuleList], model_type: str, device: torch.device) -> list[Found]:
    """Two tokens through the model with every op watched: each softmax attention found (its layer, the innermost
    module running both at its scores' product and at its product with V, and its reading). Raises the reason where
    an attention is found that does not read as one (``_Unread``). ``device``: where the token ids go."""
    stack: list[nn.Module] = []
    frames: list[tuple[int, int]] = []
    found: list[Found] = []
    unread: list[tuple[str, str, str]] = []
    handles = []
    layer_of = {id(layer): (key, i) for key, modules in lists.items() for i, layer in enumerate(modules)}

    def enter(module: nn.Module, args: Any) -> None:
        stack.append(module)
        if id(module) in layer_of:
            frames.append(layer_of[id(module)])

    def leave(module: nn.Module, args: Any, output: Any) -> None:
        if stack:
            stack.pop()
        if id(module) in layer_of and frames:
            frames.pop()

    for module in hf.modules():
        handles.append(module.register_forward_pre_hook(enter))
        handles.append(module.register_forward_hook(leave, always_call=True))

    per_layer: dict[tuple[int, int] | None, list[str]] = {}

    def on_attention(watch: _Watch, av: _Node, softmax: _Node) -> None:
        where = frames[0] if frames else None
        per_layer.setdefault(where, []).append(type(stack[-1]).__name__ if stack else "?")
        try:
            reading = watch.read(av, softmax)
        except _Unread as e:
            unread.append((type(stack[-1]).__name__ if stack else "?", str(e), e.reason))
            return None
        module = _deepest_common(reading.where) or (stack[-1] if stack else hf)
        found.append(Found(where, module, reading))
        return None

    tokens = torch.zeros(1, PROBE_TOKENS, dtype=torch.long, device=device)
    try:
        with torch.no_grad(), _Watch(on_attention, stack):
            hf(input_ids=tokens, attention_mask=torch.ones_like(tokens), use_cache=False)
    except HFDecoderError:
        raise
    except Exception as e:  # noqa: BLE001 (transformers' own forward failing is a refusal, never a crash)
        raise HFDecoderError(f"{model_type}: transformers' own forward of this model fails on a two-token input "
                             f"({type(e).__name__}: {str(e)[:300]})", reason="cannot load") from None
    finally:
        for handle in handles:
            handle.remove()
    several = {key: names for key, names in per_layer.items() if key is not None and len(names) > 1}
    if several:  # ProphetNet: its main stream's and its n-gram stream's attention in every layer
        index, names = min((key[1], names) for key, names in several.items())
        raise HFDecoderError(f"{model_type}: layer {index} computes {len(names)} softmax attentions in its own code "
                             f"({', '.join(sorted(set(names)))}: each a softmax whose output multiplies values); the "
                             "trace holds one attention per layer", reason="several attentions per layer")
    if unread:
        where, why, reason = unread[0]
        raise HFDecoderError(f"{model_type}: its attention ({where}) computes a softmax in the family's own code, but "
                             f"{why}, so its Q, K, V and pattern cannot be read from its ops",
                             reason=reason)  # type: ignore[arg-type]
    return found


# -- the hooks of a traced model ------------------------------------------------------------------------------
# a context variable, not a module flag: another session's thread tracing an own-code model at the same time keeps
# its watch
_UNWATCHED: ContextVar[bool] = ContextVar("unwatched", default=False)


@contextmanager
def unwatched() -> Iterator[None]:
    """transformers' forward run beside the trace in this thread (the load guard's reference for generate(), which
    hands XLNet a second attention stream): the family's own attention modules run as written, recording nothing."""
    token = _UNWATCHED.set(True)
    try:
        yield
    finally:
        _UNWATCHED.reset(token)


class OwnAttention:
    """One layer's attention module computed in its own code, its forward watched (``_Watch``) and its one softmax
    attention recorded through the layer's hook points (``_AttentionHooks``) at every forward."""

    def __init__(self, module: nn.Module, hooks: Any, model_type: str, bias: bool = False) -> None:
        self.module = module
        self.hooks = hooks
        self.model_type = model_type
        if bias:  # the probe found a bias (ALiBi, a relative position bias): its own stage, [B, H, n, t]
            from gpt_shape_tracer.model.gpt import HookPoint

            hooks.hook_score_bias = HookPoint()
        self._watch: _Watch | None = None
        self._seen = 0
        self.handles = [module.register_forward_pre_hook(self._enter, with_kwargs=True),
                        module.register_forward_hook(self._leave, always_call=True)]

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()

    def _enter(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        hidden = args[0] if args and isinstance(args[0], torch.Tensor) else kwargs.get("hidden_states")
        batch = int(hidden.shape[0]) if isinstance(hidden, torch.Tensor) and hidden.dim() >= 2 else 1
        self._seen, self._watch = 0, None
        if _UNWATCHED.get():
            return
        self._watch = _Watch(self._record, batch=batch)
        self._watch.__enter__()

    def _leave(self, module: nn.Module, args: tuple, output: Any) -> None:
        watch, self._watch = self._watch, None
        if watch is None:
            return
        watch.__exit__(None, None, None)
        if self._seen != 1:
            raise HFDecoderError(f"{self.model_type}: {type(module).__name__} computed {self._seen} softmax "
                                 "attention(s) in this forward where the probe found one: its pattern cannot be "
                                 "recorded", reason="attention outside the interface")

    def _record(self, watch: _Watch, av: _Node, softmax: _Node) -> torch.Tensor | None:
        try:
            r = watch.read(av, softmax)
        except _Unread as e:
            raise HFDecoderError(f"{self.model_type}: {type(self.module).__name__}'s attention no longer reads as "
                                 f"one softmax attention ({e})", reason="attention outside the interface") from None
        self._seen += 1
        h = self.hooks
        q, k, v = h.receive(r.query, r.key, r.value)
        _unchanged("hook_q, hook_k, hook_v, hook_k_all, hook_v_all", (q, k, v), (r.query, r.key, r.value))
        staged = [(h.hook_qk, r.qk), (h.hook_attn_scores, r.qk * r.scale)]
        if r.bias is not None:
            if not hasattr(h, "hook_score_bias"):
                from gpt_shape_tracer.model.gpt import HookPoint

                h.hook_score_bias = HookPoint()
            staged.append((h.hook_score_bias, r.bias))
        if r.mask is not None:
            staged.append((h.hook_mask, r.mask))
        staged.append((h.hook_masked_scores, r.masked))
        for point, x in staged:
            _unchanged(_point_name(h, point), (point(x),), (x,))
        pattern = h.hook_pattern(r.pattern)
        out = av.out
        if pattern is not r.pattern:  # a hook replaced A: the product with V is taken again with it
            left, value = _operands(av)
            shape = left.shape if r.layout is None else left.permute(r.layout[0]).shape
            swapped = pattern.reshape(shape).to(left.dtype)
            if r.layout is not None:
                swapped = swapped.permute(_inverse(r.layout[0]))
            out = torch.matmul(swapped, value) if av.name != "einsum" else torch.einsum(av.args[0], swapped, value)
            r.z = (out if r.layout is None else out.permute(r.layout[2])).reshape(r.z.shape)
        z = h.hook_z(r.z)
        if z is not r.z:
            if r.layout is None:
                out = z.reshape(out.shape).to(out.dtype)
            else:
                out = z.reshape(out.permute(r.layout[2]).shape).permute(_inverse(r.layout[2])).to(out.dtype)
        return out if out is not av.out else None


def _point_name(hooks: nn.Module, point: nn.Module) -> str:
    return next((name for name, m in hooks.named_children() if m is point), "a hook point")


def _unchanged(names: str, after: tuple, before: tuple) -> None:
    if any(a is not b for a, b in zip(after, before)):
        raise HFDecoderError(f"a forward hook replaced {names} of an attention computed in the family's own code: "
                             "those stages are read after the family computed them, so a change there cannot be "
                             "applied (hook_pattern and hook_z can be changed)")

