"""Loading: GGUF + placement → a model on its devices, as a ``Session`` (``offload.session``);
``offload.load`` is ``load``. The op-offload wiring is ``offload.op_offload``'s.
"""
from __future__ import annotations

import sys
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from cpu_kernels import set_num_threads
from cpu_kernels.simd8 import has_int8_dot
from gpu.kv_cache import CacheType
from offload.cpu_ops import DECODE_ACTIVATIONS, install_cpu_attention
from offload.decode_int8 import choose_decode_int8
from offload.devices import DeviceMap, resolve
from offload.errors import OffloadError
from offload.gguf_model import ModelFile, check_shapes, open_model
import offload.dspark  # noqa: F401  (registers DSpark: the dflash --draft builder, drafter kind dspark)
from offload.models import architecture
from offload.models.shared.base import BuildContext
from offload.op_offload import enable_op_offload
from offload.plans import open_draft, plan_from_file
from offload.profile import Profile
from offload.progress import Progress
from offload.session import Session
from offload.tokenizer import Tokenizer
from offload.weights import WeightStore
from placement.devices import resolve_devices
from placement.limits import INT8_FROM
from placement.memory import cache_type, dsv4_cache, kv_cells
from placement.plan import Plan
from placement.planner import PlanOptions, make_plan

# the torch dtype of each name --gpu-dtype and --cache-type take
TORCH_DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


def kv_cache_type(name: str) -> CacheType:
    """A --cache-type name as ``gpu.kv_cache`` takes it: a torch float dtype, or the GGUF type of
    a block-quantized cache (every type the planner accepts, ``placement.memory.CACHE_TYPES``)."""
    return TORCH_DTYPES.get(name.lower()) or cache_type(name)


def compute_dtypes(devices: DeviceMap, gpu_dtype: str) -> dict[str, torch.dtype]:
    """Dtype GPU-resident weights are dequantized into per call: ``auto`` = bfloat16 on CUDA,
    float32 on CPU-backed devices (torch's CPU matmuls are slow and less exact in bf16)."""
    out = {}
    for name, dev in devices.torch_devices.items():
        if gpu_dtype == "auto":
            out[name] = torch.float32 if dev.type == "cpu" else torch.bfloat16
        else:
            out[name] = TORCH_DTYPES[gpu_dtype]
    return out


def plan_for(model: ModelFile, placement=None, devices: str | None = None, draft: str | None = None,
             **plan_options) -> Plan:
    """A Plan for ``model``: ``placement`` may be a Plan, a plan YAML path, or None (plan now
    for ``devices`` with ``placement.planner.make_plan``; the planner's flags as keywords, named
    and spelled as ``PlanOptions.from_flags`` takes them, e.g. ``n_cpu_moe=10``,
    ``override_tensor=["exps=CPU"]``, ``tensor_split="1,1"``, ``fit="on"``, ``cache_type="f32"``;
    ``draft``: a GGUF holding a NextN block to draft with)."""
    if isinstance(placement, Plan):
        if devices is not None or draft is not None or plan_options:
            raise OffloadError("give either a Plan or planning options, not both")
        return placement
    if placement is not None:
        if devices is not None or plan_options:
            raise OffloadError(f"the plan file {placement} fixes the placement; give no planning options with it")
        return plan_from_file(str(placement), model, draft)[0]
    options = PlanOptions.from_flags(**plan_options)
    draft_model = open_draft(draft, model) if draft is not None else None
    return make_plan(model, resolve_devices(devices or "auto"), options, draft=draft_model)


def load(model_path, *, placement=None, devices: str | None = None, virtual_gpus: bool = False,
         gpu_dtype: str = "auto", threads: int | None = None, progress: bool = False,
         quiet: bool = False, op_offload: str = "auto", int8_prefill: bool = True,
         decode_activations: str = "auto", **plan_options) -> Session:
    """Load a GGUF model where a plan puts each tensor.

    ``placement``: a Plan, a plan YAML path, or None to plan now for ``devices`` (``"auto"``
    by default, or a spec like ``"CUDA0=24GiB,CPU=64GiB"``) with the planner's flags as
    keywords (see ``plan_for``). ``virtual_gpus`` backs CUDA devices with the CPU where no
    CUDA exists. ``gpu_dtype``: compute dtype of GPU-resident weights (auto/f32/f16/bf16).
    ``threads``: CPU expert kernel threads. ``op_offload`` (auto/on/off): stream RAM-resident
    experts to a GPU for prompt batches of at least a threshold (``offload.op_offload``).
    ``int8_prefill`` (default on; the CLI's ``--prefill-activations int8|float``): prompt
    batches (more than ``placement.limits.DECODE_TOKENS`` tokens) quantize activations to int8 per
    32 values for the CPU kernels, as llama.cpp's Q8 activations, with integer dot products
    (VNNI or AVX2; a CPU without either runs the float path). Error bound per dot product in
    ``cpu_kernels.settings``; on the shipped model's logits it is held under 2e-2 of the
    largest (tests/kernels/test_prefill.py). ``placement.compute`` counts the quantized activations.
    ``decode_activations`` (the CLI's ``--decode-activations auto|int8|float``): the CPU routed
    experts' activations for decode/verify batches (at most ``placement.limits.DECODE_TOKENS``
    tokens): "auto" = int8 for the weight types whose int8 path measured faster on this CPU
    (``offload.decode_int8``: measured at the first load, then cached; the built-in
    ``placement.limits.DECODE_INT8_TYPES`` under ``OFFLOAD_DECODE_INT8=prior``), float for the
    others; "int8"; "float".
    """
    model = open_model(model_path)
    return load_plan(model, plan_for(model, placement, devices, **plan_options), virtual_gpus=virtual_gpus,
                     gpu_dtype=gpu_dtype, threads=threads, progress=progress, quiet=quiet, op_offload=op_offload,
                     int8_prefill=int8_prefill, decode_activations=decode_activations)


def load_plan(model: ModelFile, plan: Plan, *, virtual_gpus: bool = False, gpu_dtype: str = "auto",
              threads: int | None = None, progress: bool = False, quiet: bool = False,
              op_offload: str = "auto", int8_prefill: bool = True, decode_activations: str = "auto") -> Session:
    """``load`` for an opened model and a resolved plan (what ``offload run`` calls)."""
    if decode_activations not in DECODE_ACTIVATIONS:
        raise OffloadError(f"decode activations {decode_activations!r}: expected one of "
                           f"{', '.join(DECODE_ACTIVATIONS)}")
    t0 = time.perf_counter()
    torch_threads = torch.get_num_threads()     # put back after loading's first compiled calls (cpu_ops.compiled)
    if threads is not None:
        if threads < 1:
            raise OffloadError(f"threads must be >= 1, got {threads}")
        set_num_threads(threads)
    install_cpu_attention()
    arch = architecture(model.spec.arch)
    devices = resolve(set(plan.tensors.values()) | set(plan.draft_tensors.values()), virtual_gpus=virtual_gpus)
    if devices.virtual and not quiet:
        print(f"offload: note: {', '.join(devices.virtual)} backed by the CPU (--virtual-gpus); "
              "no CUDA is used", file=sys.stderr)
    if decode_activations == "int8" and not has_int8_dot() and not quiet:
        print("offload: note: this CPU has no u8 x s8 dot product (AVX512-VNNI / AVX-VNNI / AVX2): "
              "--decode-activations int8 runs float activations", file=sys.stderr)
    cfg = arch.config_from_gguf(model.spec, model.metadata)
    draft = open_model(plan.draft_path) if plan.draft_path else None
    for m in (model, draft):
        if m is not None:
            check_shapes(m)
    # with a --draft file its NextN block replaces the model's own (which stays unloaded)
    tensors = [t for t in model.tensors if not (draft is not None and t.nextn)]
    tensors += list(draft.tensors) if draft is not None else []
    if decode_activations == "auto":
        choose_decode_int8(tensors, {**plan.tensors, **plan.draft_tensors}, model.spec.n_expert_used, quiet)
    profile = Profile()
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cpu-experts")
    bar = Progress(len(tensors), sum(t.n_bytes for t in tensors)) if progress else None
    dtypes = compute_dtypes(devices, gpu_dtype)
    # prompt batches (more tokens than a compiled decode/verify step) use int8 activations
    int8_batch = INT8_FROM if int8_prefill else None
    weights = WeightStore(model, plan.tensors, devices, compute_dtype=dtypes, profile=profile, progress=bar,
                          hot_experts=plan.hot_experts, int8_batch=int8_batch,
                          decode_activations=decode_activations)
    draft_weights = (WeightStore(draft, plan.draft_tensors, devices, compute_dtype=dtypes, profile=profile,
                                 progress=bar, int8_batch=int8_batch, decode_activations=decode_activations)
                     if draft is not None else None)
    ctx = BuildContext(profile=profile, pool=pool, kv_dtype=kv_cache_type(plan.settings.cache_type),
                       kv_dtype_v=kv_cache_type(plan.settings.v_type),
                       kv_cells=lambda layer: kv_cells(model.spec, layer, plan.settings),
                       dsv4_cache=lambda layer: dsv4_cache(model.spec, layer, plan.settings))
    with torch.inference_mode():
        net = arch.build(cfg, weights, ctx, draft=draft_weights)
    if bar is not None:
        bar.close()
    if not quiet:
        unused = weights.unused()
        if draft is not None:
            replaced = [n for n in unused if model.tensor(n).nextn]
            if replaced:
                print(f"offload: note: the model's own NextN block ({len(replaced)} tensors) is not used: "
                      f"--draft {plan.draft_path} replaces it", file=sys.stderr)
            unused = [n for n in unused if n not in replaced] + (draft_weights.unused())
        for name in unused:
            print(f"offload: note: tensor {name} is not used by the {model.spec.arch} runtime", file=sys.stderr)
    threshold, account = enable_op_offload(net, weights, plan, model, op_offload, virtual=bool(devices.virtual))
    if not quiet and (threshold is not None or op_offload == "on"):
        print(f"offload: {account}", file=sys.stderr)
    session = Session(model=net, tokenizer=Tokenizer.from_gguf(model.metadata), devices=devices,
                      weights=weights, profile=profile, pool=pool, meta=model.metadata, plan=plan)
    session.op_offload_min = threshold
    if draft_weights is not None:
        for dev, n in draft_weights.allocated.items():
            session.allocated[dev] = session.allocated.get(dev, 0) + n
    session.load_s = time.perf_counter() - t0
    torch.set_num_threads(torch_threads)
    return session
