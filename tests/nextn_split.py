"""Split a GGUF with a NextN block into a trunk-only GGUF and a NextN-only ``--draft`` GGUF,
the way llama.cpp users hold them (``convert_hf_to_gguf.py --mtp`` writes the second kind):

- trunk: every tensor but ``blk.N.*``; ``block_count`` = N, ``nextn_predict_layers`` = 0;
- draft: only ``blk.N.*`` (the full decoder block and its ``nextn.*`` glue; embeddings and
  output stay shared with the trunk); ``block_count`` and ``nextn_predict_layers`` as in
  the source, no tokenizer.

Tensor bytes are copied unchanged (quantized blocks stay quantized).
"""
from __future__ import annotations

from pathlib import Path

from gguf import GGMLQuantizationType as Q, GGUFReader, GGUFValueType, GGUFWriter, Keys

_PLAIN = (Q.F32, Q.F16, Q.BF16)


def _copy(reader: GGUFReader, out: Path, arch: str, overrides: dict, keep_tensor, keep_key,
          rename=lambda name: name) -> None:
    w = GGUFWriter(str(out), arch)
    for key, f in reader.fields.items():
        if key.startswith("GGUF.") or key == Keys.General.ARCHITECTURE or not keep_key(key):
            continue
        vtype = f.types[0]
        sub = f.types[1] if vtype == GGUFValueType.ARRAY else None
        w.add_key_value(key, overrides.get(key, f.contents()), vtype, sub_type=sub)
    for t in reader.tensors:
        if keep_tensor(t.name):
            raw = None if t.tensor_type in _PLAIN else t.tensor_type
            w.add_tensor(rename(t.name), t.data, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def split_nextn(src: str | Path, trunk: str | Path, draft: str | Path) -> int:
    """Write the two files; returns the NextN block index N."""
    r = GGUFReader(str(src))
    arch = r.fields[Keys.General.ARCHITECTURE].contents()
    blocks = r.fields[Keys.LLM.BLOCK_COUNT.format(arch=arch)].contents()
    n_nextn = r.fields[Keys.LLM.NEXTN_PREDICT_LAYERS.format(arch=arch)].contents()
    first = blocks - n_nextn
    prefix = f"blk.{first}."
    _copy(r, Path(trunk), arch, {Keys.LLM.BLOCK_COUNT.format(arch=arch): first,
                                 Keys.LLM.NEXTN_PREDICT_LAYERS.format(arch=arch): 0},
          lambda name: not name.startswith(prefix), lambda key: True)
    _copy(r, Path(draft), arch, {}, lambda name: name.startswith(prefix),
          lambda key: not key.startswith("tokenizer."))
    return first


def split_deepseek4_mtp(src: str | Path, trunk: str | Path, draft: str | Path, *, with_root: bool = False) -> int:
    """``split_nextn`` for a bundled deepseek4 file, the draft in mainline's sidecar layout
    (``convert_hf_to_gguf.py --mtp``): the MTP head's own hc head ``blk.N.nextn.hc_head_*``
    becomes the sidecar's root ``output_hc_*``. ``with_root``: the sidecar also holds
    ``token_embd``, ``output_norm``, ``output`` and the tokenizer, as mainline's 34-tensor
    sidecar does (llama.cpp's loader requires them)."""
    r = GGUFReader(str(src))
    arch = r.fields[Keys.General.ARCHITECTURE].contents()
    first = r.fields[Keys.LLM.BLOCK_COUNT.format(arch=arch)].contents() - 1
    prefix, head = f"blk.{first}.", f"blk.{first}.nextn.hc_head_"
    # a trunk's per-block arrays have block_count entries (llama.cpp refuses any other length)
    per_block = {k.format(arch=arch): r.fields[k.format(arch=arch)].contents()[:first]
                 for k in (Keys.LLM.SWIGLU_CLAMP_EXP, Keys.LLM.SWIGLU_CLAMP_SHEXP) if k.format(arch=arch) in r.fields}
    _copy(r, Path(trunk), arch, {Keys.LLM.BLOCK_COUNT.format(arch=arch): first,
                                 Keys.LLM.NEXTN_PREDICT_LAYERS.format(arch=arch): 0, **per_block},
          lambda name: not name.startswith(prefix), lambda key: True)
    root = ("token_embd.weight", "output_norm.weight", "output.weight") if with_root else ()
    _copy(r, Path(draft), arch, {}, lambda name: name.startswith(prefix) or name in root,
          lambda key: with_root or not key.startswith("tokenizer."),
          rename=lambda name: "output_hc_" + name.removeprefix(head) if name.startswith(head) else name)
    return first
