"""Corpus, split and tokenizer of the shipped tiny model.

Corpus: the running interpreter's standard library ``.py`` sources. Left out, on purpose:
``site-packages`` (not the stdlib), directories named ``test``/``tests``/``idle_test`` (test
suites full of fixtures and odd data), ``encodings/`` (generated codec tables) and
``pydoc_data/`` (one 750 kB string of prose). The validation split is chosen by file: a file
is held out when the first byte of sha1(relative path) is below ``VAL_FRACTION * 256``, so the
split is the same on every machine that has the same stdlib.

Tokenizer: byte-level BPE trained with ``tokenizers`` (ByteLevel pre-tokenizer = the GPT-2
split regex, no prefix space), one special token ``<|endoftext|>`` (id 0) that separates files
and serves as bos/eos/pad.
"""
from __future__ import annotations

import hashlib
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

EOT = "<|endoftext|>"
VAL_FRACTION = 0.05
SKIP_DIRS = frozenset({"site-packages", "test", "tests", "idle_test", "encodings", "pydoc_data",
                       "__pycache__"})


@dataclass(frozen=True)
class Corpus:
    root: Path
    train: tuple[Path, ...]   # relative paths, sorted
    val: tuple[Path, ...]

    def texts(self, split: str) -> list[str]:
        files = self.train if split == "train" else self.val
        return [(self.root / p).read_text(encoding="utf-8", errors="replace") for p in files]


def stdlib_corpus(root: str | None = None) -> Corpus:
    root_path = Path(root or sysconfig.get_paths()["stdlib"])
    files: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root_path):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
        for name in sorted(filenames):
            if name.endswith(".py"):
                files.append(Path(dirpath, name).relative_to(root_path))
    files.sort()
    threshold = int(VAL_FRACTION * 256)
    val = tuple(p for p in files if hashlib.sha1(p.as_posix().encode()).digest()[0] < threshold)
    train = tuple(p for p in files if p not in set(val))
    return Corpus(root_path, train, val)


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOT], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def tokenizer_from_vocab(tokens: list[str], merges: list[str]) -> Tokenizer:
    """Rebuild the tokenizer from what the GGUF stores (``tokenizer.ggml.tokens``/``merges``)."""
    vocab = {t: i for i, t in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([EOT])
    return tok


def vocab_and_merges(tok: Tokenizer) -> tuple[list[str], list[str]]:
    """Tokens in id order (GPT-2 byte-to-unicode strings) and merges as 'a b' strings."""
    import json
    model = json.loads(tok.to_str())["model"]
    vocab: dict[str, int] = model["vocab"]
    tokens = [""] * len(vocab)
    for t, i in vocab.items():
        tokens[i] = t
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return tokens, merges


def encode_split(tok: Tokenizer, texts: list[str]) -> np.ndarray:
    """All files of a split as one uint16 stream, each file preceded by <|endoftext|>."""
    eot = tok.token_to_id(EOT)
    out: list[int] = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        out.append(eot)
        out.extend(enc.ids)
    return np.asarray(out, dtype=np.uint16)
