"""The commands written in the bundled recipes' comments name recipes that exist.

The accelerate configs' comments said ``train recipes/llama3_2_1b_full.yaml``, a file that never existed (issue 43):
a user who copied the line got an error. Every ``hf-optim train|validate NAME`` (or ``-m hf_optim.cli train NAME``)
in a comment must name a bundled recipe or a file of the repository.
"""

from __future__ import annotations

import re
from pathlib import Path

from hf_optim.recipes.loading import bundled_names

REPO = Path(__file__).resolve().parents[2]
COMMAND = re.compile(r"(?:hf-optim|hf_optim\.cli) (?:train|validate) ([A-Za-z0-9_./-]+)")


def test_every_recipe_named_in_a_recipe_comment_exists():
    named = []
    for path in sorted((REPO / "recipes").rglob("*.yaml")):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            comment = line.partition("#")[2]
            named += [(path.relative_to(REPO), number, name) for name in COMMAND.findall(comment)]
    assert len(named) >= 10, named  # the pattern still finds the commands
    missing = [(str(path), number, name) for path, number, name in named
               if name not in bundled_names() and not (REPO / name).is_file()]
    assert not missing, missing
