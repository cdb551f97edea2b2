"""Release stacks: other DeepSpeed / transformers / accelerate releases as overlays (``versions``), their one-off work
done up front (``prefetch``), and the source of a release read as it ships (``source``)."""
