"""``python -m sdopt serve``: a ComfyUI server on localhost with this pack installed and the models offered.

It links the pack into ``<comfyui>/custom_nodes/sdopt`` (the way a user installs it, so ComfyUI
serves ``web/`` and lists ``workflows/`` in its Templates dialog), writes a model-paths file of its own,
``sdopt_model_paths.yaml``, that offers every model folder under ``<models>`` (``checkpoints``, and
``text_encoders``, ``loras`` and the others where they exist) to ComfyUI, and starts ComfyUI's own
``main.py`` with the Python running this, handing it that file. ComfyUI's own
``extra_model_paths.yaml`` is never written: it is the user's, and ComfyUI reads it as well. The
browser tests start their server with the same ``serve``.
"""
from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Sequence

from ..errors import UserError

PACK = Path(__file__).resolve().parents[1]
LINK_NAME = "sdopt"
MODEL_PATHS = "sdopt_model_paths.yaml"
_MODEL_PATHS_MARK = "# written by python -m sdopt serve"


def install_pack(comfyui: Path) -> Path:
    """This pack's folder in ``<comfyui>/custom_nodes``: made a link named sdopt unless the pack is there
    already; a different ``sdopt`` there is an error."""
    comfyui = _comfyui_root(comfyui)
    custom_nodes = comfyui / "custom_nodes"
    # Already there under another name (a clone inside custom_nodes, a link of one's own): a second
    # entry would register every node twice.
    for entry in custom_nodes.iterdir() if custom_nodes.is_dir() else ():
        if entry.name != LINK_NAME and entry.is_dir() and entry.resolve() == PACK:
            return entry
    link = custom_nodes / LINK_NAME
    if link.is_symlink() or link.exists():
        if link.resolve() != PACK:
            raise UserError(
                f"{link} is another sdopt, not this one ({PACK}): remove or rename it "
                f"(e.g. mv {link} {link}.old), then run again"
            )
        return link
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(PACK, target_is_directory=True)
    return link


def write_model_paths(models: Path, config_dir: Path | None = None) -> Path:
    """The model-paths file (ComfyUI's extra_model_paths format) offering ``<models>/checkpoints`` and
    every other folder in ``models`` under its own name (ComfyUI's model kinds: ``text_encoders`` holds
    the Flux minis' CLIP, ``loras`` the generated LoRAs), in config_dir (default $SDOPT_HOME, else the
    models folder's parent); a file of that name that serve did not write is an error, never replaced."""
    checkpoints = Path(models).resolve() / "checkpoints"
    if not checkpoints.is_dir():
        raise UserError(
            f"--models {models}: it has no checkpoints/ folder; create one, e.g. with: python -m sdopt make-model "
            f"mini --out {checkpoints / 'sdopt-mini-sd15.safetensors'}"
        )
    home = os.environ.get("SDOPT_HOME")
    folder = Path(config_dir or (home if home else Path(models).resolve().parent)).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / MODEL_PATHS
    if path.exists() and not path.read_text(errors="replace").startswith(_MODEL_PATHS_MARK):
        raise UserError(f"{path} exists and was not written by sdopt serve: move it away (or set SDOPT_HOME to "
                        "another folder for serve's file), then run again")
    # A JSON string is a valid YAML scalar: paths with spaces or colons survive.
    kinds = "".join(f"  {json.dumps(folder.name)}: {json.dumps(str(folder))}\n"
                    for folder in sorted(checkpoints.parent.iterdir()) if folder.is_dir())
    path.write_text(f"{_MODEL_PATHS_MARK}\nsdopt:\n{kinds}")
    return path


def server_command(comfyui: Path, config: Path, port: int, listen: str = "127.0.0.1",
                   extra_args: Sequence[str] = ()) -> list[str]:
    command = [sys.executable, str(_comfyui_root(comfyui) / "main.py"), "--listen", listen, "--port", str(port),
               "--extra-model-paths-config", str(config)]
    if not _accelerator_available():
        command.append("--cpu")
    return [*command, *extra_args]


def free_port(listen: str = "127.0.0.1") -> int:
    """A TCP port free on ``listen`` now, for a server this process starts."""
    with socket.socket() as sock:
        sock.bind((listen, 0))
        return sock.getsockname()[1]


def _die_with_parent() -> None:
    """Linux: the server gets SIGTERM when its parent dies, even killed, instead of running on."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def serve(comfyui: Path, models: Path, port: int, listen: str = "127.0.0.1", *, extra_args: Sequence[str] = (),
          config_dir: Path | None = None, die_with_parent: bool = False, **popen_kwargs) -> subprocess.Popen:
    """Start ComfyUI with sdopt (not waiting for it to answer); ``extra_args`` go to main.py as they are,
    e.g. ``["--output-directory", DIR]``. ``die_with_parent``: on Linux, the server is stopped when
    this process dies, even killed (a test run, a soak), rather than holding its port."""
    config = write_model_paths(models, config_dir)
    install_pack(comfyui)
    command = server_command(comfyui, config, port, listen, extra_args)
    if die_with_parent and sys.platform == "linux":
        popen_kwargs["preexec_fn"] = _die_with_parent
    return subprocess.Popen(command, cwd=_comfyui_root(comfyui), **popen_kwargs)


def wait_ready(url: str, process: subprocess.Popen, timeout: float = 120.0) -> None:
    """Return once ``url`` answers HTTP 200; raise RuntimeError if the server exits or the timeout passes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"ComfyUI exited with status {process.returncode} before answering at {url}")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.5)
    raise RuntimeError(f"ComfyUI did not answer at {url} within {timeout:.0f} s")


def stop(process: subprocess.Popen, timeout: float = 15.0) -> None:
    """Ask the server to stop (SIGTERM), then kill it if it lingers."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def run_server(comfyui: Path | None, models: Path, port: int, listen: str = "127.0.0.1") -> int:
    """``python -m sdopt serve``: run the server in the foreground until it exits or Ctrl-C."""
    process = serve(comfyui, models, port, listen)
    print(f"sdopt: ComfyUI with sdopt starting at http://{listen}:{port} (Ctrl-C stops it)", flush=True)
    # A plain `kill` of this process must not leave ComfyUI running: exit through the finally below.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    try:
        return process.wait()
    except KeyboardInterrupt:
        # The terminal's Ctrl-C reaches ComfyUI too (same process group); give it time to exit by itself.
        try:
            return process.wait(5)
        except (subprocess.TimeoutExpired, KeyboardInterrupt):
            stop(process)
            return process.returncode
    finally:
        stop(process)


def _comfyui_root(comfyui: Path | None) -> Path:
    if comfyui is None:
        raise UserError("ComfyUI not found: pass --comfyui /path/to/ComfyUI or set COMFYUI_PATH")
    root = Path(comfyui).expanduser().resolve()
    if not (root / "main.py").is_file():
        raise UserError(f"ComfyUI not found at {comfyui} (no main.py there): pass --comfyui /path/to/ComfyUI or set COMFYUI_PATH")
    return root


def _accelerator_available() -> bool:
    import torch

    mps = getattr(torch.backends, "mps", None)
    return torch.cuda.is_available() or bool(mps and mps.is_available())
