"""What the notebooks run, tabulate, draw and assert: one module per notebook where a notebook has logic of its own
(``overview`` 00, ``explore`` 05 with its record browsers ``browse``, ``sweep`` 06, ``without_ds`` 07, ``bisect_known``
08); their figures (``verdict_plots``, ``probe_plots``, ``plot_style``: each imports matplotlib, so the rest of the kit
imports them inside the functions that draw); the batch run of every notebook (``runall``, the command, and its parts
``runall_params``, ``runall_notebook``, ``runall_batch``, ``runall_summary``) with its static site of the executed
notebooks and the docs pages (``site``); and the docs pages' generated tables (``readme_tables``)."""
