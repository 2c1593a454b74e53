"""The smoke model (not in the paper): a scripted teacher, the warm start that teaches the tiny model the
protocol, and the measurements of what it learned. It sits above selfplay: the teacher drives the real
rollouts and Judge.

teacher          scripted Challenger, Solver and Judge traces through the real loop
warm_start       SFT of the tiny model on those traces, cached; `prepare(params)` before loading
protocol_check   parse rates and content checks on held-out documents
"""
