"""SandboxFusion compatibility, the parts with no service: the wire models against the released
client's (``sandbox-fusion`` 0.3.7), the status rules, the language table, the window that
absorbs backpressure, the toolchain names, the control plane's routes and config.

Everything that runs code is in tests/e2e/test_sandboxfusion_e2e.py (a real ``dsec up``).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
import sandbox_fusion as sf  # the released client: its own models and helpers
from pydantic import ValidationError

from dsec.compat.sandboxfusion import languages
from dsec.compat.sandboxfusion.config import SandboxFusionConfig
from dsec.compat.sandboxfusion.models import (
    CellRunResult,
    CommandRunResult,
    CommandRunStatus,
    RunCodeRequest,
    RunCodeResponse,
    RunJupyterRequest,
    RunJupyterResponse,
    RunStatus,
    run_status,
)
from dsec.compat.window import Window, WindowTimeout
from dsec.images.toolchains import TOOLCHAINS, image_for, parse_toolchains, toolkit_name

# ----------------------------------------------------------- wire models ----


@pytest.mark.parametrize(("ours", "theirs"), [(RunCodeRequest, sf.RunCodeRequest),
                                              (RunJupyterRequest, sf.RunJupyterRequest)])
def test_every_field_the_client_sends_is_read_with_its_default(ours: Any, theirs: Any) -> None:
    for name, field in theirs.__fields__.items():  # pydantic v1 API of the client's models
        assert name in ours.model_fields, name
        if not field.required:
            assert ours.model_fields[name].get_default(call_default_factory=True) == field.default, name


def test_requests_the_client_builds_parse_as_ours() -> None:
    req = sf.RunCodeRequest(code="print(1)", language="python", stdin="x", files={"a.txt": "aGk="},
                            fetch_files=["a.txt"], compile_timeout=3, run_timeout=4)
    ours = RunCodeRequest.model_validate(req.dict())
    assert (ours.code, ours.language, ours.stdin, ours.compile_timeout, ours.run_timeout) == ("print(1)", "python",
                                                                                             "x", 3, 4)
    assert ours.memory_limit_MB == -1  # the released client has no such field: the server's default
    verl = {"compile_timeout": 10, "run_timeout": 10, "code": "x", "stdin": "", "memory_limit_MB": 256,
            "language": "cpp", "files": {}, "fetch_files": []}  # what verl's reward code posts
    assert RunCodeRequest.model_validate(verl).memory_limit_MB == 256
    jup = RunJupyterRequest.model_validate(sf.RunJupyterRequest(cells=["a = 1", "a"]).dict())
    assert (jup.cells, jup.total_timeout, jup.cell_timeout, jup.kernel) == (["a = 1", "a"], 45, 0, "python3")


def test_answers_parse_as_the_clients() -> None:
    stage = CommandRunResult(status=CommandRunStatus.Finished, execution_time=0.1, return_code=0, stdout="1\n",
                             stderr="", cpu_time=0.01)
    resp = RunCodeResponse(status=RunStatus.Success, message="", run_result=stage, executor_pod_name="e1-x",
                           files={"a": "aGk="})
    theirs = sf.RunCodeResponse(**json.loads(resp.model_dump_json()))
    assert theirs.status == sf.RunStatus.Success and theirs.run_result.stdout == "1\n"
    assert theirs.run_result.cpu_time == 0.01 and theirs.compile_result is None and theirs.files == {"a": "aGk="}
    assert sf.summary_run_code_result(theirs, sf.SummaryMapping()) == "Success"
    tle = RunCodeResponse(status=RunStatus.Failed, message="",
                          run_result=CommandRunResult(status=CommandRunStatus.TimeLimitExceeded, execution_time=1))
    mapping = sf.SummaryMapping(RunTimeout="timeout", CompileFailed="ce")
    assert sf.summary_run_code_result(sf.RunCodeResponse(**json.loads(tle.model_dump_json())), mapping) == "timeout"
    ce = RunCodeResponse(status=RunStatus.Failed, message="",
                         compile_result=CommandRunResult(status=CommandRunStatus.Finished, return_code=1))
    assert sf.summary_run_code_result(sf.RunCodeResponse(**json.loads(ce.model_dump_json())), mapping) == "ce"
    cell = CellRunResult(stdout="x\n", stderr="", display=[{"text/plain": "1"}], error=[])
    jup = RunJupyterResponse(status=RunStatus.Success, message="", driver=stage, cells=[cell])
    parsed = sf.RunJupyterResponse(**json.loads(jup.model_dump_json()))
    assert parsed.cells[0].display == [{"text/plain": "1"}]
    assert {s.value for s in RunStatus} == {s.value for s in sf.RunStatus}
    assert {s.value for s in CommandRunStatus} == {s.value for s in sf.CommandRunStatus}


def test_a_body_sandboxfusion_would_refuse_is_refused() -> None:
    with pytest.raises(ValidationError):
        RunCodeRequest.model_validate({"code": "x", "language": "cobol"})
    with pytest.raises(ValidationError):
        RunCodeRequest.model_validate({"language": "python"})
    with pytest.raises(ValidationError):
        RunCodeRequest.model_validate({"code": "x", "language": "python", "run_timeout": 0})
    # unknown fields are ignored, as SandboxFusion's server does
    assert RunCodeRequest.model_validate({"code": "x", "language": "python", "new_field": 1}).code == "x"


def _stage(status: CommandRunStatus, rc: int | None = None, err: str = "") -> CommandRunResult:
    return CommandRunResult(status=status, return_code=rc, stderr=err)


def test_the_overall_status_follows_sandboxfusions_rules() -> None:
    ok, fail, tle = CommandRunStatus.Finished, CommandRunStatus.Finished, CommandRunStatus.TimeLimitExceeded
    assert run_status(None, _stage(ok, 0)) == (RunStatus.Success, "")
    assert run_status(_stage(ok, 0), _stage(ok, 0)) == (RunStatus.Success, "")
    assert run_status(_stage(fail, 1), None) == (RunStatus.Failed, "")
    assert run_status(_stage(ok, 0), _stage(fail, -9)) == (RunStatus.Failed, "")
    assert run_status(_stage(tle), None) == (RunStatus.Failed, "")
    assert run_status(_stage(CommandRunStatus.Error, err="boom"), None) == (RunStatus.SandboxError, "boom")


# -------------------------------------------------------------- languages ----


def test_every_language_runs_on_a_known_toolchain_and_the_issues_list_is_served() -> None:
    for name, recipe in languages.RECIPES.items():
        assert recipe.toolchain in TOOLCHAINS, name
        assert name in RunCodeRequest.model_fields["language"].annotation.__args__, name  # type: ignore[union-attr]
    assert {"python", "pytest", "cpp", "c", "go", "java", "nodejs", "typescript", "rust", "bash"} <= set(
        languages.RECIPES)
    assert languages.JUPYTER.toolchain in TOOLCHAINS


def test_commands_run_as_one_argv_without_a_shell_and_the_module_says_so() -> None:
    """The service runs ``languages.argv(cmd)`` (shlex.split) with no shell in between, as
    docs/COMPAT.md says: no recipe may rely on shell syntax, and the module's own account
    agrees (it used to say ``sh -c``)."""
    recipes = [*languages.RECIPES.values(), languages.JUPYTER]
    for recipe in recipes:
        compile_, run = languages.commands(recipe, ["Main.java", "a b.jar", "x;y.jar"])
        for cmd in (compile_, run):
            if cmd is not None:
                assert languages.shell_syntax(cmd) == [], (recipe, cmd)
    assert languages.argv("g++ main.cpp -o main") == ["g++", "main.cpp", "-o", "main"]
    assert languages.shell_syntax("make && ./main > out") == ["&&", ">"]
    doc = languages.__doc__ or ""
    assert "sh -c" not in doc and "shlex.split" in doc and "no shell" in doc


def test_java_puts_the_requests_jars_on_the_class_path_quoted() -> None:
    compile_, run = languages.commands(languages.RECIPES["java"], ["Main.java", "lib/a b.jar", "x.txt"])
    assert compile_ == "javac -cp .:/usr/share/java/javatuples.jar:'lib/a b.jar' Main.java"
    assert run == "java -cp .:/usr/share/java/javatuples.jar:'lib/a b.jar' -ea Main"
    assert languages.commands(languages.RECIPES["python"], ["a.jar"]) == (None, "python3 main.py")


def test_toolchain_names_and_images() -> None:
    assert parse_toolchains("cpp, python") == ["python", "cpp"]  # table order
    assert parse_toolchains("all") == [t for t in TOOLCHAINS if not t.startswith("sf-")]  # library layers: a profile
    with pytest.raises(ValueError, match="unknown toolchain 'cobol'"):
        parse_toolchains("python,cobol")
    assert image_for("cpp") == ("tc-base:bookworm", ("tc-cpp:bookworm",))
    assert image_for("bash", "trixie") == ("tc-base:trixie", ())
    assert toolkit_name("go") == "tc-go"


def test_config_bounds() -> None:
    assert SandboxFusionConfig().prefix == "/sandboxfusion"
    assert SandboxFusionConfig(prefix="/api/sf").prefix == "/api/sf"
    for bad in ("sandboxfusion", "/", "/a/", "/A"):
        with pytest.raises(ValidationError):
            SandboxFusionConfig(prefix=bad)


# ----------------------------------------------------------------- window ----


def test_the_window_serves_waiters_in_order_and_learns_from_refusals() -> None:
    async def go() -> None:
        loop = asyncio.get_running_loop()
        w = Window(4, probe_s=10)
        for _ in range(4):
            await w.acquire(loop.time() + 1)
        order: list[int] = []

        async def waiter(i: int) -> None:
            await w.acquire(loop.time() + 5)
            order.append(i)

        tasks = [asyncio.create_task(waiter(i)) for i in range(3)]
        await asyncio.sleep(0.01)
        assert w.waiting == 3 and not order
        w.release()
        await asyncio.sleep(0.01)
        assert order == [0]
        # a refusal (made holding a slot): the window shrinks to what else runs
        w.refused()
        assert int(w.cap) == 3 and w.refusals == 1
        w.release()  # the refused one gives its slot back: 3 in flight, cap 3 -> nobody goes
        await asyncio.sleep(0.01)
        assert order == [0]
        w.admitted()  # a create got through: the window grows (by 1/cap)...
        w.release()
        await asyncio.sleep(0.01)
        assert order == [0, 1]
        w.release()
        await asyncio.sleep(0.01)
        assert order == [0, 1, 2]
        await asyncio.gather(*tasks)
        assert w.stats()["waits"] == 3

    asyncio.run(go())


def test_a_refused_request_goes_back_to_the_head_and_waiting_has_a_deadline() -> None:
    async def go() -> None:
        loop = asyncio.get_running_loop()
        w = Window(1, probe_s=10)
        await w.acquire(loop.time() + 1)
        got: list[str] = []

        async def waiter(name: str, again: bool) -> None:
            await w.acquire(loop.time() + 5, again=again)
            got.append(name)
            w.release()

        first = asyncio.create_task(waiter("queued", False))
        await asyncio.sleep(0.01)
        second = asyncio.create_task(waiter("refused", True))
        await asyncio.sleep(0.01)
        w.release()
        await asyncio.gather(first, second)
        assert got == ["refused", "queued"]
        await w.acquire(loop.time() + 1)
        with pytest.raises(WindowTimeout):
            await w.acquire(loop.time() + 0.05)
        assert w.timeouts == 1 and w.waiting == 0
        full = Window(1, max_waiting=0)
        await full.acquire(loop.time() + 1)
        with pytest.raises(WindowTimeout, match="waiting already"):
            await full.acquire(loop.time() + 1)

    asyncio.run(go())


def test_the_head_probes_for_room_freed_elsewhere() -> None:
    async def go() -> None:
        loop = asyncio.get_running_loop()
        w = Window(8, probe_s=0.02)
        await w.acquire(loop.time() + 1)
        await w.acquire(loop.time() + 1)
        w.refused()  # cap 1 with 2 in flight
        w.release()  # 1 in flight, cap 1
        t0 = loop.time()
        await w.acquire(loop.time() + 1)  # nothing ends: after probe_s the head widens the window
        assert 0.015 < loop.time() - t0 < 0.5 and w.inflight == 2

    asyncio.run(go())


def test_a_request_answered_504_keeps_its_place_for_its_retry() -> None:
    """verl's pattern: a waiter gives up (504), a newer request arrives, a slot frees, then the
    first comes back with the same key: the slot was held for it, not given to the newcomer."""
    async def go() -> None:
        loop = asyncio.get_running_loop()
        w = Window(1, probe_s=10, hold_s=2.0)
        await w.acquire(loop.time() + 1)  # the one slot, busy
        with pytest.raises(WindowTimeout):
            await w.acquire(loop.time() + 0.05, key="verl-case-7")  # gives up: its place is kept
        assert w.waiting == 1
        order: list[str] = []

        async def newcomer() -> None:
            await w.acquire(loop.time() + 5, key="other")
            order.append("newcomer")
            w.release()

        late = asyncio.create_task(newcomer())
        await asyncio.sleep(0.05)
        w.release()  # the slot frees while the first request sleeps before its retry
        await asyncio.sleep(0.2)
        assert order == [] and w.inflight == 0  # held: the newcomer did not take it
        await w.acquire(loop.time() + 1, key="verl-case-7")  # the retry takes its place
        order.append("retry")
        assert w.kept == 1
        w.release()
        await late
        assert order == ["retry", "newcomer"]

    asyncio.run(go())


def test_a_kept_place_nobody_comes_back_for_lapses() -> None:
    async def go() -> None:
        loop = asyncio.get_running_loop()
        w = Window(1, probe_s=10, hold_s=0.2)
        await w.acquire(loop.time() + 1)
        with pytest.raises(WindowTimeout):
            await w.acquire(loop.time() + 0.02, key="gone")
        got: list[float] = []

        async def newcomer() -> None:
            await w.acquire(loop.time() + 5)
            got.append(loop.time())

        t0 = loop.time()
        task = asyncio.create_task(newcomer())
        await asyncio.sleep(0.01)
        w.release()
        await task
        assert 0.1 < got[0] - t0 < 1.0 and w.lapsed == 1 and w.waiting == 0  # held until it lapsed, then served
        with pytest.raises(WindowTimeout):  # without a key nothing is kept
            await w.acquire(loop.time() + 0.02)
        assert w.waiting == 0

    asyncio.run(go())


# ------------------------------------------------------------------ routes ----


def test_the_control_plane_serves_the_routes_and_can_leave_them_out(tmp_path: Any) -> None:
    from dsec.control.app import create_app
    from dsec.control.config import ControlConfig

    app = create_app(ControlConfig(data_dir=tmp_path))
    paths = {getattr(r, "path", "") for r in app.routes}
    for p in ("/sandboxfusion/v1/ping", "/sandboxfusion/{token}/v1/ping", "/sandboxfusion/run_code",
              "/sandboxfusion/{token}/run_code", "/sandboxfusion/run_jupyter", "/sandboxfusion/{token}/run_jupyter"):
        assert p in paths, p
    off = create_app(ControlConfig(data_dir=tmp_path, sandboxfusion=SandboxFusionConfig(enabled=False)))
    assert not any("sandboxfusion" in getattr(r, "path", "") for r in off.routes)
    assert off.state.sandboxfusion is None


def test_dsec_up_takes_a_sandboxfusion_section(tmp_path: Any) -> None:
    import click

    from dsec.cli.up import load_control_overrides

    f = tmp_path / "control.toml"
    f.write_text('[sandboxfusion]\nqueue_timeout_s = 2.5\nprefix = "/sf"\n')
    assert load_control_overrides(f) == {"sandboxfusion": {"queue_timeout_s": 2.5, "prefix": "/sf"}}
    f.write_text('[sandboxfusion]\nqueue_timeout = 2.5\n')  # a typo fails before anything starts
    with pytest.raises(click.BadParameter, match=r"sandboxfusion\.queue_timeout"):
        load_control_overrides(f)
    f.write_text('port = 9\n')  # dsec up sets these itself
    with pytest.raises(click.BadParameter, match="sets port itself"):
        load_control_overrides(f)


# ------------------------------------------- more languages, profiles (issue 27) ----


def test_sandboxfusions_languages_are_served_or_answered_as_it_answers_a_missing_runner() -> None:
    """Every language SandboxFusion's server runs is either served (a recipe on a toolchain)
    or listed as unavailable with the stage and program it would lack; none is both."""
    known = set(RunCodeRequest.model_fields["language"].annotation.__args__)  # type: ignore[union-attr]
    assert set(languages.SANDBOXFUSION_LANGUAGES) <= known
    for lang in languages.SANDBOXFUSION_LANGUAGES:
        assert (lang in languages.RECIPES) != (lang in languages.UNAVAILABLE), lang
    assert set(languages.UNAVAILABLE) == {"julia", "swift", "lean", "cuda", "python_gpu"}
    assert len(languages.served()) == 23 and len(languages.SANDBOXFUSION_LANGUAGES) == 28
    entry, stderr = languages.unavailable("swift")
    assert (entry.stage, stderr) == ("compile", "/bin/bash: line 1: swiftc: command not found\n")
    for name in ("php", "csharp", "ruby", "perl", "lua", "R", "scala", "kotlin_script", "D_ut", "racket", "jest",
                 "junit", "verilog"):
        assert languages.RECIPES[name].toolchain in TOOLCHAINS, name


def test_sources_are_named_and_changed_as_sandboxfusion_does() -> None:
    junit = languages.plan(languages.RECIPES["junit"], "public final class AddTest { }", ["lib/x.jar", "Util.java",
                                                                                         "AddTest.java", "a.txt"])
    assert junit.source == "AddTest.java"
    assert junit.compile == ("javac -cp .:/usr/share/java/junit-platform-console-standalone.jar:lib/x.jar "
                             "AddTest.java Util.java")  # the request's other .java files too, once each
    assert "--class-path .:/usr/share/java/junit-platform-console-standalone.jar:lib/x.jar --scan-class-path" in \
        junit.run
    assert languages.plan(languages.RECIPES["junit"], "class T {}", []).source == "Main.java"  # no public class
    scala = languages.plan(languages.RECIPES["scala"], "object Adder extends App {}", [])
    assert (scala.compile, scala.run) == ("scalac main.scala", "scala Adder")
    with pytest.raises(languages.PlanError, match=r"^Object name not found\.$"):
        languages.plan(languages.RECIPES["scala"], "println(1)", [])
    assert languages.plan(languages.RECIPES["php"], "  echo 1;", []).code == "<?php\necho 1;"
    assert languages.plan(languages.RECIPES["php"], "<?php echo 1;", []).code == "<?php echo 1;"
    cs = languages.plan(languages.RECIPES["csharp"], "class P {}", []).code
    assert cs.startswith("using System;") and cs.endswith("\n#line 1\nclass P {}")  # line numbers stay the code's
    for recipe in languages.RECIPES.values():  # still no shell syntax, with every placeholder filled
        p = languages.plan(recipe, "object O {} public class C {}", ["a b.jar", "B.java"])
        for cmd in (p.compile, p.run):
            assert cmd is None or (languages.shell_syntax(cmd) == [] and "{" not in cmd), (recipe, cmd)


def test_profiles_stack_library_layers_over_toolkits() -> None:
    assert image_for("python", profile="sandboxfusion") == ("tc-base:bookworm",
                                                            ("tc-python:bookworm", "tc-sf-python:bookworm"))
    assert image_for("jupyter", profile="sandboxfusion")[1][-1] == "tc-sf-python:bookworm"
    assert image_for("typescript", profile="sandboxfusion")[1] == ("tc-typescript:bookworm", "tc-sf-node:bookworm")
    assert image_for("cpp", profile="sandboxfusion") == image_for("cpp")  # nothing to add
    assert image_for("python") == ("tc-base:bookworm", ("tc-python:bookworm",))
    # asking for typescript with the profile builds nodejs too (sf-node is built over it), in table order
    assert parse_toolchains("typescript", "sandboxfusion") == ["nodejs", "typescript", "sf-node"]
    assert parse_toolchains("sf-go") == ["go", "sf-go"]
    for name, tc in TOOLCHAINS.items():
        if tc.over is not None:
            assert list(TOOLCHAINS).index(tc.over) < list(TOOLCHAINS).index(name)
    with pytest.raises(ValueError, match="unknown profile 'conda'"):
        parse_toolchains("python", "conda")
    assert SandboxFusionConfig().profile is None
    assert SandboxFusionConfig(profile="sandboxfusion").profile == "sandboxfusion"
    with pytest.raises(ValidationError):
        SandboxFusionConfig(profile="conda")  # type: ignore[arg-type]


def test_the_token_free_listener_is_off_by_default_and_guarded() -> None:
    from dsec.compat.sandboxfusion.config import ListenerConfig
    from dsec.compat.sandboxfusion.listener import allowed

    cfg = SandboxFusionConfig()
    assert cfg.listener.enabled is False and cfg.listener.host == "127.0.0.1" and cfg.listener.port == 8080
    with pytest.raises(ValidationError, match="project"):
        ListenerConfig(enabled=True)
    with pytest.raises(ValidationError, match="not loopback"):
        ListenerConfig(enabled=True, project="rl", host="0.0.0.0")
    with pytest.raises(ValidationError, match="/0"):
        ListenerConfig(enabled=True, project="rl", host="0.0.0.0", allow=("0.0.0.0/0",))
    with pytest.raises(ValidationError):
        ListenerConfig(allow=("10.0.0.300/8",))
    with pytest.raises(ValidationError, match="service is not"):
        SandboxFusionConfig(enabled=False, listener=ListenerConfig(enabled=True, project="rl"))
    lan = ListenerConfig(enabled=True, project="rl", host="0.0.0.0", allow=("10.1.0.0/16",)).networks()
    assert allowed("10.1.2.3", lan) and not allowed("10.2.0.1", lan) and not allowed("127.0.0.1", lan)
    assert allowed("::ffff:10.1.0.9", lan)  # an IPv4 peer on a dual-stack socket
    loop = ListenerConfig().networks()
    assert allowed("127.0.0.1", loop) and allowed("::1", loop) and not allowed("192.0.2.1", loop)
    assert not allowed(None, loop) and not allowed("not-an-address", loop)


def test_the_listener_refuses_peers_outside_allow_before_anything_runs() -> None:
    """Through the listener's own app: a peer outside ``allow`` gets 403 and no token is
    minted (the store is never touched); one inside reaches the routes."""
    import httpx

    from dsec.compat.sandboxfusion.config import ListenerConfig
    from dsec.compat.sandboxfusion.listener import ProjectToken, create_listener_app

    class NoStore:
        async def write(self, fn: Any) -> Any:
            raise AssertionError("the store was touched")

    class NoService:
        async def run_code(self, *a: Any) -> Any:
            raise AssertionError("a call ran")

    cfg = ListenerConfig(enabled=True, project="rl", host="0.0.0.0", allow=("10.1.0.0/16",))
    app = create_listener_app(NoService(), ProjectToken(NoStore(), "rl"), cfg, "http://x")  # type: ignore[arg-type]

    async def ask(peer: str) -> httpx.Response:
        transport = httpx.ASGITransport(app=app, client=(peer, 5000))
        async with httpx.AsyncClient(transport=transport, base_url="http://listener") as c:
            return await c.post("/run_code", json={"code": "print(1)", "language": "python"})

    out = asyncio.run(ask("192.0.2.7"))
    assert out.status_code == 403 and "192.0.2.7 is not allowed" in out.json()["detail"]
    with pytest.raises(AssertionError, match="the store was touched"):  # allowed: it goes on to mint a token
        asyncio.run(ask("10.1.0.5"))


def test_the_listeners_token_is_minted_once_charged_to_its_project_and_revoked(tmp_path: Any) -> None:
    """Against a real store: minted on first use for the configured project (a missing
    project is a NotFound naming it), the same token after, one left by a crash revoked at
    the next mint, and nothing valid left once the listener revokes it."""
    from dsec.compat.sandboxfusion.listener import TOKEN_NAME, ProjectToken
    from dsec.control import iam
    from dsec.control.db import Store
    from dsec.errors import AuthError, NotFound
    from dsec.spec.api import Quota

    store = Store(f"sqlite:///{tmp_path / 'c.db'}", threads=2)
    try:
        store.migrate()
        _, admin = store.run_sync(lambda s: iam.bootstrap(s, root="root", quota=Quota(sandboxes=9, cpu=9,
                                                                                      memory=9 << 30),
                                                          token_secret=None), write=True)
        assert admin is not None
        root = store.run_sync(lambda s: iam.principal_for_token(s, admin), write=False)

        async def scenario() -> None:
            tok = ProjectToken(store, "rl")
            with pytest.raises(NotFound, match="no project 'rl'"):
                await tok.get()
            store.run_sync(lambda s: iam.create_project(s, root, "rl", None, Quota(sandboxes=1, cpu=1,
                                                                                  memory=1 << 30)), write=True)
            crashed = ProjectToken(store, "rl")
            stale = await crashed.get()  # a listener that died without revoking its token
            secret = await tok.get()
            assert await tok.get() == secret and secret != stale
            who = store.run_sync(lambda s: iam.principal_for_token(s, secret), write=False)
            assert who.project == "rl" and not who.is_root
            with pytest.raises(AuthError, match="revoked"):
                store.run_sync(lambda s: iam.principal_for_token(s, stale), write=False)
            await tok.revoke()
            await tok.revoke()  # idempotent
            with pytest.raises(AuthError, match="revoked"):
                store.run_sync(lambda s: iam.principal_for_token(s, secret), write=False)
            live = [t for t in store.run_sync(lambda s: iam.list_tokens(s, root), write=False)
                    if t.name == TOKEN_NAME and t.revoked_at is None]
            assert live == []

        asyncio.run(scenario())
    finally:
        store.close()


def test_the_queue_bound_follows_what_the_clients_timeout_leaves() -> None:
    """verl's request timeout is compile + run + 10 s: a request without a compile stage may
    wait its unused compile timeout longer; one that compiles waits the floor; a configured
    queue_timeout_s is the bound, whatever the request."""
    from dsec.compat.sandboxfusion.config import SandboxFusionConfig
    from dsec.compat.sandboxfusion.service import (
        CLIENT_SLACK_S,
        QUEUE_FLOOR_S,
        QUEUE_MARGIN_S,
        SandboxFusion,
    )

    sf = SandboxFusion(SandboxFusionConfig())
    python = sf._queue_wait(10, 10, compiles=False)
    assert python == 10 + CLIENT_SLACK_S - QUEUE_MARGIN_S  # 18 s: a wave of 10 s sleepers is waited out
    assert python + 10 < 10 + 10 + CLIENT_SLACK_S  # and the call still ends inside verl's timeout
    assert sf._queue_wait(10, 10, compiles=True) == QUEUE_FLOOR_S  # nothing to spare: the floor
    assert sf._queue_wait(1, 1, compiles=False) == QUEUE_FLOOR_S  # never below it
    fixed = SandboxFusion(SandboxFusionConfig(queue_timeout_s=2.5))
    assert fixed._queue_wait(10, 10, compiles=False) == 2.5 == fixed._queue_wait(10, 10, compiles=True)
