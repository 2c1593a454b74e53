"""The Challenger's learning check (scope_lib/evaluation/challenger_check.py): Challenger checkpoints write one task per
held-out document, the frozen Judge gates them and writes rubrics, a fixed Solver answers K times; the measures, the
paired comparison against M0's Challenger and the controls, the verdict, the stored tasks and answers, resume, and
cross-checkpoint play. A scripted engine plays every model over the real Wikipedia sample with a planted Challenger
signal: a task that ends "Answer in one line." is one the Solver answers naming only its first entity (ḡ = 1/3, in
the window), any other task one it answers naming everything (ḡ = 1, too easy). M0's Challenger writes a quarter of
its tasks the first way (seeded per row), the 'trained' adapter all of them, 'drift' a third, 'equal' all (a control
that gained as much), 'stray' off-document tasks in one line. The gates read (the rule gates' rules); the rubric
writer answers its probe from the source's facts and the check's tasks from the task's entities."""

from __future__ import annotations

import json
import random
import typing

import pytest
from scripted_engine import ScriptedEngine, scripted_run_params
from test_learning_check import task_names
from test_stage_probes import gate_override, rubric_override

from scope_lib.config import GRPOConfig
from scope_lib.evaluation.challenger_check import (
    CHALLENGER_SHUFFLED,
    challenger_documents,
    challenger_folder,
    challenger_tasks,
    challenger_verdict,
    cross_play,
    cross_play_figure,
    run_challenger_check,
)
from scope_lib.evaluation.evaluate import Checkpoint, Policy
from scope_lib.evaluation.held_out import CheckComponents, held_out_location
from scope_lib.evaluation.learning_check import Comparison
from scope_lib.protocol.dialects import get_dialect
from scope_lib.selfplay.judge import Judge

DIALECT = get_dialect("qwen2.5")
CHECK = {"learning_check.held_out_documents": 40, "learning_check.tasks": 12, "learning_check.samples": 4,
         "learning_check.batch_size": 6, "learning_check.eval_batch_tasks": 12,
         "learning_check.bootstrap_samples": 1000}
#: The share of its tasks each Challenger writes in the window's style.
WINDOW_SHARE = {None: 0.25, "trained": 1.0, "drift": 1 / 3, "equal": 1.0}
ONE_LINE, TWO_PARAGRAPHS = "Answer in one line.", "Answer in two paragraphs."


class ChallengerPlanted(ScriptedEngine):
    """The scripted engine with the planted Challenger signal (module docstring); `gates` 'read' or 'yes'."""

    def __init__(self, *args, gates: str = "read", **kwargs):
        reading, writing = gate_override(gates), rubric_override("reads")

        def override(role, context):
            if role == "rubrics" and "Explain how" not in context.split("## Task Prompt", 1)[-1][:200]:
                return writing(role, context)             # the rubric writer's probe: grounded in the source
            return reading(role, context)
        super().__init__(*args, override=override, **kwargs)

    def generate(self, prompt_token_ids, sampling, adapter=None):
        out = super().generate(prompt_token_ids, sampling, adapter)
        for i, ids in enumerate(prompt_token_ids):
            context = self.tokenizer.decode(ids)
            role, text = self.role(context), out[i].text
            if role == "challenger" and TWO_PARAGRAPHS in text:
                if adapter == "stray":
                    text = ("<think>Anything will do.</think>\n<task>Explain how Zanzibar Quuxley and Mount Frobnitz "
                            f"are connected, citing what each search revealed. {ONE_LINE}</task>")
                else:   # each entity once (the scripted Challenger may search one twice): 3 rubrics, 1 per name
                    head, names = text.split("Explain how ", 1)[0], task_names(f"Question: {text}")
                    style = ONE_LINE if random.Random(f"{sampling.seed}/{i}").random() < \
                        WINDOW_SHARE.get(adapter, 0.25) else TWO_PARAGRAPHS
                    text = (f"{head}Explain how {' and '.join(dict.fromkeys(names))} are connected, citing what each "
                            f"search revealed. {style}</task>")
                out[i] = self._complete(text, sampling)
            elif role == "solver" and "<answer>" in text:
                names = task_names(context)
                named = names[:1] if ONE_LINE in context and adapter != "strong" else names + ["the source document"]
                out[i] = self._complete(f"<think>I know.</think>\n<answer>It is about {', '.join(named)}.</answer>",
                                        sampling)
        return out


class Crashing(ChallengerPlanted):
    """Dies at its `crash_at`-th generate call (a kill in the middle of writing the Challenger's tasks)."""

    def __init__(self, *args, crash_at: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.crash_at = crash_at

    def generate(self, prompt_token_ids, sampling, adapter=None):
        if self.calls + 1 == self.crash_at:
            raise KeyboardInterrupt("killed")
        return super().generate(prompt_token_ids, sampling, adapter)


class Refusing(ChallengerPlanted):
    def generate(self, prompt_token_ids, sampling, adapter=None):
        pytest.fail("everything was stored: no model may generate")


@pytest.fixture(scope="module")
def params(wiki_sample, tmp_path_factory):
    return scripted_run_params(wiki_sample.parent, tmp_path_factory.mktemp("runs"), **CHECK)


def components(params, retriever, passages, tokenizer, engine_class=ChallengerPlanted, **kwargs):
    engine = engine_class(tokenizer, DIALECT, **kwargs)
    return CheckComponents(engine, Judge(engine, params.judge, seed=params.selfplay.seed), retriever, DIALECT,
                           passages)


def checkpoint(name: str) -> Checkpoint:
    return Checkpoint("base", "base", None, "base") if name == "base" else Checkpoint(name, "adapter", None, name)


def lent(c, root, names=("base", "trained", "drift", "equal", "stray", "strong")):
    return {"components": c, "model_id": "scripted", "root": root, "progress": False,
            "policies": {n: Policy(checkpoint(n), c.engine, None if n == "base" else n) for n in names}}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("heldout")


@pytest.fixture(scope="module")
def planted(params, retriever, passages, tiny_tokenizer, root):
    c = components(params, retriever, passages, tiny_tokenizer)
    check = run_challenger_check(params, checkpoint("trained"), control=checkpoint("drift"), write=False,
                                 **lent(c, root))
    return check, c


def test_a_challenger_nearer_the_window_is_found_and_learned_only_above_its_control(planted, params, retriever,
                                                                                   passages, tiny_tokenizer, root):
    check, c = planted
    before, after = check.evaluations["before"], check.evaluations["after"]
    assert len(after.documents) == 12 == len(before.documents)
    assert [d.document_id for d in after.documents] == [p.id for p in challenger_documents(params, passages)]
    assert after.mean("in_window") == 1.0 and before.mean("in_window") < 0.6          # the planted difference
    assert after.mean("gate_pass") == before.mean("gate_pass") == 1.0                 # on-document: the gates pass
    trained = check.comparisons["trained"]
    assert trained["in_window"].ci95[0] > 0 and trained["in_window"].n_tasks == 12
    assert trained["distance"].ci95[1] < 0                                             # |ḡ − τ| falls
    assert trained["reward"].ci95[0] > 0 and after.mean("reward") > before.mean("reward")   # R_C (eq. 4) rises
    assert after.mean("mean_score") == pytest.approx(1 / 3) and after.mean("distance") == pytest.approx(1 / 6)
    assert trained["names_source"].gain == 0 and after.mean("names_source") == 1.0
    assert check.comparisons["over_control"]["in_window"].ci95[0] > 0
    assert check.stages is not None and not check.stages.untrusted() and check.grader.trusted
    assert check.verdict.outcome == "learned", check.verdict.reason
    # the same trained Challenger beside a control that gained as much is not learned; without a control: not shown
    equal = run_challenger_check(params, checkpoint("trained"), control=checkpoint("equal"), write=False,
                                 **lent(c, root))
    assert equal.verdict.outcome == "not learned" and "cannot be told from its shuffled-reward control" in \
        equal.verdict.reason and equal.comparisons["over_control"]["in_window"].gain == 0
    alone = run_challenger_check(params, checkpoint("trained"), write=False, **lent(c, root))
    assert alone.verdict.outcome == "not shown" and "shuffled_challenger" in alone.verdict.reason
    # the frozen Challenger, when given, must be beaten too
    frozen = run_challenger_check(params, checkpoint("trained"), control=checkpoint("drift"),
                                  frozen=checkpoint("equal"), write=False, **lent(c, root))
    assert frozen.verdict.outcome == "not learned" and "no better than the frozen Challenger" in frozen.verdict.reason
    distance = run_challenger_check(params, checkpoint("trained"), control=checkpoint("drift"), metric="distance",
                                    write=False, **lent(c, root))
    assert distance.verdict.learned and distance.verdict.ci95[1] < 0


def test_identical_challengers_give_zero(planted, params, root):
    """'twin' is another checkpoint (its own name, folder and stored tasks) with M0's weights: the same seeds for
    every checkpoint make it write M0's tasks, and every change is exactly 0."""
    _, c = planted
    check = run_challenger_check(params, checkpoint("twin"), control=checkpoint("base"), write=False,
                                 **lent(c, root, ("base", "twin")))
    assert check.evaluations["after"].challenger == "twin" and c.engine.calls > 0
    for name, by in check.comparisons.items():
        for measure, comparison in by.items():
            if comparison is not None:
                assert comparison.gain == 0 and comparison.ci95 == (0.0, 0.0), (name, measure)
    assert check.verdict.outcome == "not learned"


def test_the_stored_tasks_and_answers_let_a_second_compare_load_no_model(planted, params, retriever, passages,
                                                                         tiny_tokenizer, root):
    first, _ = planted
    c = components(params, retriever, passages, tiny_tokenizer, Refusing)
    again = run_challenger_check(params, checkpoint("trained"), control=checkpoint("drift"), write=False,
                                 **lent(c, root))
    assert c.engine.calls == 0 and again.verdict.reason == first.verdict.reason
    assert again.to_record() == first.to_record()


def test_a_killed_write_resumes_without_losing_or_duplicating_tasks(planted, params, retriever, passages,
                                                                    tiny_tokenizer, root, tmp_path):
    check, c = planted
    folder = challenger_folder(held_out_location(params, "scripted", root)[0], checkpoint("trained"), "scripted",
                               params.learning_check.seed)
    whole = [d.task for d in check.evaluations["after"].documents]
    crashing = components(params, retriever, passages, tiny_tokenizer, Crashing, crash_at=9)
    target = tmp_path / "trained"
    policy = Policy(checkpoint("trained"), crashing.engine, "trained")
    with pytest.raises(KeyboardInterrupt):
        challenger_tasks(params, target, "trained", lambda: policy, lambda: crashing, seed=params.learning_check.seed,
                         progress=False)
    assert not (target / "DONE").exists() and len((target / "chunks.jsonl").read_text().splitlines()) == 1
    with open(target / "tasks.jsonl", "a") as f:   # the kill landed while batch 1's records were being written
        f.write('{"id": "c0001-0/g0", "chunk": 1, "task": "half a batch"}\n{"id": "c0001-1/g0", "ch')
    resumed = components(params, retriever, passages, tiny_tokenizer)
    policy = Policy(checkpoint("trained"), resumed.engine, "trained")
    tasks = challenger_tasks(params, target, "trained", lambda: policy, lambda: resumed,
                             seed=params.learning_check.seed, progress=False)
    ids = [e.challenger_id for e in tasks.evaluations]
    assert len(ids) == len(set(ids)) == 12 and [e.task for e in tasks.evaluations] == whole
    assert (target / "DONE").is_file() and (folder / "DONE").is_file()
    fresh = components(params, retriever, passages, tiny_tokenizer)
    policy = Policy(checkpoint("trained"), fresh.engine, "trained")
    challenger_tasks(params, tmp_path / "fresh", "trained", lambda: policy, lambda: fresh,
                     seed=params.learning_check.seed, progress=False)
    assert 0 < resumed.engine.calls < fresh.engine.calls                  # the batch written before the kill stays


@pytest.mark.parametrize("gates", ["read", "yes"])
def test_a_challenger_that_writes_off_document_tasks_is_caught(gates, params, retriever, passages, tiny_tokenizer,
                                                               tmp_path):
    """Tasks whose names are not in their source document: gates that read fail them (the gate pass rate and the
    window share fall); gates that say yes to everything let them into the window, but the judge-free measure
    sees the tasks leave their source, and the gates' probe is untrusted: not learned either way."""
    c = components(params, retriever, passages, tiny_tokenizer, gates=gates)
    check = run_challenger_check(params, checkpoint("stray"), control=checkpoint("drift"), write=False,
                                 **lent(c, tmp_path))
    trained = check.comparisons["trained"]
    assert check.evaluations["after"].mean("names_source") == 0.0 and trained["names_source"].ci95[1] < 0
    assert not check.verdict.learned
    if gates == "read":
        assert trained["gate_pass"].ci95[1] < 0 and check.evaluations["after"].mean("gate_pass") == 0.0
        assert trained["in_window"].ci95[1] < 0 and check.verdict.outcome == "not learned"
    else:
        assert trained["in_window"].ci95[0] > 0 and check.stages.untrusted()            # into the window ...
        verdict = challenger_verdict(trained["in_window"], over_control=check.comparisons["over_control"]["in_window"],
                                     names_source=trained["names_source"], grader=check.grader, stages=check.stages,
                                     accept_untrusted_judge=True)
        assert verdict.outcome == "not learned" and "name their source document less" in verdict.reason
        assert check.verdict.outcome == "not shown" and "failed their calibration probes" in check.verdict.reason


def test_the_challenger_control_is_the_run_that_permutes_the_challengers_rewards():
    """CHALLENGER_SHUFFLED is exactly the reward_control values whose runs permute the Challenger's rewards."""
    from scope_lib.selfplay.training import shuffles_rewards

    values = typing.get_args(GRPOConfig.model_fields["reward_control"].annotation)
    assert {v for v in values if shuffles_rewards(v, "challenger")} == set(CHALLENGER_SHUFFLED)


def test_a_verdict_needs_a_comparison_and_reads_the_metric_s_direction():
    ids = ["d1", "d2", "d3"]
    up = Comparison("base", "c", "in_window", ids, [0, 0, 0], [1, 1, 1], (1.0, 1.0))
    assert challenger_verdict(None).outcome == "not shown"
    worse = challenger_verdict(up, metric="distance")                            # |ḡ − τ| rose: worse
    assert not worse.learned and "does not fall below 0" in worse.reason and "never probed" in worse.reason
    with pytest.raises(ValueError, match="in_window or distance"):
        challenger_verdict(up, metric="score")


def fake_run(folder, params, **changes):
    """A run folder as `scope train` leaves it (params.yaml, manifest.json, an iteration-1 Challenger adapter)."""
    trained = params.model_copy(deep=True)
    trained.grpo.reward_control = changes.get("reward_control", "none")
    trained.selfplay.co_evolution = changes.get("co_evolution", True)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "params.yaml").write_text(trained.to_yaml())
    (folder / "manifest.json").write_text(json.dumps({"reward_control": trained.grpo.reward_control}))
    adapter = folder / "iter_01" / "challenger" / "adapter"
    adapter.mkdir(parents=True)
    (adapter / "adapter_config.json").write_text("{}")
    (adapter / "adapter_model.safetensors").write_bytes(json.dumps(changes).encode())
    return folder / "iter_01" / "challenger"


def test_scope_learning_check_compare_role_challenger_and_play(params, retriever, passages, tiny_tokenizer, tmp_path,
                                                               monkeypatch, capsys):
    """`scope learning-check compare --role challenger` and `scope learning-check play` end to end: printed and
    written, a second call opens no model, and the runs that play another role are refused."""
    from scope_lib.cli import main
    from scope_lib.evaluation import challenger_check, held_out, learning_check

    scripted = ChallengerPlanted(tiny_tokenizer, DIALECT)
    opened = []

    def open_policies(params, checkpoints, engine=None):
        opened.append([ck.name for ck in checkpoints])
        adapter = {"iter_01-challenger": "trained", "control-iter_01-challenger": "drift", "iter_01-solver": "strong"}
        return {ck.name: Policy(ck, scripted, None if ck.kind == "base" else adapter.get(ck.name, ck.name))
                for ck in checkpoints}

    monkeypatch.setattr(learning_check, "open_policies", open_policies)   # the one opener (learning_check.opener)
    monkeypatch.setattr(challenger_check, "model_identity", lambda params: "scripted")
    monkeypatch.setattr(held_out, "model_identity", lambda params: "scripted")
    monkeypatch.setenv("SCOPE_CACHE_DIR", str(tmp_path / "cache"))
    run = params.model_copy(deep=True)
    run.run.runs_dir = str(tmp_path / "runs")
    run.model.warm_start.enabled = False
    fake_run(run.run_dir, run)
    control = fake_run(tmp_path / "runs" / "control", run, reward_control="shuffled_challenger")
    solver_only = fake_run(tmp_path / "runs" / "solver-control", run, reward_control="shuffled")
    coevolving = fake_run(tmp_path / "runs" / "coevolving", run)
    (tmp_path / "p.yaml").write_text(run.to_yaml())
    args = ["learning-check", "compare", str(tmp_path / "p.yaml"), "--role", "challenger", "--after",
            "iter_01/challenger"]
    assert main(args + ["--control", str(control)]) == 0
    out = capsys.readouterr().out
    assert "learned: the window share" in out and "control-iter_01-challenger" in out and "window share" in out
    written = json.loads((run.run_dir / "learning_check" /
                          "challenger-iter_01-challenger-vs-base-solver-base.json").read_text())
    assert written["verdict"]["learned"] and written["comparisons"]["trained"]["in_window"]["ci95"][0] > 0
    assert len(written["evaluations"]["after"]["documents"]) == 12 and written["solver"] == "base"
    calls = scripted.calls
    assert main(args + ["--control", str(control)]) == 0 and scripted.calls == calls and len(opened) == 1
    # a verdict on |ḡ − τ| from the stored tasks: its own file, the window share's left as it was
    assert main(args + ["--control", str(control), "--metric", "distance"]) == 0 and scripted.calls == calls
    folder = run.run_dir / "learning_check"
    assert "challenger-iter_01-challenger-vs-base-solver-base-distance.json" in capsys.readouterr().out
    by_distance = json.loads((folder / "challenger-iter_01-challenger-vs-base-solver-base-distance.json").read_text())
    kept = json.loads((folder / "challenger-iter_01-challenger-vs-base-solver-base.json").read_text())
    assert by_distance["metric"] == "distance" and kept["metric"] == "in_window" and kept == written
    # cross-checkpoint play: Challengers down, Solvers across; the strong Solver solves every task
    play = ["learning-check", "play", str(tmp_path / "p.yaml"), "--challenger", "base", "iter_01/challenger",
            "--solver", "base", "iter_01/solver"]
    fake_solver = run.run_dir / "iter_01" / "solver" / "adapter"
    fake_solver.mkdir(parents=True)
    (fake_solver / "adapter_config.json").write_text("{}")
    assert main(play) == 0
    out = capsys.readouterr().out
    assert "gate pass rate" in out and "iter_01-solver" in out
    matrix = json.loads((run.run_dir / "learning_check" / "cross_play.json").read_text())["matrix"]["mean_score"]
    assert matrix[1][0] == pytest.approx(1 / 3) and matrix[0][1] == matrix[1][1] == 1.0 and matrix[0][0] > 1 / 3
    # the runs that play another role
    assert main(args + ["--control", str(solver_only)]) == 2
    assert "shuffled_challenger" in capsys.readouterr().err
    assert main(args + ["--frozen", str(coevolving)]) == 2
    assert "co_evolution=false" in capsys.readouterr().err
    assert main(["learning-check", "compare", str(tmp_path / "p.yaml"), "--role", "challenger", "--after",
                 str(control)]) == 2
    assert "give it as --control" in capsys.readouterr().err
    assert main(args + ["--metric", "score"]) == 2


def test_cross_play_matrix_table_and_figure(planted, params, root):
    _, c = planted
    play = cross_play(params, [checkpoint("base"), checkpoint("trained")], [checkpoint("base"), checkpoint("strong")],
                      write=False, **lent(c, root))
    assert play.challengers == ["base", "trained"] and play.solvers == ["base", "strong"]
    m = play.matrix()
    assert m[1][0] == pytest.approx(1 / 3) and m[0][1] == m[1][1] == 1.0 and 1 / 3 < m[0][0] < 1
    table = play.table()
    assert list(table.columns) == ["base", "strong", "gate pass rate"] and table.loc["trained", "base"] == m[1][0]
    fig = cross_play_figure(play)
    assert fig.layout.title.text.startswith("Cross-checkpoint play") and fig.layout.xaxis.title.text
    assert list(fig.data[0].y) == ["base", "trained"]


def test_asking_for_more_documents_extends_the_tasks_by_whole_batches(planted, params, retriever, passages,
                                                                      tiny_tokenizer, tmp_path):
    """Written for 9 documents (batches of 6 and 3), then asked for 12: the first batch is kept, the short last one
    is written again whole; the tasks are those written for 12 at once."""
    check, _ = planted
    fewer = params.model_copy(deep=True)
    fewer.learning_check.tasks = 9
    c = components(params, retriever, passages, tiny_tokenizer)
    policy = Policy(checkpoint("trained"), c.engine, "trained")

    def write(p):
        return challenger_tasks(p, tmp_path / "trained", "trained", lambda: policy, lambda: c,
                                seed=params.learning_check.seed, progress=False)

    assert len(write(fewer).evaluations) == 9
    calls = c.engine.calls
    grown = write(params)
    assert [e.task for e in grown.evaluations] == [d.task for d in check.evaluations["after"].documents]
    assert len({e.challenger_id for e in grown.evaluations}) == 12 and grown.summary["asked"] == 12
    assert 0 < c.engine.calls - calls < calls                        # only the last batch was written again
    calls = c.engine.calls
    assert len(write(fewer).evaluations) == 9 and c.engine.calls == calls        # fewer: read back, nothing new
