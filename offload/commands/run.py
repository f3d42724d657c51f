"""``offload run``: load a model by placement and generate.

    offload run [MODEL.gguf] [placement flags as for offload plan] [-p TEXT | -f FILE] [-n N] ...
                [--spec-type mtp|ngram|dspark|none] [--spec-n-max N] [--spec-p-min P]
                [--spec-ngram-size-n N] [--spec-verify batched|exact] [--draft MTP.gguf] [--spec-diagnose]

Every ``offload plan`` flag works here (plan on the fly), or ``--placement plan.yaml``.
stdout carries only the generated text (pipe it); progress, notices and the llama.cpp-style
timings go to stderr; ``--stats-json`` writes the same numbers as JSON.

Speculative decoding drafts with the model's NextN (MTP) head, or with the NextN block of a
``--draft`` GGUF, or (``--spec-type ngram``, any model) from earlier n-grams of the context.
Its draft length defaults to the plan's ``speculative.n_max`` (``offload
plan`` predicts one, ``offload tune`` measures one), else 0 = plain decoding. The stats add
drafted/accepted, acceptance per position, mean accepted length and the draft/verify/rest
time split; ``--spec-diagnose`` measures how far batched verification drifts numerically.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from offload.commands import run_hosts
from offload.commands.sampling_args import add_sampling_arguments, describe_sampling, sampling_options
from offload.commands.plan import add_placement_arguments, plan_from_args
from offload.commands.spec_args import add_spec_arguments, spec_settings
from offload.errors import ArgumentParser, OffloadError, write_atomic
from offload.host_memory import return_freed_memory
from offload.online_n_max import AUTO_CAP
from offload.probe import SHIPPED_MODEL

DEFAULT_MODEL = SHIPPED_MODEL      # models/tiny-glm4moe-mtp.gguf, also what offload probe times
DEFAULT_PROMPT = "def fibonacci(n):"


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="offload run", description=__doc__.split("\n\n")[0],
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", default=None,
                   help="GGUF file (default: the --placement plan's model, else the shipped tiny glm4moe model)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("-p", "--prompt", help=f"prompt text (default: {DEFAULT_PROMPT!r})")
    src.add_argument("-f", "--prompt-file", help="read the prompt from this file")
    p.add_argument("-n", "--n-predict", dest="n_predict", type=int, default=128,
                   help="tokens to generate (default 128)")
    add_sampling_arguments(p)
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence")
    p.add_argument("--stats-json", metavar="PATH", help="write timings/counters as JSON here")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="also print the path each block takes: compiled CPU kernels, or the reference "
                        "(torch) path and why")
    add_session_arguments(p)
    add_spec_arguments(p)
    run_hosts.add_rank_arguments(p)
    p.add_argument("--spec-diagnose", action="store_true",
                   help="after generating, print how far batched verification drifts from one-token "
                        "decoding on the prompt + output (largest logit difference, greedy flips)")
    add_placement_arguments(p)
    return p


def add_session_arguments(p: argparse.ArgumentParser) -> None:
    """How the model is loaded and computed (shared by run, bench and tune)."""
    p.add_argument("--virtual-gpus", action="store_true",
                   help="back the plan's CUDA devices with the CPU (testing without a GPU)")
    p.add_argument("--gpu-dtype", choices=("auto", "f32", "f16", "bf16"), default="auto",
                   help="compute dtype GPU-resident weights are dequantized into per call "
                        "(they stay quantized in memory); auto = bf16 on CUDA, f32 on virtual GPUs")
    p.add_argument("-t", "--threads", type=int, default=None,
                   help="threads for the CPU expert kernels (default: numba's, all cores)")
    p.add_argument("--op-offload", choices=("auto", "on", "off"), default="auto",
                   help="stream RAM-resident experts to a GPU for prompt batches of at least a threshold: "
                        "auto (default) = the cost model's threshold for this box, on = llama.cpp's 32 tokens, off")
    p.add_argument("--prefill-activations", choices=PREFILL_ACTIVATIONS, default="int8",
                   help="activations of the CPU kernels for prompt batches (more than 16 tokens): int8 "
                        "(default; llama.cpp's Q8 activations, integer dot products where the CPU has them (VNNI, AVX2)) "
                        "or float (float32, exact up to summation order)")
    p.add_argument("--decode-activations", choices=DECODE_ACTIVATIONS, default="auto",
                   help="activations of the CPU routed experts for decode/verify batches (up to 16 tokens): "
                        "auto (default) = int8 for the weight types whose int8 path measured faster on this CPU "
                        "(measured at the first load, about 0.1 s a type, then cached; VNNI or AVX2 CPUs), float "
                        "for the others; int8 = every quantized type; float = float32 everywhere")
    p.add_argument("--torch-threads", type=int, default=1,
                   help="torch intra-op CPU threads (default 1: torch's per-token CPU work is "
                        "small, and spare cores belong to the expert kernels)")


PREFILL_ACTIVATIONS = ("int8", "float")
DECODE_ACTIVATIONS = ("auto", "int8", "float")     # offload.cpu_ops.DECODE_ACTIVATIONS (light import: no torch here)


def session_options(args: argparse.Namespace) -> dict:
    """``add_session_arguments``' flags as ``runtime.load_plan`` keywords."""
    return dict(virtual_gpus=args.virtual_gpus, gpu_dtype=args.gpu_dtype, threads=args.threads,
                op_offload=args.op_offload, int8_prefill=args.prefill_activations == "int8",
                decode_activations=args.decode_activations)


def open_cli_model(args: argparse.Namespace):
    """The positional model, or None with ``--placement`` (the plan names its model), or the
    shipped model."""
    from offload.gguf_model import open_model

    if args.model is None and args.placement:
        return None
    path = args.model if args.model is not None else str(DEFAULT_MODEL)
    if not Path(path).is_file():
        raise OffloadError(f"model file not found: {path}")
    return open_model(path)


def runtime_process_settings() -> None:
    """What every command that runs the model sets first (before torch/numba load): freed
    activation memory leaves RSS (``offload.host_memory``; yields to the user's own setting).

    OpenMP's wait policy is left to OpenMP (spin briefly, then sleep), as llama.cpp runs.
    Forcing ``OMP_WAIT_POLICY=PASSIVE`` — the default here until the compiled CPU blocks —
    costs a sleep and a wake-up at every parallel region: on an idle 2-core box the shipped
    model decoded 470–520 t/s passive vs 1,800–2,170 t/s by default, the depth bench's
    narrow model 46–47 vs 102–106 t/s (prefill equal). On a box that is busy with other
    work spinning threads steal the cores (measured earlier on a loaded box: a 256×256
    mat-vec 37 µs passive vs 768 µs spinning): export ``OMP_WAIT_POLICY=PASSIVE`` there
    (the test suite does)."""
    return_freed_memory()


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    runtime_process_settings()
    if args.prompt_file:
        try:
            prompt = Path(args.prompt_file).read_text()
        except OSError as e:
            raise OffloadError(f"cannot read --prompt-file {args.prompt_file}: {e.strerror}") from None
    else:
        prompt = args.prompt if args.prompt is not None else DEFAULT_PROMPT
    if args.n_predict < 1:
        raise OffloadError(f"-n must be >= 1, got {args.n_predict}")
    if args.torch_threads < 1:
        raise OffloadError(f"--torch-threads must be >= 1, got {args.torch_threads}")
    across = run_hosts.launch(args)       # one rank of a plan across hosts
    if across is not None:
        return run_hosts.main(args, prompt, *across)
    model = open_cli_model(args)
    # torch (~1 s to import) only past the refusals above, which stay one quick line; before
    # planning, which may run the box's probe with these threads
    import torch

    from offload import runtime
    from offload.compiled_block import path_lines
    from offload.tokenizer import TextStream

    torch.set_num_threads(args.torch_threads)
    plan, model, _ = plan_from_args(args, model)
    spec, account = spec_settings(args, plan)
    sampling = sampling_options(args)          # bad values: one line before loading
    session = runtime.load_plan(model, plan, progress=True, **session_options(args))
    with session:
        print(f"offload: {session.devices.describe()}", file=sys.stderr)
        print(f"offload: {account}", file=sys.stderr)
        print(f"offload: {describe_sampling(sampling)}", file=sys.stderr)
        if args.verbose:
            for line in path_lines(session.model):
                print(f"offload: {line}", file=sys.stderr)
        session.warmup()
        stream = TextStream(session.detokenize)
        ids = session.tokenize(prompt)
        out = []
        for tok in session.generate(ids, max_tokens=args.n_predict, stop_at_eos=not args.ignore_eos,
                                    **sampling, **spec):
            sys.stdout.write(stream.push(tok))
            sys.stdout.flush()
            out.append(tok)
        sys.stdout.write(stream.close() + "\n")
        stats = session.stats
        print("", file=sys.stderr)
        for line in stats.lines():
            print(f"offload: {line}", file=sys.stderr)
        if stats.spec.get("verify") == "batched":
            print("offload: note: batched verify computes the drafts' target logits in one pass; float "
                  "rounding differs from one-token passes and can flip a near-tied greedy token "
                  "(--spec-diagnose measures it; --spec-verify exact is token-identical to plain decoding)",
                  file=sys.stderr)
        payload = stats.as_dict()
        if args.spec_diagnose:
            n_max = spec.get("n_max", 0)
            payload["drift"] = diagnose(session, ids + out[:-1], AUTO_CAP if isinstance(n_max, str) else n_max)
        if args.stats_json:
            payload |= {"plan": plan.to_dict() | {"tensors": None}}
            write_atomic(args.stats_json, json.dumps(payload, indent=2) + "\n")
    return 0


def diagnose(session, ids: list[int], n_max: int) -> dict:
    """Print and return the batched-vs-one-token drift on ``ids`` for the verify batch sizes
    2 .. n_max+1 (at least 2..5) and the whole sequence in one pass (prompt processing)."""
    from offload.drift import format_drift, verify_drift

    batches = sorted(set(range(2, max(n_max + 1, 5) + 1)) | {len(ids)})
    margin, rows = verify_drift(session.model, ids, batches)
    for line in format_drift(margin, rows):
        print(f"offload: {line}", file=sys.stderr)
    return {"min_top2_margin": margin, "rows": [r.as_dict() for r in rows]}
