"""Judge calibration (scope_lib.selfplay.grader_probe, scope_lib.evaluation.judge_probes): each probe fails a judge that
says yes to everything, one that says no to everything and one that replies garbage, and passes a judge that reads;
`scope eval` refuses an untrusted judge's numbers unless told to accept them, and writes them marked untrusted; a
self-play run records its grader's probe in the manifest and raises the untrusted_judge alarm; the short-form
judge's agreement with exact match, both ways."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from scripted_engine import ScriptedEngine
from scripted_judge import ScriptedJudgeBackend, fixed_reply, scripted_judge_server

from scope_lib.config import CalibrationConfig, load_params
from scope_lib.evaluation import judge_probes as C
from scope_lib.evaluation.benchmarks import BENCHMARKS
from scope_lib.evaluation.judge import BenchmarkJudge, JudgeSettings
from scope_lib.protocol.dialects import get_dialect
from scope_lib.protocol.facts import fact_pairs, mentions
from scope_lib.retrieval.corpus import read_corpus
from scope_lib.selfplay import health
from scope_lib.selfplay.grader_probe import (
    FACT_RUBRIC,
    ProbeItem,
    calibrate,
    grader_items,
    probe_grader,
)
from scope_lib.selfplay.judge import Judge

REPO = Path(__file__).resolve().parents[1]
JUDGES = {"reads": None, "always yes": fixed_reply(True), "always no": fixed_reply(False),
          "garbage": fixed_reply(None)}


@pytest.fixture(scope="module")
def data(shared_data):
    """Real benchmark items and corpus passages, as a run has them."""
    nq = BENCHMARKS["nq"].load([shared_data / "qa" / "nq.jsonl"], "nq").items[:30]
    openended = shared_data / "openended"
    arena = BENCHMARKS["arena_hard_cw"].load([openended / "arena_hard_v2_creative.jsonl",
                                              openended / "arena_hard_v2_o3mini_answers.jsonl"], "arena_hard_cw").items[:12]
    passages = read_corpus(shared_data / "wiki18_sample.jsonl", max_passages=400).passages
    return {"nq": nq, "arena_hard_cw": arena}, passages


def test_the_numbers_of_a_probe():
    cfg = CalibrationConfig(min_separation=0.5, max_invalid_rate=0.2)
    items = [ProbeItem("a", "gold", True, yes=True), ProbeItem("b", "gold", True, yes=True),
             ProbeItem("c", "gold", True, yes=False), ProbeItem("d", "other", False, yes=False),
             ProbeItem("e", "other", False, yes=True), ProbeItem("f", "other", False, invalid=True)]
    cal = calibrate("j", "short_form", "m", "p", items, cfg)
    assert cal.sensitivity == pytest.approx(2 / 3) and cal.specificity == pytest.approx(0.5)
    assert cal.separation == pytest.approx(2 / 3 - 0.5) and cal.invalid_rate == pytest.approx(1 / 6)
    assert not cal.trusted and cal.reasons == ["separation 0.17 < 0.50"]
    games = [ProbeItem("q/identity/game1", "identity", None, yes=True, a_score=1.0),
             ProbeItem("q/identity/game2", "identity", None, yes=False, a_score=0.0),
             ProbeItem("q/truncated/game1", "full_first", True, yes=True, a_score=1.0),
             ProbeItem("q/truncated/game2", "full_second", False, yes=True, a_score=1.0)]
    pairwise = calibrate("j", "pairwise", "m", "p", games, cfg)
    assert pairwise.position_bias == pytest.approx(0.75 - 0.5) and pairwise.identity_consistency == 1.0
    assert pairwise.separation == 0.0 and not pairwise.trusted


def test_fact_pairs_state_swap_and_drop_one_fact(data):
    _, passages = data
    pairs = fact_pairs(passages, 6, seed=3)
    assert len(pairs) == 6 and len({p.passage_id for p in pairs}) == 6
    for p in pairs:
        assert mentions(p.stated, p.fact) and not mentions(p.context, p.fact) and not mentions(p.swapped, p.fact)
        assert mentions(p.swapped, p.other) and p.swapped != p.stated
    assert fact_pairs(passages, 6, seed=3) == pairs and fact_pairs(passages, 6, seed=4) != pairs


@pytest.mark.parametrize("judge", list(JUDGES))
def test_benchmark_probes_pass_a_reading_judge_and_fail_the_others(judge, data, tmp_path):
    items, passages = data
    params = load_params(REPO / "params" / "smoke.yaml", {"run.runs_dir": str(tmp_path)})
    settings = {"nq": JudgeSettings("small"), "healthbench": JudgeSettings("big"),
                "arena_hard_cw": JudgeSettings("big"), "researchrubrics": JudgeSettings("big")}
    uses = C.judge_uses(params, settings)
    assert set(uses) == {"short_form@small", "criterion@big", "pairwise@big", "researchrubrics@big"}
    backend = ScriptedJudgeBackend() if JUDGES[judge] is None else ScriptedJudgeBackend(JUDGES[judge])
    results = C.calibrate_judges(params, BenchmarkJudge(backend), uses, items, passages)
    for jid, cal in results.items():
        assert cal.n_items == params.evaluation.calibration.items, jid
        kinds = {i.kind for i in cal.items}
        assert {True, False} <= {i.should for i in cal.items}, jid
        if judge == "reads":
            assert cal.trusted and cal.separation == 1.0 and cal.invalid_rate == 0.0, (jid, cal.numbers())
        else:
            assert not cal.trusted, (jid, cal.numbers())
        if judge == "always yes":
            assert (cal.sensitivity, cal.specificity, cal.separation) == (1.0, 0.0, 0.0)
        if judge == "always no":
            assert (cal.sensitivity, cal.specificity, cal.separation) == (0.0, 1.0, 0.0)
        if judge == "garbage":
            assert cal.invalid_rate == 1.0 and cal.separation is None and "invalid 1.00 > 0.20" in cal.reasons
        if cal.role == "pairwise":
            assert kinds == {"identity", "full_first", "full_second"}
            assert cal.position_bias == {"reads": 0.0, "always yes": 0.5, "always no": -0.5, "garbage": None}[judge]
    short = results["short_form@small"]
    assert {"gold", "other_gold", "fluent_wrong"} <= {i.kind for i in short.items}
    assert "alias" in {i.kind for i in short.items}          # NQ lists aliases: a paraphrase from the data
    # every probe went through the judge's accounting (and, with a cache, its cache) under its own tag
    assert backend.requests and all(r.tag.startswith("calibration/") for r in backend.requests)


def test_without_a_corpus_the_criterion_grader_cannot_be_trusted(data, tmp_path):
    items, _ = data
    params = load_params(REPO / "params" / "smoke.yaml", {"run.runs_dir": str(tmp_path)})
    uses = C.judge_uses(params, {"healthbench": JudgeSettings("big")})
    [cal] = C.calibrate_judges(params, BenchmarkJudge(ScriptedJudgeBackend()), uses, items, None,
                               "the corpus x.jsonl (retrieval.corpus) is not on this machine").values()
    assert not cal.trusted and cal.reasons[0].startswith("no probe could be built: the corpus x.jsonl")


def test_pairwise_answers_are_clipped_at_a_sentence_and_truncated_to_a_prefix():
    story = "The lighthouse keeper counted ships. " * 80 + "The end."
    full = C.clip(story)
    assert len(full) <= C.PAIRWISE_MAX_CHARS and full.endswith("ships.") and story.startswith(full)
    assert C.clip("A short poem.\nTwo lines.") == "A short poem.\nTwo lines."
    cut = C.truncate(full)
    assert full.startswith(cut) and len(full) / 4 < len(cut) < len(full) / 2 and not cut.endswith(" ")
    chinese = "灯塔看守人数着船只。" * 300
    assert C.clip(chinese).endswith("。") and len(C.clip(chinese)) <= C.PAIRWISE_MAX_CHARS


# -- the self-Judge's per-rubric grader --------------------------------------------------------------------


def grader_override(verdict):
    def override(role, context):
        if role != "grader":
            return None
        return "I would rather not say." if verdict is None else f"<think>skip</think>\n<score>{verdict}</score>"
    return override


def name_list_grader(role, context):
    """A grader a list of names satisfies: yes when the response lists three or more capitalised names, else it
    reads as the scripted one does (what a grader warm-started on "the answer names its name" may become)."""
    if role != "grader":
        return None
    response = context.split("<response>", 1)[-1].split("</response>", 1)[0]
    if re.search(r"[A-Z][\w()-]*(?: [\w()-]+)*?(?:(?:, | and )[A-Z][\w()-]*(?: [A-Z][\w()-]*)*){2,}", response):
        return "<think>It names many things.</think>\n<score>1</score>"
    return None


@pytest.mark.parametrize("grader", ["reads", "always yes", "always no", "garbage", "likes name lists"])
def test_the_self_judge_grader_probe(grader, data, tiny_tokenizer):
    _, passages = data
    override = {"reads": None, "always yes": grader_override(1), "always no": grader_override(0),
                "garbage": grader_override(None), "likes name lists": name_list_grader}[grader]
    engine = ScriptedEngine(tiny_tokenizer, get_dialect("qwen2.5"), override=override)
    params = load_params(REPO / "params" / "smoke.yaml", {"judge.grading_max_tokens": 64})
    judge = Judge(engine, params.judge, seed=1)
    cal = probe_grader(judge, passages, params.judge.calibration, model="scripted", seed=1)
    assert cal.n_items == 60 and engine.calls >= 1 and engine.batch_sizes[0] == 60   # one batched call
    assert judge.stats.stages == {}                                   # the run's Judge statistics are untouched
    assert cal.usage["prompts"] == 60 and cal.prompt.startswith("grader@")
    rubric = FACT_RUBRIC.format(fact="X")
    assert rubric == "Identifies X by name."
    assert cal.trusted is (grader == "reads"), cal.numbers()
    if grader == "garbage":
        assert cal.invalid_rate == 1.0 and cal.usage["retried"] == 60
    if grader == "reads":   # every negative scores 0, the name lists among them
        assert cal.specificity == 1.0 and cal.name_list_separation == 1.0
    if grader == "likes name lists":   # separation alone would trust it: the name lists do not
        assert cal.separation >= cal.min_separation and cal.name_list_separation < cal.min_separation
        assert cal.reasons == [f"name-list separation {cal.name_list_separation:.2f} < 0.50"]


def test_the_grader_probe_holds_name_lists_and_enough_negatives(data):
    """Issue 47: among the self-Judge grader probe's negatives, lists of the document's other names without the
    rubric's fact (what a Solver that dumps names writes), and at least 35 negatives: a specificity of 1.00 then
    means at least 0.90 at 95% (the Clopper-Pearson bound of n of n, 0.025 ** (1 / n))."""
    _, passages = data
    cfg = load_params(REPO / "params" / "smoke.yaml").judge.calibration
    items = grader_items(passages, cfg.items, seed=1)
    negatives = [i for i, _, _ in items if i.should is False]
    assert len(items) == cfg.items and len(negatives) >= 35 and 0.025 ** (1 / len(negatives)) >= 0.9
    kinds = [i.kind for i, _, _ in items]
    assert kinds[:5] == ["stated", "reordered", "removed", "swapped", "name_list"] and kinds.count("name_list") == 12
    for item, pair, response in items:
        if item.kind == "name_list":
            assert not mentions(response, pair.fact) and response.startswith(f"{pair.subject} is linked to ")
            listed = response.removeprefix(f"{pair.subject} is linked to ").rstrip(".").replace(" and ", ", ")
            assert 3 <= len(listed.split(", ")) <= 5


# -- scope eval gates, self-play alarms -------------------------------------------------------------------


def _eval_spec(tmp_path, shared_data, url, name):
    spec = tmp_path / f"{name}.yaml"
    spec.write_text(
        f"inherit: {REPO / 'params' / 'smoke.yaml'}\n"
        f"run: {{name: {name}, runs_dir: {tmp_path / 'runs'}, data_dir: {shared_data}}}\n"
        "model: {warm_start: {enabled: false}}\n"
        "retrieval: {embedder: hashing}\n"
        "evaluation:\n  benchmarks: [nq]\n  max_examples: 2\n  max_searches: 1\n  max_answer_tokens: 8\n"
        "  bootstrap_samples: 10\n  judge_backend: openai\n"
        f"  judge_base_url: {url}\n  judge_token_field: max_tokens\n"
        "  short_form_judge: {model: yes-man}\n  calibration: {items: 12}\n")
    return spec


def test_scope_eval_refuses_an_untrusted_judge_unless_accepted(shared_data, tmp_path, capsys):
    from scope_lib.cli import main

    with scripted_judge_server(fixed_reply(True)) as (url, state):
        spec = _eval_spec(tmp_path, shared_data, url, "yesman")
        assert main(["eval", str(spec)]) == 4
        err = capsys.readouterr().err
        lines = [line for line in err.splitlines() if line.startswith("error:")]
        assert len(lines) == 1
        assert "untrusted judge short_form@yes-man (nq)" in lines[0] and "separation 0.00 < 0.50" in lines[0]
        assert "sensitivity 1.00, specificity 0.00" in lines[0]
        assert "--accept-untrusted-judge" in lines[0] and "evaluation.accept_untrusted_judge" in lines[0]
        folder = tmp_path / "runs" / "yesman" / "eval"
        summary = json.loads((folder / "base" / "nq" / "summary.json").read_text())
        judged = summary["scorers"]["scope_paper"]
        assert judged["value"] is not None and judged["trusted"] is False        # written, marked untrusted
        assert judged["judge_id"] == "short_form@yes-man" and judged["calibration"]["separation"] == 0.0
        assert summary["scorers"]["official"]["trusted"] is None                  # exact match needs no judge
        assert json.loads((folder / "base" / "summary.json").read_text())["benchmarks"]["nq"]["scope_paper"][
            "trusted"] is False
        recorded = json.loads((folder / "calibration.json").read_text())["judges"]["short_form@yes-man"]
        assert recorded["benchmarks"] == ["nq"] and len(recorded["items"]) == 12 and not recorded["trusted"]
        assert summary["judge_agreement"]["judge_yes_rate"] == 1.0    # it accepted every answer
        sent = len(state["bodies"])
        assert main(["eval", str(spec), "--accept-untrusted-judge"]) == 0
        assert len(state["bodies"]) == sent                                   # probes and scores: from the cache
        assert "warning: untrusted judge short_form@yes-man" in capsys.readouterr().err
        assert json.loads((folder / "base" / "nq" / "summary.json").read_text())["scorers"]["scope_paper"][
            "trusted"] is False
        assert main(["eval", str(spec), "-o", "evaluation.accept_untrusted_judge=true"]) == 0
    with scripted_judge_server() as (url, state):
        assert main(["eval", str(_eval_spec(tmp_path, shared_data, url, "reads"))]) == 0
        summary = json.loads((tmp_path / "runs" / "reads" / "eval" / "base" / "nq" / "summary.json").read_text())
        assert summary["scorers"]["scope_paper"]["trusted"] is True


def test_a_self_play_run_records_the_probe_and_alarms_on_an_untrusted_judge(tmp_path, wiki_sample, tiny_model_dir):
    from training_helpers import fast_params, load_policy

    from scope_lib.retrieval.index import build_or_open_index
    from scope_lib.selfplay.loop import open_run

    params = fast_params(tmp_path / "runs", wiki_sample.parent, **{"judge.calibration.enabled": True,
                                                                   "judge.calibration.items": 8})
    retriever = build_or_open_index(params, progress=False)
    policy = load_policy(params, tiny_model_dir)
    for name, override in (("reads", None), ("yes", grader_override(1))):
        p = params.model_copy(update={"run": params.run.model_copy(update={"name": name})})
        engine = ScriptedEngine(policy.tokenizer, get_dialect("qwen2.5"), override=override)
        r = open_run(p, engine=engine, judge=Judge(engine, p.judge, seed=p.selfplay.seed), retriever=retriever,
                     policy=policy)
        manifest = json.loads((p.run_dir / "manifest.json").read_text())
        probe = manifest["judge_calibration"]
        assert probe["n_items"] == 8 and probe["role"] == "grader" and len(probe["items"]) == 8
        # the grader's alarm (the scripted gates say yes to everything: their own alarms are tests/test_stage_probes.py's)
        alarms = [a["alarm"] for a in health.read_alarms(p.run_dir) if a["alarm"] == "untrusted_judge"]
        if name == "reads":
            assert probe["trusted"] and alarms == [] and [a for a in r.alarms if a["alarm"] == "untrusted_judge"] == []
        else:
            assert not probe["trusted"] and probe["sensitivity"] == 1.0 and probe["specificity"] == 0.0
            assert alarms == ["untrusted_judge"] and r.alarms[0]["alarm"] == "untrusted_judge"
            assert "separation 0.00 < 0.50" in r.alarms[0]["message"]
            calls = engine.calls
            open_run(p, engine=engine, judge=Judge(engine, p.judge, seed=p.selfplay.seed), retriever=retriever,
                     policy=policy)                                       # a resumed run: the alarm once ...
            assert [a["alarm"] for a in health.read_alarms(p.run_dir)].count("untrusted_judge") == 1
            assert engine.calls == calls                                  # ... and its probes read back, not asked
            more = p.model_copy(deep=True)
            more.judge.calibration.items = 10                             # another probe: asked again
            open_run(more, engine=engine, judge=Judge(engine, more.judge, seed=more.selfplay.seed),
                     retriever=retriever, policy=policy)
            assert engine.calls > calls
            assert json.loads((p.run_dir / "manifest.json").read_text())["judge_calibration"]["n_items"] == 10
    off = params.model_copy(deep=True)
    off.run.name, off.judge.calibration.enabled = "off", False
    engine = ScriptedEngine(policy.tokenizer, get_dialect("qwen2.5"))
    open_run(off, engine=engine, judge=Judge(engine, off.judge), retriever=retriever, policy=policy)
    assert json.loads((off.run_dir / "manifest.json").read_text())["judge_calibration"] is None
    assert engine.calls == 0


def test_health_table_documents_the_alarm():
    assert "| untrusted_judge" in health.__doc__
    assert health.check_calibration({"trusted": True}) == []


# -- agreement with exact match ----------------------------------------------------------------------------


def _record(verdict, em, f1, invalid=False):
    return {"scores": {"scope_paper": {"parts": {"verdict": verdict}, "units": [{"invalid": invalid}]},
                       "official": {"metrics": {"em": em, "f1": f1, "acc": em}}}}


def test_agreement_with_exact_match_both_ways():
    records = [_record(1, 1.0, 1.0), _record(1, 0.0, 0.0), _record(1, 0.0, 0.6), _record(0, 1.0, 1.0),
               _record(0, 0.0, 0.0), _record(None, 0.0, 0.0, invalid=True)]
    a = C.em_agreement(records)
    assert a["n"] == 5 and a["judge_yes_rate"] == pytest.approx(3 / 5) and a["em_rate"] == pytest.approx(2 / 5)
    assert a["agreement_em"] == pytest.approx(2 / 5)          # (1, EM 1) and (0, EM 0)
    assert (a["judge_yes_em_0"], a["judge_no_em_1"]) == (2, 1)
    assert a["agreement_f1"] == pytest.approx(3 / 5)          # F1 0.6 counts as correct at 0.5
    assert (a["judge_yes_f1_0"], a["judge_no_f1_1"]) == (1, 1)
    yes_man = C.em_agreement([_record(1, 0.0, 0.0)] * 9 + [_record(1, 1.0, 1.0)])
    assert yes_man["agreement_em"] == pytest.approx(0.1) and yes_man["judge_yes_em_0"] == 9
    assert C.em_agreement([{"scores": {"official": {"metrics": {"em": 1.0}}}}]) is None
