"""Pieces shared by the lanes and the gateway: OpenAI-shaped errors, HTTP helpers, config loading, and the
text layer (tokenizer, chat template, prompt rendering) that the engine, the lanes and the gateway's
window precheck all count tokens with.

Nothing here imports the engine (or ``lanes`` / ``gateway``): the gateway, ``strata keys`` and
the deploy scripts use it without the C build (docs/architecture.md, layering).
"""
