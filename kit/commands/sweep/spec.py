"""A sweep's spec (YAML) and its points: the ``base`` config, the ``axes`` (dotted config keys, or ``loop``,
``dtype``, ``ga``, ``model``: a shape of ``gradkit.shapes``), the ``skip`` rules (partial points that make no sense),
the one-at-a-time keys, the ``world_size`` and the ``stacks``; each point as a case of ``gradkit.probes.ds_config`` with
an id that depends only on what the point means (a re-run reuses its record)."""
from __future__ import annotations

import copy
import hashlib
import itertools
import json

from gradkit import config as kconfig
from gradkit import shapes
from gradkit.probes import ds_config
from gradkit.stacks import patched, versions

SPECIAL_AXES = ("loop", "dtype", "ga", "model")


DTYPES = ("fp32", "bf16", "fp16")


def load_spec(path) -> dict:
    import yaml

    p = kconfig.repo_path(path)
    try:
        spec = yaml.safe_load(p.read_text())
    except OSError as e:
        raise kconfig.ConfigError(f"cannot read the sweep spec {p}: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        raise kconfig.ConfigError(f"the sweep spec {p} is not valid YAML: {str(e).splitlines()[0]}") from None
    return check_spec(spec, str(p))


def check_spec(spec, where: str = "the spec") -> dict:
    if not isinstance(spec, dict) or not isinstance(spec.get("axes"), dict) or not spec["axes"]:
        raise kconfig.ConfigError(f"{where} needs 'axes': a mapping of axis name -> list of values")
    unknown = sorted(set(spec) - {"base", "axes", "skip", "world_size", "stacks", "device", "timeout_s", "steps",
                                  "one_at_a_time"})
    if unknown:
        raise kconfig.ConfigError(f"{where}: unknown key(s) {unknown}")
    _check_one_at_a_time(spec, where)
    for axis, values in spec["axes"].items():
        if not isinstance(values, list) or not values:
            raise kconfig.ConfigError(f"{where}: axis {axis!r} must be a non-empty list, got {values!r}")
        if axis == "loop" and set(values) - set(ds_config.LOOPS):
            raise kconfig.ConfigError(f"{where}: loop values must be among {ds_config.LOOPS}, got {values}")
        if axis == "dtype" and set(values) - set(DTYPES):
            raise kconfig.ConfigError(f"{where}: dtype values must be among {DTYPES}, got {values}")
        if axis == "ga":
            for v in values:
                kconfig.check_ga(v)
        if axis == "model":
            for v in values:
                shapes.get(v)
    for rule in spec.get("skip") or []:
        if not isinstance(rule, dict) or set(rule) - set(all_axes(spec)):
            raise kconfig.ConfigError(f"{where}: a skip rule maps axes of the spec to a value, got {rule!r}")
    spec.setdefault("base", {})
    spec.setdefault("world_size", 2)
    spec.setdefault("stacks", [{}])
    spec.setdefault("device", "cpu")
    spec.setdefault("timeout_s", 1800)
    spec.setdefault("steps", ds_config.STEPS)
    kconfig.check_positive_int("steps", spec["steps"])
    kconfig.check_world_size(spec["world_size"], spec["device"])
    kconfig.check_timeout(spec["timeout_s"])
    if not isinstance(spec["stacks"], list) or not all(isinstance(s, dict) for s in spec["stacks"]):
        raise kconfig.ConfigError(f"{where}: stacks is a list of mappings like {{deepspeed: 0.18.8}}")
    for st in spec["stacks"]:
        for package, version in st.items():
            kconfig.check_version(version)
    for point in points(spec):  # every point resolves, or the spec is refused before anything launches
        try:
            point_case(spec, point)
        except kconfig.ConfigError as e:
            raise kconfig.ConfigError(f"{where}: the point {point} is not a config DeepSpeed accepts: {e}") from None
    return spec


def _matches(point: dict, rule: dict) -> bool:
    """A skip rule holds for a point when every axis it names has its value (a list: any of its values)."""
    return all(point.get(k) in v if isinstance(v, list) else point.get(k) == v for k, v in rule.items())


def _set(cfg: dict, dotted: str, value) -> None:
    keys = dotted.split(".")
    for k in keys[:-1]:
        cfg = cfg.setdefault(k, {})
    cfg[keys[-1]] = value


DEFAULT = "default"  # a one-at-a-time key's value where a point leaves it as the base config has it


def _check_one_at_a_time(spec: dict, where: str) -> None:
    extra = spec.get("one_at_a_time")
    if extra is None:
        return
    if not isinstance(extra, dict) or set(extra) != {"over", "keys"} or not isinstance(extra["over"], dict) \
            or not isinstance(extra["keys"], dict) or not extra["keys"]:
        raise kconfig.ConfigError(f"{where}: one_at_a_time is {{over: {{axis: [values]}}, keys: {{dotted key: "
                                  f"[values]}}}}, got {extra!r}")
    for axis, values in extra["over"].items():
        if axis not in spec["axes"] or not isinstance(values, list) or set(values) - set(spec["axes"][axis]):
            raise kconfig.ConfigError(f"{where}: one_at_a_time.over.{axis} must list values of the axis {axis}, "
                                      f"got {values!r}")
    for key, values in extra["keys"].items():
        if key in spec["axes"] or key in SPECIAL_AXES or not isinstance(values, list) or not values \
                or DEFAULT in values:
            raise kconfig.ConfigError(f"{where}: one_at_a_time.keys.{key} must be a config key that is not an axis, "
                                      f"with a non-empty list of values, got {values!r}")


def all_axes(spec: dict) -> dict:
    """The axes every point has a value for: the spec's, then each one-at-a-time key (``DEFAULT`` first)."""
    extra = (spec.get("one_at_a_time") or {}).get("keys") or {}
    return {**spec["axes"], **{k: [DEFAULT, *v] for k, v in extra.items()}}


def points(spec: dict) -> list[dict]:
    """Every point that no skip rule removes: ``{axis: value}`` over ``all_axes``. The product of the axes, then
    (``one_at_a_time``) each extra key set to each of its values on its own, over the product of ``over`` (an
    axis ``over`` does not name keeps its first value), every other extra key left at ``DEFAULT``."""
    axes, extra = spec["axes"], spec.get("one_at_a_time") or {}
    keys = extra.get("keys") or {}
    rest = {k: DEFAULT for k in keys}
    candidates = [{**dict(zip(axes, values)), **rest} for values in itertools.product(*axes.values())]
    if keys:
        over = {a: extra["over"].get(a, [v[0]]) for a, v in axes.items()}
        for key, values in keys.items():
            for value in values:
                candidates += [{**dict(zip(over, vs)), **rest, key: value} for vs in itertools.product(*over.values())]
    return [p for p in candidates if not any(_matches(p, rule) for rule in spec.get("skip") or [])]


def is_main(spec: dict, point: dict) -> bool:
    """A point of the axes' product (every one-at-a-time key at ``DEFAULT``): what the heatmaps draw."""
    return all(point.get(k, DEFAULT) == DEFAULT for k in (spec.get("one_at_a_time") or {}).get("keys") or {})


def user_config(spec: dict, point: dict) -> dict:
    """The DeepSpeed config of one point as a user would write it (before the loop style sets anything): what
    ``gradkit check`` or ``gradkit bisect`` takes, with the point's ``loop``."""
    cfg = copy.deepcopy(spec["base"])
    for axis, value in point.items():
        if axis not in SPECIAL_AXES and value != DEFAULT:
            _set(cfg, axis, value)
    cfg["gradient_accumulation_steps"] = point.get("ga", cfg.get("gradient_accumulation_steps", 4))
    dtype = point.get("dtype")
    if dtype in ("bf16", "fp16"):
        cfg[dtype] = {**cfg.get(dtype, {}), "enabled": True}
    return cfg


def point_case(spec: dict, point: dict) -> dict:
    """The ds_config case of one point (its config resolved the way ``gradkit check`` resolves one)."""
    cfg = user_config(spec, point)
    ga = cfg["gradient_accumulation_steps"]
    resolved = ds_config.resolve(cfg, spec["world_size"], ga=ga)
    loop = point.get("loop", "engine")
    model = point.get("model")
    (case,) = [c for c in ds_config.plan(resolved, (loop,), steps=spec.get("steps", ds_config.STEPS),
                                         model=None if model == DEFAULT else model)[0] if c["role"] == "measured"]
    case["point"] = point
    case["id"] = point_id(spec, point)
    case["name"] = case["id"]
    return case


def point_id(spec: dict, point: dict) -> str:
    key = json.dumps({"base": spec["base"], "world_size": spec["world_size"], "point": point,
                      "steps": spec.get("steps", ds_config.STEPS)}, sort_keys=True)
    return hashlib.sha1(key.encode()).hexdigest()[:12]


def spec_key(spec: dict) -> str:
    """What a point's verdict depends on besides its point and release: a re-run with another spec never reuses it."""
    key = json.dumps({k: v for k, v in spec.items() if k not in ("stacks", "timeout_s")}, sort_keys=True, default=str)
    return hashlib.sha1(key.encode()).hexdigest()[:12]


def release_of(stack: dict) -> str:
    """The DeepSpeed release a stack resolves to (never "installed": an upgrade changes it); a release with one of the
    kit's patches names the patch as it is now (an edited patch runs everything again)."""
    version = stack.get("deepspeed") or versions.installed_version("deepspeed")
    patch = patched.split(version)[1]
    return f"{version} ({patch}.diff {patched.digest('deepspeed', patch)[:12]})" if patch else version
