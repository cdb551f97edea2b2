"""gradkit: make gradient-accumulation bugs in the DeepSpeed / HF Trainer stack visible and checkable.

Data flow: config -> ``kit.launch`` W ranks -> probe (``kit.probes``; what a rank runs: ``kit.probes.ranks``) -> JSON
records (``kit.judge.records``) -> verdict (``kit.judge.oracle``) -> tables and figures (``kit.notebooks``). The
commands (``gradkit check`` / ``bisect`` / ``report``, the sweep) are ``kit.commands``; the release stacks
(overlays, prefetch, source) ``kit.stacks``; the model shapes ``kit.shapes``. ``docs/layout.md`` draws it.
"""
__version__ = "0.1.0"
