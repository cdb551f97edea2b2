"""The README and the pages of docs/: a short README, every relative link landing (in the repository as GitHub reads
it, and in a run's static site), every path and module the pages name existing, every docs page a page of the site."""
import importlib
import json
import re
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote

import nbformat
import pytest

from gradkit.commands import check
from gradkit.frameworks import attach_args
from gradkit.judge import tolerances
from gradkit.notebooks import readme_tables, site

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
DOCS = sorted((REPO / "docs").glob("*.md"))
NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))
LINK = re.compile(r"\[((?:[^\[\]]|\[[^\]]*\])*)\]\(([^)\s]+)\)")


def _prose(text: str) -> str:
    """``text`` without code: fenced and indented blocks, inline code spans (a link written there is no link)."""
    out, fence = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fence = not fence
            continue
        if not fence and not line.startswith("    "):
            out.append(re.sub(r"`[^`]*`", "``", line))
    return "\n".join(out)


def _links(path: Path) -> list[str]:
    return [target for _, target in LINK.findall(_prose(path.read_text()))]


def _relative(target: str) -> bool:
    return not re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) and not target.startswith("//")


def _github_anchors(path: Path) -> set[str]:
    return set(site.slugs(site.doc_notebook(path)))


def test_the_readme_stays_short():
    lines = README.read_text().splitlines()
    assert len(lines) < 180, f"README.md has {len(lines)} lines: move the detail to a page of docs/"


def test_there_are_docs_pages_and_the_readme_links_every_one():
    assert len(DOCS) >= 8
    linked = {(README.parent / t.partition("#")[0]).resolve() for t in _links(README) if _relative(t)}
    assert not [p.name for p in DOCS if p.resolve() not in linked], "a docs page the README does not link"


@pytest.mark.parametrize("page", [README, *DOCS], ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_relative_link_resolves_to_a_file_of_the_repo_or_a_page_of_the_site(page):
    site_pages = {"index.html"} | {f"{p.stem}.html" for p in DOCS} | {f"{p.stem}.html" for p in NOTEBOOKS}
    links = [t for t in _links(page) if _relative(t)]
    assert links, f"{page.name} links nothing"
    broken = []
    for target in links:
        path, _, frag = target.partition("#")
        if not path:  # an anchor of the page itself, as GitHub spells it
            if frag not in _github_anchors(page):
                broken.append(target)
            continue
        if path.startswith("/"):
            broken.append(target)  # an absolute path works on one machine only
            continue
        resolved = (page.parent / unquote(path)).resolve()
        if page == README and path.startswith("runs/latest/site/"):  # a page of the site a run writes
            if path.removeprefix("runs/latest/site/") not in site_pages:
                broken.append(target)
            continue
        if not resolved.is_relative_to(REPO) or not resolved.exists():
            broken.append(target)
        elif frag and resolved.suffix == ".md" and frag not in _github_anchors(resolved):
            broken.append(target)  # a heading anchor that no heading of that page has
    assert not broken, f"{page.name}: links that land nowhere: {broken}"


# a path of the repository named in backticks: kit/judge/oracle.py, scripts/params/*.yaml, kit/shapes/, ...
PATH = re.compile(r"`((?:kit|scripts|notebooks|tests|docs)/[\w./*<>-]*)`")
DOTTED = re.compile(r"`(gradkit(?:\.\w+)+)`")


@pytest.mark.parametrize("page", [README, *DOCS], ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_path_and_module_a_page_names_exists(page):
    """The layout changes (modules split, folders renamed): a page that names a path or a module that is no longer
    there fails here, with the names."""
    text = readme_tables.BLOCK.sub("", page.read_text())  # a generated table names what its command saw then
    missing = [p for p in set(PATH.findall(text)) if "<" not in p and not list(REPO.glob(p.rstrip("/")))]
    for name in set(DOTTED.findall(text)):
        parts = name.split(".")
        for i in range(len(parts), 0, -1):  # the longest importable module, then attributes
            try:
                obj = importlib.import_module(".".join(parts[:i]))
            except ImportError:
                continue
            for attr in parts[i:]:
                obj = getattr(obj, attr, None)
            if obj is None:
                missing.append(name)
            break
        else:
            missing.append(name)
    assert not missing, f"{page.name} names what the repository does not have: {sorted(missing)}"


def test_every_module_the_layout_page_names_in_a_folder_exists():
    """docs/layout.md's table: a row of folder `kit/X/` names its modules as `name.py` or `sub/name.py`, its
    sub-packages as `name/`; each must be there (a module split or renamed changes the page)."""
    missing = []
    for line in (REPO / "docs" / "layout.md").read_text().splitlines():
        row = re.match(r"^\| `(kit/\w+/)` \|(.*)\|$", line)
        if row:
            names = re.findall(r"`((?:\w+/)*\w+\.py|\w+/)`", row.group(2))
            assert names, row.group(1)
            paths = [n if n.startswith("kit/") else row.group(1) + n for n in names]  # a repository path as it is
            missing += [p for p in paths if not (REPO / p).exists()]
    assert not missing, missing


def test_every_generated_table_sits_on_its_page_with_the_command_that_writes_it_there():
    """The blocks the commands rewrite in place moved with their text: the bugs' tables on readme_tables.PAGE, the
    sweep's, the performance and the mutation tables on theirs, each first line naming its page; in the README only
    the pinned ranges (scripts/refresh_table writes them there and on the bugs page)."""
    blocks = {"B1": readme_tables.PAGE, "B2": readme_tables.PAGE, "B3": readme_tables.PAGE, "B4": readme_tables.PAGE,
              "SWEEP": "docs/sweep.md", "PERF": "docs/speed.md", "MUTATION": "docs/tests.md",
              "SUPPORT": "docs/watch.md", "SCALE": "docs/watch.md",
              **{f"VERDICT_{v}": "docs/verdicts.md" for v in ("NOT_AFFECTED", "AFFECTED", "INCONCLUSIVE", "CANNOT_RUN")}}
    found = {}
    for page in [README, *DOCS]:
        for m in readme_tables.BLOCK.finditer(page.read_text()):
            found.setdefault(m.group(2), []).append((page.relative_to(REPO).as_posix(), m.group(3)))
    assert {k: [p for p, _ in v] for k, v in found.items()} == {**{k: [p] for k, p in blocks.items()},
                                                                "RANGES": ["README.md", readme_tables.PAGE]}
    assert all("`scripts/refresh_table --ranges-only`" in body.splitlines()[0] for _, body in found["RANGES"])
    for name in ("SWEEP", "PERF", "MUTATION", "SUPPORT", "SCALE", *(k for k in blocks if k.startswith("VERDICT_"))):
        (page, body), = found[name]
        assert f"--readme {page}`" in body.splitlines()[0], (name, body.splitlines()[0])
    assert "python -m gradkit.notebooks.readme_tables" in found["B4"][0][1].splitlines()[0]
    bugs = (REPO / readme_tables.PAGE).read_text()
    assert f"readme_tables runs/latest --readme {readme_tables.PAGE}" in bugs  # the page names its own command


def test_the_table_commands_write_their_page_by_default(tmp_path, monkeypatch):
    """`--readme` without a file writes the page the table lives on (never README.md), and names it in the table."""
    monkeypatch.syspath_prepend(str(REPO / "scripts"))
    bench = importlib.import_module("bench")
    mutation_run = importlib.import_module("mutation_run")
    assert bench.PERF_PAGE == "docs/speed.md" and mutation_run.PAGE == "docs/tests.md"
    assert readme_tables.PAGE == "docs/bugs.md"
    assert "--readme docs/speed.md`" in bench.perf_table(tmp_path).splitlines()[0]
    summary = {"kit/judge/oracle.py": {"killed": 3, "survived": 0, "equivalent": 0, "score": 1.0, "wall_s": 5}}
    assert "--readme docs/tests.md`" in mutation_run.table(summary).splitlines()[0]
    folder = tmp_path / "run"  # readme_tables: `--readme` alone writes readme_tables.PAGE
    folder.mkdir()
    (folder / "run.json").write_text(json.dumps({"run_id": "R", "notebooks": {}}))
    page = tmp_path / "bugs.md"
    page.write_text("<!-- gradkit:table B4 -->\nold\n<!-- /gradkit:table -->\n")
    monkeypatch.setattr(readme_tables, "PAGE", str(page))
    monkeypatch.setattr(readme_tables, "render", lambda folder: {"B4": "new\n"})
    assert readme_tables.main([str(folder), "--readme"]) == 0
    assert page.read_text() == "<!-- gradkit:table B4 -->\nnew\n<!-- /gradkit:table -->\n"


def test_the_judge_page_states_the_tolerances_of_the_code():
    """docs/judge.md's table of limits is tolerances.TOLERANCES, number for number (tests/test_instrument.py holds each
    limit just below and above; this holds the page to the code)."""
    text = (REPO / "docs" / "judge.md").read_text()
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 6 and cells[0] in tolerances.TOLERANCES:
            rows[cells[0]] = cells
    assert set(rows) == set(tolerances.TOLERANCES)
    for dtype, tol in tolerances.TOLERANCES.items():
        _, rel, ratio, misplaced, spread, why = rows[dtype]
        assert (float(rel), float(ratio), float(misplaced), float(spread)) == \
            (tol.rel_l2, tol.norm_ratio, tol.misplaced_weight, tol.rank_spread), dtype
        assert why == tol.why, dtype


class Page(HTMLParser):
    def __init__(self, text):
        super().__init__()
        self.ids, self.hrefs, self.toc, self.title = set(), [], [], ""
        self._in_toc = self._in_title = False
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        self.ids.add(a.get("id"))
        if tag == "li" and (a.get("class") or "").startswith("toc-"):
            self._in_toc = True
        if tag == "title":
            self._in_title = True
        if tag == "a" and a.get("href"):
            self.hrefs.append(a["href"])
            if self._in_toc:
                self.toc.append(a["href"])
                self._in_toc = False

    def handle_endtag(self, tag):
        self._in_title = self._in_title and tag != "title"

    def handle_data(self, data):
        if self._in_title:
            self.title += data


def _lands(page: Page, frag: str) -> bool:
    return frag in page.ids or unquote(frag) in page.ids  # as a browser looks a fragment up: raw, then decoded


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A run folder with two executed notebooks of the kit's names (their markdown only) and its site."""
    out = tmp_path_factory.mktemp("run")
    for name, cells in (("07_without_deepspeed", ["# Without DeepSpeed\n\n## The matrix\n\nsee [B3](03_zero_boundary.ipynb)"
                                                  " and [the judge](../docs/judge.md#tolerances-by-dtype)",
                                                  "## Each fix"]),
                        ("03_zero_boundary", ["# B3\n\n## The report's symptom\n\nback to [07](07_without_deepspeed.ipynb)"
                                              " and [the explorer](05_explorer.ipynb)", "## The fix"])):
        nb = nbformat.v4.new_notebook()
        nb.cells = [nbformat.v4.new_markdown_cell(c) for c in cells]
        nbformat.write(nb, str(out / f"{name}.ipynb"))
    index = site.build(out)
    return out, index.parent


def test_every_docs_page_is_a_page_of_the_site_listed_on_its_index(built):
    _, root = built
    index = Page((root / "index.html").read_text())
    pages = {f"{p.stem}.html" for p in DOCS}
    assert pages <= set(index.hrefs), f"docs pages missing from the index: {sorted(pages - set(index.hrefs))}"
    assert {"03_zero_boundary.html", "07_without_deepspeed.html"} <= set(index.hrefs)  # beside the notebooks
    assert [h for h in index.hrefs if h in pages] == [f"{p.stem}.html" for p in site.doc_pages()]  # in order, once
    for doc in DOCS:
        assert (root / f"{doc.stem}.html").is_file(), doc.name
        nb = site.doc_notebook(doc)
        page = Page((root / f"{doc.stem}.html").read_text())
        assert page.title.strip() == site.plain(site.title(nb, doc.stem)), doc.name
        heads = site.headings(nb, 6)  # every heading of the page rendered, with the id its contents link to
        assert heads and all(a in page.ids for _, _, a in heads), doc.name


def test_every_docs_pages_contents_links_land_on_its_headings(built):
    _, root = built
    for doc in DOCS:
        page = Page((root / f"{doc.stem}.html").read_text())
        sections = [a for level, _, a in site.headings(site.doc_notebook(doc)) if level == 2]
        assert len(sections) >= 2, f"{doc.name}: a page of one section has no contents"
        assert [h[1:] for h in page.toc] == sections, doc.name
        lost = [h for h in page.toc if not _lands(page, h[1:])]
        assert not lost, (doc.name, lost)
        assert "index.html" in page.hrefs, doc.name  # the way back


def test_every_link_of_the_site_lands_on_a_page_or_a_file(built):
    """Links between pages are the site's (a docs page's .html, a notebook's executed page, a heading's id there);
    a link to any other file of the repository reaches that file from the site's folder."""
    out, root = built
    broken = []
    for html_file in sorted(root.glob("*.html")):
        page = Page(html_file.read_text())
        for href in page.hrefs:
            if not _relative(href):
                continue
            path, _, frag = href.partition("#")
            if not path:
                if frag and not _lands(page, frag):
                    broken.append((html_file.name, href))
                continue
            target = (root / unquote(path)).resolve()
            if not target.exists():
                broken.append((html_file.name, href))
            elif frag and target.parent == root.resolve() and not _lands(Page(target.read_text()), frag):
                broken.append((html_file.name, href))
            elif target.suffix == ".md" and target.parent == (REPO / "docs"):
                broken.append((html_file.name, href))  # a docs page as a file, not as its page
    assert not broken, broken
    bugs = Page((root / "bugs.html").read_text()).hrefs
    assert "07_without_deepspeed.html" in bugs  # a notebook the run has: its executed page
    assert any(h.endswith("notebooks/04_bf16_leak.ipynb") for h in bugs)  # one it has not: the repository's file
    tests = Page((root / "tests.html").read_text()).hrefs
    assert "judge.html#Tolerances-by-dtype" in tests  # GitHub's anchor for the heading, as the site's id
    b3 = Page((root / "03_zero_boundary.html").read_text()).hrefs
    assert "07_without_deepspeed.html" in b3 and any(h.endswith("notebooks/05_explorer.ipynb") for h in b3)
    seven = Page((root / "07_without_deepspeed.html").read_text()).hrefs
    assert "judge.html#Tolerances-by-dtype" in seven  # a notebook's link to a docs page


def test_a_docs_page_named_as_a_notebook_page_is_refused(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    nbformat.write(nbformat.v4.new_notebook(), str(out / "judge.ipynb"))
    with pytest.raises(ValueError, match="share a name"):
        site.build(out)


def test_the_check_page_names_every_flag_of_the_check_and_what_it_is_without_it():
    """docs/check.md's flag table: a flag the parser has and the page does not name fails here."""
    text = (REPO / "docs" / "check.md").read_text()
    table = text[text.index("## Every flag, and what it is without it"):]
    flags = [o for a in check.parser()._actions for o in a.option_strings if o.startswith("--") and o != "--help"]
    missing = [f for f in flags if not re.search(rf"`{re.escape(f)}[` ]", table)]
    assert len(flags) > 20 and not missing, f"docs/check.md's flag table lacks {missing}"


def test_the_verdicts_page_shows_each_verdict_from_the_config_its_section_names():
    """docs/verdicts.md: each generated block is the check's output on its example, ending in the verdict and exit
    status its section is about (scripts/verdicts.py refuses to write a block whose example gave another)."""
    text = (REPO / "docs" / "verdicts.md").read_text()
    found = {m.group(2): m.group(3) for m in readme_tables.BLOCK.finditer(text)}
    for name, last in (("NOT_AFFECTED", "verdict: not-affected (exit 0)"), ("AFFECTED", "verdict: affected (exit 1)"),
                       ("INCONCLUSIVE", "verdict: inconclusive (exit 3)"), ("CANNOT_RUN", "verdict: cannot-run (exit 3)")):
        body = found[f"VERDICT_{name}"]
        example = f"examples/verdicts/{name.lower()}.json"
        assert f"$ gradkit check {example}\n" in body and (REPO / example).exists(), name
        assert body.rstrip().removesuffix("```").rstrip().endswith(last), (name, body[-200:])


@pytest.mark.world
def test_each_verdict_example_gives_its_verdict_when_run_again(monkeypatch):
    """The examples docs/verdicts.md shows still run and still give the verdict, exit status and last line its block
    shows (the block is their output of the day it was written: a change of the kit that moves a verdict fails here,
    not silently on the page)."""
    monkeypatch.syspath_prepend(str(REPO / "scripts"))
    verdicts = importlib.import_module("verdicts")
    page = {m.group(2): m.group(3) for m in readme_tables.BLOCK.finditer((REPO / "docs" / "verdicts.md").read_text())}
    for name, (args, want) in verdicts.EXAMPLES.items():
        rc, text = verdicts.run(args)
        shown = page[name].rstrip().removesuffix("```").rstrip().splitlines()[-1]
        assert (rc, text.splitlines()[-1]) == (want, shown), (name, text[-1500:])


CODE_SPAN = re.compile(r"```[^\n]*\n(.*?)```|`([^`\n]+)`", re.S)
COMMAND = re.compile(r"(?:^|[\s$(])(?:\S*/)?(?:gradkit (?P<sub>[a-z]+)(?![\w:-])|(?:python3? )?-m (?P<mod>gradkit[\w.]*))"
                     r"(?P<args>[^`\n|;&#]*)")
QUOTED = re.compile(r"\"[^\"]*\"|'[^']*'")  # a quoted argument's flags are not the command's (--command "trl sft ...")
FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)")


def _commands(page: Path) -> list[tuple[str, str, list[str]]]:
    """Each gradkit command line a page's code shows (fenced blocks and inline spans): (the module it runs, the line,
    its --flags). An output line (``gradkit check x.json: DeepSpeed ...``) is not a command."""
    from gradkit.__main__ import COMMANDS

    out = []
    for fenced, inline in CODE_SPAN.findall(page.read_text()):
        for line in (fenced or inline).splitlines():
            for m in COMMAND.finditer(line):
                if m["sub"]:
                    module = COMMANDS.get(m["sub"], f"no such command: gradkit {m['sub']}")
                else:
                    module = m["mod"]
                args = QUOTED.sub("", m["args"].split(":")[0] if m["sub"] else m["args"])
                if module == attach_args.MODULE:  # what follows its target is the target's own command line
                    args = args[:len(args) - len(" ".join(_attached(args)))]
                out.append((module, line.strip(), FLAG.findall(args)))
    return out


def _attached(args: str) -> list[str]:
    """The target and its arguments of a ``gradkit.watch.attach`` line (its own parser splits them)."""
    try:
        ns = attach_args.split(args.split())
    except ValueError:
        return []
    return [ns.target, *ns.args]


def _help(module: str) -> str | None:
    """What ``python -m module --help`` prints (its argparse), run in this process; None where it does not import."""
    import contextlib
    import io
    import runpy
    import sys

    try:
        main = getattr(importlib.import_module(module), "main", None)
    except ImportError:
        return None
    argv, text = sys.argv, io.StringIO()
    sys.argv = [module, "--help"]
    try:
        with contextlib.redirect_stdout(text), contextlib.redirect_stderr(io.StringIO()):
            if callable(main):  # a command's own entry (gradkit check -> gradkit.commands.check.main)
                main(["--help"])
            else:  # a package run by its __main__, or a module with a guarded block
                runpy.run_module(module + ".__main__" if importlib.util.find_spec(module + ".__main__") else module,
                                 run_name="__main__", alter_sys=False)
    except SystemExit:
        pass
    finally:
        sys.argv = argv
    return text.getvalue()


@pytest.mark.parametrize("page", [README, *DOCS, *sorted((REPO / "examples").rglob("*.md"))],
                         ids=lambda p: p.name)
def test_every_command_a_page_shows_runs_a_module_the_kit_has_with_flags_its_parser_takes(page):
    """A command in a page's code (``gradkit check ...``, ``python -m gradkit.commands.sweep ...``) names a command or
    module that exists, and every ``--flag`` it writes is one that command's ``--help`` lists: a flag renamed or a
    command moved fails here, with the line."""
    helps: dict = {}
    bad = []
    for module, line, flags in _commands(page):
        if module not in helps:
            helps[module] = None if module.startswith("no such") else _help(module)
        text = helps[module]
        if text is None:
            bad.append(f"{line}: {module if module.startswith('no such') else f'no module {module}'}")
            continue
        bad += [f"{line}: {module} has no {f}" for f in flags if f not in FLAG.findall(text)]
    assert not bad, f"{page.name}: {bad}"


def test_a_command_with_a_flag_its_parser_lacks_or_a_command_the_kit_lacks_is_found(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("Run `gradkit check x.json --loop all --no-such-flag` or\n```\ngradkit watch x\n"
                    "python -m gradkit.commands.sweep s.yaml --readme r.md\n```\n"
                    "It prints `gradkit check x.json: DeepSpeed 0.19.8 --not-a-flag`.\n"
                    "`gradkit check --command \"trl sft --config c.yaml\" --world-size 2`\n"
                    "`torchrun -m gradkit.watch.attach --every 5 trl.scripts.sft --config c.yaml --every 2`\n"
                    "`python -m gradkit.watch.attach --no-flag job.py`\n")
    found = _commands(page)
    assert [(m, f) for m, _, f in found] == [("gradkit.commands.check", ["--loop", "--no-such-flag"]),
                                              ("no such command: gradkit watch", []),
                                              ("gradkit.commands.sweep", ["--readme"]),
                                              ("gradkit.commands.check", []),
                                              ("gradkit.commands.check", ["--command", "--world-size"]),
                                              ("gradkit.watch.attach", ["--every"]),
                                              ("gradkit.watch.attach", ["--no-flag"])]
    assert "--loop" in _help("gradkit.commands.check") and "--no-such-flag" not in _help("gradkit.commands.check")
    assert _help("gradkit.no_such_module") is None


HARD_CPU = re.compile(r"use_cpu\s*=\s*True|init_\w*\([^)]*[\"']gloo[\"']|dist_backend\s*=\s*[\"']gloo|"
                      r"environ\[[\"']DS_ACCELERATOR[\"']\]\s*=|device\s*=\s*[\"']cpu[\"']\s*\)")


@pytest.mark.parametrize("example", sorted((REPO / "examples").rglob("*.py")), ids=lambda p: p.name)
def test_an_example_takes_its_device_and_backend_from_the_environment(example):
    """Every example runs unchanged on GPUs: no CPU or gloo written into the code (the CPU runs of the suite say
    ``DS_ACCELERATOR=cpu`` on the command line); offloading the optimizer to ``{"device": "cpu"}`` is a config, not
    the run's device."""
    code = "\n".join(line.split("#")[0] for line in example.read_text().splitlines())
    assert not HARD_CPU.findall(code), f"{example.name} fixes the device or backend: {HARD_CPU.findall(code)}"


def test_a_hard_coded_cpu_or_gloo_is_found():
    for bad in ('TrainingArguments(use_cpu=True)', 'deepspeed.init_distributed(dist_backend="gloo")',
                'dist.init_process_group("gloo")', 'os.environ["DS_ACCELERATOR"] = "cpu"', 'x.to(device="cpu")'):
        assert HARD_CPU.findall(bad), bad
    assert not HARD_CPU.findall('use_cpu=not torch.cuda.is_available(), {"offload_optimizer": {"device": "cpu"}}')


MEASURED = re.compile(r"(?<![\w.])(\d+\.\d+) ?(s|×|GB|MB|min)(?!\w)|(?<![\w.])(\d+\.\d{3,})(?![\w.])")
GENERATED = re.compile(r"<!-- gradkit:table (\w+) -->(.*?)<!-- /gradkit:table -->", re.S)
SOURCE = re.compile(r"`(?:\.venv/bin/)?(?:gradkit |python|scripts/|tests/|runs/|bash |torchrun )[^`]*`|"
                    r"\]\((?!https?:)[^)]*\.md[^)]*\)")


def _measured_out_of_place(text: str) -> list[str]:
    """Each measured number (a time, size or factor with its unit, or a ratio of three decimals or more) written in a
    page's prose whose paragraph names no command, test, run file or page it comes from, or that a generated block of
    the same page already holds. A code block's numbers (a sample output) take the paragraphs either side of it. A
    page its first lines say is generated as a whole (docs/refresh.md) is its command's."""
    if "<sub>generated by `" in "\n".join(text.splitlines()[:8]):
        return []
    held = {(m[1], m[2]) if m[1] else (m[3], None) for _, body in GENERATED.findall(text)
            for m in MEASURED.finditer(body)}
    prose = GENERATED.sub("\n\n", text)
    prose = re.sub(r"```[^\n]*\n(.*?)```", lambda m: "\n".join("    " + x for x in m[1].splitlines()), prose, flags=re.S)
    paras = [p for p in re.split(r"\n\s*\n", prose) if p.strip()]
    bad = []
    for i, para in enumerate(paras):
        code = all(x.startswith("    ") for x in para.splitlines())
        context = "\n".join(paras[max(0, i - 1):i + 2]) if code else para
        for m in MEASURED.finditer(para):
            if ((m[1], m[2]) if m[1] else (m[3], None)) in held:
                bad.append(f"{m[0]!r} is the page's generated table's: refer to it")
            elif not SOURCE.search(context):
                bad.append(f"{m[0]!r} names no command, test, run file or page it was measured by: {para[:80]!r}")
    return bad


@pytest.mark.parametrize("page", [README, *DOCS, *sorted((REPO / "examples").rglob("*.md"))],
                         ids=lambda p: p.name)
def test_a_measured_number_in_prose_says_how_it_was_measured_and_is_no_generated_tables_again(page):
    """Every number and claim says how it was measured: a time, size, factor or ratio in a page's prose has in its
    paragraph the command, test, run file or page it comes from; a number a generated table of the page holds is not
    written again beside it (it would go stale at the table's next run)."""
    bad = _measured_out_of_place(page.read_text())
    assert not bad, f"{page.name}: {bad}"


def test_a_measured_number_without_its_source_or_written_twice_is_found():
    table = "<!-- gradkit:table T -->\n| a | 12.5 s |\n<!-- /gradkit:table -->"
    assert len(_measured_out_of_place(f"It took 3.4 s.\n\n{table}\n\nThe sweep took 12.5 s (`gradkit sweep`).")) == 2
    assert _measured_out_of_place(f"It took 3.4 s (`scripts/bench.py`); ratio 0.908 ([bisect](refresh.md)).\n\n"
                                  f"    step 1: ratio 0.9080\n\n(from `tests/test_x.py`)\n\n{table}\n") == []
    assert len(_measured_out_of_place("An output:\n\n```\nratio 0.9080\n```\n\nand nothing else.")) == 1
    assert _measured_out_of_place("# T\n\n<sub>generated by `scripts/refresh_table`</sub>\n\nratio 0.908") == []
