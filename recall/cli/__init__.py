"""The ``recall`` command line (``recall.cli.app``): one module per command group."""
