"""The planner's input type: one GGUF tensor as the planner sees it.

Produced by ``offload.gguf_model`` from a GGUF header; consumed by every planner module.
Kept here (not in ``offload``) so that ``placement`` never imports ``offload``.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

from gguf import GGMLQuantizationType


class Role(str, enum.Enum):
    """What a tensor does. A NextN block's tensors keep their function's role
    (its experts are ROUTED_EXPERTS, so the expert regexes match them as in llama.cpp)
    and carry ``TensorInfo.nextn = True``; only the NextN glue tensors
    (``nextn.eh_proj``, ``enorm``, ``hnorm``, ``shared_head_*``, ``embed_tokens``) are NEXTN."""

    ATTENTION = "attention"
    ROUTER = "router"                  # ffn_gate_inp, exp_probs_b
    ROUTED_EXPERTS = "routed_experts"  # ffn_{gate,up,down,gate_up}_exps
    SHARED_EXPERTS = "shared_experts"  # ffn_*_shexp
    DENSE_FFN = "dense_ffn"            # ffn_gate/ffn_up/ffn_down of dense layers
    NORM = "norm"
    EMBEDDING = "embedding"
    OUTPUT = "output"                  # output.weight, deepseek4's hc head output_hc_* (output_norm is NORM)
    NEXTN = "nextn"
    OTHER = "other"


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a (possibly split) GGUF model.

    ``shape`` is in numpy/torch order, outermost first (the reverse of GGUF's ``ne``):
    ``blk.3.ffn_down_exps.weight`` of a model with 128 experts, n_embd 2048, n_ff 768
    is ``(128, 2048, 768)``. ``n_bytes`` is the exact size of the tensor's data in the file.
    ``layer`` is the block index (``blk.N``) or None for global tensors.
    """

    name: str
    shape: tuple[int, ...]
    ggml_type: GGMLQuantizationType
    n_bytes: int
    layer: int | None
    role: Role
    nextn: bool = False

    @property
    def n_elements(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def n_experts(self) -> int:
        """Experts stacked in this tensor (the leading dim of a 3-D ``*_exps`` tensor), else 0."""
        return self.shape[0] if self.role is Role.ROUTED_EXPERTS and len(self.shape) == 3 else 0


@dataclass(frozen=True)
class ModelSpec:
    """The hyperparameters the planner needs, built once from GGUF metadata.

    ``offload.gguf_model`` fills it from ``gguf.constants.Keys``; it lives here (like
    ``TensorInfo``) so that ``placement`` never imports ``offload``. Names follow llama.cpp's
    hparams. ``n_layer`` is GGUF's ``block_count``: it includes the NextN blocks, which are the
    last ``n_nextn`` blocks.
    """

    arch: str
    n_layer: int
    n_embd: int
    n_vocab: int
    n_ctx_train: int
    n_head: int
    n_head_kv: tuple[int, ...]        # per block (GGUF allows a per-layer array)
    head_dim_k: int                   # attention.key_length
    head_dim_v: int                   # attention.value_length
    n_nextn: int = 0
    n_rot: int = 0
    n_ff: int = 0                     # dense FFN width
    n_expert: int = 0
    n_expert_used: int = 0
    n_expert_shared: int = 0
    n_ff_exp: int = 0
    n_ff_shexp: int = 0
    n_leading_dense: int = 0
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    head_dim_k_mla: int = 0           # attention.key_length_mla: present only in MLA-layout GGUFs
    head_dim_v_mla: int = 0
    sliding_window: int = 0
    swa_layers: tuple[bool, ...] = ()  # per block; empty: no sliding-window layers
    # DeepSeek-V4 (deepseek4): the attention kind of each block, hyper-connection streams,
    # the lightning indexer and the grouped output projection. 0 / () elsewhere.
    compress_ratios: tuple[int, ...] = ()   # per block: 0 window only, 4 CSA, 128 HCA
    hc_mult: int = 0                  # residual streams carried between blocks (hyper_connection.count)
    n_hash_layers: int = 0            # leading blocks routed by token id (ffn_gate_tid2eid)
    indexer_n_head: int = 0
    indexer_head_dim: int = 0
    indexer_top_k: int = 0
    o_groups: int = 0                 # attention.output_group_count
    o_lora_rank: int = 0              # attention.output_lora_rank

    @property
    def is_mla(self) -> bool:
        """llama.cpp's ``is_mla()``: the cache holds the compressed latent (K only, no V)."""
        return self.head_dim_k_mla > 0 and self.head_dim_v_mla > 0

    @property
    def n_layer_trunk(self) -> int:
        return self.n_layer - self.n_nextn

    def is_nextn_layer(self, layer: int) -> bool:
        return layer >= self.n_layer_trunk

    def is_moe_layer(self, layer: int) -> bool:
        return self.n_expert > 0 and layer >= self.n_leading_dense

    def is_swa_layer(self, layer: int) -> bool:
        return bool(self.swa_layers) and self.swa_layers[layer]

    def compress_ratio(self, layer: int) -> int:
        """deepseek4: block ``layer``'s compression (0 window only, 4 CSA, 128 HCA); 0 elsewhere."""
        return self.compress_ratios[layer] if layer < len(self.compress_ratios) else 0
