"""Train the bundled story model: ``python -m model.train`` (seeded; ~15 min on 2 CPU cores).

1. draw stories from ``model.corpus`` (train and held-out sets from different seeds);
2. train a byte-level BPE tokenizer on the training stories with ``tokenizers``;
3. train a 4-layer GPT-2 on random 256-token windows of the tokenised stream,
   a fifth of them holding a copy drill (a random token sequence, repeated);
4. measure held-out loss against a unigram baseline and find the clearest
   previous-token and induction heads;
5. write ``assets/story-gpt/`` (config.json, model.safetensors, tokenizer.json,
   training.json) in Hugging Face's GPT-2 layout.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from model.corpus import stories
from model.gpt import GPT, GPTConfig
from model.heads import induction_scores, previous_token_scores, repeated_random_tokens
from model.loading import BUNDLED_DIR, save_hf_gpt2
from model.tokenizer import END_OF_TEXT, TextTokenizer

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
    ids: list[int] = []
    for enc in tokenizer.backend.encode_batch(texts, add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


def windows(
    stream: torch.Tensor, length: int, batch: int, g: torch.Generator, vocab: int, drill_rate: float
) -> torch.Tensor:
    """Random windows of the story stream; in a ``drill_rate`` share of them a copy drill —
    a random token sequence followed by itself — overwrites a random stretch.

    The stories alone teach the model to copy their made-up words by lining up
    the two quotations, not by a general induction circuit: a model trained on
    them alone scored 0.02 on the random-token induction test. Drills make
    "find the earlier occurrence of this token, predict what came after it" the
    only way to predict the second copy. Half the drills use an alphabet of only
    3–6 tokens: there each token recurs many times, so only the exact previous
    token tells the occurrences apart, which rewards a sharp previous-token head
    over a smeared view of the last few tokens."""
    starts = torch.randint(0, stream.numel() - length - 1, (batch,), generator=g)
    rows = torch.stack([stream[s : s + length + 1] for s in starts.tolist()])
    for row in range(batch):
        if torch.rand((), generator=g).item() >= drill_rate:
            continue
        half = int(torch.randint(4, 48, (), generator=g))
        at = int(torch.randint(0, length + 1 - 2 * half, (), generator=g))
        if torch.rand((), generator=g).item() < 0.5:
            segment = torch.randint(1, vocab, (half,), generator=g)
        else:
            alphabet = torch.randint(1, vocab, (int(torch.randint(3, 7, (), generator=g)),), generator=g)
            segment = alphabet[torch.randint(0, alphabet.numel(), (half,), generator=g)]
        rows[row, at : at + half] = segment
        rows[row, at + half : at + 2 * half] = segment
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


def sinusoid_init_(weight: torch.Tensor, scale: float, base: float = 100.0) -> None:
    """Initialise a learned positional table with sin/cos waves (still trained afterwards).

    With a random start, nearby positions look alike and layer-0 heads stay
    diffuse; sinusoids make "the position just before me" a linear function of
    "my position", so a previous-token head is easy to learn. The base is 100,
    not the usual 10000: over 256 positions that keeps every position distinct
    while most dimensions still change from one position to the next."""
    n_pos, d = weight.shape
    position = torch.arange(n_pos, dtype=torch.float32)[:, None]
    freq = torch.exp(torch.arange(0, d, 2, dtype=torch.float32) * (-math.log(base) / d))
    table = torch.zeros(n_pos, d)
    table[:, 0::2] = torch.sin(position * freq)
    table[:, 1::2] = torch.cos(position * freq)
    with torch.no_grad():
        weight.copy_(table * scale)


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=BUNDLED_DIR)
    ap.add_argument("--steps", type=int, default=2800)
    ap.add_argument("--batch", type=int, default=24)
    ap.add_argument("--stories", type=int, default=40000)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--drill-rate", type=float, default=0.2, help="share of windows holding a copy drill")
    ap.add_argument("--pos-init", choices=("sinusoid", "normal"), default="sinusoid")
    ap.add_argument("--pos-scale", type=float, default=0.1, help="scale of the sinusoidal start")
    ap.add_argument("--pos-base", type=float, default=100.0, help="wavelength base of the sinusoidal start")
    args = ap.parse_args(argv)

    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    started = time.time()
    train_texts = stories(TRAIN_SEED, args.stories)
    heldout_texts = stories(HELDOUT_SEED, 400)
    tokenizer = train_tokenizer(train_texts, args.vocab)
    train_ids = token_stream(tokenizer, train_texts)
    heldout_ids = token_stream(tokenizer, heldout_texts)
    print(f"tokenizer: {tokenizer.vocab_size} tokens; train {train_ids.numel():,} tokens, "
          f"held-out {heldout_ids.numel():,}", flush=True)

    config = GPTConfig(vocab_size=tokenizer.vocab_size, n_ctx=256, d_model=128, n_layer=4, n_head=4)
    model = GPT(config)
    if args.pos_init == "sinusoid":
        sinusoid_init_(model.pos_embed.weight, args.pos_scale, args.pos_base)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95),
    )
    g = torch.Generator().manual_seed(args.seed)
    length = config.n_ctx
    model.train()
    for step in range(args.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.steps, args.lr, warmup=200)
        batch = windows(train_ids, length, args.batch, g, config.vocab_size, args.drill_rate)
        logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 250 == 0 or step == args.steps - 1:
            print(f"step {step:5d}  loss {loss.item():.3f}  {time.time() - started:6.0f}s", flush=True)
    model.eval()

    loss = heldout_loss(model, heldout_ids, length)
    unigram = unigram_loss(train_ids, heldout_ids, config.vocab_size)
    heldout_windows = heldout_ids[: (heldout_ids.numel() // 128) * 128].view(-1, 128)[:32]
    prev = previous_token_scores(model, heldout_windows)
    rep = repeated_random_tokens(config.vocab_size, 50, 16, seed=7, prefix=tokenizer.eos_id)
    ind = induction_scores(model, rep, 50)
    best_prev = divmod(int(prev.argmax()), config.n_head)
    best_ind = divmod(int(ind.argmax()), config.n_head)
    report = {
        "config": {k: getattr(config, k) for k in ("vocab_size", "n_ctx", "d_model", "n_layer", "n_head")},
        "parameters": model.num_parameters,
        "train": {
            "stories": args.stories, "tokens": train_ids.numel(), "steps": args.steps, "batch": args.batch,
            "window": length, "lr": args.lr, "weight_decay": args.weight_decay, "seed": args.seed,
            "corpus_seed": TRAIN_SEED,
            "drill_rate": args.drill_rate, "pos_init": args.pos_init, "pos_scale": args.pos_scale,
            "pos_base": args.pos_base,
            "seconds": round(time.time() - started, 1), "threads": args.threads,
            "torch": torch.__version__, "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        },
        "heldout": {"stories": len(heldout_texts), "tokens": heldout_ids.numel(), "corpus_seed": HELDOUT_SEED},
        "heldout_loss": round(loss, 4),
        "unigram_loss": round(unigram, 4),
        "previous_token_head": {"layer": best_prev[0], "head": best_prev[1], "score": round(float(prev.max()), 4)},
        "induction_head": {"layer": best_ind[0], "head": best_ind[1], "score": round(float(ind.max()), 4)},
        "previous_token_scores": [[round(float(v), 3) for v in row] for row in prev],
        "induction_scores": [[round(float(v), 3) for v in row] for row in ind],
    }
    out = save_hf_gpt2(model, args.out, tokenizer)
    (out / "training.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    print(json.dumps({k: report[k] for k in ("heldout_loss", "unigram_loss", "previous_token_head",
                                             "induction_head")}, indent=2))
    return report


if __name__ == "__main__":
    main()
