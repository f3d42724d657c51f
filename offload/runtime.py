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
from offload.commands.plan import add_placement_arguments, plan_from_args
from offload.devices import DeviceMap, resolve
from offload.errors import OffloadError
from offload.gguf_model import ModelFile, open_model
from offload.models import architecture
from offload.models.common import BuildContext, CausalLM
from offload.profile import Profile
from offload.progress import Progress
from offload.sampling import Sampler
from offload.stats import RunStats, peak_rss_bytes
from offload.tokenizer import Tokenizer
from offload.weights import WeightStore
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
        """One throw-away token so kernel loading/compilation stays out of the timings."""
        t0 = time.perf_counter()
        with torch.inference_mode():
            self.model.forward(torch.as_tensor([0]), self.model.new_state(), logits="last")
        self.load_s += time.perf_counter() - t0

    def generate(self, prompt: str | Sequence[int], *, max_tokens: int = 128, temperature: float = 0.0,
                 top_k: int = 0, top_p: float = 1.0, seed: int | None = None, ubatch: int | None = None,
                 stop_at_eos: bool = True) -> Iterator[int]:
        """Yield generated token ids for a fresh sequence. The prompt is processed in
        batches of ``ubatch`` tokens (default: the plan's), then one token per step.
        ``self.stats`` (RunStats) is filled as it goes."""
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
        sampler = Sampler(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
        stats = self.stats = RunStats(n_prompt=len(ids), load_s=self.load_s)
        state = self.model.new_state()
        eos = self.tokenizer.eos_ids if stop_at_eos else frozenset()
        self.profile.reset()
        t0 = time.perf_counter()
        with torch.inference_mode():
            for s in range(0, len(ids), ubatch):
                last = s + ubatch >= len(ids)
                logits, _ = self.model.forward(torch.as_tensor(ids[s:s + ubatch]), state,
                                               logits="last" if last else "none")
            with self.profile.time("sampling"):
                tok = sampler(logits[-1].cpu().numpy())
        stats.prompt_s, stats.prompt_profile = time.perf_counter() - t0, self.profile.snapshot()
        self.profile.reset()
        try:
            while True:
                stats.n_gen += 1
                yield tok
                if tok in eos or stats.n_gen >= max_tokens:
                    break
                t1 = time.perf_counter()
                with torch.inference_mode():
                    logits, _ = self.model.forward(torch.as_tensor([tok]), state, logits="last")
                    with self.profile.time("sampling"):
                        tok = sampler(logits[-1].cpu().numpy())
                stats.eval_s += time.perf_counter() - t1
                stats.n_eval += 1
        finally:
            stats.eval_profile = self.profile.snapshot()
            stats.memory = self.memory(state)

    def memory(self, state=None) -> dict:
        """Peak RSS, what each device holds for weights, and (given a state) its KV caches."""
        kv = defaultdict(int)
        if state is not None:
            for block, cache in zip(self.model.blocks, state.caches):
                kv[block.device_name] += cache.nbytes
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
         quiet: bool = False, **plan_options) -> Session:
    """Load a GGUF model where a plan puts each tensor.

    ``placement``: a Plan, a plan YAML path, or None to plan now for ``devices`` (``"auto"``
    by default, or a spec like ``"CUDA0=24GiB,CPU=64GiB"``) with the planner's flags as
    keywords (see ``plan_for``). ``virtual_gpus`` backs CUDA devices with the CPU where no
    CUDA exists. ``gpu_dtype``: compute dtype of GPU-resident weights (auto/f32/f16/bf16).
    ``threads``: CPU expert kernel threads.
    """
    model = open_model(model_path)
    return load_plan(model, plan_for(model, placement, devices, **plan_options), virtual_gpus=virtual_gpus,
                     gpu_dtype=gpu_dtype, threads=threads, progress=progress, quiet=quiet)


def load_plan(model: ModelFile, plan: Plan, *, virtual_gpus: bool = False, gpu_dtype: str = "auto",
              threads: int | None = None, progress: bool = False, quiet: bool = False) -> Session:
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
    devices = resolve(set(plan.tensors.values()), virtual_gpus=virtual_gpus)
    if devices.virtual and not quiet:
        print(f"offload: note: {', '.join(devices.virtual)} backed by the CPU (--virtual-gpus); "
              "no CUDA is used", file=sys.stderr)
    if plan.draft_path and not quiet:
        print(f"offload: note: the draft model {plan.draft_path} is not used by plain decoding",
              file=sys.stderr)
    cfg = arch.config_from_gguf(model.spec, model.metadata)
    profile = Profile()
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cpu-experts")
    bar = Progress(len(model.tensors), sum(t.n_bytes for t in model.tensors)) if progress else None
    weights = WeightStore(model, plan.tensors, devices, compute_dtype=compute_dtypes(devices, gpu_dtype),
                          profile=profile, progress=bar)
    ctx = BuildContext(profile=profile, pool=pool, kv_dtype=KV_DTYPES[plan.settings.cache_type])
    with torch.inference_mode():
        net = arch.build(cfg, weights, ctx)
    if bar is not None:
        bar.close()
    if not quiet:
        for name in weights.unused():
            print(f"offload: note: tensor {name} is not used by the {model.spec.arch} runtime", file=sys.stderr)
    session = Session(model=net, tokenizer=Tokenizer.from_gguf(model.metadata), devices=devices,
                      weights=weights, profile=profile, pool=pool, meta=model.metadata, plan=plan)
    session.load_s = time.perf_counter() - t0
    return session
