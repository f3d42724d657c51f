"""Plan files and draft models as the library opens them: ``offload.load``, ``offload run`` /
``plan`` / ``tune`` / ``serve`` all resolve a ``--placement`` file or a ``--draft`` GGUF here.
"""
from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path

from offload.dspark_header import dspark_header
from offload.errors import OffloadError
from offload.gguf_model import ModelFile, open_model
from placement.hosts import Host, parse_hosts
from placement.plan import Plan, build_plan
from placement.plan_file import PlanFile, load_hosts_file, load_plan_file
from placement.tensors import Role


# drafter architectures (a GGUF of its own, told by its header) and the trunks they draft for
DRAFTER_ARCHS = {"dflash": ("deepseek4",)}


def open_draft(path: str, model: ModelFile) -> ModelFile:
    """A ``--draft`` GGUF: a NextN block of the same architecture and width as the model, or a
    drafter of its own architecture (``DRAFTER_ARCHS``: DSpark's ``dflash`` for deepseek4),
    recognised by its header and checked against the trunk before any weight is read."""
    draft = open_model(path)
    if draft.spec.arch in DRAFTER_ARCHS:
        check_drafter(draft, model)
        return draft
    if not any(t.role is Role.NEXTN for t in draft.tensors):
        raise OffloadError(f"{path}: --draft needs a GGUF holding a NextN block (no blk.N.nextn.* tensors)")
    if (draft.spec.arch, draft.spec.n_embd) != (model.spec.arch, model.spec.n_embd):
        raise OffloadError(f"{path}: draft is {draft.spec.arch} with n_embd {draft.spec.n_embd}, "
                           f"the model is {model.spec.arch} with n_embd {model.spec.n_embd}")
    return draft


def check_drafter(draft: ModelFile, model: ModelFile) -> None:
    """A DSpark (``dflash``) drafter fits ``model``: its trunk architecture, then everything its
    builder reads besides the weights (``offload.dspark_header``: keys, glue tensors, width,
    vocabulary, tapped layers)."""
    arch, path = draft.spec.arch, draft.path
    if model.spec.arch not in DRAFTER_ARCHS[arch]:
        raise OffloadError(f"{path}: a {arch} drafter drafts for {', '.join(DRAFTER_ARCHS[arch])}, "
                           f"not for {model.spec.arch}")
    dspark_header(draft, model.spec)


def read_plan_file(path: str) -> PlanFile:
    """The parsed plan file at ``path``; unreadable or malformed → one-line error."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise OffloadError(f"{path}: cannot read plan file ({getattr(exc, 'strerror', None) or exc})") from None
    return load_plan_file(text, path)


def plan_from_file(path: str, model: ModelFile | None,
                   draft_path: str | None = None) -> tuple[Plan, ModelFile, ModelFile | None]:
    """The plan file at ``path`` resolved against ``model`` (None: the model it names) → (Plan, model, draft)."""
    pf = read_plan_file(path)
    if pf.hosts is not None:
        raise OffloadError(f"{path}: a plan across hosts ({', '.join(h.name for h in pf.hosts)}) runs only with "
                           "`offload run --rank R --world-size W`, one process per host (`offload plan --placement` "
                           "reads it)")
    if model is None:
        model = open_model(pf.model_path)
    elif Path(model.path).resolve() != Path(pf.model_path).resolve():
        warnings.warn(f"{path} was made for {pf.model_path}; planning {model.path}", stacklevel=2)
    if pf.n_layer != model.spec.n_layer:
        raise OffloadError(f"{path}: the plan's layout is for {pf.n_layer} blocks but {model.path} "
                           f"has {model.spec.n_layer}")
    draft_path = draft_path or pf.draft_path
    draft = open_draft(draft_path, model) if draft_path else None
    plan = build_plan(model, pf.placement, pf.settings, pf.devices, pf.targets, mode="plan file", draft=draft,
                      hot_experts=pf.hot_experts)
    plan = dataclasses.replace(plan, speculative=pf.speculative)
    plan.check_fits()
    return plan, model, draft


def read_hosts(value: str) -> tuple[Host, ...]:
    """``--hosts``: a hosts YAML when the value names one (``.yaml`` / ``.yml``, or an existing
    file), else the inline spec ``a:CUDA0=24GiB,CPU=256GiB;b:CPU=512GiB``."""
    path = Path(value)
    if value.endswith((".yaml", ".yml")) or path.is_file():
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise OffloadError(f"--hosts {value}: cannot read hosts file "
                               f"({getattr(exc, 'strerror', None) or exc})") from None
        return load_hosts_file(text, value)
    return parse_hosts(value)
