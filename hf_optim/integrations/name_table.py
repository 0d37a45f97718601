"""hf_optim's ``optim=`` names, as a table that needs no import of torch (the ``hf-optim`` command answers
``--help`` and a mistyped name with it before torch is imported). Standard library only."""

HF_OPTIM_OPTIMIZER_NAMES = (
    "adafactor", "adafactor_8bit", "adamw_32bit", "adamw_4bit", "adamw_4bit_rank1", "adamw_8bit", "adamw_bnb_8bit",
    "adamw_fp8", "adamw_torch_4bit", "adamw_torch_8bit", "ademamix", "ademamix_32bit", "ademamix_4bit",
    "ademamix_4bit_rank1", "ademamix_8bit", "ademamix_fp8", "lamb", "lamb_32bit", "lamb_8bit", "lion_32bit",
    "lion_4bit", "lion_8bit", "lion_fp8", "muon", "muon_32bit", "muon_4bit", "muon_8bit", "muon_fp8",
    "paged_adamw_32bit", "paged_adamw_4bit", "paged_adamw_4bit_rank1", "paged_adamw_8bit", "paged_adamw_fp8",
    "paged_ademamix_32bit", "paged_ademamix_4bit", "paged_ademamix_4bit_rank1", "paged_ademamix_8bit",
    "paged_ademamix_fp8", "paged_lamb_32bit", "paged_lamb_8bit", "paged_lion_32bit", "paged_lion_4bit",
    "paged_lion_8bit", "paged_lion_fp8", "paged_muon_32bit", "paged_muon_4bit", "paged_muon_8bit", "paged_muon_fp8",
    "rmsprop_8bit", "rmsprop_bnb", "rmsprop_bnb_32bit", "rmsprop_bnb_8bit",
)
"""The ``optim=`` names of hf_optim's built-in algorithms and formats (``hf_optim.integrations.names.OPTIMIZER_NAMES``
after import; tests/cli/test_cli_fast.py keeps the two equal). A name registered at run time by a user's
``register_algorithm`` is not here: the CLI runs no user code before its checks."""
