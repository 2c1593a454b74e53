"""Evaluation (§4): the 15 benchmarks, their scorers and judge, the replay ablation and the paper's tables.

benchmarks    registry, native loaders and sampling of the benchmarks
scorers       scope_paper and official scoring per benchmark
judge         the benchmark judge client (OpenAI-compatible or local), cached
evaluate      checkpoints -> Solver rollouts -> judged scores (`scope eval`)
tables        Tables 2-3 from stored summaries, gains, the co-evolution matrix
replay        Table 4: one model's trajectory answered by another
paper_tables  the paper's published numbers
"""
