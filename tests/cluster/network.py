"""The test cluster's private network: its nodes as network namespaces on a subnet that exists only in this machine.

Each node is a network namespace (``ip netns``, named by ``namespace_name``) with its own address on ``SUBNET``
(``node_address``), connected by a veth pair (``host_veth`` is the root-namespace end) to the bridge ``BRIDGE`` in
the root namespace, which holds ``CONTROLLER_ADDRESS`` (slurmctld's). A node's link to the bridge can be taken down
and up again (a dead NIC or cable). The names are fixed, so one cluster at a time can exist on a machine.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable

from tests.cluster.host import run_command

SUBNET = ipaddress.ip_network("10.231.87.0/24")
CONTROLLER_ADDRESS = "10.231.87.1"
NODE_NAMES = ("txlnode1", "txlnode2", "txlnode3")
BRIDGE = "txlbr0"


def namespace_name(node: str) -> str:
    """The ``ip netns`` name of a node."""
    return f"txl-{node}"


def host_veth(node: str) -> str:
    """The root-namespace end of a node's veth pair (at most 15 characters, the kernel's limit)."""
    return f"txlv-{node}"[:15]


def node_address(node: str) -> str:
    """The node's address on the test subnet: .11 for the first node, .12 for the second, ..."""
    return str(SUBNET.network_address + 11 + NODE_NAMES.index(node))


def subnet_in_use() -> str | None:
    """A line naming a route or address of this machine inside (or around) the test subnet, or None."""
    for family_args in (["-4", "route", "show", "table", "all"], ["-4", "-o", "addr", "show"]):
        out = run_command(["ip", *family_args], check=False).stdout
        for line in out.splitlines():
            fields = line.split()
            candidates = fields[:1] if family_args[1] == "route" else fields[3:4]
            for candidate in candidates:
                if candidate in ("default", "broadcast", "local", "unreachable", "blackhole", "prohibit"):
                    candidate = fields[1] if len(fields) > 1 else ""
                try:
                    network = ipaddress.ip_network(candidate, strict=False)
                except ValueError:
                    continue
                if network.prefixlen > 0 and network.overlaps(SUBNET):
                    return line.strip()
    return None


def make_network(nodes: Iterable[str]) -> None:
    """The bridge with the controller address, and per node a netns with a veth to the bridge."""
    run_command(["ip", "link", "add", BRIDGE, "type", "bridge"])
    run_command(["ip", "addr", "add", f"{CONTROLLER_ADDRESS}/{SUBNET.prefixlen}", "dev", BRIDGE])
    run_command(["ip", "link", "set", BRIDGE, "up"])
    for node in nodes:
        netns = namespace_name(node)
        run_command(["ip", "netns", "add", netns])
        run_command(["ip", "link", "add", host_veth(node), "type", "veth", "peer", "name", "eth0", "netns", netns])
        run_command(["ip", "link", "set", host_veth(node), "master", BRIDGE])
        run_command(["ip", "link", "set", host_veth(node), "up"])
        run_command(["ip", "-n", netns, "addr", "add", f"{node_address(node)}/{SUBNET.prefixlen}", "dev", "eth0"])
        run_command(["ip", "-n", netns, "link", "set", "eth0", "up"])
        run_command(["ip", "-n", netns, "link", "set", "lo", "up"])


def remove_network(nodes: Iterable[str]) -> None:
    """Removes the nodes' veths and namespaces and the bridge, whichever of them exist."""
    for node in nodes:
        run_command(["ip", "link", "del", host_veth(node)], check=False)
        run_command(["ip", "netns", "del", namespace_name(node)], check=False)
    run_command(["ip", "link", "del", BRIDGE], check=False)


def set_link(node: str, state: str) -> None:
    """Sets NODE's link to the bridge 'down' (nothing reaches the node, its processes run on) or 'up' again."""
    run_command(["ip", "link", "set", host_veth(node), state])
