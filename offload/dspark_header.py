"""A DSpark drafter's header (a ``dflash`` GGUF given as ``--draft``): everything its builder
(``offload.dspark``) reads besides the weights, read and checked here, torch-free, before any
weight of the trunk or the drafter is read (``offload.plans.check_drafter``: ``offload plan``,
``run``, ``bench``, ``tune``, ``serve``). Each problem is one line naming the file and the key
or tensor.

Keys as llama.cpp reads them (``src/models/dflash.cpp``, ``common/speculative.cpp``):
``dflash.target_layers``, ``dflash.block_size``, ``tokenizer.ggml.mask_token_id``,
``dflash.sample_from_anchor`` (absent: true), and the V4 keys its stages are built from
(``offload.gguf_model.dsv4_config_problem``, as for a deepseek4 trunk).
"""
from __future__ import annotations

from dataclasses import dataclass

from offload.errors import OffloadError
from offload.gguf_header import LazyArray
from offload.gguf_model import ModelFile, NewerKeys, dsv4_config_problem
from placement.tensors import ModelSpec

# the drafter's own tensors besides its stages (blk.N.*), by the name the builder reads
GLUE = ("fc.weight", "enc.output_norm.weight", "output_norm.weight", "markov_w1.weight", "markov_w2.weight",
        "output_hc_fn.weight", "output_hc_base.weight", "output_hc_scale.weight")


@dataclass(frozen=True)
class DSparkHeader:
    target_layers: tuple[int, ...]     # block inputs of the trunk whose stream means are the taps
    block_size: int                    # tokens per draft block (as trained)
    mask_id: int                       # the noise token of a block's positions after the first
    # llama.cpp's dflash.sample_from_anchor: true, draft i comes from block row i (the anchor's
    # row drafts the first token); false (SpecForge's bonus-anchor exports), the anchor's row is
    # not a draft and drafts come from rows 1.. (a block of n drafts is n + 1 tokens)
    sample_from_anchor: bool

    @property
    def max_drafts(self) -> int:
        """Drafts one block can make (llama.cpp's n_draft_max)."""
        return self.block_size if self.sample_from_anchor else self.block_size - 1


def _int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def dspark_header(draft: ModelFile, trunk: ModelSpec) -> DSparkHeader:
    """The header of the DSpark drafter ``draft`` for the trunk ``trunk``, checked: its keys,
    its glue tensors' presence and shapes, and that it fits the trunk (width, vocabulary,
    hyper-connection streams, tapped layers). One-line ``OffloadError`` otherwise."""
    path, arch, meta, spec = draft.path, draft.spec.arch, draft.metadata, draft.spec
    problem = dsv4_config_problem(spec, meta)
    if problem is not None:
        raise OffloadError(f"{path}: the DSpark drafter's stages: {problem}")
    if spec.n_embd != trunk.n_embd:
        raise OffloadError(f"{path}: the drafter's width {spec.n_embd} is not the model's {trunk.n_embd}")
    if spec.hc_mult != trunk.hc_mult:
        raise OffloadError(f"{path}: the drafter has {spec.hc_mult} hyper-connection streams, the model "
                           f"{trunk.hc_mult}")
    shapes = {t.name: t.shape for t in draft.tensors}
    for name in GLUE:
        if name not in shapes:
            raise OffloadError(f"{path}: a DSpark drafter needs tensor {name}")
    key = NewerKeys.TARGET_LAYERS.format(arch=arch)
    taps = meta.get(key)
    taps = taps.values() if isinstance(taps, LazyArray) else taps
    n = trunk.n_layer - trunk.n_nextn
    if not taps or not isinstance(taps, (list, tuple)) or any(not _int(t) or not 1 <= t <= n for t in taps):
        raise OffloadError(f"{path}: {key} {taps!r} must name block inputs 1..{n} of the model ({n} trunk blocks)")
    taps = tuple(int(t) for t in taps)
    key = NewerKeys.BLOCK_SIZE.format(arch=arch)
    block_size = meta.get(key)
    if block_size is None:
        raise OffloadError(f"{path}: a DSpark drafter needs metadata key {key}")
    anchor_key = f"{arch}.sample_from_anchor"
    anchor = meta.get(anchor_key, True)
    if not isinstance(anchor, bool):
        raise OffloadError(f"{path}: {anchor_key} is {anchor!r}, not true or false")
    least = 1 if anchor else 2               # a bonus-anchor block drafts from its rows 1..
    if not _int(block_size) or block_size < least:
        raise OffloadError(f"{path}: {key} is {block_size!r}; it must be an integer >= {least}"
                           + ("" if anchor else f" ({anchor_key} is false: the anchor's row drafts nothing)"))
    mask = meta.get(NewerKeys.MASK_ID)
    if mask is None:
        raise OffloadError(f"{path}: a DSpark drafter needs metadata key {NewerKeys.MASK_ID} (the noise token "
                           "of its draft blocks)")
    if not _int(mask) or not 0 <= mask < trunk.n_vocab:
        raise OffloadError(f"{path}: {NewerKeys.MASK_ID} is {mask!r}, not a token of the model's "
                           f"{trunk.n_vocab}-token vocabulary")
    d, v = trunk.n_embd, trunk.n_vocab
    w1, w2 = tuple(shapes["markov_w1.weight"]), tuple(shapes["markov_w2.weight"])
    for shape in (w1, w2):
        if shape[0] != v:             # the Markov head's rows are the trunk's tokens
            raise OffloadError(f"{path}: the drafter's vocabulary is {shape[0]} tokens, the model's {v}")
    rank = w1[-1]
    want = {"fc.weight": ((d, len(taps) * d), f"{len(taps)} tapped layers of width {d}"),
            "markov_w2.weight": ((v, rank), f"markov_w1's rank {rank}")}
    if "conf_proj.weight" in shapes:
        want["conf_proj.weight"] = ((1, d + rank), f"width {d} + the Markov rank {rank}")
    for name, (shape, why) in want.items():
        if tuple(shapes[name]) != shape:
            raise OffloadError(f"{path}: tensor {name} has shape {tuple(shapes[name])}; {why} give {shape}")
    return DSparkHeader(taps, int(block_size), int(mask), anchor)
