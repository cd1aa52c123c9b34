"""The ``strata`` command (cli/main.py): engine subcommands load the engine lazily, so ``strata keys``
works without the C build."""
