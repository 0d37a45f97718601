"""``hf-optim validate --fit``: memory sizes, fit decisions against a hand computation, "nothing fits", bytes per
parameter of Llama-3.1-8B against the state formats' own byte counts, gradient release never planned above
gradients kept, and the tables docs/guide/recipes.md shows are what the command prints now.

    python tests/recipes/test_fit_planner.py --write   # rewrite docs/guide/recipes.md's --fit outputs
"""

from __future__ import annotations

import io
import re
import sys
from pathlib import Path

import pytest

from hf_optim import cli
from hf_optim.formats import BLOCKWISE4, BLOCKWISE8
from hf_optim.recipes import load_recipe
from hf_optim.recipes.fit import CUDA_CONTEXT_BYTES, FRAGMENTATION_SHARE, parse_memory, plan
from hf_optim.tiny import TINY_CHAT_SHAPE

GIB = 2**30


@pytest.mark.parametrize("text,expected", [("24GiB", 24 * GIB), ("24G", 24 * GIB), ("80g", 80 * GIB),
                                           ("24GB", 24 * 10**9), ("24000MB", 24 * 10**9), ("22.5GiB", 22.5 * GIB),
                                           ("512 MiB", 512 * 2**20)])
def test_memory_sizes(text, expected):
    assert parse_memory(text) == int(expected)


@pytest.mark.parametrize("text", ["24", "24XB", "-5GB", "0GB", "big", ""])
def test_bad_memory_sizes_name_the_value_and_show_examples(text):
    with pytest.raises(ValueError, match="e.g. 24GiB") as info:
        parse_memory(text)
    assert repr(text) in str(info.value)


def test_cli_refuses_a_size_without_unit(capsys):
    assert cli.main(["validate", "quickstart", "--fit", "24"]) == 2
    assert "'24': no unit" in capsys.readouterr().err


def tiny_full_recipe():
    return load_recipe("quickstart", ["quantization=null", "peft=null", "model.dtype=bfloat16",
                                      "training.max_length=256", "training.per_device_train_batch_size=2"])


def hand_peak_kept_no_checkpointing(batch: int) -> tuple[int, int]:
    """(peak bytes, parameters) of the tiny bf16 full fine-tune with adamw_8bit, gradients kept, no checkpointing,
    worked out here from the config: at the start of backward, weights + state + every saved activation + the
    loss head's two fp32 logit-sized gradients."""
    from hf_optim.tiny import bundled_tokenizer

    h, i, layers, heads = TINY_CHAT_SHAPE["hidden_size"], TINY_CHAT_SHAPE["intermediate_size"], 2, 4
    kv = TINY_CHAT_SHAPE["kv_heads"] * h // heads
    vocab = len(bundled_tokenizer())
    linear = [h * h, h * kv, h * kv, h * h, h * i, h * i, i * h]
    params = vocab * h + layers * (sum(linear) + 2 * h) + h  # tied embedding
    # adamw_8bit: the embedding and the norm vectors (< 4096 elements) keep fp32 state (two slots of 4 bytes)
    state = 8 * (vocab * h + (2 * layers + 1) * h) + layers * sum(2 * BLOCKWISE8.state_bytes(n) for n in linear)
    norm = 4 * h + 2 * 2 * h + 4
    layer = 2 * norm + 2 * (2 * h + 2 * kv) + 4 * heads + 4 * 2 * i
    per_token = layers * layer + norm + 4 * vocab + 16 + 8 * vocab
    return 2 * params + state + batch * 256 * per_token, params


def card_for(peak: int) -> float:
    return (peak + CUDA_CONTEXT_BYTES) / (1 - FRAGMENTATION_SHARE)


def row(result, optim, release=False, checkpointing=False):
    return next(f for f in result.fits + result.misfits
                if (f.setup.optim, f.setup.release, f.setup.checkpointing) == (optim, release, checkpointing))


def test_fit_decisions_match_a_hand_computation():
    recipe = tiny_full_recipe()
    peak3, params = hand_peak_kept_no_checkpointing(3)
    exact = plan(recipe, int(card_for(peak3)) + 64)
    assert row(exact, "adamw_8bit").batch_bytes[2] == hand_peak_kept_no_checkpointing(2)[0]
    assert row(exact, "adamw_8bit").max_batch == 3
    short = plan(recipe, int(card_for(peak3)) - 64)  # a few bytes short of batch 3
    assert row(short, "adamw_8bit").max_batch == 2
    # bytes/param of the setup: bf16 weights and gradients (2 + 2) + its state
    assert row(exact, "adamw_8bit").bytes_per_param == pytest.approx(
        (4 * params + row(exact, "adamw_8bit").state_bytes) / params)
    # paged: the state is not counted on the GPU
    unpaged = row(exact, "adamw_8bit")
    assert row(exact, "paged_adamw_8bit").batch_bytes[2] == unpaged.batch_bytes[2] - unpaged.state_bytes
    # ranked: the unpaged, gradients-kept, no-checkpointing setups that reach the recipe's batch come first
    first = exact.fits[0].setup
    assert not (first.paged or first.release or first.checkpointing) and exact.fits[0].max_batch >= 2


def test_nothing_fits_says_so(capsys):
    assert cli.main(["validate", "llama-3.1-8b-full", "--fit", "8GiB"]) == 0
    out = capsys.readouterr().out
    assert "Nothing fits on 8.00 GiB" in out and "smallest setup" in out
    result = plan(load_recipe("llama-3.1-8b-full"), 8 * GIB)
    # adamw_torch's 2 setups and 8 per state format (paged x release x checkpointing): fp32, blockwise8, fp8,
    # blockwise4, rank1_4bit
    assert not result.fits and len(result.misfits) == 2 + 8 * 5


def test_8b_bytes_per_param_from_the_formats():
    """validate's per-setup bytes/param for Llama-3.1-8B from the formats' own state_bytes, worked per tensor."""
    hidden, inter, layers, kv, vocab = 4096, 14336, 32, 1024, 128256
    matrices = [hidden * hidden] * 2 + [hidden * kv] * 2 + [hidden * inter] * 3
    params = 2 * vocab * hidden + layers * (sum(matrices) + 2 * hidden) + hidden
    quantized = layers * (matrices + [hidden, hidden]) + [hidden, vocab * hidden]  # norms: 4096, the untied head
    fp32_state = 8 * vocab * hidden  # the input embedding keeps fp32 state
    result = plan(load_recipe("llama-3.1-8b-full"), 80 * GIB)
    for optim, fmt in (("adamw_8bit", BLOCKWISE8), ("adamw_4bit", BLOCKWISE4)):
        state = fp32_state + sum(2 * fmt.state_bytes(n) for n in quantized)
        assert row(result, optim).bytes_per_param == pytest.approx((4 * params + state) / params)
        released = row(result, optim, release=True)
        # untied: the output head's gradient is stepped and freed before the input embedding's is made, so one
        # embedding-sized bf16 gradient is the most alive at once
        assert released.gradient_bytes == 2 * vocab * hidden
        assert released.bytes_per_param == pytest.approx((2 * params + 2 * vocab * hidden + state) / params)
    assert row(result, "adamw_torch").bytes_per_param == pytest.approx(8.0)  # bf16 weights, grads, m, v


def test_release_is_never_planned_above_gradients_kept():
    """The planner once put llama-3.2-1b-full's released setups above their kept twins (adamw_8bit, checkpointing,
    24 GiB: 19.45 GiB and batch 4 against 18.47 GiB and batch 5). Release only frees gradients: a released setup
    never needs more than its twin, and when the peak is the loss head's (long sequences) the table says why both
    are equal."""
    from hf_optim.recipes.fit import release_note

    for overrides, equal in (([], True), (["training.max_length=64"], False)):
        result = plan(load_recipe("llama-3.2-1b-full", overrides), 24 * GIB)
        setups = result.fits + result.misfits
        for released in (f for f in setups if f.setup.release):
            kept = row(result, released.setup.optim, release=False, checkpointing=released.setup.checkpointing)
            for batch, peak in released.batch_bytes.items():
                assert peak <= kept.batch_bytes[batch]
            assert released.max_batch >= kept.max_batch
            assert released.gradient_bytes < kept.gradient_bytes
            assert (released.batch_bytes[4] == kept.batch_bytes[4]) is equal
        assert (release_note(result) is not None) is equal


RECIPES_DOC = Path(__file__).resolve().parents[2] / "docs" / "guide" / "recipes.md"
DOC_OUTPUT = re.compile(r"(`hf-optim validate (?P<recipe>\S+) --fit (?P<card>\S+)` \(bundled architecture values, "
                        r"offline\):\n\n```\n)(?P<body>.*?)(```)", re.S)
DOC_ASSUMPTIONS = re.compile(r"(The planner's assumptions, as it prints them:\n\n```\n)(?P<body>.*?)(```)", re.S)


def fit_output(recipe: str, card: str) -> list[str]:
    """What ``hf-optim validate RECIPE --fit CARD`` prints from its plan on, as a pipe or file gets it (200 columns)."""
    from rich.console import Console

    out = io.StringIO()
    cli._print_fit(load_recipe(recipe), parse_memory(card), Console(file=out, width=200, soft_wrap=True))
    return [line.rstrip() for line in out.getvalue().splitlines()]


def documented(text: str) -> str:
    """docs/guide/recipes.md with every --fit output as the command prints it now: the table and the lines after it
    but the legend and the assumptions, which the page shows once (those of its first command)."""
    assumptions = []

    def table(match: re.Match) -> str:
        lines = fit_output(match["recipe"], match["card"])
        assumptions.append([f"- {line.removeprefix('assumption: ')}" for line in lines
                            if line.startswith("assumption: ")])
        body = [line for line in lines if not line.startswith(("assumption: ", "B/param: "))]
        return match.group(1) + "\n".join(body) + "\n" + match.group(5)

    text = DOC_OUTPUT.sub(table, text)
    return DOC_ASSUMPTIONS.sub(lambda m: m.group(1) + "\n".join(assumptions[0]) + "\n" + m.group(3), text)


def test_the_guide_shows_what_fit_prints_now():
    text = RECIPES_DOC.read_text()
    assert len(DOC_OUTPUT.findall(text)) == 4 and DOC_ASSUMPTIONS.search(text)
    assert documented(text) == text, "run: python tests/recipes/test_fit_planner.py --write"


if __name__ == "__main__" and sys.argv[1:] == ["--write"]:
    RECIPES_DOC.write_text(documented(RECIPES_DOC.read_text()))
