"""What the proxy in front of the SuperLink costs (docs/deploy-internals.md, "The proxy").

    python -m bench.proxy_cost                       # 3 hospitals, fedavg, 5 rounds, 2 pairs of runs
    python -m bench.proxy_cost --pairs 3 --rounds 8 --requests 500

Two measurements, each with and without nginx between the SuperNodes and the SuperLink:

1. **one request**: in a loopback federation with the proxy, ``--requests`` Fleet requests
   (``/v1/fleet/pull-messages``, unsigned, so the SuperLink parses and refuses each with 401 after
   the whole round trip) on one kept-alive HTTPS connection to the proxy and one to the SuperLink
   itself, alternating, as a SuperNode's client sends them: the median and 90th percentile time;
2. **a round**: the loopback federation (fedderm-superlink, warm launcher) with and without the
   proxy, started in turn (``--pairs`` times each, alternating, so that both meet the machine's
   load alike), each running FedAvg for ``--rounds`` rounds: the median ``round_seconds``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from bench.deployment import round_times
from deploy.loopback import Loopback


def request_times(address: str, ca: Path, count: int) -> list[float]:
    """Seconds per request of ``count`` POSTs to the Fleet API at ``address`` on one connection."""
    import httpx

    times = []
    with httpx.Client(base_url=f"https://{address}", verify=str(ca), timeout=30) as client:
        client.post("/v1/fleet/pull-messages", content=b"", headers={"Content-Type": "application/protobuf"})
        for _ in range(count):
            start = time.perf_counter()
            response = client.post(
                "/v1/fleet/pull-messages", content=b"", headers={"Content-Type": "application/protobuf"}
            )
            times.append(time.perf_counter() - start)
            if response.status_code not in (401, 415):
                raise RuntimeError(f"{address}: unexpected {response.status_code} {response.text[:200]}")
    return times


def _pct(values: list[float], q: float) -> float:
    return sorted(values)[min(len(values) - 1, int(q * len(values)))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--hospitals", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--pairs", type=int, default=2, help="federations with and without the proxy, alternating"
    )
    parser.add_argument("--requests", type=int, default=300, help="requests per address (0: skip)")
    parser.add_argument("--workdir", default=None)
    args = parser.parse_args(argv)
    root = Path(args.workdir or tempfile.mkdtemp(prefix="fedderm-proxy-cost-"))
    rounds: dict[bool, list[float]] = {True: [], False: []}
    requests: dict[str, list[float]] = {"proxy": [], "direct": []}
    for pair in range(args.pairs):
        for proxied in (True, False) if pair % 2 == 0 else (False, True):
            name = f"{'proxy' if proxied else 'direct'}-{pair}"
            with Loopback(
                root / name, args.hospitals, per_class=8, echo=lambda _: None, proxy=proxied
            ) as fed:
                fed.start()
                if proxied and args.requests and not requests["proxy"]:
                    for _ in range(args.requests // 50):  # interleaved in blocks of 50
                        requests["proxy"] += request_times(fed.public_address, fed.secrets.ca_cert, 50)
                        requests["direct"] += request_times(f"127.0.0.1:{fed.port}", fed.secrets.ca_cert, 50)
                out = fed.run("fedavg", {"num-server-rounds": args.rounds})
                if not out.ok:
                    print(f"{name}: run failed:\n  " + "\n  ".join(out.problems))
                    return 1
                summary = json.loads((out.run_dir / "summary.json").read_text())
                times = round_times(summary)
                rounds[proxied] += times
                print(f"{name}: rounds {', '.join(f'{t:.2f}' for t in times)} s", flush=True)
    if requests["proxy"]:
        print(f"\none Fleet request, {len(requests['proxy'])} per address, one kept-alive connection each:")
        for label, values in requests.items():
            print(
                f"  {label:<7} median {1000 * statistics.median(values):.2f} ms, "
                f"90th percentile {1000 * _pct(values, 0.9):.2f} ms"
            )
        extra = statistics.median(requests["proxy"]) - statistics.median(requests["direct"])
        print(f"  the proxy adds {1000 * extra:.2f} ms per request (median)")
    print(
        f"\nFedAvg, {args.hospitals} hospitals, tiny-cnn 32 px, {args.rounds} rounds x {args.pairs} federations each:"
    )
    for proxied, label in ((True, "with the proxy"), (False, "without")):
        values = rounds[proxied]
        print(f"  {label:<15} median round {statistics.median(values):.2f} s (n={len(values)})")
    print(f"(work folder {root})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
