"""Unit tests (no root) of the edge's and the CLI's policy plumbing: the platform addresses
added to ``blocked``, which specs a warm pool may serve, and the CLI's flag parsing."""

from __future__ import annotations

import json
from pathlib import Path

import click
import pytest

from dsec.cli.policy import PolicyArgs, parse_cidr_rule
from dsec.cli.up import load_edge_overrides
from dsec.edge.config import EdgeConfig
from dsec.edge.pools import pool_eligible
from dsec.edge.service import platform_blocked
from dsec.spec import FileRules, ImageRef, NetRule, NetworkPolicy, SandboxSpec, Stage

KEY = "00" * 32
SPEC = SandboxSpec(image=ImageRef(base="busybox:latest"))


def test_platform_addresses_are_blocked() -> None:
    cfg = EdgeConfig(edge_id="e1", cluster_key=KEY, host="0.0.0.0", url="http://192.0.2.10:7071",
                     control_plane_url="http://198.51.100.5:7070", network={"blocked": ["192.0.2.0/24"]})
    # the edge's advertised address is inside a blocked range already (nftables refuses overlaps)
    assert platform_blocked(cfg) == ("192.0.2.0/24", "198.51.100.5/32")
    local = EdgeConfig(edge_id="e1", cluster_key=KEY, host="127.0.0.1", control_plane_url="http://localhost:7070",
                       network={})
    assert platform_blocked(local) == ()  # loopback is refused by the runtime anyway
    v6 = EdgeConfig(edge_id="e1", cluster_key=KEY, host="::1", url="http://[2001:db8::1]:7071", network={})
    assert platform_blocked(v6) == ()  # sandboxes have IPv4 only
    assert EdgeConfig(edge_id="e1", cluster_key=KEY).network is None


def test_pools_serve_only_specs_without_network() -> None:
    assert pool_eligible(SPEC)
    assert not pool_eligible(SPEC.model_copy(update={"network": NetworkPolicy(allow=("pypi",))}))
    files_only = SandboxSpec(image=SPEC.image, stages={"eval": Stage(files=FileRules(read_only=("/etc",)))},
                             stage="eval")
    assert pool_eligible(files_only)
    networked_stage = SandboxSpec(image=SPEC.image, stages={"s": Stage(network=NetworkPolicy())}, stage="s")
    assert not pool_eligible(networked_stage)
    # the spec's own network is ignored when it starts in a stage without one
    assert pool_eligible(files_only.model_copy(update={"network": NetworkPolicy(allow=("pypi",))}))


def test_cli_rules_and_stages(tmp_path: Path) -> None:
    assert parse_cidr_rule("10.0.0.0/8:443/tcp") == NetRule(cidr="10.0.0.0/8", ports=("443",))
    assert parse_cidr_rule("192.0.2.1:53/udp") == NetRule(cidr="192.0.2.1/32", ports=("53",), protocol="udp")
    assert parse_cidr_rule("198.51.100.0/24:*/any") == NetRule(cidr="198.51.100.0/24", protocol="any")
    assert parse_cidr_rule("[2001:db8::/32]:80,443").ports == ("80", "443")
    for bad in ("10.0.0.0/8:443/icmp", "nope", "1.2.3.4:0", "[::1"):
        with pytest.raises(click.BadParameter):
            parse_cidr_rule(bad)
    stages = tmp_path / "s.json"
    stages.write_text(json.dumps({"stages": {"eval": {"files": {"hidden": ["/tests"]}}}}))
    spec = PolicyArgs(stages_file=stages, stage="eval").apply(SPEC)
    assert spec.stage == "eval" and spec.stages["eval"].files.hidden == ("/tests",)
    spec = PolicyArgs(allow=("pypi",), allow_cidr=("10.0.0.0/8:443",)).apply(SPEC)
    assert spec.network == NetworkPolicy(allow=("pypi",), rules=(NetRule(cidr="10.0.0.0/8", ports=("443",)),))
    assert PolicyArgs().apply(SPEC) is SPEC
    with pytest.raises(click.UsageError):
        PolicyArgs(allow=("pypi",), stages_file=stages, stage="eval").apply(SPEC)
    with pytest.raises(click.BadParameter, match="not one of the declared stages"):
        PolicyArgs(stages_file=stages, stage="other").apply(SPEC)


def test_up_edge_config_is_checked(tmp_path: Path) -> None:
    good = tmp_path / "edge.toml"
    good.write_text('[network]\npool_size = 2\n[network.permissions.web]\ncidrs = ["10.0.0.0/8"]\nports = ["443"]\n')
    assert load_edge_overrides(good)["network"]["permissions"]["web"]["ports"] == ["443"]
    for text, match in (('edge_id = "x"\n', "sets edge_id"), ("[network]\nsubnet = \"nope\"\n", "network.subnet"),
                        ("[network.permissions.web]\nports = [\"99999\"]\n", "port")):
        bad = tmp_path / "bad.toml"
        bad.write_text(text)
        with pytest.raises(click.BadParameter, match=match):
            load_edge_overrides(bad)


def test_cli_names_the_flag_of_a_bad_resource_before_calling_anyone() -> None:
    # `create -n N` checks the spec here (it goes through the SDK); `run` and `create` of one
    # leave it to the server, whose answer is named the same way (tests/e2e/test_cli_use_e2e.py).
    from click.testing import CliRunner

    from dsec.cli.main import main

    runner = CliRunner()
    r = runner.invoke(main, ["create", "-n", "2", "busybox", "--disk", "0", "--memory", "1K"],
                      env={"DSEC_URL": "http://127.0.0.1:9", "DSEC_TOKEN": "x"})
    assert r.exit_code == 2, r.output
    assert "--disk 0: must be at least 1M" in r.output
    assert "--memory 1K: must be at least 16M" in r.output and "Traceback" not in r.output
    assert len(r.output.splitlines()) == 1, r.output
    r = runner.invoke(main, ["create", "busybox", "--disk-medium", "ssd"])
    assert r.exit_code == 2 and "'ssd' is not one of 'disk', 'memory'" in r.output, r.output
