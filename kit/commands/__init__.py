"""The command-line tools: ``gradkit check`` (``check``; ``check --path``: ``check_paths``), ``sweep``, ``bisect``,
``report`` and the standalone reproduction scripts they write (``repro``)."""
