"""The recipes of examples/recipes/, run as their framework runs them (torchrun, the framework's own entry point),
unchanged but for the command-line overrides a CPU needs: LLaMA-Factory's SFT on DeepSpeed ZeRO-2 with the watch in
its callbacks judges its steps, on a tiny local Llama (nothing downloaded)."""
import json
from pathlib import Path

import pytest

from gradkit.judge import oracle
from gradkit.launch import scripts
from gradkit.stacks import extras

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "examples" / "recipes" / "llamafactory"
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


@pytest.mark.world
def test_llamafactory_sft_on_zero2_with_the_watch_in_run_exps_callbacks_is_judged_exact(tmp_path):
    """LLaMA-Factory 0.9.5 (its newest release; an extra package set, not the kit's environment) runs the recipe's
    YAML, LoRA on DeepSpeed ZeRO-2, through ``run_exp(callbacks=[gradkit.watch.Callback()])``; the CPU overrides are
    ``key=value`` arguments, as LLaMA-Factory takes them. The watch judges the Trainer's steps of LLaMA-Factory's
    own prompt-masked SFT batches: exact on this transformers (5.23: B1 and HFT fixed in 5.10.1)."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "rows.json").write_text(json.dumps([{"instruction": q, "input": "", "output": a} for q, a in ROWS]))
    (data / "dataset_info.json").write_text(json.dumps({"rows": {"file_name": "rows.json"}}))
    # LLaMA-Factory imports torchaudio at start for audio data; no torchaudio release loads with torch 2.13 (the
    # newest, 2.11.0, fails to load its library): an empty module stands in for it, this text-only run never calls it
    (tmp_path / "shim" / "torchaudio").mkdir(parents=True)
    (tmp_path / "shim" / "torchaudio" / "__init__.py").write_text("")
    out = tmp_path / "out"
    overrides = {"model_name_or_path": tiny_llama(tmp_path / "model"), "trust_remote_code": "false",
                 "dataset_dir": data, "dataset": "rows", "template": "default", "cutoff_len": 64,
                 "output_dir": out, "max_steps": 2, "gradient_accumulation_steps": 2, "deepspeed": RECIPE / "ds_z2.json",
                 "use_cpu": "true", "ddp_backend": "gloo", "bf16": "false",
                 # LLaMA-Factory 0.9.5's own checkpointing wrapper reads func.func.__self__, gone in transformers 5.23
                 "disable_gradient_checkpointing": "true"}
    rc, stdout, stderr = scripts.torchrun(
        RECIPE / "train_with_gradkit.py", [RECIPE / "sft_lora_zero2.yaml", *(f"{k}={v}" for k, v in overrides.items())],
        packages=("deepspeed", "transformers", "accelerate"), timeout_s=600, cwd=REPO,
        paths=[extras.ensure("llamafactory"), tmp_path / "shim"],
        env={"DISABLE_VERSION_CHECK": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
             "HF_HOME": str(tmp_path / "hf"), "TOKENIZERS_PARALLELISM": "false"})
    assert rc == 0, (stdout + stderr)[-3000:]
    recs = [json.loads(x) for x in (out / "gradkit-watch" / "watch.jsonl").read_text().splitlines()]
    steps = [r for r in recs if "logged_norm" not in r]
    assert [r["verdict"] for r in steps] == [oracle.NOT_AFFECTED] * 2, [r["line"] for r in recs]
    assert all(r["versions"]["deepspeed"] and r["read"] == "fp32 partitions" for r in steps)
    assert {r["line"] for r in recs} <= set(stdout.splitlines())  # said in the training log too
