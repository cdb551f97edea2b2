# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""fp16 at ZeRO stage 0 with a torch optimizer (FP16_UnfusedOptimizer): its step() divides the gradients by its loss
scale, so engine.backward must have scaled the loss by it. The update must be the gradient, not gradient / scale."""

import pytest
import torch
import deepspeed
from deepspeed.accelerator import get_accelerator
from unit.common import DistributedTest


@pytest.mark.parametrize("loss_scale", [256, 0])
class TestFP16ZeRO0LossScale(DistributedTest):
    world_size = 2

    def test(self, loss_scale):
        if not get_accelerator().is_fp16_supported():
            pytest.skip("fp16 is not supported")
        config_dict = {
            "train_micro_batch_size_per_gpu": 2,
            "gradient_accumulation_steps": 1,
            "fp16": {
                "enabled": True,
                "loss_scale": loss_scale,
                "initial_scale_power": 8
            },
            "zero_optimization": {
                "stage": 0
            }
        }
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 1, bias=False).half()
        optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
        model, _, _, _ = deepspeed.initialize(config=config_dict, model=model, optimizer=optimizer)
        master = model.optimizer.fp32_groups[0][0]  # the fp32 weight the torch optimizer steps
        before = master.detach().clone()
        x = torch.ones(2, 8, dtype=torch.half, device=model.device) / 8
        model.backward(model(x).float().sum())
        model.step()
        # d(sum of 2 rows of w . x)/dw = 2 / 8 on every rank: SGD with lr 1 moves each weight by 0.25
        update = (before - master.detach()).float()
        assert torch.allclose(update, torch.full_like(update, 0.25), rtol=1e-3), (model.optimizer.loss_scale, update)
