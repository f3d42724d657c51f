"""The GGUF reader refuses what cannot be, in one line: hand-made cases for each rule, then a
seeded fuzz run (``bench.fuzz``'s mutants of the shipped model and of real-shaped fixture
headers, one of them split over two shards) where every mutant must be parsed or refused —
no other exception, no hang. The hang limit is a detector (a stuck parse), not a speed
assertion; ``python -m bench.fuzz`` reports the times."""
from __future__ import annotations

import os
import struct
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFWriter

from bench.fuzz import fuzz, load_sources, report
from offload.errors import OffloadError
from offload.gguf_header import MAX_DIMS, read_header
from offload.gguf_model import open_model
from tests.fixtures.real_models import ALL, write_fixture

Q = GGMLQuantizationType


def _model(path: Path, tensors=(("blk.0.attn_q.weight", (64, 64)), ("blk.0.attn_k.weight", (64, 64)))) -> Path:
    w = GGUFWriter(path, "qwen3moe")
    for key, value in (("block_count", 1), ("embedding_length", 64), ("context_length", 128),
                       ("attention.head_count", 4)):
        w.add_uint32(f"qwen3moe.{key}", value)
    for name, shape in tensors:
        w.add_tensor(name, np.zeros(shape, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _tensor_info_offsets(data: bytes, n_tensors: int) -> list[dict]:
    """Where each tensor info's fields are (walking the header as GGUF v3 lays it out)."""
    h = read_header_bytes(data)
    pos, out = h["ti_start"], []
    for _ in range(n_tensors):
        (n,) = struct.unpack_from("<Q", data, pos)
        info = {"name": pos}
        pos += 8 + n
        info["n_dims"] = pos
        (nd,) = struct.unpack_from("<I", data, pos)
        pos += 4
        info["dims"] = pos
        pos += 8 * nd
        info["type"] = pos
        info["offset"] = pos + 4
        pos += 12
        out.append(info)
    return out


def read_header_bytes(data: bytes) -> dict:
    """The start of the tensor infos: skip the metadata (u32 and string values here)."""
    n_kv = struct.unpack_from("<Q", data, 16)[0]
    pos = 24
    for _ in range(n_kv):
        (n,) = struct.unpack_from("<Q", data, pos)
        pos += 8 + n
        (vtype,) = struct.unpack_from("<I", data, pos)
        pos += 4
        pos += 4 if vtype == 4 else 8 + struct.unpack_from("<Q", data, pos)[0]   # u32, or string
    return {"ti_start": pos}


def _patched(tmp_path: Path, edit) -> Path:
    good = _model(tmp_path / "good.gguf")
    data = bytearray(good.read_bytes())
    edit(data, _tensor_info_offsets(bytes(data), 2))
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(data))
    return bad


def _put(data: bytearray, pos: int, fmt: str, value: int) -> None:
    struct.pack_into(fmt, data, pos, value)


@pytest.mark.parametrize("edit,match", [
    (lambda d, ti: _put(d, 8, "<Q", 2**40), "1,099,511,627,776 tensor infos need at least"),
    (lambda d, ti: _put(d, 16, "<Q", 2**62), "metadata keys need at least"),
    (lambda d, ti: d.__setitem__(slice(ti[1]["name"] + 8, ti[1]["name"] + 27), d[ti[0]["name"] + 8:ti[0]["name"] + 27]),
     "tensor blk.0.attn_q.weight twice"),
    (lambda d, ti: _put(d, ti[0]["name"], "<Q", 0), "is named ''"),
    (lambda d, ti: _put(d, ti[0]["n_dims"], "<I", MAX_DIMS + 1), "has 5 dimensions; 1 to 4 are possible"),
    (lambda d, ti: _put(d, ti[0]["n_dims"], "<I", 0), "has 0 dimensions"),
    (lambda d, ti: _put(d, ti[0]["dims"], "<Q", 0), r"has shape \[0, 64\]"),
    (lambda d, ti: _put(d, ti[0]["type"], "<I", 4), "unknown quant type id 4"),
    (lambda d, ti: _put(d, ti[1]["offset"], "<Q", 2**40), "ends at byte"),
    (lambda d, ti: _put(d, ti[1]["offset"], "<Q", 0), "the data of tensors blk.0.attn_q.weight and "
                                                       "blk.0.attn_k.weight overlap"),
    (lambda d, ti: _put(d, ti[1]["offset"], "<Q", 16400), "is not a multiple of the alignment 32"),
    (lambda d, ti: _put(d, ti[0]["name"], "<Q", 2**33), "runs past the end of the file|name of tensor 0 of"),
])
def test_impossible_headers_are_refused_in_one_line(tmp_path, edit, match):
    bad = _patched(tmp_path, edit)
    with pytest.raises(OffloadError, match=match) as err:
        open_model(bad)
    assert "\n" not in str(err.value)


def test_a_long_name_and_a_huge_string_are_refused_before_they_are_read(tmp_path):
    path = _model(tmp_path / "long.gguf", tensors=[("blk.0." + "x" * 70, (64, 64))])
    with pytest.raises(OffloadError, match="the name of tensor 0 of 76 bytes; offload reads at most 63"):
        open_model(path)
    # a metadata string claiming 1 GiB in a (sparse) file big enough to hold it
    good = _model(tmp_path / "good.gguf").read_bytes()
    pos = 24 + 8 + len("general.architecture") + 4        # the architecture string's length
    data = bytearray(good)
    _put(data, pos, "<Q", 1 << 30)
    big = tmp_path / "big.gguf"
    big.write_bytes(bytes(data))
    os.truncate(big, 2 << 30)
    with pytest.raises(OffloadError, match="a metadata string of 1,073,741,824 bytes"):
        open_model(big)


def test_block_count_past_the_tensors_is_refused(tmp_path):
    good = _model(tmp_path / "good.gguf").read_bytes()
    key = b"qwen3moe.block_count"
    pos = good.index(key) + len(key) + 4
    data = bytearray(good)
    _put(data, pos, "<I", 2**31)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(OffloadError, match="qwen3moe.block_count is 2147483648 but the last block among "
                                           "the tensors is blk.0"):
        open_model(bad)


def test_split_shards_that_disagree_are_refused(tmp_path):
    first = write_fixture(ALL["gpt-oss-120b"](), tmp_path, tokenizer="none")
    second = Path(open_model(first).shards[1])          # a sparse file: read its header only
    with open(second, "rb") as f:
        data = bytearray(f.read(read_header(second).data_start))
    key = b"split.tensors.count"
    pos = data.index(key) + len(key)                    # its type, then its value (687 in both)
    fmt = {4: "<I", 5: "<i", 10: "<Q", 11: "<q"}[struct.unpack_from("<I", data, pos)[0]]
    _put(data, pos + 4, fmt, 686)
    with open(second, "r+b") as f:
        f.write(bytes(data))
    with pytest.raises(OffloadError, match="the shards disagree: split.tensors.count is 686 here but 687"):
        open_model(first)


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    return load_sources(["shipped", "glm-4.5-air", "gpt-oss-120b"], tmp_path_factory.mktemp("fuzz"))


def test_fuzzed_headers_are_parsed_or_refused(sources, tmp_path):
    """300 seeded mutants (100 per source) through open_model, and those that open through
    ``offload plan``: none crashes or hangs."""
    summary = fuzz(sources, 300, seed=1234, workdir=tmp_path, hang_s=10.0, plan=True)
    text = "\n".join(report(summary, sources, show=10))
    print(text)
    counts = summary.counts()
    assert counts["crashed"] == 0 and counts["hung"] == 0, text
    # the mutants really are damaged: most are refused, and every source produced refusals
    assert counts["refused"] >= 0.6 * 300, text
    assert all(summary.counts(s.name)["refused"] > 0 for s in sources), text
