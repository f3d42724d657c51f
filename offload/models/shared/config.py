"""The config an architecture reads from GGUF: the numbers its math needs (``ModelConfig``,
which an architecture may extend) and the readers every architecture shares."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from gguf import Keys

from gpu.rope import RopeSpec, YaRN
from offload.errors import OffloadError
from offload.gguf_header import LazyArray
from placement.tensors import ModelSpec


@dataclass(frozen=True)
class ModelConfig:
    """The numbers the model math needs: the planner's ``ModelSpec`` fields (parsed once by
    ``offload.gguf_model``) plus the keys only the runtime reads (RoPE base, norm eps,
    routing weights)."""
    arch: str
    n_vocab: int
    n_embd: int
    n_layer: int              # trunk blocks (block_count minus the NextN blocks)
    n_head: int
    n_head_kv: int
    head_dim: int
    n_rot: int                # rotary dims per head (partial rotary when < head_dim)
    rope_base: float
    rms_eps: float
    n_expert: int
    n_expert_used: int
    expert_weights_norm: bool
    expert_weights_scale: float
    n_nextn: int              # NextN/MTP blocks after the trunk (0 or 1 supported)
    context_length: int

    @property
    def rope_spec(self) -> RopeSpec:
        """The rotary table the blocks share (an architecture with YaRN or interleaved
        rotary overrides this)."""
        return RopeSpec(self.n_rot, self.rope_base)


def meta_value(meta: Mapping, template: str, arch: str, default=None):
    """A metadata value by ``gguf.Keys`` template (long arrays decoded on demand)."""
    v = meta.get(template.format(arch=arch), default)
    return v.values() if isinstance(v, LazyArray) else v


def config_fields(spec: ModelSpec, meta: Mapping, *, expert_weights_norm_default: bool = False) -> dict:
    """The ``ModelConfig`` fields every architecture reads the same way, from ModelSpec and
    the runtime-only keys (an architecture replaces what it reads differently)."""
    get = lambda t, d=None: meta_value(meta, t, spec.arch, d)  # noqa: E731
    if spec.n_nextn > 1:
        raise OffloadError(f"{spec.n_nextn} NextN layers: only one is supported")
    eps = get(Keys.Attention.LAYERNORM_RMS_EPS)
    if eps is None:
        raise OffloadError(f"missing metadata key {Keys.Attention.LAYERNORM_RMS_EPS.format(arch=spec.arch)}")
    return dict(
        arch=spec.arch, n_vocab=spec.n_vocab, n_embd=spec.n_embd, n_layer=spec.n_layer_trunk,
        n_head=spec.n_head, n_head_kv=spec.n_head_kv[0], head_dim=spec.head_dim_k,
        n_rot=spec.n_rot or spec.head_dim_k,
        rope_base=float(get(Keys.Rope.FREQ_BASE, 10000.0)), rms_eps=float(eps),
        n_expert=spec.n_expert, n_expert_used=spec.n_expert_used,
        expert_weights_norm=bool(get(Keys.LLM.EXPERT_WEIGHTS_NORM, expert_weights_norm_default)),
        expert_weights_scale=float(get(Keys.LLM.EXPERT_WEIGHTS_SCALE, 1.0)),
        n_nextn=spec.n_nextn, context_length=spec.n_ctx_train)


def yarn_scaling(spec: ModelSpec, meta: Mapping) -> YaRN | None:
    """``rope.scaling.*`` → YaRN (None without scaling); any other scaling is refused."""
    get = lambda t, d=None: meta_value(meta, t, spec.arch, d)  # noqa: E731
    scaling = get(Keys.Rope.SCALING_TYPE, "none")
    factor = float(get(Keys.Rope.SCALING_FACTOR, 1.0) or 1.0)
    if scaling == "yarn" and factor > 1.0:
        return YaRN(factor, int(get(Keys.Rope.SCALING_ORIG_CTX_LEN, spec.n_ctx_train)),
                    beta_fast=float(get(Keys.Rope.SCALING_YARN_BETA_FAST, 32.0)),
                    beta_slow=float(get(Keys.Rope.SCALING_YARN_BETA_SLOW, 1.0)))
    if scaling not in ("none", "yarn") or factor != 1.0:
        raise OffloadError(f"{spec.arch}: RoPE scaling {scaling!r} (factor {factor}) is not supported (yarn only)")
    return None


def common_config(spec: ModelSpec, meta: Mapping, *,
                  expert_weights_norm_default: bool = False) -> ModelConfig:
    """ModelSpec + the runtime-only keys → ModelConfig for the GQA architectures, refusing
    what their math does not do. Whether a block is dense or MoE is read from its tensors
    (a router means MoE)."""
    get = lambda t, d=None: meta_value(meta, t, spec.arch, d)  # noqa: E731
    if spec.head_dim_k != spec.head_dim_v:
        raise OffloadError(f"{spec.arch}: attention key_length {spec.head_dim_k} != value_length "
                           f"{spec.head_dim_v} is not supported")
    if len(set(spec.n_head_kv)) > 1:
        raise OffloadError(f"{spec.arch}: a per-layer head_count_kv is not supported")
    if get(Keys.Rope.SCALING_TYPE, "none") not in ("none", "linear") or \
            float(get(Keys.Rope.SCALING_FACTOR, 1.0) or 1.0) != 1.0:
        raise OffloadError(f"{spec.arch}: RoPE scaling is not supported")
    return ModelConfig(**config_fields(spec, meta, expert_weights_norm_default=expert_weights_norm_default))
