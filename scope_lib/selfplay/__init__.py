"""SCOPE self-play (§3, Algorithm 1): rollouts, the Judge, task evaluation, GRPO training, the loop.

rollout    batched multi-turn Challenger and Solver rollouts (one engine call per turn)
judge      the frozen Judge: gates, rubrics, binary grades (one engine call per stage)
tasks      task evaluation: format, gates, rubrics, Solver rollouts, grades -> R_C, R_S, the difficulty filter
policy     M0 and the two roles (LoRA adapters or full weights), adapter sync to a serving engine
training   TRL GRPO for one role and one stage
health     alarms for a run that trains on nothing
loop       Algorithm 1: iterations of three stages, resumable (`scope train`)
"""
