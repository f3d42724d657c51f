"""`offload profile`: routing counts per layer and expert over a prompt set (the NextN block's
too), on the shipped model."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from offload.cli import main
from placement.errors import PlacementError
from placement.routing import RoutingCounts
from tests.runtime.test_runtime_shipped import SHIPPED

pytestmark = pytest.mark.skipif(not SHIPPED.is_file(), reason=f"{SHIPPED.name} not present yet")

PROMPTS = "def add(a, b):\n    return a + b\n\n\nclass Stack:\n    def push(self, item):\n        self.items.append(item)\n"


def profile(tmp_path: Path, *extra: str) -> RoutingCounts:
    src = tmp_path / "prompts.txt"
    src.write_text(PROMPTS)
    out = tmp_path / f"routing{len(list(tmp_path.iterdir()))}.yaml"
    assert main(["profile", str(SHIPPED), "--devices", "CPU=8GiB", "-f", str(src), "-o", str(out), *extra]) == 0
    return RoutingCounts.from_file(str(out))


def test_counts_cover_every_token_once_per_layer(tmp_path, capsys):
    from offload.gguf_model import open_model
    from offload.tokenizer import Tokenizer

    r = profile(tmp_path, "-n", "3")
    tok = Tokenizer.from_gguf(open_model(str(SHIPPED)).metadata)
    lengths = [len(tok.encode(p.strip("\n"))) + 3 for p in PROMPTS.split("\n\n\n")]   # two paragraphs
    assert [p.tokens for p in r.prompts] == lengths and r.tokens == sum(lengths)
    assert r.source.startswith("prompt files: ") and (r.n_expert, r.n_expert_used) == (32, 4)
    assert sorted(r.layers) == [1, 2, 3, 4]          # block 0 is dense; 4 is the NextN block (drafting runs it)
    for layer, counts in r.layers.items():
        assert sum(counts) == 4 * r.tokens
        assert np.allclose(np.sum([p.layers[layer] for p in r.prompts], axis=0), counts)
    assert len(r.distinct) == min(8, min(lengths)) and r.distinct[0] == 4.0
    assert "distinct experts per layer" in capsys.readouterr().out


def test_ubatch_does_not_change_the_counts(tmp_path):
    """Prompt processing in chunks of 5 routes the same tokens as one chunk: counts agree up to
    the rare near-tied router score that batch-shape rounding flips (at most 1 % of assignments)."""
    a, b = profile(tmp_path, "-n", "0"), profile(tmp_path, "-n", "0", "-ub", "5")
    assert a.tokens == b.tokens
    diff = sum(np.abs(np.subtract(a.layers[i], b.layers[i])).sum() for i in a.layers)
    assert diff <= 0.01 * 4 * a.tokens * len(a.layers)


def test_bad_input_is_one_line(tmp_path, capsys):
    assert main(["profile", str(SHIPPED), "-n", "-1", "-o", str(tmp_path / "r.yaml")]) == 2
    assert main(["profile", str(SHIPPED), "-f", str(tmp_path / "missing.txt"), "-o", str(tmp_path / "r.yaml")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(line.startswith("offload: error: ") for line in err)
    assert not (tmp_path / "r.yaml").exists()


def test_routing_file_errors_name_the_problem(tmp_path):
    good = RoutingCounts(4, 2, 3, {1: (3.0, 1.0, 2.0, 0.0)}, source="t")
    assert RoutingCounts.from_yaml(good.to_yaml(), "r.yaml") == good
    with pytest.raises(PlacementError, match="sum to 5, expected n_expert_used × tokens = 6"):
        RoutingCounts.from_yaml(good.to_yaml().replace("[3, 1, 2, 0]", "[3, 1, 1, 0]"), "r.yaml")
    with pytest.raises(PlacementError, match="not a routing profile"):
        RoutingCounts.from_yaml("version: 1\n", "r.yaml")
