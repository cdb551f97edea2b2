# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""ZeRO-1/2 + offload_optimizer at gradient_accumulation_steps 1 with several backward() per step() (every backward
a boundary): each step must apply every backward's gradient, and none of the previous step's. The loss is linear in
the weights, so every step's gradient is the same."""

import pytest
import torch
import deepspeed
import deepspeed.comm as dist
from deepspeed.utils import safe_get_full_fp32_param
from unit.common import DistributedTest


@pytest.mark.parametrize("zero_stage", [1, 2])
class TestOffloadSeveralBackwardPerStep(DistributedTest):
    world_size = 2

    def test(self, zero_stage):
        num_backward = 4
        config_dict = {
            "train_micro_batch_size_per_gpu": 2,
            "gradient_accumulation_steps": 1,
            "gradient_clipping": 0.0,
            "zero_allow_untested_optimizer": True,
            "zero_force_ds_cpu_optimizer": False,
            "zero_optimization": {
                "stage": zero_stage,
                "offload_optimizer": {
                    "device": "cpu"
                }
            }
        }
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 1, bias=False)
        optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
        model, _, _, _ = deepspeed.initialize(config=config_dict, model=model, optimizer=optimizer)
        rank = dist.get_rank()
        updates = []
        for _ in range(3):
            before = safe_get_full_fp32_param(model.module.weight).clone()
            for i in range(num_backward):
                x = torch.full((2, 8), float((rank + 1) * (i + 1)), device=model.device)
                model.backward(model(x).sum() / num_backward)
            model.step()
            updates.append((before - safe_get_full_fp32_param(model.module.weight)).float().cpu())
        # mean over the ranks of the sum over the backwards of x.sum(0) / num_backward
        expected = sum(2 * (r + 1) * (i + 1) for r in range(2) for i in range(num_backward)) / (2 * num_backward)
        assert all(torch.allclose(u, torch.full_like(u, expected)) for u in updates), [u.tolist() for u in updates]
