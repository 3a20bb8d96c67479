"""What evaluation and prediction hand back: hook fan-out for the evaluation loop, per-example predictions."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch


class Callbacks:
    """The few CallbackList events the evaluation loop sends, for one `HookCallback`."""

    def __init__(self, callbacks: list[Any]) -> None:
        self.callbacks = callbacks

    def __getattr__(self, name: str) -> Any:
        def fan_out(*args: Any, **kwargs: Any) -> None:
            for callback in self.callbacks:
                getattr(callback, name)(*args, **kwargs)

        return fan_out


def examples(out: Any, keys: list[str] | None, single: bool) -> Iterator[Any]:
    if isinstance(out, dict):
        if keys is not None:
            missing = sorted(set(keys) - set(out))
            if missing:
                raise ValueError(f"Invalid `predict_keys`: {missing} are not in the predictions {sorted(out)}.")
            out = {k: out[k] for k in keys}
        arrays = {k: v.detach().cpu().numpy() if isinstance(v, torch.Tensor) else np.asarray(v) for k, v in out.items()}
        if not single:
            yield arrays
            return
        sizes = {len(v) for v in arrays.values()}
        if len(sizes) != 1:
            raise ValueError(f"The predictions' first dimensions differ ({sorted(sizes)}); use "
                             "yield_single_examples=False.")
        for i in range(sizes.pop()):
            yield {k: v[i] for k, v in arrays.items()}
        return
    array = out.detach().cpu().numpy() if isinstance(out, torch.Tensor) else np.asarray(out)
    if not single:
        yield array
        return
    yield from array
