"""``soak``: the server started, the prompts run one at a time with the memory read between them, the
server stopped and the ComfyUI tree left as it was; the result written as JSON."""
from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

from ...errors import UserError
from ...families import resolve_model
from ..progress import progress_bar
from .chaos import ChaosResult, compare_with_fresh, require_websocket_client, run_chaos_prompts
from .drawn_nodes import REPORT, soak_nodes
from .prompts import DEFAULT_WARMUP, SoakModel, plan_prompt, probe_prompt
from .server import SUCCESS, Client, device_text, log_tail, rss_bytes, run_one, server_env
from .verdict import DEFAULT_MAX_DRIFT, READING_EVERY, PromptOutcome, SoakResult, reading_points

DEFAULT_PROMPTS = 100
# Most users run SDXL or Flux: the routine soak draws from every family's mini.
DEFAULT_MODELS = ("mini", "sdxl-mini", "sd35-mini", "flux-mini")
PROMPT_TIMEOUT_S = 600.0


def soak(comfyui: Path | None, models: Path | None = None, *, prompts: int = DEFAULT_PROMPTS, seed: int = 0,
         port: int | None = None, max_drift: float = DEFAULT_MAX_DRIFT, warmup: int = DEFAULT_WARMUP,
         model_names: tuple[str, ...] = DEFAULT_MODELS, lora: bool = True, prompt_timeout: float = PROMPT_TIMEOUT_S,
         chaos: bool = False, log: Callable[[str], None] = lambda line: print(line, flush=True)) -> SoakResult:
    """Run the soak (see ``tools.soak``'s docstring; ``chaos``: ``tools.soak.chaos``'s); ``log`` gets its
    status lines, stdout one line per prompt."""
    from ..bench_unet import checkpoint_path
    from ..modelgen import text_encoder_path, write_lora
    from ..serve import LINK_NAME, _comfyui_root

    if prompts < 1:
        raise UserError(f"--prompts {prompts}: run at least 1 prompt")
    warmup = max(0, min(warmup, prompts - 1))  # the warm reading comes before the last prompt at the latest
    if max_drift < 0:
        raise UserError(f"--max-drift {max_drift * 100:g}: give a percentage at or above 0, e.g. 5 for 5%")
    soak_nodes()  # a registered node the soak does not cover stops it here, before the server starts
    if chaos:
        require_websocket_client()
    root = _comfyui_root(comfyui)
    models = Path(models) if models is not None else root / "models"
    result = (ChaosResult if chaos else SoakResult)(seed=seed, prompts=prompts, warmup=warmup, max_drift=max_drift)
    link = root / "custom_nodes" / LINK_NAME
    linked_here = not (link.is_symlink() or link.exists())
    with tempfile.TemporaryDirectory(prefix="sdopt-soak-") as scratch:
        scratch = Path(scratch)
        checkpoints: dict[str, SoakModel] = {}
        loras = scratch / "loras"
        for name in model_names:
            family, size = resolve_model(name)
            path = checkpoint_path(name, models)
            if path.parent.resolve() != (models / "checkpoints").resolve():
                raise UserError(f"--model {name}: the checkpoint must be in {models / 'checkpoints'}, the folder ComfyUI is offered")
            checkpoints[path.name] = SoakModel(
                write_lora(name, loras / f"sdopt-soak-{name}-lora.safetensors").path.name if lora else None,
                text_encoder_path(path).name if family.text_encoder_filename(size) else None, family.clip_type)
        (scratch / "loras.yaml").write_text(f"sdopt_soak:\n  loras: {json.dumps(str(loras))}\n")
        (scratch / "output").mkdir()
        (scratch / "user").mkdir()
        first = sorted(checkpoints)[0]
        probe = probe_prompt(first, checkpoints[first])

        def plan(index: int):
            return plan_prompt(index, seed, checkpoints, result.warmup)

        start = time.monotonic()
        try:
            with _server(root, models, scratch, port, result.outcomes, log) as (client, process):
                result.device = device_text(client)
                log(f"soak: ComfyUI at {client.url} ({result.device}), {prompts} prompts, seed {seed}, RSS read after "
                    f"{warmup} warm-up prompts, every {READING_EVERY} after them and at the end"
                    + (", with users' disruptions mixed in" if chaos else ""))
                _run_prompts(client, process, result, plan, probe, prompt_timeout, scratch / "output", log)
            if chaos and result.images:
                log(f"chaos: {len(result.images)} completed images, run again on a fresh server")
                with _server(root, models, scratch, None, [], log) as (client, _):
                    compare_with_fresh(client, result, plan, prompt_timeout, scratch / "output", log)
        finally:
            result.seconds = time.monotonic() - start
            if linked_here and link.is_symlink():
                link.unlink()  # leave the ComfyUI tree as it was
    return result


@contextlib.contextmanager
def _server(root: Path, models: Path, scratch: Path, port: int | None, outcomes: list, log):
    """(client, process) of a ComfyUI server with sdopt, its outputs, user data and compile cache in
    ``scratch``, the soak's LoRAs offered; stopped on leaving, its log's end shown where it raised or one
    of ``outcomes`` failed."""
    from ..serve import free_port, install_pack, serve, stop, wait_ready

    port = port or free_port()
    args = ["--output-directory", str(scratch / "output"), "--user-directory", str(scratch / "user"),
            "--input-directory", str(scratch / "input"), "--temp-directory", str(scratch),
            "--database-url", "sqlite:///:memory:", "--extra-model-paths-config", str(scratch / "loras.yaml")]
    server_log = scratch / "server.log"
    install_pack(root)
    with server_log.open("w") as log_file:
        process = serve(root, models, port, extra_args=args, config_dir=scratch, stdout=log_file, stderr=subprocess.STDOUT,
                        env=server_env(scratch), die_with_parent=True)
    failed = True
    try:
        client = Client(f"http://127.0.0.1:{port}")
        try:
            wait_ready(client.url + f"/object_info/{REPORT}", process, timeout=300)
        except RuntimeError as error:
            raise UserError(f"{error}; the server's log ends:\n{log_tail(server_log)}") from None
        if REPORT not in client.get(f"/object_info/{REPORT}"):
            raise UserError(f"the server runs but did not load sdopt; its log ends:\n{log_tail(server_log)}")
        yield client, process
        failed = any(outcome.failed for outcome in outcomes)
    finally:
        stop(process)
        if failed:
            log(f"soak: the server's log ends:\n{log_tail(server_log)}")


def _run_prompts(client: Client, process, result: SoakResult, plan, probe: dict, timeout: float, output: Path, log) -> None:
    def run_probe(count: int) -> None:
        status, seconds, error = run_one(client, probe, timeout)
        if status != SUCCESS:
            raise UserError(f"the probe prompt (no sdopt node) before the RSS reading after {count} prompts {status}: {error}")

    def read_rss(count: int) -> None:
        run_probe(count)
        client.collect_garbage()
        # The probe twice more, every output cached, so nothing runs: ComfyUI's worker acts on /free
        # before it takes the next prompt, or at the latest after that prompt has ended (should that
        # prompt have been queued before the worker woke), so the second ends after the collection.
        run_probe(count)
        run_probe(count)
        result.readings.append((count, rss_bytes(process.pid)))
        if count == result.warmup:
            log(f"soak: RSS {result.readings[-1][1] / 2**20:,.0f} MiB after {count} warm-up prompts")

    with progress_bar(total=result.prompts, desc="soak", unit="prompt", disable=not sys.stderr.isatty()) as bar:
        def report(outcome: PromptOutcome) -> None:
            alive = process.poll() is None
            outcome.rss_bytes = rss_bytes(process.pid) if alive else None
            rss = f", RSS {outcome.rss_bytes / 2**20:,.0f} MiB" if alive else ""
            bar.write(f"prompt {outcome.index + 1}/{result.prompts} {outcome.status} {outcome.seconds:.1f} s{rss}: {outcome.chain}"
                      + (f"\n  {outcome.error}" if outcome.error else ""))
            sys.stdout.flush()  # a log shows each prompt as it ends
            bar.update()
            if not alive:
                raise _ServerGone(f"soak: the server exited with status {process.returncode} after prompt {outcome.index + 1}")

        try:
            _prompts(client, result, plan, timeout, output, read_rss, report)
        except _ServerGone as gone:
            log(str(gone))
            return
    read_rss(result.prompts)


class _ServerGone(Exception):
    """The server exited during the soak: the prompts stop there, with no end reading."""


def _prompts(client: Client, result: SoakResult, plan, timeout: float, output: Path, read_rss, report) -> None:
    """The soak's prompts one at a time, or the chaos soak's with their disruptions."""
    if isinstance(result, ChaosResult):
        run_chaos_prompts(client, result, plan, timeout, output, read_rss, report)
        return
    points = reading_points(result.prompts, result.warmup)
    for index in range(result.prompts):
        if index in points:
            read_rss(index)
        planned = plan(index)
        status, seconds, error = run_one(client, planned.api_prompt(), timeout)
        outcome = PromptOutcome(index, planned.describe(), status, seconds, error)
        result.outcomes.append(outcome)
        report(outcome)


def write_json(result: SoakResult, path: Path, command: str) -> None:
    path.write_text(json.dumps({"command": command, **result.to_dict()}, indent=2))
