"""Which notebooks run-all runs, and with which parameters, all checked before any kernel starts.

The YAML parameters file (``load_params``), each notebook's ``parameters`` cell (``papermill.inspect_notebook``:
``notebook_parameters``, ``notebook_defaults``), what one notebook gets (``params_for``: the file's defaults where they
fit, its own entries, the run's folder; ``validate_parameters`` refuses a name the notebook does not have), and every
value a kit notebook will run with, checked by the notebook's own ``check_notebook`` (``check_notebook_values``: a
probe's, or for the notebooks that are not one probe's, the module ``TOOL_NOTEBOOKS`` names).
"""
from __future__ import annotations

from pathlib import Path

from gradkit import config as kconfig
from gradkit import probes

REPO = Path(__file__).resolve().parents[2]
NOTEBOOKS = REPO / "notebooks"
AGGREGATE_PARAMETER = "LOAD_RESULTS"


def notebook_parameters(path) -> dict:
    import papermill

    return dict(papermill.inspect_notebook(str(path)))


def validate_parameters(path, params: dict, known: dict | None = None) -> None:
    """Raise ``ConfigError`` naming every parameter the notebook does not have."""
    known = notebook_parameters(path) if known is None else known
    if not known:
        raise kconfig.ConfigError(f"{path} has no cell tagged 'parameters'")
    unknown = sorted(set(params) - set(known))
    if unknown:
        raise kconfig.ConfigError(f"{Path(path).name}: unknown parameter(s) {unknown}; it has {sorted(known)}")


def load_params(path) -> dict:
    """``{"defaults": {...}, "notebooks": {stem: {...}}, "timeouts": {stem: s}}`` from YAML (all keys optional)."""
    import yaml

    keys = ("defaults", "notebooks", "timeouts")
    if path is None:
        return {k: {} for k in keys}
    if not Path(path).is_file():
        raise kconfig.ConfigError(f"no such parameters file: {path}")
    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except (UnicodeDecodeError, yaml.YAMLError) as e:
        where = getattr(e, "problem_mark", None)
        at = f" (line {where.line + 1})" if where is not None else ""
        raise kconfig.ConfigError(f"{path} is not a YAML parameters file{at}: "
                                  f"{str(e).splitlines()[0][:200]}") from None
    if not isinstance(data, dict):
        raise kconfig.ConfigError(f"{path} must map 'defaults', 'notebooks' and 'timeouts', not hold a "
                                  f"{type(data).__name__} ({str(data)[:60]!r})")
    for k in keys:
        if not isinstance(data.get(k) or {}, dict):
            raise kconfig.ConfigError(f"{path}: '{k}' must be a mapping, got {data[k]!r:.80}")
    for stem, values in (data.get("notebooks") or {}).items():
        if not isinstance(values, dict):
            raise kconfig.ConfigError(f"{path}: notebooks.{stem} must map parameter names to values, got {values!r:.80}")
    extra = set(data) - set(keys)
    if extra:
        raise kconfig.ConfigError(f"{path}: unknown top-level key(s) {sorted(extra)}; use {list(keys)}")
    spec = {k: data.get(k) or {} for k in keys}
    for stem, t in spec["timeouts"].items():
        try:
            kconfig.check_timeout(t)
        except kconfig.ConfigError as e:
            raise kconfig.ConfigError(f"{path}: timeouts.{stem}: {e}") from None
    return spec


def notebook_defaults(path: Path, known: dict | None = None) -> dict:
    """The values of a notebook's ``parameters`` cell, as Python values."""
    import ast

    known = notebook_parameters(path) if known is None else known
    return {name: ast.literal_eval(p["default"]) for name, p in known.items()}


# The kit's notebooks whose parameters are checked by a module of their own, not by a probe's ``check_notebook``: the
# notebooks that are not a probe's, and 07, which four probes share.
TOOL_NOTEBOOKS = {"00_overview.ipynb": "gradkit.notebooks.overview",
                  "05_explorer.ipynb": "gradkit.notebooks.explore",
                  "06_sweep.ipynb": "gradkit.notebooks.sweep",
                  "07_without_deepspeed.ipynb": "gradkit.notebooks.without_ds",
                  "08_new_bug.ipynb": "gradkit.notebooks.bisect_known",
                  "09_watch.ipynb": "gradkit.notebooks.watch"}


def check_notebook_values(path: Path, params: dict, known: dict | None = None, source: str = "") -> list:
    """Every value a kit notebook will run with (its defaults, then ``params``), checked by the notebook's own
    ``check_notebook`` -- before any kernel starts. ``ConfigError`` names the notebook and where the values
    came from; notebooks outside notebooks/ (a user's, a test's) have no such check. Returns the ``(probe,
    stack)`` pairs the notebook's worlds will run (what ``gradkit.stacks.prefetch`` prepares), [] when it does not
    say."""
    import importlib

    if path.parent != NOTEBOOKS.resolve():
        return []
    checks = {name: probe.check_notebook for name, probe in probes.by_notebook().items() if probe.check_notebook}
    checks.update({name: importlib.import_module(module).check_notebook for name, module in TOOL_NOTEBOOKS.items()})
    if path.name not in checks:
        return []
    try:
        values = {**notebook_defaults(path, known), **params}
        if "INTERACTIVE" in values:
            kconfig.interactive(values["INTERACTIVE"])
        return list(checks[path.name](values) or [])
    except kconfig.ConfigError as e:
        raise kconfig.ConfigError(f"{path.name}{f' ({source})' if source else ''}: {e}") from None


def params_for(path: Path, spec: dict, out: Path, aggregate_from: Path | None = None, known: dict | None = None) -> dict:
    known = notebook_parameters(path) if known is None else known
    params = {k: v for k, v in spec["defaults"].items() if k in known}  # defaults apply where they fit
    params.update(spec["notebooks"].get(path.stem, {}))  # named ones must fit
    if "RESULTS_DIR" in known:
        params["RESULTS_DIR"] = str(out)
    if AGGREGATE_PARAMETER in known and aggregate_from is not None and AGGREGATE_PARAMETER not in params:
        params[AGGREGATE_PARAMETER] = str(aggregate_from)
    validate_parameters(path, params, known)
    return params


def resolve_notebook(arg: str) -> Path:
    """A notebook as a command line names it: a path, or a name (with or without .ipynb) in notebooks/."""
    p = Path(arg)
    for cand in (p, NOTEBOOKS / p.name, NOTEBOOKS / f"{p.name}.ipynb"):
        if cand.suffix == ".ipynb" and cand.is_file():
            return cand.resolve()
    raise kconfig.ConfigError(f"no such notebook: {arg} (looked for it as given and in {NOTEBOOKS})")
