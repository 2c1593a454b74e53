"""Notebooks 02, 04 and 05 on a run of any self-play method (docs/methods.md, "Reports for every method").

    R = report_for(params)          # the run's method's report: SCOPE's, SPICE's, SSP's or SCORE's
    show(R.reward_figures(M))       # each section is a list of figures, tables and one-line notes

A notebook section calls the same function for every method; what it draws is the method's: SCOPE's gates, task
pool and rubric scores; SPICE's attempts, their validity and rule verification, the Reasoner's pass rates and the
Gaussian rewards (eq. 1); SSP's questions, rule-filter reasons, RAG verification, 1 - p rewards (eq. 7) and the
replay buffer; SCORE's rubrics and weights, the consistency reward and the meta-harness refreshes. A section that
does not apply to a method says so in one line (`skip`). The tables are read from the run's own records
(`iter_NN/<stage>/*.jsonl`, `DONE`), never recomputed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from scope_lib.config import Params
from scope_lib.protocol.rewards import difficulty_reward
from scope_lib.reports import analysis
from scope_lib.runs import Stage
from scope_lib.selfplay.methods import METHODS


def show(items) -> None:
    """Display a section's items in order: text printed, plotly figures shown, anything else `display`ed."""
    from IPython.display import display
    from plotly.basedatatypes import BaseFigure

    for item in items:
        if isinstance(item, str):
            print(item)
        elif isinstance(item, BaseFigure):
            item.show()
        else:
            display(item)


def _records(run_dir, stage: str, log: str = "rollouts") -> list[tuple[int, dict]]:
    """(iteration, record) of every record of `log` in every iteration's `stage` folder."""
    return [(t, r) for t, folder in analysis._iterations(run_dir)
            for r in analysis._jsonl(folder / stage / f"{log}.jsonl")]


def _summaries(run_dir, stage: str) -> list[tuple[int, dict]]:
    return [(t, Stage(folder / stage).summary) for t, folder in analysis._iterations(run_dir)]


def reason_counts(records: list[tuple[int, dict]], key: str = "invalid_reason", valid: str = "valid") -> Any:
    """Per iteration, how many records had each reason (`valid` for a record whose reason is null)."""
    import pandas as pd

    rows = [{"iteration": t, "reason": r.get(key) or valid} for t, r in records]
    if not rows:
        return pd.DataFrame()
    return pd.DataFrame(rows).groupby(["iteration", "reason"]).size().unstack(fill_value=0)


def _reasons_figure(counts, title: str) -> Any:
    import plotly.express as px

    long = counts.reset_index().melt(id_vars="iteration", var_name="reason", value_name="records")
    return px.bar(long.astype({"iteration": str}), x="reason", y="records", color="iteration", barmode="group",
                  title=title, labels={"records": "records", "reason": "outcome"})


def _clip(text: Any, n: int = 400) -> str:
    text = "" if text is None else str(text)
    return text if len(text) <= n else text[:n] + " …"


def learning_check_skip(name: str) -> str:
    """Notebook 04's line for method `name` where SCOPE's learning check stands."""
    return (f"{name}: the learning check here is SCOPE's (its Solver on the held-out tasks); {name}'s answering "
            "checkpoint meets the same held-out yardstick in `scope compare-methods` (docs/methods.md, \"Methods "
            "compared\"; notebook 07).")


def evaluation_skips(name: str) -> dict[str, str]:
    """Notebook 05's SCOPE-only sections, each with the one line it prints for method `name`."""
    return {
        "coevolution": f"{name}: no co-evolution matrix: it grades Challenger_i's pooled tasks against SCOPE's rubrics "
                       f"(iter_NN/pool/tasks.jsonl), which {name} does not write.",
        "held_out_matrix": f"{name}: no held-out matrix: it has SCOPE's Challenger write tasks for the Judge's gates "
                           "and rubrics.",
        "self_judge": f"{name}: no self-Judge gap: its training reward is not SCOPE's rubric grader.",
        "leave_one_out": f"{name}: no Table 6: leave-one-out task types are SCOPE's.",
    }


def probe_table(probes) -> Any:
    """The Judge stages' probes a run stored (`selfplay.stage_probes.StageProbes.rows()`), one row each."""
    import pandas as pd

    return pd.DataFrame(probes.rows()).drop(columns="reasons").round(2)


# -- the report of one method ------------------------------------------------------------------------------------


@dataclass
class Exploration:
    """Notebook 02's batch: SCOPE's live Challenger rollouts and their gates, or another method's Stage 1 records."""

    prompts: list = field(default_factory=list)
    trajectories: list = field(default_factory=list)
    stats: Any = None
    records: list = field(default_factory=list)
    formats: list = field(default_factory=list)
    frame: Any = None
    gated: list = field(default_factory=list)
    outcomes: list = field(default_factory=list)


class MethodReport:
    """What notebooks 02, 04 and 05 draw for one method. The base draws what every method's run has: its trained
    stages' metrics.jsonl, each role's reward terms per step and per iteration, the searches of the roles that search;
    a method adds its records' tables and examples."""

    name = ""
    #: role (as metrics.jsonl and `harness.Method.roles` name it) -> its name in the method's paper.
    role_names: dict[str, str] = {}
    #: metrics.jsonl columns drawn per role as "reward components per step".
    reward_terms: dict[str, list[str]] = {}
    #: (role, metrics column, axis title) drawn per iteration.
    per_iteration: list[tuple[str, str, str]] = []
    #: The stage folder of the task writer's records (Stage 1's `rollouts.jsonl`).
    writer_stage = "challenger"
    #: section -> the one line a notebook prints where the section does not apply to the method.
    skips: dict[str, str] = {}

    @property
    def method(self):
        return METHODS[self.name]

    def skip(self, section: str) -> str | None:
        """The one-line note for a section that does not apply to this method, or None when it does."""
        return self.skips.get(section)

    def role_name(self, role: str) -> str:
        return self.role_names.get(role, role.capitalize())

    # -- notebook 04 ----------------------------------------------------------------------------------------

    def metrics(self, run_dir) -> Any:
        """Every training step of the run, one row per step, from the folder of each stage that trains a role
        (`harness.Method.stages`), with `global_step` counting a role's steps across iterations."""
        return analysis.training_metrics(run_dir, tuple((s.name, s.trains) for s in self.method.stages if s.trains))

    def opening(self, params: Params, metrics, n_alarms: int) -> str:
        records = len(self.writer_records(params.run_dir))
        return (f"{params.show_path(params.run_dir)}: {self.name.upper()}, {params.selfplay.iterations} iteration(s), "
                f"{len(metrics)} training steps, {records} {self.role_name('challenger')} records, "
                f"{n_alarms} health alarm(s)")

    def reward_figures(self, metrics) -> list:
        items: list = []
        for role, terms in self.reward_terms.items():
            figure = analysis.reward_components_figure(metrics, role, terms, self.role_name(role))
            items.append(figure if figure is not None else
                         f"No {self.role_name(role)} training steps with rewards yet (see the health panel below).")
        return items

    def iteration_frame(self, metrics) -> Any:
        """One row per iteration: the mean of each `per_iteration` measure over the role's steps."""
        import pandas as pd

        rows = []
        for t in sorted(metrics["iteration"].unique()) if len(metrics) else []:
            row: dict[str, Any] = {"iteration": int(t)}
            for role, column, label in self.per_iteration:
                steps = metrics[(metrics["role"] == role) & (metrics["iteration"] == t)]
                values = steps[column].dropna() if column in steps else []
                row[label] = float(values.mean()) if len(values) else None
            rows.append(row)
        return pd.DataFrame(rows)

    def iteration_figures(self, run_dir, metrics) -> list:
        import plotly.express as px

        frame = self.iteration_frame(metrics)
        labels = [label for *_, label in self.per_iteration if label in frame and frame[label].notna().any()]
        if not labels:
            return [f"No {self.name.upper()} step has these measures yet."]
        long = frame.melt(id_vars="iteration", value_vars=labels, var_name="measure")
        fig = px.line(long, x="iteration", y="value", color="measure", markers=True,
                      title=f"{self.name.upper()}: per iteration", labels={"value": "mean over the steps"})
        return [analysis.integer_axis(fig, frame["iteration"])]

    def search_figures(self, metrics) -> list:
        items: list = []
        for role, rules in self.method.roles.items():
            if not rules.searches:
                items.append(f"The {self.role_name(role)} never searches ({self.name.upper()}): no searches to draw.")
                continue
            figure = analysis.step_figure(metrics, role, "searches_per_rollout",
                                          f"Valid searches per {self.role_name(role)} rollout, per step",
                                          "valid searches per rollout")
            items.append(figure if figure is not None else f"No {self.role_name(role)} training steps yet.")
        return items

    def writer_records(self, run_dir) -> list[tuple[int, dict]]:
        return _records(run_dir, self.writer_stage)

    def task_checks(self, params: Params) -> list:
        """The task writer's records: what was valid, how it was verified and rewarded (the method's)."""
        raise NotImplementedError

    def examples(self, run_dir) -> list[str]:
        raise NotImplementedError

    def learning_check(self, params: Params, run, control) -> tuple[Any, list]:
        return None, [self.skips["learning_check"]]

    # -- notebook 05 ----------------------------------------------------------------------------------------

    def checkpoints(self, params: Params) -> list:
        """What notebook 05 evaluates: base, and the weights that answer for the run (`method_comparison.
        answering_checkpoint`: with one shared policy, the newest stage that trained it, e.g. SPICE's Challenger stage
        when its Reasoner stage was skipped)."""
        from scope_lib.evaluation.evaluate import available_checkpoints
        from scope_lib.evaluation.method_comparison import answering_checkpoint

        answering = answering_checkpoint(params)
        return [c for c in available_checkpoints(params) if c.kind == "base"] + ([answering] if answering else [])

    def result(self, run_dir, metrics, n_alarms: int, check=None) -> str:
        records = self.writer_records(run_dir)
        valid = sum(1 for _, r in records if r.get("valid"))
        solver = metrics[metrics["role"] == "solver"] if len(metrics) else metrics
        rewards = solver["reward"].dropna() if "reward" in solver else []
        parts = [f"{valid} of {len(records)} {self.role_name('challenger')} records valid",
                 f"{self.role_name('solver')} reward {rewards.iloc[0]:.2f} → {rewards.iloc[-1]:.2f} over "
                 f"{len(rewards)} steps" if len(rewards) else f"no {self.role_name('solver')} step",
                 f"{n_alarms} alarm{'s' if n_alarms != 1 else ''}"]
        return ", ".join(parts)

    def summary_facts(self, params: Params, metrics, n_alarms: int) -> dict[str, Any]:
        records = self.writer_records(params.run_dir)
        return {"method": self.name, "iterations": params.selfplay.iterations, "training steps": len(metrics),
                f"{self.role_name('challenger')} records": len(records),
                "valid": sum(1 for _, r in records if r.get("valid")), "health alarms": n_alarms,
                "run folder": params.show_path(params.run_dir)}

    def iteration_table(self, run_dir, metrics) -> Any:
        return self.iteration_frame(metrics)

    # -- notebook 02: the task writer's prompt and its checks, from the run's Stage 1 records ------------------

    def explore(self, components, n_documents: int) -> Exploration:
        records = [r for _, r in self.writer_records(components.params.run_dir)]
        return Exploration(records=records)

    def prompt_sections(self, components) -> list:
        """The task writer's and the answerer's prompts as the run sent them (decoded from the records)."""
        run_dir = components.params.run_dir
        items: list = []
        # the answerer's prompt from its own stage, or from the answers that scored the task writer
        for role, logs in (("challenger", [(self.writer_stage, "rollouts")]),
                           ("solver", [("solver", "rollouts"), (self.writer_stage, "solver_rollouts")])):
            record = next((r for stage, log in logs for _, r in _records(run_dir, stage, log)
                           if (r.get("trajectory") or {}).get("prompt_ids")), None)
            if record is None:
                items.append(f"No {self.role_name(role)} record yet: run notebook 04 (or `scope train`).")
                continue
            text = components.tokenizer.decode(record["trajectory"]["prompt_ids"], skip_special_tokens=False)
            items.append(f"--- the {self.role_name(role)}'s prompt ({record['id']}, "
                         f"{len(record['trajectory']['prompt_ids'])} tokens):\n{text}")
        return items

    def rollout_sections(self, batch: Exploration) -> list:
        import pandas as pd

        if not batch.records:
            return [f"No {self.role_name('challenger')} record yet: `scope train` (or notebook 04) writes them; "
                    "this notebook then reads them back."]
        frame = pd.DataFrame([{"iteration": r["iteration"], "valid": bool(r.get("valid"))} for r in batch.records])
        return [frame.groupby("iteration")["valid"].agg(["size", "sum"]).rename(columns={"size": "records",
                                                                                        "sum": "valid"})]

    def format_sections(self, batch: Exploration) -> list:
        counts = reason_counts([(r["iteration"], r) for r in batch.records])
        return [counts] if len(counts) else []

    def gate_sections(self, batch: Exploration, components) -> list:
        return self.task_checks(components.params)

    def probe_sections(self, params: Params) -> list:
        """The Judge stages the run probed when it opened (`Method.judge_stages`; SSP's answer check when it checks
        by the judge), else the line saying why there is no probe."""
        from scope_lib.selfplay.stage_probes import stored_stage_probes

        probes = stored_stage_probes(params.run_dir)
        return [probe_table(probes)] if probes is not None and probes.configured() else [self.skips["gate_probes"]]

    def example_sections(self, batch: Exploration, params: Params) -> list:
        return self.examples(params.run_dir)

    def explore_summary(self, params: Params, batch: Exploration):
        from scope_lib.reports import notebook

        valid = sum(1 for r in batch.records if r.get("valid"))
        writer = self.role_name("challenger")
        return notebook.summary(f"{valid} of {len(batch.records)} {writer} records valid ({self.name.upper()})",
                                {"method": self.name, f"{writer} records": len(batch.records), "valid": valid,
                                 "run folder": params.show_path(params.run_dir)})


# -- SCOPE: what the notebooks drew before there were methods ----------------------------------------------------


class ScopeReport(MethodReport):
    name = "scope"
    role_names = {"challenger": "challenger", "solver": "solver"}

    # -- notebook 02: a live Challenger batch, its format scores and the gates ----------------------------------

    def explore(self, components, n_documents: int) -> Exploration:
        from scope_lib.reports import notebook
        from scope_lib.selfplay.tasks import challenger_format

        prompts, trajectories, stats = notebook.challenger_batch(components, n_documents, iteration=1)
        return Exploration(prompts, trajectories, stats,
                           formats=[challenger_format(t, components.dialect) for t in trajectories])

    def prompt_sections(self, components) -> list:
        import pandas as pd

        from scope_lib.protocol import prompts
        from scope_lib.protocol.dialects import DIALECTS

        P = components.params
        document = components.corpus.passages[0].document
        rows = []
        for name, dialect in DIALECTS.items():
            for task_type in P.selfplay.task_types:
                text = prompts.challenger_prompt(document, task_type, 2, dialect.search_example)
                rows.append({"dialect": name, "task type": prompts.TASK_TYPES[task_type].name,
                             "prompt tokens": len(components.tokenizer.encode(text, add_special_tokens=False))})
        return [pd.DataFrame({name: [d.search_example] for name, d in DIALECTS.items()}, index=["search action"]).T,
                pd.DataFrame(rows).pivot(index="task type", columns="dialect", values="prompt tokens"),
                prompts.challenger_prompt(document, P.selfplay.task_types[0], 2, components.dialect.search_example)]

    def rollout_sections(self, batch: Exploration) -> list:
        import pandas as pd

        stats = batch.stats
        return [pd.crosstab(pd.Series([p.task_type for p in batch.prompts], name="task type"),
                            pd.Series([p.expected_searches for p in batch.prompts], name="expected searches N")),
                pd.DataFrame([{"rollouts": len(batch.trajectories), "turns": stats.turns,
                               "engine calls": stats.engine_calls, "retrieval calls": stats.retrieval_calls,
                               "tokens generated": stats.generated_tokens,
                               "generation s": round(stats.generation_s, 2), "retrieval s": round(stats.retrieval_s, 2),
                               "other s": round(stats.overhead_s, 2)}])]

    def format_sections(self, batch: Exploration) -> list:
        import pandas as pd

        batch.frame = pd.DataFrame([{
            "task type": t.meta["task_type"], "N": t.expected_searches, "finish": t.finish, "turns": len(t.turns),
            "valid searches": t.n_valid_searches, "malformed": t.n_malformed_searches, "think": f.think,
            "tool": f.tool, "structure": f.structure, "format": f.total, "task": t.task}
            for t, f in zip(batch.trajectories, batch.formats, strict=False)])
        return [batch.frame["finish"].value_counts().rename_axis("finish").to_frame("rollouts"),
                batch.frame.groupby("task type")[["think", "tool", "structure", "format", "valid searches"]]
                .mean().round(2)]

    def gate_sections(self, batch: Exploration, components) -> list:
        import pandas as pd
        import plotly.express as px

        batch.gated = [(t, p) for t, p, f in zip(batch.trajectories, batch.prompts, batch.formats, strict=False)
                       if t.task and f.total > 0]
        batch.outcomes = components.judge.gates([t.task for t, _ in batch.gated], [p.document for _, p in batch.gated])
        gate_rows = [{"task type": t.meta["task_type"], "gate": g, "verdict": v}
                     for (t, _), o in zip(batch.gated, batch.outcomes, strict=False) for g, v in o.verdicts.items()]
        items: list = [f"{len(batch.gated)} of {len(batch.trajectories)} rollouts wrote a task with a non-zero format "
                       f"score; {sum(o.passed for o in batch.outcomes)} passed every gate",
                       pd.DataFrame(components.judge.stats.table())]
        if not gate_rows:
            items.append("No task reached the gates. Raw Challenger turns (first 300 characters):")
            items += [f"--- {t.id} ({t.finish}): {repr(t.turns[0][:300]) if t.turns else '(no turn)'}"
                      for t in batch.trajectories[:3]]
            return items
        gates = pd.DataFrame(gate_rows)
        gates["result"] = gates["verdict"].map({1: "pass", 0: "fail"}).fillna("unparseable")
        by_type = gates.pivot_table(index="task type", columns="gate", values="verdict",
                                    aggfunc=lambda v: (v == 1).mean())
        items.append(px.bar(gates.groupby(["gate", "result"]).size().reset_index(name="tasks"), x="gate", y="tasks",
                            color="result", title="Gate verdicts", labels={"tasks": "tasks"}))
        items.append(by_type.round(2).rename_axis("pass rate", axis=1))
        return items

    def probe_sections(self, params: Params) -> list:
        from scope_lib.selfplay.stage_probes import stored_stage_probes

        probes = stored_stage_probes(params.run_dir)
        if probes is None:
            return [f"No probe of the gates stored in {params.show_path(params.run_dir)} yet: `scope train` (or "
                    "notebook 04) probes the Judge when the run opens."]
        return [probe_table(probes)]

    def example_sections(self, batch: Exploration, params: Params) -> list:
        items = []
        for t, o in [(t, o) for (t, _), o in zip(batch.gated, batch.outcomes, strict=False)][:3]:
            lines = [f"[{t.meta['task_type']}, N={t.expected_searches}] gates: {o.verdicts}"]
            lines += [f"  search {s.turn + 1}: {s.query!r} -> {s.hit_ids}" for s in t.searches]
            items.append("\n".join(lines + [f"  TASK: {t.task}\n"]))
        return items or ["No example to show: no rollout produced a task (see the finish table above)."]

    def explore_summary(self, params: Params, batch: Exploration):
        from scope_lib.reports import notebook

        explore = notebook.save_challenger_batch(params.run_dir, batch.prompts, batch.trajectories)
        rollouts = batch.frame
        wrote, passed = int(rollouts["task"].notna().sum()), sum(o.passed for o in batch.outcomes)
        return notebook.summary(
            f"{wrote} of {len(batch.trajectories)} Challenger rollouts wrote a task, {passed} passed both gates; "
            f"mean format score {rollouts['format'].mean():.2f}",
            {"rollouts": len(batch.trajectories), "wrote a task": wrote,
             "mean format score": round(rollouts["format"].mean(), 3), "passed both gates": passed,
             "saved to": params.show_path(explore)})

    # -- notebook 04 ----------------------------------------------------------------------------------------

    def opening(self, params: Params, metrics, n_alarms: int) -> str:
        candidates = analysis.pool_candidates(params.run_dir)
        return (f"{params.show_path(params.run_dir)}: {params.selfplay.iterations} iteration(s), {len(metrics)} "
                f"training steps, {len(candidates)} candidate tasks, {n_alarms} health alarm(s)")

    def reward_figures(self, metrics) -> list:
        return [figure if (figure := analysis.reward_components_figure(metrics, role)) is not None
                else f"No {role} training steps with rewards yet (see the health panel below)."
                for role in ("challenger", "solver")]

    def iteration_figures(self, run_dir, metrics) -> list:
        figure = analysis.iteration_figure(analysis.iteration_summary(run_dir), "solver rubric score",
                                           "Mean rubric score g of the Solver's training rollouts, per iteration",
                                           "mean rubric score g (eq. 1)", range_y=[0, 1])
        return ["No Solver step has been graded yet."] if figure is None else [figure]

    def task_checks(self, params: Params) -> list:
        import plotly.express as px

        candidates = analysis.pool_candidates(params.run_dir)
        if candidates.empty:
            return ["No candidate tasks yet."]
        items: list = [candidates.groupby(["iteration", "outcome"]).size().unstack(fill_value=0)]
        scored = candidates.dropna(subset=["g-bar"])
        if scored.empty:
            items.append("No candidate reached the Solver rollouts, so no ḡ to plot.")
        else:
            lo, hi = params.selfplay.difficulty_window
            scored = scored.assign(stage=scored["kept"].map({True: "kept (pool)", False: "discarded"}))
            fig = px.histogram(scored, x="g-bar", color="stage", facet_col="iteration", nbins=20, range_x=[0, 1],
                               title="ḡ of the candidate tasks, with the difficulty window",
                               labels={"g-bar": "ḡ: mean rubric score of S_{t-1}"})
            fig.add_vrect(x0=lo, x1=hi, opacity=0.12, line_width=0)
            items.append(fig)
        gates = analysis.gate_pass_by_task_type(candidates)
        if len(gates):
            items.append(px.bar(gates.astype({"iteration": str}), x="task type", y="gate pass rate", color="iteration",
                                barmode="group", range_y=[0, 1], title="Quality-gate pass rate by task type"))
        return items

    def search_figures(self, metrics) -> list:
        figures = [analysis.step_figure(metrics, "solver", "searches_per_rollout",
                                        "Valid searches per Solver rollout, per step", "valid searches per rollout"),
                   analysis.step_figure(metrics, "solver", "answer_tokens",
                                        "Answer length per Solver rollout, per step", "answer tokens |a|")]
        if all(f is None for f in figures):
            return ["No Solver training steps yet."]
        return [f for f in figures if f is not None]

    def checkpoints(self, params: Params) -> list:
        from scope_lib.evaluation.evaluate import available_checkpoints

        return available_checkpoints(params)

    def learning_check(self, params: Params, run, control) -> tuple[Any, list]:
        from scope_lib.evaluation.evaluate import available_checkpoints
        from scope_lib.evaluation.held_out import CheckComponents
        from scope_lib.evaluation.learning_check import run_check

        trained = [c for c in available_checkpoints(params) if c.kind != "base"]
        if not params.learning_check.held_out_documents:
            return None, ["learning_check.held_out_documents is 0: no documents were held out from training, so no "
                          "check."]
        if not trained:
            return None, ["No trained Solver checkpoint yet (see the health panel)."]
        check = run_check(params, trained[-1], control=control,
                          components=CheckComponents(run.engine, run.judge, run.retriever, run.dialect, run.passages))
        g = check.held_out.grader
        return check, [analysis.learning_check_table(check).round(3), analysis.learning_check_figure(check),
                       f"the Judge's grader probe: {g.numbers()} -> {'trusted' if g.trusted else 'UNTRUSTED'}",
                       check.verdict.reason]

    def examples(self, run_dir) -> list[str]:
        examples = analysis.example_tasks(run_dir)
        if not examples:
            return ["No pooled task yet: the task pool is empty (see the health panel)."]
        items = []
        for ex in examples:
            lines = [f"--- iteration {ex['iteration']} · {ex['task type']} · ḡ = {ex['g-bar']}", f"TASK: {ex['task']}"]
            lines += [f"  [{priority}] {text}  ->  {verdict}" for (priority, text), verdict
                      in zip(ex["rubrics"], ex["verdicts"] or [None] * len(ex["rubrics"]), strict=False)]
            lines += [f"SEARCHES: {ex['searches']}",
                      f"ANSWER: {(ex['answer'] or '(none)')[:800]} \n(rubric score {ex['rubric score']})\n"]
            items.append("\n".join(lines))
        return items

    def result(self, run_dir, metrics, n_alarms: int, check=None) -> str:
        return analysis.training_result(metrics, analysis.pool_candidates(run_dir), n_alarms, check)

    def summary_facts(self, params: Params, metrics, n_alarms: int) -> dict[str, Any]:
        candidates = analysis.pool_candidates(params.run_dir)
        return {"iterations": params.selfplay.iterations, "training steps": len(metrics),
                "candidate tasks": len(candidates),
                "pool tasks": int(candidates["kept"].sum()) if len(candidates) else 0,
                "health alarms": n_alarms, "run folder": params.show_path(params.run_dir)}

    def iteration_table(self, run_dir, metrics) -> Any:
        return analysis.iteration_summary(run_dir)


# -- SPICE: attempts, validity and rule verification; gold answers instead of rubrics ------------------------------


class SpiceReport(MethodReport):
    name = "spice"
    role_names = {"challenger": "Challenger", "solver": "Reasoner"}
    reward_terms = {"challenger": ["reward", "task_rate", "attempt_valid_rate", "pass_rate"],
                    "solver": ["reward", "boxed_rate"]}
    per_iteration = [("challenger", "attempt_valid_rate", "valid attempts"),
                     ("challenger", "pass_rate", "Reasoner pass rate on valid tasks"),
                     ("solver", "reward", "Reasoner reward 1[â = a*]")]
    skips = {"learning_check": learning_check_skip("SPICE"),
             "gate_probes": "SPICE has no Judge, so no gate to probe: its tasks are checked by parsing (validity) and "
                            "the Reasoner's answers by rule against the gold answer (verification).",
             **evaluation_skips("SPICE")}

    def pass_rates(self, run_dir) -> Any:
        """The kept valid tasks: the Reasoner's pass rate p over its K answers and the Challenger's reward."""
        import pandas as pd

        return pd.DataFrame([{"iteration": t, "id": r["id"], "answer type": r["answer_type"],
                              "pass rate p": r["pass_rate"], "reward r_C": r["reward"]}
                             for t, r in _records(run_dir, "challenger") if r.get("valid")])

    def task_checks(self, params: Params) -> list:
        import plotly.express as px

        run_dir = params.run_dir
        attempts = _records(run_dir, "challenger", "attempts")
        if not attempts:
            return ["No Challenger attempt yet."]
        counts = reason_counts(attempts)
        items: list = ["Validity of every attempt (the gates' place: a task must parse as JSON of its answer type):",
                       counts, _reasons_figure(counts, "SPICE: why each Challenger attempt was valid or not")]
        import pandas as pd

        kinds = pd.DataFrame([{"answer type": r["answer_type"], "valid": bool(r.get("valid"))} for _, r in attempts])
        items.append(kinds.groupby("answer type")["valid"].agg(["size", "sum"])
                     .rename(columns={"size": "attempts", "sum": "valid"}))
        rates = self.pass_rates(run_dir)
        if rates.empty:
            items.append("No valid task, so no Reasoner verification and no Gaussian reward to draw.")
            return items
        ps = [i / 100 for i in range(101)]
        fig = px.scatter(rates, x="pass rate p", y="reward r_C", color="answer type", range_x=[-0.05, 1.05],
                         title="SPICE: the Reasoner's pass rate and the Challenger's Gaussian reward (eq. 1)")
        fig.add_scatter(x=ps, y=[difficulty_reward(p, shape="spice") for p in ps], mode="lines", name="eq. 1",
                        line={"color": "gray", "dash": "dot"})
        items += [fig, rates.groupby("iteration")[["pass rate p", "reward r_C"]].mean().round(3)]
        return items

    def examples(self, run_dir) -> list[str]:
        answers: dict[str, list[dict]] = {}
        for _, r in _records(run_dir, "challenger", "solver_rollouts"):
            answers.setdefault(r["task_id"], []).append(r)
        items = []
        for t, r in [(t, r) for t, r in _records(run_dir, "challenger") if r.get("valid")][:3]:
            task = r["task"]
            lines = [f"--- iteration {t} · {task['answer_type']} · pass rate {r['pass_rate']} · r_C {r['reward']:.3f}",
                     f"QUESTION: {_clip(task['question'])}"]
            lines += [f"  {chr(65 + i)}) {o}" for i, o in enumerate(task.get("options") or [])]
            lines.append(f"GOLD ANSWER: {task['answer']}   (the rubric's place: checked by rule)")
            lines += [f"  REASONER: {a['answer']!r} -> {'verified' if a['verified'] else 'wrong'}"
                      for a in answers.get(r["id"], [])]
            items.append("\n".join(lines))
        if not items:
            first = next((r for _, r in _records(run_dir, "challenger", "attempts")), None)
            items.append("No valid task yet." + (f" An attempt ({first['invalid_reason']}): {_clip(first['reply'])!r}"
                                                  if first else ""))
        return items


# -- SSP: questions, rule filters, RAG verification, 1 - p rewards and the replay buffer ----------------------------


class SspReport(MethodReport):
    name = "ssp"
    role_names = {"challenger": "Proposer", "solver": "Solver"}
    reward_terms = {"challenger": ["reward", "valid_rate", "filter_pass_rate", "rag_pass_rate", "solver_success"],
                    "solver": ["reward", "pass_rate", "answer_rate"]}
    per_iteration = [("challenger", "valid_rate", "valid questions"),
                     ("challenger", "solver_success", "Solver success on valid questions"),
                     ("solver", "reward", "Solver reward 1[a = a*]")]
    skips = {"learning_check": learning_check_skip("SSP"),
             "gate_probes": "SSP has no Judge gate to probe: its questions pass rule filters, then RAG verification (a "
                            "no-search answer from the Proposer's own results and noise). With ssp.answer_check: judge "
                            "and judge.calibration.enabled, its Correct/Wrong answer check is probed when the run "
                            "opens and shown here.",
             **evaluation_skips("SSP")}

    def buffer_table(self, run_dir) -> Any:
        """Per iteration, the Solver stage's replay: new questions, those drawn from the buffer, the buffer's size."""
        import pandas as pd

        rows = []
        for t, summary in _summaries(run_dir, "solver"):
            replay = summary.get("replay") or {}
            stored = analysis._jsonl(Path(run_dir) / f"iter_{t:02d}" / "solver" / "replay_buffer.jsonl")
            rows.append({"iteration": t, "period": replay.get("period"), "new questions": replay.get("new"),
                         "from the buffer": replay.get("from_buffer"), "buffer size": replay.get("buffer"),
                         "buffer records": len(stored)})
        return pd.DataFrame(rows)

    def task_checks(self, params: Params) -> list:
        import pandas as pd
        import plotly.express as px

        run_dir = params.run_dir
        proposals = _records(run_dir, "challenger")
        if not proposals:
            return ["No Proposer record yet."]
        filters = reason_counts(proposals, "filter_reason", valid="passed the filters")
        outcomes = reason_counts(proposals)
        items: list = ["Rule filters (§3.3; the gates' place), then RAG verification of those that passed:", filters,
                       _reasons_figure(filters, "SSP: the rule filters' reasons")]
        rag = pd.DataFrame([{"iteration": t, "RAG verified": r["rag_verified"]} for t, r in proposals
                            if r.get("rag_verified") is not None])
        if rag.empty:
            items.append("No question passed the filters, so no RAG verification.")
        else:
            items.append(rag.groupby("iteration")["RAG verified"].agg(["size", "sum"])
                         .rename(columns={"size": "RAG checked", "sum": "RAG passed"}))
        items += ["Each proposal's outcome (valid, or the first check it failed):", outcomes]
        solved = pd.DataFrame([{"iteration": t, "success rate p": r["success_rate"], "reward 1 - p": r["reward"]}
                               for t, r in proposals if r.get("valid")])
        if solved.empty:
            items.append("No valid question, so no Solver success rate and no 1 - p reward to draw.")
        else:
            fig = px.scatter(solved, x="success rate p", y="reward 1 - p", range_x=[-0.05, 1.05], range_y=[-0.05, 1.05],
                             title="SSP: the Proposer's reward 1 - p against the Solver's success rate (eq. 7)")
            fig.add_scatter(x=[0, 1], y=[1, 0], mode="lines", name="1 - p", line={"color": "gray", "dash": "dot"})
            items.append(fig)
        items += ["The replay buffer (App. B.1, reset every `ssp.replay_reset_steps` Proposer steps):",
                  self.buffer_table(run_dir)]
        return items

    def examples(self, run_dir) -> list[str]:
        items = []
        for t, r in [(t, r) for t, r in _records(run_dir, "challenger") if r.get("question")][:3]:
            items.append("\n".join([
                f"--- iteration {t} · answer {r['answer']!r} ({r.get('answer_kind')}) · {r['n_valid_searches']} of "
                f"{r['num_searches']} searches · {r.get('invalid_reason') or 'valid'}",
                f"QUESTION: {_clip(r['question'])}",
                f"GROUND TRUTH: {r['answer']}   (the rubric's place: answers are checked against it)",
                f"RAG ANSWER: {r.get('rag_answer')!r} (verified {r.get('rag_verified')})",
                f"SOLVER: solved {r.get('solved')}, success rate {r.get('success_rate')}, reward {r['reward']}"]))
        if not items:
            first = next((r for _, r in _records(run_dir, "challenger")), None)
            turn = ((first or {}).get("trajectory") or {}).get("turns") or [""]
            items.append("No proposal wrote a question yet." +
                         (f" A proposal ({first['invalid_reason']}): {_clip(turn[-1])!r}" if first else ""))
        return items


# -- SCORE: rubrics and weights, the consistency reward, the meta-harness ----------------------------------------


class ScoreReport(MethodReport):
    name = "score"
    role_names = {"challenger": "Evaluator", "solver": "Solver"}
    writer_stage = "rubric"
    reward_terms = {"challenger": ["reward", "reward_eval", "baseline", "rubric_valid_rate"],
                    "solver": ["reward", "report_valid_rate", "evaluation_valid_rate", "consistency", "zeroed_queries"]}
    per_iteration = [("solver", "consistency", "consistency C_q of the reports"),
                     ("challenger", "rubric_valid_rate", "valid rubrics"),
                     ("solver", "reward", "Solver reward R_s")]
    skips = {"learning_check": learning_check_skip("SCORE"),
             "gate_probes": "SCORE has no gates: the Evaluator's rubric is checked against the harness (validity), its "
                            "scores by the reward verifier (searches, a valid rubric).",
             **evaluation_skips("SCORE")}

    def weights(self, run_dir) -> Any:
        """Every valid rubric's dimensions with their weights (one row per dimension of a rubric)."""
        import pandas as pd

        return pd.DataFrame([{"iteration": t, "query": r["id"], "dimension": d, "weight": w}
                             for t, r in _records(run_dir, "rubric") if r.get("rubric")
                             for d, w in zip(r["rubric"]["dimensions"], r["rubric"]["weights"], strict=True)])

    def harness_table(self, run_dir) -> Any:
        import pandas as pd

        return pd.DataFrame([{"iteration": t, "refreshed": s.get("refreshed"), "accepted": s.get("accepted"),
                              "reason": s.get("reason"), "k": (s.get("harness") or {}).get("k"),
                              "must include": ", ".join((s.get("harness") or {}).get("must_include") or []),
                              "min searches": (s.get("harness") or {}).get("min_number_of_tool_call")}
                             for t, s in _summaries(run_dir, "harness") if s])

    def task_checks(self, params: Params) -> list:
        import pandas as pd
        import plotly.express as px

        run_dir = params.run_dir
        rubrics = _records(run_dir, "rubric")
        if not rubrics:
            return ["No rubric record yet."]
        counts = reason_counts(rubrics)
        items: list = ["The Evaluator's rubrics, checked against the harness (the gates' place):", counts,
                       _reasons_figure(counts, "SCORE: why each rubric was valid or not")]
        weights = self.weights(run_dir)
        if weights.empty:
            items.append("No valid rubric, so no dimension weights to draw.")
        else:
            items.append(px.box(weights, x="dimension", y="weight", title="SCORE: the rubrics' dimension weights"))
            items.append(weights.groupby("dimension")["weight"].agg(["size", "mean"]).round(3)
                         .rename(columns={"size": "rubrics"}))
        evaluations = _records(run_dir, "solver", "evaluations")
        if evaluations:
            items += ["The reward verifier (why a query's rewards were zeroed) and the consistency C_q:",
                      reason_counts(evaluations, "zero_reason", valid="not zeroed"),
                      pd.DataFrame([{"iteration": t, "query": e["query_id"], "searches": e["searches"],
                                     "required": e["required_searches"], "zeroed": e["zeroed"],
                                     "consistency C_q": e["consistency"]} for t, e in evaluations])]
        evaluator = _records(run_dir, "evaluator")
        if evaluator:
            items.append(pd.DataFrame([{"iteration": t, "query": r["query_id"], "rubric valid": r["rubric_valid"],
                                        "R_e": r["reward_e"], "baseline before": r["baseline_before"],
                                        "advantage": r["advantage"]} for t, r in evaluator]))
        items += ["The meta-harness (§3.3: rewritten every 5 steps):", self.harness_table(run_dir)]
        return items

    def examples(self, run_dir) -> list[str]:
        evaluations = {e["query_id"]: e for _, e in _records(run_dir, "solver", "evaluations")}
        items = []
        for t, r in _records(run_dir, "rubric")[:3]:
            e = evaluations.get(r["id"], {})
            rubric = r.get("rubric")
            weights = (", ".join(f"{d} {w:.2f}" for d, w in zip(rubric["dimensions"], rubric["weights"], strict=True))
                       if rubric else f"invalid ({r['invalid_reason']})")
            items.append("\n".join([f"--- iteration {t} · {r['id']}", f"QUERY: {r['query']}",
                                    f"RUBRIC (the gold answer's place): {weights}",
                                    f"SCORES: {e.get('scores')}", f"REWARDS: {e.get('rewards')} "
                                    f"(zeroed: {e.get('zero_reason')}), consistency {e.get('consistency')}"]))
        return items or ["No rubric record yet."]


#: method name (the params' `method`) -> its report.
REPORTS: dict[str, MethodReport] = {r.name: r for r in (ScopeReport(), SpiceReport(), SspReport(), ScoreReport())}

def report_for(params: Params) -> MethodReport:
    """The report of the run's method (`params.method`, as `selfplay.methods.method_for` reads it)."""
    return REPORTS[params.method]
