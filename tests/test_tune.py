"""The processor map (a file as a backend, its cell, bad maps), profiler.apply on a real tiny-sd15 U-Net, and bad
input to attnprof tune and profiler.tune: each refused in one line before anything is timed. The tunes themselves:
tests/test_tune_e2e.py."""
import contextlib
import io
import json
from pathlib import Path

import pytest

from profiler.attention import backends
from profiler.cli import main
from profiler.spec import CellSpec, InputError

SIZE = "128x128"  # tiny-sd15 at 128x128: 32 calls, 8 distinct shapes (256, 64, 16 and 4 query tokens)


def _cli(argv: list[str], code: int = 0) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(argv) == code, (argv, out.getvalue())
    return out.getvalue()


def _map(tmp_path: Path, blocks: dict, default=None, name="m.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps({"blocks": blocks, **({"default": default} if default else {})}))
    return path


def test_a_map_file_is_a_backend_whose_cell_carries_what_runs(tmp_path):
    a = _map(tmp_path, {"down_blocks.0.attentions.0.transformer_blocks.0.attn1": {"backend": "naive"}},
             {"backend": "split", "options": {"budget_bytes": 4096}})
    name, options = backends.cell_backend(str(a), {})
    assert name == "tuned" and options["file"] == "m.json"
    assert backends.label(name, options) == "tuned (m.json)" == backends.label(str(a), {})
    assert backends.family(name) == "mixed"
    # per block: its entry, else the default (options checked and filled)
    row = {"block": "down_blocks.0.attentions.0.transformer_blocks.0.attn1"}
    assert backends.for_call(name, options, row) == ("naive", {})
    assert backends.for_call(name, options, {"block": "mid_block.attentions.0.transformer_blocks.0.attn1"}) == \
        ("split", {"budget_bytes": 4096})
    # the cell's id: the same map the same id wherever the file is; another map another id
    spec = lambda o: CellSpec("tiny-sd15", 64, 64, 1, "float32", name, "cpu", tuple(sorted(o.items())))  # noqa: E731
    moved = tmp_path / "elsewhere"
    moved.mkdir()
    (moved / "m.json").write_text(a.read_text())
    assert spec(backends.cell_backend(str(moved / "m.json"), {})[1]).cell_id == spec(options).cell_id
    b = _map(tmp_path, {"down_blocks.0.attentions.0.transformer_blocks.0.attn1": {"backend": "sdpa"}},
             {"backend": "split", "options": {"budget_bytes": 4096}}, "m2.json")
    assert spec(backends.cell_backend(str(b), {})[1]).cell_id != spec(options).cell_id
    # a processor made for a map is placed per block; called as one, it says how to place it
    with pytest.raises(InputError, match="profiler.apply"):
        backends.make_processor(name, **options)(None, None)


@pytest.mark.parametrize("doc, says", [
    ("not json", "not valid JSON"),
    ({"default": {"backend": "sdpa"}}, 'no "blocks" mapping'),
    ({"blocks": {"b": {"backend": "nope"}}}, "unknown backend 'nope'"),
    ({"blocks": {"b": {"backend": "split", "options": {"budget_bytes": 0}}}}, "use a whole number >= 1"),
    ({"blocks": {"b": {"backend": "other.json"}}}, "names another map"),
    ({"blocks": {"a": {"backend": "split"}, "b": {"backend": "split", "options": {"budget_bytes": 9}}}},
     "two sets of options"),
    ({"blocks": {}}, "names no block and no default"),
])
def test_a_bad_map_is_one_line_naming_the_file(tmp_path, doc, says):
    path = tmp_path / "bad.json"
    path.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert main(["run", "--model", "tiny-sd15", "--size", "64x64", "--backend", str(path), "--out",
                     str(tmp_path / "r")]) == 2
    line = err.getvalue().strip()
    assert "\n" not in line and "bad.json" in line and says in line, line
    assert not (tmp_path / "r").exists()  # nothing run or written


def test_a_missing_map_file_is_one_line(tmp_path):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert main(["run", "--model", "tiny-sd15", "--backend", str(tmp_path / "gone.json")]) == 2
    assert "gone.json: cannot be read" in err.getvalue() and err.getvalue().count("\n") == 1


@pytest.mark.parametrize("argv, says", [
    (["--size", "64x64", "--size", "128x128"], "tune takes one --size"),
    (["--backend", "nope"], "unknown backend 'nope'"),
    (["--backend", "tuned.json"], "tune times backends by name"),
    (["--rounds", "1"], "--rounds 1 is too small"),
    (["--budget", "24"], "has no unit"),
    (["--budget", "1MiB"], "whatever the backends"),  # the weights alone: found by the planner, nothing timed
    (["--budget", "14MiB", "--backend", "naive"], "no backend keeps the forward within the budget 14.0 MiB at"),
])
def test_bad_input_to_tune_is_one_line_and_stores_nothing(tmp_path, argv, says):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert main(["tune", "--model", "tiny-sd15", "--device", "cpu", "--out", str(tmp_path / "t"), "--quiet",
                     *(["--size", "128x128"] if "--size" not in argv else []), *argv]) == 2
    line = err.getvalue().strip()
    assert "\n" not in line and says in line, line
    assert not (tmp_path / "t").exists()


def test_a_bad_map_applied_changes_nothing_and_tune_asks_for_what_it_lacks(tmp_path, tiny_sd15):
    import profiler

    own = dict(tiny_sd15.attn_processors)
    block = "down_blocks.0.attentions.0.transformer_blocks.0.attn1"
    for path, says in ((_map(tmp_path, {block: {"backend": "nope"}}), "unknown backend 'nope'"),
                       (_map(tmp_path, {block: {"backend": "naive"}}, name="p.json"),
                        "not in it and it has no default"),
                       (tmp_path / "gone.json", "cannot be read")):
        with pytest.raises(InputError, match=says):
            profiler.apply(tiny_sd15, path)
        assert all(a is b for a, b in zip(tiny_sd15.attn_processors.values(), own.values()))
    assert list(profiler.processors(tmp_path / "p.json")) == [f"{block}.processor"]  # the map's blocks alone
    with pytest.raises(InputError, match="not a processor map"):
        profiler.apply(tiny_sd15, 42)
    with pytest.raises(InputError, match="give the module's forward inputs"):
        profiler.tune(tiny_sd15)
    with pytest.raises(InputError, match="attnprof tune --model NAME --size WxH --budget"):
        profiler.tune(tiny_sd15, budget="1GiB")
