"""gradkit as a distribution: installing it into a user's training environment changes nothing there (pip's own
resolver, asked with ``--dry-run --report``), its one import name is ``gradkit`` (the folder ``kit/``), the kit's own
environment is pinned in one place (constraints.txt), and the version is written once."""
import json
import re
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement

import gradkit

REPO = Path(__file__).resolve().parents[1]
PYPROJECT = REPO / "pyproject.toml"
# what the user already has, older than the kit's own pins: a CUDA torch, the HF stack, DeepSpeed
USERS_STACK = {"torch": "2.6.0+cu124", "transformers": "4.51.3", "accelerate": "1.6.0", "deepspeed": "0.16.4",
               "peft": "0.15.2"}
TOOLING = {"jupyterlab", "notebook", "papermill", "ipykernel", "ipywidgets", "matplotlib", "nbconvert", "selenium",
           "pytest", "pytest-xdist", "nbstripout", "cosmic-ray", "distributed", "dask", "build", "coverage"}


def _name(requirement: str) -> str:
    return re.sub(r"[-_.]+", "-", Requirement(requirement).name).lower()


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> Path:
    """The sdist, and the wheel built from it (``python -m build``, as a release is made)."""
    out = tmp_path_factory.mktemp("dist")
    subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(REPO)], check=True,
                   capture_output=True, timeout=300)
    return out


@pytest.fixture(scope="module")
def wheel(dist) -> Path:
    return next(dist.glob("gradkit-*.whl"))


def _metadata(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as z:
        return z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode().splitlines()


def _environment(root: Path, has: dict) -> Path:
    """A virtual environment (no pip of its own) holding ``has`` as installed distributions: what pip's resolver
    sees of a user's environment is each distribution's metadata, so that is what is written."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True, timeout=120)
    site = next(root.glob("lib/python*/site-packages"))
    for name, version in has.items():
        info = site / f"{name.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        (info / "INSTALLER").write_text("pip\n")
        (info / "RECORD").write_text("")
    return root / "bin" / "python"


def _would_install(python: Path, *what: str, offline: bool = False) -> dict[str, str]:
    """``{name: version}`` that ``pip install what`` would install or replace in that environment."""
    cmd = [sys.executable, "-m", "pip", "--python", str(python), "install", "--dry-run", "--quiet", "--report", "-",
           "--disable-pip-version-check", *(["--no-index"] if offline else []), *what]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout)
    return {re.sub(r"[-_.]+", "-", i["metadata"]["name"]).lower(): i["metadata"]["version"] for i in report["install"]}


def test_the_requirements_are_lower_bounds_and_none_is_the_users_stack_or_tooling(wheel):
    required = [line.split(":", 1)[1].strip() for line in _metadata(wheel) if line.startswith("Requires-Dist:")]
    assert required
    for r in required:
        for spec in Requirement(r.split(";")[0]).specifier:
            assert spec.operator == ">=", f"{r}: the distribution's requirements are lower bounds only"
    base = {_name(r) for r in required if "extra ==" not in r}
    assert base == {"torch", "pyyaml", "psutil", "tqdm", "packaging"}, base
    assert not base & (set(USERS_STACK) - {"torch"} | {"trl"} | TOOLING)


def test_installing_into_an_environment_with_older_releases_changes_none_of_them(wheel, tmp_path):
    floors = {_name(r): str(next(iter(Requirement(r).specifier))).removeprefix(">=")
              for r in [line.split(":", 1)[1].strip() for line in _metadata(wheel) if line.startswith("Requires-Dist:")]
              if "extra ==" not in r and _name(r) != "torch"}
    python = _environment(tmp_path / "user", {**USERS_STACK, **floors})
    # everything the kit needs is already there, at its oldest measured release: pip installs gradkit and nothing else
    assert _would_install(python, str(wheel), offline=True) == {"gradkit": gradkit.__version__}


def test_only_the_small_base_comes_with_it_and_the_tooling_only_with_its_extra(wheel, tmp_path):
    python = _environment(tmp_path / "user", USERS_STACK)
    plain = _would_install(python, str(wheel))
    assert not set(plain) & set(USERS_STACK), f"installing gradkit would replace {set(plain) & set(USERS_STACK)}"
    assert not set(plain) & TOOLING, f"installing gradkit would bring {set(plain) & TOOLING}"
    assert set(plain) <= {"gradkit", "pyyaml", "psutil", "tqdm", "packaging"}, plain
    # the control: the same question about an extra shows its tooling, so the answer above is not blind to it
    dask = _would_install(python, f"{wheel}[dask]")
    assert {"distributed", "dask"} <= set(dask) and not set(dask) & set(USERS_STACK), dask


def test_one_import_name_gradkit_whose_code_is_the_folder_kit(wheel):
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
    assert {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")} == {"gradkit"}
    sources = {"gradkit/" + p.relative_to(REPO / "kit").as_posix() for p in (REPO / "kit").rglob("*.py")
               if "__pycache__" not in p.parts}
    assert sources <= set(names), f"kit/ files missing from the wheel: {sorted(sources - set(names))[:5]}"
    assert "gradkit/judge/history.json" in names
    assert "gradkit = gradkit.__main__:cli" in "\n".join(
        zipfile.ZipFile(wheel).read(n).decode() for n in names if n.endswith("entry_points.txt"))
    assert Path(gradkit.__file__).parent == REPO / "kit"  # the editable install maps the name onto the same folder


def test_nothing_in_the_repository_imports_the_folder_name():
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    folder = "kit"  # the folder's name, never an import name (written so that this file does not match itself)
    old = re.compile(rf"(?<![\w/.\-])(?:(?:from|import) {folder}\b(?![/\-])|{folder}\.(?:judge|probes|launch|commands|"
                     rf"stacks|shapes|notebooks|watch|frameworks|config|registry|__main__)\b|-m {folder}\b)")
    found = [f"{f}: {m.group(0)}" for f in tracked if Path(REPO / f).suffix in {".py", ".ipynb", ".md", ".sh", ".yaml"}
             for m in old.finditer((REPO / f).read_text())]
    assert not found, f"the import name is gradkit; found {found[:5]}"


def test_importing_gradkit_and_its_watch_imports_no_stack():
    code = ("import sys, gradkit, gradkit.watch, gradkit.watch.attach\n"
            "print([m for m in ('transformers', 'deepspeed', 'accelerate', 'peft', 'trl', 'matplotlib') "
            "if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd="/")
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


def test_the_version_is_written_once_and_the_command_says_it(wheel):
    assert f"Version: {gradkit.__version__}" in _metadata(wheel)
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    assert "version" not in project and "version" in project["dynamic"]  # read from gradkit.__version__
    out = subprocess.run([sys.executable, "-m", "gradkit", "--version"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.startswith(f"gradkit {gradkit.__version__} (torch "), out


def test_the_kits_own_environment_is_pinned_in_constraints_txt_alone():
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    wanted = {_name(r) for r in project["dependencies"]}
    wanted |= {_name(r) for rs in project["optional-dependencies"].values() for r in rs if _name(r) != "gradkit"}
    pins = {}
    for line in (REPO / "constraints.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, _, version = line.partition("==")
            assert version, f"constraints.txt: {line!r} is not an exact pin"
            pins[_name(name)] = version
    assert wanted <= set(pins), f"not pinned in constraints.txt: {sorted(wanted - set(pins))}"
    for r in [*project["dependencies"], *(r for rs in project["optional-dependencies"].values() for r in rs)]:
        spec = Requirement(r).specifier
        assert all(s.contains(pins[_name(r)]) for s in spec) if _name(r) in pins else True, \
            f"constraints.txt pins {_name(r)}=={pins.get(_name(r))}, outside pyproject's {r}"
    setup = (REPO / "scripts" / "setup.sh").read_text()
    assert setup.count("-c constraints.txt") >= 2 and "==" not in setup
    env = yaml.safe_load((REPO / "environment.yml").read_text())
    pip = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))
    assert any("constraints.txt" in line for line in pip)
    assert not [line for line in pip if "==" in line], "environment.yml pins nothing itself: constraints.txt does"


def test_the_stacks_floors_are_the_oldest_releases_the_support_range_measures():
    """pyproject.toml's floors for the stacks the notebooks measure are the oldest environment that
    scripts/support_range.py measures, and docs/watch.md's support table shows that environment."""
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import support_range
    finally:
        sys.path.remove(str(REPO / "scripts"))
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    floors = {_name(r): str(next(iter(Requirement(r).specifier))).removeprefix(">=")
              for r in project["optional-dependencies"]["notebooks"]}
    oldest = support_range.ENVS["oldest"]
    assert {p: floors[p] for p in ("transformers", "accelerate", "deepspeed")} == \
        {p: oldest[p] for p in ("transformers", "accelerate", "deepspeed")}
    newest = support_range.ENVS["newest"]
    pins = dict(line.split("==") for line in (REPO / "constraints.txt").read_text().splitlines()
                if "==" in line and not line.startswith("#"))
    assert all(newest[p] == pins[p] for p in ("transformers", "accelerate", "deepspeed")), "newest is the kit's own"
    table = (REPO / "docs" / "watch.md").read_text().split("<!-- gradkit:table SUPPORT -->")[1]
    row = next(line for line in table.splitlines() if line.startswith("| oldest |"))
    assert all(f" {oldest[p]} " in row for p in ("transformers", "accelerate", "deepspeed")), row
