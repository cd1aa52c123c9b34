"""Engine.warm_up: the first-use work a lane does at start instead of in its first request (a prefill step and a
greedy decode step on blocks taken and given back). It leaves the engine as it found it: every block free again,
nothing in the prefix cache, the same logits after it as before. CPU (the tiny random model); the GPU's first-use
work (kernel loading, step buffers, the decode graph) runs in tests/engine/gpu through the lane's start."""

from __future__ import annotations

import numpy as np

from engine.engine import Engine


def test_warm_up_runs_two_steps_and_leaves_the_engine_as_it_was(eng: Engine) -> None:
    prompt = [5, 17, 42, 7, 8, 250]
    before = eng.logits_for(prompt)
    free, steps = eng.blocks.num_free, eng.last_step
    took = eng.warm_up()
    assert took > 0.0
    assert eng.last_step == steps + 2  # a 16-token step (the CPU's size) and the decode step
    assert eng.blocks.num_free == free
    assert eng.blocks.take_prefix(list(range(1, 17))) == []  # its tokens were not published
    assert np.array_equal(eng.logits_for(prompt).view(np.uint32), before.view(np.uint32))


def test_warm_up_fits_what_the_cache_holds(eng: Engine) -> None:
    """A size over step_tokens or the free blocks is cut to them; with no block free it does nothing."""
    free = eng.blocks.num_free
    steps = eng.last_step
    assert eng.warm_up(tokens=10**6) > 0.0  # cut to step_tokens (prefill_chunk here): one step, then the decode step
    assert eng.last_step == steps + 2 and eng.blocks.num_free == free
    held = eng.blocks.allocate(free)
    assert held is not None
    try:
        assert eng.warm_up() == 0.0
        assert eng.last_step == steps + 2
    finally:
        eng.blocks.release(held)
    assert eng.blocks.num_free == free
