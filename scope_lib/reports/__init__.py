"""What notebooks call to show things: analysis tables and figures, notebook setup, execution and export.

analysis   tables and figures over a run folder
notebook   the notebooks' first cell: params, logging, components
export     papermill execution of the notebooks and self-contained HTML reports (`scope run`)
index_page the run's index.html: manifest facts and one line per report
"""
