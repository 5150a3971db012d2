"""Run inside the Harbor chroot (harbor_chroot.py) by test_harbor.py: Harbor's own
factory and Trial, with the environment loaded by import path. Prints one JSON line.

    python harbor_driver.py env       # the environment's own calls (start, exec, files, stop)
    python harbor_driver.py trial TASK_DIR TRIALS_DIR   # a whole trial: oracle agent + verifier
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import tempfile
from pathlib import Path

IMPORT_PATH = "dsec.compat.harbor:DSecEnvironment"
KWARGS = {"url": os.environ["DSEC_URL"], "token": os.environ["DSEC_TOKEN"], "labels": {"test": "harbor"}}


async def env_calls(image: str) -> dict[str, object]:
    from harbor.environments.factory import EnvironmentFactory
    from harbor.models.task.config import EnvironmentConfig, NetworkMode, NetworkPolicy
    from harbor.models.trial.paths import TrialPaths

    cls = EnvironmentFactory.get_environment_class(import_path=IMPORT_PATH)
    out: dict[str, object] = {"class": f"{cls.__module__}.{cls.__qualname__}", "type": cls.type()}
    with tempfile.TemporaryDirectory() as tmp:
        t = Path(tmp)
        (t / "env").mkdir()
        paths = TrialPaths(t / "trial")
        paths.mkdir()
        env = cls(environment_dir=t / "env", environment_name="t", session_id="t__x__env", trial_paths=paths,
                  task_env_config=EnvironmentConfig(docker_image=image, cpus=0.5, memory_mb=256, workdir="/app",
                                                    env={"FROM_TASK": "task"}),
                  persistent_env={"FROM_TRIAL": "trial"},
                  network_policy=NetworkPolicy(network_mode=NetworkMode.NO_NETWORK), **KWARGS)
        await env.start(force_build=False)
        try:
            r = await env.exec("pwd; echo $FROM_TASK $FROM_TRIAL $X; echo err >&2; exit 3", env={"X": "x"})
            out["exec"] = [r.stdout, r.stderr, r.return_code]
            try:
                await env.exec("sleep 30", timeout_sec=1)
            except RuntimeError as exc:
                out["timeout"] = str(exc)
            (t / "up").mkdir()
            (t / "up" / "a.txt").write_text("A")
            (t / "up" / "sub").mkdir()
            (t / "up" / "sub" / "run.sh").write_text("#!/bin/sh\necho ran\n")
            (t / "up" / "sub" / "run.sh").chmod(0o755)
            await env.upload_dir(t / "up", "/data/up")
            await env.upload_file(t / "up" / "a.txt", "/data/one/a.txt")
            r = await env.exec("cat /data/up/a.txt /data/one/a.txt; /data/up/sub/run.sh")
            out["uploaded"] = r.stdout
            await env.exec("mkdir -p /data/down/d && echo B > /data/down/b.txt && echo C > /data/down/d/c.txt")
            await env.download_file("/data/down/b.txt", t / "dl" / "b.txt")
            await env.download_dir("/data/down", t / "dl" / "tree")
            out["downloaded"] = [(t / "dl" / "b.txt").read_text(), (t / "dl" / "tree" / "d" / "c.txt").read_text()]
            out["is_dir"] = [await env.is_dir("/data/down"), await env.is_file("/data/down/b.txt")]
            net = await env.exec("(echo > /dev/tcp/1.1.1.1/53) 2>&1 | head -c 200; echo rc=$?", timeout_sec=10)
            out["network"] = net.stdout
            sid = env.sandbox.id
            out["sandbox"] = sid
        finally:
            await env.stop(delete=True)
            await env.stop(delete=True)
    return out


async def trial(task_dir: str, trials_dir: str) -> dict[str, object]:
    from harbor.models.trial.config import AgentConfig, EnvironmentConfig, TaskConfig, TrialConfig
    from harbor.trial.trial import Trial

    config = TrialConfig(task=TaskConfig(path=Path(task_dir)), trials_dir=Path(trials_dir),
                         agent=AgentConfig(name="oracle"),
                         environment=EnvironmentConfig(import_path=IMPORT_PATH, kwargs=KWARGS))
    t = await Trial.create(config)
    result = await t.run()
    return {"rewards": result.verifier_result.rewards if result.verifier_result else None,
            "exception": None if result.exception_info is None else result.exception_info.model_dump(mode="json")}


def main() -> None:
    if sys.argv[1] == "env":
        res = asyncio.run(env_calls(sys.argv[2]))
    else:
        res = asyncio.run(trial(sys.argv[2], sys.argv[3]))
    print("RESULT " + json.dumps(res))


if __name__ == "__main__":
    main()
