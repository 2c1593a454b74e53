"""The shipped accelerate configs (accelerate/*.yaml, issue 24): each parses, and `accelerate launch`'s own
validation turns it into the launch environment of its layout (checked without launching: no GPU here)."""

from __future__ import annotations

from pathlib import Path

import pytest

from scope_lib.config import ParamsError
from scope_lib.selfplay import ranks

CONFIGS = Path(__file__).resolve().parents[1] / "accelerate"
EXPECTED = {  # the environment accelerate hands each rank for the layout
    "ddp.yaml": {"ACCELERATE_MIXED_PRECISION": "bf16"},
    "fsdp2.yaml": {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "FSDP_SHARDING_STRATEGY": "FULL_SHARD",
                   "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP"},
    "zero2.yaml": {"ACCELERATE_DEEPSPEED_ZERO_STAGE": "2", "ACCELERATE_USE_DEEPSPEED": "true"},
    "zero3.yaml": {"ACCELERATE_DEEPSPEED_ZERO_STAGE": "3", "ACCELERATE_USE_DEEPSPEED": "true",
                   "ACCELERATE_DEEPSPEED_ZERO3_INIT": "true"},
}


def launch_environment(config: Path) -> tuple[int, dict[str, str]]:
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils import prepare_deepspeed_cmd_env, prepare_multi_gpu_env

    args = launch_command_parser().parse_args(["--config_file", str(config), "-m", "scope_lib.cli", "train",
                                               "params/smoke.yaml"])
    args, defaults, _ = _validate_launch_command(args)
    if args.use_deepspeed:  # what `accelerate launch` does before its DeepSpeed launcher
        args.deepspeed_fields_from_accelerate_config = ",".join(defaults.deepspeed_config)
        _, env = prepare_deepspeed_cmd_env(args)
    else:
        env = prepare_multi_gpu_env(args)
    return args.num_processes, env


def test_every_shipped_config_is_tested():
    assert sorted(p.name for p in CONFIGS.glob("*.yaml")) == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_accelerate_accepts_the_config(name):
    from accelerate.commands.config.config_args import load_config_from_file

    config = load_config_from_file(str(CONFIGS / name))  # unknown keys are an error here
    assert config.num_processes == 4 and config.mixed_precision == "bf16"
    processes, env = launch_environment(CONFIGS / name)
    assert processes == 4
    assert {k: env.get(k) for k in EXPECTED[name]} == EXPECTED[name]


@pytest.mark.parametrize("name,sharded", [("ddp.yaml", None), ("fsdp2.yaml", "FSDP2"), ("zero2.yaml", None),
                                          ("zero3.yaml", "DeepSpeed ZeRO-3")])
def test_sharded_layouts_refuse_the_hf_engine(name, sharded, monkeypatch):
    _, env = launch_environment(CONFIGS / name)
    for key in ("ACCELERATE_USE_FSDP", "FSDP_VERSION", "ACCELERATE_DEEPSPEED_ZERO_STAGE"):
        monkeypatch.delenv(key, raising=False)
        if key in env:
            monkeypatch.setenv(key, env[key])
    assert ranks.sharded_weights() == sharded
    ranks.check_generation_layout("openai")  # a served engine generates for any layout
    if sharded:
        with pytest.raises(ParamsError, match="engine.backend: hf cannot generate"):
            ranks.check_generation_layout("hf")
    else:
        ranks.check_generation_layout("hf")
