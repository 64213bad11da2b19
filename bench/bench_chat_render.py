"""What the bounded chat-template render costs: ``python bench/bench_chat_render.py [--repeats 10]``.

The same Llama-style template and chat, rendered (1) in this process by jinja2's sandbox, as before the bound,
and (2) by ``render_chat_template``: a child process bounded in memory, time and output (its cache bypassed, so
every render starts a process), alternated; the ratio is printed. A chat prompt is rendered once per generation.
"""

from __future__ import annotations

import argparse
import time

from common import machine, median, save

from gpt_shape_tracer.model.sources import compile_chat_template, forget_rendered_chats, render_chat_template

TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
            "{% else %}{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}")
CHAT = [{"role": "user", "content": "Tell me a story about a red kite."},
        {"role": "assistant", "content": "Lily had a red kite."}, {"role": "user", "content": "Go on."}]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()
    variables = {"messages": CHAT, "bos_token": "<s>", "eos_token": "</s>", "add_generation_prompt": True}
    in_process, bounded = [], []
    for _ in range(args.repeats):
        forget_rendered_chats()
        t0 = time.perf_counter()
        a = compile_chat_template(TEMPLATE).render(**variables)
        t1 = time.perf_counter()
        b = render_chat_template(TEMPLATE, **variables)
        t2 = time.perf_counter()
        assert a == b
        in_process.append(t1 - t0)
        bounded.append(t2 - t1)
    result = {"machine": machine(), "repeats": args.repeats, "in_process_ms": median(in_process) * 1e3,
              "bounded_process_ms": median(bounded) * 1e3}
    result["ratio"] = result["bounded_process_ms"] / result["in_process_ms"]
    print(f"in process (sandbox only): {result['in_process_ms']:.2f} ms   bounded child process: "
          f"{result['bounded_process_ms']:.0f} ms   ratio {result['ratio']:.0f}×  (median of {args.repeats})")
    save("bench_chat_render", result)


if __name__ == "__main__":
    main()
