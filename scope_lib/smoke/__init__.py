"""The smoke model (not in the paper): a scripted teacher, the warm start that teaches the tiny model the
protocol, and the measurements of what it learned. It sits above selfplay: the teacher drives the real
rollouts and Judge.

teacher             scripted Challenger, Solver and Judge traces through the real loop
eval_judge_teacher  traces of the evaluation judges' prompts (short-form QA judge, criterion grader)
sft                 the SFT both warm starts run (TRL's SFTTrainer, full or LoRA)
warm_start          SFT of M0 on those traces, cached; `prepare(params)` before loading
judge_adapter       the local evaluation judges' LoRA adapter on M0 (`evaluation.judge_adapter`), cached
protocol_check      parse rates and content checks on held-out documents
"""
