#!/bin/bash
# An HF Trainer script under torchrun, DeepSpeed ZeRO-2 from its own JSON beside this file.
set -e
export NGPU=8
GA=8

pip install -q -r requirements.txt  # not the launch line

torchrun --nproc_per_node $NGPU --nnodes 1 \
    train.py \
    --deepspeed ds_zero2_fp16.json \
    --bf16 \
    --gradient_accumulation_steps ${GA} \
    --per_device_train_batch_size=4 \
    --output_dir out \
    --learning_rate 1e-5 2>&1 | tee train.log
