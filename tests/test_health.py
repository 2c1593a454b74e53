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


def steps(*shares):
    return [{**HEALTHY, "step": k, "zero_spread_share": s} for k, s in enumerate(shares, 1)]


def test_mostly_zero_spread_fires_once_several_steps_running(tmp_path):
    fired = [health.check_steps(steps(*[0.75, 1.0, 0.5, 0.9, 0.6][:k])) for k in range(1, 6)]
    assert [len(a) for a in fired] == [0, 0, 1, 0, 0]          # on the third step running, once per stretch
    alarm = fired[2][0]
    assert alarm["alarm"] == "mostly_zero_spread" and alarm["step"] == 3 and alarm["value"] == 3
    assert "0.75, 1.00, 0.50" in alarm["message"]
    assert health.report(alarm, tmp_path) and not health.report(alarm, tmp_path)   # one record per step
    assert health.check_steps(steps(0.9, 0.9, 0.2, 0.9, 0.9, 0.9))[0]["step"] == 6   # a healthy step resets it


def test_mostly_zero_spread_stays_quiet_on_a_healthy_run_and_a_single_bad_step():
    assert health.check_steps(steps(0.25, 0.0, 0.4, 0.3, 0.1)) == []
    assert all(health.check_steps(steps(0.2, 1.0, 0.3, 0.1)[:k]) == [] for k in range(1, 5))
    assert health.check_steps(steps(0.49, 0.49, 0.49)) == []                  # "most" is at least half
    assert health.check_steps(steps(0.9, 0.9, None)) == []                    # a step without the number ends it
    assert health.check_step({**HEALTHY, "zero_spread_share": 0.9}) == []     # per step only at 100%
