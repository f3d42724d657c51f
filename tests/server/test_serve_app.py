"""The server app in this process (Starlette's TestClient), where a test needs to hold the
model load: ``/health`` and every generation route answer 503 with an OpenAI-style body
until the model has loaded, ``/v1/models`` answers meanwhile; a failed load is reported once
and ends the server."""
from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("httpx")
from starlette.testclient import TestClient  # noqa: E402

from offload.chat_template import ChatTemplate  # noqa: E402
from offload.errors import OffloadError  # noqa: E402
from offload.server.app import build_app  # noqa: E402
from offload.server.engine import Engine  # noqa: E402
from offload.speculative import SpecOptions  # noqa: E402


def engine(load, on_load_error=lambda message: None) -> Engine:
    return Engine(load, model_name="m", template=ChatTemplate("{{ messages }}", origin="test"),
                  spec=SpecOptions(), max_queue=2, on_load_error=on_load_error)


SHIPPED = Path(__file__).resolve().parents[2] / "models" / "tiny-glm4moe-mtp.gguf"


def wait_healthy(client) -> None:
    """Until ``/health`` says the model has loaded (10 s at most)."""
    for _ in range(200):
        if client.get("/health").status_code == 200:
            return
        threading.Event().wait(0.05)


def slots_engine(session, parallel: int, **kw) -> Engine:
    """An engine over a loaded session with ``parallel`` slots (``offload serve -np``)."""
    kw = {"spec": SpecOptions(), **kw}
    return Engine(lambda: session, model_name="m", template=ChatTemplate("{{ messages }}", origin="test"),
                  max_queue=4, on_load_error=lambda message: None, parallel=parallel, **kw)


def test_503_while_loading_then_ok():
    release, loaded = threading.Event(), threading.Event()

    def load():
        release.wait(30)
        loaded.set()
        return object()          # stands for the session: /health only asks whether there is one

    with TestClient(build_app(engine(load), model_meta={"n_ctx": 64})) as client:
        r = client.get("/health")
        assert r.status_code == 503 and r.json()["error"]["message"] == "loading model"
        for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                           ("/v1/completions", {"prompt": "hi"})):
            r = client.post(path, json=body)
            assert r.status_code == 503 and r.json()["error"]["code"] == "server_busy"
        assert client.get("/v1/models").json()["data"][0]["id"] == "m"
        release.set()
        assert loaded.wait(30)
        for _ in range(100):
            if client.get("/health").status_code == 200:
                break
            threading.Event().wait(0.05)
        assert client.get("/health").json() == {"status": "ok"}
        metrics = client.get("/metrics").text
        assert 'offload_requests_total{endpoint="/health",status="503"} 1' in metrics
        assert "offload_requests_rejected_total 0" in metrics     # loading is not a full queue


def test_failed_load_is_reported():
    errors = []

    def load():
        raise OffloadError("model file not found: x.gguf")

    with TestClient(build_app(engine(load, errors.append), model_meta={})) as client:
        for _ in range(100):
            if errors:
                break
            threading.Event().wait(0.05)
        assert errors == ["model file not found: x.gguf"]
        assert client.get("/health").status_code == 503


def test_import_offload_and_offload_plan_load_no_server_stack():
    model = SHIPPED
    code = ("import contextlib, io, sys, offload\n"
            "from offload.cli import main\n"
            f"with contextlib.redirect_stdout(io.StringIO()): assert main(['plan', {str(model)!r}, "
            "'--devices', 'CPU=16GiB']) == 0\n"
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'starlette', 'uvicorn', 'jinja2', 'torch'}))")
    out = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[2],
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_bad_serve_flags_are_one_line_and_status_2(tmp_path, capsys):
    """Everything wrong with the command line is found before the port is bound."""
    import socket

    from offload.cli import main
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in %}")
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    cases = [
        (["--max-queue", "0"], "--max-queue must be >= 1"),
        (["--port", "70000"], "--port must be in 0..65535"),
        (["--chat-template", str(tmp_path / "missing.jinja")], "cannot read --chat-template"),
        (["--chat-template", str(broken)], "broken.jinja) line 1"),
        (["--port", str(taken.getsockname()[1])], "cannot listen on 127.0.0.1"),
        (["--spec-n-max", "-1"], "--spec-n-max must be an integer >= 0"),
        ([str(tmp_path / "nope.gguf")], "model file not found"),
    ]
    try:
        for flags, message in cases:
            assert main(["serve", "--devices", "CPU=16GiB", *flags]) == 2, flags
            err = capsys.readouterr().err.strip().splitlines()
            assert err[-1].startswith("offload: error: ") and message in err[-1], (flags, err)
            assert "Traceback" not in "\n".join(err)
    finally:
        taken.close()


def test_an_ngram_drafting_server_drafts_and_reuses_the_prompt_cache():
    """A server started with ``--spec-type ngram`` drafts from the context on a request's
    n_max (greedy: the text is plain decoding's with exact verify), and the prompt cache
    works for it (no head cache to follow: the whole common prefix is reused)."""
    import offload.runtime as rt

    with rt.load(SHIPPED, devices="CPU=16GiB", quiet=True) as session:
        eng = slots_engine(session, 1, spec=SpecOptions(n_max=3, type="ngram", verify="exact"))
        prompt = '"""HTTP status codes.\n\n    200 OK\n    404 Not Found\n"""\n\nREASONS = {\n'
        body = {"prompt": prompt, "max_tokens": 32, "temperature": 0, "ignore_eos": True}
        with TestClient(build_app(eng, model_meta={"n_ctx": 512})) as client:
            wait_healthy(client)
            plain = client.post("/v1/completions", json=body | {"n_max": 0}).json()
            drafted = client.post("/v1/completions", json=body).json()
            again = client.post("/v1/completions", json=body).json()
        assert drafted["timings"]["n_max"] == 3 and drafted["timings"]["draft_n"] > 0
        assert drafted["choices"][0]["text"] == plain["choices"][0]["text"] == again["choices"][0]["text"]
        assert again["timings"]["cache_n"] == again["usage"]["prompt_tokens"] - 1


def test_slots_serve_requests_together_with_each_ones_text():
    """``-np 2`` (``Engine(parallel=2)``): four greedy completions sent at once are generated
    two at a time by continuous batching, each with the text it gets served alone; a free slot
    takes the next queued request, and both slots end idle."""
    import offload.runtime as rt

    prompts = ["import os\n", "def main(argv):\n    ", "class Config:\n    ", "Once upon a time"]
    with rt.load(SHIPPED, devices="CPU=16GiB", int8_prefill=False, quiet=True) as session:
        alone = [session.detokenize(session.generate(p, max_tokens=16, stop_at_eos=False)) for p in prompts]
        eng = slots_engine(session, 2, prompt_chunk=8)
        with TestClient(build_app(eng, model_meta={"n_ctx": 512})) as client:
            wait_healthy(client)
            got: list = [None] * len(prompts)

            def one(i):
                body = {"prompt": prompts[i], "max_tokens": 16, "temperature": 0, "ignore_eos": True}
                got[i] = client.post("/v1/completions", json=body).json()

            threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
            # the gauge drops when a slot's worker has handed its last response over, a moment
            # after the client has it (a scrape in between reads 1: seen once on a loaded box)
            deadline = time.monotonic() + 10
            while "offload_requests_processing 0" not in (metrics := client.get("/metrics").text) and \
                    time.monotonic() < deadline:
                time.sleep(0.01)
            body = {"prompt": prompts[0], "max_tokens": 16, "temperature": 0, "ignore_eos": True}
            auto = client.post("/v1/completions", json=body | {"n_max": "auto"}).json()
            bad = client.post("/v1/completions", json=body | {"n_max": "fast"})
        assert [g["choices"][0]["text"] for g in got] == alone
        assert auto["timings"]["n_max"] == "auto" and 0 <= auto["timings"]["n_max_chosen"] <= 6
        assert bad.status_code == 400 and "'n_max' must be an integer" in bad.json()["error"]["message"]
        assert session._batcher.stats.largest == 2 and session._batcher.active == 0
        assert "offload_requests_processing 0" in metrics


def test_slots_endpoint_shows_each_slot_and_erases_an_idle_ones_cache():
    """``GET /slots`` (llama-server's): with ``-np 2``, a request in flight shows on one slot
    as processing its task, with its prompt length, tokens decoded so far and sampling; the
    slot ends idle with the request's prompt and text in its prompt cache, which
    ``POST /slots/ID?action=erase`` empties (409 while the slot generates, 404 for no such
    slot, 400 for another action); ``--no-slots`` answers 501."""
    import offload.runtime as rt

    with rt.load(SHIPPED, devices="CPU=16GiB", ctx=4096, int8_prefill=False, quiet=True) as session:
        eng = slots_engine(session, 2)
        with TestClient(build_app(eng, model_meta={"n_ctx": 4096})) as client:
            wait_healthy(client)
            idle = client.get("/slots").json()
            body = {"prompt": "Once upon a time", "max_tokens": 3000, "temperature": 0, "ignore_eos": True,
                    "top_k": 7}
            done: list = []
            worker = threading.Thread(target=lambda: done.append(client.post("/v1/completions", json=body).json()))
            worker.start()
            seen = None
            while worker.is_alive() and seen is None:
                states = client.get("/slots").json()
                busy = [s for s in states if s["is_processing"] and s["n_decoded"] > 0]
                if busy:
                    seen = busy[0]
                    refused = client.post(f"/slots/{seen['id']}?action=erase")
            worker.join(300)
            after = client.get("/slots").json()
            used = next(s for s in after if s["n_cached"] > 0)
            erased = client.post(f"/slots/{used['id']}?action=erase")
            emptied = client.get("/slots").json()
            missing = client.post("/slots/2?action=erase")
            save = client.post("/slots/0?action=save")
        with TestClient(build_app(engine(lambda: session), model_meta={"n_ctx": 4096}, slots_endpoint=False)) as client:
            off = client.get("/slots")
    assert [s["id"] for s in idle] == [0, 1]
    assert all(not s["is_processing"] and s["n_cached"] == 0 and s["n_ctx"] == 4096 for s in idle)
    assert seen is not None, "the request was never seen in flight"
    assert seen["id_task"] == 0 and seen["n_prompt_tokens"] == done[0]["usage"]["prompt_tokens"]
    assert 0 < seen["n_decoded"] < 3000
    assert seen["params"]["n_predict"] == 3000 and seen["params"]["top_k"] == 7 and seen["params"]["temperature"] == 0
    assert refused.status_code == 409 and "is processing task 0" in refused.json()["error"]["message"]
    usage = done[0]["usage"]
    assert not any(s["is_processing"] for s in after)
    assert used["n_cached"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert erased.status_code == 200 and erased.json() == {"id_slot": used["id"], "n_erased": used["n_cached"]}
    assert all(s["n_cached"] == 0 for s in emptied)
    assert missing.status_code == 404 and "slot 2 does not exist" in missing.json()["error"]["message"]
    assert save.status_code == 400 and "action 'save'" in save.json()["error"]["message"]
    assert off.status_code == 501 and "--no-slots" in off.json()["error"]["message"]


def test_a_request_goes_to_the_slot_holding_its_prefix():
    """``-np 3``, requests one after another: a new prompt takes a slot nobody used (the one
    idle longest), so the other conversations' caches stay; a prompt that continues an
    earlier one goes to that one's slot and reuses its KV (``timings.cache_n``), whichever
    slot thread is free first."""
    import offload.runtime as rt

    with rt.load(SHIPPED, devices="CPU=16GiB", int8_prefill=False, quiet=True) as session:
        eng = slots_engine(session, 3)
        with TestClient(build_app(eng, model_meta={"n_ctx": 512})) as client:
            wait_healthy(client)

            def complete(prompt):
                body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
                r = client.post("/v1/completions", json=body).json()
                return r["choices"][0]["text"], r["timings"]["cache_n"], r["usage"]["prompt_tokens"]

            a_text, a_cached, _ = complete("def main(argv):\n    ")
            b_text, b_cached, _ = complete("Once upon a time")
            holding = [s["n_cached"] for s in client.get("/slots").json()]
            _, a2_cached, a2_prompt = complete("def main(argv):\n    " + a_text + "\n    return 0")
            _, b2_cached, _ = complete("Once upon a time" + b_text)
            slots = client.get("/slots").json()
    ids = session.tokenize
    assert a_cached == 0 and b_cached == 0
    assert sorted(n > 0 for n in holding) == [False, True, True]       # two slots, one conversation each
    # each continuation reuses its own conversation's prompt and text (all but the text's last token,
    # whose KV the previous request never computed)
    assert a2_cached >= len(ids("def main(argv):\n    ")) and a2_cached < a2_prompt
    assert b2_cached >= len(ids("Once upon a time"))
    assert sorted(s["n_cached"] > 0 for s in slots) == [False, True, True]


def test_the_servers_connections_have_nagle_off():
    """``offload serve``'s listening socket says TCP, so the event loop turns Nagle off on
    each connection it accepts (TCP_NODELAY): with it on, every request after the first on
    a kept-alive connection (the openai client keeps them) waited for the client's delayed
    ACK, ~40 ms, before its response's last bytes left."""
    import asyncio
    import socket

    from offload.commands.serve import listen_socket

    async def accepted_nodelay() -> int:
        sock = listen_socket("127.0.0.1", 0)
        seen = asyncio.get_running_loop().create_future()

        class Probe(asyncio.Protocol):
            def connection_made(self, transport):
                seen.set_result(transport.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP,
                                                                              socket.TCP_NODELAY))
                transport.close()

        server = await asyncio.get_running_loop().create_server(Probe, sock=sock)
        _, writer = await asyncio.open_connection(*sock.getsockname()[:2])
        try:
            return await asyncio.wait_for(seen, 10)
        finally:
            writer.close()
            server.close()

    assert asyncio.run(accepted_nodelay()) == 1
