"""What is known upstream, per bug: which releases have it, where each fix landed, with its pull request.

One table (``KNOWN``), read by every notebook's last cells and by the overview:

- for a **pinned** release (one the table vouches for: not newer than ``newest_pinned``), the measured
  verdict must equal ``expected(...)``; a mismatch there is a bug in the harness, and the notebook fails;
- for a release **newer than the table**, the measurement is a *finding* ("0.20.1 is no longer affected",
  "still affected"), printed and never failed on (``judge_release``).

Sources (upstream pull requests and issues; the releases are those that first ship each change):

- B4 (``BF16_Optimizer`` averages before it adds the boundary micro-batch): reported on 0.18.6, present through
  0.18.10-dev; deepspeedai/DeepSpeed#7985 swaps the two calls in ``_backward_epilogue``, first released in 0.19.0.
- B2 (``PipelineEngine`` with GA > 1): up to 0.18.2 the stages sum their micro-batches; deepspeedai/DeepSpeed#7724
  (0.18.4) makes the engine honour a per-output GAS scaling hook, after which earlier stages are divided by GA
  twice (0.18.3 - 0.19.2, measured); deepspeedai/DeepSpeed#8154 fixes it in 0.19.3.
- B3 (config GA = 1, N manual backwards, ZeRO-1/2 keep only the last micro-batch): not a regression but the
  boundary bookkeeping of ZeRO-1/2; the opt-out ``"managed_gradient_accumulation": false`` arrives in 0.19.4
  (deepspeedai/DeepSpeed#8184, #8203, #8217). The manual loop itself stays affected on every release measured.
- B1 (HF Trainer + DeepSpeed + ``model_accepts_loss_kwargs``): reported as huggingface/transformers#45305 on
  transformers 5.3.0; 5.3.0 counts one label token too many per sequence, so every path applies
  tokens / (tokens + sequences) of the reference; 5.23.0 (installed) is measured correct on every path. The
  release in between that fixed it is not pinned here: such releases are findings, not assertions.
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
  first micro-batch adds its window onto the previous window's total.
- B7 (``offload_optimizer`` CPU, ZeRO-1/2/3: the fp32 gradient buffer is written only for the parameters the
  boundary micro-batch reaches and never cleared): found by the kit's sweep on the same shapes (0.18.6 and
  0.19.8; no upstream report found). ``copy_grads_in_partition`` writes a parameter's slice of
  ``single_partition_of_fp32_groups[i].grad`` only when its hook fires on the boundary micro-step, and nothing
  zeroes that buffer or ``accumulated_grads_in_cpu`` between steps (ZeRO-3: ``fp32_partitioned_groups_flat[i].grad``
  and ``_offload_grad_partition_at_boundary``). A part the boundary micro-batch misses loses its window's
  gradient and keeps its last one.
- B8 (DeepSpeed's CPU accelerator, ZeRO-1/2 with ``contiguous_gradients: false``: no all-reduce at all): found by the
  kit's sweep on 0.18.6 as an unknown group, its end found by ``gradkit bisect`` (0.19.7 affected, 0.19.8 exact;
  measured affected on 0.18.3 - 0.19.7 wherever those run here) and its change read in the two releases' sources
  (notebook 08). ``buffered_reduce_fallback`` sorts the gradients with ``split_half_float_double``, which compares
  ``t.type()`` with ``"torch.{device}.FloatTensor"``; on the CPU accelerator that is ``"torch.cpu.FloatTensor"``,
  which no CPU tensor's type (``"torch.FloatTensor"``) matches, so no bucket is reduced and each rank steps its
  partition with its own local gradient. deepspeedai/DeepSpeed#8382 compares ``t.dtype`` instead, first released in
  0.19.8. A GPU run matches ``"torch.cuda.FloatTensor"`` and is not affected.

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
  is divided by GAS (huggingface/transformers#34191, #34198, first in 4.46.0); 4.46 - 5.3 count labels before the
  shift (one token per sequence too many, B1's count) and ``average_tokens_across_devices`` (from 4.46.3) defaults
  off until 5.0; 5.23.0 is exact. 4.45.2 is the oldest release measured; it runs on torch 2.13 with accelerate 1.0.1.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from kit.judge import oracle
from kit.judge.parts import PART_LOST, PART_STALE
from kit.stacks.versions import version_key

AFFECTED, NOT_AFFECTED = oracle.AFFECTED, oracle.NOT_AFFECTED


@dataclass(frozen=True)
class Pin:
    """One boundary of a bug's range, found by the kit's own bisect: the last release with the old result and the
    first with the new one, both measured (adjacent on the index, or with the releases between them that cannot run
    here in ``between``); the series of the release history (``kit/judge/history.json``) that holds both results,
    the command that found it and the code that changed between them (the diff's functions)."""

    what: str  # what starts at ``after``: "introduced", "fixed", "the step changes: ...", "the opt-out key arrives"
    before: str
    after: str
    series: str  # the recipe measured (kit.commands.bisect.known.RECIPES) and its series in the history
    found_by: str  # the gradkit bisect command line
    code: str  # the function(s) whose change the diff between the two releases shows
    between: tuple = ()  # releases between ``before`` and ``after`` that cannot run here


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
    pins: tuple = ()  # the boundaries the kit's bisect found (``Pin``), oldest first
    # where the oldest release that runs here is already affected: why the start cannot be pinned here
    start_hidden: str | None = None

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

    def fix_text(self) -> str:
        where = f"fixed in {self.package} {self.fixed_in}" if self.fixed_in else "no release fixes it"
        return where + (f" ({', '.join(self.prs)})" if self.prs else "")


KNOWN = {k.bug: k for k in (
    Known("B1", "transformers", "huggingface/transformers#45305", affected_from=None, fixed_in="5.23.0",
          last_affected="5.3.0", newest_pinned="5.23.0", prs=("huggingface/transformers#45305 (report)",),
          notes=("fixed somewhere in 5.4 - 5.23: not pinned", "the report's DeepSpeed is 0.18.9")),
    Known("B2", "deepspeed", "deepspeedai/DeepSpeed#8154", affected_from=None, fixed_in="0.19.3", last_affected=None,
          newest_pinned="0.19.8", prs=("deepspeedai/DeepSpeed#8154", "deepspeedai/DeepSpeed#7724 (0.18.4)"),
          notes=("<= 0.18.2: every stage sums (x GA)", "0.18.3 - 0.19.2: earlier stages divided by GA twice")),
    Known("B3", "deepspeed", "allenai/open-instruct#1498", affected_from="0.18.3", fixed_in=None, last_affected=None,
          newest_pinned="0.19.8", prs=("deepspeedai/DeepSpeed#8184", "#8203", "#8217 (managed_gradient_accumulation, 0.19.4)"),
          notes=("ZeRO-1/2 only; ZeRO-0/3 keep every micro-batch", "0.18.0 - 0.18.2 crash in the manual loop"),
          explains=("ZeRO-1/2 with config GA = 1 and several backward() per step(): every backward is a boundary, the "
                    "accumulator is reset", "last micro-batch / N",
                    "call engine.set_gradient_accumulation_boundary(i == N - 1) before each backward (or put N in "
                    "gradient_accumulation_steps; from 0.19.4 \"managed_gradient_accumulation\": false)")),
    Known("B4", "deepspeed", "deepspeedai/DeepSpeed#7985", affected_from="0.18.6", fixed_in="0.19.0", last_affected=None,
          newest_pinned="0.19.8", prs=("deepspeedai/DeepSpeed#7985",),
          explains=("BF16_Optimizer averages its fp32 accumulator before the boundary micro-batch is added",
                    "own rank's boundary micro-batch",
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
    Known("B6", "deepspeed", "found by gradkit (no upstream report as of 2026-11-25)", affected_from="0.18.6",
          fixed_in=None, last_affected=None, newest_pinned="0.19.8",
          notes=("ZeRO-3; only a model whose parameters some step or micro-batch does not reach shows it",),
          explains=("ZeRO-3 never zeroes its reduced-gradient partitions (grad_partitions_flat_buffer): a parameter no "
                    "micro-batch of a step reached is stepped with its last gradient, one first reached after "
                    "micro-batch 1 adds onto the previous window's", (PART_STALE,),
                    "no release fixes it: give every parameter a gradient in every micro-batch (e.g. multiply an "
                    "unused module's output by 0 and add it), or zero optimizer.grad_partitions_flat_buffer after "
                    "each step")),
    Known("B7", "deepspeed", "found by gradkit (no upstream report as of 2026-11-25)", affected_from="0.18.6",
          fixed_in=None, last_affected=None, newest_pinned="0.19.8",
          notes=("offload_optimizer cpu; only a model whose parameters the boundary micro-batch does not reach "
                 "shows it in DeepSpeed's own loop",),
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
    Known("HFT", "transformers", "huggingface/transformers#34191", affected_from=None, fixed_in="4.46.0", last_affected=None,
          newest_pinned="5.23.0", prs=("huggingface/transformers#34191", "#34198 (the accumulation loss fix, 4.46.0)",
                                       "huggingface/transformers#45305 (the label count, B1)"),
          rules=(("harness", NOT_AFFECTED, None, None), ("gas1", AFFECTED, None, "5.4.0"),
                 ("gas1", NOT_AFFECTED, "5.23.0", None),
                 ("trainer", AFFECTED, None, "4.46.0"), ("trainer", AFFECTED, "4.46.0", "5.4.0"),
                 ("trainer", NOT_AFFECTED, "5.23.0", None), ("avg_tokens_on", AFFECTED, "4.46.3", "5.4.0"),
                 ("avg_tokens_on", NOT_AFFECTED, "5.23.0", None), ("avg_tokens_off", AFFECTED, "4.46.3", None),
                 ("sum_not_mean", AFFECTED, None, None, 2)),
          notes=("< 4.46.0: each micro-batch's mean loss / GAS (micro-batches weighted by their own token counts); "
                 "at GAS 1 on 2 ranks each rank's mean, averaged (ranks weighted by their token counts)",
                 "4.46 - 5.3: num_items_in_batch counts unshifted labels, one per sequence too many (B1)",
                 "average_tokens_across_devices: from 4.46.3 (default off), default on in 5.x; off, each rank "
                 "divides by its own count (documented)")),
    Known("B8", "deepspeed", "deepspeedai/DeepSpeed#8382", affected_from="0.18.3", fixed_in="0.19.8", last_affected=None,
          newest_pinned="0.19.8", prs=("deepspeedai/DeepSpeed#8382",),
          notes=("DeepSpeed's CPU accelerator only; ZeRO-1/2 with contiguous_gradients false",
                 "found by gradkit's sweep (0.18.6), its fix release by gradkit bisect (notebook 08)")),
)}

UNMANAGED_SINCE = "0.19.4"  # B3's opt-out key; older releases ignore it silently


def expected(bug: str, versions: dict, case: str | None = None, zero_stage: int | None = None,
             ga: int | None = None) -> str | None:
    """The verdict upstream implies for one record's stack and configuration (None: not pinned).

    ``versions`` is what the record's ranks imported ({package: version}). B3 depends on the configuration:
    the manual loop is affected on ZeRO-1/2 only, and ``managed_gradient_accumulation: false`` repairs it
    from 0.19.4; the other fixes and every control are expected correct on every pinned release.
    """
    known = KNOWN[bug]
    version = (versions or {}).get(known.package)
    if not version:
        return None
    if known.rules:
        return known.rule_for(case, version, ga)
    base = known.expected_for_release(version)
    if base is None:
        return None
    if bug == "B3":
        if case == "fix_unmanaged":
            return NOT_AFFECTED if version_key(version) >= version_key(UNMANAGED_SINCE) or zero_stage in (0, 3) \
                else AFFECTED
        if case not in (None, "manual"):
            return NOT_AFFECTED
        return AFFECTED if zero_stage in (1, 2) else NOT_AFFECTED
    return base


def judge_release(bug: str, versions: dict, measured: str, **config) -> tuple[str, str]:
    """``("ok" | "mismatch" | "finding" | "not-judged", sentence)`` for one measured verdict.

    ``mismatch`` only for a pinned release (the notebook asserts there is none); a release newer than the
    table gives a ``finding`` that says what changed; ``cannot-run`` / ``inconclusive`` are ``not-judged``.
    """
    known = KNOWN[bug]
    version = (versions or {}).get(known.package, "?")
    want = expected(bug, versions, **config)
    what = f"{bug} on {known.package} {version}" + "".join(f", {k} {v}" for k, v in config.items() if v is not None)
    if measured not in (AFFECTED, NOT_AFFECTED):
        return "not-judged", f"{what}: {measured}, so it neither confirms nor contradicts the upstream table"
    if want is not None:
        if want == measured:
            return "ok", f"{what}: {measured}, as upstream says ({known.fix_text()})"
        return "mismatch", (f"{what}: measured {measured}, but upstream says {want} ({known.fix_text()}): "
                            f"a pinned release disagrees with the table, so the harness is suspect")
    newer = version_key(version) > version_key(known.newest_pinned)
    if not newer:
        return "finding", f"{what}: {measured} (this release is not pinned in the table)"
    if measured == NOT_AFFECTED:
        state = "is not affected" + (" (as the fix implies)" if known.fixed_in else ": a finding, no fix is known")
    else:
        state = "is still affected" + (f", although the fix landed in {known.fixed_in}" if known.fixed_in else "")
    return "finding", f"{what} (newer than the table's {known.newest_pinned}) {state}"


def mismatches(bug: str, recs: list[dict], verdict_key: str = "verdict", **where) -> tuple[list[str], list[str]]:
    """``(mismatches, findings)`` over the records of ``bug``: what a notebook asserts empty, and what it prints."""
    bad, found = [], []
    for r in recs:
        if any(r.get(k) != v for k, v in where.items()):
            continue
        config = {"case": r.get("case"), "zero_stage": r.get("zero_stage")} if bug == "B3" else \
            {"case": r.get("case"), "ga": r.get("ga")} if KNOWN[bug].rules else {}
        word, text = judge_release(bug, r.get("versions") or {}, r.get(verdict_key) or r["verdict"], **config)
        if word == "mismatch":
            bad.append(text)
        elif word == "finding":
            found.append(text)
    return sorted(set(bad)), sorted(set(found))
