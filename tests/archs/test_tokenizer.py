"""Tokenizer rebuilt from tokenizer.ggml.* keys: known answers on hand-made vocabularies
(expected ids derived by hand from the merge rules) and encode/decode round trips."""
from __future__ import annotations

import pytest
from gguf import Keys, TokenType

from offload.errors import OffloadError
from offload.tokenizer import TextStream, Tokenizer
from tests.tiny_models import bytes_to_unicode, tiny_vocab

TEXTS = ["def the(self):\n    return x", "héllo wörld 日本語 🙂\t\n", "  leading and trailing  ", "x123 4567"]


def gpt2_meta(pre="gpt-2"):
    tokens, merges, types = tiny_vocab()
    return {Keys.Tokenizer.MODEL: "gpt2", Keys.Tokenizer.PRE: pre, Keys.Tokenizer.LIST: tokens,
            Keys.Tokenizer.MERGES: merges, Keys.Tokenizer.TOKEN_TYPE: types,
            Keys.Tokenizer.BOS_ID: len(tokens) - 1, Keys.Tokenizer.EOS_ID: len(tokens) - 1}


def test_byte_level_bpe_known_answer():
    meta = gpt2_meta()
    tok = Tokenizer.from_gguf(meta)
    vocab = meta[Keys.Tokenizer.LIST]
    g = bytes_to_unicode()[ord(" ")]   # 'Ġ'
    # "the" and " def" are built by the merge list; "!" is a lone byte token
    assert tok.encode("the def!") == [vocab.index("the"), vocab.index(g + "def"), vocab.index("!")]
    # the control token is matched whole, not split into bytes, and decodes to nothing
    eot = len(vocab) - 1
    assert tok.encode("<|endoftext|>the") == [eot, vocab.index("the")]
    assert tok.decode([eot, vocab.index("the")]) == "the"
    assert tok.eos_ids == {eot} and not tok.add_bos


@pytest.mark.parametrize("pre", ["gpt-2", "qwen2", "llama-bpe", "glm4", "gpt-4o"])
def test_byte_level_bpe_round_trips(pre):
    tok = Tokenizer.from_gguf(gpt2_meta(pre))
    for text in TEXTS:
        assert tok.decode(tok.encode(text)) == text


def test_pre_tokenizer_regex_is_the_named_one():
    """GPT-2's regex keeps a digit run together, Qwen2's splits digits one by one: with a
    vocabulary holding a merged "12", only the GPT-2 split can produce it."""
    meta = gpt2_meta()
    meta[Keys.Tokenizer.LIST] = meta[Keys.Tokenizer.LIST][:-1] + ["12", "<|endoftext|>"]
    meta[Keys.Tokenizer.MERGES] = meta[Keys.Tokenizer.MERGES] + ["1 2"]
    meta[Keys.Tokenizer.TOKEN_TYPE] = meta[Keys.Tokenizer.TOKEN_TYPE][:-1] + [TokenType.NORMAL, TokenType.CONTROL]
    twelve = len(meta[Keys.Tokenizer.LIST]) - 2
    assert Tokenizer.from_gguf(meta).encode("12") == [twelve]
    meta[Keys.Tokenizer.PRE] = "qwen2"
    assert Tokenizer.from_gguf(meta).encode("12") == [meta[Keys.Tokenizer.LIST].index("1"),
                                                     meta[Keys.Tokenizer.LIST].index("2")]


def spm_meta():
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL] + [TokenType.BYTE] * 256
    pieces = {"▁ab": -1.0, "ab": -2.0, "▁a": -3.0, "bc": -4.0, "abc": -5.0,
              "▁": -10.0, "a": -11.0, "b": -12.0, "c": -13.0}
    scores = [0.0] * len(tokens) + list(pieces.values())
    tokens += list(pieces)
    types += [TokenType.NORMAL] * len(pieces)
    return {Keys.Tokenizer.MODEL: "llama", Keys.Tokenizer.LIST: tokens, Keys.Tokenizer.SCORES: scores,
            Keys.Tokenizer.TOKEN_TYPE: types, Keys.Tokenizer.BOS_ID: 1, Keys.Tokenizer.EOS_ID: 2}


def test_sentencepiece_known_answer():
    meta = spm_meta()
    tok = Tokenizer.from_gguf(meta)
    v = meta[Keys.Tokenizer.LIST].index
    # "▁ab▁abc": a+b (score -2) first, then ▁+ab (-1), again for the second word; "▁ab"+"c"
    # is not a piece, so c stays alone. BOS is added by default for this tokenizer type.
    assert tok.encode("ab abc") == [1, v("▁ab"), v("▁ab"), v("c")]
    # bytes without a piece fall back to <0xXX> tokens
    assert tok.encode("a€") == [1, v("▁a"), v("<0xE2>"), v("<0x82>"), v("<0xAC>")]


def test_sentencepiece_round_trips():
    tok = Tokenizer.from_gguf(spm_meta())
    for text in ["ab abc", "cab bca  x€ 日本", "abc"]:
        assert tok.decode(tok.encode(text)) == text


def test_unsupported_tokenizers_are_named():
    with pytest.raises(OffloadError, match="pre-tokenizer 'tekken'.*supported: .*gpt-2"):
        Tokenizer.from_gguf(gpt2_meta("tekken"))
    meta = gpt2_meta()
    meta[Keys.Tokenizer.MODEL] = "rwkv"
    with pytest.raises(OffloadError, match="tokenizer model 'rwkv'"):
        Tokenizer.from_gguf(meta)


@pytest.mark.parametrize("meta", [spm_meta, gpt2_meta], ids=["sentencepiece", "byte-level"])
def test_streamed_text_is_the_whole_decode(meta):
    """``TextStream`` (offload run's stdout, offload serve's chunks) gives, piece by piece, the
    text of decoding everything at once: spaces kept where a SentencePiece decoder strips the
    first one, multi-byte characters split over byte tokens held back until whole."""
    tok = Tokenizer.from_gguf(meta())
    for text in ["ab abc", "cab bca  x€ 日本", "  leading and trailing  ", *TEXTS]:
        ids = tok.encode(text)
        stream = TextStream(tok.decode)
        pieces = [stream.push(i) for i in ids] + [stream.close()]
        assert "".join(pieces) == tok.decode(ids), pieces
        assert not any("\ufffd" in p for p in pieces)
