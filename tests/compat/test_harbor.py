"""The released Harbor (0.26.0) runs dsec.compat.harbor.DSecEnvironment, loaded by import
path, against `dsec up`: the environment's own calls, then a whole trial (oracle agent,
verifier, reward). Harbor needs Python >= 3.12, so it runs in a Debian trixie chroot
(harbor_chroot.py; made once, cached) on this host's network; hence slow.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import harbor_chroot
import pytest
from compat_images import BASH_IMAGE, build_bash_layer

from conftest import dsec_up

pytestmark = [pytest.mark.root, pytest.mark.slow, pytest.mark.timeout(1800)]

CACHE = Path(os.environ.get("DSEC_STATE_DIR", "/var/lib/dsec")) / "cache"


@pytest.fixture(scope="module")
def root() -> Path:
    why = harbor_chroot.available(CACHE)
    if why is not None:
        pytest.skip(why)
    return harbor_chroot.harbor_root(CACHE)


@pytest.fixture(scope="module")
def up() -> Iterator[dict[str, str]]:
    from dsec.images.build import build_busybox
    from dsec.images.store import LocalLayerStore

    with tempfile.TemporaryDirectory(prefix="dsec-test-harbor-") as tmp:
        data = Path(tmp)
        store = LocalLayerStore(data / "layers")
        try:
            build_busybox(store, name="busybox", tag="latest")
            build_bash_layer(store)
        finally:
            store.close()
        with dsec_up(data, {**os.environ, "DSEC_STATE_DIR": str(data)}) as ready:
            yield ready


def driver(root: Path, up: dict[str, str], *args: str, binds: dict[str, str] | None = None) -> dict[str, object]:
    r = harbor_chroot.run(root, "python /dsec/tests/compat/harbor_driver.py " + " ".join(args), binds=binds,
                          env={"DSEC_URL": up["DSEC_URL"], "DSEC_TOKEN": up["DSEC_TOKEN"]})
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    assert r.returncode == 0 and lines, f"rc {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}"
    result: dict[str, object] = json.loads(lines[-1].removeprefix("RESULT "))
    return result


def test_environment_calls(root: Path, up: dict[str, str]) -> None:
    import dsec

    out = driver(root, up, "env", BASH_IMAGE)
    assert out["class"] == "dsec.compat.harbor.DSecEnvironment" and out["type"] == "dsec"
    # bash -c in the task's workdir; task env < trial env < the call's; stderr apart
    assert out["exec"] == ["/app\ntask trial x\n", "err\n", 3]
    assert out["timeout"] == "Command timed out after 1 seconds"
    assert out["uploaded"] == "AAran\n"  # a directory (modes kept) and a file, parents made
    assert out["downloaded"] == ["B\n", "C\n"]
    assert out["is_dir"] == [True, True]
    assert "unreachable" in str(out["network"]).lower()  # network_mode no-network
    with dsec.Client(up["DSEC_URL"], up["DSEC_TOKEN"]) as c, pytest.raises(dsec.SandboxNotFound):
        c.connect(str(out["sandbox"]))  # stop(delete=True) deleted it


def make_task(task: Path, solution: str) -> None:
    """Harbor's task layout: the task's docker_image names a DSec layer."""
    for d in ("environment", "solution", "tests"):
        (task / d).mkdir(parents=True)
    (task / "task.toml").write_text(
        'schema_version = "1.4"\n\n[metadata]\n\n[verifier]\ntimeout_sec = 60.0\n\n[agent]\ntimeout_sec = 60.0\n\n'
        f'[environment]\ndocker_image = "{BASH_IMAGE}"\nworkdir = "/app"\ncpus = 0.5\nmemory_mb = 256\n')
    (task / "instruction.md").write_text('Write "Hello, world!" to /app/hello.txt.\n')
    (task / "solution" / "solve.sh").write_text(f'#!/bin/bash\necho "{solution}" > /app/hello.txt\n')
    (task / "tests" / "test.sh").write_text(
        '#!/bin/bash\nif grep -qx "Hello, world!" /app/hello.txt; then r=1; else r=0; fi\n'
        'echo $r > /logs/verifier/reward.txt\n')


@pytest.mark.parametrize(("solution", "reward"), [("Hello, world!", 1.0), ("Goodbye", 0.0)])
def test_a_trial_with_the_oracle_agent(root: Path, up: dict[str, str], solution: str, reward: float) -> None:
    with tempfile.TemporaryDirectory(prefix="dsec-test-harbor-task-") as tmp:
        make_task(Path(tmp) / "hello", solution)
        out = driver(root, up, "trial", str(Path(tmp) / "hello"), str(Path(tmp) / "trials"), binds={tmp: tmp})
    assert out["exception"] is None, out
    assert out["rewards"] == {"reward": reward}


def test_harbor_run_cli(root: Path, up: dict[str, str]) -> None:
    """`harbor run` as its docs show it, the environment given by import path (-e)."""
    with tempfile.TemporaryDirectory(prefix="dsec-test-harbor-cli-") as tmp:
        make_task(Path(tmp) / "hello", "Hello, world!")
        r = harbor_chroot.run(
            root, f"cd {tmp} && harbor run -p {tmp}/hello -a oracle -e dsec.compat.harbor:DSecEnvironment "
                  '--ek url="$DSEC_URL" --ek token="$DSEC_TOKEN" -o jobs -y',
            binds={tmp: tmp}, env={"DSEC_URL": up["DSEC_URL"], "DSEC_TOKEN": up["DSEC_TOKEN"]})
        assert r.returncode == 0, f"{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
        trials = [p for p in (Path(tmp) / "jobs").glob("*/*/result.json")]
        assert len(trials) == 1, r.stdout[-3000:]
        result = json.loads(trials[0].read_text())
    assert result["exception_info"] is None, result["exception_info"]
    assert result["verifier_result"]["rewards"] == {"reward": 1.0}
