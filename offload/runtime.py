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

from cpu_kernels import set_num_threads
from cpu_kernels.simd8 import has_vnni
from gpu.kv_cache import KVCache
from offload.plans import open_draft, plan_from_file
from offload.compiled_block import MAX_TOKENS
from offload.cpu_ops import DECODE_ACTIVATIONS
from offload.devices import DeviceMap, resolve
from offload.errors import OffloadError
from offload.gguf_model import ModelFile, check_shapes, open_model
from offload.models import architecture
from offload.models.common import BuildContext, CausalLM
from offload.profile import Profile
from offload.progress import Progress
from offload.sampling import Sampler
from offload.speculative import SpecOptions, generate_step
from offload.stats import RunStats, peak_rss_bytes
from offload.tokenizer import Tokenizer
from offload.weights import WeightStore
from placement.devices import resolve_devices
from placement.memory import CACHE_PAD, pad
from placement.draft import NoDraftHead
from placement.plan import Plan
from placement.planner import PlanOptions, make_plan

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


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


class PromptCache:
    """llama-server's prompt cache: the caches of the last sequence and the tokens it ran,
    so the next prompt evaluates only what follows their longest common prefix.

    Invariant: ``tokens`` is the last sequence (prompt + every yielded token); the trunk
    cache holds its first ``state.n_past`` tokens and the head cache pairs that need only
    ``tokens`` (pair t reads x_0..x_{t+1})."""

    def __init__(self):
        self.state, self.head, self.tokens = None, None, []

    def take(self, model: CausalLM, head, ids: list[int], drafting: bool):
        """The state to continue ``ids`` on, rolled back to the reusable prefix, and its
        length n_cached (< len(ids): the last prompt token always runs, for its logits)."""
        if self.state is None or self.head is not head:
            self.state, self.head, self.tokens = model.new_state(head), head, []
        state = self.state
        common = min(common_prefix(self.tokens, ids), state.n_past)
        head_cache = state.nextn_cache
        head_ok = max(0, min(head_cache.length, common - 1)) if head_cache is not None else 0
        # drafting primes the head from the trunk states of the evaluated positions, so the
        # trunk is reused only as far as the head's pairs reach
        n_cached = head_ok if drafting else min(common, len(ids) - 1)
        try:
            state.truncate(n_cached)
        except ValueError:      # a sliding-window cache no longer holds the rows that prefix needs
            self.state = state = model.new_state(head)
            head_cache, n_cached = state.nextn_cache, 0
        if head_cache is not None:
            head_cache.truncate(min(head_ok, n_cached))
        self.tokens = list(ids)
        return state, n_cached


class Session:
    """A loaded model. ``logits`` starts a fresh sequence; ``generate`` does too, or with
    ``cache_prompt`` reuses the previous sequence's longest common prefix."""

    def __init__(self, *, model: CausalLM, tokenizer, devices: DeviceMap, weights: WeightStore,
                 profile: Profile, pool: ThreadPoolExecutor, meta: Mapping, plan: Plan):
        self.model, self.tokenizer, self.devices, self.plan = model, tokenizer, devices, plan
        self.allocated = dict(weights.allocated)
        self.profile, self._pool, self.meta = profile, pool, meta
        self.load_s = 0.0
        self.stats: RunStats | None = None
        self.prompt_cache = PromptCache()

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
                 head=None, cache_prompt: bool = False) -> Iterator[int]:
        """Yield generated token ids for a fresh sequence. The prompt is processed in
        batches of ``ubatch`` tokens (default: the plan's), then one step at a time: plain
        decoding with ``n_max = 0``, else speculative decoding with the draft head (``head``,
        default the model's NextN / ``--draft`` head) drafting up to ``n_max`` tokens per step
        (see ``offload.speculative``). ``self.stats`` (RunStats) is filled as it goes.
        ``cache_prompt``: keep the KV of the longest prefix shared with the previous
        ``cache_prompt`` sequence (``self.prompt_cache``) and evaluate only the rest."""
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
            raise NoDraftHead(self.plan.model_path, f"n_max {n_max}")
        try:
            sampler = Sampler(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
        except ValueError as exc:
            raise OffloadError(f"sampling: {exc}") from None
        stats = self.stats = RunStats(n_prompt=len(ids), load_s=self.load_s)
        if cache_prompt:
            state, n_cached = self.prompt_cache.take(self.model, head, ids, drafting=n_max > 0)
        else:
            state, n_cached = self.model.new_state(head if n_max else None), 0
        eos = self.tokenizer.eos_ids if stop_at_eos else frozenset()
        try:
            for tok in generate_step(self.model, ids, state=state, sampler=sampler,
                                     head=head if n_max else None, options=options, ubatch=ubatch,
                                     max_tokens=max_tokens, eos=eos, stats=stats, profile=self.profile,
                                     n_cached=n_cached):
                if cache_prompt:
                    self.prompt_cache.tokens.append(tok)
                yield tok
        except Exception:
            if cache_prompt:              # a pass may have stopped between layers: start over
                self.prompt_cache = PromptCache()
            raise
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
    experts to a GPU for prompt batches of at least a threshold (``enable_op_offload``).
    ``int8_prefill`` (default on; the CLI's ``--prefill-activations int8|float``): prompt
    batches (more than ``compiled_block.MAX_TOKENS`` tokens) quantize activations to int8 per
    32 values for the CPU kernels, as llama.cpp's Q8 activations, with VNNI dot products
    (a CPU without VNNI runs the float path). Error bound per dot product in
    ``cpu_kernels.settings``; on the shipped model's logits it is held under 2e-2 of the
    largest (tests/test_prefill.py). ``placement.compute`` counts the quantized activations.
    ``decode_activations`` (the CLI's ``--decode-activations auto|int8|float``): the CPU routed
    experts' activations for decode/verify batches (at most ``compiled_block.MAX_TOKENS``
    tokens): "auto" = int8 for the weight types whose int8 path measured faster
    (``cpu_kernels.matmul.DECODE_INT8_TYPES``), float for the others; "int8"; "float".
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
    if decode_activations == "int8" and not has_vnni() and not quiet:
        print("offload: note: this CPU has no u8 x s8 dot product (AVX512-VNNI / AVX-VNNI): "
              "--decode-activations int8 runs float activations", file=sys.stderr)
    cfg = arch.config_from_gguf(model.spec, model.metadata)
    draft = open_model(plan.draft_path) if plan.draft_path else None
    for m in (model, draft):
        if m is not None:
            check_shapes(m)
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
                          hot_experts=plan.hot_experts, int8_batch=int8_batch,
                          decode_activations=decode_activations)
    draft_weights = (WeightStore(draft, plan.draft_tensors, devices, compute_dtype=dtypes, profile=profile,
                                 progress=bar, int8_batch=int8_batch, decode_activations=decode_activations)
                     if draft is not None else None)
    ctx = BuildContext(profile=profile, pool=pool, kv_dtype=KV_DTYPES[plan.settings.cache_type],
                       kv_cells=pad(plan.settings.ctx, CACHE_PAD),   # what the planner counted
                       ubatch=plan.settings.ubatch)
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
    return session


def enable_op_offload(net: CausalLM, weights: WeightStore, plan: Plan, model: ModelFile, mode: str, *,
                      virtual: bool) -> tuple[int | None, str]:
    """``--op-offload``: give each trunk MoE layer whose experts are all in RAM a streamed copy
    of them on a GPU (its own when it computes on one, else the plan's first), used for passes
    of at least the threshold (``placement.op_offload``: ``on`` llama.cpp's 32, ``auto`` the
    cost model's choice for the plan's hardware profile; on ``--virtual-gpus`` ``auto`` stays
    off: a CPU-backed device gains nothing). → (threshold or None, a line saying what was chosen)."""
    from gpu.experts import StagingBuffers
    from offload.cpu_ops import CpuExperts
    from offload.moe import MoE
    from placement.cost import FootprintError
    from placement.op_offload import MODES, PrefillModel, choose_threshold
    from placement.speculative import plan_profile

    if mode not in MODES:
        raise OffloadError(f"--op-offload must be one of {', '.join(MODES)}, got {mode!r}")
    gpus = [d.name for d in plan.devices if d.is_gpu]
    if mode == "off":
        return None, "op offload: off"
    if not gpus:
        if mode == "on":
            raise OffloadError("--op-offload on: the plan has no GPU to stream the RAM-resident experts to")
        return None, "op offload: off (no GPU)"
    if mode == "auto" and virtual:
        return None, "op offload: off (auto does not stream to CPU-backed --virtual-gpus; use on)"
    hw = plan_profile(plan).hardware
    try:
        prefill = PrefillModel(plan, model, hw)
    except FootprintError as exc:
        if mode == "on":
            raise OffloadError(f"--op-offload on: {exc}") from None
        return None, f"op offload: off (the cost model cannot read this model: {exc})"
    threshold = choose_threshold(mode, prefill)
    if threshold is None:
        return None, "op offload: off (no RAM-resident experts, or streaming never pays on this box)"
    streamed: dict[str, list] = {}
    skipped = []
    for i, block in enumerate(net.blocks):
        moe = getattr(block, "ffn", None)
        if isinstance(moe, MoE) and isinstance(moe.experts, CpuExperts):
            if moe.experts.act != "silu" or moe.experts.biases:     # the streamed path computes plain SwiGLU
                skipped.append(i)
                continue
            on = block.device_name if block.device_name != "CPU" else gpus[0]
            moe.stream, moe.stream_min = weights.streamed_experts(f"blk.{i}", on, moe.owned), threshold
            streamed.setdefault(on, []).append(moe.stream)
    # one pair of staging buffers per GPU, a chunk of the largest expert tensor streamed there
    # (placement.compute.op_offload_staging_bytes counts them in the plan)
    for on, streams in streamed.items():
        staging = StagingBuffers(weights.devices[on], max(st.staging_bytes for st in streams))
        for st in streams:
            st.staging = staging
    n = sum(len(v) for v in streamed.values())
    why = "llama.cpp's default" if mode == "on" else f"cost model, profile {hw.source}"
    return threshold, (f"op offload: passes of >= {threshold} tokens stream the RAM-resident experts of "
                       f"{n} layers to a GPU ({mode}: {why}; pinned, double-buffered staging)"
                       + (f"; not blk.{','.join(map(str, skipped))} (expert biases or a non-SwiGLU "
                          "activation: the streamed path does not compute them)" if skipped else ""))
