"""Rules the GPU engine's sources keep (no GPU needed, a second or two): the environment is read in one
place (engine/gpu_settings.py's registry; the C sources read no setting), no CUDA source passes 800
lines, and comments say what the code is, not when it was measured (no work-period or run numbers,
no "candidate")."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from engine import gpu_settings

ROOT = Path(__file__).resolve().parents[2]
CUDA = ROOT / "engine" / "csrc" / "cuda"
MAX_LINES = 800

# The only getenv calls allowed in the C sources, each with why.
C_GETENV = {
    "CUDA_VISIBLE_DEVICES": "named in the no-device message (strata_cuda's stg_device_count), not a setting",
    "STRATA_REPACK": "the CPU engine's repack off switch (model.c), the other side of test_kernels' repack oracle",
}
REGISTRY = {o.env for o in gpu_settings.OVERRIDES} | {gpu_settings.LIBRARY_ENV}
GPU_NAME = re.compile(r"STRATA_(?:GPU|CUDA)_[A-Z0-9_]+")
# a read of one variable by its literal name: os.environ.get("X"), os.environ["X"] (not an assignment),
# os.getenv("X"), environ.get("X")
ENV_READ = re.compile(r"""(?:environ\.get|getenv)\(\s*["'](STRATA_[A-Z0-9_]+)["']|environ\[\s*["'](STRATA_[A-Z0-9_]+)["']\s*\](?!\s*=[^=])""")
GPU_PY = {"cuda_backend.py", "gpu_settings.py", "_build_cuda.py", "engine_gpu.py"}
HISTORY = re.compile(r"\b(?:[Rr]uns?|[Ss]essions?) \d+\b|\b[Cc]andidates?\b|\bcand\d+\b")


def c_sources() -> list[Path]:
    return sorted(p for p in (ROOT / "engine" / "csrc").rglob("*") if p.suffix in (".c", ".h", ".cu", ".cuh"))


def python_sources() -> list[Path]:
    return sorted(p for d in ("engine", "bench") for p in (ROOT / d).rglob("*.py"))


def comments(path: Path) -> list[tuple[int, str]]:
    """(line, text) of each comment of a C / CUDA or Python source (Python: # comments and docstrings)."""
    text = path.read_text()
    if path.suffix == ".py":
        pattern = re.compile(r"#[^\n]*|\"\"\"[\s\S]*?\"\"\"")
    else:
        pattern = re.compile(r"/\*[\s\S]*?\*/|//[^\n]*")
    return [(text.count("\n", 0, m.start()) + 1, m.group(0)) for m in pattern.finditer(text)]


def test_the_rules_see_the_sources() -> None:
    """The scans below cover the CUDA families and the Python that loads them (a moved tree would pass
    them vacuously)."""
    names = {p.name for p in c_sources()}
    assert {"strata_cuda.cu", "strata_cuda.h", "common.cuh", "gemm.cu", "step.cu"} <= names
    assert {"gpu_settings.py", "cuda_backend.py", "engine_gpu.py"} <= {p.name for p in python_sources()}


def test_c_sources_read_no_setting_from_the_environment() -> None:
    bad = []
    for path in c_sources():
        for i, line in enumerate(path.read_text().splitlines(), 1):
            for name in re.findall(r"getenv\(\s*\"([^\"]*)\"", line):
                if name not in C_GETENV:
                    bad.append(f"{path.relative_to(ROOT)}:{i}: getenv({name!r})")
            if "getenv(" in line and not re.search(r"getenv\(\s*\"", line):
                bad.append(f"{path.relative_to(ROOT)}:{i}: getenv of a computed name")
    assert not bad, "the C sources read settings through stg_settings (engine/gpu_settings.py), not getenv:\n" + \
        "\n".join(bad)


def test_python_reads_gpu_variables_only_through_the_registry() -> None:
    """Only engine/gpu_settings.py reads a STRATA_GPU_* / STRATA_CUDA_* variable; every such name that
    engine/ or bench/ mentions is one of its overrides."""
    bad = []
    for path in python_sources():
        rel = path.relative_to(ROOT)
        text = path.read_text()
        for name in set(GPU_NAME.findall(text)) - REGISTRY:
            bad.append(f"{rel}: {name} is not in engine/gpu_settings.py's registry")
        if path.name == "gpu_settings.py":
            continue
        for i, line in enumerate(text.splitlines(), 1):
            for m in ENV_READ.finditer(line):
                name = m.group(1) or m.group(2)
                if GPU_NAME.fullmatch(name):
                    bad.append(f"{rel}:{i}: reads {name} itself (use engine.gpu_settings)")
    assert not bad, "\n".join(bad)


def test_registry_entries_are_documented_and_distinct() -> None:
    envs = [o.env for o in gpu_settings.OVERRIDES]
    fields = [o.field for o in gpu_settings.OVERRIDES]
    assert len(set(envs)) == len(envs) and len(set(fields)) == len(fields)
    for o in gpu_settings.OVERRIDES:
        assert o.env.startswith("STRATA_GPU_") and o.doc.strip(), o
    header = (CUDA / "strata_cuda.h").read_text()
    struct = header[header.index("typedef struct stg_settings"):header.index("} stg_settings;")]
    declared = re.findall(r"int32_t (\w+);", struct)
    assert sorted(declared) == sorted(fields), "every stg_settings field has its override, and only those"


def test_apply_env_parses_and_names_the_variable() -> None:
    class S:
        gemm_min = 2

    s = gpu_settings.apply_env(S(), {"STRATA_GPU_GEMM_MIN": " 7 ", "STRATA_GPU_PDL": ""})
    assert s.gemm_min == 7 and not hasattr(s, "pdl")  # an empty value keeps the default
    with pytest.raises(ValueError, match="STRATA_GPU_GEMM_MIN"):
        gpu_settings.apply_env(S(), {"STRATA_GPU_GEMM_MIN": "two"})
    assert gpu_settings.env_override("hybrid_stage", {"STRATA_GPU_HYBRID_STAGE": "1"}) == 1
    assert gpu_settings.env_override("hybrid_stage", {"STRATA_GPU_HYBRID_STAGE": ""}) is None
    assert gpu_settings.env_override("hybrid_stage", {}) is None


def test_hybrid_plan_reserves_the_staging_ring_the_library_allocates() -> None:
    """The plan's staging slots follow the library's default hybrid_stage (model.cu), which Python cannot read
    before the library loads: the two must name the same value."""
    model_cu = (CUDA / "model.cu").read_text()
    assert re.search(r"s->hybrid_stage = (\d+);", model_cu).group(1) == str(gpu_settings.HYBRID_STAGE_DEFAULT)
    assert gpu_settings.staging_slots(128, {}) == 256
    assert gpu_settings.staging_slots(128, {"STRATA_GPU_HYBRID_STAGE": "0"}) == 0
    assert gpu_settings.staging_slots(128, {"STRATA_GPU_HYBRID_STAGE": "1"}) == 256


def test_no_cuda_source_over_800_lines() -> None:
    long = {p.name: n for p in CUDA.iterdir() if p.suffix in (".cu", ".cuh", ".h")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"split these by op family (at most {MAX_LINES} lines each): {long}"


def test_comments_carry_no_run_history() -> None:
    """History (which run measured what, work periods, the forms that were tried) lives in docs/gpu-runs.md
    and the commits; a source comment says why the code is as it is."""
    bad = []
    for path in c_sources() + python_sources():
        for line, text in comments(path):
            for m in HISTORY.finditer(text):
                if m.group(0).lower().startswith("cand") and path.suffix == ".py" and path.name not in GPU_PY:
                    continue  # "candidate" as a technical word elsewhere (sampling's candidate set, prefix lookups)
                bad.append(f"{path.relative_to(ROOT)}:{line + text.count(chr(10), 0, m.start())}: {m.group(0)!r}")
    assert not bad, "\n".join(bad)


def test_the_checks_catch_a_violation(tmp_path: Path) -> None:
    """The patterns above match what they are meant to (so a pass is not vacuous)."""
    assert HISTORY.search("faster (run 53)") and HISTORY.search("session 12's form") and HISTORY.search("a candidate")
    assert not HISTORY.search("a GEMM runs the 32-pair tiles") and not HISTORY.search("runs of 64 tokens")
    assert ENV_READ.search('x = os.environ.get("STRATA_GPU_GRAPHS")')
    assert ENV_READ.search('os.environ["STRATA_GPU_PDL"]')
    assert not ENV_READ.search('os.environ["STRATA_GPU_PDL"] = "0"')
    src = tmp_path / "x.cu"
    src.write_text("/* measured in run 12 */\nint a;\n")
    assert [t for _, t in comments(src) if HISTORY.search(t)]
