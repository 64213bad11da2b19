"""Text ⇄ token ids, through Hugging Face's ``tokenizers`` (byte-level BPE).

Byte-level BPE maps every UTF-8 byte to a symbol first, so any text — emoji,
other scripts, control characters, NUL — encodes, and decoding the ids gives
the text back. A single token may hold part of a multi-byte character; the
display label of such a token shows those bytes as ``\\xNN``.

A model directory says more than ``tokenizer.json`` alone (``TextTokenizer.from_directory``):
which special tokens a text starts or ends with (a Llama tokenizer puts BOS first),
which ids end a sequence (``eos_ids``, where generation stops) and how a chat is
written (``chat_template``). The rules are transformers 5's, so that ``encode`` gives
the ids ``AutoTokenizer.from_pretrained(dir)(text)["input_ids"]`` gives:

* with ``tokenizer.json``, its post-processor decides the special tokens; transformers
  ignores ``add_bos_token`` / ``add_eos_token`` in ``tokenizer_config.json`` then;
* with ``vocab.json`` + ``merges.txt`` (GPT-2's two files, read as ``GPT2Tokenizer``),
  ``add_bos_token`` / ``add_eos_token`` put ``bos_token`` / ``eos_token`` around the text.

Where we stop short of transformers: a named special token the vocabulary lacks is not
added as a new id (transformers appends one), and a ``tokenizer_class`` whose constructor
rebuilds the pipeline from scratch (``LlamaTokenizer`` for a SentencePiece-style vocabulary)
is read as its ``tokenizer.json`` says, which is what such repositories ship.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

from gpt_shape_tracer.model.sources._chat_render import ChatTemplateError, render_chat_template
from gpt_shape_tracer.model.sources._common import ModelLoadError, read_json_object

END_OF_TEXT = "<|endoftext|>"
# transformers' named special tokens (PreTrainedTokenizerBase.SPECIAL_TOKENS_ATTRIBUTES): what a chat template sees
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
MAX_TOKENIZER_CONFIG_BYTES = 16 << 20  # tokenizer_config.json holds added tokens and chat templates: MBs at most
GPT2_DEFAULT_SPECIAL = END_OF_TEXT  # GPT2Tokenizer's bos, eos and unk when tokenizer_config.json names none


class TokenizerConfigError(ValueError):
    """A tokenizer's configuration file that cannot be used; the message names the file and the problem."""


@lru_cache(maxsize=1)
def _unicode_to_byte() -> dict[str, int]:
    """Inverse of GPT-2's ``bytes_to_unicode`` table used by byte-level BPE."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    codes = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            codes.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, codes)}


class TextTokenizer:
    """A thin wrapper naming the few operations the project needs.

    ``special_tokens``: the named special tokens as text (``{"bos_token": "<s>", …}``), what a chat
    template sees. ``eos_ids``: the ids the model's files declare as ending a sequence (empty when they
    declare none: generation then never stops on a token). ``eos_id``: one id to pad with and to start
    probe sequences with — ``<|endoftext|>`` where the vocabulary has it (as always), else the first
    of ``eos_ids``. ``add_special_tokens``: whether ``encode`` adds what the post-processor adds (BOS …);
    ``without_special_tokens()`` gives the same tokenizer with it off, for text a chat template wrote."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        source: str = "",
        *,
        special_tokens: Mapping[str, str] | None = None,
        eos_ids: Iterable[int] = (),
        chat_template: str | None = None,
        add_special_tokens: bool = True,
    ) -> None:
        self._tok = tokenizer
        self.source = source
        self.vocab_size: int = tokenizer.get_vocab_size(with_added_tokens=True)
        self.special_tokens: dict[str, str] = dict(special_tokens or {})
        self.eos_ids: tuple[int, ...] = tuple(dict.fromkeys(int(i) for i in eos_ids))
        eot = tokenizer.token_to_id(END_OF_TEXT)
        self.eos_id: int | None = eot if eot is not None else (self.eos_ids[0] if self.eos_ids else None)
        self.chat_template = chat_template
        self.add_special_tokens = add_special_tokens

    @classmethod
    def from_file(cls, path: str | Path) -> TextTokenizer:
        """Load a ``tokenizer.json`` written by ``tokenizers`` / ``save_pretrained`` (its post-processor
        included: ``encode`` adds the special tokens it adds, as transformers does)."""
        return cls(Tokenizer.from_file(str(path)), source=str(path))

    @classmethod
    def from_vocab_merges(cls, vocab: str | Path, merges: str | Path) -> TextTokenizer:
        """GPT-2's original pair of files: ``vocab.json`` and ``merges.txt``."""
        return cls(_vocab_merges_backend(Path(vocab), Path(merges)), source=f"{vocab} + {merges}")

    @classmethod
    def from_directory(cls, directory: str | Path,
                       model_config: Mapping[str, Any] | None = None) -> TextTokenizer | None:
        """The tokenizer of a model directory as transformers reads it, or None when it has none.

        Reads ``tokenizer.json`` (or ``vocab.json`` + ``merges.txt``), and beside it, where present,
        ``tokenizer_config.json`` (named special tokens, ``add_bos_token`` / ``add_eos_token``, the chat
        template), ``special_tokens_map.json`` (older repositories' special tokens),
        ``chat_template.jinja`` (transformers 5 writes the template there) and, for the ids that end
        a sequence, ``generation_config.json`` and ``config.json`` (``model_config``, when the caller
        has read it already). Raises ``TokenizerConfigError`` for a file that is there but unusable."""
        directory = Path(directory)
        tok_json, vocab, merges = directory / "tokenizer.json", directory / "vocab.json", directory / "merges.txt"
        if not tok_json.is_file() and not (vocab.is_file() and merges.is_file()):
            return None
        config = _read_json_file(directory / "tokenizer_config.json")
        special = _named_special_tokens(config, directory / "tokenizer_config.json")
        if "added_tokens_decoder" not in config:  # transformers reads the legacy file only then
            legacy = _read_json_file(directory / "special_tokens_map.json")
            for name, value in _named_special_tokens(legacy, directory / "special_tokens_map.json").items():
                special.setdefault(name, value)
        declared = dict(special)  # what the files name, before GPT2Tokenizer's defaults below
        if tok_json.is_file():
            backend, source = Tokenizer.from_file(str(tok_json)), str(tok_json)
        else:
            backend, source = _vocab_merges_backend(vocab, merges), f"{vocab} + {merges}"
            for name in ("bos_token", "eos_token", "unk_token"):
                special.setdefault(name, GPT2_DEFAULT_SPECIAL)
            backend.post_processor = _template_processing(
                backend, special, _flag(config, "add_bos_token"), _flag(config, "add_eos_token"))
        extra = config.get("extra_special_tokens", config.get("additional_special_tokens")) or []
        extra_names = [_token_text(t) for t in (extra.values() if isinstance(extra, dict) else extra)]
        _mark_special(backend, [*special.values(), *(t for t in extra_names if t)])
        generation = _read_json_file(directory / "generation_config.json")
        if model_config is None:
            model_config = _read_json_file(directory / "config.json")
        eos_ids = _eos_ids(backend, declared, generation, model_config)
        return cls(backend, source=source, special_tokens=special, eos_ids=eos_ids,
                   chat_template=_chat_template(directory, config))

    def without_special_tokens(self) -> TextTokenizer:
        """The same tokenizer, ``encode`` adding no special tokens: for text that already holds them, as a
        chat template's output does (transformers tokenizes a rendered chat with add_special_tokens=False)."""
        return TextTokenizer(self._tok, self.source, special_tokens=self.special_tokens, eos_ids=self.eos_ids,
                             chat_template=self.chat_template, add_special_tokens=False)

    def encode(self, text: str, add_special_tokens: bool | None = None) -> list[int]:
        """Token ids of ``text``, with the special tokens the post-processor adds (BOS for a Llama tokenizer,
        none for GPT-2's) unless ``add_special_tokens`` (default: the tokenizer's setting) is False."""
        add = self.add_special_tokens if add_special_tokens is None else add_special_tokens
        return self._tok.encode(text, add_special_tokens=add).ids

    def apply_chat_template(self, messages: str | Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                            **variables: Any) -> str:
        """The model's chat template rendered for ``messages`` (a list of ``{"role", "content"}``, or one user
        text), as ``transformers``' ``apply_chat_template(messages, tokenize=False, add_generation_prompt=True)``
        writes it. The template is code from the model's author: it runs in jinja2's immutable sandbox, with the
        same globals transformers gives it (``raise_exception``, ``strftime_now``, ``namespace``, ``tojson``), in a
        separate process bounded in time, memory and output (``render_chat_template``)."""
        if self.chat_template is None:
            raise TokenizerConfigError(
                f"{self.source or 'this tokenizer'}: no chat template (looked for chat_template.jinja and "
                "\"chat_template\" in tokenizer_config.json); a base model is prompted with plain text")
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        chat = []
        for message in messages:
            if not isinstance(message, Mapping):
                raise TypeError(f"a chat message is a mapping with 'role' and 'content', got {message!r}")
            chat.append({str(k): _plain(v) for k, v in message.items() if v is not None})
        variables = {**self.special_tokens, **{k: _plain(v) for k, v in variables.items()}}
        try:
            return render_chat_template(self.chat_template, messages=chat, tools=None, documents=None,
                                        add_generation_prompt=add_generation_prompt, **variables)
        except ChatTemplateError as e:
            raise TokenizerConfigError(f"{self.source}: the chat template failed: {e}") from None

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids``; ids this tokenizer does not know (a model whose
        vocabulary is larger than its tokenizer's) show as ``⟨id⟩``."""
        known: list[int] = []
        parts: list[str] = []
        for i in ids:
            if 0 <= i < self.vocab_size:
                known.append(int(i))
            else:
                if known:
                    parts.append(self._tok.decode(known, skip_special_tokens=False))
                    known = []
                parts.append(f"⟨{int(i)}⟩")
        if known:
            parts.append(self._tok.decode(known, skip_special_tokens=False))
        return "".join(parts)

    def token_bytes(self, token_id: int) -> bytes | None:
        """The raw bytes a byte-level token stands for (None for unknown or special ids)."""
        piece = self._tok.id_to_token(int(token_id))
        if piece is None:
            return None
        table = _unicode_to_byte()
        if not all(ch in table for ch in piece):
            return None
        return bytes(table[ch] for ch in piece)

    def token_label(self, token_id: int) -> str:
        """One token as a person should see it: its text, with bytes that are not
        a whole UTF-8 character shown as ``\\xNN`` and control characters escaped."""
        raw = self.token_bytes(token_id)
        if raw is None:
            piece = self._tok.id_to_token(int(token_id))
            return piece if piece is not None else f"⟨{int(token_id)}⟩"
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            return "".join(f"\\x{b:02x}" if b >= 0x80 else _escape_char(chr(b)) for b in raw)
        return "".join(_escape_char(ch) for ch in text)

    def save(self, path: str | Path) -> None:
        self._tok.save(str(path))

    @property
    def backend(self) -> Tokenizer:
        return self._tok


# ---- reading a directory's tokenizer files ---------------------------------------------------------------------


def _vocab_merges_backend(vocab: Path, merges: Path) -> Tokenizer:
    """A byte-level BPE from GPT-2's vocab.json + merges.txt, as ``GPT2Tokenizer`` builds it."""
    tok = Tokenizer(models.BPE.from_file(str(vocab), str(merges)))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    with open(vocab, encoding="utf-8") as f:
        if END_OF_TEXT in json.load(f):
            tok.add_special_tokens([END_OF_TEXT])
    return tok


def _read_json_file(path: Path) -> dict:
    """A small JSON object file, or ``{}`` when there is none."""
    if not path.is_file():
        return {}
    return read_json_object(path, MAX_TOKENIZER_CONFIG_BYTES, "a config file", TokenizerConfigError)


def _token_text(value: object) -> str | None:
    """A special token as written in a config: a string, or an AddedToken object ``{"content": …}``."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _named_special_tokens(config: dict, path: Path) -> dict[str, str]:
    special: dict[str, str] = {}
    for name in SPECIAL_TOKEN_NAMES:
        value = config.get(name)
        if value is None:
            continue
        text = _token_text(value)
        if text is None:
            raise TokenizerConfigError(f"{path}: {name} must be a string or an object with \"content\", got {value!r}")
        special[name] = text
    return special


def _flag(config: dict, name: str) -> bool:
    value = config.get(name, False)
    return value if isinstance(value, bool) else False


def _template_processing(backend: Tokenizer, special: Mapping[str, str], add_bos: bool,
                         add_eos: bool) -> processors.TemplateProcessing:
    """transformers' ``update_post_processor``: [BOS] $A [EOS], each only when asked for and in the vocabulary."""
    bos, eos = special.get("bos_token"), special.get("eos_token")
    bos_id = backend.token_to_id(bos) if add_bos and bos is not None else None
    eos_id = backend.token_to_id(eos) if add_eos and eos is not None else None
    single = " ".join([*([f"{bos}:0"] if bos_id is not None else []), "$A:0",
                       *([f"{eos}:0"] if eos_id is not None else [])])
    pair = single + " " + " ".join([*([f"{bos}:1"] if bos_id is not None else []), "$B:1",
                                    *([f"{eos}:1"] if eos_id is not None else [])])
    tokens = [(t, i) for t, i in ((bos, bos_id), (eos, eos_id)) if i is not None]
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=tokens)


def _mark_special(backend: Tokenizer, texts: Iterable[str]) -> None:
    """Named special tokens the vocabulary holds but ``tokenizer.json`` does not list as added tokens become
    special added tokens (matched whole in text), as transformers makes them; absent ones are not created."""
    added = {t.content for t in backend.get_added_tokens_decoder().values()}
    missing = [t for t in dict.fromkeys(texts) if t not in added and backend.token_to_id(t) is not None]
    if missing:
        backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in missing])


def _ids_of(value: object) -> list[int]:
    """``eos_token_id`` as config files write it: an int, a list of ints, or null."""
    values = value if isinstance(value, list) else [value]
    return [v for v in values if isinstance(v, int) and not isinstance(v, bool) and v >= 0]


def _eos_ids(backend: Tokenizer, special: Mapping[str, str], generation: Mapping[str, Any],
             model_config: Mapping[str, Any]) -> list[int]:
    """Every id the directory's files declare as ending a sequence: generation_config.json's and config.json's
    ``eos_token_id`` (what transformers' ``generate`` stops on) and tokenizer_config.json's ``eos_token`` (a chat
    model's end of turn, which its config.json sometimes omits). A directory that declares none stops nowhere."""
    size = backend.get_vocab_size(with_added_tokens=True)
    ids = _ids_of(generation.get("eos_token_id")) + _ids_of(model_config.get("eos_token_id"))
    eos = special.get("eos_token")
    eos_id = backend.token_to_id(eos) if eos is not None else None
    if eos_id is not None:
        ids.append(eos_id)
    return [i for i in dict.fromkeys(ids) if i < size]


def _chat_template(directory: Path, config: Mapping[str, Any]) -> str | None:
    """chat_template.jinja (transformers 5) before tokenizer_config.json's ``chat_template`` (a string, or a list
    of ``{"name", "template"}`` of which "default" is the one used)."""
    jinja = directory / "chat_template.jinja"
    if jinja.is_file():
        if jinja.stat().st_size > MAX_TOKENIZER_CONFIG_BYTES:
            raise TokenizerConfigError(f"{jinja}: far too large for a chat template")
        return jinja.read_text(encoding="utf-8")
    value = config.get("chat_template")
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        value = named.get("default")
    return value if isinstance(value, str) else None


def _plain(value: Any) -> Any:
    """Only plain JSON values reach a template (transformers' ``_plain_template_data``): no object whose methods
    the sandbox does not know."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return f"<{type(value).__name__}>"


def _escape_char(ch: str) -> str:
    if ch == "\n":
        return "\\n"
    if ch == "\t":
        return "\\t"
    if ord(ch) < 0x20 or ord(ch) == 0x7F:
        return f"\\x{ord(ch):02x}"
    if not ch.isprintable():  # format and separator characters: zero-width, bidi overrides, no-break space …
        return f"\\u{ord(ch):04x}" if ord(ch) <= 0xFFFF else f"\\U{ord(ch):08x}"
    return ch


def directory_tokenizer(directory: Path, vocab_size: int | None) -> TextTokenizer | None:
    """The directory's tokenizer as transformers reads it (special tokens, end-of-sequence ids, chat template:
    ``TextTokenizer.from_directory``), or None when it has none. ``vocab_size`` None: read before the weights
    (a corrupt tokenizer.json is named before gigabytes are read), its size checked after (``fitting_vocab``)."""
    tok_json = directory / "tokenizer.json"
    try:
        tok = TextTokenizer.from_directory(directory)
    except TokenizerConfigError as e:
        raise ModelLoadError(str(e)) from None
    except Exception as e:  # tokenizers raises plain Exception subclasses from Rust
        source = tok_json if tok_json.is_file() else directory / "vocab.json"
        raise ModelLoadError(f"{source}: not a readable tokenizer ({e})") from None
    return tok if vocab_size is None else fitting_vocab(tok, vocab_size)


def fitting_vocab(tok: TextTokenizer | None, vocab_size: int) -> TextTokenizer | None:
    """``tok``, refused when it knows more ids than the model's ``vocab_size``."""
    if tok is not None and tok.vocab_size > vocab_size:
        raise ModelLoadError(
            f"{tok.source}: the tokenizer has {tok.vocab_size} tokens but the model's vocab_size is {vocab_size}"
        )
    return tok



def load_tokenizer(path: str | os.PathLike, vocab_size: int, *, required: bool = True) -> TextTokenizer | None:
    """A tokenizer from ``path``: a directory (its tokenizer.json or vocab.json + merges.txt, and the config files
    beside them), a ``tokenizer.json`` / ``vocab.json`` (read with its directory's config files), or any other
    ``tokenizers`` JSON file. None when a directory has none and ``required`` is False; a ``ModelLoadError`` when
    it is required, or when the tokenizer knows more ids than the model's ``vocab_size``."""
    p = Path(path).expanduser()
    if p.is_file() and p.name not in ("tokenizer.json", "vocab.json"):
        try:
            tok = TextTokenizer.from_file(p)
        except Exception as e:  # tokenizers raises plain Exception subclasses from Rust
            raise ModelLoadError(f"{p}: not a readable tokenizer ({e})") from None
        if tok.vocab_size > vocab_size:
            raise ModelLoadError(f"{p}: the tokenizer has {tok.vocab_size} tokens but the model's vocab_size is "
                                 f"{vocab_size}")
        return tok
    directory = p.parent if p.is_file() else p
    if not directory.is_dir():
        raise ModelLoadError(f"{p}: no such tokenizer file or directory")
    found = directory_tokenizer(directory.resolve(), vocab_size)
    if found is None and required:
        raise ModelLoadError(f"{p}: no tokenizer here (looked for tokenizer.json, and vocab.json + merges.txt)")
    return found
