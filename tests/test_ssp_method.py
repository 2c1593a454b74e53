"""Search Self-Play as a method of the library (`selfplay.methods.ssp`, issue 48 item 4): one iteration end to end on
the tiny model with real updates of one shared adapter (the Proposer's REINFORCE, the Solver's GRPO) and a scripted
engine that plays SSP's protocol; the rule filters and RAG verification as the loop wires them, the rewards (eq. 6-7)
and advantages, the records and the alarm; the replay buffer across iterations and its periodic reset; the answer
file and its evaluation guard; a Solver stage interrupted mid-way resumes with nothing duplicated; the answer check
(`ssp.answer_check`): the Correct/Wrong parser, the batch's verdicts by judge or rule, and an iteration whose rewards
follow a scripted LLM judge (App. E) where the rule would differ."""

from __future__ import annotations

import json
import re

import pytest
import torch
import yaml
from scripted_engine import ScriptedEngine
from training_helpers import FAST, REPO, comparable, load_policy

from scope_lib.config import load_params
from scope_lib.protocol import ssp
from scope_lib.protocol.answer_set import AnswerSetError
from scope_lib.protocol.dialects import get_dialect
from scope_lib.protocol.parsing import parse_correct_wrong
from scope_lib.retrieval.index import build_or_open_index
from scope_lib.runs import read_jsonl
from scope_lib.selfplay.judge import Judge
from scope_lib.selfplay.loop import run
from scope_lib.selfplay.methods.ssp import (
    RAG_REJECTED,
    SspQuestion,
    SspSolver,
    Verdict,
    check_answers,
    file_answers,
    refill_buffer,
    replay_period,
    training_questions,
)

DIALECT = get_dialect("qwen2.5")
ROT = str.maketrans("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789",
                    "nopqrstuvwxyzabcdefghijklmNOPQRSTUVWXYZABCDEFGHIJKLM1234567890")
UNROT = {v: k for k, v in ROT.items()}


def code(answer: str) -> str:
    """The answer written so that no word of it is left (rot13, digits + 1): the question carries the answer without
    containing it, and the scripted Solver reads it back."""
    return answer.translate(ROT)


def decode(text: str) -> str:
    return text.translate(UNROT)


#: What the scripted Proposer writes once it has searched, in turn: a valid question (its answer coded), one that
#: names its answer (the rule filter's `answer_in_question`), one that nothing answers (RAG verification rejects it).
QUESTIONS = ("Which name or number is coded as [code: {code}] in the passages I found?",
             "Which name or number is {answer}, as the passages I found say?",
             "Which name or number did the passages I found point to in the end?")


def first_user(context: str) -> str:
    return context.split("<|im_start|>user\n", 1)[-1]


class SspEngine(ScriptedEngine):
    """Plays SSP on the decoded contexts. The Proposer searches its answer as many times as its prompt asks, then
    writes the QUESTIONS in turn (`questions`: which kinds, cycled); the RAG Solver answers a coded question when its
    documents hold results; the Solver searches once, then every third row of a batch (0, 3, ...) answers the coded
    question and the others say they do not know (TRL and the loop put a question's rollouts side by side: n = 3
    Solver rollouts of a question solve it 1 time in 3, and each GRPO group of 2 has spread)."""

    def __init__(self, tokenizer, *, questions=(0, 1, 2)):
        super().__init__(tokenizer, DIALECT)
        self.questions = questions
        self.proposed = 0
        self.proposer_calls = 0

    def generate(self, prompt_token_ids, sampling, adapter=None):
        self.calls += 1
        out = []
        for row, ids in enumerate(prompt_token_ids):
            context = self.tokenizer.decode(ids)
            out.append(self._complete(self.write(context, row), sampling))
        return out

    def write(self, context: str, row: int) -> str:
        user = first_user(context)
        if user.startswith("You write search questions backwards"):
            self.proposer_calls += 1
            return self.propose(context)
        coded = re.search(r"\[code: (.+?)\]", context)
        if user.startswith("Answer the question from the documents"):
            documents = context.split("<documents>", 1)[-1].split("</documents>", 1)[0]
            found = coded and "Doc 1" in documents
            return f"<think>From the documents.</think>\n<answer>{decode(coded.group(1)) if found else 'unknown'}</answer>"
        if user.startswith("Answer the question below"):
            if not self._searched(context):
                return f"<think>I search first.</think>\n{DIALECT.format_search('passages I found')}"
            answer = decode(coded.group(1)) if coded and row % 3 == 0 else "I do not know"
            return f"<think>I have read the results.</think>\n<answer>{answer}</answer>"
        return "I do not know what to do."

    def propose(self, context: str) -> str:
        answer = re.search(r"\nAnswer: (.+)\n", context).group(1).strip()
        needed = int(re.search(r"following that chain with (\d+) search", context).group(1))
        searched = self._searched(context)
        if len(searched) < needed:
            query = answer if not searched else f"{answer} {len(searched)}"
            return f"<think>I look up what leads to {answer}.</think>\n{DIALECT.format_search(query)}"
        if self.questions is None:
            return "<think>I would rather not write a question.</think>"
        kind = self.questions[self.proposed % len(self.questions)]
        self.proposed += 1
        return "<think>The chain is complete.</think>\n<question>" + QUESTIONS[kind].format(
            code=code(answer), answer=answer) + "</question>"


SETTINGS = {"selfplay.iterations": 1, "selfplay.challenger_steps": 1, "selfplay.steps_per_role": 2,
            "selfplay.solver_rollouts_train": 3, "grpo.group_size": 3, "challenger.batch_size": 4}


def ssp_params(tmp_path, data_dir, **overrides):
    return load_params(REPO / "params" / "ssp-smoke.yaml",
                       {"run.runs_dir": str(tmp_path), "run.data_dir": str(data_dir), **FAST, **SETTINGS,
                        **overrides})


@pytest.fixture(scope="module")
def retriever(tmp_path_factory, wiki_sample):
    return build_or_open_index(ssp_params(tmp_path_factory.mktemp("index"), wiki_sample.parent), progress=False)


def run_ssp(params, tiny_model_dir, retriever, **engine):
    policy = load_policy(params, tiny_model_dir)
    engine = SspEngine(policy.tokenizer, **engine)
    return run(params, policy=policy, engine=engine, judge=Judge(engine, params.judge, seed=0),
               retriever=retriever), engine


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, wiki_sample, tiny_model_dir, retriever):
    params = ssp_params(tmp_path_factory.mktemp("ssp"), wiki_sample.parent)
    result, _ = run_ssp(params, tiny_model_dir, retriever)
    return params, result


def test_ssp_runs_one_iteration_with_its_filters_verification_and_rewards(uninterrupted):
    params, result = uninterrupted
    assert (params.method, params.model.shared_policy, params.grpo.loss_type, params.grpo.scale_rewards) == (
        "ssp", True, "grpo", "none")
    assert list(result.policy.model.peft_config) == ["policy"]
    folder = params.run_dir / "iter_01"
    for stage in ("challenger", "solver"):
        assert (folder / stage / "DONE").is_file()
        assert (folder / stage / "adapter" / "adapter_config.json").is_file()
    n = params.selfplay.solver_rollouts_train
    proposals = read_jsonl(folder / "challenger" / "rollouts.jsonl")
    assert len(proposals) == params.challenger.batch_size == 4      # REINFORCE: one proposal per answer
    assert len({p["answer"] for p in proposals}) == 4
    # the scripted Proposer wrote, in turn: valid, the answer inside, unanswerable, valid
    by_reason = {}
    for p in proposals:
        by_reason.setdefault(p["invalid_reason"], []).append(p)
        assert p["n_valid_searches"] == p["num_searches"] >= 1
    assert sorted(by_reason, key=str) == sorted([None, "answer_in_question", RAG_REJECTED], key=str)
    assert len(by_reason[None]) == 2
    leak = by_reason["answer_in_question"][0]    # the rule filter rejects it before any RAG answer
    assert leak["answer"] in leak["question"] and leak["filter_reason"] == "answer_in_question"
    assert (leak["valid"], leak["rag_verified"], leak["solved"], leak["reward"]) == (False, None, None, 0.0)
    unanswerable = by_reason[RAG_REJECTED][0]    # passes the filters; the RAG Solver cannot answer it
    assert (unanswerable["filter_reason"], unanswerable["rag_verified"], unanswerable["rag_answer"]) == (
        None, False, "unknown")
    assert (unanswerable["valid"], unanswerable["solved"], unanswerable["reward"]) == (False, None, 0.0)
    for p in by_reason[None]:                    # n = 3 Solver answers: the first right, the others wrong
        assert (p["valid"], p["rag_verified"], p["rag_answer"]) == (True, True, p["answer"])
        assert p["solved"] == [True, False, False]
        assert (p["success_rate"], p["reward"]) == pytest.approx((1 / 3, 2 / 3))   # eq. 7: 1 - 1/3
    rag = read_jsonl(folder / "challenger" / "rag_rollouts.jsonl")
    assert sorted(r["question_id"] for r in rag) == sorted(p["id"] for p in proposals if p["filter_reason"] is None)
    evidence = {p["id"]: [s["results"] for s in p["trajectory"]["searches"] if s["valid"]] for p in proposals}
    for r in rag:   # the RAG prompt: every result the Proposer saw, and up to 4 of the others' (noise)
        prompt = r["trajectory"]["messages"][0]["content"]
        assert all(block.strip() in prompt for block in evidence[r["question_id"]]) and r["own_passages"] >= 1
        others = {b for pid, blocks in evidence.items() if pid != r["question_id"] for b in blocks
                  if b not in evidence[r["question_id"]]}
        assert r["noise_passages"] == min(4, len(others)) >= 1
        assert r["trajectory"]["searches"] == [] and "<search>" not in prompt
    solver = read_jsonl(folder / "challenger" / "solver_rollouts.jsonl")
    assert len(solver) == n * 2 and all(s["trajectory"]["searches"] for s in solver)
    for p in proposals:  # REINFORCE's advantage: the reward minus the step's mean reward, (2/3 + 2/3) / 4
        assert (p["baseline"], p["advantage"]) == pytest.approx((1 / 3, p["reward"] - 1 / 3))
    metrics = read_jsonl(folder / "challenger" / "metrics.jsonl")[0]
    assert (metrics["valid_rate"], metrics["filter_pass_rate"], metrics["rag_pass_rate"]) == (0.5, 0.75, 2 / 3)
    assert (metrics["solver_success"], metrics["zero_spread_tasks"]) == pytest.approx((1 / 3, 0.0))
    assert (metrics["reward"], metrics["baseline"]) == pytest.approx(((2 / 3 + 2 / 3 + 0 + 0) / 4, 1 / 3))
    assert metrics["zero_spread_share"] == 0.0       # no advantage is 0
    summary = json.loads((folder / "challenger" / "DONE").read_text())
    assert (summary["attempts"], summary["valid"], summary["rag_checked"], summary["rag_passed"]) == (4, 2, 3, 2)
    assert summary["invalid_reasons"] == {"answer_in_question": 1, RAG_REJECTED: 1}
    # Stage 2: the Solver on the two valid questions, r_solve = 1[correct] (eq. 6); its groups are the n = G = 3
    # rollouts that scored the Proposer (ssp.solver_samples: shared, Algorithm 1 line 10)
    answers = read_jsonl(folder / "solver" / "rollouts.jsonl")
    scored = {s["id"]: s for s in solver}
    for a in answers:
        assert a["sampled_as"].rsplit("/s", 1)[0] == a["task_id"] and a["answer"] == scored[a["sampled_as"]]["answer"]
        assert a["sampled_as"].endswith(f"/s{a['id'].rsplit('/g', 1)[1]}")   # row j is the j-th of the n
    assert len(answers) == params.selfplay.steps_per_role * params.solver.batch_size * params.grpo.group_size
    assert {a["task_id"] for a in answers} == {p["id"] for p in by_reason[None]}
    assert all(a["reward"] == float(a["correct"]) and not a["from_buffer"] for a in answers)
    assert {a["correct"] for a in answers} == {True, False}
    buffer = read_jsonl(folder / "solver" / "replay_buffer.jsonl")
    assert sorted(q["id"] for q in buffer) == sorted(p["id"] for p in by_reason[None])
    assert all(q["global_step"] == 1 for q in buffer)
    solver_summary = json.loads((folder / "solver" / "DONE").read_text())
    assert solver_summary["replay"] == {"period": 0, "new": 2, "from_buffer": 0, "buffer": 2}
    assert "no_valid_task" not in [a["alarm"] for a in result.alarms]


def test_an_ssp_iteration_without_a_valid_question_says_so_and_goes_on(tmp_path, wiki_sample, tiny_model_dir,
                                                                       retriever):
    params = ssp_params(tmp_path, wiki_sample.parent, **{"selfplay.steps_per_role": 1})
    result, _ = run_ssp(params, tiny_model_dir, retriever, questions=None)
    assert "no_valid_task" in [a["alarm"] for a in result.alarms]
    assert "replay buffer" in (params.run_dir / "health.jsonl").read_text()
    assert "none of the Proposer's" in (params.run_dir / "health.jsonl").read_text()   # SSP's name for the role
    proposals = read_jsonl(params.run_dir / "iter_01" / "challenger" / "rollouts.jsonl")
    assert proposals and all((p["reward"], p["invalid_reason"]) == (0.0, "no_question") for p in proposals)
    solver = json.loads((params.run_dir / "iter_01" / "solver" / "DONE").read_text())
    assert solver["skipped"] == "no valid question" and solver["steps"] == 0
    assert read_jsonl(params.run_dir / "iter_01" / "solver" / "replay_buffer.jsonl") == []


def test_a_solver_stage_killed_mid_way_resumes_with_nothing_duplicated(tmp_path, wiki_sample, tiny_model_dir,
                                                                       retriever, uninterrupted, monkeypatch):
    clean_params, _ = uninterrupted
    params = ssp_params(tmp_path, wiki_sample.parent)
    metrics = params.run_dir / "iter_01" / "solver" / "metrics.jsonl"
    draw = SspSolver.draw_rollouts

    def killed_in_the_second_step(self, session, trajectories, limits, step):
        if metrics.is_file() and metrics.read_text().strip():
            raise KeyboardInterrupt("killed")
        return draw(self, session, trajectories, limits, step)

    with monkeypatch.context() as patch, pytest.raises(KeyboardInterrupt):   # the Solver stage's step 2 rows
        patch.setattr(SspSolver, "draw_rollouts", killed_in_the_second_step)
        run_ssp(params, tiny_model_dir, retriever)
    assert len(read_jsonl(metrics)) == 1 and not (params.run_dir / "iter_01" / "solver" / "DONE").exists()
    _, engine = run_ssp(params, tiny_model_dir, retriever)
    assert engine.proposer_calls == 0      # the finished Proposer stage is not redone
    mine, theirs = params.run_dir / "iter_01", clean_params.run_dir / "iter_01"
    for name in ("challenger/rollouts", "challenger/rag_rollouts", "challenger/solver_rollouts", "solver/rollouts",
                 "solver/replay_buffer"):
        ids = [r["id"] for r in read_jsonl(mine / f"{name}.jsonl")]
        assert len(ids) == len(set(ids)), f"duplicated records in {name}"
        assert comparable(mine / f"{name}.jsonl") == comparable(theirs / f"{name}.jsonl"), name
    assert [(m["id"], m["reward"]) for m in comparable(mine / "solver" / "metrics.jsonl")] == [
        (m["id"], m["reward"]) for m in comparable(theirs / "solver" / "metrics.jsonl")]
    from safetensors.torch import load_file

    a = load_file(str(mine / "solver" / "adapter" / "adapter_model.safetensors"))
    b = load_file(str(theirs / "solver" / "adapter" / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


#: An answer file of the kind App. A.4 samples (training answers, none of them an evaluation gold answer).
ANSWERS = ["Harbour Bridge Tollway", "Velvet Orchard Society", "Copper Lantern Press", "Northgate Rowing Club",
           "Saint Brennan Chapel", "Amber Valley Railway", "Kestrel Point Lighthouse", "Marlow Glass Works"]


def test_a_second_iteration_fills_the_solvers_empty_slots_from_the_buffer_the_first_stored(tmp_path, wiki_sample,
                                                                                            tiny_model_dir, retriever):
    (tmp_path / "answers.txt").write_text("\n".join(ANSWERS) + "\n")
    params = ssp_params(tmp_path, wiki_sample.parent, **{"selfplay.iterations": 2, "selfplay.steps_per_role": 1,
                                                          "solver.batch_size": 4,
                                                          "ssp.answer_file": str(tmp_path / "answers.txt")})
    run_ssp(params, tiny_model_dir, retriever)
    proposed = [read_jsonl(params.run_dir / f"iter_{t:02d}" / "challenger" / "rollouts.jsonl") for t in (1, 2)]
    assert [sorted(p["answer"] for p in step) for step in proposed] == [
        sorted(a.text for a in file_answers(params)[:4]), sorted(a.text for a in file_answers(params)[4:])]
    assert {p["answer_kind"] for step in proposed for p in step} == {"file"}      # the file's answers, 4 and 4
    assert [json.loads((params.run_dir / f"iter_{t:02d}" / "challenger" / "DONE").read_text())["answer_positions"]
            for t in (1, 2)] == [[0, 4], [4, 8]]
    first, second = (params.run_dir / f"iter_{t:02d}" / "solver" for t in (1, 2))
    stored = read_jsonl(first / "replay_buffer.jsonl")
    assert [q["global_step"] for q in stored] == [1, 1]          # Proposer step 1 of iteration 1
    # the scripted Proposer's kinds go on cycling: iteration 2 writes one valid question (then a leak, an unanswerable
    # one, ...), so 3 of the 4 slots are open and both stored questions fill them
    assert json.loads((second / "DONE").read_text())["replay"] == {"period": 0, "new": 1, "from_buffer": 2,
                                                                   "buffer": 3}
    answers = read_jsonl(second / "rollouts.jsonl")
    assert {a["task_id"] for a in answers if a["from_buffer"]} == {q["id"] for q in stored}
    assert all((a["sampled_as"] is None) == a["from_buffer"] for a in answers)   # the buffer's: rolled out anew
    assert {a["task_id"] for a in answers if not a["from_buffer"]}.isdisjoint({q["id"] for q in stored})
    assert [q["global_step"] for q in read_jsonl(second / "replay_buffer.jsonl")] == [1, 1, 2]


def test_the_answer_file_is_refused_when_it_is_or_copies_an_evaluation_set(tmp_path, wiki_sample):
    nq = [json.loads(line) for line in (wiki_sample.parent / "qa" / "nq.jsonl").read_text().splitlines()[:12]]
    copy = tmp_path / "copy.jsonl"
    copy.write_text("".join(json.dumps({"answer": r["golden_answers"][0]}) + "\n" for r in nq))
    with pytest.raises(AnswerSetError, match="evaluation gold answers"):
        file_answers(ssp_params(tmp_path, wiki_sample.parent, **{"ssp.answer_file": str(copy)}))
    own = tmp_path / "own.txt"                     # three training answers and one NQ gold answer: kept, less it
    own.write_text("\n".join([*ANSWERS[:3], nq[0]["golden_answers"][0]]) + "\n")
    assert sorted(a.text for a in file_answers(ssp_params(tmp_path, wiki_sample.parent,
                                                          **{"ssp.answer_file": str(own)}))) == sorted(ANSWERS[:3])
    (tmp_path / "data" / "qa").mkdir(parents=True)   # a file in the data dir's QA folder is an evaluation file
    (tmp_path / "data" / "qa" / "mine.txt").write_text("\n".join(ANSWERS) + "\n")
    with pytest.raises(AnswerSetError, match="evaluation data"):
        file_answers(ssp_params(tmp_path, tmp_path / "data", **{"ssp.answer_file": "qa/mine.txt"}))


def test_shared_solver_samples_need_n_equal_to_g(tmp_path, wiki_sample):
    from scope_lib.config import ParamsError
    from scope_lib.selfplay.methods.ssp import check_params

    check_params(ssp_params(tmp_path, wiki_sample.parent))
    with pytest.raises(ParamsError, match="ssp.solver_samples: fresh"):
        check_params(ssp_params(tmp_path, wiki_sample.parent, **{"grpo.group_size": 2}))
    check_params(ssp_params(tmp_path, wiki_sample.parent, **{"grpo.group_size": 2, "ssp.solver_samples": "fresh"}))


def test_ssp_settings_stay_out_of_the_parameter_hash_at_their_defaults():
    from scope_lib.selfplay.loop import science_yaml

    assert "ssp" not in yaml.safe_load(science_yaml(load_params(None)))
    assert yaml.safe_load(science_yaml(load_params(None, {"ssp.noise_passages": 7})))["ssp"]["noise_passages"] == 7
    # the answer check: an SSP run by rule hashes as every SSP run did before the option; by the judge apart
    ruled = load_params(REPO / "params" / "ssp-smoke.yaml")
    assert ruled.ssp.answer_check == "rule" and "ssp" not in yaml.safe_load(science_yaml(ruled))
    judged = load_params(REPO / "params" / "ssp-smoke.yaml", {"ssp.answer_check": "judge"})
    assert yaml.safe_load(science_yaml(judged))["ssp"]["answer_check"] == "judge"


def question(id: str, step: int, text: str | None = None, iteration: int = 1) -> SspQuestion:
    return SspQuestion(id, text or f"Which question is number {id}?", "x", iteration, step)


def test_the_replay_buffer_is_cleared_every_ten_proposer_steps():
    assert [replay_period(g) for g in (1, 10, 11, 20, 21)] == [0, 0, 1, 1, 2]
    with pytest.raises(ValueError):
        replay_period(0)
    kept = [question("a", 3), question("b", 9)]
    assert refill_buffer(kept, [question("c", 10)], now=10) == [*kept, question("c", 10)]
    assert refill_buffer(kept, [question("d", 12)], now=12) == [question("d", 12)]   # step 11 cleared a and b
    assert refill_buffer(kept, [question("e", 10, kept[0].question)], now=10) == kept  # one copy of a text


def test_the_solver_stage_takes_every_new_question_and_fills_the_rest_from_the_buffer():
    new = [question("n1", 12, iteration=2), question("n2", 12, "Which question is number n1?", iteration=2)]
    buffer = [question(f"b{i}", 11) for i in range(5)]
    chosen = training_questions(new, buffer, slots=3, seed=0)
    assert chosen[0] == new[0] and len(chosen) == 3          # n2 repeats n1's text: left out
    assert set(chosen[1:]) <= set(buffer) and len(set(chosen)) == 3
    assert chosen == training_questions(new, buffer, slots=3, seed=0)   # seeded
    assert training_questions(new, buffer, slots=1, seed=0) == [new[0]]  # new questions are never dropped
    assert len(training_questions([], buffer, slots=8, seed=0)) == 5    # no question twice


def test_scope_plan_estimates_ssp_at_the_papers_settings_with_one_adapter():
    from scope_lib.models.gpu_plan import plan_gpu

    params = load_params(REPO / "params" / "ssp-qwen2.5-7b.yaml")
    assert (params.method, params.model.base, params.grpo.group_size, params.selfplay.solver_rollouts_train) == (
        "ssp", "Qwen/Qwen2.5-7B-Instruct", 5, 5)
    report = plan_gpu(params, gpu_gib=141)
    rows = {r.item: r.gib for r in report.rows}
    assert "frozen second adapter (fp32)" not in rows           # one policy plays both roles
    two = plan_gpu(load_params(REPO / "params" / "qwen2.5-7b.yaml"), gpu_gib=141)
    second = {r.item: r.gib for r in two.rows}["frozen second adapter (fp32)"]
    assert second == pytest.approx(rows["trained adapter + gradient + AdamW (fp32)"] / 4)   # 4 B of the 16 B
    assert report.fits and "12288 tokens" in " ".join(r.note for r in report.rows)   # 4,096 prompt + 8,192 reply


# -- the answer check (ssp.answer_check; §3.2, App. E) ----------------------------------------------------------------


def test_the_judges_correct_or_wrong_is_read_and_anything_else_is_none():
    assert [parse_correct_wrong(t) for t in ("Correct", "Wrong", "correct.", " **WRONG** ", '"Correct"')] == [
        1, 0, 1, 0, 1]
    assert parse_correct_wrong("<think>It names the same city.</think>\nCorrect") == 1
    for garbage in ("The answer is correct.", "Correct or Wrong", "Correctly", "", "<think>Correct", None, 1):
        assert parse_correct_wrong(garbage) is None, garbage


def plain(text: str) -> str:
    """The scripted judge's own normalisation: lower case, letters and digits only, single spaces."""
    return " ".join(re.sub(r"[^a-z0-9]+", " ", text.lower()).split())


class AnswerJudge(ScriptedEngine):
    """An LLM judge that follows App. E's protocol: Correct when the predicted answer equals the ground truth after its
    own normalisation (`plain`), Wrong otherwise, and a reply that is neither when the prediction says it does not know
    (the retry gets the same). Counts its calls and batch sizes."""

    def generate(self, prompt_token_ids, sampling, adapter=None):
        self.calls += 1
        self.batch_sizes.append(len(prompt_token_ids))
        return [self._complete(self.verdict(first_user(self.tokenizer.decode(ids))), sampling)
                for ids in prompt_token_ids]

    @staticmethod
    def verdict(user: str) -> str:
        assert user.startswith("You are a judge of answers"), user[:80]
        reference = re.search(r"\nGround-truth answer: (.*)\n", user).group(1)
        prediction = re.search(r"\nPredicted answer: (.*)\n", user).group(1)
        if "not know" in prediction:
            return "I cannot tell."
        return "Correct" if plain(prediction) == plain(reference) else "Wrong"


def test_a_batch_is_checked_by_the_judge_in_one_call_or_by_the_rule(tmp_path, wiki_sample, tiny_model_dir):
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    judged = ssp_params(tmp_path, wiki_sample.parent, **{"ssp.answer_check": "judge"})
    engine = AnswerJudge(tokenizer, DIALECT)
    judge = Judge(engine, judged.judge, seed=0)
    predictions = ["Amber Valley Railway", "It is the Amber Valley Railway, I am sure", None, "  ", "I do not know",
                   "amber valley railway!"]
    questions, answers = ["Which railway runs through the valley?"] * 6, ["Amber Valley Railway"] * 6
    verdicts = check_answers(SimpleNamespace(params=judged, judge=judge), questions, predictions, answers)
    assert verdicts == [Verdict(True, "judge"), Verdict(False, "judge"), Verdict(False, "no_answer"),
                        Verdict(False, "no_answer"), Verdict(False, "judge_unparseable"), Verdict(True, "judge")]
    assert engine.batch_sizes == [4, 1]          # the 4 answers in one call, then the unparseable one asked again
    stats = judge.stats.stage("answer_match")
    assert (stats.prompts, stats.calls, stats.retried, stats.unparseable) == (4, 2, 1, 1)
    ruled = ssp_params(tmp_path, wiki_sample.parent, **{"ssp.answer_check": "rule"})
    assert check_answers(SimpleNamespace(params=ruled, judge=judge), questions, predictions, answers) == [
        Verdict(c, "rule") for c in (True, True, False, False, False, True)]   # containment: the rule disagrees
    assert engine.calls == 2                     # the rule asks no judge


class HedgingSspEngine(SspEngine):
    """SSP's scripted protocol, but the Solver's second row of three hedges: "It is <answer> for sure", which the rule
    counts (it holds the answer) and the scripted judge does not (`AnswerJudge`)."""

    def write(self, context: str, row: int) -> str:
        text = super().write(context, row)
        coded = re.search(r"\[code: (.+?)\]", context)
        if first_user(context).startswith("Answer the question below") and "<answer>" in text and row % 3 == 1:
            return f"<think>I have read the results.</think>\n<answer>It is {decode(coded.group(1))} for sure</answer>"
        return text


def test_ssp_rewards_follow_the_judges_verdicts_in_one_call_per_batch(tmp_path, wiki_sample, tiny_model_dir,
                                                                      retriever):
    params = ssp_params(tmp_path, wiki_sample.parent, **{"ssp.answer_check": "judge", "selfplay.steps_per_role": 1})
    policy = load_policy(params, tiny_model_dir)
    engine, judge_engine = HedgingSspEngine(policy.tokenizer), AnswerJudge(policy.tokenizer, DIALECT)
    judge = Judge(engine, params.judge, seed=0, grader_engine=judge_engine)
    run(params, policy=policy, engine=engine, judge=judge, retriever=retriever)
    folder = params.run_dir / "iter_01"
    proposals = read_jsonl(folder / "challenger" / "rollouts.jsonl")
    valid = [p for p in proposals if p["valid"]]
    assert len(valid) == 2 and all(p["solved"] == [True, False, False] for p in valid)   # the rule: [T, T, F]
    assert all(p["reward"] == pytest.approx(2 / 3) for p in valid)
    rag = read_jsonl(folder / "challenger" / "rag_rollouts.jsonl")
    assert {r["answer_check"] for r in rag} == {"judge"} and sorted(r["correct"] for r in rag) == [False, True, True]
    solver = read_jsonl(folder / "challenger" / "solver_rollouts.jsonl")
    assert [s["answer_check"] for s in solver].count("judge_unparseable") == 2
    stage1 = read_jsonl(folder / "challenger" / "metrics.jsonl")[0]
    assert stage1["answers_unparseable"] == 2
    assert json.loads((folder / "challenger" / "DONE").read_text())["answer_checks"] == {"judge": 7,
                                                                                       "judge_unparseable": 2}
    answers = read_jsonl(folder / "solver" / "rollouts.jsonl")
    gold = {p["id"]: p["answer"] for p in valid}
    hedged = [a for a in answers if a["answer"].startswith("It is ")]
    assert hedged and all(ssp.answer_correct(a["answer"], gold[a["task_id"]]) for a in hedged)   # the rule: right
    for a in answers:      # r_solve follows the judge: Correct only for the exact answer; unparseable scores 0
        exact = a["answer"] == gold[a["task_id"]]
        assert (a["reward"], a["correct"]) == (float(exact), exact)
        assert a["answer_check"] == ("judge_unparseable" if "not know" in a["answer"] else "judge")
    unknown = sum("not know" in a["answer"] for a in answers)
    assert unknown and read_jsonl(folder / "solver" / "metrics.jsonl")[0]["answers_unparseable"] == unknown
    # one judge call per batch (RAG verification, the n Solver rollouts), each followed by one retry call for its
    # unparseable replies only; the Solver stage's rows are the rollouts that scored the Proposer, with their verdicts
    # (Algorithm 1 line 10): it asks the judge nothing again
    assert all(a["sampled_as"] for a in answers)
    assert judge_engine.batch_sizes == [3, 6, 2]
    assert judge.stats.stage("answer_match").unparseable == 2 == unknown


def test_an_ssp_run_with_the_judge_check_probes_its_answer_check_alone(tmp_path, wiki_sample, tiny_model_dir,
                                                                       retriever):
    """ssp-smoke.yaml with `-o ssp.answer_check=judge -o judge.calibration.enabled=true`: the run opens, probes SSP's
    Correct/Wrong check (`Method.judge_stages`: answer_match) and no stage of SCOPE's Judge (every Judge stage is the
    AnswerJudge, which takes App. E's prompt alone), writes the probe to its manifest and reads it back on resume."""
    from scope_lib.selfplay.loop import open_run
    from scope_lib.selfplay.stage_probes import StageProbes

    params = ssp_params(tmp_path, wiki_sample.parent, **{"ssp.answer_check": "judge",
                                                         "judge.calibration.enabled": True})
    policy = load_policy(params, tiny_model_dir)
    judge_engine = AnswerJudge(policy.tokenizer, DIALECT)

    def open_it():
        return open_run(params, policy=policy, engine=SspEngine(policy.tokenizer), retriever=retriever,
                        judge=Judge(judge_engine, params.judge, seed=0))

    opened = open_it()
    manifest = json.loads((params.run_dir / "manifest.json").read_text())
    assert manifest["judge_calibration"] is None and manifest["probes_key"]          # no grader probe
    probes = StageProbes.from_record(manifest["judge_stage_calibration"])
    assert probes.gates == {} and probes.rubrics is None and judge_engine.batch_sizes == [32]   # one call
    check = probes.answer_match
    # the scripted judge says Correct to the exact ground truth only: 8 said (yes), 8 restated (no), 16 wrong (no)
    assert (check.n_items, check.sensitivity, check.specificity, check.separation, check.invalid_rate) == (
        32, 0.5, 1.0, 0.5, 0.0)
    assert check.trusted and not opened.alarms
    open_it()                                                                         # a resume probes nothing
    assert judge_engine.batch_sizes == [32]

