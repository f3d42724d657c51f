"""Tokenizer rebuilt from a GGUF's ``tokenizer.ggml.*`` keys with the ``tokenizers`` library.

- ``gpt2``: byte-level BPE (tokens are GPT-2 byte-to-unicode strings, ``merges`` ranked in
  order), split first by the regex that ``tokenizer.ggml.pre`` names (llama.cpp's names).
- ``llama``: SentencePiece-style BPE over scores: a pair merges when the merged piece is in
  the vocabulary, highest score first (merges derived from the scores, as llama.cpp's SPM
  tokenizer does), ``▁`` for spaces, unknown bytes as ``<0xXX>`` tokens.

Control and user-defined tokens are matched whole in the input text; control tokens (BOS,
EOS, chat markers) decode to nothing, as in llama.cpp's default detokenization.
``TextStream`` turns a growing token sequence into text pieces (``offload run``'s stdout,
``offload serve``'s chunks).
"""
from __future__ import annotations

from collections.abc import Mapping

from gguf import Keys, TokenType
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as _HFTokenizer

from offload.errors import OffloadError
from offload.gguf_header import LazyArray

# tokenizer.ggml.pre → pre-tokenizer split regex (llama.cpp's llama-vocab.cpp)
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
           r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
          r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# o200k (gpt-oss's tokenizer.json split; llama.cpp's "gpt-4o"): case-aware words with the
# contraction attached, numbers in threes, punctuation runs with trailing newlines or "/"
_GPT4O = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZERS = {
    "default": _GPT2, "gpt-2": _GPT2,
    "llama3": _LLAMA3, "llama-v3": _LLAMA3, "llama-bpe": _LLAMA3, "glm4": _LLAMA3, "chatglm-bpe": _LLAMA3,
    "qwen2": _QWEN2, "qwen3": _QWEN2, "gpt-4o": _GPT4O,
}


class Tokenizer:
    def __init__(self, tok: _HFTokenizer, *, bos_id: int | None, eos_ids: frozenset[int], add_bos: bool):
        self._tok, self.bos_id, self.eos_ids, self.add_bos = tok, bos_id, eos_ids, add_bos

    @property
    def n_vocab(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, *, add_bos: bool = True) -> list[int]:
        """Token ids; BOS first when the model asks for it and ``add_bos`` allows it (a chat
        template that writes the BOS itself turns it off)."""
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return ([self.bos_id] if add_bos and self.add_bos and self.bos_id is not None else []) + ids

    def decode(self, ids, *, special: bool = False) -> str:
        """Text of ``ids``; control tokens dropped unless ``special`` (tool-call markers can be
        special tokens)."""
        return self._tok.decode(list(ids), skip_special_tokens=not special)

    def to_json(self) -> str:
        """The tokenizer as ``tokenizers`` JSON (``tokenizer.json``, which transformers'
        ``PreTrainedTokenizerFast`` loads: clients that count tokens, such as lm-eval)."""
        return self._tok.to_str()

    def piece(self, token_id: int) -> str:
        """One token decoded alone, special tokens kept (logprobs name tokens by it; a byte
        token cut from its character decodes as U+FFFD)."""
        return self._tok.decode([token_id], skip_special_tokens=False)

    def token_text(self, token_id: int | None) -> str:
        """A token's own text as written in prompts (``<|endoftext|>``), "" for None."""
        return "" if token_id is None else self._tok.id_to_token(token_id) or ""

    @classmethod
    def from_gguf(cls, metadata: Mapping) -> "Tokenizer":
        meta = {k: v.values() if isinstance(v, LazyArray) else v
                for k, v in metadata.items() if k.startswith("tokenizer.ggml.")}
        kind = meta.get(Keys.Tokenizer.MODEL)
        tokens = meta.get(Keys.Tokenizer.LIST)
        if kind is None or tokens is None:
            raise OffloadError("the model file has no tokenizer (tokenizer.ggml.model / tokens missing)")
        types = meta.get(Keys.Tokenizer.TOKEN_TYPE) or [TokenType.NORMAL] * len(tokens)
        _check_arrays(meta, tokens, types)
        if kind not in ("gpt2", "llama"):
            raise OffloadError(f"unsupported tokenizer model {kind!r} (supported: gpt2, llama)")
        try:
            if kind == "gpt2":
                tok, add_bos_default = _byte_level_bpe(meta, tokens), False
            else:
                tok, add_bos_default = _sentencepiece_bpe(meta, tokens, types), True
            tok.add_tokens([AddedToken(t, special=ty == TokenType.CONTROL, normalized=False)
                            for t, ty in zip(tokens, types)
                            if ty in (TokenType.CONTROL, TokenType.USER_DEFINED)])
        except OffloadError:
            raise
        except Exception as exc:  # noqa: BLE001 — the tokenizers library raises bare Exception
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise OffloadError(f"the model file's tokenizer is inconsistent: {first}") from None
        eos = {meta.get(k) for k in (Keys.Tokenizer.EOS_ID, Keys.Tokenizer.EOT_ID, Keys.Tokenizer.EOM_ID)}
        for k in (Keys.Tokenizer.BOS_ID, Keys.Tokenizer.EOS_ID, Keys.Tokenizer.EOT_ID, Keys.Tokenizer.EOM_ID):
            v = meta.get(k)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < len(tokens)):
                raise OffloadError(f"metadata key {k} is {v!r}, not a token id (0 .. {len(tokens) - 1})")
        return cls(tok, bos_id=meta.get(Keys.Tokenizer.BOS_ID),
                   eos_ids=frozenset(int(i) for i in eos if i is not None),
                   add_bos=bool(meta.get(Keys.Tokenizer.ADD_BOS, add_bos_default)))


class TextStream:
    """The text of a growing token sequence, piece by piece as it becomes valid UTF-8: decodes
    the new tokens behind a few already-returned ones and keeps what follows their text (a
    SentencePiece decoder drops the leading space of whatever it decodes first, so the new
    tokens alone would lose theirs); holds back an incomplete multi-byte character."""

    CONTEXT = 8                 # tokens looked back for a context that decodes cleanly

    def __init__(self, detokenize):
        self.detokenize = detokenize
        self.ids: list[int] = []
        self.start = 0          # ids before this are returned; only a short context is re-decoded

    def _new_text(self) -> str:
        # the context must decode to whole characters on its own (not a byte token cut from
        # its character, not only control tokens), else it would not be a prefix of the text
        for ctx in range(self.start - 1, max(self.start - self.CONTEXT, 0) - 1, -1):
            head = self.detokenize(self.ids[ctx:self.start])
            if head and "\ufffd" not in head:
                text = self.detokenize(self.ids[ctx:])
                if text.startswith(head):
                    return text[len(head):]
        return self.detokenize(self.ids[self.start:])

    def push(self, tok: int) -> str:
        """The new text that ``tok`` completes ("" while a character is incomplete)."""
        self.ids.append(tok)
        piece = self._new_text()
        if not piece or piece.endswith("\ufffd"):   # nothing yet (a space the decoder strips
            return ""                                 # when first, a control token) or half a character
        self.start = len(self.ids)
        return piece

    def close(self) -> str:
        """What is left (an incomplete character decodes as U+FFFD)."""
        piece = self._new_text()
        self.start = len(self.ids)
        return piece


def _check_arrays(meta: dict, tokens, types) -> None:
    """The tokenizer arrays have the types and lengths GGUF gives them (one line otherwise)."""
    T = Keys.Tokenizer
    if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens):
        raise OffloadError(f"metadata key {T.LIST} must be a list of strings")
    if not isinstance(types, list) or len(types) != len(tokens) or \
            not all(isinstance(t, int) and not isinstance(t, bool) for t in types):
        raise OffloadError(f"metadata key {T.TOKEN_TYPE} must be {len(tokens)} integers, one per token")
    merges = meta.get(T.MERGES) or []
    if not isinstance(merges, list) or not all(isinstance(m, str) and " " in m for m in merges):
        raise OffloadError(f"metadata key {T.MERGES} must be a list of 'left right' strings")
    scores = meta.get(T.SCORES)
    if scores is not None and (not isinstance(scores, list) or len(scores) != len(tokens)):
        raise OffloadError(f"metadata key {T.SCORES} must hold one score per token")


def _byte_level_bpe(meta: dict, tokens: list[str]) -> _HFTokenizer:
    pre = meta.get(Keys.Tokenizer.PRE, "default")
    if pre not in PRE_TOKENIZERS:
        raise OffloadError(f"unsupported pre-tokenizer {pre!r} (supported: {', '.join(sorted(PRE_TOKENIZERS))})")
    merges = [tuple(m.split(" ", 1)) for m in meta.get(Keys.Tokenizer.MERGES) or []]
    tok = _HFTokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                                  ignore_merges=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRE_TOKENIZERS[pre]), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece_bpe(meta: dict, tokens: list[str], types: list[int]) -> _HFTokenizer:
    scores = meta.get(Keys.Tokenizer.SCORES) or [0.0] * len(tokens)
    vocab = {t: i for i, t in enumerate(tokens)}
    # every split of a vocabulary piece into two vocabulary pieces is a merge, ranked by the
    # merged piece's score (higher first), ties by id — SentencePiece's BPE order
    ranked = []
    for t, i in vocab.items():
        if types[i] != TokenType.NORMAL or len(t) < 2:
            continue
        for k in range(1, len(t)):
            if t[:k] in vocab and t[k:] in vocab:
                ranked.append((-scores[i], i, k, (t[:k], t[k:])))
    merges = [m for *_, m in sorted(ranked)]
    unk = next((tokens[i] for i, ty in enumerate(types) if ty == TokenType.UNKNOWN), None)
    tok = _HFTokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=unk, byte_fallback=True,
                                  fuse_unk=True))
    prefix = bool(meta.get(Keys.Tokenizer.ADD_PREFIX, True))
    tok.normalizer = normalizers.Sequence(([normalizers.Prepend("▁")] if prefix else []) +
                                          [normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()] +
                                    ([decoders.Strip(" ", 1, 0)] if prefix else []))
    return tok
