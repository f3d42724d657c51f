"""Assembly: GGUF + placement → a loaded model on its devices, and the session API
(``offload.load``) that the CLI and embedders use.
"""
from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from typing import Iterator, Mapping, Sequence

import numpy as np
import torch

from cpu_kernels import set_num_threads
from gpu.kv_cache import KVCache
from offload.commands.plan import add_placement_arguments, plan_from_args
from offload.compiled_block import MAX_TOKENS
from offload.devices import DeviceMap, resolve
from offload.errors import OffloadError
from offload.gguf_model import ModelFile, open_model
from offload.models import architecture
from offload.models.common import BuildContext, CausalLM
from offload.profile import Profile
from offload.progress import Progress
from offload.sampling import Sampler
from offload.speculative import SpecOptions, generate_step
from offload.stats import RunStats, peak_rss_bytes
from offload.tokenizer import Tokenizer
from offload.weights import WeightStore
from placement.memory import CACHE_PAD, pad
from placement.plan import Plan

_DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


def compute_dtypes(devices: DeviceMap, gpu_dtype: str) -> dict[str, torch.dtype]:
    """Dtype GPU-resident weights are dequantized into per call: ``auto`` = bfloat16 on CUDA,
    float32 on CPU-backed devices (torch's CPU matmuls are slow and less exact in bf16)."""
    out = {}
    for name, dev in devices.torch_devices.items():
        if gpu_dtype == "auto":
            out[name] = torch.float32 if dev.type == "cpu" else torch.bfloat16
        else:
            out[name] = _DTYPES[gpu_dtype]
    return out


class Session:
    """A loaded model. ``logits`` and ``generate`` each start a fresh sequence."""

    def __init__(self, *, model: CausalLM, tokenizer, devices: DeviceMap, weights: WeightStore,
                 profile: Profile, pool: ThreadPoolExecutor, meta: Mapping, plan: Plan):
        self.model, self.tokenizer, self.devices, self.plan = model, tokenizer, devices, plan
        self.allocated = dict(weights.allocated)
        self.profile, self._pool, self.meta = profile, pool, meta
        self.load_s = 0.0
        self.stats: RunStats | None = None

    @property
    def config(self):
        return self.model.config

    def tokenize(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def detokenize(self, ids) -> str:
        return self.tokenizer.decode(list(ids))

    @torch.inference_mode()
    def logits(self, ids) -> np.ndarray:
        """Logits (len(ids), n_vocab) float32 for a fresh sequence, one batch."""
        state = self.model.new_state()
        out, _ = self.model.forward(torch.as_tensor(list(ids), dtype=torch.long), state)
        return out.cpu().numpy()

    def warmup(self) -> None:
        """Throw-away passes (one token, and a 2-token batch, through the trunk and the draft
        head) so kernel loading/compilation stays out of the timings."""
        t0 = time.perf_counter()
        with torch.inference_mode():
            state = self.model.new_state()
            _, h = self.model.forward(torch.as_tensor([0]), state, logits="last")
            _, h2 = self.model.forward(torch.as_tensor([0, 0]), state, logits="all")
            if self.model.nextn is not None:
                self.model.nextn(torch.as_tensor([0, 0]), h2, torch.arange(1, 3), state.nextn_cache)
                self.model.nextn(torch.as_tensor([0]), h, torch.arange(3, 4), state.nextn_cache)
        self.load_s += time.perf_counter() - t0

    def generate(self, prompt: str | Sequence[int], *, max_tokens: int = 128, temperature: float = 0.0,
                 top_k: int = 0, top_p: float = 1.0, seed: int | None = None, ubatch: int | None = None,
                 stop_at_eos: bool = True, n_max: int = 0, p_min: float = 0.0, verify: str = "batched",
                 head=None) -> Iterator[int]:
        """Yield generated token ids for a fresh sequence. The prompt is processed in
        batches of ``ubatch`` tokens (default: the plan's), then one step at a time: plain
        decoding with ``n_max = 0``, else speculative decoding with the draft head (``head``,
        default the model's NextN / ``--draft`` head) drafting up to ``n_max`` tokens per step
        (see ``offload.speculative``). ``self.stats`` (RunStats) is filled as it goes."""
        ids = self.tokenize(prompt) if isinstance(prompt, str) else [int(i) for i in prompt]
        ubatch = self.plan.settings.ubatch if ubatch is None else ubatch
        ctx = self.plan.settings.ctx
        if not ids:
            raise OffloadError("the prompt is empty")
        if ubatch < 1:
            raise OffloadError(f"--ubatch must be >= 1, got {ubatch}")
        if len(ids) + max_tokens > ctx:
            raise OffloadError(f"{len(ids)} prompt tokens + {max_tokens} to generate exceed the "
                               f"context of {ctx} (raise --ctx)")
        options = SpecOptions(n_max=n_max, p_min=p_min, verify=verify)
        head = head if head is not None else self.model.nextn
        if n_max and head is None:
            raise OffloadError(f"speculative decoding (n_max {n_max}): the {self.config.arch} model has no "
                               "NextN (MTP) head; give --draft MTP.gguf or --spec-n-max 0")
        try:
            sampler = Sampler(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
        except ValueError as exc:
            raise OffloadError(f"sampling: {exc}") from None
        stats = self.stats = RunStats(n_prompt=len(ids), load_s=self.load_s)
        state = self.model.new_state(head if n_max else None)
        eos = self.tokenizer.eos_ids if stop_at_eos else frozenset()
        try:
            yield from generate_step(self.model, ids, state=state, sampler=sampler,
                                     head=head if n_max else None, options=options, ubatch=ubatch,
                                     max_tokens=max_tokens, eos=eos, stats=stats, profile=self.profile)
        finally:
            stats.memory = self.memory(state)

    def memory(self, state=None) -> dict:
        """Peak RSS, what each device holds for weights, and (given a state) its KV caches."""
        kv = defaultdict(int)
        if state is not None:
            for block, cache in zip(self.model.blocks, state.caches):
                kv[block.device_name] += cache.nbytes
            nextn = self.model.nextn
            if nextn is not None and isinstance(state.nextn_cache, KVCache):
                kv[nextn.block.device_name] += state.nextn_cache.nbytes
        return {"peak_rss": peak_rss_bytes(), "weights": dict(self.allocated), "kv": dict(kv)}

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


KV_DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


def plan_for(model: ModelFile, placement=None, devices: str | None = None, **plan_options) -> Plan:
    """A Plan for ``model``: ``placement`` may be a Plan, a plan YAML path, or None (plan now
    from ``devices`` and the planner's flags given as keywords, e.g. ``n_cpu_moe=10``,
    ``override_tensor=["exps=CPU"]``, ``tensor_split="1,1"``, ``cache_type="f32"``)."""
    if isinstance(placement, Plan):
        if devices is not None or plan_options:
            raise OffloadError("give either a Plan or planning options, not both")
        return placement
    parser = argparse.ArgumentParser()
    add_placement_arguments(parser)
    args = parser.parse_args([])
    options = sorted(k for k in vars(args) if k not in ("placement", "devices"))
    for key, value in plan_options.items():
        if key not in options:
            raise OffloadError(f"unknown planning option {key!r} (options: {', '.join(options)})")
        if key == "override_tensor" and isinstance(value, str):
            value = [value]
        if key == "tensor_split" and not isinstance(value, str):
            value = ",".join(str(v) for v in value)
        setattr(args, key, value)
    if devices is not None:
        args.devices = devices
    if placement is not None:
        args.placement = str(placement)
    return plan_from_args(args, model)[0]


def load(model_path, *, placement=None, devices: str | None = None, virtual_gpus: bool = False,
         gpu_dtype: str = "auto", threads: int | None = None, progress: bool = False,
         quiet: bool = False, int8_prefill: bool = False, **plan_options) -> Session:
    """Load a GGUF model where a plan puts each tensor.

    ``placement``: a Plan, a plan YAML path, or None to plan now for ``devices`` (``"auto"``
    by default, or a spec like ``"CUDA0=24GiB,CPU=64GiB"``) with the planner's flags as
    keywords (see ``plan_for``). ``virtual_gpus`` backs CUDA devices with the CPU where no
    CUDA exists. ``gpu_dtype``: compute dtype of GPU-resident weights (auto/f32/f16/bf16).
    ``threads``: CPU expert kernel threads. ``int8_prefill``: prompt batches (more than
    ``compiled_block.MAX_TOKENS`` tokens) quantize activations to int8 for the CPU kernels
    (llama.cpp's Q8 activations; faster with VNNI, error bound in ``cpu_kernels.settings``).
    Off by default until the planner's compute model counts the quantized activations
    (``placement.compute``: about 3.1·cols + 256 more bytes per row than the float path).
    """
    model = open_model(model_path)
    return load_plan(model, plan_for(model, placement, devices, **plan_options), virtual_gpus=virtual_gpus,
                     gpu_dtype=gpu_dtype, threads=threads, progress=progress, quiet=quiet,
                     int8_prefill=int8_prefill)


def load_plan(model: ModelFile, plan: Plan, *, virtual_gpus: bool = False, gpu_dtype: str = "auto",
              threads: int | None = None, progress: bool = False, quiet: bool = False,
              int8_prefill: bool = False) -> Session:
    """``load`` for an opened model and a resolved plan (what ``offload run`` calls)."""
    t0 = time.perf_counter()
    if threads is not None:
        if threads < 1:
            raise OffloadError(f"threads must be >= 1, got {threads}")
        set_num_threads(threads)
    arch = architecture(model.spec.arch)
    if plan.settings.cache_type not in KV_DTYPES:
        raise OffloadError(f"the runtime keeps its KV cache in f32, f16 or bf16, not "
                           f"--cache-type {plan.settings.cache_type}")
    devices = resolve(set(plan.tensors.values()) | set(plan.draft_tensors.values()), virtual_gpus=virtual_gpus)
    if devices.virtual and not quiet:
        print(f"offload: note: {', '.join(devices.virtual)} backed by the CPU (--virtual-gpus); "
              "no CUDA is used", file=sys.stderr)
    cfg = arch.config_from_gguf(model.spec, model.metadata)
    draft = open_model(plan.draft_path) if plan.draft_path else None
    # with a --draft file its NextN block replaces the model's own (which stays unloaded)
    tensors = [t for t in model.tensors if not (draft is not None and t.nextn)]
    tensors += list(draft.tensors) if draft is not None else []
    profile = Profile()
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cpu-experts")
    bar = Progress(len(tensors), sum(t.n_bytes for t in tensors)) if progress else None
    dtypes = compute_dtypes(devices, gpu_dtype)
    # prompt batches (more tokens than a compiled decode/verify step) use int8 activations
    int8_batch = MAX_TOKENS + 1 if int8_prefill else None
    weights = WeightStore(model, plan.tensors, devices, compute_dtype=dtypes, profile=profile, progress=bar,
                          int8_batch=int8_batch)
    draft_weights = (WeightStore(draft, plan.draft_tensors, devices, compute_dtype=dtypes, profile=profile,
                                 progress=bar, int8_batch=int8_batch) if draft is not None else None)
    ctx = BuildContext(profile=profile, pool=pool, kv_dtype=KV_DTYPES[plan.settings.cache_type],
                       kv_cells=pad(plan.settings.ctx, CACHE_PAD))   # what the planner counted
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
    session = Session(model=net, tokenizer=Tokenizer.from_gguf(model.metadata), devices=devices,
                      weights=weights, profile=profile, pool=pool, meta=model.metadata, plan=plan)
    if draft_weights is not None:
        for dev, n in draft_weights.allocated.items():
            session.allocated[dev] = session.allocated.get(dev, 0) + n
    session.load_s = time.perf_counter() - t0
    return session
