"""Measure the evaluation's judge path: requests per second to an OpenAI-compatible endpoint by concurrency, the cost
of a re-run served from the on-disk cache, and our own overhead per judge unit (rendering prompts, parsing replies,
combining scores) — everything except the judge model itself.

    python benchmarks/evaluation.py [--requests 200] [--latency-ms 50]

The endpoint is a loopback server that answers every chat request after a fixed latency (a stand-in for a hosted
judge), so the numbers isolate our client. Prints a table.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scope_lib.config import load_params  # noqa: E402
from scope_lib.evaluation.benchmarks import Item  # noqa: E402
from scope_lib.evaluation.evaluate import Answered, score_items  # noqa: E402
from scope_lib.evaluation.judge import (
    BenchmarkJudge,
    ChatCompletionsBackend,
    JudgeCache,
    JudgeReply,
    JudgeRequest,
    JudgeSettings,
)


class _Slow(BaseHTTPRequestHandler):
    latency = 0.05

    def log_message(self, *args):
        pass

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        time.sleep(self.latency)
        data = json.dumps({"choices": [{"message": {"content": '{"criteria_met": true}'}}],
                           "usage": {"prompt_tokens": 900, "completion_tokens": 40}}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


class _Instant:
    name = "instant"

    def send(self, requests, on_reply):
        for i, r in enumerate(requests):
            on_reply(i, JudgeReply('{"explanation": "x", "criteria_met": true}', r.key))


def judge_throughput(n: int, latency_s: float, concurrency: int, cache_dir: Path) -> dict:
    _Slow.latency = latency_s
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Slow)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    requests = [JudgeRequest([{"role": "user", "content": f"criterion {k}"}], JudgeSettings("m", 1.0), "t@1", 0, "b")
                for k in range(n)]
    backend = ChatCompletionsBackend(url, concurrency=concurrency, api_key_env="NO_KEY")
    cache = JudgeCache(cache_dir / f"c{concurrency}.sqlite")
    judge = BenchmarkJudge(backend, cache)
    t0 = time.perf_counter()
    judge.complete(requests)
    fresh = time.perf_counter() - t0
    t0 = time.perf_counter()
    BenchmarkJudge(backend, cache).complete(requests)
    cached = time.perf_counter() - t0
    backend.close()
    server.shutdown()
    return {"concurrency": concurrency, "requests": n, "fresh s": round(fresh, 2),
            "requests/s": round(n / fresh, 1), "ideal requests/s": round(concurrency / latency_s, 1),
            "cached re-run s": round(cached, 3)}


def scoring_overhead(data_dir: Path, repeats: int) -> dict:
    """score_items on the real HealthBench sample (58 criteria over 8 conversations, both scorers) with an instant
    judge: what our side costs per unit."""
    from scope_lib.evaluation.benchmarks import load_benchmark

    params = load_params(None, {"run.data_dir": str(data_dir), "evaluation.bootstrap_samples": 1000,
                                "evaluation.data_files": {"healthbench": "openended/healthbench_sample.jsonl"}})
    items: list[Item] = load_benchmark(params, "healthbench").items
    answered = [Answered(i, 0, "A short reply that names a clinic and a follow-up.", "answer", f"t{k}")
                for k, i in enumerate(items)]
    best = float("inf")
    units = 0
    for _ in range(repeats):
        t0 = time.perf_counter()
        _, summary = score_items(params, "healthbench", answered, BenchmarkJudge(_Instant()))
        best = min(best, time.perf_counter() - t0)
        units = sum(v["n_units"] for v in summary.values())
    return {"items": len(items), "units (both scorers)": units, "score_items s (incl. 2x1000 bootstrap)":
            round(best, 3), "ms per unit": round(1000 * best / units, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--latency-ms", type=float, default=50.0)
    parser.add_argument("--data-dir", default=str(Path(__file__).resolve().parents[2] / "shared" / "data"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rows = [judge_throughput(args.requests, args.latency_ms / 1000, c, Path(tmp)) for c in (1, 8, 32)]
    print(f"\nJudge client, {args.requests} requests, {args.latency_ms:.0f} ms per request at the server")
    print(" | ".join(rows[0]))
    for r in rows:
        print(" | ".join(str(v) for v in r.values()))
    if (Path(args.data_dir) / "openended" / "healthbench_sample.jsonl").is_file():
        row = scoring_overhead(Path(args.data_dir), 3)
        print("\nScoring overhead (HealthBench sample, instant judge)")
        print(" | ".join(row))
        print(" | ".join(str(v) for v in row.values()))


if __name__ == "__main__":
    main()
