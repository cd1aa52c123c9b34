"""The benchmark harness: ``strata bench run`` runs named scenarios (bench/harness/scenarios/) against a
running stack and writes report.md, PNG plots and results.json; ``strata bench compare`` diffs two
results files. docs/bench.md is its manual."""
