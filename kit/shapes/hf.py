"""The user's own architecture at toy size: ``gradkit check ds_config.json --model config.json [--adapter
adapter_config.json]``.

``user_model`` (in the caller) reads a Hugging Face model config (a ``config.json``, a folder holding one, or a
model id whose config is already in the local Hugging Face cache: nothing is downloaded), shrinks its sizes so a
step takes seconds on CPU, and says every change line by line; the layer types, tying, number of experts and
routing stay. ``shape`` (in every rank) builds it with the installed transformers' own modelling code
(``AutoModelForCausalLM.from_config``), so what is measured is the user's code path (e.g. experts as one fused
tensor per layer in transformers 5, as separate modules before), with LoRA adapters from a PEFT config where one
is given. The data are random token ids, every position a label; the loss is the mean next-token cross-entropy.
"""
from __future__ import annotations

import json
from pathlib import Path

from gradkit import config as kconfig
from gradkit.shapes.shape import Shape

SEQ = 8  # tokens per sample
# (config key, toy value): the sizes that make a step take seconds; a key the config lacks is left alone
SIZES = (("hidden_size", 32), ("intermediate_size", 64), ("moe_intermediate_size", 32),
         ("shared_expert_intermediate_size", 32), ("num_hidden_layers", 2), ("num_attention_heads", 4),
         ("head_dim", 8), ("vocab_size", 128), ("max_position_embeddings", 64), ("num_experts", 4),
         ("num_local_experts", 4), ("n_routed_experts", 4), ("num_experts_per_tok", 2), ("sliding_window", 16),
         ("kv_lora_rank", 16), ("q_lora_rank", 16), ("qk_rope_head_dim", 8), ("qk_nope_head_dim", 8),
         ("v_head_dim", 8), ("first_k_dense_replace", 1))
DROPPED = {"quantization_config": "nothing is quantised", "torch_dtype": "the check's precision decides",
           "dtype": "the check's precision decides", "auto_map": "no remote code is run",
           "_name_or_path": "no weights are loaded"}
TOKEN_IDS = ("pad_token_id", "bos_token_id", "eos_token_id")


def load_config(where: str) -> dict:
    """The config's dict from a file, a folder holding config.json, or a model id in the local HF cache."""
    p = Path(where).expanduser()
    if p.is_dir():
        p = p / "config.json"
    if p.is_file():
        try:
            return json.loads(p.read_text())
        except ValueError as e:
            raise kconfig.ConfigError(f"--model {where}: {p} is not valid JSON: {e}") from None
    if p.suffix == ".json" or "/" not in where and not where.strip():
        raise kconfig.ConfigError(f"--model {where}: no such file")
    try:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(where, local_files_only=True).to_dict()
    except Exception as e:  # noqa: BLE001 - not a file, not in the cache: one sentence, nothing downloaded
        raise kconfig.ConfigError(f"--model {where}: not a config file and not a model whose config is in the local "
                                  f"Hugging Face cache (the kit never downloads): {str(e).splitlines()[0][:200]}") from None


def shrink(cfg: dict) -> tuple[dict, list[str]]:
    """The toy-size config and one line per change ("num_hidden_layers 28 -> 2")."""
    out, notes = {k: v for k, v in cfg.items() if k not in DROPPED}, []
    for key, why in DROPPED.items():
        if key in cfg:
            notes.append(f"{key}: dropped ({why})")
    for key, toy in SIZES:
        v = cfg.get(key)
        if isinstance(v, int) and not isinstance(v, bool) and v > toy:
            out[key] = toy
            notes.append(f"{key} {v} -> {toy}")
    heads = out.get("num_attention_heads")
    kv = cfg.get("num_key_value_heads")
    if isinstance(kv, int) and isinstance(heads, int):
        new = heads if kv >= cfg.get("num_attention_heads", kv) else max(1, min(kv, heads // 2))
        if new != kv:
            out["num_key_value_heads"] = new
            notes.append(f"num_key_value_heads {kv} -> {new} ({'grouped-query attention kept' if new < heads else 'as many as the heads'})")
    if isinstance(out.get("hidden_size"), int) and isinstance(heads, int) and "head_dim" in cfg \
            and out["head_dim"] != out["hidden_size"] // heads:
        out["head_dim"] = out["hidden_size"] // heads
        notes.append(f"head_dim -> {out['head_dim']} (hidden_size / num_attention_heads)")
    k = out.get("num_experts_per_tok")
    experts = next((out[x] for x in ("num_experts", "num_local_experts", "n_routed_experts") if x in out), None)
    if isinstance(k, int) and isinstance(experts, int) and k > experts:
        out["num_experts_per_tok"] = experts
        notes.append(f"num_experts_per_tok {k} -> {experts}")
    layers = out.get("num_hidden_layers")
    for key in ("layer_types", "mlp_only_layers"):
        v = cfg.get(key)
        if isinstance(v, list) and isinstance(layers, int):
            cut = v[:layers] if key == "layer_types" else [i for i in v if i < layers]
            if cut != v:
                out[key] = cut
                notes.append(f"{key}: kept {cut} (the first {layers} layers)")
    vocab = out.get("vocab_size")
    for key in TOKEN_IDS:
        v = cfg.get(key)
        if isinstance(vocab, int) and isinstance(v, int) and v >= vocab:
            out[key] = TOKEN_IDS.index(key)
            notes.append(f"{key} {v} -> {out[key]} (inside the shrunk vocabulary)")
        elif isinstance(v, list):
            out[key] = [x for x in v if x < vocab] or None
    if out.get("tie_word_embeddings"):
        notes.append("tie_word_embeddings: kept (the input embedding and the output head are one weight)")
    return out, notes


def load_adapter(where: str) -> tuple[dict, list[str]]:
    """A PEFT adapter config (``adapter_config.json`` or its folder) for LoRA, and what the kit changes in it."""
    p = Path(where).expanduser()
    if p.is_dir():
        p = p / "adapter_config.json"
    try:
        cfg = json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise kconfig.ConfigError(f"--adapter {where}: cannot read a PEFT adapter config: {e}") from None
    if str(cfg.get("peft_type", "LORA")).upper() != "LORA":
        raise kconfig.ConfigError(f"--adapter {where}: peft_type {cfg.get('peft_type')!r}; the kit builds LoRA adapters")
    notes = []
    for key, toy in (("r", 4), ("lora_alpha", 4)):
        if isinstance(cfg.get(key), (int, float)) and cfg[key] > toy:
            notes.append(f"adapter {key} {cfg[key]} -> {toy}")
            cfg[key] = toy
    for key, want, why in (("lora_dropout", 0.0, "dropout would make the step random"),
                           ("init_lora_weights", False, "random B, so both adapter matrices get a gradient at step 1")):
        if cfg.get(key, None) != want:
            notes.append(f"adapter {key} {cfg.get(key)!r} -> {want!r} ({why})")
            cfg[key] = want
    return cfg, notes


def user_model(where: str, adapter: str | None = None) -> tuple[dict, list[str]]:
    """What a check case carries to build the user's architecture at toy size (``model_config``, ``adapter_config``,
    ``model``: its name), and every change in words. Builds it once here, so an architecture the installed
    transformers does not know is refused before anything launches."""
    cfg, notes = shrink(load_config(where))
    if "model_type" not in cfg:
        raise kconfig.ConfigError(f"--model {where}: the config has no model_type, so transformers cannot build it")
    return _built(cfg, f"{cfg['model_type']} (from {Path(where).name})", notes, where, adapter)


# a Llama at toy size: a model DeepSpeed's AutoTP has a tensor-parallel policy for (the kit's MLP has none)
TINY_LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64,
              "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
              "vocab_size": 128, "max_position_embeddings": 64, "tie_word_embeddings": False}


def tiny_llama() -> tuple[dict, list[str]]:
    """``user_model``'s keys and lines for ``TINY_LLAMA``, built by the installed transformers."""
    return _built(dict(TINY_LLAMA), "llama (tiny, the kit's)", [], "a tiny Llama", None)


def _built(cfg: dict, name: str, notes: list, where: str, adapter: str | None) -> tuple[dict, list[str]]:
    keys = {"model": name, "model_config": cfg}
    if adapter:
        keys["adapter_config"], more = load_adapter(adapter)
        notes += more
    try:
        shape(cfg, keys.get("adapter_config")).build(0, 0, 0)
    except Exception as e:  # noqa: BLE001 - said in one sentence before any launch
        import transformers

        raise kconfig.ConfigError(f"--model {where}: transformers {transformers.__version__} cannot build this "
                                  f"architecture at toy size: {type(e).__name__}: {str(e).splitlines()[0][:200]}") from None
    return keys, [f"model: {n}" for n in notes]


def shape(model_config: dict, adapter_config: dict | None = None) -> Shape:
    """The user's architecture as a shape: its own modelling code, token data, next-token cross-entropy."""
    def build(seed: int, hidden: int, depth: int):
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        cfg = dict(model_config)
        c = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(c, attn_implementation="eager").float()
        model.config.use_cache = False
        if adapter_config:
            import peft

            torch.manual_seed(seed + 1)
            known = set(peft.LoraConfig.__dataclass_fields__)
            model = peft.get_peft_model(model, peft.LoraConfig(**{k: v for k, v in adapter_config.items()
                                                                  if k in known and k not in ("peft_type",)}))
        return model

    def batches(seed: int, rank: int, ga: int, micro_batch: int, hidden: int, step: int):
        import torch

        g = torch.Generator().manual_seed(seed * 100_003 + 7919 * rank + 104_729 * step + 1)
        ids = torch.randint(0, model_config.get("vocab_size", 128), (ga * micro_batch, SEQ), generator=g)
        return [(ids[i * micro_batch:(i + 1) * micro_batch], ids[i * micro_batch:(i + 1) * micro_batch])
                for i in range(ga)]

    def loss(out, labels):
        import torch.nn.functional as F

        logits = (out.logits if hasattr(out, "logits") else out[0])[:, :-1].float()
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1).long())

    return Shape(name=f"{model_config.get('model_type')} (toy size)", title="the user's architecture at toy size",
                 build=build, groups=groups, batches=batches, loss=loss, unused_parameters=True, order=1000)


def groups(module) -> dict:
    """Parameter groups by role: adapters, embedding, head, attention, router, each expert (or the fused experts),
    the dense MLP, norms; every parameter in one."""
    import re

    out: dict = {}
    for name, _ in module.named_parameters():
        if ".lora_" in name:
            g = "adapters"
        elif "embed_tokens" in name or "wte" in name:
            g = "embedding"
        elif "lm_head" in name:
            g = "head"
        elif m := re.search(r"\.experts\.(\d+)\.", name):
            g = f"expert {m.group(1)} (every layer)"
        elif ".experts." in name:
            g = "experts (fused tensors)"
        elif re.search(r"\.(gate|router)\.", name) and "mlp" in name:
            g = "router"
        elif "attn" in name or "attention" in name:
            g = "attention"
        elif "mlp" in name or "feed_forward" in name:
            g = "dense MLP"
        else:
            g = "norms and the rest"
        out.setdefault(g, []).append(name)
    if any(".lora_" in n for n, _ in module.named_parameters()):  # frozen base weights: one group whatever their role
        out = {"adapters": out.pop("adapters"), "frozen weights": [n for g in out.values() for n in g]}
    return out
