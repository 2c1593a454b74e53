"""The warm-started smoke model (scope_lib.smoke.teacher and scope_lib.smoke.warm_start).

- The teacher's traces follow the protocol: made by the real rollout loop and Judge, every example's
  assistant tokens parse, the environment's tokens are masked out, and the quality mix is there.
- The warm start is deterministic (same seed, same weights), reused from the cache, and rebuilt when the
  prompts or the teacher change; the random model's cache key ignores warm-start settings.
- The warmed smoke model speaks the protocol on documents the teacher never read, at the rates measured for
  it (docs/smoke-model.md): the same assertions fail for the random model.
"""

from __future__ import annotations

import json
import random
import shutil
import time
from pathlib import Path

import pytest
import torch
from fixtures_tiny import count_calls, weights_hash
from scripted_engine import ScriptedEngine
from transformers import AutoModelForCausalLM, AutoTokenizer

from scope_lib.config import TinyModelConfig, WarmStartConfig, load_params
from scope_lib.models.hf_engine import HFEngine
from scope_lib.models.loading import load_model_and_tokenizer
from scope_lib.models.tiny import cache_key
from scope_lib.protocol import facts, parsing
from scope_lib.protocol.dialects import get_dialect
from scope_lib.retrieval import corpus
from scope_lib.retrieval.corpus import read_corpus
from scope_lib.retrieval.index import build_or_open_index
from scope_lib.selfplay.judge import make_judge
from scope_lib.selfplay.rollout import challenger_messages, encode_messages, make_challenger_prompts
from scope_lib.smoke import protocol_check, sft, teacher, warm_start

REPO = Path(__file__).resolve().parents[1]

#: A warm start small enough to build twice in a test (seconds): few documents, a narrow model, few steps.
SMALL_WARM = dict(vocab_size=8192, hidden_size=32, num_layers=1, num_heads=4, max_position_embeddings=4096)
SMALL_WS = dict(enabled=True, documents=12, epochs=0.25, batch_size=8)


def _spans(example: teacher.Example, tokenizer) -> list[str]:
    """The assistant's turns in an example: its runs of loss-masked tokens, decoded."""
    spans, current = [], []
    for token, mask in zip(example.input_ids, example.completion_mask):
        if mask:
            current.append(token)
        elif current:
            spans.append(tokenizer.decode(current))
            current = []
    if current:
        spans.append(tokenizer.decode(current))
    return spans


# -- the teacher -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def warm_tokenizer_dir(wiki_sample, tmp_path_factory) -> Path:
    """The warm start's tokenizer (and random weights) for the small config: no SFT."""
    return warm_start.build_protocol_model(tmp_path_factory.mktemp("warm_tok"), wiki_sample,
                                           TinyModelConfig(**SMALL_WARM), WarmStartConfig(**SMALL_WS))


@pytest.fixture(scope="module")
def traces(wiki_sample, warm_tokenizer_dir, tmp_path_factory):
    tokenizer = AutoTokenizer.from_pretrained(warm_tokenizer_dir)
    cfg = WarmStartConfig(enabled=True, documents=24)
    examples, stats = teacher.teacher_examples(tokenizer, wiki_sample, cfg, tmp_path_factory.mktemp("tix") / "ix")
    return tokenizer, cfg, examples, stats


def test_teacher_examples_parse_role_by_role(traces):
    tokenizer, _cfg, examples, stats = traces
    roles = {e.role for e in examples}
    assert roles == {"challenger", "solver", "gates", "rubrics", "grading"}
    dialect = get_dialect("qwen2.5")
    for example in examples:
        assert len(example.input_ids) == len(example.completion_mask)
        spans = _spans(example, tokenizer)
        assert spans, example.role
        for span in spans:
            assert "<information>" not in span and "<|im_start|>" not in span   # environment tokens are masked
        last = spans[-1]
        if example.role == "challenger":
            assert parsing.extract_task(last) and all(dialect.parse_search(s).valid for s in spans[:-1])
        elif example.role == "solver":
            assert parsing.extract_answer(last) and all(dialect.parse_search(s).valid for s in spans[:-1])
        elif example.role == "rubrics":
            assert len(parsing.parse_rubrics(last)) == teacher.RUBRICS_PER_TASK
        else:
            assert parsing.parse_score(last) in (0, 1)
        for span in spans:
            if example.role in ("challenger", "solver"):
                assert span.startswith("<think>") == teacher.POLICY_THINKS
            elif example.role in ("gates", "grading"):
                assert span in ("<score>0</score>", "<score>1</score>")     # the verdict alone
    # both verdicts of every stage, and tasks that fail the gates (generic ones)
    for stage, (zeros, ones) in stats.verdicts.items():
        assert zeros > 0 and ones > 0, stage


def test_sentence_grades_reach_the_graders_examples(wiki_sample, warm_tokenizer_dir, tmp_path):
    """With `sentence_grades` the teacher's grading examples hold answers quoted from the sources, in several
    rubric wordings, each reply the verdict of whether the answer holds the rubric's fact."""
    from scope_lib.protocol.facts import mentions

    tokenizer = AutoTokenizer.from_pretrained(warm_tokenizer_dir)
    cfg = WarmStartConfig(enabled=True, documents=12, sentence_grades=True)
    examples, _stats = teacher.teacher_examples(tokenizer, wiki_sample, cfg, tmp_path / "ix")
    quoted = []
    for example in (e for e in examples if e.role == "grading"):
        text = tokenizer.decode(example.input_ids)
        rubric = text.split("<rubric>", 1)[1].split("</rubric>", 1)[0].strip()
        if rubric.split(" ", 1)[0] in ("States", "Names", "Gives", "Includes"):
            answer = text.split("<response>", 1)[1].split("</response>", 1)[0].strip()
            quoted.append(int(mentions(answer, teacher.rubric_fact(rubric))))
            assert parsing.parse_score(_spans(example, tokenizer)[-1]) == quoted[-1]
    assert len(quoted) >= 8 and 0 < sum(quoted) < len(quoted)


def test_teacher_quality_is_mixed(traces):
    tokenizer, _cfg, examples, _stats = traces
    dialect = get_dialect("qwen2.5")
    solver_searches = {len(_spans(e, tokenizer)) - 1 for e in examples if e.role == "solver"}
    assert {0, 1, 2} <= solver_searches
    tasks = [parsing.extract_task(_spans(e, tokenizer)[-1]) for e in examples if e.role == "challenger"]
    names = facts.Names(tokenizer)
    named = [len(names.names(t)) for t in tasks]
    assert 0 in named and max(named) >= 2        # generic tasks and tasks naming several searched entities
    assert dialect.name == "qwen2.5"


def test_without_guesses_every_solver_trace_searches_and_names_a_retrieved_fact(traces, wiki_sample, tmp_path):
    tokenizer, cfg, with_guesses, _stats = traces
    guesses = [e for e in with_guesses if e.role == "solver" and "well-known subject" in _spans(e, tokenizer)[-1]]
    assert guesses                                      # the default quality mix has them
    cfg = cfg.model_copy(update={"solver_guesses": False})
    examples, _ = teacher.teacher_examples(tokenizer, wiki_sample, cfg, tmp_path / "ix")
    solver = [e for e in examples if e.role == "solver"]
    assert len(solver) >= len(guesses)
    for example in solver:
        spans = _spans(example, tokenizer)
        answer = parsing.extract_answer(spans[-1])
        assert len(spans) >= 2 and " is linked to " in answer, answer   # searched, then linked retrieved facts
    # the Challenger's and the rubric writer's examples are the same
    others = [e.input_ids for e in examples if e.role in ("challenger", "rubrics")]
    assert others == [e.input_ids for e in with_guesses if e.role in ("challenger", "rubrics")]


def test_teacher_contexts_are_the_rollout_contexts(traces, wiki_sample):
    """A Challenger example starts with exactly the prompt the rollout loop gives a model."""
    tokenizer, cfg, examples, _stats = traces
    passages = read_corpus(wiki_sample).passages
    pool, held = corpus.teacher_split(passages, cfg)
    prompts = make_challenger_prompts(pool[:cfg.documents], ["long_form_qa", "summarisation", "planning", "writing"],
                                      [4, 3, 2], seed=cfg.seed, tokenizer=tokenizer,
                                      document_max_tokens=cfg.document_max_tokens)
    expected = {tuple(encode_messages(tokenizer, challenger_messages(p, get_dialect("qwen2.5")))) for p in prompts}
    challenger = [e for e in examples if e.role == "challenger"]
    assert challenger
    for e in challenger:
        first = e.completion_mask.index(1)
        assert tuple(e.input_ids[:first]) in expected
    assert not {p.id for p in held} & {p.id for p in pool}


def test_split_holds_out_a_seeded_share(wiki_sample):
    passages = read_corpus(wiki_sample).passages
    pool, held = corpus.teacher_split(passages, WarmStartConfig())
    assert len(held) == 200 and len(pool) == 800
    assert corpus.unread_by_teacher(passages, WarmStartConfig()) == held
    assert corpus.unread_by_teacher(passages, WarmStartConfig(seed=1)) != held


def test_calibration_probes_leave_out_the_teachers_documents(shared_data, tmp_path):
    """The grader probes read documents the teacher never quoted (its sentence grades would make them recall)."""
    from scope_lib.selfplay.grader_probe import unseen_by_teacher

    params = load_params(REPO / "params" / "smoke.yaml", {"run.data_dir": str(shared_data),
                                                          "run.runs_dir": str(tmp_path)})
    passages = read_corpus(params.corpus_path).passages
    seen = {p.id for p in corpus.teacher_documents(passages, params.model.warm_start)}
    assert len(seen) == params.model.warm_start.documents
    unseen = unseen_by_teacher(params, passages)
    assert len(unseen) == len(passages) - len(seen) and not seen & {p.id for p in unseen}
    cold = load_params(REPO / "params" / "smoke.yaml", {"run.data_dir": str(shared_data), "run.runs_dir": str(tmp_path),
                                                        "model.warm_start.enabled": False})
    assert unseen_by_teacher(cold, passages) == passages


def test_sentence_grades_quote_the_source_and_say_both(wiki_sample, tiny_tokenizer):
    """`model.warm_start.sentence_grades`: per task, answers made of its source's sentences (the fact stated in two
    orders, removed, swapped), graded against a rubric in one of several wordings, never the probe's."""
    from types import SimpleNamespace

    from scope_lib.protocol.facts import mentions
    from scope_lib.selfplay.grader_probe import FACT_RUBRIC

    documents = read_corpus(wiki_sample).passages[:60]
    prompts = {f"p{k}": SimpleNamespace(document_id=d.id) for k, d in enumerate(documents)}
    passed = [SimpleNamespace(meta={"prompt_id": k}, task=f"Task {k}") for k in prompts]
    judge = teacher.JudgeTeacher(facts.Names(tiny_tokenizer, max_tokens=6), reasoning=True)
    grades = teacher.sentence_grades(passed, prompts, documents, judge, teacher.REASONED_GRADING_MAX_TOKENS,
                                     random.Random(0), seed=0)
    by_task: dict[str, list] = {}
    for task, answer, rubric in grades:
        by_task.setdefault(task, []).append((answer, rubric))
    assert len(by_task) >= 30
    wordings = set()
    for task, graded in by_task.items():
        assert len(graded) == 4 and len({r for _a, r in graded}) == 1
        rubric = graded[0][1]
        fact = teacher.rubric_fact(rubric)
        wording = rubric.replace(fact, "{fact}")
        assert wording in teacher.SENTENCE_RUBRICS and wording != FACT_RUBRIC
        wordings.add(wording)
        verdicts, replies = zip(*(judge.grade(a, r) for a, r in graded), strict=True)
        assert list(verdicts) == [1, 1, 0, 0] and list(verdicts) == [int(mentions(a, fact)) for a, _r in graded]
        for verdict, reply in zip(verdicts, replies, strict=True):   # a held fact is listed as the rubric spells it
            assert (f"{fact} (named)" in reply.split("The rubric asks", 1)[0]) == bool(verdict), reply
        source = documents[int(task.split("p")[-1])].text
        assert all(sentence in source for sentence in graded[2][0].split(". ") if sentence)   # the context alone
    assert len(wordings) >= 4


# -- the warm start: deterministic, cached, keyed ------------------------------------------------------------


def test_warm_start_is_deterministic_and_cached(wiki_sample, tmp_path, monkeypatch):
    builds = count_calls(monkeypatch, warm_start, "warm_start")
    cfg, ws = TinyModelConfig(**SMALL_WARM), WarmStartConfig(**SMALL_WS)
    a = warm_start.warm_model_path(wiki_sample, cfg, ws, cache_dir=tmp_path / "a")
    again = warm_start.warm_model_path(wiki_sample, cfg, ws, cache_dir=tmp_path / "a")
    b = warm_start.warm_model_path(wiki_sample, cfg, ws, cache_dir=tmp_path / "b")
    assert a == again and len(builds) == 2                       # reused from the cache, not rebuilt
    assert weights_hash(a) == weights_hash(b)                   # same seed, same weights
    random_weights = warm_start.build_protocol_model(tmp_path / "r", wiki_sample, cfg, ws)
    assert weights_hash(a) != weights_hash(random_weights)      # the SFT moved them
    c = warm_start.warm_model_path(wiki_sample, cfg, WarmStartConfig(**{**SMALL_WS, "seed": 1}),
                                   cache_dir=tmp_path / "a")
    assert c != a and weights_hash(c) != weights_hash(a)
    info = (a / warm_start.WARM_INFO).read_text()
    assert '"method": "full"' in info and '"steps"' in info
    # a normal HF model folder: the loader every engine uses takes it as it is
    model, tok = load_model_and_tokenizer(a, dtype="float32", device="cpu")
    assert model.config.model_type == "qwen3" and tok.padding_side == "left"


def test_a_pretrained_models_warm_start_runs_in_a_process_of_its_own(wiki_sample, warm_tokenizer_dir, tmp_path,
                                                                      monkeypatch):
    """SmolLM2's LoRA SFT left its process holding about 13 GB beside the training that came next: a pretrained
    model's warm start runs in a child (`runs.in_own_process`), which gives it back, and builds the very weights
    the same SFT builds in the caller (the cache keys did not change, so neither may the weights)."""
    own_process = count_calls(monkeypatch, warm_start, "in_own_process")
    ws = WarmStartConfig(**{**SMALL_WS, "method": "lora", "lora_rank": 4})
    built = warm_start.warm_pretrained_path(str(warm_tokenizer_dir), wiki_sample, ws, cache_dir=tmp_path / "cache")
    assert own_process == [warm_start.warm_start]
    here = tmp_path / "here"
    shutil.copytree(warm_tokenizer_dir, here)
    info = warm_start.warm_start(here, wiki_sample, ws, index_dir=tmp_path / "index", max_length=4096)
    assert info["method"] == "lora" and json.loads((built / warm_start.WARM_INFO).read_text())["steps"] == info["steps"]
    assert weights_hash(built) == weights_hash(here) != weights_hash(warm_tokenizer_dir)


def test_name_loss_splits_which_name_from_a_name(warm_tokenizer_dir):
    """Where the target is a name: w x its cross-entropy + (1 - w) x -log P(any name); elsewhere plain CE."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(warm_tokenizer_dir)
    vocab = model.config.vocab_size
    names = [5, 7, 11]
    ids = torch.tensor([[3, 5, 9, 7, 2, 11]])
    labels = torch.tensor([[-100, 5, 9, 7, -100, 11]])
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}
    w = 0.25
    with torch.no_grad():
        loss = sft._sft_trainer_class(names, w).compute_loss(None, model, inputs)
        plain = sft._sft_trainer_class(names, 1.0).compute_loss(None, model, inputs)
        logits = model(input_ids=ids).logits[0, :-1].float()
    logp = torch.log_softmax(logits, -1)
    expected = []
    for pos, target in enumerate(labels[0, 1:].tolist()):
        if target == -100:
            continue
        ce = -logp[pos, target]
        if target in names:
            expected.append(w * ce - (1 - w) * torch.logsumexp(logp[pos, names], -1))
        else:
            expected.append(ce)
    assert vocab > max(names)
    assert float(loss) == pytest.approx(float(torch.stack(expected).mean()), rel=1e-5)
    ce_mean = torch.stack([-logp[p, t] for p, t in enumerate(labels[0, 1:].tolist()) if t != -100]).mean()
    assert float(plain) == pytest.approx(float(ce_mean), rel=1e-5)
    assert float(loss) < float(plain)       # P(any name) >= P(that name): the class term is the easier one


def test_cache_key_follows_prompts_and_teacher(wiki_sample, monkeypatch):
    tiny, warm = TinyModelConfig(**SMALL_WARM), WarmStartConfig(**SMALL_WS)
    key = warm_start.warm_cache_key(wiki_sample, tiny, warm)
    monkeypatch.setattr(teacher, "TEACHER_VERSION", teacher.TEACHER_VERSION + 1)
    assert warm_start.warm_cache_key(wiki_sample, tiny, warm) != key
    monkeypatch.undo()
    from scope_lib.protocol import prompts

    spec = prompts.TASK_TYPES["planning"]
    monkeypatch.setitem(prompts.TASK_TYPES, "planning", prompts.TaskTypeSpec(spec.key, spec.name, spec.description + "!"))
    assert warm_start.warm_cache_key(wiki_sample, tiny, warm) != key
    monkeypatch.undo()
    assert warm_start.warm_cache_key(wiki_sample, tiny, warm) == key
    assert cache_key(wiki_sample, tiny) != key                  # the random model's key is another
    # the SFT thread count does not change the weights (measured bit-identical), so not the key either
    threads = WarmStartConfig(**SMALL_WS, threads=1)
    assert warm_start.warm_cache_key(wiki_sample, tiny, threads) == key
    assert warm_start.warm_cache_key(wiki_sample, tiny, WarmStartConfig(**{**SMALL_WS, "epochs": 0.5})) != key


def test_smoke_params_warm_the_tiny_model_and_share_its_shape():
    p = load_params(REPO / "params" / "smoke.yaml")
    ws = p.model.warm_start
    assert ws.enabled and not WarmStartConfig().enabled and ws.method == "full"
    assert ws.document_max_tokens == p.selfplay.document_max_tokens
    assert ws.max_result_tokens == p.retrieval.max_result_tokens and ws.top_k == p.retrieval.top_k
    assert ws.max_new_tokens_per_turn == p.challenger.max_new_tokens_per_turn == p.solver.max_new_tokens_per_turn
    assert ws.solver_max_searches == p.solver.max_searches
    assert p.model.dialect in ws.dialects
    assert p.judge.gate_max_tokens >= teacher.GATE_MAX_TOKENS
    assert p.judge.rubric_max_tokens >= teacher.RUBRIC_MAX_TOKENS
    assert p.judge.grading_max_tokens >= teacher.GRADING_MAX_TOKENS


# -- the warmed smoke model on held-out documents -------------------------------------------------------------

#: Measured on 16 held-out documents x 2 Challenger rollouts, prompt seed 0 (docs/smoke-model.md): task
#: rate 0.938 (30/32), answer rate 0.883, every Judge reply parsed on the first try, 30/30 tasks through the
#: gates, 18 of 30 graded tasks in the window (seeds 1-2: 0.906-1.0 tasks, 0.845-0.938 answers). The build is
#: deterministic on one machine, so these repeat there; the thresholds sit below, because another CPU rounds
#: differently and a tiny model's build is a lottery between roles (sibling recipes measured 0.69-0.94 tasks,
#: 0.70-0.88 answers). The random tiny model scores 0 on each.
MIN_TASK_RATE = 0.75
MIN_ANSWER_RATE = 0.7
MIN_JUDGE_PARSE_RATE = 0.9


@pytest.fixture(scope="session")
def smoke_params(shared_data, tmp_path_factory):
    return load_params(REPO / "params" / "smoke.yaml", {
        "run.runs_dir": str(tmp_path_factory.mktemp("warm_runs")), "run.data_dir": str(shared_data)})


@pytest.fixture(scope="session")
def warm_smoke_model(smoke_params) -> Path:
    """The smoke run's warm-started model, from the shared cache ($SCOPE_CACHE_DIR or ~/.cache/scope):
    built once (under 3 minutes on 2 CPU cores) and then reused by these tests, the notebooks and `make demo`."""
    started = time.perf_counter()
    path = warm_start.warm_model_path(smoke_params.corpus_path, smoke_params.model.tiny,
                                      smoke_params.model.warm_start)
    print(f"warm smoke model ready in {time.perf_counter() - started:.0f} s: {path}")
    return path


def test_warmed_smoke_model_speaks_the_protocol_on_held_out_documents(smoke_params, warm_smoke_model):
    p = smoke_params
    torch.manual_seed(0)
    model, tok = load_model_and_tokenizer(warm_smoke_model, dtype="float32", device="cpu")
    engine = HFEngine(model, tok)
    retriever = build_or_open_index(p, progress=False)
    documents = corpus.unread_by_teacher(read_corpus(p.corpus_path).passages, p.model.warm_start)[:16]
    rates, evals, graded, _ = protocol_check.measure_protocol(p, engine, make_judge(p, lambda _m: engine), retriever,
                                                             documents)
    print(rates.table())
    assert rates.task_rate >= MIN_TASK_RATE
    assert rates.answer_rate >= MIN_ANSWER_RATE
    assert rates.judge_rate(first_try=True) >= MIN_JUDGE_PARSE_RATE
    assert rates.gates_passed >= 1 and rates.tasks_in_window >= 1
    assert rates.solver_groups_with_spread >= 1
    assert any(e.rubrics for e in evals) and any(g.rubric_score > 0 for g in graded)
    assert rates.rubric_facts == sum(len(e.rubrics or []) for e in evals)
    assert rates.grades == sum(v is not None for g in graded for v in g.verdicts)
    assert 0 < rates.answers_searched <= rates.solver_answers


class _WordTokenizer:
    """Every whitespace-separated word is one token (so every capitalised word is a checkable name)."""

    def encode(self, text, add_special_tokens=False):
        return text.split()


def test_content_checks_count_grounded_rubrics_and_agreeing_grades():
    """The content measures of ProtocolRates, on hand-made records: a rubric fact counts as grounded when the
    source contains it; a verdict agrees when it is 1 exactly for an answer holding the fact; an answer cites
    its results when it names a fact (not the task's) that its own valid searches returned."""
    from scope_lib.protocol.parsing import Rubric
    from scope_lib.protocol.rewards import FormatScore
    from scope_lib.selfplay.rollout import SearchRecord, Trajectory
    from scope_lib.selfplay.tasks import GradedSolverRollout, TaskEvaluation

    e = TaskEvaluation("c0", "d0", "long_form_qa", 1, "Explain Paris.", FormatScore(1, 1, 1),
                       rubrics=[Rubric("Mentions Seine."), Rubric("Mentions 1889."), Rubric("Mentions Rome.")])
    answers = {"s0": "Paris is linked to Seine.", "s1": "Paris is a well-known subject.",
               "s2": "Paris is linked to Lyon.", "s3": "Paris is linked to Nice."}
    searches = {"s0": [SearchRecord(0, "Paris", True, results="The Seine crosses Paris.")],
                "s1": [SearchRecord(0, "Paris", True, results="Paris is in France.")],
                "s2": [SearchRecord(0, None, False, results="Lyon")],   # malformed: its correction is no result
                "s3": []}
    graded = [GradedSolverRollout(Trajectory(i, "solver", [], [], meta={"challenger_id": "c0"}, answer=a,
                                             searches=searches[i]), verdicts=v, rubric_score=0.0)
              for (i, a), v in zip(answers.items(), [[1, 1, None], [0, 1, 0], [None] * 3, [None] * 3],
                                   strict=True)]
    rates = protocol_check.ProtocolRates()
    protocol_check._check_content(rates, [e], graded, {"d0": "(Title: Paris)\nThe Seine crosses Paris since 1889."},
                                  facts.Names(_WordTokenizer()))
    assert (rates.rubric_facts_in_source, rates.rubric_facts) == (2, 3)
    # s0: Seine 1 (agrees), 1889 1 (disagrees), None skipped; s1: Seine 0 (agrees), 1889 1 (disagrees), Rome 0
    assert (rates.grades_agreeing, rates.grades) == (3, 5)
    assert rates.grades_fact_held == 1   # only s0's answer holds a rubric's fact (Seine)
    # s0 names Seine, which its search returned; s1 names nothing but the task's Paris; s2 and s3 have no results
    assert (rates.answers_citing_results, rates.answers_searched) == (1, 2)


def _grading_engine(tokenizer, verdict):
    """A scripted Judge engine whose grader says `verdict(response, fact)` to "Mentions <fact>." rubrics."""
    def grade(role, context):
        if role != "grader":
            return None
        response = context.split("<response>", 1)[-1].split("</response>", 1)[0]
        fact = context.split("<rubric>Mentions ", 1)[-1].split(".</rubric>", 1)[0]
        return f"<score>{verdict(response, fact)}</score>"
    return ScriptedEngine(tokenizer, get_dialect("qwen2.5"), override=grade)


def test_reasoned_grades_list_the_answers_facts_then_mark_the_rubrics(tiny_tokenizer):
    judge = teacher.JudgeTeacher(facts.Names(tiny_tokenizer, max_tokens=8), reasoning=True)
    answer = "Ada is linked to Berlin and 1990."
    verdict, reply = judge.grade(answer, "Mentions Berlin.")
    assert verdict == parsing.parse_score(reply) == 1
    assert reply.startswith("<think>The response names Berlin (named) and 1990 (named). "
                            "The rubric asks for Berlin (named).</think>")
    verdict, reply = judge.grade(answer, "Mentions Paris.")
    assert verdict == parsing.parse_score(reply) == 0 and "The rubric asks for Paris, not named.</think>" in reply
    assert judge.grade("No names here.", "Mentions Paris.")[1].startswith("<think>The response names no name or year.")
    # A long answer lists at most GRADE_FACTS facts, the rubric's among them (once) when the answer holds it.
    many = ["Berlin", "Paris", "Rome", "Madrid", "Vienna", "Prague", "Lisbon"]
    long_answer = "Ada is linked to " + ", ".join(many) + "."
    for rubric_fact in (many[-1], many[0], "Oslo"):
        verdict, reply = judge.grade(long_answer, f"Mentions {rubric_fact}.")
        listed = reply.split("The response names ", 1)[1].split(". The rubric", 1)[0]
        assert listed.count("(named)") == teacher.GRADE_FACTS
        assert listed.count(rubric_fact) == verdict
        assert len(tiny_tokenizer.encode(reply, add_special_tokens=False)) <= teacher.REASONED_GRADING_MAX_TOKENS
    assert teacher.JudgeTeacher(judge.names).grade(answer, "Mentions Berlin.") == (1, "<score>1</score>")
    # a held fact longer than one name is listed whole, as the rubric spells it (the verdict copies its mark)
    verdict, reply = judge.grade("Ada moved to New York in 1990.", "States New York.")
    assert verdict == 1 and reply.startswith("<think>The response names New York (named) and 1990 (named). ")
    verdict, reply = judge.grade("Ada moved to York in 1990.", "States New York.")
    assert verdict == 0 and "New York" not in reply.split("The rubric", 1)[0]


def test_reasoned_grades_need_their_token_budget(shared_data, tmp_path):
    params = load_params(REPO / "params" / "smollm.yaml", {"run.data_dir": str(shared_data),
                                                           "run.runs_dir": str(tmp_path)})
    assert params.model.warm_start.grade_reasoning
    assert params.judge.grading_max_tokens >= teacher.REASONED_GRADING_MAX_TOKENS
    short = load_params(REPO / "params" / "smollm.yaml", {"run.data_dir": str(shared_data), "run.runs_dir": str(tmp_path),
                                                          "judge.grading_max_tokens": 64})
    with pytest.raises(ValueError, match="grading_max_tokens is 64"):
        warm_start.prepare(short, cache_dir=tmp_path)


@pytest.mark.parametrize("verdict, expected", [
    (lambda response, fact: int(fact in response), 1.0),   # a grader that reads the answer
    (lambda response, fact: 1, 0.0),                        # one that only learned to say 1
    (lambda response, fact: int(fact not in response), -1.0),
])
def test_grader_sensitivity_separates_reading_from_blind_graders(wiki_sample, tiny_tokenizer, verdict, expected):
    params = load_params(None, overrides=["model.dialect=qwen2.5"])
    engine = _grading_engine(tiny_tokenizer, verdict)
    judge = make_judge(params, lambda _m: engine)
    documents = read_corpus(wiki_sample).passages[:100]
    probe = protocol_check.grader_sensitivity(judge, documents, facts.Names(tiny_tokenizer))
    assert probe.holds == probe.misses >= 20 and probe.unparsed == 0
    assert probe.separation == expected
    assert engine.calls == 1                                 # every triple in one Judge call


# -- the evaluation judges' traces (model.warm_start.eval_judges) -------------------------------------------


def test_eval_judge_traces_parse_with_the_real_parsers_and_say_both(wiki_sample, tiny_tokenizer):
    import re

    from scope_lib.evaluation.scorers import parse_criteria_met
    from scope_lib.protocol.facts import mentions
    from scope_lib.smoke import eval_judge_teacher as T

    documents = read_corpus(wiki_sample).passages[:40]
    cfg = WarmStartConfig(fact_max_tokens=6, seed=1, sentence_grades=True)
    traces = T.eval_judge_traces(tiny_tokenizer, documents, cfg)
    assert traces == T.eval_judge_traces(tiny_tokenizer, documents, cfg)
    plain = T.eval_judge_traces(tiny_tokenizer, documents, cfg.model_copy(update={"sentence_grades": False}))
    assert len([t for t in traces if t.role == "criterion_grader"]) >= \
        len([t for t in plain if t.role == "criterion_grader"]) + 30   # the source's own sentences, graded
    for role in T.ROLES:
        verdicts = [t.verdict for t in traces if t.role == role]
        assert len(verdicts) >= 40 and 0.4 <= sum(verdicts) / len(verdicts) <= 0.6, role   # both, about evenly
    for t in traces:
        prompt = t.messages[0]["content"]
        if t.role == "qa_judge":   # the short-form judge: SCOPE's grader with the semantic-equivalence rubric
            assert parsing.parse_score(t.reply) == t.verdict
            response = prompt.split("<response>", 1)[1].split("</response>", 1)[0]
            golds = re.findall(r'"([^"]+)"', prompt.split("<rubric>", 1)[1].split("</rubric>", 1)[0])
            assert "means the same as at least one of these reference answers" in prompt and golds
            assert t.verdict == int(any(mentions(response, g) for g in golds)), (response, golds)
            named = [g for g in golds if f"{g} (named)" in t.reply.split("reference answer", 1)[1]]
            assert bool(named) == bool(t.verdict)
        else:                      # criterion_grader: the reply against one "Mentions X." criterion
            assert parse_criteria_met(t.reply) is bool(t.verdict)
            reply = prompt.split("<reply>\n", 1)[1].split("\n</reply>", 1)[0]
            criterion = prompt.split("\n</criterion>", 1)[0].rsplit("\n", 1)[-1]
            fact = teacher.rubric_fact(criterion)
            assert criterion.replace(fact, "{fact}") in teacher.SENTENCE_RUBRICS, criterion
            assert t.verdict == int(mentions(reply, fact)), (reply, fact)
            assert (f"asks for {fact} (named)" in t.reply) == bool(t.verdict)
            assert (f"{fact} (named)" in t.reply.split("The criterion asks", 1)[0]) == bool(t.verdict), t.reply
        # the tokens: the prompt exactly as the local judge encodes it, then the reply and the end of the turn
        ids, mask = t.example.input_ids, t.example.completion_mask
        n_prompt = mask.index(1)
        assert set(mask[:n_prompt]) == {0} and set(mask[n_prompt:]) == {1}
        assert tiny_tokenizer.decode(ids[:n_prompt]) == tiny_tokenizer.apply_chat_template(
            t.messages, tokenize=False, add_generation_prompt=True)
        assert ids[-1] == tiny_tokenizer.eos_token_id and tiny_tokenizer.decode(ids[n_prompt:-1]) == t.reply
        assert len(ids) - n_prompt - 1 <= T.EVAL_JUDGE_MAX_TOKENS


def test_eval_judges_option_keeps_old_cache_keys_and_needs_its_budget(shared_data, tmp_path):
    from scope_lib.smoke import eval_judge_teacher as T

    off, on = WarmStartConfig(), WarmStartConfig(eval_judges=True)
    assert "eval_judges" not in warm_start._shape(off)          # models built before the option keep their keys
    assert warm_start._shape(on)["eval_judges"] == T.fingerprint()
    assert {k: v for k, v in warm_start._shape(on).items() if k != "eval_judges"} == warm_start._shape(off)
    assert "sentence_grades" not in warm_start._shape(off)
    assert warm_start._shape(WarmStartConfig(sentence_grades=True))["sentence_grades"] is True
    assert set(T.ROLES) <= set(WarmStartConfig.model_fields["role_repeats"].annotation.__args__[0].__args__)
    smoke = load_params(REPO / "params" / "smoke.yaml", {"run.data_dir": str(shared_data), "run.runs_dir": str(tmp_path),
                                                         "model.warm_start.eval_judges": True})
    with pytest.raises(ValueError, match=r"eval_judges.*evaluation.short_form_judge.max_tokens is 16"):
        warm_start.prepare(smoke, cache_dir=tmp_path)
    smollm = load_params(REPO / "params" / "smollm.yaml", {"run.data_dir": str(shared_data)})
    assert smollm.model.warm_start.eval_judges            # on for SmolLM2, measured (README, "Its judges")
    assert min(smollm.evaluation.short_form_judge.max_tokens,
               smollm.evaluation.open_ended_judge.max_tokens) >= T.EVAL_JUDGE_MAX_TOKENS


def test_the_sft_keeps_to_the_processs_thread_cap(monkeypatch):
    """A test worker (OMP_NUM_THREADS=1, tests/conftest.py) builds with one thread whatever `threads` says: two
    threads on a core the other worker keeps busy spin against it; without a cap the setting holds."""
    from scope_lib.smoke.sft import sft_threads

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert sft_threads(2) == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "8")
    assert sft_threads(2) == 2
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert sft_threads(2) == 2
    monkeypatch.setenv("OMP_NUM_THREADS", "")
    assert sft_threads(3) == 3
