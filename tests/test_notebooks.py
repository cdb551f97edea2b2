"""The bug notebooks execute under papermill with small parameters (scripts/params/quick.yaml) and record verdicts."""
import json
import re

import pytest

from gradkit.notebooks import runall

pytestmark = pytest.mark.world
NOTEBOOKS = tuple(sorted(p.stem for p in runall.NOTEBOOKS.glob("*.ipynb")))  # every notebook the kit ships


@pytest.fixture(scope="module")
def quick_run(repo, tmp_path_factory):
    out = tmp_path_factory.mktemp("quick")
    code = runall.main([*(str(repo / "notebooks" / f"{nb}.ipynb") for nb in NOTEBOOKS), "--params",
                        str(repo / "scripts" / "params" / "quick.yaml"), "--out", str(out), "--timeout", "900", "--jobs", "2",
                        "--no-progress"])
    return code, out


def test_every_notebook_ran_and_is_summarised(quick_run):
    code, out = quick_run
    summary = json.loads((out / "summary.json").read_text())
    assert code == 0, [(e["notebook"], e.get("error")) for e in summary["notebooks"] if e["status"] != "ok"]
    # every stack the notebooks name was ready before they started (a fresh clone: installed and built here)
    assert summary["prefetch"]["status"] == "ok" and not summary["prefetch"]["problems"], summary["prefetch"]
    assert summary["prefetch"]["stacks"] >= 5  # B1's two, 0.18.2, 0.18.9 and the installed one for DeepSpeed and torch
    md = (out / "summary.md").read_text()
    for nb in NOTEBOOKS:
        assert f"{nb}.ipynb" in md
        executed = json.loads((out / f"{nb}.ipynb").read_text())
        assert any(c.get("outputs") for c in executed["cells"] if c["cell_type"] == "code")


def test_bf16_notebook_finds_the_bug(quick_run):
    findings = json.loads((quick_run[1] / "04_bf16_leak.findings.json").read_text())
    assert set(findings["0.18.9"]["leak"].values()) == {"affected"}
    assert set(findings["installed"]["leak"].values()) == {"not-affected"}


def test_zero_boundary_notebook_finds_the_reset(quick_run):
    findings = json.loads((quick_run[1] / "03_zero_boundary.findings.json").read_text())
    assert findings == {"installed ZeRO-0 fp32 W2": "not-affected", "installed ZeRO-2 fp32 W2": "affected",
                        "installed ZeRO-3 fp32 W2": "not-affected"}


def test_pipeline_notebook_finds_the_summing_release(quick_run):
    findings = json.loads((quick_run[1] / "02_pipeline_ga.findings.json").read_text())
    old, new = findings["0.18.2 W2 fp32 ZeRO-0"], findings["installed W2 fp32 ZeRO-0"]
    assert old["verdict"] == "affected" and old["affected_stages"] == [0, 1]
    assert set(old["matches"]["0"]) == {"sum (x GA)"}
    assert new["verdict"] == "not-affected" and new["affected_stages"] == []


def test_trainer_notebook_blames_the_right_path(quick_run):
    findings = json.loads((quick_run[1] / "01_trainer_loss_kwargs.findings.json").read_text())
    seed = "deepspeed=0.18.9 transformers=5.3.0"
    assert findings[f"{seed} | no_ds"]["gas_verdict"] == "affected"
    assert findings[f"{seed} | ds_zero0"]["gas_verdict"] == "not-affected"
    installed = [f for k, f in findings.items() if k.startswith("installed")]
    assert installed and all(f["verdict"] == "not-affected" for f in installed)


def test_overview_reads_the_run_and_draws_one_matrix(quick_run):
    out = quick_run[1]
    findings = json.loads((out / "00_overview.findings.json").read_text())
    assert findings["B4 0.18.9"] == "affected" and findings["B2 0.18.2"] == "affected"
    installed = [k for k in findings if k.startswith("B3 ") and k != "B3 0.18.9"]
    assert [findings[k] for k in installed] == ["affected"]  # ZeRO-2 manual loop, no release fixes it
    summary = json.loads((out / "summary.json").read_text())
    assert {(c["bug"], c["deepspeed"]): c["verdict"] for c in summary["matrix"]} == \
        {tuple(k.split(" ")): v for k, v in findings.items()}  # the overview and the run-all agree
    assert (out / "verdict_matrix.png").stat().st_size > 10_000
    md = (out / "summary.md").read_text()
    assert "![verdict matrix](verdict_matrix.png)" in md and "[00_overview.ipynb](00_overview.ipynb)" in md


def test_explorer_runs_headless_with_its_default_selection(quick_run):
    findings = json.loads((quick_run[1] / "05_explorer.findings.json").read_text())
    assert findings["manual (measured, GA 4)"] == "affected"
    assert findings["fix_boundary (fix, GA 4)"] == "not-affected"


def test_overview_runs_the_probes_itself_when_given_no_results(repo, tmp_path, capsys):
    """... and both bars move with the ranks: run-all's (cells, then the running world's cases, read from outside
    the kernel) and the overview's own (cases of each probe's world)."""
    params = tmp_path / "p.yaml"
    params.write_text('notebooks:\n  00_overview:\n    VERSIONS: ["installed"]\n    BUGS: ["B2", "B4"]\n')
    code = runall.main([str(repo / "notebooks" / "00_overview.ipynb"), "--params", str(params), "--out", str(tmp_path),
                        "--timeout", "600"])
    assert code == 0, (tmp_path / "summary.md").read_text()
    findings = json.loads((tmp_path / "00_overview.findings.json").read_text())
    assert set(findings.values()) == {"not-affected"} and sorted(k.split()[0] for k in findings) == ["B2", "B4"]
    shown = capsys.readouterr().err.replace("\r", "\n")
    assert re.search(r"00_overview cell \d+/\d+, B[24] on installed: \d/\d cases", shown), shown[-2000:]
    assert re.search(r"cells: 100%.*\| (\d+)/\1 ", shown), shown[-2000:]  # every cell counted, none twice
    executed = json.loads((tmp_path / "00_overview.ipynb").read_text())
    text = "".join(t for c in executed["cells"] for o in c.get("outputs", []) for t in o.get("text", ""))
    assert "2 probes: B4 on installed, 2 ranks: 100%" in text  # the notebook's own bar reached its cases' end


def test_the_new_bug_notebook_verifies_the_b10_fix_end_to_end_on_the_release_and_patched(quick_run):
    """Notebook 08's section 7 (``gradkit.commands.fix.verify``, ZeRO-2, no sweep): the kit's patch applied to the
    installed release in an overlay of its own; the reproduction exits 1 on the release and 0 patched, the regression
    test fails at every stage on the release and passes patched, the recipe is affected and named B10 on the release
    and not-affected patched; the report says so."""
    from gradkit.stacks import versions

    out = quick_run[1] / "08_fix_B10"
    doc = json.loads((out / "verification.json").read_text())
    plain = versions.installed_version("deepspeed")
    release, patched = f"{plain}+b9", f"{plain}+b9.b10"  # both sides carry B9's patch: B9 hides B10 at ZeRO-0
    assert doc["verified"] and (doc["deepspeed"], doc["release"], doc["patched"]) == (plain, release, patched), doc
    runs = doc["reproduction"]
    assert runs[f"{release} ZeRO-2"]["exit"] == 1 and "REPRODUCED: 2 of 6 steps off" in runs[f"{release} ZeRO-2"]["output"]
    assert "step 3: loss scale 256 -> 512, applied / gradient 0.50" in runs[f"{release} ZeRO-2"]["output"]
    assert runs[f"{patched} ZeRO-2"]["exit"] == 0 and f"(deepspeed {patched})" in runs[f"{patched} ZeRO-2"]["output"]
    assert doc["test"][release]["exit"] == 1 and doc["test"][release]["output"].count("FAILED b10_test.py") == 4
    assert doc["test"][patched]["exit"] == 0 and "4 passed" in doc["test"][patched]["output"]
    assert doc["recipe"][release]["verdict"] == "affected" and doc["recipe"][release]["explained_by"] == "B10"
    assert doc["recipe"][patched]["verdict"] == "not-affected"
    text = (out / "report.md").read_text()
    assert "the fix is **verified**" in text and "```diff" in text and (out / "fix.diff").exists()
    assert (out / "test_b10.py").exists() and "| `test_b10.py` (pytest, 2 ranks): exit status | 1 | 0 |" in text
    assert "Both sides carry the kit's `b9` patch" in text and f"--known B10 --deepspeed {plain}" in text
    findings = json.loads((quick_run[1] / "08_new_bug.findings.json").read_text())
    assert findings["fix"] == {"bug": "B10", "verified": True, release: "affected", patched: "not-affected"}


def test_the_run_renders_a_site_to_read_without_running(quick_run):
    """OUT/site: an index with the verdict matrix embedded and a link to a page per notebook; every page has its
    figures embedded and a table of contents whose every link lands on a heading of that page."""
    from html.parser import HTMLParser
    from urllib.parse import unquote

    class Page(HTMLParser):
        def __init__(self, text):
            super().__init__()
            self.ids, self.hrefs, self.images = set(), [], []
            self.feed(text)

        def handle_starttag(self, tag, attrs):
            a = dict(attrs)
            self.ids.add(a.get("id"))
            if tag == "a" and a.get("href"):
                self.hrefs.append(a["href"])
            if tag == "img":
                self.images.append(a.get("src", ""))

    site = quick_run[1] / "site"
    index = Page((site / "index.html").read_text())
    assert any(src.startswith("data:image/png;base64,") for src in index.images), "the verdict matrix is not embedded"
    assert {f"{nb}.html" for nb in NOTEBOOKS} <= set(index.hrefs)
    assert not [h for h in index.hrefs if h.endswith(".ipynb")], "a link to a notebook file instead of its page"
    for nb in NOTEBOOKS:
        page = Page((site / f"{nb}.html").read_text())
        toc = [h[1:] for h in page.hrefs if h.startswith("#") and len(h) > 1]
        lost = [t for t in toc if t not in page.ids and unquote(t) not in page.ids]  # as a browser looks a fragment up
        assert "1-%C2%B7-The-report's-symptom:-the-gradient-with-DeepSpeed-over-the-one-without" in toc \
            or nb != "01_trainer_loss_kwargs"  # an apostrophe in a heading (once lost to percent-encoding)
        assert len(toc) >= 3 and not lost, (nb, lost)
        assert "index.html" in page.hrefs
        stored = json.loads((repo_path_of(nb)).read_text())
        draws = any("plots." in "".join(c["source"]) for c in stored["cells"] if c["cell_type"] == "code")
        embedded = [s for s in page.images if s.startswith("data:image/png;base64,")]
        assert not draws or embedded, f"{nb} draws figures, but its page embeds none"


def repo_path_of(nb):
    return runall.NOTEBOOKS / f"{nb}.ipynb"
