"""The paper's text protocol and equations, pure (no models, no I/O beyond reading prompt templates),
and the other corpus self-play methods' beside them (SPICE, Search Self-Play, SCORE; `answer_set` also reads a file).

dialects   Table 11: search syntax per model family, render/parse, stop strings
prompts    Appendix H: Challenger, Solver, rubric writer, grader and gate prompts (templates in prompts/*.txt)
parsing    total parsers of tasks, answers, rubrics and scores (never raise)
rewards    equations 1-7 and Appendix F: rubric score, difficulty, length penalty, format and search rewards
facts      the names and years a rubric asks for, and fact pairs (stated, removed, swapped) for the probes
gate_rules the quality gates decided by word rules (`judge.gates_by`; not in the paper)
verification  the rule verifier of short answers (text, numbers, Math-Verify expressions, lists, booleans, letters)
spice      SPICE: the Challenger's JSON task, the Reasoner's boxed answer verified, eq. 1's rewards
ssp        Search Self-Play: the Proposer's rule filters, RAG verification's passages, eq. 6-7's rewards
answer_set Search Self-Play's answers from the corpus or a file, never from an evaluation set
score      SCORE: the Evaluator's rubric and K reports' scores, a(r)·(1 + Σ w s), TF-IDF consistency, EMA baseline, meta-harness
"""
