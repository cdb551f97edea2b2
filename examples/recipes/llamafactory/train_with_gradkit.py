"""LLaMA-Factory with gradkit's watch: ``llamafactory-cli train`` takes no callback, so this script is the entry
point; it runs LLaMA-Factory's own ``run_exp`` with the watch in its callbacks (``run_exp(callbacks=[...])``, as
LLaMA-Factory's src/train.py runs it bare; examples/recipes/SOURCES.md cites the lines). Launch it the way
LLaMA-Factory launches itself, one process per GPU:

    torchrun --nproc-per-node 8 examples/recipes/llamafactory/train_with_gradkit.py sft_lora_zero2.yaml
    # on a CPU (what the tests run): the same file, with the YAML's device keys overridden on the command line
    DS_ACCELERATOR=cpu torchrun --nproc-per-node 2 examples/recipes/llamafactory/train_with_gradkit.py \\
        sft_lora_zero2.yaml use_cpu=true ddp_backend=gloo bf16=false

The watch judges the Trainer's first steps against the exact gradient of their global batch and writes
``<output_dir>/gradkit-watch/watch.jsonl``; ``gradkit report <output_dir>/gradkit-watch`` makes the report.
"""
import os
import sys

from llamafactory.train.tuner import run_exp

import gradkit

if __name__ == "__main__":
    run_exp(callbacks=[gradkit.watch.Callback()])  # <- gradkit's one line; the YAML is sys.argv[1], overrides after it
    sys.stdout.flush()  # leave without the interpreter's tear-down (examples/watch/trainer_job.py says why)
    sys.stderr.flush()
    os._exit(0)
