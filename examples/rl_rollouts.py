"""An RL-shaped rollout loop on DSec, with no model: a scripted policy stands in for it.

Two kinds of episodes, as a trainer (verl, SkyRL) runs them each step:

1. **Code generation, rewarded by SandboxFusion.** For each prompt the policy samples a
   group of programs; each program is run on every test case through the SandboxFusion
   API that DSec serves (``POST <endpoint>/run_code``, one request per test case, 64 in
   flight, as verl's reward does); the reward is the fraction of cases passed, and the
   group-relative advantage (GRPO) is printed.
2. **A multi-turn SWE-style task in DSec sandboxes**, driven through SWE-ReX's runtime
   interface (what SWE-agent uses): each episode gets its own sandbox with a small repo
   whose test fails; the policy looks around, runs the tests, edits a file, runs them
   again; the reward is the final test run's exit code.

Run it against ``dsec up`` (``dsec image build --toolchains python`` first: the code runs
in ``tc-python``, and so does the SWE task)::

    export DSEC_URL=http://127.0.0.1:7070 DSEC_TOKEN=$(cat /var/lib/dsec/control/admin.token)
    python examples/rl_rollouts.py                 # both parts
    python examples/rl_rollouts.py --part swe -n 16

The lines a verl or SkyRL user changes to train on DSec (docs/COMPAT.md):

- verl (code rewards):  ``reward.sandbox_fusion.url=http://DSEC_HOST:7070/sandboxfusion/<token>/run_code``
  (``reward.sandbox_fusion.max_concurrent=64`` as before; the sandboxes count against the
  token's project);
- SkyRL (skyrl-agent's code-interpreter tool):
  ``SANDBOX_FUSION_URL=http://DSEC_HOST:7070/sandboxfusion/<token>``;
- anything on the ``sandbox-fusion`` client: ``SANDBOX_FUSION_ENDPOINT=<the same>``;
- SWE-agent / SWE-ReX: ``DSecDeployment(image=...)`` where ``DockerDeployment(image=...)`` was;
- mini-swe-agent: ``environment_class: dsec.compat.minisweagent.DSecEnvironment``;
- Harbor: ``harbor run --env dsec.compat.harbor:DSecEnvironment --ek image=...``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import time
from dataclasses import dataclass

import httpx

# ---------------------------------------------------------------- part 1 ----

PROBLEMS = [
    {
        "prompt": "Read two integers from stdin and print their sum.",
        "tests": [("1 2\n", "3"), ("-5 5\n", "0"), ("100 23\n", "123")],
        "samples": [  # what a policy might sample: right, wrong, broken, too slow
            "a, b = map(int, input().split())\nprint(a + b)\n",
            "a, b = map(int, input().split())\nprint(a - b)\n",
            "print(sum(map(int, input().split()))\n",
            "import sys\nprint(sum(int(x) for x in sys.stdin.read().split()))\n",
            "while True:\n    pass\n",
            "a, b = input().split()\nprint(a + b)\n",
        ],
    },
    {
        "prompt": "Read n from stdin and print the n-th Fibonacci number (F(0)=0).",
        "tests": [("0\n", "0"), ("1\n", "1"), ("10\n", "55"), ("30\n", "832040")],
        "samples": [
            "n = int(input())\na, b = 0, 1\nfor _ in range(n):\n    a, b = b, a + b\nprint(a)\n",
            "def f(n):\n    return n if n < 2 else f(n - 1) + f(n - 2)\nprint(f(int(input())))\n",
            "n = int(input())\nprint(n * (n + 1) // 2)\n",
            "n = int(input())\na, b = 1, 1\nfor _ in range(n):\n    a, b = b, a + b\nprint(a)\n",
        ],
    },
]


def endpoint() -> str:
    """SANDBOX_FUSION_ENDPOINT, or DSec's own on $DSEC_URL with $DSEC_TOKEN in the path."""
    given = os.environ.get("SANDBOX_FUSION_ENDPOINT")
    if given:
        return given.rstrip("/")
    return f"{os.environ['DSEC_URL'].rstrip('/')}/sandboxfusion/{os.environ['DSEC_TOKEN']}"


async def run_case(http: httpx.AsyncClient, sem: asyncio.Semaphore, code: str, stdin: str, want: str) -> bool:
    """One test case, one request, as verl's sandbox_fusion reward sends it."""
    body = {"code": code, "language": "python", "stdin": stdin, "run_timeout": 5, "memory_limit_MB": 256}
    async with sem:
        for attempt in range(5):
            r = await http.post(f"{endpoint()}/run_code", json=body)
            if r.status_code in (429, 503, 504):  # no sandbox free yet: back off as verl's client does
                await asyncio.sleep(float(r.headers.get("retry-after", 1)) * (attempt + 1))
                continue
            r.raise_for_status()
            res = r.json()
            if res["status"] == "SandboxError":  # the call could not run: not the program's fault
                await asyncio.sleep(attempt + 1)
                continue
            out = (res.get("run_result") or {}).get("stdout") or ""
            return bool(res["status"] == "Success" and out.strip() == want)
    raise RuntimeError(f"run_code kept failing: {r.status_code} {r.text[:200]}")


async def code_rewards(group: int, concurrency: int) -> None:
    sem = asyncio.Semaphore(concurrency)
    rng = random.Random(0)
    t0 = time.monotonic()
    async with httpx.AsyncClient(timeout=120) as http:
        for problem in PROBLEMS:
            programs = [rng.choice(problem["samples"]) for _ in range(group)]

            async def reward(code: str, problem: dict = problem) -> float:
                passed = await asyncio.gather(*(run_case(http, sem, code, i, o) for i, o in problem["tests"]))
                return sum(passed) / len(passed)

            rewards = await asyncio.gather(*(reward(p) for p in programs))
            mean, std = statistics.mean(rewards), statistics.pstdev(rewards) or 1.0
            advantages = [(r - mean) / std for r in rewards]
            print(f"[code] {problem['prompt'][:48]:48}  rewards {' '.join(f'{r:.2f}' for r in rewards)}")
            print(f"[code] {'':48}  advantages {' '.join(f'{a:+.1f}' for a in advantages)}")
    n = sum(len(p["tests"]) for p in PROBLEMS) * group
    print(f"[code] {n} run_code calls in {time.monotonic() - t0:.1f} s")


# ---------------------------------------------------------------- part 2 ----

REPO = {
    "/work/calc.py": "def mean(xs):\n    return sum(xs) / (len(xs) - 1)\n",
    "/work/test_calc.py": "from calc import mean\n\nassert mean([1, 2, 3]) == 2, mean([1, 2, 3])\nprint('1 passed')\n",
}
FIX = "def mean(xs):\n    return sum(xs) / len(xs)\n"


@dataclass
class Episode:
    index: int
    turns: int = 0
    reward: float = 0.0
    error: str = ""


def scripted_policy(observation: str, turn: int, rng: random.Random) -> tuple[str, str]:
    """Stands in for the model: (kind, argument). Some episodes 'forget' to fix the bug."""
    plan = [("bash", "cd /work && ls && cat calc.py"),
            ("bash", "cd /work && python3 test_calc.py 2>&1 | tail -3"),
            ("edit", FIX if rng.random() < 0.75 else "def mean(xs):\n    return sum(xs) / max(len(xs) - 1, 1)\n"),
            ("bash", "cd /work && python3 test_calc.py"),
            ("submit", "")]
    return plan[min(turn, len(plan) - 1)]


async def swe_episode(i: int, args: argparse.Namespace) -> Episode:
    from swerex.runtime.abstract import BashAction, CreateBashSessionRequest, WriteFileRequest

    from dsec.compat.swerex import DSecDeployment

    ep = Episode(i)
    rng = random.Random(i)
    deployment = DSecDeployment(image=args.image, toolkits=args.toolkit, labels={"example": "rl-swe"},
                                resources={"cpu": 0.5, "memory": 512 << 20, "disk": 256 << 20})
    try:
        await deployment.start()  # waits for room while DSec answers Backpressure (startup_timeout)
        rt = deployment.runtime
        for path, text in REPO.items():
            await rt.write_file(WriteFileRequest(path=path, content=text))
        await rt.create_session(CreateBashSessionRequest())
        observation = "the task: tests in /work fail; fix calc.py"
        for turn in range(8):
            kind, arg = scripted_policy(observation, turn, rng)
            ep.turns += 1
            if kind == "bash":
                obs = await rt.run_in_session(BashAction(command=arg, timeout=60, check="silent"))
                observation = f"exit {obs.exit_code}\n{obs.output}"
            elif kind == "edit":
                await rt.write_file(WriteFileRequest(path="/work/calc.py", content=arg))
                observation = "edited"
            else:
                break
        final = await rt.run_in_session(BashAction(command="cd /work && python3 test_calc.py", timeout=60,
                                                   check="silent"))
        ep.reward = 1.0 if final.exit_code == 0 else 0.0
    except Exception as exc:  # an episode that fails is reported, the batch goes on
        ep.error = f"{type(exc).__name__}: {exc}"
    finally:
        await deployment.stop()
    return ep


async def swe_rollouts(args: argparse.Namespace) -> None:
    sem = asyncio.Semaphore(args.concurrency)

    async def one(i: int) -> Episode:
        async with sem:
            return await swe_episode(i, args)

    t0 = time.monotonic()
    episodes = await asyncio.gather(*(one(i) for i in range(args.n)))
    for ep in episodes:
        print(f"[swe] episode {ep.index:3}: {ep.turns} turns, reward {ep.reward:.0f} {ep.error}")
    ok = [e for e in episodes if not e.error]
    print(f"[swe] {len(episodes)} episodes in {time.monotonic() - t0:.1f} s; "
          f"mean reward {statistics.mean(e.reward for e in ok) if ok else 0:.2f}; {len(episodes) - len(ok)} failed")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--part", choices=["code", "swe", "both"], default="both")
    p.add_argument("-n", type=int, default=8, help="SWE episodes")
    p.add_argument("--group", type=int, default=8, help="programs sampled per prompt")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--image", default="tc-base:bookworm", help="DSec base layer of the SWE sandboxes")
    p.add_argument("--toolkit", action="append", default=None,
                   help="toolkit layers on it (default: tc-python:bookworm)")
    args = p.parse_args()
    if args.toolkit is None:
        args.toolkit = ["tc-python:bookworm"]
    if args.part in ("code", "both"):
        asyncio.run(code_rewards(args.group, args.concurrency))
    if args.part in ("swe", "both"):
        asyncio.run(swe_rollouts(args))


if __name__ == "__main__":
    main()
