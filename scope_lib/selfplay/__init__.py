"""SCOPE self-play (§3, Algorithm 1): rollouts, the Judge, task evaluation, GRPO training, the loop.

rollout    batched multi-turn Challenger and Solver rollouts (one engine call per turn)
judge      the frozen Judge: gates, rubrics, binary grades (one engine call per stage)
tasks      task evaluation: format, gates, rubrics, Solver rollouts, grades -> R_C, R_S, the difficulty filter,
           and the task pool's batch step (`candidate_batch`)
policy     M0 and the two roles (LoRA adapters or full weights), adapter sync to a serving engine
training   TRL GRPO for one role and one stage
checkpoints  mid-stage checkpoints a killed training stage resumes from
ranks      several processes (torchrun, accelerate): shares, barriers, gathers
grader_probe  the self-Judge grader's calibration probe, and the calibration records every judge probe writes
stage_probes  the quality gates' and the rubric writer's calibration probes
health     alarms for a run that trains on nothing
loop       Algorithm 1: iterations of three stages, resumable (`scope train`)
"""
