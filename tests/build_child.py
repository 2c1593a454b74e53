"""Run an index build in its own process, for the SIGKILL test: `python build_child.py PARAMS_JSON SLOW_S`.

The embedder is the real hashing embedder, slowed by SLOW_S seconds per call so that the test's kill lands
in the middle of the build; everything else is the product's build path."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from scope_lib.config import Params
from scope_lib.retrieval.embedders import HashingEmbedder
from scope_lib.retrieval.index import build_or_open_index


class SlowHashing(HashingEmbedder):
    def __init__(self, slow_s: float) -> None:
        super().__init__()
        self.slow_s = slow_s

    def _embed(self, texts, query):
        time.sleep(self.slow_s)
        return super()._embed(texts, query)


if __name__ == "__main__":
    params = Params.model_validate_json(Path(sys.argv[1]).read_text())
    build_or_open_index(params, progress=False, embedder=SlowHashing(float(sys.argv[2])))
