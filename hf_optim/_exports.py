"""Everything ``import hf_optim`` provides: the optimizer classes, the registry, the names, and transformers'
patch (installed here). ``hf_optim/__init__`` imports it at once, except in the ``hf-optim`` command, which
imports it once its checks that need no torch have passed (:mod:`hf_optim._startup`)."""


from hf_optim import notices as _notices
from hf_optim.checkpoints import last_complete_checkpoint
from hf_optim.core.algorithm import Algorithm, TritonPlan
from hf_optim.core.own_update import OwnUpdate
from hf_optim.core.partition import Partition, PartRule
from hf_optim.core.state_store import StateSpec
from hf_optim.formats import available_state_formats
from hf_optim.integrations import transformers as _transformers_integration
from hf_optim.integrations.names import OptimizerName, available_optimizers
from hf_optim.memory import StateMemory, state_memory
from hf_optim.optim.adafactor import Adafactor, RelativeStepSchedule
from hf_optim.optim.adamw import (
    AdamW,
    AdamW4bit,
    AdamW8bit,
    AdamW32bit,
    PagedAdamW,
    PagedAdamW4bit,
    PagedAdamW8bit,
    PagedAdamW32bit,
)
from hf_optim.optim.ademamix import (
    AdEMAMix,
    AdEMAMix4bit,
    AdEMAMix8bit,
    AdEMAMix32bit,
    PagedAdEMAMix,
    PagedAdEMAMix4bit,
    PagedAdEMAMix8bit,
    PagedAdEMAMix32bit,
)
from hf_optim.optim.base import HfOptimizer, StateDictError
from hf_optim.optim.lamb import LAMB, LAMB8bit, LAMB32bit, PagedLAMB, PagedLAMB8bit, PagedLAMB32bit
from hf_optim.optim.lion import (
    Lion,
    Lion4bit,
    Lion8bit,
    Lion32bit,
    PagedLion,
    PagedLion4bit,
    PagedLion8bit,
    PagedLion32bit,
)
from hf_optim.optim.muon import (
    Muon,
    Muon4bit,
    Muon8bit,
    Muon32bit,
    PagedMuon,
    PagedMuon4bit,
    PagedMuon8bit,
    PagedMuon32bit,
)
from hf_optim.optim.registry import Family, UnknownAlgorithmError, families, lookup_algorithm, register_algorithm
from hf_optim.optim.rmsprop import RMSprop, RMSprop8bit, RMSprop32bit
from hf_optim.optim.trainer_mapping import TrainerMapping

_notices.hide_optional_kernel_notices()  # before bitsandbytes is imported (by peft, transformers): it logs one then
_transformers_integration.install()

__all__ = [
    "AdamW", "AdamW4bit", "AdamW8bit", "AdamW32bit", "PagedAdamW", "PagedAdamW4bit", "PagedAdamW8bit",
    "PagedAdamW32bit",
    "AdEMAMix", "AdEMAMix4bit", "AdEMAMix8bit", "AdEMAMix32bit", "PagedAdEMAMix", "PagedAdEMAMix4bit",
    "PagedAdEMAMix8bit", "PagedAdEMAMix32bit",
    "LAMB", "LAMB8bit", "LAMB32bit", "PagedLAMB", "PagedLAMB8bit", "PagedLAMB32bit",
    "Lion", "Lion4bit", "Lion8bit", "Lion32bit", "PagedLion", "PagedLion4bit", "PagedLion8bit", "PagedLion32bit",
    "RMSprop", "RMSprop8bit", "RMSprop32bit", "Muon", "Muon4bit", "Muon8bit", "Muon32bit", "PagedMuon",
    "PagedMuon4bit", "PagedMuon8bit", "PagedMuon32bit", "Adafactor", "RelativeStepSchedule",
    "HfOptimizer", "StateDictError", "OptimizerName", "available_optimizers", "StateMemory", "state_memory",
    "last_complete_checkpoint",
    "Algorithm", "StateSpec", "TrainerMapping", "TritonPlan", "OwnUpdate", "Partition", "PartRule", "Family",
    "register_algorithm", "lookup_algorithm", "UnknownAlgorithmError", "available_state_formats",
]
# The classes of a state format registered without export lines of its own (hf_optim.AdamWFp8, ...): every
# built-in family's classes are package attributes.
for _family in families():
    for _name, _cls in _family.classes.items():
        if _name not in globals():
            globals()[_name] = _cls
            __all__.append(_name)

