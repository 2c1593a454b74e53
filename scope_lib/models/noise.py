"""Library messages that say nothing to a researcher, dropped at the logger that emits them.

Importing the model stack (transformers, PEFT, TRL, vLLM) on a CPU-only machine makes four libraries log
notices about their own packaging: torchao cannot load the CUDA kernels it ships, torch deprecates
`register_constant` on the Enum subclasses torchao registers, bitsandbytes misses an optional kernel package, and
vLLM's CPU build finds a Triton without a usable backend. None of them changes what a run computes, and they open
every report and every `scope train` with a block of warnings. Each is matched by the logger that emits it *and*
the text of the message: any other message of those loggers (and every other logger, and every Python `warnings`
category) is left alone.
`quiet_library_noise()` installs the filters; the notebooks (`reports.notebook.init`) and the `scope` commands
call it before anything imports those libraries. `NOISE` lists what is dropped and why.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Noise:
    """Records of logger `logger` (exactly that name: filters apply where a record is created) whose message
    matches `pattern`."""

    logger: str
    pattern: str
    why: str

    def matches(self, record: logging.LogRecord) -> bool:
        return record.name == self.logger and re.search(self.pattern, record.getMessage()) is not None


NOISE = (
    Noise("torchao", r"^Failed to load .*torchao/_C_\w*.*\.so",
          "torchao's CUDA kernels (_C_mxfp8, _C_cutlass_90a) cannot load on a CPU-only torch; nothing here uses them"),
    Noise("torch.utils._pytree", r"is an Enum subclass and is now natively supported by torch\.compile",
          "torch's deprecation of register_constant() on the Enum subclasses torchao registers at import"),
    Noise("bitsandbytes.backends.cpu.ops", r"^Failed to load CPU gemm_4bit_forward from kernels-community",
          "bitsandbytes looks for an optional 4-bit CPU kernel package (`kernels`) and falls back to its own"),
    Noise("vllm.triton_utils.importing", r"^Triton (is )?(installed|not installed)",
          "vLLM's CPU build checks for a Triton GPU backend at import and disables it; generation does not use it"),
)


class _KnownNoise(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not any(n.matches(record) for n in NOISE)


_FILTER = _KnownNoise()


def quiet_library_noise() -> None:
    """Drop the messages of `NOISE` at their loggers (idempotent; the loggers need not exist yet)."""
    for name in {n.logger for n in NOISE}:
        logger = logging.getLogger(name)
        if _FILTER not in logger.filters:
            logger.addFilter(_FILTER)


def is_noise(text: str) -> bool:
    """Whether a line of captured output holds one of the messages of `NOISE` (the report tests use it)."""
    return any(re.search(n.pattern.lstrip("^"), text) for n in NOISE)
