"""Probe results as JSON records: their format, their files, and how to read them (``gradkit.probes.runner`` makes
them).

A record is a flat dict: what ran (bug, probe, case, role, config, seed, world size, GA,
dtype, requested and imported versions, device), what was measured (metrics, attribution,
per-rank accumulator norms), and the verdict with its one-sentence reason. Records never
hold tensors; they are written as JSON lines and read back by notebooks and the summary.
"""
from __future__ import annotations

import datetime
import json
import os
import platform
import uuid
from pathlib import Path

from gradkit import config as kconfig
from gradkit.judge import oracle
from gradkit.stacks import versions
from gradkit.stacks.versions import version_key

RUN_ID_ENV = "GRADKIT_RUN_ID"
# {"run_id", "notebooks": {name: status}}, written by gradkit.notebooks.runall: which records are whose
RUN_FILE = "run.json"
# One id per run: gradkit.notebooks.runall sets it for every notebook it starts; a kernel or script on its own gets its
# own.
RUN_ID = os.environ.get(RUN_ID_ENV) or f"{datetime.datetime.now():%Y%m%dT%H%M%S}-{uuid.uuid4().hex[:6]}"

RECORD_KEYS = ("bug", "probe", "case", "role", "version", "versions", "device", "world_size", "seed", "ga",
               "dtype", "config", "metrics", "verdict", "reason", "run_id")


def base(meta: dict, case: dict, version: str) -> dict:
    return {**meta, "case": case["name"], "role": case["role"], "ga": case["ga"], "dtype": case["dtype"],
            "judge_dtype": case.get("judge_dtype", case["dtype"]),
            "zero_stage": case.get("zero_stage"), "config": case, "version": version,
            "host": platform.node(), "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "run_id": RUN_ID}


def failed_records(cases: list[dict], meta: dict, version: str, reason: str, versions: dict | None = None) -> list[dict]:
    """Every case of a world that could not run: verdict ``cannot-run``, never ``not-affected``."""
    return [{**base(meta, case, version), "versions": versions or {}, "metrics": None, "error": reason,
             "verdict": oracle.CANNOT_RUN, "reason": f"could not run: {reason}"} for case in cases]


def judged(rec: dict, dtype: str | None = None) -> dict:
    """What the oracle judges of a record (or of one part, e.g. a pipeline stage, given the record's ``dtype``):
    every signal the probe measured (``oracle.JUDGED_KEYS``)."""
    out = {k: rec.get(k) for k in oracle.JUDGED_KEYS}
    out["dtype"] = dtype or judge_dtype(rec)
    return out


def judge_dtype(rec: dict) -> str:
    """The precision a record is judged at: the coarsest its gradient passed through (``judge_dtype``: e.g. an
    fp32 model whose gradients are reduced in bf16 is judged at bf16's limits), else its model's dtype."""
    return rec.get("judge_dtype") or rec["dtype"]


def save(recs: list[dict], path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for r in recs:
            f.write(json.dumps(r, sort_keys=True) + "\n")
    return path


def append(rec: dict, path) -> Path:
    """One record added at the end of a JSON-lines file (made with its folder where there is none): a job that
    writes as it goes (the watch) keeps every record written before it stopped."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(rec, sort_keys=True) + "\n")
    return path


def load(path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def run_records(folder, notebooks=None) -> tuple[list[dict], list[str]]:
    """The records of the last run into ``folder``: only notebooks that ran to the end, only records of that run.

    Reads ``run.json`` (written by ``run``); ``notebooks`` limits the stems read. Returns the records and one
    line per notebook saying what was used or why not. A relative ``folder`` is the repository's.
    """
    folder = kconfig.repo_path(folder)
    try:
        run = json.loads((folder / RUN_FILE).read_text())
    except (OSError, ValueError) as e:
        raise FileNotFoundError(f"no readable {RUN_FILE} in {folder} ({type(e).__name__}): it is written by `python -m "
                                "gradkit.notebooks.runall`; run that first, or run the probes here") from None
    out, said = [], []
    for name, entry in sorted(run["notebooks"].items()):
        stem = Path(name).stem
        path = folder / f"{stem}.jsonl"
        if notebooks is not None and stem not in notebooks:
            continue
        # each notebook of the folder with the run that last executed it ({"status", "run_id"}; a bare status:
        # a run.json where every notebook belongs to the top-level run)
        status, rid = (entry, run["run_id"]) if isinstance(entry, str) else (entry["status"], entry["run_id"])
        if status != "ok":
            said.append(f"{stem}: not used ({status}: its records never reach the matrix)")
            continue
        if not path.exists():
            continue
        mine = [r for r in load(path) if r.get("run_id") == rid]
        said.append(f"{stem}: {len(mine)} records of run {rid}")
        out += mine
    return out, said


def select(recs: list[dict], **where) -> list[dict]:
    return [r for r in recs if all(r.get(k) == v for k, v in where.items())]


def group_by(recs: list[dict], keys: tuple, **where) -> dict:
    """``{(rec[k] for k in keys): [records]}`` over the records matching ``where``."""
    out: dict = {}
    for r in select(recs, **where):
        out.setdefault(tuple(r.get(k) for k in keys), []).append(r)
    return out


def one(recs: list[dict], **where) -> dict:
    found = select(recs, **where)
    if len(found) != 1:
        raise LookupError(f"expected one record with {where}, found {len(found)}")
    return found[0]


def check(rec: dict) -> None:
    """A record has every key a reader relies on, and a known verdict."""
    missing = [k for k in RECORD_KEYS if k not in rec]
    if missing:
        raise ValueError(f"record lacks {missing}")
    if rec["verdict"] not in oracle.VERDICTS + ("n/a",):
        raise ValueError(f"unknown verdict {rec['verdict']!r}")


def deepspeed_version(rec: dict) -> str:
    """The DeepSpeed release a record really imported (its request where it never got that far, the installed
    one for an "installed" request); ``NO_DEEPSPEED`` for a step whose path or probe never uses DeepSpeed."""
    if rec.get("path", (rec.get("config") or {}).get("path")) == "no_ds" or rec.get("init") == "torch":
        return NO_DEEPSPEED
    got = (rec.get("versions") or {}).get("deepspeed") or (rec.get("stack") or {}).get("deepspeed")
    if got:
        return got
    label = rec.get("version", "")
    return versions.installed_version("deepspeed") if label in (kconfig.INSTALLED, "") else label.split("=")[-1]


NO_DEEPSPEED = "none"  # the matrix column of steps that never went through DeepSpeed


def column_key(v: str):
    """The matrix's column order: no DeepSpeed first, then DeepSpeed releases oldest first."""
    return (-1,) if v == NO_DEEPSPEED else version_key(v)


def column_label(v: str, installed: str) -> str:
    return "no DeepSpeed" if v == NO_DEEPSPEED else f"{v} (installed)" if v == installed else v
