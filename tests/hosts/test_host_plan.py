"""Boards as hosts, the pure part: names, addresses, shaping, limits and the commands (milliseconds)."""

import pytest

from cachebox.link import LINK_PRESETS, LinkProfile, rtt_only
from dashboard.hosts.plan import BoardHost, Hub, tbf_burst, tbf_rate

HUB = Hub("ect", "10.77.200.0/24")


def zero(index=1, link=LINK_PRESETS["wifi4"]):
    return BoardHost(HUB, index, "zero", memory_mb=512, threads=1, link=link)


def test_each_host_has_its_own_namespace_link_ends_and_address_on_the_hubs_subnet():
    a, b = zero(1), zero(2)
    assert HUB.address == "10.77.200.1" and HUB.bridge == "ectbr"
    assert (a.address, b.address) == ("10.77.200.11", "10.77.200.12")
    assert len({a.namespace, b.namespace}) == 2 and a.namespace.startswith("ect-")
    assert all(len(name) <= 15 for name in (a.hub_end, a.board_end, HUB.bridge))
    assert a.cgroup_dir("memory") == f"/sys/fs/cgroup/memory/edgecache/{a.namespace}"


def test_a_link_is_shaped_both_ways_by_tbf_and_a_lan_is_not():
    commands = zero().shaping()
    assert [command[:7] for command in commands][0] == ["tc", "qdisc", "replace", "dev", "ect1h", "root", "tbf"]
    assert commands[1][:4] == ["ip", "netns", "exec", zero().namespace] and "ect1b" in commands[1]
    assert all("rate" in command and "20.9mbit" in command for command in commands)
    assert zero(link=None).shaping() == []
    assert tbf_rate(LINK_PRESETS["gigabit"]) == "940mbit" and tbf_burst(LINK_PRESETS["gigabit"]) == "9400kbit"
    assert tbf_burst(LINK_PRESETS["wifi4"]) == "209kbit"
    assert tbf_burst(LinkProfile(1.0, 0)) == "32kbit"  # never below the smallest useful bucket


def test_limits_cap_memory_at_the_registered_size_and_cpu_at_the_boards_threads():
    limits = BoardHost(HUB, 3, "pi5", memory_mb=4096, threads=2, link=None).limits()
    assert (
        limits["memory"]["memory.limit_in_bytes"]
        == str(4096 * 2**20)
        == limits["memory"]["memory.memsw.limit_in_bytes"]
    )
    assert limits["cpu"] == {"cpu.cfs_period_us": "100000", "cpu.cfs_quota_us": "200000"}


def test_a_process_joins_the_hosts_cgroups_before_it_enters_its_namespace():
    host = zero()
    argv = host.wrap(["python", "manage.py", "edge"])
    assert argv[:2] == ["sh", "-c"] and "cgroup.procs" in argv[2] and argv[2].endswith('exec ip netns exec "$@"')
    assert argv[4:] == [
        host.cgroup_dir("memory"),
        host.cgroup_dir("cpu"),
        host.namespace,
        "python",
        "manage.py",
        "edge",
    ]


def test_link_down_and_up_act_on_the_hubs_end_and_teardown_removes_namespace_and_link():
    host = zero()
    assert host.link_down() == [["ip", "link", "set", "ect1h", "down"]] and host.link_up()[0][-1] == "up"
    assert ["ip", "netns", "del", host.namespace] in host.teardown()


def test_the_kernel_shapes_the_bandwidth_and_the_socket_adds_only_the_round_trip():
    rtt = rtt_only(LINK_PRESETS["wifi4"])
    assert rtt.bandwidth_mbps == float("inf") and rtt.rtt_ms == 4.0 and rtt.transfer_ms(10_000_000) == 4.0
    assert rtt_only(None) is None and rtt_only(LinkProfile(100, 0)) is None


@pytest.mark.parametrize(
    "prefix, subnet",
    [
        ("", "10.77.1.0/24"),
        ("toolong1", "10.77.1.0/24"),
        ("a-b", "10.77.1.0/24"),
        ("ok", "10.77.1.0/28"),
        ("ok", "fd00::/64"),
    ],
)
def test_a_hub_refuses_names_and_subnets_it_cannot_use(prefix, subnet):
    with pytest.raises(ValueError):
        Hub(prefix, subnet)


def test_a_hub_holds_boards_1_to_200_with_some_memory_and_a_thread():
    with pytest.raises(ValueError):
        BoardHost(HUB, 0, "x", 512, 1, None)
    with pytest.raises(ValueError):
        BoardHost(HUB, 1, "x", 8, 1, None)
