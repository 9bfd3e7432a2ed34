"""Nested state (an optimizer ``state_dict``, RNG states) as a safetensors + JSON pair: never a pickle.

A checkpoint comes back from the bucket, i.e. from whoever could write there, and ``torch.load`` unpickles
(even ``weights_only`` runs a restricted unpickler over attacker-chosen bytes). So the state is split: every
tensor goes into ``{stem}.safetensors`` under a generated key, and the structure around them (dicts, lists,
tuples, numbers, strings, None) into ``{stem}.json`` with each tensor replaced by ``{"__tensor__": key}``.
Dict keys that are not strings (an optimizer's parameter indices) and tuples are tagged so they come back as
they were.

    save_state(optimizer.state_dict(), directory, "optimizer")
    optimizer.load_state_dict(load_state(directory, "optimizer"))
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

_TENSOR, _TUPLE, _ITEMS = "__tensor__", "__tuple__", "__items__"


def save_state(obj: Any, directory: str | Path, stem: str) -> None:
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}

    def enc(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            key = f"t{len(tensors)}"
            # safetensors stores dense, contiguous, non-shared tensors; a 0-dim tensor (a step count) is fine.
            tensors[key] = x.detach().to("cpu").contiguous().clone()
            return {_TENSOR: key}
        if isinstance(x, dict):
            # In key order, not insertion order: tensors are numbered as they are met, and the same state must give
            # the same bytes however it was built (an optimizer's state after load_state_dict lists its entries in
            # another order than the one that stepped).
            if all(isinstance(k, str) for k in x) and not ({_TENSOR, _TUPLE, _ITEMS} & x.keys()):
                return {k: enc(x[k]) for k in sorted(x)}
            return {_ITEMS: [[enc(k), enc(v)] for k, v in _sorted_items(x)]}
        if isinstance(x, tuple):
            return {_TUPLE: [enc(v) for v in x]}
        if isinstance(x, list):
            return [enc(v) for v in x]
        if x is None or isinstance(x, bool | int | float | str):
            return x
        raise TypeError(f"cannot store a {type(x).__name__} in {stem}.json")

    structure = enc(obj)
    root = Path(directory)
    save_file(tensors, str(root / f"{stem}.safetensors"))
    (root / f"{stem}.json").write_text(json.dumps(structure, sort_keys=True))


def _sorted_items(d: dict[Any, Any]) -> list[tuple[Any, Any]]:
    """Items by key when the keys compare (an optimizer's integer parameter indices), else as they are."""
    try:
        return sorted(d.items(), key=lambda kv: kv[0])
    except TypeError:
        return list(d.items())


def load_state(directory: str | Path, stem: str) -> Any:
    from safetensors.torch import load_file

    root = Path(directory)
    tensors = load_file(str(root / f"{stem}.safetensors"))

    def dec(x: Any) -> Any:
        if isinstance(x, dict):
            if _TENSOR in x:
                return tensors[x[_TENSOR]]
            if _TUPLE in x:
                return tuple(dec(v) for v in x[_TUPLE])
            if _ITEMS in x:
                return {dec(k): dec(v) for k, v in x[_ITEMS]}
            return {k: dec(v) for k, v in x.items()}
        if isinstance(x, list):
            return [dec(v) for v in x]
        return x

    return dec(json.loads((root / f"{stem}.json").read_text()))
