"""Small trackables the checkpoint tests share."""

from __future__ import annotations


class Position:
    """A trackable with plain python state (like a data iterator's position)."""

    def __init__(self, value: int = 0) -> None:
        self.value = value

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = state["value"]
