"""Retrieval over the corpus (§3, Table 9): every Challenger and Solver search goes through `Retriever.search`.

api            Hit, the Retriever protocol, errors (light: no chromadb, faiss or torch)
corpus         wiki-18 JSONL reading, checks, sampling, download
embedders      E5 (the paper), packaged MiniLM (offline), hashing (unit tests)
chroma_index, faiss_index, bm25_index, http_client    the backends (each imports api, never index)
store          resumable on-disk passage and embedding shards (faiss, bm25)
plan           memory, disk and build time of every index type
index          open_retriever / build_or_open_index: the one dispatch on `retrieval.backend`
check          `scope index check`: canaries, fingerprints, result sanity
formatting     what the policy sees: Doc blocks, neutralised tags, token budget
server         the Search-R1 style /retrieve server
recall         labelled-question recall on the corpus sample
"""
