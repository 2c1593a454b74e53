"""The calibration probe of Search Self-Play's Correct/Wrong answer check (`selfplay.stage_probes`, issue 48 item 4) and
the method hooks that decide what a run probes and opens (`Method.judge_stages`, `Method.uses_index`): the probe's
numbers on hand-built items under scripted judges that follow a known rule (computed by hand), a judge that says
Correct to everything untrusted, the four kinds built right from real corpus passages, the record, rows, alarm and
refusal; which Judge stages each method probes (SCOPE's unchanged, SSP's answer check only, SPICE and SCORE none);
the new item count left out of params.yaml and of the held-out set's key at its default."""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import pytest
from scripted_engine import ScriptedEngine

from scope_lib.config import load_params
from scope_lib.protocol.dialects import get_dialect
from scope_lib.protocol.facts import facts_of, is_year, mentions
from scope_lib.retrieval.corpus import read_corpus
from scope_lib.selfplay import health
from scope_lib.selfplay import stage_probes as S
from scope_lib.selfplay.harness import NoIndex
from scope_lib.selfplay.judge import Judge
from scope_lib.selfplay.methods import METHODS

REPO = Path(__file__).resolve().parents[1]
DIALECT = get_dialect("qwen2.5")


class RuleJudge(ScriptedEngine):
    """A judge of App. E's prompt that decides by a known rule on (prediction, ground truth) read from each prompt:
    'reads' = Correct when the ground truth, lower case, is in the prediction; 'prefix' = Correct when the prediction
    starts with the ground truth's first three letters (any case); 'yes' = Correct to everything. A prediction that
    starts with '??' gets a reply that is neither word, also when asked again."""

    def __init__(self, tokenizer, rule: str):
        super().__init__(tokenizer, DIALECT)
        self.rule = rule
        self.asked: list[str] = []

    def generate(self, prompt_token_ids, sampling, adapter=None):
        self.calls += 1
        self.batch_sizes.append(len(prompt_token_ids))
        return [self._complete(self.verdict(self.tokenizer.decode(ids)), sampling) for ids in prompt_token_ids]

    def verdict(self, context: str) -> str:
        assert "You are a judge of answers" in context, context[:200]    # no other Judge prompt reaches it
        reference = re.search(r"\nGround-truth answer: (.*)\n", context).group(1)
        prediction = re.search(r"\nPredicted answer: (.*)\n", context).group(1)
        self.asked.append(prediction)
        if prediction.startswith("??"):
            return "Maybe."
        correct = {"reads": reference.lower() in prediction.lower(),
                   "prefix": prediction.lower().startswith(reference.lower()[:3]), "yes": True}[self.rule]
        return "Correct" if correct else "Wrong"


def item(n: int, kind: str, prediction: str, reference: str) -> S.AnswerProbe:
    return S.AnswerProbe(f"d{n}/{kind}", kind, f"Which name fills the blank in this sentence: \"{S.BLANK} ...\"?",
                         prediction, reference)


#: Nine hand-built items: two documents' four kinds, and one wrong answer whose verdict never parses.
ITEMS = [item(1, "same", "Paris", "Paris"), item(1, "restated", "It was PARIS.", "Paris"),
         item(1, "other_document", "Berlin", "Paris"), item(1, "same_document", "Parma", "Paris"),
         item(2, "same", "1950", "1950"), item(2, "restated", "It was 1950.", "1950"),
         item(2, "other_document", "1849", "1950"), item(2, "same_document", "1951", "1950"),
         item(3, "other_document", "?? Rome", "Paris")]


@pytest.fixture(scope="module")
def judge_cfg():
    return load_params(REPO / "params" / "ssp-smoke.yaml").judge


@pytest.fixture(scope="module")
def calibration_cfg(judge_cfg):
    return judge_cfg.calibration


@pytest.mark.parametrize("rule, numbers", [
    # sensitivity: Correct on the 4 right answers; specificity: Wrong on the 4 valid wrong ones; invalid: 1 of 9
    ("reads", (1.0, 1.0, 1.0, 1 / 9, True)),      # 'It was PARIS.' holds 'paris'; 'Parma', '1951' hold nothing
    ("prefix", (0.5, 0.5, 0.0, 1 / 9, False)),    # misses both restated answers, takes 'Parma' and '1951'
    ("yes", (1.0, 0.0, 0.0, 1 / 9, False)),       # Correct to everything: separation 0
])
def test_the_answer_check_probe_gives_the_hand_computed_numbers(rule, numbers, tiny_tokenizer, judge_cfg,
                                                               calibration_cfg):
    engine = RuleJudge(tiny_tokenizer, rule)
    judge = Judge(engine, judge_cfg, seed=0)
    cal = S.probe_answer_check(judge, ITEMS, calibration_cfg, model="scripted")
    assert engine.batch_sizes == [9, 1]          # every item in ONE call, then the unparseable one asked again
    assert judge.stats.stages == {}              # the run's statistics are untouched; the probe's own are its usage
    assert (cal.usage["prompts"], cal.usage["engine_calls"], cal.usage["retried"]) == (9, 2, 1)
    sensitivity, specificity, separation, invalid, trusted = numbers
    assert (cal.sensitivity, cal.specificity, cal.separation) == pytest.approx((sensitivity, specificity, separation))
    assert cal.invalid_rate == pytest.approx(invalid) and cal.n_items == 9 and cal.n_invalid == 1
    assert cal.trusted is trusted and cal.role == "answer_match" and cal.prompt.startswith("ssp_judge@")
    if not trusted:
        assert cal.reasons == ["separation 0.00 < 0.50"]
    assert [i.kind for i in cal.items if i.invalid] == ["other_document"]
    assert [i.should for i in cal.items[:4]] == [True, True, False, False]


def test_no_item_built_is_an_untrusted_probe_that_says_why(tiny_tokenizer, judge_cfg, calibration_cfg):
    engine = RuleJudge(tiny_tokenizer, "reads")
    cal = S.probe_answer_check(Judge(engine, judge_cfg), [], calibration_cfg, model="scripted")
    assert not cal.trusted and engine.calls == 0 and "no probe item could be built" in cal.reasons[0]


# -- the items from real corpus passages ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def docs(shared_data):
    return S.probe_documents(read_corpus(shared_data / "wiki18_sample.jsonl", max_passages=400).passages[:256])


def kind_of(fact: str) -> str:
    return "year" if is_year(fact) else "number" if fact[0].isdigit() else "name"


def test_the_four_kinds_are_built_right_from_real_passages(docs):
    items = S.answer_probe_items(docs, 32, seed=0)
    assert len(items) == 32 and Counter(i.kind for i in items) == dict.fromkeys(S.ANSWER_SHOULD, 8)
    by_id = {d.passage_id: d for d in docs}
    groups: dict[str, dict[str, S.AnswerProbe]] = {}
    for i in items:
        groups.setdefault(i.key.split("/")[0], {})[i.kind] = i
    assert len(groups) == 8 and all(list(g) == list(S.ANSWER_SHOULD) for g in groups.values())
    kinds = Counter()
    for pid, g in groups.items():
        doc, truth = by_id[pid], g["same"].reference
        assert {i.reference for i in g.values()} == {truth} and len({i.question for i in g.values()}) == 1
        question = g["same"].question
        kinds[kind_of(truth)] += 1
        assert question.startswith(f"Which {kind_of(truth)} fills the blank") and S.BLANK in question
        assert not mentions(question, truth)                                # the cloze hides the ground truth ...
        sentence = question.split(": \"", 1)[1][:-2].replace(S.BLANK, truth)     # ... in its own sentence
        assert sentence in doc.document
        assert truth in [f for _, f in facts_of(sentence)] or kind_of(truth) == "number"
        assert g["same"].prediction == truth and g["restated"].prediction == f"It was {truth.upper()}."
        for wrong in ("other_document", "same_document"):
            p = g[wrong].prediction
            assert kind_of(p) == kind_of(truth) and not S.overlaps(p, truth), (wrong, p, truth)
        assert not mentions(doc.document, g["other_document"].prediction)   # another document's fact
        assert mentions(doc.document, g["same_document"].prediction)        # this document's: the plausible one
    assert kinds["name"] and kinds["year"]                                  # the kinds in turn
    assert S.answer_probe_items(docs, 32, seed=0) == items and S.answer_probe_items(docs, 32, seed=1) != items


def test_the_probes_record_rows_alarm_and_refusal_with_the_answer_check(tiny_tokenizer, judge_cfg,
                                                                      calibration_cfg):
    engine = RuleJudge(tiny_tokenizer, "yes")
    cal = S.probe_answer_check(Judge(engine, judge_cfg), ITEMS[:8], calibration_cfg, model="m")
    probes = S.StageProbes("judge", {}, None, cal)
    record = json.loads(json.dumps(probes.to_record()))
    assert set(record) == {"gates_by", "gates", "rubrics", "answer_match"}
    assert S.StageProbes.from_record(record).to_record() == probes.to_record()
    old = {"gates_by": "judge", "gates": {}, "rubrics": None}                     # a record from before it loads
    assert S.StageProbes.from_record(old).answer_match is None and S.StageProbes("judge").to_record() == old
    assert probes.configured() == [cal] and probes.untrusted() == [cal]
    assert [(r["stage"], r["decides trust"], r["probes"], r["separation"]) for r in probes.rows()] == [
        ("answer check (Correct/Wrong)", True, 8, 0.0)]
    alarms = health.check_stage_calibration(record)
    assert [(a["alarm"], a["role"]) for a in alarms] == [("untrusted_answer_check", "answer_match")]
    assert "ssp.answer_check: rule" in alarms[0]["message"] and "| untrusted_answer_check" in health.__doc__
    line = S.refusal(probes.untrusted(), calibration_cfg.model_copy(update={"accept_untrusted": False}))
    assert "answer check (m): separation 0.00 < 0.50" in line and "ssp.answer_check: rule" in line
    assert "gates_by" not in line and "--accept-untrusted-judge" in line


# -- which stages a method probes, and what it opens -------------------------------------------------------------


def test_each_method_names_the_judge_stages_it_uses_and_whether_it_searches():
    def stages(name, **overrides):
        params = load_params(REPO / "params" / name, overrides)
        return sorted(METHODS[params.method].judge_stages(params))

    assert stages("smoke.yaml") == ["gates", "grading", "rubrics"]           # SCOPE: what was always probed
    assert stages("ssp-smoke.yaml") == [] and stages("ssp-smollm.yaml") == []    # answers checked by rule
    judged = {"ssp.answer_check": "judge", "judge.calibration.enabled": True}
    assert stages("ssp-smoke.yaml", **judged) == ["answer_match"] == stages("ssp-qwen2.5-7b.yaml")
    assert load_params(REPO / "params" / "ssp-qwen2.5-7b.yaml").judge.calibration.enabled
    assert stages("spice-smoke.yaml") == [] and stages("score-smoke.yaml") == []
    assert {name: m.uses_index for name, m in METHODS.items()} == {"scope": True, "spice": False, "ssp": True,
                                                                   "score": True}
    with pytest.raises(RuntimeError, match="SPICE searches nothing"):
        NoIndex("spice").search(["anything"])


def test_probe_judge_stages_probes_only_the_stages_asked(wiki_sample, tiny_tokenizer):
    """SCOPE's default (gates, rubric writer) gives the record it gave before the answer check existed; SSP's asks the
    answer judge alone (RuleJudge refuses any other prompt)."""
    params = load_params(REPO / "params" / "ssp-smoke.yaml", {
        "run.data_dir": str(wiki_sample.parent), "ssp.answer_check": "judge", "judge.calibration.enabled": True,
        "judge.calibration.answer_match_items": 12})
    passages = read_corpus(params.corpus_path).passages
    engine = RuleJudge(tiny_tokenizer, "reads")
    probes = S.probe_judge_stages(params, Judge(engine, params.judge, seed=0), passages,
                                  METHODS["ssp"].judge_stages(params))
    assert probes.gates == {} and probes.rubrics is None and engine.batch_sizes == [12]
    assert probes.answer_match.n_items == 12 and probes.answer_match.trusted
    assert probes.answer_match.sensitivity == probes.answer_match.specificity == 1.0
    assert set(probes.to_record()) == {"gates_by", "gates", "rubrics", "answer_match"}
    scope = load_params(REPO / "params" / "smoke.yaml", {"run.data_dir": str(wiki_sample.parent),
                                                         "judge.calibration.gate_items": 6,
                                                         "judge.calibration.rubric_items": 2})
    scripted = ScriptedEngine(tiny_tokenizer, DIALECT)
    record = S.probe_judge_stages(scope, Judge(scripted, scope.judge, seed=0), passages).to_record()
    assert set(record) == {"gates_by", "gates", "rubrics"}                   # as before the answer check existed
    assert scripted.batch_sizes[:2] == [12, 2]                               # 6 tasks x 2 gates, 2 rubric tasks


def test_the_item_count_stays_out_of_params_yaml_and_the_held_out_key_at_its_default():
    """A run's params.yaml (and the Judge probes' key, its hash) and the learning check's held-out set key are what
    they were before `judge.calibration.answer_match_items` existed: SCOPE's probes and cached sets are reused."""
    from scope_lib.evaluation.held_out import held_out_fingerprint

    params = load_params(REPO / "params" / "smoke.yaml")
    assert "answer_match_items" not in params.to_yaml()
    changed = load_params(REPO / "params" / "smoke.yaml", {"judge.calibration.answer_match_items": 8})
    assert "answer_match_items: 8" in changed.to_yaml()
    assert held_out_fingerprint(params, "m", "x") == held_out_fingerprint(changed, "m", "x")
    assert "answer_match_items" not in json.dumps(held_out_fingerprint(params, "m", "x"))
