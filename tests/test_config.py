"""Run parameters: paper defaults, YAML + overrides, errors that name the key, the file and the allowed values."""

from __future__ import annotations

from pathlib import Path

import pytest

from scope_lib.config import Params, ParamsError, describe_fields, load_params

REPO = Path(__file__).resolve().parents[1]
MODEL_PARAMS = ["qwen2.5-7b", "qwen3-8b", "olmo3-7b"]


def test_defaults_are_table_9():
    p = Params()
    assert p.grpo.learning_rate_for("full") == 1e-6 and p.grpo.warmup_ratio == 0.03 and p.grpo.max_grad_norm == 1.0
    assert p.grpo.learning_rate_for("lora") == 1e-5                   # LoRA's own default (10x, documented)
    assert p.grpo.dual_clip == 3.0 and p.grpo.kl_importance_ratio is False and p.grpo.loss_type == "dapo"
    assert p.grpo.beta == 1e-3 and p.grpo.group_size == 8
    assert p.selfplay.steps_per_role == 20 and p.selfplay.iterations == 3
    assert (p.challenger.batch_size, p.solver.batch_size) == (64, 256)
    assert (p.challenger.max_prompt_tokens, p.solver.max_prompt_tokens) == (1024, 2048)
    assert (p.solver.accuracy_weight, p.solver.format_weight, p.solver.search_weight) == (1.0, 0.5, 0.1)
    assert (p.solver.length_soft, p.solver.length_hard, p.solver.length_floor) == (1024, 2048, 0.05)
    assert (p.challenger.format_weight, p.challenger.difficulty_weight, p.challenger.difficulty_target) == (0.5, 1.0, 0.5)
    assert (p.retrieval.top_k, p.retrieval.max_result_tokens, p.retrieval.embedder) == (3, 500, "e5")
    assert (p.judge.rubric_temperature, p.judge.grading_temperature, p.judge.min_rubrics) == (0.0, 0.6, 3)
    assert p.selfplay.difficulty_window == (0.2, 0.8)
    assert (p.selfplay.solver_rollouts_train, p.selfplay.solver_rollouts_filter) == (8, 4)
    assert p.selfplay.search_turn_strata == [4, 3, 2] and p.selfplay.target_tasks == 5120
    assert p.selfplay.task_types == ["long_form_qa", "summarisation", "planning", "writing"]
    assert p.selfplay.rollout_prompt_tokens == 2048                     # "rollout prompt length"
    assert p.solver.max_searches == 5 and p.solver.turn_limit == 6     # §4.1: 5 searches, then the answer


@pytest.mark.parametrize("name", MODEL_PARAMS)
def test_model_params_keep_the_paper_values(name):
    """The model files restate Table 9 for readers; they must not drift from the defaults."""
    p = load_params(REPO / "params" / f"{name}.yaml")
    paper = Params()
    for section in ("selfplay", "challenger", "solver", "grpo"):
        assert getattr(p, section) == getattr(paper, section), section
    assert p.run.name == name
    assert p.model.dialect in {"qwen2.5", "qwen3", "olmo3"}


def test_every_params_file_loads():
    files = sorted((REPO / "params").rglob("*.yaml"))
    assert len(files) >= 7
    for f in files:
        load_params(f)


@pytest.mark.parametrize(("name", "check"), [
    ("no-co-evolution", lambda p: p.selfplay.co_evolution is False),
    ("without-writing", lambda p: p.selfplay.task_types == ["long_form_qa", "summarisation", "planning"]),
    ("without-long-form-qa", lambda p: "long_form_qa" not in p.selfplay.task_types and len(p.selfplay.task_types) == 3),
    ("judge-rubrics-qwen3-4b", lambda p: p.judge.rubric_model == "Qwen/Qwen3-4B" and p.judge.grader_model is None),
    ("judge-grader-qwen3-4b", lambda p: p.judge.grader_model == "Qwen/Qwen3-4B" and p.judge.rubric_model is None),
    ("six-iterations", lambda p: p.selfplay.iterations == 6),
])
def test_ablation_files(name, check):
    p = load_params(REPO / "params" / "ablations" / f"{name}.yaml")
    assert check(p) and p.model.base == "Qwen/Qwen3-8B"
    assert p.run.name != "qwen3-8b"                                   # its own run folder


def test_no_quality_gates_ablation_file():
    p = load_params(REPO / "params" / "ablations" / "no-quality-gates.yaml")
    assert p.judge.gates == [] and p.model.base == "Qwen/Qwen3-8B"
    assert load_params().judge.gates == ["entity_identifiability", "source_relevance"]


def test_inherit_merges_section_by_section():
    p = load_params(REPO / "params" / "ablations" / "no-length-penalty.yaml")
    assert p.solver.length_penalty is False
    assert p.model.base == "Qwen/Qwen3-8B" and p.model.dialect == "qwen3"   # inherited
    assert p.solver.length_soft == 1024                                      # untouched keys stay


def test_overrides_apply_and_parse_yaml_values():
    p = load_params(REPO / "params" / "smoke.yaml",
                    ["grpo.learning_rate=2e-6", "selfplay.task_types=[planning]", "solver.length_penalty=false"])
    assert p.grpo.learning_rate == 2e-6
    assert p.selfplay.task_types == ["planning"]
    assert p.solver.length_penalty is False
    assert load_params(None, {"retrieval.top_k": 5}).retrieval.top_k == 5


def test_unknown_key_in_file_names_file_key_and_allowed(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text("grpo:\n  learnig_rate: 1e-5\n")
    with pytest.raises(ParamsError) as err:
        load_params(f)
    msg = str(err.value)
    assert str(f) in msg and "grpo.learnig_rate" in msg and "learning_rate" in msg


def test_unknown_section(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text("optimiser:\n  lr: 1\n")
    with pytest.raises(ParamsError, match=r"optimiser: unknown key; allowed keys here: run, model"):
        load_params(f)


def test_unknown_override_key_names_allowed_keys():
    with pytest.raises(ParamsError, match=r"unknown key 'learnin_rate'.*allowed: learning_rate"):
        load_params(REPO / "params" / "smoke.yaml", ["grpo.learnin_rate=1"])
    with pytest.raises(ParamsError, match=r"unknown key 'optim'"):
        load_params(None, ["optim.lr=1"])


@pytest.mark.parametrize("override, key, hint", [
    ("grpo.learning_rate=abc", "grpo.learning_rate", "valid number"),
    ("model.dialect=gpt", "model.dialect", "'qwen2.5', 'qwen3' or 'olmo3'"),
    ("grpo.learning_rate=-1", "grpo.learning_rate", "greater than 0"),
    ("retrieval.embedder=bm25", "retrieval.embedder", "'e5', 'minilm-offline' or 'hashing'"),
    ("selfplay.task_types=[poetry]", "selfplay.task_types.0", "long_form_qa"),
    ("selfplay.difficulty_window=[0.9,0.1]", "selfplay", "0 <= l <= u <= 1"),
    ("solver.length_hard=10", "solver", "must exceed length_soft"),
    ("grpo.group_size=1", "grpo.group_size", "greater than or equal to 2"),
    ("challenger.no_rubrics_reward=half", "challenger.no_rubrics_reward", "'format' or 'zero'"),
])
def test_bad_values_name_key_and_allowed(override, key, hint):
    with pytest.raises(ParamsError) as err:
        load_params(REPO / "params" / "smoke.yaml", [override])
    msg = str(err.value)
    assert "params/smoke.yaml" in msg and key in msg and hint in msg


@pytest.mark.parametrize("overrides, hint", [
    (["model.loader=vllm"], "'hf' or 'unsloth'"),
    (["model.loader=unsloth", "model.finetuning=full"], "model.finetuning: lora"),
    (["model.unsloth.load_in_4bit=true"], "model.unsloth.load_in_4bit is set but model.loader is 'hf'"),
    (["model.loader=unsloth", "model.unsloth.fast_inference=true"], "set engine.backend: vllm (it is 'hf')"),
])
def test_the_unsloth_loader_refuses_settings_it_cannot_honour(overrides, hint):
    with pytest.raises(ParamsError, match="params/smoke.yaml") as err:
        load_params(REPO / "params" / "smoke.yaml", overrides)
    assert hint in str(err.value)
    fine = load_params(REPO / "params" / "smoke.yaml", ["model.loader=unsloth", "model.unsloth.load_in_4bit=true"])
    assert fine.model.unsloth.load_in_4bit and not fine.model.unsloth.fast_inference


def test_malformed_files(tmp_path):
    with pytest.raises(ParamsError, match="no such params file"):
        load_params(tmp_path / "missing.yaml")
    (tmp_path / "list.yaml").write_text("- a\n- b\n")
    with pytest.raises(ParamsError, match="expected a mapping"):
        load_params(tmp_path / "list.yaml")
    (tmp_path / "broken.yaml").write_text("grpo: [\n")
    with pytest.raises(ParamsError, match="not valid YAML"):
        load_params(tmp_path / "broken.yaml")
    (tmp_path / "a.yaml").write_text("inherit: b.yaml\n")
    (tmp_path / "b.yaml").write_text("inherit: a.yaml\n")
    with pytest.raises(ParamsError, match="cycle"):
        load_params(tmp_path / "a.yaml")
    with pytest.raises(ParamsError, match="expected section.key=value"):
        load_params(None, ["grpo.learning_rate"])


def test_data_dir_and_corpus_path(monkeypatch, tmp_path):
    monkeypatch.setenv("SCOPE_DATA_DIR", str(tmp_path))
    p = load_params(REPO / "params" / "smoke.yaml")
    assert p.corpus_path == tmp_path / "wiki18_sample.jsonl"
    p = load_params(REPO / "params" / "smoke.yaml", ["run.data_dir=/elsewhere"])
    assert p.corpus_path == Path("/elsewhere/wiki18_sample.jsonl")
    assert p.run_dir == Path("runs/smoke")


def test_every_field_is_documented():
    rows = describe_fields()
    assert len(rows) > 100
    undocumented = [key for key, _, doc in rows if not doc]
    assert undocumented == []


def test_round_trip_yaml(tmp_path):
    p = load_params(REPO / "params" / "qwen3-8b.yaml")
    f = tmp_path / "resolved.yaml"
    f.write_text(p.to_yaml())
    assert load_params(f) == p


def test_display_path_never_shows_the_machines_folders(monkeypatch, tmp_path):
    """What a shared report prints for a path: relative to the current folder (the repository in a notebook),
    else the run folder's or the data directory's name then the path inside it, else ~/..., else the name."""
    from scope_lib.config import display_path

    repo, data, runs = tmp_path / "repo", tmp_path / "elsewhere" / "data", tmp_path / "scratch" / "runs"
    for folder in (repo / "runs" / "smoke", data, runs / "smoke"):
        folder.mkdir(parents=True)
    monkeypatch.chdir(repo)
    shown = lambda p, run_dir=runs / "smoke": display_path(p, run_dir=run_dir, data_dir=data)  # noqa: E731
    assert shown(repo / "runs" / "smoke" / "explore") == "runs/smoke/explore"
    assert shown(runs / "smoke" / "eval") == "smoke/eval"
    assert shown(data / "wiki18_sample.jsonl") == "data/wiki18_sample.jsonl"
    assert shown(Path.home() / ".cache" / "scope") == "~/.cache/scope"
    assert shown("/nowhere/known/file.jsonl") == "file.jsonl"
    assert shown("runs/smoke") == "runs/smoke"                     # relative paths as they are
    params = load_params(REPO / "params" / "smoke.yaml",
                         [f"run.data_dir={data}", f"run.runs_dir={runs}", "run.name=smoke"])
    assert params.show_path(params.corpus_path) == f"data/{Path(params.retrieval.corpus).name}"
    assert params.show_path(params.run_dir / "explore") == "smoke/explore"
