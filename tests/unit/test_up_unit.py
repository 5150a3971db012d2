"""`dsec up`'s instance identity and options, without starting it: the node name from the
data directory, the data-directory lock (real flock), the port check (a real socket) and
`--network-config` / `--node-name` refusals as one line each."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from dsec.cli import up
from dsec.cli.main import main
from dsec.errors import HostError


def test_the_node_name_is_stable_per_data_dir_and_differs_between_them(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    name = up.node_name_default(a)
    assert name == up.node_name_default(a) == up.node_name_default(tmp_path / "b" / ".." / "a")
    assert name != up.node_name_default(b)
    assert up.NODE_NAME_RE.match(name) and name.startswith("up-") and len(f"{name}-e16") <= 32
    for bad in ("", "Up", "x" * 21, "-a", "a_b"):
        with pytest.raises(ValueError, match="node name"):
            up.check_node_name(bad)
    assert up.check_node_name("lab-2") == "lab-2"


def test_a_data_dir_is_held_by_one_instance(tmp_path: Path) -> None:
    held = up.lock_data_dir(tmp_path)
    try:
        assert up.data_dir_in_use(tmp_path) == f"dsec up pid {os.getpid()}"
        for call in (up.lock_data_dir, up.check_data_dir_free):
            with pytest.raises(HostError) as err:
                call(tmp_path)
            assert str(err.value) == (f"{tmp_path} is in use by another `dsec up` (dsec up pid {os.getpid()}): "
                                      "stop it first, or give this one another --data-dir (and --port)")
    finally:
        held.release()
    assert up.data_dir_in_use(tmp_path) == ""
    up.check_data_dir_free(tmp_path)
    up.lock_data_dir(tmp_path).release()


def test_a_port_in_use_is_refused_in_one_line() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(HostError, match=f"^port {port} on 127.0.0.1 is in use .*: give this instance another --port$"):
            up.check_port_free("127.0.0.1", port)
    up.check_port_free("127.0.0.1", port)  # free again
    up.check_port_free("127.0.0.1", 0)


def test_network_config_files(tmp_path: Path) -> None:
    good = tmp_path / "net.toml"
    good.write_text('blocked = ["10.0.0.0/24"]\n[permissions.pkgs]\nhosts = ["pkgs.example.org"]\nports = ["443"]\n')
    assert up.load_network_config(good) == {"blocked": ["10.0.0.0/24"],
                                            "permissions": {"pkgs": {"hosts": ["pkgs.example.org"], "ports": ["443"]}}}
    wrapped = tmp_path / "net.json"
    wrapped.write_text('{"network": {"subnet": "10.213.0.0/16"}}')
    assert up.load_network_config(wrapped) == {"subnet": "10.213.0.0/16"}
    for text, where in (('subnet = "10.0.0.1/40"\n', "subnet"), ("[permissions.x]\nports = [\"99999\"]\n", "ports"),
                        ('pool_sise = 3\n', "pool_sise"), ("[[x]]\n[x\n", "net.toml")):
        good.write_text(text)
        with pytest.raises(click.BadParameter) as err:
            up.load_network_config(good)
        assert where in str(err.value) and str(good) in str(err.value), err.value


def test_up_refuses_bad_options_before_starting(tmp_path: Path) -> None:
    net = tmp_path / "net.toml"
    net.write_text("[permissions.pkgs]\ncidrs = [\"192.0.2.0/24\"]\n")
    edge = tmp_path / "edge.toml"
    edge.write_text("[network]\npool_size = 1\n")
    runner = CliRunner()
    r = runner.invoke(main, ["up", "--data-dir", str(tmp_path / "d"), "--network-config", str(net),
                             "--edge-config", str(edge)])
    assert r.exit_code == 2 and "has a `network` section too: give it in one place" in r.output, r.output
    r = runner.invoke(main, ["up", "--data-dir", str(tmp_path / "d"), "--node-name", "Bad_Name"])
    assert r.exit_code == 2 and "--node-name" in r.output and "node name 'Bad_Name'" in r.output, r.output
    assert not (tmp_path / "d").exists()  # refused before anything was made
