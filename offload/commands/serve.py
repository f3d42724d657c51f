"""``offload serve``: an OpenAI-compatible HTTP server, with MTP speculation inside.

    offload serve [MODEL.gguf] [placement flags as for offload plan | --placement plan.yaml]
                  [--host 127.0.0.1] [--port 8080] [--max-queue N] [--chat-template FILE]
                  [--alias NAME] [--spec-* as for offload run]

``POST /v1/chat/completions`` and ``/v1/completions`` (streaming or not), ``GET /v1/models``,
``GET /health`` (503 while the model loads), ``GET /metrics`` (Prometheus) and ``GET /slots``
(each slot's state; ``POST /slots/ID?action=erase`` empties its prompt cache; ``--no-slots``: off). ``-np N``
(llama-server's ``--parallel``; the plan counts N KV caches) serves N requests at once by
continuous batching: every step runs the tokens of all of them through the model as one
batch, a new request's prompt in chunks of ``--prompt-chunk`` between those steps. Requests
wait in arrival order for a free slot; ``--max-queue`` may wait, the next gets a 503.
Each slot reuses the KV of the longest prompt prefix it shares with its previous request
(the prompt cache).
Speculative decoding as in ``offload run``: the plan's ``n_max`` or ``--spec-n-max``; a
request's ``n_max`` field overrides it. Logprobs (with ``echo`` on completions), ``n``
choices, tool calls in the chat template's format, and ``response_format`` JSON by
constrained decoding: docs/serving.md.
"""
from __future__ import annotations

import argparse
import socket
import sys
from pathlib import Path

from offload.commands.plan import add_placement_arguments, plan_from_args
from offload.commands.sampling_args import add_sampling_arguments, sampling_defaults
from offload.commands.run import add_session_arguments, open_cli_model, runtime_process_settings, session_options
from offload.commands.spec_args import add_spec_arguments, spec_settings
from offload.errors import ArgumentParser, OffloadError

DEFAULT_MAX_QUEUE = 32
PROMPT_CHUNK = 128     # prompt tokens per batched step with several slots (a step's latency is everyone's)


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="offload serve", description=__doc__.split("\n\n")[0],
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", default=None,
                   help="GGUF file (default: the --placement plan's model, else the shipped tiny glm4moe model)")
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    g.add_argument("--port", type=int, default=8080, help="port (default 8080; 0 = a free one, printed)")
    g.add_argument("--max-queue", type=int, default=DEFAULT_MAX_QUEUE, metavar="N",
                   help=f"requests that may wait while every slot is busy; more get 503 (default {DEFAULT_MAX_QUEUE})")
    g.add_argument("--no-slots", dest="slots", action="store_false",
                   help="turn off GET /slots (each slot's state: generating or idle, tokens decoded, "
                        "prompt cache) and POST /slots/ID?action=erase (empty a slot's prompt cache), "
                        "as llama-server's --no-slots")
    g.add_argument("--prompt-chunk", type=int, metavar="N",
                   help="with -np > 1: a request's prompt runs N tokens per step, in the same steps as the "
                        f"other slots' decoding, so they do not stall for a long prompt (default {PROMPT_CHUNK})")
    g.add_argument("--chat-template", metavar="FILE",
                   help="jinja2 chat template (default: the GGUF's tokenizer.chat_template, else offload's own)")
    g.add_argument("--alias", metavar="NAME", help="model name in /v1/models and responses (default: the file's stem)")
    g.add_argument("--log-level", choices=("critical", "error", "warning", "info", "debug"), default="info",
                   help="uvicorn's log level (info logs each request)")
    add_sampling_arguments(p)
    add_session_arguments(p)
    add_spec_arguments(p)
    add_placement_arguments(p)
    return p


def listen_socket(host: str, port: int) -> socket.socket:
    """The server's socket, bound before anything loads: a taken port is a one-line error
    (port 0 picks a free one)."""
    # proto IPPROTO_TCP, not the default 0: asyncio turns Nagle off (TCP_NODELAY) only on
    # connections whose socket says TCP, and with Nagle on, every request after the first on a
    # kept-alive connection waited ~40 ms (the client's delayed ACK) for its response's tail
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM,
                         socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OffloadError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sock


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if not 0 <= args.port <= 65535:
        raise OffloadError(f"--port must be in 0..65535, got {args.port}")
    if args.max_queue < 1:
        raise OffloadError(f"--max-queue must be >= 1, got {args.max_queue}")
    if args.prompt_chunk is not None and args.prompt_chunk < 1:
        raise OffloadError(f"--prompt-chunk must be >= 1, got {args.prompt_chunk}")
    if args.torch_threads < 1:
        raise OffloadError(f"--torch-threads must be >= 1, got {args.torch_threads}")
    runtime_process_settings()
    import torch                  # the server stack and the runtime load only for this command
    import uvicorn

    from offload import runtime
    from offload.chat_template import ChatTemplate
    from offload.server.app import build_app
    from offload.server import tool_formats
    from offload.server.engine import Engine
    from offload.online_n_max import AUTO_CAP
    from offload.speculative import SpecOptions
    from offload.tokenizer import Tokenizer
    from placement.draft import NGRAM_SIZE
    from placement.spec_section import SpecSection

    torch.set_num_threads(args.torch_threads)
    model = open_cli_model(args)
    plan, model, _ = plan_from_args(args, model)
    spec, account = spec_settings(args, plan)
    p_min = args.spec_p_min if args.spec_p_min is not None else float((plan.speculative or SpecSection()).p_min or 0.0)
    options = SpecOptions(n_max=AUTO_CAP if isinstance(spec["n_max"], str) else spec["n_max"], p_min=p_min,
                          verify=args.spec_verify,
                          type=spec.get("spec_type", "mtp"), ngram_size=spec.get("ngram_size", NGRAM_SIZE))
    # everything that can be wrong with the flags is found before the port is bound
    sampling = sampling_defaults(args)
    template = ChatTemplate.for_model(model.metadata, Tokenizer.from_gguf(model.metadata), args.chat_template)
    name = args.alias or Path(plan.model_path).stem
    sock = listen_socket(args.host, args.port)
    url = f"http://{args.host}:{sock.getsockname()[1]}"

    def load():
        session = runtime.load_plan(model, plan, progress=True, **session_options(args))
        session.warmup()
        print(f"offload: {session.devices.describe()}", file=sys.stderr)
        print(f"offload: model loaded in {session.load_s:.1f} s; serving {name!r} on {url}",
              file=sys.stderr, flush=True)
        return session

    failed: list[str] = []

    def load_failed(message: str) -> None:
        print(f"offload: error: {message}", file=sys.stderr, flush=True)
        failed.append(message)
        server.should_exit = True

    tool_format = tool_formats.for_model(template.source, model.spec.arch)
    engine = Engine(load, model_name=name, template=template, spec=options, max_queue=args.max_queue,
                    on_load_error=load_failed, tool_format=tool_format, sampling=sampling,
                    parallel=plan.settings.parallel, prompt_chunk=args.prompt_chunk or PROMPT_CHUNK,
                    n_max=spec["n_max"])
    meta = {"arch": model.spec.arch, "n_ctx": plan.settings.ctx, "n_parallel": plan.settings.parallel,
            "n_max": options.n_max, "spec_type": options.type,
            "drafting": plan.drafting, "chat_template": template.origin,
            "tool_format": tool_format.name if tool_format is not None else None}
    print(f"offload: {account}", file=sys.stderr)
    print(f"offload: chat template: {template.origin}; tool calls: "
          f"{tool_format.name if tool_format is not None else 'none'}", file=sys.stderr)
    print(f"offload: listening on {url} (GET /health is 503 until the model has loaded)",
          file=sys.stderr, flush=True)
    config = uvicorn.Config(build_app(engine, model_meta=meta, slots_endpoint=args.slots), host=args.host, port=args.port,
                            log_level=args.log_level, timeout_graceful_shutdown=3, lifespan="on")
    server = uvicorn.Server(config)
    try:
        server.run(sockets=[sock])    # re-raises a Ctrl-C after shutting down (status 130)
    finally:
        engine.stop()
        if engine.session is not None:
            engine.session.close()
    if failed:
        return 2
    return 0 if server.started else 2
