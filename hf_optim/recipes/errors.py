"""Recipe errors: every problem found is collected and reported together, each with file and key path."""

from __future__ import annotations

from dataclasses import dataclass

from hf_optim.errors import UserError


@dataclass(frozen=True)
class RecipeIssue:
    """One problem: ``file: key.path: message``."""

    file: str
    key_path: str
    message: str

    def __str__(self) -> str:
        return f"{self.file}: {self.key_path}: {self.message}" if self.key_path else f"{self.file}: {self.message}"


class RecipeError(UserError, ValueError):
    """A recipe that cannot be used; ``issues`` lists every problem found, one line each in ``str()``."""

    def __init__(self, issues: list[RecipeIssue]):
        self.issues = list(issues)
        super().__init__("\n".join(str(issue) for issue in self.issues))
