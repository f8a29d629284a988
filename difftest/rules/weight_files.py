"""Reading checkpoint weight files: one line naming the file when it cannot be read.

safetensors and torch report a damaged file in their own words, without its path ("incomplete
metadata, file not fully covered"), and torch's refusal of a pickle that holds more than
tensors runs to many lines that advise loading it with weights_only=False, which would run
whatever the pickle holds. Every reader (the lint, the reference engine's draft and target
loaders) goes through these helpers, so one unreadable file gives every item the same line.
Completeness (a checkpoint that reads but lacks tensors) is difftest.rules.checkpoint_integrity's.
"""

from __future__ import annotations

import pickle
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from safetensors import safe_open

from difftest.base.errors import ConfigError
from difftest.rules.checkpoint_integrity import read_header

try:
    from safetensors import SafetensorError
except ImportError:  # an engine environment without safetensors reads no weights through here
    SafetensorError = OSError  # type: ignore[misc,assignment]

# What a weight loader raises for a file it cannot read, besides OSError/ValueError: safetensors'
# own error (a plain Exception subclass) and the refusal of torch.load(weights_only=True).
LOAD_ERRORS: tuple[type[BaseException], ...] = (SafetensorError, pickle.UnpicklingError)
_SAFETENSORS_ERRORS = (SafetensorError, OSError, ValueError)

# torch's refusal, recognised by its text too: a loader may re-raise it wrapped in another type
_TORCH_REFUSED = "Weights only load failed"


def first_line(e: BaseException) -> str:
    """`Type: first line of the message` (at most 200 characters)."""
    text = (str(e).strip().splitlines() or [""])[0][:200]
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def unreadable_safetensors(f: str | Path, e: BaseException) -> ConfigError:
    """The line for a safetensors file that `e` says cannot be read: the integrity check's reading
    of its header when that finds the fault (truncated, not one, with the sizes), so a reader that
    fails gives the line the check before a load gives; else safetensors' own first line."""
    try:
        read_header(Path(f))
    except (ConfigError, OSError) as found:
        return found if isinstance(found, ConfigError) else ConfigError(f"{f}: cannot be read ({first_line(found)})")
    return ConfigError(f"{f}: not a readable safetensors file ({first_line(e)})")


def refused_pickle(f: str | Path) -> ConfigError:
    # never torch's text: it advises weights_only=False, which would execute the pickle
    return ConfigError(
        f"{f}: refused: not a plain-tensor checkpoint (it holds objects other than tensors, which "
        "difftest never unpickles), or not a torch checkpoint at all; save the state dict as safetensors"
    )


@contextmanager
def open_safetensors(f: str | Path) -> Iterator:
    """safetensors.safe_open(f) (headers read, tensors on demand); an unreadable file is a
    ConfigError naming it, raised by the open or by a read inside the block."""
    try:
        handle = safe_open(str(f), framework="pt")
    except _SAFETENSORS_ERRORS as e:
        raise unreadable_safetensors(f, e) from None
    with handle as h:
        try:
            yield h
        except SafetensorError as e:  # only the file's own: the caller's errors stay theirs
            raise unreadable_safetensors(f, e) from None


def load_safetensors(f: str | Path, device: str = "cpu") -> dict:
    """Every tensor of a safetensors file; an unreadable file is a ConfigError naming it."""
    from safetensors.torch import load_file  # imports torch (seconds): the rules floor loads torch-free

    try:
        return load_file(str(f), device=device)
    except _SAFETENSORS_ERRORS as e:
        raise unreadable_safetensors(f, e) from None


def torch_load_tensors(f: str | Path) -> object:
    """torch.load(f, weights_only=True): nothing in the pickle runs. A pickle holding more than
    tensors is refused naming the file; a damaged one is named with torch's first line."""
    import torch  # torch takes seconds to import; the rules floor loads torch-free

    try:
        return torch.load(f, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        raise refused_pickle(f) from None
    except (RuntimeError, EOFError, OSError, ValueError) as e:
        raise ConfigError(f"{f}: not a readable torch checkpoint ({first_line(e)})") from None


def explain_load_failure(model_dir: str | Path, e: BaseException, what: str) -> ConfigError:
    """A loader (transformers' from_pretrained) failed on `model_dir` with `e`: the file at fault
    named in the words the helpers above use, found by reading each weight file's header (or, for
    a refused pickle, the pickles themselves); else `{model_dir}: {what} (first line of e)`."""
    model_dir = Path(model_dir)
    refused = isinstance(e, pickle.UnpicklingError) or _TORCH_REFUSED in str(e)
    if not refused:
        for f in sorted(model_dir.glob("*.safetensors")):
            try:
                with open_safetensors(f):
                    pass
            except ConfigError as found:
                return found
    pickles = sorted(p for pattern in ("*.bin", "*.pt", "*.pth") for p in model_dir.glob(pattern))
    if refused:
        for f in pickles:
            try:
                torch_load_tensors(f)
            except ConfigError as found:
                return found
        if len(pickles) == 1:
            return refused_pickle(pickles[0])
        return ConfigError(
            f"{model_dir}: {what}: refused a weight file that is not a plain-tensor checkpoint; "
            "save the state dict as safetensors"
        )
    return ConfigError(f"{model_dir}: {what} ({first_line(e)})")
