"""The accelerate configs in recipes/accelerate/ as accelerate reads them (nothing is launched here; the DeepSpeed
configs run for real in test_deepspeed.py).

What they promise is checked where it can be on CPU: the FSDP2 config turns into the plugin settings whose
optimizer checkpointing test_distributed.py runs (FSDP2, sharded state dict); the DeepSpeed configs give DeepSpeed
no optimizer of its own, so the Trainer's optim= (hf_optim) becomes its client optimizer, and the offload config
stops accelerate from swapping that optimizer for DeepSpeed's CPU Adam.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from accelerate.commands.config.config_args import load_config_from_file
from accelerate.commands.launch import _validate_launch_command, launch_command_parser
from accelerate.utils.launch import prepare_multi_gpu_env

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "recipes" / "accelerate"


def test_every_config_is_valid_for_accelerate():
    files = sorted(CONFIGS.glob("*.yaml"))
    assert [f.name for f in files] == ["deepspeed_zero1.yaml", "deepspeed_zero2.yaml", "deepspeed_zero2_offload.yaml",
                                       "deepspeed_zero3.yaml", "fsdp2.yaml"]
    for file in files:
        config = load_config_from_file(str(file))  # rejects unknown keys
        assert config.num_machines == 1 and not config.use_cpu, file.name


def test_fsdp2_config_launches_fsdp2_with_sharded_checkpoints(monkeypatch):
    args = launch_command_parser().parse_args(
        ["--config_file", str(CONFIGS / "fsdp2.yaml"), "-m", "hf_optim.cli", "train", "recipe.yaml"]
    )
    args, _, _ = _validate_launch_command(args)
    env = prepare_multi_gpu_env(args)
    assert env["ACCELERATE_USE_FSDP"] == "true" and env["FSDP_VERSION"] == "2"
    assert env["FSDP_STATE_DICT_TYPE"] == "SHARDED_STATE_DICT"

    from accelerate.utils import FullyShardedDataParallelPlugin
    from torch.distributed.fsdp import StateDictType

    for key, value in env.items():
        monkeypatch.setenv(key, value)
    plugin = FullyShardedDataParallelPlugin()  # what accelerate builds in each launched process
    assert plugin.fsdp_version == 2 and plugin.state_dict_type == StateDictType.SHARDED_STATE_DICT


@pytest.mark.parametrize("name,stage", [("deepspeed_zero1.yaml", 1), ("deepspeed_zero2.yaml", 2),
                                        ("deepspeed_zero3.yaml", 3)])
def test_deepspeed_configs_use_the_trainers_optimizer(name, stage):
    config = load_config_from_file(str(CONFIGS / name))
    assert config.distributed_type == "DEEPSPEED"
    assert config.num_processes == 2  # a default that runs anywhere; the comments say to pass the GPU count
    assert config.deepspeed_config["zero_stage"] == stage
    assert "deepspeed_config_file" not in config.deepspeed_config  # inline: DeepSpeed gets no "optimizer" section
    assert config.deepspeed_config["offload_optimizer_device"] == "none"


def test_deepspeed_offload_config_keeps_hf_optim_on_cpu():
    config = load_config_from_file(str(CONFIGS / "deepspeed_zero2_offload.yaml"))
    ds_file = ROOT / config.deepspeed_config["deepspeed_config_file"]
    ds = json.loads(ds_file.read_text())
    assert "optimizer" not in ds  # the Trainer builds optim= (hf_optim) and hands it to DeepSpeed
    assert ds["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    # accelerate replaces a client optimizer by DeepSpeed's CPU Adam under offload unless this is false
    assert ds["zero_force_ds_cpu_optimizer"] is False
