"""Assembly: GGUF + placement → a loaded model on its devices, and the session API
(``offload.load``) that the CLI and embedders use.
"""
from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Iterator, Mapping

import numpy as np
import torch
from gguf import Keys

from offload._standins import OffloadError, open_gguf
from offload.devices import DeviceMap, resolve
from offload.models import architecture
from offload.models.common import BuildContext, CausalLM, Meta
from offload.profile import Profile
from offload.weights import WeightStore

_DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


class Session:
    """A loaded model. ``logits`` and ``generate`` each start a fresh sequence."""

    def __init__(self, *, model: CausalLM, tokenizer, devices: DeviceMap, weights: WeightStore,
                 profile: Profile, pool: ThreadPoolExecutor, meta: dict):
        self.model, self.tokenizer, self.devices = model, tokenizer, devices
        self.allocated = dict(weights.allocated)
        self.profile, self._pool, self.meta = profile, pool, meta

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

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def load(model_path, *, placement: Mapping[str, str] | str = "CPU", virtual_gpus: bool = False,
         gpu_dtype: str = "f32", progress=None, quiet: bool = False) -> Session:
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
    weights = WeightStore(tensors, placement, devices, gpu_dtype=_DTYPES[gpu_dtype],
                          profile=profile, progress=progress)
    ctx = BuildContext(profile=profile, pool=pool)
    with torch.inference_mode():
        model = arch.build(cfg, weights, ctx)
    if not quiet:
        reader.warn_unread()
        for name in weights.unused():
            print(f"offload: note: tensor {name} is not used by the {arch_name} runtime", file=sys.stderr)
    return Session(model=model, tokenizer=None, devices=devices, weights=weights, profile=profile,
                   pool=pool, meta=meta)
