"""What runs inside a rank: one module per probe (``gradkit.probes.ranks.<module>``, whose ``run_rank`` is the probe's
``Probe.target``) with everything only its ranks call, and ``common``, the pieces every probe's ranks share.

Nothing here plans, validates or launches: that is the caller's side (``gradkit.probes.<module>``,
``gradkit.probes.runner``), which may import these modules for what both sides use; these modules never import the
caller's side.
"""
