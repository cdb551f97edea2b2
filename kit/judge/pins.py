"""Where each known bug's range starts and ends, as the kit's own bisect found it: one ``Pin`` per boundary, the
last release with the old result and the first with the new one, both measured (adjacent on the package index, or
with the releases between them that cannot run here named). Each cites the command that found it and the code that
changed between its two releases (the bisect's diff); both releases' results are in the release history
(``kit/judge/history.json``, series ``Pin.series``). ``gradkit.judge.expectations.Known.pins`` reads them; ``ranges``
says each bug's range in words (notebooks 00, 01, 07, 08, the README and the bugs page print it).

Refresh them with ``scripts/refresh_table`` (every pin measured again, every newer release measured).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Pin:
    what: str  # what starts at ``after``: "introduced", "fixed", "the step changes: ...", "the opt-out key arrives"
    before: str
    after: str
    series: str  # the recipe measured (gradkit.commands.bisect.known.RECIPES) and its series in the history
    found_by: str  # the gradkit bisect command line
    code: str  # the function(s) whose change the diff between the two releases shows
    between: tuple = ()  # releases between ``before`` and ``after`` that cannot run here


NOT_RUN_18 = ("0.18.7", "0.18.8", "0.18.9")  # ZeRO-1/2 fp32 step() crashes in gloo on torch 2.13 (cannot-run)
OLDEST_DS = "0.14.4 (0.14.0 - 0.14.3 do not import on torch 2.13)"

PINS: dict[str, tuple[Pin, ...]] = {
    "B1": (
        Pin("the step changes: exact on this model (each micro-batch's mean / GA before it, HFT's)", "4.45.2", "4.46.1",
            "B1", "gradkit bisect --known B1 --keep", "Trainer.training_step / compute_loss: num_items_in_batch (huggingface/transformers#34198)"),
        Pin("introduced: the model's loss divides by the label count, one token per sequence too many (ratio 0.91)",
            "4.46.1", "4.46.2", "B1", "gradkit bisect --known B1 --keep",
            "Trainer.__init__'s model_accepts_loss_kwargs takes a **kwargs forward, so num_items_in_batch reaches the "
            "model; Trainer.compute_loss"),
        Pin("the step changes: micro-batches summed (ratio 4.0)", "4.46.3", "4.47.0", "B1", "gradkit bisect --known B1 --keep",
            "Trainer.training_step / _inner_training_loop"),
        Pin("the step changes: back to the label count (0.91)", "4.48.0", "4.48.1", "B1", "gradkit bisect --known B1 --keep", "Trainer.training_step"),
        Pin("the step changes: divided by GA once more (0.23)", "5.1.0", "5.2.0", "B1", "gradkit bisect --known B1 --keep",
            "Trainer.create_accelerator_and_postprocess / _build_accelerator_args: Accelerate's accumulation steps"),
        Pin("the step changes: back to the label count (0.91)", "5.5.3", "5.5.4", "B1", "gradkit bisect --known B1 --keep",
            "Trainer.create_accelerator_and_postprocess: GradientAccumulationPlugin num_steps = 1"),
        Pin("fixed", "5.9.0", "5.10.1", "B1", "gradkit bisect --known B1 --keep", "Trainer._get_num_items_in_batch counts the shifted labels"),
    ),
    "ACC": (
        Pin("fixed", "0.30.1", "0.31.0", "ACC", "gradkit bisect --known ACC --keep",
            "Accelerator._do_sync / Accelerator.accumulate: sync_each_batch no longer makes the prepared optimizer step "
            "(huggingface/accelerate#2790)"),
    ),
    "HFT": (
        Pin("the step changes: each rank divides by its own label count (before: each micro-batch by its own)", "4.45.2",
            "4.46.1", "HFT", "gradkit bisect --known HFT --keep", "Trainer.compute_loss / training_step: num_items_in_batch "
            "(huggingface/transformers#34198)"),
        Pin("the step changes: the last micro-batch is the one that does not sync (rank 0's x1.9, rank 1's x0)",
            "4.46.1", "4.46.2", "HFT", "gradkit bisect --known HFT --keep", "Trainer._inner_training_loop: no_sync where i == the last micro-batch"),
        Pin("the step changes: the condition set right, B1's label count left (every micro-batch x0.9)", "4.46.2",
            "4.46.3", "HFT", "gradkit bisect --known HFT --keep", "Trainer._inner_training_loop: no_sync where i != the last micro-batch"),
        Pin("the step changes: micro-batches summed (x GA)", "4.46.3", "4.47.0", "HFT", "gradkit bisect --known HFT --keep",
            "Trainer.training_step: the loss no longer divided by GA where num_items_in_batch is given"),
        Pin("the step changes: back to B1's label count (x0.9)", "4.48.0", "4.48.1", "HFT", "gradkit bisect --known HFT --keep",
            "Trainer.training_step"),
        Pin("the step changes: the ranks weighted alike (cosine 0.998 -> 1.000)", "4.53.3", "4.54.0", "HFT", "gradkit bisect --known HFT --keep",
            "Trainer.compute_loss"),
        Pin("the step changes: divided by GA once more (x0.2)", "5.1.0", "5.2.0", "HFT", "gradkit bisect --known HFT --keep",
            "Trainer.create_accelerator_and_postprocess / _build_accelerator_args: Accelerate's accumulation steps"),
        Pin("the step changes: back to B1's label count (x0.9)", "5.5.3", "5.5.4", "HFT", "gradkit bisect --known HFT --keep",
            "Trainer.create_accelerator_and_postprocess: GradientAccumulationPlugin num_steps = 1"),
        Pin("fixed", "5.9.0", "5.10.1", "HFT", "gradkit bisect --known HFT --keep", "Trainer._get_num_items_in_batch counts the shifted labels"),
        Pin("the step changes: rank 1 from x1.1 to x1 (rank 0 x0.9: B1's label count on one rank)", "4.48.0", "4.48.1",
            "HFT gas1", "gradkit bisect --known 'HFT gas1' --keep", "Trainer.training_step"),
        Pin("the step changes: both ranks x0.9 (one label count over the ranks, B1's)", "4.53.3", "4.54.0", "HFT gas1",
            "gradkit bisect --known 'HFT gas1' --keep", "Trainer.compute_loss"),
        Pin("fixed", "5.9.0", "5.10.1", "HFT gas1", "gradkit bisect --known 'HFT gas1' --keep", "Trainer._get_num_items_in_batch counts the shifted labels"),
        Pin("the step changes: the last micro-batch's no_sync set right (x0.9)", "4.46.2", "4.46.3",
            "HFT avg_tokens_on", "gradkit bisect --known 'HFT avg_tokens_on' --keep", "Trainer._inner_training_loop: no_sync where i != the last micro-batch"),
        Pin("the step changes: micro-batches summed (x8)", "4.46.3", "4.47.0", "HFT avg_tokens_on", "gradkit bisect --known 'HFT avg_tokens_on' --keep",
            "Trainer.training_step"),
        Pin("the step changes: back to B1's label count (x0.9)", "4.48.0", "4.48.1", "HFT avg_tokens_on", "gradkit bisect --known 'HFT avg_tokens_on' --keep",
            "Trainer.training_step"),
        Pin("the step changes: divided by GA once more (x0.2)", "5.1.0", "5.2.0", "HFT avg_tokens_on", "gradkit bisect --known 'HFT avg_tokens_on' --keep",
            "Trainer.create_accelerator_and_postprocess: Accelerate's accumulation steps"),
        Pin("the step changes: back to B1's label count (x0.9)", "5.5.3", "5.5.4", "HFT avg_tokens_on", "gradkit bisect --known 'HFT avg_tokens_on' --keep",
            "Trainer.create_accelerator_and_postprocess: GradientAccumulationPlugin num_steps = 1"),
        Pin("fixed", "5.9.0", "5.10.1", "HFT avg_tokens_on", "gradkit bisect --known 'HFT avg_tokens_on' --keep",
            "Trainer._get_num_items_in_batch counts the shifted labels"),
    ),
    "B2": (
        Pin("introduced: every stage sums its micro-batches (x GA)", "0.15.4", "0.16.0", "B2",
            "gradkit bisect --known B2 --keep", "DeepSpeedEngine.backward scales the loss by 1 / GA only where "
            "do_gradient_reduction (enable_backward_allreduce, off in PipelineEngine, and not inside no_sync)"),
        Pin("the step changes: the earlier stage divided by GA twice, the last one right", "0.18.2", "0.18.5", "B2",
            "gradkit bisect --known B2 --keep", "DeepSpeedEngine.backward / _backward_prologue (the backward API of "
            "deepspeedai/DeepSpeed#7665; the per-output GAS hook of #7724)", between=("0.18.3", "0.18.4")),
        Pin("fixed", "0.19.2", "0.19.3", "B2", "gradkit bisect --known B2 --keep",
            "DeepSpeedEngine._backward_epilogue / allreduce_gradients (deepspeedai/DeepSpeed#8154)"),
    ),
    "B3": (
        Pin("introduced", "0.17.5", "0.18.3", "B3", "gradkit bisect --known B3 --keep",
            "DeepSpeedEngine.backward and DeepSpeedZeroOptimizer.backward_prologue / backward_epilogue (the backward "
            "refactor: the boundary bookkeeping moved into backward)", between=("0.17.6", "0.18.0", "0.18.1", "0.18.2")),
    ),
    "B4": (
        Pin("another optimizer: bf16 runs FP16_UnfusedOptimizer (B9's; its logged norm x65536, the step right)",
            "0.17.5", "0.17.6", "B4", "gradkit bisect --known B4 --keep",
            "DeepSpeedEngine._configure_optimizer: DDP_BFLOAT16 = \"bf16\" sends bf16 to _configure_fp16_optimizer "
            "(deepspeedai/DeepSpeed#7515)"),
        Pin("the step changes: every update / 65536 (B9)", "0.18.2", "0.18.3", "B4", "gradkit bisect --known B4 --keep",
            "DeepSpeedEngine.backward scales the loss only for a ZeRO optimizer (deepspeedai/DeepSpeed#7665)"),
        Pin("introduced", "0.18.4", "0.18.5", "B4", "gradkit bisect --known B4 --keep",
            "DeepSpeedEngine._configure_optimizer: BF16_Optimizer chosen again (deepspeedai/DeepSpeed#7788), its "
            "_backward_epilogue averaging before the boundary micro-batch is added"),
        Pin("fixed", "0.18.9", "0.19.0", "B4", "gradkit bisect --known B4 --keep",
            "DeepSpeedEngine._backward_epilogue (deepspeedai/DeepSpeed#7985)"),
    ),
    "B5": (
        Pin("introduced", "0.15.1", "0.15.2", "B5", "gradkit bisect --known B5 --keep",
            "DeepSpeedZeroOptimizer.async_accumulate_grad_in_cpu_via_gpu: else: copy_gradients_to_cpu() "
            "(deepspeedai/DeepSpeed#6550)"),
        Pin("fixed", "0.18.6", "0.19.0", "B5", "gradkit bisect --known B5 --keep",
            "DeepSpeedZeroOptimizer.async_accumulate_grad_in_cpu_via_gpu copies on every micro-step "
            "(deepspeedai/DeepSpeed#7967)", between=NOT_RUN_18),
    ),
    "B7": (
        Pin("the step changes: the part's old gradient is no longer applied again, only its window lost", "0.15.1",
            "0.15.2", "B7", "gradkit bisect --known B7 --keep",
            "DeepSpeedZeroOptimizer.async_accumulate_grad_in_cpu_via_gpu (deepspeedai/DeepSpeed#6550, B5's start)"),
        Pin("the step changes: the part's old gradient applied again as well", "0.18.6", "0.19.0", "B7",
            "gradkit bisect --known B7 --keep", "DeepSpeedZeroOptimizer.async_accumulate_grad_in_cpu_via_gpu and "
            "copy_grads_in_partition (deepspeedai/DeepSpeed#7967, B5's fix)", between=NOT_RUN_18),
    ),
    "B9": (
        Pin("introduced: every update / loss_scale (before it the step is right, the logged norm x loss_scale)",
            "0.18.2", "0.18.3", "B9", "gradkit bisect --known B9 --keep",
            "DeepSpeedEngine.backward scales the loss only for a ZeRO optimizer, FP16_UnfusedOptimizer.step still "
            "unscales (deepspeedai/DeepSpeed#7665)"),
    ),
    "B10": (
        Pin("the step changes: the scale grows one clean step later (after an overflow at step j: step j + W + 1, "
            "was j + W)", "0.17.0", "0.17.1", "B10", "gradkit bisect --known B10 --keep",
            "DeepSpeedZeroOptimizer.step and DynamicLossScaler.update_scale's stable interval "
            "(deepspeedai/DeepSpeed#6976)"),
        Pin("the step changes: B12 joins it, every step keeps only the boundary micro-batch (ratio 0.40 - 0.49, "
            "half that where the scale grows; the first micro-batch's overflow is never seen, so nothing is skipped)",
            "0.17.5", "0.17.6", "B10", "gradkit bisect --known B10 --keep",
            "DeepSpeedZeroOptimizer.independent_gradient_partition_epilogue (deepspeedai/DeepSpeed#7509: B12)"),
        Pin("the step changes: B12 fixed, the growth step alone at half again", "0.18.2", "0.18.3", "B10",
            "gradkit bisect --known B10 --keep", "DeepSpeedZeroOptimizer.independent_gradient_partition_epilogue "
            "tests all_grad_tensors (deepspeedai/DeepSpeed#7665: B12's fix)"),
    ),
    "B11": (
        Pin("introduced: each step loses its first micro-batch and applies the previous update again (before it the "
            "loop kept only the last micro-batch, B3's step)", "0.18.6", "0.19.0", "B11",
            "gradkit bisect --known B11 --keep", "DeepSpeedZeroOptimizer.copy_grads_in_partition's gate micro_step_id > "
            "0 or not boundary (deepspeedai/DeepSpeed#7981) and async_accumulate_grad_in_cpu_via_gpu "
            "(deepspeedai/DeepSpeed#7967)", between=NOT_RUN_18),
    ),
    "B12": (
        Pin("introduced: only the boundary micro-batch reaches the step (ratio 0.40 - 0.49)", "0.17.5", "0.17.6", "B12",
            "gradkit bisect --known B12 --keep", "DeepSpeedZeroOptimizer.independent_gradient_partition_epilogue tests "
            "averaged_gradients where it fills all_grad_tensors (deepspeedai/DeepSpeed#7509)"),
        Pin("fixed", "0.18.2", "0.18.3", "B12", "gradkit bisect --known B12 --keep",
            "DeepSpeedZeroOptimizer.independent_gradient_partition_epilogue tests all_grad_tensors "
            "(deepspeedai/DeepSpeed#7665)"),
    ),
    "B8": (
        Pin("fixed", "0.19.7", "0.19.8", "B8", "gradkit bisect --known B8 --keep",
            "split_half_float_double, called by DeepSpeedZeroOptimizer.buffered_reduce_fallback "
            "(deepspeedai/DeepSpeed#8382)"),
    ),
    "B13": (
        Pin("fixed", "0.19.7", "0.19.8", "B13", "gradkit bisect --known B13 --keep",
            "DeepSpeedZeroOptimizer.get_gradient_for_reduction (param.grad_accum, no longer a copy cast to the "
            "parameters' dtype) and _gradient_reduction_buffer_dtype (the bucket in the accumulator's dtype)"),
    ),
}

# where the oldest release that runs here is already affected: the start is older than what can be measured here
START_HIDDEN: dict[str, str] = {
    "ACC": "affected from 0.28.0, where sync_each_batch arrives (huggingface/accelerate#2531): 0.27.x cannot run the "
           "case (GradientAccumulationPlugin takes no sync_each_batch), so the bug starts with the feature",
    "HFT": "affected on 4.45.2, the oldest release that runs here (older ones do not install beside torch 2.13): "
           "each micro-batch's mean / GA (huggingface/transformers#34191)",
    "FSDP2": "torch 2.13.0 is the only release that runs here (another torch is a multi-GB download): no range is "
             "measured, its cases are pinned on 2.13.0",
    "B6": f"affected on every release that runs here, from {OLDEST_DS}: the start is older",
    "B7": f"affected on every release that runs here, from {OLDEST_DS}: the start is older",
    "B8": f"affected on every release that runs here, from {OLDEST_DS}: the start is older",
    "B13": f"affected on every release that runs here, from {OLDEST_DS}: the start is older (the cast came with "
           "deepspeedai/DeepSpeed#2847, v0.10.1)",
    "B10": f"affected on every release that runs here, from {OLDEST_DS}: the start is older (the ordering is in "
           "DeepSpeed's first public import, v0.1.0)",
}
# the same in a few words (the README's short table)
START_SHORT: dict[str, str] = {
    "ACC": "0.28.0, with the feature (0.27.x cannot run it)",
    "HFT": "before 4.45.2, the oldest that runs here",
    "FSDP2": "only torch 2.13.0 runs here",
    **{bug: "before 0.14.4, the oldest that runs here" for bug in ("B6", "B7", "B8", "B10", "B13")},
}
