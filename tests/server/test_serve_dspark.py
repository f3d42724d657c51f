"""``offload serve --spec-type dspark --draft FILE`` end to end on the tiny deepseek4 trunk + DSpark
pair: two real server processes (plain, and drafting with DSpark under exact verify) queried over
HTTP (httpx); greedy completions are the same text, the DSpark server drafted, and a second
request sharing the first one's prompt reuses its cache (the drafter's rings follow the trunk's)."""
from __future__ import annotations

import pytest

from tests.archs.test_dspark import TRUNK
from tests.tiny_models import write_tiny_dspark, write_tiny_model

httpx = pytest.importorskip("httpx")

PROMPTS = ("the cat sat on the mat and the dog", "the cat sat on the mat and the dog ran to the")


def _serve(tmp, model, flags):
    from tests.serve_process import ServeProcess
    with open(tmp / f"server-{len(flags)}.log", "w+") as log:
        try:
            return ServeProcess(model, ["--devices", "CPU=16GiB", "-c", "512", "--log-level", "warning", *flags],
                                log=log)
        except RuntimeError as exc:
            log.seek(0)
            pytest.fail(f"{exc}:\n{log.read()}")


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve-dspark")
    trunk = write_tiny_model(tmp / "trunk.gguf", TRUNK).path
    draft = write_tiny_dspark(tmp / "dspark.gguf", TRUNK).path
    plain = _serve(tmp, trunk, [])
    try:
        dspark = _serve(tmp, trunk, ["--draft", str(draft), "--spec-type", "dspark", "--spec-n-max", "3",
                                     "--spec-verify", "exact"])
    except BaseException:
        plain.close()
        raise
    yield plain.url, dspark.url
    assert dspark.close() in (0, 130) and plain.close() in (0, 130)


def _complete(url: str, prompt: str) -> dict:
    r = httpx.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 12, "temperature": 0},
                   timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_dspark_server_gives_the_plain_servers_greedy_text(servers):
    plain_url, dspark_url = servers
    for i, prompt in enumerate(PROMPTS):
        plain, drafted = _complete(plain_url, prompt), _complete(dspark_url, prompt)
        assert drafted["choices"][0]["text"] == plain["choices"][0]["text"], prompt
        t = drafted["timings"]
        assert t["n_max"] == 3 and t["draft_n"] > 0, t
        if i:                           # the second prompt extends the first: its prefix is reused
            assert t["cache_n"] > 0, t
