"""``python -m testbed``: build a demo lab and measure every link, or remove leftover labs.

python -m testbed demo --hosts 3 --rate 50mbit   # each link's round trip and goodput
python -m testbed cleanup                        # labs whose creating process is gone
python -m testbed cleanup --force                # every swt-* lab, including ones still in use
"""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Sequence

from testbed.netlab import PREFIX, SUBNET, NetLab, list_labs, parse_rate, remove_labs, unavailable_reason


def _demo(hosts: int, rate: str, mbytes: float) -> None:
    expected = parse_rate(rate)
    with NetLab(hosts=hosts, rate=rate) as lab:
        print(f"lab {lab.prefix}: {hosts} hosts on {SUBNET}, every link {rate} each way (tbf)")
        for src in range(hosts):
            dst = (src + 1) % hosts
            rtt = lab.rtt_ms(src, dst)
            nbytes = int(mbytes * 1e6)
            bits = lab.throughput(src, dst, nbytes=nbytes, timeout=30 + 3 * nbytes * 8 / expected)
            link = f"h{src} {lab.hosts[src].ip} -> h{dst} {lab.hosts[dst].ip}"
            print(f"{link}: rtt {rtt:.2f} ms, {bits / 1e6:.2f} Mbit/s ({bits / expected:.2f}x of {rate})")
    print(f"torn down; namespaces left with prefix {lab.prefix}: {list_labs(lab.prefix) or 'none'}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m testbed", description=(__doc__ or "").split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    demo = sub.add_parser("demo", help="build a lab, measure every link, tear it down")
    demo.add_argument("--hosts", type=int, default=3)
    demo.add_argument("--rate", default="50mbit")
    demo.add_argument("--mbytes", type=float, default=4.0, help="payload per throughput measurement")
    clean = sub.add_parser("cleanup", help="remove leftover lab namespaces and the processes in them")
    clean.add_argument("--prefix", default=PREFIX)
    clean.add_argument("--force", action="store_true", help="also labs whose creating process still runs")
    args = parser.parse_args(argv)
    if reason := unavailable_reason():
        print(f"testbed: {reason}", file=sys.stderr)
        return 2
    if args.cmd == "demo":
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
        try:
            _demo(args.hosts, args.rate, args.mbytes)
        except KeyboardInterrupt:
            print("interrupted; lab torn down", file=sys.stderr)
            return 130
    else:
        removed = remove_labs(args.prefix, owner_alive_ok=args.force)
        print(f"removed {len(removed)} namespaces" + "".join(f"\n  {name}" for name in removed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
