"""``Watch``: the oracle inside the user's own training job. Hooks on the user's model (what each micro-batch was
fed) and on the innermost optimizer (the gradient it consumes, read just before it steps); at a judged step the
reference is computed beside the job (``gradkit.watch.reference``), the consumed gradient is judged against it
(``gradkit.watch.judge``), one line goes to the training log and one record to ``<out>/watch.jsonl``. Unjudged steps
cost a counter and two hook calls that return at once.

The ecosystems' own conventions wrap this: ``gradkit.watch.deepspeed.watch_engine`` (a DeepSpeed engine, any loop),
``gradkit.watch.hf.Callback`` (the HF Trainer and TRL), and ``Watch(model, optimizer, ...)`` itself for a plain torch
loop (DDP ``no_sync`` included)."""
from __future__ import annotations

import datetime
import platform
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

from gradkit.judge import oracle, records
from gradkit.probes.ranks.ds_config import own_loss_scale
import gradkit.watch.judge as wjudge
import gradkit.watch.lines as lines
import gradkit.watch.losses as losses
import gradkit.watch.reference as reference
import gradkit.watch.sharded as sharded
from gradkit.watch.capture import Recorder
from gradkit.watch.guard import Faults, failed
from gradkit.watch.reads import Layout, chain
from gradkit.watch.schedule import Schedule
from gradkit.watch.sketch import SIZE, Sketch

RECORDS = "watch.jsonl"
PARTITIONS_FITTED = 8  # up to this many ranks, each rank's partition of a partitioned read is fitted on its own


class Affected(RuntimeError):
    """Raised on every rank after a judged step is ``affected``, where the watch was asked to stop the job."""


class Watch:
    """Judges chosen optimizer steps of a training job against the exact gradient of their global batch.

    ``model``: the user's module (unwrapped: what the forward of each micro-batch goes through); ``optimizer``: what
    the loop steps (a torch optimizer, or a wrapper holding one: Accelerate's, DeepSpeed's); ``loss``: how the user
    means the loss over the global batch (``gradkit.watch.losses``: ``Tokens()``, ``Criterion(fn)``, ``Returned()``;
    None: guessed from the first micro-batch, or ``Criterion(criterion)`` where a criterion is given, whose calls
    give each micro-batch its targets); ``clip``: the norm the engine clips at (its expected step is the reference
    clipped the same way); ``dtype``: the precision to judge at (None: the model's or autocast's); ``layers``: judge
    only the parameters whose names start with one of these; ``stop``: raise ``Affected`` after an affected step;
    ``shard``: the reference sharded over the ranks under FSDP2 (True), a whole copy on every rank (False), or
    sharded where the engine shards the model (None: ZeRO-3, FSDP2; ``gradkit.watch.sharded``).
    """

    def __init__(self, model: nn.Module, optimizer, loss=None, criterion=None, first: int = 2, every: int = 100,
                 steps=(), poll: int = 10, out="gradkit-watch", clip: float | None = None, dtype: str | None = None,
                 layers=None, stop: bool = False, sketch_size: int = SIZE, log=print, context: dict | None = None,
                 finalize_on_post: bool = True, known=None, shard: bool | None = None):
        while isinstance(model, nn.parallel.DistributedDataParallel):
            model = model.module
        wrappers = chain(optimizer)  # the engine's own optimizer is the one just above the torch one
        self.model, self.wrapper, self.basic = model, wrappers[-2] if len(wrappers) > 1 else optimizer, wrappers[-1]
        self.loss, self.criterion, self.clip, self.dtype, self.stop = loss, criterion, clip, dtype, stop
        self.layers = tuple(layers) if layers else None
        self.schedule = Schedule(first=first, every=every, steps=set(steps), poll=poll)
        self.out = Path(out)
        self.log, self.context = log, {"versions": {"torch": torch.__version__}, **(context or {})}
        self.sketch_size, self.known, self.shard = sketch_size, known, shard
        self.step = 0  # optimizer steps taken (consumed or skipped)
        self.records: list[dict] = []
        self.norms: dict[int, tuple] = {}  # judged step -> (the reference's norm before any clip, dtype)
        self.layout: Layout | None = None
        self._pending = None  # the judged step being read: its tally and reference
        self._prev_basis = None  # the previous step's basis, where it was judged
        self._consumed = False  # the optimizer consumed a gradient since the last step end
        self._written = False  # this run has written its first record (an earlier run's file was moved aside)
        self._scale_start = 1.0  # the engine's fp16 loss scale when the judged step's first backward ran
        self.faults = Faults()  # the watch's own errors: the judged step's cannot-run, never the job's (guard.py)
        self.recorder = Recorder(model, criterion,
                                 guard=lambda fn, *a: self.faults.run("capture", self.step + 1, fn, *a))
        self._handles = [self.basic.register_step_pre_hook(self._pre)]
        if finalize_on_post:
            self._handles.append(self.basic.register_step_post_hook(lambda *a: self.step_end()))
        self._arm()

    # ------------------------------------------------------------ the step's life

    def _arm(self) -> None:
        """Decide whether the next step is judged (every rank the same way) and record its window if so."""
        nxt = self.step + 1
        asked = False
        if self.schedule.polls(nxt):
            here = reference.world()[0] == 0 and self.faults.run("capture", nxt, Schedule.file_request, self.out)
            flag = torch.tensor([1.0 if here else 0.0])
            reference.all_sum(flag, dist.ReduceOp.MAX)
            asked = bool(flag.item())
            if asked and reference.world()[0] == 0:
                Schedule.take_file(self.out)
        if self.schedule.judged(nxt, asked):
            self.recorder.start()
            self._scale_start = own_loss_scale(self.wrapper)  # what the step's losses are scaled by
        else:
            self.recorder.take()

    def _pre(self, optimizer, args, kwargs) -> None:
        """Just before the innermost optimizer steps (DeepSpeed's ZeRO-1/2 step it once per parameter group). Never
        raises into the optimizer's step: an error of the watch's is the step's fault (``guard``)."""
        self._consumed = True
        try:
            if self._pending is None and self.recorder.recording:
                self._pending = self._reference(self.recorder.take())
            if self._pending is not None and "tally" in self._pending:
                t0 = time.perf_counter()
                self.faults.run("read", self.step + 1, self._read, optimizer)
                self._pending["seconds"]["read"] += time.perf_counter() - t0
        except Exception as e:  # noqa: BLE001 - a last resort: the phases above keep their own faults
            self.faults.note("reference", e)
            self._pending = {"cannot": failed(self.faults.first)}

    def _read(self, optimizer) -> None:
        current = [q for g in optimizer.param_groups for q in g["params"]]
        tally = self._pending["tally"]
        for t, start, values in self.layout.fragments(current):
            if t in self._pending["judged"]:
                tally.add(t, start, values)

    def step_end(self, skipped: bool | None = None) -> dict | None:
        """After the step (the optimizer's post-hook, the engine's step, the Trainer's step end): judge what was read,
        arm the next. ``skipped``: the engine says it skipped the step (None: skipped where nothing was consumed).
        Raises only ``Affected`` (asked for with ``stop``); an error of the watch's ends the step as cannot-run."""
        try:
            rec = self._step_end(skipped)
        except Exception as e:  # noqa: BLE001 - a last resort: the phases keep their own faults
            self.faults.note("judgement", e)
            rec = self._record({"step": self.step, "verdict": oracle.CANNOT_RUN,
                                "why": failed(self.faults.first)})
            self._pending, self._prev_basis = None, None
            self.faults.clear()
            self._arm()
        if rec and rec.get("verdict") == oracle.AFFECTED and self.stop:
            raise Affected(rec["line"])
        return rec

    def _step_end(self, skipped: bool | None) -> dict | None:
        if self._pending is None and not self.recorder.recording:
            self.faults.clear()  # an unjudged step: nothing of it to end as cannot-run
        consumed, self._consumed = self._consumed, False
        self.recorder.forwards = 0
        if skipped is None:
            skipped = not consumed
        self.step += 1
        rec = None
        fault = self.faults.agree() if self._pending is not None and "tally" in self._pending else ""
        if self._pending is not None and "cannot" in self._pending:  # the job goes on; the step is not judged
            rec = self._record({"step": self.step, "verdict": oracle.CANNOT_RUN,
                                "why": self._pending["cannot"][:600]})
            self._prev_basis = None
        elif fault:  # a rank's read failed: every rank ends the step here, before the tally's collectives
            rec = self._cannot(fault)
        elif self._pending is not None:
            rec = self._finish(self._pending)
        elif self.recorder.recording and not consumed and skipped:
            rec = self._record({"step": self.step, "verdict": "skipped",
                                "why": "the engine skipped this step (an overflow of the loss scale): nothing was "
                                       "applied, nothing to judge"})
            self._prev_basis = None
        else:
            self._prev_basis = None
        self._pending = None
        self.faults.clear()
        self._arm()
        return rec

    def _cannot(self, fault: str) -> dict:
        """The judged step ended by a fault of the watch's own, the same on every rank."""
        self._prev_basis = None
        return self._record({"step": self.step, "verdict": oracle.CANNOT_RUN,
                             "why": failed(fault)})

    # ------------------------------------------------------------ reference and judgement

    def _reference(self, window) -> dict:
        step, t0 = self.step + 1, time.perf_counter()
        if self.layout is None:
            self.layout = self.faults.run("read", step, Layout, self.model, self.wrapper, self.basic)
        built = self.faults.run("copy", step, self._copy)
        t1 = time.perf_counter()
        fault = self.faults.agree()  # the first collective of the step: every rank ends it here if one failed
        if fault:
            return {"cannot": failed(fault)}
        names = [n for n, _ in self.model.named_parameters()]
        covered = torch.zeros(len(names))
        covered[list(self.layout.covered())] = 1.0
        reference.all_sum(covered, dist.ReduceOp.MAX)
        judged = {t for t in range(len(names)) if covered[t] > 0
                  and (self.layers is None or names[t].startswith(self.layers))}
        if self.loss is None and window.micro_batches:
            self.loss = losses.guess(window.micro_batches[0], self.criterion)
        numels = [sharded.shape_of(p).numel() for p in self.model.parameters()]
        sketch = Sketch(numels, self.sketch_size, device=built.device)
        partitions = None
        if not self.layout.replicated and 1 < reference.world()[1] <= PARTITIONS_FITTED:
            mine = torch.tensor([(pc.t, pc.start, pc.numel) for pieces in self.layout.by_tensor.values()
                                 for pc in pieces], dtype=torch.int64).reshape(-1, 3)
            partitions = [[tuple(x) for x in r.tolist()] for r in reference.all_gather_ragged(mine)]
        refused = self.faults.run("reference", step, lambda: "")  # agreed before the sharded reference's collectives
        fault = self.faults.agree()
        if fault:
            return {"cannot": failed(fault)}
        t2 = time.perf_counter()
        try:
            local = built.run(window, self.loss, sketch, partitions, judged)
        except Exception as e:  # noqa: BLE001 - the user's model or loss refused the reference: said, not raised
            local, refused = None, f"{type(e).__name__}: {e}"
        flag = torch.tensor([1.0 if refused else 0.0])
        reference.all_sum(flag, dist.ReduceOp.MAX)  # every rank learns it before the next collective
        if float(flag):
            built.release()
            return {"cannot": "the reference could not be computed: "
                              + (refused or "another rank could not compute its reference")}
        t3 = time.perf_counter()
        out = built.finish(local, sketch, self.layout, judged)
        info = out["info"]
        coef = reference.clip_coef(out["rr"] ** 0.5, self.clip)
        held = {**out["held"],
                "sketches": info["basis"].numel() * 8 + (0 if info.get("parts") is None else info["parts"].numel() * 8),
                "inputs": sum(lines.nbytes(mb.args) + lines.nbytes(mb.kwargs) for mb in window.micro_batches)}
        dtype = self.dtype or lines.dtype_of(self.model, window)
        return {"tally": wjudge.Tally(out["ref"], coef, sketch), "judged": judged, "rr": out["rr"],
                "scale_change": self._scale_start / own_loss_scale(self.wrapper),  # never 0: 1 where none
                "maxref": out["top"], "info": info, "dtype": dtype, "window": len(window.micro_batches),
                "sketch": sketch, "held": held, "reference": built.MODE,
                "seconds": {"copy": t1 - t0, "agree": t2 - t1, "build": built.build_s,
                            "reference": t3 - t2 - built.build_s,
                            "gather": time.perf_counter() - t3, "read": 0.0}}

    def _copy(self):
        """The reference's copy for this judged step (made again at each: nothing of it is held between steps),
        sharded where the engine shards the model over more than one rank (``gradkit.watch.sharded``) or asked."""
        shard = self.shard if self.shard is not None else (reference.world()[1] > 1 and sharded.partitioned(self.model))
        return sharded.Sharded(self.model) if shard else reference.Copy(self.model)

    def _finish(self, p: dict) -> dict:
        tally, info, t0 = p["tally"], p["info"], time.perf_counter()
        own = tally.finish(self.layout.replicated)
        if not p["rr"]:
            out = {"verdict": oracle.INCONCLUSIVE, "why": "the reference gradient is zero on every judged parameter"}
        else:
            out = self.faults.run("judgement", self.step, wjudge.judgement, tally, p["rr"], p["maxref"],
                                  info["basis"], info["counts"], info["per_rank"], p["dtype"], own, self._prev_basis,
                                  self.context.get("loss_scale", 1.0), info.get("parts"),
                                  [n for n, _ in self.model.named_parameters()], self.context.get("declared_ga"),
                                  self.clip, p["scale_change"])
        fault = self.faults.agree()  # after the judgement's own arithmetic: one verdict on every rank
        if fault:
            return self._cannot(fault)
        p["seconds"]["judgement"] = time.perf_counter() - t0
        total = float(sum(info["counts"])) or 1.0
        rows = info["basis"]
        self._prev_basis = (torch.stack([b / n if n else b for b, n in zip(rows, info["counts"])]),
                            [n / total for n in info["counts"]]) if len(rows) else None
        self.norms[self.step] = (p["rr"] ** 0.5, p["dtype"])
        p["held"]["sign pattern"] = p["sketch"].held_bytes()
        p["held"]["peak"] += sum(v for k, v in p["held"].items() if k in ("sketches", "sign pattern", "inputs"))
        rec = {"step": self.step, **out, "dtype": p["dtype"], "ga": p["window"], "per_rank": info["per_rank"],
               "counts": info["counts"], "global_count": total, "loss": getattr(self.loss, "name", "?"),
               "read": self.layout.kind, "judged_parameters": len(p["judged"]), "clip_coef": tally.coef,
               "held_bytes": p["held"], "reference": p["reference"],
               "seconds": {k: round(v, 3) for k, v in p["seconds"].items()}}
        if p["scale_change"] != 1.0:  # the fp16 loss scale at the step's backward passes over the one at its read
            rec["loss_scale_change"] = p["scale_change"]
        declared = self.context.get("declared_ga")
        if declared and max(info["per_rank"]) < declared:
            rec["short_window"] = (f"the optimizer stepped after {max(info['per_rank'])} of the {declared} "
                                   "micro-batches the loop accumulates")
        if rec["verdict"] == oracle.AFFECTED and self.known:
            rec["known"] = self.faults.run("report", self.step, self.known, {**self.context, **rec})
        return self._record(rec)

    def _record(self, rec: dict) -> dict:
        rank, w = reference.world()
        rec = {"probe": "watch", "role": "measured", "case": f"step {rec['step']}", "world_size": w, **self.context,
               **rec, "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "host": platform.node()}
        said = Faults()  # this record's own line and file: a fault there ends this record, never another
        rec["line"] = said.run("report", rec["step"], lines.line, rec)
        if rec["line"] is None or self.faults.first and rec["verdict"] != oracle.CANNOT_RUN:  # or its explanation
            rec = self._failed(rec, said.first or self.faults.first)
        self.records.append(rec)
        if rank == 0:
            if not said.run("records", rec["step"], self._write, rec, default=False):
                self.records[-1] = rec = self._failed(rec, said.first)
            if self.log:  # the log itself failing: nothing more to say (guarded, not a phase a test plants)
                said.run("log", rec["step"], self.log, rec["line"])
        return rec

    @staticmethod
    def _failed(rec: dict, fault: str) -> dict:
        """``rec`` as its step's cannot-run: what the watch could not explain, write or say of it (this rank only:
        the verdict was agreed, its record or log line is what failed)."""
        out = {**rec, "verdict": oracle.CANNOT_RUN, "why": failed(fault),
               "measured_verdict": rec.get("verdict")}
        out["line"] = f"gradkit watch: step {out['step']}: cannot-run ({out['why']})"
        return out

    def _write(self, rec: dict) -> bool:
        if not self._written:
            self._written = True
            kept = lines.keep_earlier(self.out / RECORDS)
            if kept and self.log:
                self.log(f"gradkit watch: an earlier run's records in {self.out} were kept as {kept.name}")
        records.append(lines.plain(rec), self.out / RECORDS)
        return True

    def judge_logged_norm(self, step: int, logged: float) -> dict | None:
        """The grad norm the engine logged for a judged ``step`` (what the user's curves show, before clipping)
        against the reference's: a second verdict beside the applied step's, which clipping can make right
        whatever the scale of the gradient was (``oracle.norm_verdict``). None where ``step`` was not judged."""
        if step not in self.norms:
            return None
        norm, dtype = self.norms.pop(step)
        said = Faults()  # after the step ended: its own, never carried into the next step
        word, why = said.run("judgement", step, oracle.norm_verdict, logged, norm, dtype, default=(None, None))
        if word is None:
            word, why = oracle.CANNOT_RUN, failed(said.first)
        return self._record({"step": step, "case": f"step {step} logged grad norm", "verdict": word, "why": why,
                             "logged_norm": logged, "reference_norm": norm, "dtype": dtype})

    def request(self) -> None:
        """Judge the step about to start if none of its micro-batches has run yet, else the next one (call on every
        rank at the same point of the loop)."""
        if not self.recorder.recording and self.recorder.forwards == 0:
            self.recorder.start()
        else:
            self.schedule.request()

    def remove(self) -> None:
        """Takes every hook off the model and the optimizer."""
        self.recorder.remove()
        for h in self._handles:
            h.remove()
        self._handles = []
