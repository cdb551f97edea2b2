"""B1 inside a rank (``gradkit.probes.trainer_ga``, and ``gradkit.probes.trainer_ddp``'s ranks): a real
``transformers.Trainer`` on a tiny causal LM built from a config, its calls traced (``trainer_trace``), each step judged
against the reference of the rows it really took; and the plain-PyTorch harness, the control, on the same rows."""
from __future__ import annotations

import copy

from gradkit.judge import oracle
from gradkit.probes.ranks import common as c
from gradkit.probes.ranks import judging
from gradkit.probes.ranks.trainer_trace import probe_trainer_class

VOCAB, SEQ = 64, 12
PATHS = {"no_ds": None, "ds_zero0": 0, "ds_zero2": 2, "ds_zero3": 3}


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

    mb, gas, path, seed, steps = case["micro_batch"], case["ga"], case["path"], case["seed"], case.get("steps", judging.STEPS)
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
        for key, value in case.get("trainer_attrs", {}).items():  # what a framework sets on its Trainer (axolotl)
            setattr(trainer, key, value)

        def read():  # a collective under ZeRO: every rank's callbacks run it at the same point
            if zero is None:
                return judging.plain_read(trainer.model)
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
        judging.release(engine)
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
    steps, dev, per_step = case.get("steps", judging.STEPS), c.device(), mb * gas * w
    arch = case.get("arch", "qwen3")
    model = tiny_model(seed, arch).to(dev)
    rows = token_rows(seed, per_step * steps)
    reads, traces = [judging.plain_read(model)], []
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
        reads.append(judging.plain_read(model))
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


def run_rank(payload: dict) -> list[dict]:
    """Entry point of ``gradkit.launch``: every case of the payload, one after another, in this world."""
    return judging.run_cases(payload, lambda case: run_harness(case) if case["name"] == "harness" else run_case(case))
