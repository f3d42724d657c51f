"""The sampling flags of `offload run` and `offload serve`: llama.cpp's names and defaults
(``offload.sampling``), checked in one line before anything loads."""
from __future__ import annotations

import argparse
import secrets

from offload.errors import OffloadError
from offload.sampling import (LLAMA_MIN_P, LLAMA_REPEAT_LAST_N, LLAMA_TEMPERATURE, LLAMA_TOP_K, LLAMA_TOP_P,
                              Penalties, Sampler, SamplingDefaults)


def add_sampling_arguments(p: argparse.ArgumentParser) -> None:
    """llama.cpp's sampling flags with its defaults (``offload.sampling``); ``--temp 0`` is greedy."""
    g = p.add_argument_group("sampling (llama.cpp's flags and defaults)")
    g.add_argument("--temp", type=float, default=LLAMA_TEMPERATURE,
                   help=f"temperature (default {LLAMA_TEMPERATURE}); 0 = greedy")
    g.add_argument("--top-k", type=int, default=LLAMA_TOP_K, help=f"top-k (default {LLAMA_TOP_K}; 0 = off)")
    g.add_argument("--top-p", type=float, default=LLAMA_TOP_P, help=f"top-p (default {LLAMA_TOP_P}; 1 = off)")
    g.add_argument("--min-p", type=float, default=LLAMA_MIN_P,
                   help=f"min-p: drop tokens under this fraction of the top one's probability "
                        f"(default {LLAMA_MIN_P}; 0 = off)")
    g.add_argument("--repeat-penalty", type=float, default=1.0,
                   help="divide a recently seen token's positive logit by this, multiply a negative one "
                        "(default 1 = off)")
    g.add_argument("--repeat-last-n", type=int, default=LLAMA_REPEAT_LAST_N,
                   help=f"the penalties' window of last tokens, prompt included (default {LLAMA_REPEAT_LAST_N}; "
                        f"0 = off, -1 = all)")
    g.add_argument("--presence-penalty", type=float, default=0.0, help="lower a seen token's logit once (default 0)")
    g.add_argument("--frequency-penalty", type=float, default=0.0,
                   help="lower a seen token's logit by this times its count (default 0)")
    g.add_argument("--seed", type=int, default=None, help="sampling seed (default: a fresh one each run)")


def sampling_options(args) -> dict:
    """``Session.generate``'s sampling keywords from the flags above; bad values are one line."""
    try:
        penalties = Penalties(repeat=args.repeat_penalty, last_n=args.repeat_last_n,
                              presence=args.presence_penalty, frequency=args.frequency_penalty)
        Sampler(temperature=args.temp, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p)
    except ValueError as exc:
        raise OffloadError(f"sampling: {exc}") from None
    seed = args.seed
    if seed is None and args.temp > 0:        # drawn here so the run can be repeated (printed)
        seed = secrets.randbits(32)
    return dict(temperature=args.temp, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p, seed=seed,
                penalties=penalties if penalties.active else None)


def describe_sampling(options: dict) -> str:
    """One line of what a run samples with (llama.cpp prints its sampler chain and seed)."""
    if options["temperature"] == 0:
        text = "greedy"
    else:
        text = (f"temp {options['temperature']:g}, top-k {options['top_k']}, top-p {options['top_p']:g}, "
                f"min-p {options['min_p']:g}, seed {options['seed']}")
    pen = options["penalties"]
    if pen is not None:
        text += (f"; penalties over the last {pen.last_n if pen.last_n >= 0 else 'all'} tokens: repeat "
                 f"{pen.repeat:g}, presence {pen.presence:g}, frequency {pen.frequency:g}")
    return f"sampling: {text}"


def sampling_defaults(args) -> SamplingDefaults:
    """``offload serve``'s flags as the defaults of requests that leave a sampling field out."""
    sampling_options(args)                    # the same one-line checks as offload run's
    return SamplingDefaults(temperature=args.temp, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                            repeat_penalty=args.repeat_penalty, repeat_last_n=args.repeat_last_n,
                            presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                            seed=args.seed)
