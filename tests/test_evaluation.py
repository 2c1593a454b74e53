"""scope_lib.evaluation: checkpoints (base, tiny LoRA adapters, full models) turned into engines, `scope eval` end to
end against a scripted OpenAI-compatible judge (a second run makes zero judge calls, the key never reaches a file),
resume after a kill, the force-answer option, the co-evolution matrix over task-pool files, the self-judge gap, and
the evaluation judges' configuration (§4.1)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from scripted_engine import ScriptedEngine
from scripted_judge import ScriptedJudgeBackend, scripted_judge_server

from scope_lib.cli import main
from scope_lib.config import EVAL_JUDGE_PRESETS, load_params
from scope_lib.evaluation.benchmarks import select_items
from scope_lib.evaluation.evaluate import (
    Policy,
    available_checkpoints,
    eval_limits,
    evaluate,
    judge_settings,
    open_policies,
    resolve_checkpoint,
    run_solver,
)
from scope_lib.evaluation.judge import BenchmarkJudge
from scope_lib.evaluation.tables import coevolution_matrix, results_table, self_judge_gap
from scope_lib.protocol.dialects import get_dialect
from scope_lib.protocol.parsing import Rubric
from scope_lib.selfplay.judge import Judge

REPO = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).parent / "fixtures" / "benchmarks"
SECRET = "sk-eval-TOPSECRET-5555555555"


def make_adapter(model_dir: Path, out: Path, seed: int) -> Path:
    """A tiny LoRA adapter with random (non-zero) weights, saved the way training saves one."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                                                  init_lora_weights=False))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.add_(torch.randn_like(p) * 0.5)
    peft_model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def params(shared_data, tiny_model_dir, tmp_path_factory):
    runs = tmp_path_factory.mktemp("runs")
    return load_params(REPO / "params" / "smoke.yaml", {
        "run.runs_dir": str(runs), "run.name": "evalrun", "run.data_dir": str(shared_data),
        "retrieval.embedder": "hashing", "evaluation.max_examples": 3, "evaluation.bootstrap_samples": 50,
        "solver.max_new_tokens_per_turn": 256, "solver.max_response_tokens": 2048,
        "evaluation.max_answer_tokens": 128, "evaluation.data_files": {
            "nq": "qa/nq.jsonl", "healthbench": "openended/healthbench_sample.jsonl",
            "researchqa": str(FIXTURES / "researchqa_test.json")}})


# -- checkpoints -------------------------------------------------------------------------------------------


def test_checkpoints_resolve_and_adapters_generate(params, tiny_model_dir, tiny_tokenizer):
    from transformers import AutoModelForCausalLM

    from scope_lib.models.engine import Sampling
    from scope_lib.models.hf_engine import HFEngine

    run = params.run_dir
    assert [c.spec for c in available_checkpoints(params)] == ["base"]
    make_adapter(tiny_model_dir, run / "iter_01" / "solver" / "adapter", seed=1)
    make_adapter(tiny_model_dir, run / "iter_02" / "solver" / "adapter", seed=2)
    AutoModelForCausalLM.from_pretrained(tiny_model_dir).save_pretrained(run / "iter_03" / "solver" / "model")
    tiny_tokenizer.save_pretrained(run / "iter_03" / "solver" / "model")
    found = available_checkpoints(params)
    assert [(c.spec, c.kind, c.name) for c in found] == [
        ("base", "base", "base"), ("iter_01/solver", "adapter", "iter_01-solver"),
        ("iter_02/solver", "adapter", "iter_02-solver"), ("iter_03/solver", "model", "iter_03-solver")]
    by_path = resolve_checkpoint(params, str(run / "iter_01" / "solver"))
    assert by_path.kind == "adapter" and by_path.path == run / "iter_01" / "solver" / "adapter"
    with pytest.raises(FileNotFoundError, match=r"iter_09/solver.*available: base, iter_01/solver"):
        resolve_checkpoint(params, "iter_09/solver")
    with pytest.raises(FileNotFoundError, match="adapter_config.json"):
        resolve_checkpoint(params, str(run / "nowhere"))

    plain = HFEngine(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32), tiny_tokenizer)
    base_engine = HFEngine(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32), tiny_tokenizer)
    policies = open_policies(params, ["base", "iter_01/solver", "iter_02/solver", "iter_03/solver"],
                             engine=base_engine)
    assert policies["iter_01-solver"].engine is base_engine and policies["iter_01-solver"].adapter == "iter_01-solver"
    assert policies["iter_03-solver"].engine is not base_engine and policies["iter_03-solver"].adapter is None
    prompt = [tiny_tokenizer.encode(tiny_tokenizer.apply_chat_template(
        [{"role": "user", "content": "Who founded the city?"}], tokenize=False, add_generation_prompt=True))]
    greedy = Sampling(max_new_tokens=8, temperature=0.0)
    out = {name: p.engine.generate(prompt, greedy, adapter=p.adapter)[0].token_ids for name, p in policies.items()}
    reference = plain.generate(prompt, greedy)[0].token_ids
    assert out["base"] == reference and out["iter_03-solver"] == reference     # M0 and its unchanged copy
    assert out["iter_01-solver"] != reference and out["iter_02-solver"] != out["iter_01-solver"]
    assert policies["base"].engine.generate(prompt, greedy)[0].token_ids == reference   # adapters off again


# -- scope eval end to end ---------------------------------------------------------------------------------


def test_scope_eval_end_to_end_with_a_served_judge_and_a_cache(params, retriever, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OPENAI_API_KEY", SECRET)
    benchmarks = ["nq", "healthbench", "arena_hard_cw", "drb", "wildbench", "researchqa"]
    with scripted_judge_server() as (url, state):
        spec = tmp_path / "eval.yaml"
        spec.write_text(
            f"inherit: {REPO / 'params' / 'smoke.yaml'}\n"
            f"run: {{name: cli, runs_dir: {params.run.runs_dir}, data_dir: {params.run.data_dir}}}\n"
            "retrieval: {embedder: hashing}\n"
            "evaluation:\n"
            f"  benchmarks: {json.dumps(benchmarks)}\n"
            "  max_examples: 2\n  max_searches: 1\n  max_answer_tokens: 16\n  bootstrap_samples: 20\n"
            "  judge_backend: openai\n"
            f"  judge_base_url: {url}\n  judge_token_field: max_tokens\n"
            "  open_ended_judge: {model: judge-big, reasoning_effort: high}\n"
            "  short_form_judge: {model: judge-small}\n"
            "  data_files:\n    nq: qa/nq.jsonl\n    healthbench: openended/healthbench_sample.jsonl\n"
            "    arena_hard_cw: [openended/arena_hard_v2_creative.jsonl, openended/arena_hard_v2_o3mini_answers.jsonl]\n"
            "    drb: [openended/drb_queries.jsonl, openended/drb_criteria.jsonl, "
            "openended/drb_articles_claude37.jsonl]\n"
            f"    wildbench: {FIXTURES / 'wildbench_test.jsonl'}\n    researchqa: {FIXTURES / 'researchqa_test.json'}\n")
        assert main(["eval", str(spec)]) == 0
        first_calls = len(state["bodies"])
        assert first_calls > 0 and state["authorization"] == f"Bearer {SECRET}"
        models = {b["model"]: b for b in state["bodies"]}
        assert set(models) == {"judge-big", "judge-small"}
        assert models["judge-big"]["reasoning_effort"] == "high" and "reasoning_effort" not in models["judge-small"]
        run_dir = Path(params.run.runs_dir) / "cli" / "eval"
        summaries = {b: json.loads((run_dir / "base" / b / "summary.json").read_text()) for b in benchmarks}
        items = {b: [json.loads(line) for line in (run_dir / "base" / b / "items.jsonl").read_text().splitlines()]
                 for b in benchmarks}
        printed = capsys.readouterr().out
        assert main(["eval", str(spec)]) == 0                 # everything again: stored rollouts, cached replies
        assert len(state["bodies"]) == first_calls
    for b in benchmarks:
        assert len(items[b]) == 2 and summaries[b]["scorers"]["scope_paper"]["n"] == 2
        assert (run_dir / "manifests" / f"{b}.json").is_file() and (run_dir / "base" / b / "manifest.json").is_file()
        assert all(r["trajectory_id"].startswith(f"base/{b}/") for r in items[b])
    # the scripted verdicts, scored: DRB RACE 6 vs 4 everywhere -> 0.6; holistic (3,4,5,2,1) -> 0.5
    drb = summaries["drb"]["scorers"]
    assert drb["official"]["value"] == pytest.approx(0.6) and drb["scope_paper"]["value"] == pytest.approx(0.5)
    # Arena: the scripted judge prefers the longer reply: the baseline's long answer beats a 16-token one twice
    assert summaries["arena_hard_cw"]["scorers"]["official"]["value"] == pytest.approx(0.0)
    # the judges a probe checks read (scripted_judge), so they passed it; rating judges have no probe
    assert {b: summaries[b]["scorers"]["scope_paper"]["trusted"] for b in benchmarks} == {
        "nq": True, "healthbench": True, "arena_hard_cw": True, "drb": None, "wildbench": None, "researchqa": None}
    calibration = json.loads((run_dir / "calibration.json").read_text())["judges"]
    assert set(calibration) == {"short_form@judge-small", "criterion@judge-big", "pairwise@judge-big"}
    # WildBench: first sample garbage, the retry parses (6): WB (6-5)/5 = 0.2, paper (6-1)/9
    wb = summaries["wildbench"]["scorers"]
    assert wb["official"]["value"] == pytest.approx(0.2) and wb["scope_paper"]["value"] == pytest.approx(5 / 9)
    assert wb["official"]["n_invalid_units"] == 0
    assert all(len(u["replies"]) == 2 for r in items["wildbench"] for u in r["scores"]["official"]["units"])
    assert summaries["researchqa"]["scorers"]["official"]["value"] == pytest.approx(0.75)   # "Mostly" everywhere
    assert summaries["nq"]["scorers"]["official"]["metrics"].keys() == {"em", "f1", "acc"}
    assert summaries["nq"]["judge_usage"]["scope_paper"]["requests"] == 2
    assert "healthbench" in printed and "official" in printed
    for path in Path(params.run.runs_dir, "cli").rglob("*"):
        if path.is_file():
            assert b"TOPSECRET" not in path.read_bytes(), path


# -- resume, force-answer ----------------------------------------------------------------------------------


def test_a_killed_evaluation_resumes_without_lost_or_duplicated_rollouts(params, retriever, tiny_tokenizer):
    dialect = get_dialect("qwen2.5")
    items, _ = select_items(params, "nq")
    engine = ScriptedEngine(tiny_tokenizer, dialect)
    policy = Policy(resolve_checkpoint(params, "base"), engine, None)
    folder = params.run_dir / "eval" / "resume" / "nq"
    first = run_solver(params, policy, "nq", items, retriever=retriever, dialect=dialect, folder=folder)
    assert all(t.answer for t in first.values()) and engine.batch_sizes[0] == 3
    store = folder / "trajectories.jsonl"
    lines = store.read_bytes().split(b"\n")
    store.write_bytes(lines[0] + b"\n" + lines[1][:40])          # killed mid-write of the second record
    calls = engine.calls
    again = run_solver(params, policy, "nq", items, retriever=retriever, dialect=dialect, folder=folder)
    assert engine.batch_sizes[calls] == 2                         # only the two missing items rolled out
    records = [json.loads(line) for line in store.read_text().splitlines()]
    assert sorted(r["id"] for r in records) == sorted(t.id for t in first.values())
    assert [again[k].answer for k in first] == [first[k].answer for k in first]


def test_force_answer_nudges_a_rollout_without_an_answer(params, retriever, tiny_tokenizer):
    dialect = get_dialect("qwen2.5")
    items, _ = select_items(params, "nq")

    def stubborn(role, context):
        if role != "solver":
            return None
        return "<answer>42</answer>" if "You have used your searches" in context else "Let me think about it."

    engine = ScriptedEngine(tiny_tokenizer, dialect, override=stubborn)
    policy = Policy(resolve_checkpoint(params, "base"), engine, None)
    plain = run_solver(params, policy, "nq", items[:2], retriever=retriever, dialect=dialect,
                       folder=params.run_dir / "eval" / "plain" / "nq")
    assert all(t.answer is None for t in plain.values())
    nudged_params = params.model_copy(update={"evaluation": params.evaluation.model_copy(update={"force_answer": 2})})
    nudged = run_solver(nudged_params, policy, "nq", items[:2], retriever=retriever, dialect=dialect,
                        folder=params.run_dir / "eval" / "nudged" / "nq")
    for traj in nudged.values():
        assert traj.answer == "42" and traj.meta["force_answer"] == 1 and len(traj.turns) == 2
        a, b = traj.turn_spans
        assert set(traj.env_mask[a[1]:b[0]]) == {0} and set(traj.env_mask[b[0]:b[1]]) == {1}
        assert "You have used your searches" in tiny_tokenizer.decode(traj.completion_ids[a[1]:b[0]])
    assert eval_limits(params, dialect).max_turns == params.evaluation.max_searches + 1


# -- co-evolution matrix and self-judge gap ----------------------------------------------------------------


def _write_pool(run_dir: Path, iteration: int, tasks: list[tuple[str, list[str]]]) -> None:
    from scope_lib.protocol.rewards import FormatScore
    from scope_lib.selfplay.tasks import TaskEvaluation

    folder = run_dir / f"iter_{iteration:02d}" / "pool"
    folder.mkdir(parents=True, exist_ok=True)
    lines = []
    for k, (task, entities) in enumerate(tasks):
        e = TaskEvaluation(challenger_id=f"c{iteration}-{k}", document_id=f"d{k}", task_type="long_form_qa",
                           expected_searches=1, task=task, format=FormatScore(1.0, 1.0, 1.0), gates_passed=True,
                           rubrics=[Rubric(f"Identifies {n} by name.", "critical") for n in entities],
                           mean_score=0.5)
        lines.append(json.dumps({**e.to_record(), "id": f"iter{iteration}-t{k}", "iteration": iteration}))
    lines.insert(1, '{"id": "broken", "task": ""}')
    (folder / "tasks.jsonl").write_text("\n".join(lines) + "\n")


def test_coevolution_matrix_from_task_pools(params, retriever, tiny_tokenizer, caplog):
    from scope_lib.evaluation.tables import load_task_pool

    dialect = get_dialect("qwen2.5")
    _write_pool(params.run_dir, 1, [("Explain how Alpha and Beta are connected.", ["Alpha", "Beta"]),
                                    ("Explain how Gamma and Delta are connected.", ["Gamma", "Delta"])])
    _write_pool(params.run_dir, 2, [("Explain how Alpha and Omega are connected.", ["Alpha", "Omega"])])
    assert [t.id for t in load_task_pool(params, 1)] == ["iter1-t0", "iter1-t1"]
    assert "tasks.jsonl:2: needs id, task and rubrics" in caplog.text

    def knows(names):   # a Solver that answers naming the given entities
        def override(role, context):
            if role != "solver":
                return None
            return f"<answer>It concerns {', '.join(n for n in names if n in context)}.</answer>"
        return override

    strong = ScriptedEngine(tiny_tokenizer, dialect, override=knows(["Alpha", "Beta", "Gamma", "Delta", "Omega"]))
    weak = ScriptedEngine(tiny_tokenizer, dialect, override=knows(["Alpha"]))
    policies = {"strong": Policy(resolve_checkpoint(params, "base"), strong, None),
                "weak": Policy(resolve_checkpoint(params, "base"), weak, None)}
    judge = Judge(ScriptedEngine(tiny_tokenizer, dialect), params.judge)
    matrix, rows = coevolution_matrix(params, policies, judge, retriever=retriever, dialect=dialect)
    assert list(matrix.index) == ["Challenger iter 1", "Challenger iter 2"]
    assert matrix.loc["Challenger iter 1", "strong"] == 1.0 and matrix.loc["Challenger iter 2", "strong"] == 1.0
    assert matrix.loc["Challenger iter 1", "weak"] == pytest.approx(0.25)   # (1/2 + 0/2) / 2
    assert matrix.loc["Challenger iter 2", "weak"] == pytest.approx(0.5)
    assert len(rows) == 6 and (params.run_dir / "eval" / "weak" / "pool_iter_01" / "trajectories.jsonl").is_file()
    calls = strong.calls
    coevolution_matrix(params, {"strong": policies["strong"]}, judge, retriever=retriever, dialect=dialect)
    assert strong.calls == calls                                             # stored rollouts reused


def test_evaluate_with_scripted_policy_then_self_judge_gap(params, retriever, tiny_tokenizer):
    dialect = get_dialect("qwen2.5")
    golds = {item.question: item.reference["golden_answers"][0] for item in select_items(params, "nq")[0]}

    def knows_the_answer(role, context):   # the Solver answers NQ with its gold answer (the judge reads it)
        found = [gold for question, gold in golds.items() if role == "solver" and question in context]
        return f"<answer>{found[0]}</answer>" if found else None

    engine = ScriptedEngine(tiny_tokenizer, dialect, override=knows_the_answer)
    policies = {"base": Policy(resolve_checkpoint(params, "base"), engine, None)}
    backend = ScriptedJudgeBackend()
    summaries = evaluate(params, ["base"], ["nq", "healthbench"], policies=policies, judge=BenchmarkJudge(backend),
                         retriever=retriever, dialect=dialect)
    nq = next(s for s in summaries if s["benchmark"] == "nq")
    assert nq["answer_status"] == {"answer": 3} and nq["scorers"]["scope_paper"]["value"] == 1.0
    table = results_table(params, ["base"], "short_form")
    assert table.loc["base", "NQ"] == 100.0 and table.loc["base", "benchmarks"] == 1
    gap = self_judge_gap(params, "base", ["nq", "healthbench"], Judge(ScriptedEngine(tiny_tokenizer, dialect),
                                                                      params.judge))
    row = gap.set_index("benchmark").loc["NQ"]
    # the scripted self-Judge scores 1 only when a rubric's entity is named; the gold answers are not
    assert row["items"] == 3 and row["external judge"] == 100.0 and row["self-judge"] == 0.0
    assert row["gap (self - external)"] == -100.0


# -- the evaluation judges (§4.1) ----------------------------------------------------------------------------


def test_evaluation_judges_default_to_the_paper_and_can_be_overridden():
    e = load_params(None).evaluation
    assert (e.open_ended_judge.model, e.open_ended_judge.temperature, e.open_ended_judge.reasoning_effort) == \
        ("gpt-5.4-mini", 1.0, "high")
    assert (e.short_form_judge.model, e.short_form_judge.temperature, e.short_form_judge.reasoning_effort) == \
        ("gpt-5-mini", 1.0, None)
    assert e.max_searches == 5 and e.max_examples == 1000 and len(e.benchmarks) == 15
    code = load_params(None, ["evaluation.judge_preset=authors_code"])
    assert code.evaluation.open_ended_judge.model == "gpt-5-mini"
    assert code.evaluation.open_ended_judge.reasoning_effort is None
    assert EVAL_JUDGE_PRESETS["authors_code"]["short_form_judge"]["model"] == "gpt-5-mini"
    over = load_params(None, ["evaluation.open_ended_judge.model=gpt-4.1", "evaluation.benchmark_judges="
                              "{healthbench: {model: gpt-4.1, temperature: 0.5, reasoning_effort: null}}"])
    assert over.evaluation.open_ended_judge.model == "gpt-4.1"
    assert over.evaluation.open_ended_judge.reasoning_effort == "high"     # the rest of the preset stays
    assert judge_settings(over, "healthbench").temperature == 0.5 and judge_settings(over, "nq").model == "gpt-5-mini"
    assert judge_settings(over, "drb").model == "gpt-4.1"
    with pytest.raises(ValueError, match="evaluation.benchmarks"):
        load_params(None, ["evaluation.benchmarks=[nq, gsm8k]"])


def test_vllm_policies_register_adapters(params, tiny_vllm_model_dir, tmp_path):
    """`scope eval` with engine.backend vllm: a checkpoint's adapter is registered on the vLLM engine (vLLM's CPU
    build here; the tiny variant with head size 64)."""
    from scope_lib.models.vllm_engine import VLLMEngine

    make_adapter(tiny_vllm_model_dir, tmp_path / "iter_05" / "solver" / "adapter", seed=5)
    engine = VLLMEngine(tiny_vllm_model_dir, enable_lora=True, max_lora_rank=8, max_model_len=512, threads=1,
                        kv_cache_gib=0.25)
    try:
        vparams = params.model_copy(update={"engine": params.engine.model_copy(update={"backend": "vllm"})})
        policies = open_policies(vparams, ["base", str(tmp_path / "iter_05" / "solver")], engine=engine)
        adapter = [p for p in policies.values() if p.adapter][0]
        assert adapter.adapter in engine._adapters
    finally:
        engine.close()
