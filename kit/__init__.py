"""gradkit: make gradient-accumulation bugs in the DeepSpeed / HF Trainer stack visible and checkable.

Data flow: config -> ``launch`` W ranks -> probe (``kit.probes.*``, per rank) -> JSON ``records``
-> ``oracle`` verdict -> ``plots``.
"""
__version__ = "0.1.0"
