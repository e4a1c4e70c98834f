"""CPU lists: parsing, checking against the CPUs this process may use, the kernel's compact form, and pinning what
a process starts (a forked child inherits the mask of the thread that forked it)."""

from __future__ import annotations

import os
import threading

import pytest

from dsd.node.cli.main import build_parser
from dsd.node.peer.cpus import (
    available_cpus,
    check_cpus,
    children_pinned,
    format_cpus,
    parse_cpus,
    pin_process,
)

FOUR = frozenset({0, 1, 2, 3})


@pytest.mark.parametrize(("text", "cpus"), [("1", {1}), ("1-3", {1, 2, 3}), ("1,2", {1, 2}), ("0,2-3", {0, 2, 3}),
                                            (" 3 , 0 ", {0, 3}), ("2-2", {2})])
def test_parse_cpus_reads_the_kernels_list_form(text: str, cpus: set[int]) -> None:
    assert parse_cpus(text, FOUR) == frozenset(cpus)


@pytest.mark.parametrize("text", ["", "x", "1-", "-1", "3-1", "1,,2", "1.5", "a-b"])
def test_parse_cpus_refuses_what_is_not_a_list(text: str) -> None:
    with pytest.raises(ValueError, match="CPU list"):
        parse_cpus(text, FOUR)


def test_a_cpu_not_available_is_one_line_naming_the_available_ones() -> None:
    with pytest.raises(ValueError) as info:
        parse_cpus("2-5", {0, 1, 2})
    message = str(info.value)
    assert message == "CPUs 3-5 not available here (available: 0-2)" and "\n" not in message
    with pytest.raises(ValueError, match=r"^CPU 7 not available here \(available: 0-3\)$"):
        check_cpus({7}, FOUR)
    with pytest.raises(ValueError, match="empty"):
        check_cpus(set(), FOUR)


def test_format_cpus_collapses_ranges() -> None:
    assert format_cpus({0, 1, 2, 5, 7, 8}) == "0-2,5,7-8"
    assert format_cpus([3]) == "3"
    assert parse_cpus(format_cpus({0, 2, 3}), FOUR) == {0, 2, 3}


def test_the_default_is_this_process_affinity() -> None:
    mine = frozenset(os.sched_getaffinity(0))
    assert available_cpus() == mine
    assert parse_cpus(format_cpus(mine)) == mine


def test_children_pinned_pins_a_fork_and_restores_the_parent() -> None:
    before = os.sched_getaffinity(0)
    one = {min(before)}
    read, write = os.pipe()
    with children_pinned(one):
        pid = os.fork()
        if pid == 0:  # the child reports the CPUs it may use and leaves at once
            os.write(write, format_cpus(os.sched_getaffinity(0)).encode())
            os._exit(0)
    os.close(write)
    child = os.read(read, 100).decode()
    os.close(read)
    os.waitpid(pid, 0)
    assert child == format_cpus(one)
    assert os.sched_getaffinity(0) == before
    with children_pinned(None):
        assert os.sched_getaffinity(0) == before


def test_pin_process_pins_threads_already_running() -> None:
    before = os.sched_getaffinity(0)
    one = {min(before)}
    started, stop = threading.Event(), threading.Event()
    thread = threading.Thread(target=lambda: (started.set(), stop.wait()), daemon=True)
    thread.start()
    started.wait()
    try:
        assert pin_process(one) == one
        assert os.sched_getaffinity(thread.native_id) == one and os.sched_getaffinity(0) == one
        assert available_cpus() == before  # pinned, it may still pin itself (or its children) back
        assert pin_process(before) == before and os.sched_getaffinity(thread.native_id) == before
    finally:
        stop.set()
        os.sched_setaffinity(0, before)
    thread.join()


def test_generate_and_serve_take_cpus(capsys: pytest.CaptureFixture[str]) -> None:
    cpu = min(os.sched_getaffinity(0))
    head = ["--bootstrap", "b", "--store", "s"]
    for command in (["generate", *head, "--prompt", "p"], ["serve", *head]):
        args = build_parser().parse_args([*command, "--cpus", str(cpu)])
        assert args.cpus == {cpu} and args.threads is None
        assert build_parser().parse_args(command).cpus is None
        with pytest.raises(SystemExit):
            build_parser().parse_args([*command, "--cpus", "0-4096"])
        assert "argument --cpus: CPUs " in capsys.readouterr().err
