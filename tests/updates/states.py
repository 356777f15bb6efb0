"""Desired states and keys documents signed in the tests, as a publisher (or an attacker) would."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from pathlib import Path

from edgekit.bundle import load_private_key
from edgekit.bundle.fleet_protocol import DesiredState, Notice, sign_document
from edgekit.fleet.publish import now_iso


def signed_state(
    key: Path | None,
    fleet: str,
    models: tuple[Notice, ...],
    *,
    device: str = "",
    group: str = "",
    issued: datetime | None = None,
    fresh_for: timedelta = timedelta(hours=1),
) -> bytes:
    """The MQTT payload of a desired state signed with ``key`` (``None``: an envelope without signatures)."""
    at = issued or datetime.now(timezone.utc)
    state = DesiredState("desired", fleet, now_iso(at), now_iso(at + fresh_for), device=device, group=group,
                         models=models)  # fmt: skip
    return sign_document(state.to_json(), [load_private_key(key)] if key is not None else []).to_json()
