"""Train a bundled story model: ``python -m model.training [--family llama]`` (seeded; ~15 min on 2 CPU cores).

1. draw stories from ``model.training`` (train and held-out sets from different seeds);
2. train a byte-level BPE tokenizer on the training stories with ``tokenizers``
   (``--family llama`` loads ``assets/story-gpt/tokenizer.json`` instead, so both
   bundled models share token ids);
3. train a 4-layer model on random 256-token windows of the tokenised stream,
   some of them holding a copy drill (a random token sequence, repeated) or a
   chain drill (each token a fixed function of the one two places back):
   GPT-2 (``assets/story-gpt``) or Llama-style — RoPE, RMSNorm, SwiGLU, 4 query
   heads sharing 2 key/value heads, untied W_U (``assets/story-llama``);
4. measure held-out loss against a unigram baseline, find the clearest
   previous-token and induction heads, and what zeroing each head does to the
   loss on a repeated random sequence;
5. write ``--out`` (config.json, model.safetensors, tokenizer.json,
   training.json) in Hugging Face's layout for the family.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from gpt_shape_tracer.model.analysis import (
    ablation_effects,
    induction_scores,
    previous_token_scores,
    repeated_random_tokens,
)
from gpt_shape_tracer.model.gpt import GPT, GPTConfig, block_attention, rope_inv_freq
from gpt_shape_tracer.model.sources import ASSETS, BUNDLED_DIR, END_OF_TEXT, TextTokenizer, load_hf, save_hf
from gpt_shape_tracer.model.training._corpus import stories

TRAIN_SEED, HELDOUT_SEED = 1, 2


def train_tokenizer(texts: list[str], vocab_size: int) -> TextTokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[END_OF_TEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return TextTokenizer(tok, source="model.train")


def token_stream(tokenizer: TextTokenizer, texts: list[str]) -> torch.Tensor:
    """All stories, each followed by <|endoftext|>, as one long 1-D id tensor."""
    eos = tokenizer.eos_id
    if eos is None:
        raise ValueError(f"{tokenizer.source}: the tokenizer has no <|endoftext|> to end each story with")
    ids: list[int] = []
    for enc in tokenizer.backend.encode_batch(texts, add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


def chain_permutation(vocab: int, size: int, g: torch.Generator) -> torch.Tensor:
    """π for the chain drills: a random permutation of ``size`` token ids, as a lookup table
    (entries outside the chosen ids are unused)."""
    ids = torch.randperm(vocab - 1, generator=g)[:size] + 1
    table = torch.zeros(vocab, dtype=torch.long)
    table[ids] = ids[torch.randperm(size, generator=g)]
    return table


def windows(
    stream: torch.Tensor, length: int, batch: int, g: torch.Generator, vocab: int, drill_rate: float,
    chain_rate: float, chain: torch.Tensor,
) -> torch.Tensor:
    """Random windows of the story stream; some hold a drill that overwrites a random stretch.

    * Copy drill (``drill_rate``): a random token sequence followed by itself.
      The stories alone teach the model to copy their made-up words by lining
      up the two quotations, not by a general induction circuit (a model
      trained on them alone scored 0.02 on the random-token induction test);
      with copy drills "find the earlier occurrence of this token, predict what
      came after it" is the only way to predict the second copy.
    * Chain drill (``chain_rate``): x[i+1] = π(x[i−1]) for a fixed random
      permutation π of 128 token ids. Predicting it needs exactly the token one
      position back — a smeared view of the last few tokens gives the wrong
      answer and nothing repeats for induction to use — which is what a
      previous-token head provides. Without it the model's first layer stayed
      a diffuse smear over the last few positions (best head 0.27 on i−1)."""
    starts = torch.randint(0, stream.numel() - length - 1, (batch,), generator=g)
    rows = torch.stack([stream[s : s + length + 1] for s in starts.tolist()])
    chain_ids = torch.nonzero(chain).flatten()
    for row in range(batch):
        r = torch.rand((), generator=g).item()
        if r < drill_rate:
            half = int(torch.randint(4, 48, (), generator=g))
            at = int(torch.randint(0, length + 1 - 2 * half, (), generator=g))
            segment = torch.randint(1, vocab, (half,), generator=g)
            rows[row, at : at + half] = segment
            rows[row, at + half : at + 2 * half] = segment
        elif r < drill_rate + chain_rate:
            size = int(torch.randint(32, 97, (), generator=g))
            at = int(torch.randint(0, length + 1 - size, (), generator=g))
            seq = chain_ids[torch.randint(0, chain_ids.numel(), (2,), generator=g)].tolist()
            while len(seq) < size:
                seq.append(int(chain[seq[-2]]))
            rows[row, at : at + size] = torch.tensor(seq)
    return rows


@torch.no_grad()
def heldout_loss(model: GPT, stream: torch.Tensor, length: int) -> float:
    model.eval()
    usable = (stream.numel() - 1) // length * length
    x = stream[:usable].view(-1, length)
    y = stream[1 : usable + 1].view(-1, length)
    total, count = 0.0, 0
    for i in range(0, x.size(0), 16):
        logits = model(x[i : i + 16])
        total += F.cross_entropy(logits.flatten(0, 1), y[i : i + 16].flatten(), reduction="sum").item()
        count += y[i : i + 16].numel()
    return total / count


def unigram_loss(train: torch.Tensor, heldout: torch.Tensor, vocab: int) -> float:
    """Cross-entropy of the held-out tokens under the training set's token frequencies (add-one)."""
    counts = torch.bincount(train, minlength=vocab).double() + 1
    logp = (counts / counts.sum()).log()
    return float(-logp[heldout].mean())


def fourier_init_(weight: torch.Tensor, scale: float) -> None:
    """Initialise the learned positional table with sin/cos waves whose frequencies are spread
    evenly over (0, π] radians per position (the table is trained like any other weight).

    A random start leaves layer 0 diffuse, and the usual sinusoids (frequencies ≤ 1 rad per
    position) keep neighbouring positions ~90% alike, so a head cannot tell i−1 from i or i−2
    sharply (our best head stayed at 0.35 on i−1). Frequencies up to π make neighbours nearly
    orthogonal, while "the position one back" is still an exact rotation of "my position" —
    a linear map W_Q, W_K can learn."""
    n_pos, d = weight.shape
    position = torch.arange(n_pos, dtype=torch.float32)[:, None]
    freq = math.pi * (torch.arange(d // 2, dtype=torch.float32) + 0.5) / (d // 2)
    table = torch.zeros(n_pos, d)
    table[:, 0::2] = torch.sin(position * freq)
    table[:, 1::2] = torch.cos(position * freq)
    with torch.no_grad():
        weight.copy_(table * scale)


@torch.no_grad()
def seed_previous_token_head_(model: GPT, layer: int, head: int, pairs: int = 16, target: float = 0.9) -> float:
    """Set one head's W_Q, W_K so that it starts out attending to the previous position.

    With the Fourier positional start, the position part of LN(x_i) holds
    (sin iω, cos iω) pairs; W_Q copies ``pairs`` of them (evenly spread
    frequencies) and W_K rotates each pair one position forward, so
    q_i · k_j ∝ Σ_ω cos((i − 1 − j)·ω), which peaks at j = i − 1. The strength is
    raised until the head puts ``target`` of its weight there at initialisation.
    Training then keeps, reshapes or dissolves it like any other weight; the
    tests measure what the shipped model does. Returns the weight on i−1 at start."""
    cfg = model.config
    attn = block_attention(model, layer)
    d, dh = cfg.d_model, cfg.d_head
    n_freq = d // 2
    chosen = torch.linspace(0, n_freq - 1, pairs).round().long()
    omega = math.pi * (chosen.float() + 0.5) / n_freq
    q_block = torch.zeros(d, dh)
    k_block = torch.zeros(d, dh)
    for m, (f, w) in enumerate(zip(chosen.tolist(), omega.tolist())):
        q_block[2 * f, 2 * m] = 1.0
        q_block[2 * f + 1, 2 * m + 1] = 1.0
        k_block[2 * f, 2 * m] = math.cos(w)
        k_block[2 * f + 1, 2 * m] = math.sin(w)
        k_block[2 * f, 2 * m + 1] = -math.sin(w)
        k_block[2 * f + 1, 2 * m + 1] = math.cos(w)

    def place(strength: float) -> None:
        attn.c_attn.weight[:, head * dh : (head + 1) * dh] = q_block * strength
        attn.c_attn.weight[:, d + head * dh : d + (head + 1) * dh] = k_block * strength
        bias = attn.c_attn.bias  # b_Q, b_K of the head set to 0 (a config without qkv_bias has none to set)
        if bias is not None:
            bias[head * dh : (head + 1) * dh] = 0
            bias[d + head * dh : d + (head + 1) * dh] = 0

    return _strengthen_until(model, layer, head, target, place)


@torch.no_grad()
def seed_rope_previous_token_head_(model: GPT, layer: int, head: int, pairs: int = 4, level: float = 0.1,
                                   target: float = 0.9) -> float:
    """The RoPE version of ``seed_previous_token_head_``: start one head attending to position i − 1.

    With RoPE no position reaches the residual stream, so there is nothing to
    rotate "my position" from; but RoPE itself rotates q and k by their
    positions, so a head only needs the *same* q at every position and a k
    turned one step ahead: with q = s·e and k = R(ω)·q on a rotation pair of
    frequency ω, q_iᵀk_j = s²·cos((j − i + 1)·ω), largest at j = i − 1. The
    constant comes from one residual dimension (0) that every token embedding
    starts at ``level``; W_Q reads it into the first ``pairs`` rotation pairs
    (the highest frequencies, 1, 0.56, 0.32, 0.18 rad per position for
    θ = 10⁴, d_head = 32: several, so that their sum peaks once, not every 2π/ω)
    and W_K writes the same turned by ω. The strength s is raised until the
    head puts ``target`` of its weight on i − 1. Returns that weight at start."""
    cfg = model.config
    attn = block_attention(model, layer)
    H, G, dh = cfg.n_head, cfg.n_kv_heads, cfg.d_head
    half = dh // 2
    kv_head = head // (H // G)  # the key/value head this query head reads (Hugging Face's repeat_kv order)
    omega = rope_inv_freq(cfg)[:pairs]
    model.embed.weight[:, 0] = level
    w = attn.c_attn.weight  # W_QKV: [d, (H+2G)·d_head], columns Q heads | K heads | V heads
    q_cols = [head * dh + m for m in range(pairs)] + [head * dh + half + m for m in range(pairs)]
    k_base = H * dh + kv_head * dh
    k_cols = [k_base + m for m in range(pairs)] + [k_base + half + m for m in range(pairs)]

    def place(strength: float) -> None:
        w[:, q_cols + k_cols] = 0.0
        for m in range(pairs):
            w[0, head * dh + m] = strength  # q: (s, 0) on pair m, at every position
            w[0, k_base + m] = strength * math.cos(omega[m].item())  # k = R(ω_m)·q
            w[0, k_base + half + m] = strength * math.sin(omega[m].item())

    return _strengthen_until(model, layer, head, target, place)


def _strengthen_until(model: GPT, layer: int, head: int, target: float, place: Callable[[float], None]) -> float:
    """``place`` the head's weights at strength 0.5, then ×1.25 each time (below 64), until the head puts
    ``target`` of its weight on position i − 1 of a fixed random probe; that weight."""
    probe = torch.randint(1, model.config.vocab_size, (4, 128), generator=torch.Generator().manual_seed(0))
    strength, weight = 0.5, 0.0
    while strength < 64:
        place(strength)
        weight = previous_token_scores(model, probe)[layer, head].item()
        if weight >= target:
            break
        strength *= 1.25
    return weight


@torch.no_grad()
def snapshot(model: GPT, step: int, loss: float, probe_prev: torch.Tensor, probe_rep: torch.Tensor) -> dict:
    """The best previous-token and induction scores now (on small fixed probes), for the training history."""
    model.eval()
    prev = previous_token_scores(model, probe_prev)
    ind = induction_scores(model, probe_rep, 50)
    return {"step": step, "train_loss": round(loss, 3), "best_previous_token": round(float(prev.max()), 3),
            "best_induction": round(float(ind.max()), 3)}


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", choices=("gpt2", "llama"), default="gpt2")
    ap.add_argument("--out", type=Path, default=None, help="default: assets/story-gpt or assets/story-llama")
    ap.add_argument("--tokenizer", type=Path, default=None,
                    help="reuse this tokenizer.json instead of training one (default for llama: story-gpt's)")
    ap.add_argument("--steps", type=int, default=2800)
    ap.add_argument("--batch", type=int, default=24)
    ap.add_argument("--stories", type=int, default=40000)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--drill-rate", type=float, default=0.2, help="share of windows holding a copy drill")
    ap.add_argument("--chain-rate", type=float, default=0.2, help="share of windows holding a chain drill")
    ap.add_argument("--pos-init", choices=("fourier", "normal"), default="fourier", help="gpt2 only")
    ap.add_argument("--pos-scale", type=float, default=0.3, help="amplitude of the Fourier start")
    ap.add_argument("--seed-head", type=int, nargs=2, default=[0, 0], metavar=("LAYER", "HEAD"),
                    help="start this head as a previous-token head (gpt2: needs --pos-init fourier)")
    ap.add_argument("--no-seed-head", dest="seed_head", action="store_const", const=None)
    ap.add_argument("--init-from", type=Path, default=None,
                    help="start from this checkpoint's weights (a directory train.py wrote) instead of a fresh model")
    ap.add_argument("--history-every", type=int, default=150,
                    help="every this many steps, record the best previous-token and induction scores (0: never)")
    args = ap.parse_args(argv)
    llama = args.family == "llama"
    out_dir = args.out or (ASSETS / "story-llama" if llama else BUNDLED_DIR)
    tokenizer_file = args.tokenizer or (BUNDLED_DIR / "tokenizer.json" if llama else None)

    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    started = time.time()
    train_texts = stories(TRAIN_SEED, args.stories)
    heldout_texts = stories(HELDOUT_SEED, 400)
    if tokenizer_file is not None:
        tokenizer = TextTokenizer.from_file(tokenizer_file)
    else:
        tokenizer = train_tokenizer(train_texts, args.vocab)
    train_ids = token_stream(tokenizer, train_texts)
    heldout_ids = token_stream(tokenizer, heldout_texts)
    print(f"tokenizer: {tokenizer.vocab_size} tokens; train {train_ids.numel():,} tokens, "
          f"held-out {heldout_ids.numel():,}", flush=True)

    if llama:
        # SwiGLU has three d × d_ff matrices to GELU's two: d_ff = 344 ≈ 8d/3 keeps the MLP at GPT-2's 8d² weights
        config = GPTConfig.for_family("llama", vocab_size=tokenizer.vocab_size, n_ctx=256, d_model=128, n_layer=4,
                                      n_head=4, n_kv_head=2, d_mlp=344, layer_norm_eps=1e-5)
    else:
        config = GPTConfig(vocab_size=tokenizer.vocab_size, n_ctx=256, d_model=128, n_layer=4, n_head=4)
    model = GPT(config)
    continued = None
    if args.init_from is not None:  # go on training an earlier run's weights (a fresh optimizer and schedule)

        earlier, _ = load_hf(args.init_from)
        model.load_state_dict(earlier.state_dict())  # strict: the same names and shapes as this run's model
        previous = json.loads((args.init_from / "training.json").read_text(encoding="utf-8"))
        continued = {"from": str(args.init_from), "weights_digest": earlier.identity.weights_digest,
                     "earlier_train": previous.get("train"), "earlier_heldout_loss": previous.get("heldout_loss")}
        args.seed_head = None
    if args.init_from is None and args.pos_init == "fourier" and not llama:
        fourier_init_(model.pos_embed.weight, args.pos_scale)
    seeded = None
    if args.seed_head is not None:
        seed = seed_rope_previous_token_head_ if llama else seed_previous_token_head_
        seeded = seed(model, *args.seed_head)
        print(f"seeded layer {args.seed_head[0]} head {args.seed_head[1]}: weight on i−1 at start {seeded:.3f}")
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95),
    )
    g = torch.Generator().manual_seed(args.seed)
    chain = chain_permutation(config.vocab_size, 128, g)
    if continued is not None:  # the same π as the earlier run, but windows it has not seen
        g.manual_seed(args.seed + 1)
    length = config.n_ctx
    # small fixed probes for the training history: how the two kinds of head grow, step by step
    probe_prev = heldout_ids[: 8 * 128].view(8, 128)
    probe_rep = repeated_random_tokens(config.vocab_size, 50, 8, seed=11, prefix=tokenizer.eos_id)
    history: list[dict] = []
    model.train()
    for step in range(args.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.steps, args.lr, warmup=200)
        batch = windows(train_ids, length, args.batch, g, config.vocab_size, args.drill_rate, args.chain_rate, chain)
        logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 250 == 0 or step == args.steps - 1:
            print(f"step {step:5d}  loss {loss.item():.3f}  {time.time() - started:6.0f}s", flush=True)
        if args.history_every and ((step + 1) % args.history_every == 0 or step == args.steps - 1):
            history.append(snapshot(model, step + 1, loss.item(), probe_prev, probe_rep))
            print(f"  history {history[-1]}", flush=True)
            model.train()
    model.eval()

    heldout = heldout_loss(model, heldout_ids, length)
    unigram = unigram_loss(train_ids, heldout_ids, config.vocab_size)
    heldout_windows = heldout_ids[: (heldout_ids.numel() // 128) * 128].view(-1, 128)[:32]
    prev = previous_token_scores(model, heldout_windows)
    rep = repeated_random_tokens(config.vocab_size, 50, 16, seed=7, prefix=tokenizer.eos_id)
    ind = induction_scores(model, rep, 50)
    best_prev = divmod(int(prev.argmax()), config.n_head)
    best_ind = divmod(int(ind.argmax()), config.n_head)
    rep_ablate = repeated_random_tokens(config.vocab_size, 50, 16, seed=321, prefix=tokenizer.eos_id)
    intact, effects = ablation_effects(model, rep_ablate, 50)
    report = {
        "family": config.family,
        "config": config.to_dict(),
        "parameters": model.num_parameters,
        "train": {
            "stories": args.stories, "tokens": train_ids.numel(), "steps": args.steps, "batch": args.batch,
            "window": length, "lr": args.lr, "weight_decay": args.weight_decay, "seed": args.seed,
            "corpus_seed": TRAIN_SEED,
            "drill_rate": args.drill_rate, "chain_rate": args.chain_rate,
            "pos_init": "rope" if llama else args.pos_init, "tokenizer": str(tokenizer_file or "trained"),
            "pos_scale": args.pos_scale, "seeded_head": args.seed_head, "seeded_weight_at_start": seeded,
            "seconds": round(time.time() - started, 1), "threads": args.threads, "continued": continued,
            "torch": torch.__version__, "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        },
        "heldout": {"stories": len(heldout_texts), "tokens": heldout_ids.numel(), "corpus_seed": HELDOUT_SEED},
        "heldout_loss": round(heldout, 4),
        "unigram_loss": round(unigram, 4),
        "previous_token_head": {"layer": best_prev[0], "head": best_prev[1], "score": round(float(prev.max()), 4)},
        "induction_head": {"layer": best_ind[0], "head": best_ind[1], "score": round(float(ind.max()), 4)},
        "previous_token_scores": [[round(float(v), 3) for v in row] for row in prev],
        "induction_scores": [[round(float(v), 3) for v in row] for row in ind],
        "repeat_loss": round(intact, 3),
        "history": history,
        "ablation_delta_repeat_loss": [[round(float(v), 3) for v in row] for row in effects],
    }
    # each story ends with <|endoftext|> (token_stream): the config declares it, so generation stops there
    ends = {"bos_token_id": tokenizer.eos_id, "eos_token_id": tokenizer.eos_id}
    out = save_hf(model, out_dir, tokenizer, extra=ends)
    (out / "training.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    print(json.dumps({k: report[k] for k in ("heldout_loss", "unigram_loss", "previous_token_head",
                                             "induction_head")}, indent=2))
    return report


if __name__ == "__main__":
    main()
