"""Retrieval server fairness: how long a one-query client waits while another client's maximal allowed batch runs
(issue 21). Prints a markdown table (a measurement, not a pass/fail test).

    python benchmarks/retrieval_fairness.py [--embedder minilm-offline] [--repeats 3]

A real index (faiss, flat, over the wiki-18 sample, the `--embedder` embeddings) behind the real server on a
loopback port. Client A posts the largest request the server accepts (`MAX_REQUEST_CHARS` characters: queries
of 2,000 characters), and, with the limit raised for the measurement, the issue's 1,024 x 2,000 characters;
0.05 s later client B posts one short query every 0.1 s until A is answered. Reported: A's total time (what B
waited before this change: the old batcher searched A's request in one piece) and B's latency while A runs
(p50, max).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import httpx  # noqa: E402

from scope_lib.config import load_params  # noqa: E402
from scope_lib.retrieval.index import build_or_open_index  # noqa: E402
from scope_lib.retrieval.server import MAX_REQUEST_CHARS, background_server  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--embedder", default="minilm-offline")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--data", default=os.environ.get("SCOPE_DATA_DIR", str(REPO.parent / "shared" / "data"))
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        params = load_params(
            REPO / "params" / "smoke.yaml",
            {
                "run.runs_dir": tmp,
                "run.data_dir": args.data,
                "retrieval.backend": "faiss",
                "retrieval.embedder": args.embedder,
                "retrieval.max_passages": 1000,
                "retrieval.embedding_cache": False,  # every query embedded: the index's real cost
            },
        )
        retriever = build_or_open_index(params, progress=False)
        words = "the history of the dam on the river and the people who built it in the early years ".split()
        query = " ".join(words[i % len(words)] for i in range(400))[:2000]
        rows = []
        for n_queries, repeats in ((MAX_REQUEST_CHARS // 2000, args.repeats), (1024, 1)):
            big = [f"{i} {n_queries} {query}"[:2000] for i in range(n_queries)]
            with background_server(
                retriever, max_request_chars=max(MAX_REQUEST_CHARS, 2000 * n_queries)
            ) as url:
                httpx.post(f"{url}/retrieve", json={"queries": ["warm up"]}, timeout=60)
                for repeat in range(repeats):
                    big = [f"{repeat} {q}"[:2000] for q in big]  # new text each time
                    done = threading.Event()
                    result: dict = {}

                    def batch(result=result, done=done, big=big, url=url):
                        started = time.monotonic()
                        response = httpx.post(
                            f"{url}/retrieve", json={"queries": big, "topk": 3}, timeout=600
                        )
                        result.update(seconds=time.monotonic() - started, status=response.status_code)
                        done.set()

                    thread = threading.Thread(target=batch)
                    thread.start()
                    time.sleep(0.05)
                    latencies = []
                    while not done.is_set() or not latencies:
                        asked = time.monotonic()
                        response = httpx.post(
                            f"{url}/retrieve", json={"queries": ["Horse Mesa Dam"]}, timeout=600
                        )
                        assert response.status_code == 200
                        latencies.append(time.monotonic() - asked)
                        time.sleep(0.1)
                    thread.join()
                    assert result["status"] == 200, result
                    rows.append(
                        (
                            n_queries,
                            result["seconds"],
                            statistics.median(latencies),
                            max(latencies),
                            len(latencies),
                            httpx.get(f"{url}/health").json()["searches"],
                        )
                    )
    print(f"embedder {args.embedder}; {os.cpu_count()} CPU(s); queries of 2,000 characters\n")
    print(
        "| batch (queries) | batch total s (the old wait) | one-query p50 s | one-query max s | one-query requests "
        "| searches so far |"
    )
    print("|---|---|---|---|---|---|")
    for n, total, p50, worst, count, searches in rows:
        print(f"| {n} | {total:.2f} | {p50:.3f} | {worst:.3f} | {count} | {searches} |")


if __name__ == "__main__":
    main()
