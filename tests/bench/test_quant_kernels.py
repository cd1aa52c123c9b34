"""llama.cpp's symbol names for each type (bench/quant_kernels.py)."""

import pytest

from bench.quant_kernels import DEFAULT_TYPES, Q8K_BYTES, llama_symbols


@pytest.mark.parametrize(("name", "dot", "quant"), [
    ("Q4_K", "ggml_vec_dot_q4_K_q8_K", "quantize_row_q8_K"),
    ("Q2_K", "ggml_vec_dot_q2_K_q8_K", "quantize_row_q8_K"),
    ("IQ3_XXS", "ggml_vec_dot_iq3_xxs_q8_K", "quantize_row_q8_K"),
    ("IQ4_NL", "ggml_vec_dot_iq4_nl_q8_0", "quantize_row_q8_0"),
    ("MXFP4", "ggml_vec_dot_mxfp4_q8_0", "quantize_row_q8_0"),
    ("Q8_0", "ggml_vec_dot_q8_0_q8_0", "quantize_row_q8_0"),
])
def test_symbols_as_ggml_spells_them(name: str, dot: str, quant: str) -> None:
    d, q, nbytes = llama_symbols(name)
    assert (d, q) == (dot, quant)
    assert nbytes == (8 * 34 if quant.endswith("q8_0") else Q8K_BYTES)


def test_default_types_cover_issue_32() -> None:
    assert {"Q2_K", "Q3_K", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_NL", "IQ4_XS",
            "MXFP4"} <= set(DEFAULT_TYPES)
