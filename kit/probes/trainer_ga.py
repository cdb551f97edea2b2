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
control            the same path with GAS = 1 (nothing to accumulate)                          control
=================  ==========================================================================  ==========

The trace records, per micro-batch, what ``compute_loss`` returned and with which ``num_items_in_batch``
(against the label tokens the loss really sums over: labels are shifted by one inside the model), and
what ``accelerator.backward`` received, by wrapping the real calls.
"""
from __future__ import annotations

import copy
import math

BUG = "B1"
PROBE = "trainer_ga"
VOCAB, SEQ = 64, 12
PATHS = {"no_ds": None, "ds_zero0": 0, "ds_zero2": 2, "ds_zero3": 3}
CASES = {
    "trainer": {"role": "measured"},
    "accepts_false": {"role": "workaround"},
    "fix_scale_gas": {"role": "fix"},
    "fix_always_divide": {"role": "fix"},
    "control": {"role": "control"},
}


def tiny_qwen3(seed: int, hidden: int = 32):
    """A 2-layer Qwen3 from a config, same weights on every rank; the Trainer sees model_accepts_loss_kwargs."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=hidden // 2,
                      max_position_embeddings=4 * SEQ, tie_word_embeddings=False)
    return Qwen3ForCausalLM(cfg).float()


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
    """One Trainer step of ``case`` (path, micro_batch, gas); effective gradient, logged norm and the trace."""
    import tempfile

    import torch
    from transformers import Trainer, TrainingArguments

    from kit import oracle
    from kit.probes import common as c

    mb, gas, path, seed = case["micro_batch"], case["ga"], case["path"], case["seed"]
    model = tiny_qwen3(seed)
    start = copy.deepcopy(model)
    rows = token_rows(seed, mb * gas * c.world_size())
    zero = PATHS[path]
    with tempfile.TemporaryDirectory(prefix="gradkit-trainer-") as out_dir:
        args = TrainingArguments(output_dir=out_dir, per_device_train_batch_size=mb, gradient_accumulation_steps=gas,
                                 learning_rate=1.0, lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=1e9,
                                 optim="sgd", max_steps=1, logging_steps=1, report_to=[], save_strategy="no",
                                 remove_unused_columns=False, seed=seed, use_cpu=c.device().type == "cpu",
                                 deepspeed=None if zero is None else ds_config(zero))
        trainer = probe_trainer_class(Trainer)(model=model, args=args, train_dataset=rows,
                                               fix=case["name"] if case["name"].startswith("fix_") else None)
        if case["name"] == "accepts_false":
            trainer.model_accepts_loss_kwargs = False  # the seed's workaround
        trace = trainer.gradkit_trace
        trainer.train()
        engine = trainer.model_wrapped if zero is not None else None
        after = c.full_fp32_params(engine.module, engine.optimizer) if engine is not None else \
            torch.cat([p.detach().reshape(-1).double() for p in trainer.model.parameters()])
        logged = [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]
        accel_gas = getattr(trainer.accelerator, "gradient_accumulation_steps", None)
        engine_gas = engine.gradient_accumulation_steps() if engine is not None else None
    before = torch.cat([p.detach().reshape(-1).double() for p in start.parameters()])
    reference, tokens, ref_loss = reference_gradient(start, rows)
    out = {"metrics": oracle.compare(before - after, reference), "label_tokens": tokens, "reference_loss": ref_loss,
           "logged_grad_norm": logged[0] if logged else None, "trace": trace,
           "model_accepts_loss_kwargs": bool(trainer.model_accepts_loss_kwargs),
           "accelerator_gas": accel_gas, "engine_gas": engine_gas}
    if engine is not None:
        c.release(engine)
    return out


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
    GAS whenever the Trainer did not and keeps DeepSpeed's scaling off.
    """
    trace: list[dict] = []
    compute_loss, backward = trainer.compute_loss, trainer.accelerator.backward

    def seen_compute_loss(model, inputs, *a, num_items_in_batch=None, **kw):
        out = compute_loss(model, inputs, *a, num_items_in_batch=num_items_in_batch, **kw)
        loss = out[0] if isinstance(out, tuple) else out
        labels = inputs["labels"]
        trace.append({"call": "compute_loss", "loss": float(loss.detach()),
                      "num_items_in_batch": None if num_items_in_batch is None else int(num_items_in_batch),
                      "label_tokens_unshifted": int((labels != -100).sum()),
                      "label_tokens_shifted": int((labels[:, 1:] != -100).sum())})
        return out

    def seen_backward(loss, **kw):
        last = next((t for t in reversed(trace) if t["call"] == "compute_loss"), {})
        trainer_divided = not (trainer.model_accepts_loss_kwargs and last.get("num_items_in_batch") is not None)
        gas = trainer.args.gradient_accumulation_steps
        if fix == "fix_scale_gas" and "scale_wrt_gas" in kw:
            kw["scale_wrt_gas"] = not trainer_divided
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
        trace.append({"call": "accelerator.backward", "loss": float(loss.detach()), "trainer_divided": trainer_divided,
                      "kwargs": {k: v for k, v in kw.items() if isinstance(v, (bool, int, float, str))},
                      "backpropagated": backpropagated[-1] if backpropagated else None})
        return result

    trainer.compute_loss, trainer.accelerator.backward = seen_compute_loss, seen_backward
    return trace


def run_rank(payload: dict) -> list[dict]:
    """Entry point of ``kit.launch``: every case of the payload, one after another, in this world."""
    from kit.probes import common as c

    return c.run_cases(payload, run_case)


# ====================================================================== in the caller

def plan(paths=tuple(PATHS), gas_values=(1, 2, 4, 8), cases=tuple(CASES), global_batch: int = 8,
         seed: int = 0) -> list[dict]:
    """Per path: the GAS = 1 control, then every case at every GAS > 1 (micro-batch = global_batch / GAS)."""
    from kit import config as kconfig

    unknown = set(paths) - set(PATHS)
    if unknown:
        raise kconfig.ConfigError(f"unknown B1 path(s) {sorted(unknown)}; known: {list(PATHS)}")
    bad = set(cases) - set(CASES)
    if bad:
        raise kconfig.ConfigError(f"unknown B1 case(s) {sorted(bad)}; known: {list(CASES)}")
    out = []
    for path in paths:
        out.append({"name": "control", **CASES["control"], "path": path, "zero_stage": PATHS[path],
                    "dtype": "fp32", "micro_batch": global_batch, "ga": 1, "seed": seed})
        for gas in gas_values:
            kconfig.check_ga(gas)
            if gas == 1:
                continue
            if global_batch % gas:
                raise kconfig.ConfigError(f"GAS {gas} does not divide the global batch {global_batch}")
            for name in cases:
                if name != "control":
                    out.append({"name": name, **CASES[name], "path": path, "zero_stage": PATHS[path],
                                "dtype": "fp32", "micro_batch": global_batch // gas, "ga": gas, "seed": seed})
    return out


def validate(stacks, paths, gas_values, cases, world_size: int, global_batch: int, device: str,
             timeout_s: float) -> None:
    """Every knob of the B1 notebook, checked before the first launch (``ConfigError`` says which)."""
    from kit import config as kconfig
    from kit import versions

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


def violations(recs: list[dict]) -> list[str]:
    """The claims the B1 notebook asserts, each broken one as a sentence (empty list: all hold).

    1. every GAS = 1 control is the reference up to its token factor (the count ``num_items_in_batch``
       uses against the label tokens the loss sums): whatever is off at GAS = 1 is that count;
    2. every step the Trainer took as shipped has a GAS factor of GAS ** k for a whole k (k = 0 correct,
       +1 summed, -1 or -2: divided by GAS once or twice too often): its GAS handling is explained;
    3. the applied gradient keeps the reference's direction on every such step (cosine 1).
    """
    from kit import oracle

    bad = []
    for r in recs:
        if r["verdict"] == oracle.CANNOT_RUN or not r.get("metrics"):
            continue
        where = f"{r['version']} {r['path']} GAS={r['ga']} {r['case']}"
        tol = oracle.tolerance(r["dtype"]).norm_ratio
        if r["role"] == "control" and r.get("gas_factor") is not None and abs(r["gas_factor"] - 1) > tol:
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

    Each record is judged against its own path's GAS = 1 control from the same world, and carries
    ``token_factor`` (label tokens the loss sums over / ``num_items_in_batch`` it is divided by) and
    ``gas_factor`` (effective/reference ratio / token_factor: 1 correct, GAS summed, 1/GAS divided twice);
    both only at W = 1, where rank 0's trace holds every token. ``gas_verdict`` holds at any W.
    """
    from kit import records

    validate(stacks, paths, gas_values, cases, world_size, global_batch, device, timeout_s)
    todo = plan(paths, gas_values, cases, global_batch, seed)
    out = []
    for st in stacks:
        meta = {"bug": BUG, "probe": PROBE, "world_size": world_size, "device": device, "seed": seed,
                "stack": dict(st)}
        recs = records.run_version_world(f"kit.probes.{PROBE}:run_rank", todo, stack_label(st), meta, world_size,
                                         device, timeout_s, control_key=lambda r: r["config"]["path"], stack=dict(st))
        controls = {r["config"]["path"]: r for r in recs if r["role"] == "control"}
        out += [_annotate(r, controls.get(r["config"]["path"])) for r in recs]
    return out


def _annotate(rec: dict, control: dict | None = None) -> dict:
    """Token and GAS factors, and ``gas_verdict``: does GAS change the applied gradient at a fixed global batch?

    ``verdict`` judges the step against the reference (with the GAS = 1 control as usual). ``gas_verdict``
    judges it against that control itself: it stays meaningful when the control is off for a reason
    that does not depend on GAS (transformers 5.3.0 counts one label token too many per sequence).
    """
    from kit import oracle

    calls = [t for t in rec.get("trace") or [] if t["call"] == "compute_loss"]
    rec["path"] = rec["config"]["path"]
    if calls and rec.get("metrics") and rec["world_size"] == 1:  # the trace is rank 0's: one rank's tokens only
        items = calls[0]["num_items_in_batch"]
        summed = sum(t["label_tokens_shifted"] for t in calls)
        rec["token_factor"] = summed / items if items else None
        rec["gas_factor"] = rec["metrics"]["norm_ratio"] / rec["token_factor"] if items else None
        if rec.get("gas_factor") and rec["ga"] > 1:  # GAS ** power: +1 summed, -1 divided once too often, ...
            rec["gas_power"] = math.log(rec["gas_factor"]) / math.log(rec["ga"])
    if rec["role"] == "control" or not rec.get("metrics") or not (control or {}).get("metrics"):
        rec["gas_verdict"] = rec["verdict"] if rec["role"] != "control" else "n/a"
        return rec
    vs_control = rec["metrics"]["norm_ratio"] / control["metrics"]["norm_ratio"]
    rec["ratio_vs_control"] = vs_control
    ok = abs(vs_control - 1) <= oracle.tolerance(rec["dtype"]).norm_ratio and rec["metrics"]["cosine"] > 0.9999
    rec["gas_verdict"] = oracle.NOT_AFFECTED if ok else oracle.AFFECTED
    return rec
