"""EngineConfig refuses limits that make no sense, with a ValueError that names them."""

from __future__ import annotations

import pytest

from pipeline.engine.config import EngineConfig


@pytest.mark.parametrize(("bad", "named"), [
    ({"max_num_seqs": 0}, "max_num_seqs"), ({"batch_every": 0}, "batch_every"),
    ({"batch_prompt_tokens": -1}, "batch_prompt_tokens"), ({"shared_prompt_tokens": -1}, "shared_prompt_tokens"),
    ({"handoff_hold_ms": -1.0}, "handoff_hold_ms"), ({"interrupt_batch_steps": -0.1}, "interrupt_batch_steps"),
    ({"interrupt_batch_steps": 1.5}, "interrupt_batch_steps"), ({"dtype": "int8"}, "dtype"),
])
def test_nonsense_limits_are_refused(bad: dict[str, object], named: str) -> None:
    with pytest.raises(ValueError, match=named):
        EngineConfig(**bad)  # type: ignore[arg-type]


def test_the_defaults_and_the_edges_are_accepted() -> None:
    assert EngineConfig().interrupt_batch_steps == 1.0
    EngineConfig(interrupt_batch_steps=0.0, shared_prompt_tokens=0, batch_prompt_tokens=0, handoff_hold_ms=0.0)
    EngineConfig(interrupt_batch_steps=1.0)
