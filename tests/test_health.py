"""Health alarms: each fires on a constructed failing step and stays quiet on a healthy one."""

from __future__ import annotations

import pytest

from scope_lib.selfplay import health

HEALTHY = {"role": "solver", "iteration": 1, "step": 3, "rollouts": 16, "reward": 0.7, "empty_retrieval_rate": 0.0,
           "zero_spread_share": 0.25, "truncation_rate": 0.1, "searches_per_rollout": 2.5,
           "judge_parse_failure_rate": 0.02}

FAILING = {
    "empty_retrieval": {"empty_retrieval_rate": 0.4},
    "zero_spread": {"zero_spread_share": 1.0},
    "truncated": {"truncation_rate": 0.95},
    "no_searches": {"searches_per_rollout": 0.0},
    "judge_parse_failures": {"judge_parse_failure_rate": 0.35},
    "no_reward": {"reward": None},
}


def test_a_healthy_step_raises_no_alarm():
    assert health.check_step(HEALTHY) == []
    assert health.check_pool({"tasks": 12, "candidates": 40}) == []


@pytest.mark.parametrize("name", list(FAILING))
def test_each_alarm_fires_on_its_failure(name, tmp_path, caplog):
    alarms = health.check_step({**HEALTHY, **FAILING[name]})
    assert [a["alarm"] for a in alarms] == [name]
    assert alarms[0]["step"] == 3 and alarms[0]["role"] == "solver"
    caplog.set_level("WARNING", logger="scope_lib.selfplay.health")
    health.report(alarms[0], tmp_path)
    assert "HEALTH ALARM" in caplog.text and name in caplog.text
    assert [a["alarm"] for a in health.read_alarms(tmp_path)] == [name]


def test_thresholds_are_boundaries():
    assert health.check_step({**HEALTHY, "empty_retrieval_rate": 0.09}) == []
    assert health.check_step({**HEALTHY, "truncation_rate": 0.89}) == []
    assert health.check_step({**HEALTHY, "judge_parse_failure_rate": 0.2}) == []
    assert health.check_step({**HEALTHY, "zero_spread_share": 0.99}) == []


def test_empty_pool_alarm(tmp_path):
    alarms = health.check_pool({"tasks": 0, "candidates": 20, "iteration": 2})
    assert [a["alarm"] for a in alarms] == ["empty_pool"] and "20 candidates" in alarms[0]["message"]
    (tmp_path / "health.jsonl").write_text('{"alarm": "x"}\n{"alarm": "torn')
    assert [a["alarm"] for a in health.read_alarms(tmp_path)] == ["x"]     # a torn last line is skipped
