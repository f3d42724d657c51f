"""The speculative-decoding flags of `offload run` and `offload serve` (llama.cpp's names), and
how they and a plan's ``speculative`` section resolve into a drafter and its settings; `offload
bench` and `tune` list drafters here too. A module of its own, as ``sampling_args``, so that
`offload run` across hosts (``run_hosts``) reads them without importing `offload run`."""
from __future__ import annotations

import argparse

from offload.commands.plan import spec_type_arg
from offload.errors import OffloadError
from offload.online_n_max import POLICIES
from placement.draft import NGRAM_SIZE, NoDraftHead, check_n_max, check_ngram_size, check_p_min, spec_type
from placement.spec_section import SpecSection
from placement.speculative import BLOCK_DRAFTERS


DEFAULT_EXPLICIT_N_MAX = 3     # --spec-type X without an n_max from anywhere: llama.cpp's --spec-draft-n-max


def add_spec_arguments(p: argparse.ArgumentParser) -> None:
    """Speculative-decoding flags (shared by ``offload run``, ``offload serve``)."""
    g = p.add_argument_group("speculative decoding (llama.cpp's --spec-type draft-mtp|ngram-*, "
                             "--spec-draft-n-max, --spec-draft-p-min)")
    g.add_argument("--spec-type", type=spec_type_arg, default=None, metavar="TYPE",
                   help="mtp: draft with the NextN (MTP) head (the model's own, or --draft's); ngram: draft "
                        "from the longest earlier match of the last tokens in the context (no weights, any "
                        "model); dspark: a DSpark block drafter (--draft FILE); none: plain decoding. "
                        "llama.cpp's draft-mtp, draft-dspark and ngram-* are accepted "
                        "(default: the plan's speculative.type, else mtp when there is a head)")
    g.add_argument("--spec-n-max", "--spec-draft-n-max", dest="spec_n_max", type=n_max_arg, default=None,
                   metavar="N|auto",
                   help="longest draft per step (default: the plan's speculative.n_max; with an explicit "
                        f"--spec-type and no plan value {DEFAULT_EXPLICIT_N_MAX}; else 0 = plain); auto: "
                        "each sequence's n_max chosen every few steps from its measured acceptance and the "
                        "measured step costs at the current batch size (offload.online_n_max)")
    g.add_argument("--spec-p-min", "--spec-draft-p-min", dest="spec_p_min", type=float, default=None, metavar="P",
                   help="stop drafting when the draft's top probability is below P (MTP, DSpark; "
                        "default: the plan's speculative.p_min, else 0)")
    g.add_argument("--spec-ngram-size-n", type=int, default=None, metavar="N",
                   help=f"ngram: the longest n-gram looked up (default {NGRAM_SIZE}; shorter matches down "
                        "to 2 tokens are tried when it finds none)")
    g.add_argument("--spec-verify", choices=("batched", "exact"), default="batched",
                   help="batched: verify all drafts in one target pass (fast; batch-shape rounding may "
                        "flip near-tied greedy tokens, see --spec-diagnose); exact: one pass per token, "
                        "token-identical to plain decoding")


def n_max_arg(text: str) -> int | str:
    """``--spec-n-max`` for argparse: a draft length, or a policy that chooses it online
    (``auto``; ``bandit``, the ε-greedy comparator)."""
    if text.strip().lower() in POLICIES:
        return text.strip().lower()
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or {' / '.join(POLICIES)}, got {text!r}") from None


def spec_settings(args: argparse.Namespace, plan) -> tuple[dict, str]:
    """The flags and the plan's ``speculative`` section → the drafter and its settings as
    keywords for ``Session.generate`` (n_max, p_min, verify, spec_type, ngram_size), and a
    one-line account of where they came from."""
    section = plan.speculative or SpecSection()
    block = block_drafter(plan)
    head = {"in-model NextN": "the model's NextN head",
            "--draft": f"the {'DSpark drafter' if block else 'NextN head'} of {plan.draft_path}"}
    if args.spec_n_max is not None and args.spec_n_max not in POLICIES:
        check_n_max(args.spec_n_max, "--spec-n-max")
    if args.spec_p_min is not None:
        check_p_min(args.spec_p_min, "--spec-p-min")
    ngram_size = check_ngram_size(args.spec_ngram_size_n) if args.spec_ngram_size_n is not None else NGRAM_SIZE
    kind = args.spec_type
    if kind == "none":
        return {"n_max": 0}, "speculative decoding off (--spec-type none)"
    # the draft head decides between mtp and dspark: a dflash --draft drafts only as dspark
    if kind == "dspark" and not block:
        has = head[plan.drafting] if plan.drafting != "none" else "no draft head"
        raise OffloadError(f"--spec-type dspark needs a DSpark drafter (--draft FILE, a dflash GGUF); "
                           f"{plan.model_path} has {has}")
    if kind == "mtp" and plan.drafting == "none":
        raise NoDraftHead(plan.model_path, f"--spec-type {kind}")
    if kind == "mtp" and block:
        raise OffloadError(f"--draft {plan.draft_path} is a DSpark (dflash) drafter: draft with --spec-type dspark")
    planned = section.type or ("dspark" if block else "mtp")
    if kind is None:
        kind = planned if planned == "ngram" or plan.drafting != "none" else "mtp"
        kind = "dspark" if block and kind == "mtp" else kind
    p_min = args.spec_p_min if args.spec_p_min is not None else float(section.p_min or 0.0)
    if args.spec_n_max is not None:
        n_max, source = args.spec_n_max, "--spec-n-max"
    elif section.n_max is not None and kind == planned and (kind == "ngram" or plan.drafting != "none"):
        n_max = int(section.n_max)
        source = f"the plan's speculative.n_max ({section.source or 'plan'})"
    elif args.spec_type is not None:
        n_max, source = DEFAULT_EXPLICIT_N_MAX, f"the default for --spec-type {kind}"
    else:
        return {"n_max": 0}, ("speculative decoding off: n_max 0 (" +
                              ("the plan has no speculative section; --spec-n-max N drafts with "
                               f"{head[plan.drafting]})" if plan.drafting != "none" else
                               "no draft head; --spec-type ngram drafts from the context)"))
    if n_max == 0:
        return {"n_max": 0}, f"speculative decoding off: n_max 0 from {source}"
    if kind != "ngram" and plan.drafting == "none":
        raise NoDraftHead(plan.model_path, f"--spec-n-max {n_max}")
    what = (f"ngram from the context (longest lookup {ngram_size})" if kind == "ngram"
            else f"{kind} with {head[plan.drafting]}")
    return ({"n_max": n_max, "p_min": p_min, "verify": args.spec_verify, "spec_type": kind,
             "ngram_size": ngram_size},
            f"speculative decoding: {what}, n_max {n_max} (from {source}), "
            f"p_min {p_min:g}, verify {args.spec_verify}")


def plan_drafters(text: str | None, plan, command: str) -> list[str]:
    """The drafters a comma list (``--spec-type`` of ``offload bench`` / ``tune``) names for
    ``plan``, ``none`` left out (plain decoding always runs); default: the plan's head drafter
    (dspark with a dflash --draft, else mtp with a draft head) and ngram, which any model has.
    A drafter the plan cannot draft with: one line naming ``command``."""
    block = block_drafter(plan)
    if text is None:
        return (["dspark"] if block else ["mtp"] if plan.drafting != "none" else []) + ["ngram"]
    kinds = []
    for part in text.split(","):
        kind = spec_type(part.strip())
        if kind == "dspark" and not block:
            raise OffloadError(f"{command} --spec-type dspark needs a DSpark drafter (--draft FILE, a dflash "
                               f"GGUF); {plan.model_path} has none")
        if kind == "mtp" and block:
            raise OffloadError(f"{command} --spec-type mtp: --draft {plan.draft_path} is a DSpark (dflash) "
                               "drafter; draft with --spec-type dspark")
        if kind == "mtp" and plan.drafting == "none":
            raise NoDraftHead(plan.model_path, f"{command} --spec-type mtp")
        if kind != "none" and kind not in kinds:
            kinds.append(kind)
    return kinds


def block_drafter(plan) -> bool:
    """Whether the plan's --draft file is a block drafter (DSpark's dflash), by its header."""
    if plan.drafting != "--draft" or not plan.draft_path:
        return False
    from offload.gguf_model import open_model
    return open_model(plan.draft_path).spec.arch in BLOCK_DRAFTERS
