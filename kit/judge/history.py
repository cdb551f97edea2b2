"""The release history: every release a known bug was measured on, by any bisect, the table's refresh or notebook 08,
kept in one place (``history.json`` beside this module, committed) as one **series** per recipe
(``gradkit.commands.bisect.known``: "B5", "B3 opt-out", "B1 on DeepSpeed"), one result per release: the verdict, the
step in words, the ratio of each judged step, the cosine, the misplaced weight, and the command and day that
measured it. The pins of ``gradkit.judge.expectations`` cite it; the timeline figures
(``gradkit.notebooks.history_plots``) and the refresh page draw it.

``merge`` adds a search's results and says which stored results they contradict (a release measured otherwise
now: what moved); ``series`` / ``releases`` read it back in release order.
"""
from __future__ import annotations

import json
from pathlib import Path

from gradkit.stacks.versions import version_key

PATH = Path(__file__).with_name("history.json")
KEPT = ("verdict", "step", "ratios", "cosine", "misplaced_weight", "dtype", "reason")


def load(path: Path | str | None = None) -> dict:
    """``{"series": {name: {"bug", "axis", "with", "releases": {release: result}}}}`` (empty where there is none);
    ``history.json`` beside this module by default."""
    try:
        return json.loads(Path(path or PATH).read_text())
    except FileNotFoundError:
        return {"series": {}}


def save(history: dict, path: Path | str | None = None) -> None:
    """Written sorted (series by name, releases in release order), so that a diff of the file shows what moved."""
    out = {"series": {}}
    for name in sorted(history["series"]):
        s = history["series"][name]
        out["series"][name] = {**s, "releases": {r: s["releases"][r] for r in sorted(s["releases"], key=version_key)}}
    Path(path or PATH).write_text(json.dumps(out, indent=1) + "\n")


def compact(res: dict, how: str, day: str) -> dict:
    """One release's result as the history keeps it: the measured numbers rounded to what tells results apart."""
    out = {k: res.get(k) for k in KEPT if res.get(k) is not None}
    if "ratios" in out:
        out["ratios"] = [round(x, 6) if isinstance(x, (int, float)) else x for x in out["ratios"]]
    for k in ("cosine", "misplaced_weight"):
        if isinstance(out.get(k), float):
            out[k] = round(out[k], 6)
    if out.get("reason"):
        out["reason"] = out["reason"][:200]
    return {**out, "by": how, "on": day}


def merge(history: dict, name: str, bug: str, axis: str, fixed: dict, measured: dict, how: str, day: str,
          same) -> list[str]:
    """Add ``measured`` ({release: result}) to series ``name``; returns one sentence per release whose stored result
    ``same`` (``gradkit.commands.bisect.result.same``) says is another measurement now. A release that cannot run now
    keeps its stored result (a run that failed here says nothing of the release)."""
    s = history["series"].setdefault(name, {"bug": bug, "axis": axis, "with": dict(fixed), "releases": {}})
    moved = []
    for rel, res in measured.items():
        new = compact(res, how, day)
        old = s["releases"].get(rel)
        if old is not None and res["verdict"] in ("cannot-run", "inconclusive") \
                and old["verdict"] not in ("cannot-run", "inconclusive"):
            continue
        if old is not None and not same(old, new):
            moved.append(f"{name} on {axis} {rel}: was {_said(old)} ({old.get('by')}, {old.get('on')}), "
                         f"now {_said(new)}")
        s["releases"][rel] = new
    return moved


def series(history: dict, bug: str | None = None) -> dict:
    """``{name: series}`` of one bug (every series where ``bug`` is None), by name."""
    return {n: s for n, s in sorted(history["series"].items()) if bug is None or s["bug"] == bug}


def releases(s: dict) -> list[tuple[str, dict]]:
    """A series' ``(release, result)`` in release order."""
    return sorted(s["releases"].items(), key=lambda kv: version_key(kv[0]))


def _said(res: dict) -> str:
    ratios = "/".join(f"{x:.3f}" for x in res.get("ratios") or [] if isinstance(x, (int, float)))
    return res["verdict"] + (f" '{res['step']}'" if res.get("step") else "") + (f" ratio {ratios}" if ratios else "")
