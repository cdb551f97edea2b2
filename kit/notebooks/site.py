"""The executed notebooks of a run-all folder and the pages of ``docs/``: one static site, read without running.

    python -m gradkit.notebooks.site runs/latest          # -> runs/latest/site/index.html (gradkit.notebooks.runall builds it after each run)

nbconvert's HTML exporter (the ``lab`` template) renders every page, and every page is one self-contained
file (figures embedded), so the folder can be zipped, mailed or served as it is:

- ``index.html``: the run's summary (``summary.md``: the verdict matrix figure and table, each notebook's
  status and verdicts) with a contents list of the notebook pages and one of the docs pages; it is a notebook of
  markdown cells, rendered the same way as the others.
- ``NAME.html`` per executed notebook: a contents list of its headings at the top (anchors nbconvert itself
  makes), a link back to the index, and the notebook as it ran; a notebook that failed says where, first.
  Streams are coalesced (nbconvert's ``CoalesceStreamsPreprocessor``): a text progress bar shows its last state.
- ``PAGE.html`` per ``docs/PAGE.md``: the page as a one-cell markdown notebook, with the same contents list and
  link back. Its relative links are the repository's (they work on GitHub too) and are rewritten for the site: a
  docs page's to its ``.html`` (a heading anchor as GitHub spells it to the same heading's nbconvert id), a
  notebook's to its executed page where the run has one, any other file of the repository to that file, relative
  to the site's folder. A notebook page's links to other notebooks go to their pages the same way.

Why not Sphinx / MyST: one exporter and one template for every page keeps the notebooks and the docs one site
with no second build system and no new dependency (nbconvert is already the notebooks' renderer).
"""
from __future__ import annotations

import base64
import copy
import html
import json
import os
import re
import shutil
from pathlib import Path
from urllib.parse import unquote

import nbformat

from gradkit import config as kconfig

SITE = "site"
CONTENTS_DEPTH = 2  # headings listed in a page's contents: # and ##
_ID = re.compile(r'<h\d id="([^"]+)"')
DOCS = kconfig.REPO_ROOT / "docs"
# the order of the docs pages on the index (a page not named here follows, by name)
DOCS_ORDER = ("check", "watch", "sweep", "bisect-report", "refresh", "run-all", "judge", "bugs", "layout", "speed", "gpus", "tests")
BACK = "[← this run's index: its notebooks and the docs pages](index.html)"
_HREF = re.compile(r'(<a\s[^>]*?href=")([^"]*)(")')
_SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


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


def plain(markdown: str) -> str:
    """Inline markdown as plain text (``Is *my* check? `gradkit check` `` -> ``Is my check? gradkit check``): a page's
    HTML title."""
    return html.unescape(re.sub(r"<[^>]+>", "", _inline(markdown.strip())))


def _page(nb, entry: dict | None) -> nbformat.NotebookNode:
    """The notebook with a header cell: back to the index, its status if it did not finish, its contents."""
    lines = [BACK, ""]
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


def github_slug(heading_markdown: str, seen: dict | None = None) -> str:
    """The anchor GitHub gives a heading (``## Is *my* config? `gradkit check` `` -> ``is-my-config-gradkit-check``):
    its text lower-cased, punctuation dropped, spaces as hyphens; a repeated one gets ``-1``, ``-2`` (``seen``)."""
    text = plain(heading_markdown)
    slug = re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")
    if seen is not None:
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        slug = f"{slug}-{n}" if n else slug
    return slug


def slugs(nb) -> dict[str, str]:
    """``{GitHub's anchor: nbconvert's}`` for every heading of ``nb``: a link written for the repository, in the site."""
    seen: dict = {}
    return {github_slug(text, seen): a for _, text, a in headings(nb, 6)}


def doc_pages(docs=DOCS) -> list[Path]:
    """The pages of ``docs``: ``DOCS_ORDER`` first, then the others by name."""
    found = {p.stem: p for p in Path(docs).glob("*.md")}
    return [found[n] for n in DOCS_ORDER if n in found] + [found[n] for n in sorted(set(found) - set(DOCS_ORDER))]


def doc_notebook(path) -> nbformat.NotebookNode:
    """A docs page as a one-cell markdown notebook, rendered as the notebooks are."""
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell(Path(path).read_text())]
    return nb


def _relink(html_text: str, base: str, own: str, pages: dict[str, str], anchors: dict[str, dict], site: Path,
            files=lambda target: True) -> str:
    """``html_text``'s relative links, written from repository folder ``base``, as links of the site: a page of the
    site (``pages``: repository path -> page name) by its name, a GitHub heading anchor as the page's own id
    (``anchors``: page name -> ``slugs``), any other existing file of the repository that ``files`` accepts relative
    to ``site``. ``own`` is the page being written (a bare ``#anchor`` is its own)."""
    root = kconfig.REPO_ROOT

    def sub(m):
        href = html.unescape(m.group(2))
        if not href or href.startswith("/") or _SCHEME.match(href):
            return m.group(0)
        path, hash_, frag = href.partition("#")
        if not path:
            page, new = own, ""
        else:
            target = os.path.normpath(os.path.join(base, unquote(path))).replace(os.sep, "/")
            page = pages.get(target)
            if page:
                new = page
            elif files(target) and not target.startswith("..") and (root / target).exists():
                new = Path(os.path.relpath(root / target, site)).as_posix()
            else:
                return m.group(0)
        if frag:
            ids = anchors.get(page) or {}
            frag = frag if frag in ids.values() or unquote(frag) in ids.values() else ids.get(unquote(frag), frag)
        return m.group(1) + html.escape(new + (hash_ + frag if hash_ else ""), quote=True) + m.group(3)

    return _HREF.sub(sub, html_text)


def _a_notebook(target: str) -> bool:
    return target.startswith("notebooks/") and target.endswith(".ipynb")


def _index(out: Path, pages: list[tuple[str, str, dict | None]],
           docs: list[tuple[str, str]] = ()) -> nbformat.NotebookNode:
    """The index notebook: contents of the notebook pages and of the docs pages, then the run's summary with its
    figure attached."""
    summary = (out / "summary.md").read_text() if (out / "summary.md").exists() else "# gradkit run-all\n"
    head, _, body = summary.partition("\n")
    contents = ["**Contents**", ""]
    for name, page_title, entry in pages:
        status = f" — {entry['status']} in {entry['wall_s']} s" if entry else ""
        contents.append(f"1. [{page_title}]({Path(name).stem}.html){status}")
    if docs:
        contents += ["", "**How the kit works** (the pages of `docs/`)", ""]
        contents += [f"1. [{doc_title}]({page})" for page, doc_title in docs]
    body = re.sub(r"\]\(([^)\s]+)\.ipynb\)", r"](\1.html)", body)  # the executed copies are pages here
    cell = nbformat.v4.new_markdown_cell(body)
    png = out / "verdict_matrix.png"
    if "](verdict_matrix.png)" in body and png.exists():
        cell.source = body.replace("](verdict_matrix.png)", "](attachment:verdict_matrix.png)")
        cell.attachments = {"verdict_matrix.png": {"image/png": base64.b64encode(png.read_bytes()).decode()}}
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell(head + "\n\n" + "\n".join(contents)), cell]
    return nb


def build(out, docs=DOCS) -> Path:
    """Render the executed notebooks of run-all folder ``out`` and the pages of ``docs`` into ``out/site``; returns
    its ``index.html``. The notebooks are those ``summary.json`` lists (all ``*.ipynb`` of the folder when there is
    none)."""
    out = kconfig.repo_path(out)
    summary = json.loads((out / "summary.json").read_text()) if (out / "summary.json").exists() else {}
    entries = {Path(e["executed"]).name: e for e in summary.get("notebooks", [])}
    names = sorted(n for n in (entries or {p.name: None for p in out.glob("*.ipynb")}) if (out / n).exists())
    if not names:
        raise FileNotFoundError(f"no executed notebooks in {out}: run `python -m gradkit.notebooks.runall --out {out}` first")
    site = out / SITE
    tmp = out / f".{SITE}.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        exporter = _exporter()
        docs_dir = Path(docs)
        base = docs_dir.relative_to(kconfig.REPO_ROOT).as_posix() if docs_dir.is_relative_to(kconfig.REPO_ROOT) \
            else os.path.relpath(docs_dir, kconfig.REPO_ROOT)
        notebooks = {name: nbformat.read(str(out / name), as_version=4) for name in names}
        doc_nbs = {f"{p.stem}.html": (p, doc_notebook(p)) for p in doc_pages(docs_dir)}
        clash = set(doc_nbs) & ({f"{Path(n).stem}.html" for n in names} | {"index.html"})
        if clash:
            raise ValueError(f"a docs page and a notebook page (or the index) share a name: {sorted(clash)}")
        links = {f"notebooks/{name}": f"{Path(name).stem}.html" for name in names}  # links to a notebook: its page
        anchors = {f"{Path(name).stem}.html": slugs(nb) for name, nb in notebooks.items()}
        links.update({f"{base}/{p.name}": page for page, (p, _) in doc_nbs.items()})
        anchors.update({page: slugs(nb) for page, (_, nb) in doc_nbs.items()})
        pages = []
        for name, nb in notebooks.items():
            page_title = title(nb, Path(name).stem)
            meta = {"name": plain(page_title), "path": str(out)}
            rendered, _ = exporter.from_notebook_node(_page(nb, entries.get(name)), resources={"metadata": meta})
            page = f"{Path(name).stem}.html"
            # a notebook's links: to the site's pages, and to a notebook of the repository where the run has no page
            # for it (never to other files: its outputs' links are the run folder's, not the repository's)
            (tmp / page).write_text(_relink(rendered, "notebooks", page, links, anchors, site, files=_a_notebook))
            pages.append((name, page_title, entries.get(name)))
        listed = []
        for page, (path, nb) in doc_nbs.items():
            doc_title = title(nb, path.stem)
            meta = {"name": plain(doc_title), "path": str(docs_dir)}
            rendered, _ = exporter.from_notebook_node(_page(nb, None), resources={"metadata": meta})
            (tmp / page).write_text(_relink(rendered, base, page, links, anchors, site))
            listed.append((page, doc_title))
        meta = {"name": "gradkit run-all"}
        rendered, _ = exporter.from_notebook_node(_index(out, pages, listed), resources={"metadata": meta})
        (tmp / "index.html").write_text(rendered)
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
