"""The batch runner: parallel papermill processes, per-notebook limits, failures reported and survived."""
import json

import nbformat
import pytest

from gradkit import config
from gradkit.notebooks import runall, runall_notebook, site

pytestmark = pytest.mark.world


def _notebook(path, *cells):
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": runall_notebook.KERNEL, "display_name": "Python (gradkit)", "language": "python"}
    params = nbformat.v4.new_code_cell("X = 1")
    params.metadata["tags"] = ["parameters"]
    nb.cells = [params] + [nbformat.v4.new_code_cell(c) for c in cells]
    nbformat.write(nb, str(path))
    return path


@pytest.fixture(scope="module")
def mixed_run(tmp_path_factory):
    src, out = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("out")
    fails = _notebook(src / "a_fails.ipynb", "y = X + 1", "assert y == 3, f'deliberate failure: y is {y}'",
                      "print('never reached')")
    hangs = _notebook(src / "b_hangs.ipynb", "import time\ntime.sleep(600)")
    works = _notebook(src / "c_works.ipynb", "print('ran with X =', X)")
    params = src / "p.yaml"
    params.write_text("notebooks:\n  c_works:\n    X: 7\ntimeouts:\n  b_hangs: 15\n")
    code = runall.main([str(fails), str(hangs), str(works), "--params", str(params), "--out", str(out),
                        "--jobs", "2", "--timeout", "120", "--no-progress"])
    return code, out


def test_runner_keeps_going_past_a_failing_notebook(mixed_run):
    code, out = mixed_run
    assert code == 1
    entries = {e["notebook"]: e for e in json.loads((out / "summary.json").read_text())["notebooks"]}
    assert entries["c_works.ipynb"]["status"] == "ok"
    assert entries["c_works.ipynb"]["parameters"] == {"X": 7}
    executed = nbformat.read(str(out / "c_works.ipynb"), as_version=4)
    assert "ran with X = 7" in "".join(o.get("text", "") for c in executed.cells for o in c.get("outputs", []))
    failed = entries["a_fails.ipynb"]
    assert failed["status"] == "failed"
    assert failed["failing_cell"]["index"] == 2 and failed["failing_cell"]["ename"] == "AssertionError"
    assert "deliberate failure: y is 2" in failed["error"]
    md = (out / "summary.md").read_text()
    assert "1 of 3 notebooks ran to the end" in md
    assert "assert y == 3" in md and "[a_fails.ipynb](a_fails.ipynb)" in md
    page = (out / "site" / "a_fails.html").read_text()  # the site shows a failed notebook, saying so first
    assert "This notebook did not finish (failed)" in page and "deliberate failure: y is 2" in page
    index = (out / "site" / "index.html").read_text()
    assert 'href="a_fails.html"' in index
    for doc in site.doc_pages():  # the docs pages beside the notebooks, each a page of the same site
        assert f'href="{doc.stem}.html"' in index and (out / "site" / f"{doc.stem}.html").is_file(), doc.name


def test_runner_stops_a_notebook_at_its_own_limit(mixed_run):
    code, out = mixed_run
    e = {e["notebook"]: e for e in json.loads((out / "summary.json").read_text())["notebooks"]}["b_hangs.ipynb"]
    assert e["status"] == "timeout" and e["timeout_s"] == 15
    assert e["wall_s"] < 150, "the hung notebook was not stopped at its limit"  # a hang guard: 10x the limit
    assert e["failing_cell"]["index"] == 1


def test_runner_refuses_timeouts_for_notebooks_not_run(tmp_path):
    nb = _notebook(tmp_path / "n.ipynb", "pass")
    bad = tmp_path / "p.yaml"
    bad.write_text("timeouts:\n  other: 10\n")
    with pytest.raises(config.ConfigError, match="other"):
        runall.main([str(nb), "--params", str(bad), "--out", str(tmp_path / "o")])
    bad.write_text("timeouts:\n  n: -1\n")
    with pytest.raises(config.ConfigError, match="timeout"):
        runall.main([str(nb), "--params", str(bad), "--out", str(tmp_path / "o")])


def test_summary_survives_an_older_summary_in_the_folder(tmp_path):
    (tmp_path / "summary.json").write_text('[{"notebook": "04_bf16_leak.ipynb", "status": "ok"}]')  # an older kit's
    entry = {"notebook": "x.ipynb", "executed": str(tmp_path / "x.ipynb"), "status": "ok", "wall_s": 1.0}
    runall.summarise([entry], tmp_path, "r1")
    first = json.loads((tmp_path / "summary.json").read_text())
    assert first["changed_since_previous"] is None and first["notebooks"][0]["notebook"] == "x.ipynb"
    runall.summarise([entry], tmp_path, "r1")  # now there is a matrix (empty) to compare with
    assert json.loads((tmp_path / "summary.json").read_text())["changed_since_previous"] == []
    (tmp_path / "summary.json").write_text("{not json")  # a damaged summary: replaced, not read
    runall.summarise([entry], tmp_path, "r1")
    last = json.loads((tmp_path / "summary.json").read_text())
    assert last["notebooks"][0]["notebook"] == "x.ipynb" and last["changed_since_previous"] is None


def test_the_readmes_command_forms_work_as_written(tmp_path, monkeypatch):
    """`python -m gradkit.notebooks.runall 05_explorer.ipynb --params scripts/params/quick.yaml` from anywhere: a bare name is
    found in notebooks/, and quick.yaml serves a subset of the notebooks."""
    monkeypatch.chdir(tmp_path)
    code = runall.main(["05_explorer.ipynb", "--params", str(runall.REPO / "scripts/params/quick.yaml"),
                        "--out", str(tmp_path / "o"), "--no-progress"])
    assert code == 0
    entry, = json.loads((tmp_path / "o" / "summary.json").read_text())["notebooks"]
    assert entry["notebook"] == "05_explorer.ipynb" and entry["parameters"]["BUG"] == "B3"
    with pytest.raises(config.ConfigError, match="no such notebook: 09_nothing"):
        runall.main(["09_nothing", "--out", str(tmp_path / "o")])


def test_a_folder_in_use_by_another_run_all_is_refused(tmp_path):
    nb = _notebook(tmp_path / "n.ipynb", "pass")
    (tmp_path / "o").mkdir()
    held = runall.lock_folder(tmp_path / "o")
    try:
        with pytest.raises(config.ConfigError, match=r"in use by another run-all \(pid \d+"):
            runall.main([str(nb), "--out", str(tmp_path / "o"), "--no-progress"])
    finally:
        held.close()
    assert runall.main([str(nb), "--out", str(tmp_path / "o"), "--no-progress"]) == 0  # free again


def _b4_notebook(path, verdict_of_x):
    """A stand-in for 04_bf16_leak that writes one B4 record of this run: verdict from its parameter X."""
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": runall_notebook.KERNEL, "display_name": "Python (gradkit)", "language": "python"}
    params = nbformat.v4.new_code_cell('X = 1\nRESULTS_DIR = "."')
    params.metadata["tags"] = ["parameters"]
    nb.cells = [params, nbformat.v4.new_code_cell(
        "import json, os\n"
        f"verdict = {verdict_of_x!r}[X]\n"
        f"rec = {{'bug': '{path.stem[:2] == '04' and 'B4' or 'B3'}', 'case': '{path.stem[:2] == '04' and 'leak' or 'manual'}',"
        " 'role': 'measured', 'verdict': verdict, 'config_verdict': verdict, 'reason': verdict, 'ga': 4, 'dtype': 'bf16',"
        " 'world_size': 2, 'zero_stage': 1, 'version': 'installed', 'versions': {'deepspeed': '0.19.8'},"
        " 'metrics': {'norm_ratio': 1.0 if verdict == 'not-affected' else 1.09, 'cosine': 1.0},"
        " 'run_id': os.environ['GRADKIT_RUN_ID']}\n"
        f"open(os.path.join(RESULTS_DIR, '{path.stem}.jsonl'), 'w').write(json.dumps(rec) + '\\n')")]
    nbformat.write(nb, str(path))
    return path


def test_one_folder_one_truth(tmp_path):
    """Every notebook present in the folder stays in the summary with the run that produced it; verdicts are
    compared only between runs of the same parameters (a change of parameters is not a verdict change)."""
    b4 = _b4_notebook(tmp_path / "04_bf16_leak.ipynb", {1: "affected", 2: "not-affected"})
    b3 = _b4_notebook(tmp_path / "03_zero_boundary.ipynb", {1: "affected", 2: "affected"})
    out = tmp_path / "o"
    run = lambda *nbs, x=1: runall.main([*map(str, nbs), "--out", str(out), "--no-progress"]  # noqa: E731
                                        + (["--params", str(_params(tmp_path, x))] if x != 1 else []))
    assert run(b4, b3) == 0
    first = json.loads((out / "summary.json").read_text())
    assert {(c["bug"], c["verdict"]) for c in first["matrix"]} == {("B3", "affected"), ("B4", "affected")}
    assert run(b4, x=2) == 0  # only B4 again, other parameters
    second = json.loads((out / "summary.json").read_text())
    assert {e["notebook"] for e in second["notebooks"]} == {"04_bf16_leak.ipynb", "03_zero_boundary.ipynb"}
    kept = next(e for e in second["notebooks"] if e["notebook"] == "03_zero_boundary.ipynb")
    assert kept["from_run"] == first["run_id"]
    assert {(c["bug"], c["verdict"]) for c in second["matrix"]} == {("B3", "affected"), ("B4", "not-affected")}
    assert second["changed_since_previous"] == []  # B3 was not re-run; B4 ran with other parameters
    assert run(b4, x=2) == 0
    assert json.loads((out / "summary.json").read_text())["changed_since_previous"] == []


def _params(folder, x):
    p = folder / f"x{x}.yaml"
    p.write_text(f"notebooks:\n  04_bf16_leak:\n    X: {x}\n")
    return p


def test_a_run_all_gives_the_signal_handlers_back(tmp_path):
    """run-all takes SIGINT/SIGTERM for its run only: a kernel or test calling it keeps its own Ctrl-C."""
    import signal

    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    nb = _notebook(tmp_path / "n.ipynb", "pass")
    assert runall.main([str(nb), "--out", str(tmp_path / "o"), "--no-progress"]) == 0
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before
    assert runall.STOP.signal is None


def test_a_run_all_started_from_a_jupyterlab_kernel_runs_its_notebooks_headless(tmp_path, monkeypatch):
    """INTERACTIVE = "auto" means widgets in a JupyterLab session (JPY_SESSION_NAME): the kernels run-all starts
    must not inherit that, or a run-all started from a notebook would draw inert widgets instead of figures."""
    monkeypatch.setenv(config.FRONTEND_ENV, "notebooks/00_overview.ipynb")
    assert config.interactive("auto") is True
    nb = _notebook(tmp_path / "n.ipynb", "from gradkit.config import interactive\nassert interactive('auto') is False")
    assert runall.main([str(nb), "--out", str(tmp_path / "o"), "--no-progress"]) == 0


def test_a_kernel_that_dies_before_its_first_reply_is_started_once_more(tmp_path, monkeypatch):
    """Two kernels starting at once on two cores have lost one ("Kernel died before replying to kernel_info"): no
    cell ran, so the notebook is started again and the summary says so; a kernel that dies every time still fails."""
    import sys

    marker = tmp_path / "died-once"
    starter = (f"import pathlib, sys; m = pathlib.Path({str(marker)!r})\n"
               "if not m.exists():\n    m.touch(); sys.exit(1)\n"
               "from ipykernel import kernelapp; kernelapp.launch_new_instance()")
    spec = tmp_path / "jupyter" / "kernels" / "gradkit-dies-once"
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({"argv": [sys.executable, "-c", starter, "-f", "{connection_file}"],
                                                  "display_name": "dies once", "language": "python"}))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    monkeypatch.setattr(runall_notebook, "KERNEL", "gradkit-dies-once")
    nb = _notebook(tmp_path / "n.ipynb", "print('ran')")
    assert runall.main([str(nb), "--out", str(tmp_path / "o"), "--no-progress"]) == 0
    entry = json.loads((tmp_path / "o" / "summary.json").read_text())["notebooks"][0]
    assert entry["status"] == "ok" and "died before replying" in entry["retried"]
    assert "Started twice: its first kernel died before replying" in (tmp_path / "o" / "summary.md").read_text()

    (spec / "kernel.json").write_text(json.dumps({"argv": [sys.executable, "-c", "raise SystemExit(1)", "-f",
                                                           "{connection_file}"], "display_name": "dies", "language": "python"}))
    assert runall.main([str(nb), "--out", str(tmp_path / "o2"), "--no-progress"]) == 1
    entry = json.loads((tmp_path / "o2" / "summary.json").read_text())["notebooks"][0]
    assert entry["status"] == "failed" and runall_notebook.KERNEL_DIED_AT_START in entry["error"]
