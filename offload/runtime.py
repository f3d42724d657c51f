"""Assembly: GGUF + placement → a loaded model on its devices, and the session API
(``offload.load``) that the CLI and embedders use.
"""
from __future__ import annotations

import sys
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from typing import Iterator, Mapping, Sequence

import numpy as np
import torch
from gguf import Keys

from offload._standins import OffloadError, open_gguf, set_num_threads
from offload.devices import DeviceMap, resolve
from offload.models import architecture
from offload.models.common import BuildContext, CausalLM, Meta
from offload.profile import Profile
from offload.progress import Progress
from offload.sampling import Sampler
from offload.stats import RunStats, peak_rss_bytes
from offload.tokenizer import Tokenizer
from offload.weights import WeightStore

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
                 profile: Profile, pool: ThreadPoolExecutor, meta: dict):
        self.model, self.tokenizer, self.devices = model, tokenizer, devices
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
                 top_k: int = 0, top_p: float = 1.0, seed: int | None = None, ubatch: int = 512,
                 stop_at_eos: bool = True) -> Iterator[int]:
        """Yield generated token ids for a fresh sequence. The prompt is processed in
        batches of ``ubatch`` tokens, then one token per step. ``self.stats`` (RunStats) is
        filled as it goes."""
        ids = self.tokenize(prompt) if isinstance(prompt, str) else [int(i) for i in prompt]
        if not ids:
            raise OffloadError("the prompt is empty")
        if ubatch < 1:
            raise OffloadError(f"--ubatch must be >= 1, got {ubatch}")
        sampler = Sampler(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
        stats = self.stats = RunStats(n_prompt=len(ids), load_s=self.load_s)
        state = self.model.new_state()
        eos = self.tokenizer.eos_ids if (stop_at_eos and self.tokenizer is not None) else frozenset()
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
                kv[self._device_name(block.device)] += cache.nbytes
        return {"peak_rss": peak_rss_bytes(), "weights": dict(self.allocated), "kv": dict(kv)}

    def _device_name(self, dev: torch.device) -> str:
        for name, d in self.devices.torch_devices.items():
            if d == dev and name != "CPU" and not (dev.type == "cpu" and name not in self.devices.virtual):
                return name
        return "CPU"

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def load(model_path, *, placement: Mapping[str, str] | str = "CPU", virtual_gpus: bool = False,
         gpu_dtype: str = "auto", progress: bool = False, quiet: bool = False,
         threads: int | None = None) -> Session:
    t0 = time.perf_counter()
    if threads is not None:
        if threads < 1:
            raise OffloadError(f"threads must be >= 1, got {threads}")
        set_num_threads(threads)
    meta, tensors = open_gguf(model_path)
    arch_name = meta.get(Keys.General.ARCHITECTURE)
    if arch_name is None:
        raise OffloadError(f"{model_path}: no general.architecture in the GGUF metadata")
    arch = architecture(arch_name)
    if isinstance(placement, str):
        placement = {n: placement for n in tensors}
    devices = resolve(placement.values(), virtual_gpus=virtual_gpus)
    if devices.virtual and not quiet:
        print(f"offload: note: {', '.join(devices.virtual)} backed by the CPU (--virtual-gpus); "
              "no CUDA is used", file=sys.stderr)
    reader = Meta(meta, arch_name)
    shapes = {n: tuple(reversed([int(d) for d in t.shape])) for n, t in tensors.items()}
    cfg = arch.config_from_gguf(reader, shapes)
    profile = Profile()
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cpu-experts")
    bar = Progress(len(tensors), sum(int(t.n_bytes) for t in tensors.values())) if progress else None
    weights = WeightStore(tensors, placement, devices, compute_dtype=compute_dtypes(devices, gpu_dtype),
                          profile=profile, progress=bar)
    ctx = BuildContext(profile=profile, pool=pool)
    with torch.inference_mode():
        model = arch.build(cfg, weights, ctx)
    if bar is not None:
        bar.close()
    if not quiet:
        reader.warn_unread()
        for name in weights.unused():
            print(f"offload: note: tensor {name} is not used by the {arch_name} runtime", file=sys.stderr)
    session = Session(model=model, tokenizer=Tokenizer.from_gguf(meta), devices=devices,
                      weights=weights, profile=profile, pool=pool, meta=meta)
    session.load_s = time.perf_counter() - t0
    return session
