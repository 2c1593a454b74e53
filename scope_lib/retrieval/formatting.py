"""What a search returns to the policy: ``Doc i (Title: t)`` blocks (the Search-R1 / SCOPE layout), neutralised
so that retrieved text can never open or close a protocol tag, and cut to a token budget.

    block = format_results(hits, tokenizer, max_tokens=500)   # what the policy sees in <information>
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from scope_lib.retrieval.api import Hit

if TYPE_CHECKING:
    from scope_lib.retrieval.corpus import Passage

log = logging.getLogger(__name__)


#: Retrieved text never contains these two characters: every protocol tag (<information>, </answer>,
#: <tool_call>, <think>, ...) and every chat-template control token (<|im_end|>, <|endoftext|>, ...) needs
#: "<" (and ">"), so without them no tag can be opened or closed, whatever the case, spacing, attributes or
#: later truncation. The lookalikes keep the text readable and cost about as many tokens as the originals.
NEUTRAL_LT, NEUTRAL_GT = "\u2039", "\u203a"  # single angle quotation marks: ‹ ›


_NEUTRALISE = str.maketrans({"<": NEUTRAL_LT, ">": NEUTRAL_GT})


def neutralize(text: str) -> str:
    """Make retrieved text unable to open or close any tag in the model's context: every '<' and '>'
    becomes '‹' / '›'. Entities such as '&lt;' are left as they are (never decoded)."""
    return text.translate(_NEUTRALISE)


def _format_block(rank: int, hit: Hit) -> tuple[str, str]:
    return f"Doc {rank} (Title: {neutralize(hit.title)})\n", neutralize(hit.text)


def format_results(hits: list[Hit], tokenizer: Any = None, max_tokens: int = 500) -> str:
    """The text a search returns to the policy: ``Doc i (Title: t)\\ntext`` blocks separated by blank lines
    (the Search-R1 / SCOPE layout), neutralised, and cut at a token boundary so the WHOLE string is at most
    `max_tokens` tokens of `tokenizer` (``encode(s, add_special_tokens=False)``; None approximates tokens
    by whitespace-separated words). A block cut inside its header line is dropped."""
    return format_results_batch([hits], tokenizer, max_tokens)[0]


def format_results_batch(hits_per_query: list[list[Hit]], tokenizer: Any = None,
                         max_tokens: int = 500) -> list[str]:
    """`format_results` for every query of a batch, tokenising all of them in one tokenizer call."""
    blocks = [[_format_block(rank, hit) for rank, hit in enumerate(hits, start=1)] for hits in hits_per_query]
    texts = ["\n\n".join(header + body for header, body in parts) for parts in blocks]
    if max_tokens <= 0:
        return ["" for _ in texts]
    return [_whole_blocks(text, cut, parts)
            for text, cut, parts in zip(texts, _truncate_batch(texts, tokenizer, max_tokens), blocks, strict=True)]


def _whole_blocks(text: str, cut: str, blocks: list[tuple[str, str]]) -> str:
    """`cut` (a prefix of `text`) without a trailing block whose header line it splits."""
    if len(cut) == len(text):
        return text
    start = 0
    for header, body in blocks:
        if len(cut) <= start + len(header):  # the cut falls in this block's header: drop the block
            return cut[:start].rstrip()
        start += len(header) + len(body) + 2
        if len(cut) < start:
            break
    return cut.rstrip()


def count_tokens(text: str, tokenizer: Any = None) -> int:
    """Tokens of `text` for the policy tokenizer (no special tokens), or whitespace words when None."""
    if tokenizer is None:
        return len(text.split())
    return len(tokenizer.encode(text, add_special_tokens=False))


def _truncate_batch(texts: list[str], tokenizer: Any, max_tokens: int) -> list[str]:
    """For each text, its longest prefix ending at a token boundary with at most `max_tokens` tokens."""
    if tokenizer is None:
        cuts = []
        for text in texts:
            words = list(re.finditer(r"\S+", text))
            cuts.append(text if len(words) <= max_tokens else text[:words[max_tokens - 1].end()])
        return cuts
    prefixes: dict[int, Any] = {}  # text index -> the text of its first n tokens, for texts over budget
    if getattr(tokenizer, "is_fast", False):  # one call gives every text's tokens and character offsets
        encoded = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)
        for i, (text, offsets) in enumerate(zip(texts, encoded["offset_mapping"], strict=True)):
            if len(offsets) > max_tokens:
                prefixes[i] = lambda n, t=text, o=offsets: t[:max(end for _, end in o[:n])]
    else:
        for i, text in enumerate(texts):
            ids = tokenizer.encode(text, add_special_tokens=False)
            if len(ids) > max_tokens:
                prefixes[i] = lambda n, ids=ids: tokenizer.decode(ids[:n]).rstrip("\ufffd")
    return _fit(texts, prefixes, tokenizer, max_tokens)


def _fit(texts: list[str], prefixes: dict[int, Any], tokenizer: Any, max_tokens: int) -> list[str]:
    """Replace each over-budget text by its longest `prefixes[i](n)` that re-tokenises to at most `max_tokens`
    tokens (re-tokenising a prefix can merge differently, so candidates are counted, in one call per round)."""
    cuts = list(texts)
    pending = dict.fromkeys(prefixes, max_tokens)
    while pending:
        candidates = {i: prefixes[i](n) for i, n in pending.items()}
        counts = tokenizer(list(candidates.values()), add_special_tokens=False)["input_ids"]
        still = {}
        for (i, cut), ids in zip(candidates.items(), counts, strict=True):
            if len(ids) <= max_tokens:
                cuts[i] = cut
            elif pending[i] > 1:
                still[i] = pending[i] - 1
            else:
                cuts[i] = ""
        pending = still
    return cuts


def passages_sha256(passages: Iterable[Passage]) -> str:
    """A checksum of passages held in memory (ids, titles, texts): the `corpus_sha256` of an index built
    from passages that did not come from a file (tests, synthetic benchmarks)."""
    digest = hashlib.sha256()
    for p in passages:
        digest.update(json.dumps([p.id, p.title, p.text]).encode())
        digest.update(b"\n")
    return digest.hexdigest()
