"""Batched multi-turn rollouts for the Challenger and the Solver (paper §3.1, Appendices E-G).

Each round makes ONE engine call for every live trajectory and ONE batched retrieval call for every search
those trajectories asked for; finished trajectories drop out. A round is one assistant turn for each of them,
except that a stop string falling inside an open <think> block (a thinking model naming `</answer>` in its plan)
does not end the turn: that trajectory continues the same turn in the next round's batched call, from the
exact tokens it has so far, until a stop outside thinking, the turn's token budget or end of sequence
(counted per trajectory and per batch as `stops_in_thinking`). A Trajectory keeps the token ids exactly as
the engine sampled them (model output is never re-tokenised), an env mask (1 = model token, 0 = tokens
the environment wrote: chat headers, retrieved information, instructions) and the sampled logprobs.
"""

from __future__ import annotations

import itertools
import logging
import random
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from scope_lib.models.engine import Engine, Sampling
from scope_lib.protocol import parsing, prompts
from scope_lib.protocol.dialects import Dialect, SearchAction
from scope_lib.retrieval.api import Retriever
from scope_lib.retrieval.formatting import format_results_batch

log = logging.getLogger(__name__)

Role = Literal["challenger", "solver"]


# -- records ---------------------------------------------------------------------------------------


@dataclass
class SearchRecord:
    """One search action the environment handled: the turn it was made in, its query, and what came back
    (a malformed action gets a correction instead). An action in a turn that cannot be followed gets no
    reply and no record; the format and search rewards count actions from the turns' text (F.1, F.2).
    `turn` counts the conversation's assistant turns from the rollout's first, across calls that continue it (a
    forced answer, a replay; `conversation_turn`)."""

    turn: int
    query: str | None
    valid: bool
    hit_ids: list[str] = field(default_factory=list)
    results: str = ""


@dataclass
class Trajectory:
    """One multi-turn rollout. `completion_ids`, `env_mask` and `logprobs` are aligned token by token."""

    id: str
    role: Role
    prompt_ids: list[int]
    messages: list[dict[str, str]]
    expected_searches: int | None = None
    max_searches: int | None = None
    opens_think: bool = False          # the chat template itself opened <think> in the generation prompt
    meta: dict[str, Any] = field(default_factory=dict)
    completion_ids: list[int] = field(default_factory=list)
    env_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    turns: list[str] = field(default_factory=list)
    turn_spans: list[tuple[int, int]] = field(default_factory=list)
    turn_prompt_ids: list[list[int]] = field(default_factory=list)
    searches: list[SearchRecord] = field(default_factory=list)
    finish: str = ""
    task: str | None = None
    answer: str | None = None
    stops_in_thinking: int = 0   # stops that fell inside an open <think> block: the turn went on instead

    @property
    def done(self) -> bool:
        return bool(self.finish)

    @property
    def n_valid_searches(self) -> int:
        return sum(s.valid for s in self.searches)

    @property
    def n_malformed_searches(self) -> int:
        return sum(not s.valid for s in self.searches)

    @property
    def n_model_tokens(self) -> int:
        return sum(self.env_mask)

    @property
    def evidence(self) -> list[str]:
        """The retrieved blocks this rollout saw (the evidence set d of §3.1)."""
        return [s.results for s in self.searches if s.valid and s.results]

    def model_token_ids(self) -> list[int]:
        return [t for t, m in zip(self.completion_ids, self.env_mask, strict=True) if m]

    def to_record(self) -> dict[str, Any]:
        record = asdict(self)
        record["turn_spans"] = [list(span) for span in self.turn_spans]
        return record

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> Trajectory:
        fields = dict(record)
        fields["turn_spans"] = [tuple(span) for span in fields.get("turn_spans", [])]
        fields["searches"] = [SearchRecord(**s) for s in fields.get("searches", [])]
        return cls(**fields)


@dataclass
class RolloutLimits:
    """Turn and token budgets of one role's rollouts (Table 9, §4.1)."""

    max_turns: int
    max_new_tokens_per_turn: int
    max_response_tokens: int
    max_model_len: int
    max_prompt_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k_docs: int = 3
    max_result_tokens: int = 500
    seed: int | None = None


@dataclass
class RolloutStats:
    """What a batch of rollouts cost: engine and retrieval calls, tokens, and where the time went. `turns` is the
    most assistant turns any rollout took in the call; `engine_calls` the rounds (more than `turns` when a stop
    inside thinking continued a turn); `stops_in_thinking` how many stops inside thinking did not end a turn."""

    turns: int = 0
    engine_calls: int = 0
    stops_in_thinking: int = 0
    retrieval_calls: int = 0
    generated_tokens: int = 0
    generation_s: float = 0.0
    retrieval_s: float = 0.0
    total_s: float = 0.0
    finishes: dict[str, int] = field(default_factory=dict)

    @property
    def overhead_s(self) -> float:
        return max(0.0, self.total_s - self.generation_s - self.retrieval_s)


# -- prompts ---------------------------------------------------------------------------------------


def apportion(n: int, weights: list[int] | list[float], seed: int) -> list[int]:
    """Exactly apportion n items over len(weights) strata (largest remainder), shuffled by seed.

    Returns stratum indices; with weights 4:3:2 and n = 2000 the counts are 889/667/444 (App. G).
    """
    total = float(sum(weights))
    quotas = [n * w / total for w in weights]
    counts = [int(q) for q in quotas]
    by_remainder = sorted(range(len(weights)), key=lambda i: (quotas[i] - counts[i], -i), reverse=True)
    for i in by_remainder[: n - sum(counts)]:
        counts[i] += 1
    items = [i for i, c in enumerate(counts) for _ in range(c)]
    random.Random(seed).shuffle(items)
    return items


@dataclass(frozen=True)
class ChallengerPrompt:
    """A source document d, the task type to write, and the expected number of searches N."""

    id: str
    document_id: str
    document: str
    task_type: str
    expected_searches: int


def make_challenger_prompts(passages, task_types: list[str], strata: list[int], seed: int,
                            tokenizer=None, document_max_tokens: int | None = None,
                            id_prefix: str | None = None) -> list[ChallengerPrompt]:
    """One Challenger prompt per passage: task types and search counts (1, 2, 3, ... by `strata`) are
    each apportioned exactly and shuffled by seed. Ids are `id_prefix` + position (default "c<seed>-"); give
    each iteration and batch its own prefix so ids stay unique across a run."""
    id_prefix = f"c{seed}-" if id_prefix is None else id_prefix
    n = len(passages)
    types = apportion(n, [1] * len(task_types), seed)
    searches = apportion(n, strata, seed + 1)
    out = []
    for i, (passage, t, s) in enumerate(zip(passages, types, searches, strict=True)):
        document = passage.document
        if tokenizer is not None and document_max_tokens:
            document = truncate_tokens(document, tokenizer, document_max_tokens)
        out.append(ChallengerPrompt(id=f"{id_prefix}{i}", document_id=passage.id, document=document,
                                    task_type=task_types[t], expected_searches=s + 1))
    return out


def truncate_tokens(text: str, tokenizer, max_tokens: int) -> str:
    """Cut text to at most max_tokens tokens of the policy tokenizer."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    return text if len(ids) <= max_tokens else tokenizer.decode(ids[:max_tokens])


def challenger_messages(prompt: ChallengerPrompt, dialect: Dialect) -> list[dict[str, str]]:
    content = prompts.challenger_prompt(prompt.document, prompt.task_type, prompt.expected_searches,
                                        dialect.search_example)
    return [{"role": "user", "content": content}]


def solver_messages(question: str, dialect: Dialect, max_searches: int,
                    variant: str = "paper") -> list[dict[str, str]]:
    """The Solver's first message; `variant` is `solver.prompt` (Figure 10, or the long-form wording)."""
    content = prompts.solver_prompt(question, max_searches, dialect.search_example,
                                    dialect.results_description, variant=variant)
    return [{"role": "user", "content": content}]


def render_messages(tokenizer, messages: list[dict[str, str]]) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def encode_messages(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    return tokenizer.encode(render_messages(tokenizer, messages), add_special_tokens=False)


def new_trajectory(id: str, role: Role, messages: list[dict[str, str]], tokenizer, *,
                   expected_searches: int | None = None, max_searches: int | None = None,
                   meta: dict[str, Any] | None = None) -> Trajectory:
    text = render_messages(tokenizer, messages)
    return Trajectory(id=id, role=role, prompt_ids=tokenizer.encode(text, add_special_tokens=False),
                      messages=list(messages), expected_searches=expected_searches,
                      max_searches=max_searches, opens_think=text.rstrip().endswith("<think>"),
                      meta=dict(meta or {}))


def challenger_trajectories(challenger_prompts: list[ChallengerPrompt], dialect: Dialect, tokenizer,
                            group_size: int = 1) -> list[Trajectory]:
    """`group_size` fresh Challenger trajectories per prompt (a GRPO group), linked to it by meta."""
    return [new_trajectory(f"{p.id}/g{j}", "challenger", challenger_messages(p, dialect), tokenizer,
                           expected_searches=p.expected_searches,
                           meta={"prompt_id": p.id, "document_id": p.document_id, "task_type": p.task_type})
            for p in challenger_prompts for j in range(group_size)]


# -- the loop --------------------------------------------------------------------------------------

Decision = Literal["search", "malformed", "end"]


def _decide(traj: Trajectory, text: str, action: SearchAction) -> tuple[Decision, str]:
    """What the environment does after a turn: run a search, correct a malformed action, or end."""
    final_tag = "<task>" if traj.role == "challenger" else "<answer>"
    extract = parsing.extract_task if traj.role == "challenger" else parsing.extract_answer
    final = extract(text, starts_in_think=traj.opens_think)
    if final is not None and (action.kind == "none" or _position(text, final_tag) < _position(text, "search")):
        return "end", "task" if traj.role == "challenger" else "answer"
    limit = traj.expected_searches if traj.role == "challenger" else traj.max_searches
    if action.kind == "search":
        return ("end", "search_limit") if traj.n_valid_searches >= (limit or 0) else ("search", "")
    if action.kind == "malformed":
        return "malformed", ""
    return "end", "no_action"


def _position(text: str, tag: str) -> int:
    """Where the final tag or the first search-like opener appears (for positional parsing)."""
    if tag == "search":
        hits = [text.find(t) for t in ("<search>", "<tool_call>", "<function_calls>")]
        hits = [h for h in hits if h >= 0]
        return min(hits) if hits else len(text) + 1
    pos = text.find(tag)
    return pos if pos >= 0 else len(text) + 1


def _environment_messages(traj: Trajectory, dialect: Dialect, results: str | None) -> list[dict[str, str]]:
    """Messages the environment adds after a search (results is not None) or a malformed action."""
    limit = traj.expected_searches if traj.role == "challenger" else traj.max_searches
    remaining = max(0, (limit or 0) - traj.n_valid_searches)
    if results is None:
        note = (prompts.challenger_malformed(remaining) if traj.role == "challenger"
                else prompts.solver_malformed(remaining, dialect.search_example))
        return [{"role": "user", "content": note}]
    messages = [dialect.results_message(results)]
    if traj.role == "challenger":
        note = prompts.challenger_after_search(remaining) if remaining else prompts.challenger_finish()
        if messages[0]["role"] == "user":
            messages = [{"role": "user", "content": messages[0]["content"] + "\n\n" + note}]
        else:
            messages.append({"role": "user", "content": note})
    return messages


def _context(traj: Trajectory, dialect: Dialect, tokenizer) -> list[int]:
    """What the model sees for its next turn. Qwen3 re-renders the conversation with thinking dropped
    from earlier assistant turns (App. E); other dialects continue the exact token stream."""
    if dialect.strips_earlier_thinking and traj.turns:
        return encode_messages(tokenizer, dialect.render_history(traj.messages, keep_last=False))
    return traj.prompt_ids + traj.completion_ids


def conversation_turn(traj: Trajectory) -> int:
    """The index of `traj`'s last turn in its whole conversation: its own turns, plus the assistant turns a replay
    re-rendered into its prompt (`meta["prompt_turns"]`, set by `evaluation.replay.replay_prefix`)."""
    return traj.meta.get("prompt_turns", 0) + len(traj.turns) - 1


def _append(traj: Trajectory, ids: list[int], mask: int, logprobs: list[float] | None = None) -> None:
    traj.completion_ids.extend(ids)
    traj.env_mask.extend([mask] * len(ids))
    traj.logprobs.extend(logprobs if logprobs is not None else [0.0] * len(ids))


def run_rollouts(trajectories: list[Trajectory], engine: Engine, retriever: Retriever, dialect: Dialect,
                 limits: RolloutLimits, *, adapter: str | None = None) -> RolloutStats:
    """Roll every trajectory forward until it ends; mutates them in place and returns the cost. `limits.max_turns`
    counts the turns taken in this call (a replay or a forced answer continues a rollout that has turns already)."""
    tokenizer = engine.tokenizer
    stats = RolloutStats()
    started = time.perf_counter()
    stops = dialect.challenger_stops() if trajectories and trajectories[0].role == "challenger" \
        else dialect.solver_stops()
    for traj in trajectories:
        if len(traj.prompt_ids) > limits.max_prompt_tokens:
            traj.finish = "prompt_too_long"
    resuming: set[int] = set()   # id() of trajectories whose turn stopped inside thinking: it goes on
    before = {id(t): len(t.turns) for t in trajectories}   # turns count from here (a replay continues a rollout)
    for round_ in itertools.count():
        contexts, budgets = _round_requests([t for t in trajectories if not t.done], resuming, before, dialect,
                                            tokenizer, limits)
        if not contexts:
            break
        sampling = Sampling(max_new_tokens=max(budgets), temperature=limits.temperature, top_p=limits.top_p,
                            stop=tuple(stops),
                            seed=None if limits.seed is None else limits.seed + round_)
        t0 = time.perf_counter()
        completions = engine.generate([c for _, c in contexts], sampling, adapter=adapter)
        stats.generation_s += time.perf_counter() - t0
        stats.engine_calls += 1
        searches: list[tuple[Trajectory, str]] = []
        malformed: list[Trajectory] = []
        for (traj, context), budget, completion in zip(contexts, budgets, completions, strict=True):
            ids, logprobs, finish = completion.token_ids, completion.logprobs, completion.finish_reason
            if len(ids) > budget:
                ids, logprobs, finish = ids[:budget], (logprobs or [])[:budget] or None, "length"
            text = completion.text if len(ids) == len(completion.token_ids) else tokenizer.decode(ids)
            stats.generated_tokens += len(ids)
            _record_segment(traj, context, ids, logprobs, text, resume=id(traj) in resuming)
            resuming.discard(id(traj))
            if finish == "stop" and stopped_in_thinking(traj.turns[-1], stops, traj.opens_think):
                if ids and len(ids) < budget:   # room left in this turn: it goes on in the next round
                    resuming.add(id(traj))
                    traj.stops_in_thinking += 1
                    stats.stops_in_thinking += 1
                    continue
                finish = "length"               # the turn's budget ran out inside thinking
            turn = len(traj.turns) - 1 - before[id(traj)]   # this call's turn index (max_turns counts these)
            text = traj.turns[-1]
            action = dialect.parse_search(text, starts_in_think=traj.opens_think)
            decision, reason = _decide(traj, text, action)
            if decision != "end" and not _can_continue(traj, turn, limits):
                decision, reason = "end", "turn_limit"   # no retrieval for a turn that cannot be followed
            if decision == "end":
                traj.finish = reason if finish != "length" or reason != "no_action" else "length"
            elif decision == "search":
                searches.append((traj, action.query or ""))
            else:
                traj.searches.append(SearchRecord(turn=conversation_turn(traj), query=None, valid=False))
                malformed.append(traj)
        replies: list[tuple[Trajectory, str | None]] = [(traj, None) for traj in malformed]
        if searches:
            t0 = time.perf_counter()
            hits = retriever.search([q for _, q in searches], limits.top_k_docs)
            stats.retrieval_s += time.perf_counter() - t0
            stats.retrieval_calls += 1
            formatted = format_results_batch(hits, tokenizer, limits.max_result_tokens)
            for (traj, query), found, results in zip(searches, hits, formatted, strict=True):
                traj.searches.append(SearchRecord(turn=conversation_turn(traj), query=query, valid=True,
                                                  hit_ids=[h.id for h in found], results=results))
                replies.append((traj, results))
        _add_environment(replies, dialect, tokenizer)
    for traj in trajectories:
        if not traj.done:
            traj.finish = "max_turns"
        _finalise(traj)
        stats.finishes[traj.finish] = stats.finishes.get(traj.finish, 0) + 1
    stats.turns = max((len(t.turns) - before[id(t)] for t in trajectories), default=0)
    stats.total_s = time.perf_counter() - started
    return stats


def _round_requests(live: list[Trajectory], resuming: set[int], before: dict[int, int], dialect: Dialect, tokenizer,
                    limits: RolloutLimits) -> tuple[list[tuple[Trajectory, list[int]]], list[int]]:
    """Each live trajectory's context and token budget for this round: a new turn, or the rest of a turn that
    stopped inside thinking (its context is the turn's own context plus every token the turn has so far). A
    trajectory with no turn or no token left ends here."""
    contexts, budgets = [], []
    for traj in live:
        if id(traj) in resuming:
            start = traj.turn_spans[-1][0]
            context = traj.turn_prompt_ids[-1] + traj.completion_ids[start:]
            used = len(traj.completion_ids) - start
        elif len(traj.turns) - before[id(traj)] >= limits.max_turns:
            traj.finish = "max_turns"
            continue
        else:
            context, used = _context(traj, dialect, tokenizer), 0
        budget = min(limits.max_new_tokens_per_turn - used,
                     limits.max_response_tokens - len(traj.completion_ids),
                     limits.max_model_len - len(context))
        if budget <= 0:
            traj.finish = "budget"
            continue
        contexts.append((traj, context))
        budgets.append(budget)
    return contexts, budgets


def _record_segment(traj: Trajectory, context: list[int], ids: list[int], logprobs: list[float] | None, text: str,
                    *, resume: bool) -> None:
    """Append sampled tokens to the trajectory: a new assistant turn, or (resume) more of the current one."""
    start = traj.turn_spans[-1][0] if resume else len(traj.completion_ids)
    _append(traj, ids, 1, list(logprobs) if logprobs is not None else None)
    if resume:
        traj.turn_spans[-1] = (start, len(traj.completion_ids))
        traj.turns[-1] += text
        traj.messages[-1] = {**traj.messages[-1], "content": traj.turns[-1]}
        return
    traj.turn_prompt_ids.append(context)
    traj.turn_spans.append((start, len(traj.completion_ids)))
    traj.turns.append(text)
    traj.messages.append({"role": "assistant", "content": text})


def stopped_in_thinking(turn_text: str, stops: tuple[str, ...] | list[str], starts_in_think: bool = False) -> bool:
    """Whether the stop string that ended this turn's text (its last one) falls inside an open <think> block:
    a thinking model naming the tag it will use later, which must not end the turn."""
    found = [turn_text.rfind(s) for s in stops if s]
    at = max(found, default=-1)
    return at >= 0 and parsing.ends_in_think(turn_text[:at], starts_in_think=starts_in_think)


def _can_continue(traj: Trajectory, turn: int, limits: RolloutLimits) -> bool:
    """Whether another assistant turn can follow this one: turns left and response budget left."""
    return turn + 1 < limits.max_turns and len(traj.completion_ids) < limits.max_response_tokens


def _add_environment(replies: list[tuple[Trajectory, str | None]], dialect: Dialect, tokenizer) -> None:
    """The environment's turn for each continuing trajectory (search results, or None after a malformed
    action), tokenised in one tokenizer call."""
    if not replies:
        return
    messages = [_environment_messages(traj, dialect, results) for traj, results in replies]
    texts = [dialect.environment_text(tokenizer, m) for m in messages]
    encoded = tokenizer(texts, add_special_tokens=False)["input_ids"]
    for (traj, _), new, ids in zip(replies, messages, encoded, strict=True):
        _append(traj, list(ids), 0)
        traj.messages.extend(new)


def _finalise(traj: Trajectory) -> None:
    """The final task or answer is read from the last assistant turn only (F.1, F.2)."""
    last = traj.turns[-1] if traj.turns else ""
    if traj.role == "challenger":
        traj.task = parsing.extract_task(last, starts_in_think=traj.opens_think)
    else:
        traj.answer = parsing.extract_answer(last, starts_in_think=traj.opens_think)


# -- per-turn datums (App. E) ----------------------------------------------------------------------


@dataclass
class TurnDatum:
    """One training example per assistant turn: the context the turn was generated from (with earlier
    thinking dropped for Qwen3) and that turn's sampled tokens. Shares the trajectory's advantage."""

    trajectory_id: str
    turn: int
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]


def per_turn_datums(traj: Trajectory) -> list[TurnDatum]:
    return [TurnDatum(traj.id, k, traj.turn_prompt_ids[k], traj.completion_ids[a:b], traj.logprobs[a:b])
            for k, (a, b) in enumerate(traj.turn_spans)]
