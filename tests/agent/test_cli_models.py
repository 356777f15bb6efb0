"""`edgekit-agent list | rollback NAME | uninstall NAME`: the operator's model management, against a
running agent (through its loopback routes) and against the store when none runs."""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from tritonclient.utils import InferenceServerException

from tests.agent.conftest import AgentFactory, Bundles, agent_cli
from tests.agent.test_cli import _infer_ok

ROW = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ"


def _run(config: Path, *argv: str) -> tuple[int, str, str]:
    done = agent_cli(*argv, "--config", str(config))
    return done.returncode, done.stdout, done.stderr


def test_list_rollback_uninstall_through_the_running_agent(
    config_path: Path, bundles: Bundles, agent_factory: AgentFactory
) -> None:
    assert _run(config_path, "install", str(bundles.v1))[0] == 0
    agent = agent_factory(config_path)
    assert _run(config_path, "install", str(bundles.v2))[0] == 0
    code, out, _ = _run(config_path, "list")
    lines = out.splitlines()
    assert code == 0 and lines[0] == "MODEL  VERSION  PREVIOUS  TARGET  RUNTIME      INSTALLED"
    assert re.fullmatch(rf"tiny   v2       v1        cpu     onnxruntime  {ROW}", lines[1]), lines[1]

    assert _run(config_path, "rollback", "tiny") == (
        0,
        "rolled back tiny to v1 (was v2); recorded as the operator's rollback\n",
        "",
    )
    assert _infer_ok(agent)["model_version"] == "1"  # the daemon switched
    status = _run(config_path, "status")[1].splitlines()
    assert status[2].split(None, 5)[4:] == ["rolled_back", "rolled back by the operator (cli)"]
    assert _run(config_path, "rollback", "tiny") == (
        1,
        "",
        "edgekit-agent: error: tiny: v1 has no previous version kept to roll back to\n",
    )
    assert _run(config_path, "uninstall", "tiyn") == (
        1,
        "",
        "edgekit-agent: error: no model named 'tiyn' is installed (installed: tiny); did you mean 'tiny'?\n",
    )
    assert _run(config_path, "uninstall", "tiny") == (
        0,
        "uninstalled tiny (was v1); a later install must still be newer than v2\n",
        "",
    )
    with pytest.raises(InferenceServerException, match="no model named 'tiny' is served here"):
        _infer_ok(agent)
    assert _run(config_path, "list") == (0, "no models installed\n", "")
    store = config_path.parent / "store"
    assert list((store / "models").iterdir()) == [] and list((store / "bundles").iterdir()) == []
    code, _, err = _run(config_path, "install", str(bundles.v1))
    assert code == 1 and "tiny v1 is older than installed v2" in err  # the counter survives the uninstall


def test_manage_routes_follow_the_install_routes_rules(
    config_path: Path, bundles: Bundles, agent_factory: AgentFactory
) -> None:
    assert _run(config_path, "install", str(bundles.v1))[0] == 0
    agent = agent_factory(config_path)
    plain = urllib.request.Request(f"{agent.url}/edgekit/v1/models/tiny/uninstall", data=b"x", method="POST")
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(plain, timeout=10)
    assert refused.value.code == 403  # a web page's "simple" POST cannot uninstall
    assert _infer_ok(agent)["model_version"] == "1"
    missing = urllib.request.Request(
        f"{agent.url}/edgekit/v1/models/nope/rollback", data=b"{}", headers={"Content-Type": "application/json"}
    )
    with pytest.raises(urllib.error.HTTPError) as unknown:
        urllib.request.urlopen(missing, timeout=10)
    assert unknown.value.code == 404
    assert json.loads(unknown.value.read())["error"] == "no model named 'nope' is installed (installed: tiny)"


def test_rollback_and_uninstall_without_a_running_agent(config_path: Path, bundles: Bundles) -> None:
    for bundle in (bundles.v1, bundles.v2):
        assert _run(config_path, "install", str(bundle))[0] == 0
    assert _run(config_path, "rollback", "tiny")[1] == (
        "rolled back tiny to v1 (was v2); recorded as the operator's rollback\n"
    )
    assert _run(config_path, "list")[1].splitlines()[1].startswith("tiny   v1       -         cpu")
    assert _run(config_path, "uninstall", "tiny")[0] == 0
    assert _run(config_path, "status")[1].splitlines()[2].split(None, 5)[4:] == [
        "uninstalled",
        "uninstalled by the operator (cli)",
    ]


def test_a_models_table_for_no_installed_model_is_a_warning_at_install_and_start(
    config_path: Path, bundles: Bundles, agent_factory: AgentFactory
) -> None:
    config_path.write_text(config_path.read_text() + "\n[models.tinny.batching]\nmax_batch_size = 4\n")
    code, out, err = _run(config_path, "install", str(bundles.v1))
    assert code == 0 and out.startswith("installed tiny v1")
    warning = (
        "[models.tinny] names no installed model (installed: tiny; did you mean [models.tiny]?): its settings apply "
        "to nothing until a model of that name is installed"
    )
    assert err == f"warning: {warning}\n"
    agent = agent_factory(config_path)
    assert f"WARNING edgekit.agent: {warning}" in agent.log.read_text()
