"""What notebooks call to show things: analysis tables and figures, notebook setup, execution and export.

analysis   tables and figures over a run folder
notebook   the notebooks' first cell: params, logging, components
export     papermill execution of the notebooks and HTML reports (`scope run`)
"""
