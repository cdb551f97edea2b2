"""A standalone reproduction of one swept configuration: plain DeepSpeed + torch, no kit import, ready to file.

    path = repro.write(record, folder / "repro_<group>.py", title)   # the record of one affected point
    rc, output = repro.verify(path, world_size=2, stack={})             # rc 1: it reproduces

The script builds the point's model (its shape's own source, ``gradkit.shapes.shape.Shape.source``) and its own data,
runs the point's loop style with the point's config (SGD,
lr = 1, so the update is the gradient) for as many optimizer steps as the point took, reads each step as the
probe does (the fp32 masters, or the module's own weights where the masters' read disagrees with them), computes
on rank 0 the fp32 reference of the same global batch from that step's starting weights, fits each micro-batch's
weight, prints one JSON line (per step: ratio, cosine, relative error, fitted weights as multiples of the right
ones) and exits 1 when a step is off. ``reproduced`` believes only that printed judgement, and with the group's
shape, only an off step of the same shape.
"""
from __future__ import annotations

import json
from pathlib import Path

from gradkit import shapes
from gradkit.launch import scripts
from gradkit.judge import tolerances
from gradkit.probes.ranks import ds_config

TEMPLATE = '''"""{title}

Written by gradkit's sweep on {date}; needs only torch and deepspeed ({deepspeed} here){needs}.
    DS_ACCELERATOR=cpu torchrun --standalone --nproc_per_node={world_size} {name}    # on GPUs: drop DS_ACCELERATOR
Takes STEPS optimizer steps on the model below ({model}); each is judged against the fp32 reference of the same
global batch from that step's own starting weights. Exit status 1: a step DeepSpeed applied is off that reference.
"""
import copy, json, os, sys
import torch, torch.distributed as dist, deepspeed
from deepspeed.utils import safe_get_full_fp32_param

CONFIG = json.loads({config!r})
LOOP, N, MB, H, DEPTH, SEED, STEPS = {loop!r}, {n}, {mb}, {hidden}, {depth}, 0, {steps}  # loop, micro-batches, steps
TOL, MISPLACED, ROUND = {tol}, {mis}, {rounding}  # the dtype's limits; the module dtype's rounding
ROUTED = {routed}  # the model reads one 0/1 column per route after the H features: which of its parts a micro-batch uses

# ---- the model ({model}): the code gradkit ran
{model_source}
# ----

def batches(rank, step):  # N micro-batches of MB samples for one rank and step, the same on every run
    g = torch.Generator().manual_seed(1000 * (step + 1) + rank)
    x, y = torch.randn(N * MB, H, generator=g), torch.randn(N * MB, H, generator=g)
    out = [(x[i * MB:(i + 1) * MB], y[i * MB:(i + 1) * MB]) for i in range(N)]
    if ROUTED:
        out = [(torch.cat([a, torch.tensor([routes(i, N, step)] * MB)], dim=1), b) for i, (a, b) in enumerate(out)]
    return out

def weights(engine):  # (what the model computes with, the fp32 masters), flat float64; collectives under ZeRO
    module, masters = [], []
    for p in engine.module.parameters():
        if hasattr(p, "ds_id"):  # ZeRO-3: every rank's partition, gathered with plain torch.distributed
            parts = [torch.empty_like(p.ds_tensor.reshape(-1)) for _ in range(dist.get_world_size())]
            dist.all_gather(parts, p.ds_tensor.detach().reshape(-1).contiguous())
            module.append(torch.cat(parts)[:p.ds_numel].double().cpu())
        else:
            module.append(p.detach().double().reshape(-1).cpu().clone())
        full = safe_get_full_fp32_param(p)  # None where a parameter has no master (frozen)
        masters.append(module[-1] if full is None else full.detach().double().reshape(-1).cpu().clone())
    return torch.cat(module), torch.cat(masters)

cpu = os.environ.get("DS_ACCELERATOR") == "cpu"
deepspeed.init_distributed(dist_backend="gloo" if cpu else "nccl")
rank, world = dist.get_rank(), dist.get_world_size()
model = build(SEED, H, DEPTH)
dtype = torch.bfloat16 if CONFIG.get("bf16", {{}}).get("enabled") else torch.float32
model, fp32 = model.to(dtype), copy.deepcopy(model).double()
trainable = [p for p in model.parameters() if p.requires_grad]
engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(trainable, lr=1.0), config=CONFIG)
mse = lambda out, y: ((out.float() - y.float()) ** 2).mean()
off_any, said, prev = False, [], None
for step in range(STEPS):
    module, masters = weights(engine)
    for i, (x, y) in enumerate(batches(rank, step)):
        x, y = x.to(engine.device, dtype), y.to(engine.device)
        if LOOP == "engine":  # DeepSpeed's own loop: config GA = N, backward + step per micro-batch
            engine.backward(mse(engine(x), y)); engine.step(); continue
        if LOOP == "boundary":  # config GA = N, the boundary marked, one step
            engine.set_gradient_accumulation_boundary(is_boundary=(i == N - 1))
            engine.backward(mse(engine(x), y))
        else:  # manual: config GA = 1, N backward(loss / N), one step
            engine.backward(mse(engine(x), y) / N)
    if LOOP != "engine":
        engine.step()
    module2, masters2 = weights(engine)
    agree = all(((a - b).abs() <= ROUND * b.abs() + 1e-30).all() for a, b in ((module, masters), (module2, masters2)))
    effective = (masters - masters2) if agree else (module - module2)  # the masters' read, unless it misreports
    if rank == 0:  # the reference: this step's starting weights, fp32, the global batch in one process
        torch.nn.utils.vector_to_parameters(module.clone(), fp32.parameters())
        basis = []
        for x, y in [b for r in range(world) for b in batches(r, step)]:
            fp32.zero_grad(); mse(fp32(x.double()), y.double()).backward()
            basis.append(torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                                    for p in fp32.parameters()]))  # 0 where a part is frozen or not used
        basis = torch.stack(basis); k = len(basis)
        reference = basis.mean(0)
        full = basis if prev is None else torch.cat([basis, prev])  # the previous step's micro-batches too
        fitted = torch.linalg.lstsq(full.T, effective.unsqueeze(1)).solution.squeeze(1)
        residual = ((effective - fitted @ full).norm() / effective.norm()).item()
        rel = ((effective - reference).norm() / reference.norm()).item()
        misplaced = 0.5 * ((fitted[:k] - 1.0 / k).abs().sum() + fitted[k:].abs().sum()).item()
        prev = basis
        off = rel > TOL or misplaced > MISPLACED
        off_any |= off
        said.append({{"step": step + 1, "ratio": effective.norm().item() / reference.norm().item(), "rel_error": rel,
                      "cosine": torch.nn.functional.cosine_similarity(effective, reference, dim=0).item(),
                      "weights_x_right": [round(w * k, 2) for w in fitted[:k].tolist()], "residual": residual,
                      "masters_read": agree, "off": off}})
verdict = torch.tensor([1.0 if off_any else 0.0])
dist.broadcast(verdict, 0)  # every rank exits with rank 0's judgement
if rank == 0:
    print(json.dumps({{"deepspeed": deepspeed.__version__, "loop": LOOP, "N": N, "world": world, "model": {model!r},
                      "steps": said, "reproduced": off_any}}), flush=True)
    print("REPRODUCED: a step DeepSpeed applied is off the reference" if off_any else "not reproduced: every step matches",
          flush=True)
dist.barrier()  # no rank leaves while another still works: the process group is taken down in order, by all
dist.destroy_process_group()
sys.exit(1 if verdict.item() else 0)
'''


def write(rec: dict, path, title: str) -> Path:
    """The reproduction script of one affected record (its resolved DeepSpeed config and loop style)."""
    import datetime

    case = rec["config"]
    cfg = dict(case["ds_config"])
    shape = shapes.of_case(case)
    path = Path(path)
    path.write_text(TEMPLATE.format(
        title=title, date=datetime.date.today().isoformat(), deepspeed=(rec.get("versions") or {}).get("deepspeed"),
        needs=" and peft" if "peft" in shape.source() else "", model=shape.name, model_source=shape.source(),
        routed=bool(shape.route_names), hidden=ds_config.HIDDEN, depth=ds_config.DEPTH,
        world_size=rec["world_size"], name=path.name, config=json.dumps(cfg, sort_keys=True),
        loop=case["loop"], n=case["ga"], mb=cfg["train_micro_batch_size_per_gpu"], steps=case.get("steps", 1),
        tol=tolerances.tolerance(case.get("judge_dtype", case["dtype"])).rel_l2,
        mis=tolerances.tolerance(case.get("judge_dtype", case["dtype"])).misplaced_weight,
        rounding=tolerances.ROUNDING[case["dtype"]]))
    return path


def said(output: str) -> dict | None:
    """The script's one judged line (None: it printed none, e.g. it crashed)."""
    lines = [json.loads(line) for line in output.splitlines() if line.startswith('{"deepspeed"')]
    return lines[0] if len(lines) == 1 else None


STRUCTURAL = 0.05  # a fit whose residual is below this explains the step: its weights are its shape


def shape_of(rec: dict) -> dict:
    """The record's worst step: each micro-batch's fitted weight as a multiple of its right weight (rank-major, to a
    tenth), and the fit's residual. A step the micro-batch gradients of this and the previous step explain
    (residual < ``STRUCTURAL``) has a shape any data shows again; one they do not (older state carried along,
    noise) has weights that depend on the data, and only that kind is comparable."""
    a = rec["attribution"]
    k = rec["world_size"] * rec["ga"]
    return {"weights": [(round(w / e, 1) if e else round(w * k, 1)) + 0.0  # + 0.0: no -0.0
                        for w, e in zip(a["weights"][:k], a["expected_weights"][:k])],
            "residual": a.get("residual", 0.0)}


def reproduced(rc: int, output: str, shape: dict | None = None, tol: float = 0.15) -> bool:
    """Did the script reproduce? Only by its own judgement: its printed verdict line says so (and its exit status
    agrees). A script that crashed, or printed nothing judged, did not reproduce anything, whatever its exit code.
    With ``shape`` (``shape_of`` the group's point), one of its off steps must also have that shape: for a
    structural step, each micro-batch's fitted weight within ``tol`` of the same multiple of its right weight; for
    a step no mixture of this and the previous step's micro-batches explains, an off step of that kind too."""
    s = said(output)
    if not (s and s.get("reproduced") is True and rc == 1):
        return False
    if shape is None:
        return True
    want, structural = shape["weights"], shape["residual"] < STRUCTURAL
    for st in s.get("steps") or []:
        if not st.get("off") or len(st["weights_x_right"]) != len(want):
            continue
        if not structural and st.get("residual", 0.0) >= STRUCTURAL:
            return True
        if structural and st.get("residual", 0.0) < STRUCTURAL and \
                all(abs(a - b) <= tol for a, b in zip(st["weights_x_right"], want)):
            return True
    return False


def verify(path, world_size: int = 2, stack: dict | None = None, device: str = "cpu", timeout_s: float = 300,
           env: dict | None = None):
    """Run the script as a user would (torchrun, W ranks, ``env`` added); ``(exit status, output)``. 1 means
    reproduced."""
    rc, stdout, stderr = scripts.torchrun(path, world_size=world_size, stack=stack, device=device, timeout_s=timeout_s,
                                          env=env)
    if rc == 124:
        return 124, f"timed out after {timeout_s:g} s: {stdout[-2000:]!r}"
    text = "\n".join(line for line in (stdout + stderr).splitlines()
                     if "REPRODUCED" in line or "reproduced" in line or line.startswith("{\"deepspeed\""))
    return rc, text or unjudged(stdout + stderr)


TRACEBACK = "Traceback (most recent call last)"


def unjudged(output: str, keep: int = 2000) -> str:
    """What to show of a run that printed no judgement: its last ``keep`` characters, and before them the first
    rank's traceback (its first ``keep`` characters) where that falls outside them. torchrun's own error summary
    follows a rank's crash and alone fills the tail, so the tail alone never says why the rank died."""
    first = output.find(TRACEBACK)
    if first < 0 or first >= len(output) - keep:
        return output[-keep:]
    if first + keep >= len(output) - keep:  # the traceback runs into the tail: one piece, nothing left out
        return output[first:]
    return output[first:first + keep] + "\n[...]\n" + output[-keep:]
