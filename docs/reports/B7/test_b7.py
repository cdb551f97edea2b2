# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""offload_optimizer cpu: a parameter the last micro-batch of a window skips must still step that window's gradient,
and one no micro-batch of a window reaches must step none (not the last window's). The loss is linear in the
weights, so each micro-batch that uses the part adds the same gradient."""

import pytest
import torch
import deepspeed
from deepspeed.utils import safe_get_full_fp32_param
from unit.common import DistributedTest


class TrunkAndPart(torch.nn.Module):

    def __init__(self):
        super().__init__()
        self.trunk = torch.nn.Linear(8, 1, bias=False)
        self.part = torch.nn.Linear(8, 1, bias=False)

    def forward(self, x, use_part):
        return self.trunk(x) + self.part(x) if use_part else self.trunk(x)


@pytest.mark.parametrize("zero_stage", [1, 2, 3])
class TestOffloadGradOfParamSkippedByBoundary(DistributedTest):
    world_size = 2

    def test(self, zero_stage):
        gas = 2
        config_dict = {
            "train_micro_batch_size_per_gpu": 2,
            "gradient_accumulation_steps": gas,
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
        model = TrunkAndPart()
        optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
        model, _, _, _ = deepspeed.initialize(config=config_dict, model=model, optimizer=optimizer)
        x = torch.ones(2, 8, device=model.device) / 8
        for step in range(3):
            # micro-batch m uses the part where m % 3 == 0: the boundary skips it, then micro-batch 0, then both
            uses = [(step * gas + i) % 3 == 0 for i in range(gas)]
            before = safe_get_full_fp32_param(model.module.part.weight).clone()
            for use in uses:
                model.backward(model(x, use).sum())
                model.step()
            update = before - safe_get_full_fp32_param(model.module.part.weight)
            expected = torch.full_like(update, sum(uses) * x.sum(0)[0].item() / gas)
            assert torch.allclose(update, expected), (step, uses, update, expected)
