"""The CUDA and NVML paths of the monitor: unit tests with injected sources on any machine, the real thing on a GPU."""

from __future__ import annotations

import os
from collections import namedtuple

import pytest
import torch
from monitor_helpers import (
    assert_png_drawn,
    figure_texts,
    fixed_length_dataset,
    plain_trainer,
    read_records,
    read_summary,
)
from trainer_helpers import common_args
from transformers import Trainer, TrainingArguments

from hf_optim.monitor import TrainingMonitor, load_run
from hf_optim.monitor.cuda_memory import CUDA_FIELDS, CudaMemory
from hf_optim.monitor.nvml_memory import NVML_FIELDS, NvmlMemory
from hf_optim.monitor.plots import memory_figure
from hf_optim.monitor.sampling import MemorySampler
from hf_optim.tiny import tiny_llama

GIB = 2**30


class FakeAllocator:
    """A stand-in for torch.cuda.memory_stats / reset_peak_memory_stats with torch's key names and peak semantics."""

    def __init__(self):
        self.allocated = self.reserved = 0
        self.peak_allocated = self.peak_reserved = 0
        self.retries = self.ooms = 0
        self.resets = 0

    def set(self, allocated, reserved):
        self.allocated, self.reserved = allocated, reserved
        self.peak_allocated = max(self.peak_allocated, allocated)
        self.peak_reserved = max(self.peak_reserved, reserved)

    def stats(self):
        return {"allocated_bytes.all.current": self.allocated, "allocated_bytes.all.peak": self.peak_allocated,
                "reserved_bytes.all.current": self.reserved, "reserved_bytes.all.peak": self.peak_reserved,
                "num_alloc_retries": self.retries, "num_ooms": self.ooms}

    def reset(self):
        self.resets += 1
        self.peak_allocated, self.peak_reserved = self.allocated, self.reserved


def cuda_memory(allocator, **kwargs):
    return CudaMemory(0, stats=allocator.stats, reset=allocator.reset, capacity_bytes=80 * GIB, **kwargs)


def test_window_and_run_peaks_from_memory_stats():
    allocator = FakeAllocator()
    allocator.set(10 * GIB, 12 * GIB)
    cuda = cuda_memory(allocator)
    cuda.start_run()
    allocator.set(30 * GIB, 40 * GIB)  # a step's activations
    allocator.set(11 * GIB, 40 * GIB)  # freed, the cache keeps the reservation
    allocator.retries = 2
    first = cuda.sample(end_window=True)
    assert first == {
        "cuda_allocated_bytes": 11 * GIB, "cuda_reserved_bytes": 40 * GIB,
        "cuda_peak_allocated_window_bytes": 30 * GIB, "cuda_peak_reserved_window_bytes": 40 * GIB,
        "cuda_peak_allocated_run_bytes": 30 * GIB, "cuda_peak_reserved_run_bytes": 40 * GIB,
        "cuda_capacity_bytes": 80 * GIB, "cuda_reserved_pct": 50.0, "cuda_peak_reserved_run_pct": 50.0,
        "cuda_alloc_retries": 2, "cuda_ooms": 0,
    }
    assert set(first) == set(CUDA_FIELDS)
    allocator.set(20 * GIB, 40 * GIB)  # a smaller second window: its own peak, the run keeps the first
    second = cuda.sample(end_window=True)
    assert second["cuda_peak_allocated_window_bytes"] == 20 * GIB
    assert second["cuda_peak_allocated_run_bytes"] == 30 * GIB
    assert allocator.resets == 3  # start_run and one per closed window
    cuda.sample(end_window=False)  # a phase snapshot does not close the window
    assert allocator.resets == 3


def test_without_peak_resets_window_peaks_are_null_and_torch_is_left_alone():
    allocator = FakeAllocator()
    allocator.set(50 * GIB, 60 * GIB)  # before training, e.g. loading
    allocator.set(5 * GIB, 60 * GIB)
    cuda = cuda_memory(allocator, reset_peak_stats=False)
    cuda.start_run()
    fields = cuda.sample(end_window=True)
    assert allocator.resets == 0
    assert fields["cuda_peak_allocated_window_bytes"] is None and fields["cuda_peak_reserved_window_bytes"] is None
    assert fields["cuda_peak_allocated_run_bytes"] == 50 * GIB  # torch's peak since its last reset


MemoryInfo = namedtuple("MemoryInfo", "total free used")
Process = namedtuple("Process", "pid usedGpuMemory")


class FakeNvml:
    """The pynvml calls the monitor makes, answering for one device."""

    class NVMLError(Exception):
        pass

    def __init__(self, fail_init=False):
        self.fail_init = fail_init
        self.looked_up = None

    def nvmlInit(self):
        if self.fail_init:
            raise self.NVMLError("Driver Not Loaded")

    def nvmlDeviceGetHandleByUUID(self, uuid):
        self.looked_up = uuid
        return "handle"

    def nvmlDeviceGetHandleByIndex(self, index):
        self.looked_up = index
        return "handle"

    def nvmlDeviceGetMemoryInfo(self, handle):
        return MemoryInfo(total=80 * GIB, free=30 * GIB, used=50 * GIB)

    def nvmlDeviceGetComputeRunningProcesses(self, handle):
        return [Process(pid=1, usedGpuMemory=3 * GIB), Process(pid=os.getpid(), usedGpuMemory=45 * GIB)]

    def nvmlSystemGetDriverVersion(self):
        return b"570.86.15"


def test_nvml_reads_the_device_torch_names_by_uuid():
    fake = FakeNvml()
    nvml = NvmlMemory(0, uuid="6f2b0c1e-0000-4000-8000-000000000000", nvml=fake)
    assert fake.looked_up == "GPU-6f2b0c1e-0000-4000-8000-000000000000"  # torch's UUID lacks NVML's prefix
    assert nvml.sample() == {"nvml_used_bytes": 50 * GIB, "nvml_total_bytes": 80 * GIB, "nvml_used_pct": 62.5,
                             "nvml_process_bytes": 45 * GIB}
    assert nvml.driver_version() == "570.86.15" and nvml.error is None


def test_nvml_unavailable_gives_null_fields_and_says_why():
    nvml = NvmlMemory(0, nvml=FakeNvml(fail_init=True))
    assert nvml.sample() == dict.fromkeys(NVML_FIELDS)
    assert "Driver Not Loaded" in nvml.error and nvml.driver_version() is None


def test_monitor_records_injected_cuda_and_nvml_sources(tmp_path):
    """The whole callback with CUDA/NVML sources injected: fields land in every record, the summary and the plot."""
    allocator = FakeAllocator()
    allocator.set(2 * GIB, 4 * GIB)
    sampler = MemorySampler(cuda_memory(allocator), NvmlMemory(0, nvml=FakeNvml()))
    monitor = TrainingMonitor(tmp_path / "run", memory_sampler=sampler, synchronize=False)
    model = tiny_llama()
    trainer = plain_trainer(tmp_path, model, torch.optim.AdamW(model.parameters()), monitor, steps=3, batch_size=2,
                            seq_len=16)
    trainer.train()

    records = read_records(tmp_path / "run")
    assert len(records) == 3
    for record in records:
        assert record["cuda_allocated_bytes"] == 2 * GIB and record["cuda_capacity_bytes"] == 80 * GIB
        assert record["nvml_used_bytes"] == 50 * GIB and record["nvml_process_bytes"] == 45 * GIB
    summary = read_summary(tmp_path / "run")
    assert summary["peaks"]["cuda_peak_reserved_run_bytes"] == 4 * GIB
    assert summary["peaks"]["nvml_peak_used_sampled_bytes"] == 50 * GIB
    breakdown = summary["memory_breakdown"]
    # The model trained on CPU: nothing of it is in the (fake) CUDA allocator, so all 2 GiB count as the rest.
    assert breakdown["basis"] == "cuda_peak_allocated" and breakdown["peak_bytes"] == 2 * GIB
    assert breakdown["weights_bytes"] == 0 and breakdown["rest_bytes"] == 2 * GIB
    run = load_run(tmp_path / "run")
    text = figure_texts(memory_figure(run))
    assert "GPU capacity (80 GiB)" in text and "device used (NVML" in text and "peak allocated in window" in text
    assert_png_drawn(tmp_path / "run" / "memory.png")


@pytest.mark.gpu
def test_real_cuda_run(tmp_path):
    """On a GPU: torch's counters, NVML and the accounting agree with the model actually trained there."""
    model = tiny_llama()
    args = TrainingArguments(**{**common_args(tmp_path, "adamw_torch", max_steps=4, per_device_train_batch_size=4),
                                "use_cpu": False})
    monitor = TrainingMonitor(tmp_path / "run")
    trainer = Trainer(model=model, args=args, train_dataset=fixed_length_dataset(16, 32), callbacks=[monitor])
    trainer.train()

    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    capacity = torch.cuda.get_device_properties(0).total_memory
    for record in read_records(tmp_path / "run"):
        assert record["cuda_capacity_bytes"] == capacity
        assert record["cuda_allocated_bytes"] >= weights
        assert record["cuda_peak_allocated_window_bytes"] >= record["cuda_allocated_bytes"]
        assert record["cuda_peak_allocated_run_bytes"] >= record["cuda_peak_allocated_window_bytes"]
        assert record["cuda_reserved_bytes"] >= record["cuda_allocated_bytes"]
        assert record["nvml_used_bytes"] >= record["cuda_reserved_bytes"]  # NVML adds the context and others
    summary = read_summary(tmp_path / "run")
    breakdown = summary["memory_breakdown"]
    assert breakdown["basis"] == "cuda_peak_allocated" and breakdown["weights_bytes"] == weights
    assert breakdown["optimizer_state_bytes"] == summary["optimizer_state"]["by_device"]["cuda:0"]
    assert summary["hardware"]["gpu"]["capacity_bytes"] == capacity and summary["nvml_error"] is None
    for name in ("loss.png", "memory.png", "dashboard.png"):
        assert_png_drawn(tmp_path / "run" / name)
