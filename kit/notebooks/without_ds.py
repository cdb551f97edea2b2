"""Notebook 07: every accumulation path without DeepSpeed, judged by the same oracle, in one matrix.

Four probes share the notebook (each its own module and matrix row, ``gradkit.probes.registry()``): torch DDP
``no_sync`` (``DDP``), FSDP2 ``fully_shard`` (``FSDP2``), Accelerate ``accumulate()`` (``ACC``) and the HF Trainer
on several ranks (``HFT``). This module is the notebook's logic: its parameters (``check_notebook``), its runs
(``run``), the matrix path x setting x release (``matrix_rows``), the code behind every cell that is not exact
(``mechanisms``) and what the notebook asserts (``violations``: each probe's claims and ``kit/judge/expectations.py``).
"""
from __future__ import annotations

from gradkit import config as kconfig
from gradkit import probes
from gradkit.judge import expectations, oracle
from gradkit.judge import tables
from gradkit.probes import accelerate_ga, ddp_no_sync, fsdp2, trainer_ddp
from gradkit.stacks import source
from gradkit.stacks import versions as kversions
from gradkit.stacks.versions import version_key

PARAMETERS = ("WORLD_SIZES", "GA_VALUES", "MICRO_BATCH", "HIDDEN", "MODELS", "FSDP2_SETTINGS", "ACCELERATE_VERSIONS",
              "ACCELERATE_MODELS", "TRAINER_STACKS", "TRAINER_GAS", "TRAINER_WORLD_SIZES", "SEED", "DEVICE", "TIMEOUT_S")
PATHS = ("DDP", "FSDP2", "ACC", "HFT")  # the matrix's rows, in order


def accelerate_stack(version: str) -> dict:
    return {} if version == kconfig.INSTALLED else {"accelerate": version}


def check_notebook(p: dict) -> list:
    """Every parameter of notebook 07 (``gradkit.notebooks.runall`` runs it before any kernel); the ``(probe, stack)`` pairs its
    worlds will run (``gradkit.stacks.prefetch`` installs the overlays up front)."""
    ddp_no_sync.validate(p["WORLD_SIZES"], p["GA_VALUES"], p["DEVICE"], p["TIMEOUT_S"], p["MODELS"])
    fsdp2.validate(p["WORLD_SIZES"], p["GA_VALUES"], p["DEVICE"], p["TIMEOUT_S"], p["MODELS"], p["FSDP2_SETTINGS"])
    kconfig.check_list("ACCELERATE_VERSIONS", p["ACCELERATE_VERSIONS"])
    for v in p["ACCELERATE_VERSIONS"]:
        kconfig.check_version(v)
    kconfig.check_list("TRAINER_STACKS", p["TRAINER_STACKS"])
    unknown = [s for s in p["TRAINER_STACKS"] if s not in trainer_ddp.STACKS]
    if unknown:
        raise kconfig.ConfigError(f"TRAINER_STACKS: unknown {unknown}; the kit knows {list(trainer_ddp.STACKS)}")
    trainer_ddp.validate([trainer_ddp.STACKS[s] for s in p["TRAINER_STACKS"]], p["TRAINER_GAS"], tuple(trainer_ddp.CASES),
                         p["TRAINER_WORLD_SIZES"], 8, p["DEVICE"], p["TIMEOUT_S"])
    if 1 in p["TRAINER_WORLD_SIZES"] or 1 in p["TRAINER_GAS"]:
        raise kconfig.ConfigError("TRAINER_WORLD_SIZES and TRAINER_GAS: the Trainer is checked on several ranks, "
                                  "accumulating (each > 1)")
    stacks = [accelerate_stack(v) for v in p["ACCELERATE_VERSIONS"]]
    accelerate_ga.validate(p["WORLD_SIZES"], p["GA_VALUES"], p["DEVICE"], p["TIMEOUT_S"], p["ACCELERATE_MODELS"], stacks)
    return [(ddp_no_sync.PROBE, {}), (fsdp2.PROBE, {}), *[(accelerate_ga.PROBE, s) for s in stacks],
            *[(trainer_ddp.PROBE, trainer_ddp.STACKS[s]) for s in p["TRAINER_STACKS"]]]


def run(p: dict) -> list[dict]:
    """Every path's records, with the notebook's parameters (``p``: its globals)."""
    common = dict(micro_batch=p["MICRO_BATCH"], hidden=p["HIDDEN"], seed=p["SEED"], device=p["DEVICE"],
                  timeout_s=p["TIMEOUT_S"], models=p["MODELS"])
    recs = ddp_no_sync.run(world_sizes=p["WORLD_SIZES"], ga_values=p["GA_VALUES"], **common)
    recs += fsdp2.run(world_sizes=p["WORLD_SIZES"], ga_values=p["GA_VALUES"], settings=p["FSDP2_SETTINGS"], **common)
    recs += accelerate_ga.run(world_sizes=p["WORLD_SIZES"], ga_values=p["GA_VALUES"],
                              stacks=[accelerate_stack(v) for v in p["ACCELERATE_VERSIONS"]],
                              **{**common, "models": p["ACCELERATE_MODELS"]})
    recs += trainer_ddp.run(stacks=[trainer_ddp.STACKS[s] for s in p["TRAINER_STACKS"]], gas_values=p["TRAINER_GAS"],
                            world_sizes=p["TRAINER_WORLD_SIZES"], seed=p["SEED"], device=p["DEVICE"],
                            timeout_s=p["TIMEOUT_S"])
    return recs


def release(rec: dict) -> str:
    """The release a record's verdict belongs to: the package its probe pins (torch for DDP and FSDP2)."""
    v = rec.get("versions") or {}
    package = {"ACC": "accelerate", "HFT": "transformers"}.get(rec["bug"], "torch")
    return f"{package} {v.get(package, rec.get('version', '?'))}"


def setting(rec: dict) -> str:
    return rec.get("setting") or (rec.get("config") or {}).get("setting") or ""


def row_key(rec: dict) -> str:
    s = setting(rec)
    return f"{rec['bug']} · {rec['case']}" + (f" [{s}]" if s and rec["bug"] == "FSDP2" else "")


def in_matrix_order(recs: list[dict]) -> list[dict]:
    """The records by path (``PATHS``) then release, oldest first: the matrix figure's rows and columns."""
    return sorted(recs, key=lambda r: (PATHS.index(r["bug"]) if r["bug"] in PATHS else 9,
                                       version_key(release(r).split()[-1])))


def matrix_rows(recs: list[dict]) -> list[dict]:
    """One row per (path, case, setting, release): the worst verdict over world sizes, GAs and models, with the
    ratio, cosine and misplaced weight of its worst record (the harness and controls included: they must be exact)."""
    order = {v: i for i, v in enumerate(oracle.WORST_FIRST)}
    groups: dict = {}
    for r in recs:
        if r.get("role") == "symptom":
            continue
        groups.setdefault((r["bug"], r["case"], setting(r) if r["bug"] == "FSDP2" else "", release(r)), []).append(r)
    rows = []
    for (bug, case, st, rel), group in groups.items():
        worst = min(group, key=lambda r: (order.get(r["verdict"], 9), -abs(((r.get("metrics") or {}).get("norm_ratio") or 1) - 1)))
        m = worst.get("metrics") or {}
        a = worst.get("attribution") or {}
        rows.append({"path": bug, "case": case, "setting": st, "release": rel, "role": worst["role"],
                     "verdict": worst["verdict"], "configs": len(group),
                     "ratio": m.get("norm_ratio"), "cosine": m.get("cosine"),
                     "misplaced": a.get("misplaced_weight"), "shape": worst.get("shape") or "",
                     "where": f"W={worst['world_size']} GA={worst['ga']} {worst.get('model', '')}".strip(),
                     "reason": worst["reason"]})
    return sorted(rows, key=lambda r: (PATHS.index(r["path"]) if r["path"] in PATHS else 9, r["case"], r["setting"],
                                       r["release"]))


def markdown(rows: list[dict]) -> str:
    def num(x, f):
        return "-" if x is None else format(x, f)

    table = [{"path": r["path"], "case": r["case"] + (f" [{r['setting']}]" if r["setting"] else ""),
              "release": r["release"], "verdict": r["verdict"], "ratio": num(r["ratio"], ".4f"),
              "cosine": num(r["cosine"], ".6f"), "misplaced": num(r["misplaced"], ".3f"),
              "what the step was": r["shape"] if r["verdict"] != "cannot-run" else r["reason"][:120]}
             for r in rows]
    return tables.markdown_table(table, list(table[0])) if table else "(no records)"


def _tf_before(rec: dict, version: str) -> bool:
    return version_key((rec.get("versions") or {}).get("transformers", "0")) < version_key(version)


def _affected(rec: dict) -> bool:
    return rec["verdict"] == "affected"


def _raised(text: str):
    return lambda rec: rec["verdict"] == "cannot-run" and text in (rec.get("error") or "")


# (path, case, which records it explains, package, file, function, marks, what the lines do)
MECHANISMS = (
    ("ACC", "sync_each_batch", _affected, "accelerate", "accelerate/accelerator.py", "Accelerator.accumulate",
     ("sync_each_batch",),
     "sync_each_batch forces sync_gradients to True on every micro-batch; the prepared optimizer steps whenever "
     "sync_gradients is True, so it steps on every micro-batch (fixed by huggingface/accelerate#2790, 0.31.0)"),
    ("ACC", "last_window", _affected, "accelerate", "accelerate/accelerator.py", "Accelerator.backward",
     ("loss = loss / self.gradient_accumulation_steps",),
     "backward divides every loss by the GA it was given, also in a last window that holds fewer micro-batches "
     "(documented: huggingface/accelerate#1847)"),
    ("HFT", "trainer", lambda r: _affected(r) and _tf_before(r, "4.46.0"), "transformers", "transformers/trainer.py",
     "Trainer.training_step", ("self.compute_loss(model, inputs)", "self.accelerator.backward(loss"),
     "each micro-batch's loss is the mean over its own label tokens and Accelerate divides it by GAS: micro-batches "
     "with fewer tokens weigh more (fixed by huggingface/transformers#34191, 4.46.0)"),
    ("HFT", "avg_tokens_on", lambda r: _affected(r) and _tf_before(r, "5.4.0"), "transformers",
     "transformers/trainer.py", "Trainer.get_batch_samples", ("num_items_in_batch",),
     "num_items_in_batch counts labels before the model shifts them: one token too many per sequence (B1)"),
    ("HFT", "trainer", lambda r: _affected(r) and not _tf_before(r, "4.46.0") and _tf_before(r, "5.4.0"),
     "transformers", "transformers/trainer.py", "Trainer.get_batch_samples", ("num_items_in_batch",),
     "num_items_in_batch counts labels before the model shifts them (one token too many per sequence, B1), and "
     "without average_tokens_across_devices (off by default before 5.0) each rank divides by its own count"),
    ("HFT", "avg_tokens_off", lambda r: _affected(r) and not _tf_before(r, "5.4.0"), "transformers",
     "transformers/trainer.py", "Trainer._get_num_items_in_batch", ("average_tokens_across_devices",),
     "average_tokens_across_devices=False: each rank divides its summed token loss by its own token count and DDP "
     "averages the ranks, so a rank with fewer label tokens weighs more (documented)"),
    ("HFT", "trainer", lambda r: _affected(r) and (r.get("config") or {}).get("trainer_attrs", {}).get(
        "model_accepts_loss_kwargs") is False, "transformers", "transformers/trainer.py", "Trainer.compute_loss",
     ("model_accepts_loss_kwargs",),
     "model_accepts_loss_kwargs=False (axolotl sets it for transformers' models, axolotl-ai-cloud/axolotl#3982): the "
     "Trainer hands the model no num_items_in_batch, so each micro-batch's loss is the mean over its own label tokens "
     "and the step is the mean of the micro-batch means: micro-batches with fewer tokens weigh more"),
    ("HFT", "trainer", lambda r: _affected(r) and not _tf_before(r, "5.4.0") and (r.get("config") or {}).get(
        "trainer_args", {}).get("average_tokens_across_devices") is False, "transformers", "transformers/trainer.py",
     "Trainer._get_num_items_in_batch", ("average_tokens_across_devices",),
     "average_tokens_across_devices=False: each rank divides its summed token loss by its own token count and DDP "
     "averages the ranks, so a rank with fewer label tokens weighs more (documented)"),
    ("FSDP2", "sync_last", _raised("_unsharded_param"), "torch", "torch/distributed/fsdp/_fully_shard/_fsdp_param.py",
     "FSDPParam.to_accumulated_grad_if_needed", ("_unsharded_param.grad",),
     "reads _unsharded_param of a parameter whose unit never ran its forward in that micro-batch (never unsharded): "
     "AttributeError (pytorch/pytorch#194058)"),
    ("FSDP2", "sync_last", _raised("uniform gradient dtype"), "torch",
     "torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py", "foreach_reduce", ("uniform gradient dtype",),
     "a parameter first used by the last micro-batch brings a fresh bf16 gradient beside accumulated fp32 ones "
     "(pytorch/pytorch#196996)"),
)


def mechanisms(recs: list[dict]) -> list[dict]:
    """For every mechanism whose cell was measured off the reference or raised, the lines of the code that ran
    (the installed package, or the overlay of the release that ran): ``{"cell", "sentence", "code"}``."""
    out, seen = [], set()
    for path, case, explains, package, relpath, qualname, marks, sentence in MECHANISMS:
        for r in recs:
            if r["bug"] != path or r["case"] != case or not explains(r):
                continue
            version = (r.get("versions") or {}).get(package) or kconfig.INSTALLED
            if version.split("+")[0] == kversions.installed_version(package).split("+")[0]:
                version = kconfig.INSTALLED
            if (path, case, qualname, version) in seen:
                continue
            try:
                code = source.excerpt(package, relpath, qualname, marks, version=version) or "(not found)"
            except Exception as e:  # noqa: BLE001 - a source that cannot be read is said, not fatal
                code = f"(the source of {package} {version} could not be read: {e})"
            seen.add((path, case, qualname, version))
            # the lines without the header (the file of each release) and without their numbers
            body = [line[9:] for line in code.split("\n")[1:]]
            same = next((m for m in out if m["path"] == path and m["case"] == case and m["body"] == body), None) \
                if body else None  # two sources that could not be read are not the same lines
            if same is not None:  # another release ships the same lines: named, not printed again
                same["releases"].append(release(r))
                same["cell"] = f"{path} · {case} on {', '.join(same['releases'])}"
                continue
            out.append({"cell": f"{path} · {case} on {release(r)}", "sentence": sentence, "code": code, "path": path,
                        "case": case, "releases": [release(r)], "body": body})
    for m in out:
        del m["body"]
    return out


def violations(recs: list[dict]) -> list[str]:
    """Every probe's own claims, and every verdict on a release ``kit/judge/expectations.py`` pins equal to the table's."""
    bad = []
    for bug in PATHS:
        mine = [r for r in recs if r["bug"] == bug]
        if not mine:
            bad.append(f"{bug}: no records")
            continue
        bad += probes.get(bug).violations(mine)
        if bug in expectations.KNOWN:
            wrong, _ = expectations.mismatches(bug, mine)
            bad += wrong
    return bad


def findings(recs: list[dict]) -> list[str]:
    """What ``kit/judge/expectations.py`` does not pin: a newer release's verdict, said as a finding."""
    out = []
    for bug in PATHS:
        if bug in expectations.KNOWN:
            out += expectations.mismatches(bug, [r for r in recs if r["bug"] == bug])[1]
    return out


# (path, broken case, fix case, how the fix's records are chosen, what the fix is)
FIXES = (
    ("ACC", "sync_each_batch", "sync_each_batch", "newer", "accelerate >= 0.31.0 (huggingface/accelerate#2790)"),
    ("ACC", "last_window", "last_window_fixed", "same", "scale the last window's loss by GA / its micro-batches"),
    ("ACC", "accumulate_ragged", "tokens_global", "same", "sum the loss and divide by the window's item count "
                                                          "gathered over every rank, x W x GA (Accelerate's docs)"),
    ("ACC", "tokens_local", "tokens_global", "same", "gather the item count over every rank (accelerator.gather)"),
    ("FSDP2", "sync_last", "sync_last", "bf16 reduce", "reduce_dtype=bf16 (or fp32 params) until pytorch#194058 / "
                                                       "#196996 land"),
    ("HFT", "avg_tokens_off", "avg_tokens_on", "same", "average_tokens_across_devices=True"),
    ("HFT", "trainer", "trainer", "newer", "transformers 5.23.0 (the installed release)"),
)


def fixes(recs: list[dict]) -> list[dict]:
    """Each problem measured here next to its fix measured in the same run: ``{"problem", "fix", "before", "after",
    "expected_after", "ratio_before", "ratio_after"}``; ``after`` is the fix's worst verdict (``not-affected`` where
    the fix works), ``expected_after`` what ``kit/judge/expectations.py`` pins for it (None: not pinned; a fix can leave
    another bug of the same release in place). Only problems that were measured (affected, or FSDP2's raises) and
    whose fix ran are listed."""
    order = {v: i for i, v in enumerate(oracle.WORST_FIRST)}

    def worst(group):
        return min(group, key=lambda r: order.get(r["verdict"], 9)) if group else None

    out = []
    for path, broken, fixed, how, what in FIXES:
        bad = [r for r in recs if r["bug"] == path and r["case"] == broken and (
            r["verdict"] == oracle.AFFECTED if path != "FSDP2" else r["verdict"] == oracle.CANNOT_RUN)]
        for rel in sorted({release(r) for r in bad}):
            mine = [r for r in bad if release(r) == rel]
            if how == "same":
                after = [r for r in recs if r["bug"] == path and r["case"] == fixed and release(r) == rel]
            elif how == "newer":
                newest = max((release(r) for r in recs if r["bug"] == path and r["case"] == fixed),
                             key=lambda x: version_key(x.split()[-1]), default=None)
                after = [r for r in recs if r["bug"] == path and r["case"] == fixed and release(r) == newest] \
                    if newest and version_key(newest.split()[-1]) > version_key(rel.split()[-1]) else []
            else:  # FSDP2: the same model and GA with a bf16 reduce
                where = {(r["world_size"], r["ga"], r.get("model")) for r in mine}
                after = [r for r in recs if r["bug"] == path and r["case"] == fixed and setting(r) == "bf16 / bf16 reduce"
                         and (r["world_size"], r["ga"], r.get("model")) in where]
            a, b = worst(mine), worst(after)
            if b is None:
                continue
            want = expectations.expected(path, b.get("versions") or {}, case=fixed) if path in expectations.KNOWN \
                else None
            out.append({"problem": f"{path} · {broken} on {rel}", "fix": what, "before": a["verdict"],
                        "after": b["verdict"], "expected_after": want, "fix_release": release(b),
                        "ratio_before": (a.get("metrics") or {}).get("norm_ratio"),
                        "ratio_after": (b.get("metrics") or {}).get("norm_ratio"), "configs_after": len(after)})
    return out
