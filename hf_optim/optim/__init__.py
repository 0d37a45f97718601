"""Optimizer algorithms, one module each, all built on :class:`hf_optim.optim.base.HfOptimizer`."""
