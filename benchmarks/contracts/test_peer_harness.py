"""The peer-suite harness's own logic, without the peers' checkouts: the stand-ins' argument mapping, the rules
that leave torch's inputs out (each checked against what hf_optim really does, so a rule whose reason stops being
true fails here), the class selection, and the side-by-side summary's failure sets."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch

import hf_optim

sys.path.insert(0, str(Path(__file__).resolve().parent))
import peer_summary  # noqa: E402
import torch_standins  # noqa: E402


def build_and_step(cls, kwargs):
    params = [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(3))]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # paged-on-CPU and LAMB notices
        opt = cls(params, **kwargs)
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()


def test_adafactor_inputs_get_hf_optim_names_and_an_explicit_lr_turns_off_the_relative_step():
    mapped = torch_standins.map_kwargs(hf_optim.Adafactor, {"beta2_decay": -1.0, "d": 1.5, "lr": 0.01})
    assert mapped == {"decay_rate": -1.0, "clip_threshold": 1.5, "lr": 0.01, "relative_step": False,
                      "min_8bit_size": 0}
    build_and_step(hf_optim.Adafactor, mapped)


def test_ademamix_gets_its_default_third_beta_and_quantized_classes_their_format_on_tiny_tensors():
    mapped = torch_standins.map_kwargs(hf_optim.AdEMAMix8bit, {"betas": (0.8, 0.9)})
    assert mapped == {"betas": (0.8, 0.9, 0.9999), "min_8bit_size": 0}
    build_and_step(hf_optim.AdEMAMix8bit, mapped)


@pytest.mark.parametrize(("cls", "kwargs", "rule"), [
    (hf_optim.AdamW8bit, {"maximize": True}, "maximize"),
    (hf_optim.AdamW8bit, {"amsgrad": True}, "amsgrad=True"),
    (hf_optim.LAMB8bit, {"amsgrad": True}, "amsgrad=True"),
    (hf_optim.RMSprop8bit, {"centered": True}, "RMSprop centered / momentum"),
    (hf_optim.RMSprop8bit, {"momentum": 0.1}, "RMSprop centered / momentum"),
    (hf_optim.AdamW8bit, {"foreach": False}, "implementation flag"),
    (hf_optim.AdamW8bit, {"betas": (torch.tensor(0.9), torch.tensor(0.99))}, "tensor betas"),
    (hf_optim.Lion8bit, {"eps": 1e-8}, "no such argument"),
], ids=["maximize", "amsgrad", "lamb-amsgrad", "centered", "momentum", "foreach", "tensor-betas", "lion-eps"])
def test_each_rule_leaves_out_only_what_hf_optim_refuses(cls, kwargs, rule):
    mapped = torch_standins.map_kwargs(cls, kwargs)
    found = torch_standins._first_rule(cls, mapped)
    assert found is not None and found.name == rule
    with pytest.raises((TypeError, ValueError)):
        build_and_step(cls, mapped)


@pytest.mark.parametrize("cls", [hf_optim.AdamW8bit, hf_optim.RMSprop8bit, hf_optim.Lion8bit, hf_optim.LAMB8bit,
                                 hf_optim.AdEMAMix8bit, hf_optim.Muon8bit, hf_optim.Adafactor],
                         ids=lambda cls: cls.__name__)
def test_inputs_no_rule_names_are_taken(cls):
    for kwargs in ({}, {"lr": 0.01}, {"weight_decay": 0.1}, {"lr": torch.tensor(0.001)}):
        mapped = torch_standins.map_kwargs(cls, kwargs)
        assert torch_standins._first_rule(cls, mapped) is None
        build_and_step(cls, mapped)


def test_the_class_selection_names_real_classes_and_refuses_a_typo():
    assert [cls.__name__ for cls in torch_standins.hf_optim_classes()] == sorted(
        torch_standins.REPRESENTATIVE, key=[c.__name__ for c in torch_standins.hf_optim_classes("all")].index)
    assert len(torch_standins.hf_optim_classes("all")) > len(torch_standins.REPRESENTATIVE)
    with pytest.raises(SystemExit, match="error: unknown hf_optim class AdamW9bit"):
        torch_standins.hf_optim_classes("AdamW8bit,AdamW9bit")


JUNIT = """<testsuites><testsuite>
<testcase classname="t.C" name="test_a"/>
<testcase classname="t.C" name="test_b"><failure message="RuntimeError: GuardManager check">x</failure></testcase>
<testcase classname="t.C" name="test_c"><failure message="AssertionError: both">y</failure></testcase>
<testcase classname="t.C" name="test_d"><skipped message="no GPU"/></testcase>
</testsuite></testsuites>"""


def test_the_summary_splits_failures_by_mode(tmp_path):
    xml = tmp_path / "default.xml"
    xml.write_text(JUNIT)
    outcomes, messages = peer_summary.read_junit(xml)
    assert outcomes == {"t.C::test_a": "passed", "t.C::test_b": "failed", "t.C::test_c": "failed",
                        "t.C::test_d": "skipped"}
    default = peer_summary.Run("torch", "default", 1, 1.0, outcomes, messages)
    eager = peer_summary.Run("torch", "0", 1, 1.0, dict(outcomes, **{"t.C::test_b": "passed"}), messages)
    text = peer_summary.summary([default, eager], ["load"])
    only_default = text.split("Failures with the default compile mode only (1)")[1].split("##")[0]
    assert "test_b" in only_default and "GuardManager" in only_default and "test_c" not in only_default
    assert "t.C::test_c" in text.split("Failures in both modes (1)")[1].split("##")[0]
    assert "| torch | 1 / 2 / 1 (1, 1) | 2 / 1 / 1 (1, 1) |" in text


def test_a_report_of_earlier_runs_reads_their_files_back(tmp_path, capsys):
    (tmp_path / "torch-default.xml").write_text(JUNIT)
    (tmp_path / "torch-0.xml").write_text(JUNIT.replace("<failure message=\"RuntimeError: GuardManager check\">x"
                                                        "</failure>", ""))
    assert peer_summary.main(["--report", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "| torch | 1 / 2 / 1 (1, 0) | 2 / 1 / 1 (1, 0) |" in printed
    assert "default compile mode only (1)" in printed
