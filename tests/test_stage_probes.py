"""The Judge's gates and rubric writer probed like its grader (scope_lib.selfplay.stage_probes, issue 51): the word
rules of the rule-based gates (scope_lib.protocol.gate_rules) on hand-made tasks; the probe tasks built from the corpus
with their known verdicts; a gate that says yes to everything and one that says no to everything found untrusted, the
rules and a reading gate trusted; `rules_then_judge` asks the Judge only for tasks the rules pass; the rubric writer
trusted when its rubrics name the source's facts and not when they restate the task or never parse; the alarms; and
`scope train` stops with exit 4 before training unless it accepts an untrusted Judge stage."""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import pytest
from scripted_engine import ScriptedEngine, scripted_run_params

from scope_lib.config import PAPER_TASK_TYPES, load_params
from scope_lib.protocol import gate_rules as R
from scope_lib.protocol.dialects import get_dialect
from scope_lib.protocol.facts import mentions
from scope_lib.protocol.names import names_in
from scope_lib.retrieval.corpus import read_corpus
from scope_lib.selfplay import health
from scope_lib.selfplay import stage_probes as S
from scope_lib.selfplay.judge import Judge

REPO = Path(__file__).resolve().parents[1]
DOC = ("(Title: George Kennedy Young)\n"
       "George Kennedy Young was a British intelligence officer posted to Zürich in 1950.")


# -- the rules -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("task, names", [
    ("Plan a three-step study of Kennedy.", ["Kennedy"]),
    ("Summarise the key points of the document, in one paragraph.", []),   # issue 51's generic task
    ("Describe Arsenal Stadium's history. Then write a timeline.", ["Arsenal Stadium"]),
    ("Arsenal Stadium opened when?", ["Stadium"]),          # a sentence's first word is a name only with the next
    ("Write about ARSENAL STADIUM in The Times.", ["ARSENAL STADIUM", "Times"]),
    ("In 1990 the club moved north. After That, it grew.", []),
    ("Explain how the village's economy works.", []),
])
def test_the_names_a_task_names(task, names):
    assert names_in(task) == names


@pytest.mark.parametrize("task, entity, source", [
    ("Plan a three-step study of George Kennedy Young, with a timeline.", 1, 1),
    ("Plan a three-step study of Kennedy.", 1, 1),                  # a bare name: the rule cannot tell
    ("Summarise the main facts about GEORGE KENNEDY YOUNG.", 1, 1),  # another case
    ("Summarise what happened to him in Zurich.", 1, 1),            # another spelling (no accent)
    ("Write an essay on the life of young george.", 1, 1),          # lower case: words of the title
    ("Summarise the main facts about Harwick Rovers.", 1, 0),       # another document's name
    ("Summarise the key points of the document in one paragraph.", 0, 0),
    ("Explain how intelligence services recruit officers.", 0, 0),  # the topic, no name
])
def test_the_gate_rules_on_hand_made_tasks(task, entity, source):
    assert R.rule_verdicts(task, DOC, R.RULE_GATES) == {"entity_identifiability": entity, "source_relevance": source}
    assert R.rule_verdicts(task, DOC, ["source_relevance"]) == {"source_relevance": source}
    assert R.title_of(DOC) == "George Kennedy Young" and R.title_of("no title") == ""


# -- the probe tasks -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def passages(shared_data):
    return read_corpus(shared_data / "wiki18_sample.jsonl", max_passages=400).passages


@pytest.fixture(scope="module")
def docs(passages):
    return S.probe_documents(passages[:256])


def test_probe_tasks_have_every_kind_and_their_known_verdicts(docs):
    tasks = S.gate_probe_tasks(docs, 32, seed=0)
    assert len(tasks) == 32 and len({t.key for t in tasks}) == 32
    kinds = Counter(t.kind for t in tasks)
    assert set(kinds) == set(S.KINDS) and min(kinds.values()) >= 4, kinds
    assert len({t.passage_id for t in tasks}) == 16 and set(t.task_type for t in tasks) == set(PAPER_TASK_TYPES)
    for t in tasks:
        if t.kind == "generic":
            assert t.task == S.GENERIC_TASKS[t.task_type] and t.name == ""
        elif t.kind == "topic_only":
            assert t.task.startswith(S.TOPIC_TASKS[t.task_type].split("{topic}")[0]) and t.name == ""
        else:
            assert t.task == S.NAMED_TASKS[t.task_type].format(name=t.name)
        if t.kind == "own_name":
            assert mentions(t.document, t.name) and len(t.name.split()) >= 2
        if t.kind == "respelled":
            assert R.mentions_folded(t.document, t.name) and (t.name.isupper() or t.name.isascii())
        if t.kind == "other_name":
            assert not any(R.mentions_folded(t.document, w) for w in t.name.split())
        if t.kind == "bare_name":
            assert len(t.name.split()) == 1 and mentions(t.document, t.name)
        if t.kind in ("generic", "topic_only"):   # they name nothing: no capitalised name, no title word
            assert R.rule_verdicts(t.task, t.document, R.RULE_GATES) == {"entity_identifiability": 0,
                                                                        "source_relevance": 0}
    assert S.gate_probe_tasks(docs, 32, seed=0) == tasks and S.gate_probe_tasks(docs, 32, seed=1) != tasks


def test_the_known_verdicts_per_gate():
    should = S.GATE_SHOULD
    assert [k for k in should if should[k]["entity_identifiability"]] == ["own_name", "respelled", "other_name"]
    assert [k for k in should if should[k]["source_relevance"]] == ["own_name", "respelled"]
    assert [k for k in should if should[k]["source_relevance"] is None] == ["bare_name", "topic_only"]
    assert S.respell("Zürich Opera") == "Zurich Opera" and S.respell("Aer Arann") == "AER ARANN"


def test_a_bare_name_is_one_that_begins_or_ends_several_names_elsewhere():
    def doc(i, title, text):
        return S.ProbeDocument(str(i), title, f"(Title: {title})\n{text}", S.document_names(title, text))

    docs = [doc(0, "George Kennedy Young", "He served in the war."), doc(1, "George Orwell", "A writer."),
            doc(2, "George Best", "A footballer."), doc(3, "Lake Bled", "A lake.")]
    ends = S.name_ends(docs)
    assert S.bare_name(docs[0], ends) == "George" and S.bare_name(docs[3], ends) is None
    assert S.topic_word(doc(4, "Lake Bled", "The lake has an island. The island holds a church.")) == "island"


# -- the gate probe on scripted gates --------------------------------------------------------------------------


def _last(text: str, tag: str) -> str:
    return re.findall(rf"<{tag}>(.*?)</{tag}>", text, re.S)[-1]


def gate_override(kind):
    """Gates that say yes to everything, no to everything, or read (the rules, applied to the prompt they see)."""
    def override(role, context):
        if role not in ("gate_entity", "gate_source"):
            return None
        if kind == "read":
            task = _last(context, "task_prompt")
            doc = _last(context, "source_document") if role == "gate_source" else ""
            verdict = R.source_relevance(task, doc) if doc else R.entity_identifiability(task)
        else:
            verdict = kind == "yes"
        return f"<think>done</think>\n<score>{int(verdict)}</score>"
    return override


def _judge(tiny_tokenizer, override, **overrides):
    engine = ScriptedEngine(tiny_tokenizer, get_dialect("qwen2.5"), override=override)
    params = load_params(REPO / "params" / "smoke.yaml", {"judge.gate_max_tokens": 64,
                                                          "judge.rubric_max_tokens": 512, **overrides})
    return engine, params, Judge(engine, params.judge, seed=1)


@pytest.mark.parametrize("kind", ["yes", "no", "read"])
def test_the_gate_probe_finds_yes_and_no_men_untrusted_and_the_rules_separate(kind, docs, tiny_tokenizer):
    engine, params, judge = _judge(tiny_tokenizer, gate_override(kind))
    tasks = S.gate_probe_tasks(docs, 32)
    result = S.probe_gates(judge, tasks, params.judge.calibration, model="scripted")
    assert engine.calls == 1 and engine.batch_sizes == [64]        # every gate on every task in one call
    assert judge.stats.stages == {}                                 # the run's statistics are untouched
    for gate in R.RULE_GATES:
        by = result[gate]
        assert set(by) == set(S.GATE_METHODS)
        judged, rules, both = by["judge"], by["rules"], by["rules_then_judge"]
        assert judged.n_items == 32 and judged.usage["prompts"] == 64 and rules.usage == {}
        if kind == "yes":
            assert (judged.sensitivity, judged.specificity, judged.separation) == (1.0, 0.0, 0.0)
        if kind == "no":
            assert (judged.sensitivity, judged.specificity, judged.separation) == (0.0, 1.0, 0.0)
        assert judged.trusted is (kind == "read"), judged.numbers()
        assert rules.trusted and rules.separation >= 0.5, rules.numbers()           # the rule gate separates
        assert both.trusted is (kind != "no"), both.numbers()
        assert rules.model == "rules" and both.model == "rules + scripted"
    assert result["source_relevance"]["rules"].separation == 1.0
    probes = S.StageProbes("judge", result)
    assert [c.trusted for c in probes.untrusted()] == ([] if kind == "read" else [False, False])
    assert S.StageProbes.from_record(json.loads(json.dumps(probes.to_record()))).to_record() == probes.to_record()
    rows = probes.rows()
    assert [(r["stage"], r["decided by"], r["decides trust"]) for r in rows[:3]] == [
        ("gate: entity_identifiability", "judge", True), ("gate: entity_identifiability", "rules", False),
        ("gate: entity_identifiability", "rules_then_judge", False)]


def test_rules_then_judge_asks_the_judge_only_for_tasks_the_rules_pass(tiny_tokenizer):
    tasks = ["Plan a three-step study of George Kennedy Young.", "Summarise the key points of the document.",
             "Summarise the main facts about Harwick Rovers."]
    for gates_by, prompts, verdicts in (
            ("judge", 6, [{"entity_identifiability": 1, "source_relevance": 1}] * 3),
            ("rules", 0, [{"entity_identifiability": 1, "source_relevance": 1},
                          {"entity_identifiability": 0, "source_relevance": 0},
                          {"entity_identifiability": 1, "source_relevance": 0}]),
            ("rules_then_judge", 2, [{"entity_identifiability": 1, "source_relevance": 1},
                                     {"entity_identifiability": 0, "source_relevance": 0},
                                     {"entity_identifiability": 1, "source_relevance": 0}])):
        engine, params, judge = _judge(tiny_tokenizer, gate_override("yes"), **{"judge.gates_by": gates_by})
        outcomes = judge.gates(tasks, [DOC] * 3)
        assert [o.verdicts for o in outcomes] == verdicts, gates_by
        assert judge.stats.stage("gates").prompts == prompts and engine.calls == (1 if prompts else 0)


# -- the rubric-writer probe -----------------------------------------------------------------------------------


def rubric_override(kind):
    """A rubric writer that names three facts of its document the task does not name ("reads"), one that restates
    the task ("restates"), and one whose replies never parse ("garbage")."""
    def override(role, context):
        if role != "rubrics":
            return None
        if kind == "garbage":
            return "These are good rubrics."
        task = context.split("## Task Prompt\n", 1)[1].split("\n\n## ", 1)[0]
        document = context.split("Document 1:\n", 1)[1].split("\n\n## Instructions", 1)[0]
        facts = S.source_facts(document, task) if kind == "reads" else []
        subjects = (facts + ["the subject"] * 3)[:3] if facts else ["the subject of the task"] * 3
        rubrics = "".join(f'<rubric priority="critical">Identifies {s} by name.</rubric>' for s in subjects)
        return f"<think>rubrics</think>\n<rubrics>{rubrics}</rubrics>"
    return override


@pytest.mark.parametrize("kind", ["reads", "restates", "garbage"])
def test_the_rubric_writer_probe(kind, docs, tiny_tokenizer):
    engine, params, judge = _judge(tiny_tokenizer, rubric_override(kind))
    tasks = S.rubric_probe_tasks(docs, 16)
    assert len(tasks) == 16 and {t.kind for t in tasks} == {"own_name"} and len({t.passage_id for t in tasks}) == 16
    cal = S.probe_rubric_writer(judge, tasks, params.judge.calibration, model="scripted")
    assert engine.batch_sizes[0] == 16 and cal.n_items == 32 and cal.role == "rubrics"
    assert {i.kind for i in cal.items} == {"grounded", "foreign"}
    assert cal.trusted is (kind == "reads"), cal.numbers()
    if kind == "reads":
        assert (cal.sensitivity, cal.specificity) == (1.0, 1.0)
    if kind == "restates":
        assert cal.sensitivity == 0.0 and cal.separation == 0.0
    if kind == "garbage":
        assert cal.invalid_rate == 1.0 and cal.usage["retried"] == 16


def test_a_rubric_naming_another_documents_fact_is_foreign(docs):
    tasks = S.rubric_probe_tasks(docs, 2)
    foreign = [f for f in S.document_facts(tasks[1].document) if not mentions(tasks[0].document, f)]
    assert foreign and S.names_a_fact(f"Identifies {foreign[0]} by name.", foreign)
    assert not S.names_a_fact("Identifies the subject by name.", S.source_facts(tasks[0].document, tasks[0].task))


# -- alarms and the refusal ------------------------------------------------------------------------------------


def test_untrusted_stages_raise_their_alarms_and_the_refusal(docs, tiny_tokenizer):
    engine, params, judge = _judge(tiny_tokenizer, lambda role, context: (
        gate_override("yes")(role, context) or rubric_override("restates")(role, context)))
    probes = S.StageProbes("judge", S.probe_gates(judge, S.gate_probe_tasks(docs, 12), params.judge.calibration,
                                                  model="m"),
                           S.probe_rubric_writer(judge, S.rubric_probe_tasks(docs, 4), params.judge.calibration,
                                                 model="m"))
    alarms = health.check_stage_calibration(probes.to_record())
    assert [(a["alarm"], a["role"]) for a in alarms] == [("untrusted_gate", "entity_identifiability"),
                                                        ("untrusted_gate", "source_relevance"),
                                                        ("untrusted_rubric_writer", "rubrics")]
    assert "separation 0.00 < 0.50" in alarms[0]["message"] and "judge.gates_by" in alarms[0]["message"]
    assert len({health.alarm_key(a) for a in alarms}) == 3                   # each recorded once, none lost
    cfg = params.judge.calibration.model_copy(update={"accept_untrusted": False})
    line = S.refusal(probes.untrusted(), cfg)
    assert "entity identifiability gate (judge) (m): separation 0.00 < 0.50" in line
    assert "--accept-untrusted-judge" in line and "judge.calibration.accept_untrusted" in line
    assert S.refusal(probes.untrusted(), cfg.model_copy(update={"accept_untrusted": True})) is None
    assert S.refusal([], cfg) is None
    ruled = S.StageProbes("rules_then_judge", probes.gates, None)
    assert ruled.untrusted() == [] and health.check_stage_calibration(ruled.to_record()) == []
    for name in ("untrusted_gate", "untrusted_rubric_writer"):
        assert f"| {name}" in health.__doc__


def test_the_held_out_build_stores_the_stage_probes_beside_the_set(wiki_sample, tmp_path, tiny_tokenizer):
    """The learning check's held-out build probes the Judge's gates and rubric writer once, beside its grader."""
    from scope_lib.evaluation.held_out import (
        STAGE_PROBES,
        CheckComponents,
        held_out_set,
        held_out_stage_probes,
    )
    from scope_lib.retrieval.index import build_or_open_index

    params = scripted_run_params(wiki_sample.parent, tmp_path / "runs", **{
        "learning_check.held_out_documents": 16, "learning_check.tasks": 2, "learning_check.samples": 1,
        "learning_check.batch_size": 8, "judge.calibration.items": 8, "judge.calibration.gate_items": 12,
        "judge.calibration.rubric_items": 4})
    engine = ScriptedEngine(tiny_tokenizer, get_dialect("qwen2.5"), override=gate_override("read"))
    c = CheckComponents(engine, Judge(engine, params.judge, seed=params.selfplay.seed),
                        build_or_open_index(params, progress=False), get_dialect("qwen2.5"))
    held = held_out_set(params, c, model_id="scripted", root=tmp_path / "heldout", progress=False)
    stages = held_out_stage_probes(held)
    assert (held.path / STAGE_PROBES).is_file() and stages is not None
    assert [c.n_items for c in stages.configured()] == [12, 12, 8] and all(c.trusted for c in stages.configured()[:2])
    calls = engine.calls
    assert held_out_stage_probes(held_out_set(params, c, model_id="scripted", root=tmp_path / "heldout",
                                              progress=False)).to_record() == stages.to_record()
    assert engine.calls == calls                                    # probed once per set


def test_scope_train_stops_with_exit_4_unless_it_accepts_an_untrusted_stage(tmp_path, wiki_sample, tiny_model_dir,
                                                                         monkeypatch, capsys):
    """`scope train` on yes-man gates: exit 4 before training, one error line naming the stage and both ways to
    accept; it proceeds with --accept-untrusted-judge or the params key. The run's models are the scripted Judge
    and the session's tiny policy (cli._torch_params and loop.run are narrowed to open the run with them)."""
    from training_helpers import fast_params, load_policy

    from scope_lib import cli
    from scope_lib.retrieval.index import build_or_open_index
    from scope_lib.selfplay import loop

    params = fast_params(tmp_path / "runs", wiki_sample.parent, **{
        "run.name": "yesman", "judge.calibration.enabled": True, "judge.calibration.items": 8,
        "judge.calibration.gate_items": 12,
        "judge.calibration.rubric_items": 4, "judge.calibration.accept_untrusted": False})
    spec = tmp_path / "yesman.yaml"
    spec.write_text(params.to_yaml())
    retriever = build_or_open_index(params, progress=False)
    policy = load_policy(params, tiny_model_dir)
    engine = ScriptedEngine(policy.tokenizer, get_dialect("qwen2.5"), override=gate_override("yes"))
    opened = []

    def open_only(p):   # loop.run without its iterations: the refusal comes before any of them
        opened.append(loop.open_run(p, engine=engine, judge=Judge(engine, p.judge, seed=p.selfplay.seed),
                                    retriever=retriever, policy=policy))
        return opened[-1]

    monkeypatch.setattr(cli, "_torch_params", lambda args, **kw: cli._params(args))
    monkeypatch.setattr(loop, "run", open_only)
    assert cli.main(["train", str(spec)]) == cli.UNTRUSTED_JUDGE_EXIT == 4 and opened == []
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "entity identifiability gate (judge)" in errors[0]
    assert "--accept-untrusted-judge" in errors[0]
    run_dir = tmp_path / "runs" / "yesman"
    stored = S.stored_stage_probes(run_dir)
    assert stored is not None and not stored.gates["source_relevance"]["judge"].trusted
    assert {a["alarm"] for a in health.read_alarms(run_dir)} >= {"untrusted_gate"}
    assert not any(run_dir.glob("iter_*"))                                   # nothing trained
    assert cli.main(["train", str(spec), "--accept-untrusted-judge"]) == 0 and len(opened) == 1
    assert cli.main(["train", str(spec), "-o", "judge.calibration.accept_untrusted=true"]) == 0 and len(opened) == 2
    assert "iteration(s) done" in capsys.readouterr().out


def test_the_index_page_states_each_judge_stage_and_the_params_hash_keeps_old_runs(tmp_path, docs, tiny_tokenizer):
    from scope_lib.reports.index_page import write_index
    from scope_lib.selfplay.loop import science_yaml

    engine, params, judge = _judge(tiny_tokenizer, gate_override("yes"))
    probes = S.StageProbes("judge", S.probe_gates(judge, S.gate_probe_tasks(docs, 12), params.judge.calibration,
                                                  model="m"))
    (tmp_path / "run" / "reports").mkdir(parents=True)
    manifest = {"params_hash": "abc", S.MANIFEST_KEY: probes.to_record()}
    (tmp_path / "run" / "manifest.json").write_text(json.dumps(manifest))
    text = write_index(tmp_path / "run").read_text()
    assert "entity identifiability gate (judge): UNTRUSTED, separation 0.00" in text
    assert S.stored_stage_probes(tmp_path / "run").to_record() == probes.to_record()
    assert S.stored_stage_probes(tmp_path / "none") is None
    assert "gates_by" not in science_yaml(params)                    # the paper's gates: runs started before resume
    ruled = params.model_copy(deep=True)
    ruled.judge.gates_by = "rules_then_judge"
    assert "gates_by: rules_then_judge" in science_yaml(ruled)
    ruled.judge.calibration.accept_untrusted = True                  # the probes change no verdict: not hashed
    assert science_yaml(ruled) == science_yaml(ruled.model_copy(update={"judge": ruled.judge.model_copy(
        update={"calibration": params.judge.calibration})}))
