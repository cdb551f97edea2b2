"""The judge: the plain-PyTorch reference and the comparison against it (``oracle``), the records a probe leaves
(``records``), what is known upstream per bug (``expectations``), the verdict and exit status every command shares
(``verdict``), and the tables and sentences made of records (``tables``). It imports nothing above it."""
