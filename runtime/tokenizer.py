"""A byte-level BPE tokenizer rebuilt from GGUF metadata, with streaming detokenization.

Theory of operation
-------------------
A GGUF file of a GPT-2-style model (``tokenizer.ggml.model == "gpt2"``) carries the whole
tokenizer: the token strings (in GPT-2's byte-to-unicode alphabet, so a space is ``Ġ``), the
merge list in rank order, a type per token (normal, control, user-defined, ...), and a
pre-tokenizer name (``tokenizer.ggml.pre``) that selects the regex splitting text into words
before merging. The ``tokenizers`` package assembles the same pipeline Hugging Face would load
from ``tokenizer.json``; control tokens become special added tokens, so ``<|im_start|>`` in a
prompt is one token and ``skip_special_tokens`` drops it on the way out.

Streaming: one token may end in the middle of a multi-byte UTF-8 character (emoji are often
split over two or three tokens). :class:`IncrementalDetokenizer` maps each token id straight to
its bytes and feeds them through an incremental UTF-8 decoder, so each step returns exactly the
characters completed so far and the concatenated deltas equal ``decode(all_ids)``.
"""

from __future__ import annotations

import codecs
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from functools import cache
from typing import TYPE_CHECKING, Any

from .gguf_loader import open_gguf, read_field

if TYPE_CHECKING:
    import gguf
    import tokenizers

__all__ = ["IncrementalDetokenizer", "Tokenizer"]

# gguf.TokenType values (constants.py); spelled out so this module imports without gguf.
_TOKEN_NORMAL = 1
_TOKEN_CONTROL = 3
_TOKEN_USER_DEFINED = 4

# Pre-tokenizer names (llama.cpp's tokenizer.ggml.pre) known to split text like StarCoder:
# single digits first, then the GPT-2 word regex. SmolLM2's tokenizer.json has exactly
# Sequence[Digits(individual_digits=True), ByteLevel(add_prefix_space=False)].
_STARCODER_LIKE = frozenset({"smollm", "starcoder", "refact", "codeshell"})
_GPT2_LIKE = frozenset({"default", "gpt2", "gpt-2"})
# Llama 3's split regex, applied before a regex-free ByteLevel step.
_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
    r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SUPPORTED_PRE = _STARCODER_LIKE | _GPT2_LIKE | {"llama-bpe"}

# SmolLM2-Instruct's template inserts this system turn when the conversation has none; we read
# the actual text from the file's template when it follows that pattern.
_DEFAULT_SYSTEM_RE = re.compile(
    r"messages\[0\]\['role'\] != 'system'.*?<\|im_start\|>system\n(.*?)<\|im_end\|>", re.S
)


@cache
def _unicode_to_byte() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode: printable stand-ins back to raw bytes."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("\xa1"), ord("\xac") + 1),
        *range(ord("\xae"), ord("\xff") + 1),
    ]
    mapping = {chr(b): b for b in printable}
    shift = 0
    for b in range(256):
        if b not in printable:
            mapping[chr(256 + shift)] = b
            shift += 1
    return mapping


def _build_backend(
    tokens: Sequence[str], merges: Sequence[str], pre: str, types: Sequence[int]
) -> tokenizers.Tokenizer:
    try:
        from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
        from tokenizers import Tokenizer as HFTokenizer
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            "the GGUF tokenizer needs the `tokenizers` package: pip install 'enginewire[gguf]'"
        ) from exc

    vocab = {tok: i for i, tok in enumerate(tokens)}
    # Byte-level tokens never contain a literal space (it is spelled Ġ), so one split suffices.
    pairs = [(left, right) for left, _, right in (m.partition(" ") for m in merges)]
    backend = HFTokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _STARCODER_LIKE:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    elif pre in _GPT2_LIKE:
        backend.pre_tokenizer = byte_level
    else:  # llama-bpe
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_LLAMA3_REGEX), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(
        [
            AddedToken(tok, special=True, normalized=False)
            for tok, kind in zip(tokens, types, strict=True)
            if kind == _TOKEN_CONTROL
        ]
    )
    backend.add_tokens(
        [
            AddedToken(tok, special=False, normalized=False)
            for tok, kind in zip(tokens, types, strict=True)
            if kind == _TOKEN_USER_DEFINED
        ]
    )
    return backend


class Tokenizer:
    """Byte-level BPE tokenizer; build it with :meth:`from_gguf`."""

    def __init__(
        self,
        tokens: Sequence[str],
        merges: Sequence[str],
        token_types: Sequence[int],
        *,
        pre: str = "default",
        bos_token_id: int | None = None,
        eos_token_id: int | None = None,
        add_bos_token: bool = False,
        default_system_prompt: str | None = None,
    ) -> None:
        if pre not in _SUPPORTED_PRE:
            raise ValueError(
                f"unsupported GGUF pre-tokenizer {pre!r}; supported: {sorted(_SUPPORTED_PRE)}"
            )
        if len(token_types) != len(tokens):
            raise ValueError(f"{len(tokens)} tokens but {len(token_types)} token types")
        self._tokens = list(tokens)
        self._types = list(token_types)
        self._backend = _build_backend(self._tokens, merges, pre, self._types)
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.add_bos_token = add_bos_token
        self.default_system_prompt = default_system_prompt
        self.special_ids = frozenset(
            i for i, kind in enumerate(self._types) if kind == _TOKEN_CONTROL
        )
        self._bytes_cache: dict[int, bytes] = {}

    @classmethod
    def from_gguf(cls, source: str | os.PathLike[str] | gguf.GGUFReader) -> Tokenizer:
        """Build from a GGUF file (path) or an already-parsed reader (saves re-parsing)."""
        reader = open_gguf(source) if isinstance(source, str | os.PathLike) else source
        kind = read_field(reader, "tokenizer.ggml.model")
        if kind != "gpt2":
            raise ValueError(
                f"unsupported GGUF tokenizer model {kind!r}; only byte-level BPE ('gpt2') is"
            )
        tokens = read_field(reader, "tokenizer.ggml.tokens")
        types = read_field(reader, "tokenizer.ggml.token_type", [_TOKEN_NORMAL] * len(tokens))
        template = read_field(reader, "tokenizer.chat_template", "")
        system = _DEFAULT_SYSTEM_RE.search(template)
        return cls(
            tokens,
            read_field(reader, "tokenizer.ggml.merges"),
            types,
            pre=read_field(reader, "tokenizer.ggml.pre", "default"),
            bos_token_id=read_field(reader, "tokenizer.ggml.bos_token_id", None),
            eos_token_id=read_field(reader, "tokenizer.ggml.eos_token_id", None),
            add_bos_token=bool(read_field(reader, "tokenizer.ggml.add_bos_token", False)),
            default_system_prompt=system.group(1) if system else None,
        )

    def __repr__(self) -> str:
        return f"<Tokenizer vocab={self.vocab_size} eos={self.eos_token_id}>"

    @property
    def vocab_size(self) -> int:
        return len(self._tokens)

    def id_to_token(self, token_id: int) -> str:
        return self._tokens[token_id]

    def encode(self, text: str, *, add_bos: bool | None = None) -> list[int]:
        """Token ids for `text`; control tokens spelled in the text map to their ids.

        `add_bos` defaults to the file's tokenizer.ggml.add_bos_token.
        """
        ids: list[int] = self._backend.encode(text, add_special_tokens=False).ids
        bos = self.add_bos_token if add_bos is None else add_bos
        if bos and self.bos_token_id is not None:
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes one token stands for (control tokens: their UTF-8 spelling)."""
        cached = self._bytes_cache.get(token_id)
        if cached is not None:
            return cached
        token = self._tokens[token_id]
        table = _unicode_to_byte()
        if self._types[token_id] in (_TOKEN_CONTROL, _TOKEN_USER_DEFINED) or any(
            ch not in table for ch in token
        ):
            # Same fallback as tokenizers' ByteLevel decoder: take the text as written.
            raw = token.encode("utf-8")
        else:
            raw = bytes(table[ch] for ch in token)
        self._bytes_cache[token_id] = raw
        return raw

    def incremental(self, *, skip_special_tokens: bool = True) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True
    ) -> str:
        """Render ChatML as SmolLM2-Instruct's template does.

        ``<|im_start|>{role}\\n{content}<|im_end|>\\n`` per message, preceded by the file's
        default system turn when the first message is not a system message, and followed by
        ``<|im_start|>assistant\\n`` when `add_generation_prompt`.
        """
        parts: list[str] = []
        if self.default_system_prompt is not None and (
            not messages or messages[0]["role"] != "system"
        ):
            parts.append(f"<|im_start|>system\n{self.default_system_prompt}<|im_end|>\n")
        for message in messages:
            parts.append(f"<|im_start|>{message['role']}\n{message['content']}<|im_end|>\n")
        if add_generation_prompt:
            parts.append("<|im_start|>assistant\n")
        return "".join(parts)


class IncrementalDetokenizer:
    """Turns token ids into text deltas as they arrive, never splitting a UTF-8 character.

    ``"".join(deltas) + flush()`` equals ``tokenizer.decode(ids)`` for the same ids.
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._pieces: list[str] = []

    def push(self, token_id: int) -> str:
        """Add one token; return the newly completed text (possibly empty)."""
        if self._skip and token_id in self._tokenizer.special_ids:
            return ""
        delta: str = self._decoder.decode(self._tokenizer.token_bytes(token_id))
        if delta:
            self._pieces.append(delta)
        return delta

    def extend(self, token_ids: Iterable[int]) -> str:
        return "".join(self.push(t) for t in token_ids)

    def flush(self) -> str:
        """End of stream: bytes of an unfinished character come out as U+FFFD."""
        delta: str = self._decoder.decode(b"", final=True)
        if delta:
            self._pieces.append(delta)
        return delta

    @property
    def text(self) -> str:
        """All text returned so far."""
        return "".join(self._pieces)
