"""Self-play methods over the shared harness (`selfplay.harness`): one module per method, registered by the name the
params' `method` key gives (`docs/methods.md`; adding one: `docs/architecture.md`).

    method = method_for(params)     # the run's Method: its stages and its roles' rules
"""

from __future__ import annotations

from scope_lib.config import Params, ParamsError
from scope_lib.selfplay.harness import Method
from scope_lib.selfplay.methods.scope import SCOPE
from scope_lib.selfplay.methods.score import SCORE
from scope_lib.selfplay.methods.spice import SPICE
from scope_lib.selfplay.methods.ssp import SSP

#: name (the params' `method`) -> the method.
METHODS: dict[str, Method] = {m.name: m for m in (SCOPE, SPICE, SSP, SCORE)}


def method_for(params: Params) -> Method:
    """The method `params.method` names."""
    if params.method not in METHODS:
        raise ParamsError(f"method: {params.method!r} is not a self-play method of this library; "
                          f"choose one of {', '.join(METHODS)}")
    return METHODS[params.method]
