"""DSecDeployment / DSecRuntime against a real all-in-one, through the released swe-rex's
own request and error types (SWE-ReX's own suite runs against it too: test_swerex_suite.py).
"""

from __future__ import annotations

import asyncio
import os
import stat
import tempfile
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import pexpect  # type: ignore[import-untyped]
import pytest
from compat_images import BASH_IMAGE, build_bash_layer
from swerex.exceptions import (
    BashIncorrectSyntaxError,
    CommandTimeoutError,
    DeploymentNotStartedError,
    NonZeroExitCodeError,
    SessionDoesNotExistError,
    SessionExistsError,
)
from swerex.runtime.abstract import (
    BashAction,
    BashInterruptAction,
    CloseBashSessionRequest,
    Command,
    CreateBashSessionRequest,
    ReadFileRequest,
    UploadRequest,
    WriteFileRequest,
)

from conftest import ClusterHarness
from dsec.compat.swerex import DSecDeployment, DSecRuntime
from dsec.errors import SandboxNotFound

pytestmark = pytest.mark.root

RES = {"cpu": 0.5, "memory": 256 << 20, "disk": 64 << 20}


@pytest.fixture(scope="module")
def svc() -> Iterator[ClusterHarness]:
    from dsec.cli.up import start_cluster
    from dsec.images.build import build_busybox
    from dsec.images.store import LocalLayerStore

    with tempfile.TemporaryDirectory(prefix="dsec-test-rex-") as tmp:
        data = Path(tmp)
        store = LocalLayerStore(data / "layers")
        try:
            build_busybox(store, name="busybox", tag="latest")
            build_bash_layer(store)  # before the edge starts: it reports its layers when it registers
        finally:
            store.close()
        h = ClusterHarness(data)
        h.cluster = h.run(start_cluster(data, port=0))
        try:
            yield h
        finally:
            h.run(h.cluster.stop())
            h.runner.close()


def deployment(svc: ClusterHarness, **kw: object) -> DSecDeployment:
    return DSecDeployment(image=BASH_IMAGE, url=svc.cluster.url, token=svc.cluster.admin_token, resources=RES, **kw)


def with_runtime(svc: ClusterHarness, body: Callable[[DSecRuntime], Awaitable[None]], *,
                 session: bool = True) -> None:
    async def go() -> None:
        d = deployment(svc)
        await d.start()
        try:
            if session:
                await d.runtime.create_session(CreateBashSessionRequest())
            await body(d.runtime)
        finally:
            await d.stop()

    svc.run(go(), timeout=120)


def A(command: str, **kw: object) -> BashAction:
    kw.setdefault("timeout", 10)
    return BashAction(command=command, **kw)  # type: ignore[arg-type]


def test_deployment_lifecycle_hooks_and_the_sandbox_is_deleted(svc: ClusterHarness) -> None:
    async def go() -> None:
        steps: list[str] = []

        class Hook:
            def on_custom_step(self, message: str) -> None:
                steps.append(message)

        d = deployment(svc, labels={"job": "rex"})
        d.add_hook(Hook())  # type: ignore[arg-type]
        with pytest.raises(DeploymentNotStartedError):
            d.runtime  # noqa: B018
        with pytest.raises(DeploymentNotStartedError):
            await d.is_alive()
        await d.start()
        assert steps == ["Starting sandbox"]
        assert await d.is_alive()
        sid = d.sandbox.id
        assert d.sandbox.info.labels == {"swerex": "1", "job": "rex"}
        await d.stop()
        await d.stop()  # idempotent
        with pytest.raises(DeploymentNotStartedError):
            await d.is_alive()
        async with svc.client() as c:
            with pytest.raises(SandboxNotFound):
                await c.connect(sid)

    svc.run(go())


def test_session_exit_codes_check_modes_and_multiline(svc: ClusterHarness) -> None:
    async def body(rt: DSecRuntime) -> None:
        run = rt.run_in_session
        assert (await run(A("echo 'hello world'"))).output == "hello world\n"
        assert (await run(A("doesntexist", check="silent"))).exit_code == 127
        assert (await run(A("false && true", check="silent"))).exit_code == 1
        ignored = await run(A("false", check="ignore"))
        assert ignored.exit_code is None
        with pytest.raises(NonZeroExitCodeError, match="exit code 3"):
            await run(A("(exit 3)", check="raise", error_msg="setup"))
        r = await run(A("\n\n echo 'a' \n\n echo b\ncd /tmp\nexport X=7\n"))
        assert (r.output, r.exit_code) == ("a\nb\n", 0)
        assert (await run(A("pwd; echo $X"))).output == "/tmp\n7\n"  # state persists
        r = await run(A("cat <<'EOF'\nline 1\n  line $X\nEOF\nfor i in {1..3}; do\n echo $i\ndone"))
        assert r.output == "line 1\n  line $X\n1\n2\n3\n"
        assert (await run(A("printf '\\n\\nx\\n\\n\\n'"))).output == "\n\nx\n\n\n"
        assert (await run(A("# just a comment"))).output == ""
        assert (await run(A("echo out; echo err >&2"))).output == "out\nerr\n"  # one terminal
        big = (await run(A("head -c 5000000 /dev/zero | tr '\\0' a; echo"))).output  # searched once, not per chunk
        assert len(big) == 5_000_001 and big.count("a") == 5_000_000

    with_runtime(svc, body)


def test_timeout_raises_and_interrupt_recovers_even_when_ctrl_c_is_ignored(svc: ClusterHarness) -> None:
    async def body(rt: DSecRuntime) -> None:
        run = rt.run_in_session
        with pytest.raises(CommandTimeoutError):
            await run(A("sleep 30", timeout=0.3))
        obs = await run(BashInterruptAction())
        assert obs.exit_code == 0 and obs.expect_string == "SHELLPS1PREFIX"
        assert (await run(A("echo back"))).output == "back\n"
        # ^C does nothing to this one: after n_retry, ^Z and `kill -9 %1` (SWE-ReX's fallback)
        with pytest.raises(CommandTimeoutError):
            await run(A("bash -c \"trap '' INT; sleep 60\"", timeout=0.3))
        obs = await run(BashInterruptAction())
        assert "Stopped" in obs.output  # ^Z's job notice; bash's "Killed" one comes at some later prompt
        r = await run(A("echo after"))
        assert "after" in r.output
        assert "sleep 60" not in (await rt.execute(Command(command="ps -o args", shell=True))).stdout

    with_runtime(svc, body)


def test_interrupt_fallback_reports_the_killed_job_at_the_next_prompt(svc: ClusterHarness) -> None:
    """SWE-ReX's test_interrupt_pager, in a loop: after ^Z and ``kill -9 %1`` the next command's
    output carries bash's ``[1]+ Killed`` notice, every time. bash loses the SIGCHLD of a job
    that dies while it reprints the job's ``Stopped`` notice (``kill %1`` asks for that): 1 round
    in 4 had no notice before the interrupt reaped it for bash (compat/swerex.py)."""
    async def body(rt: DSecRuntime) -> None:
        run = rt.run_in_session
        for i in range(8):
            with pytest.raises(CommandTimeoutError):
                await run(A("bash -c \"trap '' INT; sleep 60\"", timeout=0.2))
            obs = await run(BashInterruptAction())
            assert "Killed" not in obs.output, (i, obs.output)
            r = await run(A(f"echo round {i}", check="raise"))
            assert f"round {i}" in r.output and "Killed" in r.output, (i, obs.output, r.output)

    with_runtime(svc, body)


def test_interactive_program_with_expect(svc: ClusterHarness) -> None:
    async def body(rt: DSecRuntime) -> None:
        run = rt.run_in_session
        obs = await run(A("PS1='ash> ' sh -i", is_interactive_command=True, expect=["ash> "]))
        assert obs.expect_string == "ash> "
        obs = await run(A("echo $((6 * 7))", is_interactive_command=True, expect=["ash> "]))
        assert obs.output == "42"
        with pytest.raises(CommandTimeoutError):
            await run(A("sleep 5", is_interactive_command=True, expect=["NEVER"], timeout=0.3))
        await run(BashInterruptAction(expect=["ash> "]))
        await run(A("exit", is_interactive_quit=True))
        assert (await run(A("echo bash again"))).output == "bash again\n"

    with_runtime(svc, body)


def test_syntax_errors_are_found_by_the_sandboxes_bash(svc: ClusterHarness) -> None:
    async def body(rt: DSecRuntime) -> None:
        with pytest.raises(BashIncorrectSyntaxError) as e:
            await rt.run_in_session(A("(a"))
        assert "syntax error" in e.value.extra_info["bash_stderr"]
        assert e.value.extra_info["bash_stdout"] == ""
        assert (await rt.run_in_session(A("[[ 1 == 1 ]] && echo ok"))).output == "ok\n"

    with_runtime(svc, body)


def test_sessions_are_named_isolated_and_typed_errors(svc: ClusterHarness) -> None:
    async def body(rt: DSecRuntime) -> None:
        with pytest.raises(SessionDoesNotExistError):
            await rt.run_in_session(A("true"))
        with pytest.raises(SessionDoesNotExistError):
            await rt.close_session(CloseBashSessionRequest(session="nope"))
        await rt.create_session(CreateBashSessionRequest(session="s1"))
        await rt.create_session(CreateBashSessionRequest(session="s2", startup_source=["/etc/profile"]))
        with pytest.raises(SessionExistsError):
            await rt.create_session(CreateBashSessionRequest(session="s1"))
        await asyncio.gather(rt.run_in_session(A("x=1", session="s1")), rt.run_in_session(A("x=2", session="s2")))
        assert (await rt.run_in_session(A("echo $x", session="s1"))).output == "1\n"
        assert (await rt.run_in_session(A("echo $x", session="s2"))).output == "2\n"
        await rt.close_session(CloseBashSessionRequest(session="s1"))
        with pytest.raises(SessionDoesNotExistError):
            await rt.run_in_session(A("true", session="s1"))
        # A shell that exited answers as SWE-ReX's does (its server transfers pexpect's EOF).
        with pytest.raises(pexpect.EOF):
            await rt.run_in_session(A("exit 0", session="s2"))
        with pytest.raises(pexpect.EOF):
            await rt.run_in_session(A("true", session="s2"))

    with_runtime(svc, body, session=False)


def test_execute_like_subprocess_run(svc: ClusterHarness) -> None:
    async def body(rt: DSecRuntime) -> None:
        ex = rt.execute
        assert (await ex(Command(command="echo 'hi there'", shell=True))).stdout == "hi there\n"
        assert (await ex(Command(command=["echo", "-n", "a b"]))).stdout == "a b"
        r = await ex(Command(command=["sh", "-c", "echo out; echo err >&2; exit 4"]))
        assert (r.stdout, r.stderr, r.exit_code) == ("out\n", "err\n", 4)
        r = await ex(Command(command="echo out; echo err >&2", shell=True, merge_output_streams=True))
        assert (r.stdout.splitlines(), r.stderr) == (["out", "err"], "")
        r = await ex(Command(command=["sh", "-c", "echo ${ONLY-unset} ${HOME-nohome}"], env={"ONLY": "me"}))
        assert r.stdout == "me nohome\n"  # env replaces the environment, as subprocess's does
        assert (await ex(Command(command="pwd", shell=True, cwd="/tmp"))).stdout == "/tmp\n"
        with pytest.raises(CommandTimeoutError):
            await ex(Command(command=["sleep", "10"], timeout=0.2))
        with pytest.raises(NonZeroExitCodeError, match="exit code 1"):
            await ex(Command(command="false", shell=True, check=True))
        with pytest.raises(FileNotFoundError):
            await ex(Command(command=["no-such-program"]))

    with_runtime(svc, body, session=False)


def test_files_read_write_and_upload(svc: ClusterHarness, tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "a.txt").write_text("A")
    (src / "sub" / "run.sh").write_text("#!/bin/sh\necho ran\n")
    (src / "sub" / "run.sh").chmod(0o755)
    single = tmp_path / "one.txt"
    single.write_text("one")

    async def body(rt: DSecRuntime) -> None:
        await rt.write_file(WriteFileRequest(path="/deep/new/dir/f.txt", content="x\r\ny\n"))
        # read_text's universal newlines, as SWE-ReX's server reads
        assert (await rt.read_file(ReadFileRequest(path="/deep/new/dir/f.txt"))).content == "x\ny\n"
        with pytest.raises(FileNotFoundError):
            await rt.read_file(ReadFileRequest(path="/deep/missing"))
        await rt.execute(Command(command="printf '#!/bin/sh\\n' > /s.sh && chmod 750 /s.sh", shell=True, check=True))
        await rt.write_file(WriteFileRequest(path="/s.sh", content="#!/bin/sh\necho new\n"))
        assert (await rt.execute(Command(command=["/s.sh"]))).stdout == "new\n"  # kept its mode
        await rt.upload(UploadRequest(source_path=str(single), target_path="/up/one/one.txt"))
        await rt.upload(UploadRequest(source_path=str(src), target_path="/up/tree"))
        r = await rt.execute(Command(command="cat /up/one/one.txt /up/tree/a.txt; /up/tree/sub/run.sh", shell=True))
        assert r.stdout == "oneAran\n"
        with pytest.raises(ValueError):
            await rt.upload(UploadRequest(source_path=str(tmp_path / "nothing"), target_path="/x"))
        assert os.stat(src / "sub" / "run.sh").st_mode & stat.S_IXUSR

    with_runtime(svc, body, session=False)


def test_closing_ends_the_shells_and_their_jobs(svc: ClusterHarness) -> None:
    async def body(rt: DSecRuntime) -> None:
        await rt.run_in_session(A("(sleep 1000) &"))
        await rt.run_in_session(A("true"))  # the syntax checker's shell runs too
        ps = "ps -o args | grep -v grep"
        before = (await rt.execute(Command(command=ps, shell=True))).stdout
        assert "sleep 1000" in before and "bash --noprofile" in before
        await rt.close_session(CloseBashSessionRequest())
        await rt.close()
        for _ in range(50):
            after = (await rt.execute(Command(command=ps, shell=True))).stdout
            if "sleep 1000" not in after and "bash" not in after:
                break
            await asyncio.sleep(0.1)
        assert "sleep 1000" not in after and "bash" not in after, after

    with_runtime(svc, body)


def test_each_call_from_a_new_event_loop(svc: ClusterHarness) -> None:
    """mini-swe-agent's SWE-ReX environments call ``asyncio.run(runtime.execute(...))`` per
    command: every call on a new loop. The sessions' terminals must outlive those loops."""

    def calls() -> None:
        d = deployment(svc)
        asyncio.run(d.start())
        try:
            asyncio.run(d.runtime.create_session(CreateBashSessionRequest()))
            asyncio.run(d.runtime.run_in_session(A("export N=1")))
            for i in range(3):
                obs = asyncio.run(d.runtime.run_in_session(A("echo $N; N=$((N + 1))")))
                assert obs.output == f"{i + 1}\n"
            assert asyncio.run(d.runtime.execute(Command(command="echo x", shell=True))).stdout == "x\n"
            assert asyncio.run(d.is_alive())
        finally:
            asyncio.run(d.stop())

    svc.run(asyncio.to_thread(calls), timeout=120)


def test_start_waits_for_room_and_a_start_given_up_leaves_no_sandbox(svc: ClusterHarness) -> None:
    from swerex.exceptions import DeploymentStartupError

    from dsec import ImageRef, Resources, SandboxSpec
    from dsec.errors import Backpressure

    async def go() -> None:
        async with svc.client() as c:
            big = SandboxSpec(image=ImageRef(base=BASH_IMAGE), resources=Resources(cpu=4, memory=64 << 20))
            blockers = []
            try:
                for _ in range(64):  # fill the edge's CPU budget, whatever the host's size
                    try:
                        blockers.append(await c.create(big, labels={"job": "blocker"}))
                    except Backpressure:
                        break
                else:
                    pytest.skip("the edge took 64 sandboxes of 4 cores: no backpressure to test")
                d = DSecDeployment(image=BASH_IMAGE, url=svc.cluster.url, token=svc.cluster.admin_token,
                                   resources={"cpu": 4, "memory": 64 << 20}, labels={"job": "waiter"},
                                   startup_timeout=60)
                start = asyncio.create_task(d.start())
                await asyncio.sleep(1.5)
                assert not start.done()  # waiting for room, not failed
                await blockers.pop().close()
                await asyncio.wait_for(start, 60)
                assert (await d.runtime.execute(Command(command="echo up", shell=True))).stdout == "up\n"
                await d.stop()
                # given up mid-create (a timeout far shorter than a create): nothing is left behind
                quick = DSecDeployment(image=BASH_IMAGE, url=svc.cluster.url, token=svc.cluster.admin_token,
                                       resources={"cpu": 0.1, "memory": 64 << 20}, labels={"job": "given-up"},
                                       startup_timeout=0.001)
                with pytest.raises(DeploymentStartupError):
                    await quick.start()
                assert [s.id for s in await c.list(labels={"job": "given-up"})] == []
            finally:
                for b in blockers:
                    await b.close()

    svc.run(go(), timeout=180)
