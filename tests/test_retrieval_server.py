"""The Search-R1 compatible /retrieve server and its client, on a free loopback port."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
from servers import free_port

from scope_lib.config import RetrievalConfig, load_params
from scope_lib.corpus import read_corpus
from scope_lib.retrieval import (
    Hit,
    HttpRetriever,
    RetrievalError,
    RetrieverUnavailable,
    build_index,
    open_retriever,
    passages_sha256,
)
from scope_lib.retrieval_server import background_server


@pytest.fixture(scope="module")
def index(wiki_sample: Path, tmp_path_factory):
    passages = read_corpus(wiki_sample).passages[:300]
    cfg = RetrievalConfig(embedder="hashing", collection="server_test")
    return build_index(passages, cfg, corpus_sha256=passages_sha256(passages),
                       path=tmp_path_factory.mktemp("index"), progress=False)


@pytest.fixture(scope="module")
def server(index):
    with background_server(index, default_topk=3) as url:
        yield url


def test_retrieve_answers_in_search_r1_shape(server, index):
    queries = ["Horse Mesa Dam Apache Lake Salt River", "Genentech lobbyist Roche"]
    response = httpx.post(f"{server}/retrieve", json={"queries": queries, "topk": 2, "return_scores": True})
    assert response.status_code == 200
    result = response.json()["result"]
    assert len(result) == 2 and all(len(items) == 2 for items in result)
    first = result[0][0]
    assert first["document"]["id"] == "14"
    assert first["document"]["contents"].startswith('"Horse Mesa Dam"\n')
    assert isinstance(first["score"], float)
    direct = index.search(queries, 2)
    assert [[item["document"]["id"] for item in items] for items in result] == [[h.id for h in hs] for hs in direct]


def test_default_topk_and_documents_without_scores(server):
    response = httpx.post(f"{server}/retrieve", json={"queries": ["Genentech"], "return_scores": False})
    assert response.status_code == 200
    items = response.json()["result"][0]
    assert len(items) == 3 and set(items[0]) == {"id", "contents"}


def test_health_reports_documents_and_embedder(server):
    body = httpx.get(f"{server}/health").json()
    assert body == {"status": "ok", "documents": 300, "embedder": "scope-hashing (hashing-v1-dim384)"}


def test_http_retriever_round_trips_hits(server, index):
    queries = ["Horse Mesa Dam", "", "Which lobbyist for Genentech died in 2015?"]
    with HttpRetriever(server, timeout_s=10) as client:
        remote = client.search(queries, k=3)
        assert client.health()["documents"] == 300
    local = index.search(queries, 3)
    assert remote[1] == [] and local[1] == []
    for got, want in zip(remote, local, strict=True):
        assert [(h.id, h.title, h.text) for h in got] == [(h.id, h.title, h.text) for h in want]
        assert [h.score for h in got] == pytest.approx([h.score for h in want], abs=1e-6)
    assert remote[0][0] == Hit(id="14", title="Horse Mesa Dam", text=local[0][0].text, score=remote[0][0].score)


@pytest.mark.parametrize("payload", [
    {"queries": []},
    {"queries": [""]},
    {"queries": ["   "]},
    {"queries": "not a list"},
    {"queries": ["ok", 3]},
    {"queries": ["ok"], "topk": 0},
    {"queries": ["ok"], "topk": 101},
    {"queries": ["ok"], "topk": "3"},
    {"queries": ["ok"], "return_scores": "yes"},
    {"topk": 3},
    ["ok"],
])
def test_bad_payloads_get_422(server, payload):
    response = httpx.post(f"{server}/retrieve", json=payload)
    assert response.status_code == 422, response.text
    assert response.json()["detail"]


@pytest.mark.parametrize("body", [b"{not json", b"", b"null", b'{"queries": ["a"]'])
def test_malformed_json_gets_4xx(server, body):
    response = httpx.post(f"{server}/retrieve", content=body, headers={"content-type": "application/json"})
    assert 400 <= response.status_code < 500, response.text


def test_too_many_queries_get_413(index):
    with background_server(index, max_queries=4) as small:
        response = httpx.post(f"{small}/retrieve", json={"queries": ["a"] * 5})
        assert response.status_code == 413 and "at most 4" in response.json()["detail"]
        assert httpx.post(f"{small}/retrieve", json={"queries": ["a"] * 4}).status_code == 200


class _Broken:
    def search(self, queries, k=None):
        raise RuntimeError("index on fire")


def test_retriever_failure_gets_503_and_client_names_the_server():
    with background_server(_Broken()) as broken:
        response = httpx.post(f"{broken}/retrieve", json={"queries": ["a"]})
        assert response.status_code == 503 and "index on fire" in response.json()["detail"]
        client = HttpRetriever(broken, timeout_s=5, retries=1, backoff_s=0.01)
        with pytest.raises(RetrieverUnavailable, match="503"):
            client.search(["a"])


def test_unreachable_server_names_url_and_remedy():
    url = f"http://127.0.0.1:{free_port()}"
    client = HttpRetriever(url, timeout_s=2, retries=2, backoff_s=0.01)
    with pytest.raises(RetrieverUnavailable) as info:
        client.search(["anything"])
    message = str(info.value)
    assert url in message and "scope serve retrieval" in message and "3 attempts" in message


def test_client_error_is_not_retried(server):
    client = HttpRetriever(server, timeout_s=5, retries=3, backoff_s=5.0)
    started = time.monotonic()
    with pytest.raises(RetrievalError, match="422"):
        client.search(["ok"], k=1000)  # topk > 100: rejected at once, no 5 s backoff
    assert time.monotonic() - started < 4


def test_open_retriever_http_backend(server):
    params = load_params(overrides={"retrieval.backend": "http", "retrieval.server_url": server + "/"})
    retriever = open_retriever(params)
    assert isinstance(retriever, HttpRetriever)
    assert retriever.search(["Horse Mesa Dam"])[0][0].id == "14"


def test_background_server_round_trip_and_shutdown():
    class OneHit:
        def search(self, queries, k=None):
            return [[Hit(id="7", title="T", text=q, score=0.5)] for q in queries]

    with background_server(OneHit()) as url:
        body = httpx.post(f"{url}/retrieve", json={"queries": ["a", "b"], "topk": 1}).json()
        assert [r[0]["document"]["contents"] for r in body["result"]] == ['"T"\na', '"T"\nb']
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{url}/health", timeout=2)
