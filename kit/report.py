"""Tables and sentences from records: what the notebooks print and what the run-all summary collects."""
from __future__ import annotations


def fmt(x, digits: int = 4) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.{digits}g}" if abs(x) < 1e-3 and x != 0 else f"{x:.{digits}f}"
    return str(x)


def markdown_table(rows: list[dict], columns: list[str]) -> str:
    head = "| " + " | ".join(columns) + " |\n|" + "|".join("---" for _ in columns) + "|\n"
    return head + "\n".join("| " + " | ".join(fmt(r.get(c)) for c in columns) + " |" for r in rows)


VERDICT_COLUMNS = ["deepspeed", "case", "W", "GA", "optimizer", "ratio", "cosine", "rel_err", "misplaced", "verdict"]


def verdict_rows(recs: list[dict]) -> list[dict]:
    """One row per gradient record (trajectories left out), with the numbers a reader needs."""
    rows = []
    for r in recs:
        if r["role"] == "symptom":
            continue
        m, a = r.get("metrics") or {}, r.get("attribution") or {}
        rows.append({"deepspeed": r.get("versions", {}).get("deepspeed", r["version"]), "case": r["case"],
                     "W": r["world_size"], "GA": r["ga"], "optimizer": r.get("optimizer", "-"),
                     "ratio": m.get("norm_ratio"), "cosine": m.get("cosine"), "rel_err": m.get("rel_l2"),
                     "misplaced": a.get("misplaced_weight"), "verdict": r["verdict"], "reason": r["reason"]})
    return rows


def verdict_table(recs: list[dict]) -> str:
    return markdown_table(verdict_rows(recs), VERDICT_COLUMNS)
