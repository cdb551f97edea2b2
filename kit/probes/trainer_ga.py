"""B1 (work in progress): HF Trainer + DeepSpeed with a ``model_accepts_loss_kwargs=True`` model.

The seed (``000``) compares the Trainer's logged grad norm with and without DeepSpeed and concludes
that DeepSpeed sums micro-batch gradients. A ratio between two paths does not say which one is
wrong, so this probe judges every path against the reference: one real ``transformers.Trainer``
step (SGD, lr=1, constant schedule, no clipping, no weight decay) on a tiny ``Qwen3ForCausalLM``
built from a config (no download), on a synthetic token dataset whose samples have different
numbers of label tokens, compared with the plain fp32 gradient of the global batch's loss: the
mean over all its label tokens, which is what the Trainer means to apply.

Paths: ``no_ds`` (the Trainer alone) and ``ds_zero0`` / ``ds_zero2`` / ``ds_zero3``.
"""
from __future__ import annotations

import copy

BUG = "B1"
PROBE = "trainer_ga"
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
        trainer = Trainer(model=model, args=args, train_dataset=rows)
        if case.get("accepts_loss_kwargs") is False:
            trainer.model_accepts_loss_kwargs = False  # the seed's workaround
        trace = _observe(trainer)
        trainer.train()
        engine = trainer.model_wrapped if zero is not None else None
        after = c.full_fp32_params(engine.module, engine.optimizer) if engine is not None else \
            torch.cat([p.detach().reshape(-1).double() for p in trainer.model.parameters()])
        logged = [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]
    before = torch.cat([p.detach().reshape(-1).double() for p in start.parameters()])
    reference, tokens, ref_loss = reference_gradient(start, rows)
    out = {"metrics": oracle.compare(before - after, reference), "label_tokens": tokens, "reference_loss": ref_loss,
           "logged_grad_norm": logged[0] if logged else None, "trace": trace,
           "model_accepts_loss_kwargs": bool(trainer.model_accepts_loss_kwargs)}
    if engine is not None:
        c.release(engine)
    return out


def _observe(trainer) -> list[dict]:
    """Wrap the real calls (not re-implement them): what compute_loss got, what accelerator.backward got."""
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
        trace.append({"call": "accelerator.backward", "loss": float(loss.detach()),
                      "kwargs": {k: v for k, v in kw.items() if isinstance(v, (bool, int, float, str))}})
        return backward(loss, **kw)

    trainer.compute_loss, trainer.accelerator.backward = seen_compute_loss, seen_backward
    return trace


def run_rank(payload: dict) -> list[dict]:
    """Entry point of ``kit.launch``: every case of the payload, one after another, in this world."""
    from kit.probes import common as c

    return c.run_cases(payload, run_case)
