"""Strata benchmarks: each module measures Strata against a peer measured in the same run.

- ``python -m bench.engine_cpu``: the CPU engine against llama.cpp (decode and prefill tok/s).

Shared helpers (medians, machine description, tables, JSON reports) live in ``bench.common``.
"""
