"""Tokenizers: save one, load any ``tokenizer.json``.

The toy model uses a byte-level BPE trained on the synthetic corpus (:mod:`qmtp.tiny.corpus`) by
:func:`qmtp.tiny.bpe.train_bpe`; the real Qwen3.6 checkpoint ships its own byte-level BPE in
``tokenizer.json``. Both load through :meth:`Tokenizer.from_dir`, which needs only the HuggingFace
``tokenizers`` library, not ``transformers``.

Byte-level BPE maps every byte to a token before merging, so any string round-trips:
``decode(encode(s)) == s`` (for the Qwen tokenizer, up to its NFC normalisation).

A tokenizer loaded from a model directory also carries the model's chat template, if it has one
(:meth:`Tokenizer.apply_chat_template`, rendered as transformers renders it: :mod:`qmtp.chat`).
"""

from __future__ import annotations

import codecs
import json
import os
import warnings
from collections.abc import Iterable, Sequence
from pathlib import Path

import tokenizers
from tokenizers import decoders

from qmtp.checkpoint import open_regular, read_json, write_atomic
from . import chat
from .errors import CheckpointError, TemplateError, TemplateRefusedError, UsageError

__all__ = ["EOS_TOKEN", "Tokenizer", "save"]

EOS_TOKEN = "<|endoftext|>"
TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
MAX_TOKENIZER_BYTES = 256 * 1024 * 1024  # Qwen's tokenizer.json is about 11 MB


def save(
    tokenizer: tokenizers.Tokenizer | Tokenizer,
    directory: str | os.PathLike[str],
    *,
    eos_token: str = EOS_TOKEN,
    model_max_length: int = 2048,
) -> Path:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` into ``directory``; return it.

    The config names ``PreTrainedTokenizerFast``, so ``transformers.AutoTokenizer`` accepts the
    directory; ``eos_token`` is also the padding token (the toy model has no other special
    token). Each file is written to a temporary file and moved into place with ``os.replace``,
    so a reader never sees half a file. The directory is created if needed.
    """
    raw = tokenizer.backend if isinstance(tokenizer, Tokenizer) else tokenizer
    if not isinstance(raw, tokenizers.Tokenizer):
        raise UsageError(f"expected a tokenizers.Tokenizer or qmtp Tokenizer, got {type(tokenizer).__name__}")
    eos_id = raw.token_to_id(eos_token)
    if eos_id is None:
        raise UsageError(f"eos_token {eos_token!r} is not in the tokenizer's vocabulary")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)

    added = {
        str(t_id): {
            "content": t.content,
            "lstrip": t.lstrip,
            "normalized": t.normalized,
            "rstrip": t.rstrip,
            "single_word": t.single_word,
            "special": t.special,
        }
        for t_id, t in sorted(raw.get_added_tokens_decoder().items())
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "bos_token": None,
        "eos_token": eos_token,
        "pad_token": eos_token,
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
    }
    write_atomic(directory / TOKENIZER_FILE, raw.to_str(pretty=True).encode("utf-8"))
    write_atomic(
        directory / CONFIG_FILE,
        (json.dumps(config, indent=2, ensure_ascii=False) + "\n").encode("utf-8"),
    )
    return directory


def _token_content(value: object) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


class Tokenizer:
    """A loaded tokenizer: ``encode`` text to ids and ``decode`` ids back.

    Wraps a ``tokenizers.Tokenizer``; ``backend`` exposes it for anything not covered here.
    """

    def __init__(self, backend: tokenizers.Tokenizer, config: dict | None = None,
                 chat_template: str | None = None) -> None:
        if not isinstance(backend, tokenizers.Tokenizer):
            raise UsageError(f"expected a tokenizers.Tokenizer, got {type(backend).__name__}")
        if chat_template is not None and not isinstance(chat_template, str):
            raise UsageError(f"chat_template: give the template's text, not {type(chat_template).__name__}")
        self.backend = backend
        self.config = dict(config or {})
        self._eos_id = self._find_eos_id()
        # The Jinja text of the chat template: given, else the config's `chat_template` (from_dir also reads
        # chat_template.jinja, which wins as in transformers); None when the model has none.
        self.chat_template = chat_template if chat_template is not None else chat.load_template(None, self.config)
        self.source: Path | None = None  # the directory it was loaded from, named in errors

    @classmethod
    def from_dir(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """Load ``tokenizer.json`` (and ``tokenizer_config.json`` if present) from a model directory.

        Works for the toy model's directory and for the Qwen3.6 checkpoint directory alike.
        """
        directory = Path(path)
        if not directory.is_dir():
            raise CheckpointError(f"{directory}: not a directory (expected a model directory holding {TOKENIZER_FILE})")
        tok_path = directory / TOKENIZER_FILE
        if not tok_path.exists() and not tok_path.is_symlink():
            raise CheckpointError(f"{directory}: missing {TOKENIZER_FILE} (looked for {tok_path})")
        _refuse_dangling(tok_path)
        with open_regular(tok_path, what=TOKENIZER_FILE) as f:  # a FIFO or a folder: one line, no hang
            data = f.read(MAX_TOKENIZER_BYTES + 1)
        if len(data) > MAX_TOKENIZER_BYTES:
            raise CheckpointError(f"{tok_path}: more than {MAX_TOKENIZER_BYTES} bytes, too large for a tokenizer")
        try:
            backend = tokenizers.Tokenizer.from_str(data.decode("utf-8"))
        except Exception as exc:  # the Rust side raises plain Exception on bad JSON
            raise CheckpointError(f"{tok_path}: cannot load tokenizer: {exc}") from exc
        config: dict = {}
        cfg_path = directory / CONFIG_FILE
        if cfg_path.exists() or cfg_path.is_symlink():
            loaded = read_json(cfg_path, what=CONFIG_FILE)
            if not isinstance(loaded, dict):
                raise CheckpointError(f"{cfg_path}: expected a JSON object, got {type(loaded).__name__}")
            config = loaded
        tokenizer = cls(backend, config, chat.load_template(directory, config))
        tokenizer.source = directory
        return tokenizer

    @classmethod
    def check_dir(cls, path: str | os.PathLike[str], vocab_size: int) -> Tokenizer | None:
        """The directory's tokenizer, parsed and checked against the model's vocabulary (doctor and convert
        refuse a tokenizer.json chat could not use); None when there is no tokenizer.json at all."""
        tok_path = Path(path) / TOKENIZER_FILE
        if not tok_path.exists() and not tok_path.is_symlink():
            return None
        tokenizer = cls.from_dir(path)
        with warnings.catch_warnings():  # a much smaller tokenizer works: `load` warns about it, once
            warnings.simplefilter("ignore")
            tokenizer.check_fits(vocab_size, path)
        return tokenizer

    def check_fits(self, vocab_size: int, where) -> None:
        """Refuse a tokenizer of more ids than the model's embedding has rows (its ids would index past the
        embedding); warn when it has far fewer (Qwen pads 248,077 ids to 248,320 rows, under 1% spare), since
        then the model can generate ids that decode to no text."""
        if self.vocab_size > vocab_size:
            raise CheckpointError(f"{where}: tokenizer.json has {self.vocab_size} ids but the model's vocabulary has "
                                  f"{vocab_size}: the tokenizer is another model's")
        if self.vocab_size < vocab_size * 0.9:
            import warnings

            warnings.warn(f"{where}: tokenizer.json has {self.vocab_size} ids but the embedding has {vocab_size} "
                          f"rows: any generated id from {self.vocab_size} up decodes to no text (another model's "
                          f"tokenizer?)", stacklevel=3)

    def _find_eos_id(self) -> int | None:
        eos = self.backend.token_to_id(EOS_TOKEN)
        if eos is not None:
            return eos
        name = _token_content(self.config.get("eos_token"))
        if name is not None:
            return self.backend.token_to_id(name)
        return None

    @property
    def eos_id(self) -> int | None:
        """Id of ``<|endoftext|>`` if the vocabulary has it, else of the config's ``eos_token``, else None.

        ``<|endoftext|>`` is the document separator in both the toy corpus and Qwen's
        pre-training data. (Qwen's chat template ends a turn with ``<|im_end|>`` instead; that is
        a different question from where a document ends.)
        """
        return self._eos_id

    @property
    def end_ids(self) -> frozenset[int]:
        """Ids that end a generation as far as the tokenizer knows, ``<|endoftext|>`` and the config's
        ``eos_token`` (Qwen3.6's is ``<|im_end|>``, which ends a chat turn). `qmtp.chat.end_ids` adds the
        checkpoint's generation_config.json."""
        ids = {self._eos_id, self._config_token_id("eos_token")}
        return frozenset(i for i in ids if i is not None)

    @property
    def special_tokens(self) -> dict[str, str]:
        """The named special tokens of tokenizer_config.json (eos_token, pad_token, ...) that are set; a chat
        template sees them as variables, as in transformers."""
        found = {name: _token_content(self.config.get(name)) for name in chat.SPECIAL_TOKENS}
        return {name: text for name, text in found.items() if text is not None}

    def _config_token_id(self, name: str) -> int | None:
        text = _token_content(self.config.get(name))
        return self.backend.token_to_id(text) if text is not None else None

    def apply_chat_template(self, messages, add_generation_prompt: bool = True, enable_thinking: bool | None = None,
                            tokenize: bool = False, *, tools=None, documents=None, chat_template: str | None = None,
                            **kwargs):
        """The prompt of a conversation: `messages` ([{"role": "user", "content": "..."}, ...]) rendered by the
        model's chat template exactly as transformers' `apply_chat_template(..., tokenize=False)` renders them;
        with `tokenize`, its token ids (special-token text mapped to its ids, nothing added).

        Unlike transformers, `add_generation_prompt` defaults to True (a prompt to generate from).
        `enable_thinking`: None leaves it to the template (Qwen: thinking on), False asks for no thinking.
        `tools`: JSON schemas; `chat_template`: a template's text to use instead of the model's; other keyword
        arguments (e.g. Qwen3.6's `preserve_thinking=True`, which keeps earlier turns' thinking) are the
        template's variables. A model without a template raises UsageError (give a prompt string instead)."""
        template = self._template(chat_template)
        for name, value in (("add_generation_prompt", add_generation_prompt), ("tokenize", tokenize)):
            if not isinstance(value, bool):
                raise UsageError(f"{name}={value!r:.40} must be True or False")
        if enable_thinking is not None:
            if not isinstance(enable_thinking, bool):  # the template tests `enable_thinking is false`
                raise UsageError(f"enable_thinking={enable_thinking!r:.40} must be True, False or None")
            kwargs["enable_thinking"] = enable_thinking
        clash = next((name for name in ("messages", "template", "special_tokens") if name in kwargs), None)
        if clash is not None:
            raise UsageError(f"{clash} cannot be a template variable here: apply_chat_template sets it")
        try:
            text = chat.render(template, messages, tools=tools, documents=documents,
                               add_generation_prompt=add_generation_prompt, special_tokens=self.special_tokens,
                               **kwargs)
        except (TemplateError, TemplateRefusedError, CheckpointError) as err:  # the template's doing: say whose
            raise type(err)(f"{self._template_name(chat_template)}: {err}") from None
        return self.encode(text) if tokenize else text

    def _template(self, chat_template: str | None) -> str:
        """The template text to render: `chat_template` (a template's text, or the name of one of
        tokenizer_config.json's named templates), else the model's."""
        named = chat.named_templates(self.config)
        if chat_template is None:
            if self.chat_template is not None:
                return self.chat_template
            where = f"{self.source}: " if self.source is not None else ""
            if named:
                raise UsageError(f"{where}{CONFIG_FILE} names its chat templates {', '.join(map(repr, named))} but "
                                 f"none 'default': pass chat_template=NAME to choose one, or give the prompt as text")
            raise UsageError(f"{where}the tokenizer has no chat template (no {chat.TEMPLATE_FILE}, no chat_template "
                             f"in {CONFIG_FILE}): give the prompt as text or token ids instead of messages")
        if not isinstance(chat_template, str):
            raise UsageError(f"chat_template: give the template's text, not {type(chat_template).__name__}")
        return named.get(chat_template, chat_template)

    def _template_name(self, chat_template: str | None) -> str:
        """The template as an error names it: its file, its name in tokenizer_config.json, or 'the given one'."""
        if chat_template is not None:
            return (f"chat template {chat_template!r:.40}" if chat_template in chat.named_templates(self.config)
                    else "the given chat_template")
        if self.source is None:
            return "the tokenizer's chat template"
        jinja = self.source / chat.TEMPLATE_FILE
        return str(jinja) if jinja.exists() else f"{self.source / CONFIG_FILE} (chat_template)"

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added (special) tokens included."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; no BOS/EOS is added. Special-token strings in ``text`` map to their ids."""
        if not isinstance(text, str):
            raise UsageError(f"encode expects a str, got {type(text).__name__}")
        if not text.isascii():
            chat.refuse_surrogates(text, "the text to encode")
        return self.backend.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """:meth:`encode` for many texts at once (parallel in the Rust library)."""
        if isinstance(texts, str):
            raise UsageError("encode_batch expects a sequence of strings, not a single string")
        for i, text in enumerate(texts):
            if isinstance(text, str) and not text.isascii():
                chat.refuse_surrogates(text, f"texts[{i}]")
        return [e.ids for e in self.backend.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids``; special tokens are kept, so ``decode(encode(s)) == s``."""
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=False)

    def ends_mid_character(self, ids: Sequence[int]) -> bool:
        """Whether the text of ``ids`` ends inside a character: its last bytes begin a UTF-8 sequence that
        more tokens would complete (``decode`` shows them as U+FFFD until they come, and shows a U+FFFD that
        is in the text, or bytes that can start no character, the same way). Judged on the bytes for a
        byte-level BPE (Qwen's, the bundled model's); otherwise, as tokenizers' DecodeStream judges it, by
        a trailing U+FFFD."""
        if not isinstance(self.backend.decoder, decoders.ByteLevel):
            return self.decode(ids).endswith("\ufffd")
        tail = b""
        for token_id in reversed(list(ids)):  # an unfinished character is at most 3 bytes: the last 4 suffice
            tail = _token_bytes(self.backend.id_to_token(int(token_id)) or "") + tail
            if len(tail) >= 4:
                break
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        decoder.decode(tail[-4:])
        return bool(decoder.getstate()[0])

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def __repr__(self) -> str:
        return f"Tokenizer(vocab_size={self.vocab_size}, eos_id={self.eos_id})"


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's character for each byte (GPT-2's table), inverted: character -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
                 *range(ord("\xae"), ord("\xff") + 1)]
    shifted = [b for b in range(256) if b not in printable]
    table = {chr(b): b for b in printable}
    table.update({chr(256 + n): b for n, b in enumerate(shifted)})
    return table


_BYTE_OF = _byte_level_alphabet()


def _token_bytes(token: str) -> bytes:
    """The bytes a byte-level decoder makes of one token: its characters through the table, or, if one is not
    in it (an added token's text), its UTF-8 bytes (as the tokenizers library does)."""
    if all(c in _BYTE_OF for c in token):
        return bytes(_BYTE_OF[c] for c in token)
    return token.encode("utf-8")


def _refuse_dangling(path: Path) -> None:
    """A symbolic link to nothing is not a missing file: say where it points."""
    if path.is_symlink():
        try:
            os.stat(path)
        except FileNotFoundError:
            raise CheckpointError(f"{path}: is a dangling symbolic link to {os.readlink(path)} (nothing is "
                                  f"there); fix the link or copy the file in its place") from None
        except OSError:
            pass  # a loop or a permission: open_regular says which
