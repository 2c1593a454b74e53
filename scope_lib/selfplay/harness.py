"""The shared harness every self-play method's stages run on (`scope_lib.selfplay.methods`).

    run = SelfPlayRun(...)          # corpus, index, policy, Judge, engine and the method, loaded once (loop.open_run)
    run.method.stages               # the method's stages, in order: each a name and the function that runs it

A `Method` says what its roles see, what a task is, how a task is verified and rewarded (its `RoleRules`, one per
trained role, handed to `training.train_role` through the `StageContext`), and what the stages of one iteration
are. The loop (`selfplay.loop`) only opens the run and calls the stages in order; what a stage does is the
method's. The helpers below are what every method's stages share: stage seeds, publishing roles to a serving
engine, resuming or clearing an interrupted training stage, DONE sentinels on the main rank.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from scope_lib.config import GRPOConfig, Params
from scope_lib.models.engine import Engine
from scope_lib.protocol.dialects import Dialect
from scope_lib.retrieval.api import Retriever
from scope_lib.retrieval.corpus import training_documents
from scope_lib.runs import Stage, iteration_dir
from scope_lib.selfplay import ranks
from scope_lib.selfplay.checkpoints import latest_checkpoint
from scope_lib.selfplay.judge import Judge
from scope_lib.selfplay.policy import Policy, serves_adapters
from scope_lib.selfplay.training import RoleRules, StageContext

log = logging.getLogger(__name__)


#: Each stage's place in its iteration's seeds (`stage_seed`). A method names its stages with these names or adds
#: its own (a new name needs a new offset below 10, the seeds' stride per iteration).
STAGE_OFFSETS = {"challenger": 1, "pool": 2, "solver": 3}


#: grpo.seed's default: a run with another grpo.seed is a replicate (`stage_seed`).
GRPO_SEED_DEFAULT = GRPOConfig.model_fields["seed"].default


def stage_seed(params: Params, iteration: int, stage: str) -> int:
    """The seed of one stage of one iteration (data order, rollouts, trainer). `selfplay.seed` fixes the documents
    (their permutation, the learning check's held-out tail); `grpo.seed` (with the LoRA initialisation) shifts every
    stage's sampling and data order, so runs that differ only in it are replicates on the same documents, which
    the learning check compares on the same held-out tasks. At its default it shifts nothing."""
    replicate = params.grpo.seed - GRPO_SEED_DEFAULT
    return params.selfplay.seed + 10 * (iteration - 1) + STAGE_OFFSETS[stage] + 1000 * replicate


def documents_start(r: SelfPlayRun, t: int, recorded_by: str) -> int:
    """Where iteration t's documents begin in the run's permutation: after everything earlier iterations used, as
    the stage `recorded_by` of iteration t - 1 recorded it (its summary's `documents`: [start, end])."""
    if t == 1:
        return 0
    previous = r.stage(t - 1, recorded_by).summary
    if "documents" not in previous:
        raise RuntimeError(f"iteration {t - 1}'s {recorded_by} stage is not finished; run the iterations in order")
    return previous["documents"][1]


@dataclass(frozen=True)
class StageSpec:
    """One stage of a method's iteration: its folder name (`iter_NN/<name>/`), the function that runs it (or
    returns the summary of a finished one) and the role it trains (None for a stage that trains nothing)."""

    name: str
    run: Callable[[SelfPlayRun, int], dict]
    trains: str | None = None


class Method:
    """A self-play method over the shared harness: its name, its stages and its roles' rules. Subclasses fill
    `name`, `stages` and `roles`; `selfplay.methods.METHODS` registers them by name (the params' `method`). What the
    run opens for it is the method's too: the retrieval index (`uses_index`) and the Judge stages whose verdicts it
    uses, which `loop.open_run` probes before they count (`judge_stages`)."""

    name: str = ""
    #: role name (`challenger`, `solver`, or the method's own) -> its rules.
    roles: dict[str, RoleRules] = {}
    #: Whether a role of the method searches the corpus: when False the run opens and checks no index, and its
    #: retriever is `NoIndex` (a search is a bug and says so).
    uses_index: bool = True

    def judge_stages(self, params: Params) -> frozenset[str]:
        """The Judge stages whose verdicts a run of this method uses with these params (of `judge.STAGES` and
        `judge.ANSWER_MATCH`): those `loop.open_run` probes (`judge.calibration`). None by default."""
        return frozenset()

    @property
    def stages(self) -> tuple[StageSpec, ...]:
        """The stages of one iteration, in order."""
        raise NotImplementedError

    def role_rules(self, role: str) -> RoleRules:
        """What `role` sees (its prompts), its rollout budgets, and how its rollouts are verified and rewarded."""
        if role not in self.roles:
            raise ValueError(f"{self.name.upper()} has no role {role!r}; it trains {', '.join(self.roles)}")
        return self.roles[role]


class NoIndex:
    """The retriever of a method that searches nothing (`Method.uses_index` False): no index is built, opened or
    checked, and a search raises instead of reading one."""

    def __init__(self, method: str):
        self.method = method

    def search(self, queries: list[str], k: int | None = None) -> list:
        raise RuntimeError(f"{self.method.upper()} searches nothing (its Method.uses_index is False, so the run "
                           f"opened no index), yet a rollout searched {len(queries)} query(ies): a rollout limit "
                           "lets it search (max_searches), or the method should set uses_index")


@dataclass
class SelfPlayRun:
    """Everything a method's stages work with, loaded once per process."""

    params: Params
    passages: list
    retriever: Retriever
    dialect: Dialect
    policy: Policy
    judge: Judge
    engine: Engine       # rollouts of both roles (the policy's engine unless a test gives another)
    method: Method
    alarms: list[dict] = field(default_factory=list)

    @property
    def run_dir(self):
        return self.params.run_dir

    def stage(self, iteration: int, name: str):
        return Stage(iteration_dir(self.run_dir, iteration) / name)

    @property
    def training_documents(self) -> int:
        """How many positions of the document permutation training may sample (`corpus.training_documents`)."""
        return training_documents(self.params, len(self.passages))


def publish_roles(r: SelfPlayRun, t: int, stage: str, roles: tuple[str, ...]) -> None:
    """Register the roles' current weights with a serving engine (vLLM, `vllm serve`) before a stage uses them;
    nothing to do when the engine generates with the trained model itself (hf)."""
    if not serves_adapters(r.engine):
        return
    folder = r.stage(t, stage).path / "serving"
    if ranks.distributed():  # each rank publishes to its own engine from its own folder
        folder = folder / f"rank{ranks.rank()}"
    for role in roles:
        r.policy.publish(role, folder / role, r.engine)


def reset_stage(r: SelfPlayRun, t: int, stage) -> None:
    """Before a training stage, the main rank resumes or clears what an interrupted attempt left
    (`restart_or_resume`); then every rank goes on."""
    if ranks.is_main():
        restart_or_resume(r, t, stage)
    ranks.barrier()


def mark_done(stage, summary: dict, saved=None) -> None:
    """Write the stage's DONE sentinel (the main rank; with the checksums of `saved` weights); every rank goes on
    once it is there."""
    if ranks.is_main():
        stage.mark_done(summary, saved=saved)
    ranks.barrier()


def stage_context(r: SelfPlayRun, t: int, role: str, stage, *, seed_stage: str | None = None) -> StageContext:
    """The StageContext of `role`'s training stage, with the method's rules for the role and the seed of
    `seed_stage` (default: the stage named after the role)."""
    return StageContext(r.params, t, role, r.policy, r.retriever, r.dialect, r.judge, stage,
                        seed=stage_seed(r.params, t, seed_stage or role), engine=r.engine, alarms=r.alarms,
                        rules=r.method.role_rules(role))


def restart_or_resume(r: SelfPlayRun, t: int, stage) -> None:
    """Before a training stage: keep what an interrupted attempt left when it has a complete mid-stage checkpoint
    (`run.checkpoint_steps`; train_role resumes from it), otherwise clear the folder, saying how many finished
    steps are discarded."""
    if r.params.run.checkpoint_steps and latest_checkpoint(stage.path / "trainer") is not None:
        return
    metrics = stage.path / "metrics.jsonl"
    finished = sum(1 for line in metrics.read_text().splitlines() if line.strip()) if metrics.is_file() else 0
    if finished:
        log.warning("iteration %d %s: an interrupted attempt finished %d step(s) but left no mid-stage checkpoint: "
                    "the stage restarts from its first step (set run.checkpoint_steps to resume mid-stage)", t,
                    stage.path.name, finished)
    stage.reset()


def trained_summary(result, *per_step: str, **extra) -> dict:
    """A training stage's DONE summary: its steps, seconds, saved folder and per-step `reward`, each name of
    `per_step` as its per-step list from the stage's metrics, then the method's `extra` counts."""
    summary = {"steps": result.steps, "seconds": round(result.seconds, 2), "saved": result.saved.name,
               "reward": [m.get("reward") for m in result.metrics]}
    summary.update({name: [m.get(name) for m in result.metrics] for name in per_step})
    summary.update(extra)
    return summary

