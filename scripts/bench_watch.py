"""The watch's cost (issue 38), for scripts/bench.py --watch: a plain torch loop on a tiny Llama (transformers' own
class from a config: no download), AdamW, GA micro-batches of token rows per step, one process, timed step by step:

- no watch: the loop as it is;
- the watch on, judging nothing: the overhead of an unjudged step (two hooks that return at once);
- a judged step: its time, and what the watch holds at its peak (the reference copy's weights and gradient, the
  sketches, the recorded inputs) against one fp32 gradient of the model, and the process's resident memory before
  and after it (psutil; the allocator keeps freed memory, so the first judged step's growth is the one that counts).

- a judged step judging the last half of the layers (``layers=``): the reference's backward stops below them;
- the floor: the reference's own forward and backward alone (an fp32 copy, each micro-batch once, no watch), which
  any reference of the same step costs. A judged step can be no cheaper than none + floor; what it costs above that
  is the watch's own work (sketches, the tally, the copy).

The settings alternate step by step (a round each), so that the machine's drift falls on each alike; the medians over
the rounds are compared. Two micro-batch shapes (``SHAPES``): the judged step's sketches cost a pass over the
parameters per micro-batch whatever its size, its extra forward and backward grow with its tokens, so the judged
step's ratio falls towards 2x as micro-batches grow. Writes runs/bench_watch.json.
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def _model(hidden: int, layers: int, vocab: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                                        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                        max_position_embeddings=512))


SHAPES = ((4, 64), (8, 256))  # rows x tokens per micro-batch: a step's compute per parameter, small and larger


def watch_bench(json_path: str) -> int:
    """The watch's cost at each micro-batch shape of ``SHAPES`` (``runs/bench_watch.json``: one entry per shape)."""
    import os

    shapes = [one_shape(rows=rows, seq=seq) for rows, seq in SHAPES]
    res = {"cpus": os.cpu_count(), "shapes": shapes, "parameters_m": round(shapes[0]["parameters"] / 1e6, 1)}
    for name, r in zip(("small", "large"), shapes):  # the performance table's rows (scripts/bench_table.py)
        res[f"unjudged_over_none_{name}"] = r["unjudged_over_none"]
        res[f"judged_over_none_{name}"] = r["judged_over_none"]
        res[f"floor_over_none_{name}"] = r["floor_over_none"]
        res[f"half_over_none_{name}"] = r["half_over_none"]
        res[f"tokens_{name}"] = f"{r['rows']} x {r['seq']}"
    res["held_in_gradients"] = max(r["held_in_gradients"] for r in shapes)
    Path(json_path).parent.mkdir(parents=True, exist_ok=True)
    Path(json_path).write_text(json.dumps(res, indent=1))
    print(f"-> {json_path}")
    return 0


def one_shape(rounds: int = 10, ga: int = 4, rows: int = 4, seq: int = 64, size: tuple = (256, 4, 4096)) -> dict:
    """Rounds of three steps of one loop, interleaved so that the machine's drift falls on each alike: a step with
    no watch on the model, one with the watch on judging nothing, one judged (``request()``)."""
    import psutil
    import torch

    from gradkit.watch import Watch

    torch.manual_seed(0)
    model = _model(*size)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(1)
    proc = psutil.Process()
    from gradkit.watch import reference

    out = {"none": [], "unjudged": [], "judged": [], "half": [], "floor": []}
    names = [n for n, _ in model.named_parameters()]
    half = tuple(f"model.layers.{i}." for i in range(size[1] // 2, size[1])) + ("model.norm.", "lm_head.")
    growth, held, verdicts = [], None, set()

    def step():
        batches = [torch.randint(0, size[2], (rows, seq), generator=g) for _ in range(ga)]
        t0 = time.perf_counter()
        for ids in batches:
            (model(input_ids=ids, labels=ids).loss / ga).backward()
        opt.step()
        opt.zero_grad()
        return time.perf_counter() - t0

    def floor():  # the reference's own work: an fp32 copy, one forward and backward per micro-batch
        batches = [torch.randint(0, size[2], (rows, seq), generator=g) for _ in range(ga)]
        t0 = time.perf_counter()
        clone = reference.copy_of(model)
        for ids in batches:
            clone(input_ids=ids, labels=ids).loss.backward()
        return time.perf_counter() - t0

    step()  # warm-up
    for r in range(rounds):
        out["none"].append(step())
        watch = Watch(model, opt, first=0, every=0, poll=0, log=None, out=str(REPO / "runs" / "bench_watch_records"))
        out["unjudged"].append(step())
        watch.request()  # the next step is judged
        before = proc.memory_info().rss
        out["judged"].append(step())
        growth.append(proc.memory_info().rss - before)
        rec = [x for x in watch.records if "measured" in x][-1]
        held, verdicts = rec["held_bytes"], verdicts | {rec["verdict"]}
        watch.remove()
        watch = Watch(model, opt, first=0, every=0, poll=0, log=None, layers=half,
                      out=str(REPO / "runs" / "bench_watch_records"))
        watch.request()
        out["half"].append(step())
        verdicts |= {[x for x in watch.records if "measured" in x][-1]["verdict"]}
        watch.remove()
        out["floor"].append(floor())
    params = sum(p.numel() for p in model.parameters())
    med = {k: statistics.median(v) for k, v in out.items()}
    res = {"ga": ga, "rows": rows, "seq": seq, "hidden_layers_vocab": list(size), "parameters": params,
           "gradient_bytes": params * 4, "steps_s": out, "median_s": med,
           "unjudged_over_none": med["unjudged"] / med["none"], "judged_over_none": med["judged"] / med["none"],
           "floor_over_none": 1 + med["floor"] / med["none"], "half_over_none": med["half"] / med["none"],
           "half_layers": f"{sum(n.startswith(half) for n in names)} of {len(names)} tensors",
           "none_spread": (max(out["none"]) - min(out["none"])) / med["none"], "held_bytes": held,
           "held_in_gradients": held.get("peak", sum(held.values())) / (params * 4), "rss_growth_bytes": growth,
           "verdicts": sorted(verdicts)}
    print(f"tiny Llama {params / 1e6:.1f}M parameters, GA {ga} x {rows} rows x {seq} tokens, {rounds} rounds: a step "
          f"{med['none'] * 1e3:.0f} ms without the watch (spread {res['none_spread']:.2f}); unjudged "
          f"{res['unjudged_over_none']:.3f}x; judged {res['judged_over_none']:.2f}x (floor {res['floor_over_none']:.2f}x: "
          f"none + the reference's own forward and backward), the last half of the layers "
          f"{res['half_over_none']:.2f}x; the watch holds "
          f"{res['held_in_gradients']:.2f} fp32 gradients at a judged step's peak ({json.dumps(held)}); first judged "
          f"step's RSS growth {growth[0] / (params * 4):.2f} gradients; verdicts {res['verdicts']}")
    return res


if __name__ == "__main__":
    sys.exit(watch_bench(sys.argv[1] if len(sys.argv) > 1 else str(REPO / "runs" / "bench_watch.json")))
