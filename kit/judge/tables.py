"""Tables and sentences from records: what the notebooks print and what the run-all summary collects."""
from __future__ import annotations

from gradkit.judge import oracle


def fmt(x, digits: int = 4) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.{digits}g}" if abs(x) < 1e-3 and x != 0 else f"{x:.{digits}f}"
    return str(x)


def markdown_table(rows: list[dict], columns: list[str]) -> str:
    head = "| " + " | ".join(columns) + " |\n|" + "|".join("---" for _ in columns) + "|\n"
    return head + "\n".join("| " + " | ".join(fmt(r.get(c)) for c in columns) + " |" for r in rows)


VERDICT_COLUMNS = ["deepspeed", "case", "stage", "dtype", "W", "GA", "optimizer", "ratio", "cosine", "rel_err", "misplaced",
                   "ratio per step (* off)", "verdict"]


def per_step(rec: dict) -> str:
    """Every judged step's ratio, ``*`` where that step is off (the record's numbers are its worst step's)."""
    steps = rec.get("steps") or []
    dtype = rec.get("judge_dtype") or rec["dtype"]
    return " / ".join(f"{s['metrics']['norm_ratio']:.3f}{'*' if oracle.severity({**s, 'dtype': dtype}) > 1 else ''}"
                      for s in steps) or "-"


def verdict_rows(recs: list[dict]) -> list[dict]:
    """One row per gradient record (trajectories left out), with the numbers a reader needs."""
    rows = []
    for r in recs:
        if r["role"] == "symptom":
            continue
        m, a = r.get("metrics") or {}, r.get("attribution") or {}
        rows.append({"deepspeed": r.get("versions", {}).get("deepspeed", r["version"]), "case": r["case"],
                     "stage": r.get("zero_stage"), "dtype": r["dtype"], "W": r["world_size"], "GA": r["ga"],
                     "optimizer": r.get("optimizer", "-"),
                     "ratio": m.get("norm_ratio"), "cosine": m.get("cosine"), "rel_err": m.get("rel_l2"),
                     "misplaced": a.get("misplaced_weight"), "ratio per step (* off)": per_step(r),
                     "verdict": r["verdict"], "reason": r["reason"],
                     "model": (r.get("config") or {}).get("model") or "mlp"})
    return rows


def cannot_run_summary(recs: list[dict]) -> str:
    """Plain sentences for the cases that could not run, grouped by why; a world that lost a rank is said so."""
    why: dict = {}
    for r in recs:
        if r.get("verdict") == "cannot-run":
            why.setdefault(r["reason"].split("\n")[0][:400], []).append(r)
    lines = []
    for reason, sel in why.items():
        lost = " died: " in reason or "killed by signal" in reason
        head = "The world LOST A RANK" if lost else "Could not run"
        cases = sorted({f"{r['case']} (GA {r['ga']})" for r in sel})
        lines.append(f"{head}: {len(sel)} case(s) are cannot-run ({', '.join(cases[:8])}"
                     f"{', ...' if len(cases) > 8 else ''}) because {reason}")
    return "\n".join(lines) or f"every one of the {len(recs)} cases ran"


def verdict_table(recs: list[dict]) -> str:
    """``verdict_rows`` as markdown; a ``model`` column where the records ran on more than one model shape."""
    rows = verdict_rows(recs)
    several = len({r["model"] for r in rows}) > 1
    return markdown_table(rows, (["model"] if several else []) + VERDICT_COLUMNS)


# Named columns any probe's records can be tabled by: name -> function of a record.
FIELDS = {
    "deepspeed": lambda r: r.get("versions", {}).get("deepspeed", r["version"]),
    "case": lambda r: r["case"],
    "W": lambda r: r["world_size"],
    "GA": lambda r: r["ga"],
    "N": lambda r: r["ga"],
    "stage": lambda r: r.get("zero_stage"),
    "dtype": lambda r: r["dtype"],
    "optimizer": lambda r: r.get("optimizer", "-"),
    "ratio": lambda r: (r.get("metrics") or {}).get("norm_ratio"),
    "cosine": lambda r: (r.get("metrics") or {}).get("cosine"),
    "rel_err": lambda r: (r.get("metrics") or {}).get("rel_l2"),
    "misplaced": lambda r: (r.get("attribution") or {}).get("misplaced_weight"),
    "matches": lambda r: r.get("matches") or "-",
    "per step": per_step,
    "verdict": lambda r: r["verdict"],
    "reason": lambda r: r["reason"],
}


def table(recs: list[dict], columns: list[str]) -> str:
    """A markdown table of ``recs`` with the named ``FIELDS`` as columns (trajectories left out)."""
    rows = [{c: FIELDS[c](r) for c in columns} for r in recs if r.get("role") != "symptom"]
    return markdown_table(rows, columns)
