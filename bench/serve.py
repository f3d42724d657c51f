"""``offload serve`` measured from the client's side, against a real server process.

    python -m bench.serve [MODEL.gguf] [--turns 6] [--reps 3] [--clients 20] [--parts 1234] [-- serve flags]

1. A streamed chat completion, printed as the raw server-sent events it arrived as.
2. Time to first token (client clock: request sent → first content chunk) on a multi-turn
   conversation, each turn sent twice in a row: with the prompt cache (the previous turn's
   KV reused) and with ``cache_prompt: false`` (the whole prompt evaluated), so both see the
   same box state. Medians over ``--reps`` conversations, with the server's own prompt_n /
   cache_n / prompt_ms.
3. ``--clients`` clients at once (one request each, a barrier releases them together),
   against the default ``--max-queue`` and against ``--max-queue 4``: answered / 503, and
   latency percentiles.
4. Why requests are served one at a time: one sequence's forward over T tokens vs T single
   tokens, in this process — about what a T-sequence batch could save per step (it reads each
   touched expert once, like a verify batch of T tokens; attention would differ).
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx

from tests.serve_process import ServeProcess

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "models" / "tiny-glm4moe-mtp.gguf"
SYSTEM = "You are a careful Python programmer. Answer with code only."
ASKS = ["Write a function that reads an INI config file into a dict.",
        "Now make it accept a default section and report unknown keys.",
        "Add type hints and a docstring that explains the return value.",
        "Write three pytest tests for it, one for a missing file.",
        "Refactor the parsing loop into a generator of (section, key, value).",
        "Add logging of every unknown key with the logging module.",
        "Make the file encoding a keyword argument, defaulting to utf-8."]


# one client, kept: a new httpx client per request costs tens of ms (SSL context) before it sends
CLIENT = httpx.Client(timeout=600, limits=httpx.Limits(max_connections=64))


def stream_chat(url: str, body: dict, *, show: bool = False) -> tuple[float, str, dict]:
    """(seconds to the first content chunk, the text, the last chunk's timings)."""
    t0 = time.perf_counter()
    ttft, text, timings = None, "", {}
    with CLIENT.stream("POST", f"{url}/v1/chat/completions", json=body | {"stream": True}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if show and line:
                print(f"  {line}")
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            piece = chunk["choices"][0]["delta"].get("content") if chunk["choices"] else None
            if piece:
                ttft = ttft if ttft is not None else time.perf_counter() - t0
                text += piece
            timings = chunk.get("timings", timings)
    return ttft if ttft is not None else time.perf_counter() - t0, text, timings


def transcript(url: str) -> None:
    body = {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": ASKS[0]}],
            "max_tokens": 12, "temperature": 0, "stream_options": {"include_usage": True}}
    print(f"1. streamed chat completion: POST /v1/chat/completions {json.dumps(body)}")
    stream_chat(url, body, show=True)


def ttft(url: str, turns: int, reps: int, max_tokens: int) -> None:
    print(f"\n2. time to first token, {turns}-turn conversation, {max_tokens} tokens per answer, "
          f"median of {reps} (client clock; prompt_n/cache_n/prompt_ms from the server)")
    rows = [[] for _ in range(turns)]
    for rep in range(reps):
        messages = [{"role": "system", "content": f"{SYSTEM} (conversation {rep})"}]
        for turn in range(turns):
            messages.append({"role": "user", "content": ASKS[turn % len(ASKS)]})
            body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0}
            hit_s, answer, hit = stream_chat(url, body)
            miss_s, _, miss = stream_chat(url, body | {"cache_prompt": False})
            rows[turn].append((hit_s, miss_s, hit, miss))
            messages.append({"role": "assistant", "content": answer})
    print(f"{'turn':>4} {'prompt':>7} {'cached':>7} {'TTFT cache':>11} {'TTFT none':>10} {'ratio':>6} "
          f"{'prompt_ms cache':>16} {'prompt_ms none':>15}")
    for turn, runs in enumerate(rows):
        med = lambda f: statistics.median(f(r) for r in runs)  # noqa: E731
        hit, miss = med(lambda r: r[0]), med(lambda r: r[1])
        print(f"{turn + 1:>4} {runs[0][3]['prompt_n']:>7} {runs[0][2]['cache_n']:>7} {1e3 * hit:>9.1f}ms "
              f"{1e3 * miss:>8.1f}ms {miss / hit:>6.1f} {med(lambda r: r[2]['prompt_ms']):>14.1f}ms "
              f"{med(lambda r: r[3]['prompt_ms']):>13.1f}ms")


def together(clients: int, one) -> tuple[float, list]:
    """``one(i)`` for i < clients, each on its thread, released together by a barrier →
    (wall seconds from the release, their results)."""
    results: list = [None] * clients
    gate = threading.Barrier(clients)

    def run(i):
        gate.wait()
        results[i] = one(i)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0, results


def pct(xs: list[float], q: float) -> float:
    """The q-quantile of xs (seconds) in ms, nearest rank; NaN for none."""
    xs = sorted(xs)
    return 1e3 * xs[min(len(xs) - 1, round(q * (len(xs) - 1)))] if xs else float("nan")


def crowd(url: str, clients: int, max_tokens: int, label: str) -> None:
    body = {"prompt": "import sys\n", "max_tokens": max_tokens, "temperature": 0.8, "ignore_eos": True}

    def one(i):
        t = time.perf_counter()
        try:
            status = CLIENT.post(f"{url}/v1/completions", json=body | {"seed": i}).status_code
        except httpx.TransportError as exc:
            status = type(exc).__name__
        return status, time.perf_counter() - t

    wall, results = together(clients, one)
    ok = sorted(s for st, s in results if st == 200)
    busy = sorted(s for st, s in results if st == 503)
    other = [st for st, _ in results if st not in (200, 503)]

    print(f"{label}: {len(ok)} answered, {len(busy)} got 503, {len(other)} other {other or ''}; wall {wall:.2f} s")
    if ok:
        print(f"    answered latency ms: p50 {pct(ok, .5):.0f}  p90 {pct(ok, .9):.0f}  p99 {pct(ok, .99):.0f}  "
              f"max {1e3 * ok[-1]:.0f}")
    if busy:
        print(f"    503 latency ms:      p50 {pct(busy, .5):.0f}  max {1e3 * busy[-1]:.0f}")


def batching(model: str) -> None:
    import torch

    import offload.runtime as rt
    torch.set_num_threads(1)
    print("\n4. one sequence's forward over T tokens vs T one-token forwards (60 rounds, this process; on a "
          "shared box the minimum is the least disturbed)")
    with rt.load(model, devices="CPU=16GiB", quiet=True) as s:
        s.warmup()
        m = s.model
        ids = s.tokenize("import os\nimport sys\n\n\ndef main(argv):\n    return 0\n" * 3)
        with torch.inference_mode():
            state = m.new_state()
            m.forward(torch.tensor(ids), state, logits="none")
            n0 = state.n_past

            def once(t):
                state.truncate(n0)
                t1 = time.perf_counter()
                m.forward(torch.tensor(ids[:t]), state, logits="all")
                return time.perf_counter() - t1

            sizes = (1, 2, 3, 4, 6, 8)
            times = {t: [] for t in sizes}
            rng = random.Random(0)
            for _ in range(60):                 # sizes in a fresh random order each round
                for t in rng.sample(sizes, len(sizes)):
                    times[t].append(once(t))
            best = {t: min(v) for t, v in times.items()}
            print(f"{'T':>3} {'min ms':>7} {'median ms':>10} {'T x one-token min ms':>21} {'saved':>6}")
            for t in sizes:
                print(f"{t:>3} {1e3 * best[t]:>7.2f} {1e3 * statistics.median(times[t]):>10.2f} "
                      f"{1e3 * t * best[1]:>21.2f} {1 - best[t] / (t * best[1]):>6.0%}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.serve", description=__doc__.split("\n\n")[0])
    p.add_argument("model", nargs="?", default=str(SHIPPED))
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--answer-tokens", type=int, default=32)
    p.add_argument("--clients", type=int, default=20)
    p.add_argument("--crowd-tokens", type=int, default=32)
    p.add_argument("--parts", default="1234", help="which of the four parts to run (default 1234)")
    p.add_argument("serve_flags", nargs=argparse.REMAINDER, help="after --: flags for offload serve")
    a = p.parse_args(argv)
    flags = [f for f in a.serve_flags if f != "--"] or ["--devices", "CPU=16GiB", "--spec-n-max", "2"]
    if {"1", "2", "3"} & set(a.parts):
        print(f"offload serve {a.model} {' '.join(flags)}")
        server = ServeProcess(a.model, ["--log-level", "warning", *flags])
        try:
            if "1" in a.parts:
                transcript(server.url)
            if "2" in a.parts:
                ttft(server.url, a.turns, a.reps, a.answer_tokens)
            if "3" in a.parts:
                print(f"\n3. {a.clients} concurrent clients, {a.crowd_tokens} tokens each")
                crowd(server.url, a.clients, a.crowd_tokens, "default --max-queue 32")
        finally:
            server.close()
    if "3" in a.parts:
        server = ServeProcess(a.model, ["--log-level", "warning", *flags, "--max-queue", "4"])
        try:
            crowd(server.url, a.clients, a.crowd_tokens, "--max-queue 4")
        finally:
            server.close()
    if "4" in a.parts:
        batching(a.model)
    return 0


if __name__ == "__main__":
    sys.exit(main())
