"""The testbed that tests, benchmarks and users share: an emulated internet on one Linux machine.

Not part of the library: ``swarm/`` and ``peers/`` never import it (tests/test_imports.py). It needs
root and iproute2; docs/testbed.md describes what it builds and how to use it.

    from testbed import NetLab, unavailable_reason
"""

from testbed.netlab import (
    NAT_SUBNET,
    PREFIX,
    SUBNET,
    Host,
    NetLab,
    NetLabError,
    list_labs,
    nat_unavailable_reason,
    parse_rate,
    remove_labs,
    root_available,
    sh,
    unavailable_reason,
)

__all__ = [
    "NAT_SUBNET",
    "PREFIX",
    "SUBNET",
    "Host",
    "NetLab",
    "NetLabError",
    "list_labs",
    "nat_unavailable_reason",
    "parse_rate",
    "remove_labs",
    "root_available",
    "sh",
    "unavailable_reason",
]
