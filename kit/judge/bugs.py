"""The bug table: what is known upstream of each bug the kit measures (``KNOWN``: one ``Known`` per bug), read through
``gradkit.judge.expectations``, which says what it implies for a measured release.

Sources (upstream pull requests and issues; the releases are those that first ship each change):

- B4 (``BF16_Optimizer`` averages before it adds the boundary micro-batch): reported on 0.18.6; gradkit bisect finds
  it from 0.18.5, where deepspeedai/DeepSpeed#7788 makes this config run ``BF16_Optimizer`` again (0.17.6 - 0.18.4 run
  ``FP16_UnfusedOptimizer``, #7515, and show B9; <= 0.17.5 ``BF16_Optimizer`` is exact); deepspeedai/DeepSpeed#7985
  swaps the two calls in ``_backward_epilogue``, first released in 0.19.0.
- B2 (``PipelineEngine`` with GA > 1): exact up to 0.15.4; from 0.16.0 ``engine.backward`` scales the loss by 1 / GA
  only where it reduces gradients itself, which the pipeline never does, so the stages sum their micro-batches;
  after the backward rework (#7665, 0.18.3) and the per-output GAS hook (#7724, 0.18.4) earlier stages are divided
  by GA twice (measured 0.18.5 - 0.19.2; 0.18.3 - 0.18.4 refuse the pipeline's backward here);
  deepspeedai/DeepSpeed#8154 fixes it in 0.19.3. Every boundary found by gradkit bisect (``gradkit.judge.pins``).
- B3 (config GA = 1, N manual backwards, ZeRO-1/2 keep only the last micro-batch): a regression of the backward
  rework, found by gradkit bisect: <= 0.17.5 keep every micro-batch in this loop, 0.17.6 - 0.18.2 crash in it, 0.18.3
  is the first affected; the opt-out ``"managed_gradient_accumulation": false`` arrives in 0.19.4
  (deepspeedai/DeepSpeed#8184, #8203, #8217). The manual loop itself stays affected on every later release.
- B1 (HF Trainer + DeepSpeed + ``model_accepts_loss_kwargs``): reported as huggingface/transformers#45305 on
  transformers 5.3.0; 5.3.0 counts one label token too many per sequence, so every path applies
  tokens / (tokens + sequences) of the reference. gradkit bisect over every release that runs here pins it (on a
  tiny Llama, which every release has): 4.46.2 starts passing the count to a **kwargs model; 4.47.0 - 4.48.0 sum the
  micro-batches, 5.2.0 - 5.5.3 divide by GA once more (0.91 -> 0.23 -> 0.91), and 5.10.1 counts the shifted
  labels (5.9.0 the last affected); held at 5.3.0, every DeepSpeed release from 0.14.4 gives the same step.
- B5 (ZeRO-1/2 + ``offload_optimizer`` CPU, DeepSpeed's own loop with GA > 2): found by the kit's sweep on 0.18.6,
  then traced upstream. ``async_accumulate_grad_in_cpu_via_gpu`` copies a micro-step's gradient to the CPU buffer
  only at ``micro_step_id == 0`` (deepspeedai/DeepSpeed#6550); the micro-steps between the first and the boundary
  are added on the device and never copied back, so only the first and the boundary micro-batch reach the step.
  deepspeedai/DeepSpeed#7967 copies on every micro-step, first released in 0.19.0 (read in the 0.18.9 and 0.19.0
  sources: 0.18.9 still has the ``else``, 0.19.0 does not). Its start was found by ``gradkit bisect`` over every
  release from 0.14.0 (2026-11-25): 0.14.4 - 0.15.1 exact, 0.15.2 the first affected, and the diff between them is
  #6550's ``else: copy_gradients_to_cpu()``; 0.14.0 - 0.14.3 do not import on torch 2.13.
- B6 (ZeRO-3: a parameter with no gradient in a step is stepped with an old one): found by the kit's sweep on the
  ``no_grad_step`` and ``conditional`` shapes (0.18.6 and 0.19.8; no upstream report found, 2026-11-25). Stage 3
  keeps every reduced gradient partition in ``grad_partitions_flat_buffer``, which nothing zeroes after
  initialisation; ``partition_grads`` copies into a parameter's slice at ``micro_step_id == 0`` and adds after it,
  and the epilogue rebuilds ``averaged_gradients`` from every parameter's slice, reduced in this step or not. So
  a parameter no micro-batch reached keeps, and applies again, its last gradient; one first reached after the
  first micro-batch adds its window onto the previous window's total. Affected on every release that runs here
  (from 0.14.4; gradkit bisect): its start is older.
- B7 (``offload_optimizer`` CPU, ZeRO-1/2/3: the fp32 gradient buffer is written only for the parameters the
  boundary micro-batch reaches and never cleared): found by the kit's sweep on the same shapes (0.18.6 and
  0.19.8; no upstream report found). ``copy_grads_in_partition`` writes a parameter's slice of
  ``single_partition_of_fp32_groups[i].grad`` only when its hook fires on the boundary micro-step, and nothing
  zeroes that buffer or ``accumulated_grads_in_cpu`` between steps (ZeRO-3: ``fp32_partitioned_groups_flat[i].grad``
  and ``_offload_grad_partition_at_boundary``, called from ``partition_grads`` only at the boundary). A part the
  boundary micro-batch misses loses its window's gradient and keeps its last one. The sweep's ZeRO-3 offload points
  once read as "a stale gradient of its own" (``no_grad_step``, ratio 2.52 on 0.19.8) are B7's: the kit's B7 fix,
  which at the boundary fills every skipped parameter's fp32 slice from its reduced partition or zeroes it, makes
  them exact, and B6's does not (2026-11-28). Affected on every release from 0.14.4 (its start is older); its step
  changes with B5's start and fix (0.15.2: the old gradient no longer applied again; 0.19.0: applied again), both found by
  gradkit bisect. (ZeRO-1/2's manual loop with offload on any model is B11, another buffer.)
- B8 (DeepSpeed's CPU accelerator, ZeRO-1/2 with ``contiguous_gradients: false``: no all-reduce at all): found by the
  kit's sweep on 0.18.6 as an unknown group, its end found by ``gradkit bisect`` (0.19.7 affected, 0.19.8 exact;
  measured affected on every release from 0.14.4 that runs here: its start is older) and its change read in the two releases' sources
  (notebook 08). ``buffered_reduce_fallback`` sorts the gradients with ``split_half_float_double``, which compares
  ``t.type()`` with ``"torch.{device}.FloatTensor"``; on the CPU accelerator that is ``"torch.cpu.FloatTensor"``,
  which no CPU tensor's type (``"torch.FloatTensor"``) matches, so no bucket is reduced and each rank steps its
  partition with its own local gradient. deepspeedai/DeepSpeed#8382 compares ``t.dtype`` instead, first released in
  0.19.8. A GPU run matches ``"torch.cuda.FloatTensor"`` and is not affected.

- B13 (ZeRO-1 with ``data_types.grad_accum_dtype`` other than the parameters' dtype: fp16 + fp32, or bf16 + fp32 with
  ``offload_optimizer``): found by the kit's sweep on 0.18.6 with B8's step where B8 cannot be (offload forces
  contiguous gradients), then read in the source: ``use_grad_accum_attribute`` keeps it in ``param.grad_accum``,
  ``get_gradient_for_reduction`` returns ``param.grad_accum.to(self.dtype)`` (a copy: the cast came with
  deepspeedai/DeepSpeed#2847, v0.10.1, 2023-07, which added ``grad_accum_dtype``), the bucket reduces that copy, and the step
  (``copy_grads_in_partition`` with offload, the partition's gradient without) reads the rank's own unreduced
  ``param.grad_accum``. gradkit bisect: affected on every release that runs here, 0.14.4 - 0.19.7 (bf16 + fp32 with
  offload; fp16 + fp32 measured on 0.19.6 too), exact on 0.19.8, whose ``get_gradient_for_reduction`` returns
  ``param.grad_accum`` itself and reduces in its dtype (no upstream report found; the change is not in a mirror
  read up to 2026-08-22).
- B9 (``FP16_UnfusedOptimizer``, a torch optimizer without a ZeRO optimizer): from 0.18.3 (#7665) ``engine.backward``
  scales the loss only for a ZeRO optimizer while the optimizer's ``step`` still divides by its loss scale, so every
  update is 1 / loss_scale (deepspeedai/DeepSpeed#8393, open; #7839 fixed the bf16 ZeRO-0 case in 0.18.6); before it
  the logged grad norm is the scaled one (#8588, open). Found by gradkit check on a shipped fp16 ZeRO-0 config; B4's
  config runs this optimizer on 0.17.6 - 0.18.4 (#7515 until #7788).
- B10 (fp16 with a dynamic loss scale, ZeRO-1/2/3 and the fp16 optimizers): ``step()`` calls ``_update_scale`` before
  ``unscale_and_clip_grads``, which divides the gradient, scaled by the old scale in backward, by the new one; on the
  step where the scale grows (one in ``loss_scale_window``) the update is old / new = 1/2 of the right one (ZeRO-3's
  logged norm too; ZeRO-1/2 divide the norm by ``prev_scale`` since deepspeedai/DeepSpeed#2695, 0.8.0). The ordering
  is in DeepSpeed's first public import (2020-02-03, v0.1.0) and unchanged in every release up to 0.19.8; its
  comment on deepspeedai/DeepSpeed#8588 (open) reproduces it for ``FP16_Optimizer`` only. Found by ``gradkit check``
  judging DeepSpeed's own dynamic scaler with a short window; the Trainer's watch sees it on the user's job.
- B11 (ZeRO-1/2 + ``offload_optimizer`` CPU, config GA 1 and several ``backward()`` per ``step()``): every backward
  is a boundary, and ``copy_grads_in_partition`` calls ``async_accumulate_grad_in_cpu_via_gpu`` only where
  ``micro_step_id > 0 or not boundary`` (deepspeedai/DeepSpeed#7981, 0.19.0), so the CPU accumulator
  ``accumulated_grads_in_cpu`` is never reset at micro-step 0 and nothing in ``step()`` resets it: each step loses its
  first micro-batch and applies the previous step's update again (hence every earlier one). Before 0.19.0 the CPU
  accumulation was gated on ``gradient_accumulation_steps > 1`` and the loop kept only its last micro-batch (B3's
  step). Found by gradkit check (0.19.8; named B7 until 2026-11-27); no upstream report found.
- B12 (ZeRO-2 without offload, GA > 1, any precision): ``independent_gradient_partition_epilogue`` tests
  ``averaged_gradients`` where #7509 (0.17.6) fills ``all_grad_tensors``, so each micro-batch replaces the last and
  only the boundary micro-batch reaches the step (an fp16 overflow in an earlier one is never seen);
  deepspeedai/DeepSpeed#7665 tests the right dict, 0.18.3. Reported upstream as deepspeedai/DeepSpeed#7718; the kit met
  it on B10's bisect (0.17.6 - 0.18.2 every step off).

The paths without DeepSpeed (notebook 07) are pinned case by case (``Known.rules``): their cases are correct paths,
loop bugs the oracle must see, and documented behaviours.

- FSDP2 (torch, only the installed 2.13.0 runs here): every ``set_requires_gradient_sync`` loop is exact in fp32 and
  with a bf16 reduce; pytorch/pytorch#162338 (gloo's AVG reduce-scatter summed, open upstream) does not show on
  2.13.0. With bf16 parameters and an fp32 reduce two raises are measured on a model some micro-batches do not use
  entirely: ``to_accumulated_grad_if_needed`` reads ``_unsharded_param`` of a unit that never ran its forward
  (pytorch/pytorch#194058) and, with one unit, ``foreach_reduce`` refuses a fresh bf16 gradient beside accumulated
  fp32 ones (pytorch/pytorch#196996, open). A raise is ``cannot-run``, never a verdict, so the table pins none.
- ACC (accelerate): ``sync_each_batch`` (huggingface/accelerate#2531, 0.28.0) set ``sync_gradients`` on every
  micro-batch, which also makes the prepared optimizer step there; huggingface/accelerate#2790 fixed it in 0.31.0
  (0.28.0 and 0.30.1 measured affected, 0.31.0 exact). The last, incomplete window is still divided by the full GA:
  documented (huggingface/accelerate#1847). Token-level losses need the item count gathered over every process, as
  Accelerate's gradient-accumulation guide does.
- HFT (transformers, the Trainer on several ranks without DeepSpeed): before 4.46.0 each micro-batch's mean loss
  is divided by GAS (huggingface/transformers#34191, #34198, first in 4.46.0); from 4.46 the labels are counted
  before the shift (one token per sequence too many, B1's count) and ``average_tokens_across_devices`` (from 4.46.2)
  defaults off until 5.0. On the way (gradkit bisect over all 86 releases, ``gradkit.judge.pins``): 4.46.2 leaves the
  wrong micro-batch out of ``no_sync``, 4.47.0 - 4.48.0 sum the micro-batches, 5.2.0 - 5.5.3 divide by GA once more;
  5.10.1 is exact. 4.45.2 is the oldest release that runs here, with accelerate 1.0.1 beside it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from gradkit.judge import naming, oracle, pins
from gradkit.judge.parts import PART_LOST, PART_STALE
from gradkit.stacks.versions import version_key

AFFECTED, NOT_AFFECTED = oracle.AFFECTED, oracle.NOT_AFFECTED


@dataclass(frozen=True)
class Known:
    """What upstream says of one bug, as ranges of one package's releases."""

    bug: str
    package: str  # the library whose release decides ("deepspeed", "transformers")
    report: str
    affected_from: str | None  # first release known affected (None: as far back as the kit goes)
    fixed_in: str | None  # first release with the fix (None: no fix released)
    last_affected: str | None  # newest release known affected, where a gap to fixed_in is not pinned
    newest_pinned: str  # the newest release this table vouches for; later ones are findings
    prs: tuple[str, ...] = ()
    notes: tuple[str, ...] = field(default_factory=tuple)
    introduced_in: str | None = None  # the first release with the bug, where a bisect found it (the one before is exact)
    # per-case verdicts, where the probe's cases mean different things (a correct path, a loop bug, a documented
    # behaviour): (case, verdict, first release it holds for or None, first release it no longer holds for or None
    # [, the smallest GA it holds at: a loop bug that sums micro-batches has nothing to sum at GA 1]).
    # A bug with rules pins only the cases and releases its rules name (up to ``newest_pinned``).
    rules: tuple = ()
    # what the bug looks like in ``gradkit check`` and its fix there (the case that re-runs it): (what the engine does,
    # the step it leaves: a named hypothesis or a tuple of the parts' patterns any of which it may be, the fix text)
    explains: tuple = ()

    @property
    def pins(self) -> tuple:
        """The boundaries of this bug's range the kit's own bisect found (``gradkit.judge.pins``), oldest first."""
        return pins.PINS.get(self.bug, ())

    def rule_for(self, case: str | None, version: str, ga: int | None = None) -> str | None:
        """The verdict a rule gives ``case`` on ``version`` at ``ga`` (None: no rule covers them, or newer than
        pinned)."""
        v = version_key(version)
        if v > version_key(self.newest_pinned):
            return None
        for name, verdict, since, until, *least in self.rules:
            if least and ga is not None and ga < least[0]:
                continue
            if name == case and (since is None or v >= version_key(since)) and (until is None or v < version_key(until)):
                return verdict
        return None

    def expected_for_release(self, version: str) -> str | None:
        """The verdict upstream implies for ``version`` of ``package`` (None: not pinned here)."""
        v = version_key(version)
        if v > version_key(self.newest_pinned):
            return None
        if self.affected_from is not None and v < version_key(self.affected_from):
            return None
        if self.fixed_in is not None and v >= version_key(self.fixed_in):
            return NOT_AFFECTED
        if self.last_affected is not None and v > version_key(self.last_affected):
            return None  # between the last release known affected and the fix: not pinned
        return AFFECTED

    def range_text(self) -> str:
        """Where this bug starts and ends in ``package``'s releases, from its pins: each boundary with the release on
        either side; a start older than what runs here and a bug no release fixes said as such."""
        parts = []
        if not any(p.what.startswith("introduced") for p in self.pins):
            hidden = pins.START_HIDDEN.get(self.bug)
            parts.append(hidden or (f"affected from {self.affected_from} (not pinned by a bisect)" if self.affected_from
                                    else "start not pinned"))
        for p in self.pins:
            gap = f"; {', '.join(p.between)} cannot run here" if p.between else ""
            kind, _, detail = p.what.partition(": ")
            detail = f": {detail}" if detail else ""
            if p.series != self.bug:  # another recipe of the same bug (a case of its own): named
                detail += f" [{p.series}]"
            if kind == "introduced":
                parts.append(f"introduced in {p.after} ({p.before} without it{gap}){detail}")
            elif kind == "fixed":
                parts.append(f"fixed in {p.after} ({p.before} with it{gap}){detail}")
            else:
                parts.append(f"from {p.after} ({p.before} before{gap}) {p.what}" + (f" [{p.series}]" if p.series !=
                                                                                  self.bug else ""))
        if self.fixed_in is None:
            parts.append(f"no release fixes it (measured up to {self.newest_pinned})")
        elif not any(p.what.startswith("fixed") for p in self.pins):
            parts.append(f"fixed in {self.fixed_in} (not pinned by a bisect)")
        return f"{self.bug} ({self.package}): " + "; ".join(parts)

    def fix_text(self) -> str:
        where = f"fixed in {self.package} {self.fixed_in}" if self.fixed_in else "no release fixes it"
        return where + (f" ({', '.join(self.prs)})" if self.prs else "")


KNOWN = {k.bug: k for k in (
    Known("B1", "transformers", "huggingface/transformers#45305", affected_from="4.46.2", fixed_in="5.10.1",
          last_affected=None, newest_pinned="5.24.0", prs=("huggingface/transformers#45305 (report)",),
          introduced_in="4.46.2",
          notes=("4.46.2: a model with a **kwargs forward gets num_items_in_batch, counted before the shift (0.91)",
                 "4.47.0 - 4.48.0 sum the micro-batches (4.0); 5.2.0 - 5.5.3 divide by GA once more (0.23)",
                 "fixed in 5.10.1: Trainer._get_num_items_in_batch counts the shifted labels (gradkit bisect)",
                 "the report's DeepSpeed is 0.18.9; with transformers 5.3.0 every DeepSpeed release from 0.14.4 gives "
                 "the same step (gradkit bisect --known 'B1 on DeepSpeed'): the count is the Trainer's")),
    Known("B2", "deepspeed", "deepspeedai/DeepSpeed#8154", affected_from="0.16.0", fixed_in="0.19.3", last_affected=None,
          newest_pinned="0.19.8", prs=("deepspeedai/DeepSpeed#8154", "deepspeedai/DeepSpeed#7724 (0.18.4)"),
          notes=("<= 0.15.4: exact; 0.16.0 - 0.18.2: every stage sums (x GA)",
                 "0.18.5 - 0.19.2: earlier stages divided by GA twice (0.18.3 - 0.18.4 refuse the pipeline's backward "
                 "here: cannot-run)"),
          introduced_in="0.16.0"),
    Known("B3", "deepspeed", "allenai/open-instruct#1498", affected_from="0.18.3", fixed_in=None, last_affected=None,
          newest_pinned="0.19.8", prs=("deepspeedai/DeepSpeed#8184", "#8203", "#8217 (managed_gradient_accumulation, 0.19.4)"),
          notes=("ZeRO-1/2 only; ZeRO-0/3 keep every micro-batch",
                 "<= 0.17.5 keep every micro-batch in the manual loop; 0.17.6 - 0.18.2 crash in it (TypeError)"),
          introduced_in="0.18.3",
          explains=("ZeRO-1/2 with config GA = 1 and several backward() per step(): every backward is a boundary, the "
                    "accumulator is reset", "last micro-batch / N",
                    "call engine.set_gradient_accumulation_boundary(i == N - 1) before each backward (or put N in "
                    "gradient_accumulation_steps; from 0.19.4 \"managed_gradient_accumulation\": false)")),
    Known("B4", "deepspeed", "deepspeedai/DeepSpeed#7985", affected_from="0.18.5", fixed_in="0.19.0", last_affected=None,
          newest_pinned="0.19.8", prs=("deepspeedai/DeepSpeed#7985",),
          notes=("<= 0.17.5 BF16_Optimizer is exact on this config; 0.17.6 - 0.18.4 the config runs "
                 "FP16_UnfusedOptimizer instead (deepspeedai/DeepSpeed#7515) and shows B9, not B4; "
                 "deepspeedai/DeepSpeed#7788 (0.18.5) chooses BF16_Optimizer again, and B4 with it",),
          introduced_in="0.18.5",
          # at GA 1 the boundary micro-batch is the only one: no rank's reaches another's partition (B8's step)
          explains=("BF16_Optimizer averages its fp32 accumulator before the boundary micro-batch is added",
                    ("own rank's boundary micro-batch", naming.OWN_PARTITION),
                    "set \"bf16\": {\"immediate_grad_update\": true}, or upgrade to DeepSpeed >= 0.19.0")),
    Known("B5", "deepspeed", "deepspeedai/DeepSpeed#7967", affected_from="0.15.2", fixed_in="0.19.0", last_affected="0.18.9",
          newest_pinned="0.19.8", prs=("deepspeedai/DeepSpeed#6550 (the regression)", "deepspeedai/DeepSpeed#7967 (the fix)"),
          notes=("ZeRO-1/2 with offload_optimizer only, GA > 2, DeepSpeed's own loop",
                 "introduced in 0.15.2 (gradkit bisect: 0.15.1 exact, 0.15.2 'first and last micro-batch'; the diff is "
                 "#6550's else: copy_gradients_to_cpu() in async_accumulate_grad_in_cpu_via_gpu)"),
          introduced_in="0.15.2",
          explains=("ZeRO-1/2 with offload_optimizer copies a micro-step's gradient to the CPU buffer only on the first "
                    "micro-step; the ones between it and the boundary are lost", "first and last micro-batch",
                    "upgrade to DeepSpeed >= 0.19.0, or keep GA <= 2 with optimizer offload")),
    Known("B6", "deepspeed", "found by gradkit (no upstream report as of 2026-11-25)", affected_from=None,
          fixed_in=None, last_affected=None, newest_pinned="0.19.8",
          notes=("ZeRO-3; only a model whose parameters some step or micro-batch does not reach shows it",),
          explains=("ZeRO-3 never zeroes its reduced-gradient partitions (grad_partitions_flat_buffer): a parameter no "
                    "micro-batch of a step reached is stepped with its last gradient, one first reached after "
                    "micro-batch 1 adds onto the previous window's", (PART_STALE,),
                    "no release fixes it: give every parameter a gradient in every micro-batch (e.g. multiply an "
                    "unused module's output by 0 and add it), or zero optimizer.grad_partitions_flat_buffer after "
                    "each step")),
    Known("B7", "deepspeed", "found by gradkit (no upstream report as of 2026-11-25)", affected_from=None,
          fixed_in=None, last_affected=None, newest_pinned="0.19.8",
          notes=("offload_optimizer cpu; only a model whose parameters the boundary micro-batch does not reach "
                 "shows it in DeepSpeed's own loop",
                 "ZeRO-3 with offload: a part no micro-batch of a step reaches (no_grad_step) is B7's alone (the kit's "
                 "B7 fix makes it exact, B6's does not); a part first reached after micro-batch 1 adds the previous "
                 "window through B6's partition, so ZeRO-3 with offload is exact only with both fixes"),
          explains=("offload_optimizer cpu writes the fp32 gradient only for the parameters the boundary micro-batch "
                    "reaches and never clears it: a part the boundary misses loses its window's gradient and keeps its "
                    "last one", (PART_STALE, PART_LOST, f"{PART_STALE} and {PART_LOST}", f"{PART_LOST} and {PART_STALE}"),
                    "no release fixes it: give every parameter a gradient in every micro-batch (an unused module's "
                    "output x 0 added), or train without optimizer offload")),
    Known("FSDP2", "torch", "pytorch/pytorch#162338 (gloo AVG reduce-scatter summed; open upstream)", affected_from=None,
          fixed_in=None, last_affected=None, newest_pinned="2.13.0",
          rules=(("control", NOT_AFFECTED, None, None),
                 ("sync_last", NOT_AFFECTED, None, None), ("sync_every", NOT_AFFECTED, None, None),
                 ("sum_not_mean", AFFECTED, None, None, 2), ("sum_not_mean", NOT_AFFECTED, None, None),
                 ("sync_kept_off", AFFECTED, None, None)),
          notes=("#162338: measured exact on torch 2.13.0 CPU gloo (fp32 and bf16 reduce-scatter average)",
                 "pytorch/pytorch#194058: bf16 params + fp32 reduce, sync off, a unit whose forward did not run in a "
                 "micro-batch raises AttributeError '_unsharded_param' (2.13.0: cannot-run)",
                 "pytorch/pytorch#196996 (open): bf16 params + fp32 reduce, one FSDP unit, a parameter first used "
                 "by the last micro-batch raises 'uniform gradient dtype' (2.13.0: cannot-run)")),
    Known("ACC", "accelerate", "huggingface/accelerate#2790", affected_from=None, fixed_in="0.31.0", last_affected=None,
          newest_pinned="1.15.0", prs=("huggingface/accelerate#2531 (sync_each_batch, 0.28.0)",
                                       "huggingface/accelerate#2790 (its optimizer step fixed, 0.31.0)"),
          rules=(("control", NOT_AFFECTED, "0.27.0", None),
                 ("accumulate", NOT_AFFECTED, "0.27.0", None), ("sync_each_batch", AFFECTED, "0.28.0", "0.31.0", 2),
                 ("sync_each_batch", NOT_AFFECTED, "0.28.0", "0.31.0"),
                 ("sync_each_batch", NOT_AFFECTED, "0.31.0", None), ("last_window", AFFECTED, "0.27.0", None),
                 ("last_window_fixed", NOT_AFFECTED, "0.27.0", None), ("sum_not_mean", AFFECTED, "0.27.0", None, 2),
                 ("sum_not_mean", NOT_AFFECTED, "0.27.0", None),
                 ("accumulate_ragged", AFFECTED, "0.27.0", None), ("tokens_global", NOT_AFFECTED, "0.27.0", None),
                 ("tokens_local", AFFECTED, "0.27.0", None)),
          notes=("sync_each_batch: the optimizer stepped on every micro-batch from 0.28.0 until 0.31.0",
                 "last_window: the last incomplete window's loss is still divided by the full GA "
                 "(huggingface/accelerate#1847; documented behaviour)",
                 "micro-batches of different sizes (tokens): mean losses weigh them alike; Accelerate documents the "
                 "normalisation by the window's item count gathered over every process (tokens_global)")),
    Known("HFT", "transformers", "huggingface/transformers#34191", affected_from=None, fixed_in="5.10.1", last_affected=None,
          newest_pinned="5.24.0", prs=("huggingface/transformers#34191", "#34198 (the accumulation loss fix, 4.46.0)",
                                       "huggingface/transformers#45305 (the label count, B1)"),
          rules=(("harness", NOT_AFFECTED, None, None), ("gas1", AFFECTED, None, "5.10.1"),
                 ("gas1", NOT_AFFECTED, "5.10.1", None),
                 ("trainer", AFFECTED, None, "5.10.1"), ("trainer", NOT_AFFECTED, "5.10.1", None),
                 ("avg_tokens_on", AFFECTED, "4.46.2", "5.10.1"),
                 ("avg_tokens_on", NOT_AFFECTED, "5.10.1", None), ("avg_tokens_off", AFFECTED, "4.46.2", None),
                 ("sum_not_mean", AFFECTED, None, None, 2)),
          notes=("< 4.46.0: each micro-batch's mean loss / GAS (micro-batches weighted by their own token counts); "
                 "at GAS 1 on 2 ranks each rank's mean, averaged (ranks weighted by their token counts)",
                 "4.46 - 5.3: num_items_in_batch counts unshifted labels, one per sequence too many (B1)",
                 "average_tokens_across_devices: from 4.46.2 (default off), default on in 5.x; off, each rank "
                 "divides by its own count (documented)")),
    Known("B9", "deepspeed", "deepspeedai/DeepSpeed#8393", affected_from="0.18.3", fixed_in=None, last_affected=None,
          newest_pinned="0.19.8", prs=("deepspeedai/DeepSpeed#7665 (the regression, 0.18.3)",
                                       "deepspeedai/DeepSpeed#7839 (bf16 on ZeRO-0 only, 0.18.6)",
                                       "deepspeedai/DeepSpeed#8588 (the logged norm, open)"),
          notes=("FP16_UnfusedOptimizer (a torch optimizer, no ZeRO optimizer: fp16 at ZeRO-0; bf16 at ZeRO-1 with "
                 "grad_accum_dtype fp32 on 0.17.6 - 0.18.4, deepspeedai/DeepSpeed#7515 until #7788)",
                 "from 0.18.3 engine.backward scales the loss only for a ZeRO optimizer, while "
                 "FP16_UnfusedOptimizer.step still divides by its loss scale: every update is 1 / loss_scale",
                 "before it the step is right but the logged grad norm is the scaled one (x loss_scale)",
                 "fp16 at ZeRO-0 runs here from 0.16.8 (0.14.4 - 0.16.7 refuse fp16 gradients on the CPU "
                 "accelerator): 0.16.8 - 0.18.2 step right, the logged norm x loss_scale",
                 "found by gradkit check on a shipped fp16 ZeRO-0 config; its start by gradkit bisect"),
          introduced_in="0.18.3",
          explains=("FP16_UnfusedOptimizer divides every update by its loss scale, which engine.backward no longer "
                    "applied to the loss (it scales it for a ZeRO optimizer only)", "global mean / loss scale",
                    "no release fixes it: run ZeRO stage 1 or more (a ZeRO optimizer scales the loss itself), or "
                    "a DeepSpeed release before 0.18.3")),
    Known("B10", "deepspeed", "found by gradkit (deepspeedai/DeepSpeed#8588's comments read the same ordering; no "
          "report for ZeRO as of 2026-11-27)", affected_from=None, fixed_in=None, last_affected=None,
          newest_pinned="0.19.8",
          notes=("fp16 with a dynamic loss scale (fp16.loss_scale 0): the step on which the scale grows, one in "
                 "loss_scale_window (1000 by default); a clip that binds hides it (the clipped step has the clip's "
                 "norm either way)",
                 "the optimizer's step() calls _update_scale before unscale_and_clip_grads, which divides the "
                 "gradient (scaled by the old scale in backward) by the new one: that step applies old / new = 1/2",),
          explains=("DeepSpeed's fp16 step raises its dynamic loss scale (_update_scale) before it unscales the "
                    "gradient (unscale_and_clip_grads), which then divides by the new scale: the step where the scale "
                    "grows applies old / new of the update (1/2)", naming.SCALE_GREW,
                    "no release fixes it: a static loss scale (\"fp16\": {\"loss_scale\": 1024} or another power "
                    "of 2), or bf16; with a dynamic scale, one step in loss_scale_window is applied at half size")),
    Known("B11", "deepspeed", "found by gradkit (no upstream report as of 2026-11-27)", affected_from="0.19.0",
          fixed_in=None, last_affected=None, newest_pinned="0.19.8", introduced_in="0.19.0",
          prs=("deepspeedai/DeepSpeed#7967 (B5's fix: the CPU copy on every micro-step, 0.19.0)",
               "deepspeedai/DeepSpeed#7981 (the gate micro_step_id > 0 or not boundary, 0.19.0)"),
          notes=("ZeRO-1/2 with offload_optimizer cpu, config GA 1 and several backward() per step() (your own loop)",
                 "every backward is a boundary, so the CPU accumulator (accumulated_grads_in_cpu) is never reset at "
                 "micro-step 0, and nothing in step() resets it: each step loses its first micro-batch and applies "
                 "the previous step's update again (so every earlier one)",
                 "before 0.19.0 the same loop keeps only the last micro-batch (the gradient_accumulation_steps > 1 "
                 "gate of the CPU accumulation; B3's step)"),
          explains=("ZeRO-1/2 with offload_optimizer cpu and several backward() per step() at config GA 1: every backward "
                    "is a boundary, so the CPU gradient accumulator is never reset (#7981's gate skips micro-step 0): "
                    "each step loses its first micro-batch and applies the previous step's update again",
                    naming.CARRIED,
                    "call engine.set_gradient_accumulation_boundary(i == N - 1) before each backward (or put N in "
                    "gradient_accumulation_steps; from 0.19.4 \"managed_gradient_accumulation\": false); no release "
                    "fixes it")),
    Known("B12", "deepspeed", "deepspeedai/DeepSpeed#7718", affected_from="0.17.6", fixed_in="0.18.3",
          last_affected=None, newest_pinned="0.19.8", introduced_in="0.17.6",
          prs=("deepspeedai/DeepSpeed#7509 (the regression, 0.17.6)", "deepspeedai/DeepSpeed#7665 (the fix, 0.18.3)"),
          notes=("ZeRO-2 without optimizer offload, GA > 1, any precision: only the boundary micro-batch reaches the "
                 "step (ZeRO-1, ZeRO-3 and offload are not hit)",
                 "independent_gradient_partition_epilogue tests averaged_gradients where it now fills all_grad_tensors, "
                 "so every micro-batch replaces the last; an fp16 overflow in an earlier micro-batch is never seen",
                 "found on the kit's B10 bisect (0.17.6 - 0.18.2 every step off); upstream: #7718, huggingface/trl#4540"),
          explains=("ZeRO-2's independent_gradient_partition_epilogue tests averaged_gradients where it fills "
                    "all_grad_tensors (#7509), so each micro-batch replaces the previous one: only the boundary "
                    "micro-batch reaches the step", "last micro-batch / N",
                    "upgrade to DeepSpeed >= 0.18.3 (or, on 0.17.6 - 0.18.2, ZeRO-1, ZeRO-3 or optimizer offload)")),
    Known("B8", "deepspeed", "deepspeedai/DeepSpeed#8382", affected_from=None, fixed_in="0.19.8", last_affected=None,
          newest_pinned="0.19.8", prs=("deepspeedai/DeepSpeed#8382",),
          notes=("DeepSpeed's CPU accelerator only; ZeRO-1/2 with contiguous_gradients false",
                 "found by gradkit's sweep (0.18.6), its fix release by gradkit bisect (notebook 08)"),
          explains=("on DeepSpeed's CPU accelerator, ZeRO-1/2 with contiguous_gradients false never all-reduce: "
                    "split_half_float_double matches no CPU tensor's type, so each rank steps its partition with the "
                    "sum of its own micro-batches", naming.OWN_PARTITION,
                    "upgrade to DeepSpeed >= 0.19.8, or set \"contiguous_gradients\": true (a GPU run is not "
                    "affected)")),
    Known("B13", "deepspeed", "found by gradkit (no upstream report found as of 2026-11-28)", affected_from=None,
          fixed_in="0.19.8", last_affected=None, newest_pinned="0.19.8", prs=("deepspeedai/DeepSpeed#2847 (the cast, v0.10.1)",),
          notes=("ZeRO-1 with data_types.grad_accum_dtype other than the parameters' dtype: fp16 + fp32, or bf16 + "
                 "fp32 with offload_optimizer (bf16 + fp32 without offload runs BF16_Optimizer: B4's)",
                 "found by gradkit's sweep (0.18.6) as an unknown group with B8's step, read in the source"),
          explains=("ZeRO-1 accumulating in another dtype than the parameters' reduces a copy: "
                    "get_gradient_for_reduction returns param.grad_accum.to(self.dtype), the all-reduce averages that "
                    "copy, and the step copies each rank's own unreduced param.grad_accum, so each rank steps its "
                    "partition with the sum of its own micro-batches", naming.OWN_PARTITION,
                    "upgrade to DeepSpeed >= 0.19.8, or leave data_types.grad_accum_dtype at the parameters' dtype "
                    "(bf16 + fp32 accumulation without offload runs BF16_Optimizer instead: B4 up to 0.18.9)")),
)}

UNMANAGED_SINCE = "0.19.4"  # B3's opt-out key; older releases ignore it silently
