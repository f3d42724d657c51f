"""Quantized KV caches: logits error against the f16 cache, beside llama.cpp's own error for
the same model and type, and CPU decode speed per cache type — ratios against f16 measured in
the same run.

    python -m bench.kv_quant [--model GGUF] [--contexts 2048,8192] [--speed-contexts 1024,8192]
                             [--types q8_0,q4_0,...] [--positions 32] [-n 32] [-t THREADS]

Error: a fixed random prompt of L tokens (prefilled in ubatches), then the logits of its last
``--positions`` tokens as one verify-sized batch; per type, max |logits − logits_f16| / max
|logits_f16| over those positions and the share of positions whose argmax agrees with f16's.
Models: ``--model`` (default the shipped model) and a tiny deepseek2 (MLA latent cache,
written here with ``tests.tiny_models``; random weights, so its errors say little about a real
model's). llama.cpp's column runs the same GGUF, prompt and type through llama-cpp-python
(``type_k``/``type_v``, flash attention on), its logits against its own f16 run; "-" where it
cannot load the model.

Speed: after a prompt of L − n tokens, ``-n`` greedy decode steps of one token, all on the CPU
(compiled blocks), timed with perf_counter after one warm-up step; tokens/s and the ratio
to the f16 cache's.
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

F16 = "f16"
TYPES = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "iq4_nl")
GGML_IDS = {"f16": 1, "q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "q8_0": 8, "iq4_nl": 20}   # enum ggml_type
UBATCH = 512


def prompt_ids(n: int) -> np.ndarray:
    """A fixed random prompt of ids below the tiny models' vocabularies."""
    return np.random.default_rng(1234).integers(3, 250, n)


def offload_logits(path: str, ctx: int, cache: str, positions: int, threads: int) -> np.ndarray:
    """Logits (positions, vocab) of the prompt's last ``positions`` tokens with a ``cache`` cache."""
    import torch

    import offload.runtime as rt
    with rt.load(path, devices="CPU=64GiB", ctx=ctx, cache_type=cache, quiet=True, threads=threads) as s, \
            torch.inference_mode():
        ids = torch.tensor(prompt_ids(ctx))
        state = s.model.new_state()
        head = ctx - positions
        for i in range(0, head, UBATCH):
            s.model.forward(ids[i:min(head, i + UBATCH)], state, logits="none")
        logits = s.model.forward(ids[head:], state, logits="all")[0]
        return logits.float().numpy()


def llama_logits(path: str, ctx: int, cache: str, positions: int, threads: int) -> np.ndarray | None:
    try:
        import llama_cpp
        llm = llama_cpp.Llama(model_path=path, n_ctx=ctx, n_batch=UBATCH, n_ubatch=UBATCH, n_threads=threads,
                              type_k=GGML_IDS[cache], type_v=GGML_IDS[cache], flash_attn=True,
                              logits_all=True, verbose=False)
    except Exception:     # noqa: BLE001  (not installed, or this model is not one llama.cpp loads)
        return None
    llm.eval(list(map(int, prompt_ids(ctx))))
    return np.array(llm.scores[ctx - positions:ctx], np.float32)


def errors(got: np.ndarray, ref: np.ndarray) -> tuple[float, float]:
    """(max relative error, argmax agreement) of ``got`` against ``ref``."""
    rel = float(np.abs(got - ref).max() / np.abs(ref).max())
    return rel, float((got.argmax(-1) == ref.argmax(-1)).mean())


def error_table(name: str, path: str, contexts, types, positions: int, threads: int) -> None:
    print(f"\n{name}: logits vs the f16 cache (last {positions} positions)")
    print(f"{'ctx':>6} {'type':>7} {'offload max rel':>16} {'argmax':>7} {'llama.cpp max rel':>18} {'argmax':>7}")
    for ctx in contexts:
        ref = offload_logits(path, ctx, F16, positions, threads)
        lref = llama_logits(path, ctx, F16, positions, threads)
        for t in types:
            rel, agree = errors(offload_logits(path, ctx, t, positions, threads), ref)
            lcol = "-".rjust(18) + " " + "-".rjust(7)
            if lref is not None:
                got = llama_logits(path, ctx, t, positions, threads)
                if got is not None:
                    lrel, lagree = errors(got, lref)
                    lcol = f"{lrel:18.2e} {lagree:7.3f}"
            print(f"{ctx:>6} {t:>7} {rel:16.2e} {agree:7.3f} {lcol}")


def decode_tps(path: str, ctx: int, cache: str, n: int, threads: int) -> tuple[float, int, int]:
    """(tokens/s, planned KV bytes, allocated KV bytes) of ``n`` one-token steps after ctx − n tokens."""
    import torch

    import offload.runtime as rt
    torch.set_num_threads(1)
    with rt.load(path, devices="CPU=64GiB", ctx=ctx, cache_type=cache, quiet=True, threads=threads) as s, \
            torch.inference_mode():
        ids = torch.tensor(prompt_ids(ctx))
        state = s.model.new_state()
        head = ctx - n - 1
        for i in range(0, head, UBATCH):
            s.model.forward(ids[i:min(head, i + UBATCH)], state, logits="none")
        tok = s.model.forward(ids[head:head + 1], state, logits="last")[0].argmax(-1).reshape(1)  # warm-up step
        t0 = time.perf_counter()
        for _ in range(n):
            tok = s.model.forward(tok, state, logits="last")[0].argmax(-1).reshape(1)
        tps = n / (time.perf_counter() - t0)
        planned = sum(t.kv_bytes for t in s.plan.totals)
        allocated = sum(s.memory(state)["kv"].values())
        return tps, planned, allocated


def speed_table(path: str, contexts, types, n: int, threads: int) -> None:
    print(f"\nCPU decode, {n} tokens, {threads} threads ({path})")
    print(f"{'ctx':>6} {'type':>7} {'t/s':>8} {'vs f16':>7} {'KV planned':>12} {'allocated':>12}")
    for ctx in contexts:
        base = None
        for t in (F16,) + tuple(types):
            tps, planned, allocated = decode_tps(path, ctx, t, n, threads)
            base = base or tps
            print(f"{ctx:>6} {t:>7} {tps:8.2f} {tps / base:7.2f} {planned:12,} {allocated:12,}")


def main() -> int:
    from offload.probe import SHIPPED_MODEL
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(SHIPPED_MODEL))
    ap.add_argument("--contexts", default="2048,8192")
    ap.add_argument("--speed-contexts", default="1024,8192")
    ap.add_argument("--types", default=",".join(TYPES))
    ap.add_argument("--positions", type=int, default=32)
    ap.add_argument("-n", type=int, default=32, help="decode steps timed per type and context")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--no-deepseek2", action="store_true", help="skip the tiny deepseek2")
    ap.add_argument("--no-speed", action="store_true")
    ap.add_argument("--speed-tiny", action="store_true",
                    help="also time a tiny deepseek2 (MLA latent cache) and gpt-oss (window caches, sinks): "
                         "their CPU attention reads the quantized cache tile by tile through torch")
    a = ap.parse_args()
    contexts = [int(x) for x in a.contexts.split(",")]
    types = tuple(a.types.split(","))
    error_table(Path(a.model).name, a.model, contexts, types, a.positions, a.threads)
    if not a.no_deepseek2:
        from tests.tiny_models import TinySpec, write_tiny_model
        with tempfile.TemporaryDirectory() as tmp:      # latent 64 + 32: whole blocks of 32
            tiny = write_tiny_model(Path(tmp) / "ds2.gguf", TinySpec(arch="deepseek2", n_layer=3, n_rot=32))
            error_table("tiny deepseek2 (random weights)", str(tiny.path), contexts, types, a.positions, a.threads)
    if not a.no_speed:
        speed_table(a.model, [int(x) for x in a.speed_contexts.split(",")], types, a.n, a.threads)
    if a.speed_tiny:
        from tests.tiny_models import TinySpec, write_tiny_model
        with tempfile.TemporaryDirectory() as tmp:
            for name, spec in (("ds2", TinySpec(arch="deepseek2", n_layer=3, n_rot=32)),
                               ("gpt-oss", TinySpec(arch="gpt-oss", n_layer=3, head_dim=64, n_head_kv=2, window=128))):
                tiny = write_tiny_model(Path(tmp) / f"{name}.gguf", spec)
                speed_table(str(tiny.path), [int(x) for x in a.speed_contexts.split(",")], types, a.n, a.threads)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
