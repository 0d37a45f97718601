"""One table row: a configuration compiled for an arch and read back (resources, occupancy, local memory), with its
main path's instructions and global loads per element."""

from __future__ import annotations

from hf_optim.gpu_static.compiling import Compiled, compile_config, occupancy, resources
from hf_optim.gpu_static.control_flow import Sass, read_sass
from hf_optim.gpu_static.launch_config import LaunchConfig
from hf_optim.gpu_static.main_path import main_path
from hf_optim.gpu_static.targets import ARCHES


def _names(config: LaunchConfig) -> dict:
    return {**{k: getattr(v, "value", v) for k, v in config.constexprs.items()}, **config.facts}


def measure(config: LaunchConfig, arch: str, compiled: Compiled | None = None) -> dict:
    """One table row: ``config`` compiled for ``arch`` (or its ``compiled`` binary) and read back.

    Args:
        config: the configuration.
        arch: a key of :data:`ARCHES`.
        compiled (default None): its binary for ``arch`` from :func:`compile_config` (compiled here when None).
    """
    if compiled is None:
        compiled = compile_config(config, arch)
    limits = ARCHES[arch]
    res = resources(compiled)
    sass = read_sass(compiled.cubin)
    local = sum(1 for ins in sass.instructions if ins.opcode.split(".")[0] in ("LDL", "STL"))
    smem = compiled.dynamic_smem + max(res["static_smem"], limits.reserved_smem)
    occ, blocks, limiter = occupancy(res["regs"], smem, compiled.num_warps, limits)
    row = {"config": config.name, "group": config.group, "arch": arch, "num_warps": compiled.num_warps, **res,
           "local_instructions": local, "smem": smem, "occupancy": occ, "blocks_per_sm": blocks,
           "occupancy_limiter": limiter, "sass_instructions": len(sass.instructions),
           "compile_seconds": compiled.seconds, "elements_per_program": config.elements_per_program,
           "path_instructions": None, "instructions_per_element": None, "ambiguous_branches": None,
           "loads_per_element": None}
    if config.elements_per_program:
        _count_main_path(row, config, sass, compiled.num_warps)
    if config.stream is not None:
        row["bytes_per_element"] = config.stream.bytes_per_element()
    return row


def _count_main_path(row: dict, config: LaunchConfig, sass: Sass, num_warps: int) -> None:
    """Fill ``row``'s main-path counts: instructions and global loads (``LDG``, any width) executed per thread on the
    main path x threads per program / elements per program (or ``analysis_error`` when no main path is found)."""
    try:
        path = main_path(sass, _names(config))
    except RuntimeError as error:  # the binary's other numbers still stand
        row["analysis_error"] = str(error)
    else:
        row["path_instructions"] = path.instructions
        row["ambiguous_branches"] = path.ambiguous
        row["instructions_per_element"] = (path.instructions * num_warps * 32
                                           / config.elements_per_program)
        loads = sum(1 for b in path.blocks for ins in sass.blocks[b].instructions
                    if ins.opcode.split(".")[0] == "LDG")
        row["loads_per_element"] = loads * num_warps * 32 / config.elements_per_program
