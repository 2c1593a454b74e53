"""Retrieval server fairness: how long a one-query client waits while another client's largest accepted batch of
fresh queries runs, on the server as a user starts it (issues 21, 46). Prints a markdown table (a measurement, not a
pass/fail test).

    python benchmarks/retrieval_fairness.py [--backends chroma,faiss] [--arrivals 0.05,1,2,4] [--repeats 2]
                                            [--params params/smoke.yaml] [-o KEY=VALUE ...]

For each back end: `scope serve retrieval --params P -o retrieval.backend=B` in its own process on a loopback
port (the index is built on first use in a temporary runs folder; `engine.torch_threads`, the embedding cache and
the embedder are the params' own, as for a user). Then, as a user trying its limits: 1,024-, 512- and 256-query
batches of 2,000-character queries (refused: 413), then, for each arrival time and repeat, the largest batch the
server accepts (`MAX_REQUEST_CHARS` characters: queries of 2,000 characters) and, that many seconds after it was
sent, one one-query request. Every query's text is new (random words and a per-run nonce), so no embedding cache
answers it: what a user's fresh batch costs. The first batch is the first search of a fresh server. Reported per
back end and arrival: the one-query wait (min, median, max over the repeats) and the batch's total time.
"""

from __future__ import annotations

import argparse
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import httpx  # noqa: E402

from scope_lib.retrieval.server import MAX_REQUEST_CHARS  # noqa: E402

QUERY_CHARS = 2000
WORDS = ("dam river history people built early years lake power station valley flood bridge town railway "
         "mountain war treaty king church school island harbour mine canal census election").split()


def fresh_queries(rng: random.Random, nonce: str, n: int, chars: int = QUERY_CHARS) -> list[str]:
    """`n` queries of `chars` characters no cache has seen: random words, each query numbered under `nonce`."""
    out = []
    for i in range(n):
        words = [f"{nonce}-{i}"]
        while sum(len(w) + 1 for w in words) < chars:
            words.append(f"{rng.choice(WORDS)}{rng.randrange(1000)}")
        out.append(" ".join(words)[:chars])
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(params: str, backend: str, runs_dir: str, overrides: list[str], log_path: Path,
                 timeout_s: float) -> tuple[subprocess.Popen, str, float]:
    port = free_port()
    scope = Path(sys.executable).parent / "scope"
    command = [str(scope), "serve", "retrieval", "--params", params, "--port", str(port),
               "-o", f"run.runs_dir={runs_dir}", "-o", f"retrieval.backend={backend}"]
    for override in overrides:
        command += ["-o", override]
    url = f"http://127.0.0.1:{port}"
    started = time.monotonic()
    process = subprocess.Popen(command, stdout=log_path.open("w"), stderr=subprocess.STDOUT, cwd=REPO)
    while time.monotonic() - started < timeout_s:
        if process.poll() is not None:
            raise SystemExit(f"`{' '.join(command)}` exited {process.returncode}; see {log_path}")
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return process, url, time.monotonic() - started
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    process.terminate()
    raise SystemExit(f"the server did not answer /health within {timeout_s:.0f} s; see {log_path}")


def measure(url: str, arrival: float, batch: list[str], one: str) -> tuple[float, float]:
    """(one-query wait s, batch total s): `batch` posted, `one` posted `arrival` s later."""
    answer: dict = {}

    def post_batch() -> None:
        response = httpx.post(f"{url}/retrieve", json={"queries": batch, "topk": 3}, timeout=600)
        answer.update(seconds=time.monotonic() - started, status=response.status_code)

    thread = threading.Thread(target=post_batch)
    started = time.monotonic()
    thread.start()
    time.sleep(arrival)
    asked = time.monotonic()
    response = httpx.post(f"{url}/retrieve", json={"queries": [one]}, timeout=600)
    wait = time.monotonic() - asked
    thread.join(timeout=600)
    if response.status_code != 200 or answer.get("status") != 200:
        raise SystemExit(f"one-query {response.status_code}, batch {answer.get('status')}: expected 200 and 200")
    if wait > answer["seconds"] - arrival:
        print(f"  (note: the one-query request ended after the batch: arrival {arrival} s is past the batch)")
    return wait, answer["seconds"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backends", default="chroma,faiss")
    parser.add_argument("--arrivals", default="0.05,1,2,4", help="seconds after the batch the one query is sent")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--params", default=str(REPO / "params" / "smoke.yaml"))
    parser.add_argument("-o", "--override", action="append", default=[], help="KEY=VALUE for the server")
    parser.add_argument("--runs-dir", help="where the server builds its index (default: a temporary folder)")
    parser.add_argument("--startup-timeout", type=float, default=900)
    args = parser.parse_args()
    arrivals = [float(a) for a in args.arrivals.split(",")]
    n_queries = MAX_REQUEST_CHARS // QUERY_CHARS
    rng = random.Random(time.time_ns())
    nonce = f"{os.getpid()}x{time.time_ns()}"
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for backend in args.backends.split(","):
            runs_dir = args.runs_dir or str(Path(tmp) / backend)
            log_path = Path(tmp) / f"serve-{backend}.log"
            process, url, startup_s = start_server(args.params, backend, runs_dir, args.override, log_path,
                                                   args.startup_timeout)
            try:
                refused = []
                for n in (1024, 512, 256):
                    status = httpx.post(f"{url}/retrieve", json={"queries": fresh_queries(rng, nonce, n)},
                                        timeout=600).status_code
                    refused.append(f"{n}: {status}")
                waits: dict[float, list[float]] = {a: [] for a in arrivals}
                totals: dict[float, list[float]] = {a: [] for a in arrivals}
                first = None
                for repeat in range(args.repeats):
                    for arrival in arrivals:
                        tag = f"{nonce}-{backend}-{repeat}-{arrival}"
                        batch = fresh_queries(rng, tag, n_queries)
                        one = f"Horse Mesa Dam {tag}"
                        load = os.getloadavg()[0]
                        wait, total = measure(url, arrival, batch, one)
                        first = first if first is not None else (arrival, wait)
                        waits[arrival].append(wait)
                        totals[arrival].append(total)
                        print(f"{backend} repeat {repeat} arrival {arrival:.2f} s: one-query {wait:.3f} s, "
                              f"batch {total:.2f} s (load {load:.2f})", flush=True)
                health = httpx.get(f"{url}/health", timeout=30).json()
            finally:
                process.terminate()
                process.wait(timeout=60)
            rows += [(backend, a, waits[a], totals[a]) for a in arrivals]
            print(f"{backend}: server up in {startup_s:.1f} s; refused {', '.join(refused)}; first batch "
                  f"(fresh server) one-query {first[1]:.3f} s at {first[0]} s; {health['searches']} searches; "
                  f"{health['index']}", flush=True)

    from scope_lib.models.cpu import cpu_description

    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), "unknown") if Path("/proc/cpuinfo").exists() else "unknown"
    print(f"\nCPU: {model}; {cpu_description()}; {os.cpu_count()} CPU(s); load average now "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"params {Path(args.params).name} {' '.join(args.override)}; batch {n_queries} x {QUERY_CHARS:,} characters "
          f"of fresh queries (the largest accepted); {args.repeats} repeat(s)\n")
    print("| backend | one query sent (s after the batch) | one-query wait s (min / median / max) | batch total s "
          "(median) |")
    print("|---|---|---|---|")
    for backend, arrival, w, t in rows:
        print(f"| {backend} | {arrival:g} | {min(w):.3f} / {statistics.median(w):.3f} / {max(w):.3f} | "
              f"{statistics.median(t):.2f} |")


if __name__ == "__main__":
    main()
