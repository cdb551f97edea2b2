# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""fp16 with a dynamic loss scale: the step on which the scale grows must apply the whole update (the gradient was
scaled by the old scale in backward). The loss is linear in the weights, so every step's gradient is the same. ZeRO-0
steps with FP16_UnfusedOptimizer (a torch optimizer), whose fp32 weights safe_get_full_fp32_param does not read."""

import pytest
import torch
import deepspeed
from deepspeed.accelerator import get_accelerator
from deepspeed.utils import safe_get_full_fp32_param
from unit.common import DistributedTest


@pytest.mark.parametrize("zero_stage", [0, 1, 2, 3])
class TestUnscaleWhenScaleGrows(DistributedTest):
    world_size = 2

    def test(self, zero_stage):
        if not get_accelerator().is_fp16_supported():
            pytest.skip("fp16 is not supported")
        config_dict = {
            "train_micro_batch_size_per_gpu": 2,
            "gradient_accumulation_steps": 1,
            "zero_allow_untested_optimizer": True,
            "fp16": {
                "enabled": True,
                "loss_scale": 0,
                "initial_scale_power": 8,
                "loss_scale_window": 2
            },
            "zero_optimization": {
                "stage": zero_stage
            }
        }
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 1, bias=False).half()
        optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
        model, _, _, _ = deepspeed.initialize(config=config_dict, model=model, optimizer=optimizer)
        x = torch.ones(2, 8, dtype=torch.half, device=model.device) / 8

        def fp32_weight():
            return safe_get_full_fp32_param(model.module.weight) if zero_stage else model.optimizer.fp32_groups[0][0]

        scales, updates = [], []
        for _ in range(4):
            before = fp32_weight().clone()
            scales.append(model.optimizer.loss_scale)
            model.backward(model(x).float().sum())
            model.step()
            updates.append((before - fp32_weight()).float())
        assert model.optimizer.loss_scale > scales[0], scales  # the scale grew within the steps
        for update in updates[1:]:
            assert torch.allclose(update, updates[0], rtol=1e-3), (scales, [u.norm().item() for u in updates])
