"""A loaded model as the CLI, the server and embedders use it (``offload.load`` returns a
``Session``): tokenize, logits, ``generate`` (plain or speculative), and llama-server's prompt
cache. ``offload.runtime`` builds it.
"""
from __future__ import annotations

import threading
import time
from dataclasses import replace
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from typing import Iterator, Mapping, Sequence

import numpy as np
import torch

from offload.batching import Batcher, Slot
from offload.online_n_max import AUTO_CAP, POLICIES, EpsilonGreedy, OnlineNMax, StepCosts, prior_for
from offload.devices import DeviceMap
from offload.errors import OffloadError
from offload.models.shared.base import CausalLM
from offload.profile import Profile
from offload.sampling import Penalties, Sampler, with_penalties
from offload.speculative import SpecOptions, drafter_uses_hidden, generate_step
from offload.stats import RunStats, peak_rss_bytes
from offload.weights import WeightStore
from placement.draft import NGRAM_SIZE, NoDraftHead
from placement.plan import Plan


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
            if head_cache is not None:
                head_cache.truncate(min(head_ok, n_cached))
        except ValueError:      # a sliding-window cache (trunk's or drafter's) no longer holds that prefix
            self.state = state = model.new_state(head)
            n_cached = 0
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
        self._step_costs = StepCosts()       # what --spec-n-max auto measured alone, kept across generations
        self._batcher = None                 # offload.batching.Batcher, made by the first ``slots``
        self.batch_stats: list[RunStats] = []

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
                 top_k: int = 0, top_p: float = 1.0, seed: int | None = None, min_p: float = 0.0,
                 penalties: Penalties | None = None, ubatch: int | None = None,
                 stop_at_eos: bool = True, n_max: int = 0, p_min: float = 0.0, verify: str = "batched",
                 spec_type: str = "mtp", ngram_size: int = NGRAM_SIZE, head=None, cache_prompt: bool = False,
                 guide=None, on_token=None, on_prompt_logits=None, slot=None) -> Iterator[int]:
        """Yield generated token ids for a fresh sequence. The prompt is processed in
        batches of ``ubatch`` tokens (default: the plan's), then one step at a time: plain
        decoding with ``n_max = 0``, else speculative decoding with the drafter ``spec_type``
        names (``mtp``: the draft head ``head``, default the model's NextN / ``--draft`` head;
        ``ngram``: self-drafting from the context, ``ngram_size`` its longest lookup; ``dspark``:
        the DSpark drafter) drafting up to ``n_max`` tokens per step (see ``offload.speculative``). ``self.stats`` (RunStats) is filled as it goes.
        ``cache_prompt``: keep the KV of the longest prefix shared with the previous
        ``cache_prompt`` sequence (``self.prompt_cache``) and evaluate only the rest.
        ``guide``, ``on_token``, ``on_prompt_logits``: as ``offload.speculative.generate_step``
        takes them (the prompt's logits need every prompt token evaluated: no prompt cache).

        Sampling (``offload.sampling``): greedy by default here (the library's callers ask for
        what they want); ``offload run`` and ``offload serve`` pass llama.cpp's defaults.
        ``penalties``: llama.cpp's repetition penalties, the prompt counted in their window.

        ``slot`` (``offload.batching.Slot``, from ``slots``): generate as one of several
        sequences stepped together (continuous batching), with the slot's own prompt cache;
        its ``stats`` is this generation's RunStats."""
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
        policy = n_max if isinstance(n_max, str) else None      # "auto" | "bandit": chosen online
        if policy is not None:
            if policy not in POLICIES:
                raise OffloadError(f"n_max {policy!r}: a number, or one of {', '.join(POLICIES)}")
            n_max = AUTO_CAP
        options = SpecOptions(n_max=n_max, p_min=p_min, verify=verify, type=spec_type, ngram_size=ngram_size)
        head = head if head is not None else self.draft_head(options.type)
        if policy is not None and options.type == "dspark" and head is not None:    # drafts at most its block
            options = replace(options, n_max=min(n_max, head.header.max_drafts))
        if n_max and head is None and options.type == "dspark":
            raise OffloadError(f"--spec-type dspark needs a DSpark drafter (--draft FILE, a dflash GGUF); "
                               f"{self.plan.model_path} was loaded without one")
        if n_max and head is None and options.type != "ngram":
            raise NoDraftHead(self.plan.model_path, f"n_max {n_max}")
        # a drafter that reads the trunk's states keeps a cache the prompt cache must follow
        follows_trunk = n_max > 0 and drafter_uses_hidden(options.type)
        try:
            sampler = Sampler(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, min_p=min_p)
        except ValueError as exc:
            raise OffloadError(f"sampling: {exc}") from None
        stats = RunStats(n_prompt=len(ids), load_s=self.load_s)
        if slot is None:
            self.stats = stats
            model, holder, profile, compute = self.model, self, self.profile, None
        else:
            slot.stats = stats
            model, holder, profile, compute = slot.model, slot, slot.profile, slot.batcher.call
        chooser = None
        if policy == "auto":
            chooser = OnlineNMax(options.n_max, slot.batcher.costs if slot is not None else self._step_costs,
                                 prior_for(options.type), drafter=options.type, timed_by_batcher=slot is not None)
        elif policy == "bandit":
            chooser = EpsilonGreedy(options.n_max, seed=0 if seed is None else seed)
        cache_prompt = cache_prompt and on_prompt_logits is None
        if cache_prompt:
            state, n_cached = holder.prompt_cache.take(model, head, ids, drafting=follows_trunk)
        else:
            state, n_cached = model.new_state(head if follows_trunk else None), 0
        eos = self.tokenizer.eos_ids if stop_at_eos else frozenset()
        guide = with_penalties(guide, penalties, ids)
        if slot is not None:
            slot.batcher.join()
        try:
            for tok in generate_step(model, ids, state=state, sampler=sampler,
                                     head=head if follows_trunk else None, options=options, ubatch=ubatch,
                                     max_tokens=max_tokens, eos=eos, stats=stats, profile=profile,
                                     n_cached=n_cached, guide=guide, on_token=on_token,
                                     on_prompt_logits=on_prompt_logits, compute=compute,
                                     n_policy=chooser):
                if cache_prompt:
                    holder.prompt_cache.tokens.append(tok)
                yield tok
        except Exception:
            if cache_prompt:              # a pass may have stopped between layers: start over
                holder.prompt_cache = PromptCache()
            raise
        finally:
            if slot is not None:
                slot.batcher.leave()
            if chooser is not None:
                chooser.close()
                stats.spec["n_max_policy"] = chooser.report()
            stats.memory = self.memory(state)

    def slots(self, n: int) -> list:
        """``n`` slots (``offload.batching.Slot``) whose generations step through the model
        together (continuous batching), sharing this session's one batcher. Each slot's
        generation runs on a thread of its own, while the thread that loaded the model runs
        ``self.batcher.run(stop)`` (``generate_batch`` and ``offload serve -np`` do both)."""
        return [Slot(i, self.batcher, PromptCache()) for i in range(n)]

    @property
    def batcher(self) -> Batcher:
        """The session's one ``Batcher`` (made at first use)."""
        if self._batcher is None:
            self._batcher = Batcher(self.model)
        return self._batcher

    def generate_batch(self, prompts: Sequence[str | Sequence[int]], *, seed: int | None = None,
                       parallel: int | None = None, **options) -> list[list[int]]:
        """Generate for every prompt, up to ``parallel`` of them (default: all) at once as one
        batch per step (continuous batching: a finished prompt's place goes to the next);
        returns each prompt's token ids, in order. ``options`` are ``generate``'s; with a
        ``seed``, prompt i samples with ``seed + i``. ``self.batch_stats`` holds each prompt's
        RunStats afterwards."""
        prompts = list(prompts)
        if parallel is not None and parallel < 1:
            raise OffloadError(f"parallel must be >= 1, got {parallel}")
        if not prompts:
            return []
        n = len(prompts) if parallel is None else parallel
        slots = self.slots(min(n, len(prompts)))
        out: list[list[int] | None] = [None] * len(prompts)
        stats: list[RunStats | None] = [None] * len(prompts)
        errors: list[BaseException] = []
        todo = iter(range(len(prompts)))
        pick = threading.Lock()

        def work(slot) -> None:
            while not errors:
                with pick:
                    i = next(todo, None)
                if i is None:
                    return
                try:
                    out[i] = list(self.generate(prompts[i], seed=None if seed is None else seed + i,
                                                slot=slot, **options))
                    stats[i] = slot.stats
                except BaseException as exc:     # re-raised in the caller's thread
                    errors.append(exc)
                    return

        threads = [threading.Thread(target=work, args=(s,), name=f"offload-slot-{s.index}") for s in slots]
        for t in threads:
            t.start()
        try:          # this thread computes every step while the prompts' threads generate
            self.batcher.run(lambda: not any(t.is_alive() for t in threads))
        except BaseException:     # (Ctrl-C) the waiting generations get an error and end
            self._batcher.close()
            self._batcher = None
            raise
        finally:
            for t in threads:
                t.join()
        if errors:
            raise errors[0]
        self.batch_stats = stats
        return out

    def draft_head(self, spec_type: str):
        """The head the drafter ``spec_type`` drafts with: the NextN head for ``mtp``, the
        DSpark drafter for ``dspark`` (None when the model has none); ``ngram`` needs none."""
        if spec_type == "mtp":
            return self.model.nextn
        if spec_type == "dspark":
            return getattr(self.model, "dspark", None)
        return None

    def memory(self, state=None) -> dict:
        """Peak RSS, what each device holds for weights, and (given a state) its KV caches."""
        kv = defaultdict(int)
        if state is not None:
            for block, cache in zip(self.model.blocks, state.caches):
                kv[block.device_name] += cache.nbytes
            nextn = self.model.nextn
            if nextn is not None and hasattr(state.nextn_cache, "nbytes"):   # KVCache, Dsv4Cache
                kv[nextn.block.device_name] += state.nextn_cache.nbytes
            dspark = getattr(self.model, "dspark", None)
            if dspark is not None and hasattr(state.nextn_cache, "caches"):     # its stages' rings
                for stage, cache in zip(dspark.stages, state.nextn_cache.caches):
                    kv[stage.device_name] += cache.nbytes
        return {"peak_rss": peak_rss_bytes(), "weights": dict(self.allocated), "kv": dict(kv)}

    def close(self) -> None:
        if self._batcher is not None:
            self._batcher.close()
        self._pool.shutdown(wait=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
