"""Recipe files: validation against the installed classes, error reports, extends, overrides, auto, smoke mode."""

from __future__ import annotations

import textwrap
import warnings

import pytest
import torch

from hf_optim.recipes import RecipeError, bundled_names, load_recipe
from hf_optim.recipes.build import build_sft_config
from hf_optim.recipes.hardware import best_dtype, resolve_auto
from hf_optim.recipes.loading import parse_value
from hf_optim.recipes.targets import training_target
from hf_optim.tiny import BUILTIN_DATA, BUILTIN_MODEL

GOOD = """
model: {id: builtin:tiny-llama-3, dtype: float32}
peft: {r: 32, lora_alpha: 32, target_modules: [q_proj, v_proj]}
training: {optim: adamw_8bit, learning_rate: 2e-4, max_steps: 2}
data: {path: builtin:tiny-chat}
"""


def write(tmp_path, text: str, name: str = "r.yaml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def errors_of(path, *overrides, smoke=False) -> list[str]:
    with pytest.raises(RecipeError) as info:
        load_recipe(path, overrides, smoke=smoke)
    return str(info.value).splitlines()


def test_every_bundled_recipe_validates():
    names = bundled_names()
    assert {"quickstart", "llama-3.2-1b-lora", "llama-3.2-1b-qlora", "llama-3.2-1b-full", "llama-3.2-3b-lora",
            "llama-3.2-3b-qlora", "llama-3.2-3b-full", "llama-3.1-8b-lora", "llama-3.1-8b-qlora",
            "llama-3.1-8b-full", "llama-3.3-70b-qlora"} <= set(names)
    for name in names:
        recipe = load_recipe(name)
        assert recipe.hardware, name  # every bundled recipe says what it targets
        assert recipe.method == ("full" if "full" in name.split("-") else "qlora" if "qlora" in name or
                                 name == "quickstart" else "lora"), name


def test_muon_recipe_is_the_full_recipe_with_muon_8bit_at_the_adamw_lr():
    """llama-3.2-1b-full-muon changes only the optimizer (and its run's names): with match_rms_adamw, the Trainer's
    default for the muon names, the AdamW recipe's lr is the one its header promises (docs/muon_defaults.md)."""
    muon, adamw = load_recipe("llama-3.2-1b-full-muon").to_dict(), load_recipe("llama-3.2-1b-full").to_dict()
    assert muon["training"].pop("optim") == "muon_8bit" and adamw["training"].pop("optim") == "paged_adamw_8bit"
    for recipe, name in ((muon, "llama-3.2-1b-full-muon"), (adamw, "llama-3.2-1b-full")):
        assert recipe["training"].pop("output_dir") == f"runs/{name}" and recipe["logging"].pop("run_name") == name
        recipe.pop("description")
    assert muon == adamw


def test_misspelled_key_in_each_section_is_reported_with_file_key_and_suggestion(tmp_path):
    path = write(tmp_path, """
        trainig: {}
        model: {id: x, dtyp: bfloat16}
        quantization: {load_in_4bitt: true}
        peft: {lora_rr: 8}
        training: {learning_rat: 1.0e-4}
        data: {pth: x.jsonl}
        logging: {run_nam: x}
        """)
    lines = errors_of(path)
    expected = [
        "trainig: unknown section; did you mean 'training'?",
        "model.dtyp: unknown from_pretrained argument; did you mean 'dtype'?",
        "quantization.load_in_4bitt: unknown BitsAndBytesConfig field; did you mean 'load_in_4bit'?",
        "peft.lora_rr: unknown LoraConfig field; did you mean 'r'?",
        "training.learning_rat: unknown SFTConfig field; did you mean 'learning_rate'?",
        "data.pth: unknown key; did you mean 'path'?",
        "logging.run_nam: unknown key; did you mean 'run_name'?",
    ]
    for message in expected:
        assert f"{path}: {message}" in lines, (message, lines)
    assert f"{path}: data.path: Field required" in lines  # everything is collected, not only the first error


def test_wrong_types_are_reported(tmp_path):
    path = write(tmp_path, """
        model: {id: 7}
        peft: {r: sixteen}
        training: {learning_rate: fast, num_train_epochs: [1], gradient_checkpointing: maybe}
        quantization: {load_in_4bit: "no way"}
        data: {path: x, max_samples: -3}
        logging: {monitor: 12}
        """)
    lines = errors_of(path)
    for message in ["model.id: expected str, got int 7", "peft.r: expected int, got str 'sixteen'",
                    "training.learning_rate: expected float, got str 'fast'",
                    "training.num_train_epochs: expected float, got list [1]",
                    # checked against activation_checkpointing (bool | None) where transformers renamed it
                    "training.gradient_checkpointing: expected bool",
                    "quantization.load_in_4bit: expected bool, got str 'no way'",
                    "data.max_samples: Input should be greater than 0",
                    "logging.monitor: Input should be a valid boolean"]:
        assert any(line.startswith(f"{path}: {message}") for line in lines), (message, lines)
    assert any(line.startswith(f"{path}: training.gradient_checkpointing: ") and line.endswith("got str 'maybe'")
               for line in lines)


def test_unknown_optimizer_suggests_names(tmp_path):
    path = write(tmp_path, GOOD)
    (line,) = errors_of(path, "training.optim=paged_adamw_8bt")
    assert line.startswith("command line: training.optim: unknown optimizer 'paged_adamw_8bt'; did you mean "
                           "'paged_adamw_8bit'")
    load_recipe(path, ["training.optim=adamw_torch"])  # transformers' own names are valid too
    load_recipe(path, ["training.optim=lamb_8bit"])


def test_not_a_mapping(tmp_path):
    (line,) = errors_of(write(tmp_path, "- model\n- training\n", "list.yaml"))
    assert line.startswith(f"{tmp_path / 'list.yaml'}: a recipe must be a mapping of sections")
    path = write(tmp_path, GOOD + "logging: 16\n")
    lines = errors_of(path, "peft=16")
    assert "command line: peft: must be a mapping of keys, got int 16" in lines
    assert f"{path}: logging: must be a mapping of keys, got int 16" in lines


def test_values_checked_by_the_class_itself(tmp_path):
    (line,) = errors_of(write(tmp_path, GOOD), "peft.bias=some")
    assert "peft.bias" in line
    (line,) = errors_of(write(tmp_path, GOOD), "quantization.load_in_4bit=true", "quantization.load_in_8bit=true")
    # both keys came from the command line: the issue names them and blames the command line, not the file
    assert line.startswith("command line: quantization.load_in_4bit, quantization.load_in_8bit: BitsAndBytesConfig "
                           "rejected these values: ")


def test_yaml_number_strings_become_numbers(tmp_path):
    recipe = load_recipe(write(tmp_path, GOOD))  # YAML 1.1 reads 2e-4 as a string
    assert recipe.training["learning_rate"] == 2e-4 and isinstance(recipe.training["learning_rate"], float)
    assert parse_value("1e-4") == 1e-4 and parse_value("[q_proj, v_proj]") == ["q_proj", "v_proj"]
    assert parse_value("null") is None and parse_value("true") is True and parse_value("lamb_8bit") == "lamb_8bit"


def test_yaml_boolean_words_are_read_by_the_fields_type(tmp_path):
    """YAML 1.1 reads no/yes/on/off as booleans. A string or enum field keeps the word (transformers documents
    save_strategy="no"); a bool field takes the boolean; a number field refuses it. The same on the command line,
    in a file, and through extends, where a child's value replaces the parent's word."""
    import yaml
    from transformers.trainer_utils import SaveStrategy
    from trl import SFTConfig

    words = ["training.save_strategy=no", "training.eval_strategy=No", "training.use_cpu=yes", "logging.monitor=off",
             "logging.run_name=on", "peft.target_modules=[q_proj, on]"]
    in_file = write(tmp_path, GOOD.replace("max_steps: 2}", "max_steps: 2, save_strategy: no, eval_strategy: No, "
                                           "use_cpu: yes}") + "logging: {monitor: off, run_name: on}\n", "words.yaml")
    in_file.write_text(in_file.read_text().replace("target_modules: [q_proj, v_proj]", "target_modules: [q_proj, on]"))
    for recipe in (load_recipe(write(tmp_path, GOOD), words), load_recipe(in_file)):
        assert recipe.training["save_strategy"] == "no" and recipe.training["eval_strategy"] == "No"
        assert recipe.training["use_cpu"] is True
        assert recipe.logging.monitor is False and recipe.logging.run_name == "on"
        assert recipe.peft["target_modules"] == ["q_proj", "on"]
        recipe.training["eval_strategy"] = "no"  # "No" is a string to the schema; transformers wants lower case
        built = build_sft_config(recipe, tmp_path / "out")
        reference = SFTConfig(output_dir=str(tmp_path), save_strategy="no", use_cpu=True)
        assert built.save_strategy == reference.save_strategy == SaveStrategy.NO
        # recipe.yaml keeps the word a word
        assert yaml.safe_load(yaml.safe_dump(recipe.to_dict()))["training"]["save_strategy"] == "no"
    child = write(tmp_path, "extends: words.yaml\ntraining: {save_strategy: steps, use_cpu: no}\n", "child.yaml")
    recipe = load_recipe(child)
    assert recipe.training["save_strategy"] == "steps" and recipe.training["use_cpu"] is False
    assert load_recipe(child, ["training.save_strategy=off"]).training["save_strategy"] == "off"
    assert load_recipe(in_file, smoke=True).training["save_strategy"] == "no"  # smoke mode's own, a string
    # random-weights mode keeps the words of the values it does not replace
    from hf_optim.recipes.loading import load_raw
    from hf_optim.recipes.real_shape import RandomWeights, random_weights_recipe

    measured = random_weights_recipe(load_raw(in_file), RandomWeights())
    assert measured.bool_words == {"training.use_cpu": "yes",  # (eval_strategy is its own "no")
                                   "logging.monitor": "off", "logging.run_name": "on", "peft.target_modules.1": "on"}
    # a number field refuses a boolean (pydantic's lax mode would make it 1.0), naming the word written
    assert errors_of(in_file, "training.learning_rate=yes", "data.seed=off") == [
        "command line: training.learning_rate: expected float, got 'yes'",
        "command line: data.seed: expected int, got 'off'"]
    assert errors_of(write(tmp_path, GOOD + "logging: {run_name: [x, no]}\n")) == [
        f"{tmp_path / 'r.yaml'}: logging.run_name: Input should be a valid string"]


def test_overrides(tmp_path):
    path = write(tmp_path, GOOD)
    recipe = load_recipe(path, ["training.optim=lamb_8bit", "training.learning_rate=1e-4", "peft.r=64",
                                "peft.target_modules=[q_proj, k_proj]", "logging.run_name=x"])
    assert recipe.optim == "lamb_8bit" and recipe.training["learning_rate"] == 1e-4
    assert recipe.peft["r"] == 64 and recipe.peft["target_modules"] == ["q_proj", "k_proj"]
    assert recipe.logging.run_name == "x"
    assert load_recipe(path, ["peft=null"]).method == "full"
    (line,) = errors_of(path, "training.optim")
    assert line.startswith("command line: training.optim: an override is KEY.PATH=VALUE")


def test_extends_deep_merges_and_names_the_file_of_each_error(tmp_path):
    parent = write(tmp_path, GOOD.replace("max_steps: 2", "max_steps: 2, warmup_stepz: 1"), "parent.yaml")
    child = write(tmp_path, """
        extends: parent.yaml
        peft: {r: 16}
        training: {optim: lion_8bit}
        data: {max_sampels: 4}
        """, "child.yaml")
    lines = errors_of(child)
    assert f"{parent}: training.warmup_stepz: unknown SFTConfig field; did you mean 'warmup_steps'?" in lines
    assert f"{child}: data.max_sampels: unknown key; did you mean 'max_samples'?" in lines
    write(tmp_path, GOOD, "parent.yaml")
    recipe = load_recipe(write(tmp_path, "extends: parent.yaml\npeft: {r: 16}\ntraining: {optim: lion_8bit}\n",
                               "child.yaml"))
    assert recipe.peft == {"r": 16, "lora_alpha": 32, "target_modules": ["q_proj", "v_proj"]}
    assert recipe.optim == "lion_8bit" and recipe.training["max_steps"] == 2
    # a bundled recipe extends another bundled one by name
    qlora = load_recipe("llama-3.1-8b-qlora")
    assert qlora.model["id"] == "meta-llama/Llama-3.1-8B-Instruct" and qlora.peft["r"] == 16
    checkpointing = training_target().aliases.get("gradient_checkpointing", "gradient_checkpointing")
    assert qlora.training[checkpointing] is True  # inherited from the LoRA recipe


@pytest.mark.parametrize("name", ["quickstart", "llama-3.2-1b-lora"])
def test_sft_config_gets_the_key_the_installed_transformers_does_not_deprecate(name, tmp_path):
    """The LoRA recipe sets gradient_checkpointing (the name every supported transformers knows); the quickstart
    sets nothing and gets TRL's default. transformers 5.2x deprecates the name with a FutureWarning: neither
    recipe may trigger it, and both must still turn activation checkpointing on."""
    recipe = load_recipe(name, smoke=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        config = build_sft_config(recipe, tmp_path)
    assert config.gradient_checkpointing is True  # transformers mirrors the new name into the old one
    if "gradient_checkpointing" in training_target().aliases:  # this transformers has the new name
        assert config.activation_checkpointing is True
        assert "gradient_checkpointing" not in recipe.training


def test_deprecated_key_and_its_replacement_together_are_refused(tmp_path):
    aliases = training_target().aliases
    if "gradient_checkpointing" not in aliases:  # transformers before the rename: one name, nothing to refuse
        assert load_recipe(write(tmp_path, GOOD), ["training.gradient_checkpointing=false"])
        return
    lines = errors_of(write(tmp_path, GOOD), "training.gradient_checkpointing=false",
                      f"training.{aliases['gradient_checkpointing']}=true")
    assert lines == ["command line: training.gradient_checkpointing: deprecated alias of 'activation_checkpointing', "
                     "which is set too: keep only one of them"]


def test_extends_cycle_and_missing_file(tmp_path):
    write(tmp_path, "extends: b.yaml\n", "a.yaml")
    write(tmp_path, "extends: a.yaml\n", "b.yaml")
    (line,) = errors_of(tmp_path / "a.yaml")
    assert "circular extends" in line
    (line,) = errors_of("llama-3.1-8b-lroa")
    assert "did you mean 'llama-3.1-8b-lora'" in line


def test_auto_resolves_to_the_hardware(tmp_path):
    assert best_dtype() == ("float32" if not torch.cuda.is_available() else best_dtype())
    assert best_dtype(use_cpu=True) == "float32"
    qlora = load_recipe("llama-3.1-8b-qlora")
    full = load_recipe("llama-3.1-8b-full")
    for dtype, bf16, fp16 in (("bfloat16", True, False), ("float16", False, True), ("float32", False, False)):
        resolved = resolve_auto(qlora, dtype)
        assert resolved.model["dtype"] == dtype and resolved.quantization["bnb_4bit_compute_dtype"] == dtype
        assert (resolved.training["bf16"], resolved.training["fp16"]) == (bf16, fp16)
        assert qlora.model["dtype"] == "auto"  # the original is untouched
    # a full fine-tune on an fp16-only GPU keeps fp32 weights under fp16 autocast
    assert resolve_auto(full, "float16").model["dtype"] == "float32"
    assert resolve_auto(full, "float16").training["fp16"] is True


@pytest.mark.parametrize("name", ["llama-3.3-70b-qlora", "llama-3.2-1b-lora", "llama-3.1-8b-full"])
def test_smoke_mode_keeps_method_lora_and_optimizer(name, monkeypatch):
    original = load_recipe(name)
    smoke = load_recipe(name, smoke=True)
    assert smoke.method == original.method and smoke.optim == original.optim
    assert smoke.peft == original.peft
    assert smoke.model["id"] == BUILTIN_MODEL and smoke.data.path == BUILTIN_DATA
    assert smoke.training["use_cpu"] is True and smoke.training["max_steps"] == 3
    if original.quantization:
        assert smoke.quantization["load_in_4bit"] and smoke.quantization["bnb_4bit_compute_dtype"] == "float32"
    monkeypatch.setenv("HF_OPTIM_SMOKE", "1")
    assert load_recipe(name).model["id"] == BUILTIN_MODEL
    assert load_recipe(name, ["training.max_steps=5"]).training["max_steps"] == 5  # overrides apply after smoke


def test_bundled_chat_data_and_tokenizer():
    import json
    import re

    from hf_optim.tiny import CHAT_FILE, LLAMA3_SPECIAL_TOKENS, bundled_tokenizer, tiny_chat_examples

    shipped = [json.loads(line) for line in CHAT_FILE.read_text().splitlines()]
    assert shipped == tiny_chat_examples()  # the file is the generator's output
    for example in shipped:
        question, answer = (turn["content"] for turn in example["messages"])
        if match := re.fullmatch(r"What is (\d+) plus (\d+)\?", question):
            assert answer == f"{match[1]} plus {match[2]} is {int(match[1]) + int(match[2])}."
        elif match := re.fullmatch(r"Reverse the word '(\w+)'\.", question):
            assert answer == f"'{match[1]}' reversed is '{match[1][::-1]}'."
    tokenizer = bundled_tokenizer()
    assert all(token in tokenizer.get_vocab() for token in LLAMA3_SPECIAL_TOKENS)
    text = tokenizer.apply_chat_template(shipped[0]["messages"], tokenize=False)
    assert text.startswith("<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n")
    assert text.endswith("<|eot_id|>") and tokenizer.eos_token == "<|eot_id|>"
    assert tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"]) == text
