"""The judge: the plain-PyTorch reference and the comparison against it, every signal judged and the verdict
(``oracle``), the limits per dtype and why (``tolerances``), each parameter group of a step judged on its own
(``parts``), which named hypothesis a step is and what a record's steps are called (``naming``), the records a probe
leaves (``records``), what is known upstream per bug, with how ``gradkit check`` tells it and its fix
(``expectations``), the verdict and exit status every command shares (``verdict``), and the tables and sentences
made of records (``tables``). It imports nothing above it (``gradkit.config`` and ``gradkit.stacks.versions`` only)."""
