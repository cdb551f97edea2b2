#!/bin/bash
# LLaMA-Factory under accelerate FSDP (as its examples/extras/fsdp_qlora/train.sh launches), GA overridden.
CUDA_VISIBLE_DEVICES=0,1 accelerate launch \
    --config_file accelerate_fsdp.yaml \
    src/train.py llamafactory_lora_fsdp.yaml gradient_accumulation_steps=16
