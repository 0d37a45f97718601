"""Integrations with the Hugging Face stack: Trainer / TRL optimizer names."""
