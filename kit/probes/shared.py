"""What several probes share on the caller's side (``gradkit.probes.ranks.common`` is what their ranks share): the check
of a split of one batch into micro-batch x GA (B2's and B4's notebooks), and the set-up of the plain-torch path probes
of notebook 07 (``ddp_no_sync``, ``fsdp2``, ``accelerate_ga``): their explorer knobs, their ``PROBE`` and their
``annotate``."""
from __future__ import annotations

from gradkit import config as kconfig
from gradkit.judge import naming
from gradkit.probes.probe import Probe


def check_split(split) -> tuple:
    """A notebook's split ``[micro_batch, GA]``, checked (``ConfigError`` says what is wrong); ``(micro_batch, GA)``."""
    if not isinstance(split, (list, tuple)) or len(split) != 2:
        raise kconfig.ConfigError(f"a split is [micro_batch, GA], got {split!r}")
    mb, ga = split
    kconfig.check_ga(ga)
    kconfig.check_positive_int("micro-batch size", mb)
    return mb, ga


# what the explorer offers every probe of a plain-torch path (notebook 07), and how it asks for one run
KNOBS = {"world_size": [2, 3, 4], "ga": [4, 1, 2, 8], "zero_stage": ["none"], "dtype": ["fp32"],
         "version": ["installed"]}


def explorer_kwargs(sel: dict, device: str, timeout_s: float) -> dict:
    return dict(world_sizes=[sel["world_size"]], ga_values=[sel["ga"]], device=device, timeout_s=timeout_s)


def annotate(rec: dict, **top) -> dict:
    """A plain-torch path's record: its shape (``model``) and ``top`` (e.g. its ``setting``) at the top of the record
    (notebook 07's rows), each step named and described (per parameter group where the shape has several)."""
    rec["model"] = rec["config"].get("model") or "mlp"
    rec.update(top)
    return naming.annotate_steps(rec) if rec.get("steps") else rec


def torch_path_probe(annotate_record=annotate, **fields) -> Probe:
    """The ``PROBE`` of a plain-torch path of notebook 07: a plain torch world (its ranks never import DeepSpeed),
    ``KNOBS`` and ``explorer_kwargs`` unless ``fields`` say otherwise, every case judged against the control of its
    GA and shape, each record annotated by ``annotate_record`` (``annotate`` by default)."""
    return Probe(**{"notebook": "07_without_deepspeed.ipynb", "knobs": KNOBS, "explorer_kwargs": explorer_kwargs,
                    "init": "torch", "control_key": lambda r: (r["ga"], r["config"].get("model")),
                    "annotate": lambda recs: [annotate_record(r) for r in recs], **fields})
