"""The paper's text protocol and equations, pure (no models, no I/O beyond reading prompt templates).

dialects   Table 11: search syntax per model family, render/parse, stop strings
prompts    Appendix H: Challenger, Solver, rubric writer, grader and gate prompts (templates in prompts/*.txt)
parsing    total parsers of tasks, answers, rubrics and scores (never raise)
rewards    equations 1-7 and Appendix F: rubric score, difficulty, length penalty, format and search rewards
facts      the names and years a rubric asks for, and fact pairs (stated, removed, swapped) for the probes
"""
