"""docs/agent-config.md is generated from the typed config classes; it must not go stale."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from device_agents.config import AgentConfig, BatchingConfig, ServerConfig
from device_agents.config_reference import reference

PAGE = Path(__file__).resolve().parents[2] / "docs" / "agent-config.md"


def test_config_reference_page_is_current() -> None:
    assert PAGE.read_text() == reference(), (
        "docs/agent-config.md is stale: run `python -m device_agents.config_reference > docs/agent-config.md`"
    )


def test_config_reference_lists_every_key_of_every_table() -> None:
    page = reference()
    for cls in (AgentConfig, ServerConfig, BatchingConfig):
        for f in dataclasses.fields(cls):
            assert f"| `{f.name}` |" in page, f.name
    assert "## `[models.NAME.batching]`" in page and "## `[[trusted]]`" in page
    assert "| `max_wait_ms` | `float` | `2.0` |" in page
    assert "| `hung_call_s` | `float` | `60.0` | a runtime call running longer than this is hung" in page
