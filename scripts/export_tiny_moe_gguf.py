"""Export a checkpoint of scripts/train_tiny_moe.py to a llama.cpp ``glm4moe`` GGUF.

    python scripts/export_tiny_moe_gguf.py out/tiny-moe models/tiny-glm4moe-mtp.gguf

Metadata keys are what llama.cpp's convert_hf_to_gguf.py writes for Glm4MoeModel; tensor
names and shapes are what llama.cpp's glm4moe loader asks for. Types: routed experts Q8_0,
router (``ffn_gate_inp``), ``exp_probs_b``, norms and biases F32, every other matrix F16.
The training model's parameter names already are the GGUF names (minus the NextN block's
index and the ``.weight``/``.bias`` suffix of bare parameters), so the only mapping is the
short table ``_SUFFIX`` below. Written to a temp file, then renamed.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

import numpy as np
import torch
from gguf import (GGMLQuantizationType, GGUFWriter, MODEL_ARCH, MODEL_ARCH_NAMES, MODEL_TENSORS,
                  TENSOR_NAMES, ExpertGatingFuncType, TokenType)
from gguf.quants import quantize
from tokenizers import Tokenizer

from tiny_moe_data import EOT, vocab_and_merges
from tiny_moe_model import TinyConfig

ARCH = MODEL_ARCH.GLM4_MOE
Q_EXPERTS = GGMLQuantizationType.Q8_0
# bare nn.Parameter / buffer names in the torch model -> their GGUF suffix
_SUFFIX = {"ffn_gate_exps": ".weight", "ffn_up_exps": ".weight", "ffn_down_exps": ".weight",
           "exp_probs_b": ".bias"}
_F32_ALWAYS = ("norm.weight", ".bias", "ffn_gate_inp.weight", "exp_probs_b.bias")


def gguf_name(torch_name: str, n_layer: int) -> str:
    """``blk.3.ffn_gate_exps`` -> ``blk.3.ffn_gate_exps.weight``;
    ``nextn.eh_proj.weight`` -> ``blk.{n_layer}.nextn.eh_proj.weight``."""
    name = f"blk.{n_layer}.{torch_name}" if torch_name.startswith("nextn.") else torch_name
    last = name.rsplit(".", 1)[-1]
    return name + _SUFFIX.get(last, "")


def allowed_names(n_blocks: int) -> set[str]:
    """Every tensor name llama.cpp's table lists for glm4moe, with .weight and .bias."""
    out = set()
    for t in MODEL_TENSORS[ARCH]:
        for bid in range(n_blocks) if "{bid}" in TENSOR_NAMES[t] else [None]:
            base = TENSOR_NAMES[t].format(bid=bid)
            out |= {base + ".weight", base + ".bias"}
    return out


def tensor_type(name: str) -> GGMLQuantizationType:
    if name.endswith(_F32_ALWAYS):
        return GGMLQuantizationType.F32
    if re.search(r"\.ffn_(gate|up|down)_exps\.weight$", name):
        return Q_EXPERTS
    return GGMLQuantizationType.F16


def add_metadata(w: GGUFWriter, cfg: TinyConfig, name: str) -> None:
    w.add_name(name)
    w.add_context_length(cfg.n_ctx)
    w.add_embedding_length(cfg.n_embd)
    w.add_feed_forward_length(cfg.n_ff)
    w.add_block_count(cfg.n_layer + 1)                 # + the NextN block
    w.add_head_count(cfg.n_head)
    w.add_head_count_kv(cfg.n_head_kv)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_base)
    w.add_rope_dimension_count(cfg.n_rot)
    w.add_layer_norm_rms_eps(cfg.norm_eps)
    w.add_vocab_size(cfg.n_vocab)
    w.add_expert_count(cfg.n_expert)
    w.add_expert_used_count(cfg.n_expert_used)
    w.add_expert_feed_forward_length(cfg.n_ff_exp)
    w.add_expert_shared_count(cfg.n_expert_shared)
    w.add_leading_dense_block_count(cfg.n_dense_lead)
    w.add_expert_gating_func(ExpertGatingFuncType.SIGMOID)
    w.add_expert_weights_scale(cfg.expert_weights_scale)
    w.add_expert_weights_norm(True)
    w.add_nextn_predict_layers(1)


def add_tokenizer(w: GGUFWriter, tok: Tokenizer) -> None:
    tokens, merges = vocab_and_merges(tok)
    eot = tok.token_to_id(EOT)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types([TokenType.CONTROL if t == EOT else TokenType.NORMAL for t in tokens])
    w.add_token_merges(merges)
    w.add_bos_token_id(eot)
    w.add_eos_token_id(eot)
    w.add_pad_token_id(eot)
    # training sequences start a file right after <|endoftext|>, so prompts should too
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)


def export(ckpt_dir: Path, out_path: Path, name: str = "tiny-glm4moe-mtp") -> None:
    ckpt = torch.load(ckpt_dir / "model.pt", map_location="cpu", weights_only=False)
    cfg = TinyConfig(**ckpt["config"])
    tok = Tokenizer.from_file(str(ckpt_dir / "tokenizer.json"))
    allowed = allowed_names(cfg.n_layer + 1)

    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_name(out_path.name + ".tmp")
    w = GGUFWriter(tmp, MODEL_ARCH_NAMES[ARCH])
    add_metadata(w, cfg, name)
    add_tokenizer(w, tok)
    for tname, t in ckpt["state_dict"].items():
        if tname.startswith("rope_"):
            continue
        gname = gguf_name(tname, cfg.n_layer)
        if gname not in allowed:
            raise ValueError(f"{tname} -> {gname}: not a glm4moe tensor name")
        data = t.detach().float().numpy()
        qtype = tensor_type(gname)
        if qtype == GGMLQuantizationType.F32:
            w.add_tensor(gname, data.astype(np.float32))
        elif qtype == GGMLQuantizationType.F16:
            w.add_tensor(gname, data.astype(np.float16))
        else:
            w.add_tensor(gname, quantize(data, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(tmp, out_path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("ckpt_dir", type=Path)
    ap.add_argument("out", type=Path)
    args = ap.parse_args(argv)
    if not (args.ckpt_dir / "model.pt").is_file():
        print(f"error: {args.ckpt_dir / 'model.pt'}: no checkpoint", file=sys.stderr)
        return 2
    export(args.ckpt_dir, args.out)
    print(f"wrote {args.out} ({args.out.stat().st_size / 1e6:.1f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
