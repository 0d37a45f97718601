"""The configurations the table compiles: those the kernels layer lists
(``hf_optim.kernels.triton_path.configs.kernel_specs``, built from the objects the launches use), each with the
run-time facts of its main path and the bytes model of its pass."""

from __future__ import annotations

from hf_optim.gpu_static.launch_config import LaunchConfig, Stream
from hf_optim.gpu_static.targets import ARCHES

FULL_TILE = {"first_block": 0, "n": 1 << 40}
"""Run-time facts of a program whose tile lies wholly inside its tensor (for kernels that test it at run time)."""
DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def _dtype_facts(dtype: str) -> dict:
    """The kernels' code of parameter dtype ``dtype`` (``fp32``, ``bf16``, ``fp16``) and its bytes per element."""
    import torch  # noqa: PLC0415

    from hf_optim.kernels.triton_path.tile import dtype_code  # noqa: PLC0415

    torch_dtype = getattr(torch, DTYPE_NAMES[dtype])
    return {"dtype": dtype_code(torch_dtype), "param_bytes": torch_dtype.itemsize}


def kernel_layer_configs() -> tuple[list[LaunchConfig], list[str]]:
    """(every configuration ``hf_optim.kernels.triton_path.configs.kernel_specs`` lists for the registered algorithms,
    the configurations one AdamW8bit step with bf16 parameters launches: ``step_specs``). The layer enumerates per
    arch (a few configurations take another tile width on some arches): each configuration is kept for the arches
    it is launched on."""
    # the algorithms are registered: importing this package ran hf_optim/__init__.py first
    from hf_optim.kernels.triton_path import configs as layer  # noqa: PLC0415
    from hf_optim.optim import registry  # noqa: PLC0415

    algorithms = [(family.algorithm, family.base._supported_formats()) for family in registry.families()]
    configs = [_from_spec(spec, arch) for arch in ARCHES
               for spec in layer.kernel_specs(algorithms, arch=ARCHES[arch].cc)]
    dtype = _dtype_facts("bf16")["dtype"]
    cold = [spec.name for spec in layer.step_specs(registry.lookup_algorithm("adamw").algorithm, "blockwise8", dtype)]
    return configs, cold


def _from_spec(spec, arch: str | None = None) -> LaunchConfig:
    """A :class:`LaunchConfig` of a ``triton_configs.LaunchSpec`` (its bytes model from its dtype and formats),
    launched on ``arch`` (None: every arch)."""
    stream = None
    if spec.param_dtype is not None and spec.group in ("fused", "lamb"):
        param_bytes = _dtype_facts(spec.param_dtype)["param_bytes"]
        if spec.state_rows:  # a fused update (LAMB's direction pass writes the fp32 direction, not the parameter)
            stream = Stream(param_bytes, spec.state_format, spec.state_rows, param_write=not spec.writes_direction,
                            out_write=4 if spec.writes_direction else 0)
        elif spec.group == "lamb":  # LAMB's apply pass: p -= lr * ratio * direction
            stream = Stream(param_bytes, None, 0, grad_read=False, out_read=4)
    facts = dict(FULL_TILE) if spec.main else {"first_block": 0, "n": 1}
    config = LaunchConfig(spec.name, spec.kernel, spec.signature, spec.constexprs, num_warps=spec.num_warps,
                          options=dict(spec.options), facts=facts, elements_per_program=spec.elements_per_program,
                          stream=stream, group=spec.group, fp32_state_twin=spec.fp32_state_twin,
                          launched_by=spec.launched_by, main=spec.main, specialization=spec.attrs(), arch=arch)
    return config
