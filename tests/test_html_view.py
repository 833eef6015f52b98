"""The HTML view of a sharded program (``ssmshard inspect MODEL --tp N --html PATH``).

The page is checked in a real headless Chromium (Debian's ``chromium`` package; `.ci/run`
installs it): it loads with no console error and no network request, shows one block per row
of each rank's ``program.summary()`` and one mark per collective the ``collectives`` pass
accounted for, shows a weight's placement and local shape on hover, and switches ranks. A
screenshot is written to ``$SSMSHARD_TEST_ARTIFACTS`` (default ``test-artifacts/``).
"""

from __future__ import annotations

import json
import os
import pathlib
import re

import pytest

import ssmshard
from ssmshard.cli import main
from ssmshard.families import BY_NAME, build_meta_model
from ssmshard.placement import Shard, local_shape
from ssmshard.views import render_html, sharded_programs

from headless_browser import Browser, find_chromium

ROOT = pathlib.Path(__file__).resolve().parent.parent
ARTIFACTS = pathlib.Path(os.environ.get("SSMSHARD_TEST_ARTIFACTS", ROOT / "test-artifacts"))


def _meta_model(family):
    """The family's small model on the meta device: shapes only, as ``ssmshard inspect`` builds it."""
    return build_meta_model(BY_NAME[family].make_config()).eval()


_PROGRAMS = {}


def _rank_programs(family, tp):
    if (family, tp) not in _PROGRAMS:
        model = _meta_model(family)
        program = ssmshard.capture(model, mode="forward")
        _PROGRAMS[family, tp] = (model, program, sharded_programs(program, model, ssmshard.Plan(tp=tp)))
    return _PROGRAMS[family, tp]


def _summary_rows(program) -> int:
    return len(program.summary().splitlines()) - 2  # a title line and a header line


def _page_data(page: str) -> dict:
    match = re.search(r'<script id="ssmshard-data" type="application/json">(.*?)</script>', page, re.S)
    return json.loads(match.group(1))


def test_each_rank_program_equals_a_fresh_capture_sharded_for_that_rank():
    """Copying one capture per rank gives what sharding a fresh capture gives (shared block included)."""
    from ssmshard.runtime.pipeline import shard_program

    model, _, programs = _rank_programs("zamba2", 2)
    plan = ssmshard.Plan(tp=2)
    for rank, copied in enumerate(programs):
        fresh = shard_program(ssmshard.capture(model, mode="forward"), model, plan, rank=rank, group="inspect")
        assert copied.report() == fresh.report()
        assert copied.graph_module.code == fresh.graph_module.code


def test_page_is_one_self_contained_file_with_every_rank():
    _, _, programs = _rank_programs("mamba", 2)
    page = render_html(programs)
    assert not re.search(r"""(src|href)\s*=|https?://|@import|url\(""", page), "the page must load nothing"
    data = _page_data(page)
    assert [r["rank"] for r in data["ranks"]] == [0, 1]
    for program, rank in zip(programs, data["ranks"]):
        assert sum(len(row["blocks"]) for row in rank["rows"]) == _summary_rows(program)
        assert rank["collectives"] == len(program.collectives) == 6  # x_proj and out_proj x 2 layers, the head
        assert rank["bytes_per_token"] == sum(c["bytes_per_token"] for c in program.collectives)


@pytest.mark.parametrize("tp", [1, 2])
def test_cli_writes_the_page(tp, tmp_path, capsys):
    path = tmp_path / "mamba2.html"
    assert main(["inspect", "mamba2", "--tp", str(tp), "--html", str(path)]) == 0
    assert f"wrote {path}" in capsys.readouterr().out
    ranks = _page_data(path.read_text())["ranks"]
    assert len(ranks) == tp
    weights = [w for row in ranks[0]["rows"] for b in row["blocks"] for w in b["weights"]]
    in_proj = next(w for w in weights if w["fqn"] == "backbone.layers.0.mixer.in_proj.weight")
    # unsharded: no placement and the global shape; tp=2: z, x, B, C, dt each halved (2 groups)
    assert (in_proj["placement"], in_proj["local_shape"]) == (("-", [328, 64]) if tp == 1 else
                                                              ("S(0:128/2,128/2,32/2,32/2,8/2)", [164, 64]))


def test_inspect_help_explains_the_placement_notation(capsys):
    with pytest.raises(SystemExit):
        main(["inspect", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "S(d:n/k,...)" in out and "@s" in out and "R~" in out


@pytest.fixture(scope="module")
def browser():
    executable = find_chromium()
    if executable is None:
        pytest.skip("no chromium on PATH: the HTML view's browser test needs Debian's `chromium` package "
                    "(apt-get install -y chromium; .ci/run installs it)")
    with Browser(executable) as b:
        yield b


def test_page_in_a_headless_browser(browser, tmp_path):
    _, _, programs = _rank_programs("zamba2", 2)
    path = tmp_path / "zamba2_tp2.html"
    path.write_text(render_html(programs))
    browser.load(path.as_uri())
    assert browser.errors() == []
    assert set(browser.requested_urls()) <= {path.as_uri()}, "the page requested something besides itself"

    for rank, program in enumerate(programs):
        browser.evaluate(f"(s => {{ s.value = '{rank}'; s.dispatchEvent(new Event('change')); }})"
                         "(document.getElementById('rank'))")
        assert browser.evaluate("document.body.dataset.rank") == str(rank)
        assert browser.evaluate("document.querySelectorAll('.block').length") == _summary_rows(program)
        marks = browser.evaluate("[...document.querySelectorAll('.collective')].map(e => e.dataset.sync)")
        assert sorted(marks) == sorted(c["op"] for c in program.collectives)
        assert "all_gather" in marks and marks.count("all_reduce") == len(marks) - 1

        # Hover the first layer's in_proj: its placement, local shape and this rank's rows.
        fqn = "model.layers.0.mamba.in_proj.weight"
        spec = program.param_specs[fqn]
        assert isinstance(spec.placement, Shard)
        box = browser.evaluate(
            "(() => { const w = [...document.querySelectorAll('.weight')].find(e => e.dataset.tip.startsWith("
            f"'{fqn}\\n')); w.scrollIntoView({{block: 'center'}}); const r = w.getBoundingClientRect(); "
            "return [r.x + r.width / 2, r.y + r.height / 2]; })()")
        browser.hover(*box)
        tip = browser.evaluate("(t => t.hidden ? '' : t.textContent)(document.getElementById('tip'))")
        assert str(spec.placement) in tip
        assert "(" + ", ".join(map(str, local_shape(spec.shape, spec.placement))) + ")" in tip
        first_start = spec.placement.segments[0].offset(rank)
        assert f"dim 0: {first_start}:{first_start + spec.placement.segments[0].local}," in tip

    browser.evaluate("window.scrollTo(0, 0)")
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    shot = ARTIFACTS / "html_view_zamba2_tp2.png"
    browser.screenshot(str(shot))
    assert shot.stat().st_size > 10_000
    assert browser.errors() == []
