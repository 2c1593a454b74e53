"""Evaluation (§4): the 15 benchmarks, their scorers and judge, the replay ablation and the paper's tables.

benchmarks    registry, native loaders and sampling of the benchmarks
scorers       scope_paper and official scoring per benchmark
judge         the benchmark judge client (OpenAI-compatible or local), cached
evaluate      checkpoints -> Solver rollouts -> judged scores (`scope eval`)
tables        Tables 2-3 from stored summaries, gains, the co-evolution matrix
replay        Table 4: one model's trajectory answered by another
paper_tables  the paper's published numbers
judge_probes  the benchmark judges' calibration probes (controlled pairs whose right verdict is known)
held_out      the learning check's held-out task set (M0's tasks on documents training never samples)
learning_check  checkpoints on the held-out set, the paired comparison and the verdict (`scope learning-check`)
"""
