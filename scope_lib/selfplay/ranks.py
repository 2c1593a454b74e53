"""Several processes (ranks) of one `scope train`: who does what, through accelerate's own collectives.

`torchrun --nproc_per_node N -m scope_lib.cli train PARAMS` (or `accelerate launch`, or `scope train --processes
N`) starts N ranks. Every rank holds the policy and runs TRL's GRPOTrainer, which splits each step's prompts over
the ranks, gathers the rewards and averages the gradients (DDP; FSDP2 or ZeRO through an accelerate config). Each
rank generates the rollouts of its own share and asks the Judge about those only. The rest is ours:

- the main rank (rank 0) alone writes: records (gathered from every rank), metrics, DONE sentinels, adapters,
  the manifest and health alarms; the other ranks wait at a barrier after each write that they read;
- the task pool (Stage 2) splits each candidate batch over the ranks the same way and gathers the evaluations;
- every collective has `run.collective_timeout_s`: a rank that died (SIGKILL, out of memory) makes the others
  fail within that time instead of hanging, and the run resumes like any interrupted run.

With one process every function here is a no-op and nothing imports accelerate.
"""

from __future__ import annotations

import logging
import os
from datetime import timedelta
from typing import Any

log = logging.getLogger(__name__)


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def is_main() -> bool:
    return rank() == 0


def distributed() -> bool:
    return world_size() > 1


def init(timeout_s: float, *, cpu: bool) -> None:
    """Join the process group (gloo on CPU, NCCL on GPUs) with the collective timeout. accelerate's PartialState
    is a singleton: TRL's Accelerator later reuses this one, timeout included."""
    if not distributed():
        return
    from accelerate import PartialState

    state = PartialState(cpu=cpu, timeout=timedelta(seconds=timeout_s))
    log.info("rank %d of %d (pid %d, %s, %s backend), collective timeout %ss", state.process_index,
             state.num_processes, os.getpid(), state.distributed_type, state.backend, timeout_s)


def weights_digest(model) -> str:
    """sha256 over the trainable weights (a LoRA adapter's, or the whole model's): equal on every rank after a
    synchronised step. Logged by each rank at the end of a training stage."""
    import hashlib

    digest = hashlib.sha256()
    for name, tensor in sorted((n, p) for n, p in model.named_parameters() if p.requires_grad):
        digest.update(name.encode())
        digest.update(tensor.detach().float().cpu().numpy().tobytes())
    return digest.hexdigest()


def barrier() -> None:
    """Every rank waits here until all arrive (after the main rank wrote what the others read next)."""
    if distributed():
        from accelerate import PartialState

        PartialState().wait_for_everyone()


def gather(items: list[Any]) -> list[Any]:
    """The concatenation of every rank's `items`, in rank order, on every rank (picklable objects)."""
    if not distributed():
        return list(items)
    from accelerate.utils import gather_object

    return gather_object(list(items))


def broadcast(value: Any) -> Any:
    """The main rank's `value`, on every rank."""
    if not distributed():
        return value
    from accelerate.utils import broadcast_object_list

    return broadcast_object_list([value], from_process=0)[0]


def share(items: list[Any]) -> list[Any]:
    """This rank's contiguous share of `items` (the ranks' shares, in rank order, are `items` again)."""
    n, k, r = len(items), world_size(), rank()
    return items[r * n // k:(r + 1) * n // k]


def lost_rank_message(exc: BaseException) -> str:
    return (f"rank {rank()} of {world_size()}: another rank died or stopped answering ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else 'no detail'}); the run resumes from its records with the "
            "same command")


def is_collective_failure(exc: BaseException) -> bool:
    """A gloo/NCCL error or timeout of a collective (torch raises RuntimeError or DistBackendError)."""
    if not distributed():
        return False
    text = f"{type(exc).__name__} {exc}".lower()
    return any(word in text for word in ("gloo", "nccl", "connection", "timed out", "timeout", "distbackend",
                                         "peer", "broken pipe"))


def sharded_weights() -> str | None:
    """The launcher's sharding of the weights (FSDP, DeepSpeed ZeRO-3), read from the environment `accelerate
    launch` sets; None for DDP, ZeRO-1/2 and a single process."""
    if os.environ.get("ACCELERATE_USE_FSDP", "").lower() in ("1", "true"):
        return f"FSDP{os.environ.get('FSDP_VERSION', '1')}"
    if os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE") == "3":
        return "DeepSpeed ZeRO-3"
    return None


def check_generation_layout(backend: str) -> None:
    """Sharded weights need every rank in every forward pass; the hf engine's generate runs a different number
    of forwards on each rank (its own prompts, its own lengths) and would hang. Refuse that pairing up front."""
    sharding = sharded_weights()
    if sharding and backend == "hf":
        from scope_lib.config import ParamsError

        raise ParamsError(f"{sharding} shards the weights over the ranks, so engine.backend: hf cannot generate "
                          "rollouts on one rank alone: serve M0 with vLLM (engine.backend: openai with "
                          "engine.base_url: [...], docs/gpus.md), or train LoRA under DDP (accelerate/ddp.yaml)")
