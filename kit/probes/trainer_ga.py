"""B1 (work in progress): HF Trainer + DeepSpeed with a ``model_accepts_loss_kwargs=True`` model.

The seed (``000``) compares the Trainer's logged grad norm with and without DeepSpeed and concludes
that DeepSpeed sums micro-batch gradients. A ratio between two paths does not say which one is
wrong, so this probe judges every path against the reference: one real ``transformers.Trainer``
step (SGD, lr=1, constant schedule, no clipping, no weight decay) on a tiny ``Qwen3ForCausalLM``
built from a config (no download), on a synthetic token dataset whose samples have different
numbers of label tokens, compared with the plain fp32 gradient of the global batch's loss: the
mean over all its label tokens, which is what the Trainer means to apply.

Paths: ``no_ds`` (the Trainer alone) and ``ds_zero0`` / ``ds_zero2`` / ``ds_zero3``. Cases per path and GAS:

=================  ==========================================================================  ==========
case               what                                                                        role
=================  ==========================================================================  ==========
trainer            the Trainer as shipped                                                      measured
accepts_false      ``trainer.model_accepts_loss_kwargs = False`` (the seed's workaround)       workaround
fix_scale_gas      seed fix 1: under DeepSpeed pass ``scale_wrt_gas=True`` when the Trainer     fix
                   did not divide the loss itself
fix_always_divide  seed fix 2: always divide the loss by GAS, always ``scale_wrt_gas=False``    fix
gas1               the same path with GAS = 1 (nothing to accumulate)                          baseline
harness            the same model and rows through a plain PyTorch loop (no Trainer,            control
                   Accelerate or DeepSpeed): ``torch.distributed.all_reduce`` and SGD
=================  ==========================================================================  ==========

Two named verdicts per step:

- ``verdict`` -- *matches the reference*: the applied gradient against the fp32 reference of the global batch,
  with the ``harness`` step of the same GAS as the control. The control does not depend on the library under
  test: whatever transformers counts, the harness either reproduces the reference or the harness is suspect.
- ``gas_verdict`` -- *GAS-invariant*: the applied gradient against the same path's GAS = 1 step (``gas1``), the
  report's own question. A path can be GAS-invariant and still not match the reference (transformers 5.3.0
  counts one label token too many per sequence, so every path applies tokens / (tokens + sequences)).

The trace records, per micro-batch, what ``compute_loss`` returned and with which ``num_items_in_batch``
(against the label tokens the loss really sums over: labels are shifted by one inside the model), and
what ``accelerator.backward`` received, by wrapping the real calls.
"""
from __future__ import annotations

import copy
import math

from kit import config as kconfig
from kit.judge import oracle
from kit.probes import common as c
from kit.probes import runner
from kit.probes.probe import Probe
from kit.stacks import versions
from kit.stacks.versions import PACKAGES

BUG = "B1"
VOCAB, SEQ = 64, 12
PATHS = {"no_ds": None, "ds_zero0": 0, "ds_zero2": 2, "ds_zero3": 3}
CASES = {
    "trainer": {"role": "measured"},
    "accepts_false": {"role": "workaround"},
    "fix_scale_gas": {"role": "fix"},
    "fix_always_divide": {"role": "fix"},
    "gas1": {"role": "baseline"},
    "harness": {"role": "control"},
}
HARNESS_PATH = "harness"  # the plain-PyTorch control runs outside every Trainer path


def tiny_qwen3(seed: int, hidden: int = 32):
    """A 2-layer Qwen3 from a config, same weights on every rank; the Trainer sees model_accepts_loss_kwargs."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=hidden // 2,
                      max_position_embeddings=4 * SEQ, tie_word_embeddings=False)
    return Qwen3ForCausalLM(cfg).float()


def tiny_llama(seed: int, hidden: int = 32):
    """A 2-layer Llama from a config, same weights on every rank: the architecture every transformers release the kit
    runs has (Qwen3 arrived in 4.51), so the Trainer's accumulation can be judged on both sides of 4.46's fix."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=4 * SEQ,
                      tie_word_embeddings=False)
    return LlamaForCausalLM(cfg).float()


ARCHS = {"qwen3": tiny_qwen3, "llama": tiny_llama}


def tiny_model(seed: int, arch: str = "qwen3"):
    """The case's tiny causal LM (``arch``: a key of ``ARCHS``)."""
    return ARCHS[arch](seed)


def token_rows(seed: int, n: int):
    """``n`` samples of ``SEQ`` tokens; a random tail of each sample's labels is -100, so label counts differ."""
    import torch

    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        ids = torch.randint(0, VOCAB, (SEQ,), generator=g)
        labels = ids.clone()
        masked = int(torch.randint(0, SEQ // 2, (1,), generator=g))
        if masked:
            labels[-masked:] = -100
        rows.append({"input_ids": ids, "attention_mask": torch.ones(SEQ, dtype=torch.long), "labels": labels})
    return rows


def reference_gradient(model, rows):
    """fp32, one process: the gradient of (sum of token losses) / (number of label tokens) over all ``rows``."""
    import torch
    import torch.nn.functional as F

    ref = copy.deepcopy(model).float()
    ids = torch.stack([r["input_ids"] for r in rows])
    labels = torch.stack([r["labels"] for r in rows])
    logits = ref(input_ids=ids).logits[:, :-1].float()
    target = labels[:, 1:]
    tokens = int((target != -100).sum())
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), ignore_index=-100,
                           reduction="sum") / tokens
    grads = torch.autograd.grad(loss, [p for p in ref.parameters()])
    return torch.cat([g.reshape(-1) for g in grads]).double(), tokens, loss.item()


def ds_config(zero_stage: int) -> dict:
    """The Trainer fills the "auto" values from its own arguments, as users' configs do."""
    return {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
            "train_batch_size": "auto", "gradient_clipping": "auto", "zero_allow_untested_optimizer": True,
            "zero_optimization": {"stage": zero_stage}}


def run_case(case: dict) -> dict:
    """``case["steps"]`` (``common.STEPS`` by default) Trainer steps of ``case`` (path, micro_batch, gas), each judged
    against the reference of the rows it really took (read from what ``compute_loss`` was handed), from that step's
    own starting weights; the logged norm and the trace per step."""
    import tempfile

    import torch
    from transformers import Trainer, TrainerCallback, TrainingArguments

    mb, gas, path, seed, steps = case["micro_batch"], case["ga"], case["path"], case["seed"], case.get("steps", c.STEPS)
    arch = case.get("arch", "qwen3")
    model = tiny_model(seed, arch)
    rows = token_rows(seed, mb * gas * c.world_size() * steps)
    zero, reads = PATHS[path], []
    with tempfile.TemporaryDirectory(prefix="gradkit-trainer-") as out_dir:
        args = TrainingArguments(output_dir=out_dir, per_device_train_batch_size=mb, gradient_accumulation_steps=gas,
                                 learning_rate=1.0, lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=1e9,
                                 optim="sgd", max_steps=steps, logging_steps=1, report_to=[], save_strategy="no",
                                 remove_unused_columns=False, seed=seed, use_cpu=c.device().type == "cpu",
                                 deepspeed=None if zero is None else ds_config(zero), **case.get("trainer_args", {}))
        trainer = probe_trainer_class(Trainer)(model=model, args=args, train_dataset=rows,
                                               fix=case.get("fix") or (case["name"] if case["name"].startswith("fix_")
                                                                       else None))
        trainer.gradkit_rows = {tuple(r["input_ids"].tolist()): i for i, r in enumerate(rows)}
        if case["name"] == "accepts_false":
            trainer.model_accepts_loss_kwargs = False  # the seed's workaround

        def read():  # a collective under ZeRO: every rank's callbacks run it at the same point
            if zero is None:
                return c.plain_read(trainer.model)
            engine = trainer.model_wrapped
            return c.read_weights(engine.module, engine.optimizer, "fp32")

        class Reads(TrainerCallback):
            def on_train_begin(self, *a, **k):
                reads.append(read())

            def on_step_end(self, *a, **k):
                reads.append(read())

        trainer.add_callback(Reads())
        trace = trainer.gradkit_trace
        trainer.train()
        engine = trainer.model_wrapped if zero is not None else None
        logged = [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]
        accel_gas = getattr(trainer.accelerator, "gradient_accumulation_steps", None)
        engine_gas = engine.gradient_accumulation_steps() if engine is not None else None
    effective = [c.applied(reads[s], reads[s + 1])[0] for s in range(len(reads) - 1)]
    per_rank = [c.all_gather_flat(e) for e in effective]  # every rank must have applied the same update
    rank_traces = [None] * c.world_size()  # the token count is a matter of every rank's micro-batches
    if c.world_size() > 1:
        import torch.distributed as dist
        dist.all_gather_object(rank_traces, trace)
    else:
        rank_traces = [trace]
    out = {"model_accepts_loss_kwargs": bool(getattr(trainer, "model_accepts_loss_kwargs", False)),
           "accelerator_gas": accel_gas,
           "engine_gas": engine_gas}
    if c.rank() == 0:
        judged = [_judge_step(s, reads[s], effective[s], per_rank[s], rows, rank_traces, seed,
                              logged[s] if s < len(logged) else None, arch, case.get("attribute", False))
                  for s in range(len(effective))]
        out.update(_worst(judged, reads[0]["module"], reads[-1]["module"], rows, rank_traces, seed, arch))
    if engine is not None:
        c.release(engine)
    return out


def _judge_step(step: int, before: dict, effective, per_rank, rows, rank_traces, seed: int, logged,
                arch: str = "qwen3", attribute: bool = False) -> dict:
    """Rank 0: one step against the reference of the rows every rank's ``compute_loss`` was handed in that step,
    from the step's own starting weights. ``attribute``: also fit the step over the micro-batches (rank-major, in
    the order each rank's ``compute_loss`` saw them), each basis vector the gradient of that micro-batch's summed
    token loss over the global batch's label tokens (weight 1 each is the reference): a micro-batch weighted by
    its own or its rank's token count shows as such."""
    import torch

    traces = [[t for t in tr or [] if t.get("step") == step] for tr in rank_traces]
    taken = sorted({i for tr in traces for t in tr if t["call"] == "compute_loss" for i in t.get("rows") or []})
    start = tiny_model(seed, arch)
    torch.nn.utils.vector_to_parameters(before["module"].float(), start.parameters())
    reference, tokens, ref_loss = reference_gradient(start, [rows[i] for i in taken])
    out = {}
    if attribute:
        basis = []
        for trace in traces:
            for t in trace:
                if t["call"] == "compute_loss":
                    g, n, _ = reference_gradient(start, [rows[i] for i in t["rows"]])
                    basis.append(g * n / tokens)
        out["attribution"] = oracle.attribute(effective, torch.stack(basis), torch.ones(len(basis), dtype=torch.float64))
    return {**out, "step": step, "rows": taken, "metrics": oracle.compare(effective, reference), "label_tokens": tokens,
            "reference_loss": ref_loss, "logged_grad_norm": logged, "logged_norm": logged,
            "reference_norm": reference.norm().item(), "trace": traces[0], "rank_traces": traces,
            "rank_spread": {"effective gradients": oracle.spread(per_rank)}}


def _worst(judged: list[dict], first, last, rows, rank_traces, seed: int, arch: str = "qwen3") -> dict:
    """The record: its worst step's measurement, every step in ``steps``, and the trajectory (the weights after every
    step against the reference's own steps, on the same rows, from the same start)."""
    import torch

    worst = max(range(len(judged)), key=lambda q: oracle.severity({**judged[q], "dtype": "fp32"}))
    ref = first.clone()
    for st in judged:
        model = tiny_model(seed, arch)
        torch.nn.utils.vector_to_parameters(ref.float(), model.parameters())
        ref = ref - reference_gradient(model, [rows[i] for i in st["rows"]])[0]
    return {**judged[worst], "steps": judged, "worst_step": worst,
            "trajectory": {"steps": len(judged), **oracle.compare(first - last, first - ref)}}


def run_harness(case: dict) -> dict:
    """The control: the same model and rows, a plain PyTorch accumulation loop, no Trainer / Accelerate / DeepSpeed.

    Rank r takes its own block of rows in GAS micro-batches; each micro-batch's summed token loss is divided by
    the label tokens of the whole global batch (counted after the shift), gradients are summed over ranks with
    ``torch.distributed.all_reduce`` and plain SGD (lr = 1) steps: exactly the reference's update. Each of
    ``case["steps"]`` steps takes the next global batch of rows and is judged as the Trainer's steps are.
    """
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    mb, gas, seed, w, r = case["micro_batch"], case["ga"], case["seed"], c.world_size(), c.rank()
    steps, dev, per_step = case.get("steps", c.STEPS), c.device(), mb * gas * w
    arch = case.get("arch", "qwen3")
    model = tiny_model(seed, arch).to(dev)
    rows = token_rows(seed, per_step * steps)
    reads, traces = [c.plain_read(model)], []
    for s in range(steps):
        block = rows[s * per_step:(s + 1) * per_step]
        tokens = sum(int((row["labels"][1:] != -100).sum()) for row in block)
        mine = block[r * mb * gas:(r + 1) * mb * gas]
        for i in range(gas):
            chunk = mine[i * mb:(i + 1) * mb]
            ids = torch.stack([x["input_ids"] for x in chunk]).to(dev)
            target = torch.stack([x["labels"] for x in chunk])[:, 1:].to(dev)
            logits = model(input_ids=ids).logits[:, :-1].float()
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), ignore_index=-100,
                                   reduction="sum") / tokens
            loss.backward()
            first = s * per_step + r * mb * gas + i * mb
            traces.append({"call": "compute_loss", "step": s, "rows": list(range(first, first + mb))})
        if w > 1:
            for p in model.parameters():
                dist.all_reduce(p.grad)  # the sum over ranks: every label token of the global batch once
        with torch.no_grad():
            for p in model.parameters():
                p -= p.grad  # SGD, lr = 1
                p.grad = None
        reads.append(c.plain_read(model))
    effective = [c.applied(reads[s], reads[s + 1])[0] for s in range(steps)]
    per_rank = [c.all_gather_flat(e) for e in effective]
    rank_traces = [None] * w
    if w > 1:
        dist.all_gather_object(rank_traces, traces)
    else:
        rank_traces = [traces]
    if c.rank() != 0:
        return {}
    judged = [_judge_step(s, reads[s], effective[s], per_rank[s], rows, rank_traces, seed, None, arch,
                          case.get("attribute", False)) for s in range(steps)]
    for st in judged:  # the harness has no Trainer calls to show
        st["trace"], st["rank_traces"] = [], []
    return _worst(judged, reads[0]["module"], reads[-1]["module"], rows, rank_traces, seed, arch)


def probe_trainer_class(trainer_cls):
    """A subclass of the Trainer under test that records its calls and, if asked, applies one of the seed's fixes."""

    class ProbeTrainer(trainer_cls):
        def __init__(self, *args, fix: str | None = None, **kwargs):
            super().__init__(*args, **kwargs)
            self.gradkit_trace = _observe(self, fix)

    return ProbeTrainer


def _observe(trainer, fix: str | None = None) -> list[dict]:
    """Wrap the real calls (not re-implement them): what compute_loss got, what accelerator.backward got.

    ``fix`` applies one of the seed's proposed fixes at the same place its patch would act, the call
    into ``accelerator.backward`` (the Trainer's own division has happened by then):
    ``fix_scale_gas`` lets DeepSpeed divide when the Trainer did not; ``fix_always_divide`` divides by
    GAS whenever the Trainer did not and keeps DeepSpeed's scaling off. ``fault_undivided`` is a loop bug, not a fix:
    the loss reaches backward multiplied by GAS (a custom ``compute_loss`` that forgot to divide).
    """
    trace: list[dict] = []
    compute_loss, backward = trainer.compute_loss, trainer.accelerator.backward

    def seen_compute_loss(model, inputs, *a, num_items_in_batch=None, **kw):
        if num_items_in_batch is not None:
            kw["num_items_in_batch"] = num_items_in_batch  # a Trainer before 4.46 neither passes nor takes it
        out = compute_loss(model, inputs, *a, **kw)
        loss = out[0] if isinstance(out, tuple) else out
        labels = inputs["labels"]
        ids = getattr(trainer, "gradkit_rows", {})
        trace.append({"call": "compute_loss", "loss": float(loss.detach()), "step": trainer.state.global_step,
                      "rows": [ids.get(tuple(x.tolist()), -1) for x in inputs["input_ids"].cpu()],
                      "num_items_in_batch": None if num_items_in_batch is None else int(num_items_in_batch),
                      "label_tokens_unshifted": int((labels != -100).sum()),
                      "label_tokens_shifted": int((labels[:, 1:] != -100).sum())})
        return out

    def seen_backward(loss, **kw):
        last = next((t for t in reversed(trace) if t["call"] == "compute_loss"), {})
        trainer_divided = not (getattr(trainer, "model_accepts_loss_kwargs", False)
                               and last.get("num_items_in_batch") is not None)
        gas = trainer.args.gradient_accumulation_steps
        if fix == "fix_scale_gas" and "scale_wrt_gas" in kw:
            kw["scale_wrt_gas"] = not trainer_divided
        elif fix == "fault_undivided":
            loss = loss * gas
        elif fix == "fix_always_divide" and not trainer_divided:
            loss = loss / gas
            if "scale_wrt_gas" in kw:
                kw["scale_wrt_gas"] = False
        import torch

        backpropagated: list[float] = []
        tensor_backward = torch.Tensor.backward

        def seen_tensor_backward(self, *a, **k):  # the scalar autograd really starts from, after Accelerate/DS
            if self.dim() == 0:
                backpropagated.append(float(self.detach()))
            return tensor_backward(self, *a, **k)

        torch.Tensor.backward = seen_tensor_backward
        try:
            result = backward(loss, **kw)
        finally:
            torch.Tensor.backward = tensor_backward
        trace.append({"call": "accelerator.backward", "step": trainer.state.global_step,
                      "loss": float(loss.detach()), "trainer_divided": trainer_divided,
                      "kwargs": {k: v for k, v in kw.items() if isinstance(v, (bool, int, float, str))},
                      "backpropagated": backpropagated[-1] if backpropagated else None})
        return result

    trainer.compute_loss, trainer.accelerator.backward = seen_compute_loss, seen_backward
    return trace


def run_rank(payload: dict) -> list[dict]:
    """Entry point of ``kit.launch``: every case of the payload, one after another, in this world."""
    return c.run_cases(payload, lambda case: run_harness(case) if case["name"] == "harness" else run_case(case))


# ====================================================================== in the caller

def plan(paths=tuple(PATHS), gas_values=(1, 2, 4, 8), cases=tuple(CASES), global_batch: int = 8,
         seed: int = 0) -> list[dict]:
    """Per GAS the plain-PyTorch ``harness`` control; per path the GAS = 1 baseline, then every case at every GAS > 1
    (micro-batch = global_batch / GAS)."""
    unknown = set(paths) - set(PATHS)
    if unknown:
        raise kconfig.ConfigError(f"unknown B1 path(s) {sorted(unknown)}; known: {list(PATHS)}")
    bad = set(cases) - set(CASES)
    if bad:
        raise kconfig.ConfigError(f"unknown B1 case(s) {sorted(bad)}; known: {list(CASES)}")
    out = []
    for gas in sorted({1, *gas_values}):
        kconfig.check_ga(gas)
        if global_batch % gas:
            raise kconfig.ConfigError(f"GAS {gas} does not divide the global batch {global_batch}")
        out.append({"name": "harness", **CASES["harness"], "path": HARNESS_PATH, "zero_stage": None,
                    "dtype": "fp32", "micro_batch": global_batch // gas, "ga": gas, "seed": seed})
    for path in paths:
        out.append({"name": "gas1", **CASES["gas1"], "path": path, "zero_stage": PATHS[path],
                    "dtype": "fp32", "micro_batch": global_batch, "ga": 1, "seed": seed})
        for gas in gas_values:
            if gas == 1:
                continue
            for name in cases:
                if name not in ("gas1", "harness"):
                    out.append({"name": name, **CASES[name], "path": path, "zero_stage": PATHS[path],
                                "dtype": "fp32", "micro_batch": global_batch // gas, "ga": gas, "seed": seed})
    return out


def validate(stacks, paths, gas_values, cases, world_size: int, global_batch: int, device: str,
             timeout_s: float) -> None:
    """Every knob of the B1 notebook, checked before the first launch (``ConfigError`` says which)."""
    kconfig.check_device(device)
    kconfig.check_world_size(world_size, device)
    kconfig.check_timeout(timeout_s)
    for name, values in (("STACKS", stacks), ("PATHS", paths), ("GAS_VALUES", gas_values), ("CASES", cases)):
        kconfig.check_list(name, values)
    for st in stacks:
        if not isinstance(st, dict):
            raise kconfig.ConfigError(f"a version stack is a mapping like {{'transformers': '5.3.0'}}, got {st!r}")
        for package, version in st.items():
            if package not in versions.PACKAGES:
                raise kconfig.ConfigError(f"stacks pin {versions.PACKAGES}, not {package!r}")
            kconfig.check_version(version)
    kconfig.check_positive_int("global_batch", global_batch)
    plan(paths, gas_values, cases, global_batch)


def check_notebook(p: dict) -> list:
    """Every parameter of notebook 01, by its name there (what the notebook and ``kit.notebooks.runall`` call first);
    returns the ``(probe, stack)`` pairs its worlds will run (``kit.stacks.prefetch``)."""
    validate(p["STACKS"], p["PATHS"], p["GAS_VALUES"], p["CASES"], p["WORLD_SIZE"], p["GLOBAL_BATCH"], p["DEVICE"],
             p["TIMEOUT_S"])
    return [(PROBE, stack) for stack in p["STACKS"]]


def violations(recs: list[dict]) -> list[str]:
    """The claims the B1 notebook asserts, each broken one as a sentence (empty list: all hold).

    0. every plain-PyTorch harness step (the control) is the reference: the harness itself is sound;
    1. every GAS = 1 step of the Trainer is the reference up to its token factor (the count ``num_items_in_batch``
       uses against the label tokens the loss sums, over every rank): whatever is off at GAS = 1 is that count,
       and the token factor is known for every step of a loss-kwargs model;
    2. every step the Trainer took as shipped has a GAS factor of GAS ** k for a whole k (k = 0 correct,
       +1 summed, -1 or -2: divided by GAS once or twice too often): its GAS handling is explained;
    3. the applied gradient keeps the reference's direction on every such step (cosine 1).
    """
    bad = []
    for r in recs:
        if r["case"] == "harness" and r["verdict"] == oracle.CANNOT_RUN:  # the world itself did not run
            bad.append(f"{r['version']} GAS={r['ga']}: the plain-PyTorch harness could not run, so nothing of this "
                       f"stack was measured: {r['reason'][:300]}")
        if r["verdict"] == oracle.CANNOT_RUN or not r.get("metrics"):
            continue
        where = f"{r['version']} {r['path']} GAS={r['ga']} {r['case']}"
        tol = oracle.tolerance(r["dtype"]).norm_ratio
        if r["role"] == "control" and r["verdict"] != oracle.NOT_AFFECTED:
            bad.append(f"{where}: the plain-PyTorch harness is off the reference: {r['reason']}")
            continue
        if r["case"] in ("trainer", "gas1") and r.get("model_accepts_loss_kwargs") and r.get("token_factor") is None:
            bad.append(f"{where}: the token factor could not be computed from the ranks' traces")
        if r["role"] == "baseline" and r.get("gas_factor") is not None and abs(r["gas_factor"] - 1) > tol:
            bad.append(f"{where}: the GAS=1 step is off the reference by more than its token count explains "
                       f"({r['metrics']['norm_ratio']:.5f} vs token factor {r['token_factor']:.5f})")
        if r["case"] == "trainer" and r.get("gas_power") is not None:
            k = round(r["gas_power"])
            if abs(r["gas_factor"] / r["ga"] ** k - 1) > tol:
                bad.append(f"{where}: GAS factor {r['gas_factor']:.5f} is no whole power of GAS")
            if r["metrics"]["cosine"] < 1 - tol:
                bad.append(f"{where}: the applied gradient is rotated (cosine {r['metrics']['cosine']:.6f})")
    return bad


def stack_label(stack: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in sorted(stack.items())) or "installed"


def run(stacks=({},), paths=tuple(PATHS), gas_values=(1, 2, 4, 8), cases=tuple(CASES), world_size: int = 1,
        global_batch: int = 8, seed: int = 0, device: str = "cpu",
        timeout_s: float = 600) -> list[dict]:
    """Every path x case x GAS under every version stack ({package: version}, {} = installed); one world each.

    Each record carries two verdicts: ``verdict`` (matches the reference; control: the plain-PyTorch ``harness``
    step of the same GAS from the same world) and ``gas_verdict`` (GAS-invariant: against the same path's GAS = 1
    step), plus ``token_factor`` (label tokens the loss sums over, on every rank / the ``num_items_in_batch`` it
    is divided by) and ``gas_factor`` (effective/reference ratio / token_factor: 1 correct, GAS summed, 1/GAS
    divided twice).
    """
    validate(stacks, paths, gas_values, cases, world_size, global_batch, device, timeout_s)
    todo = plan(paths, gas_values, cases, global_batch, seed)
    return runner.run(PROBE, todo, [dict(st) for st in stacks], (world_size,), device, timeout_s, meta={"seed": seed},
                      label=stack_label)


def annotate_world(recs: list[dict]) -> list[dict]:
    baselines = {r["config"]["path"]: r for r in recs if r["case"] == "gas1"}
    return [_annotate(r, baselines.get(r["config"]["path"])) for r in recs]


def token_factor(rank_traces: list[list[dict]]) -> float | None:
    """Label tokens the loss really sums over, on every rank, over the count the Trainer divides by.

    The Trainer counts ``num_items_in_batch`` over a rank's whole accumulation window and, with
    ``average_tokens_across_devices``, sums it over ranks (every rank then holds the same global count);
    otherwise each rank divides by its own count and the ranks' gradients are averaged.
    """
    calls = [[t for t in trace or [] if t["call"] == "compute_loss"] for trace in rank_traces]
    if not calls or not all(calls) or any(c[0]["num_items_in_batch"] is None for c in calls):
        return None
    summed = [sum(t["label_tokens_shifted"] for t in c) for c in calls]
    items = [c[0]["num_items_in_batch"] for c in calls]
    if len(set(items)) == 1 and (len(calls) == 1 or items[0] > max(sum(t["label_tokens_unshifted"] for t in c)
                                                                   for c in calls)):
        return sum(summed) / items[0] if items[0] else None  # one global count
    return sum(s / n for s, n in zip(summed, items)) / len(items) if all(items) else None  # per-rank counts, averaged


def _annotate(rec: dict, baseline: dict | None = None) -> dict:
    """Token and GAS factors, and ``gas_verdict``: does GAS change the applied gradient at a fixed global batch?

    ``verdict`` (set by the records) judges the step against the reference, with the harness as control.
    ``gas_verdict`` judges it against the same path's GAS = 1 step: it answers the report's question even
    where that step is itself off the reference for a reason GAS does not change (the token count). Every judged
    step gets its own factors and ``gas_verdict`` (against the baseline's same step); the record's factors are its
    worst step's, its ``gas_verdict`` the worst of its steps'.
    """
    rec["path"] = rec["config"]["path"]
    steps = rec.get("steps") or [rec]
    base_steps = (baseline or {}).get("steps") or [baseline or {}]
    for i, st in enumerate(steps):
        _factors(st, rec["ga"])
        st["gas_verdict"] = _gas_verdict(rec, st, base_steps[min(i, len(base_steps) - 1)])
    if rec.get("steps"):
        worst = steps[rec.get("worst_step", 0)]
        for k in ("token_factor", "gas_factor", "gas_power", "ratio_vs_control"):
            if k in worst:
                rec[k] = worst[k]
        rec["gas_verdict"] = min((st["gas_verdict"] for st in steps),
                                 key=lambda v: oracle.WORST_FIRST.index(v) if v in oracle.WORST_FIRST else 99)
    elif not rec.get("metrics"):
        rec["gas_verdict"] = "n/a" if rec["role"] in ("control", "baseline") else oracle.CANNOT_RUN
    return rec


def _factors(part: dict, ga: int) -> None:
    """A step's ``token_factor`` (from every rank's trace of that step), ``gas_factor`` and ``gas_power``."""

    factor = token_factor(part.get("rank_traces") or [part.get("trace")]) if part.get("metrics") else None
    if factor:
        part["token_factor"] = factor
        part["gas_factor"] = part["metrics"]["norm_ratio"] / factor
        if ga > 1:  # GAS ** power: +1 summed, -1 divided once too often, ...
            part["gas_power"] = math.log(part["gas_factor"]) / math.log(ga)


def _gas_verdict(rec: dict, part: dict, base: dict) -> str:
    """One step against the same path's GAS = 1 step (same rows): is it GAS-invariant?"""
    if rec["role"] in ("control", "baseline"):
        return "n/a"
    if not part.get("metrics") or not base.get("metrics"):
        return oracle.CANNOT_RUN if not part.get("metrics") else oracle.INCONCLUSIVE
    vs = part["metrics"]["norm_ratio"] / base["metrics"]["norm_ratio"]
    part["ratio_vs_control"] = vs
    ok = abs(vs - 1) <= oracle.tolerance(rec["dtype"]).norm_ratio and part["metrics"]["cosine"] > 0.9999
    return oracle.NOT_AFFECTED if ok else oracle.AFFECTED


STACKS = {"installed": {}, "transformers 5.3.0 + DeepSpeed 0.18.9": {"transformers": "5.3.0", "deepspeed": "0.18.9"}}


def explorer_kwargs(sel: dict, device: str, timeout_s: float) -> dict:
    path = "no_ds" if sel["zero_stage"] == "none" else f"ds_zero{sel['zero_stage']}"
    return {"stacks": [STACKS[sel["version"]]], "paths": [path], "gas_values": [1, sel["ga"]],
            "cases": ["trainer", "accepts_false"], "world_size": sel["world_size"], "device": device,
            "timeout_s": timeout_s}


PROBE = Probe(
    id=BUG, title="HF Trainer + DeepSpeed + model_accepts_loss_kwargs=True", module="trainer_ga",
    notebook="01_trainer_loss_kwargs.ipynb", measured_case="trainer",
    ratio_meaning="effective / reference gradient of the Trainer's step (GAS > 1)",
    advice="the Trainer's step is off the reference: read notebook 01 for which path GAS changes and what the token "
           "count costs; upgrade transformers (see the upstream table in kit/judge/expectations.py), and never add the "
           "report's extra division by GAS",
    run=run, check_notebook=check_notebook,
    quick_plan=lambda w: dict(paths=("no_ds", "ds_zero0"), gas_values=(1, 4), cases=("trainer",), world_size=1),
    knobs={"world_size": [1, 2], "ga": [4, 2, 8], "zero_stage": ["none", 0, 2, 3], "dtype": ["fp32"],
           "version": list(STACKS)},
    explorer_kwargs=explorer_kwargs, packages=PACKAGES, typical_s=45.0, annotate=annotate_world,
    violations=violations, order=1)
