"""The kit's fixes of known bugs, each a patch of a release with its proof beside it in
``kit/stacks/patches/<package>/``: ``<patch>.diff`` (applied by ``gradkit.stacks.patched``), ``<patch>_repro.py``
(a standalone reproduction: exit 1 where the bug shows) and ``<patch>_test.py`` (a regression test in DeepSpeed's
``tests/unit`` style). ``gradkit report --known BUG`` (``gradkit.commands.fix``) verifies one on both sides. A new
fix is those three files and one entry here.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from gradkit import config as kconfig


@dataclass(frozen=True)
class Fix:
    bug: str
    patch: str  # kit/stacks/patches/deepspeed/<patch>.diff, and <patch>_repro.py beside it
    title: str
    stages: tuple  # the ZeRO stages the reproduction runs at (its STAGE)
    lines: tuple  # (file, the code lines that make the bug, each as it reads in the release)
    fixes: str  # what the patch does, in a sentence
    on: str = ""  # another of the kit's patches both sides carry, where that bug hides this one at some stage
    on_why: str = ""  # why, in a sentence


FIXES = {f.bug: f for f in (
    Fix("B10", "b10", "fp16 with a dynamic loss scale: the step on which the scale grows applies half the update "
                      "(ZeRO-0/1/2/3)", (0, 2, 3),
        (("deepspeed/runtime/zero/stage_1_and_2.py", ("prev_scale = self.loss_scale", "self._update_scale(self.overflow)",
                                                      "self.unscale_and_clip_grads([single_grad_partition]",
                                                      "combined_scale = self.loss_scale")),
         ("deepspeed/runtime/zero/stage3.py", ("prev_scale = self.loss_scale", "self._update_scale(self.overflow)",
                                               "self._global_grad_norm = scaled_global_grad_norm / self.loss_scale",
                                               "combined_scale = self.loss_scale")),
         ("deepspeed/runtime/fp16/unfused_optimizer.py", ("self._update_scale(False)",
                                                          "combined_scale = self.loss_scale_config.cur_scale"))),
        "the gradient is unscaled by the scale it was multiplied by in backward, the one before the update (ZeRO-1/2/3 "
        "and FP16_UnfusedOptimizer, ZeRO-0 with a torch optimizer; FP16_Optimizer, which needs FusedAdam, has the same "
        "order and is left to a GPU run)",
        on="b9", on_why="from 0.18.3 ZeRO-0's fp16 step with a torch optimizer is 1 / loss scale of the right one (B9, "
                        "deepspeedai/DeepSpeed#8393), which hides B10 there; B9's patch touches nothing ZeRO-1/2/3 run"),
    Fix("B6", "b6", "ZeRO-3 never zeroes its reduced-gradient partitions: a parameter a step does not reach is stepped "
                    "with its last gradient, one first reached after micro-batch 1 adds onto the previous window's",
        (3,),
        (("deepspeed/runtime/zero/stage3.py", ("self.grad_partitions_flat_buffer: Tensor = torch.zeros(",
                                               "if param.requires_grad else torch.zeros_like(param.ds_tensor)",
                                               "if self.micro_step_id == 0:  # don't accumulate",
                                               "grad_buffer.add_(grad_partition.to(self.gradient_accumulation_dtype)",
                                               "def _overflow_clean_up(self, prev_scale):",
                                               "def _post_step(self, timer_names):")),),
        "the reduced-gradient partitions are zeroed once the step has used them, and when an overflow skips it, so "
        "every window starts from zero"),
    Fix("B9", "b9", "fp16 at ZeRO-0 with a torch optimizer (FP16_UnfusedOptimizer): every update is 1 / loss_scale of "
                    "the right one", (0,),
        (("deepspeed/runtime/engine.py", ("# TODO: handle these scaling with direct calls to loss.backward()",
                                          "loss = self.optimizer.scale_if_loss(loss)")),
         ("deepspeed/runtime/fp16/unfused_optimizer.py", ("self.unscale_and_clip_grads(self._global_grad_norm)",
                                                           "combined_scale = self.loss_scale_config.cur_scale",
                                                           "param.grad.data.mul_(1. / combined_scale)",
                                                           "self._global_grad_norm = get_global_norm(norm_list=norm_groups)"
                                                           ))),
        "engine.backward scales the loss by the fp16 optimizer's loss scale, as its backward() did before #7665 and "
        "where deepspeedai/DeepSpeed#8393 (open) adds its branch, so step() unscales a scaled gradient; and the "
        "optimizer stashes the norm unscaled, as deepspeedai/DeepSpeed#8588 (open) does, else the logged norm is "
        "x loss_scale again"),
    Fix("B11", "b11", "offload_optimizer cpu, several backward() per step() at GA 1: a step loses its first micro-batch "
                      "and applies the previous step's update again (ZeRO-1/2)", (1, 2),
        (("deepspeed/runtime/zero/stage_1_and_2.py", (
            "if self.micro_step_id > 0 or not self.is_gradient_accumulation_boundary():", "if self.micro_step_id > 0:",
            "dest_tensor.copy_(src_tensor, non_blocking=True)")),),
        "a boundary backward that skips the CPU gradient buffer records its parameters, a later backward of the same "
        "step adds their gradient from the fp32 buffer, and the CPU buffer is added only once this step has written "
        "it (both sets emptied in step())"),
    Fix("B7", "b7", "offload_optimizer cpu: a parameter the boundary micro-batch skips loses its window's gradient and "
                    "steps a stale one (ZeRO-1/2/3)", (1, 2, 3),
        (("deepspeed/runtime/zero/stage_1_and_2.py", (
            "self.single_partition_of_fp32_groups[i].grad = get_accelerator().pin_memory(",
            "if self.micro_step_id > 0:", "if self.micro_step_id > 0 or not self.is_gradient_accumulation_boundary():",
            "dest_tensor.copy_(src_tensor, non_blocking=True)",
            "if self.get_param_id(param) not in self._offload_accumulated_param_ids:")),
         ("deepspeed/runtime/zero/stage3.py", (
            "if self.is_gradient_accumulation_boundary():",
            "self._offload_grad_partition_at_boundary(param, grad_buffer, offload_fp32_gradients,",
            "if param.ds_id not in self._offload_boundary_param_ids:"))),
        "the CPU accumulator is added only once this window wrote it, and at the boundary every parameter the boundary "
        "micro-batch skipped gets its slice of the fp32 gradient from this window's accumulated gradient (ZeRO-1/2: the "
        "CPU accumulator; ZeRO-3: its reduced partition), or zero where no micro-batch reached it",
        on="b6", on_why="at ZeRO-3 a part first reached after the window's first micro-batch adds the previous window's "
                        "gradient (B6, in the reduced partition the fp32 gradient is copied from): ZeRO-3 shows B7 "
                        "alone only with B6's fix"),
)}


def verified_report(bug: str) -> str | None:
    """The repository path of ``bug``'s report where ``gradkit report --known`` wrote one and found its fix verified
    (``docs/reports/<bug>/verification.json``), else None."""
    path = f"docs/reports/{bug}"
    try:
        doc = json.loads(kconfig.repo_path(f"{path}/verification.json").read_text())
    except (OSError, ValueError):
        return None
    # only ever the kit's own file, but the watch calls this: a file that is not an object is no verified report
    return f"{path}/report.md" if bug in FIXES and isinstance(doc, dict) and doc.get("verified") is True else None
