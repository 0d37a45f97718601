"""The predicted step time of the fused elementwise configurations on the Llama-3.2-1B full set: ``max(bandwidth
bound, issue bound)`` on an H100 SXM (sm_90 rows) and a T4 (sm_75 rows)."""

from __future__ import annotations

from collections.abc import Sequence

from hf_optim.gpu_static.launch_config import LaunchConfig
from hf_optim.gpu_static.targets import GPUS


def llama_numels() -> list[int]:
    """Element counts of the Llama-3.2-1B tensors a full fine-tune steps (tied embeddings), from the model's public
    config values (hidden 2048, intermediate 8192, 16 layers, 8 key-value heads of 64, vocabulary 128256): the
    embedding, per layer q, k, v, o, gate, up, down and two norms, and the final norm. The same set as
    ``benchmarks/performance/step_time.py``'s ``llama-3.2-1b`` (``test_gpu_static.py`` checks that)."""
    hidden, intermediate, layers, kv, vocab = 2048, 8192, 16, 8 * 64, 128256
    per_layer = [hidden * hidden, kv * hidden, kv * hidden, hidden * hidden, intermediate * hidden,
                 intermediate * hidden, hidden * intermediate, hidden, hidden]
    return [vocab * hidden] + per_layer * layers + [hidden]


def min_8bit_size() -> int:
    from hf_optim.optim.options import BY_NAME  # noqa: PLC0415

    return BY_NAME["min_8bit_size"].default


def predict(rows: list[dict], configs: dict[str, LaunchConfig], numels: Sequence[int]) -> None:
    """Add the H100 / T4 step-time prediction to the rows of fused elementwise configurations (in place).

    Args:
        rows: measured rows (:func:`measure`).
        configs: the configurations by name.
        numels: the tensor set's element counts.
    """
    from hf_optim.formats import FP32  # noqa: PLC0415

    small = min_8bit_size()
    by_key = {(row["config"], row["arch"]): row for row in rows}
    for row in rows:
        config = configs.get(row["config"])
        if (config is None or config.stream is None or not config.main
                or row.get("instructions_per_element") is None):
            continue
        for gpu in GPUS:
            if row["arch"] != gpu.arch:
                continue
            twin = by_key.get((config.fp32_state_twin, gpu.arch), row) if config.fp32_state_twin else row
            per_program = config.elements_per_program
            total_bytes, warp_instructions = 0.0, 0.0
            for n in numels:
                quantized = n >= small
                fmt = None if quantized else FP32
                source = row if quantized else twin
                total_bytes += n * config.stream.bytes_per_element(fmt)
                padded = -(-n // per_program) * per_program
                warp_instructions += padded * source["instructions_per_element"] / 32
            bandwidth = total_bytes / gpu.bandwidth
            issue = gpu.issue_seconds(warp_instructions)
            row[f"{gpu.name}_bandwidth_ms"] = bandwidth * 1e3
            row[f"{gpu.name}_issue_ms"] = issue * 1e3
            row[f"{gpu.name}_predicted_ms"] = max(bandwidth, issue) * 1e3
