"""The source of truth for the notebooks in this folder: writes them, and re-executes them in smoke mode.

    python notebooks/build.py              # regenerate every notebook from the cells below (keeps no outputs)
    python notebooks/build.py --execute    # regenerate, run each in smoke mode (tiny model, CPU) and save outputs
    python notebooks/build.py --execute 01_quickstart_qlora_1b.ipynb    # just one

Cells shared by several notebooks (install, login, smoke switch, GPU check) are written once here; what a notebook
is about stays in its own cells, where the reader sees it. Executing skips the cells tagged ``skip-ci`` (install,
Hub login) and runs with ``HF_OPTIM_SMOKE=1`` in a temporary directory, so nothing is written into the repository
but the notebooks themselves.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import tempfile
import textwrap
from pathlib import Path

import nbformat

# The one place that names the repository: Colab badges and the install cell point here.
REPOSITORY = "hf-optim/hf_optim"
BRANCH = "main"
NOTEBOOK_DIR = Path(__file__).resolve().parent
REPO_ROOT = NOTEBOOK_DIR.parent

SKIP_CI = "skip-ci"  # cells CI does not run: package installs and the Hub login
PARAMETERS = "parameters"  # papermill's tag: `papermill -p MAX_STEPS 200 ...` overrides these values

DATASET_ID = "trl-lib/Capybara"  # multi-turn chats in the "messages" format (as the recipes use), ungated

# Llama 3 tokenizers reserve a pad token but leave it unset; the recipes pick the same one.
TOKENIZER = """
    tokenizer = AutoTokenizer.from_pretrained(MODEL_ID)
    tokenizer.pad_token = tokenizer.pad_token or "<|finetune_right_pad_id|>"
    """


def colab_url(name: str) -> str:
    return f"https://colab.research.google.com/github/{REPOSITORY}/blob/{BRANCH}/notebooks/{name}"


def colab_badge(name: str) -> str:
    return f"[![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)]({colab_url(name)})"


def _src(text: str) -> str:
    return textwrap.dedent(text).strip("\n")


def md(text: str, tags: tuple[str, ...] = ()):
    return nbformat.v4.new_markdown_cell(_src(text), metadata={"tags": list(tags)} if tags else {})


def code(*parts: str, tags: tuple[str, ...] = ()):
    """A code cell from one or more source parts (each dedented on its own, so shared snippets can be spliced in)."""
    source = "\n".join(_src(part) for part in parts)
    return nbformat.v4.new_code_cell(source, metadata={"tags": list(tags)} if tags else {})


# ------------------------------------------------------------------------------------------------ shared cells


def header(name: str, title: str, intro: str):
    note = _src("""
        > **About the saved outputs:** the outputs stored in this notebook come from a CPU smoke run
        > (`HF_OPTIM_SMOKE=1`: a tiny Llama-3-shaped model, bundled data, a few steps), which CI executes on every
        > change. They are not T4 figures. Run the notebook on a GPU for real numbers.
        """)
    return md("\n\n".join([f"# {title}", colab_badge(name), _src(intro), note]))


def install():
    return code(f"""
        # hf_optim with the recipes' Hugging Face stack (transformers, TRL, PEFT, bitsandbytes, datasets) and the
        # monitor's plotting and memory readers (matplotlib, psutil, nvidia-ml-py).
        %pip install -q "hf_optim[recipes,monitor] @ git+https://github.com/{REPOSITORY}"
        """, tags=(SKIP_CI,))


def login():
    return [
        md("""
            Llama weights are gated: accept the license on the model's Hub page once, then log in with a token that
            has read access (on Colab you can instead store it as the `HF_TOKEN` secret and skip this cell).
            """),
        code("""
            from huggingface_hub import notebook_login

            notebook_login()
            """, tags=(SKIP_CI,)),
    ]


def parameters(text: str):
    return code(text, tags=(PARAMETERS,))


def smoke_switch(overrides: str):
    """The cell that turns a real run into a smoke run: the tiny local checkpoint, bundled data, a few steps."""
    return code(_src("""
        import hf_optim  # before transformers builds its arguments: optim= names then build hf_optim's classes
        from hf_optim import notebook as nb

        print("hf_optim", hf_optim.__version__)
        if nb.smoke_mode(SMOKE):  # CI: tiny local checkpoint and bundled data on the CPU, a few steps, offline
            assets = nb.smoke_assets()
            MODEL_ID, DATASET_ID = assets.model_dir, assets.dataset_dir
        """) + "".join(f"\n    {line}" for line in overrides.splitlines()) + "\n    print(nb.SMOKE_BANNER)")


def gpu_check():
    return [
        md("## Check the GPU"),
        code("""
            import torch

            print(nb.device_summary(smoke=nb.smoke_mode(SMOKE)))
            GPU = torch.cuda.is_available()
            BF16 = GPU and torch.cuda.is_bf16_supported(including_emulation=False)  # a T4 has none: fp16
            COMPUTE_DTYPE = torch.bfloat16 if BF16 else torch.float16 if GPU else torch.float32
            DEVICE_MAP = {"": 0} if GPU else "cpu"
            """),
    ]


def load_chats(rows: str):
    """The dataset cell: one pass worth of shuffled chats (``rows`` is the expression for how many)."""
    return code(f"""
        from datasets import load_dataset

        dataset = load_dataset(DATASET_ID, split="train")
        dataset = dataset.shuffle(seed=0).select(range(min(len(dataset), {rows})))  # one pass
        print(dataset)
        print(dataset[0]["messages"][:2])
        """)


def try_model(model_expr: str):
    return [
        md("## Try the model"),
        code(f"""
            model = {model_expr}
            model.eval()
            messages = [{{"role": "user", "content": PROMPT}}]
            inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                                   return_dict=True).to(model.device)
            with torch.no_grad():
                output = model.generate(**inputs, max_new_tokens=64, do_sample=False,
                                        pad_token_id=tokenizer.pad_token_id)
            print("user:", PROMPT)
            reply = tokenizer.decode(output[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
            print("assistant:", reply.strip())
            """),
    ]


def show_saved(directory_expr: str) -> str:
    """Lines listing a saved directory's files and sizes (appended to a save cell)."""
    return (f"for path in sorted(Path({directory_expr}).iterdir()):\n"
            f'    print(f"{{path.name:<40}}{{path.stat().st_size / 2**20:>10.2f}} MiB")')


# ------------------------------------------------------------------------------------------------ QLoRA notebooks


def qlora_notebook(name: str, title: str, intro: str, params: str, target: str, recipe: str):
    """Quickstart (1B) and 8B on a T4 share their flow; the parameters and the words around them differ."""
    return [
        header(name, title, intro),
        install(),
        *login(),
        md("## Parameters\nEverything a run depends on (papermill can override this cell)."),
        parameters(params),
        smoke_switch("MAX_STEPS, MAX_LENGTH, BATCH_SIZE, GRAD_ACCUM, LEARNING_RATE = 8, 128, 2, 1, 3e-3\n"
                     "LORA_R = LORA_ALPHA = nb.SMOKE_LORA_R  # tiny model: rank 32 makes every adapter 8-bit"),
        *gpu_check(),
        md(f"""
            ## Load the model in 4-bit
            NF4 weights with double quantization (QLoRA). {target}
            """),
        code("""
            from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig

            bnb_config = BitsAndBytesConfig(
                load_in_4bit=True,
                bnb_4bit_quant_type="nf4",
                bnb_4bit_use_double_quant=True,
                bnb_4bit_compute_dtype=COMPUTE_DTYPE,
            )
            model = AutoModelForCausalLM.from_pretrained(
                MODEL_ID, quantization_config=bnb_config, dtype=COMPUTE_DTYPE, device_map=DEVICE_MAP
            )
            """, TOKENIZER, """
            print(f"{MODEL_ID}: {sum(p.numel() for p in model.parameters()):,} parameters (4-bit ones count packed)")
            """),
        md("## Prepare the data\nCapybara's multi-turn chats in the `messages` format: `SFTTrainer` renders them with "
           "the model's chat template. One pass of `MAX_STEPS` is selected, so tokenizing stays quick."),
        load_chats("MAX_STEPS * BATCH_SIZE * GRAD_ACCUM"),
        md("## Memory before training"),
        code("""
            before = nb.memory_report("after loading", model)
            """),
        md("""
            ## Train
            LoRA adapters on every linear layer, trained with `optim="paged_adamw_8bit"`: `import hf_optim` made
            that name build `hf_optim.PagedAdamW8bit` (its log line says so). `TrainingMonitor` writes
            `metrics.jsonl`, `summary.json` and plots into `OUTPUT_DIR`; `nb.LivePlot` redraws loss and memory while
            it runs.
            """),
        code("""
            from peft import LoraConfig
            from trl import SFTConfig, SFTTrainer

            from hf_optim.monitor import TrainingMonitor

            peft_config = LoraConfig(
                r=LORA_R, lora_alpha=LORA_ALPHA, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM"
            )
            args = SFTConfig(
                output_dir=OUTPUT_DIR,
                optim=OPTIM,
                max_steps=MAX_STEPS,
                per_device_train_batch_size=BATCH_SIZE,
                gradient_accumulation_steps=GRAD_ACCUM,
                learning_rate=LEARNING_RATE,
                lr_scheduler_type="cosine",
                warmup_steps=0.05,
                max_length=MAX_LENGTH,
                gradient_checkpointing=True,
                fp16=GPU and not BF16,
                bf16=BF16,
                logging_steps=1,
                save_strategy="no",
                report_to="none",
                seed=0,
            )
            trainer = SFTTrainer(
                model=model,
                args=args,
                train_dataset=dataset,
                processing_class=tokenizer,
                peft_config=peft_config,
                callbacks=[TrainingMonitor(OUTPUT_DIR), nb.LivePlot(title=OPTIM)],
            )
            if not BF16:  # TRL keeps QLoRA adapters in bf16; without bf16 hardware, fp32 adapters under fp16 autocast
                for param in trainer.model.parameters():
                    if param.requires_grad:
                        param.data = param.data.float()
            trainer.model.print_trainable_parameters()
            stats = trainer.train()
            """),
        md("## Memory summary\nPeak memory, the optimizer state by dtype (8-bit `uint8` moments, fp32 for tensors "
           "below 4096 elements), and the dashboard the monitor drew (`hf_optim.monitor.plot_run(OUTPUT_DIR)` "
           "redraws it from the run's files)."),
        code("""
            from IPython.display import Image, display

            after = nb.memory_report("after training")
            print(f"training took {stats.metrics['train_runtime']:.0f} s")
            print(nb.optimizer_state_report(trainer.optimizer))
            display(Image(filename=f"{OUTPUT_DIR}/dashboard.png"))  # also there: loss.png, memory.png, metrics.jsonl
            """),
        *try_model("trainer.model"),
        md("## Save\nOnly the LoRA adapter is saved (tens of MB); load it with "
           "`PeftModel.from_pretrained(base, path)`."),
        code("""
            from pathlib import Path

            trainer.save_model(f"{OUTPUT_DIR}/adapter")
            tokenizer.save_pretrained(f"{OUTPUT_DIR}/adapter")
            # trainer.model.push_to_hub("your-name/adapter-name")  # after notebook_login() with a write token
            """, show_saved('f"{OUTPUT_DIR}/adapter"')),
        md(f"""
            ## The same run from the command line
            The bundled recipe `{recipe}` is this notebook's command-line counterpart (same model, data and
            optimizer; its own full-length schedule). `hf-optim validate {recipe}` estimates its memory without
            downloading the weights, `hf-optim ls` lists every recipe:

            ```bash
            hf-optim train {recipe} training.max_steps=60
            ```
            """),
    ]


QUICKSTART_PARAMS = f"""
    MODEL_ID = "meta-llama/Llama-3.2-1B-Instruct"
    DATASET_ID = "{DATASET_ID}"
    OPTIM = "paged_adamw_8bit"
    MAX_STEPS = 60
    BATCH_SIZE = 2
    GRAD_ACCUM = 4
    MAX_LENGTH = 1024
    LEARNING_RATE = 2e-4
    LORA_R = 16
    LORA_ALPHA = 16
    OUTPUT_DIR = "outputs/quickstart"
    PROMPT = "Give me three tips for a good night's sleep."
    SMOKE = None  # None: follow HF_OPTIM_SMOKE; True: tiny model on the CPU, a few steps (what CI runs)
    """

QLORA_8B_PARAMS = f"""
    MODEL_ID = "meta-llama/Llama-3.1-8B-Instruct"
    DATASET_ID = "{DATASET_ID}"
    OPTIM = "paged_adamw_8bit"
    MAX_STEPS = 60
    BATCH_SIZE = 1
    GRAD_ACCUM = 8
    MAX_LENGTH = 512
    LEARNING_RATE = 2e-4
    LORA_R = 16
    LORA_ALPHA = 16
    OUTPUT_DIR = "outputs/qlora_8b"
    PROMPT = "Explain what a learning rate is, in two sentences."
    SMOKE = None  # None: follow HF_OPTIM_SMOKE; True: tiny model on the CPU, a few steps (what CI runs)
    """


def quickstart():
    name = "01_quickstart_qlora_1b.ipynb"
    return name, qlora_notebook(
        name, "Quickstart: Llama-3.2-1B QLoRA with `paged_adamw_8bit` on a free T4",
        """
        Fine-tune Llama-3.2-1B with QLoRA on a free Colab T4, with hf_optim's paged 8-bit AdamW. The flow is the
        one from the popular fine-tuning notebooks: check the GPU, load in 4-bit, prepare data, train with a live
        loss and memory plot, read the memory summary (optimizer state included), try the model, save.
        """,
        QUICKSTART_PARAMS,
        "On a T4 the 1B model takes about 1 GB in 4-bit and leaves plenty of room for batch 2 x 1024 tokens.",
        "llama-3.2-1b-qlora",
    )


def qlora_8b():
    name = "03_qlora_8b_t4.ipynb"
    return name, qlora_notebook(
        name, "Llama-3.1-8B QLoRA on a free T4",
        """
        An 8B model on a 15 GB T4: 4-bit weights (about 5.5 GB with the fp16 embeddings and head), gradient
        checkpointing, batch 1 with 8 accumulation steps, and `paged_adamw_8bit`, whose 8-bit state for the 42M
        LoRA parameters is about 80 MB instead of about 340 MB for fp32 AdamW (whether the state is paged to CPU
        memory yet: see docs/guide/paging.md in the repository). Same flow as the quickstart; the memory read-outs are
        the point here.
        """,
        QLORA_8B_PARAMS,
        "Loading quantizes shard by shard, so the 16 GB of fp16 weights never sit in the T4's 15 GB at once; "
        "Colab's free tier has about 12.7 GB of system RAM, which is enough.",
        "llama-3.1-8b-qlora",
    )


# ------------------------------------------------------------------------------------------------ shoot-out


def shootout():
    name = "02_optimizer_shootout_1b.ipynb"
    return name, [
        header(name, "Optimizer shoot-out: Llama-3.2-1B full fine-tune", """
            Full fine-tuning is where the optimizer's memory matters: fp32 AdamW keeps 8 bytes per parameter (about
            10 GB for 1.24B parameters), 8-bit AdamW 2 bytes (2.5 GB). This notebook trains the same model on the same
            data with each optimizer in turn and compares loss, peak memory, optimizer-state size and speed in one
            table, with a loss overlay and memory bars. A run that does not fit is caught and shown as an OOM row.
            On a 15 GB T4 the 32-bit optimizers are expected to run out of memory; an L4 or A100 runs them all.
            """),
        install(),
        *login(),
        md("## Parameters"),
        parameters(f"""
            MODEL_ID = "meta-llama/Llama-3.2-1B-Instruct"
            DATASET_ID = "{DATASET_ID}"
            OPTIMIZERS = ["adamw_torch", "adamw_8bit", "paged_adamw_8bit", "paged_adamw_32bit", "adafactor",
                          "lamb_8bit", "ademamix_8bit"]
            BASELINE = "adamw_torch"
            MAX_STEPS = 30
            BATCH_SIZE = 1
            GRAD_ACCUM = 4
            MAX_LENGTH = 512
            LEARNING_RATE = 1e-5
            OUTPUT_DIR = "outputs/shootout"
            PROMPT = "Give me three tips for a good night's sleep."
            SMOKE = None  # None: follow HF_OPTIM_SMOKE; True: tiny model on the CPU, a few steps (what CI runs)
            """),
        smoke_switch("MAX_STEPS, MAX_LENGTH, BATCH_SIZE, GRAD_ACCUM, LEARNING_RATE = 3, 128, 2, 1, 1e-3"),
        *gpu_check(),
        md("## Load the tokenizer and data\nEach optimizer gets a freshly loaded model, so only the tokenizer and "
           "the dataset are loaded once."),
        code("""
            from transformers import AutoModelForCausalLM, AutoTokenizer
            """, "", TOKENIZER, """
            WEIGHTS_DTYPE = torch.bfloat16 if BF16 else torch.float32  # fp16 AMP (T4) needs fp32 master weights


            def load_model():
                return AutoModelForCausalLM.from_pretrained(MODEL_ID, dtype=WEIGHTS_DTYPE, device_map=DEVICE_MAP)
            """),
        load_chats("MAX_STEPS * BATCH_SIZE * GRAD_ACCUM"),
        md("## Memory before training\nThe weights alone, loaded once and released again."),
        code("""
            model = load_model()
            before = nb.memory_report("weights loaded", model)
            del model
            """),
        md("""
            ## Train with each optimizer
            Same seed, data order, learning rate and schedule for every run; each run writes its own directory
            (`metrics.jsonl`, `summary.json`, plots). `torch.OutOfMemoryError` ends that run only: the OOM is recorded
            and the loop moves on. The model of the run with the lowest final loss is kept for the last cells.
            """),
        code("""
            import gc

            from trl import SFTConfig, SFTTrainer

            from hf_optim.monitor import TrainingMonitor

            run_dirs, state_bytes, out_of_memory = {}, {}, []
            best = (float("inf"), None)
            BEST_DIR = f"{OUTPUT_DIR}/best_model"
            for name in OPTIMIZERS:
                run_dirs[name] = f"{OUTPUT_DIR}/{name}"
                args = SFTConfig(
                    output_dir=run_dirs[name],
                    optim=name,
                    max_steps=MAX_STEPS,
                    per_device_train_batch_size=BATCH_SIZE,
                    gradient_accumulation_steps=GRAD_ACCUM,
                    learning_rate=LEARNING_RATE,
                    weight_decay=0.01,  # also what makes LAMB LAMB: apex applies its trust ratio to decayed weights
                    lr_scheduler_type="constant",
                    max_length=MAX_LENGTH,
                    gradient_checkpointing=True,
                    fp16=GPU and not BF16,
                    bf16=BF16,
                    logging_steps=1,
                    save_strategy="no",
                    report_to="none",
                    seed=0,
                )
                model = load_model()
                # plots=False: compare_runs draws the comparison; plot_run(run_dir) draws one run's plots on demand
                monitor = TrainingMonitor(run_dirs[name], run_name=name, plots=False)
                trainer = SFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer,
                                     callbacks=[monitor, nb.LivePlot(title=name)])
                try:
                    trainer.train()
                    state_bytes[name] = hf_optim.state_memory(nb.unwrap_optimizer(trainer.optimizer)).total_bytes
                    final_loss = [log["loss"] for log in trainer.state.log_history if "loss" in log][-1]
                    if final_loss < best[0]:
                        best = (final_loss, name)
                        trainer.save_model(BEST_DIR)
                except torch.OutOfMemoryError as error:
                    monitor.record_oom(error)  # summary.json says "oom": compare_runs shows an OOM row
                    print(f"{name}: out of memory: {str(error).splitlines()[0]}")
                    out_of_memory.append(name)
                finally:
                    del trainer, model, monitor  # the monitor holds the model and optimizer too
                    gc.collect()
                    if GPU:
                        torch.cuda.empty_cache()
                        torch.cuda.reset_peak_memory_stats()
            print("optimizer-state MiB:", {k: round(v / 2**20, 1) for k, v in state_bytes.items()})
            print("out of memory:", out_of_memory or "none")
            """),
        md("## Compare\nOne table (peak memory, optimizer state, tokens/s, final loss, deltas against the baseline, "
           "OOM rows), the loss overlay and the memory bars, all written by `compare_runs`."),
        code("""
            from pathlib import Path

            from IPython.display import Image, Markdown, display

            from hf_optim.monitor import compare_runs

            baseline = None if BASELINE in out_of_memory else BASELINE  # None: the first run that fitted
            report = compare_runs(list(run_dirs.values()), f"{OUTPUT_DIR}/compare", baseline=baseline)
            lines = Path(report).read_text().splitlines()
            display(Markdown("\\n".join(line for line in lines if not line.startswith("!["))))  # images: below
            for png in sorted(Path(report).parent.glob("*.png")):
                display(Image(filename=str(png)))
            """),
        *try_model_best(),
        md("## Save\nThe best run's model was saved by the loop (full weights, as a full fine-tune produces). "
           "The same sweep from the command line, one run per optimizer and the comparison at the end: "
           "`hf-optim train llama-3.2-1b-full --sweep training.optim=adamw_torch,adamw_8bit,paged_adamw_8bit`."),
        code("""
            tokenizer.save_pretrained(BEST_DIR)
            print(f"best optimizer: {best[1]} (final loss {best[0]:.4f}), saved in {BEST_DIR}")
            """, show_saved("BEST_DIR")),
    ]


def try_model_best():
    cells = try_model("AutoModelForCausalLM.from_pretrained(BEST_DIR, dtype=WEIGHTS_DTYPE, device_map=DEVICE_MAP)")
    cells[0] = md("## Try the model\nThe model of the run with the lowest final loss.")
    return cells


# ------------------------------------------------------------------------------------------------ your own Trainer


def byo_trainer():
    name = "04_bring_your_own_trainer.ipynb"
    return name, [
        header(name, "Bring your own Trainer: hf_optim with `Trainer`, `SFTTrainer` and bitsandbytes checkpoints", """
            hf_optim is not a framework: `import hf_optim` and the `optim=` names of `TrainingArguments` /
            `SFTConfig` build its optimizers. This notebook shows the name table, a plain `transformers.Trainer` with
            `lamb_8bit` and `optim_args`, `SFTTrainer` with `ademamix_8bit`, how to inspect the optimizer state
            (dtypes and bytes per tensor), and loading a bitsandbytes `AdamW8bit` checkpoint into
            `hf_optim.AdamW8bit` (and back). Llama-3.2-1B with LoRA adapters fits a T4.
            """),
        install(),
        *login(),
        md("## Parameters"),
        parameters(f"""
            MODEL_ID = "meta-llama/Llama-3.2-1B-Instruct"
            DATASET_ID = "{DATASET_ID}"
            MAX_STEPS = 20
            BATCH_SIZE = 2
            MAX_LENGTH = 512
            LEARNING_RATE = 2e-4
            LORA_R = 16
            OUTPUT_DIR = "outputs/byo_trainer"
            PROMPT = "What does an optimizer do when training a neural network?"
            SMOKE = None  # None: follow HF_OPTIM_SMOKE; True: tiny model on the CPU, a few steps (what CI runs)
            """),
        smoke_switch("MAX_STEPS, MAX_LENGTH, BATCH_SIZE, LEARNING_RATE = 4, 128, 2, 1e-3\n"
                     "LORA_R = nb.SMOKE_LORA_R  # tiny model: rank 32 makes every adapter 8-bit"),
        *gpu_check(),
        md("""
            ## The `optim=` names
            transformers' bitsandbytes names are taken over by hf_optim (same math, bitsandbytes' state format);
            the `lamb*`, `adafactor_8bit` and a few 32-bit names are new. A typo gets a did-you-mean.
            """),
        code("""
            from transformers import TrainingArguments

            for entry in hf_optim.available_optimizers():
                origin = "transformers name" if entry.takes_over else "added by hf_optim"
                print(f"{entry.name:<22}{entry.describe():<52}{origin}")

            try:
                TrainingArguments(output_dir=OUTPUT_DIR, optim="paged_adamw_8bt")
            except ValueError as error:
                print("\\n" + str(error))
            """),
        md("## Load the model and data\nfp16/bf16 weights with LoRA adapters (PEFT keeps the adapters in fp32)."),
        code("""
            from peft import LoraConfig, get_peft_model
            from transformers import AutoModelForCausalLM, AutoTokenizer
            """, "", TOKENIZER, """
            lora_config = LoraConfig(r=LORA_R, lora_alpha=LORA_R, target_modules="all-linear", task_type="CAUSAL_LM")


            def load_model():
                model = AutoModelForCausalLM.from_pretrained(MODEL_ID, dtype=COMPUTE_DTYPE, device_map=DEVICE_MAP)
                return get_peft_model(model, lora_config)
            """),
        load_chats("MAX_STEPS * BATCH_SIZE"),
        md("A plain `Trainer` needs token ids: render each chat with the chat template, then tokenize."),
        code("""
            def tokenize(example):
                text = tokenizer.apply_chat_template(example["messages"], tokenize=False)
                return tokenizer(text, add_special_tokens=False, truncation=True, max_length=MAX_LENGTH)


            tokenized = dataset.map(tokenize, remove_columns=dataset.column_names)
            model = load_model()
            before = nb.memory_report("after loading", model)
            """),
        md("""
            ## A plain `Trainer` with `lamb_8bit` and `optim_args`
            `optim_args` takes transformers' keys (`beta1`, `eps`, ...) and any constructor argument of the class,
            converted to its type; an unknown key is an error listing the valid ones. Here LAMB's trust ratio is
            capped at 10 and applied to every parameter (`use_nvlamb`: by default LAMB follows NVIDIA apex's
            FusedLAMB and applies it only to parameters with weight decay, the Trainer's default is no decay, and
            LAMB without a trust ratio is Adam).
            """),
        code("""
            from transformers import DataCollatorForLanguageModeling, Trainer

            from hf_optim.monitor import TrainingMonitor

            train_args = dict(max_steps=MAX_STEPS, per_device_train_batch_size=BATCH_SIZE, learning_rate=LEARNING_RATE,
                              fp16=GPU and not BF16, bf16=BF16, logging_steps=1, save_strategy="no", report_to="none",
                              seed=0)
            args = TrainingArguments(output_dir=f"{OUTPUT_DIR}/lamb_8bit", optim="lamb_8bit",
                                     optim_args="beta1=0.9,max_trust_ratio=10,use_nvlamb=true", **train_args)
            trainer = Trainer(model=model, args=args, train_dataset=tokenized,
                              data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False),
                              callbacks=[TrainingMonitor(args.output_dir), nb.LivePlot(title="lamb_8bit")])
            stats = trainer.train()
            """),
        md("""
            ## Inspect the optimizer state
            `trainer.optimizer` is accelerate's wrapper; the hf_optim optimizer is inside. 8-bit state is `uint8`
            with one fp32 `absmax` per block of 256; tensors under 4096 elements keep fp32 state, as in bitsandbytes.
            `hf_optim.state_memory` totals it for any `torch.optim.Optimizer`.
            """),
        code("""
            optimizer = nb.unwrap_optimizer(trainer.optimizer)
            print(optimizer.__class__.__name__, {k: optimizer.defaults[k] for k in ("max_trust_ratio", "use_nvlamb")})
            print()
            param, state = next(iter(optimizer.state.items()))
            for key, value in state.items():
                if torch.is_tensor(value):
                    nbytes = value.numel() * value.element_size()
                    print(f"{key:<10}{str(value.dtype):<16}{str(tuple(value.shape)):<16}{nbytes:>10,} B")
            print()
            print(nb.state_table(optimizer, trainer.model, limit=6))
            print()
            memory = hf_optim.state_memory(optimizer)
            print(memory)
            print(nb.optimizer_state_report(optimizer))
            """),
        md("""
            ## `SFTTrainer` with `ademamix_8bit`
            AdEMAMix keeps a second, slow momentum (3 state tensors instead of 2). `alpha` weighs it, and the
            `t_alpha` / `t_beta3` warm-ups (in steps) keep it from dominating early.
            """),
        code("""
            from trl import SFTConfig, SFTTrainer

            del trainer, model
            model = load_model()
            sft_args = SFTConfig(output_dir=f"{OUTPUT_DIR}/ademamix_8bit", optim="ademamix_8bit",
                                 optim_args=f"alpha=5,t_alpha={MAX_STEPS},t_beta3={MAX_STEPS}",
                                 max_length=MAX_LENGTH, **train_args)
            trainer = SFTTrainer(model=model, args=sft_args, train_dataset=dataset, processing_class=tokenizer,
                                 callbacks=[TrainingMonitor(sft_args.output_dir), nb.LivePlot(title="ademamix_8bit")])
            stats = trainer.train()
            print(nb.optimizer_state_report(trainer.optimizer))
            """),
        md("""
            ## Load a bitsandbytes checkpoint
            hf_optim's 8-bit state is bitsandbytes' blockwise format, so an optimizer checkpoint written by
            `bitsandbytes.optim.AdamW8bit` loads into `hf_optim.AdamW8bit` and training goes on from it (and back).
            """),
        code("""
            from pathlib import Path

            import bitsandbytes as bnb

            Path(OUTPUT_DIR).mkdir(parents=True, exist_ok=True)
            collate = DataCollatorForLanguageModeling(tokenizer, mlm=False)
            batch = {k: v.to(model.device) for k, v in collate([tokenized[i] for i in range(BATCH_SIZE)]).items()}
            params = [p for p in model.parameters() if p.requires_grad]


            def train_steps(optimizer, steps):
                for _ in range(steps):
                    loss = model(**batch).loss
                    loss.backward()
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                return loss.item()


            bnb_optimizer = bnb.optim.AdamW8bit(params, lr=LEARNING_RATE)
            print("bitsandbytes AdamW8bit, 3 steps, loss", round(train_steps(bnb_optimizer, 3), 4))
            torch.save(bnb_optimizer.state_dict(), f"{OUTPUT_DIR}/bnb_adamw8bit.pt")

            optimizer = hf_optim.AdamW8bit(params, lr=LEARNING_RATE)
            optimizer.load_state_dict(torch.load(f"{OUTPUT_DIR}/bnb_adamw8bit.pt"))
            same = all(torch.equal(optimizer.state[p]["state1"], bnb_optimizer.state[p]["state1"])
                       for p in params if "state1" in bnb_optimizer.state[p])
            print("8-bit moments identical after loading:", same)
            print("hf_optim AdamW8bit, 3 more steps, loss", round(train_steps(optimizer, 3), 4))

            back = bnb.optim.AdamW8bit(params, lr=LEARNING_RATE)  # and back: bitsandbytes loads hf_optim's state
            back.load_state_dict(optimizer.state_dict())
            print("bitsandbytes resumed from hf_optim's state, step", back.state[params[0]]["step"])
            """),
        *try_model("trainer.model"),
        md("## Save\nThe adapter, and the optimizer state in bitsandbytes' format (a Trainer checkpoint's "
           "`optimizer.pt` has the same layout)."),
        code("""
            trainer.save_model(f"{OUTPUT_DIR}/adapter")
            torch.save(optimizer.state_dict(), f"{OUTPUT_DIR}/adapter/hf_optim_adamw8bit.pt")
            """, show_saved('f"{OUTPUT_DIR}/adapter"')),
    ]


# ------------------------------------------------------------------------------------------------ build / execute

NOTEBOOKS = [quickstart, shootout, qlora_8b, byo_trainer]


def build(name_and_cells) -> tuple[str, nbformat.NotebookNode]:
    name, cells = name_and_cells
    notebook = nbformat.v4.new_notebook()
    notebook.metadata.update({
        "kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"},
        "language_info": {"name": "python"},
        "accelerator": "GPU",
        "colab": {"provenance": [], "gpuType": "T4"},
    })
    stem = name.removesuffix(".ipynb")
    for index, cell in enumerate(cells):
        cell.id = f"{stem[:3]}{index:02d}"  # stable ids keep diffs small across rebuilds
    notebook.cells = cells
    nbformat.validate(notebook)
    return name, notebook


def all_notebooks() -> dict[str, nbformat.NotebookNode]:
    return dict(build(make()) for make in NOTEBOOKS)


def execute(notebook: nbformat.NotebookNode, workdir: str | os.PathLike, timeout: int = 600) -> nbformat.NotebookNode:
    """Run ``notebook`` in smoke mode in ``workdir``, skipping ``skip-ci`` cells; returns it with outputs.

    A failing cell raises ``nbclient.exceptions.CellExecutionError`` naming the cell. The kernel imports hf_optim
    from this checkout (``PYTHONPATH``), so the notebooks test the code next to them, and runs offline with the
    eager CPU kernels (``HF_OPTIM_COMPILE=0``).
    """
    from nbclient import NotebookClient

    runnable = copy.deepcopy(notebook)
    runnable.cells = [c for c in runnable.cells if SKIP_CI not in c.metadata.get("tags", [])]
    keys = ("HF_OPTIM_SMOKE", "HF_HUB_OFFLINE", "HF_OPTIM_COMPILE", "PYTHONPATH", "MPLBACKEND")
    env_before = {k: os.environ.get(k) for k in keys}
    # HF_OPTIM_COMPILE=0: for a few tiny steps, compiling the CPU kernels costs far more than it saves (as in tests).
    os.environ.update(HF_OPTIM_SMOKE="1", HF_HUB_OFFLINE="1", HF_OPTIM_COMPILE="0", MPLBACKEND="Agg",
                      PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), env_before["PYTHONPATH"]])))
    try:
        NotebookClient(runnable, timeout=timeout, kernel_name="python3",
                       resources={"metadata": {"path": str(workdir)}}).execute()
    finally:
        for key, value in env_before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    outputs = {c.id: c for c in runnable.cells}
    executed = copy.deepcopy(notebook)
    for cell in executed.cells:
        if cell.cell_type == "code" and cell.id in outputs:
            cell.outputs = outputs[cell.id].outputs
            cell.execution_count = outputs[cell.id].execution_count
    return executed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="*", help="notebook file names (default: all)")
    parser.add_argument("--execute", action="store_true", help="run in smoke mode and save the outputs")
    args = parser.parse_args(argv)
    notebooks = all_notebooks()
    unknown = sorted(set(args.names) - set(notebooks))
    if unknown:
        parser.error(f"unknown notebook(s) {unknown}; valid: {sorted(notebooks)}")
    for name in args.names or notebooks:
        notebook = notebooks[name]
        if args.execute:
            with tempfile.TemporaryDirectory(prefix="hf_optim_nb_") as workdir:
                print(f"executing {name} (smoke mode) ...", flush=True)
                notebook = execute(notebook, workdir)
        nbformat.write(notebook, NOTEBOOK_DIR / name)
        print(f"wrote notebooks/{name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
