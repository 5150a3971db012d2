"""The released mini-swe-agent loads dsec.compat.minisweagent.DSecEnvironment by import path
and runs an agent in it (its DeterministicModel stands in for the LLM), against `dsec up`."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

os.environ.setdefault("MSWEA_SILENT_STARTUP", "1")  # mini-swe-agent prints a banner on import otherwise

import yaml
from compat_images import BASH_IMAGE, build_bash_layer
from minisweagent.agents.default import DefaultAgent
from minisweagent.config import get_config_path
from minisweagent.environments import get_environment
from minisweagent.exceptions import Submitted
from minisweagent.models.test_models import DeterministicModel, make_output

from conftest import dsec_up
from dsec.compat.minisweagent import DSecEnvironment

pytestmark = pytest.mark.root

CLASS = "dsec.compat.minisweagent.DSecEnvironment"


@pytest.fixture(scope="module")
def up() -> Iterator[dict[str, str]]:
    from dsec.images.build import build_busybox
    from dsec.images.store import LocalLayerStore

    with tempfile.TemporaryDirectory(prefix="dsec-test-mswea-") as tmp:
        data = Path(tmp)
        store = LocalLayerStore(data / "layers")
        try:
            build_busybox(store, name="busybox", tag="latest")
            build_bash_layer(store)
        finally:
            store.close()
        with dsec_up(data, {**os.environ, "DSEC_STATE_DIR": str(data)}) as ready:
            yield ready


def environment(up: dict[str, str], **kw: object) -> DSecEnvironment:
    config = {"environment_class": CLASS, "image": BASH_IMAGE, "url": up["DSEC_URL"], "token": up["DSEC_TOKEN"],
              "resources": {"cpu": 0.5, "memory": 256 << 20, "disk": 64 << 20}, **kw}
    env = get_environment(config)
    assert isinstance(env, DSecEnvironment)
    return env


def test_execute_as_docker_environment_does(up: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DSEC_TEST_FORWARDED", "fwd")
    env = environment(up, cwd="/tmp", env={"GREETING": "hi"}, forward_env=["DSEC_TEST_FORWARDED", "UNSET_ONE"],
                      timeout=5)
    try:
        out = env.execute({"command": "echo $GREETING $DSEC_TEST_FORWARDED ${UNSET_ONE-none}; pwd; echo oops >&2"})
        assert out == {"output": "hi fwd none\n/tmp\noops\n", "returncode": 0, "exception_info": ""}
        assert env.execute({"command": "cd /; exit 3"})["returncode"] == 3
        assert env.execute({"command": "pwd"}, cwd="/etc")["output"] == "/etc\n"  # no state carried over
        env.execute({"command": "echo kept > /tmp/f"})
        assert env.execute({"command": "cat /tmp/f"})["output"] == "kept\n"  # but files are
        slow = env.execute({"command": "echo started; sleep 30"}, timeout=1)
        assert slow["returncode"] == -1 and slow["output"] == "started\n"
        assert "An error occurred while executing the command" in slow["exception_info"]
        assert slow["extra"]["exception_type"] == "ExecTimeout"
        with pytest.raises(Submitted) as sub:
            env.execute({"command": "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT; echo the patch"})
        assert sub.value.messages[0]["extra"] == {"exit_status": "Submitted", "submission": "the patch\n"}
        tv = env.get_template_vars(extra=1)
        assert tv["cwd"] == "/tmp" and tv["extra"] == 1 and tv["sandbox_id"] == env.sandbox.id and "system" in tv
        info = env.serialize()["info"]["config"]
        assert info["environment_type"] == CLASS and "token" not in info["environment"]
    finally:
        env.cleanup()


def test_an_agent_runs_in_the_sandbox_and_cleanup_deletes_it(up: dict[str, str]) -> None:
    import dsec

    agent_config = yaml.safe_load(get_config_path("default").read_text())["agent"]
    model = DeterministicModel(outputs=[
        make_output("look", [{"command": "printf 'def add(a, b):\\n    return a - b\\n' > /tmp/calc.py; cat /tmp/calc.py"}]),
        make_output("fix", [{"command": "sed -i 's/a - b/a + b/' /tmp/calc.py && grep -c 'a + b' /tmp/calc.py"}]),
        make_output("done", [{"command": "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && cat /tmp/calc.py"}]),
    ])
    env = environment(up)
    sid = env.sandbox.id
    try:
        agent = DefaultAgent(model, env, **agent_config)
        result = agent.run("fix add() in /tmp/calc.py")
        assert result["exit_status"] == "Submitted"
        assert result["submission"] == "def add(a, b):\n    return a + b\n"
        observations = [m["content"] for m in agent.messages if m.get("role") == "user"][1:]
        assert "<returncode>0</returncode>" in observations[1] and "1" in observations[1]
    finally:
        env.cleanup()
        env.cleanup()  # idempotent
    with dsec.Client(up["DSEC_URL"], up["DSEC_TOKEN"]) as c, pytest.raises(dsec.SandboxNotFound):
        c.connect(sid)
