"""The recipes of examples/recipes/, run as their framework runs them (torchrun, accelerate launch, the framework's
own entry point), unchanged but for the command-line overrides a CPU needs: LLaMA-Factory's SFT on DeepSpeed ZeRO-2
with the watch in its callbacks, and TRL's SFT script under its own ZeRO-2 preset with the watch attached
(``gradkit.watch.attach``), judge their steps on a tiny local Llama (nothing downloaded)."""
import json
import shlex
import sys
from pathlib import Path

import pytest
import yaml

from gradkit import frameworks
from gradkit.config import ConfigError
from gradkit.judge import oracle
from gradkit.launch import scripts
from gradkit.stacks import extras
from gradkit.watch import attach

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "examples" / "recipes" / "llamafactory"
TRL = REPO / "examples" / "recipes" / "trl"
AXOLOTL = REPO / "examples" / "recipes" / "axolotl"
ROWS = [("Give three tips for staying healthy.", "Eat good food, drink water, sleep."),
        ("Why is the sky blue?", "Because blue light scatters."), ("What is the capital of France?", "Paris."),
        ("Add two and three.", "Five."), ("Name a color.", "Blue."), ("Say hello.", "Hello!"),
        ("Is water good?", "Yes, drink water every day."), ("Tell me a city.", "Paris is a city in France.")] * 4


def tiny_llama(folder: Path) -> Path:
    """A one-layer Llama and a word-level tokenizer with a chat template, saved as a model folder (no download)."""
    import torch
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    words = sorted({w for q, a in ROWS for w in (q + " " + a).lower().replace(".", " ").replace("?", " ").split()})
    vocab = {t: i for i, t in enumerate(["<unk>", "<s>", "</s>", "<pad>", *words, *".,!?:' \n"])}
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tk.normalizer, tk.decoder = normalizers.Lowercase(), decoders.Fuse()
    tk.pre_tokenizer = pre_tokenizers.Split(Regex(r"\w+|[^\w\s]|\s"), behavior="isolated")
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                  pad_token="<pad>")
    tok.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                         "{% if add_generation_prompt %}assistant: {% endif %}")
    tok.save_pretrained(folder)
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(hidden_size=32, num_hidden_layers=1, intermediate_size=64, num_attention_heads=2,
                                 num_key_value_heads=2, vocab_size=len(tok), max_position_embeddings=256,
                                 bos_token_id=1, eos_token_id=2, pad_token_id=3)).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """What the runs of one framework share: the Hugging Face home and LLaMA-Factory's torchaudio stand-in. The job
    server that forks their ranks is keyed by the ranks' whole environment (transformers reads HF_HOME at import):
    one folder for every run lets the runs of a framework fork from one server instead of importing the stack each.
    Each run's data, model, cache of prepared rows and output stay its own."""
    folder = tmp_path_factory.mktemp("recipes")
    # LLaMA-Factory imports torchaudio at start for audio data; no torchaudio release loads with torch 2.13 (the
    # newest, 2.11.0, fails to load its library): an empty module stands in for it, a text-only run never calls it
    (folder / "shim" / "torchaudio").mkdir(parents=True)
    (folder / "shim" / "torchaudio" / "__init__.py").write_text("")
    return {"hf": folder / "hf", "shim": folder / "shim"}


@pytest.mark.world
@pytest.mark.parametrize("entry", ["script", "attach"])
def test_llamafactory_sft_on_zero2_with_the_watch_in_run_exps_callbacks_is_judged_exact(tmp_path, entry, shared):
    """LLaMA-Factory 0.9.5 (its newest release; an extra package set, not the kit's environment) runs the recipe's
    YAML, LoRA on DeepSpeed ZeRO-2, through ``run_exp(callbacks=[gradkit.watch.Callback()])``; the CPU overrides are
    ``key=value`` arguments, as LLaMA-Factory takes them. The watch judges the Trainer's steps of LLaMA-Factory's
    own prompt-masked SFT batches: exact on this transformers (5.23: B1 and HFT fixed in 5.10.1). The same through
    LLaMA-Factory's own entry point with the watch attached (``torchrun -m gradkit.watch.attach
    llamafactory.launcher``, what ``llamafactory-cli train`` runs on each rank): its callback beside LLaMA-Factory's."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "rows.json").write_text(json.dumps([{"instruction": q, "input": "", "output": a} for q, a in ROWS]))
    (data / "dataset_info.json").write_text(json.dumps({"rows": {"file_name": "rows.json"}}))
    out = tmp_path / "out"
    overrides = {"model_name_or_path": tiny_llama(tmp_path / "model"), "trust_remote_code": "false",
                 "dataset_dir": data, "dataset": "rows", "template": "default", "cutoff_len": 64,
                 "output_dir": out, "max_steps": 2, "gradient_accumulation_steps": 2, "deepspeed": RECIPE / "ds_z2.json",
                 "use_cpu": "true", "ddp_backend": "gloo", "bf16": "false",
                 # LLaMA-Factory 0.9.5's own checkpointing wrapper reads func.func.__self__, gone in transformers 5.23
                 "disable_gradient_checkpointing": "true"}
    args = [RECIPE / "sft_lora_zero2.yaml", *(f"{k}={v}" for k, v in overrides.items())]
    program, argv = ((RECIPE / "train_with_gradkit.py", args) if entry == "script" else
                     ("gradkit.watch.attach", ["llamafactory.launcher", *args]))
    rc, stdout, stderr = scripts.torchrun(
        program, argv, module=entry == "attach", packages=("deepspeed", "transformers", "accelerate"), timeout_s=600, cwd=REPO,
        paths=[extras.ensure("llamafactory"), shared["shim"]],
        env={"DISABLE_VERSION_CHECK": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
             "HF_HOME": str(shared["hf"]), "TOKENIZERS_PARALLELISM": "false"})
    assert rc == 0, (stdout + stderr)[-3000:]
    recs = [json.loads(x) for x in (out / "gradkit-watch" / "watch.jsonl").read_text().splitlines()]
    steps = [r for r in recs if "logged_norm" not in r]
    assert [r["verdict"] for r in steps] == [oracle.NOT_AFFECTED] * 2, [r["line"] for r in recs]
    assert all(r["versions"]["deepspeed"] and r["read"] == "fp32 partitions" for r in steps)
    assert {r["line"] for r in recs} <= set(stdout.splitlines())  # said in the training log too


@pytest.mark.world
@pytest.mark.parametrize("rows", ["even", "uneven", "uneven+fix"])
def test_axolotls_own_entry_point_with_the_watch_attached_on_two_ranks_is_judged_and_its_mean_of_means_named(
        tmp_path, rows, shared):
    """What ``axolotl train lora.yml`` launches (``-m axolotl.cli.train``, axolotl 0.19.0, an extra package set), with
    ``-m gradkit.watch.attach`` before it, on 2 ranks (DDP, gloo): the recipe's YAML with the model, the data, two
    steps of GA 2 and the CPU keys (no bf16 or flash attention; axolotl's Triton LoRA kernels off; ``max_memory``,
    so that its device map is not ``{"": LOCAL_RANK}``, an accelerator index) and ``ACCELERATE_USE_CPU`` (what
    ``accelerate launch --cpu`` sets, so that Accelerate takes the CPU ranks as one gloo world).

    axolotl's trainer sets ``model_accepts_loss_kwargs = False`` for a model whose ``forward`` names no
    ``num_items_in_batch`` (it takes ``**kwargs``, as transformers' Llama does), so each micro-batch's loss is its own
    token mean: the step is the mean of the micro-batch means (axolotl-ai-cloud/axolotl#3982, open). Where every
    micro-batch holds as many label tokens, that is the token mean: not-affected; on rows of other lengths the watch
    names that step. The recipe's plugin (``gradkit_axolotl_fix.TokenMean``) sets both back: the same rows exact."""
    if rows == "even":  # every answer 4 words and a full stop: 8 label tokens and EOS in every row
        data = [{"instruction": q, "input": "", "output": f"{w[0]} {w[1]} {w[2]} {w[3]}."}
                for q, a in ROWS for w in [a.lower().replace(",", "").replace(".", "").replace("!", "").split() * 4]]
    else:
        data = [{"instruction": q, "input": "", "output": a} for q, a in ROWS]
    (tmp_path / "rows.json").write_text(json.dumps(data))
    cfg = yaml.safe_load((AXOLOTL / "lora.yml").read_text())
    cfg.update(base_model=str(tiny_llama(tmp_path / "model")), output_dir=str(tmp_path / "out"),
               datasets=[{"path": str(tmp_path / "rows.json"), "ds_type": "json", "type": "alpaca"}],
               dataset_prepared_path=str(tmp_path / "prepared"), sequence_len=128, max_steps=2,
               gradient_accumulation_steps=2, bf16=False, flash_attention=False, gradient_checkpointing=False,
               lora_mlp_kernel=False, lora_qkv_kernel=False, lora_o_kernel=False, lora_embedding_kernel=False,
               max_memory={"cpu": "8GiB"}, dataloader_num_workers=0, dataset_num_proc=1,
               **({"plugins": ["gradkit_axolotl_fix.TokenMean"]} if rows.endswith("+fix") else {}))
    (tmp_path / "lora.yml").write_text(yaml.safe_dump(cfg))
    rc, stdout, stderr = scripts.torchrun(
        "gradkit.watch.attach", ["axolotl.cli.train", tmp_path / "lora.yml"], module=True, timeout_s=600,
        packages=("deepspeed", "transformers", "accelerate"), cwd=tmp_path, paths=[extras.ensure("axolotl"), AXOLOTL],
        env={"ACCELERATE_USE_CPU": "true", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
             "HF_HOME": str(shared["hf"]), "TOKENIZERS_PARALLELISM": "false", "AXOLOTL_DO_NOT_TRACK": "1",
             "DO_NOT_TRACK": "1", "WANDB_MODE": "disabled"})
    assert rc == 0, (stdout + stderr)[-3000:]
    recs = [json.loads(x) for x in (tmp_path / "out" / "gradkit-watch" / "watch.jsonl").read_text().splitlines()]
    steps = [r for r in recs if "logged_norm" not in r]
    assert len(steps) == 2 and all(r["world_size"] == 2 and r["ga"] == 2 for r in steps), [r["line"] for r in recs]
    if rows != "uneven":
        assert [r["verdict"] for r in steps] == [oracle.NOT_AFFECTED] * 2, [r["line"] for r in recs]
    else:
        assert [r["verdict"] for r in steps] == [oracle.AFFECTED] * 2, [r["line"] for r in recs]
        assert all(r["matches"] == "mean of micro-batch means" for r in steps), [r["line"] for r in recs]


@pytest.mark.world
def test_trls_sft_script_under_its_zero2_preset_with_the_watch_attached_is_judged_exact_at_its_bf16(tmp_path):
    """What ``trl sft --config sft_zero2.yaml --accelerate_config zero2`` launches (``accelerate launch`` of
    trl/scripts/sft.py with TRL's preset), with ``-m gradkit.watch.attach`` before the script: TRL 1.16's own SFT
    script builds its ``SFTTrainer`` and the attach puts the watch's callback in it. TRL's preset as shipped (bf16,
    ZeRO-2), TRL's packing; the overrides are the model, the data, two steps of GA 2, rows of 48 tokens and the CPU."""
    assert (TRL / "zero2.yaml").read_text() == (extras.ensure("trl") / "trl/accelerate_configs/zero2.yaml").read_text()
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.jsonl").write_text("".join(json.dumps({"text": f"{q} {a}"}) + "\n" for q, a in ROWS))
    out = tmp_path / "out"
    overrides = {"model_name_or_path": tiny_llama(tmp_path / "model"), "dataset_name": tmp_path / "data",
                 "eos_token": "</s>", "output_dir": out, "max_steps": 2, "gradient_accumulation_steps": 2,
                 "max_length": 48, "use_cpu": "true", "report_to": "none", "save_strategy": "no"}
    rc, stdout, stderr = scripts.accelerate(
        ["--config_file", TRL / "zero2.yaml", "--num_processes", 2, "-m", "gradkit.watch.attach", "trl.scripts.sft",
         "--config", TRL / "sft_zero2.yaml", *(x for k, v in overrides.items() for x in (f"--{k}", v))],
        timeout_s=600, cwd=REPO, paths=[extras.ensure("trl")],
        env={"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"),
             "TOKENIZERS_PARALLELISM": "false"})
    assert rc == 0, (stdout + stderr)[-3000:]
    recs = [json.loads(x) for x in (out / "gradkit-watch" / "watch.jsonl").read_text().splitlines()]
    steps = [r for r in recs if "logged_norm" not in r]
    assert [r["verdict"] for r in steps] == [oracle.NOT_AFFECTED] * 2, [r["line"] for r in recs]
    assert all(r["read"] == "fp32 partitions" and r["dtype"] == "bf16" and r["world_size"] == 2 for r in steps)
    assert steps[0]["ga"] == 2 and steps[0]["versions"]["deepspeed"]


def test_the_check_reads_a_launch_line_with_the_watch_attached_as_the_run_it_wraps():
    """``gradkit check --command`` on the recipe's launch line reads the run of ``trl sft`` itself: the attach's own
    options are no training settings, its target's arguments are."""
    def read(line):
        run = frameworks.read_command_line(shlex.split(line), cwd=TRL)
        return run, {k: getattr(run, k) for k in ("framework", "world_size", "zero_stage", "precision", "ga",
                                                 "micro_batch", "path")}

    plain, want = read("trl sft --config sft_zero2.yaml --accelerate_config zero2")
    assert want == {"framework": "trl", "world_size": 8, "zero_stage": 2, "precision": "bf16", "ga": 8,
                    "micro_batch": 2, "path": "deepspeed"}
    attached, got = read("accelerate launch --config_file zero2.yaml -m gradkit.watch.attach --every 50 --stop "
                         "trl.scripts.sft --config sft_zero2.yaml --gradient_accumulation_steps 4")
    assert got == {**want, "ga": 4}
    assert any("gradkit.watch.attach runs trl.scripts.sft" in n for n in attached.notes)
    with pytest.raises(ConfigError, match="gradkit.watch.attach: argument --every"):
        read("accelerate launch --config_file zero2.yaml -m gradkit.watch.attach --every trl.scripts.sft")


def test_the_attach_adds_one_callback_to_every_trainer_and_refuses_a_target_that_is_not_there(tmp_path, monkeypatch,
                                                                                             capsys):
    """A Trainer (or subclass) built after ``attach`` holds one gradkit callback, with the attach's options; one that
    has its own keeps it alone; where transformers cannot be imported the job runs without the watch and says so; a
    target that is neither a module nor a file, or a wrong option, is exit 2 and one sentence before anything runs."""
    import torch
    from transformers import Trainer, TrainingArguments

    from gradkit.watch.hf import Callback

    monkeypatch.setattr(Trainer, "__init__", Trainer.__init__)  # restored after the test
    model, args = torch.nn.Linear(2, 2), TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])

    def ours(trainer):
        return [c for c in trainer.callback_handler.callbacks if isinstance(c, Callback)]

    assert ours(Trainer(model=model, args=args)) == []
    assert attach.attach({"every": 7, "stop": True}) and attach.attach({"every": 9})  # the second changes nothing

    class Sub(Trainer):
        pass

    added = ours(Sub(model=model, args=args))
    assert len(added) == 1 and added[0].options == {"every": 7} and added[0].stop
    own = Callback(every=3)
    assert ours(Trainer(model=model, args=args, callbacks=[own])) == [own]

    monkeypatch.setitem(sys.modules, "transformers", None)
    said = []
    assert not attach.attach({}, log=said.append) and "the job runs without the watch" in said[0]

    ran = tmp_path / "ran"
    job = tmp_path / "job.py"
    job.write_text(f"import sys; open({str(ran)!r}, 'w').write(' '.join(sys.argv[1:]))\n")
    for argv in (["no.such.module"], [str(tmp_path / "none.py")], ["--every", "x", str(job)], []):
        assert attach.main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("python -m gradkit.watch.attach: ") and err.count("\n") == 1, err
    assert not ran.exists()
    assert attach.main(["--every", "5", str(job), "--its", "own"]) == 0 and ran.read_text() == "--its own"
