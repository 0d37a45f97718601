"""A kernel configuration as the table sees it: one binary (kernel, signature, compile-time constants, launch
options), the run-time facts that pick its main path, and the bytes its pass moves (for the bandwidth bound)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Stream:
    """Bytes a configuration moves per element, from its formats (the bandwidth bound).

    Args:
        param_bytes: bytes of one parameter (and gradient) element.
        state_format: the state rows' format (a ``hf_optim.formats`` format), or None: no state.
        state_rows: state rows read and written.
        param_read / grad_read / param_write (default True): whether the pass streams them.
        out_read / out_write (default 0): bytes per element of an fp32 side output (LAMB's direction).
    """

    param_bytes: int
    state_format: Any
    state_rows: int
    param_read: bool = True
    grad_read: bool = True
    param_write: bool = True
    out_read: int = 0
    out_write: int = 0

    def bytes_per_element(self, state_format: Any = None) -> float:
        """Bytes per element, with ``state_format`` in place of the configuration's (default: its own)."""
        fmt = state_format if state_format is not None else self.state_format
        total = self.param_bytes * (self.param_read + self.grad_read + self.param_write)
        total += self.out_read + self.out_write
        if fmt is not None:
            per_row = fmt.bits / 8 + (4 / fmt.block_size if fmt.block_size else 0)
            total += 2 * self.state_rows * per_row  # read and written
        return total


@dataclass(eq=False)
class LaunchConfig:
    """One kernel configuration an optimizer launches: a binary (kernel, signature, compile-time constants, launch
    options) and the run-time facts that pick its main path.

    Args:
        name: the row's label (``group/kernel ...``), unique.
        kernel: the ``@triton.jit`` kernel.
        signature: type of each run-time argument (``"*fp32"``, ``"i32"``, a tuple of types for a named tuple).
        constexprs: value of each ``tl.constexpr`` argument.
        num_warps (default 4): warps per program, as launched (Triton's default unless the launch sets it).
        options (default {}): other launch options, as launched (``enable_fp_fusion``).
        facts (default {}): run-time values that decide the main path: names the kernels' ``if`` and ``for`` tests
            read (``dtype``, ``fmt``, ``n``...), or a test's exact source text mapped to its outcome.
        elements_per_program (default None): elements one program updates on the main path (None: per-tensor work,
            no per-element count).
        stream (default None): the bytes model (:class:`Stream`) of a fused elementwise configuration: gets a
            predicted step time.
        group (default ""): the kernel family (``fused``, ``lamb``, ``adafactor``, ``standalone``).
        fp32_state_twin (default None): the name of the configuration tensors below ``min_8bit_size`` run instead
            (fp32 state), for the prediction.
        launched_by (default ""): who launches it (shown in the JSON).
        main (default True): a configuration of the common case; only those get a predicted step time.
        specialization (default None): Triton's ``attrs`` of the arguments as launched (None: :meth:`attrs`).
    """

    name: str
    kernel: Any
    signature: dict
    constexprs: dict
    num_warps: int = 4
    options: dict = field(default_factory=dict)
    facts: dict = field(default_factory=dict)
    elements_per_program: int | None = None
    stream: Stream | None = None
    group: str = ""
    fp32_state_twin: str | None = None
    launched_by: str = ""
    main: bool = True
    """Whether it runs the common case (whole tiles); False: e.g. the masked kernel of tensors' last tiles."""
    specialization: dict | None = None
    """Triton's ``attrs`` of the arguments as launched; None: :meth:`attrs`' default."""
    arch: str | None = None
    """The arch it is launched on (a key of :data:`ARCHES`), where the kernels layer specializes per arch; None: every
    arch."""

    def attrs(self) -> dict:
        """Triton's specialization of the arguments as launched: by default every pointer hf_optim passes is a
        tensor's data, 16-byte aligned (``tt.divisibility`` 16, as Triton's launcher detects); integers general."""
        if self.specialization is not None:
            return self.specialization
        names = self.kernel.arg_names
        return {(names.index(name),): [["tt.divisibility", 16]] for name, kind in self.signature.items()
                if isinstance(kind, str) and kind.startswith("*")}

    def binary_key(self) -> tuple:
        """Configurations with equal keys share one compiled binary."""
        def plain(value):
            return getattr(value, "__name__", None) or repr(value)
        return (self.kernel.fn.__module__, self.kernel.__name__, repr(sorted(self.signature.items())),
                repr(sorted((k, plain(v)) for k, v in self.constexprs.items())), self.num_warps,
                repr(sorted(self.options.items())), repr(sorted(self.attrs().items())))
