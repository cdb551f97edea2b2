"""An HF Trainer job with gradkit's watch on it: the one line is ``callbacks=[gradkit.watch.Callback()]``.

    torchrun --nproc-per-node 2 examples/watch/trainer_job.py --collator pad

A tiny Llama built from a config (no download) on rows of 5 to 16 tokens, AdamW, the Trainer's defaults otherwise
(max_grad_norm 1.0). ``--collator pad``: rows padded per micro-batch, padding labels -100; ``packed``: transformers'
padding-free ``DataCollatorWithFlattening`` (one row, ``position_ids``, each sequence's first label -100);
``packed-wrong``: a hand-written packing collator that forgets that mask (the label of each sequence's first token is
predicted from the previous sequence and counted). ``--custom-loss``: a ``compute_loss`` that returns the sum of the
token losses and forgets to divide.
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
p.add_argument("--custom-loss", action="store_true")
p.add_argument("--ga", type=int, default=2)
p.add_argument("--steps", type=int, default=2)
p.add_argument("--every", type=int, default=0, help="judge every this many steps after the first two")
p.add_argument("--out", default="gradkit-watch")
args = p.parse_args()

torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256))
g = torch.Generator().manual_seed(1)
rows = []
for _ in range(64):
    ids = torch.randint(0, 64, (int(torch.randint(5, 17, (1,), generator=g)),), generator=g).tolist()
    rows.append({"input_ids": ids, "labels": list(ids)})


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


collator = {"pad": lambda: DataCollatorForSeq2Seq(tokenizer=None, padding=True, label_pad_token_id=-100),
            "packed": DataCollatorWithFlattening, "packed-wrong": lambda: packed_wrong}[args.collator]()
if args.collator == "pad":  # without a tokenizer: pad by hand, as DataCollatorForSeq2Seq would
    def collator(features):
        n = max(len(f["input_ids"]) for f in features)
        pad = lambda xs, v: [x + [v] * (n - len(x)) for x in xs]  # noqa: E731
        return {"input_ids": torch.tensor(pad([f["input_ids"] for f in features], 0)),
                "attention_mask": torch.tensor(pad([[1] * len(f["input_ids"]) for f in features], 0)),
                "labels": torch.tensor(pad([f["labels"] for f in features], -100))}

targs = TrainingArguments(output_dir=args.out + "-trainer", per_device_train_batch_size=2,
                          gradient_accumulation_steps=args.ga, learning_rate=1e-3, max_steps=args.steps,
                          report_to=[], save_strategy="no", logging_steps=1, use_cpu=True, seed=0,
                          remove_unused_columns=False, dataloader_drop_last=True)
trainer = (SumLoss if args.custom_loss else Trainer)(
    model=model, args=targs, train_dataset=rows, data_collator=collator,
    callbacks=[gradkit.watch.Callback(out=args.out, every=args.every)])  # <- gradkit's one line
trainer.train()
# Leave without the interpreter's tear-down: on CPU its C++ destructors (gloo, DeepSpeed's comm op) abort a rank now
# and then after the work is done ("terminate called without an active exception"), as kit/launch/worker.py says.
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
