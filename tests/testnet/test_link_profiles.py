"""Named link profiles and the testnet options around them: every profile is a valid link with a citation, the
--wan-* override rule, --peer-profile and --peer-cpus parsing, and what the testnet state records. No daemons."""

from __future__ import annotations

import os
import random
import re
from pathlib import Path

import pytest

from dsd.node.cli.main import build_parser
from dsd.node.cli.options import link_profile
from dsd.node.cli.testnet import _peer_extras, _swarm_line, spec_of
from dsd.node.peer.shaper import LinkProfile, LinkSchedule
from dsd.node.testnet import processes
from dsd.node.testnet.link_profiles import (
    PROFILES,
    build_link,
    describe,
    link_record,
    named,
    parse_peer_profiles,
    peer_link,
)
from dsd.node.testnet.processes import PeerProcess
from dsd.node.testnet.swarm import SwarmError, SwarmSpec, peer_links


@pytest.mark.parametrize("name", sorted(PROFILES))
def test_every_profile_is_a_valid_link_with_a_citation(name: str) -> None:
    profile = PROFILES[name]
    assert profile.name == name and named(name) is profile
    link = profile.link(latency_ms=None if profile.latency_ms is not None else 10.0)
    assert isinstance(link, LinkProfile) and link.active
    assert profile.jitter_ms <= (profile.latency_ms or 10.0)
    assert profile.emulates and len(profile.source) > 40
    assert re.search(r"\b(19|20)\d\d\b|arXiv", profile.source), "a citation names its year (or arXiv id)"


def test_the_profiles_numbers() -> None:
    assert build_link("home") == LinkProfile.from_options(22.0, 5.0, 10.0)
    assert build_link("continental") == LinkProfile.from_options(34.0, 1.0, None)
    assert build_link("paper") == LinkProfile() and not build_link("paper").active


def test_explicit_wan_options_override_their_field_only() -> None:
    assert build_link("home", latency_ms=30.0) == LinkProfile(0.030, 0.005, 10e6)
    assert build_link("home", jitter_ms=0.0) == LinkProfile(0.022, 0.0, 10e6)
    assert build_link("home", mbit=100.0) == LinkProfile(0.022, 0.005, 100e6)
    assert build_link("home", mbit=0.0).bandwidth_bps is None  # 0 = unlimited
    assert build_link("paper", latency_ms=20.0) == LinkProfile.from_options(20.0)
    assert build_link(None, 20.0, 2.0, 50.0) == LinkProfile.from_options(20.0, 2.0, 50.0)  # no profile: as before
    with pytest.raises(ValueError, match="jitter"):
        build_link("home", latency_ms=3.0)  # the profile's ±5 ms jitter would exceed it
    with pytest.raises(ValueError, match=r"unknown link profile 'lan' \(known: paper, home, continental\)"):
        build_link("lan")


def _up(*extra: str):
    return build_parser().parse_args(["testnet", "up", "--store", "s", "--state", "st", *extra])


def test_cli_link_profile_with_an_override_and_a_bad_combination() -> None:
    assert link_profile(_up("--link-profile", "home", "--wan-latency-ms", "30")) == LinkProfile(0.030, 0.005, 10e6)
    assert link_profile(_up("--wan-latency-ms", "20")) == LinkProfile.from_options(20.0)
    assert link_profile(_up()) == LinkProfile()
    with pytest.raises(SystemExit, match="^dsd-node: bad WAN option: jitter"):
        link_profile(_up("--link-profile", "home", "--wan-latency-ms", "1"))
    for command in (["generate", "--bootstrap", "b", "--store", "s", "--prompt", "p"], ["start", "--bootstrap-only"]):
        args = build_parser().parse_args([*command, "--link-profile", "continental"])
        assert link_profile(args) == build_link("continental")


def test_testnet_up_options_reach_the_swarm_spec() -> None:
    cpu = min(os.sched_getaffinity(0))
    spec = spec_of(_up("--link-profile", "home", "--peer-profile", "1:continental", "--peer-profile", "3:paper",
                       "--peer-cpus", str(cpu)))
    assert spec.link == build_link("home") and spec.link_name == "home"
    assert spec.peer_profiles == ["1:continental", "3:paper"] and spec.peer_cpus == {cpu}
    assert peer_links(spec, 4) == {1: ("continental", build_link("continental")),
                                   3: ("paper", LinkProfile.from_options(22.0))}  # paper: the swarm's latency
    plain = spec_of(_up())
    assert plain.link_name is None and plain.peer_profiles == [] and plain.peer_cpus is None


def test_bad_peer_cpus_are_an_argparse_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _up("--peer-cpus", "4096")
    err = capsys.readouterr().err
    assert "--peer-cpus: CPU 4096 not available here (available:" in err


FORM = "expected INDEX:NAME, e.g. 1:home"


@pytest.mark.parametrize(("item", "why"), [
    ("home", FORM), ("x:home", FORM), ("1:", FORM), ("-1:home", FORM), ("4:home", "peer index 4 is not in 0..3"),
    ("1:lan", "unknown link profile 'lan' (known: paper, home, continental)"),
])
def test_peer_profile_errors_name_the_item(item: str, why: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_peer_profiles([item], 4)
    assert str(info.value) == f"--peer-profile {item}: {why}"


def test_peer_profiles_parse_and_refuse_a_peer_given_twice() -> None:
    assert parse_peer_profiles(["0:home", " 2 : continental"], 3) == {0: "home", 2: "continental"}
    with pytest.raises(ValueError, match="peer 0 already has profile home"):
        parse_peer_profiles(["0:home", "0:paper"], 3)
    assert peer_link("home", 50.0) == build_link("home")  # a named peer keeps its own numbers
    assert peer_link("paper", 50.0) == LinkProfile.from_options(50.0)


def test_swarm_turns_a_bad_peer_profile_into_a_swarm_error(tmp_path: Path) -> None:
    spec = SwarmSpec(state=tmp_path, store=tmp_path, peers=2, peer_profiles=["2:home"])
    with pytest.raises(SwarmError, match=r"^--peer-profile 2:home: peer index 2 is not in 0\.\.1$"):
        peer_links(spec, spec.peers)


def test_home_jitter_keeps_each_stream_in_order() -> None:
    schedule = LinkSchedule(build_link("home"), random.Random(3))
    sent = [i * 0.0005 for i in range(400)]
    arrivals = [schedule.arrival(t, 1500) for t in sent]
    assert arrivals == sorted(arrivals)
    assert min(a - t for a, t in zip(arrivals, sent, strict=True)) >= 0.017 - 1e-9  # latency - jitter


def test_state_records_links_and_cpus_and_reads_old_states(tmp_path: Path) -> None:
    home, cont = link_record("home", build_link("home")), link_record("continental", build_link("continental"))
    peers = [PeerProcess("bootstrap", 1, "b.log", cpus=[1], link=home),
             PeerProcess("peer0", 2, "p0.log", cpus=[1], link=home, start=0, end=2),
             PeerProcess("peer1", 3, "p1.log", cpus=[1], link=cont, start=2, end=4)]
    processes.TestnetState("/ip4/127.0.0.1/tcp/1", "m", "s", 4, peers, wan=home, peer_cpus=[1]).save(tmp_path)
    state = processes.TestnetState.load(tmp_path)
    assert state.peers[2].link == cont and state.peer_cpus == [1] and state.wan["profile"] == "home"
    assert _swarm_line(state) == "link home 22±5 ms, 10 Mbit/s  peer cpus 1"
    assert _peer_extras(state, vars(state.peers[1])) == "  cpus 1"
    assert _peer_extras(state, vars(state.peers[2])) == "  cpus 1  link continental 34±1 ms, unlimited"
    old = tmp_path / "old"
    old.mkdir()
    (old / "testnet.json").write_text('{"bootstrap": "b", "model": null, "store": null, "num_layers": null, '
                                      '"peers": [{"name": "peer0", "pid": 5, "log": "l"}], '
                                      '"wan": {"latency_ms": 20.0, "jitter_ms": 0.0, "mbit": null}}')
    state = processes.TestnetState.load(old)
    assert state.peer_cpus is None and state.peers[0].cpus is None and state.peers[0].link is None
    assert _swarm_line(state) == "link 20 ms, unlimited" and _peer_extras(state, vars(state.peers[0])) == ""
    assert describe(link_record(None, LinkProfile())) == "0 ms, unlimited"
