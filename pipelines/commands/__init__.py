"""Subcommands of the ``gascan`` command line, one module each."""
