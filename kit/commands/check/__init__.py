"""``gradkit check CONFIG``: is the run this config describes affected by a gradient-accumulation bug?

    gradkit check ds_config.json                 # a DeepSpeed config (HF Trainer "auto" values allowed)
    gradkit check train.yaml                     # a training config: LLaMA-Factory, axolotl, TrainingArguments / TRL,
                                                 # an `accelerate config` file, or a launch command line in a .sh file
    gradkit check --command "torchrun --nproc_per_node 8 train.py --deepspeed ds.json --bf16 ..."
    gradkit check configs/ other.json --out table  # many configs: one table (Markdown and JSON), one exit status
    python -m gradkit check ...                      # the same

A config runs on the kit's tiny model in one world of W ranks, in the loops its framework runs (a bare DeepSpeed
config: DeepSpeed's own loop and the Trainer's / Accelerate's; ``--loop`` asks for others, such as your own
``manual`` loop), in every precision it could resolve to, next to a plain torch.distributed control. Per loop it
prints the verdict, the effective/reference ratio, the cosine and the misplaced weight; which known bug explains
an affected loop (``gradkit.judge.expectations``) or "not explained by any known bug"; and the known fix, re-run and
judged. How the config was read, and every value the kit resolved or replaced, is one ``as run:`` line each.

Exit status: 0 not affected, 1 affected (measured), 2 bad input (nothing launched), 3 inconclusive or cannot
run. Over precisions: the worst of those judged; one this machine cannot run counts only where it was asked for
(``gradkit.judge.verdict.over_precisions``). ``--path fsdp2|accelerate|trainer`` asks the same of the paths without
DeepSpeed (``gradkit.commands.check_paths``).
"""
from __future__ import annotations

import json
import shlex
from pathlib import Path

from gradkit import config as kconfig
from gradkit import frameworks, shapes
from gradkit.commands import check_paths
from gradkit.commands.check import many, one, paths, task
from gradkit.commands.check.known import candidates, explain, ruled_out, tied  # noqa: F401 - the check's public face
from gradkit.commands.check.plan import model_of, precisions  # noqa: F401
from gradkit.commands.check.summary import SEPARATING_GA, report, separate, summarise  # noqa: F401
from gradkit.probes import ds_config

DEFAULT_GA = check_paths.DEFAULT_GA


def parser():
    p = kconfig.Parser(prog="gradkit check", description=__doc__.split("\n\n")[0])
    p.add_argument("config", nargs="*", default=[],
                   help="a DeepSpeed JSON config, a training config (LLaMA-Factory / axolotl YAML, TrainingArguments / "
                        "TRL JSON or YAML, `accelerate config` YAML, a launch line in a .sh file), or a folder of "
                        "them; several are checked as one set (with --path accelerate: an `accelerate config` YAML)")
    p.add_argument("--command", default=None, help="the launch command line of your run, as one string")
    p.add_argument("--world-size", type=int, default=None, help="the ranks to run (default: your run's own, where its "
                   "training config or launch line gives it, up to what this machine runs; else 2)")
    p.add_argument("--loop", default=None, help=f"all, or a comma list of {', '.join(ds_config.LOOPS)} (default: the "
                   "loops your framework runs; a bare DeepSpeed config: engine,boundary)")
    p.add_argument("--deepspeed", default=kconfig.INSTALLED, help="a DeepSpeed release, or a comma list of them (a "
                   "matrix: every config at every release; default: the installed one)")
    p.add_argument("--scheduler", default="here", help="where a set's cells run: here (one after another, warm "
                   "worlds), dask (a local Dask cluster), or a Dask scheduler's address (tcp://host:8786)")
    p.add_argument("--ga", type=int, default=None, help="gradient_accumulation_steps where the config says \"auto\" "
                   f"and no training config gives it (default {DEFAULT_GA})")
    p.add_argument("--precision", "--trainer-dtype", dest="precision", default=None, choices=["fp32", "bf16", "fp16"],
                   help="the precision your run resolves to (default: the training config's, else every precision "
                        "an \"auto\" could resolve to)")
    p.add_argument("--steps", type=int, default=ds_config.STEPS, help="optimizer steps per loop style, each judged")
    p.add_argument("--allow-one-rank", action="store_true", help="accept --world-size 1 (it hides every bug that "
                                                                  "lives between ranks)")
    p.add_argument("--model", default=None, help="judge it on a model shape (" + ", ".join(shapes.registry()) + "), "
                   "or on your architecture at toy size: a Hugging Face config.json, its folder, or a model id whose "
                   "config is in the local cache (nothing is downloaded)")
    p.add_argument("--adapter", default=None, help="a PEFT LoRA adapter_config.json to put on --model")
    p.add_argument("--device", default="cpu")
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--json", help="write the records and the summary here")
    p.add_argument("--out", default=None, help="several configs: write the table here as OUT.md and OUT.json")
    check_paths.add_arguments(p)
    return p


def _validate(a) -> None:
    a.releases = [v.strip() for v in str(a.deepspeed).split(",") if v.strip()]
    for v in a.releases or [a.deepspeed]:
        kconfig.check_version(v)
    a.deepspeed = a.releases[0]
    if not (a.scheduler in ("here", "dask") or a.scheduler.startswith(("tcp://", "tls://", "ucx://"))):
        raise kconfig.ConfigError(f"--scheduler must be here, dask or a Dask scheduler's address (tcp://host:8786), "
                                  f"got {a.scheduler!r}")
    kconfig.check_device(a.device)
    kconfig.check_timeout(a.timeout)
    kconfig.check_positive_int("--steps", a.steps)
    kconfig.check_ga(a.ga)
    if a.world_size == 1 and not a.allow_one_rank:
        raise kconfig.ConfigError("--world-size 1 hides every bug that lives between ranks (B4, B5, any reduction); "
                                  "use 2 or more, or add --allow-one-rank to check one rank anyway")
    for flag, path in (("--json", a.json), ("--out", a.out)):
        if path and not Path(path).parent.exists():
            raise kconfig.ConfigError(f"{flag} {path}: the folder {Path(path).parent} does not exist")


def main(argv=None) -> int:
    a = parser().parse_args(argv)
    if a.path != "deepspeed":
        if a.command:
            raise kconfig.ConfigError(f"--path {a.path} takes its settings as flags, not --command")
        return check_paths.main(a)
    a.ga_given, a.ga = a.ga, DEFAULT_GA if a.ga is None else a.ga
    check_paths.refuse_path_flags(a)
    if not a.config and not a.command:
        raise kconfig.ConfigError("gradkit check needs a DeepSpeed config file, a training config, a folder of "
                                  "them, or --command \"your launch line\" (or --path fsdp2|accelerate|trainer)")
    _validate(a)
    files, skipped = many.expand(a.config)
    sources = ([("command", a.command)] if a.command else []) + files
    if len(sources) > 1 or skipped or any(Path(c).is_dir() for c in a.config) or len(a.releases) > 1 or \
            a.scheduler != "here":
        return many.main(sources, skipped, a)
    model, model_notes = model_of(a.model, a.adapter)
    run = frameworks.read_command_line(shlex.split(a.command)) if a.command else task.read(files[0])
    if run.path != "deepspeed":  # the Trainer on DDP, Accelerate, FSDP: their path check, the run's values as flags
        a.world_size = a.world_size or 2
        paths.path_args(run, a)  # refused here, before any launch
        result = paths.check(run, a)
    else:
        result = paths.trainer_side(run, a, one.check(run, one.prepare(run, a, model, model_notes), a, model))
    if a.json:
        out = result["precisions"]
        first = next(iter(out.values()))
        summary = ({**first["summary"], "verdict": result["verdict"], "exit": result["exit"]} if len(out) == 1 else
                   {"verdict": result["verdict"], "exit": result["exit"]})
        doc = {"config_file": str(Path(run.source).resolve()) if Path(run.source).exists() else run.source,
               "framework": run.framework, "summary": summary,
               "records": first["records"] if len(out) == 1 else [], "precisions": out}
        Path(a.json).write_text(json.dumps(doc, indent=1, default=str))
    return result["exit"]


if __name__ == "__main__":
    kconfig.run_cli(main)
