"""Package list only (everything else is in pyproject.toml): ``hf_optim*`` plus the top-level ``recipes/``
directory installed as ``hf_optim.bundled_recipes``."""

from setuptools import find_packages, setup

setup(
    packages=[*find_packages(include=["hf_optim*"]), "hf_optim.bundled_recipes"],
    package_dir={"hf_optim.bundled_recipes": "recipes"},
)
