"""The agent refuses to batch a model whose manifest says its rows are not independent
(``rows_independent = false``): at install with a batching table, and at start when the table was
added after the install. Without the table, or with the flag true or absent, it serves as before."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.agent.bundles import rebundle
from tests.agent.conftest import Bundles, agent_cli, write_config

BATCHING = "[models.tiny.batching]\nmax_batch_size = 8\n"
REFUSAL = (
    "agent.models.tiny.batching: model tiny v1 mixes rows (its packager found a row's outputs change when another "
    "row shares its batch: rows_independent is false), so requests of different clients must not share a batch; "
    "remove [models.tiny.batching]"
)


@pytest.fixture(scope="module")
def mixing(tmp_path_factory: pytest.TempPathFactory, keypair: tuple[Path, Path], bundles: Bundles) -> Path:
    out = tmp_path_factory.mktemp("mixing") / "tiny-mixing-1.ekb"
    return rebundle(bundles.v1, keypair[0], out, rows_independent=False)


def test_install_refuses_batching_a_model_whose_rows_are_not_independent(
    tmp_path: Path, keypair: tuple[Path, Path], mixing: Path
) -> None:
    config = write_config(tmp_path / "a", keypair[1], BATCHING)
    done = agent_cli("install", str(mixing), "--config", str(config))
    assert done.returncode != 0
    assert REFUSAL in done.stderr, done.stderr


def test_install_batches_a_model_whose_rows_were_found_independent(
    tmp_path: Path, keypair: tuple[Path, Path], bundles: Bundles
) -> None:
    independent = rebundle(bundles.v1, keypair[0], tmp_path / "tiny-rows-1.ekb", rows_independent=True)
    config = write_config(tmp_path / "a", keypair[1], BATCHING)
    done = agent_cli("install", str(independent), "--config", str(config))
    assert done.returncode == 0, done.stdout + done.stderr


def test_run_refuses_a_batching_table_added_after_a_row_mixing_model_was_installed(
    tmp_path: Path, keypair: tuple[Path, Path], mixing: Path
) -> None:
    config = write_config(tmp_path / "a", keypair[1])
    done = agent_cli("install", str(mixing), "--config", str(config))
    assert done.returncode == 0, done.stdout + done.stderr  # unbatched, it serves
    config.write_text(config.read_text() + BATCHING)
    run = agent_cli("run", "--config", str(config), timeout=120)
    assert run.returncode != 0
    assert REFUSAL in run.stderr, run.stderr
