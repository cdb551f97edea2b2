"""A launch command line (``torchrun ... train.py --deepspeed ds.json --bf16 ...``), or a shell script holding one,
-> ``TrainingRun``: the launcher gives ranks and environment (``launchers``), the program's arguments or config file
give the framework's settings (HfArgumentParser's rules for script flags: ``hf_args.parse_cli``)."""
from __future__ import annotations

import os
import re
import shlex
from pathlib import Path

from gradkit.config import ConfigError
import gradkit.frameworks.accelerate_cfg as accelerate_cfg
import gradkit.frameworks.attach_args as attach
import gradkit.frameworks.axolotl as axolotl
import gradkit.frameworks.ds_rules as ds_rules
import gradkit.frameworks.hf_args as hf_args
import gradkit.frameworks.launchers as launchers
import gradkit.frameworks.llamafactory as llamafactory
from gradkit.frameworks.dispatch import detect_data, read_data
from gradkit.frameworks.run import (
    Launch,
    TrainingRun,
    find_file,
    load_ds_json,
    load_mapping,
)

ASSIGN = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
WRAPPERS = ("nohup", "exec", "time", "env", "command")
OPERATORS = ("|", "||", "&&", ";", "&")
LAUNCHERS = ("torchrun", "deepspeed", "accelerate", "llamafactory-cli", "lmf", "axolotl", "trl")
PYTHON = re.compile(r"^python(\d+(\.\d+)?)?$")
TORCHRUN_MODULES = ("torch.distributed.run", "torch.distributed.launch")
NOT_TRAINING = ("pip", "venv", "ensurepip", "json.tool", "http.server")
CONFIG_SUFFIXES = (".yaml", ".yml", ".json")
KNOWN = ("torchrun, python -m torch.distributed.run, deepspeed, accelerate launch, llamafactory-cli train, "
         "axolotl train, trl <command> or python")


PLACEHOLDER = re.compile(r"^<[^<>]+>$")  # a README's "<your_data_path>": a value to fill in, not a redirection


def _substitute(tokens: list[str], env: dict) -> list[str]:
    return [launchers.SHELL_VAR.sub(lambda m: str(env[m.group(1)]) if m.group(1) in env else m.group(0), t)
            for t in tokens]


def _command(tokens: list[str], env: dict) -> list[str]:
    """The command itself: leading VAR=value (into ``env``) and wrappers (nohup, env ...) off, redirections and
    what follows a pipe or ``&&`` cut."""
    i = 0
    while i < len(tokens) and (ASSIGN.match(tokens[i]) or tokens[i] in WRAPPERS):
        if ASSIGN.match(tokens[i]):
            k, _, v = tokens[i].partition("=")
            env[k] = v
        i += 1
    out = []
    for t in tokens[i:]:
        if t in OPERATORS or re.match(r"^\d?>", t) or t.startswith("<") and not PLACEHOLDER.match(t):
            break
        out.append(t)
    return out


def _is_launch(tokens: list[str]) -> bool:
    if not tokens:
        return False
    prog = os.path.basename(tokens[0])
    if prog in LAUNCHERS:
        return True
    if PYTHON.match(prog):
        return len(tokens) > 1 and not (tokens[1] == "-m" and len(tokens) > 2 and tokens[2] in NOT_TRAINING)
    return False


def split_script(text: str, source: str) -> tuple[list[str], dict]:
    """The launch line of a shell script and the variables set before it: lines joined at trailing backslashes,
    comments skipped, ``VAR=value`` / ``export VAR=value`` lines collected for ``$VAR`` and the launcher."""
    logical, buf = [], ""
    for raw in text.splitlines():
        line = raw.rstrip()
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        logical.append(buf + line)
        buf = ""
    if buf:
        logical.append(buf)
    env: dict = {}
    for line in logical:
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        try:
            tokens = shlex.split(line, comments=True)
        except ValueError as e:
            raise ConfigError(f"{source}: cannot read the line {line.strip()[:60]!r}: {e}") from None
        if tokens and tokens[0] == "export":
            tokens = tokens[1:]
        if tokens and all(ASSIGN.match(t) for t in tokens):
            for t in _substitute(tokens, env):
                k, _, v = t.partition("=")
                env[k] = v
            continue
        line_tokens = _substitute(tokens, env)  # as the shell expands it: a VAR=value prefix is not seen yet
        if _is_launch(_command(list(line_tokens), {})):
            return line_tokens, env
    raise ConfigError(f"{source} holds no launch command ({KNOWN})")


def read_command_file(path, cwd=None) -> TrainingRun:
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise ConfigError(f"cannot read {p}: {e.strerror or e}") from None
    argv, env = split_script(text, str(p))
    run = read_command_line(argv, cwd=cwd, env=env, base_dir=p.parent)
    run.notes.insert(0, f"command line from {p}: {shlex.join(argv)}")
    return run


def read_command_line(argv: list[str], cwd=None, *, env: dict | None = None, base_dir=None) -> TrainingRun:
    """A launch command (``shlex.split`` of it). Paths in it are looked up relative to ``base_dir`` (the script's
    folder, for a file), then ``cwd`` (default: the working directory). ``env``: shell variables set before it (a
    script's ``export X=...``); the calling process's environment is not read, so the answer depends on the line only.
    """
    if isinstance(argv, str):
        raise ConfigError("read_command_line takes the command split into a list (shlex.split), not a string")
    env = dict(env or {})
    cwd = Path(cwd) if cwd is not None else Path.cwd()
    base_dir = Path(base_dir) if base_dir is not None else cwd
    tokens = _command(_substitute([str(a) for a in argv], env), env)
    if not tokens:
        raise ConfigError("the command line is empty")
    prog, rest = os.path.basename(tokens[0]), tokens[1:]
    kw = {"base_dir": base_dir, "cwd": cwd}
    if prog == "torchrun":
        launch, program, module = launchers.torchrun(rest)
    elif prog == "deepspeed":
        launch, program, module = launchers.deepspeed(rest)
    elif prog == "accelerate":
        if not rest or rest[0] != "launch":
            raise ConfigError(f"accelerate {rest[0] if rest else ''}: only accelerate launch starts training")
        launch, program, module = launchers.accelerate(rest[1:], **kw)
    elif prog in ("llamafactory-cli", "lmf"):
        if not rest or rest[0] != "train" or len(rest) < 2:
            raise ConfigError(f"{prog}: the kit reads '{prog} train <config.yaml> [key=value ...]'")
        launch = launchers.llamafactory(env)
        return _finish(_llamafactory(rest[1:], launch, **kw), launch, prog)
    elif prog == "axolotl":
        if not rest or rest[0] != "train" or len(rest) < 2:
            raise ConfigError("axolotl: the kit reads 'axolotl train <config.yml> [--key value ...] [-- launcher args]'")
        return _axolotl_cli(rest[1:], **kw)
    elif prog == "trl":
        if not rest or rest[0].startswith("-"):
            raise ConfigError("trl: the kit reads 'trl <sft|dpo|grpo|...> --config <config.yaml> [--key value ...]'")
        return _trl(rest[0], rest[1:], **kw)
    elif PYTHON.match(prog):
        launch, program, module = _python(rest, **kw)
    else:
        raise ConfigError(f"{tokens[0]} is no launcher the kit reads ({KNOWN})")
    return _finish(_program(program, launch, module, **kw), launch, prog)


def _python(rest: list[str], **kw):
    i = 0
    while i < len(rest) and rest[i].startswith("-") and rest[i] != "-m":
        i += 2 if rest[i] in ("-X", "-W") else 1
    if i < len(rest) and rest[i] == "-m":
        if i + 1 >= len(rest):
            raise ConfigError("python -m names no module")
        mod, after = rest[i + 1], rest[i + 2:]
        if mod in TORCHRUN_MODULES:
            return launchers.torchrun(after)
        if mod == "accelerate.commands.launch":
            return launchers.accelerate(after, **kw)
        if mod == "deepspeed.launcher.runner":
            return launchers.deepspeed(after)
        return Launch(launcher="python", world_size=1, notes=["launcher: python (one process)"]), [mod, *after], True
    return Launch(launcher="python", world_size=1, notes=["launcher: python (one process)"]), rest[i:], False


def _finish(run: TrainingRun, launch: Launch, prog: str) -> TrainingRun:
    run.source = "command line"
    run.launcher = launch.launcher or prog
    run.notes[:0] = [n for n in launch.notes if n not in run.notes]
    return run


def _config(value, key, base_dir, cwd) -> tuple[Path, dict]:
    p = find_file(value, key, base_dir, cwd)
    return p, load_mapping(p)


def _program(tokens: list[str], launch: Launch, module: bool, *, base_dir, cwd) -> TrainingRun:
    if not tokens:
        raise ConfigError(f"{launch.launcher} launches no program")
    script, args = tokens[0], tokens[1:]
    if script == attach.MODULE or script.replace("\\", "/").endswith("gradkit/watch/attach.py"):
        try:
            ns = attach.split(args)
        except ValueError as e:
            raise ConfigError(f"{attach.PROG}: {e}") from None
        launch.notes.append(f"program: {attach.PROG} runs {ns.target} with gradkit's watch in its Trainer")
        return _program([ns.target, *ns.args], launch, not ns.target.endswith(".py"), base_dir=base_dir, cwd=cwd)
    if script == "axolotl.cli.train" or script.replace("\\", "/").endswith("axolotl/cli/train.py"):
        return _axolotl_cfg(args, launch, base_dir=base_dir, cwd=cwd)
    prog = f"program: {'python -m ' if module else ''}{script}"
    if args and args[0].endswith(CONFIG_SUFFIXES) and not args[0].startswith("-"):
        p, data = _config(args[0], f"{script}'s config argument", base_dir, cwd)
        fw = detect_data(data, str(p))
        if fw == "llamafactory":
            data.update(llamafactory.overrides(args[1:]))
        else:
            _, opts = hf_args.parse_cli(args[1:])
            data.update(axolotl.overrides(opts) if fw == "axolotl" else hf_args.cli_values(opts))
        run = read_data(data, "command line", base_dir=p.parent, cwd=cwd, launch=launch, config_file=str(p),
                        framework=fw)
        run.notes.insert(0, f"{prog} with {p}" + (f", overridden by {' '.join(args[1:])}" if args[1:] else ""))
        return run
    _, opts = hf_args.parse_cli(args)
    if isinstance(opts.get("config"), str) and opts["config"].endswith(CONFIG_SUFFIXES):
        p, data = _config(opts.pop("config"), "--config", base_dir, cwd)
        data.update(hf_args.cli_values(opts))
        run = read_data(data, "command line", base_dir=p.parent, cwd=cwd, launch=launch, config_file=str(p))
        run.notes.insert(0, f"{prog} --config {p} (TRL's TrlParser.parse_args_and_config: the file sets defaults, "
                            "command-line flags override them)")
        return run
    if opts.get("deepspeed_config"):
        ds, file = load_ds_json(opts["deepspeed_config"], "--deepspeed_config", base_dir, cwd)
        run = ds_rules.read_bare(ds, "command line", file)
        run.world_size = launch.world_size
        run.notes.insert(0, f"{prog} --deepspeed_config {file or '{...}'}: the script hands it to deepspeed.initialize "
                            "itself (deepspeed/__init__.py add_config_arguments)")
        return run
    given = hf_args.cli_values(opts)
    if (hf_args.HF_KEYS | hf_args.TRL_KEYS) & set(given):
        run = hf_args.read_hf(given, "command line", base_dir=base_dir, cwd=cwd, launch=launch)
        run.notes.insert(0, f"{prog} with TrainingArguments flags (HfArgumentParser)")
        return run
    if launch.launcher == "accelerate":
        run = accelerate_cfg.from_launch(launch, "command line")
        run.notes.insert(len(launch.notes), f"{prog}: its arguments name no TrainingArguments, so what accelerate launch sets up is "
                            "all that is known")
        return run
    raise ConfigError(f"{script}'s arguments name no TrainingArguments, config file or DeepSpeed config: how it trains "
                      "is unknown")


def _llamafactory(args: list[str], launch: Launch, *, base_dir, cwd) -> TrainingRun:
    p, data = _config(args[0], "llamafactory-cli train", base_dir, cwd)
    data.update(llamafactory.overrides(args[1:]))
    run = llamafactory.read(data, "command line", base_dir=p.parent, cwd=cwd, launch=launch, config_file=str(p))
    run.notes.insert(0, f"config: {p}" + (f", overridden by {' '.join(args[1:])} (OmegaConf.from_cli: LLaMA-Factory "
                                          "hparams/parser.py read_args)" if args[1:] else ""))
    return run


def _axolotl_cfg(args: list[str], launch: Launch, *, base_dir, cwd) -> TrainingRun:
    positionals, opts = hf_args.parse_cli(args)
    if not positionals:
        raise ConfigError("axolotl names no config file")
    p, data = _config(positionals[0], "axolotl config", base_dir, cwd)
    over = axolotl.overrides(opts)
    data.update(over)
    run = axolotl.read(data, "command line", base_dir=p.parent, cwd=cwd, launch=launch, config_file=str(p))
    run.notes.insert(0, f"config: {p}" + (f", overridden by {', '.join(over)} (axolotl cli/config.py load_cfg)"
                                          if over else ""))
    return run


def _axolotl_cli(args: list[str], *, base_dir, cwd) -> TrainingRun:
    """axolotl train: the launcher it runs (cli/utils/train.py launch_training), then the config."""
    own, extra = (args[:args.index("--")], args[args.index("--") + 1:]) if "--" in args else (args, [])
    _, opts = hf_args.parse_cli(own)
    which = opts.get("launcher", "accelerate")
    if which == "accelerate":
        n = ["--num_processes", str(opts["num_processes"])] if opts.get("num_processes") else []
        launch, _, _ = launchers.accelerate(n + extra + ["-m", "axolotl.cli.train"], base_dir=base_dir, cwd=cwd)
    elif which == "torchrun":
        launch, _, _ = launchers.torchrun(extra + ["-m", "axolotl.cli.train"])
    elif which == "python":
        launch = Launch(launcher="python", world_size=1, notes=["launcher: python (one process)"])
    else:
        raise ConfigError(f"axolotl --launcher {which!r}: accelerate, torchrun or python")
    launch.notes.insert(0, f"axolotl train --launcher {which} (axolotl cli/main.py train; cli/utils/train.py "
                           "launch_training)")
    launch.launcher = "axolotl"
    return _finish(_axolotl_cfg(own, launch, base_dir=base_dir, cwd=cwd), launch, "axolotl")


def _trl(command: str, args: list[str], *, base_dir, cwd) -> TrainingRun:
    _, opts = hf_args.parse_cli(args)
    data, p = {}, None
    if opts.get("config"):
        p, data = _config(opts.pop("config"), "--config", base_dir, cwd)
    launch = launchers.trl_accelerate_args(opts, data, base_dir=p.parent if p else base_dir, cwd=cwd)
    given = {k: v for k, v in data.items() if k not in launchers.LAUNCH_KEYS}
    given.update(hf_args.cli_values({k: v for k, v in opts.items() if k not in launchers.LAUNCH_KEYS}))
    run = hf_args.read_hf(given, "command line", base_dir=p.parent if p else base_dir, cwd=cwd, launch=launch,
                          config_file=str(p) if p else None, trl_command=command)
    run.notes.insert(0, f"trl {command}: TRL's CLI runs trl/scripts/{command}.py under accelerate launch "
                        "(trl/cli/commands/training.py TrainingCommand.run)")
    return _finish(run, launch, "trl")
