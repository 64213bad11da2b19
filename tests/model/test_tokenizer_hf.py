"""Tokenization as transformers does it: special tokens, end-of-sequence ids, chat templates.

Tokenizer directories are built here from the bundled byte-level BPE (1024 tokens) with ``<s>`` (1024) and
``</s>`` (1025) added, in the layouts real repositories use; ``transformers.AutoTokenizer`` on the same
directory is the reference for every id and every rendered chat.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tokenizers import AddedToken, Tokenizer, processors

from gpt_shape_tracer.model import GPT, GPTConfig, ModelLoadError, TextTokenizer, load_bundled, load_hf, save_hf
from gpt_shape_tracer.model.sources import ASSETS, TokenizerConfigError
from gpt_shape_tracer.tracer import GenerationStopped, TracedGeneration

BOS, EOS = "<s>", "</s>"
TEXTS = ["Lily had a red ball.", " Once upon a time\n\nthere was a cat", "a<s>b</s>c", "<|endoftext|>hi",
         "héllo 🙂  x\t", "Tom said, \"Let's go!\""]
CHAT_TEMPLATE = """{%- set ns = namespace(turns=0) -%}
{{ bos_token }}
{% for message in messages %}
    {% if message['role'] not in ['system', 'user', 'assistant'] %}
        {{ raise_exception('unknown role ' + message['role']) }}
    {% endif %}
    {% if message['role'] == 'system' and not loop.first %}{% continue %}{% endif %}
<|{{ message['role'] }}|>
{{ message['content'] | trim }}{{ eos_token }}
    {% set ns.turns = ns.turns + 1 %}
{% endfor %}
{% if add_generation_prompt %}
<|assistant|>
{% endif %}
{{- {'turns': ns.turns} | tojson if ns.turns > 2 else '' -}}
"""


def base_tokenizer() -> Tokenizer:
    tok = Tokenizer.from_file(str(ASSETS / "story-gpt" / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(BOS, special=True, normalized=False),
                            AddedToken(EOS, special=True, normalized=False)])
    return tok


def write_dir(directory: Path, post: str | None = None, config: dict | None = None, files: dict | None = None,
              vocab_merges: bool = False) -> Path:
    """A tokenizer directory: tokenizer.json (with post-processor ``post``) or vocab.json + merges.txt, and the
    config files given."""
    directory.mkdir(parents=True, exist_ok=True)
    tok = base_tokenizer()
    if vocab_merges:
        Tokenizer.from_file(str(ASSETS / "story-gpt" / "tokenizer.json")).model.save(str(directory))
    else:
        if post == "bos":
            tok.post_processor = processors.TemplateProcessing(
                single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, 1024)])
        elif post == "bos-eos":
            tok.post_processor = processors.TemplateProcessing(
                single=f"{BOS} $A {EOS}", pair=f"{BOS} $A {EOS} $B {EOS}", special_tokens=[(BOS, 1024), (EOS, 1025)])
        elif post == "bytelevel":
            tok.post_processor = processors.ByteLevel(trim_offsets=False)
        tok.save(str(directory / "tokenizer.json"))
    if config is not None:
        (directory / "tokenizer_config.json").write_text(json.dumps(config))
    for name, content in (files or {}).items():
        (directory / name).write_text(content if isinstance(content, str) else json.dumps(content))
    return directory


LLAMA_CONFIG = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS}
LAYOUTS = {
    # a Llama-3-style tokenizer.json whose post-processor puts BOS first
    "post-processor-bos": dict(post="bos", config=LLAMA_CONFIG),
    "post-processor-bos-eos": dict(post="bos-eos", config=LLAMA_CONFIG),
    # with tokenizer.json, transformers 5 drops add_bos_token / add_eos_token: the post-processor decides
    "flags-ignored-beside-tokenizer-json": dict(config={**LLAMA_CONFIG, "add_bos_token": True, "add_eos_token": True}),
    "flag-off-ignored-too": dict(post="bos", config={**LLAMA_CONFIG, "add_bos_token": False}),
    "tokens-as-objects": dict(post="bos", config={"bos_token": {"content": BOS, "__type": "AddedToken"},
                                                   "eos_token": {"content": EOS, "__type": "AddedToken"}}),
    "byte-level-post-processor": dict(post="bytelevel", config={}),
    "no-config": dict(),
    # GPT-2's two files: GPT2Tokenizer applies add_bos_token / add_eos_token
    "vocab-merges-bos": dict(vocab_merges=True, config={"tokenizer_class": "GPT2Tokenizer", "add_bos_token": True}),
    "vocab-merges-bos-eos": dict(vocab_merges=True, config={"tokenizer_class": "GPT2Tokenizer", "add_bos_token": True,
                                                            "add_eos_token": True, "eos_token": "<|endoftext|>"}),
    "vocab-merges-legacy-map": dict(vocab_merges=True, config={"tokenizer_class": "GPT2Tokenizer",
                                                               "add_bos_token": True},
                                    files={"special_tokens_map.json": {"bos_token": "<|endoftext|>"}}),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_ids_equal_transformers(tmp_path, layout):
    from transformers import AutoTokenizer

    directory = write_dir(tmp_path / layout, **LAYOUTS[layout])
    reference = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    ours = TextTokenizer.from_directory(directory)
    assert ours is not None
    for text in TEXTS:
        assert ours.encode(text) == reference(text)["input_ids"], text
        assert ours.decode(ours.encode(text, add_special_tokens=False)) == text


def test_a_bos_tokenizer_puts_bos_first_and_the_bundled_ones_do_not(tmp_path):
    ours = TextTokenizer.from_directory(write_dir(tmp_path / "llama", post="bos", config=LLAMA_CONFIG))
    assert ours.encode("Lily") [0] == 1024 and ours.without_special_tokens().encode("Lily")[0] != 1024
    assert ours.special_tokens == {"bos_token": BOS, "eos_token": EOS} and ours.eos_ids == (1025,)
    for name in ("story-gpt", "story-llama"):  # the bundled models: the same ids as before, no BOS added
        from transformers import AutoTokenizer

        _, tok = load_bundled(name)
        raw = Tokenizer.from_file(str(ASSETS / name / "tokenizer.json"))
        reference = AutoTokenizer.from_pretrained(str(ASSETS / name), local_files_only=True)
        for text in TEXTS:
            assert tok.encode(text) == raw.encode(text, add_special_tokens=False).ids == reference(text)["input_ids"]
        # <|endoftext|> (id 0) ends every training story: config.json declares it as end-of-sequence (and pads with it)
        assert tok.eos_ids == (0,) and tok.eos_id == 0


def test_end_of_sequence_ids_come_from_every_file_that_declares_them(tmp_path):
    tokenizer_only = TextTokenizer.from_directory(write_dir(tmp_path / "a", post="bos", config=LLAMA_CONFIG))
    assert tokenizer_only.eos_ids == (1025,) and tokenizer_only.eos_id == 0  # <|endoftext|> still pads
    both = write_dir(tmp_path / "b", config={"bos_token": BOS}, files={
        "generation_config.json": {"eos_token_id": [1025, 0], "bos_token_id": 1024},
        "config.json": {"model_type": "llama", "eos_token_id": 1024},
    })
    assert TextTokenizer.from_directory(both).eos_ids == (1025, 0, 1024)
    nothing = write_dir(tmp_path / "c", config={}, files={"config.json": {"eos_token_id": None}})
    assert TextTokenizer.from_directory(nothing).eos_ids == ()
    junk = write_dir(tmp_path / "d", files={"config.json": {"eos_token_id": [True, "2", -1, 99999, 7]}})
    assert TextTokenizer.from_directory(junk).eos_ids == (7,)  # only ids the tokenizer has
    (tmp_path / "d" / "tokenizer_config.json").write_text("[1, 2]")
    with pytest.raises(TokenizerConfigError, match="expected a JSON object"):
        TextTokenizer.from_directory(tmp_path / "d")


def position_model(vocab_size: int, targets: dict[int, int], default: int) -> GPT:
    """A GPT-2 whose greedy choice depends on the position only: the token chosen at position p is
    ``targets.get(p, default)``. Every block adds zero (its output projections are zero), the token embeddings
    are zero, and position p's embedding is a one-hot on dimension p, which W_U maps to its target."""
    config = GPTConfig(vocab_size=vocab_size, n_ctx=64, d_model=64, n_layer=1, n_head=1, tie_embeddings=False)
    model = GPT(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            is_norm_gain = name.endswith("weight") and (name.startswith("ln_final") or ".ln" in name)
            p.fill_(1.0 if is_norm_gain else 0.0)
        model.pos_embed.weight.copy_(torch.eye(64) * 4)
        for p in range(64):
            model.unembed.weight[p, targets.get(p, default)] = 1.0
    return model


def test_generation_stops_when_every_sequence_has_chosen_eos(tmp_path):
    tok = TextTokenizer.from_directory(write_dir(tmp_path / "tok", post="bos", config=LLAMA_CONFIG))
    prompt = "Lily had a red ball."
    n0 = len(tok.encode(prompt))
    model = position_model(tok.vocab_size, {n0 + 1: 1025}, default=300)  # </s> chosen at step 2
    gen = TracedGeneration(model, tok, prompt, temperature=0)
    assert gen.run(10) == 3 and gen.generated() == (300, 300, 1025)
    assert gen.stopped.startswith("step 2: the model chose '</s>' (id 1025), an end-of-sequence token")
    with pytest.raises(GenerationStopped):
        gen.step()
    going_on = TracedGeneration(model, tok, prompt, temperature=0, stop_at_eos=False)
    assert going_on.run(5) == 5 and not going_on.stopped
    # a batch stops when its last sequence has ended; the one that ended first went on being generated
    other = "Tom ran."
    n1 = len(tok.encode(other))
    assert n1 < n0
    batch = TracedGeneration(model, tok, [prompt, other], temperature=0)
    last = n0 + 1 - n1 + 1  # the step at which the shorter prompt reaches the EOS position
    assert batch.run(20) == last + 1
    assert batch.generated(0)[2] == 1025 and batch.generated(1)[-1] == 1025
    assert f"at steps 2, {last}" in batch.stopped
    # a tokenizer that declares no EOS never stops on a token (the bundled models)
    plain = TextTokenizer(base_tokenizer())
    assert TracedGeneration(model, plain, prompt, temperature=0).run(5) == 5


MESSAGES = [
    {"role": "system", "content": "You tell short stories."},
    {"role": "user", "content": "  Tell me about Lily.  "},
    {"role": "assistant", "content": "Lily had a red ball.", "tool_calls": None},
    {"role": "user", "content": "And Tom?"},
]


@pytest.mark.parametrize("where", ["tokenizer_config", "jinja-file", "named-list"])
def test_the_chat_template_renders_as_transformers_renders_it(tmp_path, where):
    from transformers import AutoTokenizer

    config = dict(LLAMA_CONFIG)
    files = {}
    if where == "tokenizer_config":
        config["chat_template"] = CHAT_TEMPLATE
    elif where == "jinja-file":
        files["chat_template.jinja"] = CHAT_TEMPLATE
    else:
        config["chat_template"] = [{"name": "default", "template": CHAT_TEMPLATE},
                                   {"name": "tool_use", "template": "{{ 'tools' }}"}]
    directory = write_dir(tmp_path / where, post="bos", config=config, files=files)
    reference = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    ours = TextTokenizer.from_directory(directory)
    for messages in (MESSAGES, MESSAGES[1:2], "Tell me a story.", [MESSAGES[0], MESSAGES[3]]):
        as_list = [{"role": "user", "content": messages}] if isinstance(messages, str) else messages
        expected = reference.apply_chat_template(as_list, tokenize=False, add_generation_prompt=True)
        assert ours.apply_chat_template(messages) == expected
        assert ours.apply_chat_template(messages, add_generation_prompt=False) == reference.apply_chat_template(
            as_list, tokenize=False, add_generation_prompt=False)
        # the template wrote <s> itself: encoded without adding another, the ids are transformers' own
        ids = reference.apply_chat_template(as_list, tokenize=True, add_generation_prompt=True)["input_ids"]
        assert ours.without_special_tokens().encode(expected) == ids and ids[0] == 1024 and ids.count(1024) == 1
    with pytest.raises(TokenizerConfigError, match="unknown role tool"):
        ours.apply_chat_template([{"role": "tool", "content": "x"}])


def test_a_template_cannot_reach_python_internals(tmp_path):
    for template in ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "{% set ns = namespace(_x=1) %}",
                     "{{ messages.append(1) }}"):
        directory = write_dir(tmp_path / str(abs(hash(template))), config={"chat_template": template})
        with pytest.raises(TokenizerConfigError, match="the chat template failed"):
            TextTokenizer.from_directory(directory).apply_chat_template("hi")
    with pytest.raises(TokenizerConfigError, match="no chat template"):
        load_bundled()[1].apply_chat_template("hi")


@pytest.mark.parametrize(("template", "bound"), [
    ("{{ 'x' * 5*10**9 }}", "more than 1024 MiB of memory"),
    ("{{ messages|tojson(indent=10**9) }}", "(more than 1024 MiB of memory|did not finish within)"),
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "did not finish within"),
    ("{% for i in range(100000) %}{% for j in range(100000) %}xxxxxxxx{% endfor %}{% endfor %}",
     "passed 100000 characters"),
])
def test_a_template_that_asks_for_gigabytes_or_hours_is_stopped_by_its_bound(tmp_path, monkeypatch, template, bound):
    """The sandbox keeps a template from Python's internals, not from work: each of these raised an untyped
    MemoryError or never returned. The render runs in a child process bounded in memory, time and output, and the
    bound it passed is a TokenizerConfigError (the time and output bounds shortened here, so that the test is quick)."""
    import gpt_shape_tracer.model.sources._chat_render as chat_render

    monkeypatch.setattr(chat_render, "RENDER_SECONDS", 3.0)
    monkeypatch.setattr(chat_render, "RENDER_MAX_CHARS", 100_000)
    directory = write_dir(tmp_path / "t", config={"chat_template": template})
    with pytest.raises(TokenizerConfigError, match=f"the chat template failed: .*{bound}"):
        TextTokenizer.from_directory(directory).apply_chat_template("hi")


def test_load_hf_reads_the_tokenizer_config_beside_the_weights(tmp_path):
    directory = tmp_path / "model"
    save_hf(GPT(GPTConfig(vocab_size=1026, n_ctx=32, d_model=32, n_layer=1, n_head=2)), directory)
    write_dir(directory, post="bos", config={**LLAMA_CONFIG, "chat_template": CHAT_TEMPLATE})
    _, tok = load_hf(directory)
    assert tok.eos_ids == (1025,) and tok.chat_template == CHAT_TEMPLATE and tok.encode("Hi")[0] == 1024
    (directory / "tokenizer_config.json").write_text(json.dumps({"bos_token": 5}))
    with pytest.raises(ModelLoadError, match="bos_token must be a string"):
        load_hf(directory)


def test_the_cli_chats_and_stops_at_eos(tmp_path, capsys, monkeypatch):
    import gpt_shape_tracer.session._choice as choice_module  # the one loader the CLI calls (session.load)
    from gpt_shape_tracer.trace_command import main

    tok = TextTokenizer.from_directory(write_dir(tmp_path / "tok", post="bos",
                                                 config={**LLAMA_CONFIG, "chat_template": CHAT_TEMPLATE}))
    n0 = len(tok.without_special_tokens().encode(tok.apply_chat_template("Hi")))
    chat_model = position_model(1026, {n0: 1025}, default=300)  # </s> at step 1
    monkeypatch.setattr(choice_module, "load_model", lambda spec, **kwargs: (chat_model, tok))
    out = tmp_path / "t.zip"
    code = main(["--prompt", "Hi", "--chat", "--steps", "5", "--model-dir", "anything", "--out", str(out)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "stopped after 2 step(s): step 1: the model chose '</s>'" in captured.err
    assert "text[0]: '<s>\\n<|user|>\\nHi</s>\\n<|assistant|>\\n" in captured.out
    code = main(["--prompt", "Hi", "--chat", "--no-stop-at-eos", "--steps", "4", "--model-dir", "anything",
                 "--out", str(out)])
    captured = capsys.readouterr()
    assert code == 0 and "stopped after" not in captured.err
    code = main(["--prompt", "Hi", "--chat", "--out", str(tmp_path / "u.zip")])  # the bundled model has none
    assert code == 2 and "no chat template" in capsys.readouterr().err
