"""An HF Trainer job with gradkit's watch on it: the one line is ``callbacks=[gradkit.watch.Callback()]``.

    torchrun --nproc-per-node 2 examples/watch/trainer_job.py --collator pad
    torchrun --nproc-per-node 2 examples/watch/trainer_job.py --deepspeed 2 --rows prompts   # the Trainer on ZeRO-2

A tiny Llama built from a config (no download), AdamW (the Trainer's own, its two parameter groups: decay and no
decay), the Trainer's defaults otherwise (max_grad_norm 1.0). ``--rows short``: rows of 5 to 16 tokens, every label
counted; ``prompts``: rows of 3 to 60 tokens, every other one's first half a prompt (labels -100), as SFT data has them.
``--collator pad``: rows padded per micro-batch, padding labels -100; ``packed``: transformers' padding-free
``DataCollatorWithFlattening`` (one row, ``position_ids``, each sequence's first label -100); ``packed-wrong``: a
hand-written packing collator that forgets that mask (the label of each sequence's first token is predicted from the
previous sequence and counted). ``--custom-loss``: a ``compute_loss`` that returns the sum of the token losses and
forgets to divide.

On DeepSpeed (``--deepspeed STAGE``): the config LLaMA-Factory and axolotl ship, every size ``"auto"`` (the Trainer
fills them), ``--offload optimizer|param|both`` to the CPU, ``--ds-optimizer`` DeepSpeed's optimizer from the config
(torch's AdamW under it) instead of the Trainer's; ``--precision bf16`` mixed precision, ``fp16`` DeepSpeed's fp16 with
its dynamic loss scale (``--loss-scale-window``: the steps between its increases); ``--lora`` a PEFT LoRA adapter
(only its weights train); ``--gradient-checkpointing``. The device is the machine's: CUDA where there is one.
"""
import argparse
import os
import sys

import torch
import torch.nn.functional as F
from transformers import (DataCollatorForSeq2Seq, DataCollatorWithFlattening, LlamaConfig, LlamaForCausalLM, Trainer,
                          TrainingArguments)

import gradkit

p = argparse.ArgumentParser()
p.add_argument("--collator", choices=("pad", "packed", "packed-wrong"), default="pad")
p.add_argument("--rows", choices=("short", "prompts"), default="short")
p.add_argument("--custom-loss", action="store_true")
p.add_argument("--user-error", type=int, help="the job's own compute_loss raises at this step (the watch passes it on)")
p.add_argument("--ga", type=int, default=2)
p.add_argument("--steps", type=int, default=2)
p.add_argument("--every", type=int, default=0, help="judge every this many steps after the first two")
p.add_argument("--deepspeed", type=int, choices=(0, 1, 2, 3), help="the Trainer on DeepSpeed, this ZeRO stage")
p.add_argument("--offload", choices=("optimizer", "param", "both"), help="with --deepspeed: offloaded to the CPU")
p.add_argument("--ds-optimizer", action="store_true", help="with --deepspeed: the optimizer from the DeepSpeed config")
p.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default="fp32",
               help="mixed precision (fp16: with --deepspeed, its dynamic loss scale)")
p.add_argument("--loss-scale-window", type=int, help="with --precision fp16: DeepSpeed's loss_scale_window")
p.add_argument("--optim", default="adamw_torch", help="the Trainer's optim (e.g. sgd)")
p.add_argument("--lora", action="store_true", help="a PEFT LoRA adapter on the attention projections")
p.add_argument("--gradient-checkpointing", action="store_true")
p.add_argument("--out", default="gradkit-watch")
p.add_argument("--no-watch", action="store_true", help="the same job without the watch (a control's losses)")
p.add_argument("--shard", choices=("auto", "on", "off"), default="auto",
               help="the watch's reference sharded over the ranks (auto: where the engine shards the model)")
args = p.parse_args()
if args.precision == "fp16" and args.deepspeed is None:
    p.error("--precision fp16 runs DeepSpeed's fp16 (give --deepspeed STAGE): Accelerate's own fp16 needs a GPU")
if args.precision == "fp16" and not torch.cuda.is_available():  # DeepSpeed's CPU accelerator declares no fp16 where
    from gradkit.probes.ranks.ds_config import allow_fp16_on_cpu  # oneDNN lacks fp16 kernels; torch computes half on

    allow_fp16_on_cpu()  # any CPU: told so, DeepSpeed's own fp16 code runs (as gradkit check does)

torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256))
if args.lora:
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
g = torch.Generator().manual_seed(1)
rows = []
for _ in range(64):
    lo, hi = (5, 17) if args.rows == "short" else (3, 61)
    ids = torch.randint(0, 64, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g).tolist()
    prompt = len(ids) // 2 if args.rows == "prompts" and len(rows) % 2 else 0  # every other row has a prompt
    rows.append({"input_ids": ids, "labels": [-100] * prompt + ids[prompt:]})


def packed_wrong(features):  # concatenates the rows and counts every label, the first token of each sequence too
    ids = [t for f in features for t in f["input_ids"]]
    pos = [i for f in features for i in range(len(f["input_ids"]))]
    return {"input_ids": torch.tensor([ids]), "labels": torch.tensor([ids]), "position_ids": torch.tensor([pos])}


class SumLoss(Trainer):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        labels = inputs.pop("labels")
        logits = model(**inputs).logits[:, :-1]
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100,
                               reduction="sum")  # forgets to divide by num_items_in_batch
        return loss


class Raises(Trainer):  # the user's own code failing: its error reaches the user as it would without the watch
    def compute_loss(self, model, inputs, *rest, **kw):
        if self.state.global_step + 1 == args.user_error:
            raise ValueError(f"the user's own error at step {args.user_error}")
        return super().compute_loss(model, inputs, *rest, **kw)


collator = {"pad": lambda: DataCollatorForSeq2Seq(tokenizer=None, padding=True, label_pad_token_id=-100),
            "packed": DataCollatorWithFlattening, "packed-wrong": lambda: packed_wrong}[args.collator]()
if args.collator == "pad":  # without a tokenizer: pad by hand, as DataCollatorForSeq2Seq would
    def collator(features):
        n = max(len(f["input_ids"]) for f in features)
        pad = lambda xs, v: [x + [v] * (n - len(x)) for x in xs]  # noqa: E731
        return {"input_ids": torch.tensor(pad([f["input_ids"] for f in features], 0)),
                "attention_mask": torch.tensor(pad([[1] * len(f["input_ids"]) for f in features], 0)),
                "labels": torch.tensor(pad([f["labels"] for f in features], -100))}

ds = None
if args.deepspeed is not None:  # as LLaMA-Factory's and axolotl's shipped configs: every size left to the Trainer
    ds = {"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto", "gradient_accumulation_steps": "auto",
          "gradient_clipping": "auto", "bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"},
          "zero_optimization": {"stage": args.deepspeed, "overlap_comm": False, "contiguous_gradients": True}}
    for what in ("optimizer", "param") if args.offload == "both" else (args.offload,) if args.offload else ():
        ds["zero_optimization"][f"offload_{what}"] = {"device": "cpu"}
    if args.loss_scale_window:
        ds["fp16"]["loss_scale_window"] = args.loss_scale_window
    if args.offload:
        ds["zero_force_ds_cpu_optimizer"] = False  # a torch optimizer, not DeepSpeedCPUAdam (a C++ op to build)
    if args.ds_optimizer:  # DeepSpeed builds it (torch's AdamW: no fused op to build); the Trainer's is not made
        ds["optimizer"] = {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto", "torch_adam": True}}
targs = TrainingArguments(output_dir=args.out + "-trainer", per_device_train_batch_size=2,
                          gradient_accumulation_steps=args.ga, learning_rate=1e-3, max_steps=args.steps,
                          report_to=[], save_strategy="no", logging_steps=1, use_cpu=not torch.cuda.is_available(),
                          seed=0, remove_unused_columns=False, dataloader_drop_last=True, deepspeed=ds,
                          bf16=args.precision == "bf16", fp16=args.precision == "fp16",
                          gradient_checkpointing=args.gradient_checkpointing,
                          optim=args.optim)
trainer = (SumLoss if args.custom_loss else Raises if args.user_error else Trainer)(
    model=model, args=targs, train_dataset=rows, data_collator=collator,
    callbacks=[] if args.no_watch else [gradkit.watch.Callback(out=args.out, every=args.every, shard={
        "on": True, "off": False}.get(args.shard))])  # <- gradkit's one line
trainer.train()
# Leave without the interpreter's tear-down: on CPU its C++ destructors (gloo, DeepSpeed's comm op) abort a rank now
# and then after the work is done ("terminate called without an active exception"), as kit/launch/worker.py says.
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
