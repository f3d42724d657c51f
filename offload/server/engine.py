"""The model side of ``offload serve``: one loaded ``Session`` and ``parallel`` slots
(llama-server's ``-np``), each a worker thread. Queued requests are handed out in arrival
order, each to the idle slot whose prompt cache it shares the longest prefix with (else the
slot idle longest), so a conversation's next turn finds its KV where it left it.
With one slot, requests are served one at a time; with several, the slots' generations step
through the model together (``offload.batching``: continuous batching, each slot with its own
caches, prompt cache and drafter, every step one batch of all their tokens), and a finished
or cancelled request frees its slot at once.

The event loop never runs the model: ``prepare`` checks a request and builds its prompt (in
the loop, cheap), ``submit`` queues it (503 when ``max_queue`` requests already wait), and
the worker thread generates, handing text pieces back to the loop's queue of that job. A
job whose client left is ``cancel``-ed: dropped from the queue, or its generation stopped
at the next token (closing the generator rewinds the caches to what was yielded).
"""
from __future__ import annotations

import asyncio
import sys
import threading
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np

from offload.chat_template import ChatTemplate, ChatTemplateError, TemplateRaised
from offload.errors import OffloadError
from offload.server.constrain import GrammarError, TokenGuide, Vocabulary, json_grammar, lark_grammar
from offload.server.tools import MALFORMED, ToolFormat, ToolStream, object_or_none
from offload.server.logprobs import Pieces, TokenLogprob, score
from offload.server.metrics import Metrics
from offload.server.protocol import APIError, Piece, Request, Result, server_busy
from offload.server.stops import StopText
from offload.sampling import SamplingDefaults
from offload.session import PromptCache, common_prefix
from offload.speculative import SpecOptions
from offload.stats import RunStats, add_per_position
from offload.tokenizer import TextStream


@dataclass(eq=False)          # a job is itself: compared and hashed by identity
class Job:
    request: Request
    ids: list[int]
    max_tokens: int
    n_max: int
    loop: asyncio.AbstractEventLoop
    prompt_text: str = ""                     # what echo repeats
    grammar: str | None = None                # the constraint each choice is decoded under
    parse_calls: bool = False                 # parse tool calls out of the output
    # ("piece", Piece) | ("end", (index, finish_reason)) | ("done", Result) | ("error", APIError)
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    finished: bool = False
    task: int = -1                            # llama-server's id_task: numbered at submit

    def emit(self, kind: str, value) -> None:
        """From the worker thread: hand an event to the job's event loop."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))
        except RuntimeError:       # the loop is gone (server shutting down)
            pass


class Engine:
    def __init__(self, load: Callable[[], object], *, model_name: str, template: ChatTemplate,
                 spec: SpecOptions, max_queue: int, on_load_error: Callable[[str], None],
                 tool_format: ToolFormat | None = None, sampling: SamplingDefaults = SamplingDefaults(),
                 parallel: int = 1, prompt_chunk: int | None = None, n_max: int | str | None = None):
        self._load, self.model_name, self.template, self.spec = load, model_name, template, spec
        self.sampling = sampling               # what a request that names no sampling field gets
        self.tool_format = tool_format         # how this model writes tool calls (None: unknown)
        self.max_queue, self._on_load_error = max_queue, on_load_error
        self.session = None
        self._pieces: Pieces | None = None
        self._vocabulary: Vocabulary | None = None
        self.metrics = Metrics()
        self._queue: deque[Job] = deque()
        self._cond = threading.Condition()
        self._stopping = False
        self.n_max = spec.n_max if n_max is None else n_max    # a request's default: a number or "auto"
        self.parallel = parallel               # slots: requests generated at once
        self.prompt_chunk = prompt_chunk       # a slot's prompt runs in chunks of this (None: the plan's ubatch)
        self._slots: list = []                 # the session's slots (-np > 1), once loaded
        self._busy: dict[int, Job] = {}        # slot index → the job handed to it or generating (under _cond)
        self._idle: dict[int, int] = {}        # idle slot index → the count of jobs finished when it became idle
        self._inbox: dict[int, Job] = {}       # slot index → the job handed to it, not taken yet
        self._finished = 0
        self._tasks = 0                        # jobs submitted so far
        self._thread = threading.Thread(target=self._main, name="offload-engine", daemon=True)

    # -- event-loop side ------------------------------------------------------------

    @property
    def ready(self) -> bool:
        return self.session is not None

    @property
    def vocabulary(self) -> Vocabulary:
        """The tokenizer as the constrained decoder sees it (built at first use)."""
        if self._vocabulary is None:
            self._vocabulary = Vocabulary(self.session.tokenizer)
        return self._vocabulary

    @property
    def pieces(self) -> Pieces:
        """Token → text for logprobs (the loaded model's tokenizer; built at first use)."""
        if self._pieces is None:
            self._pieces = Pieces(self.session.tokenizer)
        return self._pieces

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Cancel everything and let the worker end after the token it is on."""
        with self._cond:
            self._stopping = True
            for job in self._queue:
                job.cancelled.set()
            self._queue.clear()
            for job in self._busy.values():     # handed to a slot, or generating
                job.cancelled.set()
            self._cond.notify_all()

    def prepare(self, request: Request, loop: asyncio.AbstractEventLoop) -> Job:
        """Check ``request`` against the model and build its prompt; APIError if it cannot run."""
        if not self.ready:
            raise server_busy("the model is still loading")
        if request.model is not None and request.model != self.model_name:
            raise APIError(404, f"model {request.model!r} does not exist; this server has {self.model_name!r}",
                           param="model", code="model_not_found")
        session = self.session
        prompt_text = ""
        tools = request.tools if request.tool_choice != "none" else []
        if tools and self.tool_format is None:
            raise APIError(400, "'tools': this model's chat template writes no tool-call format offload knows "
                                "(Hermes/Qwen3, GLM-4.5, DeepSeek, harmony)", param="tools")
        if request.messages is not None:
            try:
                ids = self.template.encode(template_messages(request.messages, self.template), session.tokenizer,
                                           tools=[t.as_openai() for t in request.tools] or None)
            except TemplateRaised as exc:
                raise APIError(400, f"the chat template rejected the messages: {exc}", param="messages") from None
            except ChatTemplateError as exc:
                raise APIError(500, str(exc), type="server_error") from None
        elif isinstance(request.prompt, str):
            ids = session.tokenize(request.prompt)
            prompt_text = request.prompt
        else:
            ids = list(request.prompt)
            n_vocab = session.tokenizer.n_vocab
            if max(ids) >= n_vocab:
                raise APIError(400, f"prompt token id {max(ids)} is not below the vocabulary size {n_vocab}",
                               param="prompt")
            prompt_text = session.detokenize(ids) if request.echo else ""
        ctx = session.plan.settings.ctx
        if len(ids) >= ctx or (request.max_tokens is not None and len(ids) + request.max_tokens > ctx):
            wanted = f"{len(ids)} prompt tokens" + (f" + {request.max_tokens} max_tokens"
                                                     if request.max_tokens is not None else "")
            raise APIError(400, f"{wanted} exceed the context of {ctx} tokens (the server's --ctx)",
                           param="messages" if request.messages is not None else "prompt",
                           code="context_length_exceeded")
        n_max = self.n_max if request.n_max is None else request.n_max
        if n_max and self.spec.type != "ngram" and session.draft_head(self.spec.type) is None:
            raise APIError(400, f"n_max {n_max}: the model has no {self.spec.type} draft head "
                           "(the server was started without one; --spec-type ngram drafts from the context)",
                           param="n_max")
        grammar = None
        forced = request.tool_choice not in ("none", "auto")
        if request.response_format is not None:
            if forced:
                raise APIError(400, "'response_format' and a forced 'tool_choice' cannot both constrain the output",
                               param="response_format")
            try:
                grammar = json_grammar(request.response_format.schema)
                self.vocabulary.check(grammar)
            except GrammarError as exc:
                raise APIError(400, f"'response_format': the schema cannot be compiled: {exc}",
                               param="response_format") from None
        elif forced:                             # required / a named tool: the call's syntax is forced
            try:
                grammar = lark_grammar(self.tool_format.grammar(
                    tools, None if request.tool_choice == "required" else request.tool_choice))
                self.vocabulary.check(grammar)
            except GrammarError as exc:
                raise APIError(400, f"'tools': the tools' parameters cannot be compiled: {exc}",
                               param="tools") from None
        return Job(request=request, ids=ids, max_tokens=request.max_tokens or ctx - len(ids), n_max=n_max,
                   loop=loop, prompt_text=prompt_text, grammar=grammar, parse_calls=bool(tools))

    def submit(self, job: Job) -> None:
        with self._cond:
            if self._stopping:
                raise server_busy("the server is shutting down")
            if len(self._queue) >= self.max_queue:
                self.metrics.rejected += 1
                raise server_busy(f"{len(self._queue)} requests are already waiting (--max-queue {self.max_queue})")
            job.task = self._tasks
            self._tasks += 1
            self._queue.append(job)
            self.metrics.queued = len(self._queue)
            self._dispatch()

    def _dispatch(self) -> None:
        """(Under ``_cond``.) Hand the queued jobs, oldest first, to idle slots: each to the idle
        slot whose prompt cache it can reuse most (llama-server's slot choice by prompt
        similarity: the longest shared prefix, counted when it is at least half of what that
        slot holds), else to the slot idle longest, whose cache is the stalest to give up."""
        handed = False
        while self._queue and self._idle:
            job = self._queue.popleft()
            def fit(i):
                cached = self._holder(i).prompt_cache.tokens
                n = common_prefix(cached, job.ids)
                return (n if 2 * n >= len(cached) else 0, -self._idle[i])
            index = max(self._idle, key=fit)
            del self._idle[index]
            self._inbox[index] = self._busy[index] = job
            handed = True
        if handed:
            self.metrics.queued = len(self._queue)
            self.metrics.processing = len(self._busy)
            self._cond.notify_all()

    def _holder(self, index: int):
        """What holds slot ``index``'s prompt cache and stats: its Slot, or the session (-np 1)."""
        return self._slots[index] if self._slots else self.session

    def cancel(self, job: Job) -> None:
        """The client left: drop the job if it still waits, else stop its generation."""
        if job.finished:
            return
        job.cancelled.set()
        with self._cond:
            if job in self._queue:
                self._queue.remove(job)
                self.metrics.queued = len(self._queue)
                self.metrics.cancelled += 1

    # -- slots (GET /slots, POST /slots/{id}?action=erase) ------------------------------

    def slot_states(self) -> list[dict]:
        """Each slot as llama-server's ``GET /slots`` lists it: its context, whether it is
        generating (and for which task, how far), the tokens its prompt cache holds, and the
        request's sampling and draft settings."""
        session = self.session
        with self._cond:
            busy = dict(self._busy)
        out = []
        for i in range(self.parallel):
            holder = self._holder(i)
            stats = holder.stats
            job = busy.get(i)
            state = {"id": i, "n_ctx": session.plan.settings.ctx, "is_processing": job is not None,
                     "id_task": job.task if job is not None else -1,
                     "n_cached": len(holder.prompt_cache.tokens)}
            if job is not None:
                r = job.request
                state |= {"n_prompt_tokens": len(job.ids),
                          "n_decoded": stats.n_gen if stats is not None else 0,
                          "params": {"n_predict": job.max_tokens, "n_max": job.n_max, "stream": r.stream,
                                     **{k: v for k, v in self.sampling.of(r).items() if k != "penalties"}},
                          "draft_n": stats.drafted if stats is not None else 0,
                          "draft_n_accepted": stats.accepted if stats is not None else 0}
            out.append(state)
        return out

    def erase_slot(self, index: int) -> int:
        """Empty slot ``index``'s prompt cache (llama-server's ``action=erase``); → the tokens
        it held. APIError 404 for no such slot, 409 while it generates."""
        if not 0 <= index < self.parallel:
            raise APIError(404, f"slot {index} does not exist; this server has {self.parallel} "
                           f"(ids 0-{self.parallel - 1})", param="id_slot")
        with self._cond:        # a worker marks its slot busy under this lock before reading its cache
            if index in self._busy:
                raise APIError(409, f"slot {index} is processing task {self._busy[index].task}; "
                               "erase it when it is idle", param="id_slot")
            holder = self._holder(index)
            n = len(holder.prompt_cache.tokens)
            holder.prompt_cache = PromptCache()
        return n

    # -- worker thread --------------------------------------------------------------

    def _main(self) -> None:
        try:
            session = self._load()
        except OffloadError as exc:
            self._on_load_error(str(exc))
            return
        except Exception as exc:       # report, then let the server exit
            traceback.print_exc()
            self._on_load_error(f"loading failed: {type(exc).__name__}: {exc}")
            return
        self.session = session
        if self.parallel == 1:
            self._work(None)
            return
        # N slot threads generate; this thread, which loaded the model, computes every step
        self._slots = session.slots(self.parallel)
        for i, slot in enumerate(self._slots):
            threading.Thread(target=self._work, args=(slot,), name=f"offload-slot-{i}", daemon=True).start()
        session.batcher.run(lambda: self._stopping)

    def _work(self, slot) -> None:
        """One slot: wait for the job ``_dispatch`` hands it, generate it, repeat until the
        server stops."""
        index = slot.index if slot is not None else 0
        while True:
            with self._cond:
                self._idle[index] = self._finished
                self._dispatch()
                while index not in self._inbox and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    return
                job = self._inbox.pop(index)
            try:
                self._serve(job, slot)
            finally:
                job.finished = True
                with self._cond:
                    self._busy.pop(index, None)
                    self._finished += 1
                    self.metrics.processing = len(self._busy)

    def _serve(self, job: Job, slot=None) -> None:
        session, r = self.session, job.request
        if job.cancelled.is_set():          # left between leaving the queue and starting
            self.metrics.cancelled += 1
            return
        runs: list[RunStats] = []
        guides: list[TokenGuide] = []
        prompt_lp: list[TokenLogprob] | None = None
        n_gen = 0
        for index in range(r.n):
            try:
                guide = self.vocabulary.guide(job.grammar) if job.grammar is not None else None
                if guide is not None:
                    guides.append(guide)
                finish, n, prompt_lp = self._choice(job, index, prompt_lp, guide, slot)
            except OffloadError as exc:
                job.emit("error", APIError(400, str(exc)))
                return
            except Exception as exc:
                traceback.print_exc(file=sys.stderr)
                job.emit("error", APIError(500, f"generation failed: {type(exc).__name__}: {exc}",
                                           type="server_error"))
                return
            st = session.stats if slot is None else slot.stats
            runs.append(st)
            self.metrics.record(st)
            n_gen += n
            if job.cancelled.is_set():
                self.metrics.cancelled += 1
                return
            job.emit("end", (index, finish))
        t = timings(merged(runs), job.n_max)
        if guides:           # what constrained decoding cost: masking and advancing, drafts included
            t["constrain_ms"] = sum(g.cost.seconds for g in guides) * 1000.0
            t["constrain_per_token_ms"] = t["constrain_ms"] / n_gen if n_gen else 0.0
        job.emit("done", Result(prompt_tokens=len(job.ids), completion_tokens=n_gen, timings=t))

    def _choice(self, job: Job, index: int, prompt_lp, guide: TokenGuide | None, slot=None):
        """Generate choice ``index``, emitting its pieces; → (finish_reason, tokens generated,
        the prompt's logprobs when echo asked for them)."""
        session, r = self.session, job.request
        eos = session.tokenizer.eos_ids
        stops = StopText(r.stop)
        if job.parse_calls:  # call markers may be special tokens: keep them, drop end-of-sequence
            stream = TextStream(lambda ids: session.tokenizer.decode([t for t in ids if t not in eos], special=True))
            calls = ToolStream(self.tool_format, {t.name for t in r.tools})
        else:
            stream, calls = TextStream(session.detokenize), None
        k = r.logprobs
        pending: list[TokenLogprob] = []         # logprobs of tokens whose text is not out yet
        on_token = on_prompt = None
        if k is not None:
            def on_token(tok, row):
                pending.append(score(row, tok, k))
        if r.echo:
            if k is not None and prompt_lp is None:
                prompt_lp = [TokenLogprob(job.ids[0], None, None)]

                def on_prompt(start, rows):
                    for i, row in enumerate(rows[:len(job.ids) - 1 - start]):
                        prompt_lp.append(score(row, job.ids[start + i + 1], k))
        finish, n_gen = "length", 0
        gen = session.generate(job.ids, max_tokens=job.max_tokens, **self.sampling.of(r),
                               seed=choice_seed(self.sampling.seed if r.seed is None else r.seed, index),
                               stop_at_eos=not r.ignore_eos,
                               n_max=job.n_max, p_min=self.spec.p_min, verify=self.spec.verify,
                               spec_type=self.spec.type, ngram_size=self.spec.ngram_size,
                               cache_prompt=r.cache_prompt, guide=guide, on_token=on_token,
                               on_prompt_logits=on_prompt, slot=slot,
                               ubatch=self.prompt_chunk if slot is not None else None)
        try:
            for tok in gen:
                if r.echo and n_gen == 0:        # the prompt ran: echo it first
                    job.emit("piece", Piece(index, job.prompt_text, list(prompt_lp or [])))
                if job.cancelled.is_set():
                    break
                n_gen += 1
                piece = stops.push(stream.push(tok))
                if calls is not None:
                    piece = calls.push(piece)
                if stops.stopped:
                    if piece:
                        job.emit("piece", Piece(index, piece, []))
                    finish = "stop"
                    break
                if piece:
                    job.emit("piece", Piece(index, piece, pending[:]))
                    pending.clear()
                if tok in eos and not r.ignore_eos:
                    finish = "stop"
            else:
                piece = stops.push(stream.close()) + stops.close()
                if calls is not None:
                    piece = calls.push(piece)
                if piece or pending:
                    job.emit("piece", Piece(index, piece, pending[:]))
        finally:
            gen.close()
        if calls is not None:
            parsed = calls.close()
            if parsed.content or parsed.calls:
                job.emit("piece", Piece(index, parsed.content, [], parsed.calls))
            finish = "tool_calls" if parsed.calls else MALFORMED if parsed.malformed else finish
        return finish, n_gen, prompt_lp


def template_messages(messages: list[dict], template: ChatTemplate) -> list[dict]:
    """Messages as ``template`` reads them: tool calls' arguments as objects where it takes
    objects (``ChatTemplate.object_arguments``), else the JSON text as sent."""
    if not any("tool_calls" in m for m in messages) or not template.object_arguments:
        return messages
    out = []
    for m in messages:
        if "tool_calls" in m:
            calls = []
            for c in m["tool_calls"]:
                args = object_or_none(c["function"]["arguments"])
                fn = c["function"] | ({"arguments": args} if args is not None else {})
                calls.append(c | {"function": fn})
            m = m | {"tool_calls": calls}
        out.append(m)
    return out


def choice_seed(seed: int | None, index: int) -> int | None:
    """Choice 0 samples with the request's seed (as with n = 1); choice i with a seed drawn
    from (seed, i), so the choices are independent and each is reproducible."""
    if seed is None or index == 0:
        return seed
    return int(np.random.SeedSequence([seed, index]).generate_state(1, np.uint64)[0])


def merged(runs: list[RunStats]) -> RunStats:
    """One RunStats for a request's choices: the first's prompt, every choice's generation."""
    out = replace(runs[0], drafted_per_position=list(runs[0].drafted_per_position),
                  accepted_per_position=list(runs[0].accepted_per_position))
    for st in runs[1:]:
        out.n_gen += st.n_gen
        out.eval_s += st.eval_s
        out.drafted += st.drafted
        out.accepted += st.accepted
        add_per_position(out.drafted_per_position, st.drafted_per_position)
        add_per_position(out.accepted_per_position, st.accepted_per_position)
    return out


def timings(st, n_max: int) -> dict:
    """llama-server's ``timings`` object from a run's RunStats, with the draft counts."""
    ms = 1000.0
    return {
        "cache_n": st.n_prompt_cached,
        "prompt_n": st.n_prompt_eval, "prompt_ms": st.prompt_s * ms,
        "prompt_per_token_ms": st.prompt_s * ms / st.n_prompt_eval if st.n_prompt_eval else 0.0,
        "prompt_per_second": st.prompt_tps,
        "predicted_n": st.n_gen, "predicted_ms": st.eval_s * ms,
        "predicted_per_token_ms": st.eval_s * ms / st.n_eval_tokens if st.n_eval_tokens else 0.0,
        "predicted_per_second": st.eval_tps,
        "n_max": n_max, "draft_n": st.drafted, "draft_n_accepted": st.accepted,
        "draft_acceptance_per_position": st.acceptance_per_position,
        **({"n_max_chosen": st.spec["n_max_policy"]["n_max_chosen"],
            "n_max_mean": st.spec["n_max_policy"]["n_max_mean"]} if "n_max_policy" in st.spec else {}),
    }
