"""The deepseek4 model of the depth benchmark (``python -m bench.depth --only v4,v4-prefill``):
DeepSeek-V4-Flash's depth and layout at reduced widths, random weights.

43 blocks with V4-Flash's attention pattern (``[0, 0] + [4, 128] × 20 + [4]``: 2 window-only,
21 CSA with the lightning indexer, 20 HCA), the first 3 hash-routed (``ffn_gate_tid2eid``),
4 hyper-connection streams with 20 Sinkhorn iterations, a 128-token window, YaRN ×16 on the
compressed blocks; widths: n_embd 512, 8 heads × 128 (rope 64), q LoRA 256, 4 output groups
× 128, indexer 16 heads × 64 (top 512), 32 experts top-6 of 256 (MXFP4, as V4-Flash ships
them; ``--v4-expert-type``) plus one shared, Q8_0 attention/shared/output/embedding.

The tensor list and the keys are the tiny test models' (``tests.tiny_models``: the names,
shapes and keys llama.cpp's deepseek4 loader reads); only the data is bench.depth's (random
quant bytes with sane scales, streamed)."""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np
from gguf import GGMLQuantizationType as Q, GGUFWriter

from bench.depth import FORMAT_VERSION, TensorPlan

FLASH_RATIOS = (0, 0) + (4, 128) * 20 + (4,)


@dataclass(frozen=True)
class V4DepthSpec:
    n_layer: int = 43
    n_embd: int = 512
    n_head: int = 8
    head_dim: int = 128
    n_expert: int = 32
    n_expert_used: int = 6
    n_ff_exp: int = 256
    expert_type: Q = Q.MXFP4
    dense_type: Q = Q.Q8_0          # attention, shared expert, output, token embedding
    seed: int = 0
    arch = "deepseek4"

    @cached_property
    def tiny(self):
        from tests.tiny_models import TinySpec
        ratios = (FLASH_RATIOS * (self.n_layer // len(FLASH_RATIOS) + 1))[:self.n_layer]
        return TinySpec(arch="deepseek4", n_embd=self.n_embd, n_head=self.n_head, head_dim=self.head_dim, n_rot=64,
                        n_layer=self.n_layer, compress_ratios=ratios, n_hash=3, window=128, q_lora_rank=256,
                        o_groups=4, o_lora_rank=128, indexer_n_head=16, indexer_head_dim=64, indexer_top_k=512,
                        yarn_factor=16.0, yarn_orig_ctx=65536, n_expert=self.n_expert,
                        n_expert_used=self.n_expert_used, n_ff_exp=self.n_ff_exp, rms_eps=1e-6,
                        expert_type=self.expert_type, dense_type=self.dense_type, embd_type=self.dense_type,
                        nextn=False, seed=self.seed)

    def write_keys(self, w: GGUFWriter) -> int:
        from tests.tiny_models import write_tiny_keys
        return write_tiny_keys(w, self.tiny)

    def tensors(self, n_vocab: int) -> list[TensorPlan]:
        from tests.tiny_models import tiny_tensors
        out = []
        for t in tiny_tensors(self.tiny):
            if t.value is not None:
                qtype = Q.I32 if t.value.dtype == np.int32 else Q.F32
            else:
                qtype = t.qtype(self.tiny)
            out.append(TensorPlan(t.name, t.shape, qtype, t.std, t.mean, t.value))
        return out

    @property
    def file_name(self) -> str:
        return (f"depth-v{FORMAT_VERSION}-deepseek4-L{self.n_layer}-d{self.n_embd}-h{self.n_head}x{self.head_dim}-"
                f"e{self.n_expert}k{self.n_expert_used}f{self.n_ff_exp}-{self.expert_type.name}-"
                f"{self.dense_type.name}-s{self.seed}.gguf")

    def describe(self) -> str:
        t = self.tiny
        return (f"deepseek4 random weights, {self.n_layer} blocks (V4-Flash's pattern: "
                f"{t.compress_ratios.count(0)} window-only, {t.compress_ratios.count(4)} CSA, "
                f"{t.compress_ratios.count(128)} HCA; {t.n_hash} hash-routed), n_embd {self.n_embd}, "
                f"{self.n_head} heads x {self.head_dim}, {t.hc_mult} streams, {self.n_expert} experts "
                f"top-{self.n_expert_used} ff {self.n_ff_exp}, {self.expert_type.name} experts, "
                f"{self.dense_type.name} attention")


V4 = V4DepthSpec()
