"""A TRL ``SFTTrainer`` job with gradkit's watch on it: TRL's trainers are the HF Trainer's subclasses, so the one
line is the same, ``callbacks=[gradkit.watch.Callback()]``.

    torchrun --nproc-per-node 2 examples/watch/trl_job.py [--packing] [--fp32]

A tiny Llama built from a config and a word-level tokenizer built in memory (no download), rows of 5 to 16 tokens
already tokenized, TRL's SFT defaults otherwise: its own loss (the fused LM head, per-token log-probabilities summed
over the tokens of every rank, ``average_tokens_across_devices``) and its precision (bf16 autocast where the machine
has it, CPU included). ``--packing``: TRL's packing (best-fit decreasing into rows of 48 tokens, padding-free, each
sequence's positions from 0 in ``position_ids``). ``--fp32``: no bf16 autocast. ``--deepspeed STAGE``: on DeepSpeed, the
config's sizes all ``"auto"``. ``--per-rank-mean``:
``average_tokens_across_devices=False``, each rank's loss divided by its own tokens and the ranks' gradients
averaged: not the mean over the global batch's tokens when the ranks hold different numbers of them.
"""
import argparse
import os
import sys

import torch
from datasets import Dataset
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from trl import SFTConfig, SFTTrainer

import gradkit

p = argparse.ArgumentParser()
p.add_argument("--packing", action="store_true", help="TRL's packing (best-fit decreasing) into rows of 48 tokens")
p.add_argument("--fp32", action="store_true", help="no bf16 autocast")
p.add_argument("--per-rank-mean", action="store_true", help="average_tokens_across_devices=False")
p.add_argument("--deepspeed", type=int, choices=(0, 1, 2, 3), help="TRL's trainer on DeepSpeed, this ZeRO stage")
p.add_argument("--ga", type=int, default=2)
p.add_argument("--steps", type=int, default=2)
p.add_argument("--out", default="gradkit-watch")
args = p.parse_args()

VOCAB = 64
words = {f"w{i}": i for i in range(VOCAB - 2)} | {"<pad>": VOCAB - 2, "</s>": VOCAB - 1}
tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(words, unk_token="<pad>")),
                                    pad_token="<pad>", eos_token="</s>")
torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                                     pad_token_id=VOCAB - 2, eos_token_id=VOCAB - 1))
g = torch.Generator().manual_seed(1)
rows = [{"input_ids": torch.randint(0, VOCAB - 2, (int(torch.randint(5, 17, (1,), generator=g)),), generator=g).tolist()}
        for _ in range(160)]

config = SFTConfig(output_dir=args.out + "-trl", per_device_train_batch_size=2, gradient_accumulation_steps=args.ga,
                   learning_rate=1e-3, max_steps=args.steps, report_to=[], save_strategy="no", logging_steps=1,
                   use_cpu=not torch.cuda.is_available(), seed=0, dataloader_drop_last=True,
                   deepspeed=None if args.deepspeed is None else {  # every size left to the trainer, as shipped
                       "train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
                       "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
                       "bf16": {"enabled": "auto"}, "zero_optimization": {"stage": args.deepspeed}},
                   **({"packing": True, "packing_strategy": "bfd", "max_length": 48} if args.packing else {}),
                   average_tokens_across_devices=not args.per_rank_mean, **({"bf16": False} if args.fp32 else {}))
trainer = SFTTrainer(model=model, args=config, train_dataset=Dataset.from_list(rows), processing_class=tokenizer,
                     callbacks=[gradkit.watch.Callback(out=args.out)])  # <- gradkit's one line
trainer.train()
sys.stdout.flush()  # leave without the interpreter's tear-down (examples/watch/trainer_job.py says why)
sys.stderr.flush()
os._exit(0)
