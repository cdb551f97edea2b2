"""The part of DeepSpeed's ``tests/unit/common.py`` a patch's regression test uses, for running it here: DeepSpeed's
``DistributedTest`` forks ``world_size`` processes and starts their process group itself; here torchrun has started
the ranks (``run_unit_test.py``), so the class only joins the group once and checks the world is the one it asks for.
On the CPU accelerator fp16 is declared supported, as the kit declares it (torch has half on CPU; DeepSpeed's CPU
accelerator declares fp16 only with fp16 kernels), so a test that skips without fp16 runs here.
"""
import os

import deepspeed
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator

if get_accelerator().device_name() == "cpu":
    get_accelerator().is_fp16_supported = lambda: True


class DistributedTest:
    world_size = 2

    def setup_method(self, method):
        if not dist.is_initialized():
            deepspeed.init_distributed()
        if dist.get_world_size() != self.world_size:
            raise RuntimeError(f"{type(self).__name__} asks for world_size {self.world_size}; torchrun started "
                               f"{os.environ.get('WORLD_SIZE')}")
