"""The stored notebooks, as files: no outputs, one parameters cell, code that parses, short cells."""
import ast

import nbformat
import pytest

from gradkit.notebooks import runall_notebook, runall_params

NOTEBOOKS = sorted(runall_params.NOTEBOOKS.glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_is_stored_clean_and_parses(path):
    nb = nbformat.read(path, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(not c.get("outputs") and c.get("execution_count") is None for c in code), "stored with outputs"
    tagged = [c for c in code if "parameters" in c.metadata.get("tags", [])]
    assert len(tagged) == 1, "exactly one cell tagged 'parameters'"
    for c in code:
        ast.parse(c.source)  # a SyntaxError names the cell's line
        assert len(c.source.splitlines()) <= 40, f"a {len(c.source.splitlines())}-line cell: move logic into kit/"
    assert nb.cells[0].cell_type == "markdown" and nb.cells[0].source.startswith("# ")
    assert nb.metadata["kernelspec"]["name"] == runall_notebook.KERNEL


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_papermill_sees_every_parameter(path):
    import re

    nb = nbformat.read(path, as_version=4)
    cell = next(c for c in nb.cells if "parameters" in c.metadata.get("tags", []))
    assigned = {m.group(1) for m in re.finditer(r"^([A-Z_][A-Z0-9_]*)\s*=", cell.source, re.M)}
    assert assigned == set(runall_params.notebook_parameters(path)), "papermill cannot parse a line (an '=' in a comment?)"


@pytest.mark.parametrize("params", sorted((runall_params.REPO / "scripts" / "params").glob("*.yaml")), ids=lambda p: p.name)
def test_every_params_file_fits_every_notebook(params, tmp_path):
    spec = runall_params.load_params(params)
    assert len(NOTEBOOKS) >= 9 and set(spec["notebooks"]) | set(spec["timeouts"]) <= {p.stem for p in NOTEBOOKS}
    fitted = [runall_params.params_for(path, spec, tmp_path) for path in NOTEBOOKS]  # raises on a parameter it lacks
    assert len(fitted) == len(NOTEBOOKS)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_every_figure_has_a_caption_that_says_what_to_look_at(path):
    nb = nbformat.read(str(path), as_version=4)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code" and ("plots." in cell.source or "plt.show" in cell.source):
            before = nb.cells[i - 1]
            assert before.cell_type == "markdown" and "**Look at**" in before.source, \
                f"{path.name} cell {i} draws a figure without a '**Look at**' caption above it"


MEASURED = __import__("re").compile(r"(?<![\w.])\d+\.\d{3,}(?![\d.])|\d\s?%")  # 0.889, 1.092, 0.4 %: a run's numbers


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_no_markdown_cell_states_a_measured_number_as_fixed_text(path):
    """Numbers a run measures come from that run, printed in a sentence; 1.000 (what correct means) and release
    numbers (0.18.9) are not measurements."""
    nb = nbformat.read(path, as_version=4)
    for i, c in enumerate(nb.cells):
        if c.cell_type == "markdown":
            found = [m.group(0) for m in MEASURED.finditer(c.source) if m.group(0) != "1.000"]
            assert not found, f"markdown cell {i} states {found} as fixed text: print it from the run instead"


def test_every_notebook_is_stored_as_the_git_filter_would_store_it():
    """nbstripout (the clean filter scripts/setup.sh installs) leaves every stored notebook byte for byte as it is:
    a commit through the filter changes nothing but what a session added. One nbstripout for all of them
    (``--textconv``: each cleaned notebook to stdout, written as the filter writes it); a difference names the file."""
    import subprocess
    import sys

    def cleaned(*paths):
        return subprocess.run([sys.executable, "-m", "nbstripout", "--keep-id", "--textconv", *map(str, paths)],
                              capture_output=True, check=True).stdout

    if cleaned(*NOTEBOOKS) != b"".join(p.read_bytes() for p in NOTEBOOKS):
        rewritten = [p.name for p in NOTEBOOKS if cleaned(p) != p.read_bytes()]
        pytest.fail(f"nbstripout --keep-id would rewrite {rewritten}: run it on the file(s)")


def test_outputs_jupyterlab_autosaves_never_reach_a_commit(tmp_path):
    """scripts/nbstripout_filter.sh in a clone: a notebook autosaved with outputs, execution counts and widget
    state stages nothing; an edit of its code is staged without the outputs around it."""
    import shutil
    import subprocess
    import sys

    git = lambda *a: subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *a], cwd=tmp_path,  # noqa: E731
                                    capture_output=True, text=True, check=True).stdout
    git("init", "-q")
    subprocess.run(["bash", str(runall_params.REPO / "scripts" / "nbstripout_filter.sh"), sys.executable], cwd=tmp_path,
                   check=True, capture_output=True)
    nb_path = tmp_path / "n.ipynb"
    shutil.copy(NOTEBOOKS[0], nb_path)
    git("add", "n.ipynb")
    git("commit", "-qm", "clean")
    nb = nbformat.read(nb_path, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    for i, c in enumerate(code):
        c.execution_count = i + 1
        c.outputs = [nbformat.v4.new_output("stream", name="stdout", text=f"ran {i}\n")]
    nb.metadata["widgets"] = {"application/vnd.jupyter.widget-state+json": {"state": {}}}
    nbformat.write(nb, str(nb_path))
    assert git("diff") == ""
    git("add", "-A")  # (git status may list the file until then: its size changed, its cleaned content did not)
    assert git("diff", "--cached") == "" and git("status", "--porcelain") == ""  # nothing to commit
    code[-1].source += "\nprint('edited')"
    nbformat.write(nb, str(nb_path))
    git("add", "-A")
    staged = git("diff", "--cached")
    assert "print('edited')" in staged and "ran 0" not in staged and "execution_count\": 1" not in staged
