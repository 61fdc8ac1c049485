"""The ComfyUI server a soak drives: its HTTP API (queue a prompt, wait for its end, collect garbage), its
replies read into one line, its memory, and the environment it starts in."""
from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from pathlib import Path

CLIENT_ID = "sdopt-soak"
SUCCESS = "success"
INTERRUPTED = "interrupted"


def rss_bytes(pid: int) -> int:
    import psutil

    return psutil.Process(pid).memory_info().rss


class Client:
    """ComfyUI's HTTP API, the calls a soak makes."""

    def __init__(self, url: str):
        self.url = url

    def get(self, path: str):
        with urllib.request.urlopen(self.url + path, timeout=30) as response:
            return json.load(response)

    def queue(self, prompt: dict) -> str:
        """The prompt id; a refused prompt raises ``Rejected`` with the server's reasons."""
        try:
            with self._post("/prompt", {"prompt": prompt, "client_id": CLIENT_ID}) as response:
                return json.load(response)["prompt_id"]
        except urllib.error.HTTPError as error:
            raise Rejected(_rejection(error.read().decode(errors="replace"))) from None

    def collect_garbage(self) -> None:
        """Ask the server to unload its models and collect garbage (``POST /free``); the outputs it
        cached are kept."""
        with self._post("/free", {"unload_models": True}):
            pass

    def free(self) -> None:
        """What ComfyUI's "Free model and node cache" asks: unload the models and free memory (POST /free)."""
        with self._post("/free", {"unload_models": True, "free_memory": True}):
            pass

    def interrupt(self, prompt_id: str) -> None:
        """Interrupt ``prompt_id`` if it runs now (POST /interrupt, as the Cancel button does)."""
        with self._post("/interrupt", {"prompt_id": prompt_id}):
            pass

    def _post(self, path: str, body: dict):
        request = urllib.request.Request(self.url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        return urllib.request.urlopen(request, timeout=30)

    def wait(self, prompt_id: str, timeout: float) -> dict | None:
        """The prompt's history entry once it has ended; None after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            entry = self.get(f"/history/{prompt_id}").get(prompt_id)
            if entry:  # ComfyUI files a prompt in its history when it ends, with an error or not
                return entry
            time.sleep(0.2)
        return None


class Rejected(Exception):
    """The server refused a prompt (validation)."""


def _rejection(body: str) -> str:
    try:
        data = json.loads(body)
    except json.JSONDecodeError:
        return body.strip()[:500]
    parts = [data.get("error", {}).get("message", "")] if isinstance(data.get("error"), dict) else [str(data.get("error", ""))]
    for node_id, errors in (data.get("node_errors") or {}).items():
        for error in errors.get("errors", []):
            parts.append(f"node {node_id} {errors.get('class_type', '')}: {error.get('message', '')}: {error.get('details', '')}")
    return "; ".join(filter(None, parts))


def history_error(entry: dict) -> str:
    """The error of a failed prompt's history entry: node, exception and its message, then the traceback."""
    for kind, data in entry.get("status", {}).get("messages", []):
        if kind == "execution_error":
            where = f"node {data.get('node_id')} {data.get('node_type')}"
            trace = "".join(data.get("traceback") or [])
            return f"{where}: {data.get('exception_type')}: {data.get('exception_message', '').strip()}\n{trace}".rstrip()
        if kind == "execution_interrupted":
            return f"interrupted at node {data.get('node_id')} {data.get('node_type')}"
    return "the history says the prompt failed, with no error message"


def run_one(client: Client, prompt: dict, timeout: float) -> tuple[str, float, str]:
    """(status, seconds, error) of one prompt run to its end."""
    start = time.monotonic()
    try:
        prompt_id = client.queue(prompt)
    except Rejected as error:
        return "rejected", time.monotonic() - start, str(error)
    entry = client.wait(prompt_id, timeout)
    status, error = ended_status(entry, timeout)
    return status, time.monotonic() - start, error


def ended_status(entry: dict | None, timeout: float) -> tuple[str, str]:
    """(status, error) of a prompt's history entry: success, interrupted (cancelled), error, or timeout
    (no entry within ``timeout`` seconds)."""
    if entry is None:
        return "timeout", f"no end within {timeout:.0f} s"
    if entry["status"].get("status_str") == SUCCESS:
        return SUCCESS, ""
    if any(kind == "execution_interrupted" for kind, _ in entry["status"].get("messages", [])):
        return INTERRUPTED, history_error(entry)
    return "error", history_error(entry)


# glibc's mmap threshold held at its initial 128 KiB: glibc otherwise raises it with each large block
# freed (up to 32 MiB), after which freed tensors stay in the heap, and a reading after the stock probe
# prompt (which runs no sdopt heap trim) counts hundreds of MiB of free heap that wander with what ran
# before it (docs/benchmarks-log.md, Soak). Held, a freed tensor's pages go back at once and RSS follows the
# live memory, which is what a leak grows. A value the caller set is kept; other C libraries ignore it.
MMAP_THRESHOLD = {"MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}


def server_env(scratch: Path) -> dict:
    import os

    # Compile's disk cache in the scratch folder: a soak neither reads nor grows the user's cache.
    return {**MMAP_THRESHOLD, **os.environ, "SDOPT_CACHE_DIR": str(scratch / "compile-cache")}


def device_text(client: Client) -> str:
    try:
        devices = client.get("/system_stats").get("devices", [])
    except (urllib.error.URLError, OSError, ValueError):
        return ""
    return ", ".join(device.get("name", "?") for device in devices)


def log_tail(path: Path, lines: int = 30) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
