"""One rank of scripts/bench_watch_scale.py: a Llama of a chosen size (transformers' own class from a config, no
download) trained under ZeRO-3, ZeRO-2 or FSDP2 with the watch on it, judging chosen steps; every step timed, and
malloc's bytes in use (glibc's ``mallinfo2``: small blocks in use plus mmapped ones) sampled every 2 ms on a thread
of its own: before the step, its peak, after it, and within the innermost optimizer's step (from a step pre-hook put
on before the watch's: the watch's reference, read and judgement happen there, beside the optimizer's own work).
Writes ``<out>/rank<R>.json``."""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

import gradkit.watch
import gradkit.watch.reads

SIZES = {"25m": (512, 4, 1376, 8192), "130m": (1024, 8, 2816, 16384), "400m": (1536, 12, 4096, 32000)}


class _Info(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                      "fsmblks", "uordblks", "fordblks", "keepcost")]


class Malloc:
    """Bytes malloc holds in use now, and their peak since ``reset``, sampled on a thread of its own."""

    def __init__(self, every_s: float = 0.002):
        self.libc = ctypes.CDLL("libc.so.6")
        self.libc.mallinfo2.restype = _Info
        self.peak, self.every_s, self.stop, self.lock = 0, every_s, False, threading.Lock()
        threading.Thread(target=self._sample, daemon=True).start()

    def now(self) -> int:
        info = self.libc.mallinfo2()
        return int(info.uordblks + info.hblkhd)

    def _sample(self):
        while not self.stop:
            with self.lock:  # never a peak from before a reset written back after it
                self.peak = max(self.peak, self.now())
            time.sleep(self.every_s)

    def reset(self) -> tuple[int, int]:
        """The bytes in use now, and the peak until now; the peak starts again from now."""
        with self.lock:
            before, self.peak = self.peak, self.now()
            return self.peak, before


def model_of(size: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, layers, inter, vocab = SIZES[size]
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                                        num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=8,
                                        max_position_embeddings=256, tie_word_embeddings=False))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--engine", choices=("zero3", "zero2", "fsdp2"), required=True)
    p.add_argument("--size", choices=tuple(SIZES), required=True)
    p.add_argument("--shard", choices=("auto", "off"), default="auto")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--judged", default="3,5")
    p.add_argument("--ga", type=int, default=2)
    p.add_argument("--rows", type=int, default=1)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--optim", choices=("adamw", "sgd"), default="adamw")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    judged = {int(x) for x in a.judged.split(",")}
    options = dict(first=0, every=0, steps=judged, out=str(Path(a.out) / "watch"), log=None,
                   shard=False if a.shard == "off" else None)
    optimizer = (lambda ps: torch.optim.SGD(ps, lr=1e-5)) if a.optim == "sgd" else \
        (lambda ps: torch.optim.AdamW(ps, lr=1e-5))
    model = None if a.engine == "zero3" else model_of(a.size)  # ZeRO-3's is built partitioned, below
    malloc = Malloc()
    window = {}

    def bracket(inner):  # before the watch's own hooks: the innermost optimizer's step, the watch's work inside it
        def pre(*_):
            if "base" not in window:
                window["base"], window["peak_before"] = malloc.reset()
        inner.register_step_pre_hook(pre)
    if a.engine == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        dist.init_process_group("gloo")
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        opt = optimizer(model.parameters())
        bracket(opt)
        watch = gradkit.watch.Watch(model, opt, **options)

        def step(batches):
            for ids in batches:
                (model(input_ids=ids, labels=ids).loss / a.ga).backward()
            opt.step()
            opt.zero_grad()
    else:
        import deepspeed

        config = {"train_micro_batch_size_per_gpu": a.rows, "gradient_accumulation_steps": a.ga,
                  "zero_optimization": {"stage": 3 if a.engine == "zero3" else 2}, "steps_per_print": 10 ** 9,
                  "zero_allow_untested_optimizer": True}  # SGD
        if a.engine == "zero3":  # gathered parameters kept live: DeepSpeed's defaults (1e9) hold a 440M model whole
            config["zero_optimization"].update(stage3_max_live_parameters=3e7, stage3_max_reuse_distance=3e7,
                                               stage3_prefetch_bucket_size=3e7, reduce_bucket_size=3e7)
            deepspeed.init_distributed()
            import transformers.models.llama.modeling_llama  # noqa: F401 - imported before zero.Init patches torch
            with deepspeed.zero.Init(config_dict_or_path=config):  # partitioned as it is built (as the Trainer does)
                model = model_of(a.size)
        else:  # ZeRO-2's buckets: its defaults (5e8 elements) allocate 2 GB on a CPU rank at every step
            config["zero_optimization"].update(reduce_bucket_size=3e7, allgather_bucket_size=3e7)
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer(model.parameters()), config=config)
        bracket(gradkit.watch.reads.innermost(engine.optimizer))
        engine = gradkit.watch.watch_engine(engine, **options)
        watch = engine.gradkit_watch

        def step(batches):
            for ids in batches:
                engine.backward(engine(input_ids=ids, labels=ids).loss)
                engine.step()
    rank, w = dist.get_rank(), dist.get_world_size()
    params = sum(getattr(q, "ds_numel", q.numel()) for q in model.parameters())
    data = torch.Generator().manual_seed(rank)
    rows = []
    for s in range(1, a.steps + 1):
        batches = [torch.randint(0, SIZES[a.size][3], (a.rows, a.seq), generator=data) for _ in range(a.ga)]
        dist.barrier()
        before, _ = malloc.reset()
        window.clear()
        t0 = time.perf_counter()
        step(batches)
        took = time.perf_counter() - t0
        time.sleep(0.01)
        print(f"rank {rank}: step {s} ({'judged' if s in judged else 'unjudged'}) {took:.1f} s, in use "
              f"{malloc.now() / 2 ** 30:.2f} GiB, peak {malloc.peak / 2 ** 30:.2f} GiB", flush=True)
        rows.append({"step": s, "judged": s in judged, "s": took, "before": before,
                     "peak": max(malloc.peak, window.get("peak_before", 0)), "after": malloc.now(),
                     "window_base": window.get("base", 0), "window_peak": malloc.peak})
    malloc.stop = True
    recs = [r for r in watch.records if "measured" in r or r.get("verdict") == "cannot-run"]
    unjudged = [r for r in rows if not r["judged"] and r["step"] > 1]
    judged_rows = [r for r in rows if r["judged"]]
    out = {"rank": rank, "world_size": w, "engine": a.engine, "size": a.size, "parameters": params,
           "fp32_model_bytes": params * 4, "shard": a.shard, "steps": rows,
           "verdicts": [r["verdict"] for r in recs], "reference": [r.get("reference") for r in recs],
           "whys": [r.get("why") for r in recs if r["verdict"] == "cannot-run"],
           "held_bytes": [r.get("held_bytes") for r in recs],
           "seconds": [r.get("seconds") for r in recs],
           "unjudged_s": statistics.median(r["s"] for r in unjudged),
           "judged_s": statistics.median(r["s"] for r in judged_rows),
           "peak_above_unjudged": max(r["peak"] for r in judged_rows) - statistics.median(r["peak"] for r in unjudged),
           "window_above_unjudged": max(r["window_peak"] - r["window_base"] for r in judged_rows)
           - statistics.median(r["window_peak"] - r["window_base"] for r in unjudged),
           "stays": max(r["after"] - r["before"] for r in judged_rows)
           - statistics.median(r["after"] - r["before"] for r in unjudged)}
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / f"rank{rank}.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
