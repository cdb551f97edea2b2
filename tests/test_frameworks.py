"""gradkit.frameworks: a training config / launch line, resolved as its framework resolves it (no world, no framework
imported). Each fixture under tests/configs/frameworks/ is read, its fields checked, and its notes said."""
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from gradkit import frameworks
from gradkit.config import ConfigError

HERE = Path(__file__).resolve().parent / "configs" / "frameworks"
SHIPPED = Path(__file__).resolve().parent.parent / "scripts" / "configs" / "shipped"


def said(run, *words):
    """Some note holds every word."""
    assert any(all(w in n for w in words) for n in run.notes), (words, run.notes)


def cmd(line, cwd=HERE, **kw):
    return frameworks.read_command_line(shlex.split(line), cwd=cwd, **kw)


def write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text if isinstance(text, str) else json.dumps(text))
    return p


# --- detection --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name, framework", [
    ("llamafactory_full_sft.yaml", "llamafactory"), ("llamafactory_lora_fsdp.yaml", "llamafactory"),
    ("axolotl_lora.yml", "axolotl"), ("hf_training_args.json", "hf-trainer"), ("trl_sft.yaml", "trl"),
    ("accelerate_deepspeed.yaml", "accelerate"), ("accelerate_fsdp.yaml", "accelerate"),
    ("ds_zero2_fp16.json", "deepspeed"), ("launch_torchrun.sh", "command-line"),
    ("launch_llamafactory_fsdp.sh", "command-line"),
])
def test_detect_by_keys(name, framework):
    assert frameworks.detect(HERE / name) == framework


def test_detect_ignores_the_file_name(tmp_path):
    p = write(tmp_path, "ds_config.json", {"base_model": "x", "micro_batch_size": 1, "gradient_accumulation_steps": 2})
    assert frameworks.detect(p) == "axolotl"


def test_a_config_is_read_by_its_content_json_wherever_it_parses_as_json(tmp_path):
    """A DeepSpeed config shipped as .conf, JSON with numbers written 1e9: YAML would read '1e9' as a string (and
    DeepSpeed's parser would then refuse what DeepSpeed itself reads as a number)."""
    conf = tmp_path / "ds_config.conf"
    conf.write_text('{"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4,\n'
                    ' "zero_optimization": {"stage": 2, "reduce_bucket_size": 5e8, "allgather_bucket_size": 1e9}}\n')
    run = frameworks.read(conf)
    assert run.framework == "deepspeed" and run.zero_stage == 2
    assert run.ds_config["zero_optimization"]["allgather_bucket_size"] == 1e9
    yml = tmp_path / "ds_config.yml"  # YAML stays YAML: its own reading of 1e9
    yml.write_text("train_micro_batch_size_per_gpu: 2\nzero_optimization:\n  stage: 2\n  reduce_bucket_size: 1e9\n")
    assert frameworks.read(yml).ds_config["zero_optimization"]["reduce_bucket_size"] == "1e9"


@pytest.mark.parametrize("shipped", sorted(p.relative_to(SHIPPED).as_posix() for p in SHIPPED.rglob("*.json")))
def test_every_shipped_deepspeed_json_is_a_bare_deepspeed_config(shipped):
    run = frameworks.read(SHIPPED / shipped)
    assert (run.framework, run.loops, run.path) == ("deepspeed", ("engine", "boundary"), "deepspeed")
    assert run.precisions[0] in ("fp32", "bf16")


# --- the fixtures -----------------------------------------------------------------------------------------------

def test_llamafactory_full_sft_zero3():
    run = frameworks.read(HERE / "llamafactory_full_sft.yaml")
    assert (run.framework, run.precision, run.precisions, run.ga, run.micro_batch) == ("llamafactory", "bf16",
                                                                                       ("bf16",), 2, 1)
    assert (run.path, run.zero_stage, run.adapter, run.max_grad_norm, run.world_size) == ("deepspeed", 3, None, 1.0, None)
    assert run.loops == ("boundary",) and run.trainer_dtype == "bf16"
    assert run.ds_config_file == str((SHIPPED / "llamafactory" / "ds_z3_config.json").resolve())
    assert run.ds_config == json.loads((SHIPPED / "llamafactory" / "ds_z3_config.json").read_text())  # before "auto"
    said(run, "bf16: true -> bf16", "LLaMA-Factory passes it to TrainingArguments.bf16")
    said(run, "finetuning_type: full", "adapter none")
    said(run, 'gradient_accumulation_steps: "auto" -> 2', "trainer_config_process")
    said(run, 'bf16.enabled: "auto" -> true', "TrainingArguments.bf16")
    said(run, "max_grad_norm: absent -> 1.0", "TrainingArguments default")
    said(run, "loop: boundary", "set_gradient_accumulation_boundary")


def test_llamafactory_lora_defaults_and_qlora(tmp_path):
    p = write(tmp_path, "lf.yaml", "stage: sft\nmodel_name_or_path: m\ndataset: d\ntemplate: llama3\n"
                                   "quantization_bit: 4\n")
    run = frameworks.read(p)
    assert (run.adapter, run.ga, run.micro_batch, run.precision, run.path) == ("qlora", 1, 8, "fp32", "ddp")
    said(run, "finetuning_type: absent -> lora (FinetuningArguments default)", "qlora")
    said(run, "gradient_accumulation_steps: absent -> 1 (TrainingArguments default)")
    said(run, "per_device_train_batch_size: absent -> 8")


def test_llamafactory_pure_bf16_keeps_trainer_flags_off(tmp_path):
    ds = SHIPPED / "llamafactory" / "ds_z2_config.json"
    p = write(tmp_path, "lf.yaml", f"finetuning_type: full\npure_bf16: true\ndeepspeed: {ds}\n")
    run = frameworks.read(p)
    assert (run.precision, run.trainer_dtype, run.zero_stage) == ("bf16", "fp32", 2)
    said(run, "pure_bf16: true", "no autocast")
    said(run, 'bf16.enabled: "auto" -> false')


def test_axolotl_lora_bf16_auto_depends_on_the_gpu():
    run = frameworks.read(HERE / "axolotl_lora.yml")
    assert (run.framework, run.precision, run.precisions, run.trainer_dtype) == ("axolotl", None, ("bf16", "fp16"), None)
    assert (run.ga, run.micro_batch, run.adapter, run.path, run.zero_stage) == (4, 2, "lora", "deepspeed", 2)
    assert run.max_grad_norm == 1.0 and run.loops == ("boundary",)
    said(run, 'bf16: "auto" -> bf16 on a GPU with bf16 support (Ampere or newer), else fp16',
         "utils/config/__init__.py resolve_dtype")
    said(run, "micro_batch_size: 2 -> per_device_train_batch_size 2")
    said(run, "max_grad_norm: absent -> 1.0")
    said(run, "precision on a GPU without bf16 support: fp16")


@pytest.mark.parametrize("yaml_text, ga, words", [
    ("micro_batch_size: 4\nbatch_size: 32\n", 1, "batch_size 32 does not change it"),
    ("micro_batch_size: 4\nbatch_size: 32\ngradient_accumulation_steps: null\n", 8, "batch_size 32 // micro_batch_size 4"),
    ("gradient_accumulation_steps: 3\nbatch_size: null\nmicro_batch_size: 2\n", 3, "gradient_accumulation_steps: 3"),
])
def test_axolotl_batch_size_rules(tmp_path, yaml_text, ga, words):
    run = frameworks.read(write(tmp_path, "a.yml", "base_model: m\n" + yaml_text))
    assert run.ga == ga
    said(run, words)


@pytest.mark.parametrize("flags, precision, words", [
    ("bf16: true\n", "bf16", "bf16: true -> true"),
    ("bf16: false\n", "fp32", "bf16: false -> false"),
    ("fp16: true\n", "fp16", '"auto" (axolotl utils/schemas/config.py default) -> false, as fp16 is true'),
    ("bf16: auto\nfp16: false\n", None, "else fp32"),
    ("bf16: false\nbfloat16: true\n", "bf16", "bfloat16: true"),
])
def test_axolotl_precision(tmp_path, flags, precision, words):
    run = frameworks.read(write(tmp_path, "a.yml", "base_model: m\nmicro_batch_size: 1\n"
                                                   "gradient_accumulation_steps: 2\n" + flags))
    assert run.precision == precision
    said(run, words)


def _axolotl_resolves(bf16, fp16) -> set[str]:
    """axolotl's own rules, written out from its source (not from the reader): utils/config/__init__.py resolve_dtype
    turns bf16 "auto" (also when absent) into true on a GPU with bf16 and false on one without, where it also sets fp16
    true unless fp16 is set; fp16 true with bf16 "auto" makes bf16 false; bf16 true turns fp16 off. Then
    core/builders/base.py passes TrainingArguments fp16 = fp16 and not bf16, bf16 = bf16. Returns the precisions the
    Trainer can run with over both kinds of GPU."""
    out = set()
    for gpu_has_bf16 in (True, False):
        b, f = bf16, fp16
        if b in ("auto", None):
            b = False if f is True else gpu_has_bf16
            if not gpu_has_bf16 and f is None:
                f = True
        if b:
            f = False
        out.add("bf16" if b else "fp16" if f and not b else "fp32")
    return out


@pytest.mark.parametrize("bf16", [True, False, "auto", None])
@pytest.mark.parametrize("fp16", [True, False, None])
def test_axolotl_bf16_and_fp16_resolve_as_axolotl_resolves_them_and_bf16_always_turns_fp16_off(tmp_path, bf16, fp16):
    flags = "".join(f"{k}: {json.dumps(v)}\n" for k, v in (("bf16", bf16), ("fp16", fp16)) if v is not None)
    run = frameworks.read(write(tmp_path, "a.yml", "base_model: m\nmicro_batch_size: 1\n"
                                                   "gradient_accumulation_steps: 2\n" + flags))
    assert set(run.precisions) == _axolotl_resolves(bf16, fp16), (flags, run.precisions)
    assert run.precision == (run.precisions[0] if len(run.precisions) == 1 else None)
    if bf16 is True and fp16 is True:
        said(run, "fp16: true -> TrainingArguments.fp16 false")


def test_hf_training_args_json_with_its_own_deepspeed_json():
    run = frameworks.read(HERE / "hf_training_args.json")
    assert (run.framework, run.precision, run.ga, run.micro_batch, run.max_grad_norm) == ("hf-trainer", "fp16", 8, 4, 0.5)
    assert run.ds_config_file == str(HERE / "ds_zero2_fp16.json") and run.ds_config["fp16"]["enabled"] == "auto"
    said(run, "fp16: true -> fp16 (TrainingArguments.fp16)")
    said(run, 'gradient_clipping: "auto" -> 0.5', "max_grad_norm")
    said(run, "world size: not in the file -> unknown")


def test_trl_sft_bf16_default_depends_on_the_trl_release():
    run = frameworks.read(HERE / "trl_sft.yaml")
    assert (run.framework, run.precision, run.precisions, run.ga, run.micro_batch) == ("trl", None, ("bf16", "fp32"), 8, 2)
    said(run, "bf16: absent -> true on TRL >= 0.19.0, false on older TRL", "_BaseConfig.__post_init__", "#3515")
    said(run, "framework: TRL (SFTConfig")


def test_trl_fp16_turns_the_bf16_default_off(tmp_path):
    run = frameworks.read(write(tmp_path, "t.yaml", "packing: true\nfp16: true\n"))
    assert run.precision == "fp16"
    said(run, "bf16: absent -> off, as fp16 is on")


def test_accelerate_deepspeed_builds_the_config_from_its_fields():
    run = frameworks.read(HERE / "accelerate_deepspeed.yaml")
    assert (run.framework, run.path, run.precision, run.ga, run.world_size, run.zero_stage) == (
        "accelerate", "deepspeed", "bf16", 4, 8, 2)
    assert run.micro_batch is None and run.max_grad_norm == 1.0 and run.ds_config_file is None
    ds = run.ds_config
    assert ds["gradient_accumulation_steps"] == 4 and ds["train_micro_batch_size_per_gpu"] == "auto"
    assert ds["zero_optimization"]["offload_optimizer"]["device"] == "cpu" and ds["bf16"] == {"enabled": True}
    said(run, "built by accelerate utils/dataclasses.py DeepSpeedPlugin.__post_init__")
    said(run, "num_processes: 8 -> world size 8")


def test_accelerate_fsdp():
    run = frameworks.read(HERE / "accelerate_fsdp.yaml")
    assert (run.framework, run.path, run.precision, run.world_size, run.ga, run.ds_config) == (
        "accelerate", "fsdp", "bf16", 2, None, None)
    said(run, "distributed_type: FSDP -> FSDP")
    said(run, "the script's Accelerator(gradient_accumulation_steps=...)")


def test_accelerate_with_a_deepspeed_file_leaves_precision_to_the_script(tmp_path):
    p = write(tmp_path, "acc.yaml", "distributed_type: DEEPSPEED\nnum_processes: 2\ndeepspeed_config:\n"
                                    f"  deepspeed_config_file: {SHIPPED / 'axolotl' / 'zero1.json'}\n")
    run = frameworks.read(p)
    assert (run.precision, run.precisions, run.ga, run.zero_stage) == (None, ("fp32", "bf16", "fp16"), None, 1)
    said(run, "deepspeed_config_file")


# --- command lines ----------------------------------------------------------------------------------------------

def test_the_brief_example_line():
    run = cmd("torchrun --nproc_per_node 8 train.py --deepspeed ds_z2_config.json --bf16 "
              "--gradient_accumulation_steps 8 --per_device_train_batch_size 4", cwd=SHIPPED / "llamafactory")
    assert (run.framework, run.source, run.launcher, run.world_size) == ("hf-trainer", "command line", "torchrun", 8)
    assert (run.precision, run.ga, run.micro_batch, run.path, run.zero_stage) == ("bf16", 8, 4, "deepspeed", 2)
    said(run, "torchrun --nproc_per_node 8", "world size 8")
    said(run, 'train_batch_size: "auto" -> 256')


def test_shell_script_joins_lines_and_reads_variables():
    run = frameworks.read(HERE / "launch_torchrun.sh")
    assert (run.framework, run.world_size, run.ga, run.micro_batch, run.precision) == ("hf-trainer", 8, 8, 4, "bf16")
    said(run, "command line from", "torchrun --nproc_per_node 8 --nnodes 1 train.py")
    said(run, 'bf16: absent -> {"enabled": true}', "set_mixed_precision")  # the JSON has no bf16 section


def test_shell_script_llamafactory_under_accelerate_fsdp():
    run = frameworks.read(HERE / "launch_llamafactory_fsdp.sh")
    assert (run.framework, run.launcher, run.path, run.world_size, run.ga, run.adapter) == (
        "llamafactory", "accelerate", "fsdp", 2, 16, "qlora")
    said(run, "overridden by gradient_accumulation_steps=16")


@pytest.mark.parametrize("line, expect", [
    (("python -m torch.distributed.run --nproc-per-node=4 --nnodes=2 train.py --deepspeed ds_zero2_fp16.json --fp16 "
     "--bf16 False"), {"world_size": 8, "precision": "fp16", "ga": 1, "micro_batch": 8}),
    ("deepspeed --num_gpus 4 train.py --deepspeed ds_zero2_fp16.json --fp16 --gradient-accumulation-steps 2",
     {"world_size": 4, "launcher": "deepspeed", "ga": 2, "precision": "fp16"}),
    ("deepspeed --include localhost:0,1 train.py --deepspeed --deepspeed_config ds_zero2_fp16.json",
     {"framework": "deepspeed", "world_size": 2, "loops": ("engine", "boundary")}),
    (("accelerate launch --config_file accelerate_deepspeed.yaml train.py --bf16 --gradient_accumulation_steps 4 "
     "--per_device_train_batch_size 2"), {"world_size": 8, "ga": 4, "micro_batch": 2, "path": "deepspeed", "zero_stage": 2}),
    ("accelerate launch --use_deepspeed --zero_stage 3 --num_processes 2 --mixed_precision bf16 train.py --bf16",
     {"world_size": 2, "zero_stage": 3, "precision": "bf16"}),
    ("accelerate launch --config_file accelerate_fsdp.yaml my_loop.py --lr 3e-4",
     {"framework": "accelerate", "path": "fsdp", "world_size": 2, "precision": "bf16"}),
    ("FORCE_TORCHRUN=1 NPROC_PER_NODE=4 llamafactory-cli train llamafactory_full_sft.yaml gradient_accumulation_steps=4",
     {"framework": "llamafactory", "world_size": 4, "ga": 4, "launcher": "llamafactory-cli"}),
    ("axolotl train axolotl_lora.yml --num-processes 4 --micro-batch-size 4",
     {"framework": "axolotl", "world_size": 4, "micro_batch": 4, "launcher": "axolotl"}),
    ("axolotl train axolotl_lora.yml --launcher torchrun -- --nproc_per_node 2", {"world_size": 2}),
    ("python -m axolotl.cli.train axolotl_lora.yml --gradient_accumulation_steps=2", {"world_size": 1, "ga": 2}),
    ("trl sft --config trl_sft.yaml --accelerate_config zero2",
     {"framework": "trl", "precision": "bf16", "world_size": 8, "zero_stage": 2, "launcher": "trl"}),
    ("nohup python train.py --per_device_train_batch_size 2 --fp16 > log 2>&1 &",
     {"world_size": 1, "path": "single", "precision": "fp16"}),
])
def test_launch_lines(line, expect):
    run = cmd(line)
    assert {k: getattr(run, k) for k in expect} == expect


def test_a_command_file_without_suffix_and_config_arguments(tmp_path):
    (tmp_path / "args.json").write_text(json.dumps({"output_dir": "o", "gradient_accumulation_steps": 3, "bf16": True}))
    (tmp_path / "sft.yaml").write_text("packing: true\nper_device_train_batch_size: 2\n")
    p = write(tmp_path, "launch", "NGPU=2\nFORCE=1 torchrun --nproc_per_node=$NGPU run_clm.py args.json\n")
    assert frameworks.detect(p) == "command-line"
    run = frameworks.read(p)
    assert (run.framework, run.ga, run.precision, run.world_size, run.config_file) == (
        "hf-trainer", 3, "bf16", 2, str(tmp_path / "args.json"))
    run = cmd("python sft.py --config sft.yaml --gradient_accumulation_steps 4 --fp16", cwd=tmp_path)
    assert (run.framework, run.ga, run.micro_batch, run.precision) == ("trl", 4, 2, "fp16")
    said(run, "TrlParser.parse_args_and_config")


def test_accelerate_mixed_precision_fills_a_trainer_without_flags():
    run = cmd("accelerate launch --num_processes 2 --mixed_precision fp16 train.py --gradient_accumulation_steps 2")
    assert (run.precision, run.path, run.trainer_dtype) == ("fp16", "ddp", "fp32")
    said(run, "mixed precision: fp16 from accelerate launch")


def test_trl_preset_drops_the_trl_release_that_the_trainer_refuses():
    run = cmd("trl sft --config trl_sft.yaml --accelerate_config zero3")
    assert run.precisions == ("bf16",)
    said(run, "refused on TRL < 0.19.0", "bf16.enabled=true")


def test_deepspeed_json_without_ga_gets_1_in_the_engine(tmp_path):
    write(tmp_path, "ds.json", {"train_micro_batch_size_per_gpu": "auto", "zero_optimization": {"stage": 2}})
    run = cmd("torchrun --nproc_per_node 2 train.py --deepspeed ds.json --gradient_accumulation_steps 4", cwd=tmp_path)
    assert run.ga == 4 and run.max_grad_norm == 0.0
    said(run, "gradient_accumulation_steps: absent -> 1", "DeepSpeedPlugin.__post_init__ sets 1")
    said(run, "gradient_clipping: absent from the DeepSpeed config -> no clipping")


@pytest.mark.parametrize("line", ["torchrun --nproc_per_node $NGPU train.py --bf16",
                                  "NGPU=2 torchrun --nproc_per_node $NGPU train.py --bf16"])  # the shell expands first
def test_unset_launcher_variable_leaves_the_world_unknown(line):
    run = cmd(line)
    assert run.world_size is None
    said(run, "--nproc_per_node: $NGPU -> unknown")


def test_fsdp_string_option():
    run = cmd("torchrun --nproc_per_node 2 train.py --fsdp 'full_shard auto_wrap' --bf16")
    assert (run.path, run.precision) == ("fsdp", "bf16")
    said(run, "FSDP2, full_shard", "_process_fsdp_args")


# --- errors -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name, text, words", [
    ("bad.yaml", "stage: [sft\n", "not valid YAML"),
    ("bad.json", "{\"a\": ", "not valid JSON"),
    ("list.yaml", "- a\n- b\n", "must hold a config mapping"),
    ("what.yaml", "foo: 1\nbar: 2\n", "no training config the kit reads"),
    ("ga0.json", {"output_dir": "o", "gradient_accumulation_steps": 0}, "gradient_accumulation_steps must be a positive"),
    ("gax.json", {"output_dir": "o", "gradient_accumulation_steps": "many"}, "positive integer"),
    ("both.json", {"output_dir": "o", "bf16": True, "fp16": True}, "At most one of fp16 and bf16"),
    ("maybe.json", {"output_dir": "o", "bf16": "maybe"}, "bf16 must be true or false"),
    ("nods.json", {"output_dir": "o", "deepspeed": "missing/ds.json"}, "deepspeed: missing/ds.json is not found relative to"),
    ("fsdp.json", {"output_dir": "o", "fsdp": "full_shard wrap_everything"}, "unknown fsdp option"),
    ("fsdp1.json", {"output_dir": "o", "fsdp": "hybrid_shard"}, "FSDP1-only"),
    ("stage.yaml", "stage: pretrain\nfinetuning_type: lora\n", "stage: 'pretrain' is not a LLaMA-Factory stage"),
    ("ftype.yaml", "finetuning_type: adapters\n", "finetuning_type"),
    ("qfull.yaml", "finetuning_type: full\nquantization_bit: 4\n", "with LoRA or OFT only"),
    ("axfsdp.yml", "base_model: m\nmicro_batch_size: 1\ngradient_accumulation_steps: 2\nfsdp_config: full\n",
     "fsdp_config must be a mapping"),
    ("ax1.yml", "base_model: m\nbatch_size: 32\n", "at least two of micro_batch_size"),
    ("ax2.yml", "base_model: m\nbatch_size: 32\ngradient_accumulation_steps: 4\n", "check_gas_bsz"),
    ("ax3.yml", "base_model: m\nmicro_batch_size: 1\ngradient_accumulation_steps: 2\nbf16: full\n", 'bf16 must be true'),
    ("ax4.yml", "base_model: m\nmicro_batch_size: 8\nbatch_size: 4\ngradient_accumulation_steps: null\n", "is 0"),
    ("acc1.yaml", "distributed_type: XLA\n", "distributed_type 'XLA'"),
    ("acc2.yaml", "distributed_type: MULTI_GPU\nmixed_precision: fp32\n", "mixed_precision 'fp32'"),
    ("acc3.yaml", "distributed_type: DEEPSPEED\ndeepspeed_config:\n  zero_stage: 5\n", "zero_stage must be 0, 1, 2 or 3"),
    ("acc4.yaml", "distributed_type: MULTI_GPU\nmixed_precision: fp8\nnum_processes: 2\n", "fp8"),
    ("ds1.json", {"zero_optimization": {"stage": 2}, "bf16": {"enabled": "yes"}}, "bf16.enabled must be"),
    ("ds2.json", {"zero_optimization": {"stage": 2}, "bf16": {"enabled": True}, "fp16": {"enabled": True}},
     "both bf16 and fp16"),
    ("ds3.json", {"zero_optimization": {"stage": 7}}, "zero_optimization.stage must be"),
    ("ds4.json", {"train_micro_batch_size_per_gpu": 0, "zero_optimization": {}}, "positive integer"),
    ("noline.sh", "#!/bin/bash\nset -e\necho hello\n", "holds no launch command"),
    ("hfds.json", {"output_dir": "o", "deepspeed": {"zero_optimization": {"stage": 2}, "bf16": True}},
     '"bf16" must be an object'),
    ("ds5.json", {"zero_optimization": [2]}, "zero_optimization must be an object"),
])
def test_bad_files_raise_config_error(tmp_path, name, text, words):
    with pytest.raises(ConfigError, match=re.escape(words)):
        frameworks.read(write(tmp_path, name, text))


def test_missing_file_raises_config_error(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        frameworks.read(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="no such file"):
        frameworks.detect(tmp_path / "nope.yaml")


def test_accelerate_file_next_to_fields_is_refused(tmp_path):
    p = write(tmp_path, "acc.yaml", "distributed_type: DEEPSPEED\ndeepspeed_config:\n  zero_stage: 2\n"
                                    f"  deepspeed_config_file: {SHIPPED / 'axolotl' / 'zero2.json'}\n")
    with pytest.raises(ConfigError, match="_deepspeed_config_checks"):
        frameworks.read(p)


def test_pure_bf16_with_zero3_is_refused(tmp_path):
    p = write(tmp_path, "lf.yaml", f"finetuning_type: full\npure_bf16: true\n"
                                   f"deepspeed: {SHIPPED / 'llamafactory' / 'ds_z3_config.json'}\n")
    with pytest.raises(ConfigError, match="pure_bf16 with DeepSpeed ZeRO-3"):
        frameworks.read(p)


@pytest.mark.parametrize("line, words", [
    ("", "empty"),
    ("srun train.py", "no launcher the kit reads"),
    ("accelerate config", "only accelerate launch"),
    ("llamafactory-cli chat x.yaml", "llamafactory-cli train"),
    ("python train.py --foo 3", "name no TrainingArguments"),
    ("torchrun train.py --deepspeed", "--deepspeed needs a value"),
    ("torchrun train.py --gradient_accumulation_steps $GA", "positive integer"),
    ("llamafactory-cli train missing.yaml", "llamafactory-cli train: missing.yaml is not found"),
    ("CUDA_VISIBLE_DEVICES=0 llamafactory-cli train llamafactory_full_sft.yaml", "FORCE_TORCHRUN=1"),
    ("accelerate launch --config_file accelerate_deepspeed.yaml train.py --bf16 --gradient_accumulation_steps 8",
     "ds gradient_accumulation_steps=4 vs TrainingArguments gradient_accumulation_steps=8"),
    ("accelerate launch --config_file accelerate_deepspeed.yaml train.py --gradient_accumulation_steps 4",
     "ds bf16.enabled=true vs TrainingArguments bf16"),
    ("trl sft --config trl_sft.yaml --accelerate_config zero1", "gradient_accumulation_steps=1 vs"),
    ("torchrun --nproc_per_node 2 train.py --deepspeed ds_zero2_fp16.json --bf16 --fp16", "At most one"),
    ("axolotl train axolotl_lora.yml --launcher slurm", "--launcher 'slurm'"),
])
def test_bad_command_lines_raise_config_error(line, words):
    with pytest.raises(ConfigError, match=re.escape(words)):
        cmd(line)


def test_a_string_is_not_an_argv():
    with pytest.raises(ConfigError, match="shlex.split"):
        frameworks.read_command_line("torchrun train.py")


def test_ds_batch_assertion(tmp_path):
    write(tmp_path, "ds.json", {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
                                "zero_optimization": {"stage": 1}})
    with pytest.raises(ConfigError, match="_batch_assertion"):
        cmd("torchrun --nproc_per_node 2 train.py --deepspeed ds.json --gradient_accumulation_steps 4", cwd=tmp_path)


def test_config_paths_look_in_the_config_folder_then_cwd(tmp_path):
    (tmp_path / "cfg").mkdir()
    (tmp_path / "run").mkdir()
    write(tmp_path / "run", "ds.json", {"zero_optimization": {"stage": 1}, "gradient_accumulation_steps": "auto"})
    p = write(tmp_path / "cfg", "hf.json", {"output_dir": "o", "deepspeed": "ds.json"})
    assert frameworks.read(p, cwd=tmp_path / "run").zero_stage == 1
    with pytest.raises(ConfigError, match=re.escape(f"deepspeed: ds.json is not found relative to {tmp_path / 'cfg'} "
                                                    f"or {tmp_path}")):
        frameworks.read(p, cwd=tmp_path)


def test_no_framework_is_imported():
    code = ("import sys, gradkit.frameworks as f; f.read(sys.argv[1]); "
            "bad = [m for m in ('transformers', 'trl', 'accelerate', 'deepspeed', 'axolotl', 'llamafactory', 'torch',"
            " 'gradkit.commands', 'gradkit.probes', 'gradkit.launch', 'gradkit.notebooks') if m in sys.modules];"
            " print(bad)")
    out = subprocess.run([sys.executable, "-c", code, str(HERE / "launch_torchrun.sh")], capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parent.parent, check=True)
    assert out.stdout.strip() == "[]"


def test_a_readme_placeholder_is_a_value_not_a_redirection(tmp_path):
    """deepseek-coder's README launch line has "--data_path <your_data_path>": a shell would refuse it, a reader
    fills it in; the flags after it still count."""
    ds = tmp_path / "ds.json"
    ds.write_text('{"zero_optimization": {"stage": 3}, "bf16": {"enabled": "auto"}}')
    run = frameworks.read_command_line(["torchrun", "--nproc_per_node", "8", "train.py", "--data_path",
                                        "<your_data_path>", "--deepspeed", str(ds), "--bf16", "True",
                                        "--gradient_accumulation_steps", "4"], cwd=tmp_path)
    assert (run.precision, run.ga, run.path) == ("bf16", 4, "deepspeed")
    run = frameworks.read_command_line(["torchrun", "train.py", "--deepspeed", str(ds), "<", "input.txt"], cwd=tmp_path)
    assert run.path == "deepspeed"  # a real redirection still ends the command


def test_axolotl_is_told_apart_by_one_key_only_axolotl_has_or_two_it_shares():
    """A strong key (base_model, micro_batch_size, ...) alone names axolotl; of the keys other configs share too, it
    takes two (a LLaMA-Factory YAML with ``datasets`` alone is not axolotl's)."""
    from gradkit.frameworks import axolotl

    assert axolotl.is_axolotl({"micro_batch_size": 2})
    assert axolotl.is_axolotl({"datasets": [], "adapter": "lora"})
    assert not axolotl.is_axolotl({"datasets": []}) and not axolotl.is_axolotl({"learning_rate": 1e-5, "bf16": True})


def test_axolotl_ga_of_one_from_batch_size_is_allowed_and_a_config_without_micro_batch_size_is_refused(tmp_path):
    """batch_size // micro_batch_size = 1 is GA 1; without micro_batch_size axolotl's two batch checks refuse the
    config (two of the three fields, not both of GA and batch_size: utils/schemas/validation.py)."""
    run = frameworks.read(write(tmp_path, "a.yml", "base_model: m\nmicro_batch_size: 4\nbatch_size: 4\n"
                                                   "gradient_accumulation_steps: null\n"))
    assert (run.micro_batch, run.ga) == (4, 1)
    for text in ("gradient_accumulation_steps: 4\nbatch_size: 8\n", "gradient_accumulation_steps: 4\n"):
        with pytest.raises(ConfigError, match="axolotl"):
            frameworks.read(write(tmp_path, "b.yml", "base_model: m\n" + text))


def test_axolotl_fsdp_version_goes_into_an_fsdp_config_that_lacks_one_and_fsdp_config_alone_turns_fsdp_on(tmp_path):
    """axolotl's schema moves the top-level ``fsdp_version`` into ``fsdp_config`` (utils/schemas/config.py); an
    ``fsdp_config`` with no ``fsdp`` list still runs FSDP (axolotl sets TrainingArguments.fsdp)."""
    base = "base_model: m\nmicro_batch_size: 1\ngradient_accumulation_steps: 2\n"
    run = frameworks.read(write(tmp_path, "a.yml", base + "fsdp_version: 1\nfsdp_config:\n  reshard_after_forward: true\n"))
    assert run.path == "fsdp" and any("-> FSDP1" in n for n in run.notes), run.notes
    said(run, "fsdp_version: 1 -> fsdp_config")
    run = frameworks.read(write(tmp_path, "b.yml", base + "fsdp_version: 1\nfsdp_config:\n  fsdp_version: 2\n"))
    assert any("-> FSDP2" in n for n in run.notes) and not any(n.startswith("fsdp_version:") for n in run.notes)
    run = frameworks.read(write(tmp_path, "c.yml", base + "fsdp_version: 2\n"))
    assert run.path != "fsdp"  # fsdp_version alone asks for no FSDP


def test_axolotl_says_which_quantised_adapter_and_pure_fp16_weights_it_read(tmp_path):
    base = "base_model: m\nmicro_batch_size: 1\ngradient_accumulation_steps: 2\n"
    said(frameworks.read(write(tmp_path, "a.yml", base + "adapter: qlora\nload_in_4bit: true\n")), "adapter: qlora (load_in_4bit)")
    said(frameworks.read(write(tmp_path, "b.yml", base + "adapter: lora\nload_in_8bit: true\n")), "adapter: lora (load_in_8bit)")
    plain = frameworks.read(write(tmp_path, "c.yml", base + "adapter: lora\n"))
    said(plain, "adapter: lora")
    assert not any("load_in" in n for n in plain.notes)
    said(frameworks.read(write(tmp_path, "d.yml", base)), "adapter: absent -> none (all parameters train)")
    pure = frameworks.read(write(tmp_path, "e.yml", base + "bf16: false\nfloat16: true\n"))
    said(pure, "float16: true -> fp16 weights without AMP")
    assert not any("float16: true" in n for n in frameworks.read(write(tmp_path, "f.yml", base + "bf16: false\n")).notes)


def test_axolotl_sets_both_loss_accounting_switches_off_whatever_the_yaml_says(tmp_path):
    """axolotl 0.19.0: average_tokens_across_devices False (core/builders/base.py) and model_accepts_loss_kwargs False
    (core/trainers/base.py, axolotl-ai-cloud/axolotl#3982), the Trainer's path check runs the Trainer with both."""
    run = frameworks.read(write(tmp_path, "a.yml", "base_model: m\nmicro_batch_size: 1\ngradient_accumulation_steps: 2\n"
                                                   "average_tokens_across_devices: true\n"))
    assert run.trainer_overrides == {"average_tokens_across_devices": False, "model_accepts_loss_kwargs": False}


def test_axolotl_command_line_values_are_read_as_yaml_scalars_over_the_file():
    from gradkit.frameworks import axolotl

    out = axolotl.overrides({"micro_batch_size": "4", "bf16": "true", "lr": "0.5", "name": "", "flag": True,
                             "launcher": "torchrun"})
    assert out == {"micro_batch_size": 4, "bf16": True, "lr": 0.5, "name": "", "flag": True}
