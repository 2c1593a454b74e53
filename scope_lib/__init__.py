"""scope_lib: the library behind the SCOPE notebooks (arXiv 2605.31433).

Notebooks hold narrative, parameters, tables and plots; this package holds every piece of logic.
"""

__version__ = "0.1.0"
