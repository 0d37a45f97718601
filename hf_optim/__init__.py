"""hf_optim: memory-efficient optimizers for Hugging Face training, compatible with bitsandbytes' state format."""

from hf_optim.optim.adamw import AdamW, AdamW8bit, AdamW32bit, PagedAdamW, PagedAdamW8bit, PagedAdamW32bit

__version__ = "0.1.0"
