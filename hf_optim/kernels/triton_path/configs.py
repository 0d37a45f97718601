"""Every Triton kernel configuration hf_optim's optimizers launch, enumerated for ahead-of-time compilation.

A :class:`LaunchSpec` is one binary as the optimizers launch it: the ``@triton.jit`` kernel, the types of its
run-time arguments, the values of its compile-time ones and its launch options. :func:`kernel_specs` lists them
all, built from the same configuration objects the launches use (``elementwise.FusedConfig``, and the configurations
a multi-pass algorithm's ``TritonPlan.specs`` lists from its own folder: LAMB's and Adafactor's
``triton_passes.launch_specs``), so the compile test
(``tests/kernels/test_gpu_static.py``) and :mod:`hf_optim.gpu_static` compile exactly what runs;
:func:`step_specs`
lists the kernels one step of one optimizer launches (the cold-start cost). :meth:`LaunchSpec.compile` compiles one
for an arch without a GPU (``triton.compile(ASTSource(...), target=GPUTarget("cuda", cc, 32))``).

This module sits in the kernels layer, so it does not know the optimizer classes: callers pass the algorithms and
the state formats each runs with, e.g. ``[(f.algorithm, f.base._supported_formats()) for f in registry.families()]``
(a format may be given as a :class:`StateFormat`, its name, or bitsandbytes' ``optim_bits`` alias).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from hf_optim.core.algorithm import Algorithm
from hf_optim.formats import FP32, StateFormat, format_for_bits, format_named
from hf_optim.kernels.triton_path import quant4, quant8, rounding
from hf_optim.kernels.triton_path.elementwise import FusedConfig, _fused_update_kernel
from hf_optim.kernels.triton_path.tile import DTYPE_NAMES, launch_options

DTYPES = (0, 1, 2)
"""fp32, bf16, fp16 (``tile.DTYPE_CODES``)."""
BF16 = 1

_ROUNDING = {"ordinals": "*i64", "key": "*i64"}


@dataclass(frozen=True)
class LaunchSpec:
    """One kernel binary as launched.

    Args:
        name: a unique label (``fused/adamw bf16 8-bit full``).
        kernel: the ``@triton.jit`` kernel.
        signature: the type of each run-time argument (``"*fp32"``, ``"i32"``, a named tuple of types for a
            named-tuple argument).
        constexprs: the value of each ``tl.constexpr`` argument.
        num_warps: warps per program, as launched.
        group: the kernel family: ``fused``, ``lamb``, ``adafactor`` or ``standalone``.
        launched_by: what launches it.
        elements_per_program (default None): elements one program processes on its main path (None: per-tensor
            work, no per-element count).
        main (default True): a whole-tile (main path) configuration; False: the masked kernel of tensors' last,
            partial tiles, or another configuration off the main path.
        param_dtype (default None): ``fp32``, ``bf16`` or ``fp16`` where the kernel streams parameters.
        state_format (default None): the format of its state rows (fused kernels), None without state.
        state_rows (default 0): state rows read and written per element.
        writes_direction (default False): LAMB's direction pass (writes an fp32 direction, not the parameter).
        fp32_state_twin (default None): the name of the configuration that tensors under ``min_8bit_size`` of the
            same optimizer run (fp32 state).
        options (default: no fp fusion): other launch options, as launched.
    """

    name: str
    kernel: Any
    signature: dict
    constexprs: dict
    num_warps: int
    group: str
    launched_by: str
    elements_per_program: int | None = None
    main: bool = True
    param_dtype: str | None = None
    state_format: StateFormat | None = None
    state_rows: int = 0
    writes_direction: bool = False
    fp32_state_twin: str | None = None
    options: dict = field(default_factory=lambda: {"enable_fp_fusion": False})

    def attrs(self) -> dict:
        """Triton's specialization of the pointer arguments as launched: every tensor hf_optim passes is 16-byte
        aligned (``tt.divisibility`` 16), as Triton's launcher detects."""
        names = self.kernel.arg_names
        return {(names.index(name),): [["tt.divisibility", 16]] for name, kind in self.signature.items()
                if isinstance(kind, str) and kind.startswith("*")}

    def source(self) -> ASTSource:
        names = self.kernel.arg_names
        signature = {**self.signature, **{name: "constexpr" for name in self.constexprs}}
        constexprs = {(names.index(name),): value for name, value in self.constexprs.items()}
        return ASTSource(self.kernel, signature, constexprs, self.attrs())

    def compile(self, arch: int = 90):
        """Compile for CUDA compute capability ``arch`` (e.g. 90, 75) without a GPU; returns Triton's compiled
        kernel (``.asm["cubin"]``, ``.asm["ptx"]``, ``.metadata``)."""
        return triton.compile(self.source(), target=GPUTarget("cuda", arch, 32),
                              options={"num_warps": self.num_warps, **self.options})


def _hyper_signature(algorithm: Algorithm):
    return algorithm.hyper(*["fp32"] * len(algorithm.hyper._fields))


FUSED_SIGNATURE = {"meta": "*i64", "tiles": "*i32", "partials": "*fp32", "qmap0": "*fp32", "encoder0": "*i32",
                   "qmap1": "*fp32", "encoder1": "*i32", "qmap2": "*fp32", "encoder2": "*i32"}


def fused_spec(algorithm: Algorithm, config: FusedConfig, launched_by: str = "") -> LaunchSpec:
    """The :class:`LaunchSpec` of one fused-kernel configuration of ``algorithm``."""
    codes = set(config.formats)
    state_format = next(fmt for fmt in _formats() if fmt.code in codes) if len(codes) == 1 else None
    twin = _fused_name(config, FP32.code) if state_format not in (None, FP32) else None
    return LaunchSpec(
        _fused_name(config), _fused_update_kernel,
        {**FUSED_SIGNATURE, "h": _hyper_signature(algorithm), **_ROUNDING}, config.constants(), config.num_warps,
        "lamb" if config.write_out else "fused", launched_by or algorithm.class_name,
        elements_per_program=config.tile_blocks * 256, main=config.full, param_dtype=DTYPE_NAMES[config.param_dtype],
        state_format=state_format, state_rows=len(config.formats), writes_direction=config.write_out,
        fp32_state_twin=twin, options={k: v for k, v in config.launch_options().items() if k != "num_warps"})


def _formats() -> list[StateFormat]:
    from hf_optim.formats import FORMATS

    return list(FORMATS.values())


def _fused_name(config: FusedConfig, state_code: int | None = None) -> str:
    codes = config.formats if state_code is None else (state_code,) * len(config.formats)
    bits = "/".join(next(f.class_suffix for f in _formats() if f.code == code) for code in sorted(set(codes)))
    kind = f"lamb/direction {config.algorithm}" if config.write_out else f"fused/{config.algorithm}"
    grad = "" if config.grad_dtype == config.param_dtype else f" grad={DTYPE_NAMES[config.grad_dtype]}"
    return (f"{kind} {DTYPE_NAMES[config.param_dtype]}{grad} {bits} {'full' if config.full else 'partial'}"
            f"{' sr' if config.stochastic else ''}{'' if config.aligned or not config.full else ' unaligned'}")


def as_formats(formats: Iterable[StateFormat | str | int]) -> list[StateFormat]:
    """``formats`` as :class:`StateFormat` objects (from names or bitsandbytes' ``optim_bits`` aliases), in table
    order, each once."""
    found = {f if isinstance(f, StateFormat) else format_named(f) if isinstance(f, str) else format_for_bits(f)
             for f in formats}
    return sorted(found, key=lambda f: f.rank)


def fused_configs(algorithm: Algorithm, formats: Iterable[StateFormat | str | int], *,
                  include_unaligned: bool = False, arch: int = 90) -> list[FusedConfig]:
    """Every fused-kernel configuration ``algorithm`` launches with state in ``formats`` (fp32 included: tensors
    under ``min_8bit_size``) on compute capability ``arch``: per parameter dtype (gradients of the same dtype), state
    format, whole or partial tile and, for bf16 parameters of elementwise algorithms, stochastic rounding. A format
    without a Triton branch (``StateFormat.triton`` False: ``rank1_4bit``) has none."""
    if algorithm.triton_rule is None:
        return []
    rule = algorithm.resolve(algorithm.triton_rule)
    write_out = not algorithm.triton_plan.elementwise
    signed = tuple(spec.signed for spec in algorithm.slots for _ in range(spec.rows))
    configs = []
    for fmt in as_formats([*formats, FP32]):
        if not fmt.triton:  # stepped on the PyTorch path (optim/runner.py): no kernel of its own
            continue
        codes = (fmt.code,) * len(signed)
        for dtype in DTYPES:
            for stochastic in (False, True) if dtype == BF16 and not write_out else (False,):
                for full in (True, False):
                    for aligned in (True, False) if include_unaligned and full else (True,):
                        configs.append(FusedConfig(algorithm.name, rule, codes, signed, dtype, dtype, full,
                                                   stochastic=stochastic, write_out=write_out, aligned=aligned,
                                                   arch=arch))
    return configs




def standalone_specs() -> list[LaunchSpec]:
    """The standalone quantize / dequantize / rounding kernels (tests and tools)."""
    specs = []
    blocks8, blocks4 = quant8.TILE_BLOCKS, quant4.TILE_BLOCKS
    rows8 = {"n": "i32", "blocks_per_row": "i32"}
    rows4 = {"n": "i32", "row_bytes": "i32", "row_blocks": "i32"}
    specs.append(LaunchSpec(  # the encoder's tables carry the map's signedness
        "standalone/quantize8", quant8._quantize_kernel,
        {"values_ptr": "*fp32", "codes_ptr": "*u8", "absmax_ptr": "*fp32", "tables": "*i32", **rows8},
        {"BLOCKS": blocks8}, launch_options()["num_warps"], "standalone",
        "triton_path.quant8.quantize", elements_per_program=blocks8 * 256, main=False))
    for signed in (True, False):
        specs.append(LaunchSpec(
            f"standalone/quantize4 {'signed' if signed else 'unsigned'}", quant4._quantize_kernel,
            {"values_ptr": "*fp32", "codes_ptr": "*u8", "scale_ptr": "*fp32", **rows4},
            {"SIGNED": signed, "BLOCKS": blocks4}, launch_options()["num_warps"], "standalone",
            "triton_path.quant4.quantize", elements_per_program=blocks4 * 256, main=False))
        specs.append(LaunchSpec(
            f"standalone/dequantize4 {'signed' if signed else 'unsigned'}", quant4._dequantize_kernel,
            {"codes_ptr": "*u8", "scale_ptr": "*fp32", "qmap_ptr": "*fp32", "out_ptr": "*fp32", **rows4},
            {"SIGNED": signed, "BLOCKS": blocks4}, launch_options()["num_warps"], "standalone",
            "triton_path.quant4.dequantize", elements_per_program=blocks4 * 256, main=False))
    specs.append(LaunchSpec(
        "standalone/dequantize8", quant8._dequantize_kernel,
        {"codes_ptr": "*u8", "absmax_ptr": "*fp32", "qmap_ptr": "*fp32", "out_ptr": "*fp32", **rows8},
        {"BLOCKS": blocks8}, launch_options()["num_warps"], "standalone", "triton_path.quant8.dequantize",
        elements_per_program=blocks8 * 256, main=False))
    specs.append(LaunchSpec(
        "standalone/round_bf16", rounding._round_kernel,
        {"values_ptr": "*fp32", "out_ptr": "*i16", "n": "i32", "start": "i32", "ordinal": "i64", "key": "*i64"},
        {"BLOCK": rounding.ROUND_BLOCK}, launch_options()["num_warps"], "standalone",
        "triton_path.rounding.round_to_bf16", elements_per_program=rounding.ROUND_BLOCK, main=False))
    return specs


def kernel_specs(algorithms: Iterable[tuple[Algorithm, Iterable[StateFormat | str | int]]], *,
                 include_unaligned: bool = False,
                 standalone: bool = True, arch: int = 90) -> list[LaunchSpec]:
    """Every kernel configuration the optimizers of ``algorithms`` launch on a GPU of compute capability ``arch``
    (a few fused configurations take another tile width or a register limit on some arches:
    ``FusedConfig.whole_tile_width``, ``FusedConfig.max_registers``).

    Args:
        algorithms: ``(algorithm, state formats it runs with)`` pairs, e.g. from the optimizer registry.
        include_unaligned (default False): also the whole-tile fused configurations for tensors that are not 16-byte
            aligned (views at odd offsets; torch's own allocations always are).
        standalone (default True): also the standalone quantize / dequantize / rounding kernels.
        arch (default 90): the compute capability (``major * 10 + minor``).
    """
    specs: list[LaunchSpec] = []
    for algorithm, formats in algorithms:
        formats = as_formats(formats)
        fused = fused_configs(algorithm, formats, include_unaligned=include_unaligned, arch=arch)
        specs.extend(fused_spec(algorithm, config) for config in fused)
        if algorithm.triton_plan.specs is not None:  # a multi-pass algorithm's own kernels (LAMB, Adafactor)
            specs.extend(algorithm.resolve(algorithm.triton_plan.specs)(algorithm, formats, fused))
    if standalone:
        specs.extend(standalone_specs())
    names = [spec.name for spec in specs]
    duplicates = {name for name in names if names.count(name) > 1}
    if duplicates:
        raise AssertionError(f"kernel spec names repeat: {sorted(duplicates)}")
    return specs


def step_specs(algorithm: Algorithm, state_format: StateFormat | str | int, param_dtype: int, *,
               stochastic: bool = False, arch: int = 90) -> list[LaunchSpec]:
    """The fused kernels one step of ``algorithm`` with state in ``state_format`` launches on a model whose
    parameters (and gradients) are of dtype code ``param_dtype``, on compute capability ``arch``: whole and partial
    tiles, of the quantized tensors and of those under ``min_8bit_size`` (fp32 state)."""
    codes = {fmt.code for fmt in as_formats([state_format, FP32])}
    return [fused_spec(algorithm, config) for config in fused_configs(algorithm, (state_format,), arch=arch)
            if config.param_dtype == param_dtype and config.stochastic == stochastic
            and codes >= set(config.formats)]
