"""What the notebooks run, tabulate, draw and assert, one module per notebook where a notebook has logic of its own
(``overview`` 00, ``explore`` 05, ``without_ds`` 07, ``bisect_known`` 08), their figures (``plots``), and the batch
run of every notebook (``runall``) with its static site (``site``) and the README's generated tables
(``readme_tables``)."""
