"""GGUF inventory: a (possibly split) model's header → ``ModelSpec`` + ``TensorInfo`` list.

``open_model(path)`` reads headers only (``offload.gguf_header``), finds every shard of a
split model (``…-00001-of-00003.gguf``: any shard may be named), checks the ``split.*`` keys,
and builds, once:

* ``ModelSpec`` (``placement.tensors``) from the metadata through ``gguf.constants.Keys``
  templates. Keys offload does not understand are warned about (once per key), not dropped
  silently;
* one ``TensorInfo`` per tensor: GGUF name, numpy-order shape, quant type, exact bytes, block
  index, role (from the one table ``ROLE_OF``, keyed by ``gguf``'s ``MODEL_TENSOR``) and
  whether it belongs to a NextN block;
* where each tensor's data lives (shard, absolute offset), so the runtime can map it later
  with ``ModelFile.tensor_data(name)`` — a read-only memmap view shaped exactly like
  ``gguf.GGUFReader``'s ``ReaderTensor.data``. Nothing here reads tensor data.
"""
from __future__ import annotations

import re
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType
from gguf.constants import MODEL_TENSOR, TENSOR_NAMES, Keys
from gguf.quants import quant_shape_to_byte_shape

from offload.errors import OffloadError
from offload.gguf_header import GGUFHeader, LazyArray, read_header
from placement.tensors import ModelSpec, Role, TensorInfo

__all__ = ["ModelFile", "ModelSpec", "TensorInfo", "open_model", "UnknownMetadataWarning"]

MT = MODEL_TENSOR
# The one mapping from gguf's tensor kinds to planner roles. Kinds not listed are planned as
# OTHER (dense) with a warning.
ROLE_OF: dict[MODEL_TENSOR, Role] = {
    **dict.fromkeys([MT.TOKEN_EMBD, MT.POS_EMBD, MT.TOKEN_TYPES], Role.EMBEDDING),
    MT.OUTPUT: Role.OUTPUT,
    **dict.fromkeys([
        MT.ATTN_Q, MT.ATTN_K, MT.ATTN_V, MT.ATTN_QKV, MT.ATTN_OUT, MT.ATTN_ROT_EMBD, MT.ATTN_SINKS,
        MT.ATTN_GATE, MT.ATTN_Q_A, MT.ATTN_Q_B, MT.ATTN_KV_A_MQA, MT.ATTN_KV_B, MT.ATTN_K_B,
        MT.ATTN_V_B, MT.ROPE_FREQS, MT.ROPE_FACTORS_LONG, MT.ROPE_FACTORS_SHORT,
        MT.INDEXER_K_NORM, MT.INDEXER_PROJ, MT.INDEXER_ATTN_K, MT.INDEXER_ATTN_Q_B,
    ], Role.ATTENTION),
    **dict.fromkeys([
        MT.TOKEN_EMBD_NORM, MT.OUTPUT_NORM, MT.ATTN_NORM, MT.ATTN_NORM_2, MT.ATTN_Q_NORM,
        MT.ATTN_K_NORM, MT.ATTN_OUT_NORM, MT.ATTN_POST_NORM, MT.ATTN_Q_A_NORM, MT.ATTN_KV_A_NORM,
        MT.ATTN_SUB_NORM, MT.FFN_NORM, MT.FFN_PRE_NORM, MT.FFN_POST_NORM, MT.FFN_SUB_NORM,
        MT.LAYER_OUT_NORM, MT.FFN_NORM_EXP,
    ], Role.NORM),
    **dict.fromkeys([MT.FFN_GATE_INP, MT.FFN_EXP_PROBS_B], Role.ROUTER),
    **dict.fromkeys([
        MT.FFN_GATE_EXP, MT.FFN_UP_EXP, MT.FFN_DOWN_EXP, MT.FFN_GATE_UP_EXP,
        MT.FFN_GATE_CHEXP, MT.FFN_UP_CHEXP, MT.FFN_DOWN_CHEXP,
    ], Role.ROUTED_EXPERTS),
    **dict.fromkeys([MT.FFN_GATE_SHEXP, MT.FFN_UP_SHEXP, MT.FFN_DOWN_SHEXP, MT.FFN_GATE_INP_SHEXP],
                    Role.SHARED_EXPERTS),
    **dict.fromkeys([MT.FFN_GATE, MT.FFN_UP, MT.FFN_DOWN], Role.DENSE_FFN),
    **dict.fromkeys([MT.NEXTN_EH_PROJ, MT.NEXTN_EMBED_TOKENS, MT.NEXTN_ENORM, MT.NEXTN_HNORM,
                     MT.NEXTN_SHARED_HEAD_HEAD, MT.NEXTN_SHARED_HEAD_NORM], Role.NEXTN),
}
# Tensor kinds of architectures newer than the gguf package on PyPI (0.19 has no deepseek4),
# named as llama.cpp's gguf-py constants.py spells them (MODEL_TENSOR name → GGUF name). The
# kind is this string until gguf ships the MODEL_TENSOR; then the row moves into ROLE_OF.
NEWER_KINDS: dict[str, tuple[str, Role]] = {
    "ATTN_KV": ("blk.{bid}.attn_kv", Role.ATTENTION),
    "ATTN_OUT_A": ("blk.{bid}.attn_output_a", Role.ATTENTION),
    "ATTN_OUT_B": ("blk.{bid}.attn_output_b", Role.ATTENTION),
    # hyper-connection mixing around each sublayer: computed on the block's home
    **{f"HC_{part}_{w}": (f"blk.{{bid}}.hc_{part.lower()}_{w.lower()}", Role.ATTENTION)
       for part in ("ATTN", "FFN") for w in ("FN", "BASE", "SCALE")},
    # the hc head collapses the streams right before output_norm: it goes where the output goes
    **{f"HC_HEAD_{w}": (f"output_hc_{w.lower()}", Role.OUTPUT) for w in ("FN", "BASE", "SCALE")},
    # bundled trunk+MTP files (forks): the MTP head's own hc head
    **{f"NEXTN_HC_HEAD_{w}": (f"blk.{{bid}}.nextn.hc_head_{w.lower()}", Role.NEXTN)
       for w in ("FN", "BASE", "SCALE")},
    **{f"{who}_COMPRESSOR_{w}": (f"blk.{{bid}}.{who.lower()}_compressor_{n}", Role.ATTENTION)
       for who in ("ATTN", "INDEXER") for w, n in (("WKV", "kv"), ("WGATE", "gate"), ("APE", "ape"),
                                                   ("NORM", "norm"))},
    "FFN_GATE_TID2EID": ("blk.{bid}.ffn_gate_tid2eid", Role.ROUTER),
    # a DSpark drafter (arch dflash): the taps' projection and norm, the Markov and
    # confidence heads — draft-head glue, placed with the drafter
    "FC": ("fc", Role.NEXTN),
    "ENC_OUTPUT_NORM": ("enc.output_norm", Role.NEXTN),
    "DSPARK_MARKOV_W1": ("markov_w1", Role.NEXTN),
    "DSPARK_MARKOV_W2": ("markov_w2", Role.NEXTN),
    "DSPARK_CONF_PROJ": ("conf_proj", Role.NEXTN),
}
_BLOCK_PREFIX = "blk.{bid}."
_KIND_NAMES: dict[MODEL_TENSOR | str, str] = {
    **{t: n for t, n in TENSOR_NAMES.items() if t in ROLE_OF},
    **{k: n for k, (n, _) in NEWER_KINDS.items()},
}
# "attn_q" → ATTN_Q for block tensors, "output_norm" → OUTPUT_NORM for global ones
_BLOCK_KINDS = {n[len(_BLOCK_PREFIX):]: t for t, n in _KIND_NAMES.items() if n.startswith(_BLOCK_PREFIX)}
_GLOBAL_KINDS = {n: t for t, n in _KIND_NAMES.items() if "{" not in n}


def role_of(kind: MODEL_TENSOR | str | None) -> Role:
    """The planner role of a tensor kind (``tensor_kind``'s second value); OTHER when unknown."""
    if kind is None:
        return Role.OTHER
    return NEWER_KINDS[kind][1] if isinstance(kind, str) else ROLE_OF[kind]


class NewerKeys:
    """Metadata keys gguf 0.19 (the newest on PyPI) does not define yet, spelled as llama.cpp's
    gguf-py constants.py does (deepseek4; the dflash drafter)."""
    COMPRESS_RATIOS = "{arch}.attention.compress_ratios"
    COMPRESS_ROPE_FREQ_BASE = "{arch}.attention.compress_rope_freq_base"
    OUTPUT_GROUP_COUNT = "{arch}.attention.output_group_count"
    OUTPUT_LORA_RANK = "{arch}.attention.output_lora_rank"
    HASH_LAYER_COUNT = "{arch}.hash_layer_count"
    HC_COUNT = "{arch}.hyper_connection.count"
    HC_SINKHORN_ITERATIONS = "{arch}.hyper_connection.sinkhorn_iterations"
    HC_EPSILON = "{arch}.hyper_connection.epsilon"
    TARGET_LAYERS = "{arch}.target_layers"        # dflash: the target's tapped block inputs
    BLOCK_SIZE = "{arch}.block_size"              # dflash: tokens drafted per block
    MASK_ID = "tokenizer.ggml.mask_token_id"      # dflash: the noise token of a draft block


# deepseek4's attention kinds by compress ratio (llama.cpp's loader refuses any other ratio)
COMPRESS_RATIOS = {0: "window", 4: "CSA", 128: "HCA"}
DSV4 = "deepseek4"
DSV4_GATING = 4          # expert_gating_func: sqrt(softplus), the only scoring llama.cpp's loader takes
_BLOCK_NAME = re.compile(r"^blk\.(\d+)\.(.+)$")

LLM, ATTN, ROPE = Keys.LLM, Keys.Attention, Keys.Rope
# Metadata the planner reads into ModelSpec.
PLANNER_KEYS = (
    LLM.BLOCK_COUNT, LLM.NEXTN_PREDICT_LAYERS, LLM.EMBEDDING_LENGTH, LLM.VOCAB_SIZE,
    LLM.CONTEXT_LENGTH, LLM.FEED_FORWARD_LENGTH, LLM.EXPERT_FEED_FORWARD_LENGTH,
    LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH, LLM.EXPERT_COUNT, LLM.EXPERT_USED_COUNT,
    LLM.EXPERT_SHARED_COUNT, LLM.LEADING_DENSE_BLOCK_COUNT, ATTN.HEAD_COUNT, ATTN.HEAD_COUNT_KV,
    ATTN.KEY_LENGTH, ATTN.VALUE_LENGTH, ATTN.KEY_LENGTH_MLA, ATTN.VALUE_LENGTH_MLA,
    ATTN.Q_LORA_RANK, ATTN.KV_LORA_RANK, ATTN.SLIDING_WINDOW, ATTN.SLIDING_WINDOW_PATTERN,
    ROPE.DIMENSION_COUNT, NewerKeys.COMPRESS_RATIOS, NewerKeys.HC_COUNT, NewerKeys.HASH_LAYER_COUNT,
    ATTN.Indexer.HEAD_COUNT, ATTN.Indexer.KEY_LENGTH, ATTN.Indexer.TOP_K, NewerKeys.OUTPUT_GROUP_COUNT,
    NewerKeys.OUTPUT_LORA_RANK,
)
# Metadata the runtime's model math reads (norm eps, rope, routing); understood, not planned.
RUNTIME_KEYS = (
    ATTN.LAYERNORM_RMS_EPS, ATTN.LAYERNORM_EPS, ROPE.FREQ_BASE, ROPE.SCALING_TYPE,
    ROPE.SCALING_FACTOR, ROPE.SCALING_ORIG_CTX_LEN, ROPE.SCALING_FINETUNED,
    ROPE.SCALING_YARN_LOG_MUL, ROPE.SCALING_YARN_BETA_FAST, ROPE.SCALING_YARN_BETA_SLOW,
    ROPE.SCALING_ATTN_FACTOR, LLM.EXPERT_WEIGHTS_SCALE,
    LLM.EXPERT_WEIGHTS_NORM, LLM.EXPERT_GATING_FUNC, LLM.EXPERT_GROUP_COUNT,
    LLM.EXPERT_GROUP_USED_COUNT, LLM.EMBEDDING_LENGTH_OUT, LLM.SWIGLU_CLAMP_EXP, LLM.SWIGLU_CLAMP_SHEXP,
    NewerKeys.COMPRESS_ROPE_FREQ_BASE, NewerKeys.HC_SINKHORN_ITERATIONS, NewerKeys.HC_EPSILON,
    ROPE.FREQ_BASE_SWA,                    # early deepseek4 GGUFs: the compressed layers' rope base
    NewerKeys.TARGET_LAYERS, NewerKeys.BLOCK_SIZE,   # a dflash (DSpark) drafter's taps and block
)
# Whole namespaces: provenance, the tokenizer (offload's tokenizer reads it), split bookkeeping,
# quantizer provenance (imatrix file/dataset).
UNDERSTOOD_PREFIXES = ("general.", "tokenizer.", "split.", "quantize.")
# llama.cpp hard-codes some sliding-window patterns instead of storing them (llama-model.cpp
# set_swa_pattern): every n-th block is full attention, the others use the window.
SWA_PATTERN_BY_ARCH = {"gpt-oss": 2}

_SPLIT_NAME = re.compile(r"^(?P<prefix>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


class UnknownMetadataWarning(UserWarning):
    """A GGUF metadata key or tensor kind offload does not understand (reported, not fatal)."""


class HeaderNotice(UserWarning):
    """Something in the header offload acts on in a way the user should know (one line)."""


@dataclass(frozen=True)
class TensorLocation:
    path: str
    offset: int                # absolute offset of the tensor's data in ``path``
    ggml_type: GGMLQuantizationType
    shape: tuple[int, ...]     # numpy order
    n_bytes: int


_NUMPY_TYPES = {
    GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


@dataclass(frozen=True)
class ModelFile:
    """A GGUF model as the planner and the runtime see it (header only)."""

    path: str                              # as the user named it
    shards: tuple[str, ...]
    spec: ModelSpec
    tensors: tuple[TensorInfo, ...]
    metadata: Mapping[str, Any]            # first shard's; long arrays are LazyArray
    locations: Mapping[str, TensorLocation]
    _maps: dict[str, np.memmap] = field(default_factory=dict, repr=False, compare=False)

    def tensor(self, name: str) -> TensorInfo:
        return next(t for t in self.tensors if t.name == name)

    def tensor_data(self, name: str) -> np.ndarray:
        """Read-only memmap view of a tensor's data, shaped like ``ReaderTensor.data``:
        float/int types as that dtype in numpy order, quantized types as uint8 rows of blocks."""
        loc = self.locations[name]
        mm = self._maps.get(loc.path)
        if mm is None:
            mm = self._maps.setdefault(loc.path, np.memmap(loc.path, mode="r"))
        raw = mm[loc.offset:loc.offset + loc.n_bytes]
        dtype = _NUMPY_TYPES.get(loc.ggml_type)
        if dtype is not None:
            return raw.view(dtype).reshape(loc.shape)
        return raw.reshape(quant_shape_to_byte_shape(loc.shape, loc.ggml_type))


def find_shards(path: str | Path) -> list[str]:
    """All shards of a split model (from any one of them), or ``[path]``."""
    path = Path(path)
    m = _SPLIT_NAME.match(path.name)
    if not m:
        return [str(path)]
    count = int(m.group("count"))
    shards = [path.with_name(f"{m.group('prefix')}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    for s in shards:
        if not s.exists():
            raise OffloadError(f"{path}: split model shard {s.name} is missing")
    return [str(s) for s in shards]


def _check_split(headers: list[GGUFHeader]) -> None:
    first = headers[0]
    count = first.metadata.get(Keys.Split.LLM_KV_SPLIT_COUNT)
    if count is None:
        if len(headers) > 1:
            raise OffloadError(f"{first.path}: named as a split shard but has no {Keys.Split.LLM_KV_SPLIT_COUNT} key")
        return
    if count != len(headers):
        raise OffloadError(f"{first.path}: {Keys.Split.LLM_KV_SPLIT_COUNT} is {count} but "
                           f"{len(headers)} shard file(s) were found by name")
    for i, h in enumerate(headers):
        no = h.metadata.get(Keys.Split.LLM_KV_SPLIT_NO)
        if no != i:
            raise OffloadError(f"{h.path}: {Keys.Split.LLM_KV_SPLIT_NO} is {no}, expected {i}")
        # keys a shard repeats must agree with the first shard (gguf-split writes the split
        # keys into every shard, the model's keys into the first)
        for key in (Keys.Split.LLM_KV_SPLIT_COUNT, Keys.Split.LLM_KV_SPLIT_TENSORS_COUNT,
                    Keys.General.ARCHITECTURE):
            if key in h.metadata and h.metadata[key] != first.metadata.get(key):
                raise OffloadError(f"{h.path}: the shards disagree: {key} is {h.metadata[key]!r} here "
                                   f"but {first.metadata.get(key)!r} in {first.path}")
    total = first.metadata.get(Keys.Split.LLM_KV_SPLIT_TENSORS_COUNT)
    found = sum(len(h.tensors) for h in headers)
    if total is not None and total != found:
        raise OffloadError(f"{first.path}: {Keys.Split.LLM_KV_SPLIT_TENSORS_COUNT} is {total} "
                           f"but the shards hold {found} tensors")


def _warn(msg: str) -> None:
    warnings.warn(msg, UnknownMetadataWarning, stacklevel=3)


def _check_keys(path: str, arch: str, metadata: Mapping[str, Any]) -> None:
    known = {k.format(arch=arch) for k in PLANNER_KEYS + RUNTIME_KEYS}
    for key in metadata:
        if key not in known and not key.startswith(UNDERSTOOD_PREFIXES):
            _warn(f"{path}: metadata key {key!r} is not understood by offload; ignored")


class _Meta:
    """Typed access to one architecture's keys, with one-line errors naming the key."""

    def __init__(self, path: str, arch: str, metadata: Mapping[str, Any]):
        self.path, self.arch, self.md = path, arch, metadata

    def key(self, template: str) -> str:
        return template.format(arch=self.arch)

    def get(self, template: str, default: Any = None) -> Any:
        value = self.md.get(self.key(template), default)
        return value.values() if isinstance(value, LazyArray) else value

    def int(self, template: str, default: int | None = None) -> int:
        value = self.get(template, default)
        if value is None:
            raise OffloadError(f"{self.path}: missing metadata key {self.key(template)}")
        if isinstance(value, list):        # per-block arrays: the largest value sizes buffers
            value = max(value, default=0)
        if isinstance(value, bool) or not isinstance(value, int):
            raise OffloadError(f"{self.path}: metadata key {self.key(template)} is {value!r}, not an integer")
        return value

    def per_block(self, template: str, n: int, default: int) -> tuple[int, ...]:
        value = self.get(template, default)
        if isinstance(value, list):
            if len(value) != n:
                raise OffloadError(f"{self.path}: {self.key(template)} has {len(value)} values "
                                   f"for {n} blocks")
            return tuple(int(v) for v in value)
        return (int(value),) * n


def _swa_layers(m: _Meta, n_layer: int, window: int) -> tuple[bool, ...]:
    if not window:
        return ()
    pattern = m.get(ATTN.SLIDING_WINDOW_PATTERN, SWA_PATTERN_BY_ARCH.get(m.arch))
    if isinstance(pattern, list):
        return tuple(bool(x) for x in pattern)
    if not pattern:
        return (True,) * n_layer
    return tuple(il % pattern < pattern - 1 for il in range(n_layer))  # llama.cpp set_swa_pattern


MAX_BLOCKS = 1 << 16      # a block_count no model comes near (checked when no blk.N tensor bounds it)


def _check_block_count(path: str, key: str, n_layer: int, tensor_names) -> None:
    """A block holds tensors: a block_count past the highest ``blk.N`` present cannot be (and
    per-block tables are sized by it, so a corrupt count must stop here). A header without
    block tensors (a vocabulary-only file, a test) is bounded by ``MAX_BLOCKS``."""
    top = max((int(m.group(1)) for m in map(_BLOCK_NAME.match, tensor_names) if m), default=-1)
    if top >= 0 and n_layer > top + 1:
        raise OffloadError(f"{path}: {key} is {n_layer} but the last block among the tensors is blk.{top}")
    if n_layer > MAX_BLOCKS:
        raise OffloadError(f"{path}: {key} is {n_layer}; offload reads at most {MAX_BLOCKS:,} blocks")


def spec_from_metadata(path: str, metadata: Mapping[str, Any], tensors_by_name: Mapping[str, Any]) -> ModelSpec:
    arch = metadata.get(Keys.General.ARCHITECTURE)
    if not isinstance(arch, str) or not arch:
        raise OffloadError(f"{path}: missing metadata key {Keys.General.ARCHITECTURE}")
    _check_keys(path, arch, metadata)
    m = _Meta(path, arch, metadata)
    n_layer = m.int(LLM.BLOCK_COUNT)
    n_embd = m.int(LLM.EMBEDDING_LENGTH)
    n_head = m.int(ATTN.HEAD_COUNT)
    if n_layer < 1 or n_embd < 1 or n_head < 1:
        raise OffloadError(f"{path}: block_count, embedding_length and head_count must be positive")
    _check_block_count(path, m.key(LLM.BLOCK_COUNT), n_layer, tensors_by_name)
    head_k = m.int(ATTN.KEY_LENGTH, n_embd // n_head)
    n_vocab = m.get(LLM.VOCAB_SIZE)
    if n_vocab is None:
        tokens = metadata.get(Keys.Tokenizer.LIST)
        embd = tensors_by_name.get("token_embd.weight")
        n_vocab = len(tokens) if tokens is not None else (embd.shape[0] if embd is not None else 0)
    n_nextn = m.int(LLM.NEXTN_PREDICT_LAYERS, 0)
    if not 0 <= n_nextn < n_layer:
        raise OffloadError(f"{path}: {m.key(LLM.NEXTN_PREDICT_LAYERS)} is {n_nextn} for {n_layer} blocks")
    if arch == DSV4:
        n_nextn = _dsv4_nextn(m, n_layer, n_nextn, tensors_by_name)
        gating = m.get(LLM.EXPERT_GATING_FUNC)
        if gating is not None and gating != DSV4_GATING:
            raise OffloadError(f"{path}: deepseek4: expert_gating_func is {gating}; "
                               f"only {DSV4_GATING} (sqrt-softplus) is supported")
    n_ff_exp = m.int(LLM.EXPERT_FEED_FORWARD_LENGTH, 0)
    window = m.int(ATTN.SLIDING_WINDOW, 0)
    ratios = _compress_ratios(m, n_layer)
    return ModelSpec(
        arch=arch, n_layer=n_layer, n_embd=n_embd, n_vocab=int(n_vocab),
        n_ctx_train=m.int(LLM.CONTEXT_LENGTH), n_head=n_head,
        n_head_kv=m.per_block(ATTN.HEAD_COUNT_KV, n_layer, n_head),
        head_dim_k=head_k, head_dim_v=m.int(ATTN.VALUE_LENGTH, head_k),
        n_nextn=n_nextn, n_rot=m.int(ROPE.DIMENSION_COUNT, head_k),
        n_ff=m.int(LLM.FEED_FORWARD_LENGTH, 0), n_expert=m.int(LLM.EXPERT_COUNT, 0),
        n_expert_used=m.int(LLM.EXPERT_USED_COUNT, 0), n_expert_shared=m.int(LLM.EXPERT_SHARED_COUNT, 0),
        n_ff_exp=n_ff_exp, n_ff_shexp=m.int(LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH, n_ff_exp),
        n_leading_dense=m.int(LLM.LEADING_DENSE_BLOCK_COUNT, 0),
        q_lora_rank=m.int(ATTN.Q_LORA_RANK, 0), kv_lora_rank=m.int(ATTN.KV_LORA_RANK, 0),
        head_dim_k_mla=m.int(ATTN.KEY_LENGTH_MLA, 0), head_dim_v_mla=m.int(ATTN.VALUE_LENGTH_MLA, 0),
        sliding_window=window, swa_layers=_swa_layers(m, n_layer, window),
        compress_ratios=ratios, hc_mult=m.int(NewerKeys.HC_COUNT, None if arch == DSV4 else 0),
        n_hash_layers=m.int(NewerKeys.HASH_LAYER_COUNT, 0),
        indexer_n_head=m.int(ATTN.Indexer.HEAD_COUNT, 0), indexer_head_dim=m.int(ATTN.Indexer.KEY_LENGTH, 0),
        indexer_top_k=m.int(ATTN.Indexer.TOP_K, 0), o_groups=m.int(NewerKeys.OUTPUT_GROUP_COUNT, 0),
        o_lora_rank=m.int(NewerKeys.OUTPUT_LORA_RANK, 0),
    )


def _dsv4_nextn(m: _Meta, n_layer: int, n_nextn: int, tensors_by_name: Mapping[str, Any]) -> int:
    """deepseek4's NextN count as llama.cpp's loader settles it: some trunks (0731 conversions)
    say ``nextn_predict_layers = 1`` but carry no MTP block; llama.cpp probes
    ``blk.{n_layer - n_nextn}.nextn.eh_proj.weight`` and plans without a draft head when it is
    absent, and so does offload (saying so in one line)."""
    if not n_nextn:
        return 0
    probe = f"blk.{n_layer - n_nextn}.nextn.eh_proj.weight"
    if probe in tensors_by_name:
        return n_nextn
    warnings.warn(f"{m.path}: {m.key(LLM.NEXTN_PREDICT_LAYERS)} is {n_nextn} but there is no {probe}: "
                  f"no MTP head in this file; planned without a draft head (give --draft MTP.gguf to draft)",
                  HeaderNotice, stacklevel=4)
    return 0


def _compress_ratios(m: _Meta, n_layer: int) -> tuple[int, ...]:
    """deepseek4's per-block compress ratios: at least ``block_count`` of them (checkpoints list
    the MTP/DSpark stages after the trunk; llama.cpp reads the first block_count), each 0, 4
    or 128. () when the key is absent."""
    value = m.get(NewerKeys.COMPRESS_RATIOS)
    if value is None:
        return ()
    key = m.key(NewerKeys.COMPRESS_RATIOS)
    if not isinstance(value, list) or len(value) < n_layer:
        have = len(value) if isinstance(value, list) else "one"
        raise OffloadError(f"{m.path}: {key} has {have} value(s) for {n_layer} blocks")
    bad = sorted({v for v in value[:n_layer] if v not in COMPRESS_RATIOS}, key=str)
    if bad:
        raise OffloadError(f"{m.path}: {key} holds {bad[0]!r}; each ratio must be one of "
                           f"{', '.join(f'{r} ({k})' for r, k in COMPRESS_RATIOS.items())}")
    return tuple(int(v) for v in value[:n_layer])


def dsv4_config_problem(spec: ModelSpec, metadata: Mapping[str, Any]) -> str | None:
    """What deepseek4's config (``offload.models.deepseek4.config_from_gguf``) cannot be built
    from, in words (None: nothing): a key it reads that is missing, a per-block array too
    short, an attention shape it does not take. Torch-free, so a header is refused before
    any weight is read (a DSpark drafter's stages are built from the same keys)."""
    m = _Meta("", spec.arch, metadata)
    keys = [LLM.EXPERT_GATING_FUNC, NewerKeys.COMPRESS_RATIOS, NewerKeys.HC_COUNT, ATTN.Q_LORA_RANK,
            ATTN.SLIDING_WINDOW, NewerKeys.OUTPUT_GROUP_COUNT, NewerKeys.OUTPUT_LORA_RANK,
            NewerKeys.HASH_LAYER_COUNT, NewerKeys.COMPRESS_ROPE_FREQ_BASE, NewerKeys.HC_SINKHORN_ITERATIONS,
            NewerKeys.HC_EPSILON, LLM.SWIGLU_CLAMP_EXP, ATTN.LAYERNORM_RMS_EPS]
    if any(spec.compress_ratio(i) == 4 for i in range(spec.n_layer_trunk)):      # CSA blocks: the indexer
        keys += [ATTN.Indexer.HEAD_COUNT, ATTN.Indexer.KEY_LENGTH, ATTN.Indexer.TOP_K]
    for template in keys:
        if m.get(template) is None:
            return f"missing metadata key {m.key(template)}"
    for template in (LLM.SWIGLU_CLAMP_EXP, LLM.SWIGLU_CLAMP_SHEXP):
        v = m.get(template)
        if isinstance(v, list) and len(v) < spec.n_layer_trunk:
            return f"{m.key(template)} has {len(v)} values for {spec.n_layer_trunk} blocks"
    if spec.head_dim_k != spec.head_dim_v or set(spec.n_head_kv) != {1}:
        return (f"one K=V head expected (head_count_kv {spec.n_head_kv[0]}, key_length {spec.head_dim_k}, "
                f"value_length {spec.head_dim_v})")
    if not spec.o_groups or (spec.n_head * spec.head_dim_k) % spec.o_groups:
        return f"{spec.n_head} heads of {spec.head_dim_k} do not split into {spec.o_groups} output groups"
    return None


def tensor_kind(name: str) -> tuple[int | None, MODEL_TENSOR | str | None, str]:
    """``blk.12.ffn_down_exps.weight`` → (12, FFN_DOWN_EXP, "ffn_down_exps"); a kind of
    ``NEWER_KINDS`` is its string (``blk.3.hc_attn_fn.weight`` → (3, "HC_ATTN_FN", "hc_attn_fn"))."""
    m = _BLOCK_NAME.match(name)
    rest, table = (m.group(2), _BLOCK_KINDS) if m else (name, _GLOBAL_KINDS)
    layer = int(m.group(1)) if m else None
    stem = rest.rsplit(".", 1)[0]
    for base in (stem, rest):          # "attn_q.weight" → "attn_q"; "ssm_a" has no suffix
        if base in table:
            return layer, table[base], base
    return layer, None, stem


def _tensor_infos(path: str, spec: ModelSpec, headers: list[GGUFHeader]) -> list[TensorInfo]:
    infos, unknown = [], set()
    for h in headers:
        for th in h.tensors:
            layer, kind, base = tensor_kind(th.name)
            if layer is not None and layer >= spec.n_layer:
                raise OffloadError(f"{path}: tensor {th.name} is in block {layer} but "
                                   f"{spec.arch}.block_count is {spec.n_layer}")
            if kind is None and base not in unknown:
                unknown.add(base)
                _warn(f"{path}: tensor kind {base!r} (e.g. {th.name}) is not understood by offload; "
                      f"planned as a dense tensor")
            role = role_of(kind)
            infos.append(TensorInfo(th.name, th.shape, th.ggml_type, th.n_bytes, layer, role,
                                    nextn=layer is not None and spec.is_nextn_layer(layer)))
    return infos


# What the metadata says each tensor's shape is (numpy order; None = not fixed by the
# metadata), as llama.cpp's loader creates them (llama-model.cpp create_tensor). Kinds not
# listed, and MLA attention, are not checked. ``hk``/``hv``: n_head_kv·head_dim of the block.
_SHAPE_OF: dict[MODEL_TENSOR, Any] = {
    MT.TOKEN_EMBD: lambda s, hk, hv: (s.n_vocab, s.n_embd),
    MT.OUTPUT: lambda s, hk, hv: (s.n_vocab, s.n_embd),
    **dict.fromkeys([MT.OUTPUT_NORM, MT.ATTN_NORM, MT.FFN_NORM, MT.ATTN_POST_NORM, MT.NEXTN_ENORM,
                     MT.NEXTN_HNORM, MT.NEXTN_SHARED_HEAD_NORM], lambda s, hk, hv: (s.n_embd,)),
    MT.ATTN_Q: lambda s, hk, hv: (s.n_head * s.head_dim_k, s.n_embd),
    MT.ATTN_K: lambda s, hk, hv: (hk, s.n_embd),
    MT.ATTN_V: lambda s, hk, hv: (hv, s.n_embd),
    MT.ATTN_OUT: lambda s, hk, hv: (s.n_embd, s.n_head * s.head_dim_v),
    **dict.fromkeys([MT.ATTN_Q_NORM, MT.ATTN_K_NORM], lambda s, hk, hv: (s.head_dim_k,)),
    MT.FFN_GATE_INP: lambda s, hk, hv: (s.n_expert, s.n_embd),
    MT.FFN_EXP_PROBS_B: lambda s, hk, hv: (s.n_expert,),
    **dict.fromkeys([MT.FFN_GATE_EXP, MT.FFN_UP_EXP], lambda s, hk, hv: (s.n_expert, s.n_ff_exp, s.n_embd)),
    MT.FFN_DOWN_EXP: lambda s, hk, hv: (s.n_expert, s.n_embd, s.n_ff_exp),
    **dict.fromkeys([MT.FFN_GATE_SHEXP, MT.FFN_UP_SHEXP], lambda s, hk, hv: (None, s.n_embd)),
    MT.FFN_DOWN_SHEXP: lambda s, hk, hv: (s.n_embd, None),
    **dict.fromkeys([MT.FFN_GATE, MT.FFN_UP], lambda s, hk, hv: (s.n_ff, s.n_embd)),
    MT.FFN_DOWN: lambda s, hk, hv: (s.n_embd, s.n_ff),
    MT.NEXTN_EH_PROJ: lambda s, hk, hv: (s.n_embd, 2 * s.n_embd),
    **dict.fromkeys([MT.NEXTN_EMBED_TOKENS, MT.NEXTN_SHARED_HEAD_HEAD], lambda s, hk, hv: (s.n_vocab, s.n_embd)),
}
_MLA_FREE = {MT.ATTN_Q, MT.ATTN_K, MT.ATTN_V, MT.ATTN_OUT, MT.ATTN_Q_NORM, MT.ATTN_K_NORM}
_BIAS_OF = {MT.ATTN_Q: lambda s, hk, hv: (s.n_head * s.head_dim_k,), MT.ATTN_K: lambda s, hk, hv: (hk,),
            MT.ATTN_V: lambda s, hk, hv: (hv,)}




def _hc_fn(s: ModelSpec, layer) -> tuple[int, int]:
    """hc_{attn,ffn}_fn: pre (hc), post (hc) and the hc × hc mixing, from the hc·n_embd streams."""
    return ((2 + s.hc_mult) * s.hc_mult, s.hc_mult * s.n_embd)


def _coff(s: ModelSpec, layer: int) -> int:
    """A compressor's projections per token: CSA's windows overlap (two), HCA's do not (one)."""
    return 2 if s.compress_ratio(layer) == 4 else 1


# deepseek4's shapes (numpy order) per kind, as llama.cpp's loader creates them (create_tensor in
# llama-model.cpp's LLM_ARCH_DEEPSEEK4 case; ../shared/deepseek4.md §1.3), with the keys that fix
# them (named in the refusal). ``layer`` is the block (None for global tensors).
_E, _HC, _DK = LLM.EMBEDDING_LENGTH, NewerKeys.HC_COUNT, ATTN.KEY_LENGTH
_RATIOS, _IH, _ID = NewerKeys.COMPRESS_RATIOS, ATTN.Indexer.HEAD_COUNT, ATTN.Indexer.KEY_LENGTH
_DSV4_SHAPE_OF: dict[MODEL_TENSOR | str, tuple[Any, tuple[str, ...]]] = {
    MT.ATTN_Q_A: (lambda s, i: (s.q_lora_rank, s.n_embd), (ATTN.Q_LORA_RANK, _E)),
    MT.ATTN_Q_A_NORM: (lambda s, i: (s.q_lora_rank,), (ATTN.Q_LORA_RANK,)),
    MT.ATTN_Q_B: (lambda s, i: (s.n_head * s.head_dim_k, s.q_lora_rank), (ATTN.HEAD_COUNT, _DK, ATTN.Q_LORA_RANK)),
    "ATTN_KV": (lambda s, i: (s.n_head_kv[i] * s.head_dim_k, s.n_embd), (ATTN.HEAD_COUNT_KV, _DK, _E)),
    MT.ATTN_KV_A_NORM: (lambda s, i: (s.head_dim_k,), (_DK,)),
    MT.ATTN_SINKS: (lambda s, i: (s.n_head,), (ATTN.HEAD_COUNT,)),
    "ATTN_OUT_A": (lambda s, i: (s.o_groups * s.o_lora_rank, s.n_head * s.head_dim_k // max(1, s.o_groups)),
                   (NewerKeys.OUTPUT_GROUP_COUNT, NewerKeys.OUTPUT_LORA_RANK, ATTN.HEAD_COUNT, _DK)),
    "ATTN_OUT_B": (lambda s, i: (s.n_embd, s.o_groups * s.o_lora_rank),
                   (_E, NewerKeys.OUTPUT_GROUP_COUNT, NewerKeys.OUTPUT_LORA_RANK)),
    **{f"HC_{p}_FN": (_hc_fn, (_HC, _E)) for p in ("ATTN", "FFN")},
    **{f"HC_{p}_BASE": (lambda s, i: ((2 + s.hc_mult) * s.hc_mult,), (_HC,)) for p in ("ATTN", "FFN")},
    **{f"HC_{p}_SCALE": (lambda s, i: (3,), ()) for p in ("ATTN", "FFN")},
    **{f"{who}HC_HEAD_FN": (lambda s, i: (s.hc_mult, s.hc_mult * s.n_embd), (_HC, _E)) for who in ("", "NEXTN_")},
    **{f"{who}HC_HEAD_BASE": (lambda s, i: (s.hc_mult,), (_HC,)) for who in ("", "NEXTN_")},
    **{f"{who}HC_HEAD_SCALE": (lambda s, i: (1,), ()) for who in ("", "NEXTN_")},
    **{f"ATTN_COMPRESSOR_{w}": (lambda s, i: (_coff(s, i) * s.head_dim_k, s.n_embd), (_RATIOS, _DK, _E))
       for w in ("WKV", "WGATE")},
    "ATTN_COMPRESSOR_APE": (lambda s, i: (s.compress_ratio(i), _coff(s, i) * s.head_dim_k), (_RATIOS, _DK)),
    "ATTN_COMPRESSOR_NORM": (lambda s, i: (s.head_dim_k,), (_DK,)),
    **{f"INDEXER_COMPRESSOR_{w}": (lambda s, i: (2 * s.indexer_head_dim, s.n_embd), (_ID, _E))
       for w in ("WKV", "WGATE")},
    "INDEXER_COMPRESSOR_APE": (lambda s, i: (4, 2 * s.indexer_head_dim), (_ID,)),
    "INDEXER_COMPRESSOR_NORM": (lambda s, i: (s.indexer_head_dim,), (_ID,)),
    MT.INDEXER_PROJ: (lambda s, i: (s.indexer_n_head, s.n_embd), (_IH, _E)),
    MT.INDEXER_ATTN_Q_B: (lambda s, i: (s.indexer_n_head * s.indexer_head_dim, s.q_lora_rank),
                          (_IH, _ID, ATTN.Q_LORA_RANK)),
    "FFN_GATE_TID2EID": (lambda s, i: (s.n_vocab, s.n_expert_used), (LLM.VOCAB_SIZE, LLM.EXPERT_USED_COUNT)),
}
# Kinds whose type their meaning fixes: the routing table holds expert ids (llama-quant.cpp
# never quantizes integer tensors; a quantized one would be a corrupt file).
_TYPE_OF: dict[MODEL_TENSOR | str, tuple[GGMLQuantizationType, str]] = {
    "FFN_GATE_TID2EID": (GGMLQuantizationType.I32, "expert ids per token: I32, never a quantized type"),
}
# The tensors of a deepseek4 block that only a compressed (CSA, HCA) or only a CSA block has.
_DSV4_COMPRESSED = {f"ATTN_COMPRESSOR_{w}" for w in ("WKV", "WGATE", "APE", "NORM")}
_DSV4_CSA = {f"INDEXER_COMPRESSOR_{w}" for w in ("WKV", "WGATE", "APE", "NORM")} | {MT.INDEXER_PROJ,
                                                                                  MT.INDEXER_ATTN_Q_B}


def _dsv4_rule(spec: ModelSpec, name: str):
    """(shape, keys) of a deepseek4 tensor whose kind ``_DSV4_SHAPE_OF`` lists, else None."""
    if spec.arch != DSV4 or not name.endswith(".weight"):
        return None
    layer, kind, _ = tensor_kind(name)
    entry = _DSV4_SHAPE_OF.get(kind)
    if entry is None:
        return None
    rule, keys = entry
    return rule(spec, layer if layer is not None else 0), keys


def expected_shape(spec: ModelSpec, name: str) -> tuple[int | None, ...] | None:
    """The shape the metadata gives tensor ``name`` (None where it does not say)."""
    layer, kind, base = tensor_kind(name)
    if kind is None or (spec.is_mla and kind in _MLA_FREE):
        return None
    dsv4 = _dsv4_rule(spec, name)
    if dsv4 is not None:
        return dsv4[0]
    table = _BIAS_OF if name.endswith(".bias") else _SHAPE_OF if name.endswith(".weight") else {}
    rule = table.get(kind)
    if rule is None:
        return None
    n_kv = spec.n_head_kv[layer] if layer is not None and layer < len(spec.n_head_kv) else spec.n_head_kv[0]
    return rule(spec, n_kv * spec.head_dim_k, n_kv * spec.head_dim_v)


def _key_values(model: "ModelFile", keys: tuple[str, ...], layer: int | None) -> str:
    """``deepseek4.hyper_connection.count = 4, …`` for a refusal (a per-block array: its value
    for the tensor's block)."""
    out = []
    for template in keys:
        key = template.format(arch=model.spec.arch)
        value = model.metadata.get(key)
        value = value.values() if isinstance(value, LazyArray) else value
        if isinstance(value, list) and layer is not None and layer < len(value):
            key, value = f"{key}[{layer}]", value[layer]
        out.append(f"{key} = {'(missing)' if value is None else value}")
    return ", ".join(out)


def check_shapes(model: "ModelFile", names=None) -> None:
    """Refuse, in one line, a tensor (of ``names``, default all) whose shape disagrees with
    the metadata, or whose type its meaning fixes (``_TYPE_OF``) is another — before a
    mismatched matrix fails deep inside a forward pass (``offload plan`` checks at planning,
    the runtime at load)."""
    spec = model.spec
    for t in model.tensors:
        if names is not None and t.name not in names:
            continue
        layer, kind, base = tensor_kind(t.name)
        fixed = _TYPE_OF.get(kind)
        if fixed is not None and t.ggml_type != fixed[0]:
            raise OffloadError(f"{model.path}: tensor {t.name} is {t.ggml_type.name}, but {base} holds "
                               f"{fixed[1]}")
        if spec.arch == DSV4 and layer is not None and not spec.is_nextn_layer(layer) and (
                (kind in _DSV4_COMPRESSED and not spec.compress_ratio(layer))
                or (kind in _DSV4_CSA and spec.compress_ratio(layer) != 4)):
            raise OffloadError(f"{model.path}: tensor {t.name} belongs to a compressed block but "
                               f"{_key_values(model, (NewerKeys.COMPRESS_RATIOS,), layer)}")
        want = expected_shape(spec, t.name)
        if want is None:
            continue
        if len(want) != len(t.shape) or any(w is not None and w != d for w, d in zip(want, t.shape)):
            shown = "(" + ", ".join("*" if w is None else str(w) for w in want) + ")"
            dsv4 = _dsv4_rule(spec, t.name)
            by = (_key_values(model, dsv4[1], layer) if dsv4 is not None and dsv4[1]
                  else f"the metadata ({spec.arch}.*)")
            raise OffloadError(f"{model.path}: tensor {t.name} has shape {t.shape} but {by} gives {shown}")


def open_model(path: str | Path) -> ModelFile:
    """Read the header(s) of a GGUF model; see the module docstring."""
    path = str(path)
    headers = [read_header(p) for p in find_shards(path)]
    _check_split(headers)
    seen: dict[str, str] = {}
    for h in headers:
        for th in h.tensors:
            if th.name in seen:
                raise OffloadError(f"{h.path}: tensor {th.name} is also in {seen[th.name]}")
            seen[th.name] = h.path
    by_name = {th.name: th for h in headers for th in h.tensors}
    spec = spec_from_metadata(path, headers[0].metadata, by_name)
    tensors = _tensor_infos(path, spec, headers)
    locations = {th.name: TensorLocation(h.path, th.data_offset, th.ggml_type, th.shape, th.n_bytes)
                 for h in headers for th in h.tensors}
    return ModelFile(path, tuple(h.path for h in headers), spec, tuple(tensors),
                     dict(headers[0].metadata), locations)
