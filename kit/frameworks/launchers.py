"""Launcher options -> ranks and environment (``Launch``), and where the launched program starts.

- torchrun / python -m torch.distributed.run: torch/distributed/run.py get_args_parser (--nproc_per_node default
  "1", --nnodes default "1:1", --standalone);
- deepspeed: deepspeed/launcher/runner.py parse_args / main (--num_gpus, --num_nodes, --include host:slots, no
  hostfile -> local resources only);
- accelerate launch: accelerate/commands/launch.py launch_command_parser (see accelerate_cfg for the config file);
- llamafactory-cli train: LLaMA-Factory src/llamafactory/launcher.py launch (torchrun with NNODES x NPROC_PER_NODE
  when FORCE_TORCHRUN or more than one visible device);
- axolotl train: axolotl src/axolotl/cli/main.py train, cli/utils/train.py launch_training (--launcher accelerate
  by default, --num-processes, launcher args after ``--``);
- trl <command>: TRL trl/cli/commands/training.py TrainingCommand.run (accelerate launch; --accelerate_config a path or
  a preset of trl/accelerate_configs, huggingface/trl f2cd5771 = v1.9.0-26).
"""
from __future__ import annotations

import re

from gradkit.config import ConfigError
import gradkit.frameworks.accelerate_cfg as accelerate_cfg
from gradkit.frameworks.run import Launch, find_file, load_mapping

TORCHRUN_FLAGS = frozenset(("standalone", "no_python", "module", "m", "run_path", "use_env", "virtual_local_rank"))
DEEPSPEED_FLAGS = frozenset(("no_python", "module", "no_local_rank", "no_ssh_check", "force_multi", "save_pid",
                             "elastic_training", "bind_cores_to_rank", "no_ssh", "enable_each_rank_log_flag"))
ACCELERATE_FLAGS = frozenset(("cpu", "multi_gpu", "tpu", "use_deepspeed", "use_fsdp", "use_megatron_lm", "use_xpu",
                              "m", "module", "no_python", "debug", "same_network", "enable_cpu_affinity", "q", "quiet",
                              "tpu_use_cluster", "tpu_use_sudo", "downcast_bf16", "use_parallelism_config"))
# TRL's accelerate presets (trl/accelerate_configs/*.yaml at f2cd5771), the keys that matter here
TRL_PRESETS = {
    "zero1": {"distributed_type": "DEEPSPEED", "mixed_precision": "bf16", "num_processes": 8,
              "deepspeed_config": {"gradient_accumulation_steps": 1, "zero3_init_flag": False, "zero_stage": 1}},
    "zero2": {"distributed_type": "DEEPSPEED", "mixed_precision": "bf16", "num_processes": 8,
              "deepspeed_config": {"offload_optimizer_device": "none", "offload_param_device": "none",
                                   "zero3_init_flag": False, "zero_stage": 2}},
    "zero3": {"distributed_type": "DEEPSPEED", "mixed_precision": "bf16", "num_processes": 8,
              "deepspeed_config": {"offload_optimizer_device": "none", "offload_param_device": "none",
                                   "zero3_init_flag": True, "zero3_save_16bit_model": True, "zero_stage": 3}},
    "fsdp1": {"distributed_type": "FSDP", "mixed_precision": "bf16", "num_processes": 8,
              "fsdp_config": {"fsdp_version": 1, "fsdp_reshard_after_forward": "FULL_SHARD"}},
    "fsdp2": {"distributed_type": "FSDP", "mixed_precision": "bf16", "num_processes": 8,
              "fsdp_config": {"fsdp_version": 2, "fsdp_reshard_after_forward": True}},
    "multi_gpu": {"distributed_type": "MULTI_GPU", "mixed_precision": "bf16", "num_processes": 8},
    "single_gpu": {"distributed_type": "NO", "mixed_precision": "bf16", "num_processes": 8},
}


def split_options(tokens: list[str], flags: frozenset) -> tuple[dict, list[str]]:
    """A launcher's own options, up to the program: ({name: value or True}, the program and its arguments)."""
    opts, i = {}, 0
    while i < len(tokens):
        tok = tokens[i]
        if not tok.startswith("-") or tok == "-":
            break
        if tok == "--":
            i += 1
            break
        name, eq, value = tok.lstrip("-").partition("=")
        name = name.replace("-", "_")
        if eq:
            opts[name] = value
        elif name in flags:
            opts[name] = True
        elif i + 1 < len(tokens):
            opts[name] = tokens[i + 1]
            i += 1
        else:
            raise ConfigError(f"launcher option {tok} has no value")
        i += 1
    return opts, tokens[i:]


def _int(value, what: str, notes: list) -> int | None:
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.isdigit() and int(value) > 0:
        return int(value)
    notes.append(f"{what}: {value} -> unknown (not a number here)")
    return None


def torchrun(tokens: list[str]) -> tuple[Launch, list[str], bool]:
    opts, rest = split_options(tokens, TORCHRUN_FLAGS)
    out = Launch(launcher="torchrun")
    nproc = _int(opts.get("nproc_per_node", "1"), "--nproc_per_node", out.notes)
    nnodes_raw = "1" if opts.get("standalone") else str(opts.get("nnodes", "1:1"))
    lo, _, hi = nnodes_raw.partition(":")
    nnodes = _int(lo, "--nnodes", out.notes) if not hi or hi == lo else None
    if hi and hi != lo:
        out.notes.append(f"--nnodes {nnodes_raw}: elastic -> world size unknown")
    out.world_size = nproc * nnodes if nproc and nnodes else None
    out.notes.append(f"launcher: torchrun --nproc_per_node {opts.get('nproc_per_node', '1 (default)')} --nnodes "
                     f"{nnodes_raw} -> world size {out.world_size if out.world_size else 'unknown'} "
                     "(torch/distributed/run.py)")
    return out, rest, bool(opts.get("module") or opts.get("m"))


def deepspeed(tokens: list[str]) -> tuple[Launch, list[str], bool]:
    opts, rest = split_options(tokens, DEEPSPEED_FLAGS)
    out = Launch(launcher="deepspeed")
    gpus = opts.get("num_gpus", opts.get("num_accelerators"))
    if opts.get("include") or opts.get("i"):
        spec = str(opts.get("include") or opts.get("i"))
        hosts = [h for h in spec.split("@") if h]
        counts = [len(h.partition(":")[2].split(",")) if ":" in h else None for h in hosts]
        out.world_size = sum(counts) if all(c for c in counts) else None
        out.notes.append(f"launcher: deepspeed --include {spec} -> world size {out.world_size or 'unknown'} "
                         "(deepspeed/launcher/runner.py parse_inclusion_exclusion)")
    else:
        nodes = opts.get("num_nodes")
        if nodes is None and not (opts.get("hostfile") or opts.get("H")):
            nodes = "1"  # runner.py main: no hostfile -> local resources only
        g = _int(gpus, "--num_gpus", out.notes) if gpus is not None else None
        n = _int(nodes, "--num_nodes", out.notes) if nodes is not None else None
        out.world_size = g * n if g and n else None
        where = " (no --hostfile: local resources only, unless /job/hostfile exists on the launching machine)" \
            if "num_nodes" not in opts and nodes == "1" else ""
        out.notes.append(f"launcher: deepspeed --num_gpus {gpus if gpus is not None else '(all visible)'} --num_nodes "
                         f"{nodes if nodes is not None else '(the hostfile)'}{where} -> world size "
                         f"{out.world_size or 'unknown'} (deepspeed/launcher/runner.py main, fetch_hostfile)")
    return out, rest, bool(opts.get("module"))


def accelerate(tokens: list[str], *, base_dir=None, cwd=None, preset: dict | None = None) -> tuple[Launch, list, bool]:
    opts, rest = split_options(tokens, ACCELERATE_FLAGS)
    cfg, where = preset, None
    if opts.get("config_file"):
        p = find_file(opts["config_file"], "--config_file", base_dir, cwd)
        cfg, where = load_mapping(p, "accelerate config"), p.parent
    out = accelerate_cfg.launch(cfg, opts, base_dir=where, cwd=cwd,
                                source=str(opts.get("config_file") or "accelerate launch"))
    out.notes.insert(0, "launcher: accelerate launch" + (f" --config_file {opts['config_file']}" if cfg and where
                                                         else " with a TRL preset" if cfg else
                                                         " without --config_file (accelerate's default config, if the "
                                                         "launching machine has one, is not read here)"))
    return out, rest, bool(opts.get("module") or opts.get("m"))


def llamafactory(env: dict) -> Launch:
    """llamafactory-cli train: torchrun when FORCE_TORCHRUN is set or several devices are visible."""
    out = Launch(launcher="llamafactory-cli")
    visible = env.get("CUDA_VISIBLE_DEVICES")
    devices = len([d for d in visible.split(",") if d.strip()]) if visible else None
    force = str(env.get("FORCE_TORCHRUN", "")).lower() in ("1", "true", "y", "yes")
    if force or (devices or 0) > 1:
        nproc = env.get("NPROC_PER_NODE", str(devices) if devices else None)
        nnodes = env.get("NNODES", "1")
        n = _int(nproc, "NPROC_PER_NODE", out.notes) if nproc is not None else None
        m = _int(nnodes, "NNODES", out.notes)
        out.world_size = n * m if n and m else None
        out.notes.append(f"launcher: llamafactory-cli train -> torchrun, NPROC_PER_NODE {nproc or '(device count)'} x "
                         f"NNODES {nnodes} -> world size {out.world_size or 'unknown'} (LLaMA-Factory "
                         "src/llamafactory/launcher.py launch)")
    elif devices == 1:
        out.world_size = 1
        out.notes.append("launcher: llamafactory-cli train, one visible device and no FORCE_TORCHRUN -> one process "
                         "(LLaMA-Factory src/llamafactory/launcher.py launch)")
    else:
        out.notes.append("launcher: llamafactory-cli train -> torchrun over every visible device, or one process on "
                         "one device (FORCE_TORCHRUN / CUDA_VISIBLE_DEVICES not set): world size unknown")
    return out


def trl_accelerate_args(options: dict, data: dict, *, base_dir=None, cwd=None) -> Launch:
    """``trl <cmd>``: what the TRL parser leaves (CLI flags, or keys of the --config YAML that are no dataclass
    field) goes to accelerate launch, --accelerate_config as --config_file (trl/cli/accelerate_config.py)."""
    launch_opts = {k: v for k, v in {**{k: data[k] for k in data if k in LAUNCH_KEYS}, **options}.items()
                   if k in LAUNCH_KEYS}
    tokens, preset = [], None
    name = launch_opts.pop("accelerate_config", None)
    if name is not None:
        if str(name) in TRL_PRESETS:
            preset = TRL_PRESETS[str(name)]
        else:  # a path (trl/cli/accelerate_config.py resolve_accelerate_config_argument)
            launch_opts["config_file"] = str(find_file(name, f"--accelerate_config (a path, or one of "
                                                             f"{', '.join(TRL_PRESETS)})", base_dir, cwd))
    for k, v in launch_opts.items():
        tokens += [f"--{k}"] if v is True else [f"--{k}", str(v)]
    out, _, _ = accelerate(tokens + ["trl-script"], base_dir=base_dir, cwd=cwd, preset=preset)
    if preset is not None:
        out.notes.insert(1, f"--accelerate_config {name}: TRL's preset trl/accelerate_configs/{name}.yaml")
    out.launcher = "trl"
    return out


LAUNCH_KEYS = frozenset(("accelerate_config", "config_file", "num_processes", "num_machines", "mixed_precision",
                         "use_deepspeed", "use_fsdp", "multi_gpu", "deepspeed_config_file", "zero_stage",
                         "gradient_clipping", "offload_optimizer_device", "offload_param_device", "zero3_init_flag",
                         "main_process_port", "machine_rank", "gpu_ids"))
SHELL_VAR = re.compile(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?")
