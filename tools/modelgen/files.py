"""Writing generated tensors into a safetensors file: one tensor at a time, the file appearing only
when complete; the output path checks and what a written file holds (``CheckpointSummary``)."""
from __future__ import annotations

import json
import os
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from ...errors import UserError
from ...optim.precision import DTYPES
from ..progress import progress_bar
from .specs import TensorSpec, generate_tensor

CHECKPOINT_DTYPES = ("fp16", "fp32")
_SAFETENSORS_DTYPE_NAMES = {torch.float16: "F16", torch.float32: "F32"}


@dataclass(frozen=True)
class CheckpointSummary:
    path: Path
    model: str
    seed: int
    dtype: str
    tensor_count: int
    param_count: int
    file_bytes: int
    text_encoder_path: Path | None = None


def checked_out_path(out: str | os.PathLike) -> Path:
    path = Path(out).expanduser()
    if path.is_dir():
        example = str(path / "model.safetensors")
        raise UserError(f"output path {str(path)!r} is a folder: give a file path such as {example!r}")
    if path.suffix != ".safetensors":
        example = str(path.with_suffix(".safetensors"))
        raise UserError(f"output path {str(path)!r} must end in .safetensors: e.g. {example!r}")
    return path


def _safetensors_header(specs: dict[str, TensorSpec], dtype: torch.dtype, metadata: dict[str, str]) -> bytes:
    """The length-prefixed JSON header; tensors follow back to back in key order."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    header: dict[str, dict] = {"__metadata__": metadata}
    offset = 0
    for key, spec in specs.items():
        end = offset + spec.numel * itemsize
        header[key] = {
            "dtype": _SAFETENSORS_DTYPE_NAMES[dtype],
            "shape": list(spec.shape),
            "data_offsets": [offset, end],
        }
        offset = end
    text = json.dumps(header, separators=(",", ":")).encode()
    # The format allows trailing spaces; padding to 8 bytes keeps the tensor data aligned.
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text


def write_safetensors(
    specs: dict[str, TensorSpec], out: str | os.PathLike, metadata: dict[str, str], *, seed: int, dtype: str,
    desc: str, progress: bool, given: Mapping[str, torch.Tensor] | None = None,
) -> tuple[Path, dict[str, TensorSpec]]:
    """Generate ``specs`` into the safetensors file ``out``; returns its path and the specs in file order.
    Keys in ``given`` take its tensors (a reference model's trained and hand-built parts) instead.

    Tensors are generated and streamed one at a time, so peak memory is one tensor,
    not the model. The file appears only when complete: it is written under a temporary
    name in the same folder and then renamed over ``out``.
    """
    if dtype not in CHECKPOINT_DTYPES:
        raise UserError(f"unknown dtype {dtype!r}: choose one of {', '.join(CHECKPOINT_DTYPES)}")
    # Sorted like safetensors' own writer, so the bytes on disk depend on nothing but (specs, seed, dtype).
    specs = dict(sorted(specs.items()))
    path = checked_out_path(out)
    torch_dtype = DTYPES[dtype]

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
        # O_EXCL: never clobber another writer's temp file; mode 0o666 lets the umask decide.
        descriptor = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    except OSError as error:
        raise UserError(f"cannot create {str(path)!r}: {error.strerror or error}; choose a writable folder") from None

    try:
        with os.fdopen(descriptor, "wb") as file:
            file.write(_safetensors_header(specs, torch_dtype, metadata))
            for key, spec in progress_bar(specs.items(), desc=desc, unit="tensor", disable=not progress):
                tensor = given[key].to(torch_dtype) if given and key in given else generate_tensor(key, spec, seed, torch_dtype)
                file.write(tensor.contiguous().numpy())
            file.flush()
            os.fsync(file.fileno())
        os.replace(temp, path)
    except BaseException as error:
        temp.unlink(missing_ok=True)
        if isinstance(error, OSError):
            reason = f"{error.strerror or error}; free some space or choose another folder"
            raise UserError(f"cannot write {str(path)!r}: {reason}") from None
        raise
    return path, specs
