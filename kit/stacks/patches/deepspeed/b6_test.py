# Copyright (c) DeepSpeed Team.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team

import copy

import torch

import deepspeed
import deepspeed.comm as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.utils import safe_get_full_grad
from unit.common import DistributedTest


class RoutedModel(torch.nn.Module):

    def __init__(self, hidden_dim):
        super().__init__()
        self.trunk = torch.nn.Linear(hidden_dim, hidden_dim)
        self.expert = torch.nn.Linear(hidden_dim, hidden_dim)

    def forward(self, x, use_expert):
        h = self.trunk(x)
        if use_expert:
            h = h + self.expert(h)
        return h.square().mean()


class TestZero3GradPartitionsStartFromZero(DistributedTest):
    world_size = 2

    def test_param_not_reached_by_every_micro_batch(self):
        hidden_dim, gradient_accumulation_steps = 8, 2
        device = get_accelerator().current_device_name()
        rank, world_size = dist.get_rank(), dist.get_world_size()
        # the expert joins both micro-batches of window 0, only the second of window 1, none of window 2
        routes = [(True, True), (False, True), (False, False)]

        torch.manual_seed(0)
        model = RoutedModel(hidden_dim)
        reference = copy.deepcopy(model).to(device)
        config = {
            "train_micro_batch_size_per_gpu": 2,
            "gradient_accumulation_steps": gradient_accumulation_steps,
            "gradient_clipping": 0.0,
            "zero_allow_untested_optimizer": True,
            "zero_optimization": {
                "stage": 3
            },
        }
        # lr 0 keeps the weights, so every window's expected gradient comes from the initial model
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)

        for window, route in enumerate(routes):
            expected = torch.zeros_like(reference.expert.weight)
            for micro_step, use_expert in enumerate(route):
                inputs = [
                    torch.randn(2, hidden_dim, generator=torch.Generator().manual_seed(100 * window + 10 * micro_step +
                                                                                       r)).to(device)
                    for r in range(world_size)
                ]
                engine.backward(engine(inputs[rank], use_expert))
                if micro_step == gradient_accumulation_steps - 1:
                    actual = safe_get_full_grad(engine.module.expert.weight)
                engine.step()
                if use_expert:
                    for x in inputs:
                        grad, = torch.autograd.grad(reference(x, True), reference.expert.weight)
                        expected += grad / (world_size * gradient_accumulation_steps)

            # only this window's micro-batches: nothing left over from the previous window
            torch.testing.assert_close(actual.float(), expected)
