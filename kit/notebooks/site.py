"""The executed notebooks of a run-all folder as a static site, read without running anything.

    python -m kit.notebooks.site runs/latest          # -> runs/latest/site/index.html (kit.notebooks.runall builds it after each run)

nbconvert's HTML exporter (the ``lab`` template) renders every page, and every page is one self-contained
file (figures embedded), so the folder can be zipped, mailed or served as it is:

- ``index.html``: the run's summary (``summary.md``: the verdict matrix figure and table, each notebook's
  status and verdicts) with a contents list of the pages; it is a notebook of markdown cells, rendered the
  same way as the others.
- ``NAME.html`` per executed notebook: a contents list of its headings at the top (anchors nbconvert itself
  makes), a link back to the index, and the notebook as it ran; a notebook that failed says where, first.
  Streams are coalesced (nbconvert's ``CoalesceStreamsPreprocessor``): a text progress bar shows its last state.
"""
from __future__ import annotations

import argparse
import base64
import copy
import html
import json
import re
import shutil
from pathlib import Path

import nbformat

from kit import config as kconfig

SITE = "site"
CONTENTS_DEPTH = 2  # headings listed in a page's contents: # and ##
_ID = re.compile(r'<h\d id="([^"]+)"')


def _exporter():
    from nbconvert import HTMLExporter
    from traitlets.config import Config

    c = Config()
    c.CoalesceStreamsPreprocessor.enabled = True
    return HTMLExporter(config=c, template_name="lab", embed_images=True)


def anchor(heading_markdown: str) -> str:
    """The id nbconvert gives a heading (``## A *b*`` -> ``A-b``): asked of nbconvert's own markdown filter."""
    from nbconvert.filters.markdown import markdown2html

    found = _ID.search(markdown2html(heading_markdown))
    return found.group(1) if found else ""


def headings(nb, depth: int = CONTENTS_DEPTH) -> list[tuple[int, str, str]]:
    """``(level, text, anchor)`` of every markdown heading of ``nb`` down to ``depth``, in order."""
    out = []
    fence = False
    for cell in nb.cells:
        if cell.cell_type != "markdown":
            continue
        for line in cell.source.splitlines():
            fence ^= line.lstrip().startswith("```")
            m = None if fence else re.match(r"^(#{1,6})\s+(.+?)\s*#*\s*$", line)
            if m and len(m.group(1)) <= depth:
                out.append((len(m.group(1)), m.group(2), anchor(line)))
    return out


def _inline(markdown: str) -> str:
    """A heading's text as inline HTML (its `code` kept), through nbconvert's markdown filter."""
    from nbconvert.filters.markdown import markdown2html

    out = markdown2html(markdown).strip()
    return out[3:-4] if out.startswith("<p>") and out.endswith("</p>") else html.escape(markdown)


def title(nb, fallback: str) -> str:
    first = headings(nb, 1)
    return first[0][1] if first else fallback


def _page(nb, entry: dict | None) -> nbformat.NotebookNode:
    """The notebook with a header cell: back to the index, its status if it did not finish, its contents."""
    lines = ["[← all notebooks of this run](index.html)", ""]
    if entry and entry.get("status") != "ok":
        lines += [f"**This notebook did not finish ({entry.get('status')}):** `{entry.get('error', '')}`", ""]
    items = headings(nb)
    if items:
        # an HTML block, not markdown links: mistune would percent-encode an apostrophe in the anchor, which then
        # matches no id (nbconvert keeps it as it is in the heading's id)
        entries = "".join(f'<li class="toc-{level}"><a href="#{html.escape(a)}">{_inline(text)}</a></li>'
                          for level, text, a in items[1:])
        lines += ["**Contents**", "", f"<ul>{entries}</ul>"]
    page = copy.deepcopy(nb)
    page.cells.insert(0, nbformat.v4.new_markdown_cell("\n".join(lines)))
    return page


def _index(out: Path, pages: list[tuple[str, str, dict | None]]) -> nbformat.NotebookNode:
    """The index notebook: contents of the pages, then the run's summary with its figure attached."""
    summary = (out / "summary.md").read_text() if (out / "summary.md").exists() else "# gradkit run-all\n"
    head, _, body = summary.partition("\n")
    contents = ["**Contents**", ""]
    for name, page_title, entry in pages:
        status = f" — {entry['status']} in {entry['wall_s']} s" if entry else ""
        contents.append(f"1. [{page_title}]({Path(name).stem}.html){status}")
    body = re.sub(r"\]\(([^)\s]+)\.ipynb\)", r"](\1.html)", body)  # the executed copies are pages here
    cell = nbformat.v4.new_markdown_cell(body)
    png = out / "verdict_matrix.png"
    if "](verdict_matrix.png)" in body and png.exists():
        cell.source = body.replace("](verdict_matrix.png)", "](attachment:verdict_matrix.png)")
        cell.attachments = {"verdict_matrix.png": {"image/png": base64.b64encode(png.read_bytes()).decode()}}
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell(head + "\n\n" + "\n".join(contents)), cell]
    return nb


def build(out) -> Path:
    """Render the executed notebooks of run-all folder ``out`` into ``out/site``; returns its ``index.html``.
    The notebooks are those ``summary.json`` lists (all ``*.ipynb`` of the folder when there is none)."""
    out = kconfig.repo_path(out)
    summary = json.loads((out / "summary.json").read_text()) if (out / "summary.json").exists() else {}
    entries = {Path(e["executed"]).name: e for e in summary.get("notebooks", [])}
    names = sorted(n for n in (entries or {p.name: None for p in out.glob("*.ipynb")}) if (out / n).exists())
    if not names:
        raise FileNotFoundError(f"no executed notebooks in {out}: run `python -m kit.notebooks.runall --out {out}` first")
    site = out / SITE
    tmp = out / f".{SITE}.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        exporter = _exporter()
        pages = []
        for name in names:
            nb = nbformat.read(str(out / name), as_version=4)
            page_title = title(nb, Path(name).stem)
            html, _ = exporter.from_notebook_node(_page(nb, entries.get(name)),
                                                  resources={"metadata": {"name": page_title, "path": str(out)}})
            (tmp / f"{Path(name).stem}.html").write_text(html)
            pages.append((name, page_title, entries.get(name)))
        html, _ = exporter.from_notebook_node(_index(out, pages), resources={"metadata": {"name": "gradkit run-all"}})
        (tmp / "index.html").write_text(html)
        shutil.rmtree(site, ignore_errors=True)  # the site is replaced whole: never half old, half new
        tmp.rename(site)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return site / "index.html"


def main(argv=None) -> int:
    ap = kconfig.Parser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", nargs="?", default="runs/latest", help="a run-all folder (default runs/latest)")
    a = ap.parse_args(argv)
    folder = kconfig.repo_path(a.folder)
    if not folder.is_dir():
        raise kconfig.ConfigError(f"{folder} is not a run-all folder (no such directory)")
    print(f"site: {build(folder)}")
    return 0


if __name__ == "__main__":
    kconfig.run_cli(main)
