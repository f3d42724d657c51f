"""Every load failure is one line (``OffloadError``), found at load, not deep in a forward
pass: a tensor the architecture needs is missing, a tensor's shape disagrees with the
metadata, a device the plan names does not exist, a plan made for another model. And a
model whose weights produce NaN stops generating with one line naming the first block
whose output is not finite."""
from __future__ import annotations

import shutil
import struct
import warnings
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader

import offload.runtime as rt
from offload.errors import USER_ERRORS, OffloadError
from offload.gguf_model import open_model
from tests.tiny_models import TinySpec, write_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("m") / "tiny.gguf", TinySpec(arch="glm4moe", nextn=True))


def _copy(tiny, tmp_path: Path, name="bad.gguf") -> Path:
    out = tmp_path / name
    shutil.copyfile(tiny.path, out)
    return out


def _rename(path: Path, old: bytes, new: bytes) -> None:
    """Rename tensors in place (same length): every occurrence of ``old`` in the header."""
    data = bytearray(path.read_bytes())
    end = GGUFReader(path).tensors[0].data_offset
    head = bytes(data[:end]).replace(old, new)
    data[:end] = head
    path.write_bytes(bytes(data))


def _tensor_field(path: Path, name: str):
    reader = GGUFReader(path)
    return next(t for t in reader.tensors if t.name == name)


def _load(path: Path, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return rt.load(path, devices="CPU=16GiB", quiet=True, **kw)


def test_a_missing_tensor_is_named(tiny, tmp_path):
    bad = _copy(tiny, tmp_path)
    _rename(bad, b"blk.1.ffn_gate_inp.weight", b"blk.1.ffn_gate_xxx.weight")
    # the router gone, block 1 is built as a dense FFN, whose tensors the file lacks
    with pytest.raises(OffloadError, match=r"^the model file lacks tensor blk\.1\.ffn_gate\.weight$"):
        _load(bad)


def test_a_block_without_attention_is_one_line_not_a_key_error(tiny, tmp_path):
    """A corrupt file whose block 2 lost its attention tensors used to fail with
    ``KeyError: None`` from offload/devices.py (via the attention builder)."""
    bad = _copy(tiny, tmp_path)
    _rename(bad, b"blk.2.attn_", b"blk.2.attx_")
    with pytest.raises(OffloadError, match=r"lacks tensor blk\.2\.attn_q\.weight \(block 2 has no attention"):
        _load(bad)


@pytest.mark.parametrize("name,dim,factor", [("blk.1.attn_q.weight", 1, 2), ("blk.1.ffn_down_exps.weight", 2, 2),
                                            ("output.weight", 1, 2)])
def test_a_shape_that_disagrees_with_the_metadata_is_refused_at_load(tiny, tmp_path, name, dim, factor):
    """One GGUF dimension (ne, innermost first) shrunk in the header: the file stays
    readable (less data, still inside the file), the shape no longer matches the metadata."""
    bad = _copy(tiny, tmp_path)
    t = _tensor_field(bad, name)
    parts = t.field.parts
    pos = t.field.offset + sum(p.nbytes for p in parts[:3]) + 8 * dim
    data = bytearray(bad.read_bytes())
    (ne,) = struct.unpack_from("<Q", data, pos)
    struct.pack_into("<Q", data, pos, ne // factor)
    bad.write_bytes(bytes(data))
    open_model(bad)                                   # the header itself is fine
    with pytest.raises(OffloadError, match=rf"tensor {name} has shape .* but the metadata \(glm4moe\.\*\) gives"):
        _load(bad)


def test_a_device_the_plan_names_must_exist(tiny):
    with pytest.raises(OffloadError, match="the plan places tensors on CUDA0 but this machine has") as err:
        rt.load(tiny.path, devices="CUDA0=8GiB,CPU=16GiB", quiet=True)
    assert "\n" not in str(err.value)


def test_a_plan_made_for_another_model_is_refused(tiny, tmp_path):
    other = write_tiny_model(tmp_path / "qwen.gguf", TinySpec(arch="qwen3moe", n_rot=32))
    plan = rt.plan_for(open_model(other.path), devices="CPU=16GiB")
    with pytest.raises(USER_ERRORS, match="was it made for another model"):
        rt.load_plan(open_model(tiny.path), plan, quiet=True)


def test_nan_weights_stop_generation_naming_the_first_bad_block(tiny, tmp_path):
    """blk.2's attention norm set to NaN in the file: blocks 0 and 1 stay finite, so the
    search names blk.2 (the logits are checked each step; the search runs only now). The
    layers sit on a virtual GPU (torch), so the NaN reaches the logits whatever the CPU
    expert kernels do with non-finite inputs (their own tests cover that)."""
    bad = _copy(tiny, tmp_path)
    t = _tensor_field(bad, "blk.2.attn_norm.weight")
    with open(bad, "r+b") as f:
        f.seek(t.data_offset)
        f.write(np.full(t.n_elements, np.nan, np.float32).tobytes())
    gpu = dict(devices="CUDA0=8GiB,CPU=16GiB", virtual_gpus=True, n_gpu_layers=-1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        s = rt.load(bad, quiet=True, **gpu)
    with s:
        with pytest.raises(OffloadError, match=r"^non-finite logits at the prompt: the first non-finite output "
                                               r"is that of block blk\.2 \(on CUDA0\)") as err:
            list(s.generate([1, 2, 3], max_tokens=4))
    assert "\n" not in str(err.value)
    with rt.load(tiny.path, quiet=True, **gpu) as s:   # the control: the intact file generates
        assert len(list(s.generate([1, 2, 3], max_tokens=4, stop_at_eos=False))) == 4


@pytest.mark.parametrize("edit,match", [
    (lambda md: md.__setitem__("tokenizer.ggml.merges", ["Ġ t", "zzzq zzzr"]), "tokenizer is inconsistent: .*out of vocabulary"),
    (lambda md: md.__setitem__("tokenizer.ggml.merges", ["Ġt"]), "tokenizer.ggml.merges must be a list of 'left right'"),
    (lambda md: md.__setitem__("tokenizer.ggml.token_type", [1, 2]), "tokenizer.ggml.token_type must be 4096 integers"),
    (lambda md: md.__setitem__("tokenizer.ggml.eos_token_id", 10**6), "tokenizer.ggml.eos_token_id is 1000000, not a token id"),
])
def test_a_corrupt_tokenizer_is_one_line(edit, match):
    """What mutated vocabularies and merges of the shipped model used to raise from inside the
    tokenizers library (``Exception: Error while initializing BPE``, a multi-line TypeError)."""
    from offload.commands.run import DEFAULT_MODEL
    from offload.tokenizer import Tokenizer

    md = dict(open_model(DEFAULT_MODEL).metadata)
    Tokenizer.from_gguf(md)                               # the intact one builds
    edit(md)
    with pytest.raises(OffloadError, match=match) as err:
        Tokenizer.from_gguf(md)
    assert "\n" not in str(err.value)
