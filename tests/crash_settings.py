"""The run test_crash_safety.py kills and resumes (shared with crash_worker.py)."""

NAME = "ademamix_8bit"  # three 8-bit state tensors per weight (stacked EMAs), the most to corrupt
MAX_STEPS = 6
SAVE_STEPS = 2
