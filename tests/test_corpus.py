"""scope_lib.retrieval.corpus: reading wiki-18 JSONL, problems with file:line, sampling, fetching (file:// and a local
HTTP server with Range support; never an external address)."""

from __future__ import annotations

import gzip
import hashlib
import json
import logging
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

import scope_lib.retrieval.corpus as corpus_module
from scope_lib.config import load_params
from scope_lib.retrieval.corpus import (
    Corpus,
    CorpusError,
    FetchError,
    Passage,
    corpus_checksum,
    fetch_corpus,
    fetch_data,
    iter_passages,
    permutation_slice,
    read_corpus,
    sample_documents,
)

SAMPLE_SHA256 = "4ff49380c38844c413c5d022e9c269b21a00726130f561b518600f2beb7cc6ed"


@pytest.fixture(autouse=True)
def _no_proxy(monkeypatch):
    """Loopback requests must not go through a proxy from the environment."""
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.delenv(name, raising=False)


def line(pid, title="T", text="some text") -> str:
    return json.dumps({"id": pid, "contents": f'"{title}"\n{text}'})


def write_lines(path: Path, lines: list[str], trailing_newline: bool = True) -> Path:
    path.write_text("\n".join(lines) + ("\n" if trailing_newline else ""))
    return path


def first_lines(path: Path, n: int) -> bytes:
    with open(path, "rb") as f:
        return b"".join(f.readline() for _ in range(n))


# -- passages -------------------------------------------------------------------------------------


def test_passage_formats():
    p = Passage.from_contents("7", '"Evan Morris"\nEvan Morris was a lobbyist.\n')
    assert (p.title, p.text) == ("Evan Morris", "Evan Morris was a lobbyist.")
    assert p.contents == '"Evan Morris"\nEvan Morris was a lobbyist.'
    assert p.document == "(Title: Evan Morris)\nEvan Morris was a lobbyist."
    assert Passage.from_contents("8", "Absalon\ntext").title == "Absalon"  # unquoted titles occur in wiki-18
    assert Passage.from_contents("9", '""Havn""\ntext').title == '"Havn"'  # only one pair removed


# -- the real sample ------------------------------------------------------------------------------


def test_real_sample_loads(wiki_sample):
    corpus = read_corpus(wiki_sample)
    assert len(corpus) == 1000
    assert [p.id for p in corpus] == [str(i) for i in range(1000)]
    assert all(p.title and '"' not in p.title and p.text for p in corpus)
    assert corpus.passages[0].title == "Evan Morris"
    assert corpus.passages[0].text.startswith("Evan Morris Evan L. Morris (January 26, 1977")
    assert corpus.problems == []
    assert corpus.summary() == "1000 passages, 0 skipped (wiki18_sample.jsonl)"


def test_real_sample_checksum(wiki_sample, shared_data):
    assert SAMPLE_SHA256 in (shared_data / "README.md").read_text()
    assert corpus_checksum(wiki_sample) == SAMPLE_SHA256
    assert read_corpus(wiki_sample, max_passages=3).sha256 == SAMPLE_SHA256


def test_max_passages_and_streaming(wiki_sample):
    assert [p.id for p in read_corpus(wiki_sample, max_passages=5)] == ["0", "1", "2", "3", "4"]
    stream = iter_passages(wiki_sample)
    assert next(stream).title == "Evan Morris"
    stream.close()


def test_gzip_corpus(wiki_sample, tmp_path):
    data = wiki_sample.read_bytes()
    gz = tmp_path / "wiki.jsonl.gz"
    gz.write_bytes(gzip.compress(data))
    odd_name = tmp_path / "wiki_gz_without_suffix.jsonl"  # detected from the bytes, not the name
    odd_name.write_bytes(gzip.compress(data))
    plain = read_corpus(wiki_sample).passages
    assert read_corpus(gz).passages == plain
    assert read_corpus(odd_name).passages == plain


def test_truncated_gzip_is_an_error(wiki_sample, tmp_path):
    gz = tmp_path / "cut.jsonl.gz"
    gz.write_bytes(gzip.compress(wiki_sample.read_bytes())[:50_000])
    with pytest.raises(CorpusError, match=r"cut\.jsonl\.gz:\d+: the gzip stream is corrupt or truncated"):
        read_corpus(gz, on_error="skip")


# -- malformed lines ------------------------------------------------------------------------------

BAD_LINES = {
    "invalid_json": '{"id": "x", "contents": "\\"T\\"\\ntext"',
    "not_object": '["a", "list"]',
    "bad_field": json.dumps({"id": "x"}),
    "empty_passage": json.dumps({"id": "x", "contents": '"Title only"\n  '}),
    "duplicate_id": line("1"),
}


@pytest.mark.parametrize("kind", list(BAD_LINES))
def test_problem_raises_with_file_and_line(tmp_path, kind):
    path = write_lines(tmp_path / "bad.jsonl", [line("1"), line("2"), BAD_LINES[kind], line("4")])
    with pytest.raises(CorpusError) as info:
        read_corpus(path)
    message = str(info.value)
    assert message.startswith(f"{path}:3: ")
    assert "retrieval.on_error: skip" in message
    assert info.value.problem.kind == kind and info.value.problem.line == 3
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("record, words", [
    ({"contents": '"T"\ntext'}, "missing 'id'"),
    ({"id": 3, "contents": '"T"\ntext'}, "'id' must be a string, got int"),
    ({"id": "3", "contents": None}, "'contents' must be a string, got NoneType"),
    ({"id": "", "contents": '"T"\ntext'}, "'id' is empty"),
])
def test_bad_field_messages(tmp_path, record, words):
    path = write_lines(tmp_path / "f.jsonl", [json.dumps(record)])
    with pytest.raises(CorpusError, match=f"f.jsonl:1: {words}"):
        read_corpus(path)


def test_skip_counts_each_kind(tmp_path, caplog):
    lines = [line("1"), BAD_LINES["invalid_json"], "", BAD_LINES["not_object"], BAD_LINES["bad_field"],
             line("5"), BAD_LINES["empty_passage"], BAD_LINES["duplicate_id"], "   ", line("9")]
    path = write_lines(tmp_path / "mixed.jsonl", lines)
    with caplog.at_level(logging.WARNING, logger="scope_lib.retrieval.corpus"):
        corpus = read_corpus(path, on_error="skip")
    assert [p.id for p in corpus] == ["1", "5", "9"]
    assert [(p.line, p.kind) for p in corpus.problems] == [
        (2, "invalid_json"), (4, "not_object"), (5, "bad_field"), (7, "empty_passage"), (8, "duplicate_id")]
    assert str(corpus.problems[-1]) == f"{path}:8: duplicate id '1' (ids must be unique)"
    assert corpus.summary() == ("3 passages, 5 skipped (mixed.jsonl; invalid_json 1, not_object 1, "
                                "bad_field 1, empty_passage 1, duplicate_id 1)")
    warnings = [r for r in caplog.records if r.name == "scope_lib.retrieval.corpus"]
    assert len(warnings) == 1 and "skipped 5 malformed line(s)" in warnings[0].getMessage()


def test_no_trailing_newline_blank_lines_and_crlf(tmp_path):
    path = write_lines(tmp_path / "n.jsonl", ["", line("a"), "", line("b", text="last")],
                       trailing_newline=False)
    assert [(p.id, p.text) for p in read_corpus(path)] == [("a", "some text"), ("b", "last")]
    crlf = tmp_path / "crlf.jsonl"
    crlf.write_bytes(f"{line('a')}\r\n{line('b')}\r\n".encode())
    assert [p.id for p in read_corpus(crlf)] == ["a", "b"]


def test_duplicate_ids_numeric_and_text(tmp_path):
    ids = ["0", "7", "1000000", "007", "x", "7", "x", "1000000"]
    path = write_lines(tmp_path / "d.jsonl", [line(i) for i in ids])
    corpus = read_corpus(path, on_error="skip")
    assert [p.id for p in corpus] == ["0", "7", "1000000", "007", "x"]
    assert [p.line for p in corpus.problems] == [6, 7, 8]


def test_missing_file_says_what_to_do(tmp_path):
    with pytest.raises(CorpusError, match="no such corpus file.*SCOPE_DATA_DIR.*retrieval.corpus"):
        read_corpus(tmp_path / "absent.jsonl")


def test_on_error_is_checked(wiki_sample):
    with pytest.raises(ValueError, match="on_error"):
        read_corpus(wiki_sample, on_error="ignore")


# -- sampling source documents --------------------------------------------------------------------


def passages(n: int) -> list[Passage]:
    return [Passage(str(i), f"T{i}", f"text {i}") for i in range(n)]


def test_sampling_is_deterministic_and_seeded():
    pool = passages(100)
    first = sample_documents(pool, 10, seed=42, iteration=1)
    assert first == sample_documents(pool, 10, seed=42, iteration=1)
    assert first != sample_documents(pool, 10, seed=43, iteration=1)
    assert first != pool[:10]  # a permutation, not the file order


def test_iterations_do_not_overlap():
    pool = passages(100)
    slices = [sample_documents(pool, 25, seed=0, iteration=t) for t in (1, 2, 3, 4)]
    ids = [p.id for s in slices for p in s]
    assert len(ids) == len(set(ids)) == 100
    assert slices[1] == [pool[i] for i in permutation_slice(100, 25, 0, 1)]


def test_sampling_wraps_around_with_a_warning(caplog):
    pool = passages(10)
    with caplog.at_level(logging.WARNING, logger="scope_lib.retrieval.corpus"):
        third = sample_documents(pool, 4, seed=1, iteration=3)
    assert "wrapping around" in caplog.text
    everything = sample_documents(pool, 10, seed=1, iteration=1)
    assert third == everything[8:] + everything[:2]


def test_sampling_exclude_and_errors():
    pool = passages(20)
    chosen = sample_documents(pool, 10, seed=5, iteration=1, exclude=[str(i) for i in range(10)])
    assert sorted(int(p.id) for p in chosen) == list(range(10, 20))
    with pytest.raises(ValueError, match="1-based"):
        sample_documents(pool, 1, seed=0, iteration=0)
    with pytest.raises(ValueError, match="no documents"):
        sample_documents(pool, 1, seed=0, iteration=1, exclude=[p.id for p in pool])


# -- fetching from local files --------------------------------------------------------------------


def sidecar_digest(dest: Path) -> str:
    digest, name = dest.with_name(dest.name + ".sha256").read_text().split()
    assert name == dest.name
    return digest


def test_fetch_slice_from_file_url_gz(wiki_sample, tmp_path):
    source = tmp_path / "src" / "wiki-18.jsonl.gz"
    source.parent.mkdir()
    source.write_bytes(gzip.compress(wiki_sample.read_bytes()))
    dest = tmp_path / "data" / "wiki-18.jsonl"
    assert fetch_corpus(source.as_uri(), dest, max_passages=25, progress=False) == dest
    assert dest.read_bytes() == first_lines(wiki_sample, 25)
    assert sidecar_digest(dest) == corpus_checksum(dest)
    assert len(read_corpus(dest)) == 25
    assert not list(dest.parent.glob("*.part")) and not list(dest.parent.glob(".*tmp"))


def test_fetch_full_from_plain_path_with_checksum(wiki_sample, tmp_path):
    dest = tmp_path / "wiki.jsonl"
    fetch_corpus(str(wiki_sample), dest, sha256=SAMPLE_SHA256.upper(), progress=False)
    assert dest.read_bytes() == wiki_sample.read_bytes()
    assert sidecar_digest(dest) == SAMPLE_SHA256


def test_fetch_full_gz_is_decompressed_or_kept(wiki_sample, tmp_path):
    packed = gzip.compress(wiki_sample.read_bytes())
    source = tmp_path / "wiki.jsonl.gz"
    source.write_bytes(packed)
    plain = fetch_corpus(source.as_uri(), tmp_path / "out" / "wiki.jsonl",
                         sha256=hashlib.sha256(packed).hexdigest(), progress=False)
    assert plain.read_bytes() == wiki_sample.read_bytes()
    assert sidecar_digest(plain) == SAMPLE_SHA256
    kept = fetch_corpus(str(source), tmp_path / "out" / "wiki.jsonl.gz", progress=False)
    assert kept.read_bytes() == packed
    assert not list((tmp_path / "out").glob("*.part"))


def test_fetch_corrupt_gzip_keeps_nothing(wiki_sample, tmp_path):
    source = tmp_path / "src" / "broken.jsonl.gz"
    source.parent.mkdir()
    source.write_bytes(gzip.compress(wiki_sample.read_bytes())[:30_000])  # truncated
    out = tmp_path / "out"
    with pytest.raises(FetchError, match="gzip file is corrupt"):
        fetch_corpus(str(source), out / "wiki.jsonl", progress=False)
    assert list(out.iterdir()) == []


def test_fetch_slice_of_gzip_members_and_short_source(tmp_path):
    source = tmp_path / "multi.jsonl.gz"  # two gzip members, as pigz/bgzip write
    source.write_bytes(gzip.compress(f"{line('a')}\n".encode()) + gzip.compress(f"{line('b')}".encode()))
    dest = fetch_corpus(str(source), tmp_path / "s.jsonl", max_passages=10, progress=False)
    assert [p.id for p in read_corpus(dest)] == ["a", "b"]
    assert dest.read_text().endswith("\n")
    packed = fetch_corpus(str(source), tmp_path / "s.jsonl.gz", max_passages=1, progress=False)
    assert packed.read_bytes()[:2] == b"\x1f\x8b" and [p.id for p in read_corpus(packed)] == ["a"]


def test_resume_from_file_part(wiki_sample, tmp_path):
    data = wiki_sample.read_bytes()
    dest = tmp_path / "wiki.jsonl"
    dest.with_name("wiki.jsonl.part").write_bytes(data[:100_000])
    fetch_corpus(wiki_sample.as_uri(), dest, sha256=SAMPLE_SHA256, progress=False)
    assert dest.read_bytes() == data


def test_checksum_mismatch_keeps_nothing(wiki_sample, tmp_path):
    dest = tmp_path / "wiki.jsonl"
    with pytest.raises(FetchError, match="sha256 mismatch.*expected 0{64}.*" + SAMPLE_SHA256):
        fetch_corpus(str(wiki_sample), dest, sha256="0" * 64, progress=False)
    assert list(tmp_path.iterdir()) == []


def test_existing_dest_is_kept_unless_overwrite(wiki_sample, tmp_path):
    dest = write_lines(tmp_path / "wiki.jsonl", [line("only")])
    assert fetch_corpus("http://127.0.0.1:9/never-contacted", dest, progress=False) == dest
    assert len(read_corpus(dest)) == 1
    fetch_corpus(str(wiki_sample), dest, max_passages=3, overwrite=True, progress=False)
    assert len(read_corpus(dest)) == 3


def test_missing_source_says_how_to_use_local_files(tmp_path):
    with pytest.raises(FetchError, match="no such source file.*SCOPE_DATA_DIR.*retrieval.corpus"):
        fetch_corpus(str(tmp_path / "nothing.jsonl"), tmp_path / "d.jsonl", progress=False)


def test_fetch_data_uses_params(wiki_sample, tmp_path):
    params = load_params(overrides={"run.data_dir": str(tmp_path / "data"),
                                    "retrieval.corpus_url": wiki_sample.as_uri(),
                                    "retrieval.fetch_max_passages": 7})
    path = fetch_data(params, progress=False)
    assert path == tmp_path / "data" / "wiki-18.jsonl" == params.corpus_path
    assert [p.id for p in read_corpus(path)] == [str(i) for i in range(7)]
    params.retrieval.fetch_max_passages = 2
    assert len(read_corpus(fetch_data(params, progress=False))) == 7  # kept
    assert len(read_corpus(fetch_data(params, overwrite=True, progress=False))) == 2


# -- fetching over HTTP (a server on 127.0.0.1 in this process) -----------------------------------


class RangeServer(ThreadingHTTPServer):
    """Serves `files` by path; honours `Range: bytes=N-` unless `ranges` is False; `cut_after` bytes
    ends the next response early (a dropped connection)."""

    daemon_threads = True

    def __init__(self):
        super().__init__(("127.0.0.1", 0), RangeHandler)
        self.files: dict[str, bytes] = {}
        self.ranges = True
        self.cut_after: int | None = None
        self.requests: list[tuple[str | None, int]] = []  # (Range header, status)

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/{name}"


class RangeHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self):  # noqa: N802 (http.server's name)
        server: RangeServer = self.server
        body = server.files.get(self.path.lstrip("/"))
        wanted = self.headers.get("Range")
        if body is None:
            return self._reply(server, wanted, 404, b"not found", {})
        start = int(wanted.removeprefix("bytes=").rstrip("-")) if wanted and server.ranges else 0
        if start >= len(body) and start:
            return self._reply(server, wanted, 416, b"", {"Content-Range": f"bytes */{len(body)}"})
        headers = {"Content-Length": str(len(body) - start)}
        if wanted and server.ranges:
            headers["Content-Range"] = f"bytes {start}-{len(body) - 1}/{len(body)}"
        payload = body[start:]
        if server.cut_after is not None:
            payload, server.cut_after = payload[:server.cut_after], None
            self.close_connection = True
        self._reply(server, wanted, 206 if "Content-Range" in headers else 200, payload, headers)

    def _reply(self, server, wanted, status, payload, headers):
        server.requests.append((wanted, status))
        self.send_response(status)
        headers.setdefault("Content-Length", str(len(payload)))
        for key, value in headers.items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(payload)
        self.wfile.flush()

    def log_message(self, *args):
        pass


@pytest.fixture
def http_server():
    server = RangeServer()
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()
    thread.join(timeout=5)


def test_http_slice_of_gz(http_server, wiki_sample, tmp_path):
    http_server.files["wiki-18.jsonl.gz"] = gzip.compress(wiki_sample.read_bytes())
    dest = fetch_corpus(http_server.url("wiki-18.jsonl.gz"), tmp_path / "wiki.jsonl", max_passages=40,
                        progress=False)
    assert dest.read_bytes() == first_lines(wiki_sample, 40)
    assert sidecar_digest(dest) == corpus_checksum(dest)


def test_http_full_download(http_server, wiki_sample, tmp_path):
    http_server.files["wiki.jsonl"] = wiki_sample.read_bytes()
    dest = fetch_corpus(http_server.url("wiki.jsonl"), tmp_path / "wiki.jsonl", sha256=SAMPLE_SHA256,
                        progress=False)
    assert corpus_checksum(dest) == SAMPLE_SHA256
    assert http_server.requests == [(None, 200)]


def test_http_resume_after_dropped_connection(http_server, wiki_sample, tmp_path):
    data = wiki_sample.read_bytes()
    packed = gzip.compress(data)
    http_server.files["wiki.jsonl.gz"] = packed
    http_server.cut_after = 60_000
    dest = tmp_path / "wiki.jsonl"
    url = http_server.url("wiki.jsonl.gz")
    with pytest.raises(FetchError, match="run again to resume"):
        fetch_corpus(url, dest, progress=False)
    part = tmp_path / "wiki.jsonl.part"
    assert part.stat().st_size == 60_000 and not dest.exists()
    fetch_corpus(url, dest, sha256=hashlib.sha256(packed).hexdigest(), progress=False)
    assert http_server.requests == [(None, 200), ("bytes=60000-", 206)]
    assert dest.read_bytes() == data and not part.exists()


def test_http_resume_of_complete_part(http_server, wiki_sample, tmp_path):
    data = wiki_sample.read_bytes()
    http_server.files["wiki.jsonl"] = data
    (tmp_path / "wiki.jsonl.part").write_bytes(data)
    fetch_corpus(http_server.url("wiki.jsonl"), tmp_path / "wiki.jsonl", sha256=SAMPLE_SHA256, progress=False)
    assert http_server.requests == [(f"bytes={len(data)}-", 416)]
    assert (tmp_path / "wiki.jsonl").read_bytes() == data


def test_http_server_without_range_restarts(http_server, wiki_sample, tmp_path):
    data = wiki_sample.read_bytes()
    http_server.files["wiki.jsonl"] = data
    http_server.ranges = False
    (tmp_path / "wiki.jsonl.part").write_bytes(b"stale bytes from an older attempt")
    dest = fetch_corpus(http_server.url("wiki.jsonl"), tmp_path / "wiki.jsonl", progress=False)
    assert dest.read_bytes() == data
    assert http_server.requests == [("bytes=33-", 200)]


def test_http_error_status(http_server, tmp_path):
    with pytest.raises(FetchError, match=r"HTTP 404.*SCOPE_DATA_DIR.*retrieval\.corpus"):
        fetch_corpus(http_server.url("missing.jsonl.gz"), tmp_path / "wiki.jsonl", progress=False)
    assert list(tmp_path.iterdir()) == []


def test_unreachable_server_fails_fast(tmp_path):
    with socket.socket() as sock:  # a loopback port that nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    started = time.monotonic()
    with pytest.raises(FetchError) as info:
        fetch_corpus(f"http://127.0.0.1:{port}/wiki-18.jsonl.gz", tmp_path / "wiki-18.jsonl", progress=False)
    assert time.monotonic() - started < 10
    message = str(info.value)
    assert "could not connect" in message and "SCOPE_DATA_DIR" in message and "retrieval.corpus" in message
    assert not (tmp_path / "wiki-18.jsonl").exists()


def test_unresponsive_server_hits_the_connect_timeout(tmp_path, monkeypatch):
    """A host that never answers the handshake (a full accept queue on loopback) fails after the short
    connect timeout, not after `timeout_s`."""
    assert corpus_module.CONNECT_TIMEOUT_S <= 5
    monkeypatch.setattr(corpus_module, "CONNECT_TIMEOUT_S", 1.0)
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(0)
        port = server.getsockname()[1]
        fillers = [socket.socket() for _ in range(3)]
        for filler in fillers:
            filler.setblocking(False)
            filler.connect_ex(("127.0.0.1", port))
        started = time.monotonic()
        try:
            with pytest.raises(FetchError, match="could not connect.*ConnectTimeout.*SCOPE_DATA_DIR"):
                fetch_corpus(f"http://127.0.0.1:{port}/wiki.jsonl.gz", tmp_path / "w.jsonl", timeout_s=60,
                             progress=False)
        finally:
            for filler in fillers:
                filler.close()
    assert time.monotonic() - started < 5


def test_corpus_is_a_dataclass_of_passages(wiki_sample):
    corpus = read_corpus(wiki_sample, max_passages=2)
    assert isinstance(corpus, Corpus) and corpus.path == wiki_sample
    assert all(isinstance(p, Passage) for p in corpus)
