"""The HF Trainer on several ranks inside a rank (``gradkit.probes.trainer_ddp``): B1's machinery, its Trainer run and
its harness, as they are (``gradkit.probes.ranks.trainer_ga``)."""
from __future__ import annotations

from gradkit.probes.ranks import trainer_ga


def run_rank(payload: dict) -> list[dict]:
    return trainer_ga.run_rank(payload)
